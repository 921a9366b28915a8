//! [`DeviceFsdpMlp`]: the reference MLP fully sharded on a CUDA device.

use std::sync::Arc;

use hypershard_collectives::nccl::DeviceBuffer;
use hypershard_collectives::{
    Buffer, BufferPair, Communicator, DType as CommDType, HostBuffer, ReduceOp, Work,
};
use hypershard_nn::cuda::{DeviceLayer, DeviceLinear, DeviceMlp, mse_loss};
use hypershard_nn::{Linear, Module, Relu, Sequential};
use hypershard_tensor::cuda::{CudaDevice, CudaTensor, copy_in_ranges, copy_out_ranges};
use hypershard_tensor::{DType, Tensor};

use super::error::{DeviceFsdpError, DeviceFsdpResult};
use super::plan::{
    Action, GroupPlan, Held, LinearShape, Schedule, Staging, plan_groups, uses_device_buffers,
};
use hypershard_dtensor::bridge::{reducible, wire_dtype};

/// How [`DeviceFsdpMlp`] shards and schedules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFsdpConfig {
    /// Consecutive Linear layers per parameter group (one all-gather and one reduce-scatter
    /// per group). Default 1: one group per Linear, as `fully_shard` on each Linear.
    pub layers_per_group: usize,
    /// The dtype the gathered parameters compute in (mixed precision: the f32 shard is cast
    /// to it before the all-gather). `None`: the parameters' own dtype. Gradients are always
    /// accumulated and reduced in the parameters' dtype (f32 for mixed precision: the GEMMs
    /// accumulate bf16 or f16 operands into f32).
    pub param_dtype: Option<DType>,
    /// Where collectives take their buffers from.
    pub staging: Staging,
    /// Issue the next group's all-gather before computing the current group (forward: the
    /// next group; backward: the previous one).
    pub prefetch: bool,
    /// Free each group's gathered parameters after its forward (and gather them again for
    /// the backward), except the last group's, whose backward comes next. Without it the
    /// parameters stay gathered until the group's backward is done.
    pub reshard_after_forward: bool,
}

impl Default for DeviceFsdpConfig {
    fn default() -> Self {
        DeviceFsdpConfig {
            layers_per_group: 1,
            param_dtype: None,
            staging: Staging::Auto,
            prefetch: true,
            reshard_after_forward: true,
        }
    }
}

/// A read-only description of one parameter group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    /// The group's Linear layers (indices into the model's `Sequential`).
    pub layers: Vec<usize>,
    /// The parameters' dotted names, in flat-buffer order.
    pub params: Vec<String>,
    /// Elements of this rank's shard (one rank's block of the flat buffer, padding included).
    pub shard_numel: usize,
}

/// One layer: a Linear whose parameters are swapped between gathered tensors and empty
/// placeholders, or a ReLU.
#[derive(Debug)]
enum Layer {
    Linear {
        linear: Box<DeviceLinear>,
        group: usize,
    },
    Relu,
}

/// Where a group's parameters are.
#[derive(Debug)]
enum Params {
    /// Only the shard exists; the Linear's parameters are empty placeholders.
    Sharded,
    /// An all-gather of the group is in flight.
    Gathering(Work<BufferPair>),
    /// The Linear's parameters hold the gathered values.
    Unsharded,
}

#[derive(Debug)]
struct Group {
    plan: GroupPlan,
    /// This rank's block of the flat buffer (its shard of every member, padded), in the
    /// parameters' dtype.
    shard: CudaTensor,
    /// The reduced gradient of `shard`, once a synchronised backward has run.
    grad: Option<CudaTensor>,
    params: Params,
    /// Whether the Linear layers hold unsharded gradients (during the group's backward, and
    /// between backwards without gradient sync).
    full_grads: bool,
    /// A reduce-scatter of the group's gradients in flight.
    reducing: Option<Work<BufferPair>>,
}

/// The reference MLP (a `Sequential` of Linear and ReLU layers) fully sharded on a CUDA
/// device: FSDP on device.
///
/// Every rank keeps only its shard of each parameter group, a flat device buffer laid out as
/// the CPU FSDP lays out a unit's fused all-gather (each parameter cut along dim 0 and padded,
/// slots aligned to 64 bytes). A group is gathered (copy-in of the shard, one all-gather,
/// copy-out of the ranges into the Linear's parameters) before its forward and its backward,
/// and freed after; its gradients are copied into a zero-padded flat buffer and
/// reduce-scattered (average) back to the shard; SGD updates the shard. See `docs/fsdp-device.md`.
///
/// The communicator is any [`Communicator`]: NCCL runs on the device buffers in place, other
/// backends (local threads, tcp) through host copies (see [`Staging`]).
pub struct DeviceFsdpMlp {
    device: CudaDevice,
    comm: Arc<dyn Communicator>,
    rank: usize,
    world: usize,
    config: DeviceFsdpConfig,
    /// The sharded parameters' (and gradients') dtype.
    storage: DType,
    /// The gathered parameters' dtype.
    compute: DType,
    device_buffers: bool,
    layers: Vec<Layer>,
    groups: Vec<Group>,
    /// Each group's layers `[start, end)`: from its first Linear (the model's first layer for
    /// group 0) to the next group's first Linear (the model's end for the last group).
    spans: Vec<(usize, usize)>,
    /// The index of the model's first Linear.
    first_linear: usize,
    /// Activations of the last forward: slot 0 is the input, then one per Linear.
    slots: Vec<CudaTensor>,
    /// For each layer, the slot of its input.
    inputs: Vec<usize>,
    ones: Option<CudaTensor>,
    sync_grads: bool,
}

impl std::fmt::Debug for DeviceFsdpMlp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFsdpMlp")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("backend", &self.comm.backend())
            .field("device_buffers", &self.device_buffers)
            .field("storage", &self.storage)
            .field("compute", &self.compute)
            .field("groups", &self.groups.len())
            .finish_non_exhaustive()
    }
}

/// The collectives dtype of `dtype` (the bridge's one map), or a typed error for a dtype whose
/// gradients cannot be reduced (`Bool`).
fn comm_of(rank: usize, dtype: DType) -> DeviceFsdpResult<CommDType> {
    if !reducible(dtype) {
        return Err(DeviceFsdpError::UnsupportedDType { rank, dtype });
    }
    Ok(wire_dtype(dtype))
}

/// An empty tensor standing in for a freed parameter or gradient (CUDA keeps one byte).
fn placeholder(device: &CudaDevice, dtype: DType) -> DeviceFsdpResult<CudaTensor> {
    Ok(CudaTensor::zeros(device, &[0], dtype)?)
}

impl DeviceFsdpMlp {
    /// Opens device `ordinal` and shards `model` over `comm`: on a machine without CUDA (or
    /// without that device) `DeviceFsdpError::Cuda(CudaError::Unavailable { .. })`, never a
    /// panic. The configuration is checked against the communicator first, so its errors
    /// (`DeviceBuffersUnsupported`, `ZeroGroupSize`) come before the device is opened.
    pub fn open(
        ordinal: usize,
        model: &Sequential,
        comm: Arc<dyn Communicator>,
        config: DeviceFsdpConfig,
    ) -> DeviceFsdpResult<DeviceFsdpMlp> {
        let rank = comm.rank();
        uses_device_buffers(
            config.staging,
            DeviceBuffer::accepted_by(comm.as_ref()),
            comm.backend(),
            rank,
        )?;
        if config.layers_per_group == 0 {
            return Err(DeviceFsdpError::ZeroGroupSize { rank });
        }
        let device = CudaDevice::new(ordinal)?;
        DeviceFsdpMlp::new(&device, model, comm, config)
    }

    /// Shards `model` (every rank passes the same model: same layers, widths and values)
    /// over `comm` on `device`.
    ///
    /// The model is read and copied to the device by nn's [`DeviceMlp::from_cpu`] (which
    /// checks it: Linear and ReLU layers, one dtype, chained widths); each group's shard is
    /// then cut out of the full parameters on the device, and the full parameters and
    /// gradients are freed. So the whole model is on the device once, while it is sharded.
    pub fn new(
        device: &CudaDevice,
        model: &Sequential,
        comm: Arc<dyn Communicator>,
        config: DeviceFsdpConfig,
    ) -> DeviceFsdpResult<DeviceFsdpMlp> {
        let rank = comm.rank();
        let world = comm.size();
        let device_buffers = uses_device_buffers(
            config.staging,
            DeviceBuffer::accepted_by(comm.as_ref()),
            comm.backend(),
            rank,
        )?;
        let mlp = DeviceMlp::from_cpu(device, model)?;
        let storage = mlp.dtype();
        let compute = config.param_dtype.unwrap_or(storage);
        let mixed_ok = compute == storage
            || (storage == DType::F32 && matches!(compute, DType::BF16 | DType::F16));
        if !mixed_ok {
            return Err(DeviceFsdpError::UnsupportedParamDType {
                rank,
                storage,
                param_dtype: compute,
            });
        }
        comm_of(rank, storage)?;
        comm_of(rank, compute)?;
        let mut layers = Vec::new();
        let mut shapes = Vec::new();
        for (index, layer) in mlp.into_layers().into_iter().enumerate() {
            match layer {
                DeviceLayer::Linear(linear) => {
                    shapes.push(LinearShape {
                        layer: index,
                        out_features: linear.out_features(),
                        in_features: linear.in_features(),
                        bias: linear.bias.is_some(),
                    });
                    layers.push(Layer::Linear { linear, group: 0 });
                }
                DeviceLayer::Relu => layers.push(Layer::Relu),
                _ => return Err(DeviceFsdpError::UnsupportedLayer { rank, index }),
            }
        }
        let plans = plan_groups(&shapes, config.layers_per_group, world, storage, rank)?;
        let mut groups = Vec::with_capacity(plans.len());
        for (index, layer) in layers.iter_mut().enumerate() {
            if let Layer::Linear { group, .. } = layer {
                *group = plans
                    .iter()
                    .position(|plan| plan.layers.contains(&index))
                    .unwrap_or(0);
            }
        }
        for plan in plans {
            groups.push(Group {
                plan,
                shard: placeholder(device, storage)?,
                grad: None,
                params: Params::Unsharded,
                full_grads: false,
                reducing: None,
            });
        }
        let first_layer = |g: usize| {
            layers
                .iter()
                .position(|l| matches!(l, Layer::Linear { group, .. } if *group == g))
                .unwrap_or(layers.len())
        };
        let spans: Vec<(usize, usize)> = (0..groups.len())
            .map(|g| {
                let start = if g == 0 { 0 } else { first_layer(g) };
                let end = if g + 1 < groups.len() {
                    first_layer(g + 1)
                } else {
                    layers.len()
                };
                (start, end)
            })
            .collect();
        let first_linear = first_layer(0);
        let mut model = DeviceFsdpMlp {
            device: device.clone(),
            comm,
            rank,
            world,
            config,
            storage,
            compute,
            device_buffers,
            layers,
            groups,
            spans,
            first_linear,
            slots: Vec::new(),
            inputs: Vec::new(),
            ones: None,
            sync_grads: true,
        };
        for g in 0..model.groups.len() {
            model.cut_shard(g)?;
            model.reshard(g)?;
            model.free_full_grads(g)?;
        }
        Ok(model)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether collectives run on device buffers (else through host copies).
    pub fn uses_device_buffers(&self) -> bool {
        self.device_buffers
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The parameter groups.
    pub fn groups(&self) -> Vec<GroupInfo> {
        self.groups
            .iter()
            .map(|g| GroupInfo {
                layers: g.plan.layers.clone(),
                params: g.plan.members.iter().map(|m| m.name.clone()).collect(),
                shard_numel: g.plan.per_rank,
            })
            .collect()
    }

    /// Bytes of unsharded parameters and gradients the Linear layers hold now (0 when every
    /// group is resharded and no unsynchronised gradient is kept).
    pub fn unsharded_bytes(&self) -> usize {
        self.linears()
            .map(|linear| {
                linear.weight.nbytes()
                    + linear.bias.as_ref().map_or(0, CudaTensor::nbytes)
                    + linear.grad_weight.nbytes()
                    + linear.grad_bias.as_ref().map_or(0, CudaTensor::nbytes)
            })
            .sum()
    }

    /// Bytes of this rank's shards and their reduced gradients.
    pub fn sharded_bytes(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.shard.nbytes() + g.grad.as_ref().map_or(0, CudaTensor::nbytes))
            .sum()
    }

    /// Turns gradient synchronisation on or off (FSDP's `set_requires_gradient_sync`, or
    /// DDP's `no_sync`): without it a backward keeps the unsharded gradients on the Linear
    /// layers, accumulating, and issues no reduce-scatter; the next backward with it adds its
    /// gradients and reduce-scatters the sum.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.sync_grads = sync;
    }

    fn linears(&self) -> impl Iterator<Item = &DeviceLinear> {
        self.layers.iter().filter_map(|layer| match layer {
            Layer::Linear { linear, .. } => Some(linear.as_ref()),
            Layer::Relu => None,
        })
    }

    /// The group's Linear layers, mutably, in order.
    fn group_linears(&mut self, g: usize) -> Vec<&mut DeviceLinear> {
        self.layers
            .iter_mut()
            .filter_map(|layer| match layer {
                Layer::Linear { linear, group } if *group == g => Some(linear.as_mut()),
                _ => None,
            })
            .collect()
    }

    /// Cuts this rank's shard out of the full parameters the Linear layers hold (at
    /// construction).
    fn cut_shard(&mut self, g: usize) -> DeviceFsdpResult<()> {
        let rank = self.rank;
        let ranges = self.groups[g].plan.shard_ranges(rank)?;
        let mut shard =
            CudaTensor::zeros(&self.device, &[self.groups[g].plan.per_rank], self.storage)?;
        {
            let linears = self.group_linears(g);
            let mut parts: Vec<&CudaTensor> = Vec::with_capacity(2 * linears.len());
            for linear in &linears {
                parts.push(&linear.weight);
                if let Some(bias) = &linear.bias {
                    parts.push(bias);
                }
            }
            copy_in_ranges(&mut shard, &parts, &ranges)?;
        }
        self.groups[g].shard = shard;
        self.groups[g].params = Params::Unsharded;
        Ok(())
    }

    /// Frees the group's gathered parameters (the placeholders are empty, so the memory goes
    /// back to CUDA's pool on the device's stream, after the kernels that read it).
    fn reshard(&mut self, g: usize) -> DeviceFsdpResult<()> {
        let device = self.device.clone();
        let compute = self.compute;
        for linear in self.group_linears(g) {
            linear.weight = placeholder(&device, compute)?;
            if linear.bias.is_some() {
                linear.bias = Some(placeholder(&device, compute)?);
            }
        }
        self.groups[g].params = Params::Sharded;
        Ok(())
    }

    /// Frees the group's unsharded gradients.
    fn free_full_grads(&mut self, g: usize) -> DeviceFsdpResult<()> {
        let device = self.device.clone();
        let storage = self.storage;
        for linear in self.group_linears(g) {
            linear.grad_weight = placeholder(&device, storage)?;
            if linear.grad_bias.is_some() {
                linear.grad_bias = Some(placeholder(&device, storage)?);
            }
        }
        self.groups[g].full_grads = false;
        Ok(())
    }

    /// Gives the group's Linear layers zeroed unsharded gradients, unless they hold some.
    fn ensure_full_grads(&mut self, g: usize) -> DeviceFsdpResult<()> {
        if self.groups[g].full_grads {
            return Ok(());
        }
        let device = self.device.clone();
        let storage = self.storage;
        for linear in self.group_linears(g) {
            let (out, inp) = (linear.out_features(), linear.in_features());
            linear.grad_weight = CudaTensor::zeros(&device, &[out, inp], storage)?;
            if linear.grad_bias.is_some() {
                linear.grad_bias = Some(CudaTensor::zeros(&device, &[1, out], storage)?);
            }
        }
        self.groups[g].full_grads = true;
        Ok(())
    }

    /// Starts a collective on `input` (a flat device tensor) into a new flat output of
    /// `out_numel` elements: device buffers in place, or host copies when staged. A staged
    /// input is copied to host memory before the call returns (the copy waits for the
    /// device's stream, so every kernel that wrote the input has finished).
    fn start(
        &self,
        op: &'static str,
        group: usize,
        input: CudaTensor,
        out_numel: usize,
        reduce: Option<ReduceOp>,
    ) -> DeviceFsdpResult<Work<BufferPair>> {
        let dtype = comm_of(self.rank, input.dtype())?;
        let (input, output) = if self.device_buffers {
            // The NCCL stream waits for the tensor stream's last write to each buffer (cudarc
            // events on the slices), so no synchronisation is needed here.
            let output = CudaTensor::zeros(&self.device, &[out_numel], input.dtype())?;
            let input = DeviceBuffer::from_slice(input.into_device_bytes(), dtype)
                .map_err(|source| self.comm_error(op, group, source))?;
            let output = DeviceBuffer::from_slice(output.into_device_bytes(), dtype)
                .map_err(|source| self.comm_error(op, group, source))?;
            (Buffer::Cuda(input), Buffer::Cuda(output))
        } else {
            let mut host = HostBuffer::zeros(dtype, input.numel());
            input.copy_to_host_bytes(host.as_bytes_mut())?;
            (Buffer::Host(host), Buffer::zeros(dtype, out_numel))
        };
        Ok(match reduce {
            None => self.comm.all_gather_async(input, output),
            Some(op) => self.comm.reduce_scatter_async(input, output, op),
        })
    }

    /// Waits for a collective started by [`start`](Self::start) and returns its output as a
    /// flat device tensor of `numel` elements of `dtype`. A device output becomes the tensor
    /// without a copy (the tensor stream's next use waits for NCCL's write through cudarc's
    /// events); a staged one is copied to the device.
    fn finish(
        &self,
        op: &'static str,
        group: usize,
        work: Work<BufferPair>,
        numel: usize,
        dtype: DType,
    ) -> DeviceFsdpResult<CudaTensor> {
        let pair = work
            .wait()
            .map_err(|source| self.comm_error(op, group, source))?;
        let output = pair.output;
        if output.len() != numel {
            return Err(DeviceFsdpError::CollectiveLength {
                rank: self.rank,
                op,
                group,
                expected: numel,
                actual: output.len(),
            });
        }
        if let Buffer::Cuda(buffer) = output {
            let bytes = buffer
                .into_slice()
                .map_err(|source| self.comm_error(op, group, source))?;
            return Ok(CudaTensor::from_device_bytes(
                &self.device,
                bytes,
                &[numel],
                dtype,
            )?);
        }
        let host = output
            .into_host()
            .map_err(|source| self.comm_error(op, group, source))?;
        let mut flat = CudaTensor::zeros(&self.device, &[numel], dtype)?;
        flat.copy_from_host_bytes(host.as_bytes())?;
        Ok(flat)
    }

    fn comm_error(
        &self,
        op: &'static str,
        group: usize,
        source: hypershard_collectives::Error,
    ) -> DeviceFsdpError {
        DeviceFsdpError::Comm {
            rank: self.rank,
            op,
            group,
            source,
        }
    }

    /// Issues the all-gather of group `g` unless it is gathered or being gathered: copy-in
    /// (the shard, cast to the compute dtype for mixed precision, into the all-gather input)
    /// and the collective, which runs while the caller goes on.
    fn issue_gather(&mut self, g: usize) -> DeviceFsdpResult<()> {
        if !matches!(self.groups[g].params, Params::Sharded) {
            return Ok(());
        }
        let shard = &self.groups[g].shard;
        let input = if self.compute == self.storage {
            shard.try_clone()?
        } else {
            shard.to_dtype(self.compute)?
        };
        let work = self.start(
            "all_gather",
            g,
            input,
            self.groups[g].plan.flat_numel(),
            None,
        )?;
        self.groups[g].params = Params::Gathering(work);
        Ok(())
    }

    /// Makes group `g`'s parameters the gathered ones: waits for its all-gather (issuing it
    /// first if needed) and copies every rank's range of every parameter out of the flat
    /// output into fresh parameter tensors (one launch).
    fn gather(&mut self, g: usize) -> DeviceFsdpResult<()> {
        self.issue_gather(g)?;
        let params = std::mem::replace(&mut self.groups[g].params, Params::Unsharded);
        let Params::Gathering(work) = params else {
            self.groups[g].params = params;
            return Ok(());
        };
        let result = self.unshard_from(g, work);
        if result.is_err() {
            // The layers still hold the placeholders: the group stays sharded, so a later
            // pass gathers it again instead of computing with empty parameters.
            self.groups[g].params = Params::Sharded;
        }
        result
    }

    /// The second half of [`gather`](Self::gather): waits for `work` and copies the
    /// parameters out of its output.
    fn unshard_from(&mut self, g: usize, work: Work<BufferPair>) -> DeviceFsdpResult<()> {
        let numel = self.groups[g].plan.flat_numel();
        let flat = self.finish("all_gather", g, work, numel, self.compute)?;
        let ranges = self.groups[g].plan.unshard_ranges()?;
        let device = self.device.clone();
        let compute = self.compute;
        let mut linears = self.group_linears(g);
        let mut fresh: Vec<CudaTensor> = Vec::with_capacity(2 * linears.len());
        for linear in &linears {
            let (out, inp) = (linear.out_features(), linear.in_features());
            fresh.push(CudaTensor::zeros(&device, &[out, inp], compute)?);
            if linear.bias.is_some() {
                fresh.push(CudaTensor::zeros(&device, &[1, out], compute)?);
            }
        }
        {
            let mut parts: Vec<&mut CudaTensor> = fresh.iter_mut().collect();
            copy_out_ranges(&flat, &mut parts, &ranges)?;
        }
        let mut fresh = fresh.into_iter();
        for linear in &mut linears {
            if let Some(weight) = fresh.next() {
                linear.weight = weight;
            }
            if linear.bias.is_some() {
                linear.bias = fresh.next();
            }
        }
        Ok(())
    }

    /// After group `g`'s backward (with gradient sync): copy-in of its unsharded gradients
    /// into a zero-padded flat buffer (the padding must be zero: it is reduced into the
    /// shard's padding, which SGD then leaves at zero), the unsharded gradients freed, and the
    /// reduce-scatter (average) left in flight while the earlier groups' backward runs.
    fn reduce_grads(&mut self, g: usize) -> DeviceFsdpResult<()> {
        let numel = self.groups[g].plan.flat_numel();
        let per_rank = self.groups[g].plan.per_rank;
        let ranges = self.groups[g].plan.unshard_ranges()?;
        let mut flat = CudaTensor::zeros(&self.device, &[numel], self.storage)?;
        {
            let linears = self.group_linears(g);
            let mut parts: Vec<&CudaTensor> = Vec::with_capacity(2 * linears.len());
            for linear in &linears {
                parts.push(&linear.grad_weight);
                if let Some(grad_bias) = &linear.grad_bias {
                    parts.push(grad_bias);
                }
            }
            copy_in_ranges(&mut flat, &parts, &ranges)?;
        }
        self.free_full_grads(g)?;
        let work = self.start("reduce_scatter", g, flat, per_rank, Some(ReduceOp::Avg))?;
        self.groups[g].reducing = Some(work);
        Ok(())
    }

    /// The groups' state as the schedule sees it.
    fn held(&self) -> Vec<Held> {
        self.groups
            .iter()
            .map(|g| match g.params {
                Params::Unsharded => Held::Unsharded,
                Params::Sharded | Params::Gathering(_) => Held::Sharded,
            })
            .collect()
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            prefetch: self.config.prefetch,
            reshard_after_forward: self.config.reshard_after_forward,
        }
    }

    /// Runs one communication or memory action of the schedule (the computations are run by
    /// the passes themselves).
    fn run(&mut self, action: Action) -> DeviceFsdpResult<()> {
        match action {
            Action::Gather(g) => self.issue_gather(g),
            Action::Unshard(g) => self.gather(g),
            Action::Reduce(g) => self.reduce_grads(g),
            Action::Reshard(g) => self.reshard(g),
            // Not reached: forward and backward run their own computations.
            Action::Compute(_) => Ok(()),
        }
    }

    /// Group `g`'s layers in the forward pass: from its first Linear (from the model's start
    /// for group 0) to the next group's first Linear, ReLUs included.
    fn forward_group(&mut self, g: usize) -> DeviceFsdpResult<()> {
        let (start, end) = self.spans[g];
        for index in start..end {
            let slot = self.slots.len() - 1;
            self.inputs.push(slot);
            match &self.layers[index] {
                Layer::Linear { linear, .. } => {
                    let ones = self
                        .ones
                        .as_ref()
                        .ok_or(DeviceFsdpError::BackwardBeforeForward { rank: self.rank })?;
                    let y = linear.forward(&self.slots[slot], ones)?;
                    self.slots.push(y);
                }
                Layer::Relu => self.slots[slot].relu_()?,
            }
        }
        Ok(())
    }

    /// Group `g`'s layers in the backward pass, in reverse, accumulating their unsharded
    /// gradients (zeroed first unless kept from a backward without sync). Layers before the
    /// model's first Linear need no backward; the first Linear computes no input gradient.
    fn backward_group(&mut self, g: usize, grad: &mut CudaTensor) -> DeviceFsdpResult<()> {
        self.ensure_full_grads(g)?;
        let (start, end) = self.spans[g];
        let first_linear = self.first_linear;
        for index in (start.max(first_linear)..end).rev() {
            let input = &self.slots[self.inputs[index]];
            match &mut self.layers[index] {
                Layer::Relu => grad.relu_grad_(input)?,
                Layer::Linear { linear, .. } => {
                    let ones = self
                        .ones
                        .as_ref()
                        .ok_or(DeviceFsdpError::BackwardBeforeForward { rank: self.rank })?;
                    if let Some(dx) = linear.backward(input, grad, ones, index > first_linear)? {
                        *grad = dx;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits for every reduce-scatter in flight and accumulates its output into the group's
    /// reduced gradient.
    fn finish_reductions(&mut self) -> DeviceFsdpResult<()> {
        for g in 0..self.groups.len() {
            let Some(work) = self.groups[g].reducing.take() else {
                continue;
            };
            let per_rank = self.groups[g].plan.per_rank;
            let reduced = self.finish("reduce_scatter", g, work, per_rank, self.storage)?;
            match &mut self.groups[g].grad {
                Some(grad) => grad.add_(&reduced)?,
                slot @ None => *slot = Some(reduced),
            }
        }
        Ok(())
    }

    fn bad_tensor(
        &self,
        op: &'static str,
        role: &'static str,
        t: &CudaTensor,
        expected: String,
        expected_dtype: DType,
    ) -> DeviceFsdpError {
        DeviceFsdpError::BadTensor {
            rank: self.rank,
            op,
            role,
            actual: t.shape().to_vec(),
            dtype: t.dtype(),
            expected,
            expected_dtype,
        }
    }

    /// The first Linear's input width.
    fn in_width(&self) -> usize {
        self.linears().next().map_or(0, DeviceLinear::in_features)
    }

    /// The forward pass for `input: [rows, in]` (in the parameters' dtype or the compute
    /// dtype; it is cast to the compute dtype): each group is gathered before its layers run
    /// (the next group's all-gather issued first, with prefetch) and freed after them (with
    /// `reshard_after_forward`, except the last group). Returns the output, in the compute
    /// dtype.
    pub fn forward(&mut self, input: &CudaTensor) -> DeviceFsdpResult<&CudaTensor> {
        const OP: &str = "DeviceFsdpMlp::forward";
        let width = self.in_width();
        let dtype_ok = input.dtype() == self.compute || input.dtype() == self.storage;
        let rows = match input.shape() {
            &[rows, w] if w == width && dtype_ok => rows,
            _ => {
                return Err(self.bad_tensor(
                    OP,
                    "input",
                    input,
                    format!("[rows, {width}]"),
                    self.compute,
                ));
            }
        };
        if self.ones.as_ref().is_none_or(|o| o.shape() != [rows, 1]) {
            let ones = Tensor::ones(&[rows, 1], self.compute)?;
            self.ones = Some(CudaTensor::from_host(&self.device, &ones)?);
        }
        self.slots.clear();
        self.inputs.clear();
        self.slots.push(if input.dtype() == self.compute {
            input.try_clone()?
        } else {
            input.to_dtype(self.compute)?
        });
        let mut held = self.held();
        for action in self.schedule().forward(&mut held) {
            match action {
                Action::Compute(g) => self.forward_group(g)?,
                other => self.run(other)?,
            }
        }
        let last = self.slots.len() - 1;
        Ok(&self.slots[last])
    }

    /// The backward pass from `grad` (the gradient of the last forward's output, in the
    /// compute dtype): each group is gathered again if it was freed (the previous group's
    /// all-gather issued first, with prefetch), its layers' gradients are computed in
    /// unsharded form, then (with gradient sync) copied into a flat buffer and
    /// reduce-scattered while the earlier groups' backward runs; the reduced gradients are
    /// accumulated into the shards' gradients before this returns.
    pub fn backward(&mut self, mut grad: CudaTensor) -> DeviceFsdpResult<()> {
        const OP: &str = "DeviceFsdpMlp::backward";
        if self.inputs.len() != self.layers.len() || self.slots.is_empty() {
            return Err(DeviceFsdpError::BackwardBeforeForward { rank: self.rank });
        }
        let last = &self.slots[self.slots.len() - 1];
        if grad.shape() != last.shape() || grad.dtype() != last.dtype() {
            return Err(self.bad_tensor(
                OP,
                "gradient",
                &grad,
                format!("{:?}", last.shape()),
                last.dtype(),
            ));
        }
        let mut held = self.held();
        for action in self.schedule().backward(&mut held, self.sync_grads) {
            match action {
                Action::Compute(g) => self.backward_group(g, &mut grad)?,
                other => self.run(other)?,
            }
        }
        self.slots.clear();
        self.inputs.clear();
        self.finish_reductions()
    }

    /// Drops the reduced gradients (and unsynchronised unsharded ones).
    pub fn zero_grad(&mut self) -> DeviceFsdpResult<()> {
        for g in 0..self.groups.len() {
            self.groups[g].grad = None;
            if self.groups[g].full_grads {
                self.free_full_grads(g)?;
            }
        }
        Ok(())
    }

    /// Plain SGD on the shards: `shard −= lr · reduced gradient`, one launch per group (the
    /// padding stays zero: its gradient is zero).
    pub fn sgd_step(&mut self, lr: f64) -> DeviceFsdpResult<()> {
        for (g, group) in self.groups.iter().enumerate() {
            if group.grad.is_none() {
                return Err(DeviceFsdpError::NoGradient {
                    rank: self.rank,
                    group: g,
                });
            }
        }
        for group in &mut self.groups {
            if let Some(grad) = &group.grad {
                group.shard.axpy_(-lr, grad)?;
            }
        }
        Ok(())
    }

    /// One training step: zero the gradients, forward, MSE loss against `target` (cast to
    /// the compute dtype if it is in the parameters' dtype), backward, SGD with `lr`. Returns
    /// this rank's loss.
    pub fn train_step(
        &mut self,
        input: &CudaTensor,
        target: &CudaTensor,
        lr: f64,
    ) -> DeviceFsdpResult<f64> {
        self.zero_grad()?;
        let loss = self.forward_loss(input, target)?;
        self.backward(loss.1)?;
        self.sgd_step(lr)?;
        Ok(loss.0)
    }

    /// Forward and MSE loss, for gradient accumulation: returns the loss and its gradient
    /// (pass it to [`backward`](Self::backward)).
    pub fn forward_loss(
        &mut self,
        input: &CudaTensor,
        target: &CudaTensor,
    ) -> DeviceFsdpResult<(f64, CudaTensor)> {
        const OP: &str = "DeviceFsdpMlp::forward_loss";
        let compute = self.compute;
        let storage = self.storage;
        let rank = self.rank;
        let output = self.forward(input)?;
        if target.shape() != output.shape()
            || (target.dtype() != compute && target.dtype() != storage)
        {
            return Err(DeviceFsdpError::BadTensor {
                rank,
                op: OP,
                role: "target",
                actual: target.shape().to_vec(),
                dtype: target.dtype(),
                expected: format!("{:?}", output.shape()),
                expected_dtype: compute,
            });
        }
        let loss = if target.dtype() == compute {
            mse_loss(output, target)?
        } else {
            mse_loss(output, &target.to_dtype(compute)?)?
        };
        Ok((loss.loss, loss.grad))
    }

    /// The full model on the host (collective: every rank calls it): each group's shard is
    /// all-gathered in the parameters' dtype and copied out, and with `grads` so is its
    /// reduced gradient (as each parameter's `grad`; none before a synchronised backward).
    /// The result is a `Sequential` with the CPU model's layers and names.
    pub fn full_model(&mut self, grads: bool) -> DeviceFsdpResult<Sequential> {
        let mut full: Vec<Vec<Tensor>> = Vec::with_capacity(self.groups.len());
        let mut full_grads: Vec<Option<Vec<Tensor>>> = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            let shard = self.groups[g].shard.try_clone()?;
            full.push(self.gather_to_host(g, shard)?);
            let grad = match (&self.groups[g].grad, grads) {
                (Some(grad), true) => Some(grad.try_clone()?),
                _ => None,
            };
            full_grads.push(match grad {
                Some(grad) => Some(self.gather_to_host(g, grad)?),
                None => None,
            });
        }
        let mut layers: Vec<Box<dyn Module>> = Vec::with_capacity(self.layers.len());
        let mut per_group: Vec<usize> = vec![0; self.groups.len()];
        for layer in &self.layers {
            match layer {
                Layer::Relu => layers.push(Box::new(Relu::new())),
                Layer::Linear { linear, group } => {
                    let g = *group;
                    let at = per_group[g];
                    let has_bias = linear.bias.is_some();
                    per_group[g] += if has_bias { 2 } else { 1 };
                    let weight = full[g][at].clone();
                    let bias = has_bias.then(|| full[g][at + 1].clone());
                    let mut cpu = Linear::from_tensors(weight, bias)?;
                    if let Some(grads) = &full_grads[g] {
                        cpu.weight.grad = Some(grads[at].clone());
                        if let Some(param) = &mut cpu.bias {
                            param.grad = Some(grads[at + 1].clone());
                        }
                    }
                    layers.push(Box::new(cpu));
                }
            }
        }
        Ok(Sequential::new(layers))
    }

    /// All-gathers `block` (a copy of this rank's block of group `g`, in the parameters'
    /// dtype) and returns every member unsharded, on the host, in CPU shapes.
    fn gather_to_host(&self, g: usize, block: CudaTensor) -> DeviceFsdpResult<Vec<Tensor>> {
        let plan = &self.groups[g].plan;
        let dtype = block.dtype();
        let work = self.start("all_gather", g, block, plan.flat_numel(), None)?;
        let flat = self.finish("all_gather", g, work, plan.flat_numel(), dtype)?;
        let mut members = Vec::with_capacity(plan.members.len());
        for member in &plan.members {
            members.push(CudaTensor::zeros(
                &self.device,
                &member.layout.shape,
                dtype,
            )?);
        }
        {
            let mut parts: Vec<&mut CudaTensor> = members.iter_mut().collect();
            copy_out_ranges(&flat, &mut parts, &plan.unshard_ranges()?)?;
        }
        members
            .iter()
            .map(|m| m.to_host().map_err(DeviceFsdpError::from))
            .collect()
    }
}
