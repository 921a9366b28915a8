//! `hypershard train` frees nn's cached kernel outputs once, before the first optimizer step
//! (which allocates AdamW's moments), and keeps them from then on.
//!
//! nn's kernel-output cache is process-wide, so this binary holds this one test only: no other
//! test fills or empties the cache while it reads it.

use std::path::PathBuf;

use hypershard::collectives;
use hypershard::data::{DataOrder, TokenizerKind, default_corpus_path};
use hypershard::nn::cached_kernel_buffer_bytes;
use hypershard::tensor::DType;
use hypershard::train::{
    LrSchedule, MeshSpec, ModelShape, OptimConfig, TrainConfig, TrainDevice, run_rank,
};

/// One rank of the small preset for `steps` steps (its MLP's hidden activations, 8 × 64 × 256
/// f32, are above nn's smallest recycled size), writing into `out`.
fn config(steps: u64, out: PathBuf) -> TrainConfig {
    TrainConfig {
        model: ModelShape::resolve("small")
            .and_then(|shape| shape.config(256, 0))
            .expect("invariant: the small preset is valid"),
        mesh: MeshSpec::parse("1").expect("invariant: a valid mesh"),
        data: default_corpus_path(),
        tokenizer: TokenizerKind::Bytes,
        vocabulary: None,
        data_order: DataOrder::Random,
        steps,
        micro_batch: 8,
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
        device: TrainDevice::Cpu,
        losses: out.join("losses.jsonl"),
        out,
        resume: false,
        reset_optimizer: false,
        allow_nonfinite: false,
        checkpoint_every: 0,
        eval_every: 0,
    }
}

/// The cache after a run of `steps` steps, once the run has dropped its model (whose large
/// gradients then return to the cache too).
fn cached_after(steps: u64) -> usize {
    hypershard::nn::release_cached_kernel_buffers();
    let dir = std::env::temp_dir().join(format!(
        "hypershard-kernel-cache-{}-{steps}",
        std::process::id()
    ));
    let world = collectives::local::spawn_world(1)
        .expect("a local world of one")
        .remove(0);
    run_rank(config(steps, dir.clone()), world).expect("training runs");
    let cached = cached_kernel_buffer_bytes();
    // Best effort: a leftover directory under the temp dir is harmless.
    let _ = std::fs::remove_dir_all(&dir);
    cached
}

/// Without the release, a run of one step and a run of two end with the same cache: the last
/// step's activations and the gradients. With it, the one-step run's activations went back
/// before its (first) optimizer step, and the two-step run's second step keeps its own.
#[test]
fn the_first_optimizer_step_runs_without_cached_kernel_outputs_and_later_ones_keep_them() {
    let (one, two) = (cached_after(1), cached_after(2));
    assert!(two > one, "one step: {one} bytes cached, two steps: {two}");
}
