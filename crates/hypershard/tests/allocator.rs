//! `allocator::return_large_blocks_to_the_kernel`: after it, a large block that is freed leaves
//! the resident set even once glibc's dynamic threshold would have moved. One test in its own
//! binary, so no other test's allocations move the resident set meanwhile.

use std::hint::black_box;

/// The resident set of this process in bytes (`VmRSS` of `/proc/self/status`, in kB).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let vm_rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("status has VmRSS in kB");
    vm_rss_kib * 1024
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_large_blocks_leave_the_resident_set() {
    assert!(
        hypershard::allocator::return_large_blocks_to_the_kernel(),
        "glibc refused M_MMAP_THRESHOLD"
    );
    // Without the pinned threshold, freeing this mmap'ed 16 MiB block would raise glibc's
    // threshold to 16 MiB, and the 2 MiB blocks below would come from the heap.
    drop(black_box(vec![1u8; 16 << 20]));

    const BLOCK: usize = 2 << 20;
    const { assert!(BLOCK >= hypershard::allocator::MMAP_THRESHOLD_BYTES as usize) };
    const BLOCKS: usize = 32;
    let blocks: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|i| black_box(vec![i as u8 + 1; BLOCK]))
        .collect();
    // A block below the threshold allocated after them pins the heap's top, so that heap
    // trimming cannot be what returns their memory.
    let pin = black_box(vec![7u8; 128 << 10]);
    let with_blocks = resident_bytes();
    drop(blocks);
    let after_free = resident_bytes();
    let released = with_blocks.saturating_sub(after_free);
    assert!(
        released >= (BLOCKS as u64 * BLOCK as u64) * 3 / 4,
        "freeing {BLOCKS} blocks of {BLOCK} bytes gave back only {released} bytes \
         (resident {with_blocks} -> {after_free})"
    );
    assert_eq!(pin[pin.len() - 1], 7);
}
