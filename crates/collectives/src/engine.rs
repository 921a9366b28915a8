//! The progress engine: one worker thread per communicator that runs submitted ops one after
//! another, in submission order, while the caller computes.
//!
//! Every backend uses it the same way: an async op validates what it can on the caller's
//! thread, then [`ProgressEngine::submit`]s a closure that does the communication and returns
//! the op's outputs. The engine gives the closure a [`JobContext`] with the op's sequence
//! number and deadline, opens the op's `tracing` span around it, fails it with
//! [`Error::Aborted`] if the communicator was aborted before it started, and delivers the result
//! to the op's [`Work`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::op::OpKind;
use crate::work::Work;

/// A shared "this communicator was aborted" flag. Backends poll it inside long waits (the
/// abort call also wakes whatever they block on, see [`Communicator::abort`](crate::Communicator::abort)).
#[derive(Clone, Debug, Default)]
pub struct AbortFlag(Arc<AtomicBool>);

impl AbortFlag {
    /// A flag that is not set.
    pub fn new() -> Self {
        AbortFlag::default()
    }

    /// Sets the flag; it is never cleared.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the flag is set.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What the engine needs to know about an op when it is submitted.
#[derive(Clone, Copy, Debug)]
pub struct JobSpec {
    /// The op, for the span, the error and the [`Work`].
    pub op: OpKind,
    /// The payload bytes this rank contributes, for the span.
    pub bytes: usize,
    /// The op's deadline, counted from the moment it starts executing.
    pub timeout: Duration,
}

/// What a running job knows about itself.
#[derive(Debug)]
pub struct JobContext {
    /// The op.
    pub op: OpKind,
    /// The position of the op in this communicator's stream, from 0 (p2p ops included).
    pub seq: u64,
    /// The op's timeout.
    pub timeout: Duration,
    /// When the op must have finished: its start plus its timeout.
    pub deadline: Instant,
    abort: AbortFlag,
}

impl JobContext {
    /// Whether the communicator has been aborted.
    pub fn is_aborted(&self) -> bool {
        self.abort.is_set()
    }

    /// [`Error::Aborted`] when the communicator has been aborted, [`Error::Timeout`] (with the
    /// given peer) when the deadline has passed, `Ok` otherwise.
    pub fn check(&self, peer: Option<usize>) -> Result<()> {
        if self.is_aborted() {
            return Err(Error::Aborted { op: self.op });
        }
        if Instant::now() >= self.deadline {
            return Err(self.timeout_error(peer));
        }
        Ok(())
    }

    /// The [`Error::Timeout`] of this op.
    pub fn timeout_error(&self, peer: Option<usize>) -> Error {
        Error::Timeout {
            op: self.op,
            after: self.timeout,
            peer,
        }
    }

    /// Time left before the deadline (zero once it has passed).
    pub fn time_left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The part of a job that knows its result type: runs it with its context and completes its
/// [`Work`] (`None`: the communicator was aborted before the job started).
type TypedJob = Box<dyn FnOnce(Option<&JobContext>) + Send>;

/// A worker thread that runs jobs in submission order. Cheap to share behind an `Arc`.
///
/// Dropping the engine lets the thread finish the jobs already queued and exit; it is not
/// joined, so a drop never blocks (each job ends by its own deadline).
#[derive(Debug)]
pub struct ProgressEngine {
    sender: mpsc::Sender<Job>,
    abort: AbortFlag,
    next_seq: AtomicU64,
    group: String,
}

impl ProgressEngine {
    /// Starts the worker thread of a group. The name appears in the thread name and in every
    /// op's span.
    pub fn new(group: impl Into<String>) -> Result<Self> {
        let group = group.into();
        let (sender, receiver) = mpsc::channel::<Job>();
        thread::Builder::new()
            .name(format!("hs-progress-{group}"))
            .spawn(move || {
                while let Ok(job) = receiver.recv() {
                    // A panicking job drops its Completer, which fails its Work with
                    // EngineStopped; the thread goes on with the next job.
                    let _ = catch_unwind(AssertUnwindSafe(job));
                }
            })
            .map_err(|source| Error::SpawnFailed {
                group: group.clone(),
                source,
            })?;
        Ok(ProgressEngine {
            sender,
            abort: AbortFlag::new(),
            next_seq: AtomicU64::new(0),
            group,
        })
    }

    /// The group name given at construction.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The engine's abort flag (shared: backends hand clones to whatever they block on).
    pub fn abort_flag(&self) -> &AbortFlag {
        &self.abort
    }

    /// Sets the abort flag: queued jobs and jobs submitted later fail with
    /// [`Error::Aborted`]; the running job sees it through [`JobContext::check`].
    pub fn abort(&self) {
        self.abort.set();
    }

    /// Whether [`ProgressEngine::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.abort.is_set()
    }

    /// Queues `job` behind every job submitted before it and returns its [`Work`].
    pub fn submit<T, F>(&self, spec: JobSpec, job: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&JobContext) -> Result<T> + Send + 'static,
    {
        let op = spec.op;
        if self.abort.is_set() {
            return Work::ready(op, Err(Error::Aborted { op }));
        }
        let (work, completer) = Work::pending(op);
        // Only this small closure is generic over the job: the span, the abort check and the
        // queueing below are compiled once, not once per kind of op (every backend submits
        // a dozen kinds, and the crates above instantiate more).
        self.enqueue(
            spec,
            Box::new(move |context: Option<&JobContext>| match context {
                None => completer.complete(Err(Error::Aborted { op })),
                Some(context) => {
                    let result = job(context);
                    if let Err(error) = &result {
                        tracing::debug!(%error, "op failed");
                    }
                    completer.complete(result);
                }
            }),
        );
        work
    }

    /// Queues `run` behind every job submitted before it: on the worker it is called with the
    /// job's context, or with `None` when the communicator was aborted before it started.
    fn enqueue(&self, spec: JobSpec, run: TypedJob) {
        let op = spec.op;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "collective",
            op = op.as_str(),
            bytes = spec.bytes,
            group = %self.group,
            seq
        );
        let abort = self.abort.clone();
        let boxed: Job = Box::new(move || {
            let _entered = span.enter();
            if abort.is_set() {
                run(None);
                return;
            }
            let context = JobContext {
                op,
                seq,
                timeout: spec.timeout,
                deadline: Instant::now() + spec.timeout,
                abort,
            };
            run(Some(&context));
        });
        // If the thread is gone, the job comes back inside the error and is dropped here,
        // which drops its Completer and fails the Work with EngineStopped.
        let _ = self.sender.send(boxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn spec(op: OpKind) -> JobSpec {
        JobSpec {
            op,
            bytes: 0,
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn jobs_run_in_submission_order_and_overlap_the_caller() {
        let engine = ProgressEngine::new("order").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let mut works = Vec::new();
        for i in 0..20u64 {
            let log = log.clone();
            let gate = gate.clone();
            works.push(engine.submit(spec(OpKind::AllReduce), move |ctx| {
                if i == 0 {
                    // The first job blocks until the caller opens the gate, which proves that
                    // submit returned before the job ran.
                    let (lock, cv) = &*gate;
                    let mut open = lock.lock().unwrap();
                    while !*open {
                        open = cv.wait(open).unwrap();
                    }
                }
                log.lock().unwrap().push((i, ctx.seq));
                Ok(i * 10)
            }));
        }
        assert!(!works[0].is_completed());
        {
            let (lock, cv) = &*gate;
            *lock.lock().unwrap() = true;
            cv.notify_all();
        }
        // Wait out of order: the results still belong to their own jobs.
        for (i, work) in works.into_iter().enumerate().rev() {
            assert_eq!(work.wait().unwrap(), i as u64 * 10);
        }
        let log = log.lock().unwrap();
        let expected: Vec<(u64, u64)> = (0..20).map(|i| (i, i)).collect();
        assert_eq!(*log, expected);
    }

    #[test]
    fn abort_fails_queued_and_later_jobs() {
        let engine = ProgressEngine::new("abort").unwrap();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let first = engine.submit(spec(OpKind::Barrier), move |ctx| {
            let _ = release_rx.recv_timeout(Duration::from_secs(5));
            ctx.check(None)
        });
        let queued = engine.submit(spec(OpKind::Broadcast), |_| Ok(()));
        engine.abort();
        release_tx.send(()).unwrap();
        assert!(matches!(
            first.wait(),
            Err(Error::Aborted {
                op: OpKind::Barrier
            })
        ));
        assert!(matches!(
            queued.wait(),
            Err(Error::Aborted {
                op: OpKind::Broadcast
            })
        ));
        let later = engine.submit(spec(OpKind::Send), |_| Ok(()));
        assert!(later.is_completed());
        assert!(matches!(later.wait(), Err(Error::Aborted { .. })));
    }

    #[test]
    fn a_panicking_job_fails_only_itself() {
        let engine = ProgressEngine::new("panic").unwrap();
        let bad = engine.submit::<(), _>(spec(OpKind::Gather), |_| panic!("job fell over"));
        let good = engine.submit(spec(OpKind::Scatter), |_| Ok(1));
        assert!(matches!(
            bad.wait(),
            Err(Error::EngineStopped { op: OpKind::Gather })
        ));
        assert_eq!(good.wait().unwrap(), 1);
    }

    #[test]
    fn the_deadline_is_checked() {
        let engine = ProgressEngine::new("deadline").unwrap();
        let work = engine.submit(
            JobSpec {
                op: OpKind::AllGather,
                bytes: 4,
                timeout: Duration::from_millis(1),
            },
            |ctx| {
                thread::sleep(Duration::from_millis(5));
                ctx.check(Some(2))
            },
        );
        assert!(matches!(
            work.wait(),
            Err(Error::Timeout {
                op: OpKind::AllGather,
                peer: Some(2),
                ..
            })
        ));
    }
}
