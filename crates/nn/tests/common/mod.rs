//! Helpers shared by the integration tests: random tensors and central finite differences.

#![allow(dead_code)]

use hypershard_nn::{Module, ParamVisitor, ParamVisitorMut, Result, to_device, zero_grad};
use hypershard_tensor::{DType, Device, RandomInit, Tensor};

/// The test device: host memory reached only through the device API (see
/// `hypershard_tensor::emulated`).
pub const EMULATED: Device = Device::Emulated { ordinal: 0 };

/// Runs `body` on the host and on the emulated device and returns the host run's result after
/// checking that the device run's is equal: one test body, two devices, the same values
/// (results compare as `f64` bits or exactly, as `R` does).
pub fn same_on_both<R: PartialEq + std::fmt::Debug>(body: impl Fn(&Device) -> R) -> R {
    let host = body(&Device::Cpu);
    let device = body(&EMULATED);
    assert_eq!(
        host, device,
        "the emulated device's run differs from the host's"
    );
    host
}

/// A tensor's values as `f64`, read with one explicit copy from wherever it lives.
pub fn host_values(t: &Tensor) -> Vec<f64> {
    // invariant: every test tensor is materialised, of a numeric dtype, and copies to the host.
    t.to_host().and_then(|h| h.to_f64_vec()).expect("f64")
}

/// A tensor's values as `f64` bits, read with one explicit copy from wherever it lives (so
/// runs on two devices compare exactly, NaN included).
pub fn bits_of(t: &Tensor) -> Vec<u64> {
    // invariant: every test tensor is materialised and copies to the host.
    let host = t.to_host().expect("to_host");
    host.to_f64_vec()
        .expect("f64")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Every parameter's value and gradient of `module`, in visiting order.
pub fn params_and_grads(module: &dyn Module) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    module.visit_params("", &mut |_, p| {
        out.push(p.data()?.clone());
        out.extend(p.grad.clone());
        Ok(())
    })?;
    Ok(out)
}

/// A standard normal random tensor.
pub fn normal(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
    Ok(Tensor::random(
        shape,
        dtype,
        RandomInit::normal(seed, 0.0, 1.0),
    )?)
}

/// Moves `module` to `device`, runs forward on `input` and backward on a random output
/// gradient there; returns the output, the input gradient and every parameter's value and
/// gradient.
pub fn forward_backward(
    module: &mut dyn Module,
    device: &Device,
    input: &Tensor,
    seed: u64,
) -> Result<Vec<Tensor>> {
    to_device(module, device)?;
    let y = module.forward(&input.to_device(device)?)?;
    let g = normal(y.shape(), y.dtype(), seed)?.to_device(device)?;
    let gx = module.backward(&g)?;
    let mut out = vec![y, gx];
    out.extend(params_and_grads(module)?);
    Ok(out)
}

/// A uniform random tensor on `[-1, 1)`.
pub fn random(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    // invariant: float dtype and small shapes, so creation cannot fail.
    Tensor::random(shape, dtype, RandomInit::uniform(seed, -1.0, 1.0)).expect("random")
}

/// `|a − n| ≤ 1e-6 · max(|a|, |n|) + 1e-9`: relative error 1e-6, with an absolute floor for
/// entries that are zero up to rounding.
pub fn assert_close(analytic: &[f64], numeric: &[f64], what: &str) {
    assert_eq!(analytic.len(), numeric.len(), "{what}: lengths");
    for (i, (a, n)) in analytic.iter().zip(numeric).enumerate() {
        let tol = 1e-6 * a.abs().max(n.abs()) + 1e-9;
        assert!(
            (a - n).abs() <= tol,
            "{what}[{i}]: analytic {a} vs numeric {n}"
        );
    }
}

/// `Σ forward(x) ⊙ weights`, the scalar whose gradient `backward(weights)` computes.
fn probe(module: &mut dyn Module, input: &Tensor, weights: &[f64]) -> f64 {
    // invariant: the module accepted this input in the analytic pass.
    let out = module
        .forward(input)
        .expect("forward")
        .to_f64_vec()
        .expect("f64");
    out.iter().zip(weights).map(|(o, w)| o * w).sum()
}

/// Central difference of `probe` with respect to element `index` of `target`, which is the
/// input or a view of a parameter's storage.
fn central_difference(
    module: &mut dyn Module,
    input: &Tensor,
    target: &Tensor,
    index: usize,
    weights: &[f64],
) -> f64 {
    const H: f64 = 1e-5;
    let set = |delta: f64| {
        // invariant: targets are contiguous f64 tensors created by the tests or layers.
        target
            .with_data_mut(|xs: &mut [f64]| xs[index] += delta)
            .expect("f64 contiguous");
    };
    set(H);
    let plus = probe(module, input, weights);
    set(-2.0 * H);
    let minus = probe(module, input, weights);
    set(H);
    (plus - minus) / (2.0 * H)
}

/// The analytic pass of `module` on `device`: forward on `input`, backward on the output
/// gradient `random(out shape, seed)`, then the output, the input gradient (for a float input)
/// and every parameter's gradient as `f64` bits read on the host. The module is left on the
/// host.
fn analytic_bits(
    module: &mut dyn Module,
    input: &Tensor,
    seed: u64,
    device: &Device,
) -> Vec<Vec<u64>> {
    // invariant: the tests pass modules that accept `input`, on devices this machine has.
    to_device(module, device).expect("to_device");
    zero_grad(module).expect("zero_grad");
    let out = module
        .forward(&input.to_device(device).expect("input"))
        .expect("forward");
    let weights = random(out.shape(), DType::F64, seed)
        .to_device(device)
        .expect("weights");
    let grad_input = module.backward(&weights).expect("backward");
    let mut bits = vec![bits_of(&out)];
    if input.dtype().is_float() {
        bits.push(bits_of(&grad_input));
    }
    module
        .visit_params("", &mut |_, param| {
            bits.push(bits_of(param.grad.as_ref().expect("a gradient")));
            Ok(())
        })
        .expect("visit");
    zero_grad(module).expect("zero_grad");
    to_device(module, &Device::Cpu).expect("back to the host");
    bits
}

/// The analytic pass of `module` on the emulated device gives the host's bits.
fn check_same_on_both(module: &mut dyn Module, input: &Tensor, seed: u64) {
    let device = analytic_bits(module, input, seed, &EMULATED);
    let host = analytic_bits(module, input, seed, &Device::Cpu);
    assert_eq!(
        host, device,
        "the emulated device's gradients differ from the host's"
    );
}

/// Checks `backward` of an f64 module against central finite differences for the input and
/// every parameter, after checking that its analytic pass gives the same bits on the emulated
/// device.
pub fn check_module(module: &mut dyn Module, input_shape: &[usize], seed: u64) {
    let input = random(input_shape, DType::F64, seed);
    check_same_on_both(module, &input, seed + 1000);
    // invariant: the tests pass modules that accept `input_shape`.
    let out = module.forward(&input).expect("forward");
    let weights = random(out.shape(), DType::F64, seed + 1000);
    zero_grad(module).expect("zero_grad");
    let grad_input = module.backward(&weights).expect("backward");
    let weights = weights.to_f64_vec().expect("f64");

    let mut analytic = Vec::new();
    module
        .visit_params("", &mut |name, param| {
            let grad = param
                .grad
                .as_ref()
                .expect("every parameter gets a gradient");
            analytic.push((name.to_string(), param.data()?.clone(), grad.to_f64_vec()?));
            Ok(())
        })
        .expect("visit");

    let numeric: Vec<f64> = (0..input.numel())
        .map(|i| central_difference(module, &input, &input, i, &weights))
        .collect();
    assert_close(&grad_input.to_f64_vec().expect("f64"), &numeric, "input");

    for (name, data, grad) in analytic {
        let numeric: Vec<f64> = (0..data.numel())
            .map(|i| central_difference(module, &input, &data, i, &weights))
            .collect();
        assert_close(&grad, &numeric, &name);
    }
}

/// Checks the parameter gradients of an f64 module against central finite differences for a
/// fixed input that has no gradient of its own (token ids), after checking that its analytic
/// pass gives the same bits on the emulated device.
pub fn check_params(module: &mut dyn Module, input: &Tensor, seed: u64) {
    check_same_on_both(module, input, seed);
    // invariant: the tests pass modules that accept `input`.
    let out = module.forward(input).expect("forward");
    let weights = random(out.shape(), DType::F64, seed);
    zero_grad(module).expect("zero_grad");
    module.backward(&weights).expect("backward");
    let weights = weights.to_f64_vec().expect("f64");
    let mut analytic = Vec::new();
    module
        .visit_params("", &mut |name, param| {
            let grad = param
                .grad
                .as_ref()
                .expect("every parameter gets a gradient");
            analytic.push((name.to_string(), param.data()?.clone(), grad.to_f64_vec()?));
            Ok(())
        })
        .expect("visit");
    for (name, data, grad) in analytic {
        let numeric: Vec<f64> = (0..data.numel())
            .map(|i| central_difference(module, input, &data, i, &weights))
            .collect();
        assert_close(&grad, &numeric, &name);
    }
}

/// Forwards every call to the inner module. Being another type, it makes `CausalSelfAttention`
/// treat a child wrapped in it as replaced, which sends the attention down its materialised
/// (dense) path.
pub struct Opaque(pub Box<dyn Module>);

impl Module for Opaque {
    fn kind(&self) -> &'static str {
        "Opaque"
    }
    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.0.forward(input)
    }
    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.0.backward(grad_output)
    }
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.0.visit_params(prefix, f)
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.0.visit_params_mut(prefix, f)
    }
    fn set_training(&mut self, training: bool) -> Result<()> {
        self.0.set_training(training)
    }
}
