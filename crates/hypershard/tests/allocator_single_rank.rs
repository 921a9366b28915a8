//! `allocator::pin_mmap_threshold` at the single-rank threshold: a block between the two
//! thresholds, freed and allocated again, is reused from the heap without page faults, where
//! at the default threshold it is mapped afresh and faults every page in again. Its own test
//! binary, since the threshold is the process's.

use std::hint::black_box;

use hypershard::allocator::{
    MMAP_THRESHOLD_BYTES, SINGLE_RANK_MMAP_THRESHOLD_BYTES, pin_mmap_threshold,
};

/// Minor page faults of this process so far.
fn minor_faults() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `getrusage` writes one `rusage` into the pointer, which points at enough
    // zero-initialised memory for it; RUSAGE_SELF is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: `getrusage` succeeded, so it initialised the struct (which was zeroed anyway).
    unsafe { usage.assume_init() }.ru_minflt
}

/// Page faults taken by allocating, touching and freeing a `bytes` block `rounds` times
/// after a first one, which a small block allocated after it keeps off the heap's top (so
/// heap trimming cannot be what gives its memory back).
fn faults_reusing(bytes: usize, rounds: usize) -> i64 {
    let first = black_box(vec![1u8; bytes]);
    let pin = black_box(vec![7u8; 64 << 10]);
    drop(first);
    let before = minor_faults();
    for round in 0..rounds {
        drop(black_box(vec![round as u8 + 2; bytes]));
    }
    let faults = minor_faults() - before;
    assert_eq!(pin[0], 7);
    faults
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn one_rank_reuses_activation_sized_blocks_without_faulting_them_in() {
    const BLOCK: usize = 2 << 20;
    const ROUNDS: usize = 8;
    const PAGES: i64 = (BLOCK / 4096) as i64;
    const {
        assert!(BLOCK >= MMAP_THRESHOLD_BYTES as usize);
        assert!(BLOCK < SINGLE_RANK_MMAP_THRESHOLD_BYTES as usize);
    };
    assert!(
        pin_mmap_threshold(MMAP_THRESHOLD_BYTES),
        "glibc refused the threshold"
    );
    let mapped = faults_reusing(BLOCK, ROUNDS);
    assert!(
        mapped >= ROUNDS as i64 * PAGES * 3 / 4,
        "at the default threshold each 2 MiB block is mapped afresh: {mapped} faults"
    );
    assert!(
        pin_mmap_threshold(SINGLE_RANK_MMAP_THRESHOLD_BYTES),
        "glibc refused the threshold"
    );
    let reused = faults_reusing(BLOCK, ROUNDS);
    assert!(
        reused <= PAGES,
        "at the single-rank threshold the block is reused from the heap: {reused} faults \
         against {mapped} at the default"
    );
}
