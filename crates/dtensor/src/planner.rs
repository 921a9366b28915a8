//! The redistribute planner: source placements × target placements → ordered steps.
//!
//! Pure: it sees only shapes and placements, never a tensor or a communicator, so every rank
//! computes the same plan from the same inputs, and plans can be cached and unit-tested.
//! The executor (`executor.rs`) runs the steps.
//!
//! # Steps
//! One step changes the placement of one mesh dim. The legal steps (see
//! `docs/redistribute.md` for the table):
//!
//! | from → to      | step                       | collective on that mesh dim |
//! |----------------|----------------------------|-----------------------------|
//! | `S(d)` → `R`   | [`StepKind::AllGather`]    | all-gather                  |
//! | `P` → `R`      | [`StepKind::AllReduce`]    | all-reduce                  |
//! | `P` → `S(d)`   | [`StepKind::ReduceScatter`]| reduce-scatter              |
//! | `S(d)` → `S(e)`| [`StepKind::AllToAll`]     | all-to-all                  |
//! | `R` → `S(d)`   | [`StepKind::LocalChunk`]   | none                        |
//! | `R` → `P(op)`  | [`StepKind::LocalPartition`]| none                       |
//! | `S(d)` → `P(sum)` | [`StepKind::LocalShardToPartial`] | none              |
//!
//! A step that shards or unshards tensor dim `d` on mesh dim `i` is legal only when no later
//! mesh dim `j > i` shards `d` in the current state: nested shards split in mesh-dim order,
//! so the innermost split must be undone first (or made last). The planner searches the
//! states reachable through legal steps (Dijkstra over at most a few hundred states) for the
//! cheapest path under [`CostModel`]; "replicate misaligned nested shards first" falls out of
//! the search instead of being a special case.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hypershard_collectives::OpKind;
use hypershard_mesh::{MeshError, Placement, ReduceOp};

use crate::error::{Error, Result};

/// What one step does on its mesh dim.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepKind {
    /// `S(tensor_dim)` → `R`: all-gather of the padded shards.
    AllGather {
        /// The tensor dim being unsharded.
        tensor_dim: usize,
    },
    /// `P(op)` → `R`: all-reduce.
    AllReduce {
        /// The pending reduction.
        op: ReduceOp,
    },
    /// `P(op)` → `S(tensor_dim)`: reduce-scatter of the padded tensor.
    ReduceScatter {
        /// The pending reduction.
        op: ReduceOp,
        /// The tensor dim being sharded.
        tensor_dim: usize,
    },
    /// `S(from_dim)` → `S(to_dim)`: all-to-all of padded blocks.
    AllToAll {
        /// The tensor dim sharded before.
        from_dim: usize,
        /// The tensor dim sharded after.
        to_dim: usize,
    },
    /// `R` → `S(tensor_dim)`: keep the local chunk, no communication.
    LocalChunk {
        /// The tensor dim being sharded.
        tensor_dim: usize,
    },
    /// `R` → `P(op)`: rewrite the replicated value as partials, no communication. Sum keeps
    /// the value on coordinate 0 and zeros elsewhere; product keeps it on 0 and ones
    /// elsewhere; premul-sum(f) keeps value / f on 0 and zeros elsewhere; avg, max and min keep
    /// the value everywhere (the reduction of equal values is the value).
    LocalPartition {
        /// The reduction the partials owe.
        op: ReduceOp,
    },
    /// `S(tensor_dim)` → `P(sum)`: place the shard in a zero tensor of the unsharded extent,
    /// no communication.
    LocalShardToPartial {
        /// The tensor dim being unsharded.
        tensor_dim: usize,
    },
}

impl StepKind {
    /// The collective this step issues, if any.
    pub fn collective(&self) -> Option<OpKind> {
        match self {
            StepKind::AllGather { .. } => Some(OpKind::AllGather),
            StepKind::AllReduce { .. } => Some(OpKind::AllReduce),
            StepKind::ReduceScatter { .. } => Some(OpKind::ReduceScatter),
            StepKind::AllToAll { .. } => Some(OpKind::AllToAll),
            StepKind::LocalChunk { .. }
            | StepKind::LocalPartition { .. }
            | StepKind::LocalShardToPartial { .. } => None,
        }
    }
}

/// One step of a plan: the placement of `mesh_dim` goes from `from` to `to`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// The mesh dim whose placement changes.
    pub mesh_dim: usize,
    /// Its placement before.
    pub from: Placement,
    /// Its placement after.
    pub to: Placement,
    /// How.
    pub kind: StepKind,
}

/// An ordered list of steps and its estimated cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The steps, in execution order.
    pub steps: Vec<Step>,
    /// The estimated cost under [`CostModel`], in element-equivalents.
    pub cost: u64,
}

impl Plan {
    /// The collectives the plan issues, in order, with their mesh dims.
    pub fn collectives(&self) -> Vec<(usize, OpKind)> {
        self.steps
            .iter()
            .filter_map(|step| step.kind.collective().map(|op| (step.mesh_dim, op)))
            .collect()
    }
}

/// What to plan: the mesh and tensor shapes and the two layouts.
#[derive(Debug, Clone, Copy)]
pub struct PlanRequest<'a> {
    /// The size of every mesh dim.
    pub mesh_shape: &'a [usize],
    /// The global tensor shape.
    pub global_shape: &'a [usize],
    /// The current placements, one per mesh dim.
    pub src: &'a [Placement],
    /// The wanted placements, one per mesh dim.
    pub dst: &'a [Placement],
}

/// The planner's cost model, in element-equivalents (the element size multiplies every term
/// alike, so plans do not depend on the dtype).
///
/// For a step on a mesh dim of `n` ranks, with `N` the largest local block (the chunk sizes of
/// coordinate 0) before the step:
/// - all-gather: `(n - 1) · N` elements on the wire (ring), copies `N + n · N`;
/// - all-reduce: `2 (n - 1) / n · N` on the wire, copies `2 N`;
/// - reduce-scatter of the padded input `Np`: `(n - 1) / n · Np`, copies `Np + Np / n`;
/// - all-to-all of the padded input `Np`: `(n - 1) / n · Np`, copies `2 Np`;
/// - local chunk, partition, shard→partial: no wire, copies of the output.
///
/// Cost = `LATENCY · collectives + wire + copies / COPY_DIVISOR`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostModel;

impl CostModel {
    /// The fixed cost of one collective, in elements: its latency expressed as bandwidth.
    pub const LATENCY: u64 = 16_384;
    /// A local copy of `x` elements costs `x / COPY_DIVISOR` (memory is faster than the wire).
    pub const COPY_DIVISOR: u64 = 4;
}

/// Checks one layout: one placement per mesh dim, shard dims inside the tensor, and pending
/// reductions that commute.
pub fn validate_placements(
    op: &'static str,
    mesh_ndim: usize,
    tensor_ndim: usize,
    placements: &[Placement],
) -> Result<()> {
    if placements.len() != mesh_ndim {
        return Err(MeshError::PlacementCountMismatch {
            placements: placements.len(),
            mesh_ndim,
        }
        .into());
    }
    for (mesh_dim, placement) in placements.iter().enumerate() {
        if let Some(shard_dim) = placement.shard_dim()
            && shard_dim >= tensor_ndim
        {
            return Err(MeshError::ShardDimOutOfRange {
                mesh_dim,
                shard_dim,
                tensor_ndim,
            }
            .into());
        }
    }
    if !partials_commute(placements) {
        return Err(Error::MixedPartialOps {
            op,
            placements: placements.to_vec(),
        });
    }
    Ok(())
}

/// Whether the pending reductions of a layout can be applied in any order: all linear
/// (sum, avg, premul-sum), or all the same op.
fn partials_commute(placements: &[Placement]) -> bool {
    let ops: Vec<ReduceOp> = placements
        .iter()
        .filter_map(Placement::partial_op)
        .collect();
    let linear =
        |op: &ReduceOp| matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_));
    ops.iter().all(linear) || ops.windows(2).all(|pair| pair[0] == pair[1])
}

/// Whether `R → P(op)` can be done locally.
fn partition_supported(op: ReduceOp) -> bool {
    match op {
        ReduceOp::PreMulSum(factor) => factor.is_finite() && factor != 0.0,
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max | ReduceOp::Min | ReduceOp::Product => true,
    }
}

/// Plans a redistribute. Pure and deterministic: equal requests give equal plans on every
/// rank.
pub fn plan(request: &PlanRequest<'_>) -> Result<Plan> {
    let mesh_ndim = request.mesh_shape.len();
    let tensor_ndim = request.global_shape.len();
    validate_placements("redistribute", mesh_ndim, tensor_ndim, request.src)?;
    validate_placements("redistribute", mesh_ndim, tensor_ndim, request.dst)?;
    for (mesh_dim, (&from, &to)) in request.src.iter().zip(request.dst).enumerate() {
        if let (Placement::Partial(a), Placement::Partial(b)) = (from, to)
            && a != b
        {
            return Err(Error::PartialOpChange { mesh_dim, from, to });
        }
        if let (false, Placement::Partial(op)) = (from == to, to)
            && !partition_supported(op)
        {
            return Err(Error::UnsupportedPartial {
                op: "redistribute",
                mesh_dim,
                placement: to,
            });
        }
    }
    if request.src == request.dst {
        return Ok(Plan {
            steps: Vec::new(),
            cost: 0,
        });
    }
    let search = Search::new(request);
    // A change of one mesh dim that is legal on its own is the table's transition, whatever
    // the search might find equally cheap: users expect S→R to be one all-gather.
    let changed: Vec<usize> = (0..mesh_ndim)
        .filter(|&i| request.src[i] != request.dst[i])
        .collect();
    if let [mesh_dim] = changed[..]
        && let Some(step) = search.step(request.src, mesh_dim, request.dst[mesh_dim])
    {
        let cost = search.step_cost(request.src, &step);
        return Ok(Plan {
            steps: vec![step],
            cost,
        });
    }
    search.run()
}

/// The Dijkstra search over layouts. A layout is a vector of indices into `alphabet`.
struct Search<'a> {
    request: &'a PlanRequest<'a>,
    alphabet: Vec<Placement>,
}

type State = Vec<u16>;

/// Per reached state: its best cost and the state and step it was reached from.
type Reached = BTreeMap<State, (u64, Option<(State, Step)>)>;

impl<'a> Search<'a> {
    fn new(request: &'a PlanRequest<'a>) -> Self {
        let mut alphabet = vec![Placement::Replicate];
        alphabet.extend((0..request.global_shape.len()).map(Placement::Shard));
        for &placement in request.src.iter().chain(request.dst) {
            if placement.partial_op().is_some() && !alphabet.contains(&placement) {
                alphabet.push(placement);
            }
        }
        Search { request, alphabet }
    }

    fn encode(&self, placements: &[Placement]) -> State {
        placements
            .iter()
            .map(|p| {
                // invariant: the alphabet holds R, every S(d) of the tensor and every partial
                // of src and dst, which are the only placements encoded.
                self.alphabet
                    .iter()
                    .position(|a| a == p)
                    .expect("invariant: in the alphabet (see above)") as u16
            })
            .collect()
    }

    fn decode(&self, state: &[u16]) -> Vec<Placement> {
        state.iter().map(|&i| self.alphabet[i as usize]).collect()
    }

    fn run(&self) -> Result<Plan> {
        let start = self.encode(self.request.src);
        let goal = self.encode(self.request.dst);
        // Best known cost and the step that reached each state; BTreeMap and an ordered heap
        // keep the search identical on every rank.
        let mut best: Reached = BTreeMap::new();
        let mut heap = BinaryHeap::new();
        best.insert(start.clone(), (0, None));
        heap.push(Reverse((0u64, start)));
        while let Some(Reverse((cost, state))) = heap.pop() {
            if best.get(&state).is_some_and(|(known, _)| *known < cost) {
                continue;
            }
            if state == goal {
                return Ok(self.unwind(&best, goal, cost));
            }
            let placements = self.decode(&state);
            for mesh_dim in 0..placements.len() {
                for (index, &to) in self.alphabet.iter().enumerate() {
                    let Some(step) = self.step(&placements, mesh_dim, to) else {
                        continue;
                    };
                    let mut next_placements = placements.clone();
                    next_placements[mesh_dim] = to;
                    if !partials_commute(&next_placements) {
                        continue;
                    }
                    let mut next = state.clone();
                    next[mesh_dim] = index as u16;
                    let next_cost = cost.saturating_add(self.step_cost(&placements, &step));
                    if best.get(&next).is_none_or(|(known, _)| next_cost < *known) {
                        best.insert(next.clone(), (next_cost, Some((state.clone(), step))));
                        heap.push(Reverse((next_cost, next)));
                    }
                }
            }
        }
        Err(Error::NoPlan {
            from: self.request.src.to_vec(),
            to: self.request.dst.to_vec(),
            global_shape: self.request.global_shape.to_vec(),
        })
    }

    fn unwind(&self, best: &Reached, goal: State, cost: u64) -> Plan {
        let mut steps = Vec::new();
        let mut at = goal;
        while let Some((_, Some((prev, step)))) = best.get(&at) {
            steps.push(*step);
            at = prev.clone();
        }
        steps.reverse();
        Plan { steps, cost }
    }

    /// The step that moves `mesh_dim` of `state` to `to`, if it is legal.
    fn step(&self, state: &[Placement], mesh_dim: usize, to: Placement) -> Option<Step> {
        let from = state[mesh_dim];
        if from == to {
            return None;
        }
        // A dim only becomes partial when the target asks for exactly that partial.
        if to.partial_op().is_some() && self.request.dst[mesh_dim] != to {
            return None;
        }
        let free = |dim: usize| {
            state[mesh_dim + 1..]
                .iter()
                .all(|p| *p != Placement::Shard(dim))
        };
        let kind = match (from, to) {
            (Placement::Shard(d), Placement::Replicate) if free(d) => {
                StepKind::AllGather { tensor_dim: d }
            }
            (Placement::Shard(d), Placement::Shard(e)) if free(d) && free(e) => {
                StepKind::AllToAll {
                    from_dim: d,
                    to_dim: e,
                }
            }
            (Placement::Shard(d), Placement::Partial(ReduceOp::Sum)) if free(d) => {
                StepKind::LocalShardToPartial { tensor_dim: d }
            }
            (Placement::Replicate, Placement::Shard(d)) if free(d) => {
                StepKind::LocalChunk { tensor_dim: d }
            }
            (Placement::Replicate, Placement::Partial(op)) if partition_supported(op) => {
                StepKind::LocalPartition { op }
            }
            (Placement::Partial(op), Placement::Replicate) => StepKind::AllReduce { op },
            (Placement::Partial(op), Placement::Shard(d)) if free(d) => {
                StepKind::ReduceScatter { op, tensor_dim: d }
            }
            _ => return None,
        };
        Some(Step {
            mesh_dim,
            from,
            to,
            kind,
        })
    }

    /// The cost of `step` taken from `state` (see [`CostModel`]).
    fn step_cost(&self, state: &[Placement], step: &Step) -> u64 {
        let shape = max_local_shape(self.request.global_shape, self.request.mesh_shape, state);
        let numel = product(&shape);
        let n = self.request.mesh_shape[step.mesh_dim] as u64;
        let others = |dims: &[usize]| {
            product(
                &shape
                    .iter()
                    .enumerate()
                    .filter(|(d, _)| !dims.contains(d))
                    .map(|(_, &s)| s)
                    .collect::<Vec<_>>(),
            )
        };
        let (wire, copies) = match step.kind {
            StepKind::AllGather { .. } => {
                ((n - 1).saturating_mul(numel), numel.saturating_mul(n + 1))
            }
            StepKind::AllReduce { .. } => (
                2u64.saturating_mul(n - 1).saturating_mul(numel) / n,
                numel.saturating_mul(2),
            ),
            StepKind::ReduceScatter { tensor_dim, .. } => {
                let padded = others(&[tensor_dim])
                    .saturating_mul((shape[tensor_dim] as u64).div_ceil(n))
                    .saturating_mul(n);
                ((n - 1).saturating_mul(padded) / n, padded + padded / n)
            }
            StepKind::AllToAll { from_dim, to_dim } => {
                let padded = others(&[from_dim, to_dim])
                    .saturating_mul(shape[from_dim] as u64)
                    .saturating_mul((shape[to_dim] as u64).div_ceil(n))
                    .saturating_mul(n);
                ((n - 1).saturating_mul(padded) / n, padded.saturating_mul(2))
            }
            StepKind::LocalChunk { tensor_dim } => (
                0,
                others(&[tensor_dim]).saturating_mul((shape[tensor_dim] as u64).div_ceil(n)),
            ),
            StepKind::LocalPartition { .. } => (0, numel),
            StepKind::LocalShardToPartial { .. } => (0, numel.saturating_mul(n)),
        };
        let latency = if step.kind.collective().is_some() {
            CostModel::LATENCY
        } else {
            0
        };
        latency
            .saturating_add(wire)
            .saturating_add(copies / CostModel::COPY_DIVISOR)
    }
}

/// The local shape of the rank at coordinate 0 (the largest block) under `placements`.
fn max_local_shape(global: &[usize], mesh_shape: &[usize], placements: &[Placement]) -> Vec<usize> {
    let mut shape = global.to_vec();
    for (placement, &n) in placements.iter().zip(mesh_shape) {
        if let Some(d) = placement.shard_dim() {
            shape[d] = shape[d].div_ceil(n);
        }
    }
    shape
}

fn product(shape: &[usize]) -> u64 {
    shape
        .iter()
        .fold(1u64, |acc, &s| acc.saturating_mul(s as u64))
}

/// A placement in a hashable form (`ReduceOp` holds an `f64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PlacementKey {
    Shard(usize),
    Replicate,
    Partial(u8, u64),
}

impl From<Placement> for PlacementKey {
    fn from(placement: Placement) -> Self {
        match placement {
            Placement::Shard(d) => PlacementKey::Shard(d),
            Placement::Replicate => PlacementKey::Replicate,
            Placement::Partial(op) => {
                let (code, bits) = match op {
                    ReduceOp::Sum => (0, 0),
                    ReduceOp::Avg => (1, 0),
                    ReduceOp::Max => (2, 0),
                    ReduceOp::Min => (3, 0),
                    ReduceOp::Product => (4, 0),
                    ReduceOp::PreMulSum(factor) => (5, factor.to_bits()),
                };
                PlacementKey::Partial(code, bits)
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PlanKey {
    mesh_shape: Vec<usize>,
    global_shape: Vec<usize>,
    src: Vec<PlacementKey>,
    dst: Vec<PlacementKey>,
}

/// A cache of plans keyed by (mesh shape, global shape, src, dst). Shared by every mesh
/// derived from one [`ProcessMesh`](crate::ProcessMesh); errors are not cached.
#[derive(Debug, Default)]
pub struct PlanCache {
    plans: Mutex<HashMap<PlanKey, Arc<Plan>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl PlanCache {
    /// The plan for `request`, computed once.
    pub fn get(&self, request: &PlanRequest<'_>) -> Result<Arc<Plan>> {
        let key = PlanKey {
            mesh_shape: request.mesh_shape.to_vec(),
            global_shape: request.global_shape.to_vec(),
            src: request.src.iter().map(|&p| p.into()).collect(),
            dst: request.dst.iter().map(|&p| p.into()).collect(),
        };
        if let Some(found) = self
            .plans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(found.clone());
        }
        let planned = Arc::new(plan(request)?);
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.plans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, planned.clone());
        Ok(planned)
    }

    /// How many lookups found a cached plan.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// How many lookups had to plan.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Placement = Placement::Replicate;
    const S0: Placement = Placement::Shard(0);
    const S1: Placement = Placement::Shard(1);
    const PSUM: Placement = Placement::Partial(ReduceOp::Sum);
    const PAVG: Placement = Placement::Partial(ReduceOp::Avg);
    const PMAX: Placement = Placement::Partial(ReduceOp::Max);

    fn plan_of(mesh: &[usize], shape: &[usize], src: &[Placement], dst: &[Placement]) -> Plan {
        plan(&PlanRequest {
            mesh_shape: mesh,
            global_shape: shape,
            src,
            dst,
        })
        .expect("a plan")
    }

    fn kinds(plan: &Plan) -> Vec<(usize, StepKind)> {
        plan.steps.iter().map(|s| (s.mesh_dim, s.kind)).collect()
    }

    /// Replays a plan: every step must start from the current placement and end at the target.
    fn replay(src: &[Placement], plan: &Plan) -> Vec<Placement> {
        let mut state = src.to_vec();
        for step in &plan.steps {
            assert_eq!(state[step.mesh_dim], step.from, "{plan:?}");
            state[step.mesh_dim] = step.to;
            assert!(partials_commute(&state));
        }
        state
    }

    #[test]
    fn single_transitions_follow_the_table() {
        let cases = [
            (S0, R, StepKind::AllGather { tensor_dim: 0 }),
            (PSUM, R, StepKind::AllReduce { op: ReduceOp::Sum }),
            (
                PAVG,
                S1,
                StepKind::ReduceScatter {
                    op: ReduceOp::Avg,
                    tensor_dim: 1,
                },
            ),
            (
                S0,
                S1,
                StepKind::AllToAll {
                    from_dim: 0,
                    to_dim: 1,
                },
            ),
            (R, S1, StepKind::LocalChunk { tensor_dim: 1 }),
            (R, PMAX, StepKind::LocalPartition { op: ReduceOp::Max }),
            (S1, PSUM, StepKind::LocalShardToPartial { tensor_dim: 1 }),
        ];
        for (src, dst, kind) in cases {
            let plan = plan_of(&[4], &[10, 3], &[src], &[dst]);
            assert_eq!(kinds(&plan), vec![(0, kind)], "{src} -> {dst}");
        }
        assert_eq!(plan_of(&[4], &[10, 3], &[S0], &[S0]).steps, vec![]);
    }

    #[test]
    fn shard_to_other_partials_goes_through_replicate() {
        let plan = plan_of(&[2], &[4], &[S0], &[PMAX]);
        assert_eq!(
            kinds(&plan),
            vec![
                (0, StepKind::AllGather { tensor_dim: 0 }),
                (0, StepKind::LocalPartition { op: ReduceOp::Max })
            ]
        );
    }

    #[test]
    fn nested_shards_unshard_the_innermost_first() {
        let plan = plan_of(&[2, 3], &[10, 4], &[S0, S0], &[R, R]);
        assert_eq!(
            kinds(&plan),
            vec![
                (1, StepKind::AllGather { tensor_dim: 0 }),
                (0, StepKind::AllGather { tensor_dim: 0 })
            ]
        );
        // Sharding again nests outermost first.
        let plan = plan_of(&[2, 3], &[10, 4], &[R, R], &[S0, S0]);
        assert_eq!(replay(&[R, R], &plan), vec![S0, S0]);
        assert_eq!(plan.collectives(), vec![]);
        assert_eq!(plan.steps[0].mesh_dim, 0);
    }

    #[test]
    fn misaligned_orders_go_through_a_replicated_dim() {
        let plan = plan_of(&[2, 2], &[8, 8], &[S0, S1], &[S1, S0]);
        assert_eq!(replay(&[S0, S1], &plan), vec![S1, S0]);
        let ops: Vec<OpKind> = plan.collectives().into_iter().map(|(_, op)| op).collect();
        assert_eq!(ops.len(), 2, "{plan:?}");
        assert!(ops.contains(&OpKind::AllGather) && ops.contains(&OpKind::AllToAll));
    }

    #[test]
    fn reductions_run_while_the_tensor_is_sharded() {
        // All-reducing the shard then gathering beats gathering partials then reducing them.
        let plan = plan_of(&[2, 4], &[64, 64], &[PSUM, S0], &[R, R]);
        assert_eq!(
            kinds(&plan),
            vec![
                (0, StepKind::AllReduce { op: ReduceOp::Sum }),
                (1, StepKind::AllGather { tensor_dim: 0 })
            ]
        );
        // P -> S(0) on the outer dim with the inner dim sharding another dim is one step.
        let plan = plan_of(&[2, 4], &[64, 64], &[PSUM, S1], &[S0, S1]);
        assert_eq!(plan.collectives(), vec![(0, OpKind::ReduceScatter)]);
    }

    #[test]
    fn three_d_meshes_plan_every_dim() {
        let src = [S0, PSUM, S1];
        let dst = [S1, R, S0];
        let plan = plan_of(&[2, 2, 2], &[6, 5, 3], &src, &dst);
        assert_eq!(replay(&src, &plan), dst.to_vec());
        assert!(
            plan.collectives()
                .iter()
                .any(|&(dim, op)| dim == 1 && op == OpKind::AllReduce)
        );
    }

    #[test]
    fn invalid_requests_are_typed_errors() {
        let request = |src: &'static [Placement], dst: &'static [Placement]| {
            plan(&PlanRequest {
                mesh_shape: &[2, 2],
                global_shape: &[4, 4],
                src,
                dst,
            })
        };
        assert!(matches!(
            request(&[PSUM, R], &[PAVG, R]),
            Err(Error::PartialOpChange { mesh_dim: 0, .. })
        ));
        assert!(matches!(
            request(&[PMAX, PSUM], &[R, R]),
            Err(Error::MixedPartialOps { .. })
        ));
        assert!(matches!(
            request(&[R, R], &[R, Placement::Partial(ReduceOp::PreMulSum(0.0))]),
            Err(Error::UnsupportedPartial { mesh_dim: 1, .. })
        ));
        assert!(matches!(
            request(&[R, Placement::Shard(2)], &[R, R]),
            Err(Error::Mesh(MeshError::ShardDimOutOfRange { .. }))
        ));
        assert!(matches!(
            request(&[R], &[R, R]),
            Err(Error::Mesh(MeshError::PlacementCountMismatch { .. }))
        ));
    }

    #[test]
    fn plans_are_deterministic_and_cached() {
        let request = PlanRequest {
            mesh_shape: &[2, 2, 2],
            global_shape: &[7, 5, 3],
            src: &[S0, S1, PAVG],
            dst: &[S1, S0, S0],
        };
        let first = plan(&request).expect("a plan");
        assert_eq!(plan(&request).expect("a plan"), first);
        let cache = PlanCache::default();
        let a = cache.get(&request).expect("a plan");
        let b = cache.get(&request).expect("a plan");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(*a, first);
        assert_eq!((cache.hits(), cache.misses()), (1, 1));
        // PreMulSum factors are part of the key.
        let premul = |f: f64| [Placement::Partial(ReduceOp::PreMulSum(f)), R, R];
        let (half, quarter) = (premul(0.5), premul(0.25));
        for src in [&half, &quarter] {
            cache
                .get(&PlanRequest {
                    src,
                    dst: &[R, R, R],
                    ..request
                })
                .expect("a plan");
        }
        assert_eq!(cache.misses(), 3);
    }

    #[test]
    fn costs_follow_the_model() {
        // S(0) -> R over 4 ranks of a [8, 2] tensor: N = 2 x 2 = 4 elements per shard.
        let plan = plan_of(&[4], &[8, 2], &[S0], &[R]);
        let wire = 3 * 4;
        let copies = 4 + 4 * 4;
        assert_eq!(
            plan.cost,
            CostModel::LATENCY + wire + copies / CostModel::COPY_DIVISOR
        );
        assert_eq!(
            plan_of(&[4], &[8, 2], &[R], &[S0]).cost,
            4 / CostModel::COPY_DIVISOR
        );
    }
}
