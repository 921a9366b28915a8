//! Before training: the bytes one rank will need, from the model, the batch, the mesh and the
//! flags, against what the rank may use, so a run that cannot fit stops with one error line
//! instead of every rank aborting in the allocator.
//!
//! The formula (docs/cli.md, "Memory check") is an upper estimate of the largest terms, not
//! an exact account. With `N = batch_size · block_size` tokens per micro-step, `P` parameters,
//! `S` shards per parameter (the second number of `--mesh`), `L` layers of width `C` with `H`
//! heads, vocabulary `V`, block size `T`, a block unit of `B = 12·C² + 13·C` parameters, the root unit of
//! `R = V·C + T·C + 2·C` (the embeddings, ln_f), `p` and `r` the bytes of `--param-dtype` and
//! `--reduce-dtype`:
//!
//! - state: `16·⌈P/S⌉` (f32 parameter shard, gradient shard, two AdamW moments), plus `4·P`
//!   with `--eager-init` (the whole model is built before it is sharded);
//! - the rest is taken at whichever of four moments holds the most, each term its size then:
//!   1. forward, in a block: the root gathered and two blocks (`R·p + 2·B·p`), what the blocks
//!      before kept, the embeddings;
//!   2. the fused head: the root gathered, the kept activations, a block of at most 2²³ logits,
//!      the head's gradients of its weight and the hidden states (`4·V·C + 4·N·C`), the
//!      embeddings;
//!   3. backward, in a block: the root less the head weight (with f32 parameters the weight's
//!      memory holds the head's gradient from then on), this block and the next gathered, this
//!      block's f32 gradients, the previous block's reduce-scatter input and output
//!      (`(R − V·C)·p + B·(2·p + 4) + B·r + ⌈B/S⌉·r`); the kept activations, one block
//!      recomputed (with checkpointing) and one block's gradients; the head's gradients;
//!   4. the root's post-backward: its parameters freed, its other gradients, reduce-scatter
//!      input and output (`(R − V·C)·4 + R·r + ⌈R/S⌉·r`), and the head's gradients;
//!
//!   where a block keeps `4·N·(18·C + H)` for backward (its inputs, q/k/v, the attention
//!   output and its per-row log-sum-exp — the tiled attention never holds the `T × T`
//!   probabilities —, the MLP's 4C hidden twice, the norms and residuals), or with
//!   `--activation-checkpointing` `4·N·C` (its input);
//! - data: 4 bytes per corpus token (ids in memory);
//! - runtime: 64 MiB (code, thread stacks, allocator), and against an address-space limit
//!   (`ulimit -v`) 1 GiB, which counts reserved rather than used memory.
//!
//! At one rank nothing is gathered or reduced: the communication terms keep only the cast
//! copies of the parameters (`p`-byte copies of what is gathered above, none with f32
//! parameters), and the head's gradient lives in a buffer of its own.

use crate::error::{Error, Result};
use crate::launch::{MemoryLimit, human_bytes};

use hypershard_tensor::DType;

use super::config::TrainConfig;

/// Logit elements per block of the fused loss head.
const FUSED_LOSS_BLOCK: u64 = 1 << 23;

/// Memory of the process outside the terms: code, libraries, thread stacks, allocator.
const RUNTIME_BYTES: u64 = 64 << 20;

/// The same against a limit on address space, which counts what threads and allocator arenas
/// reserve (a rank maps far more than it touches).
const RUNTIME_ADDRESS_SPACE_BYTES: u64 = 1 << 30;

/// One rank's estimated memory, term by term, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Parameter and gradient shards and optimizer moments (and the whole model at start-up
    /// with `--eager-init`).
    pub state: u64,
    /// FSDP's all-gather and reduce-scatter buffers (the unsharded parameters and gradients),
    /// at the moment of the largest sum of this and the next two terms.
    pub comm: u64,
    /// Activations kept for backward, and backward's gradients of one block.
    pub activations: u64,
    /// Logits, their softmax and gradient, and the embeddings.
    pub logits: u64,
    /// The corpus as token ids.
    pub data: u64,
}

impl MemoryEstimate {
    /// The terms' sum, without the runtime (it cannot overflow: each term was checked to be
    /// below `u64::MAX / 8`).
    pub fn terms(&self) -> u64 {
        self.state + self.comm + self.activations + self.logits + self.data
    }

    /// What a limit is compared with: the terms plus the runtime that limit counts.
    pub fn needed_under(&self, limit: &MemoryLimit) -> u64 {
        let runtime = if limit.address_space {
            RUNTIME_ADDRESS_SPACE_BYTES
        } else {
            RUNTIME_BYTES
        };
        self.terms() + runtime
    }

    fn breakdown(&self, runtime: u64) -> String {
        format!(
            "state {}, communication buffers {}, activations {}, logits {}, data {}, runtime {}",
            human_bytes(self.state),
            human_bytes(self.comm),
            human_bytes(self.activations),
            human_bytes(self.logits),
            human_bytes(self.data),
            human_bytes(runtime)
        )
    }
}

/// A checked product of `factors`, each term kept below `u64::MAX / 8` so the terms' sum
/// (five of them) plus the runtime cannot overflow either.
fn product(term: &'static str, drivers: impl Fn() -> String, factors: &[u64]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |acc, f| acc.checked_mul(*f))
        .filter(|bytes| *bytes < u64::MAX / 8)
        .ok_or_else(|| Error::MemoryOverflow {
            term,
            drivers: drivers(),
        })
}

fn sum(term: &'static str, drivers: impl Fn() -> String, parts: &[u64]) -> Result<u64> {
    parts
        .iter()
        .try_fold(0u64, |acc, p| acc.checked_add(*p))
        .filter(|bytes| *bytes < u64::MAX / 8)
        .ok_or_else(|| Error::MemoryOverflow {
            term,
            drivers: drivers(),
        })
}

/// The estimate for one rank of `config`, whose corpus holds `data_tokens` tokens.
pub fn estimate(config: &TrainConfig, data_tokens: u64) -> Result<MemoryEstimate> {
    let m = &config.model;
    let as_u64 = |n: usize| n as u64;
    let (v, t, l, h, c) = (
        as_u64(m.vocab_size),
        as_u64(m.block_size),
        as_u64(m.n_layer),
        as_u64(m.n_head),
        as_u64(m.n_embd),
    );
    let b = as_u64(config.micro_batch);
    let s = as_u64(config.mesh.shards.max(1));
    let model_drivers = || {
        format!(
            "--model (n_layer {}, n_embd {}, vocab_size {}, block_size {})",
            m.n_layer, m.n_embd, m.vocab_size, m.block_size
        )
    };
    let batch_drivers = || {
        format!(
            "--batch-size {} and --model (block_size {}, vocab_size {}, n_embd {}, n_head {}, \
             n_layer {})",
            config.micro_batch, m.block_size, m.vocab_size, m.n_embd, m.n_head, m.n_layer
        )
    };
    let params = m
        .parameter_count()
        .map(as_u64)
        .ok_or_else(|| Error::MemoryOverflow {
            term: "parameter count",
            drivers: model_drivers(),
        })?;
    let shard = params.div_ceil(s);
    let eager = if config.eager_init {
        product("training state", model_drivers, &[4, params])?
    } else {
        0
    };
    let shards = product("training state", model_drivers, &[16, shard])?;
    let state = sum("training state", model_drivers, &[shards, eager])?;

    // The units: a block (12·C² + 13·C with biases) and the root (the embeddings, ln_f), of
    // which the tied token embedding, the head weight, is `V·C`.
    let comm_drivers = model_drivers;
    let block = sum(
        "communication buffers",
        comm_drivers,
        &[
            product("communication buffers", comm_drivers, &[12, c, c])?,
            product("communication buffers", comm_drivers, &[13, c])?,
        ],
    )?;
    let head = product("communication buffers", comm_drivers, &[v, c])?;
    let root = sum(
        "communication buffers",
        comm_drivers,
        &[
            head,
            product("communication buffers", comm_drivers, &[t, c])?,
            product("communication buffers", comm_drivers, &[2, c])?,
        ],
    )?;
    let p = as_u64(config.param_dtype.size_of());
    let r = as_u64(config.reduce_dtype.size_of());
    // From the fused head to the root's post-backward the head's f32 weight gradient lives in
    // the memory of the gathered weight when that has the same width (f32 parameters).
    let head_in_weight = if config.param_dtype == DType::F32 {
        head
    } else {
        0
    };
    let comm_term = |parts: &[(u64, u64)]| -> Result<u64> {
        let bytes = parts
            .iter()
            .map(|&(n, size)| product("communication buffers", comm_drivers, &[n, size]))
            .collect::<Result<Vec<u64>>>()?;
        sum("communication buffers", comm_drivers, &bytes)
    };
    // The communication term at each moment: forward (the root gathered all along, a block
    // gathered and the next one prefetched), the fused head (every block resharded, nothing
    // prefetched), backward in a block, and the root's post-backward.
    let single_rank = config.mesh.ranks() == 1;
    let (comm_forward, comm_head, comm_backward, comm_root_reduce) = if single_rank {
        // Nothing is gathered or reduced: the unsharded parameters are the shards themselves,
        // cast copies with a narrower --param-dtype the only term left, and the gradients
        // land as the shards' gradients, counted in the state.
        if config.param_dtype == DType::F32 {
            (0, 0, 0, 0)
        } else {
            let in_use = comm_term(&[(root, p), (block, 2 * p)])?;
            (in_use, comm_term(&[(root, p)])?, in_use, 0)
        }
    } else {
        (
            comm_term(&[(root, p), (block, 2 * p)])?,
            comm_term(&[(root, p)])?,
            // The root (less the head weight once it holds the gradient), this block and the
            // next gathered, this block's f32 gradients, and the previous block's
            // reduce-scatter input and output still in flight.
            comm_term(&[
                (root - head_in_weight, p),
                (block, 2 * p + 4),
                (block, r),
                (block.div_ceil(s), r),
            ])?,
            // Its gradients besides the head's (a term of its own), its reduce-scatter input
            // and output; its parameters were freed just before.
            comm_term(&[(root - head, 4), (root, r), (root.div_ceil(s), r)])?,
        )
    };

    let tokens = product("activations", batch_drivers, &[b, t])?;
    let per_token_block = sum(
        "activations",
        batch_drivers,
        &[product("activations", batch_drivers, &[18, c])?, h],
    )?;
    let block_full = product("activations", batch_drivers, &[4, tokens, per_token_block])?;
    let kept = if config.activation_checkpointing {
        // Each block's input, and in backward one block recomputed in full.
        product("activations", batch_drivers, &[4, tokens, c, l])?
    } else {
        product("activations", batch_drivers, &[block_full, l])?
    };
    let recomputed = if config.activation_checkpointing {
        block_full
    } else {
        0
    };
    // In backward: what forward kept, a recomputed block, and one block's gradients.
    let activations_backward = sum(
        "activations",
        batch_drivers,
        &[kept, recomputed, block_full],
    )?;

    // The lm_head and the loss run fused over blocks of at most 2^23 logits (nn's
    // `fused_loss.rs`); the block never exceeds the whole logits. The embeddings and the
    // final hidden state are `[N, C]` each; the head's gradients are the weight's `[V, C]`
    // and the hidden state's `[N, C]`.
    let logit_block = product("logits", batch_drivers, &[tokens, v])?.min(FUSED_LOSS_BLOCK);
    let embeddings = product("logits", batch_drivers, &[8, tokens, c])?;
    let head_grads = sum(
        "logits",
        batch_drivers,
        &[
            product("logits", model_drivers, &[4, v, c])?,
            product("logits", batch_drivers, &[4, tokens, c])?,
        ],
    )?;
    let logits_head = sum(
        "logits",
        batch_drivers,
        &[
            product("logits", batch_drivers, &[4, logit_block])?,
            head_grads,
            embeddings,
        ],
    )?;
    let logits_backward = sum("logits", batch_drivers, &[head_grads, embeddings])?;

    // The rank's peak is at one of four moments; each term is its size at the moment whose
    // sum is largest (docs/cli.md, "Memory check").
    let phases = [
        // In forward, before the head.
        (comm_forward, kept, embeddings),
        // The fused head.
        (comm_head, kept, logits_head),
        (comm_backward, activations_backward, logits_backward),
        (comm_root_reduce, 0, head_grads),
    ];
    let mut peak = phases[0];
    for phase in phases {
        let total = sum("memory", batch_drivers, &[phase.0, phase.1, phase.2])?;
        if total > sum("memory", batch_drivers, &[peak.0, peak.1, peak.2])? {
            peak = phase;
        }
    }
    let (mut comm, activations, logits) = peak;
    if config.keep_step_buffers && !single_rank {
        // Kept, the idle buffers of the last step stay beside this step's own: the pool holds
        // at most the larger of 4 x its largest request (the root's gather) and the most it
        // lent at once (dtensor's pool.rs), which is at most the largest phase.
        let idle = comm_term(&[(root, 4 * p)])?
            .max(comm_forward)
            .max(comm_backward)
            .max(comm_root_reduce);
        comm = sum("communication buffers", comm_drivers, &[comm, idle])?;
    }
    let data = product(
        "corpus",
        || format!("--data ({data_tokens} tokens)"),
        &[4, data_tokens],
    )?;
    Ok(MemoryEstimate {
        state,
        comm,
        activations,
        logits,
        data,
    })
}

/// The flags behind the largest term, with their values, for the error.
fn drivers(config: &TrainConfig, estimate: &MemoryEstimate) -> String {
    let m = &config.model;
    let largest = [
        estimate.state,
        estimate.comm,
        estimate.activations,
        estimate.logits,
        estimate.data,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    if largest == estimate.activations || largest == estimate.logits {
        let checkpointing = if config.activation_checkpointing {
            "on"
        } else {
            "off"
        };
        format!(
            "--batch-size {} and --model's block_size {}, vocab_size {}, n_embd {}, n_layer {} \
             (--activation-checkpointing {checkpointing})",
            config.micro_batch, m.block_size, m.vocab_size, m.n_embd, m.n_layer
        )
    } else if largest == estimate.data {
        format!("--data {}", config.data.display())
    } else {
        format!(
            "--model ({} parameters) with {}-way sharding (--mesh), --param-dtype {}, \
             --reduce-dtype {}{}",
            m.parameter_count().unwrap_or(usize::MAX),
            config.mesh.shards,
            config.param_dtype,
            config.reduce_dtype,
            if config.eager_init {
                ", --eager-init"
            } else {
                ""
            }
        )
    }
}

/// Refuses a run whose estimate exceeds the tightest of `limits` (each already a per-rank
/// share) with [`Error::MemoryEstimate`].
pub fn check_fits(
    config: &TrainConfig,
    estimate: &MemoryEstimate,
    limits: &[MemoryLimit],
) -> Result<()> {
    // The limit with the least room left decides (address-space limits count more runtime).
    let tightest = limits
        .iter()
        .min_by_key(|limit| limit.bytes as i128 - i128::from(estimate.needed_under(limit)));
    let Some(limit) = tightest else {
        return Ok(());
    };
    let needed = estimate.needed_under(limit);
    if needed <= limit.bytes {
        return Ok(());
    }
    Err(Error::MemoryEstimate {
        needed: format!(
            "{} ({})",
            human_bytes(needed),
            estimate.breakdown(needed - estimate.terms())
        ),
        limit: format!(
            "{} it may use under {}",
            human_bytes(limit.bytes),
            limit.source
        ),
        drivers: drivers(config, estimate),
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use hypershard_tensor::DType;

    use super::*;
    use crate::data::{DataOrder, TokenizerKind};
    use crate::launch::LimitSource;
    use crate::train::{LrSchedule, MeshSpec, ModelShape, OptimConfig};

    fn config(model: &str, batch: usize) -> TrainConfig {
        TrainConfig {
            model: ModelShape::resolve(model).unwrap().config(256, 0).unwrap(),
            mesh: MeshSpec::parse("2x2").unwrap(),
            data: PathBuf::from("corpus.txt"),
            tokenizer: TokenizerKind::Bytes,
            vocabulary: None,
            data_order: DataOrder::Random,
            steps: 10,
            micro_batch: batch,
            grad_accum: 1,
            seed: 0,
            optim: OptimConfig {
                lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 0,
                schedule: LrSchedule::Cosine,
                decay_steps: None,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                grad_clip: 1.0,
            },
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
            init: None,
            init_from_hf: None,
            eager_init: false,
            activation_checkpointing: false,
            keep_step_buffers: false,
            device: crate::train::TrainDevice::Cpu,
            out: PathBuf::from("out"),
            resume: false,
            reset_optimizer: false,
            allow_nonfinite: false,
            checkpoint_every: 0,
            eval_every: 0,
            losses: PathBuf::from("out/losses.jsonl"),
        }
    }

    /// Kept step buffers stay beside the step's own: the idle pool's bound (at least the
    /// largest phase's buffers) adds to the communication term and nothing else.
    #[test]
    fn kept_step_buffers_count_in_the_estimate() {
        for model in ["small", "gpt2"] {
            let released = config(model, 1);
            let mut kept = config(model, 1);
            kept.keep_step_buffers = true;
            let (e, k) = (
                estimate(&released, 1000).unwrap(),
                estimate(&kept, 1000).unwrap(),
            );
            assert!(k.comm >= 2 * e.comm, "{model}: {} vs {}", k.comm, e.comm);
            assert_eq!(
                (k.state, k.activations, k.logits),
                (e.state, e.activations, e.logits)
            );
        }
    }

    #[test]
    fn the_terms_follow_the_formula() {
        // small: V 256, T 64, L 4, H 4, C 64; 2x2 mesh shards 2 ways; batch 8.
        let small = config("small", 8);
        let e = estimate(&small, 1000).unwrap();
        let params = small.model.parameter_count().unwrap() as u64;
        assert_eq!(e.state, 16 * params.div_ceil(2));
        let (block, head) = (12 * 64 * 64 + 13 * 64, 256 * 64);
        let root = head + 64 * 64 + 2 * 64;
        let n = 8 * 64;
        let block_acts = 4 * n * (18 * 64 + 4);
        let head_grads = 4 * 256 * 64 + 4 * n * 64;
        let embeddings = 8 * n * 64;
        // Activations dominate this model: the peak is in backward, inside a block. In f32:
        // the root less the head weight (it holds its gradient now), this block and the next
        // gathered, this block's gradients, the previous block's reduce-scatter input and
        // output (its shard).
        let in_block = |p: u64, r: u64, root_held: u64| {
            root_held * p + block * (2 * p + 4) + block * r + block.div_ceil(2) * r
        };
        assert_eq!(e.comm, in_block(4, 4, root - head));
        // Every block's activations kept, and one block's gradients.
        assert_eq!(e.activations, 4 * block_acts + block_acts);
        assert_eq!(e.logits, head_grads + embeddings);
        assert_eq!(e.data, 4000);
        // Checkpointing keeps only each block's input, plus one block recomputed.
        let mut checkpointed = small.clone();
        checkpointed.activation_checkpointing = true;
        let c = estimate(&checkpointed, 1000).unwrap();
        assert_eq!(c.activations, 4 * n * 64 * 4 + 2 * block_acts);
        assert_eq!(c.comm, e.comm);
        // bf16 gathers and reductions: a 2-byte head weight cannot hold its f32 gradient, so
        // the whole root stays gathered through backward.
        let mut mixed = small.clone();
        mixed.param_dtype = DType::BF16;
        mixed.reduce_dtype = DType::BF16;
        assert_eq!(estimate(&mixed, 1000).unwrap().comm, in_block(2, 2, root));
        // With a large vocabulary the fused head is the peak: the root gathered, every block
        // resharded and its activations kept, a block of logits and the head's gradients.
        let mut wide_vocab = config("small", 8);
        wide_vocab.model.vocab_size = 50_304;
        let wide = estimate(&wide_vocab, 1000).unwrap();
        assert_eq!(wide.comm, (50_304 * 64 + 64 * 64 + 128) * 4);
        assert_eq!(wide.activations, 4 * block_acts);
        assert_eq!(
            wide.logits,
            4 * (1 << 23) + 4 * 50_304 * 64 + 4 * n * 64 + embeddings
        );
        // --eager-init builds the whole model (4 B a parameter) before sharding it.
        let mut eager = small;
        eager.eager_init = true;
        assert_eq!(estimate(&eager, 1000).unwrap().state, e.state + 4 * params);
    }

    #[test]
    fn the_demonstration_fits_its_budget() {
        // 354 M parameters (vocab 50304, 24 blocks of width 1024, context 256) over 8 ranks,
        // batch 1, activation checkpointing: under 1.25 GiB a rank, as measured (benches
        // memory --demo), with the corpus of data/shakespeare.txt.
        let mut demo = config("small", 1);
        demo.model.vocab_size = 50_304;
        demo.model.block_size = 256;
        demo.model.n_layer = 24;
        demo.model.n_head = 16;
        demo.model.n_embd = 1024;
        demo.mesh = MeshSpec::parse("8").unwrap();
        demo.activation_checkpointing = true;
        let e = estimate(&demo, 1_115_394).unwrap();
        let limit = MemoryLimit {
            bytes: 1280 << 20,
            source: LimitSource::MaxRankMemory,
            address_space: false,
        };
        check_fits(&demo, &e, &[limit]).unwrap();
        // The state alone is 675 MiB; the root's 196 MiB head weight is held once.
        assert_eq!(e.state, 16 * 354_084_864u64.div_ceil(8));
        assert!(e.terms() + RUNTIME_BYTES > 1150 << 20, "{e:?}");
    }

    #[test]
    fn overflowing_sizes_are_typed_errors_naming_the_flags() {
        let huge = config("small", usize::MAX / 2);
        match estimate(&huge, 0) {
            Err(Error::MemoryOverflow { term, drivers }) => {
                assert_eq!(term, "activations");
                assert!(drivers.contains(&format!("--batch-size {}", usize::MAX / 2)));
            }
            other => panic!("{other:?}"),
        }
        let mut wide = config("small", 1);
        wide.model.vocab_size = usize::MAX / 64;
        assert!(matches!(
            estimate(&wide, 0),
            Err(Error::MemoryOverflow { .. })
        ));
    }

    #[test]
    fn the_tightest_limit_decides_and_is_named() {
        let big = config("small", 100_000_000);
        let e = estimate(&big, 0).unwrap();
        let limits = [
            MemoryLimit {
                bytes: 1 << 40,
                source: LimitSource::MemAvailable { ranks: 4 },
                address_space: false,
            },
            MemoryLimit {
                bytes: 6 << 30,
                source: LimitSource::AddressSpace,
                address_space: true,
            },
        ];
        match check_fits(&big, &e, &limits) {
            Err(Error::MemoryEstimate {
                limit,
                drivers,
                needed,
            }) => {
                assert!(
                    limit.starts_with("6.0 GiB it may use under RLIMIT_AS"),
                    "{limit}"
                );
                assert!(limit.contains("ulimit -v"), "{limit}");
                assert!(drivers.contains("--batch-size 100000000"), "{drivers}");
                let total = human_bytes(e.terms() + RUNTIME_ADDRESS_SPACE_BYTES);
                assert!(needed.starts_with(&format!("{total} (state ")), "{needed}");
                assert!(needed.ends_with("runtime 1.0 GiB)"), "{needed}");
            }
            other => panic!("{other:?}"),
        }
        // The default run fits the same limits, and no limits at all refuse nothing.
        let small = config("small", 8);
        let e = estimate(&small, 1_000_000).unwrap();
        check_fits(&small, &e, &limits).unwrap();
        check_fits(&big, &estimate(&big, 0).unwrap(), &[]).unwrap();
        // Exactly at the limit fits; one byte less does not.
        let exact = MemoryLimit {
            bytes: e.terms() + RUNTIME_BYTES,
            source: LimitSource::MaxRankMemory,
            address_space: false,
        };
        check_fits(&small, &e, std::slice::from_ref(&exact)).unwrap();
        let short = MemoryLimit {
            bytes: exact.bytes - 1,
            ..exact
        };
        assert!(matches!(
            check_fits(&small, &e, &[short]),
            Err(Error::MemoryEstimate { .. })
        ));
    }
}
