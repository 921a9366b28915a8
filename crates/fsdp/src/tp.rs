//! Tensor parallelism under `fully_shard` (2-d: data parallel × tensor parallel).
//!
//! [`TpLinear`] is a linear layer whose parameters are DTensors over a 1-d TP mesh: the
//! column-parallel style holds `weight` and `bias` as `Shard(0)` (rows of the output), the
//! row-parallel style holds `weight` as `Shard(1)` (columns of the input) and `bias` as
//! `Replicate`, and its output is `Partial(Sum)` until an all-reduce over the TP group makes it
//! whole. Chained column → row (the Megatron MLP), the activation between them stays sharded
//! on its feature dim and the block needs one all-reduce forward and one backward.
//!
//! `fully_shard` finds the `TpLinear` layers of the module it wraps and treats each local
//! shard as the parameter to shard again over the data-parallel group; with
//! [`TensorParallelConfig`](crate::TensorParallelConfig) it also all-reduces the gradients of TP-replicated parameters over
//! the TP group. See `docs/fsdp.md`, "TP + FSDP".

use std::collections::BTreeMap;

use hypershard_dtensor::{DTensor, Placement, ProcessMesh, ReduceOp};
use hypershard_mesh::shard_span;
use hypershard_nn::{Linear, Module, ParamVisitor, ParamVisitorMut, Parameter, join_name};
use hypershard_tensor::Tensor;

use crate::error::{FsdpError, Result};

/// Which way a [`TpLinear`] cuts its weight over the TP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TpStyle {
    /// `weight [out, in]` and `bias [out]` are `Shard(0)`: each rank computes its slice of the
    /// output features from the whole (replicated) input. Backward all-reduces the input
    /// gradient, which each rank holds only a part of.
    Column,
    /// `weight [out, in]` is `Shard(1)`: each rank multiplies its slice of the input features
    /// (the output of a column-parallel layer) and the partial outputs are all-reduced, after
    /// which the replicated `bias [out]` is added.
    Row,
}

/// How one parameter of a [`TpLinear`] is laid out over the TP mesh.
#[derive(Debug, Clone, PartialEq)]
pub struct TpParamLayout {
    /// The parameter's name relative to the layer (`weight`, `bias`).
    pub name: String,
    /// Its placement over the 1-d TP mesh: `Shard(d)` or `Replicate`.
    pub placement: Placement,
    /// Its global (unsharded over TP) shape.
    pub global_shape: Vec<usize>,
}

/// A column- or row-parallel linear layer over a 1-d TP [`ProcessMesh`] (see the module
/// docs). Its parameters are the local shards (`torch.chunk` over the TP ranks, uneven sizes
/// allowed), so nn's optimizers and `fully_shard` see ordinary tensors; their DTensor view is
/// [`dtensors`](TpLinear::dtensors).
pub struct TpLinear {
    style: TpStyle,
    mesh: ProcessMesh,
    /// The local layer: column style `[out/tp, in]` with the bias slice; row style
    /// `[out, in/tp]` without bias (the bias is added after the all-reduce).
    linear: Linear,
    /// The row style's replicated bias.
    bias: Option<Parameter>,
    in_features: usize,
    out_features: usize,
}

fn check_tp_mesh(mesh: &ProcessMesh) -> Result<()> {
    if mesh.ndim() != 1 {
        return Err(FsdpError::TpMeshDims { ndim: mesh.ndim() });
    }
    Ok(())
}

/// All-reduces (sums) `local` over the 1-d `mesh`: a `Partial(Sum)` DTensor made `Replicate`.
fn all_reduce_sum(local: Tensor, mesh: &ProcessMesh) -> hypershard_nn::Result<Tensor> {
    let shape = local.shape().to_vec();
    let reduced = DTensor::from_local(
        local,
        mesh,
        &[Placement::Partial(ReduceOp::Sum)],
        Some(&shape),
    )
    .and_then(|partial| partial.into_redistribute(&[Placement::Replicate]))
    .map_err(|error| hypershard_nn::Error::Foreign {
        op: "TpLinear all-reduce",
        source: Box::new(error),
    })?;
    Ok(reduced.into_local())
}

impl TpLinear {
    /// This rank's column-parallel slice of `full` (a whole `Linear`, the same on every TP
    /// rank): rows `torch.chunk(out, tp)[rank]` of the weight and bias.
    pub fn column(full: &Linear, mesh: &ProcessMesh) -> Result<Self> {
        check_tp_mesh(mesh)?;
        let (tp, rank) = (mesh.shape()[0], mesh.coordinate()[0]);
        let span = shard_span(full.out_features(), tp, rank)?;
        let weight = full
            .weight
            .data()?
            .narrow(0, span.offset, span.len)?
            .deep_copy()?;
        let bias = match &full.bias {
            Some(b) => Some(b.data()?.narrow(0, span.offset, span.len)?.deep_copy()?),
            None => None,
        };
        Ok(TpLinear {
            style: TpStyle::Column,
            mesh: mesh.clone(),
            linear: Linear::from_tensors(weight, bias)?,
            bias: None,
            in_features: full.in_features(),
            out_features: full.out_features(),
        })
    }

    /// This rank's row-parallel slice of `full`: columns `torch.chunk(in, tp)[rank]` of the
    /// weight; the bias is kept whole (replicated).
    pub fn row(full: &Linear, mesh: &ProcessMesh) -> Result<Self> {
        check_tp_mesh(mesh)?;
        let (tp, rank) = (mesh.shape()[0], mesh.coordinate()[0]);
        let span = shard_span(full.in_features(), tp, rank)?;
        let weight = full
            .weight
            .data()?
            .narrow(1, span.offset, span.len)?
            .contiguous()?
            .deep_copy()?;
        let bias = match &full.bias {
            Some(b) => Some(Parameter::new("bias", b.data()?.deep_copy()?)),
            None => None,
        };
        Ok(TpLinear {
            style: TpStyle::Row,
            mesh: mesh.clone(),
            linear: Linear::from_tensors(weight, None)?,
            bias,
            in_features: full.in_features(),
            out_features: full.out_features(),
        })
    }

    /// The style.
    pub fn style(&self) -> TpStyle {
        self.style
    }

    /// The TP mesh.
    pub fn mesh(&self) -> &ProcessMesh {
        &self.mesh
    }

    /// The global input and output sizes.
    pub fn features(&self) -> (usize, usize) {
        (self.in_features, self.out_features)
    }

    /// How each parameter is laid out over the TP mesh, in visiting order.
    pub fn param_layouts(&self) -> Vec<TpParamLayout> {
        let weight = TpParamLayout {
            name: "weight".to_string(),
            placement: match self.style {
                TpStyle::Column => Placement::Shard(0),
                TpStyle::Row => Placement::Shard(1),
            },
            global_shape: vec![self.out_features, self.in_features],
        };
        let has_bias = self.linear.bias.is_some() || self.bias.is_some();
        let bias = has_bias.then(|| TpParamLayout {
            name: "bias".to_string(),
            placement: match self.style {
                TpStyle::Column => Placement::Shard(0),
                TpStyle::Row => Placement::Replicate,
            },
            global_shape: vec![self.out_features],
        });
        std::iter::once(weight).chain(bias).collect()
    }

    /// Each parameter's current value as a DTensor over the TP mesh (the local tensors share
    /// storage with the parameters). While `fully_shard` holds the layer resharded, the
    /// parameters are data-parallel shards and this fails with a shape error.
    pub fn dtensors(&self) -> Result<BTreeMap<String, DTensor>> {
        let mut locals = BTreeMap::new();
        self.visit_params("", &mut |name, p| {
            locals.insert(name.to_string(), p.data()?.clone());
            Ok(())
        })?;
        let mut out = BTreeMap::new();
        for layout in self.param_layouts() {
            let Some(local) = locals.remove(&layout.name) else {
                continue;
            };
            let dtensor = tp_dtensor(local, &self.mesh, layout.placement, &layout.global_shape)?;
            out.insert(layout.name, dtensor);
        }
        Ok(out)
    }
}

/// `local` as a DTensor over the 1-d `mesh`, after checking it is this rank's
/// `torch.chunk` piece of `global`.
fn tp_dtensor(
    local: Tensor,
    mesh: &ProcessMesh,
    placement: Placement,
    global: &[usize],
) -> Result<DTensor> {
    let expected = tp_local_shape(global, placement, mesh.shape()[0], mesh.coordinate()[0])?;
    if local.shape() != expected.as_slice() {
        return Err(FsdpError::StateDictShape {
            name: "TpLinear parameter".to_string(),
            expected: global.to_vec(),
            local: expected,
            actual: local.shape().to_vec(),
        });
    }
    Ok(DTensor::from_local(
        local,
        mesh,
        &[placement],
        Some(global),
    )?)
}

/// The shape TP rank `rank` of `tp` holds of a parameter of `global` shape placed `placement`.
pub(crate) fn tp_local_shape(
    global: &[usize],
    placement: Placement,
    tp: usize,
    rank: usize,
) -> Result<Vec<usize>> {
    let mut shape = global.to_vec();
    if let Placement::Shard(dim) = placement
        && dim < shape.len()
    {
        shape[dim] = shard_span(global[dim], tp, rank)?.len;
    }
    Ok(shape)
}

impl Module for TpLinear {
    fn kind(&self) -> &'static str {
        match self.style {
            TpStyle::Column => "ColumnParallelLinear",
            TpStyle::Row => "RowParallelLinear",
        }
    }

    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        match self.style {
            TpStyle::Column => self.linear.forward(input),
            TpStyle::Row => {
                let partial = self.linear.forward(input)?;
                let full = all_reduce_sum(partial, &self.mesh)?;
                match &self.bias {
                    Some(bias) => full.add(bias.data()?).map_err(Into::into),
                    None => Ok(full),
                }
            }
        }
    }

    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        match self.style {
            TpStyle::Column => {
                // Each rank's input gradient covers only its output features: sum them.
                let partial = self.linear.backward(grad_output)?;
                all_reduce_sum(partial, &self.mesh)
            }
            TpStyle::Row => {
                if let Some(bias) = &mut self.bias
                    && bias.requires_grad
                {
                    let rows = grad_output.numel() / self.out_features.max(1);
                    let flat = grad_output
                        .contiguous()?
                        .reshape(&[rows, self.out_features])?;
                    bias.accumulate_grad(flat.sum(0, false)?)?;
                }
                self.linear.backward(grad_output)
            }
        }
    }

    fn clear_cache(&mut self) -> hypershard_nn::Result<()> {
        self.linear.clear_cache()
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        self.linear.visit_params(prefix, f)?;
        if let Some(bias) = &self.bias {
            f(&join_name(prefix, "bias"), bias)?;
        }
        Ok(())
    }

    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        self.linear.visit_params_mut(prefix, f)?;
        if let Some(bias) = &mut self.bias {
            f(&join_name(prefix, "bias"), bias)?;
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl std::fmt::Debug for TpLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpLinear")
            .field("style", &self.style)
            .field("in_features", &self.in_features)
            .field("out_features", &self.out_features)
            .field("tp", &self.mesh.shape())
            .finish()
    }
}

/// The TP layout of every parameter inside a [`TpLinear`] below `module` (or `module` itself),
/// by dotted name relative to `module`, with the layer's mesh. Walks through nested units.
pub(crate) fn tp_layouts(
    module: &mut dyn Module,
    prefix: &str,
    out: &mut BTreeMap<String, (TpParamLayout, ProcessMesh)>,
) -> hypershard_nn::Result<()> {
    if let Some(layer) = module
        .as_any_mut()
        .and_then(|any| any.downcast_mut::<TpLinear>())
    {
        for layout in layer.param_layouts() {
            out.insert(
                join_name(prefix, &layout.name),
                (layout, layer.mesh.clone()),
            );
        }
        return Ok(());
    }
    // A unit shows its wrapped module's children, not the module itself, which may be a
    // `TpLinear`.
    if let Some(unit) = module
        .as_any_mut()
        .and_then(|any| any.downcast_mut::<crate::FsdpModule>())
    {
        return tp_layouts(unit.inner_mut(), prefix, out);
    }
    module.visit_children_mut(&mut |name, child| {
        tp_layouts(child.as_mut(), &join_name(prefix, name), out)
    })
}
