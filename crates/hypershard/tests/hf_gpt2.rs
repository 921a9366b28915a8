//! Hugging Face GPT-2 folders: a checkpoint in `transformers`' layout (names, `Conv1D` weights
//! stored `[in, out]`, mask buffers, tied `lm_head`, config.json) made here loads sharded into
//! the same shards as the nanoGPT weights it was made from, trains, exports back to the same
//! layout, and reloads equal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use hypershard::Error;
use hypershard::fsdp::{
    DataParallelMesh, FsdpError, FsdpModule, FullyShardConfig, fully_shard, fully_shard_children,
    has_params,
};
use hypershard::nn::{Gpt, GptConfig, Module};
use hypershard::tensor::{DType, Tensor};
use hypershard::train::{attach_hf_init, is_conv1d_weight};
use serde_json::json;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-hf-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Uneven for 2, 3 and 4 ranks (67 vocabulary rows, 30 rows of c_attn, 40 of c_fc).
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

fn params(model: &dyn Module) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    model
        .visit_params("", &mut |name, p| {
            out.push((name.to_string(), p.data()?.contiguous()?));
            Ok(())
        })
        .expect("every parameter materialised");
    out
}

/// How a test writes the folder.
#[derive(Clone, Copy)]
struct Layout {
    /// Names with `transformer.` (GPT2LMHeadModel) or without (GPT2Model).
    prefixed: bool,
    /// Extra positions in wpe beyond the model's block size.
    extra_positions: usize,
}

/// Writes `gpt` as transformers would: Conv1D weights transposed, the causal-mask buffers
/// and a copy of the tied lm_head alongside, and a config.json.
fn write_hf(dir: &Path, gpt: &Gpt, layout: Layout) {
    std::fs::create_dir_all(dir).expect("dir");
    let c = *gpt.config();
    let t = c.block_size + layout.extra_positions;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (name, tensor) in params(gpt) {
        let stored = if is_conv1d_weight(&name) {
            tensor
                .transpose(0, 1)
                .and_then(|t| t.contiguous())
                .expect("t")
        } else if name == "transformer.wpe.weight" && layout.extra_positions > 0 {
            let extra =
                Tensor::full(&[layout.extra_positions, c.n_embd], 7.0, DType::F32).expect("extra");
            Tensor::cat(&[&tensor, &extra], 0).expect("cat")
        } else {
            tensor
        };
        let name = if layout.prefixed {
            name
        } else {
            name.strip_prefix("transformer.")
                .expect("prefix")
                .to_string()
        };
        tensors.push((name, stored));
    }
    let prefix = if layout.prefixed { "transformer." } else { "" };
    for layer in 0..c.n_layer {
        let mask = Tensor::ones(&[1, 1, t, t], DType::F32).expect("mask");
        tensors.push((format!("{prefix}h.{layer}.attn.bias"), mask));
        let masked = Tensor::full(&[], -1e4, DType::F32).expect("masked");
        tensors.push((format!("{prefix}h.{layer}.attn.masked_bias"), masked));
    }
    if layout.prefixed {
        let wte = tensors[0].1.clone();
        tensors.push(("lm_head.weight".to_string(), wte));
    }
    hypershard::tensor::save_safetensors_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        &dir.join("model.safetensors"),
    )
    .expect("save");
    let config = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": t,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": null,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.1,
        "tie_word_embeddings": true,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&config).expect("json"),
    )
    .expect("config");
}

fn shard_gpt(mut gpt: Gpt, config: &FullyShardConfig) -> Result<FsdpModule, FsdpError> {
    fully_shard_children(&mut gpt, config, &mut |name, block| {
        name.starts_with("transformer.h.") && has_params(block)
    })?;
    fully_shard(Box::new(gpt), config.clone()).map_err(|rejected| rejected.error)
}

fn local_bytes(model: &dyn Module) -> Vec<(String, Vec<u8>)> {
    params(model)
        .into_iter()
        .map(|(n, t)| (n, t.to_bytes().expect("bytes")))
        .collect()
}

/// Bytes of the elements `torch.chunk` gives shard `rank` of `world` of every parameter.
fn own_bytes(gpt: &Gpt, rank: usize, world: usize) -> u64 {
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

#[derive(Debug)]
struct RankOut {
    from_hf: Vec<(String, Vec<u8>)>,
    reference: Vec<(String, Vec<u8>)>,
    read: u64,
    own: u64,
}

#[test]
fn an_hf_folder_loads_sharded_into_the_shards_of_the_weights_it_was_made_from() {
    let dir = scratch("sharded");
    // Another seed than the models below start from, so a load that did nothing would show.
    let source = Gpt::new(config(99)).expect("source");
    let reference_file = dir.join("reference.safetensors");
    source
        .save_safetensors_file(&reference_file)
        .expect("save reference");
    let layouts = [
        (
            "prefixed",
            Layout {
                prefixed: true,
                extra_positions: 0,
            },
        ),
        (
            "bare-longer-wpe",
            Layout {
                prefixed: false,
                extra_positions: 3,
            },
        ),
    ];
    for (label, layout) in layouts {
        let hf = Arc::new(dir.join(label));
        write_hf(&hf, &source, layout);
        let reference_file = Arc::new(reference_file.clone());
        for world in [1usize, 2, 3, 4] {
            let comms = hypershard::collectives::local::spawn_world(world).expect("world");
            let (hf, reference_file) = (Arc::clone(&hf), Arc::clone(&reference_file));
            let outs = hypershard_testkit::run_ranks(world, move |rank| {
                let text = |e: &dyn std::fmt::Display| e.to_string();
                let mesh = DataParallelMesh::fsdp(comms[rank].clone()).map_err(|e| text(&e))?;
                let fsdp = FullyShardConfig::new(mesh);
                let mut deferred = Gpt::new_deferred(config(1)).map_err(|e| text(&e))?;
                let own = own_bytes(&deferred, rank, world);
                let index = attach_hf_init(&mut deferred, &hf).map_err(|e| text(&e))?;
                let from_hf = shard_gpt(deferred, &fsdp).map_err(|e| text(&e))?;
                let read = index.bytes_read();
                let mut eager = Gpt::new(config(1)).map_err(|e| text(&e))?;
                eager
                    .load_safetensors_file(&reference_file)
                    .map_err(|e| text(&e))?;
                let reference = shard_gpt(eager, &fsdp).map_err(|e| text(&e))?;
                Ok::<_, String>(RankOut {
                    from_hf: local_bytes(&from_hf),
                    reference: local_bytes(&reference),
                    read,
                    own,
                })
            })
            .unwrap_or_else(|e| panic!("{label} world {world}: {e}"));
            for (rank, out) in outs.iter().enumerate() {
                assert_eq!(
                    out.from_hf, out.reference,
                    "{label} world {world} rank {rank}"
                );
                // Transposed weights included: a rank reads its own elements and no others.
                assert_eq!(out.read, out.own, "{label} world {world} rank {rank}");
            }
        }
    }
    // An eagerly built model loads the same values at once.
    let mut eager = Gpt::new(config(1)).expect("eager");
    attach_hf_init(&mut eager, &dir.join("prefixed")).expect("eager load");
    assert_eq!(local_bytes(&eager), local_bytes(&source));
}

#[test]
fn folders_that_do_not_match_are_refused_naming_what_differs() {
    let dir = scratch("refused");
    let source = Gpt::new(config(5)).expect("source");
    let good = Layout {
        prefixed: true,
        extra_positions: 0,
    };
    let hf = dir.join("good");
    write_hf(&hf, &source, good);
    let expect_reason =
        |model: &mut Gpt, folder: &Path, needle: &str| match attach_hf_init(model, folder) {
            Err(Error::HfCheckpoint { reason, .. }) => {
                assert!(reason.contains(needle), "{needle:?} not in {reason:?}")
            }
            other => panic!("expected HfCheckpoint, got {other:?}"),
        };
    // A model with a layer more: the missing tensor is named.
    let mut bigger = Gpt::new_deferred(GptConfig {
        n_layer: 3,
        ..config(1)
    })
    .expect("deferred");
    expect_reason(&mut bigger, &hf, "transformer.h.2.ln_1.weight is missing");
    // A Conv1D weight saved untransposed ([out, in]) is refused with its layout.
    let wrong = dir.join("untransposed");
    std::fs::create_dir_all(&wrong).expect("dir");
    let mut tensors = params(&source);
    tensors.push((
        "transformer.h.0.attn.bias".into(),
        Tensor::ones(&[1], DType::F32).unwrap(),
    ));
    hypershard::tensor::save_safetensors_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        &wrong.join("model.safetensors"),
    )
    .expect("save");
    let mut model = Gpt::new_deferred(config(1)).expect("deferred");
    expect_reason(
        &mut model,
        &wrong,
        "transformer.h.0.attn.c_attn.weight has shape [30, 10] ([in, out])",
    );
    // A stray tensor is named.
    let stray = dir.join("stray");
    write_hf(&stray, &source, good);
    let mut tensors: Vec<(String, Tensor)> =
        hypershard::tensor::load_safetensors_file(&stray.join("model.safetensors"))
            .expect("load")
            .into_iter()
            .collect();
    tensors.push((
        "transformer.h.0.mlp.gate.weight".into(),
        Tensor::ones(&[2], DType::F32).unwrap(),
    ));
    hypershard::tensor::save_safetensors_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        &stray.join("model.safetensors"),
    )
    .expect("save");
    let mut model = Gpt::new_deferred(config(1)).expect("deferred");
    expect_reason(&mut model, &stray, "transformer.h.0.mlp.gate.weight");
    // config.json fields nanoGPT's GPT does not compute are refused, naming the field.
    for (field, value, needle) in [
        ("n_inner", json!(7), "n_inner 7"),
        (
            "activation_function",
            json!("relu"),
            "activation_function \"relu\"",
        ),
        ("tie_word_embeddings", json!(false), "tie_word_embeddings"),
        ("layer_norm_epsilon", json!(1e-6), "layer_norm_epsilon"),
        ("model_type", json!("gpt_neo"), "model_type"),
    ] {
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
        config[field] = value;
        let folder = dir.join(format!("config-{field}"));
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        match hypershard::train::HfGpt2Config::load(&folder) {
            Err(Error::HfCheckpoint { path, reason }) => {
                assert_eq!(path, folder.join("config.json"));
                assert!(reason.contains(needle), "{needle:?} not in {reason:?}");
            }
            other => panic!("{field}: expected HfCheckpoint, got {other:?}"),
        }
    }
    let config = hypershard::train::HfGpt2Config::load(&hf).expect("good config");
    assert!(!config.approximates_gelu());
    let shape = config.model_shape();
    // A --model shape is checked against config.json, field by field.
    let deeper = hypershard::train::ModelShape {
        n_layer: 3,
        ..shape
    };
    let reason = config.check_shape(&deeper).expect_err("deeper");
    assert_eq!(
        reason,
        "--model has n_layer 3, the checkpoint's config.json 2"
    );
    let longer = hypershard::train::ModelShape {
        block_size: 14,
        ..shape
    };
    assert!(
        config
            .check_shape(&longer)
            .expect_err("longer")
            .contains("n_positions 13")
    );
    let shorter = hypershard::train::ModelShape {
        block_size: 8,
        vocab_size: None,
        ..shape
    };
    config
        .check_shape(&shorter)
        .expect("a shorter block keeps the first positions");
    assert_eq!(
        (
            shape.vocab_size,
            shape.block_size,
            shape.n_layer,
            shape.n_head,
            shape.n_embd
        ),
        (Some(67), 13, 2, 2, 10)
    );
}

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn run(args: &[&str]) -> Output {
    let output = Command::new(hypershard())
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs");
    assert!(
        output.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
fn the_cli_loads_an_hf_folder_trains_exports_it_and_reloads_it_equal() {
    let dir = scratch("cli");
    // Vocabulary 300 (above the bytes tokenizer's 256), 32 positions, 2 layers of width 32.
    let source = Gpt::new(GptConfig {
        vocab_size: 300,
        block_size: 32,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        ..config(3)
    })
    .expect("source");
    let hf = dir.join("hf");
    write_hf(
        &hf,
        &source,
        Layout {
            prefixed: true,
            extra_positions: 0,
        },
    );
    let s = |p: &Path| p.to_str().expect("utf-8 path").to_string();
    let train = |out: &Path, lr: &str, from: &Path| {
        run(&[
            "train",
            "--init-from-hf",
            &s(from),
            "--nproc",
            "2",
            "--mesh",
            "2",
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--warmup-steps",
            "0",
            "--weight-decay",
            "0",
            "--lr",
            lr,
            "--out",
            &s(out),
        ])
    };
    // A step of lr 1e-30 moves a weight by about 1e-30 (nothing, next to ~0.02; the zero
    // biases become ~1e-30): what was loaded is what is exported, in the source's layout
    // (transposes undone and redone), within 1e-25.
    train(&dir.join("still"), "1e-30", &hf);
    let still = dir.join("still-hf");
    run(&[
        "export",
        "--checkpoint",
        &s(&dir.join("still")),
        "--format",
        "hf",
        "--out",
        &s(&still),
    ]);
    let mut expected =
        hypershard::tensor::load_safetensors_file(&hf.join("model.safetensors")).expect("source");
    expected.retain(|n, _| {
        !n.ends_with(".attn.bias") && !n.ends_with(".attn.masked_bias") && n != "lm_head.weight"
    });
    let exported = hypershard::tensor::load_safetensors_file(&still.join("model.safetensors"))
        .expect("export");
    assert_eq!(
        exported.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &expected {
        let got = &exported[name];
        assert_eq!(got.shape(), tensor.shape(), "{name}");
        assert!(got.allclose(tensor, 0.0, 1e-25).expect("compare"), "{name}");
    }
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(still.join("config.json")).unwrap()).unwrap();
    for (field, value) in [
        ("vocab_size", json!(300)),
        ("n_positions", json!(32)),
        ("n_layer", json!(2)),
        ("n_head", json!(2)),
        ("n_embd", json!(32)),
        ("activation_function", json!("gelu")),
        ("tie_word_embeddings", json!(true)),
    ] {
        assert_eq!(written[field], value, "{field}");
    }
    // A real step moves the weights; its HF export reloads equal to its nanoGPT export.
    let trained = dir.join("trained");
    train(&trained, "1e-2", &hf);
    let exported = dir.join("trained-hf");
    run(&[
        "export",
        "--checkpoint",
        &s(&trained),
        "--format",
        "hf",
        "--out",
        &s(&exported),
    ]);
    let nanogpt = dir.join("trained.safetensors");
    run(&[
        "export",
        "--checkpoint",
        &s(&trained),
        "--out",
        &s(&nanogpt),
    ]);
    let model_config = GptConfig {
        vocab_size: 300,
        block_size: 32,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        ..config(0)
    };
    let mut reloaded = Gpt::new(model_config).expect("model");
    attach_hf_init(&mut reloaded, &exported).expect("reload");
    let mut reference = Gpt::new(model_config).expect("model");
    reference
        .load_safetensors_file(&nanogpt)
        .expect("nanogpt export");
    assert_eq!(local_bytes(&reloaded), local_bytes(&reference));
    assert_ne!(
        local_bytes(&reloaded),
        local_bytes(&source),
        "a step was taken"
    );
    // The exported folder trains again (its config.json derives the same model).
    train(&dir.join("again"), "1e-2", &exported);
    // Exporting over the folder needs --force.
    let again = Command::new(hypershard())
        .args([
            "export",
            "--checkpoint",
            &s(&trained),
            "--format",
            "hf",
            "--out",
            &s(&exported),
        ])
        .output()
        .expect("runs");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}
