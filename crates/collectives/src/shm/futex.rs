//! Futex wait and wake on a 32-bit word of a shared mapping: the "park" half of the rings'
//! spin-then-park signalling. The futexes are process-shared (no `FUTEX_PRIVATE_FLAG`),
//! because the waiter and the waker are different processes mapping the same file.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps until `word` is woken, stops holding `expected`, or `timeout` passes (whichever is
/// first; spurious wake-ups are possible, so callers re-check their condition).
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let timeout = libc::timespec {
        // Waits are capped by the callers at a few milliseconds; saturate just in case.
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 10^9, so it fits a c_long on every target.
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, 4-byte aligned atomic for the whole call (it is borrowed), and
    // FUTEX_WAIT only reads it atomically in the kernel; `timeout` is a valid timespec that
    // outlives the call; the two trailing arguments are unused by FUTEX_WAIT. A failed or
    // interrupted wait (EAGAIN, EINTR, ETIMEDOUT) simply returns, which callers handle by
    // re-checking their condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &timeout as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter parked on `word`.
pub(crate) fn wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned atomic for the whole call; FUTEX_WAKE does not access
    // the memory beyond hashing its address, and the unused arguments are zero.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn a_wait_on_a_changed_word_returns_at_once_and_a_timeout_is_bounded() {
        let word = AtomicU32::new(7);
        let started = Instant::now();
        // The word does not hold 3, so the kernel refuses to sleep (EAGAIN).
        wait(&word, 3, Duration::from_secs(5));
        assert!(started.elapsed() < Duration::from_secs(1));
        let started = Instant::now();
        wait(&word, 7, Duration::from_millis(30));
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(20) && waited < Duration::from_secs(2));
    }

    #[test]
    fn wake_releases_a_parked_thread() {
        let word = Arc::new(AtomicU32::new(1));
        let parked = {
            let word = Arc::clone(&word);
            std::thread::spawn(move || {
                let started = Instant::now();
                while word.load(Ordering::SeqCst) == 1 && started.elapsed() < Duration::from_secs(5)
                {
                    wait(&word, 1, Duration::from_secs(5));
                }
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        word.store(0, Ordering::SeqCst);
        wake(&word);
        let waited = parked.join().unwrap();
        assert!(waited < Duration::from_secs(4), "{waited:?}");
    }
}
