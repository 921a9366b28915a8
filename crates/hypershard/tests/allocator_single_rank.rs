//! `allocator::use_single_rank_thresholds`: a block between the two mmap thresholds, freed and
//! allocated again, is reused from the heap without page faults, inside the heap or at its
//! top, where at the default settings it is mapped afresh (or trimmed off the heap's top) and
//! faults every page in again. Its own test binary, since the settings are the process's.

use std::hint::black_box;

use hypershard::allocator::{
    MMAP_THRESHOLD_BYTES, SINGLE_RANK_MMAP_THRESHOLD_BYTES, pin_mmap_threshold,
    use_single_rank_thresholds,
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
    let faults = faults_of_rounds(bytes, rounds);
    assert_eq!(pin[0], 7);
    faults
}

/// Page faults taken by allocating, touching and freeing a `bytes` block `rounds` times.
fn faults_of_rounds(bytes: usize, rounds: usize) -> i64 {
    let before = minor_faults();
    for round in 0..rounds {
        drop(black_box(vec![round as u8 + 2; bytes]));
    }
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn one_rank_reuses_activation_sized_blocks_without_faulting_them_in() {
    const BLOCK: usize = 2 << 20;
    const TOP_BLOCK: usize = 3 << 20;
    const ROUNDS: usize = 8;
    const PAGES: i64 = (BLOCK / 4096) as i64;
    const TOP_PAGES: i64 = (TOP_BLOCK / 4096) as i64;
    const {
        assert!(BLOCK >= MMAP_THRESHOLD_BYTES as usize);
        assert!(TOP_BLOCK < SINGLE_RANK_MMAP_THRESHOLD_BYTES as usize);
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
    // At the heap's top, with only the mmap threshold raised: glibc's default trim threshold
    // gives a freed 3 MiB block back with `brk`, so every round faults it in again.
    assert!(
        pin_mmap_threshold(SINGLE_RANK_MMAP_THRESHOLD_BYTES),
        "glibc refused the threshold"
    );
    drop(black_box(vec![1u8; TOP_BLOCK]));
    let trimmed = faults_of_rounds(TOP_BLOCK, ROUNDS);
    assert!(
        trimmed >= ROUNDS as i64 * TOP_PAGES * 3 / 4,
        "with the default trim threshold the heap's top is given back: {trimmed} faults"
    );
    assert!(use_single_rank_thresholds(), "glibc refused the thresholds");
    let reused = faults_reusing(BLOCK, ROUNDS);
    assert!(
        reused <= PAGES,
        "at the single-rank threshold the block is reused from the heap: {reused} faults \
         against {mapped} at the default"
    );
    // The single-rank trim threshold keeps the freed top for the next round.
    drop(black_box(vec![1u8; TOP_BLOCK]));
    let at_top = faults_of_rounds(TOP_BLOCK, ROUNDS);
    assert!(
        at_top <= TOP_PAGES,
        "a block freed at the heap's top is kept for the next: {at_top} faults against \
         {trimmed} with the default trim threshold"
    );
}
