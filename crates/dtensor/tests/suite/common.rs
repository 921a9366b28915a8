//! Shared helpers: run a closure on every rank of a local-backend mesh with counting
//! communicators, and the first-principles shard math and partial values the tests expect.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hypershard_dtensor::collectives::{self, CommCounter, Communicator, OpKind};
use hypershard_dtensor::tensor::{DType, Tensor};
use hypershard_dtensor::{DeviceMesh, Placement, ProcessMesh, ReduceOp, Result};
use hypershard_testkit::{RunRanksError, run_ranks_with_deadline};

/// Deadline for one multi-rank run: far above what a case needs, so a hang fails the test.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// What every rank's closure gets: its mesh and the counter wrapping its world communicator.
pub struct RankCtx {
    pub mesh: ProcessMesh,
    pub counter: Arc<CommCounter>,
}

impl RankCtx {
    /// Calls of `op` on the world communicator and every communicator split from it.
    pub fn calls(&self, op: OpKind) -> u64 {
        total(&self.counter, op)
    }

    /// Calls per op kind (all ops but `split`), over the whole communicator tree.
    pub fn counts(&self) -> BTreeMap<OpKind, u64> {
        OpKind::ALL
            .iter()
            .filter(|&&op| op != OpKind::Split)
            .map(|&op| (op, self.calls(op)))
            .filter(|&(_, calls)| calls > 0)
            .collect()
    }

    /// Clears every count in the tree.
    pub fn reset(&self) {
        reset(&self.counter);
    }
}

fn total(counter: &CommCounter, op: OpKind) -> u64 {
    counter.calls(op) + counter.children().iter().map(|c| total(c, op)).sum::<u64>()
}

fn reset(counter: &CommCounter) {
    counter.reset();
    for child in counter.children() {
        reset(&child);
    }
}

/// Runs `f` on every rank of a mesh of `shape` over a local world, returning each rank's
/// result in rank order.
pub fn on_mesh<T, F>(shape: &[usize], names: &[&str], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T> + Send + Sync + 'static,
{
    let world_size: usize = shape.iter().product();
    let comms = collectives::local::spawn_world(world_size).expect("local world");
    on_comms(comms, shape, names, f)
}

/// Like [`on_mesh`] over given world communicators (one per rank, in rank order).
pub fn on_comms<T, F>(
    comms: Vec<Arc<dyn Communicator>>,
    shape: &[usize],
    names: &[&str],
    f: F,
) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T> + Send + Sync + 'static,
{
    let world_size = comms.len();
    let slots = slots(comms);
    let shape = shape.to_vec();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let outcome = run_ranks_with_deadline(world_size, DEADLINE, move |rank| {
        let comm = take(&slots, rank);
        let counter = CommCounter::new(comm);
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let device_mesh = DeviceMesh::new(&shape, &names)?;
        let mesh = ProcessMesh::new(device_mesh, counter.clone())?;
        f(RankCtx { mesh, counter })
    });
    match outcome {
        Ok(values) => values,
        Err(RunRanksError::Rank { rank, error }) => panic!("rank {rank} failed: {error}"),
        Err(other) => panic!("{other}"),
    }
}

/// One communicator per rank, each taken once by its rank's thread.
pub type Slots = Arc<Vec<Mutex<Option<Arc<dyn Communicator>>>>>;

/// Puts a world's communicators into slots.
pub fn slots(comms: Vec<Arc<dyn Communicator>>) -> Slots {
    Arc::new(comms.into_iter().map(|c| Mutex::new(Some(c))).collect())
}

/// Takes rank `rank`'s communicator.
pub fn take(slots: &Slots, rank: usize) -> Arc<dyn Communicator> {
    // invariant: each rank takes its own slot exactly once.
    slots[rank].lock().unwrap().take().unwrap()
}

/// The full test tensor: element at flat index `i` is `i + 1` (f64, exact).
pub fn full_tensor(shape: &[usize]) -> Tensor {
    let numel: usize = shape.iter().product();
    let values: Vec<f64> = (0..numel).map(|i| i as f64 + 1.0).collect();
    Tensor::from_vec(values, shape).expect("numel matches")
}

/// The `(offset, len)` along every tensor dim of the block that the rank at `coordinate`
/// holds, written out from the `torch.chunk` rule (chunk = ceil(L / n), trailing shards short
/// or empty) and nesting in mesh-dim order.
pub fn expected_spans(
    global: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
    coordinate: &[usize],
) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = global.iter().map(|&g| (0, g)).collect();
    for ((placement, &n), &k) in placements.iter().zip(mesh_shape).zip(coordinate) {
        if let Placement::Shard(d) = placement {
            let (offset, len) = spans[*d];
            let chunk = len.div_ceil(n);
            let start = (k * chunk).min(len);
            let end = ((k + 1) * chunk).min(len);
            spans[*d] = (offset + start, end - start);
        }
    }
    spans
}

/// The block of `full` at `spans`.
pub fn block(full: &Tensor, spans: &[(usize, usize)]) -> Tensor {
    let mut t = full.clone();
    for (d, &(offset, len)) in spans.iter().enumerate() {
        t = t.narrow(d, offset, len).expect("span inside the tensor");
    }
    t.contiguous().expect("contiguous copy")
}

/// A partial value of `x` held at coordinate `c` of a mesh dim of `n` ranks, chosen so that
/// the reduction `op` over `c` gives `x` back and the partials differ across ranks.
pub fn partial_value(op: ReduceOp, x: f64, c: usize, n: usize) -> f64 {
    let c_f = c as f64;
    match op {
        ReduceOp::Sum => {
            if c == 0 {
                x - (n * (n - 1) / 2) as f64
            } else {
                c_f
            }
        }
        ReduceOp::Avg => x + c_f - (n as f64 - 1.0) / 2.0,
        ReduceOp::Max => x - c_f,
        ReduceOp::Min => x + c_f,
        ReduceOp::PreMulSum(factor) => {
            if c == 0 {
                x / factor - (n * (n - 1) / 2) as f64
            } else {
                c_f
            }
        }
        ReduceOp::Product => {
            if c == 0 {
                x
            } else {
                1.0
            }
        }
    }
}

/// The local tensor of the rank at `coordinate` for `full` under `placements`: its block,
/// with the partial values of every partial mesh dim applied in mesh-dim order.
pub fn expected_local(
    full: &Tensor,
    mesh_shape: &[usize],
    placements: &[Placement],
    coordinate: &[usize],
) -> Tensor {
    let spans = expected_spans(full.shape(), mesh_shape, placements, coordinate);
    let mut values = block(full, &spans).to_vec::<f64>().expect("f64");
    for (mesh_dim, placement) in placements.iter().enumerate() {
        if let Placement::Partial(op) = placement {
            for v in &mut values {
                *v = partial_value(*op, *v, coordinate[mesh_dim], mesh_shape[mesh_dim]);
            }
        }
    }
    let shape: Vec<usize> = spans.iter().map(|&(_, len)| len).collect();
    Tensor::from_vec(values, &shape).expect("numel matches")
}

/// The values and shape of a tensor, for comparisons across threads.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl Snapshot {
    pub fn of(t: &Tensor) -> Snapshot {
        Snapshot {
            shape: t.shape().to_vec(),
            values: t.to_f64_vec().expect("readable"),
        }
    }
}

/// `DType::F64` for brevity.
pub const F64: DType = DType::F64;
