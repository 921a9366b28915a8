//! Activation checkpointing (`Checkpointed`): bitwise the same losses and gradients as the
//! plain GPT, with and without dropout, on the host and on the emulated device (the same bits
//! on both); the same names and state dict; less activation memory in forward, measured at the
//! allocator.

mod common;

use std::collections::BTreeMap;

use common::same_on_both;
use hypershard_nn::optim::{AdamW, AdamWConfig};
use hypershard_nn::{
    Block, BlockConfig, Checkpointed, DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module, Sequential,
    cross_entropy, parameter_names, replace_module, with_num_threads, zero_grad,
};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device, RandomInit, Tensor};

fn config(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 61,
        block_size: 16,
        n_layer: 3,
        n_head: 4,
        n_embd: 32,
        bias: true,
        dropout,
        dtype: DType::F32,
        seed: 5,
    }
}

/// Token ids `[2, 12]` and their next-token targets for step `step`.
fn batch(step: usize, vocab: usize) -> (Tensor, Tensor) {
    let token = |i: usize| ((i * 7 + step * 13 + 3) % vocab) as i64;
    let ids: Vec<i64> = (0..24).map(token).collect();
    let targets: Vec<i64> = (1..25).map(token).collect();
    // invariant: 24 values for a [2, 12] tensor.
    let ids = Tensor::from_vec(ids, &[2, 12]).expect("ids");
    let targets = Tensor::from_vec(targets, &[2, 12]).expect("targets");
    (ids, targets)
}

/// Wraps every block of `gpt` in a `Checkpointed`, in place.
fn checkpoint_blocks(gpt: &mut Gpt) {
    for slot in gpt.blocks_mut().iter_mut() {
        replace_module(slot, |block| Ok(Box::new(Checkpointed::new(block))))
            .expect("invariant: wrapping cannot fail");
    }
}

/// Per step: the loss's bits and every gradient's bits by name.
type Trace = Vec<(u64, BTreeMap<String, Vec<u32>>)>;

/// `steps` AdamW steps of `model` on `device` (where the model already is).
fn train(model: &mut dyn Module, vocab: usize, steps: usize, device: &Device) -> Trace {
    let mut optimizer = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    })
    .expect("invariant: valid config");
    let mut trace = Vec::new();
    for step in 0..steps {
        let (ids, targets) = batch(step, vocab);
        let (ids, targets) = (
            ids.to_device(device).expect("ids"),
            targets.to_device(device).expect("targets"),
        );
        let logits = model.forward(&ids).expect("forward");
        let loss = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).expect("loss");
        model.backward(&loss.grad).expect("backward");
        let mut grads = BTreeMap::new();
        model
            .visit_params("", &mut |name, p| {
                let grad = p.grad.as_ref().expect("every parameter gets a gradient");
                grads.insert(
                    name.to_string(),
                    grad.to_host()?
                        .to_vec::<f32>()?
                        .iter()
                        .map(|g| g.to_bits())
                        .collect(),
                );
                Ok(())
            })
            .expect("visit");
        trace.push((loss.loss.to_bits(), grads));
        optimizer.step(model).expect("step");
        zero_grad(model).expect("zero_grad");
    }
    trace
}

fn assert_same_training(dropout: f64) {
    let config = config(dropout);
    same_on_both(|d| {
        let mut plain = Gpt::new(config).expect("gpt");
        let mut wrapped = Gpt::new(config).expect("gpt");
        checkpoint_blocks(&mut wrapped);
        hypershard_nn::to_device(&mut plain, d).expect("to_device");
        hypershard_nn::to_device(&mut wrapped, d).expect("to_device");
        assert_eq!(
            parameter_names(&plain).expect("names"),
            parameter_names(&wrapped).expect("names"),
            "checkpointing is transparent in names"
        );
        assert_eq!(
            plain.save_safetensors().expect("save"),
            wrapped.save_safetensors().expect("save"),
            "and in the state dict"
        );
        let expected = train(&mut plain, config.vocab_size, 3, d);
        let got = train(&mut wrapped, config.vocab_size, 3, d);
        assert_eq!(expected.len(), got.len());
        for (step, (e, g)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(e.0, g.0, "loss bits at step {step} on {d}");
            assert_eq!(e.1.len(), g.1.len());
            for (name, bits) in &e.1 {
                assert_eq!(
                    Some(bits),
                    g.1.get(name),
                    "gradient of {name} at step {step} on {d}"
                );
            }
        }
        // The trained parameters agree too: the optimizer saw the same gradients.
        let saved = plain.save_safetensors().expect("save");
        assert_eq!(saved, wrapped.save_safetensors().expect("save"));
        (expected, saved)
    });
}

#[test]
fn checkpointed_blocks_train_bitwise_like_the_plain_gpt_without_dropout() {
    assert_same_training(0.0);
}

#[test]
fn checkpointed_blocks_train_bitwise_like_the_plain_gpt_with_dropout() {
    // Dropout on the embeddings, attention weights and residual branches: the recomputation
    // must draw the masks the first forward drew, and leave the streams where they were.
    assert_same_training(0.2);
}

#[test]
fn a_checkpointed_whole_gpt_trains_bitwise_like_the_plain_one() {
    // The GPT's own dropout and ln_f are not children: its overrides must reach them.
    let config = config(0.2);
    same_on_both(|d| {
        let mut plain = Gpt::new(config).expect("gpt");
        let mut wrapped = Checkpointed::new(Box::new(Gpt::new(config).expect("gpt")));
        hypershard_nn::to_device(&mut plain, d).expect("to_device");
        hypershard_nn::to_device(&mut wrapped, d).expect("to_device");
        let trace = train(&mut plain, config.vocab_size, 2, d);
        assert_eq!(trace, train(&mut wrapped, config.vocab_size, 2, d));
        trace
    });
}

const BLOCKS: usize = 8;
const WIDTH: usize = 64;
const BATCH: usize = 4;
const SEQ: usize = 32;

fn deep_stack(checkpoint: bool) -> Sequential {
    let layers = (0..BLOCKS)
        .map(|i| {
            let block = Block::new(BlockConfig {
                n_embd: WIDTH,
                n_head: 4,
                bias: true,
                dropout: 0.1,
                dtype: DType::F32,
                seed: 16 * i as u64,
            })
            .expect("invariant: valid config");
            let block: Box<dyn Module> = Box::new(block);
            if checkpoint {
                Box::new(Checkpointed::new(block)) as Box<dyn Module>
            } else {
                block
            }
        })
        .collect();
    Sequential::new(layers)
}

/// Peak tensor bytes above what the model and input held, during forward and during backward.
fn peaks(checkpoint: bool) -> (usize, usize) {
    // One kernel thread: the pool's worker allocates everything, under the tracker.
    with_num_threads(1, || {
        let tracker = MemoryTracker::new();
        let _scope = tracker.enter();
        let mut model = deep_stack(checkpoint);
        let x = Tensor::random(
            &[BATCH, SEQ, WIDTH],
            DType::F32,
            RandomInit::uniform(1, -1.0, 1.0),
        )
        .expect("invariant: valid shape");
        let held = tracker.live_bytes();
        tracker.reset_peak();
        let y = model.forward(&x).expect("forward");
        let forward = tracker.peak_bytes() - held;
        let g = Tensor::ones(y.shape(), DType::F32).expect("ones");
        model.backward(&g).expect("backward");
        let step = tracker.peak_bytes() - held;
        (forward, step)
    })
    .expect("invariant: a one-thread pool builds")
}

#[test]
fn checkpointing_a_deep_stack_cuts_forward_activation_memory() {
    let (plain_forward, plain_step) = peaks(false);
    let (ckpt_forward, ckpt_step) = peaks(true);
    let activation = BATCH * SEQ * WIDTH * 4;
    eprintln!(
        "forward peak: plain {plain_forward} B, checkpointed {ckpt_forward} B; \
         forward+backward: plain {plain_step} B, checkpointed {ckpt_step} B; \
         one [B, T, C] activation is {activation} B"
    );
    // Plain: every block keeps its caches (LayerNorm outputs, q/k/v, two [B, H, T, T]
    // attention maps, the 4C-wide MLP hidden state twice ...) until backward.
    assert!(
        plain_forward >= BLOCKS * 10 * activation,
        "plain forward peak {plain_forward}"
    );
    // Checkpointed: each block's output, which the next block keeps as its input, plus one
    // block's transient caches.
    assert!(
        ckpt_forward * 4 <= plain_forward,
        "checkpointed forward peak {ckpt_forward} vs plain {plain_forward}"
    );
    // Backward recomputes one block at a time, so the whole step stays lower too.
    assert!(
        ckpt_step < plain_step,
        "checkpointed step peak {ckpt_step} vs plain {plain_step}"
    );
}
