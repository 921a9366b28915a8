//! One test body, two devices: every layer's forward and backward, the losses, matmul, the
//! optimizers and a few GPT training steps run on the host and on the emulated device, with
//! every output on the device it ran on and the same bits on both; device misuse is a typed
//! error.

use hypershard_nn::linalg::{MatmulOptions, matmul, matmul_with};
use hypershard_nn::optim::{AdamW, AdamWConfig, Sgd, SgdConfig, clip_grad_norm};
use hypershard_nn::{
    Block, BlockConfig, CausalSelfAttention, CausalSelfAttentionConfig, Checkpointed,
    DEFAULT_IGNORE_INDEX, Dropout, Embedding, EmbeddingConfig, Error, Gelu, GeluApproximation, Gpt,
    GptConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, Mlp, Module, Relu, Result,
    RmsNorm, RmsNormConfig, Silu, cross_entropy, mse_loss, replace_module, to_device, zero_grad,
};
use hypershard_tensor::{DType, Device, Tensor};

mod common;
use common::{EMULATED, Opaque, forward_backward, normal, params_and_grads};

/// Runs `body` on the host and on the emulated device, checks that every tensor it returns is
/// on the device it ran on and that both runs give the same bytes; returns the host run's
/// tensors.
fn on_both(body: impl Fn(&Device) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    let host = body(&Device::Cpu)?;
    let device = body(&EMULATED)?;
    assert_eq!(host.len(), device.len());
    for (i, (h, d)) in host.iter().zip(&device).enumerate() {
        assert_eq!(h.device(), Device::Cpu, "output {i}");
        assert_eq!(d.device(), EMULATED, "output {i}");
        assert_eq!(h.shape(), d.shape(), "output {i}");
        assert_eq!(h.dtype(), d.dtype(), "output {i}");
        assert_eq!(
            h.to_bytes()?,
            d.to_host()?.to_bytes()?,
            "output {i}: bits differ"
        );
    }
    Ok(host)
}

fn linear(dtype: DType, bias: bool) -> Result<Linear> {
    Linear::new(LinearConfig {
        in_features: 6,
        out_features: 5,
        bias,
        dtype,
        seed: 4,
    })
}

#[test]
fn linear_runs_on_its_inputs_device() -> Result<()> {
    for (dtype, bias) in [(DType::F32, true), (DType::F64, false), (DType::BF16, true)] {
        let x = normal(&[2, 3, 6], dtype, 1)?;
        let out = on_both(|d| forward_backward(&mut linear(dtype, bias)?, d, &x, 2))?;
        assert_eq!(out[0].shape(), &[2, 3, 5]);
    }
    // A strided input is gathered where it lives.
    let x = normal(&[6, 4], DType::F32, 3)?;
    on_both(|d| forward_backward(&mut linear(DType::F32, true)?, d, &x.transpose(0, 1)?, 4))?;
    Ok(())
}

#[test]
fn embedding_and_norms_run_on_their_inputs_device() -> Result<()> {
    let ids = Tensor::from_vec(vec![3i64, 0, 3, 5, 1, 1], &[2, 3])?;
    on_both(|d| {
        let mut emb = Embedding::new(EmbeddingConfig {
            num_embeddings: 6,
            embedding_dim: 4,
            dtype: DType::F32,
            seed: 9,
        })?;
        forward_backward(&mut emb, d, &ids, 5)
    })?;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let x = normal(&[3, 2, 8], dtype, 6)?;
        on_both(|d| {
            let mut ln = LayerNorm::new(LayerNormConfig {
                normalized_shape: 8,
                eps: 1e-5,
                bias: true,
                dtype,
            })?;
            // Non-trivial parameters, so that their gradients matter.
            ln.weight.data = Some(normal(&[8], dtype, 7)?);
            forward_backward(&mut ln, d, &x, 8)
        })?;
        on_both(|d| {
            let mut rms = RmsNorm::new(RmsNormConfig {
                normalized_shape: 8,
                eps: None,
                dtype,
            })?;
            forward_backward(&mut rms, d, &x, 9)
        })?;
    }
    Ok(())
}

#[test]
fn activations_and_dropout_run_on_their_inputs_device() -> Result<()> {
    // Large enough for the activations' parallel chunks.
    let x = normal(&[3, 20_000], DType::F32, 10)?;
    let small = normal(&[4, 7], DType::F64, 11)?;
    for input in [&x, &small] {
        on_both(|d| forward_backward(&mut Gelu::new(GeluApproximation::None), d, input, 12))?;
        on_both(|d| forward_backward(&mut Gelu::new(GeluApproximation::Tanh), d, input, 13))?;
        on_both(|d| forward_backward(&mut Relu::new(), d, input, 14))?;
        on_both(|d| forward_backward(&mut Silu::new(), d, input, 15))?;
        let out = on_both(|d| forward_backward(&mut Dropout::new(0.3, 16)?, d, input, 17))?;
        // The mask dropped something (so the test compares a real mask on both devices).
        let zeros = out[0].to_f64_vec()?.iter().filter(|&&v| v == 0.0).count();
        assert!(zeros > 0);
    }
    Ok(())
}

fn attention(dtype: DType, dropout: f64, dense: bool) -> Result<CausalSelfAttention> {
    let mut attn = CausalSelfAttention::new(CausalSelfAttentionConfig {
        n_embd: 8,
        n_head: 2,
        bias: true,
        dropout,
        dtype,
        seed: 21,
    })?;
    if dense {
        attn.visit_children_mut(&mut |name, child| {
            if name == "attn_dropout" {
                replace_module(child, |inner| Ok(Box::new(Opaque(inner))))?;
            }
            Ok(())
        })?;
    }
    Ok(attn)
}

#[test]
fn attention_runs_on_its_inputs_device_tiled_and_dense() -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let x = normal(&[2, 5, 8], dtype, 22)?;
        for dense in [false, true] {
            for dropout in [0.0, 0.2] {
                on_both(|d| forward_backward(&mut attention(dtype, dropout, dense)?, d, &x, 23))?;
            }
        }
    }
    Ok(())
}

fn block_config(dropout: f64) -> BlockConfig {
    BlockConfig {
        n_embd: 8,
        n_head: 2,
        bias: true,
        dropout,
        dtype: DType::F32,
        seed: 31,
    }
}

#[test]
fn blocks_mlps_and_checkpointed_blocks_run_on_their_inputs_device() -> Result<()> {
    let x = normal(&[2, 4, 8], DType::F32, 32)?;
    on_both(|d| forward_backward(&mut Mlp::new(block_config(0.1))?, d, &x, 33))?;
    on_both(|d| forward_backward(&mut Block::new(block_config(0.1))?, d, &x, 34))?;
    let plain = on_both(|d| forward_backward(&mut Block::new(block_config(0.0))?, d, &x, 35))?;
    let recomputed = on_both(|d| {
        let mut wrapped = Checkpointed::new(Box::new(Block::new(block_config(0.0))?));
        forward_backward(&mut wrapped, d, &x, 35)
    })?;
    // Recomputation changes nothing, on either device.
    assert_eq!(plain.len(), recomputed.len());
    for (a, b) in plain.iter().zip(&recomputed) {
        assert_eq!(a.to_bytes()?, b.to_bytes()?);
    }
    Ok(())
}

#[test]
fn losses_and_matmul_run_on_their_inputs_device() -> Result<()> {
    let logits = normal(&[4, 5], DType::F32, 40)?;
    let targets = Tensor::from_vec(vec![1i64, DEFAULT_IGNORE_INDEX, 4, 0], &[4])?;
    let prediction = normal(&[3, 2], DType::F64, 41)?;
    let target = normal(&[3, 2], DType::F64, 42)?;
    let a = normal(&[3, 4], DType::BF16, 43)?;
    let b = normal(&[5, 4], DType::BF16, 44)?;
    let c = normal(&[4, 2], DType::F64, 45)?;
    let out = on_both(|d| {
        let ce = cross_entropy(&logits.to_device(d)?, &targets.to_device(d)?, -100)?;
        let mse = mse_loss(&prediction.to_device(d)?, &target.to_device(d)?)?;
        let losses = Tensor::from_vec_on(vec![ce.loss, mse.loss], &[2], d)?;
        let nt = MatmulOptions {
            transpose_a: false,
            transpose_b: true,
        };
        let tn = MatmulOptions {
            transpose_a: true,
            transpose_b: false,
        };
        let c = c.to_device(d)?;
        Ok(vec![
            losses,
            ce.grad,
            mse.grad,
            matmul_with(&a.to_device(d)?, &b.to_device(d)?, nt)?,
            matmul(&c.transpose(0, 1)?, &c)?,
            matmul_with(&c, &c, tn)?,
        ])
    })?;
    assert_eq!(out[3].dtype(), DType::BF16);
    assert!(out[0].to_f64_vec()?.iter().all(|l| l.is_finite()));
    Ok(())
}

#[test]
fn optimizers_step_on_the_parameters_device() -> Result<()> {
    let x = normal(&[3, 6], DType::F32, 50)?;
    // AdamW: the f32 in-place path and the f64 general path; SGD plain and with momentum.
    for dtype in [DType::F32, DType::F64] {
        let x = x.to_dtype(dtype)?;
        on_both(|d| {
            let mut layer = linear(dtype, true)?;
            let mut adamw = AdamW::new(AdamWConfig::default())?;
            let mut out = Vec::new();
            for step in 0..3 {
                forward_backward(&mut layer, d, &x, 51 + step)?;
                clip_grad_norm(&mut layer, 0.5)?;
                adamw.step(&mut layer)?;
                zero_grad(&mut layer)?;
            }
            out.extend(params_and_grads(&layer)?);
            if let Some(state) = adamw.state("weight") {
                out.extend([state.exp_avg.clone(), state.exp_avg_sq.clone()]);
            }
            Ok(out)
        })?;
        for momentum in [0.0, 0.9] {
            on_both(|d| {
                let mut layer = linear(dtype, true)?;
                let mut sgd = Sgd::new(SgdConfig {
                    lr: 0.1,
                    momentum,
                    ..SgdConfig::default()
                })?;
                for step in 0..2 {
                    forward_backward(&mut layer, d, &x, 60 + step)?;
                    sgd.step(&mut layer)?;
                    zero_grad(&mut layer)?;
                }
                params_and_grads(&layer)
            })?;
        }
    }
    Ok(())
}

fn small_gpt(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 6,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        bias: true,
        dropout,
        dtype: DType::F32,
        seed: 70,
    }
}

/// Three AdamW steps of a small GPT on `device`, the loss unfused (logits and
/// `cross_entropy`) or fused into the head; returns the losses and the final parameters.
fn train_gpt(device: &Device, fused: bool, ids: &Tensor, targets: &Tensor) -> Result<Vec<Tensor>> {
    let mut model = Gpt::new(small_gpt(0.1))?;
    to_device(&mut model, device)?;
    let handle = fused.then(|| model.fused_loss(DEFAULT_IGNORE_INDEX));
    let mut adamw = AdamW::new(AdamWConfig::default())?;
    let (ids, targets) = (ids.to_device(device)?, targets.to_device(device)?);
    let mut losses = Vec::new();
    for _ in 0..3 {
        if let Some(handle) = &handle {
            handle.for_backward(targets.clone());
            let loss = model.forward(&ids)?;
            assert_eq!(loss.device(), *device);
            losses.push(loss.to_host()?.to_f64_vec()?[0]);
            model.backward(&Tensor::from_vec_on(vec![1.0f64], &[1], device)?)?;
        } else {
            let logits = model.forward(&ids)?;
            let v = logits.shape()[2];
            let flat = logits.view(&[logits.numel() / v, v])?;
            let loss = cross_entropy(&flat, &targets.view(&[targets.numel()])?, -100)?;
            losses.push(loss.loss);
            model.backward(&loss.grad.view(logits.shape())?)?;
        }
        adamw.step(&mut model)?;
        zero_grad(&mut model)?;
    }
    let mut out = vec![Tensor::from_vec_on(losses, &[3], device)?];
    out.extend(params_and_grads(&model)?);
    Ok(out)
}

#[test]
fn gpt_trains_to_the_same_bits_on_both_devices() -> Result<()> {
    let ids = Tensor::from_vec(vec![1i64, 4, 9, 2, 0, 10, 3, 3, 7, 5, 8, 6], &[2, 6])?;
    let targets = Tensor::from_vec(vec![4i64, 9, 2, 0, 10, -100, 3, 7, 5, 8, 6, 1], &[2, 6])?;
    for fused in [false, true] {
        let out = on_both(|d| train_gpt(d, fused, &ids, &targets))?;
        let losses = out[0].to_f64_vec()?;
        assert!(losses.iter().all(|l| l.is_finite()));
        assert!(losses[2] < losses[0], "the loss goes down: {losses:?}");
    }
    Ok(())
}

#[test]
fn gpt_checkpoint_round_trips_from_the_device() -> Result<()> {
    let mut host = Gpt::new(small_gpt(0.0))?;
    let mut device = Gpt::new(small_gpt(0.0))?;
    to_device(&mut device, &EMULATED)?;
    // Saving reads device parameters through an explicit copy; loading keeps them there.
    assert_eq!(host.save_safetensors()?, device.save_safetensors()?);
    let bytes = Gpt::new(GptConfig {
        seed: 71,
        ..small_gpt(0.0)
    })?
    .save_safetensors()?;
    host.load_safetensors(&bytes)?;
    device.load_safetensors(&bytes)?;
    let (h, d) = (params_and_grads(&host)?, params_and_grads(&device)?);
    for (h, d) in h.iter().zip(&d) {
        assert_eq!(d.device(), EMULATED);
        assert_eq!(h.to_bytes()?, d.to_host()?.to_bytes()?);
    }
    Ok(())
}

/// The device mismatch a layer reports: its op and both devices.
fn mismatch(result: Result<Tensor>) -> (&'static str, Device, Device) {
    match result {
        Err(Error::Tensor(hypershard_tensor::Error::DeviceMismatch { op, lhs, rhs })) => {
            (op, lhs, rhs)
        }
        other => panic!("expected a device mismatch, got {other:?}"),
    }
}

#[test]
fn a_host_input_to_a_device_layer_is_a_typed_mismatch() -> Result<()> {
    let mut layer = linear(DType::F32, true)?;
    to_device(&mut layer, &EMULATED)?;
    let x = normal(&[2, 6], DType::F32, 80)?;
    assert_eq!(
        mismatch(layer.forward(&x)),
        ("Linear::forward", EMULATED, Device::Cpu)
    );
    // The right device works; a host gradient then is refused by the backward.
    let y = layer.forward(&x.to_device(&EMULATED)?)?;
    assert_eq!(
        mismatch(layer.backward(&Tensor::ones(y.shape(), DType::F32)?)),
        ("Linear::backward", EMULATED, Device::Cpu)
    );

    let mut ln = LayerNorm::new(LayerNormConfig {
        normalized_shape: 6,
        eps: 1e-5,
        bias: true,
        dtype: DType::F32,
    })?;
    to_device(&mut ln, &EMULATED)?;
    let (op, lhs, rhs) = mismatch(ln.forward(&x));
    assert_eq!((lhs, rhs), (EMULATED, Device::Cpu));
    assert!(op.starts_with("LayerNorm"), "{op}");

    let mut gpt = Gpt::new(small_gpt(0.0))?;
    to_device(&mut gpt, &EMULATED)?;
    let ids = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3])?;
    assert_eq!(
        mismatch(gpt.forward(&ids)),
        ("Gpt::forward", EMULATED, Device::Cpu)
    );

    // Losses and matmul compare their operands' devices too.
    let host_logits = normal(&[2, 3], DType::F32, 81)?;
    let device_targets = Tensor::from_vec(vec![0i64, 1], &[2])?.to_device(&EMULATED)?;
    assert!(matches!(
        cross_entropy(&host_logits, &device_targets, -100),
        Err(Error::Tensor(hypershard_tensor::Error::DeviceMismatch {
            op: "cross_entropy",
            ..
        }))
    ));
    let on_device = host_logits.to_device(&EMULATED)?;
    assert_eq!(
        mismatch(matmul(&host_logits, &on_device.transpose(0, 1)?)),
        ("matmul", Device::Cpu, EMULATED)
    );
    Ok(())
}
