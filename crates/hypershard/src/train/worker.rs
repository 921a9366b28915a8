//! One training rank: build the GPT, wrap it with `fully_shard` (each block its own unit, the
//! root holding the embeddings and the final norm), and run the steps.

use std::path::PathBuf;
use std::sync::Arc;

use hypershard_collectives::watchdog::{Phase, set_phase};
use hypershard_collectives::{CommCounter, Communicator, CommunicatorExt, ReduceOp};
use hypershard_fsdp::{
    DataParallelMesh, FsdpModule, FullyShardConfig, MixedPrecisionPolicy, fully_shard,
    fully_shard_children, has_params,
};
use hypershard_nn::{Checkpointed, DEFAULT_IGNORE_INDEX, Gpt, LossTargets, Module, replace_module};
use hypershard_tensor::{DType, Device, Tensor};
use serde_json::json;

use super::config::TrainConfig;
use super::fault::{Fault, FaultPoint};
use super::finite::check_finite_parameters;
use super::hf::attach_hf_init;
use super::init_file::attach_init_file;
use super::memory::{MemoryMeter, gather_memory};
use super::optimizer::ShardedAdamW;
use super::report::{LossRecord, Reporter, ReporterConfig, TrainSummary};
use super::shards::{SaveOptions, ShardContext, global_shapes, load, save};
use crate::checkpoint::{Checkpoint, CheckpointDir, CommitInfo};
use crate::data::{
    BatchLayout, Batcher, DataOrder, Dataset, MicroBatch, TokenData, Tokenizer, load_dataset,
};
use crate::error::{Error, Result};

/// The fraction of the corpus held out for `--eval-every`.
pub const EVAL_FRACTION: f64 = 0.1;

/// The checkpoint root of an output directory.
pub fn checkpoint_root(out: &std::path::Path) -> PathBuf {
    out.join("checkpoints")
}

/// What the ranks hold while training.
struct Trainer {
    config: TrainConfig,
    world: Arc<dyn Communicator>,
    counter: Arc<CommCounter>,
    mesh: Arc<DataParallelMesh>,
    model: FsdpModule,
    /// The targets of the model's next forward (its loss head is fused).
    loss_targets: LossTargets,
    optimizer: ShardedAdamW,
    shapes: std::collections::BTreeMap<String, Vec<usize>>,
    batcher: Batcher,
    eval: Option<Batcher>,
    /// The fault `HYPERSHARD_FAULT` arms (reliability tests), if any.
    fault: Option<Fault>,
    /// The step being trained (where a fault fires).
    step: u64,
    /// Where this rank's memory goes.
    meter: MemoryMeter,
    /// Where the model, the batches and the activations live (`--device`).
    device: Device,
}

fn ids_tensor(name: &str, ids: &[u32], shape: &[usize], device: &Device) -> Result<Tensor> {
    let values: Vec<i64> = ids.iter().map(|t| i64::from(*t)).collect();
    Tensor::from_vec_on(values, shape, device).map_err(|source| Error::Tensor {
        name: name.to_string(),
        source,
    })
}

/// Loads the corpus; when asked to evaluate, on the dataset's `val.bin` or else on a
/// held-out tenth split off the end.
fn corpus(config: &TrainConfig) -> Result<(TokenData, Option<TokenData>)> {
    let tokenizer = Tokenizer::from_parts(config.tokenizer, config.vocabulary.as_deref())?;
    let Dataset { train, val } = load_dataset(&config.data, &tokenizer)?;
    for split in std::iter::once(&train).chain(&val) {
        split.check_vocab(config.model.vocab_size)?;
    }
    match (config.eval_every, val) {
        (0, _) => Ok((train, None)),
        (_, Some(val)) => Ok((train, Some(val))),
        (_, None) => {
            let (train, eval) = train.split_tail(EVAL_FRACTION);
            Ok((train, Some(eval)))
        }
    }
}

impl Trainer {
    fn new(config: TrainConfig, world: Arc<dyn Communicator>) -> Result<Trainer> {
        let meter = MemoryMeter::start();
        // One device per rank on a node: the launcher's LOCAL_RANK (torchrun's), else the
        // rank (a single process).
        let local_rank = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| world.rank());
        let device = config.device.resolve(local_rank)?;
        let counter = CommCounter::new(Arc::clone(&world));
        let counted: Arc<dyn Communicator> = counter.clone();
        let (train, eval) = corpus(&config)?;
        let layout = BatchLayout {
            block_size: config.model.block_size,
            micro_batch: config.micro_batch,
            grad_accum: config.grad_accum,
            world_size: world.size(),
        };
        let batcher = Batcher::new(Arc::new(train), layout, config.data_order, config.seed)?;
        let eval = match eval {
            Some(data) => {
                let eval_layout = BatchLayout {
                    grad_accum: 1,
                    ..layout
                };
                Some(Batcher::new(
                    Arc::new(data),
                    eval_layout,
                    DataOrder::Sequential,
                    0,
                )?)
            }
            None => None,
        };
        // Deferred: no rank ever holds the whole model; fully_shard below materialises each
        // rank's shard alone (from the init recipe or the --init file's rows), equal bit for
        // bit to the same block of the eagerly built model.
        let mut gpt = if config.eager_init {
            Gpt::new(config.model.gpt())?
        } else {
            Gpt::new_deferred(config.model.gpt())?
        };
        if let Some(init) = &config.init {
            attach_init_file(&mut gpt, init)?;
        }
        if let Some(dir) = &config.init_from_hf {
            attach_hf_init(&mut gpt, dir)?;
        }
        if config.eager_init {
            // Built whole on the host, then moved: deferred models are materialised on the
            // device by fully_shard below instead.
            hypershard_nn::to_device(&mut gpt, &device)?;
        }
        let shapes = global_shapes(&gpt)?;
        // The lm_head and the loss run fused, in blocks of tokens: the [B, T, V] logits and
        // their gradient are never held whole (docs/fsdp.md, "How memory per rank scales").
        let loss_targets = gpt.fused_loss(DEFAULT_IGNORE_INDEX);
        let mesh = if config.mesh.replicas == 1 {
            DataParallelMesh::fsdp(counted)?
        } else {
            DataParallelMesh::hsdp(counted, config.mesh.replicas)?
        };
        // Over several ranks the root's wte is an all-gathered copy, freed at the root's
        // post-backward and read by nothing after the fused head: the head's weight gradient
        // can live in its memory, so a rank holds one `[V, C]` buffer through backward, not two
        // (docs/fsdp.md). At one rank the unsharded wte is the parameter itself.
        gpt.keep_head_grad_in_gathered_weight(mesh.world().size() > 1);
        let mut fsdp = FullyShardConfig::new(Arc::clone(&mesh));
        fsdp.device = Some(device);
        fsdp.mp_policy = MixedPrecisionPolicy {
            param_dtype: (config.param_dtype != DType::F32).then_some(config.param_dtype),
            reduce_dtype: (config.reduce_dtype != DType::F32).then_some(config.reduce_dtype),
            ..MixedPrecisionPolicy::default()
        };
        if config.activation_checkpointing {
            // Checkpoint first, then shard: each unit's hooks wrap the recomputation, so its
            // backward all-gather serves it (docs/fsdp.md, activation checkpointing).
            for block in gpt.blocks_mut().iter_mut() {
                replace_module(block, |b| Ok(Box::new(Checkpointed::new(b))))?;
            }
        }
        // Each transformer block is its own unit; the root keeps wte, wpe and ln_f.
        fully_shard_children(&mut gpt, &fsdp, &mut |name, block| {
            name.starts_with("transformer.h.") && has_params(block)
        })?;
        let mut model = fully_shard(Box::new(gpt), fsdp).map_err(|rejected| rejected.error)?;
        model.set_release_buffers_after_backward(!config.keep_step_buffers);
        let optimizer = ShardedAdamW::new(config.optim);
        let mut meter = meter;
        meter.after_build();
        Ok(Trainer {
            config,
            world,
            counter,
            mesh,
            model,
            loss_targets,
            optimizer,
            shapes,
            batcher,
            eval,
            fault: Fault::from_env(),
            step: 0,
            meter,
            device,
        })
    }

    fn shard_context(&self) -> ShardContext<'_> {
        ShardContext {
            mesh: &self.mesh,
            world: self.world.as_ref(),
            global_shapes: &self.shapes,
        }
    }

    /// Restores model, optimizer and step from `OUT/checkpoints`; returns the next step.
    fn resume(&mut self) -> Result<u64> {
        let checkpoint = Checkpoint::open(&checkpoint_root(&self.config.out))?;
        checkpoint.check_model_config(&self.config.model.to_json())?;
        let state = &checkpoint.metadata().state;
        let step = checkpoint.step();
        // --reset-optimizer: fresh moments, and bias correction from step 0 again.
        let optimizer = if self.config.reset_optimizer {
            None
        } else {
            self.optimizer.step = state["optimizer_step"].as_u64().unwrap_or(step);
            Some(&mut self.optimizer)
        };
        let ctx = ShardContext {
            mesh: &self.mesh,
            world: self.world.as_ref(),
            global_shapes: &self.shapes,
        };
        load(&ctx, &checkpoint, &mut self.model, optimizer)?;
        Ok(step)
    }

    fn micro_loss(&mut self, batch: &MicroBatch, scale: f64, backward: bool) -> Result<f64> {
        let device = self.device;
        let ids = ids_tensor(
            "input ids",
            &batch.inputs,
            &[batch.rows, batch.cols],
            &device,
        )?;
        let targets = ids_tensor(
            "targets",
            &batch.targets,
            &[batch.rows * batch.cols],
            &device,
        )?;
        let (fault, rank) = (self.fault.as_ref(), self.world.rank());
        if backward {
            Fault::maybe_fire(fault, FaultPoint::Forward, self.step, rank);
            set_phase(Phase::Forward, self.step);
        }
        if backward {
            self.loss_targets.for_backward(targets);
        } else {
            self.loss_targets.for_eval(targets);
        }
        let loss = self.model.forward(&ids)?;
        if backward {
            Fault::maybe_fire(fault, FaultPoint::Backward, self.step, rank);
            set_phase(Phase::Backward, self.step);
        }
        // The one scalar comes back to the host (no copy when it is there).
        let loss = match loss.to_host().and_then(|loss| loss.to_f64_vec()) {
            Ok(values) if values.len() == 1 => values[0],
            _ => {
                return Err(Error::Tensor {
                    name: "loss".to_string(),
                    source: hypershard_tensor::Error::ShapeMismatch {
                        op: "loss",
                        lhs: vec![1],
                        rhs: loss.shape().to_vec(),
                    },
                });
            }
        };
        if backward {
            let scale = Tensor::from_vec_on(vec![scale], &[1], &device).map_err(|source| {
                Error::Tensor {
                    name: "loss scale".to_string(),
                    source,
                }
            })?;
            self.model.backward(&scale)?;
        }
        Ok(loss)
    }

    /// Clips the global gradient norm (torch's `clip_grad_norm_`): the squares of the local
    /// shards are summed over the shard group (replicas hold the same reduced gradients).
    fn clip_gradients(&mut self) -> Result<f64> {
        let mut sum_sq = 0.0f64;
        self.model.visit_params("", &mut |_, param| {
            if let Some(grad) = &param.grad {
                sum_sq += hypershard_nn::optim::sum_of_squares(grad)?;
            }
            Ok(())
        })?;
        let total = self
            .mesh
            .shard()
            .all_reduce_vec(vec![sum_sq], ReduceOp::Sum)?;
        let norm = total[0].sqrt();
        let max_norm = self.config.optim.grad_clip;
        let coefficient = max_norm / (norm + 1e-6);
        if max_norm > 0.0 && coefficient < 1.0 {
            self.model.visit_params_mut("", &mut |_, param| {
                if let Some(grad) = &param.grad {
                    grad.scale_(coefficient)?;
                }
                Ok(())
            })?;
        }
        Ok(norm)
    }

    fn train_step(&mut self, step: u64) -> Result<f64> {
        let _span = tracing::info_span!("train.step", step).entered();
        self.step = step;
        let lr = self.config.optim.lr_at(step, self.config.steps);
        self.model.zero_grad()?;
        let accum = self.config.grad_accum;
        let rank = self.world.rank();
        let mut loss_sum = 0.0;
        for micro in 0..accum {
            let batch = self.batcher.micro_batch(step, rank, micro);
            loss_sum += self.micro_loss(&batch, 1.0 / accum as f64, true)?;
        }
        set_phase(Phase::Optimizer, step);
        Fault::maybe_fire(self.fault.as_ref(), FaultPoint::Optimizer, step, rank);
        if self.config.optim.grad_clip > 0.0 {
            self.clip_gradients()?;
        }
        if self.optimizer.moments.is_empty() {
            // The first optimizer step allocates AdamW's moments. nn's cached kernel outputs
            // (up to the activations' peak) go back first, so the two never stack on the
            // resident peak; later steps allocate nothing here, and the cache refilled by the
            // next forward stays from then on (docs/fsdp.md).
            hypershard_nn::release_cached_kernel_buffers();
        }
        self.optimizer.step(&mut self.model, lr)?;
        self.meter.after_step(&self.model, &self.optimizer)?;
        let mean = self
            .world
            .all_reduce_vec(vec![loss_sum / accum as f64], ReduceOp::Avg)?;
        Ok(mean[0])
    }

    fn evaluate(&mut self) -> Result<f64> {
        let Some(eval) = self.eval.clone() else {
            return Ok(f64::NAN);
        };
        let rank = self.world.rank();
        set_phase(Phase::Eval, self.step);
        let mut sum = 0.0;
        // A fixed set: the first 4 global batches of the held-out tenth.
        const EVAL_BATCHES: u64 = 4;
        for batch in 0..EVAL_BATCHES {
            sum += self.micro_loss(&eval.micro_batch(batch, rank, 0), 1.0, false)?;
        }
        // The root keeps its parameters gathered after forward (a backward usually follows);
        // without one, reshard it so the shards are what the optimizer and checkpoints see.
        self.model.reshard()?;
        let mean = self
            .world
            .all_reduce_vec(vec![sum / EVAL_BATCHES as f64], ReduceOp::Avg)?;
        Ok(mean[0])
    }

    fn save(&mut self, steps_done: u64) -> Result<()> {
        let _span = tracing::info_span!("train.checkpoint", step = steps_done).entered();
        set_phase(Phase::Checkpoint, steps_done);
        if !self.config.allow_nonfinite {
            check_finite_parameters(&self.model, self.world.as_ref(), steps_done)?;
        }
        let info = CommitInfo {
            step: steps_done,
            world_size: self.world.size(),
            model_config: self.config.model.to_json(),
            state: json!({
                "optimizer_step": self.optimizer.step,
                "data": {
                    "order": self.config.data_order,
                    "seed": self.config.seed,
                    "next_step": steps_done,
                    "global_batch": self.batcher.layout().global_batch(),
                    "block_size": self.config.model.block_size,
                },
                "rng": {"kind": "counter", "seed": self.config.seed, "position": steps_done},
                "tokenizer": self.config.tokenizer,
                "vocabulary": self.config.vocabulary,
                "mesh": self.config.mesh,
                "seed": self.config.seed,
            }),
        };
        let root = CheckpointDir::new(checkpoint_root(&self.config.out));
        let fault = self
            .fault
            .filter(|f| f.point == FaultPoint::Checkpoint && f.step == steps_done);
        save(
            &self.shard_context(),
            &root,
            &self.model,
            &self.optimizer,
            SaveOptions { info, fault },
        )
    }
}

/// Runs one rank of `hypershard train` over `world` (every rank calls it alike). Rank 0
/// returns the summary; the others return `None`.
pub fn run_rank(config: TrainConfig, world: Arc<dyn Communicator>) -> Result<Option<TrainSummary>> {
    // The loop runs on a thread of the kernels' pool itself when it can: every parallel kernel
    // then starts on the calling thread, where from outside the pool each one is handed to a
    // pool thread and waited for (a wake-up and a sleep per kernel, on cores other ranks may
    // share). It can with one kernel thread, and at one rank, which gathers nothing; a rank of
    // several with more threads stays outside, so that FSDP's large copy-in and copy-out may
    // split over the pool (tensor's `copy_from` splits only off the pool's threads).
    let threads = rayon::current_num_threads();
    if (threads == 1 || config.mesh.ranks() == 1) && rayon::current_thread_index().is_none() {
        return hypershard_nn::with_num_threads(threads, move || train_rank(config, world))?;
    }
    train_rank(config, world)
}

/// [`run_rank`] on the calling thread.
fn train_rank(config: TrainConfig, world: Arc<dyn Communicator>) -> Result<Option<TrainSummary>> {
    if config.mesh.ranks() == 1 {
        // One rank shards nothing and owns the machine's memory: its activation-sized blocks
        // stay in the heap for reuse instead of being mapped afresh each layer (allocator.rs).
        crate::allocator::use_single_rank_thresholds();
    }
    let mut trainer = Trainer::new(config, world)?;
    let start = if trainer.config.resume {
        trainer.resume()?
    } else {
        0
    };
    let rank = trainer.world.rank();
    let total = trainer.config.steps;
    let tokens_per_step = trainer.batcher.layout().tokens_per_step() as u64;
    let mut reporter = if rank == 0 {
        let reporter = Reporter::new(ReporterConfig {
            losses: trainer.config.losses.clone(),
            append: trainer.config.resume,
            start_step: start,
            total_steps: total,
            tokens_per_step,
        })?;
        reporter.note(&format!(
            "training GPT ({} layers, {} wide, {} params) on {} ranks, mesh {}, {} tokens/step",
            trainer.config.model.n_layer,
            trainer.config.model.n_embd,
            trainer
                .shapes
                .values()
                .map(|s| s.iter().product::<usize>())
                .sum::<usize>(),
            trainer.world.size(),
            trainer.config.mesh.label(),
            tokens_per_step
        ));
        if start > 0 {
            reporter.note(&format!("resumed from step {start}"));
        }
        Some(reporter)
    } else {
        None
    };
    trainer.counter.reset();
    for step in start..total {
        let timer = std::time::Instant::now();
        // The step's kernels alternate with short serial stretches; the pool's other threads
        // poll through them instead of sleeping (see `keep_warm`).
        let loss = hypershard_nn::keep_warm(|| trainer.train_step(step))?;
        let step_seconds = timer.elapsed().as_secs_f64();
        // The loss is the mean over the ranks, so every rank stops here alike.
        if !loss.is_finite() && !trainer.config.allow_nonfinite {
            return Err(Error::NonFiniteLoss { step, loss });
        }
        let lr = trainer.config.optim.lr_at(step, total);
        if let Some(reporter) = reporter.as_mut() {
            reporter.step(
                LossRecord {
                    step,
                    loss,
                    lr,
                    tokens: (step + 1) * tokens_per_step,
                },
                step_seconds,
            )?;
        }
        let done = step + 1;
        if trainer.config.eval_every > 0 && done % trainer.config.eval_every == 0 {
            let eval = hypershard_nn::keep_warm(|| trainer.evaluate())?;
            if let Some(reporter) = reporter.as_mut() {
                reporter.eval(step, eval);
            }
        }
        let every = trainer.config.checkpoint_every;
        if (every > 0 && done % every == 0) || done == total {
            trainer.save(done)?;
        }
    }
    let steps_run = total.saturating_sub(start).max(1) as f64;
    let sent: u64 = sum_bytes(&trainer.counter);
    let bytes_per_step = sent as f64 / steps_run;
    let own = trainer
        .meter
        .report(rank, trainer.mesh.comm_buffer_stats().peak_in_use_bytes);
    let memory = gather_memory(trainer.world.as_ref(), own)?;
    match reporter {
        Some(reporter) => Ok(Some(reporter.finish(
            &trainer.config.out.join("loss.svg"),
            bytes_per_step,
            memory,
        )?)),
        None => Ok(None),
    }
}

/// Bytes counted on a communicator and every sub-communicator split from it.
fn sum_bytes(counter: &CommCounter) -> u64 {
    let own: u64 = counter.snapshot().ops.values().map(|c| c.bytes).sum();
    own + counter
        .children()
        .iter()
        .map(|child| sum_bytes(child))
        .sum::<u64>()
}
