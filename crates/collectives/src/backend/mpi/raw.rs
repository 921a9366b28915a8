//! The only file of the MPI backend with `unsafe`: owned communicator and request handles, and
//! [`run`], which starts one nonblocking MPI call and polls it to completion within the op's
//! deadline while owning every byte the call reads or writes.
//!
//! Every nonblocking MPI call (`MPI_Iallreduce`, `MPI_Isend`, ...) is made through [`run`]:
//! the caller moves the buffers (and count arrays) the call points into into a `keep` value,
//! the `start` closure derives the pointers from that value and makes the call, and `run`
//! tests the request until it completes. If the op times out or the communicator is aborted
//! first, MPI may still touch the memory later (a started MPI collective cannot be
//! cancelled), so `run` leaks `keep` instead of dropping it.

use std::ffi::{c_int, c_void};
use std::time::Instant;

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::SimpleCommunicator;

use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::OpKind;

/// `MPI_SUCCESS`, which the MPI standard fixes at 0.
const MPI_SUCCESS: c_int = 0;

/// An owned MPI communicator (freed with `MPI_Comm_free` when dropped) that may be used from
/// any thread.
pub(crate) struct Comm {
    handle: SimpleCommunicator,
}

// SAFETY: the runtime only hands out communicators after MPI granted MPI_THREAD_MULTIPLE, under
// which MPI handles may be used from any thread, concurrently; `Comm` never mutates the handle
// (rsmpi frees it once, in its drop).
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: under MPI_THREAD_MULTIPLE concurrent calls on one communicator from
// several threads are allowed by the MPI standard (section 12.4).
unsafe impl Sync for Comm {}

impl Comm {
    /// Wraps a communicator this backend owns and makes MPI return error codes on it (and on
    /// every communicator split from it) instead of aborting the job.
    pub(crate) fn adopt(handle: SimpleCommunicator) -> Result<Comm> {
        // SAFETY: `handle` is a valid communicator owned by `handle`, and MPI_ERRORS_RETURN is a
        // predefined error handler constant exported by mpi-sys (read, never written).
        let code =
            unsafe { ffi::MPI_Comm_set_errhandler(handle.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
        check(None, "MPI_Comm_set_errhandler", code)?;
        Ok(Comm { handle })
    }

    /// The rsmpi communicator.
    pub(crate) fn handle(&self) -> &SimpleCommunicator {
        &self.handle
    }

    fn raw(&self) -> ffi::MPI_Comm {
        self.handle.as_raw()
    }
}

/// An MPI request handle that may move to the send drain thread.
pub(crate) struct RawRequest(ffi::MPI_Request);

// SAFETY: under MPI_THREAD_MULTIPLE a request may be completed by any thread; each
// `RawRequest` is owned by exactly one thread at a time (it is moved, never shared).
unsafe impl Send for RawRequest {}

/// Tests `request` once: `Ok(true)` when it has completed (MPI then sets it to
/// `MPI_REQUEST_NULL`), `Ok(false)` while it is still running.
pub(crate) fn test_request(request: &mut RawRequest) -> Result<bool> {
    let mut flag: c_int = 0;
    // SAFETY: `request.0` is a request started by `start_send` (or null, which MPI_Test accepts);
    // `flag` is a valid out-pointer; MPI_STATUS_IGNORE is mpi-sys's predefined constant.
    let code = unsafe { ffi::MPI_Test(&mut request.0, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
    check(None, "MPI_Test", code)?;
    Ok(flag != 0)
}

/// Turns an MPI return code into a typed error.
pub(crate) fn check(op: Option<OpKind>, call: &'static str, code: c_int) -> Result<()> {
    if code == MPI_SUCCESS {
        Ok(())
    } else {
        Err(Error::Mpi { op, call, code })
    }
}

/// The arguments every nonblocking call takes besides its buffers, handed to `start`.
pub(crate) struct Call {
    pub(crate) comm: ffi::MPI_Comm,
    pub(crate) request: *mut ffi::MPI_Request,
}

/// Starts one nonblocking MPI call with `start` and waits for it within `ctx`'s deadline.
///
/// `keep` owns every buffer and count array the call uses; `start` must derive its pointers
/// from it (heap data does not move when `keep` is moved). On success `keep` is handed back;
/// on a timeout or abort it is leaked, because MPI may still access it.
pub(crate) fn run<K>(
    ctx: &JobContext,
    comm: &Comm,
    call: &'static str,
    mut keep: K,
    start: impl FnOnce(&mut K, Call) -> c_int,
) -> Result<K> {
    // SAFETY: reading mpi-sys's predefined MPI_REQUEST_NULL constant.
    let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
    let code = start(
        &mut keep,
        Call {
            comm: comm.raw(),
            request: &mut request,
        },
    );
    check(Some(ctx.op), call, code)?;
    let mut polls: u32 = 0;
    let started = Instant::now();
    loop {
        let mut flag: c_int = 0;
        // SAFETY: `request` was just started by `start` on a buffer owned by `keep`, which is
        // alive (owned by this frame) for as long as this loop runs.
        let code = unsafe { ffi::MPI_Test(&mut request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if code != MPI_SUCCESS {
            std::mem::forget(keep);
            return Err(Error::Mpi {
                op: Some(ctx.op),
                call: "MPI_Test",
                code,
            });
        }
        if flag != 0 {
            return Ok(keep);
        }
        if let Err(error) = ctx.check(None) {
            // MPI may still write into (or read from) the buffers: never free them.
            std::mem::forget(keep);
            return Err(error);
        }
        polls = polls.saturating_add(1);
        // Spin briefly (latency), then yield (ranks often outnumber cores), then nap.
        if polls < 64 {
            std::hint::spin_loop();
        } else if started.elapsed().as_millis() < 2 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
}

/// A read-only pointer to `bytes` for MPI.
pub(crate) fn read_ptr(bytes: &[u8]) -> *const c_void {
    bytes.as_ptr().cast()
}

/// A writable pointer to `bytes` for MPI.
pub(crate) fn write_ptr(bytes: &mut [u8]) -> *mut c_void {
    bytes.as_mut_ptr().cast()
}

/// Starts `MPI_Isend` of `bytes` (bytes as `MPI_BYTE`-sized units of `datatype`, `count` of
/// them) and returns the request; the caller keeps `bytes` alive until it completes (the
/// runtime's send queue does).
pub(crate) fn start_send(
    comm: &Comm,
    bytes: &[u8],
    datatype: ffi::MPI_Datatype,
    count: c_int,
    dest: c_int,
    tag: c_int,
) -> Result<RawRequest> {
    // SAFETY: reading mpi-sys's predefined MPI_REQUEST_NULL constant.
    let mut request = RawRequest(unsafe { ffi::RSMPI_REQUEST_NULL });
    // SAFETY: `bytes` holds `count` elements of `datatype` (checked by the caller), and the
    // caller hands `bytes` to the send queue, which keeps them until the request completes.
    let code = unsafe {
        ffi::MPI_Isend(
            read_ptr(bytes),
            count,
            datatype,
            dest,
            tag,
            comm.raw(),
            &mut request.0,
        )
    };
    check(Some(OpKind::Send), "MPI_Isend", code)?;
    Ok(request)
}
