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

/// The `futex_waitv` syscall (Linux 5.16): the same number on every architecture that uses
/// the generic syscall table, x86-64 included.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const SYS_FUTEX_WAITV: libc::c_long = 449;

/// One entry of `futex_waitv`'s array (`struct futex_waitv` of the kernel's uapi).
#[repr(C)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// `FUTEX2_SIZE_U32`: the word is 32 bits (and, without `FUTEX2_PRIVATE`, process-shared).
const FUTEX2_SIZE_U32: u32 = 0x02;

/// The most words one `futex_waitv` takes (the kernel's `FUTEX_WAITV_MAX`).
pub(crate) const WAITV_MAX: usize = 128;

/// Set once the kernel said it has no `futex_waitv` (`ENOSYS`), so later waits skip it.
static NO_WAITV: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sleeps until any of `words` (at most [`WAITV_MAX`]) is woken or does not hold `expected`,
/// or `timeout` passes. Returns `false` without sleeping when the kernel lacks
/// `futex_waitv` (the caller then waits on one word with [`wait`]); spurious wake-ups are
/// possible.
pub(crate) fn wait_any(words: &[&AtomicU32], expected: u32, timeout: Duration) -> bool {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    {
        use std::sync::atomic::Ordering;
        if words.is_empty() || words.len() > WAITV_MAX || NO_WAITV.load(Ordering::Relaxed) {
            return false;
        }
        let waiters: Vec<FutexWaitv> = words
            .iter()
            .map(|word| FutexWaitv {
                val: u64::from(expected),
                uaddr: word.as_ptr() as u64,
                flags: FUTEX2_SIZE_U32,
                reserved: 0,
            })
            .collect();
        // futex_waitv's timeout is absolute, on the clock named by the last argument.
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid, writable timespec for the call.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let nanos = i128::from(now.tv_nsec) + i128::from(timeout.subsec_nanos());
        let deadline = libc::timespec {
            tv_sec: now
                .tv_sec
                .saturating_add(libc::time_t::try_from(timeout.as_secs()).unwrap_or(0))
                .saturating_add(libc::time_t::from(nanos >= 1_000_000_000)),
            // Below 10^9 after the carry, so it fits a c_long.
            tv_nsec: (nanos % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `waiters` is a live array of `words.len()` (at most 128) entries laid out
        // as the kernel's `struct futex_waitv`, each naming a live, 4-byte aligned atomic
        // that stays borrowed for the whole call (the kernel only reads them atomically);
        // `deadline` is a valid timespec that outlives the call. A failed or interrupted
        // wait (EAGAIN, EINTR, ETIMEDOUT) simply returns; callers re-check their condition.
        let result = unsafe {
            libc::syscall(
                SYS_FUTEX_WAITV,
                waiters.as_ptr(),
                waiters.len() as libc::c_uint,
                0 as libc::c_uint,
                &deadline as *const libc::timespec,
                libc::CLOCK_MONOTONIC,
            )
        };
        if result < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            NO_WAITV.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (words, expected, timeout, &NO_WAITV);
        false
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
    fn a_wait_on_several_words_ends_on_a_wake_of_any_and_its_timeout_is_bounded() {
        let first = AtomicU32::new(1);
        let changed = AtomicU32::new(5);
        let started = Instant::now();
        // One word does not hold 1: no sleep at all.
        assert!(wait_any(&[&first, &changed], 1, Duration::from_secs(5)));
        assert!(started.elapsed() < Duration::from_secs(1));
        let second = AtomicU32::new(1);
        let started = Instant::now();
        assert!(wait_any(&[&first, &second], 1, Duration::from_millis(30)));
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(20) && waited < Duration::from_secs(2));
        let words = Arc::new([AtomicU32::new(1), AtomicU32::new(1), AtomicU32::new(1)]);
        let parked = {
            let words = Arc::clone(&words);
            std::thread::spawn(move || {
                let started = Instant::now();
                while words[2].load(Ordering::SeqCst) == 1
                    && started.elapsed() < Duration::from_secs(5)
                {
                    wait_any(
                        &[&words[0], &words[1], &words[2]],
                        1,
                        Duration::from_secs(5),
                    );
                }
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        // Only the last word is woken.
        words[2].store(0, Ordering::SeqCst);
        wake(&words[2]);
        let waited = parked.join().unwrap();
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        assert!(
            !wait_any(&[], 1, Duration::from_secs(5)),
            "nothing to wait on"
        );
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
