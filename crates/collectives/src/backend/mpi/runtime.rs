//! The process-wide MPI runtime: initialisation with `MPI_THREAD_MULTIPLE`, the queue of sends
//! still in flight, and `MPI_Finalize` once nothing uses MPI any more.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread;
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};

use super::raw::{self, RawRequest};
use crate::error::{Error, MpiInitProblem, Result};

/// How long dropping the runtime waits for sends still in flight before it finalises anyway.
const FINAL_DRAIN: Duration = Duration::from_secs(30);

/// The one live runtime of this process, if any (a `Weak`, so the last communicator's drop
/// finalises MPI).
static CURRENT: Mutex<Option<Weak<Runtime>>> = Mutex::new(None);

/// MPI for this process. Every communicator holds an `Arc` of it; when the last one goes, the
/// runtime waits for the sends still in flight and calls `MPI_Finalize` (MPI cannot be
/// initialised again afterwards).
pub(crate) struct Runtime {
    sends: Arc<SendQueue>,
    drainer: Option<thread::JoinHandle<()>>,
    // Dropped last: its drop is `MPI_Finalize`.
    _universe: Universe,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Runtime {
    /// The process's runtime: the live one, or a fresh `MPI_Init_thread(MPI_THREAD_MULTIPLE)`.
    pub(crate) fn get() -> Result<Arc<Runtime>> {
        let mut current = CURRENT.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(live) = current.as_ref().and_then(Weak::upgrade) {
            return Ok(live);
        }
        let (universe, provided) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or(Error::MpiInit {
                problem: MpiInitProblem::AlreadyInitialized,
            })?;
        if provided != Threading::Multiple {
            // Dropping the universe finalises MPI again; the error says why.
            drop(universe);
            return Err(Error::MpiInit {
                problem: MpiInitProblem::ThreadLevel {
                    provided: threading_name(provided),
                },
            });
        }
        let sends = Arc::new(SendQueue::default());
        let drainer = {
            let sends = sends.clone();
            thread::Builder::new()
                .name("hs-mpi-sends".to_string())
                .spawn(move || sends.drain_forever())
                .map_err(|source| Error::SpawnFailed {
                    group: "mpi-sends".to_string(),
                    source,
                })?
        };
        let runtime = Arc::new(Runtime {
            sends,
            drainer: Some(drainer),
            _universe: universe,
        });
        *current = Some(Arc::downgrade(&runtime));
        Ok(runtime)
    }

    /// Hands a started send to the drain thread, which tests it until it completes and then
    /// frees its bytes.
    pub(crate) fn track_send(&self, send: PendingSend) {
        self.sends.push(send);
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.sends.shut_down(Instant::now() + FINAL_DRAIN);
        if let Some(drainer) = self.drainer.take() {
            // The drain thread returns once the queue is shut down; a panic in it is ignored
            // here (Drop never panics).
            let _ = drainer.join();
        }
    }
}

fn threading_name(level: Threading) -> &'static str {
    match level {
        Threading::Single => "single",
        Threading::Funneled => "funneled",
        Threading::Serialized => "serialized",
        Threading::Multiple => "multiple",
    }
}

/// A send MPI is still working on, with the bytes it reads.
pub(crate) struct PendingSend {
    pub(crate) request: RawRequest,
    /// The copy of the payload MPI reads from until the request completes.
    pub(crate) bytes: Vec<u8>,
}

#[derive(Default)]
struct QueueState {
    pending: Vec<PendingSend>,
    /// Set by the runtime's drop: drain until this instant, then stop.
    stop_by: Option<Instant>,
}

#[derive(Default)]
struct SendQueue {
    state: Mutex<QueueState>,
    changed: Condvar,
}

impl SendQueue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, send: PendingSend) {
        self.lock().pending.push(send);
        self.changed.notify_all();
    }

    fn shut_down(&self, by: Instant) {
        self.lock().stop_by = Some(by);
        self.changed.notify_all();
    }

    /// Tests every pending send until it completes. Sends need this even when their own
    /// communicator issues nothing more: MPI moves a large (rendezvous) message only while
    /// the sender's process calls into MPI.
    fn drain_forever(&self) {
        let mut state = self.lock();
        loop {
            state
                .pending
                .retain_mut(|send| match raw::test_request(&mut send.request) {
                    Ok(done) => !done,
                    Err(_) => {
                        // A send whose test failed cannot report to anyone (its Work completed when
                        // the send started); MPI may still read its bytes, so they are leaked.
                        std::mem::forget(std::mem::take(&mut send.bytes));
                        false
                    }
                });
            if let Some(by) = state.stop_by
                && (state.pending.is_empty() || Instant::now() >= by)
            {
                // Sends MPI never finished keep their bytes forever: MPI may still read them.
                for send in state.pending.drain(..) {
                    std::mem::forget(send.bytes);
                }
                return;
            }
            let wait = if state.pending.is_empty() {
                Duration::from_millis(100)
            } else {
                Duration::from_micros(50)
            };
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}
