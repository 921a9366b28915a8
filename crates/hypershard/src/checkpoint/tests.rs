//! Save at one layout, load at another; crashes mid-save; config checks; export.

mod paths;

use std::path::PathBuf;

use hypershard_tensor::{DType, Tensor};
use serde_json::json;

use super::*;
use crate::error::Error;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-ckpt-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The global weight `w[i][j] = 10·i + j + step`, a 4×6 f32 tensor.
fn w_block(step: u64, offset: [usize; 2], shape: [usize; 2]) -> Tensor {
    let mut values = Vec::new();
    for i in 0..shape[0] {
        for j in 0..shape[1] {
            values.push((10 * (offset[0] + i) + offset[1] + j) as f32 + step as f32);
        }
    }
    Tensor::from_vec(values, &shape).unwrap()
}

/// The global bias `b[i] = 100 + i`, 5 elements of f64, sharded unevenly on dim 0.
fn b_block(start: usize, len: usize) -> Tensor {
    Tensor::from_vec(
        (start..start + len).map(|i| 100.0 + i as f64).collect(),
        &[len],
    )
    .unwrap()
}

fn config() -> serde_json::Value {
    json!({"n_layer": 2, "n_embd": 8, "vocab_size": 256})
}

/// Saves `step` as 4 ranks on a 2×2 grid: rank r holds w rows 2·(r/2).., cols 3·(r%2)..,
/// b elements [0..2), [2..4), [4..5), [] for ranks 0..3, and rank 0 alone holds the scalar.
fn save_2x2(dir: &CheckpointDir, step: u64) -> PathBuf {
    let staging = dir.prepare_staging(step).unwrap();
    let b_splits = [(0, 2), (2, 2), (4, 1), (5, 0)];
    for (rank, &(start, len)) in b_splits.iter().enumerate() {
        let mut writer = ShardWriter::new(&staging, rank);
        let offset = [2 * (rank / 2), 3 * (rank % 2)];
        writer
            .add(
                BlockSpec {
                    name: "model/w",
                    global_shape: &[4, 6],
                    offset: &offset,
                    placement: Some("[Shard(0), Shard(1)] on 2x2"),
                },
                &w_block(step, offset, [2, 3]),
            )
            .unwrap();
        writer
            .add(
                BlockSpec {
                    name: "optim/b",
                    global_shape: &[5],
                    offset: &[start],
                    placement: None,
                },
                &b_block(start, len),
            )
            .unwrap();
        if rank == 0 {
            writer
                .add(
                    BlockSpec {
                        name: "model/scale",
                        global_shape: &[],
                        offset: &[],
                        placement: None,
                    },
                    &Tensor::scalar(2.5f32),
                )
                .unwrap();
        }
        writer.finish().unwrap();
    }
    dir.commit(CommitInfo {
        step,
        world_size: 4,
        model_config: config(),
        state: json!({"data_step": step, "rng": [1, 2]}),
    })
    .unwrap()
}

#[test]
fn saved_at_4_ranks_2x2_loads_at_2_ranks_and_at_1() {
    let root = scratch("reshard");
    let dir = CheckpointDir::new(root.join("checkpoints"));
    let committed = save_2x2(&dir, 7);
    assert_eq!(committed, dir.step_dir(7));
    // Open through the training output directory, as `--resume` and `sample` do.
    let ckpt = Checkpoint::open(&root).unwrap();
    assert_eq!(ckpt.step(), 7);
    assert_eq!(ckpt.metadata().state["data_step"], 7);
    let entry = ckpt.entry("model/w").unwrap();
    assert_eq!(entry.shape, vec![4, 6]);
    assert_eq!(entry.blocks.len(), 4);
    // Two ranks, FSDP on dim 0: rank r reads rows 2r..2r+2 (two saved blocks each).
    for rank in 0..2 {
        let want = Block {
            offset: vec![2 * rank, 0],
            shape: vec![2, 6],
        };
        let got = ckpt.read_block("model/w", &want).unwrap();
        assert_eq!(
            got.to_vec::<f32>().unwrap(),
            w_block(7, [2 * rank, 0], [2, 6]).to_vec::<f32>().unwrap()
        );
    }
    // An odd block straddling all four saved blocks.
    let odd = Block {
        offset: vec![1, 1],
        shape: vec![3, 4],
    };
    assert_eq!(
        ckpt.read_block("model/w", &odd)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        w_block(7, [1, 1], [3, 4]).to_vec::<f32>().unwrap()
    );
    // One rank: everything whole.
    assert_eq!(
        ckpt.read_tensor("model/w")
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        w_block(7, [0, 0], [4, 6]).to_vec::<f32>().unwrap()
    );
    assert_eq!(
        ckpt.read_tensor("optim/b")
            .unwrap()
            .to_vec::<f64>()
            .unwrap(),
        b_block(0, 5).to_vec::<f64>().unwrap()
    );
    assert_eq!(
        ckpt.read_tensor("model/scale")
            .unwrap()
            .item::<f32>()
            .unwrap(),
        2.5
    );
    // Two-rank uneven split of b: [0..3), [3..5).
    let b1 = ckpt
        .read_block(
            "optim/b",
            &Block {
                offset: vec![3],
                shape: vec![2],
            },
        )
        .unwrap();
    assert_eq!(b1.to_vec::<f64>().unwrap(), vec![103.0, 104.0]);
    assert!(matches!(
        ckpt.read_block(
            "optim/b",
            &Block {
                offset: vec![4],
                shape: vec![2]
            }
        ),
        Err(Error::BlockOutOfBounds { .. })
    ));
    assert!(matches!(
        ckpt.read_tensor("nope"),
        Err(Error::MissingTensor { .. })
    ));
}

#[test]
fn a_crash_mid_save_leaves_the_previous_checkpoint_loadable() {
    let root = scratch("crash");
    let dir = CheckpointDir::new(&root);
    save_2x2(&dir, 1);
    // Step 2: rank 0 finishes its shard, rank 1 dies half-way through writing its file (a
    // truncated shard, no index), ranks 2 and 3 never start.
    let staging = dir.prepare_staging(2).unwrap();
    let mut writer = ShardWriter::new(&staging, 0);
    writer
        .add(
            BlockSpec {
                name: "model/w",
                global_shape: &[4, 6],
                offset: &[0, 0],
                placement: None,
            },
            &w_block(2, [0, 0], [2, 3]),
        )
        .unwrap();
    writer.finish().unwrap();
    let full = std::fs::read(staging.join("rank-00000.safetensors")).unwrap();
    std::fs::write(
        staging.join("rank-00001.safetensors"),
        &full[..full.len() / 2],
    )
    .unwrap();
    // Readers still see step 1, whole and correct.
    let ckpt = Checkpoint::open(&root).unwrap();
    assert_eq!(ckpt.step(), 1);
    assert_eq!(
        ckpt.read_tensor("model/w")
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        w_block(1, [0, 0], [4, 6]).to_vec::<f32>().unwrap()
    );
    // A commit attempt over the broken staging directory is refused and changes nothing.
    assert!(matches!(
        dir.commit(CommitInfo {
            step: 2,
            world_size: 4,
            model_config: config(),
            state: json!({}),
        }),
        Err(Error::MissingShard { rank: 1, .. })
    ));
    assert_eq!(Checkpoint::open(&root).unwrap().step(), 1);
    // The next save of step 2 clears the debris and succeeds.
    save_2x2(&dir, 2);
    assert_eq!(Checkpoint::open(&root).unwrap().step(), 2);
    assert!(!dir.staging_dir(2).exists());
    // Even with `latest` lost, the newest complete step is found.
    std::fs::remove_file(root.join(LATEST_FILE)).unwrap();
    assert_eq!(Checkpoint::open(&root).unwrap().step(), 2);
}

#[test]
fn saving_the_same_step_again_replaces_it() {
    let root = scratch("replace");
    let dir = CheckpointDir::new(&root);
    save_2x2(&dir, 3);
    save_2x2(&dir, 3);
    let ckpt = Checkpoint::open(&root).unwrap();
    assert_eq!(ckpt.step(), 3);
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn another_model_config_is_a_typed_error() {
    let root = scratch("config");
    let dir = CheckpointDir::new(&root);
    save_2x2(&dir, 1);
    let ckpt = Checkpoint::open(&root).unwrap();
    ckpt.check_model_config(&config()).unwrap();
    let mut other = config();
    other["n_layer"] = json!(4);
    match ckpt.check_model_config(&other) {
        Err(Error::ConfigMismatch {
            field,
            saved,
            requested,
            ..
        }) => {
            assert_eq!(
                (field.as_str(), saved.as_str(), requested.as_str()),
                ("n_layer", "2", "4")
            );
        }
        other => panic!("expected ConfigMismatch, got {other:?}"),
    }
    assert!(matches!(
        Checkpoint::open(&root.join("missing")),
        Err(Error::NoCheckpoint { .. })
    ));
}

#[test]
fn inconsistent_and_incomplete_saves_are_refused() {
    let root = scratch("inconsistent");
    let dir = CheckpointDir::new(&root);
    let staging = dir.prepare_staging(1).unwrap();
    for (rank, global) in [(0usize, [4usize, 6]), (1, [4, 7])] {
        let mut writer = ShardWriter::new(&staging, rank);
        writer
            .add(
                BlockSpec {
                    name: "w",
                    global_shape: &global,
                    offset: &[2 * rank, 0],
                    placement: None,
                },
                &Tensor::zeros(&[2, 6], DType::F32).unwrap(),
            )
            .unwrap();
        writer.finish().unwrap();
    }
    let info = CommitInfo {
        step: 1,
        world_size: 2,
        model_config: config(),
        state: json!({}),
    };
    assert!(matches!(
        dir.commit(info.clone()),
        Err(Error::InconsistentTensor { .. })
    ));
    // Only half of a tensor saved: a gap.
    let staging = dir.prepare_staging(1).unwrap();
    let mut writer = ShardWriter::new(&staging, 0);
    writer
        .add(
            BlockSpec {
                name: "w",
                global_shape: &[4, 6],
                offset: &[0, 0],
                placement: None,
            },
            &Tensor::zeros(&[2, 6], DType::F32).unwrap(),
        )
        .unwrap();
    writer.finish().unwrap();
    let info = CommitInfo {
        world_size: 1,
        ..info
    };
    assert!(matches!(
        dir.commit(info),
        Err(Error::BlockCoverage {
            covered: 12,
            numel: 24,
            ..
        })
    ));
    assert!(matches!(
        Checkpoint::open(&root),
        Err(Error::NoCheckpoint { .. })
    ));
}

#[test]
fn export_writes_one_consolidated_file() {
    let root = scratch("export");
    let dir = CheckpointDir::new(&root);
    save_2x2(&dir, 5);
    let ckpt = Checkpoint::open(&root).unwrap();
    let out = root.join("model.safetensors");
    let strip = |name: &str| name.strip_prefix("model/").map(str::to_string);
    let summary = export_consolidated(&ckpt, &out, false, strip).unwrap();
    assert_eq!(summary.tensors, 2);
    assert_eq!(summary.bytes, 24 * 4 + 4);
    let loaded = hypershard_tensor::load_safetensors_file(&out).unwrap();
    assert_eq!(loaded.keys().collect::<Vec<_>>(), ["scale", "w"]);
    assert_eq!(
        loaded["w"].to_vec::<f32>().unwrap(),
        w_block(5, [0, 0], [4, 6]).to_vec::<f32>().unwrap()
    );
    assert!(matches!(
        export_consolidated(&ckpt, &out, false, strip),
        Err(Error::WouldOverwrite { .. })
    ));
    export_consolidated(&ckpt, &out, true, strip).unwrap();
}

#[test]
fn every_saved_block_carries_a_crc32c_and_a_flipped_byte_is_named_on_load() {
    let root = scratch("crc");
    let dir = CheckpointDir::new(&root);
    let path = save_2x2(&dir, 3);
    let checkpoint = Checkpoint::open(&path).unwrap();
    for entry in checkpoint.metadata().tensors.values() {
        for saved in &entry.blocks {
            assert!(saved.crc32c.is_some(), "{} has no checksum", saved.key);
        }
    }
    // Intact, the weight loads with its closed-form values.
    assert_eq!(
        checkpoint
            .read_tensor("model/w")
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        w_block(3, [0, 0], [4, 6]).to_vec::<f32>().unwrap()
    );
    drop(checkpoint);
    // Flip one bit in the last byte of rank 1's shard: the data of its last tensor.
    let shard = path.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();
    let checkpoint = Checkpoint::open(&path).unwrap();
    let last_key = SafetensorsIndex::open(&shard)
        .unwrap()
        .tensors()
        .iter()
        .max_by_key(|(_, t)| t.end)
        .map(|(k, _)| k.clone())
        .unwrap();
    match checkpoint.read_tensor(&last_key) {
        Err(Error::ChecksumMismatch {
            file,
            tensor,
            expected,
            actual,
            ..
        }) => {
            assert_eq!(file, shard);
            assert_eq!(tensor, last_key);
            assert_ne!(expected, actual);
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    std::fs::remove_dir_all(&root).unwrap();
}

mod metadata_fuzz {
    use super::super::reader::parse_metadata;
    use proptest::prelude::*;
    use std::path::Path;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Arbitrary bytes as metadata.json: a typed error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_metadata(&bytes, Path::new("/nonexistent"));
        }

        /// Well-formed JSON with hostile numbers (huge shapes, offsets past the end, blocks
        /// that overlap or leave holes, unknown dtypes) is refused without panicking or
        /// allocating from the claimed sizes.
        #[test]
        fn hostile_tensor_entries_are_refused_or_valid(
            shape in proptest::collection::vec(0usize..=usize::MAX, 0..4),
            offset in proptest::collection::vec(0usize..=usize::MAX, 0..4),
            block_shape in proptest::collection::vec(0usize..=usize::MAX, 0..4),
            dtype in prop_oneof![Just("float32"), Just("bfloat16"), Just("nonsense")],
        ) {
            let doc = serde_json::json!({
                "format": "hypershard-checkpoint", "version": 1, "step": 1, "world_size": 1,
                "model_config": {}, "state": {},
                "tensors": {"t": {"dtype": dtype, "shape": shape, "blocks": [
                    {"rank": 0, "file": "rank-00000.safetensors", "key": "t",
                     "offset": offset, "shape": block_shape}
                ]}}
            });
            let bytes = serde_json::to_vec(&doc).unwrap();
            if let Ok(meta) = parse_metadata(&bytes, Path::new("/nonexistent")) {
                // Only an exact single-block cover of a known dtype may pass.
                let entry = &meta.tensors["t"];
                prop_assert_eq!(&entry.blocks[0].block.shape, &entry.shape);
                prop_assert!(entry.blocks[0].block.offset.iter().all(|&o| o == 0));
            }
        }
    }
}
