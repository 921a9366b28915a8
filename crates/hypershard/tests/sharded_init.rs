//! `--init FILE` into a deferred model: each rank reads only its own rows of every tensor and
//! gets the same shards as a full load; a file that does not match is refused, naming the
//! tensor.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hypershard::Error;
use hypershard::fsdp::{
    DataParallelMesh, FsdpError, FsdpModule, FullyShardConfig, fully_shard, fully_shard_children,
    has_params,
};
use hypershard::nn::{Gpt, GptConfig, Module};
use hypershard::tensor::{DType, Tensor};
use hypershard::train::attach_init_file;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Uneven for 2, 3 and 4 ranks (67 vocabulary rows, 13 positions, 30 rows of c_attn).
fn config(seed: u64) -> GptConfig {
    GptConfig {
        vocab_size: 67,
        block_size: 13,
        n_layer: 2,
        n_head: 2,
        n_embd: 10,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed,
    }
}

fn shard_gpt(mut gpt: Gpt, config: &FullyShardConfig) -> Result<FsdpModule, FsdpError> {
    fully_shard_children(&mut gpt, config, &mut |name, block| {
        name.starts_with("transformer.h.") && has_params(block)
    })?;
    fully_shard(Box::new(gpt), config.clone()).map_err(|rejected| rejected.error)
}

fn local_bytes(model: &dyn Module) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    model
        .visit_params("", &mut |name, param| {
            out.push((name.to_string(), param.data()?.to_bytes()?));
            Ok(())
        })
        .expect("every shard materialised");
    out
}

/// Bytes of rows `torch.chunk` gives shard `rank` of `world` of every parameter.
fn own_row_bytes(gpt: &Gpt, rank: usize, world: usize) -> u64 {
    let mut total = 0u64;
    gpt.visit_params("", &mut |_, param| {
        let t = param.tensor()?;
        let rows = t.shape()[0];
        let span = hypershard::mesh::shard_span(rows, world, rank).expect("span");
        total += (span.len * t.numel() / rows * 4) as u64;
        Ok(())
    })
    .expect("visit");
    total
}

fn write_trained_like_file(dir: &Path) -> PathBuf {
    // Another seed than the models below start from, so a load that did nothing would show.
    let source = Gpt::new(config(99)).expect("source");
    let file = dir.join("init.safetensors");
    source.save_safetensors_file(&file).expect("save");
    file
}

#[derive(Debug)]
struct RankOut {
    deferred: Vec<(String, Vec<u8>)>,
    eager: Vec<(String, Vec<u8>)>,
    read: u64,
    own: u64,
}

#[test]
fn each_rank_reads_only_its_rows_and_gets_the_full_loads_shards() {
    let dir = scratch("sharded-init");
    let file = Arc::new(write_trained_like_file(&dir));
    let file_bytes = std::fs::metadata(file.as_path()).expect("size").len();
    for world in [1usize, 2, 3, 4] {
        let comms = hypershard::collectives::local::spawn_world(world).expect("world");
        let file = Arc::clone(&file);
        let outs = hypershard_testkit::run_ranks(world, move |rank| {
            let text = |e: &dyn std::fmt::Display| e.to_string();
            let mesh = DataParallelMesh::fsdp(comms[rank].clone()).map_err(|e| text(&e))?;
            let fsdp = FullyShardConfig::new(mesh);
            let mut deferred = Gpt::new_deferred(config(1)).map_err(|e| text(&e))?;
            let own = own_row_bytes(&deferred, rank, world);
            let index = attach_init_file(&mut deferred, &file).map_err(|e| text(&e))?;
            let deferred = shard_gpt(deferred, &fsdp).map_err(|e| text(&e))?;
            let read = index.bytes_read();
            // The reference: the whole file loaded into an eager model, then sharded.
            let mut eager = Gpt::new(config(1)).map_err(|e| text(&e))?;
            eager.load_safetensors_file(&file).map_err(|e| text(&e))?;
            let eager = shard_gpt(eager, &fsdp).map_err(|e| text(&e))?;
            Ok::<_, String>(RankOut {
                deferred: local_bytes(&deferred),
                eager: local_bytes(&eager),
                read,
                own,
            })
        })
        .unwrap_or_else(|e| panic!("world {world}: {e}"));
        for (rank, out) in outs.iter().enumerate() {
            assert_eq!(out.deferred, out.eager, "world {world} rank {rank}");
            assert_eq!(
                out.read, out.own,
                "world {world} rank {rank} read its rows only"
            );
            if world > 1 {
                assert!(
                    out.read < file_bytes / 2,
                    "world {world} rank {rank}: {out:?}"
                );
            }
        }
    }
}

#[test]
fn a_file_that_does_not_match_is_refused_naming_the_tensor_and_changes_nothing() {
    let dir = scratch("sharded-init-bad");
    // A model with one layer more than the file: a tensor is missing.
    let file = write_trained_like_file(&dir);
    let mut bigger = Gpt::new_deferred(GptConfig {
        n_layer: 3,
        ..config(1)
    })
    .expect("deferred");
    match attach_init_file(&mut bigger, &file) {
        Err(Error::InitFile { path, reason }) => {
            assert_eq!(path, file);
            assert!(
                reason.contains("transformer.h.2.") && reason.contains("missing"),
                "{reason}"
            );
        }
        other => panic!("expected InitFile, got {other:?}"),
    }
    let mut untouched = true;
    bigger
        .visit_params("", &mut |_, p| {
            untouched &= p.init.is_none() && p.is_deferred();
            Ok(())
        })
        .expect("visit");
    assert!(untouched, "nothing changes on a refusal");
    // A wider model: shapes differ.
    let mut wider = Gpt::new_deferred(GptConfig {
        n_embd: 12,
        ..config(1)
    })
    .expect("deferred");
    let error = attach_init_file(&mut wider, &file).expect_err("wrong shapes");
    let message = error.to_string();
    assert!(
        message.contains("init.safetensors") && message.contains("[67, 10]"),
        "{message}"
    );
    // A tensor the model does not have.
    let extra = dir.join("extra.safetensors");
    let one = Tensor::zeros(&[2], DType::F32).expect("t");
    let source = Gpt::new(config(1)).expect("source");
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    source
        .visit_params("", &mut |name, p| {
            tensors.push((name.to_string(), p.data()?.clone()));
            Ok(())
        })
        .expect("visit");
    tensors.push(("stray.weight".to_string(), one));
    hypershard::tensor::save_safetensors_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), &extra)
        .expect("save");
    let mut model = Gpt::new_deferred(config(1)).expect("deferred");
    let message = attach_init_file(&mut model, &extra)
        .expect_err("stray tensor")
        .to_string();
    assert!(message.contains("stray.weight"), "{message}");
    // Garbage is refused with the path.
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").expect("write");
    let message = attach_init_file(&mut model, &garbage)
        .expect_err("garbage")
        .to_string();
    assert!(message.contains("garbage.safetensors"), "{message}");
}
