//! The completion thread: it waits for each launch's CUDA event and completes its [`Work`].
//!
//! Launches return at once (NCCL enqueues on the communicator's stream); this thread polls
//! the events in launch order, copies staged host buffers back, and fills the completers, so
//! the caller's thread is never blocked by the device and [`Work::wait`] blocks only its own
//! caller. A launch still running at its deadline aborts the communicator.
//!
//! [`Work`]: crate::Work
//! [`Work::wait`]: crate::Work::wait

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;

use super::ffi::RawComm;
use crate::buffer::Buffer;
use crate::buffer::BufferPair;
use crate::device_buffer::DeviceBuffer;
use crate::error::{Error, Result};
use crate::op::OpKind;
use crate::work::Completer;

/// The state the communicator handles and the completion thread share.
pub(crate) struct Shared {
    /// Every NCCL call (and the abort) takes this lock.
    pub comm: Mutex<RawComm>,
    pub aborted: AtomicBool,
}

impl Shared {
    /// Marks the communicator aborted and aborts the NCCL handle.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.comm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .abort();
    }
}

/// How an op hands its buffers back.
pub(crate) enum Finish {
    One(Completer<Buffer>),
    Pair(Completer<BufferPair>),
    Unit(Completer<()>),
}

/// One buffer of a launched op: the caller's buffer and, for a host buffer, the device copy
/// the op ran on (copied back when `written`).
pub(crate) struct Operand {
    pub original: Buffer,
    pub staged: Option<DeviceBuffer>,
    pub written: bool,
}

impl Operand {
    /// Copies a staged result back into the caller's host buffer.
    fn settle(mut self, op: OpKind) -> Result<Buffer> {
        if let (Some(staged), true) = (&self.staged, self.written) {
            let host = self.original.as_host_mut()?;
            staged.download(host.as_bytes_mut(), op)?;
        }
        Ok(self.original)
    }
}

/// A launched op waiting for its event.
pub(crate) struct Launched {
    pub op: OpKind,
    pub event: Arc<CudaEvent>,
    pub input: Operand,
    pub output: Option<Operand>,
    pub finish: Finish,
    pub deadline: Instant,
    pub timeout: Duration,
}

/// Runs until every sender is gone, completing launches in order.
pub(crate) fn run(shared: Arc<Shared>, launches: Receiver<Launched>) {
    for launched in launches {
        let outcome = wait_event(&shared, &launched);
        finish(launched, outcome);
    }
}

fn wait_event(shared: &Shared, launched: &Launched) -> Result<()> {
    let mut pause = Duration::from_micros(20);
    loop {
        match launched.event.try_is_complete() {
            Ok(true) => break,
            Ok(false) => {}
            Err(error) => return Err(crate::device_buffer::driver("cuEventQuery", error)),
        }
        if Instant::now() >= launched.deadline {
            shared.abort();
            return Err(Error::Timeout {
                op: launched.op,
                after: launched.timeout,
                peer: None,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
    if shared.aborted.load(Ordering::SeqCst) {
        return Err(Error::Aborted { op: launched.op });
    }
    Ok(())
}

fn finish(launched: Launched, outcome: Result<()>) {
    let op = launched.op;
    let input = outcome.and_then(|()| launched.input.settle(op));
    match launched.finish {
        Finish::One(completer) => completer.complete(input),
        Finish::Unit(completer) => completer.complete(input.map(drop)),
        Finish::Pair(completer) => {
            let result = input.and_then(|input| {
                let output = launched.output.ok_or(Error::EngineStopped { op })?;
                Ok(BufferPair {
                    input,
                    output: output.settle(op)?,
                })
            });
            completer.complete(result);
        }
    }
}
