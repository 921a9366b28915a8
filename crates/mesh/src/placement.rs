//! How a tensor is laid out along one mesh dimension.

use std::fmt;

/// The reduction that turns partial values into the full value.
///
/// This is the mesh-level (layout) view of a reduction: it says what a `Partial` placement
/// still owes. The collectives crate has its own wire-level op; dtensor maps between them.
///
/// ```
/// use hypershard_mesh::ReduceOp;
///
/// assert_eq!(ReduceOp::Sum.to_string(), "sum");
/// assert_eq!(ReduceOp::PreMulSum(0.5).to_string(), "premul_sum(0.5)");
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks of the group.
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product.
    Product,
    /// Each rank's value is multiplied by the factor before the sum
    /// (NCCL's `ncclRedOpCreatePreMulSum`); used for gradient scaling.
    PreMulSum(f64),
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::Sum => f.write_str("sum"),
            ReduceOp::Avg => f.write_str("avg"),
            ReduceOp::Max => f.write_str("max"),
            ReduceOp::Min => f.write_str("min"),
            ReduceOp::Product => f.write_str("product"),
            ReduceOp::PreMulSum(factor) => write!(f, "premul_sum({factor})"),
        }
    }
}

/// The layout of a tensor along one mesh dimension.
///
/// A distributed tensor carries one placement per mesh dimension:
/// - `Shard(d)`: tensor dimension `d` is split across the ranks of this mesh dimension
///   with `torch.chunk` semantics (see [`shard_span`](crate::shard_span));
/// - `Replicate`: every rank of this mesh dimension holds the same full values;
/// - `Partial(op)`: every rank holds a partial value, and the full value is the
///   reduction `op` over the ranks of this mesh dimension.
///
/// ```
/// use hypershard_mesh::{Placement, ReduceOp};
///
/// let placements = [Placement::Replicate, Placement::Shard(0), Placement::Partial(ReduceOp::Sum)];
/// let shown: Vec<String> = placements.iter().map(ToString::to_string).collect();
/// assert_eq!(shown, ["R", "S(0)", "P(sum)"]);
/// assert_eq!(placements[1].shard_dim(), Some(0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Placement {
    /// Split tensor dimension `.0` across this mesh dimension.
    Shard(usize),
    /// Hold the full value on every rank of this mesh dimension.
    Replicate,
    /// Hold a partial value whose reduction by the op over this mesh dimension is the full value.
    Partial(ReduceOp),
}

impl Placement {
    /// The sharded tensor dimension, if this is a `Shard` placement.
    pub fn shard_dim(&self) -> Option<usize> {
        match self {
            Placement::Shard(dim) => Some(*dim),
            Placement::Replicate | Placement::Partial(_) => None,
        }
    }

    /// Whether this is a `Shard` placement.
    pub fn is_shard(&self) -> bool {
        matches!(self, Placement::Shard(_))
    }

    /// Whether this is the `Replicate` placement.
    pub fn is_replicate(&self) -> bool {
        matches!(self, Placement::Replicate)
    }

    /// The pending reduction, if this is a `Partial` placement.
    pub fn partial_op(&self) -> Option<ReduceOp> {
        match self {
            Placement::Partial(op) => Some(*op),
            Placement::Shard(_) | Placement::Replicate => None,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(dim) => write!(f, "S({dim})"),
            Placement::Replicate => f.write_str("R"),
            Placement::Partial(op) => write!(f, "P({op})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_op_display_names_every_op() {
        let shown: Vec<String> = [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
            ReduceOp::PreMulSum(0.25),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            shown,
            ["sum", "avg", "max", "min", "product", "premul_sum(0.25)"]
        );
    }

    #[test]
    fn placement_display_is_short() {
        assert_eq!(Placement::Shard(0).to_string(), "S(0)");
        assert_eq!(Placement::Shard(12).to_string(), "S(12)");
        assert_eq!(Placement::Replicate.to_string(), "R");
        assert_eq!(Placement::Partial(ReduceOp::Sum).to_string(), "P(sum)");
        assert_eq!(Placement::Partial(ReduceOp::Avg).to_string(), "P(avg)");
        assert_eq!(
            Placement::Partial(ReduceOp::PreMulSum(2.0)).to_string(),
            "P(premul_sum(2))"
        );
    }

    #[test]
    fn accessors_tell_the_kind() {
        let shard = Placement::Shard(2);
        let replicate = Placement::Replicate;
        let partial = Placement::Partial(ReduceOp::Max);
        assert_eq!(shard.shard_dim(), Some(2));
        assert_eq!(replicate.shard_dim(), None);
        assert_eq!(partial.shard_dim(), None);
        assert!(shard.is_shard() && !replicate.is_shard() && !partial.is_shard());
        assert!(replicate.is_replicate() && !shard.is_replicate() && !partial.is_replicate());
        assert_eq!(partial.partial_op(), Some(ReduceOp::Max));
        assert_eq!(shard.partial_op(), None);
        assert_eq!(replicate.partial_op(), None);
    }
}
