//! A sharded checkpoint round trip: 4 ranks on a 2 x 2 mesh save their DTensors in
//! hypershard's distributed checkpoint format (`hypershard::checkpoint`: one safetensors shard
//! per rank plus `metadata.json` naming every block's global offset), then 3 ranks on a 1-D
//! mesh load them back under other placements, and every value must come back bit for bit.
//! Run: `cargo run -p hypershard-dtensor --example checkpoint` (`cargo test` runs it too).
//!
//! Saving: a `Partial` value is reduced first (a checkpoint holds values, not pending sums);
//! then each rank writes its local block at the offset `mesh::local_block` gives, and of the
//! replicas of a block only the one at coordinate 0 of every non-sharding mesh dim writes it,
//! so each element is saved exactly once. Loading: each rank asks for the block its new
//! placement gives it; the reader assembles it from whichever saved blocks overlap.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hypershard::checkpoint::BlockSpec;
use hypershard::checkpoint::{Block, Checkpoint, CheckpointDir, CommitInfo, ShardWriter};
use hypershard_dtensor::mesh::{ReduceOp, local_block};
use hypershard_dtensor::tensor::RandomInit;
use hypershard_dtensor::{
    Communicator, DTensor, DType, Placement, ProcessMesh, Tensor, init_process_mesh, run_local,
};

type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SAVE_WORLD: usize = 4;
const LOAD_WORLD: usize = 3;
const STEP: u64 = 1;
const DEADLINE: Duration = Duration::from_secs(60);

/// One tensor of the checkpoint: its layout when saved (2 x 2 mesh "dp" x "tp") and when
/// loaded (1-D mesh of 3), and the seed of its values.
struct Spec {
    name: &'static str,
    shape: &'static [usize],
    saved: [Placement; 2],
    loaded: [Placement; 1],
    seed: u64,
}

const SPECS: [Spec; 4] = [
    // Sharded on both mesh dims (rows over dp, columns over tp); loaded column-sharded over 3.
    Spec {
        name: "weight",
        shape: &[10, 6],
        saved: [Placement::Shard(0), Placement::Shard(1)],
        loaded: [Placement::Shard(1)],
        seed: 1,
    },
    // Replicated over dp, sharded over tp: only dp coordinate 0 writes; loaded replicated.
    Spec {
        name: "bias",
        shape: &[7],
        saved: [Placement::Replicate, Placement::Shard(0)],
        loaded: [Placement::Replicate],
        seed: 2,
    },
    // Fully replicated: rank 0 alone writes; loaded as uneven row shards (5 rows over 3).
    Spec {
        name: "embedding",
        shape: &[5, 3],
        saved: [Placement::Replicate, Placement::Replicate],
        loaded: [Placement::Shard(0)],
        seed: 3,
    },
    // A pending sum over dp (each dp rank holds half of the value), reduced before saving.
    Spec {
        name: "grad",
        shape: &[9, 4],
        saved: [Placement::Partial(ReduceOp::Sum), Placement::Shard(0)],
        loaded: [Placement::Shard(0)],
        seed: 4,
    },
];

/// The global values of `spec`, the same on any mesh: `DTensor::rand` draws by global index.
fn init(spec: &Spec) -> RandomInit {
    RandomInit::normal(spec.seed, 0.0, 1.0)
}

/// This rank's DTensor of `spec` in its saved layout.
fn saved_tensor(mesh: &ProcessMesh, spec: &Spec) -> AnyResult<DTensor> {
    let partial = spec
        .saved
        .iter()
        .any(|p| matches!(p, Placement::Partial(_)));
    if !partial {
        return Ok(DTensor::rand(
            mesh,
            spec.shape,
            DType::F32,
            init(spec),
            &spec.saved,
        )?);
    }
    // Halves are exact in binary floating point, so the two dp ranks' halves sum back to
    // exactly the drawn values.
    let placements: Vec<Placement> = spec
        .saved
        .iter()
        .map(|p| match p {
            Placement::Partial(_) => Placement::Replicate,
            other => *other,
        })
        .collect();
    let whole = DTensor::rand(mesh, spec.shape, DType::F32, init(spec), &placements)?;
    let half = whole.to_local().scale(0.5)?;
    Ok(DTensor::from_local(
        half,
        mesh,
        &spec.saved,
        Some(spec.shape),
    )?)
}

/// Saves `tensors` as the checkpoint of `STEP` under `root`. Collective over `world`.
fn save(
    world: &Arc<dyn Communicator>,
    mesh: &ProcessMesh,
    root: &CheckpointDir,
    tensors: &[(&str, DTensor)],
) -> AnyResult<()> {
    let rank = world.rank();
    if rank == 0 {
        root.prepare_staging(STEP)?;
    }
    world.barrier()?;
    let mut writer = ShardWriter::new(root.staging_dir(STEP), rank);
    for (name, tensor) in tensors {
        let reduced: Vec<Placement> = tensor
            .placements()
            .iter()
            .map(|p| match p {
                Placement::Partial(_) => Placement::Replicate,
                other => *other,
            })
            .collect();
        let tensor = tensor.redistribute(&reduced)?;
        let writes = tensor
            .placements()
            .iter()
            .zip(mesh.coordinate())
            .all(|(placement, &index)| placement.is_shard() || index == 0);
        if !writes {
            continue;
        }
        let block = local_block(tensor.shape(), mesh.mesh(), tensor.placements(), rank)?;
        writer.add(
            BlockSpec {
                name,
                global_shape: tensor.shape(),
                offset: &block.offset,
                placement: Some(&format!("{:?}", tensor.placements())),
            },
            tensor.to_local(),
        )?;
    }
    writer.finish()?;
    world.barrier()?;
    if rank == 0 {
        root.commit(CommitInfo {
            step: STEP,
            world_size: world.size(),
            model_config: serde_json::Value::Null,
            state: serde_json::Value::Null,
        })?;
    }
    world.barrier()?;
    Ok(())
}

/// Loads tensor `name` from `checkpoint` as a DTensor laid out as `placements` on `mesh`.
fn load(
    checkpoint: &Checkpoint,
    mesh: &ProcessMesh,
    name: &str,
    placements: &[Placement],
) -> AnyResult<DTensor> {
    let shape = checkpoint.entry(name)?.shape.clone();
    let mine = local_block(&shape, mesh.mesh(), placements, mesh.rank())?;
    let local = checkpoint.read_block(
        name,
        &Block {
            offset: mine.offset,
            shape: mine.shape,
        },
    )?;
    Ok(DTensor::from_local(local, mesh, placements, Some(&shape))?)
}

fn save_rank(world: Arc<dyn Communicator>, root: &Path) -> AnyResult<String> {
    let mesh = init_process_mesh(Arc::clone(&world), &[2, 2], &["dp", "tp"])?;
    let tensors = SPECS
        .iter()
        .map(|spec| Ok((spec.name, saved_tensor(&mesh, spec)?)))
        .collect::<AnyResult<Vec<_>>>()?;
    save(&world, &mesh, &CheckpointDir::new(root), &tensors)?;
    let local: Vec<String> = tensors
        .iter()
        .map(|(name, t)| format!("{name} {:?}", t.to_local().shape()))
        .collect();
    Ok(format!(
        "save rank {} at {:?}: {}",
        world.rank(),
        mesh.coordinate(),
        local.join(", ")
    ))
}

fn load_rank(world: Arc<dyn Communicator>, root: &Path) -> AnyResult<String> {
    let mesh = init_process_mesh(Arc::clone(&world), &[LOAD_WORLD], &["dp"])?;
    // `Checkpoint::open` follows the root's `latest` pointer to the committed step.
    let checkpoint = Checkpoint::open(root)?;
    let mut local = Vec::new();
    for spec in &SPECS {
        let tensor = load(&checkpoint, &mesh, spec.name, &spec.loaded)?;
        let expected = Tensor::random(spec.shape, DType::F32, init(spec))?;
        assert_eq!(tensor.placements(), &spec.loaded[..]);
        assert_eq!(tensor.shape(), spec.shape);
        // Bit for bit: a checkpoint copies values, it never computes them.
        let got: Vec<u32> = tensor
            .full_tensor()?
            .to_vec::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let want: Vec<u32> = expected
            .to_vec::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, want, "{} differs after the round trip", spec.name);
        local.push(format!("{} {:?}", spec.name, tensor.to_local().shape()));
    }
    Ok(format!("load rank {}: {}", world.rank(), local.join(", ")))
}

/// A fresh directory for this run's checkpoint.
fn scratch_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!(
        "hypershard-dtensor-checkpoint-{}-{nanos}",
        std::process::id()
    ))
}

/// Runs `f` on `world` local ranks and returns their lines, or the first rank's error.
fn on_ranks(
    world: usize,
    root: &Path,
    f: fn(Arc<dyn Communicator>, &Path) -> AnyResult<String>,
) -> AnyResult<Vec<String>> {
    let root = root.to_path_buf();
    // A rank's checkpoint error comes back as its value, so `run_local`'s own errors (a
    // panic, the deadline) stay distinct from it.
    let outcomes = run_local(world, DEADLINE, move |comm| Ok(f(comm, &root)))?;
    outcomes.into_iter().collect()
}

fn main() -> AnyResult<()> {
    let root = scratch_dir();
    let outcome = (|| -> AnyResult<Vec<String>> {
        let mut lines = on_ranks(SAVE_WORLD, &root, save_rank)?;
        lines.extend(on_ranks(LOAD_WORLD, &root, load_rank)?);
        Ok(lines)
    })();
    // The checkpoint is scratch: remove it whatever happened.
    let _ = std::fs::remove_dir_all(&root);
    for line in outcome? {
        println!("{line}");
    }
    println!(
        "{} tensors saved by {SAVE_WORLD} ranks (2 x 2 mesh) loaded equal by {LOAD_WORLD} ranks",
        SPECS.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    /// `cargo test` builds this example as a test (`test = true` in Cargo.toml) and runs its
    /// main: the assertions on every loaded value are there.
    #[test]
    fn checkpoint_round_trip_at_another_world_size_and_layout() {
        if let Err(error) = super::main() {
            panic!("checkpoint example failed: {error}");
        }
    }
}
