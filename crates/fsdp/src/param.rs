//! `FsdpParam`: one parameter's shard, its unsharded form while in use, and its state.

use hypershard_mesh::Placement;
use hypershard_tensor::{DType, Tensor};

use crate::error::{FsdpError, Result};
use crate::layout::ShardLayout;
use crate::state::ShardedState;

/// How a parameter is distributed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParamRole {
    /// Sharded over the shard group (FSDP / HSDP).
    Sharded,
    /// Whole on every rank, gradients all-reduced (DDP-style `replicate_params`).
    Replicated,
}

/// One managed parameter.
#[derive(Debug)]
pub(crate) struct FsdpParam {
    /// The name relative to the wrapped module (its member's module, for a group).
    pub name: String,
    /// Which module of the unit holds it: 0 for a unit of one module, the position in the
    /// list for `fully_shard_group`.
    pub member: usize,
    pub role: ParamRole,
    /// The layout over the shard group (a one-shard layout for replicated parameters).
    pub layout: ShardLayout,
    /// The layout over the post-forward group, with `reshard_after_forward = int`.
    pub post_layout: Option<ShardLayout>,
    pub orig_dtype: DType,
    pub param_dtype: DType,
    pub reduce_dtype: DType,
    pub requires_grad: bool,
    /// The local shard, in the original dtype; what the module holds while sharded.
    pub sharded: Tensor,
    /// The sharded gradient while the module shows the unsharded parameter.
    pub sharded_grad: Option<Tensor>,
    /// The unsharded parameter while `Unsharded`.
    pub unsharded: Option<Tensor>,
    /// The padded post-forward slot (flat, `param_dtype`, on the unit's device) while
    /// `ShardedPostForward`.
    pub post_forward: Option<Tensor>,
    /// Unsharded gradients accumulated without synchronisation, while resharded.
    pub unsharded_grad_accum: Option<Tensor>,
    /// The fp32 main gradient, with `fp32_main_grad`.
    pub main_grad: Option<Tensor>,
    /// Whether the module currently holds the unsharded tensor.
    pub installed: bool,
    /// With tensor parallelism: how the (unsharded, TP-local) parameter sits in the global
    /// one. `Replicate` for parameters outside tensor-parallel layers.
    pub tp: Option<TpInfo>,
    pub state: ShardedState,
}

impl FsdpParam {
    /// Fails unless the parameter is in one of `expected`.
    pub fn assert_state(
        &self,
        unit: &str,
        op: &'static str,
        expected: &'static [ShardedState],
    ) -> Result<()> {
        if expected.contains(&self.state) {
            Ok(())
        } else {
            Err(FsdpError::InvalidState {
                unit: unit.to_string(),
                param: self.name.clone(),
                op,
                expected,
                actual: self.state,
            })
        }
    }
}

/// A parameter's place over the TP mesh.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TpInfo {
    pub placement: Placement,
    /// The global shape (over TP); the FSDP layout's shape is this rank's TP-local shape.
    pub global_shape: Vec<usize>,
}

impl TpInfo {
    pub fn is_replicated(&self) -> bool {
        self.placement == Placement::Replicate
    }
}

/// What a caller can see of a managed parameter (`PartialEq` only: a TP placement may be
/// `Partial` with a float factor).
#[derive(Debug, Clone, PartialEq)]
pub struct FsdpParamInfo {
    /// The name relative to the wrapped module.
    pub name: String,
    /// The unsharded shape: the global one, over every data-parallel and TP rank (what the
    /// state dicts use).
    pub global_shape: Vec<usize>,
    /// With tensor parallelism, the parameter's placement over the TP mesh (`Replicate`
    /// outside tensor-parallel layers); the data-parallel shards cut this rank's TP-local
    /// piece.
    pub tp_placement: Option<Placement>,
    /// The local shard's shape.
    pub local_shape: Vec<usize>,
    /// The dim sharded along (0 for replicated parameters).
    pub shard_dim: usize,
    /// Whether the parameter is kept whole and all-reduced (`replicate_params`).
    pub replicated: bool,
    /// The current state.
    pub state: ShardedState,
}
