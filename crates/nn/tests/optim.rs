//! Optimizer steps against values worked out by hand, and gradient clipping. Each body runs on
//! the host and on the emulated device (`same_on_both`), with the same values.

mod common;

use common::{bits_of, host_values, same_on_both};
use hypershard_nn::optim::{
    AdamW, AdamWConfig, AdamWUpdate, Sgd, SgdConfig, clip_grad_norm_params,
};
use hypershard_nn::{Error, Parameter};
use hypershard_tensor::{DType, Device, Tensor};

fn param(values: &[f64], device: &Device) -> Parameter {
    // invariant: a 1-D f64 tensor of the slice's length always builds and moves.
    Parameter::new(
        "p",
        Tensor::from_slice(values, &[values.len()])
            .and_then(|t| t.to_device(device))
            .expect("tensor"),
    )
}

fn set_grad(p: &mut Parameter, grad: &[f64], device: &Device) {
    p.grad = Some(
        Tensor::from_slice(grad, &[grad.len()])
            .and_then(|t| t.to_device(device))
            .expect("tensor"),
    );
}

/// The values, read on the host whatever the device.
fn values(p: &Parameter) -> Vec<f64> {
    host_values(p.data().expect("materialised"))
}

fn assert_values(got: &[f64], expected: &[f64], tol: f64) {
    for (got, want) in got.iter().zip(expected) {
        assert!((got - want).abs() <= tol, "{got} vs {want}");
    }
}

/// Runs three SGD steps with gradient `grad` on a parameter starting at 1 and returns the
/// values, on both devices.
fn sgd_three_steps(config: SgdConfig, grad: f64) -> Vec<f64> {
    same_on_both(|d| {
        let mut sgd = Sgd::new(config).expect("config");
        let mut p = param(&[1.0], d);
        (0..3)
            .map(|_| {
                set_grad(&mut p, &[grad], d);
                sgd.step_param("p", &mut p).expect("step");
                values(&p)[0]
            })
            .collect()
    })
}

#[test]
fn sgd_momentum() {
    // lr 0.1, momentum 0.9, g = 1: b = 1, 1.9, 2.71; p = 0.9, 0.71, 0.439.
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    let got = sgd_three_steps(config, 1.0);
    for (g, e) in got.iter().zip([0.9, 0.71, 0.439]) {
        assert!((g - e).abs() < 1e-14, "{g} vs {e}");
    }
}

#[test]
fn sgd_nesterov() {
    // b = 1, 1.9, 2.71; direction g + 0.9 b = 1.9, 2.71, 3.439; p = 0.81, 0.539, 0.1951.
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        nesterov: true,
        ..SgdConfig::default()
    };
    let got = sgd_three_steps(config, 1.0);
    for (g, e) in got.iter().zip([0.81, 0.539, 0.1951]) {
        assert!((g - e).abs() < 1e-14, "{g} vs {e}");
    }
}

#[test]
fn sgd_dampening_skips_the_first_step() {
    // torch initialises the buffer with g undamped: b = 1, 0.9 + 0.5, 1.26 + 0.5.
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.5,
        ..SgdConfig::default()
    };
    let got = sgd_three_steps(config, 1.0);
    for (g, e) in got.iter().zip([0.9, 0.76, 0.584]) {
        assert!((g - e).abs() < 1e-14, "{g} vs {e}");
    }
}

#[test]
fn sgd_weight_decay() {
    // g = 0 + 0.5 p, so p *= 1 − 0.05 each step.
    let config = SgdConfig {
        lr: 0.1,
        weight_decay: 0.5,
        ..SgdConfig::default()
    };
    let got = sgd_three_steps(config, 0.0);
    for (g, e) in got.iter().zip([0.95, 0.9025, 0.857375]) {
        assert!((g - e).abs() < 1e-14, "{g} vs {e}");
    }
}

#[test]
fn sgd_rejects_invalid_nesterov_and_skips_params_without_grad() {
    let bad = SgdConfig {
        nesterov: true,
        ..SgdConfig::default()
    };
    assert!(matches!(
        Sgd::new(bad),
        Err(Error::InvalidConfig {
            field: "nesterov",
            ..
        })
    ));
    let negative = SgdConfig {
        lr: -1.0,
        ..SgdConfig::default()
    };
    assert!(matches!(
        Sgd::new(negative),
        Err(Error::InvalidConfig { field: "lr", .. })
    ));
    same_on_both(|d| {
        let mut sgd = Sgd::new(SgdConfig::default()).expect("config");
        let mut p = param(&[2.0], d);
        sgd.step_param("p", &mut p).expect("step");
        assert_eq!(values(&p), vec![2.0]);
        assert!(sgd.momentum_buffer("p").is_none());
    });
}

#[test]
fn adamw_defaults_are_torchs() {
    let d = AdamWConfig::default();
    assert_eq!(
        (d.lr, d.betas, d.eps, d.weight_decay),
        (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    );
    let s = SgdConfig::default();
    assert_eq!(
        (s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov),
        (1e-3, 0.0, 0.0, 0.0, false)
    );
}

#[test]
fn adamw_three_steps() {
    let config = AdamWConfig {
        lr: 0.1,
        ..AdamWConfig::default()
    };
    // Step 1 in closed form: m̂ = g and v̂ = g², so p = p(1 − lr·wd) − lr·g/(|g| + eps):
    // 1·0.999 − 0.1·0.5/(0.5 + 1e-8) = 0.899000002 and −0.5·0.999 + 0.1·1/(1 + 1e-8).
    // Steps 2 and 3 were worked through torch's recursions (m, v, bias corrections) by hand.
    let grads = [[0.5, -1.0], [-0.25, 2.0], [1.0, 0.5]];
    let expected = [
        [0.899_000_002, -0.399_500_001],
        [0.871_467_298_705_846_3, -0.435_710_853_471_074_85],
        [0.804_784_672_376_384, -0.476_840_262_292_302_75],
    ];
    let (steps, state_step, m) = same_on_both(|d| {
        let mut adamw = AdamW::new(config).expect("config");
        let mut p = param(&[1.0, -0.5], d);
        let steps: Vec<Vec<f64>> = grads
            .iter()
            .map(|grad| {
                set_grad(&mut p, grad, d);
                adamw.step_param("p", &mut p).expect("step");
                values(&p)
            })
            .collect();
        let state = adamw.state("p").expect("state");
        assert_eq!(state.exp_avg.device(), *d);
        (steps, state.step, host_values(&state.exp_avg))
    });
    for (got, want) in steps.iter().zip(expected) {
        assert_values(got, &want, 1e-12);
    }
    assert_eq!(state_step, 3);
    // m₃ = 0.9·(0.9·0.05 − 0.025) + 0.1 = 0.118 for the first element.
    assert!((m[0] - 0.118).abs() < 1e-15);
}

#[test]
fn adamw_constant_gradient_moves_by_lr_per_step() {
    // With a constant g the bias-corrected moments are exactly g and g², so without weight
    // decay every step moves by lr·g/(|g| + eps).
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let steps = same_on_both(|d| {
        let mut adamw = AdamW::new(config).expect("config");
        let mut p = param(&[0.0, 0.0], d);
        (1..=3)
            .map(|_| {
                set_grad(&mut p, &[2.0, -3.0], d);
                adamw.step_param("p", &mut p).expect("step");
                values(&p)
            })
            .collect::<Vec<_>>()
    });
    for (step, got) in (1..=3).zip(&steps) {
        let moved = f64::from(step) * 0.01;
        assert_values(
            got,
            &[-moved * 2.0 / (2.0 + 1e-8), moved * 3.0 / (3.0 + 1e-8)],
            1e-12,
        );
    }
}

#[test]
fn adamw_f32_state_stays_f32() {
    let got = same_on_both(|d| {
        let mut adamw = AdamW::new(AdamWConfig::default()).expect("config");
        let on = |t: hypershard_tensor::Result<Tensor>| t.and_then(|t| t.to_device(d));
        let mut p = Parameter::new("w", on(Tensor::ones(&[3], DType::F32)).expect("ones"));
        p.grad = Some(on(Tensor::full(&[3], 0.5, DType::F32)).expect("full"));
        adamw.step_param("w", &mut p).expect("step");
        let state = adamw.state("w").expect("state");
        assert_eq!(state.exp_avg.dtype(), DType::F32);
        let data = p.data().expect("data").to_host().expect("host");
        data.to_vec::<f32>().expect("f32")
    });
    // 1·(1 − 1e-5) − 1e-3·0.5/(0.5 + 1e-8), rounded to f32.
    let want = (0.99999f64 - 1e-3 * 0.5 / (0.5 + 1e-8)) as f32;
    assert_eq!(got, vec![want; 3]);
}

/// Three AdamW steps of an f32 parameter of `rows × cols` with gradients `f(step, i)`; when
/// `transposed`, the parameter is a non-contiguous view (the general path through f64 copies),
/// else a contiguous tensor (the in-place path), both holding the same logical values.
fn adamw_f32_after_three_steps(
    rows: usize,
    cols: usize,
    transposed: bool,
    threads: usize,
    device: &Device,
) -> Vec<u32> {
    let n = rows * cols;
    let value = |i: usize| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5;
    let grad = |step: usize, i: usize| ((i * 31 + step * 17) % 203) as f32 * 1e-2 - 1.0;
    let logical = |f: &dyn Fn(usize) -> f32| -> Tensor {
        let values: Vec<f32> = (0..n).map(f).collect();
        // invariant: n values always fill a rows × cols tensor.
        let t = Tensor::from_vec(values, &[rows, cols])
            .and_then(|t| t.to_device(device))
            .expect("tensor");
        if transposed {
            // The same logical [rows, cols] values, stored column-major.
            let stored = t
                .transpose(0, 1)
                .expect("transpose")
                .contiguous()
                .expect("copy");
            stored.transpose(0, 1).expect("transpose back")
        } else {
            t
        }
    };
    let mut p = Parameter::new("w", logical(&value));
    assert_eq!(p.data().expect("data").is_contiguous(), !transposed);
    let mut adamw = AdamW::new(AdamWConfig {
        lr: 0.05,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    })
    .expect("config");
    for step in 0..3 {
        p.grad = Some(logical(&|i| grad(step, i)));
        hypershard_nn::with_num_threads(threads, || adamw.step_param("w", &mut p))
            .expect("pool")
            .expect("step");
    }
    let values = p.data().expect("data").to_host().expect("host");
    let values = values.to_vec::<f32>().expect("f32");
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn adamw_f32_in_place_equals_the_general_path_bit_for_bit_at_any_thread_count() {
    // 317 × 211 = 66 887 elements: more than two of the update's parallel chunks, not a
    // multiple of one.
    let (rows, cols) = (317, 211);
    let general = adamw_f32_after_three_steps(rows, cols, true, 1, &Device::Cpu);
    for (threads, device) in [
        (1, Device::Cpu),
        (2, Device::Cpu),
        (3, Device::Cpu),
        (2, common::EMULATED),
    ] {
        let in_place = adamw_f32_after_three_steps(rows, cols, false, threads, &device);
        assert_eq!(in_place.len(), general.len());
        let differing = in_place
            .iter()
            .zip(&general)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differing, 0,
            "{differing} elements differ at {threads} threads on {device}"
        );
    }
    // The steps moved the values (a test of equality between two no-ops would prove nothing).
    let start = (-0.5f32).to_bits(); // value(0)
    assert_ne!(general[0], start);
}

#[test]
fn adamw_update_rejects_slices_of_different_lengths() {
    let update = AdamWUpdate::new(&AdamWConfig::default(), 1);
    let (mut p, mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 3]);
    let err = update
        .apply_f32(&mut p, &mut m, &mut v, &[1.0; 4])
        .expect_err("lengths differ");
    assert!(
        matches!(&err, Error::ShapeMismatch { op, lhs, rhs }
            if op.contains("exp_avg_sq") && lhs == &[4] && rhs == &[3]),
        "{err}"
    );
    assert_eq!(p, vec![0.0; 4], "nothing written on error");
}

#[test]
fn adamw_rejects_bad_betas_and_unmaterialised_params() {
    let bad = AdamWConfig {
        betas: (0.9, 1.0),
        ..AdamWConfig::default()
    };
    assert!(matches!(
        AdamW::new(bad),
        Err(Error::InvalidConfig {
            field: "betas.1",
            ..
        })
    ));
    let mut adamw = AdamW::new(AdamWConfig::default()).expect("config");
    let mut p = param(&[1.0], &Device::Cpu);
    set_grad(&mut p, &[1.0], &Device::Cpu);
    p.data = None;
    assert!(matches!(
        adamw.step_param("p", &mut p),
        Err(Error::NotMaterialised { name }) if name == "p"
    ));
}

#[test]
fn clipping_scales_to_max_norm_and_returns_total_norm() {
    let (norm, ga, gb, norm_below, gb_below) = same_on_both(|d| {
        let mut a = param(&[0.0, 0.0], d);
        let mut b = param(&[0.0], d);
        set_grad(&mut a, &[3.0, 4.0], d);
        set_grad(&mut b, &[12.0], d);
        let norm = clip_grad_norm_params(&mut [&mut a, &mut b], 6.5).expect("clip");
        let grad = |p: &Parameter| host_values(p.grad.as_ref().expect("grad"));
        let (ga, gb) = (grad(&a), grad(&b));
        let norm_below = clip_grad_norm_params(&mut [&mut a, &mut b], 100.0).expect("clip");
        (norm.to_bits(), ga, gb, norm_below.to_bits(), grad(&b))
    });
    // ‖(3, 4, 12)‖ = 13.
    assert!((f64::from_bits(norm) - 13.0).abs() < 1e-15);
    let coef = 6.5 / (13.0 + 1e-6);
    assert_eq!(ga, vec![3.0 * coef, 4.0 * coef]);
    assert_eq!(gb, vec![12.0 * coef]);
    // Below the bound nothing changes.
    assert!((f64::from_bits(norm_below) - 13.0 * coef).abs() < 1e-12);
    assert_eq!(gb_below, vec![12.0 * coef]);
}

#[test]
fn plain_sgd_steps_in_place_in_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        same_on_both(|d| {
            let data = Tensor::from_vec(vec![1.0f64, -2.0, 0.5], &[3])
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.to_device(d))
                .expect("tensor");
            let storage_before = data.clone();
            let mut p = Parameter::new("w", data);
            p.grad = Some(
                Tensor::from_vec(vec![0.5f64, 1.0, -2.0], &[3])
                    .and_then(|t| t.to_dtype(dtype))
                    .and_then(|t| t.to_device(d))
                    .expect("grad"),
            );
            let mut sgd = Sgd::new(SgdConfig {
                lr: 0.25,
                ..SgdConfig::default()
            })
            .expect("sgd");
            sgd.step_param("w", &mut p).expect("step");
            // Exact in binary: 1 - 0.125, -2 - 0.25, 0.5 + 0.5.
            let after = p.data().map(host_values).expect("data");
            assert_eq!(after, vec![0.875, -2.25, 1.0], "{dtype:?} on {d}");
            // In place: the tensor seen before the step shares the storage.
            assert_eq!(host_values(&storage_before), vec![0.875, -2.25, 1.0]);
            p.grad = Some(
                Tensor::zeros(&[2], dtype)
                    .and_then(|t| t.to_device(d))
                    .expect("grad"),
            );
            assert!(matches!(
                sgd.step_param("w", &mut p),
                Err(Error::ShapeMismatch { .. })
            ));
            bits_of(p.data().expect("data"))
        });
    }
}

/// The per-tensor update is AdamW's, aliased moments take the copying path with the same
/// bits, and a moment of another shape is a typed error naming the op; on both devices.
#[test]
fn adamw_update_on_tensors_is_adamws_step() {
    use hypershard_nn::optim::{AdamWTensors, adamw_update};
    let config = AdamWConfig {
        lr: 0.1,
        ..AdamWConfig::default()
    };
    let init = [0.5f32, -1.0, 2.0, 0.25];
    let grads = [0.3f32, -0.2, 0.1, 0.05];
    same_on_both(|d| {
        let on = |values: &[f32]| {
            Tensor::from_vec(values.to_vec(), &[values.len()])
                .and_then(|t| t.to_device(d))
                .unwrap()
        };
        let zeros = |n| {
            Tensor::zeros(&[n], DType::F32)
                .and_then(|t| t.to_device(d))
                .unwrap()
        };
        let read = |t: &Tensor| t.to_host().unwrap().to_vec::<f32>().unwrap();
        // The reference: AdamW's own step on a parameter.
        let mut p = Parameter::new("p", on(&init));
        p.grad = Some(on(&grads));
        let mut opt = AdamW::new(config).unwrap();
        opt.step_param("p", &mut p).unwrap();
        let want = read(p.data().unwrap());

        let grad = on(&grads);
        // One update from `init` with the moments `m` and `v`: the parameter after it.
        let update = |m: &Tensor, v: &Tensor, step| {
            let param = on(&init);
            let tensors = AdamWTensors {
                param: &param,
                grad: &grad,
                exp_avg: m,
                exp_avg_sq: v,
            };
            adamw_update(tensors, &config, step).map(|()| read(&param))
        };
        let (m, v) = (zeros(4), zeros(4));
        assert_eq!(update(&m, &v, 1).unwrap(), want);
        assert_eq!(read(&m), read(&opt.state("p").unwrap().exp_avg));

        // Both moments as halves of one buffer: they share a storage, so the update copies.
        let both = zeros(8);
        let (m, v) = (both.narrow(0, 0, 4).unwrap(), both.narrow(0, 4, 4).unwrap());
        assert_eq!(update(&m, &v, 1).unwrap(), want);

        let short = zeros(3);
        match update(&short, &v, 2) {
            Err(Error::ShapeMismatch { op, lhs, rhs }) => {
                assert_eq!((op, lhs, rhs), ("adamw_update", vec![4], vec![3]));
            }
            other => panic!("expected ShapeMismatch, got {other:?}"),
        }
        want
    });
}
