//! The GPT's fused loss head against the unfused one (logits → `cross_entropy` → backward):
//! the same loss bit for bit, the same gradients to rounding, ignored targets, the loss scale,
//! evaluation without gradients, and the errors. The comparisons run on the host and on the
//! emulated device, with the same values on both.

mod common;

use std::collections::BTreeMap;

use common::same_on_both;
use hypershard_nn::{DEFAULT_IGNORE_INDEX, Error, Gpt, GptConfig, Module, cross_entropy};
use hypershard_tensor::{DType, Device, Tensor};

fn config(dtype: DType, vocab_size: usize) -> GptConfig {
    GptConfig {
        vocab_size,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        bias: true,
        dropout: 0.0,
        dtype,
        seed: 11,
    }
}

/// Token ids and targets where rank-free formula `f(i)` picks each; two targets ignored.
fn batch(vocab: usize, rows: usize, cols: usize) -> (Tensor, Tensor) {
    let n = rows * cols;
    let ids: Vec<i64> = (0..n).map(|i| ((7 * i + 3) % vocab) as i64).collect();
    let mut targets: Vec<i64> = (0..n).map(|i| ((5 * i + 1) % vocab) as i64).collect();
    targets[1] = DEFAULT_IGNORE_INDEX;
    targets[n - 2] = DEFAULT_IGNORE_INDEX;
    (
        Tensor::from_vec(ids, &[rows, cols]).expect("ids"),
        Tensor::from_vec(targets, &[n]).expect("targets"),
    )
}

fn grads(model: &Gpt) -> BTreeMap<String, Vec<f64>> {
    let mut out = BTreeMap::new();
    model
        .visit_params("", &mut |name, p| {
            let grad = p.grad.as_ref().expect("every parameter has a gradient");
            out.insert(name.to_string(), grad.to_host()?.to_f64_vec()?);
            Ok(())
        })
        .expect("visit");
    out
}

/// A GPT of `config` on `device`.
fn model_on(config: GptConfig, device: &Device) -> Gpt {
    let mut model = Gpt::new(config).expect("gpt");
    hypershard_nn::to_device(&mut model, device).expect("to_device");
    model
}

/// The unfused reference on `device`: loss and gradients for a loss scale of `scale`.
fn unfused(
    config: GptConfig,
    ids: &Tensor,
    targets: &Tensor,
    scale: f64,
    device: &Device,
) -> (f64, Grads) {
    let mut model = model_on(config, device);
    let (ids, targets) = (
        ids.to_device(device).expect("ids"),
        &targets.to_device(device).expect("targets"),
    );
    let logits = model.forward(&ids).expect("forward");
    let v = config.vocab_size;
    let flat = logits.view(&[targets.numel(), v]).expect("view");
    let loss = cross_entropy(&flat, targets, DEFAULT_IGNORE_INDEX).expect("loss");
    let grad = loss.grad.scale(scale).expect("scale");
    model
        .backward(&grad.view(logits.shape()).expect("view"))
        .expect("backward");
    (loss.loss, grads(&model))
}

type Grads = BTreeMap<String, Vec<f64>>;

/// The fused head on `device`: loss and gradients for a loss scale of `scale`.
fn fused(
    config: GptConfig,
    ids: &Tensor,
    targets: &Tensor,
    scale: f64,
    device: &Device,
) -> (f64, Grads) {
    let mut model = model_on(config, device);
    let handle = model.fused_loss(DEFAULT_IGNORE_INDEX);
    handle.for_backward(targets.to_device(device).expect("targets"));
    let loss = model
        .forward(&ids.to_device(device).expect("ids"))
        .expect("forward");
    assert_eq!(loss.shape(), &[1]);
    assert_eq!(loss.dtype(), DType::F64);
    assert_eq!(loss.device(), *device);
    let loss = loss.to_host().and_then(|l| l.to_f64_vec()).expect("f64")[0];
    let scale = Tensor::from_vec_on(vec![scale], &[1], device).expect("scale");
    model.backward(&scale).expect("backward");
    (loss, grads(&model))
}

fn assert_close(a: &Grads, b: &Grads, tol: f64) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, x) in a {
        let y = &b[name];
        let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= tol * scale,
                "{name}[{i}]: fused {q} vs unfused {p} (max |g| {scale})"
            );
        }
    }
}

#[test]
fn fused_loss_equals_unfused_bitwise_and_gradients_to_rounding() {
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        let config = config(dtype, 37);
        let (ids, targets) = batch(37, 3, 5);
        let ((loss_a, grads_a), (loss_b, grads_b)) = same_on_both(|d| {
            (
                unfused(config, &ids, &targets, 0.25, d),
                fused(config, &ids, &targets, 0.25, d),
            )
        });
        assert_eq!(
            loss_a.to_bits(),
            loss_b.to_bits(),
            "{dtype:?}: {loss_a} vs {loss_b}"
        );
        assert!(loss_a.is_finite() && loss_a > 0.0);
        assert_close(&grads_a, &grads_b, tol);
    }
}

#[test]
fn a_vocabulary_larger_than_one_block_is_worked_through_in_blocks() {
    // 2^23 logit elements per block: a vocabulary of 300 000 gives 27 rows per block, so 64
    // tokens take three blocks, the last one short.
    let vocab = 300_000;
    let config = GptConfig {
        n_layer: 1,
        n_embd: 4,
        block_size: 16,
        ..config(DType::F32, vocab)
    };
    let (ids, targets) = batch(vocab, 4, 16);
    let ((loss_a, grads_a), (loss_b, grads_b)) = same_on_both(|d| {
        (
            unfused(config, &ids, &targets, 1.0, d),
            fused(config, &ids, &targets, 1.0, d),
        )
    });
    assert_eq!(loss_a.to_bits(), loss_b.to_bits(), "{loss_a} vs {loss_b}");
    assert_close(&grads_a, &grads_b, 1e-5);
}

#[test]
fn evaluation_computes_the_loss_only_and_targets_are_required() {
    let config = config(DType::F32, 37);
    let (ids, targets) = batch(37, 2, 4);
    let mut model = Gpt::new(config).expect("gpt");
    let handle = model.fused_loss(DEFAULT_IGNORE_INDEX);
    // No targets set: a typed error, not a panic.
    match model.forward(&ids) {
        Err(Error::LossTargetsMissing { module: "GPT" }) => {}
        other => panic!("expected LossTargetsMissing, got {other:?}"),
    }
    handle.for_eval(targets.clone());
    let loss = model
        .forward(&ids)
        .expect("forward")
        .to_f64_vec()
        .expect("f64")[0];
    let (reference, _) = unfused(config, &ids, &targets, 1.0, &Device::Cpu);
    assert_eq!(loss.to_bits(), reference.to_bits());
    // Nothing was kept for a backward.
    let one = Tensor::from_vec(vec![1.0f64], &[1]).expect("one");
    assert!(matches!(
        model.backward(&one),
        Err(Error::BackwardBeforeForward { module: "GPT" })
    ));
    // Each set is used once.
    assert!(matches!(
        model.forward(&ids),
        Err(Error::LossTargetsMissing { .. })
    ));
}

#[test]
fn bad_targets_and_loss_gradients_are_typed_errors() {
    let config = config(DType::F32, 37);
    let (ids, _) = batch(37, 2, 4);
    let mut model = Gpt::new(config).expect("gpt");
    let handle = model.fused_loss(DEFAULT_IGNORE_INDEX);
    let out_of_range = Tensor::from_vec(vec![37i64; 8], &[8]).expect("targets");
    handle.for_backward(out_of_range);
    assert!(matches!(
        model.forward(&ids),
        Err(Error::TargetOutOfRange {
            position: 0,
            target: 37,
            classes: 37,
            ..
        })
    ));
    let too_few = Tensor::from_vec(vec![1i64; 5], &[5]).expect("targets");
    handle.for_backward(too_few);
    assert!(matches!(
        model.forward(&ids),
        Err(Error::ShapeMismatch { .. })
    ));
    let good = Tensor::from_vec(vec![1i64; 8], &[8]).expect("targets");
    handle.for_backward(good);
    model.forward(&ids).expect("forward");
    let not_a_scalar = Tensor::from_vec(vec![1.0f64, 2.0], &[2]).expect("grad");
    assert!(matches!(
        model.backward(&not_a_scalar),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// The fused head's loss and every gradient with the head's weight gradient kept in the
/// weight's memory (as `hypershard train` asks of its gathered copy), against the default.
fn fused_in_weight(
    config: GptConfig,
    ids: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> (f64, Grads, bool) {
    let mut model = Gpt::new(config).expect("gpt");
    let handle = model.fused_loss(DEFAULT_IGNORE_INDEX);
    model.keep_head_grad_in_gathered_weight(true);
    handle.for_backward(targets.clone());
    let loss = model
        .forward(ids)
        .expect("forward")
        .to_f64_vec()
        .expect("f64")[0];
    let scale = Tensor::from_vec(vec![scale], &[1]).expect("scale");
    model.backward(&scale).expect("backward");
    let mut shared = false;
    model
        .visit_params("", &mut |name, p| {
            if name == "transformer.wte.weight" {
                let grad = p.grad.as_ref().expect("wte has a gradient");
                shared = grad.shares_storage(p.data()?);
            }
            Ok(())
        })
        .expect("visit");
    (loss, grads(&model), shared)
}

#[test]
fn the_head_gradient_kept_in_the_weight_memory_is_bitwise_the_default() {
    // Token ids repeat (a vocabulary of 5), so rows of the embedding's gradient sum several
    // tokens before the head's gradient is added to them. 24 tokens are more than the width
    // (8): the gradient is copied into the weight; 8 are not: it is formed there.
    for (dtype, rows) in [DType::F64, DType::F32, DType::BF16]
        .into_iter()
        .flat_map(|d| [(d, 3), (d, 1)])
    {
        let config = config(dtype, 5);
        let (ids, targets) = batch(5, rows, 8);
        let (loss_a, grads_a) = fused(config, &ids, &targets, 0.5, &Device::Cpu);
        let (loss_b, grads_b, shared) = fused_in_weight(config, &ids, &targets, 0.5);
        assert_eq!(loss_a.to_bits(), loss_b.to_bits(), "{dtype:?}");
        assert_eq!(
            grads_a.keys().collect::<Vec<_>>(),
            grads_b.keys().collect::<Vec<_>>()
        );
        for (name, a) in &grads_a {
            let a: Vec<u64> = a.iter().map(|g| g.to_bits()).collect();
            let b: Vec<u64> = grads_b[name].iter().map(|g| g.to_bits()).collect();
            assert_eq!(a, b, "{dtype:?} {name}");
        }
        // f32 and f64 weights hold their gradient; a bf16 weight is too narrow for the f32
        // gradient and keeps its own memory.
        assert_eq!(shared, dtype != DType::BF16, "{dtype:?}");
    }
}
