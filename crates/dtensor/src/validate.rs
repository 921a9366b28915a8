//! [`DTensor::from_local_checked`]: the validating constructor.
//!
//! Every rank runs the same fixed sequence of small collectives over the mesh-dim
//! communicators whatever it finds, so a rank with a bad local tensor cannot leave the others
//! waiting: problems are recorded, spread to every rank with one max-all-reduce per mesh dim,
//! and then every rank fails together.

use hypershard_collectives::{CommunicatorExt, ReduceOp as WireOp};
use hypershard_mesh::{Placement, ReduceOp, local_block, shard_span};
use hypershard_tensor::{DType, Tensor};

use crate::dtensor::DTensor;
use crate::error::{Error, Result};
use crate::planner::validate_placements;
use crate::process_mesh::ProcessMesh;

const OP: &str = "from_local_checked";

/// What a rank found wrong; the discriminant travels as the problem code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Problem {
    /// Dtype, tensor ndim or placements differ from a peer's.
    Header = 1,
    /// The local shapes of a group do not tile a dim the `torch.chunk` way (or a replicated
    /// dim differs).
    Layout = 2,
    /// The global shape passed in differs from the one the local shapes give.
    GlobalShape = 3,
}

impl Problem {
    fn what(code: i64) -> &'static str {
        match code {
            1 => "dtype, ndim or placements",
            2 => "local shape",
            _ => "global shape",
        }
    }
}

/// A problem and the global rank that has it.
#[derive(Debug, Clone, Copy)]
struct Found {
    problem: Problem,
    rank: usize,
}

impl DTensor {
    /// Like [`from_local`](DTensor::from_local), but collective and validating (PyTorch's
    /// `run_check=True`, extended to uneven shards).
    ///
    /// Every rank of the mesh calls it. The ranks check that they agree on the dtype, the
    /// tensor ndim and the placements; then the global shape is derived from every rank's
    /// local shape (summing shard lengths along each sharding mesh dim, innermost first),
    /// checking that the shards follow `torch.chunk` and that replicated dims agree. A given
    /// `global_shape` must equal the derived one. Dtype, ndim and placements are compared
    /// with those of the rank at mesh coordinate 0. When any rank finds a problem every rank
    /// fails together: the rank named at fault (the highest one, if several are) with
    /// [`Error::LocalShapeMismatch`] when its own shape is wrong, every other rank with
    /// [`Error::InconsistentAcrossRanks`] naming it.
    pub fn from_local_checked(
        local: Tensor,
        mesh: &ProcessMesh,
        placements: &[Placement],
        global_shape: Option<&[usize]>,
    ) -> Result<DTensor> {
        // The mesh ndim is the same on every rank; a wrong count is an error everywhere.
        if placements.len() != mesh.ndim() {
            validate_placements(OP, mesh.ndim(), local.ndim(), placements)?;
        }
        let mut findings = Findings::default();
        if validate_placements(OP, mesh.ndim(), local.ndim(), placements).is_err() {
            findings.note(Problem::Header, mesh.rank());
        }
        // Everyone compares its header with the one of the rank at mesh coordinate 0, which
        // reaches every rank through one broadcast per mesh dim (from coordinate 0 of that
        // dim), so a rank that disagrees names itself.
        let mine = header(&local, placements);
        let mut reference = mine.clone();
        for mesh_dim in 0..mesh.ndim() {
            reference = mesh.dim_comm(mesh_dim)?.broadcast_vec(reference, 0)?;
        }
        if reference != mine {
            findings.note(Problem::Header, mesh.rank());
        }
        // Stop here (together) if the headers differ: later steps need equal ndims.
        if let Some(spread) = spread(mesh, findings.found)? {
            return Err(failure(mesh, &findings, spread, &local, placements));
        }
        let derived = derive_global_shape(&local, mesh, placements, &mut findings)?;
        if let Some(given) = global_shape
            && given != derived.as_slice()
        {
            findings.note(Problem::GlobalShape, mesh.rank());
        }
        let expected = local_block(&derived, mesh.mesh(), placements, mesh.rank())?.shape;
        if expected != local.shape() {
            findings.note(Problem::Layout, mesh.rank());
            findings.own_layout = Some((derived.clone(), expected));
        }
        if let Some(spread) = spread(mesh, findings.found)? {
            return Err(failure(mesh, &findings, spread, &local, placements));
        }
        Ok(DTensor::from_parts(
            local,
            mesh.clone(),
            placements.to_vec(),
            derived,
        ))
    }
}

/// What this rank found so far: the worst problem, and the details of its own bad shape.
#[derive(Debug, Default)]
struct Findings {
    found: Option<Found>,
    /// The derived global shape and the local shape this rank should have had.
    own_layout: Option<(Vec<usize>, Vec<usize>)>,
}

impl Findings {
    /// Records a problem, keeping the worst (lowest code) one.
    fn note(&mut self, problem: Problem, rank: usize) {
        if self.found.is_none_or(|f| problem < f.problem) {
            self.found = Some(Found { problem, rank });
        }
    }
}

/// The error this rank returns once `spread` (code, rank) is known everywhere.
fn failure(
    mesh: &ProcessMesh,
    findings: &Findings,
    spread: (i64, usize),
    local: &Tensor,
    placements: &[Placement],
) -> Error {
    match &findings.own_layout {
        Some((global_shape, expected)) if spread.1 == mesh.rank() => Error::LocalShapeMismatch {
            op: OP,
            rank: mesh.rank(),
            global_shape: global_shape.clone(),
            placements: placements.to_vec(),
            expected: expected.clone(),
            actual: local.shape().to_vec(),
        },
        _ => Error::InconsistentAcrossRanks {
            op: OP,
            rank: spread.1,
            reference: mesh.rank(),
            what: Problem::what(spread.0),
        },
    }
}

/// Spreads the worst problem (lowest code) to every rank of the mesh: one max-all-reduce per
/// mesh dim reaches every rank of a grid. Returns `(code, rank)` if any rank found one.
fn spread(mesh: &ProcessMesh, found: Option<Found>) -> Result<Option<(i64, usize)>> {
    // Encoded so that the maximum is the lowest code: (4 - code, rank).
    let mut value = match found {
        Some(f) => vec![4 - f.problem as i64, to_i64(f.rank)?],
        None => vec![0, 0],
    };
    for mesh_dim in 0..mesh.ndim() {
        let comm = mesh.dim_comm(mesh_dim)?;
        // The code and the rank are reduced separately; the rank is only a hint of where.
        value = comm.all_reduce_vec(value, WireOp::Max)?;
    }
    Ok((value[0] > 0).then(|| (4 - value[0], usize::try_from(value[1]).unwrap_or(0))))
}

/// Sums shard lengths from the innermost mesh dim outwards to get the global shape,
/// noting layout problems.
fn derive_global_shape(
    local: &Tensor,
    mesh: &ProcessMesh,
    placements: &[Placement],
    findings: &mut Findings,
) -> Result<Vec<usize>> {
    let mut extents: Vec<i64> = local
        .shape()
        .iter()
        .map(|&s| to_i64(s))
        .collect::<Result<_>>()?;
    for mesh_dim in (0..mesh.ndim()).rev() {
        let comm = mesh.dim_comm(mesh_dim)?;
        let n = comm.size();
        let all = comm.all_gather_vec(extents.clone())?;
        let rows: Vec<&[i64]> = all.chunks(extents.len().max(1)).collect();
        for (d, extent) in extents.iter_mut().enumerate() {
            if placements[mesh_dim] == Placement::Shard(d) {
                let lens: Vec<i64> = rows.iter().map(|row| row[d]).collect();
                let total: i64 = lens.iter().sum();
                let total_usize = usize::try_from(total).unwrap_or(0);
                for (peer, &len) in lens.iter().enumerate() {
                    let expected = shard_span(total_usize, n, peer)?.len;
                    if usize::try_from(len).ok() != Some(expected) {
                        findings.note(Problem::Layout, peer_rank(mesh, mesh_dim, peer)?);
                    }
                }
                *extent = total;
            } else {
                // Unsharded here: every rank of the group must hold the extent of the group's
                // first rank; a rank that does not is the one at fault.
                let reference = rows.first().map_or(*extent, |row| row[d]);
                for (peer, row) in rows.iter().enumerate() {
                    if row[d] != reference {
                        findings.note(Problem::Layout, peer_rank(mesh, mesh_dim, peer)?);
                    }
                }
                *extent = reference;
            }
        }
    }
    Ok(extents
        .into_iter()
        .map(|e| usize::try_from(e).unwrap_or(0))
        .collect())
}

/// What every rank must agree on: ndim, dtype and the placements.
fn header(local: &Tensor, placements: &[Placement]) -> Vec<i64> {
    let dtype = DType::ALL
        .iter()
        .position(|&d| d == local.dtype())
        .unwrap_or(usize::MAX);
    let mut header = vec![local.ndim() as i64, dtype as i64];
    for placement in placements {
        let (kind, payload) = match placement {
            Placement::Shard(d) => (1, *d as i64),
            Placement::Replicate => (2, 0),
            Placement::Partial(op) => match op {
                ReduceOp::Sum => (3, 0),
                ReduceOp::Avg => (3, 1),
                ReduceOp::Max => (3, 2),
                ReduceOp::Min => (3, 3),
                ReduceOp::Product => (3, 4),
                ReduceOp::PreMulSum(factor) => (4, factor.to_bits() as i64),
            },
        };
        header.push(kind);
        header.push(payload);
    }
    header
}

/// The global rank of the peer at index `peer` of this rank's group along `mesh_dim`.
fn peer_rank(mesh: &ProcessMesh, mesh_dim: usize, peer: usize) -> Result<usize> {
    let mut coordinate = mesh.coordinate().to_vec();
    coordinate[mesh_dim] = peer;
    Ok(mesh.mesh().rank_at(&coordinate)?)
}

fn to_i64(value: usize) -> Result<i64> {
    i64::try_from(value).map_err(|_| Error::ValueTooLarge {
        op: OP,
        value,
        target: "i64",
    })
}
