//! How the process's allocator gives memory back.
//!
//! glibc's `malloc` serves a large request with its own `mmap` and returns it to the kernel on
//! `free`, but only above a threshold that it raises, up to 32 MiB, each time such a block is
//! freed. A training step frees and re-allocates blocks of every size from kilobytes to hundreds
//! of megabytes, so after the first step most of them come from the heap instead, where a freed
//! block stays resident until the heap's top is trimmed: measured on `--model gpt2` at 4 ranks,
//! that held a rank's resident peak 0.5 GiB above the tracker's peak of live tensors. Pinning the
//! threshold keeps large blocks on `mmap`, so memory freed within a step is memory the kernel
//! gets back.
//!
//! The price is a page fault per page each time a new large block is touched, so the threshold
//! sits where that price stops being paid over and over: blocks under 1 MiB (GEMM packing
//! buffers, attention tiles, a small model's activations) are many and short-lived, and from the
//! heap they are reused without a fault. Measured on `--model medium` at 2×2 over 12 steps, a
//! 256 KiB threshold took 4.0 M page faults and 24 CPU-seconds, 1 MiB 1.4 M and 19.6 (an
//! unpinned glibc 0.4 M and 19.3), for a resident peak of 126, 146 and 154 MiB per rank; at
//! gpt2 the resident peak is the same at either threshold, its blocks being far larger.
//!
//! A run of one rank shards nothing and has the machine's memory to itself, and there the
//! price wins: a model of width 192 allocates and frees its 0.75–3 MiB activations on every
//! layer, and with each of them on `mmap` the step spent a tenth of its time faulting pages in
//! and shooting down the other threads' TLBs on `munmap`. Such a run raises the threshold to
//! [`SINGLE_RANK_MMAP_THRESHOLD_BYTES`] and keeps up to [`SINGLE_RANK_TRIM_THRESHOLD_BYTES`]
//! free at the heap's top (a further 6–9 %): `--model medium` on one process of two threads went
//! from 6 085 to 7 068 tokens/s for a resident peak of 155 → 179 MiB (PyTorch: 869 MiB), and
//! `--model gpt2` gained 2 % for 3.54 → 3.74 GB (PyTorch: 4.0 GB).
//! Ranks that share a machine keep the lower threshold: at gpt2 over 4 ranks the higher one
//! held 0.1 GiB more per rank for 2 % more speed.

/// Requests at or above this size are served by `mmap` and returned to the kernel on `free`.
pub const MMAP_THRESHOLD_BYTES: libc::c_int = 1024 * 1024;

/// The threshold of a run of one rank (see the module's docs).
pub const SINGLE_RANK_MMAP_THRESHOLD_BYTES: libc::c_int = 4 * 1024 * 1024;

/// How much free memory at the top of the heap a run of one rank keeps instead of giving it
/// back (glibc's default is 128 KiB): freeing a step's gradients otherwise shrank the heap
/// with `brk` each step, and the next step faulted the same pages in again.
pub const SINGLE_RANK_TRIM_THRESHOLD_BYTES: libc::c_int = 16 * 1024 * 1024;

/// A run of one rank's allocator settings: [`SINGLE_RANK_MMAP_THRESHOLD_BYTES`] and
/// [`SINGLE_RANK_TRIM_THRESHOLD_BYTES`]. Returns whether glibc took both (`false` elsewhere).
pub fn use_single_rank_thresholds() -> bool {
    let mmap = pin_mmap_threshold(SINGLE_RANK_MMAP_THRESHOLD_BYTES);
    let trim = set_option(Tunable::TrimThreshold, SINGLE_RANK_TRIM_THRESHOLD_BYTES);
    mmap && trim
}

/// Pins glibc's mmap threshold at [`MMAP_THRESHOLD_BYTES`] (which also stops it from moving),
/// so that large freed blocks leave the resident set at once. Call it once, early in `main`.
/// Returns whether the allocator took the setting: always `false` where the C library is not
/// glibc (nothing to do there), and `false` if glibc refused it.
pub fn return_large_blocks_to_the_kernel() -> bool {
    pin_mmap_threshold(MMAP_THRESHOLD_BYTES)
}

/// Pins glibc's mmap threshold at `bytes` for the allocations from now on (blocks already
/// allocated keep where they came from). Returns whether the allocator took the setting, as
/// [`return_large_blocks_to_the_kernel`].
pub fn pin_mmap_threshold(bytes: libc::c_int) -> bool {
    set_option(Tunable::MmapThreshold, bytes)
}

/// The glibc `malloc` settings this module changes.
#[derive(Clone, Copy)]
enum Tunable {
    MmapThreshold,
    TrimThreshold,
}

/// Sets one of glibc's `malloc` options; whether glibc took it (`false` without glibc).
fn set_option(tunable: Tunable, value: libc::c_int) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let option = match tunable {
            Tunable::MmapThreshold => libc::M_MMAP_THRESHOLD,
            Tunable::TrimThreshold => libc::M_TRIM_THRESHOLD,
        };
        // SAFETY: `mallopt` takes two integers and touches only the allocator's own settings,
        // under the allocator's lock; no pointer crosses. Tested by tests/allocator.rs
        // (`freed_large_blocks_leave_the_resident_set`) and tests/allocator_single_rank.rs.
        unsafe { libc::mallopt(option, value) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = (tunable, value);
        false
    }
}
