//! [`Work`]: the handle of an op in flight, which owns the op's buffers until it completes.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::op::OpKind;

/// The shared slot a [`Completer`] fills and a [`Work`] waits on.
struct Slot<T> {
    result: Mutex<Option<Result<T>>>,
    filled: Condvar,
}

impl<T> Slot<T> {
    /// Locks the result; a poisoned lock only means a thread panicked while holding it, and the
    /// `Option` inside is still meaningful, so the poison is ignored.
    fn lock(&self) -> MutexGuard<'_, Option<Result<T>>> {
        self.result.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The handle of an op in flight.
///
/// The op owns its buffers until it completes; [`Work::wait`] hands them back (or the error).
/// Dropping a `Work` does not cancel the op: it still runs, in order, and its buffers are freed
/// when it finishes.
#[must_use = "an op's buffers come back only through Work::wait"]
pub struct Work<T> {
    op: OpKind,
    state: State<T>,
}

enum State<T> {
    /// Completed when it was created (argument errors, empty ops on one rank, wrappers).
    Ready(Result<T>),
    /// Completed by a [`Completer`] on another thread.
    Pending(Arc<Slot<T>>),
}

/// What [`Work::wait_timeout`] found.
#[must_use]
pub enum WaitOutcome<T> {
    /// The op finished; here is its result.
    Done(Result<T>),
    /// The op is still running; here is the handle back.
    Pending(Work<T>),
}

impl<T> Work<T> {
    /// A handle that is already complete.
    pub fn ready(op: OpKind, result: Result<T>) -> Self {
        Work {
            op,
            state: State::Ready(result),
        }
    }

    /// A pending handle and the [`Completer`] that finishes it. If the completer is dropped
    /// without [`Completer::complete`] (its job panicked or was discarded), the work completes
    /// with [`Error::EngineStopped`], so a waiter never hangs on a lost job.
    pub fn pending(op: OpKind) -> (Work<T>, Completer<T>) {
        let slot = Arc::new(Slot {
            result: Mutex::new(None),
            filled: Condvar::new(),
        });
        (
            Work {
                op,
                state: State::Pending(slot.clone()),
            },
            Completer {
                op,
                slot: Some(slot),
            },
        )
    }

    /// Which op this is.
    pub fn op(&self) -> OpKind {
        self.op
    }

    /// Whether the op has finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Ready(_) => true,
            State::Pending(slot) => slot.lock().is_some(),
        }
    }

    /// Blocks until the op finishes and returns its outputs. Every op carries its own deadline
    /// ([`CommConfig::timeout`](crate::CommConfig::timeout)), so this returns within it.
    pub fn wait(self) -> Result<T> {
        match self.state {
            State::Ready(result) => result,
            State::Pending(slot) => {
                let mut guard = slot.lock();
                loop {
                    if let Some(result) = guard.take() {
                        return result;
                    }
                    guard = slot
                        .filled
                        .wait(guard)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Waits at most `timeout`; gives the handle back when the op is still running.
    pub fn wait_timeout(self, timeout: Duration) -> WaitOutcome<T> {
        let deadline = Instant::now() + timeout;
        match self.state {
            State::Ready(result) => WaitOutcome::Done(result),
            State::Pending(slot) => {
                let mut guard = slot.lock();
                loop {
                    if let Some(result) = guard.take() {
                        return WaitOutcome::Done(result);
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        drop(guard);
                        return WaitOutcome::Pending(Work {
                            op: self.op,
                            state: State::Pending(slot),
                        });
                    }
                    guard = slot
                        .filled
                        .wait_timeout(guard, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("completed", &self.is_completed())
            .finish()
    }
}

/// The producer half of a pending [`Work`]: whoever runs the op completes it exactly once.
pub struct Completer<T> {
    op: OpKind,
    slot: Option<Arc<Slot<T>>>,
}

impl<T> Completer<T> {
    /// Which op this completes.
    pub fn op(&self) -> OpKind {
        self.op
    }

    /// Hands the result to the waiting [`Work`].
    pub fn complete(mut self, result: Result<T>) {
        self.fill(result);
    }

    fn fill(&mut self, result: Result<T>) {
        if let Some(slot) = self.slot.take() {
            *slot.lock() = Some(result);
            slot.filled.notify_all();
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        // A completer dropped unfilled belongs to a job that never finished; tell the waiter.
        let op = self.op;
        self.fill(Err(Error::EngineStopped { op }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn completes_across_threads() {
        let (work, completer) = Work::<u32>::pending(OpKind::Barrier);
        assert!(!work.is_completed());
        let handle = thread::spawn(move || completer.complete(Ok(7)));
        assert_eq!(work.wait().unwrap(), 7);
        handle.join().unwrap();
    }

    #[test]
    fn wait_timeout_gives_the_handle_back() {
        let (work, completer) = Work::<u32>::pending(OpKind::AllReduce);
        let work = match work.wait_timeout(Duration::from_millis(10)) {
            WaitOutcome::Pending(work) => work,
            WaitOutcome::Done(result) => panic!("completed early: {result:?}"),
        };
        completer.complete(Ok(3));
        assert!(work.is_completed());
        match work.wait_timeout(Duration::from_millis(10)) {
            WaitOutcome::Done(result) => assert_eq!(result.unwrap(), 3),
            WaitOutcome::Pending(_) => panic!("still pending after completion"),
        }
    }

    #[test]
    fn a_dropped_completer_fails_the_work() {
        let (work, completer) = Work::<()>::pending(OpKind::Send);
        drop(completer);
        assert!(matches!(
            work.wait(),
            Err(Error::EngineStopped { op: OpKind::Send })
        ));
    }

    #[test]
    fn ready_work_is_complete() {
        let work = Work::ready(OpKind::Recv, Ok(5u8));
        assert!(work.is_completed());
        assert_eq!(work.op(), OpKind::Recv);
        assert_eq!(work.wait().unwrap(), 5);
    }
}
