//! What `hypershard train` is asked to do: the model, the mesh, the data, the optimizer.

use std::path::PathBuf;

use hypershard_nn::GptConfig;
use hypershard_tensor::DType;
use serde::{Deserialize, Serialize};

use crate::data::{DataOrder, TokenizerKind};
use crate::error::{Error, Result};

/// The data-parallel layout (`--mesh`): `N` is FSDP over `N` ranks, `RxS` is HSDP with `R`
/// replicas of `S`-way sharding (torch's `init_device_mesh((R, S), ("dp_replicate",
/// "dp_shard"))`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshSpec {
    /// Replicas (1 for plain FSDP).
    pub replicas: usize,
    /// Ranks each parameter is sharded over.
    pub shards: usize,
}

impl MeshSpec {
    /// Parses `N` or `RxS`. Each number must be positive and their product (the rank count)
    /// must fit in `usize`: `4611686018427387905x4` would otherwise wrap around to 4.
    pub fn parse(text: &str) -> Result<MeshSpec> {
        let bad = |reason: &str| Error::InvalidMesh {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        const SHAPE: &str = "expected N or AxB with positive integers, e.g. 4 or 2x2";
        let parts: Vec<&str> = text.trim().split(['x', 'X', '*']).collect();
        let numbers: Vec<usize> = parts
            .iter()
            .map(|p| p.trim().parse::<usize>().ok().filter(|n| *n > 0))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad(SHAPE))?;
        let spec = match numbers.as_slice() {
            [n] => MeshSpec {
                replicas: 1,
                shards: *n,
            },
            [r, s] => MeshSpec {
                replicas: *r,
                shards: *s,
            },
            _ => return Err(bad(SHAPE)),
        };
        if spec.replicas.checked_mul(spec.shards).is_none() {
            return Err(bad("the rank count (the product) overflows"));
        }
        Ok(spec)
    }

    /// Ranks in the mesh.
    pub fn ranks(&self) -> usize {
        // Saturating: `parse` refuses products that overflow, and a deserialized spec that
        // overflows must not wrap around to a small count that matches the world.
        self.replicas.saturating_mul(self.shards)
    }

    /// Checks the mesh holds exactly `world_size` ranks.
    pub fn check_world(&self, text: &str, world_size: usize) -> Result<()> {
        if self.ranks() == world_size {
            Ok(())
        } else {
            Err(Error::MeshMismatch {
                mesh: text.to_string(),
                mesh_ranks: self.ranks(),
                nproc: world_size,
            })
        }
    }

    /// `2x2` or `4`, as written in summaries.
    pub fn label(&self) -> String {
        if self.replicas == 1 {
            format!("{} (FSDP)", self.shards)
        } else {
            format!("{}x{} (HSDP)", self.replicas, self.shards)
        }
    }
}

/// A model shape as presets and `--model FILE.json` give it (nanoGPT's `GPTConfig` fields).
/// `vocab_size` defaults to the tokenizer's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Vocabulary size; `None`: the tokenizer's.
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Context length.
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Model width.
    pub n_embd: usize,
    /// Biases in linear layers and layer norms.
    #[serde(default = "default_bias")]
    pub bias: bool,
    /// Dropout probability.
    #[serde(default)]
    pub dropout: f64,
}

fn default_bias() -> bool {
    true
}

/// The named presets of `--model`.
pub const MODEL_PRESETS: [&str; 4] = ["tiny", "small", "medium", "gpt2"];

impl ModelShape {
    /// A preset (`tiny`, `small`, `medium`, `gpt2`) or a JSON file with these fields.
    pub fn resolve(text: &str) -> Result<ModelShape> {
        let preset = |block_size, n_layer, n_head, n_embd| ModelShape {
            vocab_size: None,
            block_size,
            n_layer,
            n_head,
            n_embd,
            bias: true,
            dropout: 0.0,
        };
        match text {
            "tiny" => Ok(preset(32, 2, 2, 32)),
            "small" => Ok(preset(64, 4, 4, 64)),
            "medium" => Ok(preset(128, 6, 6, 192)),
            "gpt2" => Ok(ModelShape {
                vocab_size: Some(50_304),
                ..preset(1024, 12, 12, 768)
            }),
            path => {
                let bytes = std::fs::read(path).map_err(|e| Error::InvalidModel {
                    text: text.to_string(),
                    reason: format!(
                        "not a preset ({}) and not a readable JSON file: {e}",
                        MODEL_PRESETS.join(", ")
                    ),
                })?;
                let shape: ModelShape =
                    serde_json::from_slice(&bytes).map_err(|e| Error::InvalidModel {
                        text: text.to_string(),
                        reason: format!("not a model config (nanoGPT GPTConfig fields): {e}"),
                    })?;
                Ok(shape)
            }
        }
    }

    /// The fields as a person reads them, for errors about a shape not read from a file.
    pub fn describe(&self) -> String {
        format!(
            "block_size {}, n_layer {}, n_head {}, n_embd {}",
            self.block_size, self.n_layer, self.n_head, self.n_embd
        )
    }

    /// The full model configuration, with `default_vocab` ids when the shape names no
    /// vocabulary size (the tokenizer's, or a dataset's `meta.pkl`'s). Whether the vocabulary
    /// covers the data is checked against the data (a text corpus needs the tokenizer's ids,
    /// token files their largest id), not here.
    pub fn config(&self, default_vocab: usize, seed: u64) -> Result<ModelConfig> {
        let vocab_size = self.vocab_size.unwrap_or(default_vocab);
        let config = ModelConfig {
            vocab_size,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            bias: self.bias,
            dropout: self.dropout,
            seed,
        };
        let invalid = |reason: String| Error::InvalidModel {
            text: self.describe(),
            reason,
        };
        if vocab_size == 0 {
            return Err(invalid("vocab_size must be positive".to_string()));
        }
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(invalid(format!(
                "n_head {} must divide n_embd {}",
                self.n_head, self.n_embd
            )));
        }
        if self.block_size == 0 || self.n_layer == 0 || self.n_embd == 0 {
            return Err(invalid(
                "block_size, n_layer and n_embd must be positive".to_string(),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid(format!(
                "dropout {} must be in [0, 1)",
                self.dropout
            )));
        }
        if config.parameter_count().is_none() {
            return Err(invalid(
                "its parameter count overflows a machine word".to_string(),
            ));
        }
        Ok(config)
    }
}

/// The model configuration a checkpoint records and checks on load.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length.
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Model width.
    pub n_embd: usize,
    /// Biases.
    pub bias: bool,
    /// Dropout probability.
    pub dropout: f64,
    /// Initialisation seed.
    pub seed: u64,
}

impl ModelConfig {
    /// The nn crate's configuration (f32 master weights).
    pub fn gpt(&self) -> GptConfig {
        GptConfig {
            vocab_size: self.vocab_size,
            block_size: self.block_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            bias: self.bias,
            dropout: self.dropout,
            dtype: DType::F32,
            seed: self.seed,
        }
    }

    /// Parameters of the GPT (nanoGPT's layout, biases included when `bias`), or `None` when
    /// the count overflows `usize`: every size a rank later allocates is below it.
    pub fn parameter_count(&self) -> Option<usize> {
        let c = self.n_embd;
        let bias = usize::from(self.bias);
        let c2 = c.checked_mul(c)?;
        // Per block: ln_1, ln_2 (weight, bias), c_attn (3c·c + 3c), attn c_proj (c·c + c),
        // c_fc (4c·c + 4c), mlp c_proj (4c·c + c).
        let norms = c.checked_mul(2 + 2 * bias)?;
        let weights = c2.checked_mul(12)?;
        let biases = c.checked_mul(9 * bias)?;
        let block = norms.checked_add(weights)?.checked_add(biases)?;
        let blocks = block.checked_mul(self.n_layer)?;
        let embeddings = self
            .vocab_size
            .checked_add(self.block_size)?
            .checked_mul(c)?;
        let ln_f = c.checked_mul(1 + bias)?;
        blocks.checked_add(embeddings)?.checked_add(ln_f)
    }

    /// The JSON that checkpoints store and compare. The seed is left out: resuming or
    /// sampling with another `--seed` is the same model.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "bias": self.bias,
            "dropout": self.dropout,
        })
    }
}

/// Where `hypershard train` keeps the model (`--device`): the host, the emulated device (host
/// memory behind the device API, stream order checked: what CI runs the device path on), or
/// a CUDA GPU (one per rank, by local rank; needs the `cuda` feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainDevice {
    /// Host memory.
    #[default]
    Cpu,
    /// The emulated device, one per rank.
    Emulated,
    /// A CUDA GPU per rank: local rank `r` of a node with `n` GPUs takes GPU `r mod n`, so
    /// several ranks share a GPU when a node has fewer GPUs than ranks. The collectives run
    /// over NCCL when every rank has a GPU of its own ([`default_cuda_backend`]).
    Cuda,
}

impl TrainDevice {
    /// The name `--device` takes.
    pub fn name(self) -> &'static str {
        match self {
            TrainDevice::Cpu => "cpu",
            TrainDevice::Emulated => "emulated",
            TrainDevice::Cuda => "cuda",
        }
    }

    /// The device of the rank whose rank on its node is `local_rank`; for CUDA, an
    /// [`Error::DeviceUnavailable`] when this build has no CUDA support or the GPU cannot be
    /// opened.
    pub fn resolve(self, local_rank: usize) -> Result<hypershard_tensor::Device> {
        match self {
            TrainDevice::Cpu => Ok(hypershard_tensor::Device::Cpu),
            TrainDevice::Emulated => Ok(hypershard_tensor::Device::Emulated {
                ordinal: local_rank,
            }),
            TrainDevice::Cuda => cuda_device(local_rank),
        }
    }
}

/// The GPU of local rank `local_rank` on a node with `gpus` GPUs: `local_rank mod gpus`, so
/// that ranks beyond the GPU count share them round-robin (the collectives of the tcp, shm and
/// local backends stage through host memory and do not care which GPU a rank holds).
#[cfg(any(feature = "cuda", test))]
fn gpu_of_local_rank(local_rank: usize, gpus: usize) -> Result<usize> {
    local_rank
        .checked_rem(gpus)
        .ok_or_else(|| Error::DeviceUnavailable {
            device: "cuda",
            reason: "no GPU is visible on this node".to_string(),
        })
}

/// The collective backend `--device cuda` ranks use when `HYPERSHARD_BACKEND` does not name
/// one (`explicit`): NCCL, on device memory, when every rank of a node has a GPU of its own;
/// the tcp backend, staging through host memory, when ranks must share GPUs (NCCL refuses two
/// ranks on one GPU) or the job is one rank (no collectives). `None`: leave the choice as it is.
pub fn default_cuda_backend(
    explicit: Option<&str>,
    ranks_per_node: usize,
    world_size: usize,
    gpus: usize,
) -> Option<&'static str> {
    if explicit.is_some_and(|value| !value.trim().is_empty()) {
        return None;
    }
    if world_size > 1 && ranks_per_node <= gpus {
        Some("nccl")
    } else {
        Some("tcp")
    }
}

/// What `hypershard train` sets `HYPERSHARD_TRANSPORT` to for its ranks, from `--transport`
/// (`flag`) and the variable as the user's environment has it (`inherited`): the flag when
/// given (a word on the command line beats one inherited from the shell); otherwise `auto`
/// (shared memory between the ranks of one node, TCP between nodes) unless the environment
/// already names a transport. `None`: leave the environment as it is.
///
/// The library's own default stays TCP (a program opts in); the trainer opts in because its
/// ranks are processes of one node: on two cores, HSDP 2x2 ran 4–6 % faster on shared memory
/// than over loopback TCP (docs/cli.md).
pub fn worker_transport(
    flag: Option<hypershard_collectives::shm::TransportPolicy>,
    inherited: Option<&str>,
) -> Option<&'static str> {
    match flag {
        Some(policy) => Some(policy.name()),
        None if inherited.is_some_and(|value| !value.trim().is_empty()) => None,
        None => Some(hypershard_collectives::shm::TransportPolicy::Auto.name()),
    }
}

/// The number of GPUs this node has, for [`default_cuda_backend`].
#[cfg(feature = "cuda")]
pub fn gpu_count() -> Result<usize> {
    hypershard_tensor::cuda::device_count().map_err(|source| Error::DeviceUnavailable {
        device: "cuda",
        reason: format!("the GPUs cannot be counted: {source}"),
    })
}

#[cfg(not(feature = "cuda"))]
pub fn gpu_count() -> Result<usize> {
    Err(no_cuda_support())
}

#[cfg(feature = "cuda")]
fn cuda_device(local_rank: usize) -> Result<hypershard_tensor::Device> {
    let ordinal = gpu_of_local_rank(local_rank, gpu_count()?)?;
    let device = hypershard_tensor::Device::Cuda { ordinal };
    // Opening the backend probes the driver and the GPU: a typed error here, not a failure
    // in the middle of building the model.
    device
        .backend("hypershard train --device cuda")
        .map_err(|source| Error::DeviceUnavailable {
            device: "cuda",
            reason: format!("GPU {ordinal} cannot be used: {source}"),
        })?;
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_local_rank: usize) -> Result<hypershard_tensor::Device> {
    Err(no_cuda_support())
}

/// `--device cuda` in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda_support() -> Error {
    Error::DeviceUnavailable {
        device: "cuda",
        reason: "this build has no CUDA support (build hypershard with `--features cuda`)"
            .to_string(),
    }
}

/// The learning-rate schedule (`--lr-schedule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Linear warmup, then cosine decay to `--min-lr` at the last step (nanoGPT).
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

/// AdamW and schedule hyper-parameters, named as nanoGPT names them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine schedule.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Schedule after warmup.
    pub schedule: LrSchedule,
    /// The step at which the cosine reaches `min_lr` (nanoGPT's `lr_decay_iters`); `None`:
    /// the run's last step.
    pub decay_steps: Option<u64>,
    /// AdamW β₁.
    pub beta1: f64,
    /// AdamW β₂.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay, for parameters of 2 or more dims only.
    pub weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    pub grad_clip: f64,
}

impl OptimConfig {
    /// nanoGPT's `get_lr`: linear warmup `lr·(it+1)/(warmup+1)`, then cosine from `lr` to
    /// `min_lr` over the remaining steps (or constant).
    pub fn lr_at(&self, step: u64, total_steps: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        match self.schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine => {
                let horizon = self.decay_steps.unwrap_or(total_steps);
                let decay_steps = horizon.saturating_sub(self.warmup_steps).max(1);
                let ratio = ((step - self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
        }
    }
}

/// Everything a training rank needs.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelConfig,
    /// The mesh.
    pub mesh: MeshSpec,
    /// The corpus.
    pub data: PathBuf,
    /// The tokenizer for text corpora.
    pub tokenizer: TokenizerKind,
    /// Window order.
    pub data_order: DataOrder,
    /// Optimizer steps to reach (a resumed run continues up to this).
    pub steps: u64,
    /// Windows per rank per micro-step.
    pub micro_batch: usize,
    /// Micro-steps per optimizer step.
    pub grad_accum: usize,
    /// Seed of the initialisation and the random data order.
    pub seed: u64,
    /// Optimizer.
    pub optim: OptimConfig,
    /// FSDP's compute dtype for parameters (`--param-dtype`).
    pub param_dtype: DType,
    /// FSDP's dtype for gradient reduction (`--reduce-dtype`).
    pub reduce_dtype: DType,
    /// The char tokenizer's table (`itos` of the dataset's `meta.pkl`), recorded in
    /// checkpoints so `sample` decodes without the dataset.
    pub vocabulary: Option<Vec<String>>,
    /// Initial weights (nanoGPT names).
    pub init: Option<PathBuf>,
    /// Initial weights from a Hugging Face GPT-2 folder (`config.json`, `model.safetensors`).
    pub init_from_hf: Option<PathBuf>,
    /// Build the whole model on every rank before sharding (the old path, for comparison);
    /// by default the model is built deferred and each rank materialises only its shard.
    pub eager_init: bool,
    /// Checkpoint every transformer block's activations (`--activation-checkpointing`).
    pub activation_checkpointing: bool,
    /// Keep the step's idle communication buffers cached across steps
    /// (`--keep-step-buffers`) instead of freeing them after each backward.
    pub keep_step_buffers: bool,
    /// Where each rank keeps its shards, gradients and activations (`--device`).
    pub device: TrainDevice,
    /// Output directory.
    pub out: PathBuf,
    /// Continue from `OUT/checkpoints`.
    pub resume: bool,
    /// On resume, start AdamW afresh (zero moments, step count 0) instead of loading it.
    pub reset_optimizer: bool,
    /// Keep going when the loss or the parameters are not finite (by default the run stops
    /// with [`Error::NonFiniteLoss`] and checkpoints nothing non-finite).
    pub allow_nonfinite: bool,
    /// Save a checkpoint every K steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Evaluate on the held-out tenth every K steps (0: never).
    pub eval_every: u64,
    /// Where the per-step losses go.
    pub losses: PathBuf,
}

#[cfg(test)]
mod tests {
    #[test]
    fn cuda_ranks_use_nccl_when_each_has_a_gpu_and_tcp_when_they_share() {
        assert_eq!(default_cuda_backend(None, 2, 2, 2), Some("nccl"));
        assert_eq!(default_cuda_backend(None, 4, 8, 8), Some("nccl"));
        // Two ranks on one GPU: NCCL would refuse them.
        assert_eq!(default_cuda_backend(None, 2, 2, 1), Some("tcp"));
        // One rank has no collectives to run.
        assert_eq!(default_cuda_backend(None, 1, 1, 1), Some("tcp"));
        assert_eq!(default_cuda_backend(Some(""), 2, 2, 2), Some("nccl"));
        // The user's choice stands.
        assert_eq!(default_cuda_backend(Some("tcp"), 2, 2, 2), None);
        assert_eq!(default_cuda_backend(Some("nccl"), 2, 2, 1), None);
    }

    #[test]
    fn ranks_default_to_shared_memory_unless_told_otherwise() {
        use hypershard_collectives::shm::TransportPolicy;
        // Nothing said anywhere: shared memory between co-located ranks.
        assert_eq!(worker_transport(None, None), Some("auto"));
        assert_eq!(worker_transport(None, Some("  ")), Some("auto"));
        // The shell's choice is kept when the command line says nothing ...
        assert_eq!(worker_transport(None, Some("tcp")), None);
        // ... and the command line's wins over it.
        assert_eq!(
            worker_transport(Some(TransportPolicy::Tcp), Some("shm")),
            Some("tcp")
        );
        assert_eq!(
            worker_transport(Some(TransportPolicy::Shm), None),
            Some("shm")
        );
    }

    #[test]
    fn ranks_beyond_the_gpu_count_share_gpus_round_robin() {
        let gpus: Vec<usize> = (0..5).map(|r| gpu_of_local_rank(r, 2).unwrap()).collect();
        assert_eq!(gpus, [0, 1, 0, 1, 0]);
        assert_eq!(gpu_of_local_rank(3, 8).unwrap(), 3);
        match gpu_of_local_rank(0, 0) {
            Err(Error::DeviceUnavailable {
                device: "cuda",
                reason,
            }) => {
                assert!(reason.contains("no GPU"), "{reason}");
            }
            other => panic!("expected DeviceUnavailable, got {other:?}"),
        }
    }

    use super::*;

    #[test]
    fn meshes_parse_and_must_match_the_world() {
        assert_eq!(
            MeshSpec::parse("2x2").unwrap(),
            MeshSpec {
                replicas: 2,
                shards: 2
            }
        );
        assert_eq!(
            MeshSpec::parse("4").unwrap(),
            MeshSpec {
                replicas: 1,
                shards: 4
            }
        );
        for bad in ["", "0", "2x", "axb", "2x2x2", "-1"] {
            assert!(
                matches!(MeshSpec::parse(bad), Err(Error::InvalidMesh { .. })),
                "{bad}"
            );
        }
        // (2⁶² + 1)·4 wraps around to 4 in 64 bits: refused, not matched against 4 ranks.
        match MeshSpec::parse("4611686018427387905x4") {
            Err(Error::InvalidMesh { reason, .. }) => {
                assert_eq!(reason, "the rank count (the product) overflows");
            }
            other => panic!("expected InvalidMesh, got {other:?}"),
        }
        let big = MeshSpec::parse("4294967296x4294967295").unwrap();
        assert_eq!(big.ranks(), 4294967296 * 4294967295);
        let mesh = MeshSpec::parse("2x2").unwrap();
        mesh.check_world("2x2", 4).unwrap();
        assert!(matches!(
            mesh.check_world("2x2", 3),
            Err(Error::MeshMismatch {
                mesh_ranks: 4,
                nproc: 3,
                ..
            })
        ));
    }

    #[test]
    fn the_lr_schedule_is_nanogpts() {
        let optim = OptimConfig {
            lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 4,
            schedule: LrSchedule::Cosine,
            decay_steps: None,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
        };
        // Warmup: (it+1)/(warmup+1).
        assert_eq!(optim.lr_at(0, 14), 0.2);
        assert_eq!(optim.lr_at(3, 14), 0.8);
        // Cosine: halfway through the 10 decay steps the coefficient is 1/2.
        assert!((optim.lr_at(9, 14) - 0.55).abs() < 1e-12);
        assert!((optim.lr_at(14, 14) - 0.1).abs() < 1e-12);
        let constant = OptimConfig {
            schedule: LrSchedule::Constant,
            ..optim
        };
        assert_eq!(constant.lr_at(10, 14), 1.0);
        // A decay horizon beyond the run: the run of 14 steps follows the 24-step curve.
        let longer = OptimConfig {
            decay_steps: Some(24),
            ..optim
        };
        assert_eq!(longer.lr_at(9, 14), optim.lr_at(9, 24));
    }

    #[test]
    fn presets_and_json_models_resolve() {
        let small = ModelShape::resolve("small").unwrap();
        assert_eq!(small.config(256, 0).unwrap().vocab_size, 256);
        let dir = std::env::temp_dir().join(format!("hypershard-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.json");
        std::fs::write(
            &path,
            r#"{"block_size": 16, "n_layer": 1, "n_head": 3, "n_embd": 12}"#,
        )
        .unwrap();
        let shape = ModelShape::resolve(path.to_str().unwrap()).unwrap();
        assert_eq!(shape.n_head, 3);
        std::fs::write(
            &path,
            r#"{"block_size": 16, "n_layer": 1, "n_head": 5, "n_embd": 12}"#,
        )
        .unwrap();
        let shape = ModelShape::resolve(path.to_str().unwrap()).unwrap();
        assert!(matches!(
            shape.config(256, 0),
            Err(Error::InvalidModel { .. })
        ));
        assert!(matches!(
            ModelShape::resolve("nope"),
            Err(Error::InvalidModel { .. })
        ));
        // Shape errors describe the fields, not a Debug dump of the struct.
        match shape.config(256, 0) {
            Err(Error::InvalidModel { text, reason }) => {
                assert_eq!(text, "block_size 16, n_layer 1, n_head 5, n_embd 12");
                assert_eq!(reason, "n_head 5 must divide n_embd 12");
            }
            other => panic!("expected InvalidModel, got {other:?}"),
        }
        for (dropout, ok) in [
            (0.0, true),
            (0.5, true),
            (1.0, false),
            (-0.1, false),
            (f64::NAN, false),
        ] {
            let shape = ModelShape {
                dropout,
                n_head: 3,
                ..shape
            };
            assert_eq!(shape.config(256, 0).is_ok(), ok, "dropout {dropout}");
        }
        let wide = ModelShape {
            n_embd: usize::MAX / 2,
            n_head: 1,
            ..shape
        };
        match wide.config(256, 0) {
            Err(Error::InvalidModel { reason, .. }) => {
                assert_eq!(reason, "its parameter count overflows a machine word");
            }
            other => panic!("expected InvalidModel, got {other:?}"),
        }
    }
}
