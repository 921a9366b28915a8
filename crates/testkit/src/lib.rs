//! Test helpers for hypershard: run N ranks on threads with a deadline, and closed-form fixtures.
//!
//! Multi-rank tests follow Gloo's habit: rank `r` writes `f(r, i)` into element `i`, so the
//! expected result of any collective is a formula in `r`, `i` and the world size, never a value
//! copied from a previous run.

pub mod device;
pub mod port;

pub use port::unused_port;

use std::fmt;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// The default deadline for [`run_ranks`]: long enough for a debug build on two loaded cores,
/// short enough that a hang fails the test instead of stalling CI.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(120);

/// Why a multi-rank run failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum RunRanksError<E> {
    /// A rank's closure returned an error; the first one observed is reported.
    Rank {
        /// The rank whose closure failed.
        rank: usize,
        /// Its error.
        error: E,
    },
    /// A rank's closure panicked.
    Panicked {
        /// The rank that panicked.
        rank: usize,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// Some ranks had not finished when the deadline passed.
    Timeout {
        /// The deadline that passed.
        after: Duration,
        /// The ranks that were still running.
        unfinished: Vec<usize>,
    },
    /// The world size was zero.
    EmptyWorld,
}

impl<E: fmt::Display> fmt::Display for RunRanksError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunRanksError::Rank { rank, error } => write!(f, "rank {rank} failed: {error}"),
            RunRanksError::Panicked { rank, message } => {
                write!(f, "rank {rank} panicked: {message}")
            }
            RunRanksError::Timeout { after, unfinished } => {
                write!(f, "ranks {unfinished:?} still running after {after:?}")
            }
            RunRanksError::EmptyWorld => write!(f, "run_ranks called with world size 0"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for RunRanksError<E> {}

/// Runs `f(rank)` for every rank in `0..world` on its own thread and returns every rank's result
/// in rank order, or the first error. Uses [`DEFAULT_DEADLINE`].
pub fn run_ranks<T, E, F>(world: usize, f: F) -> Result<Vec<T>, RunRanksError<E>>
where
    T: Send + 'static,
    E: Send + 'static,
    F: Fn(usize) -> Result<T, E> + Send + Sync + 'static,
{
    run_ranks_with_deadline(world, DEFAULT_DEADLINE, f)
}

/// Like [`run_ranks`] with an explicit deadline.
///
/// A rank that is still running at the deadline is reported in [`RunRanksError::Timeout`]; its
/// thread is left detached (a thread cannot be killed safely), which is acceptable in a test
/// process that is about to fail.
pub fn run_ranks_with_deadline<T, E, F>(
    world: usize,
    deadline: Duration,
    f: F,
) -> Result<Vec<T>, RunRanksError<E>>
where
    T: Send + 'static,
    E: Send + 'static,
    F: Fn(usize) -> Result<T, E> + Send + Sync + 'static,
{
    if world == 0 {
        return Err(RunRanksError::EmptyWorld);
    }
    let f = std::sync::Arc::new(f);
    let (tx, rx) = mpsc::channel::<(usize, thread::Result<Result<T, E>>)>();
    for rank in 0..world {
        let f = f.clone();
        let tx = tx.clone();
        thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                // The receiver may be gone after a timeout; nothing is left to tell then.
                let _ = tx.send((rank, out));
            })
            .map_err(|e| RunRanksError::Panicked {
                rank,
                message: format!("could not spawn thread: {e}"),
            })?;
    }
    drop(tx);
    let start = Instant::now();
    let mut results: Vec<Option<T>> = (0..world).map(|_| None).collect();
    let mut done = 0;
    while done < world {
        let left = deadline.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(Ok(v)))) => {
                results[rank] = Some(v);
                done += 1;
            }
            Ok((rank, Ok(Err(error)))) => return Err(RunRanksError::Rank { rank, error }),
            Ok((rank, Err(payload))) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".to_string());
                return Err(RunRanksError::Panicked { rank, message });
            }
            Err(_) => {
                let unfinished = (0..world).filter(|r| results[*r].is_none()).collect();
                return Err(RunRanksError::Timeout {
                    after: deadline,
                    unfinished,
                });
            }
        }
    }
    // Every slot was filled exactly once above (done == world), so flatten drops nothing.
    Ok(results.into_iter().flatten().collect())
}

/// The closed-form value rank `rank` writes at element `i`: distinct across ranks and indices,
/// exact in every dtype we test (small integers, so f16/bf16 sums stay exact for small worlds).
pub fn fixture(rank: usize, i: usize) -> f64 {
    ((rank + 1) * 10 + (i % 7)) as f64
}

/// `sum over r in 0..world of fixture(r, i)`, the closed form of a sum-reduction of [`fixture`].
pub fn fixture_sum(world: usize, i: usize) -> f64 {
    (0..world).map(|r| fixture(r, i)).sum()
}

/// A vector of `len` elements where element `i` is `fixture(rank, i)`, converted by `conv`.
pub fn fixture_vec<T>(rank: usize, len: usize, conv: impl Fn(f64) -> T) -> Vec<T> {
    (0..len).map(|i| conv(fixture(rank, i))).collect()
}

/// The world sizes every multi-rank test covers: odd and non-dividing ones included.
pub const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_rank_order() {
        let out = run_ranks(5, |r| Ok::<_, String>(r * r)).unwrap();
        assert_eq!(out, vec![0, 1, 4, 9, 16]);
    }

    #[test]
    fn a_failing_rank_is_named() {
        let err = run_ranks(3, |r| if r == 2 { Err("boom") } else { Ok(r) }).unwrap_err();
        match err {
            RunRanksError::Rank { rank, error } => {
                assert_eq!(rank, 2);
                assert_eq!(error, "boom");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_panicking_rank_is_reported_not_propagated() {
        let err = run_ranks(2, |r| {
            if r == 1 {
                panic!("rank one fell over");
            }
            Ok::<_, String>(())
        })
        .unwrap_err();
        match err {
            RunRanksError::Panicked { rank, message } => {
                assert_eq!(rank, 1);
                assert!(message.contains("fell over"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_hanging_rank_times_out() {
        let err = run_ranks_with_deadline(3, Duration::from_millis(200), |r| {
            if r == 0 {
                thread::sleep(Duration::from_secs(5));
            }
            Ok::<_, String>(r)
        })
        .unwrap_err();
        match err {
            RunRanksError::Timeout { unfinished, .. } => assert_eq!(unfinished, vec![0]),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn zero_world_is_an_error() {
        assert!(matches!(
            run_ranks(0, |_| Ok::<_, String>(())),
            Err(RunRanksError::EmptyWorld)
        ));
    }

    #[test]
    fn fixture_sum_matches_its_definition() {
        // 3 ranks at i = 8 (i % 7 = 1): 11 + 21 + 31.
        assert_eq!(fixture_sum(3, 8), 63.0);
        assert_eq!(fixture_vec(1, 3, |v| v as i32), vec![20, 21, 22]);
    }
}
