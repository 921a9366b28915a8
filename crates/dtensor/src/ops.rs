//! Sharded ops with sharding propagation.
//!
//! Each op decides, mesh dim by mesh dim, which output placement follows from its inputs'
//! placements (the propagation rule), then runs the plain tensor op on the local blocks. No
//! op communicates unless [`OpConfig::auto_redistribute`] is set; then an input whose layout
//! has no rule is redistributed first (cheapest first: a local chunk or partition of a
//! replicated input, then replicating one side, then both).
//!
//! Rules (per mesh dim, `R` = Replicate, `P` = Partial with a linear op: sum, avg, premul-sum):
//!
//! | op                    | inputs                         | output             |
//! |-----------------------|--------------------------------|--------------------|
//! | add, sub, mul         | `R`, `R`                       | `R`                |
//! | add, sub, mul         | `S(d)`, `S(d)` (same extent)   | `S(d)`             |
//! | add, sub, mul         | `S(d)`, `R` broadcast along d  | `S(d)` (and mirrored) |
//! | add, sub              | `P(op)`, `P(op)`               | `P(op)`            |
//! | mul                   | `P(op)`, `R`                   | `P(op)` (and mirrored) |
//! | matmul `a·b`          | `S(m)`, `R`                    | `S(m)`             |
//! | matmul                | `R`, `S(n)`                    | `S(n)`             |
//! | matmul                | `S(k)`, `S(k)`                 | `P(sum)`           |
//! | matmul                | `S(batch)`, `S(batch)` (or `R` for an unbatched side) | `S(batch)` |
//! | matmul                | `P(op)`, `R`                   | `P(op)` (and mirrored) |
//! | sum, mean along `d`   | `S(d)`                         | `P(sum)`           |
//! | sum, mean             | `S(e)`, `R`, `P(op)`           | `S(e')`, `R`, `P(op)` |
//! | transpose             | `S(d0)` / `S(d1)`              | `S(d1)` / `S(d0)`  |
//! | reshape               | `S(d)` when dim d is kept whole | `S(d')`           |

use hypershard_mesh::{Placement, ReduceOp};
use hypershard_tensor::{DType, Tensor};

use crate::dtensor::{DTensor, check_local_shape};
use crate::error::{Error, Result};
use crate::planner::validate_placements;

/// How a sharded op treats inputs whose layouts have no propagation rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpConfig {
    /// Redistribute such inputs (collectively) instead of failing with
    /// [`Error::UnsupportedSharding`]. Off by default, so communication never happens behind
    /// the caller's back.
    pub auto_redistribute: bool,
}

impl OpConfig {
    /// The default config with `auto_redistribute` set to `enabled`.
    pub fn with_auto_redistribute(mut self, enabled: bool) -> Self {
        self.auto_redistribute = enabled;
        self
    }
}

/// The elementwise binary ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Binary {
    Add,
    Sub,
    Mul,
}

impl Binary {
    fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
        }
    }
}

/// Whether a pending reduction is linear (commutes with sums and with scaling by a replica).
fn linear(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_))
}

impl DTensor {
    /// Elementwise `self + other` with broadcasting. See the module docs for the rules.
    pub fn add(&self, other: &DTensor) -> Result<DTensor> {
        self.binary(other, Binary::Add, OpConfig::default())
    }

    /// Elementwise `self - other` with broadcasting.
    pub fn sub(&self, other: &DTensor) -> Result<DTensor> {
        self.binary(other, Binary::Sub, OpConfig::default())
    }

    /// Elementwise `self * other` with broadcasting.
    pub fn mul(&self, other: &DTensor) -> Result<DTensor> {
        self.binary(other, Binary::Mul, OpConfig::default())
    }

    /// [`add`](DTensor::add) with a config.
    pub fn add_with(&self, other: &DTensor, config: OpConfig) -> Result<DTensor> {
        self.binary(other, Binary::Add, config)
    }

    /// [`sub`](DTensor::sub) with a config.
    pub fn sub_with(&self, other: &DTensor, config: OpConfig) -> Result<DTensor> {
        self.binary(other, Binary::Sub, config)
    }

    /// [`mul`](DTensor::mul) with a config.
    pub fn mul_with(&self, other: &DTensor, config: OpConfig) -> Result<DTensor> {
        self.binary(other, Binary::Mul, config)
    }

    /// Matrix product of the last two dims, batched over the leading ones: `[.., m, k] ·
    /// [.., k, n] → [.., m, n]`. The batch dims must be equal, or one side unbatched (2-d).
    pub fn matmul(&self, other: &DTensor) -> Result<DTensor> {
        self.matmul_with(other, OpConfig::default())
    }

    /// [`matmul`](DTensor::matmul) with a config.
    pub fn matmul_with(&self, other: &DTensor, config: OpConfig) -> Result<DTensor> {
        let op = "matmul";
        check_pair(op, self, other)?;
        let dims = MatmulDims::new(self.shape(), other.shape())?;
        let rule = |a: Placement, b: Placement| dims.rule(a, b);
        let candidates =
            |a: Placement, b: Placement| vec![(a, Placement::Replicate), (Placement::Replicate, b)];
        let (lhs, rhs, placements) = resolve_pair(op, self, other, config, rule, candidates)?;
        let local = local_matmul(lhs.to_local(), rhs.to_local())?;
        finish(op, lhs, local, placements, dims.out_shape)
    }

    /// The sum along `dim`. A dim sharded on some mesh dim becomes `P(sum)` there.
    pub fn sum(&self, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.reduce_dim("sum", dim, keepdim, OpConfig::default())
    }

    /// The mean along `dim` (float dtypes). A sharded dim becomes `P(sum)` of the local sums
    /// divided by the global extent, which is exact for uneven shards too.
    pub fn mean(&self, dim: usize, keepdim: bool) -> Result<DTensor> {
        self.reduce_dim("mean", dim, keepdim, OpConfig::default())
    }

    /// [`sum`](DTensor::sum) with a config (a non-linear partial input is reduced first).
    pub fn sum_with(&self, dim: usize, keepdim: bool, config: OpConfig) -> Result<DTensor> {
        self.reduce_dim("sum", dim, keepdim, config)
    }

    /// [`mean`](DTensor::mean) with a config.
    pub fn mean_with(&self, dim: usize, keepdim: bool, config: OpConfig) -> Result<DTensor> {
        self.reduce_dim("mean", dim, keepdim, config)
    }

    /// Swaps two dims; their shard placements swap with them. No communication.
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<DTensor> {
        let ndim = self.ndim();
        for dim in [dim0, dim1] {
            if dim >= ndim {
                return Err(Error::DimOutOfRange {
                    op: "transpose",
                    dim,
                    ndim,
                });
            }
        }
        let swap = |d: usize| match d {
            d if d == dim0 => dim1,
            d if d == dim1 => dim0,
            d => d,
        };
        let placements = self
            .placements()
            .iter()
            .map(|p| match p {
                Placement::Shard(d) => Placement::Shard(swap(*d)),
                other => *other,
            })
            .collect();
        let mut shape = self.shape().to_vec();
        shape.swap(dim0, dim1);
        let local = self.to_local().transpose(dim0, dim1)?;
        Ok(DTensor::from_parts(
            local,
            self.process_mesh().clone(),
            placements,
            shape,
        ))
    }

    /// The same elements under a new global shape. Allowed when every sharded dim is kept
    /// whole (the dims before it multiply to the same count in both shapes and its size is
    /// unchanged); otherwise [`Error::UnsupportedReshape`]. No communication.
    pub fn reshape(&self, shape: &[usize]) -> Result<DTensor> {
        let from = self.shape();
        let unsupported = || Error::UnsupportedReshape {
            from: from.to_vec(),
            to: shape.to_vec(),
            placements: self.placements().to_vec(),
        };
        if from.iter().product::<usize>() != shape.iter().product::<usize>() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                lhs: from.to_vec(),
                rhs: shape.to_vec(),
            });
        }
        let prefix = |dims: &[usize], d: usize| dims[..d].iter().product::<usize>();
        let mut mapped: Vec<(usize, usize)> = Vec::new();
        for placement in self.placements() {
            let Some(d) = placement.shard_dim() else {
                continue;
            };
            if mapped.iter().any(|&(old, _)| old == d) {
                continue;
            }
            let target = (0..shape.len())
                .find(|&e| shape[e] == from[d] && prefix(shape, e) == prefix(from, d))
                .ok_or_else(unsupported)?;
            mapped.push((d, target));
        }
        let mut local_shape = shape.to_vec();
        for &(old, new) in &mapped {
            local_shape[new] = self.to_local().shape()[old];
        }
        let placements: Vec<Placement> = self
            .placements()
            .iter()
            .map(|p| match p {
                Placement::Shard(d) => mapped
                    .iter()
                    .find(|(old, _)| old == d)
                    .map(|&(_, new)| Placement::Shard(new))
                    .unwrap_or(*p),
                other => *other,
            })
            .collect();
        let local = self.to_local().reshape(&local_shape)?;
        finish("reshape", self.clone(), local, placements, shape.to_vec())
    }

    fn binary(&self, other: &DTensor, binary: Binary, config: OpConfig) -> Result<DTensor> {
        let op = binary.name();
        check_pair(op, self, other)?;
        let out_shape =
            broadcast_shapes(self.shape(), other.shape()).ok_or_else(|| Error::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            })?;
        let out_ndim = out_shape.len();
        let (a_shape, b_shape) = (
            aligned(self.shape(), out_ndim),
            aligned(other.shape(), out_ndim),
        );
        let (a_lead, b_lead) = (out_ndim - self.ndim(), out_ndim - other.ndim());
        let rule = |a: Placement, b: Placement| -> Option<Placement> {
            let a = shift(a, a_lead);
            let b = shift(b, b_lead);
            match (a, b) {
                (Placement::Replicate, Placement::Replicate) => Some(Placement::Replicate),
                (Placement::Shard(d), Placement::Shard(e))
                    if d == e && a_shape[d] == b_shape[d] =>
                {
                    Some(a)
                }
                (Placement::Shard(d), Placement::Replicate) if b_shape[d] == 1 => Some(a),
                (Placement::Replicate, Placement::Shard(d)) if a_shape[d] == 1 => Some(b),
                (Placement::Partial(x), Placement::Partial(y))
                    if x == y && linear(x) && binary != Binary::Mul =>
                {
                    Some(a)
                }
                (Placement::Partial(x), Placement::Replicate)
                    if linear(x) && binary == Binary::Mul =>
                {
                    Some(a)
                }
                (Placement::Replicate, Placement::Partial(y))
                    if linear(y) && binary == Binary::Mul =>
                {
                    Some(b)
                }
                _ => None,
            }
        };
        // Candidates: give the other side the same layout (a free local chunk or partition of
        // a replica, or an all-to-all), then replicate one side, then both.
        let candidates = |a: Placement, b: Placement| {
            let mut list = Vec::new();
            if let Some(mirrored) = reshift(shift(a, a_lead), b_lead) {
                list.push((a, mirrored));
            }
            if let Some(mirrored) = reshift(shift(b, b_lead), a_lead) {
                list.push((mirrored, b));
            }
            list.push((a, Placement::Replicate));
            list.push((Placement::Replicate, b));
            list
        };
        let (lhs, rhs, placements) = resolve_pair(op, self, other, config, rule, candidates)?;
        let (x, y) = (lhs.to_local(), rhs.to_local());
        let local = match binary {
            Binary::Add => x.add(y)?,
            Binary::Sub => x.sub(y)?,
            Binary::Mul => x.mul(y)?,
        };
        finish(op, lhs, local, placements, out_shape)
    }

    fn reduce_dim(
        &self,
        op: &'static str,
        dim: usize,
        keepdim: bool,
        config: OpConfig,
    ) -> Result<DTensor> {
        let ndim = self.ndim();
        if dim >= ndim {
            return Err(Error::DimOutOfRange { op, dim, ndim });
        }
        let mut source = self.clone();
        let blocked: Vec<usize> = (0..self.placements().len())
            .filter(|&i| {
                self.placements()[i]
                    .partial_op()
                    .is_some_and(|p| !linear(p))
            })
            .collect();
        if let Some(&mesh_dim) = blocked.first() {
            if !config.auto_redistribute {
                let placement = self.placements()[mesh_dim];
                return Err(Error::UnsupportedSharding {
                    op,
                    mesh_dim,
                    lhs: placement,
                    rhs: placement,
                });
            }
            let mut target = self.placements().to_vec();
            for &i in &blocked {
                target[i] = Placement::Replicate;
            }
            source = self.redistribute(&target)?;
        }
        let sharded = source.placements().contains(&Placement::Shard(dim));
        let placements: Vec<Placement> = source
            .placements()
            .iter()
            .map(|p| match *p {
                Placement::Shard(d) if d == dim => Placement::Partial(ReduceOp::Sum),
                Placement::Shard(d) if !keepdim && d > dim => Placement::Shard(d - 1),
                other => other,
            })
            .collect();
        let local = source.to_local();
        let reduced = match (op, sharded) {
            ("mean", false) => local.mean(dim, keepdim)?,
            ("mean", true) => {
                let extent = source.shape()[dim] as f64;
                local.sum(dim, keepdim)?.scale(1.0 / extent)?
            }
            _ => local.sum(dim, keepdim)?,
        };
        let mut shape = source.shape().to_vec();
        if keepdim {
            shape[dim] = 1;
        } else {
            shape.remove(dim);
        }
        finish(op, source, reduced, placements, shape)
    }
}

/// Checks that two operands share a mesh and a dtype.
fn check_pair(op: &'static str, a: &DTensor, b: &DTensor) -> Result<()> {
    if !a.process_mesh().same_mesh(b.process_mesh()) {
        return Err(Error::MeshMismatch {
            op,
            lhs: a.process_mesh().to_string(),
            rhs: b.process_mesh().to_string(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// Applies `rule` on every mesh dim; where it has no answer and `auto_redistribute` is set,
/// picks the first candidate input layout that has one and redistributes the inputs to it.
/// Returns the (possibly redistributed) inputs and the output placements.
fn resolve_pair(
    op: &'static str,
    a: &DTensor,
    b: &DTensor,
    config: OpConfig,
    rule: impl Fn(Placement, Placement) -> Option<Placement>,
    candidates: impl Fn(Placement, Placement) -> Vec<(Placement, Placement)>,
) -> Result<(DTensor, DTensor, Vec<Placement>)> {
    let mesh_ndim = a.placements().len();
    let mut a_target = a.placements().to_vec();
    let mut b_target = b.placements().to_vec();
    let mut out = Vec::with_capacity(mesh_ndim);
    for mesh_dim in 0..mesh_ndim {
        let (pa, pb) = (a_target[mesh_dim], b_target[mesh_dim]);
        if let Some(placement) = rule(pa, pb) {
            out.push(placement);
            continue;
        }
        let fallback = || Error::UnsupportedSharding {
            op,
            mesh_dim,
            lhs: pa,
            rhs: pb,
        };
        if !config.auto_redistribute {
            return Err(fallback());
        }
        let mut choices = candidates(pa, pb);
        choices.push((Placement::Replicate, Placement::Replicate));
        let (ca, cb, placement) = choices
            .into_iter()
            .filter(|&(ca, cb)| reachable(pa, ca) && reachable(pb, cb))
            .find_map(|(ca, cb)| rule(ca, cb).map(|p| (ca, cb, p)))
            .ok_or_else(fallback)?;
        a_target[mesh_dim] = ca;
        b_target[mesh_dim] = cb;
        out.push(placement);
    }
    let lhs = a.redistribute(&a_target)?;
    let rhs = b.redistribute(&b_target)?;
    Ok((lhs, rhs, out))
}

/// Whether a redistribute can take one mesh dim from `from` to `to` (a partial cannot become
/// another partial).
fn reachable(from: Placement, to: Placement) -> bool {
    match (from, to) {
        (Placement::Partial(x), Placement::Partial(y)) => x == y,
        _ => true,
    }
}

/// Validates the output layout and assembles the result.
fn finish(
    op: &'static str,
    like: DTensor,
    local: Tensor,
    placements: Vec<Placement>,
    shape: Vec<usize>,
) -> Result<DTensor> {
    let mesh = like.process_mesh();
    validate_placements(op, mesh.ndim(), shape.len(), &placements)?;
    check_local_shape(op, &local, mesh, &placements, &shape)?;
    Ok(DTensor::from_parts(local, mesh.clone(), placements, shape))
}

/// `Shard(d)` of an operand with `lead` fewer dims than the output, in output dims.
fn shift(placement: Placement, lead: usize) -> Placement {
    match placement {
        Placement::Shard(d) => Placement::Shard(d + lead),
        other => other,
    }
}

/// An output-dim placement in the dims of an operand with `lead` fewer dims, if it has it.
fn reshift(placement: Placement, lead: usize) -> Option<Placement> {
    match placement {
        Placement::Shard(d) if d >= lead => Some(Placement::Shard(d - lead)),
        Placement::Shard(_) => None,
        other => Some(other),
    }
}

/// `shape` with leading 1s up to `ndim` dims.
fn aligned(shape: &[usize], ndim: usize) -> Vec<usize> {
    let mut out = vec![1; ndim - shape.len()];
    out.extend_from_slice(shape);
    out
}

/// Numpy broadcasting of two shapes.
fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let ndim = a.len().max(b.len());
    let (a, b) = (aligned(a, ndim), aligned(b, ndim));
    a.iter()
        .zip(&b)
        .map(|(&x, &y)| match (x, y) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

/// The dims of a (batched) matmul and its propagation rule.
struct MatmulDims {
    a_batch: usize,
    b_batch: usize,
    out_shape: Vec<usize>,
}

impl MatmulDims {
    fn new(a: &[usize], b: &[usize]) -> Result<MatmulDims> {
        let mismatch = || Error::ShapeMismatch {
            op: "matmul",
            lhs: a.to_vec(),
            rhs: b.to_vec(),
        };
        if a.len() < 2 || b.len() < 2 {
            return Err(mismatch());
        }
        let (a_batch, b_batch) = (a.len() - 2, b.len() - 2);
        let batch_ok = a_batch == 0 || b_batch == 0 || a[..a_batch] == b[..b_batch];
        if !batch_ok || a[a_batch + 1] != b[b_batch] {
            return Err(mismatch());
        }
        let mut out_shape = if a_batch >= b_batch {
            a[..a_batch].to_vec()
        } else {
            b[..b_batch].to_vec()
        };
        out_shape.push(a[a_batch]);
        out_shape.push(b[b_batch + 1]);
        Ok(MatmulDims {
            a_batch,
            b_batch,
            out_shape,
        })
    }

    fn rule(&self, a: Placement, b: Placement) -> Option<Placement> {
        let batch = self.a_batch.max(self.b_batch);
        let (a_m, a_k) = (self.a_batch, self.a_batch + 1);
        let (b_k, b_n) = (self.b_batch, self.b_batch + 1);
        match (a, b) {
            (Placement::Replicate, Placement::Replicate) => Some(Placement::Replicate),
            (Placement::Shard(d), Placement::Replicate) if d == a_m => {
                Some(Placement::Shard(batch))
            }
            (Placement::Replicate, Placement::Shard(d)) if d == b_n => {
                Some(Placement::Shard(batch + 1))
            }
            (Placement::Shard(d), Placement::Shard(e)) if d == a_k && e == b_k => {
                Some(Placement::Partial(ReduceOp::Sum))
            }
            (Placement::Shard(d), Placement::Shard(e))
                if d == e && d < self.a_batch && self.a_batch == self.b_batch =>
            {
                Some(a)
            }
            (Placement::Shard(d), Placement::Replicate)
                if d < self.a_batch && self.b_batch == 0 =>
            {
                Some(a)
            }
            (Placement::Replicate, Placement::Shard(d))
                if d < self.b_batch && self.a_batch == 0 =>
            {
                Some(b)
            }
            (Placement::Partial(x), Placement::Replicate) if linear(x) => Some(a),
            (Placement::Replicate, Placement::Partial(y)) if linear(y) => Some(b),
            _ => None,
        }
    }
}

/// The local batched matmul, accumulated in f64 and rounded once to the dtype.
fn local_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dtype: DType = a.dtype();
    let (ar, br) = (a.ndim() - 2, b.ndim() - 2);
    let (m, k, n) = (a.shape()[ar], a.shape()[ar + 1], b.shape()[br + 1]);
    let batch_shape = if ar >= br {
        &a.shape()[..ar]
    } else {
        &b.shape()[..br]
    };
    // The propagation rules make the local contraction dims and batches agree; check anyway,
    // so a broken rule is an error and never an out-of-bounds index.
    let batches_agree = ar == 0 || br == 0 || a.shape()[..ar] == b.shape()[..br];
    if b.shape()[br] != k || !batches_agree {
        return Err(Error::ShapeMismatch {
            op: "matmul (local blocks)",
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
        });
    }
    let batches: usize = batch_shape.iter().product();
    let xs = a.to_f64_vec()?;
    let ys = b.to_f64_vec()?;
    let mut out = vec![0.0f64; batches * m * n];
    for batch in 0..batches {
        let x = &xs[if ar == 0 { 0 } else { batch * m * k }..][..m * k];
        let y = &ys[if br == 0 { 0 } else { batch * k * n }..][..k * n];
        let z = &mut out[batch * m * n..][..m * n];
        for i in 0..m {
            for p in 0..k {
                let xv = x[i * k + p];
                for j in 0..n {
                    z[i * n + j] += xv * y[p * n + j];
                }
            }
        }
    }
    let mut shape = batch_shape.to_vec();
    shape.push(m);
    shape.push(n);
    Ok(Tensor::from_vec(out, &shape)?.to_dtype(dtype)?)
}
