//! What `fully_shard` is configured with: the mesh, resharding, policies and special params.

use std::collections::BTreeSet;
use std::sync::Arc;

use hypershard_dtensor::ProcessMesh;
use hypershard_nn::Parameter;
use hypershard_tensor::{DType, Device};

use crate::mesh::DataParallelMesh;

/// What a unit does with its unsharded parameters after forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReshardAfterForward {
    /// Free them (FSDP2's `True`, ZeRO-3): backward all-gathers them again.
    #[default]
    Reshard,
    /// Keep them until after backward (FSDP2's `False`, ZeRO-2): no all-gather in backward.
    Keep,
    /// Reshard to a smaller group of this many ranks (FSDP2's `int`, e.g. within a host):
    /// backward all-gathers over that group only. Must divide the shard group size; the size
    /// of the shard group itself means [`Reshard`](Self::Reshard), 1 means
    /// [`Keep`](Self::Keep).
    ToGroupOf(usize),
}

/// How gradients are combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradReduceOp {
    /// The mean over every data-parallel rank (torch's default).
    #[default]
    Avg,
    /// The sum over every data-parallel rank.
    Sum,
}

/// Mixed precision, as FSDP2's `MixedPrecisionPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MixedPrecisionPolicy {
    /// The dtype of the unsharded parameters (and so of compute); `None` keeps the original.
    pub param_dtype: Option<DType>,
    /// The dtype gradients are reduced in; `None` uses `param_dtype` (torch's rule).
    pub reduce_dtype: Option<DType>,
    /// The dtype the unit's output is cast to; `None` leaves it.
    pub output_dtype: Option<DType>,
    /// Whether floating inputs are cast to `param_dtype` before the wrapped forward.
    pub cast_forward_inputs: bool,
    /// Accumulate reduced gradients into an fp32 `main_grad` kept by the unit instead of
    /// `Parameter::grad` (see [`FsdpModule::main_grad`](crate::FsdpModule::main_grad)).
    pub fp32_main_grad: bool,
}

/// CPU offload, as FSDP2's `CPUOffloadPolicy`. Every tensor of this build already lives in
/// host memory, so the policy is accepted and changes nothing (see `docs/fsdp.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuOffloadPolicy {
    /// Whether host memory would be pinned for device copies.
    pub pin_memory: bool,
}

/// Communication fusion: how parameters are packed into collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommFusionPolicy {
    /// One collective per bucket (true) or one per parameter (false).
    pub enabled: bool,
    /// Unsharded parameters are views into one flat storage per bucket (true) or each
    /// parameter gets its own storage (false).
    pub zero_copy: bool,
    /// The most bytes (per rank, padded) one bucket may hold; a parameter larger than this
    /// gets a bucket of its own.
    pub bucket_bytes: usize,
}

impl Default for CommFusionPolicy {
    fn default() -> Self {
        CommFusionPolicy {
            enabled: true,
            zero_copy: false,
            bucket_bytes: 1 << 30,
        }
    }
}

/// Chooses the dim a parameter is sharded along (FSDP2's `shard_placement_fn`); `None` means
/// dim 0. Called with the parameter's name relative to the wrapped module.
pub type ShardPlacementFn = Arc<dyn Fn(&str, &Parameter) -> Option<usize> + Send + Sync>;

/// The configuration of one `fully_shard` call.
#[derive(Clone)]
pub struct FullyShardConfig {
    /// The data-parallel mesh and its communicators.
    pub mesh: Arc<DataParallelMesh>,
    /// What happens after forward.
    pub reshard_after_forward: ReshardAfterForward,
    /// Per-parameter shard dim.
    pub shard_placement_fn: Option<ShardPlacementFn>,
    /// Mixed precision.
    pub mp_policy: MixedPrecisionPolicy,
    /// CPU offload (a documented no-op on host-only builds).
    pub offload_policy: Option<CpuOffloadPolicy>,
    /// Communication fusion.
    pub comm_fusion: CommFusionPolicy,
    /// Parameters fully_shard leaves alone. An entry names the parameter with that dotted name
    /// relative to the wrapped module, or every parameter whose name ends in `.entry`.
    pub ignored_params: BTreeSet<String>,
    /// Parameters kept whole on every rank, with gradients all-reduced (DDP-style); named as
    /// in `ignored_params`.
    pub replicate_params: BTreeSet<String>,
    /// How gradients are combined.
    pub reduce_op: GradReduceOp,
    /// Tensor parallelism under this data-parallel mesh (2-d: dp × tp), or `None`.
    pub tensor_parallel: Option<TensorParallelConfig>,
    /// The unit's device: where deferred (shape-only) parameters are materialised and where
    /// every other managed parameter must already be. `None` takes the device of the first
    /// managed parameter that has data (the host when all are deferred). Shards, unsharded
    /// parameters and gradients stay there; collectives of the host backends are staged
    /// through host memory, one copy each way per bucket.
    pub device: Option<Device>,
}

impl FullyShardConfig {
    /// The defaults over `mesh`: reshard after forward, dim-0 shards, no mixed precision,
    /// fused collectives, average reduction.
    pub fn new(mesh: Arc<DataParallelMesh>) -> Self {
        FullyShardConfig {
            mesh,
            reshard_after_forward: ReshardAfterForward::default(),
            shard_placement_fn: None,
            mp_policy: MixedPrecisionPolicy::default(),
            offload_policy: None,
            comm_fusion: CommFusionPolicy::default(),
            ignored_params: BTreeSet::new(),
            replicate_params: BTreeSet::new(),
            reduce_op: GradReduceOp::default(),
            tensor_parallel: None,
            device: None,
        }
    }
}

impl std::fmt::Debug for FullyShardConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardConfig")
            .field("mesh", &self.mesh)
            .field("reshard_after_forward", &self.reshard_after_forward)
            .field("shard_placement_fn", &self.shard_placement_fn.is_some())
            .field("mp_policy", &self.mp_policy)
            .field("offload_policy", &self.offload_policy)
            .field("comm_fusion", &self.comm_fusion)
            .field("ignored_params", &self.ignored_params)
            .field("replicate_params", &self.replicate_params)
            .field("reduce_op", &self.reduce_op)
            .field("tensor_parallel", &self.tensor_parallel)
            .field("device", &self.device)
            .finish()
    }
}

/// What `fully_shard` needs to know about tensor parallelism: the world mesh holding both
/// the data-parallel dims (those of [`FullyShardConfig::mesh`](crate::FullyShardConfig)) and
/// the TP dim.
#[derive(Clone)]
pub struct TensorParallelConfig {
    /// The mesh over every rank, e.g. `[dp, tp]`.
    pub world: ProcessMesh,
    /// The name of its TP dim.
    pub tp_dim: String,
    /// How the gradients of TP-replicated parameters are combined over the TP group after
    /// the data-parallel reduction: `Avg` (the default) when every TP rank computed the
    /// whole gradient from the same data, as in plain TP, where it keeps the replicas
    /// identical; `Sum` when each TP rank holds a part of it (sequence parallelism).
    pub replicated_grad_op: GradReduceOp,
}

impl TensorParallelConfig {
    /// TP over dim `tp_dim` of `world`, averaging replicated gradients.
    pub fn new(world: ProcessMesh, tp_dim: &str) -> Self {
        TensorParallelConfig {
            world,
            tp_dim: tp_dim.to_string(),
            replicated_grad_op: GradReduceOp::Avg,
        }
    }
}

impl std::fmt::Debug for TensorParallelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallelConfig")
            .field("world", &self.world.shape())
            .field("tp_dim", &self.tp_dim)
            .field("replicated_grad_op", &self.replicated_grad_op)
            .finish()
    }
}
