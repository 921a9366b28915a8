//! The phase-0 descriptor: what a rank tells every peer about its call before any data moves.

use super::AlgorithmKnobs;
use crate::dtype::DType;
use crate::error::Error;
use crate::op::{AllToAllCounts, OpKind, ReduceOp};

/// What a rank tells the others about its call, compared across ranks in phase 0.
#[derive(Debug)]
pub(crate) struct Desc {
    pub(crate) op: OpKind,
    /// The dtype every rank must share (the input's; the output's for scatter).
    pub(crate) dtype: Option<DType>,
    /// The length every rank must share, when the op has one.
    pub(crate) len: Option<usize>,
    pub(crate) root: Option<usize>,
    pub(crate) reduce: Option<ReduceOp>,
    /// Counts every rank must share (`_v` gathers and reduce-scatters).
    pub(crate) counts: Option<Vec<usize>>,
    /// Per-peer counts of all-to-all-v, checked pairwise.
    pub(crate) a2a: Option<AllToAllCounts>,
    /// `(color, key)` of a split.
    pub(crate) split: Option<(Option<u32>, i64)>,
    /// A local argument error of this rank, as its peers should report it.
    pub(crate) fault: Option<Error>,
    /// The TCP backend's algorithm knobs (`None` on `local`, whose ranks share one config).
    pub(crate) knobs: Option<AlgorithmKnobs>,
}

impl Desc {
    pub(crate) fn new(op: OpKind) -> Self {
        Desc {
            op,
            dtype: None,
            len: None,
            root: None,
            reduce: None,
            counts: None,
            a2a: None,
            split: None,
            fault: None,
            knobs: None,
        }
    }
}
