//! Every backward against central finite differences in f64 (relative error ≤ 1e-6).

mod common;

use common::{assert_close, check_module, random};
use hypershard_nn::{
    DEFAULT_IGNORE_INDEX, Gelu, GeluApproximation, LayerNorm, LayerNormConfig, Linear,
    LinearConfig, Module, Relu, RmsNorm, RmsNormConfig, Sequential, Silu, cross_entropy, mse_loss,
};
use hypershard_tensor::{DType, Tensor};

fn linear(in_features: usize, out_features: usize, bias: bool, dtype: DType, seed: u64) -> Linear {
    let config = LinearConfig {
        in_features,
        out_features,
        bias,
        dtype,
        seed,
    };
    // invariant: a float dtype is always accepted.
    Linear::new(config).expect("linear")
}

#[test]
fn linear_with_and_without_bias() {
    check_module(&mut linear(5, 3, true, DType::F64, 1), &[4, 5], 10);
    check_module(&mut linear(5, 3, false, DType::F64, 3), &[4, 5], 11);
}

#[test]
fn linear_with_leading_dims() {
    check_module(&mut linear(4, 6, true, DType::F64, 5), &[2, 3, 4], 12);
}

#[test]
fn activations() {
    check_module(&mut Relu::new(), &[3, 7], 20);
    check_module(&mut Gelu::new(GeluApproximation::None), &[3, 7], 21);
    check_module(&mut Gelu::new(GeluApproximation::Tanh), &[3, 7], 22);
    check_module(&mut Silu::new(), &[3, 7], 23);
}

#[test]
fn sequential_mlp() {
    let mut mlp = Sequential::default()
        .with(linear(4, 8, true, DType::F64, 30))
        .with(Gelu::new(GeluApproximation::Tanh))
        .with(linear(8, 8, true, DType::F64, 32))
        .with(Silu::new())
        .with(linear(8, 3, false, DType::F64, 34));
    check_module(&mut mlp, &[5, 4], 40);
}

/// Central differences of a scalar loss of `x` (an f64 tensor) with respect to every element.
fn numeric_grad(x: &Tensor, loss: impl Fn(&Tensor) -> f64) -> Vec<f64> {
    const H: f64 = 1e-5;
    let base = x.to_f64_vec().expect("f64");
    (0..base.len())
        .map(|i| {
            let mut shifted = base.clone();
            shifted[i] = base[i] + H;
            let plus = loss(&Tensor::from_vec(shifted.clone(), x.shape()).expect("tensor"));
            shifted[i] = base[i] - H;
            let minus = loss(&Tensor::from_vec(shifted, x.shape()).expect("tensor"));
            (plus - minus) / (2.0 * H)
        })
        .collect()
}

#[test]
fn mse_gradient() {
    let prediction = random(&[3, 4], DType::F64, 50);
    let target = random(&[3, 4], DType::F64, 51);
    let out = mse_loss(&prediction, &target).expect("loss");
    let numeric = numeric_grad(&prediction, |p| mse_loss(p, &target).expect("loss").loss);
    assert_close(&out.grad.to_f64_vec().expect("f64"), &numeric, "mse");
}

#[test]
fn cross_entropy_gradient_with_ignored_targets() {
    let logits = random(&[2, 3, 5], DType::F64, 60)
        .scale(3.0)
        .expect("scale");
    let targets = Tensor::from_vec(vec![4i64, -100, 0, 2, 1, -100], &[2, 3]).expect("targets");
    let out = cross_entropy(&logits, &targets, DEFAULT_IGNORE_INDEX).expect("loss");
    let numeric = numeric_grad(&logits, |l| {
        cross_entropy(l, &targets, DEFAULT_IGNORE_INDEX)
            .expect("loss")
            .loss
    });
    assert_close(
        &out.grad.to_f64_vec().expect("f64"),
        &numeric,
        "cross_entropy",
    );
}

#[test]
fn f32_layers_agree_with_f64() {
    let make = |dtype| {
        Sequential::default()
            .with(linear(6, 5, true, dtype, 70))
            .with(Gelu::new(GeluApproximation::None))
            .with(linear(5, 2, true, dtype, 72))
    };
    let mut mlp64 = make(DType::F64);
    let mut mlp32 = make(DType::F32);
    let x64 = random(&[4, 6], DType::F64, 80);
    let x32 = x64.to_dtype(DType::F32).expect("cast");
    let y64 = mlp64
        .forward(&x64)
        .expect("forward")
        .to_f64_vec()
        .expect("f64");
    let y32 = mlp32.forward(&x32).expect("forward");
    assert_eq!(y32.dtype(), DType::F32);
    for (a, b) in y32.to_f64_vec().expect("f64").iter().zip(&y64) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    let g = random(&[4, 2], DType::F64, 81);
    let gx64 = mlp64
        .backward(&g)
        .expect("backward")
        .to_f64_vec()
        .expect("f64");
    let gx32 = mlp32
        .backward(&g.to_dtype(DType::F32).expect("cast"))
        .expect("backward");
    assert_eq!(gx32.dtype(), DType::F32);
    for (a, b) in gx32.to_f64_vec().expect("f64").iter().zip(&gx64) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

/// Perturbs the freshly initialised (ones / zeros) affine parameters so the check sees a
/// general weight and bias.
fn randomise_params(module: &mut dyn Module, seed: u64) {
    let mut next = seed;
    module
        .visit_params_mut("", &mut |_, param| {
            let data = param.data()?;
            data.copy_from(&random(data.shape(), DType::F64, next))?;
            next += 1;
            Ok(())
        })
        .expect("randomise");
}

#[test]
fn layer_norm_with_and_without_bias() {
    for bias in [true, false] {
        let config = LayerNormConfig {
            normalized_shape: 6,
            eps: 1e-5,
            bias,
            dtype: DType::F64,
        };
        let mut norm = LayerNorm::new(config).expect("layer norm");
        randomise_params(&mut norm, 90);
        check_module(&mut norm, &[2, 3, 6], 91);
    }
}

#[test]
fn rms_norm() {
    let config = RmsNormConfig {
        normalized_shape: 5,
        eps: None,
        dtype: DType::F64,
    };
    let mut norm = RmsNorm::new(config).expect("rms norm");
    randomise_params(&mut norm, 95);
    check_module(&mut norm, &[4, 5], 96);
}
