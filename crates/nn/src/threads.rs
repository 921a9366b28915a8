//! Choosing how many threads the kernels use, and keeping them ready between kernels.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// Runs `f` with the kernels (GEMM row blocks, attention heads) spread over `threads`
/// threads, as `torch.set_num_threads` does for a region of code.
///
/// The kernels use rayon's current pool: by default the global one, sized by
/// `RAYON_NUM_THREADS` or the number of CPUs. This builds a dedicated pool for the call; a
/// caller that runs many steps should wrap the whole loop, not each step. Each rank of a
/// multi-rank job on one machine should pass its share of the cores.
pub fn with_num_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|source| Error::ThreadPool { threads, source })?;
    Ok(pool.install(f))
}

/// How long a thread kept warm by [`keep_warm`] polls without finding work before it goes to
/// sleep as usual. The serial stretches between a training step's kernels last microseconds;
/// this bounds what a long one (an evaluation, a checkpoint write) costs in burnt cycles, as
/// OpenMP's spin count does for PyTorch's threads.
const POLL_BUDGET: Duration = Duration::from_millis(2);

/// `spin_loop` hints between two looks for work: enough that the poller does not keep the
/// owner's work queue's cache line bouncing, few enough that a job waits well under a
/// microsecond to be taken.
const PAUSES_BETWEEN_POLLS: usize = 16;

/// Runs `f` while the other threads of the current rayon pool poll for work instead of
/// sleeping between the kernels `f` runs.
///
/// A rayon thread that finds no work sleeps after a few tens of microseconds, and waking it
/// takes tens more (far more on a virtual machine, where an idle virtual CPU is halted): a
/// training step that alternates short serial stretches with parallel kernels pays that at
/// nearly every kernel, and a kernel shorter than the wake-up runs on one thread.
/// Here the other threads run a polling job until `f` returns, or until they find no work for
/// 2 ms; the jobs `f`'s kernels hand out are taken as soon as they are queued.
///
/// Called off a rayon pool's threads, or on a pool of one thread, this is just `f()`: there
/// is no other thread to keep. The poll burns the other cores while `f` runs serially, so use
/// it where the pool has the cores to itself (one rank per machine, as `hypershard train`
/// does at one rank).
pub fn keep_warm<R>(f: impl FnOnce() -> R) -> R {
    keep_warm_with(POLL_BUDGET, |_| f())
}

/// What one [`keep_warm`] call shares with its polling jobs.
#[derive(Default)]
struct Warmth {
    /// Set when `f` has returned (or unwound): the pollers stop at their next look.
    stop: AtomicBool,
    /// How many pollers are in their loop now.
    polling: AtomicUsize,
    /// How many pollers have entered their loop.
    started: AtomicUsize,
}

/// Sets the stop flag when dropped, so the pollers stop even if `f` unwinds.
struct StopOnDrop(Arc<Warmth>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Release);
    }
}

/// [`keep_warm`] with pollers that give up after `budget` without work, handing `f` the state
/// shared with them (`None` when there are none); the tests watch the pollers through it.
fn keep_warm_with<R>(budget: Duration, f: impl FnOnce(Option<&Arc<Warmth>>) -> R) -> R {
    let Some(owner) = rayon::current_thread_index() else {
        return f(None);
    };
    if rayon::current_num_threads() < 2 {
        return f(None);
    }
    let warmth = Arc::new(Warmth::default());
    let shared = Arc::clone(&warmth);
    // Every thread of the pool gets the job; the owner's copy, which runs whenever the owner
    // next looks for work (possibly after `f`), returns at once.
    rayon::spawn_broadcast(move |context| {
        if context.index() != owner {
            poll(&shared, budget);
        }
    });
    let guard = StopOnDrop(warmth);
    f(Some(&guard.0))
}

/// Takes queued jobs of the pool until `warmth.stop` is set or none has come for `budget`.
fn poll(warmth: &Warmth, budget: Duration) {
    warmth.polling.fetch_add(1, Ordering::AcqRel);
    warmth.started.fetch_add(1, Ordering::AcqRel);
    let mut last_job = Instant::now();
    while !warmth.stop.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            last_job = Instant::now();
        } else if last_job.elapsed() > budget {
            break;
        } else {
            for _ in 0..PAUSES_BETWEEN_POLLS {
                std::hint::spin_loop();
            }
        }
    }
    warmth.polling.fetch_sub(1, Ordering::AcqRel);
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::*;

    #[test]
    fn runs_on_a_pool_of_the_requested_size() {
        for threads in [1, 3] {
            let seen = with_num_threads(threads, rayon::current_num_threads).expect("pool");
            assert_eq!(seen, threads);
        }
    }

    /// Waits (bounded) until `done` holds; returns whether it did.
    fn eventually(done: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        done()
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
    }

    fn polling(warmth: &Warmth) -> usize {
        warmth.polling.load(Ordering::Acquire)
    }

    /// Longer than any test: the pollers stop only when told.
    const FOREVER: Duration = Duration::from_secs(600);

    #[test]
    fn the_other_threads_poll_while_f_runs_and_stop_after() {
        let (warmth, sum, polled) = pool(3).install(|| {
            keep_warm_with(FOREVER, |warmth| {
                let warmth = Arc::clone(warmth.expect("a pool of three keeps two threads warm"));
                // Both other threads enter their poll loop while `f` runs serially.
                let polled = eventually(|| polling(&warmth) == 2);
                // Kernels handed out meanwhile run, on the pollers too, with the right values.
                let sum: u64 = (0..10_000u64).into_par_iter().map(|i| i * i).sum();
                (warmth, sum, polled)
            })
        });
        assert!(polled, "the pool's other threads never started polling");
        assert_eq!(sum, (0..10_000u64).map(|i| i * i).sum::<u64>());
        assert!(warmth.stop.load(Ordering::Acquire));
        assert!(
            eventually(|| polling(&warmth) == 0),
            "pollers still running after keep_warm returned"
        );
    }

    #[test]
    fn a_job_handed_out_runs_on_the_polling_thread() {
        let ((first, waited), second) = pool(2).install(|| {
            keep_warm_with(FOREVER, |warmth| {
                let warmth = warmth.expect("a pool of two keeps one thread warm");
                assert!(eventually(|| polling(warmth) == 1));
                // The first half waits for the second to start: only another thread taking
                // it lets the join finish early.
                let started = AtomicBool::new(false);
                rayon::join(
                    || {
                        let ok = eventually(|| started.load(Ordering::Acquire));
                        (rayon::current_thread_index(), ok)
                    },
                    || {
                        started.store(true, Ordering::Release);
                        rayon::current_thread_index()
                    },
                )
            })
        });
        assert!(waited, "the second half never started");
        assert_ne!(first, second, "both halves ran on one thread");
    }

    #[test]
    fn pollers_stop_when_f_unwinds_and_without_other_threads_it_is_just_f() {
        assert_eq!(keep_warm(|| 7), 7);
        assert!(keep_warm_with(FOREVER, |warmth| warmth.is_none()));
        let single = with_num_threads(1, || keep_warm_with(FOREVER, |warmth| warmth.is_none()));
        assert!(single.expect("pool"));
        let mut watched = None;
        let unwound = pool(2).install(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                keep_warm_with(FOREVER, |warmth| {
                    watched = warmth.cloned();
                    panic!("step failed")
                })
            }))
        });
        assert!(unwound.is_err());
        let warmth = watched.expect("a pool of two keeps one thread warm");
        assert!(warmth.stop.load(Ordering::Acquire));
        assert!(eventually(|| polling(&warmth) == 0));
    }

    #[test]
    fn a_poller_without_work_sleeps_after_its_budget() {
        let (started, stopped_early) = pool(2).install(|| {
            keep_warm_with(Duration::from_millis(1), |warmth| {
                let warmth = warmth.expect("a pool of two keeps one thread warm");
                let started = eventually(|| warmth.started.load(Ordering::Acquire) == 1);
                // `f` is still running: only the budget can have ended the poll.
                let stopped_early = eventually(|| polling(warmth) == 0);
                (
                    started,
                    stopped_early && !warmth.stop.load(Ordering::Acquire),
                )
            })
        });
        assert!(started, "the poller never started");
        assert!(stopped_early, "the poller outlived its budget");
    }
}
