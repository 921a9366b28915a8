//! The Module contract: names, child visiting, wrapping, accumulation and typed errors. The
//! accumulation, empty-dim and norm closed forms run on the host and on the emulated device,
//! with the same values on both.

mod common;

use common::{host_values, random, same_on_both};
use hypershard_nn::optim::clip_grad_norm;
use hypershard_nn::{
    ChildVisitorMut, Error, Linear, LinearConfig, Module, ParamVisitor, ParamVisitorMut, Relu,
    Result, Sequential, parameter_names, qualify_parameter_names, zero_grad,
};
use hypershard_tensor::{DType, Device, Tensor};

/// The bias gradient of `layer`, read on the host.
fn bias_grad(layer: &Linear) -> Vec<f64> {
    let bias = layer.bias.as_ref().expect("a bias");
    host_values(bias.grad.as_ref().expect("a bias gradient"))
}

fn linear(in_features: usize, out_features: usize, seed: u64) -> Linear {
    let config = LinearConfig {
        in_features,
        out_features,
        bias: true,
        dtype: DType::F64,
        seed,
    };
    Linear::new(config).expect("linear")
}

/// A wrapper that counts the calls of the module it wraps, as FSDP runs hooks around them.
struct Counting {
    inner: Box<dyn Module>,
    forwards: usize,
    backwards: usize,
}

impl Module for Counting {
    fn kind(&self) -> &'static str {
        "Counting"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.forwards += 1;
        self.inner.forward(input)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.backwards += 1;
        self.inner.backward(grad_output)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.inner.visit_params(prefix, f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.inner.visit_params_mut(prefix, f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        f("", &mut self.inner)
    }
}

#[test]
fn names_follow_pytorch() {
    let inner = Sequential::default()
        .with(linear(2, 3, 0))
        .with(Relu::new());
    let mut no_bias = linear(3, 1, 2);
    no_bias.bias = None;
    let model = Sequential::default().with(inner).with(no_bias);
    assert_eq!(
        parameter_names(&model).expect("names"),
        ["0.0.weight", "0.0.bias", "1.weight"]
    );
    let layer = linear(4, 5, 0);
    assert_eq!(layer.weight.data().expect("data").shape(), &[5, 4]);
}

#[test]
fn wrapping_children_keeps_results_and_names() {
    let mut plain = Sequential::default()
        .with(linear(3, 4, 0))
        .with(linear(4, 2, 2));
    let mut wrapped = Sequential::default();
    for seed in [0, 2] {
        let (i, o) = if seed == 0 { (3, 4) } else { (4, 2) };
        wrapped.layers.push(Box::new(Counting {
            inner: Box::new(linear(i, o, seed)),
            forwards: 0,
            backwards: 0,
        }));
    }
    let x = random(&[5, 3], DType::F64, 9);
    let y_plain = plain.forward(&x).expect("forward");
    let y_wrapped = wrapped.forward(&x).expect("forward");
    assert_eq!(
        y_plain.to_vec::<f64>().expect("f64"),
        y_wrapped.to_vec::<f64>().expect("f64")
    );
    let g = random(&[5, 2], DType::F64, 10);
    let gx_plain = plain.backward(&g).expect("backward");
    let gx_wrapped = wrapped.backward(&g).expect("backward");
    assert_eq!(
        gx_plain.to_vec::<f64>().expect("f64"),
        gx_wrapped.to_vec::<f64>().expect("f64")
    );
    assert_eq!(
        parameter_names(&plain).expect("names"),
        parameter_names(&wrapped).expect("names")
    );
    let mut kinds = Vec::new();
    wrapped
        .visit_children_mut(&mut |name, child| {
            kinds.push(format!("{name}:{}", child.kind()));
            Ok(())
        })
        .expect("children");
    assert_eq!(kinds, ["0:Counting", "1:Counting"]);
}

#[test]
fn gradients_accumulate_over_backward_passes() {
    same_on_both(|d| {
        let mut layer = linear(3, 2, 4);
        hypershard_nn::to_device(&mut layer, d).expect("to_device");
        let x = random(&[4, 3], DType::F64, 11).to_device(d).expect("x");
        let g = random(&[4, 2], DType::F64, 12).to_device(d).expect("g");
        let weight_grad = |layer: &Linear| host_values(layer.weight.grad.as_ref().expect("grad"));
        layer.forward(&x).expect("forward");
        layer.backward(&g).expect("backward");
        let once = weight_grad(&layer);
        layer.forward(&x).expect("forward");
        layer.backward(&g).expect("backward");
        let twice = weight_grad(&layer);
        for (a, b) in once.iter().zip(&twice) {
            assert!((2.0 * a - b).abs() < 1e-14);
        }
        zero_grad(&mut layer).expect("zero_grad");
        assert!(layer.weight.grad.is_none() && layer.bias.as_ref().expect("bias").grad.is_none());
        layer.weight.requires_grad = false;
        layer.forward(&x).expect("forward");
        layer.backward(&g).expect("backward");
        assert!(layer.weight.grad.is_none());
        assert!(layer.bias.as_ref().expect("bias").grad.is_some());
        let norm = clip_grad_norm(&mut layer, 1e9).expect("clip");
        let bias_grad = bias_grad(&layer);
        let expected = bias_grad.iter().map(|v| v * v).sum::<f64>().sqrt();
        assert!((norm - expected).abs() < 1e-14);
        (once, twice, norm.to_bits())
    });
}

#[test]
fn typed_errors() {
    let mut layer = linear(3, 2, 0);
    let g = Tensor::zeros(&[1, 2], DType::F64).expect("zeros");
    assert!(matches!(
        layer.backward(&g),
        Err(Error::BackwardBeforeForward { module: "Linear" })
    ));
    let x = Tensor::zeros(&[1, 3], DType::F64).expect("zeros");
    layer.forward(&x).expect("forward");
    layer.backward(&g).expect("backward");
    // The cache is consumed: a second backward needs a new forward.
    assert!(matches!(
        layer.backward(&g),
        Err(Error::BackwardBeforeForward { .. })
    ));
    let mut relu = Relu::new();
    assert!(matches!(
        relu.backward(&g),
        Err(Error::BackwardBeforeForward { module: "ReLU" })
    ));

    let wrong = Tensor::zeros(&[1, 4], DType::F64).expect("zeros");
    assert!(matches!(layer.forward(&wrong), Err(Error::BadShape { .. })));
    let wrong_dtype = Tensor::zeros(&[1, 3], DType::F32).expect("zeros");
    assert!(matches!(
        layer.forward(&wrong_dtype),
        Err(Error::DTypeMismatch { .. })
    ));

    layer.weight.data = None;
    layer.weight.name = "0.weight".to_string();
    let err = layer.forward(&x).expect_err("not materialised");
    assert!(matches!(&err, Error::NotMaterialised { name } if name == "0.weight"));
    assert_eq!(err.to_string(), "parameter `0.weight` is not materialised");
}

#[test]
fn qualified_names_reach_errors() {
    let mut model = Sequential::default()
        .with(Relu::new())
        .with(linear(3, 2, 0));
    qualify_parameter_names(&mut model).expect("qualify");
    model
        .visit_params_mut("", &mut |name, param| {
            if name == "1.bias" {
                param.data = None;
            }
            Ok(())
        })
        .expect("visit");
    let x = Tensor::zeros(&[2, 3], DType::F64).expect("zeros");
    assert!(matches!(
        model.forward(&x),
        Err(Error::NotMaterialised { name }) if name == "1.bias"
    ));
}

#[test]
fn zero_sized_dims() {
    same_on_both(|d| {
        let mut layer = linear(0, 2, 0);
        hypershard_nn::to_device(&mut layer, d).expect("to_device");
        let on = |t: hypershard_tensor::Result<Tensor>| t.and_then(|t| t.to_device(d)).expect("t");
        let x = on(Tensor::zeros(&[3, 0], DType::F64));
        let y = layer.forward(&x).expect("forward");
        assert_eq!(y.shape(), &[3, 2]);
        // With no inputs the output is the bias on every row, and torch's bias bound is 0.
        let bias = host_values(layer.bias.as_ref().expect("bias").data().expect("data"));
        let y = host_values(&y);
        assert_eq!(y, [bias.clone(), bias.clone(), bias].concat());
        let gx = layer
            .backward(&on(Tensor::ones(&[3, 2], DType::F64)))
            .expect("backward");
        assert_eq!(gx.shape(), &[3, 0]);
        let bias_grad = bias_grad(&layer);
        assert_eq!(bias_grad, vec![3.0, 3.0]);
        y
    });
}

#[test]
fn linear_init_is_torchs_bound_and_seeded() {
    let a = linear(16, 8, 42);
    let b = linear(16, 8, 42);
    let w = a.weight.data().expect("data").to_vec::<f64>().expect("f64");
    // torch: U(-1/√16, 1/√16) = U(-0.25, 0.25) for weight and bias.
    assert!(w.iter().all(|v| (-0.25..0.25).contains(v)));
    assert!(
        w.iter().any(|v| v.abs() > 0.2),
        "values spread over the interval"
    );
    let bias = a
        .bias
        .as_ref()
        .expect("bias")
        .data()
        .expect("data")
        .to_vec::<f64>()
        .expect("f64");
    assert!(bias.iter().all(|v| (-0.25..0.25).contains(v)));
    assert_eq!(
        w,
        b.weight.data().expect("data").to_vec::<f64>().expect("f64")
    );
    assert_ne!(w[..8], bias[..], "weight and bias use different seeds");
}

#[test]
fn norms_closed_form() {
    use hypershard_nn::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig};
    same_on_both(|d: &Device| {
        let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[1, 4])
            .and_then(|t| t.to_device(d))
            .expect("tensor");
        let mut ln = LayerNorm::new(LayerNormConfig {
            normalized_shape: 4,
            eps: 0.0,
            bias: true,
            dtype: DType::F64,
        })
        .expect("layer norm");
        hypershard_nn::to_device(&mut ln, d).expect("to_device");
        // mean 2.5, biased variance 1.25.
        let s = 1.25f64.sqrt();
        let y_ln = host_values(&ln.forward(&x).expect("forward"));
        for (got, want) in y_ln.iter().zip([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]) {
            assert!((got - want).abs() < 1e-15);
        }
        assert_eq!(parameter_names(&ln).expect("names"), ["weight", "bias"]);
        let mut rms = RmsNorm::new(RmsNormConfig {
            normalized_shape: 4,
            eps: Some(0.0),
            dtype: DType::F64,
        })
        .expect("rms norm");
        hypershard_nn::to_device(&mut rms, d).expect("to_device");
        // mean square 7.5.
        let r = 7.5f64.sqrt();
        let y_rms = host_values(&rms.forward(&x).expect("forward"));
        for (got, want) in y_rms.iter().zip([1.0 / r, 2.0 / r, 3.0 / r, 4.0 / r]) {
            assert!((got - want).abs() < 1e-15);
        }
        let wrong = Tensor::zeros(&[2, 3], DType::F64)
            .and_then(|t| t.to_device(d))
            .expect("zeros");
        assert!(matches!(rms.forward(&wrong), Err(Error::BadShape { .. })));
        (y_ln, y_rms)
    });
}

#[test]
fn replace_module_wraps_a_child_in_place_and_downcasts() {
    let mut model = Sequential::default()
        .with(linear(2, 3, 0))
        .with(Relu::new());
    let x = random(&[4, 2], DType::F64, 5);
    let before = model
        .forward(&x)
        .expect("forward")
        .to_vec::<f64>()
        .expect("f64");
    hypershard_nn::replace_module(&mut model.layers[0], |old| {
        Ok(Box::new(Counting {
            inner: old,
            forwards: 0,
            backwards: 0,
        }))
    })
    .expect("replace");
    assert_eq!(model.layers[0].kind(), "Counting");
    let after = model
        .forward(&x)
        .expect("forward")
        .to_vec::<f64>()
        .expect("f64");
    assert_eq!(before, after);
    // Plain layers do not offer themselves as `Any`.
    assert!(model.layers[1].as_any_mut().is_none());
    // A failing wrap leaves the identity in the slot and returns the error.
    let err = hypershard_nn::replace_module(&mut model.layers[0], |_| {
        Err(Error::BackwardBeforeForward { module: "test" })
    })
    .expect_err("wrap fails");
    assert!(matches!(err, Error::BackwardBeforeForward { .. }));
    assert_eq!(model.layers[0].kind(), "Identity");
}
