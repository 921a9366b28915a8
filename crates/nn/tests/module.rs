//! The Module contract: names, child visiting, wrapping, accumulation and typed errors. Every
//! test body runs on the host and on the emulated device, with the same values (bit for bit)
//! and the same errors on both.

mod common;

use common::{bits_of, host_values, random, same_on_both};
use hypershard_nn::optim::clip_grad_norm;
use hypershard_nn::{
    ChildVisitorMut, Error, Linear, LinearConfig, Module, ParamVisitor, ParamVisitorMut, Relu,
    Result, Sequential, parameter_names, qualify_parameter_names, to_device, zero_grad,
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
    same_on_both(|d| {
        let inner = Sequential::default()
            .with(linear(2, 3, 0))
            .with(Relu::new());
        let mut no_bias = linear(3, 1, 2);
        no_bias.bias = None;
        let mut model = Sequential::default().with(inner).with(no_bias);
        to_device(&mut model, d).expect("to_device");
        let names = parameter_names(&model).expect("names");
        assert_eq!(names, ["0.0.weight", "0.0.bias", "1.weight"]);
        // Moving keeps every name, shape and value; the data now lives on `d`.
        let mut placed = Vec::new();
        model
            .visit_params("", &mut |name, param| {
                let data = param.data()?;
                assert_eq!(data.device(), *d, "{name}");
                placed.push((name.to_string(), data.shape().to_vec(), bits_of(data)));
                Ok(())
            })
            .expect("visit");
        let mut layer = linear(4, 5, 0);
        to_device(&mut layer, d).expect("to_device");
        assert_eq!(layer.weight.data().expect("data").shape(), &[5, 4]);
        (names, placed)
    });
}

#[test]
fn wrapping_children_keeps_results_and_names() {
    same_on_both(|d| {
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
        to_device(&mut plain, d).expect("to_device");
        to_device(&mut wrapped, d).expect("to_device");
        let x = random(&[5, 3], DType::F64, 9).to_device(d).expect("x");
        let y_plain = bits_of(&plain.forward(&x).expect("forward"));
        let y_wrapped = bits_of(&wrapped.forward(&x).expect("forward"));
        assert_eq!(y_plain, y_wrapped);
        let g = random(&[5, 2], DType::F64, 10).to_device(d).expect("g");
        let gx_plain = bits_of(&plain.backward(&g).expect("backward"));
        let gx_wrapped = bits_of(&wrapped.backward(&g).expect("backward"));
        assert_eq!(gx_plain, gx_wrapped);
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
        (y_plain, gx_plain)
    });
}

#[test]
fn gradients_accumulate_over_backward_passes() {
    same_on_both(|d| {
        let mut layer = linear(3, 2, 4);
        to_device(&mut layer, d).expect("to_device");
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

/// `error`'s variant and fields, for comparing the errors of two devices.
fn described(error: &Error) -> String {
    format!("{error:?}")
}

#[test]
fn typed_errors() {
    // Each device must refuse with the same variant carrying the same fields.
    same_on_both(|d| {
        let on = |t: hypershard_tensor::Result<Tensor>| t.and_then(|t| t.to_device(d)).expect("t");
        let mut seen = Vec::new();
        let mut layer = linear(3, 2, 0);
        to_device(&mut layer, d).expect("to_device");
        let g = on(Tensor::zeros(&[1, 2], DType::F64));
        let err = layer.backward(&g).expect_err("no forward");
        assert!(matches!(
            err,
            Error::BackwardBeforeForward { module: "Linear" }
        ));
        seen.push(described(&err));
        let x = on(Tensor::zeros(&[1, 3], DType::F64));
        layer.forward(&x).expect("forward");
        layer.backward(&g).expect("backward");
        // The cache is consumed: a second backward needs a new forward.
        let err = layer.backward(&g).expect_err("cache consumed");
        assert!(matches!(err, Error::BackwardBeforeForward { .. }));
        seen.push(described(&err));
        let mut relu = Relu::new();
        let err = relu.backward(&g).expect_err("no forward");
        assert!(matches!(
            err,
            Error::BackwardBeforeForward { module: "ReLU" }
        ));
        seen.push(described(&err));

        let wrong = on(Tensor::zeros(&[1, 4], DType::F64));
        let err = layer.forward(&wrong).expect_err("bad shape");
        assert!(matches!(err, Error::BadShape { .. }));
        seen.push(described(&err));
        let wrong_dtype = on(Tensor::zeros(&[1, 3], DType::F32));
        let err = layer.forward(&wrong_dtype).expect_err("bad dtype");
        assert!(matches!(err, Error::DTypeMismatch { .. }));
        seen.push(described(&err));

        layer.weight.data = None;
        layer.weight.name = "0.weight".to_string();
        let err = layer.forward(&x).expect_err("not materialised");
        assert!(matches!(&err, Error::NotMaterialised { name } if name == "0.weight"));
        assert_eq!(err.to_string(), "parameter `0.weight` is not materialised");
        seen.push(described(&err));
        seen
    });
}

#[test]
fn qualified_names_reach_errors() {
    same_on_both(|d| {
        let mut model = Sequential::default()
            .with(Relu::new())
            .with(linear(3, 2, 0));
        to_device(&mut model, d).expect("to_device");
        qualify_parameter_names(&mut model).expect("qualify");
        model
            .visit_params_mut("", &mut |name, param| {
                if name == "1.bias" {
                    param.data = None;
                }
                Ok(())
            })
            .expect("visit");
        let x = Tensor::zeros(&[2, 3], DType::F64)
            .and_then(|t| t.to_device(d))
            .expect("zeros");
        let err = model.forward(&x).expect_err("not materialised");
        assert!(matches!(&err, Error::NotMaterialised { name } if name == "1.bias"));
        described(&err)
    });
}

#[test]
fn zero_sized_dims() {
    same_on_both(|d| {
        let mut layer = linear(0, 2, 0);
        to_device(&mut layer, d).expect("to_device");
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
    // Built on the host and moved, as a user does: the device holds the host's init exactly.
    same_on_both(|d| {
        let (mut a, mut b) = (linear(16, 8, 42), linear(16, 8, 42));
        to_device(&mut a, d).expect("to_device");
        to_device(&mut b, d).expect("to_device");
        let w = host_values(a.weight.data().expect("data"));
        // torch: U(-1/√16, 1/√16) = U(-0.25, 0.25) for weight and bias.
        assert!(w.iter().all(|v| (-0.25..0.25).contains(v)));
        assert!(
            w.iter().any(|v| v.abs() > 0.2),
            "values spread over the interval"
        );
        let bias = host_values(a.bias.as_ref().expect("bias").data().expect("data"));
        assert!(bias.iter().all(|v| (-0.25..0.25).contains(v)));
        assert_eq!(w, host_values(b.weight.data().expect("data")));
        assert_ne!(w[..8], bias[..], "weight and bias use different seeds");
        (
            bits_of(a.weight.data().expect("data")),
            bits_of(a.bias.as_ref().expect("bias").data().expect("data")),
        )
    });
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
        to_device(&mut ln, d).expect("to_device");
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
        to_device(&mut rms, d).expect("to_device");
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
    same_on_both(|d| {
        let mut model = Sequential::default()
            .with(linear(2, 3, 0))
            .with(Relu::new());
        to_device(&mut model, d).expect("to_device");
        let x = random(&[4, 2], DType::F64, 5).to_device(d).expect("x");
        let before = bits_of(&model.forward(&x).expect("forward"));
        hypershard_nn::replace_module(&mut model.layers[0], |old| {
            Ok(Box::new(Counting {
                inner: old,
                forwards: 0,
                backwards: 0,
            }))
        })
        .expect("replace");
        assert_eq!(model.layers[0].kind(), "Counting");
        let after = bits_of(&model.forward(&x).expect("forward"));
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
        after
    });
}
