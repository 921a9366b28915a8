//! `hypershard train`: validates the flags, then runs the ranks (in this process for one rank,
//! otherwise as processes under the launcher, each re-running this command with `--worker`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use hypershard::FileAction;
use hypershard::checkpoint::{Checkpoint, SafetensorsIndex};
use hypershard::data::{
    DataOrder, Dataset, Tokenizer, TokenizerKind, dataset_meta, default_corpus_path, has_val_split,
    is_token_data, load_dataset,
};
use hypershard::launch::{LaunchConfig, launch, rank_limits};
use hypershard::tensor::DType;
use hypershard::train::{
    HF_CONFIG_FILE, HF_WEIGHTS_FILE, HfGpt2Config, LrSchedule, MeshSpec, ModelShape, OptimConfig,
    TrainConfig, TrainDevice, check_fits, checkpoint_root, default_cuda_backend, estimate,
    gpu_count, print_summary, run_rank, worker_transport,
};
use hypershard::{Error, collectives};

use super::stall_flags::StallArgs;
use super::{checks, resume};

/// The variable through which the parent hands its chosen output directory to the ranks.
const OUT_ENV: &str = "HYPERSHARD_TRAIN_OUT";

/// Floating dtypes for `--param-dtype` / `--reduce-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FloatDType {
    F32,
    Bf16,
    F16,
}

impl FloatDType {
    fn dtype(self) -> DType {
        match self {
            FloatDType::F32 => DType::F32,
            FloatDType::Bf16 => DType::BF16,
            FloatDType::F16 => DType::F16,
        }
    }
}

/// Train nanoGPT's GPT under fully_shard (FSDP / HSDP) on a text corpus.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Processes (ranks) on this node.
    #[arg(long, default_value_t = 4)]
    nproc: usize,
    /// Nodes in the job (run the same command on each, with its --node-rank).
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on node 0 (default: a free port; required with --nnodes > 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// Data-parallel mesh: N (FSDP over N ranks) or RxS (HSDP: R replicas of S-way shards).
    #[arg(long, default_value = "2x2")]
    mesh: String,
    /// Model: a preset (tiny, small, medium, gpt2) or a JSON file of nanoGPT GPTConfig fields
    /// (default: small, or with --init-from-hf the checkpoint's config.json).
    #[arg(long)]
    model: Option<String>,
    /// Corpus: a text file, a nanoGPT .bin of little-endian u16 token ids, or a nanoGPT dataset
    /// folder (train.bin, val.bin, and meta.pkl whose vocabulary and char tokenizer are then
    /// used) (default: the Shakespeare shipped in data/).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenizer for text corpora.
    #[arg(long, value_enum, default_value_t = TokenizerKind::Bytes)]
    tokenizer: TokenizerKind,
    /// Window order: random (seeded) or sequential (g·block_size mod (N − block_size − 1)).
    #[arg(long, value_enum, default_value_t = DataOrder::Random)]
    data_order: DataOrder,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Sequences per rank per micro-step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Micro-steps accumulated per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Final learning rate of the cosine schedule (default: lr / 10).
    #[arg(long)]
    min_lr: Option<f64>,
    /// Steps of linear warmup.
    #[arg(long, default_value_t = 10)]
    warmup_steps: u64,
    /// Step at which the cosine reaches --min-lr (nanoGPT's lr_decay_iters; default: --steps).
    #[arg(long)]
    lr_decay_steps: Option<u64>,
    /// Learning-rate schedule after warmup.
    #[arg(long, value_enum, default_value_t = LrSchedule::Cosine)]
    lr_schedule: LrSchedule,
    /// AdamW weight decay (parameters of 2 or more dims only).
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// AdamW β₁.
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    /// AdamW β₂.
    #[arg(long, default_value_t = 0.99)]
    beta2: f64,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// Seed of the initialisation and the random data order.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Dtype of the gathered parameters (FSDP mixed precision).
    #[arg(long, value_enum, default_value_t = FloatDType::F32)]
    param_dtype: FloatDType,
    /// Dtype of gradient reduction.
    #[arg(long, value_enum, default_value_t = FloatDType::F32)]
    reduce_dtype: FloatDType,
    /// Initial weights: a safetensors file with nanoGPT parameter names.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Initial weights from a Hugging Face GPT-2 folder (config.json and model.safetensors as
    /// transformers' save_pretrained writes them); the model is the one its config.json
    /// describes, or --model checked against it.
    #[arg(long, value_name = "DIR", conflicts_with = "init")]
    init_from_hf: Option<PathBuf>,
    /// Each rank's memory budget (e.g. `1.25GiB`, `800MiB`, bytes): every rank runs in its own
    /// memory cgroup with this limit, so a rank that needs more is stopped by the kernel and
    /// the error names it. Needs a writable cgroup (v1 or v2).
    #[arg(long, value_name = "SIZE", value_parser = hypershard::launch::parse_size)]
    max_rank_memory: Option<u64>,
    /// Start even when the estimated memory of a rank exceeds what it may use (the smallest
    /// of --max-rank-memory, ulimit -v, ulimit -d, the job's memory cgroup and MemAvailable,
    /// shared ones divided among this node's ranks). The estimate is an upper one.
    #[arg(long)]
    no_memory_check: bool,
    /// Build the whole model on every rank before sharding it. By default the model is built
    /// deferred (shapes only) and each rank materialises only its own shard, so start-up
    /// memory per rank falls with the number of ranks; the values are the same either way.
    #[arg(long)]
    eager_init: bool,
    /// Recompute each transformer block's forward in backward instead of keeping its
    /// activations (one more forward per block, no extra all-gather).
    #[arg(long)]
    activation_checkpointing: bool,
    /// Keep each step's communication buffers (the unsharded parameters and gradients and
    /// the collectives' buffers) cached for the next step instead of freeing them after
    /// backward (as PyTorch's caching allocator does on a GPU): faster, since no step faults
    /// them in again, but they stay resident through the optimizer step. The memory check
    /// counts them. On by default; `--keep-step-buffers=false` is the memory-lean setting. A
    /// world of one rank has none. Large kernel outputs stay cached either way (in use plus
    /// cached within a tenth above the most of them ever in use at once).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    keep_step_buffers: Option<bool>,
    /// Where each rank keeps its model shards, gradients and activations: cpu, emulated (the
    /// test device: host memory behind the device API, what CI runs the device path on), or
    /// cuda (GPU `LOCAL_RANK mod GPUs` on a node, so ranks may share one; needs a build with
    /// `--features cuda`).
    /// The model is materialised (or, with --eager-init, moved) there and trained under
    /// FSDP/HSDP there; collectives stage through host memory.
    #[arg(long, value_enum, default_value_t = TrainDevice::Cpu)]
    device: TrainDevice,
    /// How the ranks move collective data: auto (shared memory between the ranks of one node,
    /// TCP between nodes), tcp (loopback TCP even on one node) or shm (as auto, but a shared
    /// memory setup failure is an error, not a fallback to TCP). Without the flag,
    /// HYPERSHARD_TRANSPORT when set, else auto.
    #[arg(long, value_parser = parse_transport, value_name = "tcp|auto|shm")]
    transport: Option<collectives::shm::TransportPolicy>,
    /// Output directory (default: a new runs/train-NNN).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue from the newest checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// With --resume: accept a --seed or --data-order other than the checkpoint's.
    #[arg(long, requires = "resume")]
    override_resume_config: bool,
    /// With --resume: start AdamW afresh (zero moments, step count 0), also when the
    /// checkpoint holds no optimizer state.
    #[arg(long, requires = "resume")]
    reset_optimizer: bool,
    /// Keep training (and checkpointing) when the loss or the parameters become NaN or
    /// infinite, instead of stopping with an error.
    #[arg(long)]
    allow_nonfinite: bool,
    /// Save a checkpoint every K steps (and always at the end).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Evaluate every K steps on the dataset's val.bin, or else on the held-out last tenth of
    /// the corpus (0: never; default: 10 times per run when --data has a val.bin, else never).
    #[arg(long)]
    eval_every: Option<u64>,
    /// Per-step losses, one JSON object per line (default: OUT/losses.jsonl).
    #[arg(long)]
    losses: Option<PathBuf>,
    #[command(flatten)]
    stall: StallArgs,
    /// Internal: run as one rank under the launcher.
    #[arg(long, hide = true)]
    worker: bool,
}

/// The first `runs/train-NNN` that does not exist yet.
fn fresh_out_dir() -> PathBuf {
    (1..)
        .map(|n| PathBuf::from(format!("runs/train-{n:03}")))
        .find(|p| !p.exists())
        .unwrap_or_else(|| PathBuf::from("runs/train"))
}

/// Refuses to start a fresh run over an output directory that holds one.
fn check_fresh(out: &Path) -> Result<(), Error> {
    for existing in [
        checkpoint_root(out),
        out.join("losses.jsonl"),
        out.join("loss.svg"),
    ] {
        if existing.exists() {
            return Err(Error::WouldOverwrite { path: existing });
        }
    }
    Ok(())
}

/// Checks the losses file can be written as asked: not a directory or a device, not an
/// existing file a fresh run would truncate, writable when a resumed run appends to it.
fn check_losses(path: &Path, explicit: bool, resume: bool) -> Result<(), Error> {
    let refuse = |reason: &str| Error::InvalidOutput {
        flag: "--losses",
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(refuse(
            "is a directory (name the file the losses are written to)",
        )),
        Ok(meta) if !meta.is_file() => Err(refuse(
            "is not a regular file (the losses are written to one, one JSON line per step)",
        )),
        Ok(_) if !resume && explicit => Err(refuse(
            "already exists (name a new file, or pass --resume to append to it)",
        )),
        Ok(_) if resume => {
            // Opened for appending and closed: nothing is written, but a read-only file or
            // file system is reported now rather than by rank 0 after the launch.
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .map(drop)
                .map_err(|e| Error::io(FileAction::Write, path, e))
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match path.parent().filter(|p| !p.as_os_str().is_empty()) {
                Some(parent) if parent.exists() && !parent.is_dir() => Err(refuse(&format!(
                    "cannot be created: {} is not a directory",
                    parent.display()
                ))),
                _ => Ok(()),
            }
        }
        Err(e) => Err(Error::io(FileAction::Read, path, e)),
    }
}

/// Range checks of every numeric flag (see `checks`), before anything is read or written.
fn check_flags(args: &TrainArgs) -> Result<(), Error> {
    // A device this build or machine cannot use fails here, before any rank starts.
    if args.device == TrainDevice::Cuda {
        args.device.resolve(0)?;
    }
    checks::at_least("--nproc", args.nproc as u64, 1)?;
    checks::at_least("--nnodes", args.nnodes as u64, 1)?;
    if args.node_rank >= args.nnodes {
        return Err(Error::InvalidFlag {
            flag: "--node-rank",
            value: args.node_rank.to_string(),
            reason: format!("must be below --nnodes {}", args.nnodes),
        });
    }
    checks::product(
        &[("--nproc", args.nproc), ("--nnodes", args.nnodes)],
        "the world size",
    )?;
    checks::steps("--steps", args.steps, 1)?;
    checks::steps("--warmup-steps", args.warmup_steps, 0)?;
    if let Some(decay) = args.lr_decay_steps {
        checks::steps("--lr-decay-steps", decay, 1)?;
    }
    checks::at_least("--batch-size", args.batch_size as u64, 1)?;
    checks::at_least("--grad-accum", args.grad_accum as u64, 1)?;
    checks::positive_float("--lr", args.lr)?;
    if let Some(min_lr) = args.min_lr {
        checks::float_in("--min-lr", min_lr, 0.0, args.lr, false)?;
    }
    checks::float_in(
        "--weight-decay",
        args.weight_decay,
        0.0,
        f64::INFINITY,
        false,
    )?;
    checks::float_in("--beta1", args.beta1, 0.0, 1.0, true)?;
    checks::float_in("--beta2", args.beta2, 0.0, 1.0, true)?;
    checks::float_in("--grad-clip", args.grad_clip, 0.0, f64::INFINITY, false)?;
    args.stall.watchdog()?;
    Ok(())
}

/// The batch sizes the flags and the model multiply out to must fit: tokens per step in
/// `usize`, and tokens seen by the last step in `u64`.
fn check_batch(args: &TrainArgs, block_size: usize) -> Result<(), Error> {
    let tokens_per_step = checks::product(
        &[
            ("--model", block_size),
            ("--batch-size", args.batch_size),
            ("--grad-accum", args.grad_accum),
            ("--nproc", args.nproc),
            ("--nnodes", args.nnodes),
        ],
        "the tokens per step",
    )?;
    let total = u64::try_from(tokens_per_step)
        .ok()
        .and_then(|t| t.checked_mul(args.steps));
    if total.is_none() {
        return Err(Error::InvalidFlag {
            flag: "--steps",
            value: args.steps.to_string(),
            reason: format!("times {tokens_per_step} tokens per step overflows the token count"),
        });
    }
    Ok(())
}

/// The `--model` preset when none is given.
const DEFAULT_MODEL: &str = "small";

/// The model of `--init-from-hf DIR`: its config.json's, or `--model`'s checked against it
/// (with the checkpoint's vocabulary when `--model` names none).
fn hf_shape(dir: &Path, model: Option<&str>) -> Result<ModelShape, Error> {
    let hf = HfGpt2Config::load(dir)?;
    let Some(text) = model else {
        return Ok(hf.model_shape());
    };
    let mut shape = ModelShape::resolve(text)?;
    hf.check_shape(&shape)
        .map_err(|reason| Error::HfCheckpoint {
            path: dir.join(HF_CONFIG_FILE),
            reason,
        })?;
    shape.vocab_size = Some(hf.vocab_size);
    Ok(shape)
}

fn build_config(args: &TrainArgs, out: PathBuf) -> Result<TrainConfig, Error> {
    check_flags(args)?;
    let mesh = MeshSpec::parse(&args.mesh)?;
    mesh.check_world(&args.mesh, args.nproc * args.nnodes)?;
    let data = args.data.clone().unwrap_or_else(default_corpus_path);
    // A dataset folder's meta.pkl brings its vocabulary size and, for characters, its tokenizer.
    let meta = dataset_meta(&data)?;
    let vocabulary = meta.as_ref().and_then(|m| m.itos.clone());
    let tokenizer_kind = match vocabulary {
        Some(_) => TokenizerKind::Char,
        None => args.tokenizer,
    };
    let tokenizer = Tokenizer::from_parts(tokenizer_kind, vocabulary.as_deref())?;
    let default_vocab = meta
        .as_ref()
        .map_or(tokenizer.vocab_size(), |m| m.vocab_size);
    let model_text = args.model.as_deref().unwrap_or(DEFAULT_MODEL);
    let shape = match &args.init_from_hf {
        Some(dir) => hf_shape(dir, args.model.as_deref())?,
        None => ModelShape::resolve(model_text)?,
    };
    // Errors about the shape name what --model was given (a preset or the JSON file).
    let model = shape
        .config(default_vocab, args.seed)
        .map_err(|error| match error {
            Error::InvalidModel { reason, .. } => Error::InvalidModel {
                text: model_text.to_string(),
                reason,
            },
            other => other,
        })?;
    // A text corpus is encoded here: the model must cover every id the tokenizer produces.
    // Token files are checked against their largest id instead (preflight, and each rank).
    if !is_token_data(&data) && model.vocab_size < tokenizer.vocab_size() {
        return Err(Error::InvalidModel {
            text: model_text.to_string(),
            reason: format!(
                "vocab_size {} is smaller than the tokenizer's {}",
                model.vocab_size,
                tokenizer.vocab_size()
            ),
        });
    }
    check_batch(args, model.block_size)?;
    let eval_every = args.eval_every.unwrap_or(if has_val_split(&data) {
        (args.steps / 10).max(1)
    } else {
        0
    });
    let losses = args
        .losses
        .clone()
        .unwrap_or_else(|| out.join("losses.jsonl"));
    Ok(TrainConfig {
        model,
        mesh,
        data,
        tokenizer: tokenizer_kind,
        vocabulary,
        data_order: args.data_order,
        steps: args.steps,
        micro_batch: args.batch_size,
        grad_accum: args.grad_accum,
        seed: args.seed,
        optim: OptimConfig {
            lr: args.lr,
            min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
            warmup_steps: args.warmup_steps,
            schedule: args.lr_schedule,
            decay_steps: args.lr_decay_steps,
            beta1: args.beta1,
            beta2: args.beta2,
            eps: 1e-8,
            weight_decay: args.weight_decay,
            grad_clip: args.grad_clip,
        },
        param_dtype: args.param_dtype.dtype(),
        reduce_dtype: args.reduce_dtype.dtype(),
        init: args.init.clone(),
        init_from_hf: args.init_from_hf.clone(),
        eager_init: args.eager_init,
        activation_checkpointing: args.activation_checkpointing,
        keep_step_buffers: args.keep_step_buffers.unwrap_or(true),
        device: args.device,
        out,
        resume: args.resume,
        reset_optimizer: args.reset_optimizer,
        allow_nonfinite: args.allow_nonfinite,
        checkpoint_every: args.checkpoint_every,
        eval_every,
        losses,
    })
}

/// The checks that would otherwise fail on every rank at once: data readable and well
/// formed, resume target present and of the same model, nothing overwritten.
fn preflight(config: &TrainConfig, args: &TrainArgs) -> Result<(), Error> {
    if config.out.exists() && !config.out.is_dir() {
        return Err(Error::InvalidOutput {
            flag: "--out",
            path: config.out.clone(),
            reason: "is not a directory (the run's outputs go into one)".to_string(),
        });
    }
    let tokenizer = Tokenizer::from_parts(config.tokenizer, config.vocabulary.as_deref())?;
    let data = load_dataset(&config.data, &tokenizer)?;
    let needed = config.model.block_size + 2;
    // The validation split is cut into windows only when evaluated.
    let evaluated = data.val.as_ref().filter(|_| config.eval_every > 0);
    for split in std::iter::once(&data.train).chain(evaluated) {
        split.check_vocab(config.model.vocab_size)?;
        if split.len() < needed {
            return Err(Error::DataTooShort {
                path: split.path.clone(),
                tokens: split.len(),
                block_size: config.model.block_size,
                needed,
            });
        }
    }
    check_memory(config, args, &data)?;
    if let Some(init) = &config.init {
        check_init(init)?;
    }
    if let Some(dir) = &config.init_from_hf {
        SafetensorsIndex::open(&dir.join(HF_WEIGHTS_FILE))?;
        if HfGpt2Config::load(dir)?.approximates_gelu() {
            eprintln!(
                "note: {} asks for a tanh-approximated GELU; hypershard computes the exact GELU \
                 (as nanoGPT does with GPT-2 weights), so logits differ slightly from transformers'",
                dir.join(HF_CONFIG_FILE).display()
            );
        }
    }
    if config.resume {
        let checkpoint = Checkpoint::open(&checkpoint_root(&config.out))?;
        checkpoint.check_model_config(&config.model.to_json())?;
        resume::check(&checkpoint, config, args.override_resume_config)?;
    } else {
        check_fresh(&config.out)?;
    }
    check_losses(&config.losses, args.losses.is_some(), config.resume)
}

/// The estimate of one rank's memory against what a rank of this node may use, before any
/// rank starts: a run that cannot fit stops here with one line naming the estimate, the limit
/// and the flags behind it, rather than with every rank aborting in the allocator. Sizes that
/// overflow are refused even with `--no-memory-check`.
fn check_memory(config: &TrainConfig, args: &TrainArgs, data: &Dataset) -> Result<(), Error> {
    let tokens = data.train.len() + data.val.as_ref().map_or(0, |val| val.len());
    let estimate = estimate(config, tokens as u64)?;
    if args.no_memory_check {
        return Ok(());
    }
    check_fits(
        config,
        &estimate,
        &rank_limits(args.nproc, args.max_rank_memory),
    )
}

/// `--init` must be a regular file with a well-formed safetensors header (errors name it).
fn check_init(init: &Path) -> Result<(), Error> {
    let meta = std::fs::metadata(init).map_err(|e| Error::io(FileAction::Read, init, e))?;
    if !meta.is_file() {
        return Err(Error::InvalidFlag {
            flag: "--init",
            value: init.display().to_string(),
            reason: "is not a regular file (a safetensors file is expected)".to_string(),
        });
    }
    SafetensorsIndex::open(init).map(drop)
}

/// Rank 0's line on how its collective data travels: to `shm_peers` of its `peers` through
/// shared memory, to the rest over TCP.
fn transport_note(shm_peers: usize, peers: usize) -> String {
    match shm_peers {
        0 => "collectives over TCP".to_string(),
        n if n == peers => format!("collectives over shared memory ({n} of {peers} peers)"),
        n => format!(
            "collectives over shared memory ({n} of {peers} peers), TCP to the other {}",
            peers - n
        ),
    }
}

/// `--transport`'s words, as `HYPERSHARD_TRANSPORT` spells them.
fn parse_transport(text: &str) -> Result<collectives::shm::TransportPolicy, String> {
    collectives::shm::TransportPolicy::parse(text)
        .ok_or_else(|| format!("expected tcp, auto or shm, got {text:?}"))
}

pub fn run(args: TrainArgs) -> Result<(), Error> {
    if args.worker {
        return run_worker(&args);
    }
    let out = args.out.clone().unwrap_or_else(fresh_out_dir);
    let config = build_config(&args, out.clone())?;
    preflight(&config, &args)?;
    std::fs::create_dir_all(&out).map_err(|e| Error::io(FileAction::CreateDir, &out, e))?;
    let world_size = args.nproc * args.nnodes;
    // One rank runs in this process, unless it needs a cgroup of its own.
    if world_size == 1 && args.max_rank_memory.is_none() {
        let world = collectives::local::spawn_world(1)?.remove(0);
        if let Some(summary) = run_rank(config, world)? {
            print_summary(&summary);
        }
        return Ok(());
    }
    let program = std::env::current_exe()
        .map_err(|e| Error::io(FileAction::Read, "current executable", e))?;
    let mut worker_args: Vec<OsString> = std::env::args_os().skip(1).collect();
    worker_args.push("--worker".into());
    let mut extra_env: Vec<(OsString, OsString)> = [(OUT_ENV.into(), out.into_os_string())]
        .into_iter()
        .chain(args.stall.rank_env())
        .collect();
    let inherited = std::env::var(collectives::shm::TRANSPORT_ENV).ok();
    if let Some(word) = worker_transport(args.transport, inherited.as_deref()) {
        extra_env.push((collectives::shm::TRANSPORT_ENV.into(), word.into()));
    }
    if args.device == TrainDevice::Cuda {
        let explicit = std::env::var(collectives::BACKEND_ENV).ok();
        if let Some(backend) =
            default_cuda_backend(explicit.as_deref(), args.nproc, world_size, gpu_count()?)
        {
            extra_env.push((collectives::BACKEND_ENV.into(), backend.into()));
        }
    }
    let launch_config = LaunchConfig {
        nproc_per_node: args.nproc,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        program: program.into_os_string(),
        args: worker_args,
        extra_env,
        stop_timeout: Duration::from_secs(5),
        rank0_owns_terminal: true,
        max_rank_memory: args.max_rank_memory,
    };
    launch(&launch_config)?;
    Ok(())
}

fn run_worker(args: &TrainArgs) -> Result<(), Error> {
    let out = args
        .out
        .clone()
        .or_else(|| std::env::var_os(OUT_ENV).map(PathBuf::from))
        .unwrap_or_else(fresh_out_dir);
    let config = build_config(args, out)?;
    // HYPERSHARD_BACKEND (tcp by default, or mpi) picks the backend; the world keeps the TCP
    // store alive when there is one.
    let world = collectives::init_default_from_env()?;
    // The stall watchdog (TCP worlds): dropped before the world, which it publishes about.
    let _watchdog = match (args.stall.watchdog()?, world.tcp()) {
        (Some(config), Some(tcp)) => Some(collectives::watchdog::Watchdog::start(tcp, config)?),
        _ => None,
    };
    if let Some(tcp) = world.tcp()
        && world.comm.rank() == 0
    {
        let peers = world.comm.size().saturating_sub(1);
        println!("{}", transport_note(tcp.comm.shm_peers().len(), peers));
    }
    let comm: Arc<dyn collectives::Communicator> = world.comm.clone();
    let summary = run_rank(config, Arc::clone(&comm))?;
    // Rank 0 hosts the store: keep it up until every rank is done with it.
    comm.barrier()?;
    if let Some(summary) = summary {
        print_summary(&summary);
    }
    drop(world);
    Ok(())
}
