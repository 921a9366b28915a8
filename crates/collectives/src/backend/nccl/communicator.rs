//! [`NcclCommunicator`]: the [`Communicator`] over NCCL on one CUDA device per rank.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::completion::{self, Finish, Launched, Operand, Shared};
use super::ffi::{self, Enqueue, Operands, RawComm};
use super::library::{BACKEND, unavailable};
use super::plan::{self, Call, Place, Request, Shape};
use super::split::{self, SplitEntry};
use crate::buffer::BufferPair;
use crate::buffer::{Buffer, BufferLocation, HostBuffer};
use crate::communicator::Communicator;
use crate::config::CommConfig;
use crate::device_buffer::{DeviceBuffer, driver};
use crate::dtype::DType;
use crate::error::{Error, Result, Unavailable};
use crate::op::{AllToAllCounts, BufferRole, OpKind, ReduceOp};
use crate::rendezvous::Store;
use crate::work::{Completer, Work};

/// How to create the world communicator of one rank.
#[derive(Clone)]
pub struct NcclInit {
    /// This rank, `0..size`.
    pub rank: usize,
    /// The number of ranks (one CUDA device each: NCCL refuses two ranks of one communicator
    /// on the same device).
    pub size: usize,
    /// The CUDA device ordinal this rank uses.
    pub device: usize,
    /// The rendezvous store every rank shares (rank 0 publishes the NCCL unique id there).
    pub store: Arc<dyn Store>,
    /// Deadline and other options, inherited by `split`.
    pub config: CommConfig,
}

/// A [`Communicator`] that runs every op as NCCL kernels on its own CUDA stream.
///
/// * Buffers: [`Buffer::Cuda`] device buffers run in place. Host buffers are accepted too and
///   staged through device copies (uploaded at launch, copied back when the op completes),
///   which is how the host-buffer conformance suite runs on this backend.
/// * Asynchrony: an op is enqueued on the communicator's stream when it is issued (after that
///   stream waits for the last write to each device buffer, through cudarc's event tracking),
///   and its [`Work`] completes when the CUDA event recorded after it fires; the caller's
///   thread and compute stream keep running meanwhile.
/// * Fused launches: [`NcclCommunicator::group`] issues every op of a closure inside one
///   `ncclGroupStart`/`ncclGroupEnd`.
/// * `Avg` is NCCL's native `ncclAvg`; `PreMulSum(f)` is `ncclRedOpCreatePreMulSum` with the
///   factor in the buffer's dtype.
/// * NCCL does not compare arguments across ranks: every rank must pass the same lengths,
///   dtypes, roots and counts (this rank's own lengths are checked before any NCCL call).
pub struct NcclCommunicator {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    size: usize,
    name: String,
    config: CommConfig,
    store: Arc<dyn Store>,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    shared: Arc<Shared>,
    launches: Mutex<Sender<Launched>>,
    /// The ops of an open [`NcclCommunicator::group`], launched together when it closes.
    batch: Mutex<Option<Vec<Prepared>>>,
    splits: AtomicU64,
}

/// An op whose arguments were checked, ready to enqueue.
struct Prepared {
    op: OpKind,
    calls: Vec<Call>,
    reduce: Option<ReduceOp>,
    dtype: DType,
    input: Operand,
    output: Option<Operand>,
    finish: Finish,
}

/// What `build` needs for a world or a split.
struct Build {
    rank: usize,
    size: usize,
    name: String,
    config: CommConfig,
    store: Arc<dyn Store>,
    context: Arc<CudaContext>,
    id_key: String,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The context of CUDA device `device`, or [`Error::BackendUnavailable`] when the libraries
/// or the device are missing.
pub(crate) fn open_device(device: usize) -> Result<Arc<CudaContext>> {
    let available = super::placement::device_count()?;
    if device >= available {
        return Err(unavailable(Unavailable::NoDevice {
            requested: device,
            available,
        }));
    }
    CudaContext::new(device).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))
}

impl NcclCommunicator {
    /// Joins the world of `init.size` ranks (collective: every rank calls it, each with its
    /// own device). Fails with [`Error::BackendUnavailable`] when libcuda, libnccl or the
    /// device are missing, before touching them.
    pub fn new(init: NcclInit) -> Result<Self> {
        if init.size == 0 {
            return Err(Error::InvalidWorldSize { size: 0 });
        }
        if init.rank >= init.size {
            return Err(Error::InvalidRank {
                op: OpKind::Split,
                rank: init.rank,
                size: init.size,
            });
        }
        let context = open_device(init.device)?;
        NcclCommunicator::build(Build {
            rank: init.rank,
            size: init.size,
            name: "world".to_string(),
            config: init.config,
            store: init.store,
            context,
            id_key: "nccl/world/id".to_string(),
        })
    }

    fn build(build: Build) -> Result<Self> {
        build
            .context
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let stream = build
            .context
            .new_stream()
            .map_err(|e| driver("cuStreamCreate", e))?;
        let id = split::exchange_id(
            build.store.as_ref(),
            &build.id_key,
            build.rank,
            build.config.timeout,
            RawComm::unique_id,
        )?;
        let comm = RawComm::init(build.size, id, build.rank)?;
        let shared = Arc::new(Shared {
            comm: Mutex::new(comm),
            aborted: AtomicBool::new(false),
        });
        let (sender, receiver) = mpsc::channel();
        let thread_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("nccl-{}-{}", build.name, build.rank))
            .spawn(move || completion::run(thread_shared, receiver))
            .map_err(|source| Error::SpawnFailed {
                group: build.name.clone(),
                source,
            })?;
        Ok(NcclCommunicator {
            inner: Arc::new(Inner {
                rank: build.rank,
                size: build.size,
                name: build.name,
                config: build.config,
                store: build.store,
                context: build.context,
                stream,
                shared,
                launches: Mutex::new(sender),
                batch: Mutex::new(None),
                splits: AtomicU64::new(0),
            }),
        })
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.inner.context.ordinal()
    }

    /// The stream the communicator's kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// A device buffer of `len` zeros on this communicator's device.
    pub fn zeros(&self, dtype: DType, len: usize) -> Result<Buffer> {
        Ok(Buffer::Cuda(DeviceBuffer::zeros(
            &self.inner.stream,
            dtype,
            len,
        )?))
    }

    /// A device copy of `host` on this communicator's device.
    pub fn upload(&self, host: &HostBuffer) -> Result<Buffer> {
        Ok(Buffer::Cuda(DeviceBuffer::from_host(
            &self.inner.stream,
            host,
        )?))
    }

    /// Runs `ops` with every op it issues on this communicator fused into one NCCL group
    /// (one `ncclGroupStart`/`ncclGroupEnd`, so NCCL may launch them as one kernel), and
    /// launches them when `ops` returns. Inside `ops` use only the `*_async` forms and wait
    /// on their [`Work`] after `group` returns: a blocking op inside would wait for a launch
    /// that happens only at the end. A `group` inside a `group` joins the outer one.
    pub fn group<R>(&self, ops: impl FnOnce(&Self) -> R) -> R {
        {
            let mut batch = lock(&self.inner.batch);
            if batch.is_some() {
                drop(batch);
                return ops(self);
            }
            *batch = Some(Vec::new());
        }
        let result = ops(self);
        let batch = lock(&self.inner.batch).take().unwrap_or_default();
        self.launch(batch);
        result
    }

    /// Checks the buffers and plans the calls of one op.
    fn prepare(
        &self,
        request: Request<'_>,
        buffers: Buffers,
        reduce: Option<ReduceOp>,
    ) -> Result<PreparedParts> {
        let op = request.kind();
        let dtype = buffers.input.dtype();
        if let Some(output) = &buffers.output
            && output.dtype() != dtype
        {
            return Err(Error::DTypeMismatch {
                op,
                role: BufferRole::Output,
                expected: dtype,
                got: output.dtype(),
            });
        }
        if let Some(reduce @ (ReduceOp::Avg | ReduceOp::PreMulSum(_))) = reduce
            && !dtype.is_float()
        {
            return Err(Error::UnsupportedOp { op: reduce, dtype });
        }
        let shape = Shape {
            input: buffers.input.len(),
            output: buffers.output.as_ref().map_or(0, Buffer::len),
        };
        let place = Place {
            rank: self.inner.rank,
            size: self.inner.size,
        };
        let calls = plan::plan(request, shape, place)?;
        let usage = plan::usage(&calls);
        let input = self.operand(op, buffers.input, usage.input_used, usage.input_written)?;
        let output = match buffers.output {
            Some(output) => {
                Some(self.operand(op, output, usage.output_used, usage.output_written)?)
            }
            None => None,
        };
        Ok(PreparedParts {
            op,
            calls,
            reduce,
            dtype,
            input,
            output,
        })
    }

    /// Wraps one buffer: a device buffer must be on this device; a host buffer the op touches
    /// is uploaded to a staging copy.
    fn operand(&self, op: OpKind, buffer: Buffer, used: bool, written: bool) -> Result<Operand> {
        let staged = match &buffer {
            Buffer::Cuda(device) => {
                if device.device() != self.device() {
                    return Err(Error::UnsupportedBuffer {
                        op,
                        location: device.location(),
                        backend: BACKEND,
                    });
                }
                None
            }
            Buffer::Host(host) if used => Some(DeviceBuffer::from_host(&self.inner.stream, host)?),
            Buffer::Host(_) => None,
        };
        Ok(Operand {
            original: buffer,
            staged,
            written,
        })
    }

    /// Queues the op in the open group, or launches it now.
    fn submit(&self, prepared: Prepared) {
        {
            let mut batch = lock(&self.inner.batch);
            if let Some(batch) = batch.as_mut() {
                batch.push(prepared);
                return;
            }
        }
        self.launch(vec![prepared]);
    }

    /// Enqueues `batch` (one NCCL group when it holds several ops), records one event after
    /// it, and hands each op to the completion thread; an op that failed to enqueue completes
    /// with its error at once.
    fn launch(&self, mut batch: Vec<Prepared>) {
        if batch.is_empty() {
            return;
        }
        let inner = &self.inner;
        let comm = lock(&inner.shared.comm);
        let results = if inner.shared.aborted.load(Ordering::SeqCst) {
            batch
                .iter()
                .map(|p| Err(Error::Aborted { op: p.op }))
                .collect::<Vec<_>>()
        } else {
            enqueue_batch(&comm, &inner.context, &inner.stream, &mut batch)
        };
        let event = inner
            .stream
            .record_event(None)
            .map(Arc::new)
            .map_err(|e| driver("cuEventRecord", e));
        drop(comm);
        let launches = lock(&inner.launches);
        for (prepared, result) in batch.into_iter().zip(results) {
            let launched = result.and_then(|()| match &event {
                Ok(event) => Ok(Arc::clone(event)),
                Err(error) => Err(clone_device_error(error)),
            });
            match launched {
                Ok(event) => {
                    let deadline = Instant::now() + inner.config.timeout;
                    let launched = Launched {
                        op: prepared.op,
                        event,
                        input: prepared.input,
                        output: prepared.output,
                        finish: prepared.finish,
                        deadline,
                        timeout: inner.config.timeout,
                    };
                    if let Err(mpsc::SendError(launched)) = launches.send(launched) {
                        fail(launched.finish, Error::EngineStopped { op: launched.op });
                    }
                }
                Err(error) => fail(prepared.finish, error),
            }
        }
    }

    fn run_one<T>(
        &self,
        request: Request<'_>,
        buffers: Buffers,
        reduce: Option<ReduceOp>,
        make: impl FnOnce(Completer<T>) -> Finish,
    ) -> Work<T> {
        let op = request.kind();
        match self.prepare(request, buffers, reduce) {
            Ok(parts) => {
                let (work, completer) = Work::pending(op);
                self.submit(parts.finish(make(completer)));
                work
            }
            Err(error) => Work::ready(op, Err(error)),
        }
    }

    fn single(
        &self,
        request: Request<'_>,
        buffer: Buffer,
        reduce: Option<ReduceOp>,
    ) -> Work<Buffer> {
        let buffers = Buffers {
            input: buffer,
            output: None,
        };
        self.run_one(request, buffers, reduce, Finish::One)
    }

    fn pair(
        &self,
        request: Request<'_>,
        input: Buffer,
        output: Buffer,
        reduce: Option<ReduceOp>,
    ) -> Work<BufferPair> {
        let buffers = Buffers {
            input,
            output: Some(output),
        };
        self.run_one(request, buffers, reduce, Finish::Pair)
    }
}

/// An op's buffers as passed in.
struct Buffers {
    input: Buffer,
    output: Option<Buffer>,
}

/// A [`Prepared`] without its completer.
struct PreparedParts {
    op: OpKind,
    calls: Vec<Call>,
    reduce: Option<ReduceOp>,
    dtype: DType,
    input: Operand,
    output: Option<Operand>,
}

impl PreparedParts {
    fn finish(self, finish: Finish) -> Prepared {
        Prepared {
            op: self.op,
            calls: self.calls,
            reduce: self.reduce,
            dtype: self.dtype,
            input: self.input,
            output: self.output,
            finish,
        }
    }
}

fn fail(finish: Finish, error: Error) {
    match finish {
        Finish::One(completer) => completer.complete(Err(error)),
        Finish::Pair(completer) => completer.complete(Err(error)),
        Finish::Unit(completer) => completer.complete(Err(error)),
    }
}

/// A second copy of a device error for every op of a batch (errors are not `Clone`).
fn clone_device_error(error: &Error) -> Error {
    match error {
        Error::DeviceCall {
            op,
            library,
            call,
            code,
        } => Error::DeviceCall {
            op: *op,
            library: *library,
            call,
            code: *code,
        },
        _ => Error::EngineStopped {
            op: OpKind::Barrier,
        },
    }
}

/// The device address of one operand (0 when the op does not touch it), with the cudarc guard
/// that records the access on `stream` when dropped.
fn operand_address<'a>(
    operand: &'a mut Operand,
    stream: &'a CudaStream,
) -> Result<Option<(u64, SyncOnDrop<'a>)>> {
    let written = operand.written;
    let device = match (&mut operand.staged, &mut operand.original) {
        (Some(staged), _) => staged,
        (None, Buffer::Cuda(device)) => device,
        // A host buffer the op does not touch was not staged.
        (None, _) => return Ok(None),
    };
    if written {
        let slice = device.make_unique()?;
        Ok(Some(slice.device_ptr_mut(stream)))
    } else {
        Ok(Some(device.slice().device_ptr(stream)))
    }
}

/// Enqueues one op's calls; its buffers' sync guards go to `guards`.
fn enqueue_prepared<'a>(
    prepared: &'a mut Prepared,
    comm: &RawComm,
    stream: &'a CudaStream,
    guards: &mut Vec<SyncOnDrop<'a>>,
) -> Result<()> {
    let input = operand_address(&mut prepared.input, stream)?;
    let output = match prepared.output.as_mut() {
        Some(output) => operand_address(output, stream)?,
        None => None,
    };
    let operands = Operands {
        input: input.as_ref().map_or(0, |(address, _)| *address),
        output: output.as_ref().map_or(0, |(address, _)| *address),
        dtype: prepared.dtype,
    };
    let enqueue = Enqueue {
        comm,
        stream: stream.cu_stream() as _,
        op: prepared.op,
        reduce: prepared.reduce,
        operands,
    };
    ffi::enqueue(&enqueue, &prepared.calls)?;
    guards.extend(input.map(|(_, guard)| guard));
    guards.extend(output.map(|(_, guard)| guard));
    Ok(())
}

/// Enqueues every op of `batch` inside one NCCL group; one result per op.
fn enqueue_batch(
    comm: &RawComm,
    context: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    batch: &mut [Prepared],
) -> Vec<Result<()>> {
    if let Err(error) = context.bind_to_thread() {
        let error = driver("cuCtxSetCurrent", error);
        return batch
            .iter()
            .map(|_| Err(clone_device_error(&error)))
            .collect();
    }
    let grouped = batch.len() > 1;
    if grouped && let Err(error) = cudarc::nccl::result::group_start() {
        let error = ffi::nccl_error(None, "ncclGroupStart", error);
        return batch
            .iter()
            .map(|_| Err(clone_device_error(&error)))
            .collect();
    }
    // The guards must outlive the group: kernels are enqueued at ncclGroupEnd, and each
    // guard records the buffer's read/write event on the stream when dropped.
    let count = batch.len();
    let mut guards = Vec::new();
    let mut results = Vec::with_capacity(count);
    for prepared in batch.iter_mut() {
        results.push(enqueue_prepared(prepared, comm, stream, &mut guards));
    }
    if grouped && let Err(error) = cudarc::nccl::result::group_end() {
        let error = ffi::nccl_error(None, "ncclGroupEnd", error);
        results = (0..count)
            .map(|_| Err(clone_device_error(&error)))
            .collect();
    }
    drop(guards);
    results
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn config(&self) -> &CommConfig {
        &self.inner.config
    }

    fn group_name(&self) -> &str {
        &self.inner.name
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn all_reduce_async(&self, buffer: Buffer, op: ReduceOp) -> Work<Buffer> {
        self.single(Request::AllReduce, buffer, Some(op))
    }

    fn all_gather_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        self.pair(Request::AllGather, input, output, None)
    }

    fn all_gather_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
    ) -> Work<BufferPair> {
        self.pair(Request::AllGatherV(&counts), input, output, None)
    }

    fn reduce_scatter_async(
        &self,
        input: Buffer,
        output: Buffer,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        self.pair(Request::ReduceScatter, input, output, Some(op))
    }

    fn reduce_scatter_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<BufferPair> {
        self.pair(Request::ReduceScatterV(&counts), input, output, Some(op))
    }

    fn broadcast_async(&self, buffer: Buffer, root: usize) -> Work<Buffer> {
        self.single(Request::Broadcast { root }, buffer, None)
    }

    fn reduce_async(&self, buffer: Buffer, root: usize, op: ReduceOp) -> Work<Buffer> {
        self.single(Request::Reduce { root }, buffer, Some(op))
    }

    fn gather_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        self.pair(Request::Gather { root }, input, output, None)
    }

    fn scatter_async(&self, input: Buffer, output: Buffer, root: usize) -> Work<BufferPair> {
        self.pair(Request::Scatter { root }, input, output, None)
    }

    fn all_to_all_async(&self, input: Buffer, output: Buffer) -> Work<BufferPair> {
        self.pair(Request::AllToAll, input, output, None)
    }

    fn all_to_all_v_async(
        &self,
        input: Buffer,
        output: Buffer,
        counts: AllToAllCounts,
    ) -> Work<BufferPair> {
        self.pair(Request::AllToAllV(&counts), input, output, None)
    }

    fn send_async(&self, buffer: Buffer, peer: usize, _tag: u32) -> Work<Buffer> {
        // NCCL has no tags: messages between two ranks match in issue order.
        self.single(Request::Send { peer }, buffer, None)
    }

    fn recv_async(&self, buffer: Buffer, peer: usize, _tag: u32) -> Work<Buffer> {
        self.single(Request::Recv { peer }, buffer, None)
    }

    fn barrier_async(&self) -> Work<()> {
        // A one-element all-reduce on a scratch device buffer: it completes on every rank
        // only once every rank has launched it.
        let scratch = match DeviceBuffer::zeros(&self.inner.stream, DType::F32, 1) {
            Ok(scratch) => Buffer::Cuda(scratch),
            Err(error) => return Work::ready(OpKind::Barrier, Err(error)),
        };
        let buffers = Buffers {
            input: scratch,
            output: None,
        };
        let work: Work<()> = self.run_one(
            Request::AllReduce,
            buffers,
            Some(ReduceOp::Sum),
            Finish::Unit,
        );
        // Work::op says all_reduce for the scratch op; callers see only the outcome.
        work
    }

    fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Arc<dyn Communicator>>> {
        let inner = &self.inner;
        let index = inner.splits.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("nccl/{}/split{index}", inner.name);
        let entries = split::exchange_entries(
            inner.store.as_ref(),
            &prefix,
            inner.rank,
            inner.size,
            SplitEntry { color, key },
            inner.config.timeout,
        )?;
        let Some(plan) = split::split_plan(&entries, inner.rank) else {
            return Ok(None);
        };
        let child = NcclCommunicator::build(Build {
            rank: plan.rank,
            size: plan.members.len(),
            name: format!("{}/c{}#{index}", inner.name, plan.color),
            config: inner.config.clone(),
            store: Arc::clone(&inner.store),
            context: Arc::clone(&inner.context),
            id_key: format!("{prefix}/color/{}/id", plan.color),
        })?;
        Ok(Some(Arc::new(child)))
    }

    fn abort(&self) {
        self.inner.shared.abort();
    }

    fn is_aborted(&self) -> bool {
        self.inner.shared.aborted.load(Ordering::SeqCst)
    }
}

/// Whether a buffer location can be used by [`NcclCommunicator`] on `device`.
pub fn accepts(location: BufferLocation, device: usize) -> bool {
    match location {
        BufferLocation::Host => true,
        BufferLocation::Cuda { device: d } => d == device,
    }
}
