//! The only place that calls NCCL: a communicator handle, dtype and reduce-op mapping, and
//! [`enqueue`], which turns checked [`Call`]s into NCCL calls on a stream.

use std::ffi::c_void;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::nccl::result::{self as nccl, NcclError};
use cudarc::nccl::sys::{self, ncclDataType_t, ncclRedOp_t, ncclScalarResidence_t};

use half::{bf16, f16};

use super::plan::{Call, Side, Span};
use crate::dtype::DType;
use crate::error::{DeviceLibrary, Error, Result};
use crate::op::{OpKind, ReduceOp};

/// A failed NCCL call as an [`Error::DeviceCall`].
pub(crate) fn nccl_error(op: Option<OpKind>, call: &'static str, error: NcclError) -> Error {
    Error::DeviceCall {
        op,
        library: DeviceLibrary::Nccl,
        call,
        code: error.0 as i32,
    }
}

/// An `ncclComm_t` this process created; destroyed on drop unless it was aborted.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
}

// SAFETY: an ncclComm_t is a heap object NCCL lets any thread use; we never use one from two
// threads at once (every use goes through the `Mutex<RawComm>` of the communicator).
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommInitRank`: blocks until all `size` ranks have called it with the same id.
    /// The caller has bound the device's context to this thread.
    pub fn init(size: usize, id: [u8; super::split::UNIQUE_ID_BYTES], rank: usize) -> Result<Self> {
        let bad_size = Error::InvalidWorldSize { size };
        let nranks = i32::try_from(size).map_err(|_| bad_size)?;
        let rank_arg = i32::try_from(rank).map_err(|_| Error::InvalidRank {
            op: OpKind::Split,
            rank,
            size,
        })?;
        let internal = id.map(|b| b as std::ffi::c_char);
        let unique = sys::ncclUniqueId { internal };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer for one handle; the id is 128 initialised bytes
        // (by value); nranks > 0 and 0 <= rank < nranks were checked by the caller's plan.
        unsafe { nccl::comm_init_rank(&mut comm, nranks, unique, rank_arg) }
            .map_err(|e| nccl_error(Some(OpKind::Split), "ncclCommInitRank", e))?;
        Ok(RawComm { comm })
    }

    /// A fresh unique id (`ncclGetUniqueId`).
    pub fn unique_id() -> Result<[u8; super::split::UNIQUE_ID_BYTES]> {
        let id = nccl::get_uniqueid().map_err(|e| nccl_error(None, "ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// `ncclCommAbort`: kernels of this communicator stop, pending ops fail.
    pub fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: the handle came from ncclCommInitRank and is nulled right after, so it is
            // aborted exactly once and never used again.
            let _ = unsafe { nccl::comm_abort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }

    /// Whether [`abort`](Self::abort) was called.
    pub fn is_aborted(&self) -> bool {
        self.comm.is_null()
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: the handle is live (not aborted) and this is its last use. Every op's
            // event completed before the last reference went away (the completion thread
            // holds one until it has drained), so destroy does not wait on running kernels.
            // Errors cannot be reported from drop and leave nothing to clean up.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

/// NCCL's name for a dtype.
pub(crate) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// The built-in NCCL op for `op`, or `None` for `PreMulSum` (made per launch).
pub(crate) fn builtin_op(op: ReduceOp) -> Option<ncclRedOp_t> {
    match op {
        ReduceOp::Sum => Some(ncclRedOp_t::ncclSum),
        ReduceOp::Avg => Some(ncclRedOp_t::ncclAvg),
        ReduceOp::Max => Some(ncclRedOp_t::ncclMax),
        ReduceOp::Min => Some(ncclRedOp_t::ncclMin),
        ReduceOp::Product => Some(ncclRedOp_t::ncclProd),
        ReduceOp::PreMulSum(_) => None,
    }
}

/// The factor of a `PreMulSum` in the dtype's own representation (NCCL reads
/// `sizeof(dtype)` bytes from the host pointer at creation).
#[derive(Clone, Copy)]
enum Scalar {
    F32(f32),
    F64(f64),
    BF16(bf16),
    F16(f16),
}

impl Scalar {
    fn new(dtype: DType, factor: f64) -> Option<Scalar> {
        match dtype {
            DType::F32 => Some(Scalar::F32(factor as f32)),
            DType::F64 => Some(Scalar::F64(factor)),
            DType::BF16 => Some(Scalar::BF16(bf16::from_f64(factor))),
            DType::F16 => Some(Scalar::F16(f16::from_f64(factor))),
            DType::I32 | DType::I64 | DType::U8 => None,
        }
    }

    fn as_mut_ptr(&mut self) -> *mut c_void {
        match self {
            Scalar::F32(v) => (v as *mut f32).cast(),
            Scalar::F64(v) => (v as *mut f64).cast(),
            Scalar::BF16(v) => (v as *mut bf16).cast(),
            Scalar::F16(v) => (v as *mut f16).cast(),
        }
    }
}

/// The raw value NCCL gives the first user-defined op of a communicator (`ncclNumOps + 0`).
/// cudarc models `ncclRedOp_t` as a Rust enum, so only that value is representable without
/// undefined behaviour; ops are created and destroyed around each launch under the
/// communicator's lock, so the first slot is always the one handed out.
const FIRST_USER_OP: u32 = ncclRedOp_t::ncclNumOps as u32;

/// A reduce op ready for NCCL calls; a `PreMulSum` is destroyed on drop.
struct LaunchOp {
    op: ncclRedOp_t,
    custom: Option<sys::ncclComm_t>,
}

impl LaunchOp {
    fn new(comm: &RawComm, reduce: ReduceOp, dtype: DType, op_kind: OpKind) -> Result<LaunchOp> {
        if let Some(op) = builtin_op(reduce) {
            return Ok(LaunchOp { op, custom: None });
        }
        let ReduceOp::PreMulSum(factor) = reduce else {
            return Err(Error::UnsupportedOp { op: reduce, dtype });
        };
        let mut scalar =
            Scalar::new(dtype, factor).ok_or(Error::UnsupportedOp { op: reduce, dtype })?;
        let mut raw: u32 = u32::MAX;
        // SAFETY: `raw` is a writable 4-byte slot NCCL fills with the op's int value (read back
        // as u32, never as the enum); `scalar` points to one element of `dtype` that lives
        // across the call (HostImmediate: NCCL copies it now); the communicator is live.
        unsafe {
            nccl::reduce_op_create_pre_mul_sum(
                (&mut raw as *mut u32).cast::<ncclRedOp_t>(),
                scalar.as_mut_ptr(),
                nccl_dtype(dtype),
                ncclScalarResidence_t::ncclScalarHostImmediate,
                comm.comm,
            )
        }
        .map_err(|e| nccl_error(Some(op_kind), "ncclRedOpCreatePreMulSum", e))?;
        if raw != FIRST_USER_OP {
            // Not representable as cudarc's enum; the op stays allocated in NCCL (it cannot be
            // named to destroy it), which only happens if NCCL changes how it numbers ops.
            return Err(Error::UnsupportedOp { op: reduce, dtype });
        }
        Ok(LaunchOp {
            op: ncclRedOp_t::ncclNumOps,
            custom: Some(comm.comm),
        })
    }
}

impl Drop for LaunchOp {
    fn drop(&mut self) {
        if let Some(comm) = self.custom {
            // SAFETY: the op was created on this live communicator and NCCL allows destroying
            // it as soon as the last call given it has returned, which is before this drop.
            let _ = unsafe { nccl::reduce_op_destroy(self.op, comm) };
        }
    }
}

/// The device addresses of an op's two buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    pub input: CUdeviceptr,
    pub output: CUdeviceptr,
    pub dtype: DType,
}

impl Operands {
    fn address(&self, span: Span) -> *mut c_void {
        let base = match span.side {
            Side::Input => self.input,
            Side::Output => self.output,
        };
        // Spans were checked against the buffers' lengths (plan::check_spans), so the byte
        // offset stays inside the allocation.
        (base + (span.offset * self.dtype.size_bytes()) as u64) as *mut c_void
    }
}

/// What [`enqueue`] needs besides the calls.
pub(crate) struct Enqueue<'a> {
    pub comm: &'a RawComm,
    pub stream: sys::cudaStream_t,
    pub op: OpKind,
    pub reduce: Option<ReduceOp>,
    pub operands: Operands,
}

/// Enqueues `calls` on the stream, inside one NCCL group when there is more than one.
///
/// The spans were checked by `plan::check_spans` against the buffers whose addresses are in
/// `operands`; the caller keeps those buffers alive (and their cudarc sync guards) until the
/// enclosing group, if any, has ended.
pub(crate) fn enqueue(args: &Enqueue<'_>, calls: &[Call]) -> Result<()> {
    if calls.is_empty() {
        return Ok(());
    }
    if args.comm.is_aborted() {
        return Err(Error::Aborted { op: args.op });
    }
    let dtype = nccl_dtype(args.operands.dtype);
    let reduce = match args.reduce {
        Some(reduce) => Some(LaunchOp::new(
            args.comm,
            reduce,
            args.operands.dtype,
            args.op,
        )?),
        None => None,
    };
    let red = reduce.as_ref().map_or(ncclRedOp_t::ncclSum, |r| r.op);
    let fail = |call: &'static str| move |e: NcclError| nccl_error(Some(args.op), call, e);
    let grouped = calls.len() > 1;
    if grouped {
        nccl::group_start().map_err(fail("ncclGroupStart"))?;
    }
    let mut first_error = None;
    for call in calls {
        let result = enqueue_one(args, call, dtype, red);
        if let Err(error) = result {
            first_error = Some(error);
            break;
        }
    }
    if grouped {
        let ended = nccl::group_end().map_err(fail("ncclGroupEnd"));
        if first_error.is_none() {
            ended?;
        }
    }
    match first_error {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

fn rank_arg(op: OpKind, rank: usize) -> Result<i32> {
    i32::try_from(rank).map_err(|_| Error::InvalidRank {
        op,
        rank,
        size: i32::MAX as usize,
    })
}

fn enqueue_one(
    args: &Enqueue<'_>,
    call: &Call,
    dtype: ncclDataType_t,
    red: ncclRedOp_t,
) -> Result<()> {
    let comm = args.comm.comm;
    let stream = args.stream;
    let at = |span: Span| args.operands.address(span);
    let fail = |name: &'static str| move |e: NcclError| nccl_error(Some(args.op), name, e);
    // Every arm's SAFETY rests on this: the addresses point into device allocations of at least
    // `offset + count` elements (checked spans); counts are the spans' counts; the
    // communicator is live (checked above, and the caller holds its lock); the stream belongs
    // to the communicator's device.
    match *call {
        Call::AllReduce { data } => {
            // SAFETY: see above (in place: send and receive are the same checked span).
            unsafe { nccl::all_reduce(at(data), at(data), data.count, dtype, red, comm, stream) }
                .map_err(fail("ncclAllReduce"))?
        }
        Call::AllGather { send, recv } => {
            // SAFETY: see above; `recv` holds size × `send.count` elements (checked by plan).
            unsafe { nccl::all_gather(at(send), at(recv), send.count, dtype, comm, stream) }
                .map_err(fail("ncclAllGather"))?
        }
        Call::ReduceScatter { send, recv } => {
            // SAFETY: see above; `send` holds size × `recv.count` elements (checked by plan).
            unsafe {
                nccl::reduce_scatter(at(send), at(recv), recv.count, dtype, red, comm, stream)
            }
            .map_err(fail("ncclReduceScatter"))?
        }
        Call::Broadcast { root, send, recv } => {
            let root = rank_arg(args.op, root)?;
            // SAFETY: see above; `send` is only read on the root, where its span is full.
            unsafe { nccl::broadcast(at(send), at(recv), recv.count, dtype, root, comm, stream) }
                .map_err(fail("ncclBroadcast"))?
        }
        Call::Reduce { root, send, recv } => {
            let root = rank_arg(args.op, root)?;
            // SAFETY: see above; `recv` is only written on the root, where its span is full.
            unsafe {
                nccl::reduce(
                    at(send),
                    at(recv),
                    send.count,
                    dtype,
                    red,
                    root,
                    comm,
                    stream,
                )
            }
            .map_err(fail("ncclReduce"))?
        }
        Call::Send { peer, data } => {
            let peer = rank_arg(args.op, peer)?;
            // SAFETY: see above.
            unsafe { nccl::send(at(data), data.count, dtype, peer, comm, stream) }
                .map_err(fail("ncclSend"))?
        }
        Call::Recv { peer, data } => {
            let peer = rank_arg(args.op, peer)?;
            // SAFETY: see above.
            unsafe { nccl::recv(at(data), data.count, dtype, peer, comm, stream) }
                .map_err(fail("ncclRecv"))?
        }
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_and_builtin_op_has_an_nccl_name() {
        let names: Vec<ncclDataType_t> = DType::ALL.iter().map(|&d| nccl_dtype(d)).collect();
        assert_eq!(names.len(), 7);
        assert_eq!(nccl_dtype(DType::BF16), ncclDataType_t::ncclBfloat16);
        assert_eq!(builtin_op(ReduceOp::Avg), Some(ncclRedOp_t::ncclAvg));
        assert_eq!(builtin_op(ReduceOp::PreMulSum(0.5)), None);
        assert_eq!(FIRST_USER_OP, 5);
    }

    #[test]
    fn premul_scalars_use_the_dtype_and_reject_integers() {
        assert!(
            matches!(Scalar::new(DType::BF16, 0.5), Some(Scalar::BF16(v)) if v.to_f64() == 0.5)
        );
        assert!(matches!(Scalar::new(DType::F64, 0.25), Some(Scalar::F64(v)) if v == 0.25));
        assert!(Scalar::new(DType::I32, 2.0).is_none());
    }

    #[test]
    fn span_addresses_scale_by_the_element_size() {
        let operands = Operands {
            input: 0x1000,
            output: 0x8000,
            dtype: DType::F64,
        };
        let span = Span {
            side: Side::Output,
            offset: 3,
            count: 1,
        };
        assert_eq!(operands.address(span) as usize, 0x8000 + 24);
    }
}
