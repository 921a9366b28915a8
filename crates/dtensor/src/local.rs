//! [`run_local`]: a closure on N in-process ranks, for trying DTensor without a launcher and
//! for tests.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hypershard_collectives::Communicator;

use crate::error::{Error, Result};

/// Runs `f` on `world` ranks, each a thread holding its world communicator of the `local`
/// backend, and returns the results in rank order.
///
/// The first rank (by rank) whose closure returned an error gives [`Error::RankFailed`]; a
/// panic gives [`Error::RankPanicked`] with its message; ranks still running after `deadline`
/// give [`Error::RankDeadline`] naming them (a hung collective, a rank that never joins). The
/// threads of ranks that did not finish are left running detached: the local backend's own
/// op deadline ends their collectives with a timeout.
///
/// ```
/// use std::time::Duration;
/// use hypershard_dtensor::{run_local, init_process_mesh, DTensor, Placement, Tensor, DType};
///
/// let sums = run_local(3, Duration::from_secs(30), |world| {
///     let mesh = init_process_mesh(world, &[3], &["dp"])?;
///     let x = DTensor::distribute_local(&Tensor::arange(7, DType::F64)?, &mesh, &[Placement::Shard(0)])?;
///     Ok(x.sum(0, false)?.full_tensor()?.item::<f64>()?)
/// })?;
/// assert_eq!(sums, vec![21.0; 3]);
/// # Ok::<(), hypershard_dtensor::Error>(())
/// ```
pub fn run_local<T, F>(world: usize, deadline: Duration, f: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(Arc<dyn Communicator>) -> Result<T> + Send + Sync + 'static,
{
    let comms = hypershard_collectives::local::spawn_world(world)?;
    let f = Arc::new(f);
    let (sender, receiver) = mpsc::channel();
    for (rank, comm) in comms.into_iter().enumerate() {
        let (f, sender) = (Arc::clone(&f), sender.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)));
                // The receiver may be gone after a deadline; nothing is waiting then.
                let _ = sender.send((rank, outcome));
            });
        if let Err(source) = spawned {
            return Err(Error::RankThread {
                rank,
                reason: source.to_string(),
            });
        }
    }
    drop(sender);
    let started = Instant::now();
    let mut results: Vec<Option<T>> = (0..world).map(|_| None).collect();
    let mut failures: Vec<(usize, Error)> = Vec::new();
    let mut done = 0;
    while done < world {
        let left = deadline.saturating_sub(started.elapsed());
        match receiver.recv_timeout(left) {
            Ok((rank, Ok(Ok(value)))) => results[rank] = Some(value),
            Ok((rank, Ok(Err(error)))) => failures.push((rank, error)),
            Ok((rank, Err(panic))) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_string());
                failures.push((rank, Error::RankPanicked { rank, message }));
            }
            Err(_) => {
                let finished: Vec<usize> = failures.iter().map(|(r, _)| *r).collect();
                let unfinished = (0..world)
                    .filter(|r| results[*r].is_none() && !finished.contains(r))
                    .collect();
                return Err(Error::RankDeadline {
                    deadline,
                    unfinished,
                });
            }
        }
        done += 1;
    }
    if let Some((rank, error)) = failures.into_iter().min_by_key(|(rank, _)| *rank) {
        return Err(match error {
            panicked @ Error::RankPanicked { .. } => panicked,
            source => Error::RankFailed {
                rank,
                source: Box::new(source),
            },
        });
    }
    Ok(results.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Placement, Tensor, init_process_mesh};

    #[test]
    fn results_come_back_in_rank_order() {
        let ranks = run_local(4, Duration::from_secs(30), |world| Ok(world.rank() * 10))
            .expect("four ranks");
        assert_eq!(ranks, vec![0, 10, 20, 30]);
    }

    #[test]
    fn a_hung_rank_is_a_deadline_error_naming_it() {
        let error = run_local(3, Duration::from_millis(300), |world| {
            if world.rank() == 2 {
                // Waits for a barrier that ranks 0 and 1 never enter.
                world.barrier()?;
            }
            Ok(())
        })
        .expect_err("rank 2 hangs");
        match error {
            Error::RankDeadline { unfinished, .. } => assert_eq!(unfinished, vec![2]),
            other => panic!("expected RankDeadline, got {other}"),
        }
    }

    #[test]
    fn errors_and_panics_name_their_rank() {
        let error = run_local(3, Duration::from_secs(30), |world| {
            let mesh = init_process_mesh(world.clone(), &[3], &["dp"])?;
            if world.rank() == 1 {
                // Sharding dim 4 of a 1-d tensor is a typed error.
                DTensor::distribute_local(
                    &Tensor::zeros(&[5], DType::F32)?,
                    &mesh,
                    &[Placement::Shard(4)],
                )?;
            }
            Ok(())
        })
        .expect_err("rank 1 fails");
        assert!(
            matches!(error, Error::RankFailed { rank: 1, .. }),
            "{error}"
        );
        let error = run_local(2, Duration::from_secs(30), |world| {
            assert!(world.rank() != 0, "rank zero gives up");
            Ok(())
        })
        .expect_err("rank 0 panics");
        match error {
            Error::RankPanicked { rank, message } => {
                assert_eq!(rank, 0);
                assert!(message.contains("rank zero gives up"), "{message}");
            }
            other => panic!("expected RankPanicked, got {other}"),
        }
    }

    use crate::DTensor;
}
