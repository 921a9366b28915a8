//! The tiled attention of `CausalSelfAttention` against its materialised path, through the
//! public API: a module whose `attn_dropout` child is wrapped (so it is no longer the plain
//! `Dropout`) takes the path that builds the `[B, H, T, T]` weights, and is the reference for
//! the output, the input gradient and every parameter gradient. Also finite differences
//! across several tiles, the peak tensor memory of forward + backward, and a typed error for
//! a replaced projection of the wrong width. The parity runs on the host and on the emulated
//! device, with the same values on both.

mod common;

use common::{Opaque, check_module, host_values, random, same_on_both};
use hypershard_nn::{
    CausalSelfAttention, CausalSelfAttentionConfig, Error, Linear, LinearConfig, Module,
    replace_module, with_num_threads, zero_grad,
};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device, Tensor};

fn config(n_embd: usize, n_head: usize, dropout: f64, dtype: DType) -> CausalSelfAttentionConfig {
    CausalSelfAttentionConfig {
        n_embd,
        n_head,
        bias: true,
        dropout,
        dtype,
        seed: 17,
    }
}

/// The module on the tiled path and an identical one on the materialised path.
fn pair(config: CausalSelfAttentionConfig) -> (CausalSelfAttention, CausalSelfAttention) {
    // invariant: the tests pass valid configs.
    let tiled = CausalSelfAttention::new(config).expect("attention");
    let mut dense = CausalSelfAttention::new(config).expect("attention");
    dense
        .visit_children_mut(&mut |name, child| {
            if name == "attn_dropout" {
                replace_module(child, |inner| Ok(Box::new(Opaque(inner))))?;
            }
            Ok(())
        })
        .expect("wrap attn_dropout");
    (tiled, dense)
}

/// Output, input gradient and parameter gradients (by name) of one forward + backward on
/// `device` (where the module is), read on the host.
fn run(
    module: &mut CausalSelfAttention,
    x: &Tensor,
    grad: &Tensor,
    device: &Device,
) -> Vec<(String, Vec<f64>)> {
    // invariant: the inputs match the module's width and the output's shape.
    zero_grad(module).expect("zero_grad");
    let y = module
        .forward(&x.to_device(device).expect("x"))
        .expect("forward");
    let dx = module
        .backward(&grad.to_device(device).expect("grad"))
        .expect("backward");
    let mut out = vec![
        ("output".to_string(), host_values(&y)),
        ("input grad".to_string(), host_values(&dx)),
    ];
    module
        .visit_params("", &mut |name, param| {
            let g = param
                .grad
                .as_ref()
                .expect("every parameter gets a gradient");
            out.push((format!("{name} grad"), g.to_host()?.to_f64_vec()?));
            Ok(())
        })
        .expect("visit");
    out
}

/// `max |a − b| ≤ tol · max(max |b|, 1)` for every named result.
fn assert_parity(got: &[(String, Vec<f64>)], want: &[(String, Vec<f64>)], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for ((name, a), (name_b, b)) in got.iter().zip(want) {
        assert_eq!(name, name_b);
        assert_eq!(a.len(), b.len(), "{what} {name}");
        let scale = b.iter().fold(1f64, |m, x| m.max(x.abs()));
        let err = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            err <= tol * scale,
            "{what} {name}: error {err}, scale {scale}"
        );
    }
}

fn check_parity(dtype: DType, dropout: f64, tol: f64) {
    for seq in [1, 7, 64, 130] {
        let what = format!("{dtype:?} p={dropout} T={seq}");
        same_on_both(|d| {
            let (mut tiled, mut dense) = pair(config(32, 2, dropout, dtype));
            hypershard_nn::to_device(&mut tiled, d).expect("to_device");
            hypershard_nn::to_device(&mut dense, d).expect("to_device");
            // Two steps: the second draws the next dropout mask on both paths.
            (0..2)
                .map(|step| {
                    let x = random(&[2, seq, 32], dtype, 3 + step);
                    let grad = random(&[2, seq, 32], dtype, 5 + step);
                    let got = run(&mut tiled, &x, &grad, d);
                    let want = run(&mut dense, &x, &grad, d);
                    assert_parity(&got, &want, tol, &format!("{what} step {step} on {d}"));
                    (got, want)
                })
                .collect::<Vec<_>>()
        });
    }
}

#[test]
fn f32_and_f64_match_the_materialised_path() {
    for dropout in [0.0, 0.25] {
        check_parity(DType::F32, dropout, 1e-5);
        check_parity(DType::F64, dropout, 1e-12);
    }
}

#[test]
fn half_precision_matches_the_materialised_path_to_its_rounding() {
    // Both paths compute in f32 and round the attention output and gradients to the dtype
    // at the same points; a last-bit difference in f32 can flip one rounding, so the bound
    // is two units of the dtype's last place (2⁻⁸ for bf16, 2⁻¹¹ for f16) times the
    // values' magnitude, not 1e-5.
    for dropout in [0.0, 0.25] {
        check_parity(DType::BF16, dropout, 8e-3);
        check_parity(DType::F16, dropout, 1e-3);
    }
}

#[test]
fn evaluation_mode_skips_the_dropout_on_both_paths() {
    let (mut tiled, mut dense) = pair(config(32, 2, 0.5, DType::F64));
    tiled.set_training(false).expect("eval");
    dense.set_training(false).expect("eval");
    let (mut plain, _) = pair(config(32, 2, 0.0, DType::F64));
    let x = random(&[1, 70, 32], DType::F64, 8);
    let grad = random(&[1, 70, 32], DType::F64, 9);
    let want = run(&mut plain, &x, &grad, &Device::Cpu);
    assert_parity(
        &run(&mut tiled, &x, &grad, &Device::Cpu),
        &want,
        1e-12,
        "eval tiled",
    );
    assert_parity(
        &run(&mut dense, &x, &grad, &Device::Cpu),
        &want,
        1e-12,
        "eval dense",
    );
}

#[test]
fn backward_across_tiles_matches_finite_differences() {
    // T = 70 spans two 64-row tiles (the second a ragged 6-row one) in both directions.
    // invariant: a valid config.
    let mut attn = CausalSelfAttention::new(config(4, 2, 0.0, DType::F64)).expect("attention");
    check_module(&mut attn, &[1, 70, 4], 61);
}

/// Peak tensor bytes of one forward + backward at `[1, 512, 16]`, f32, on one thread (the
/// tracker counts allocations of the thread it was entered on). The width is small so that
/// the `O(T·C)` activations (input, q/k/v, output and their gradients, about 330 KB) do not
/// hide the `O(H·T²)` term being measured.
fn peak_bytes(module: &mut CausalSelfAttention) -> usize {
    // invariant: one thread is a valid pool size; the input matches the module.
    with_num_threads(1, || {
        let tracker = MemoryTracker::new();
        let _scope = tracker.enter();
        let x = random(&[1, 512, 16], DType::F32, 1);
        let grad = random(&[1, 512, 16], DType::F32, 2);
        let y = module.forward(&x).expect("forward");
        drop(y);
        drop(module.backward(&grad).expect("backward"));
        tracker.peak_bytes()
    })
    .expect("pool")
}

#[test]
fn peak_memory_stays_far_below_the_weights_of_every_head() {
    let (batch, heads, seq) = (1, 2, 512);
    let weights_bytes = batch * heads * seq * seq * 4;
    let (mut tiled, mut dense) = pair(config(16, heads, 0.0, DType::F32));
    let dense_peak = peak_bytes(&mut dense);
    let tiled_peak = peak_bytes(&mut tiled);
    // The materialised path holds the weights (and their gradient) as tensors, so it cannot
    // pass the bound below; the tiled one holds q, k, v, the output and B·H·T log-sum-exps.
    eprintln!("peak tensor bytes: tiled {tiled_peak}, materialised {dense_peak}");
    assert!(dense_peak >= weights_bytes, "dense peak {dense_peak}");
    assert!(
        tiled_peak < weights_bytes / 4,
        "tiled peak {tiled_peak} (dense {dense_peak}) vs weights {weights_bytes}"
    );
    // Tighter: the tiled path's peak is what backward must hold at once and no more: the
    // input, the output, its gradient and the input's gradient (`[B, T, C]` each), the heads'
    // q, k, v and the projection's gradient (`[B, T, 3C]` each) and the log-sum-exps. The
    // heads' results go straight into their tensors, with no `[B, H, 3, T, D]` staging buffer
    // (which would add 98,304 bytes here); 16 KiB covers the weights' gradients.
    let c = 16;
    let activation = batch * seq * c * 4;
    let accounted = 4 * activation + 2 * 3 * activation + batch * heads * seq * 4;
    assert!(
        tiled_peak <= accounted + 16 * 1024,
        "tiled peak {tiled_peak} vs {accounted} bytes of operands and results"
    );
}

#[test]
fn a_replaced_projection_of_the_wrong_width_is_a_typed_error() {
    // invariant: valid configs.
    let mut attn = CausalSelfAttention::new(config(8, 2, 0.0, DType::F32)).expect("attention");
    attn.visit_children_mut(&mut |name, child| {
        if name == "c_attn" {
            replace_module(child, |_| {
                Ok(Box::new(Linear::new(LinearConfig {
                    in_features: 8,
                    out_features: 16,
                    bias: false,
                    dtype: DType::F32,
                    seed: 1,
                })?))
            })?;
        }
        Ok(())
    })
    .expect("replace c_attn");
    let x = random(&[1, 5, 8], DType::F32, 1);
    let err = attn
        .forward(&x)
        .expect_err("c_attn gives [1, 5, 16], not [1, 5, 24]");
    assert!(
        matches!(&err, Error::ShapeMismatch { lhs, rhs, .. } if lhs == &[1, 5, 24] && rhs == &[1, 5, 16]),
        "{err:?}"
    );
}
