//! Where a rank's local parameter shard sits in the global tensor, and saving / loading the
//! model and optimizer shards through the checkpoint module.

use std::collections::BTreeMap;

use hypershard_collectives::Communicator;
use hypershard_fsdp::DataParallelMesh;
use hypershard_mesh::shard_span;
use hypershard_nn::Module;

use super::fault::{Fault, FaultPoint};
use super::optimizer::{Moments, ShardedAdamW, restored_moment};
use crate::checkpoint::{Block, BlockSpec, Checkpoint, CheckpointDir, CommitInfo, ShardWriter};
use crate::error::{Error, Result};

/// The checkpoint name of a model parameter.
pub fn model_key(name: &str) -> String {
    format!("model/{name}")
}

fn moment_key(which: &str, name: &str) -> String {
    format!("optim/{which}/{name}")
}

/// Where a local tensor of `local_shape` sits in the global `global_shape`, given FSDP's
/// dim-0 chunking (torch.chunk) over the shard group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlace {
    /// The block in the global tensor.
    pub block: Block,
    /// Whether this rank is the one that saves it (one copy of every element is saved: the
    /// first replica, and for a parameter kept whole, shard rank 0).
    pub saves: bool,
}

/// Places a local shard: a dim-0 chunk at its torch.chunk offset, or (a parameter FSDP keeps
/// whole, or a scalar) the whole tensor.
pub fn place(
    name: &str,
    global_shape: &[usize],
    local_shape: &[usize],
    mesh: &DataParallelMesh,
) -> Result<ShardPlace> {
    let first_replica = mesh.rank() / mesh.shard_world().max(1) == 0;
    let whole = ShardPlace {
        block: Block::whole(global_shape),
        saves: first_replica && mesh.shard_rank() == 0,
    };
    let Some(&rows) = global_shape.first() else {
        return Ok(whole);
    };
    let span = shard_span(rows, mesh.shard_world(), mesh.shard_rank()).map_err(|_| {
        Error::InconsistentTensor {
            name: name.to_string(),
            reason: format!("no shard {} of {}", mesh.shard_rank(), mesh.shard_world()),
        }
    })?;
    let mut expected = global_shape.to_vec();
    expected[0] = span.len;
    if local_shape == expected.as_slice() {
        let mut offset = vec![0; global_shape.len()];
        offset[0] = span.offset;
        return Ok(ShardPlace {
            block: Block {
                offset,
                shape: expected,
            },
            saves: first_replica,
        });
    }
    if local_shape == global_shape {
        return Ok(whole);
    }
    Err(Error::InconsistentTensor {
        name: name.to_string(),
        reason: format!(
            "local shard {local_shape:?} is neither dim-0 chunk {} of {global_shape:?} over {} nor the whole",
            mesh.shard_rank(),
            mesh.shard_world()
        ),
    })
}

/// What a save or load needs to know about the job.
pub struct ShardContext<'a> {
    /// The data-parallel mesh.
    pub mesh: &'a DataParallelMesh,
    /// The world communicator (barriers).
    pub world: &'a dyn Communicator,
    /// Global shapes by parameter name, recorded before wrapping.
    pub global_shapes: &'a BTreeMap<String, Vec<usize>>,
}

fn global_shape<'a>(ctx: &'a ShardContext<'_>, name: &str) -> Result<&'a Vec<usize>> {
    ctx.global_shapes
        .get(name)
        .ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
        })
}

/// What [`save`] writes besides the tensors, and the fault it may fire (tests only).
#[derive(Debug)]
pub struct SaveOptions {
    /// Step, world size, model configuration and resume state.
    pub info: CommitInfo,
    /// A [`FaultPoint::Checkpoint`] fault to fire after this rank's shard is written.
    pub fault: Option<Fault>,
}

/// Saves the model's and optimizer's local shards as the checkpoint of `step`. Collective
/// over the world: rank 0 prepares and commits, every rank writes its shard in between.
pub fn save(
    ctx: &ShardContext<'_>,
    root: &CheckpointDir,
    module: &dyn Module,
    optimizer: &ShardedAdamW,
    options: SaveOptions,
) -> Result<()> {
    let SaveOptions { info, fault } = options;
    let rank = ctx.world.rank();
    if rank == 0 {
        root.prepare_staging(info.step)?;
    }
    ctx.world.barrier()?;
    let mut writer = ShardWriter::new(root.staging_dir(info.step), rank);
    let mut failure: Option<Error> = None;
    module.visit_params("", &mut |name, param| {
        if failure.is_some() {
            return Ok(());
        }
        let result = (|| -> Result<()> {
            let data = param.data()?;
            let global = global_shape(ctx, name)?;
            let placed = place(name, global, data.shape(), ctx.mesh)?;
            if !placed.saves {
                return Ok(());
            }
            let placement = if placed.block.shape == *global {
                "Replicate".to_string()
            } else {
                format!("Shard(0) over {}", ctx.mesh.shard_world())
            };
            let key = model_key(name);
            // Written from host memory: a device shard is copied once, a host one is itself.
            let host = data.to_host().map_err(|source| Error::Tensor {
                name: name.to_string(),
                source,
            })?;
            writer.add(
                BlockSpec {
                    name: &key,
                    global_shape: global,
                    offset: &placed.block.offset,
                    placement: Some(&placement),
                },
                &host,
            )?;
            if let Some(moments) = optimizer.moments.get(name) {
                for (which, moment) in [
                    ("exp_avg", &moments.exp_avg),
                    ("exp_avg_sq", &moments.exp_avg_sq),
                ] {
                    let key = moment_key(which, name);
                    // As the shard: copied from a device once, a host one is itself.
                    let tensor = moment.to_host().map_err(|source| Error::Tensor {
                        name: key.clone(),
                        source,
                    })?;
                    writer.add(
                        BlockSpec {
                            name: &key,
                            global_shape: global,
                            offset: &placed.block.offset,
                            placement: Some(&placement),
                        },
                        &tensor,
                    )?;
                }
            }
            Ok(())
        })();
        if let Err(error) = result {
            failure = Some(error);
        }
        Ok(())
    })?;
    if let Some(error) = failure {
        return Err(error);
    }
    writer.finish()?;
    Fault::maybe_fire(fault.as_ref(), FaultPoint::Checkpoint, info.step, rank);
    ctx.world.barrier()?;
    if rank == 0 {
        root.commit(info)?;
    }
    ctx.world.barrier()?;
    Ok(())
}

/// Loads this rank's blocks of the model (and, when `optimizer` is given and the checkpoint
/// has them, of the optimizer moments) from `checkpoint`, whatever layout saved it.
pub fn load(
    ctx: &ShardContext<'_>,
    checkpoint: &Checkpoint,
    module: &mut dyn Module,
    mut optimizer: Option<&mut ShardedAdamW>,
) -> Result<()> {
    let mut failure: Option<Error> = None;
    module.visit_params_mut("", &mut |name, param| {
        if failure.is_some() {
            return Ok(());
        }
        let result = (|| -> Result<()> {
            let data = param.data()?;
            let global = global_shape(ctx, name)?;
            let placed = place(name, global, data.shape(), ctx.mesh)?;
            let saved = checkpoint
                .read_block(&model_key(name), &placed.block)?
                .to_device(&data.device())
                .map_err(|source| Error::Tensor {
                    name: name.to_string(),
                    source,
                })?;
            // Read into host memory; onto the shard's device (no copy when that is the host).
            data.copy_from(&saved).map_err(|source| Error::Tensor {
                name: name.to_string(),
                source,
            })?;
            if let Some(optimizer) = optimizer.as_deref_mut() {
                let key = moment_key("exp_avg", name);
                if checkpoint.metadata().tensors.contains_key(&key) {
                    let exp_avg =
                        restored_moment(&key, &checkpoint.read_block(&key, &placed.block)?, data)?;
                    let key = moment_key("exp_avg_sq", name);
                    let exp_avg_sq =
                        restored_moment(&key, &checkpoint.read_block(&key, &placed.block)?, data)?;
                    optimizer.moments.insert(
                        name.to_string(),
                        Moments {
                            exp_avg,
                            exp_avg_sq,
                        },
                    );
                }
            }
            Ok(())
        })();
        if let Err(error) = result {
            failure = Some(error);
        }
        Ok(())
    })?;
    failure.map_or(Ok(()), Err)
}

/// Global shapes of every parameter of an unwrapped module.
pub fn global_shapes(module: &dyn Module) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut shapes = BTreeMap::new();
    module.visit_params("", &mut |name, param| {
        shapes.insert(name.to_string(), param.tensor()?.shape().to_vec());
        Ok(())
    })?;
    Ok(shapes)
}

/// Reads a full model from a checkpoint into an unwrapped module (for `sample`).
pub fn load_whole(checkpoint: &Checkpoint, module: &mut dyn Module) -> Result<()> {
    let mut failure: Option<Error> = None;
    module.visit_params_mut("", &mut |name, param| {
        if failure.is_some() {
            return Ok(());
        }
        let result = checkpoint.read_tensor(&model_key(name)).and_then(|saved| {
            param
                .data()?
                .copy_from(&saved)
                .map_err(|source| Error::Tensor {
                    name: name.to_string(),
                    source,
                })
        });
        if let Err(error) = result {
            failure = Some(error);
        }
        Ok(())
    })?;
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn local_shards_are_placed_at_their_torch_chunk_offsets() {
        // Two ranks of plain FSDP: 5 rows chunk as 3 + 2.
        let comms = hypershard_collectives::local::spawn_world(2).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let mesh = DataParallelMesh::fsdp(Arc::clone(&comm)).unwrap();
                    let rank = comm.rank();
                    let rows = [3, 2][rank];
                    let placed = place("w", &[5, 4], &[rows, 4], &mesh).unwrap();
                    assert_eq!(placed.block.offset, vec![3 * rank, 0]);
                    assert_eq!(placed.block.shape, vec![rows, 4]);
                    assert!(placed.saves);
                    // A scalar, or a tensor kept whole: only shard rank 0 saves it.
                    let scalar = place("s", &[], &[], &mesh).unwrap();
                    assert_eq!(scalar.saves, rank == 0);
                    let whole = place("r", &[5, 4], &[5, 4], &mesh).unwrap();
                    assert_eq!(
                        (whole.block.offset.clone(), whole.saves),
                        (vec![0, 0], rank == 0)
                    );
                    assert!(matches!(
                        place("w", &[5, 4], &[1, 4], &mesh),
                        Err(Error::InconsistentTensor { .. })
                    ));
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
    }
}
