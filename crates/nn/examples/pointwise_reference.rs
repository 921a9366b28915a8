//! Writes the CPU's f32 pointwise layers that have CUDA kernels (the exact GELU, the tanh
//! GELU, SiLU, and a training `Dropout(0.3)` with seed 77) with their backwards for 400 000
//! inputs, as raw little-endian f32 arrays: `x`, `g`, then `f(x)` and the input gradient for
//! the output gradient `g`, per layer in that order. Then the SGD steps of [`SGD_CASES`]:
//! three steps each of a parameter that starts as the first [`SGD_LEN`] values of `x`, step
//! `k` taking gradient values `k·SGD_LEN..(k+1)·SGD_LEN` of `g`, with the parameter and the
//! momentum buffer (zeros without momentum) after each step. All of it goes to the path given
//! as the only argument. The host emulation of the device kernels
//! (crates/tensor/tests/cuda_emulate/run.sh) compares the device kernels with these bit for
//! bit.

use hypershard_nn::optim::{Sgd, SgdConfig};
use hypershard_nn::{Dropout, Gelu, GeluApproximation, Module, Parameter, Silu};
use hypershard_tensor::{DType, RandomInit, Tensor};

/// The parameter length of the SGD cases.
const SGD_LEN: usize = 100_000;

/// `(momentum, dampening, weight_decay, nesterov)` of each SGD case, in the order written.
const SGD_CASES: [(f64, f64, f64, bool); 3] = [
    (0.9, 0.1, 0.01, false),
    (0.8, 0.0, 0.0, true),
    (0.0, 0.0, 0.05, false),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: pointwise_reference <output file>")?;
    let n = 400_000;
    let mut xs =
        Tensor::random(&[n], DType::F32, RandomInit::uniform(1, -12.0, 12.0))?.to_vec::<f32>()?;
    // A dense sweep through zero and the series/formula switch of erf at |x/√2| = 0.5.
    for (i, x) in xs.iter_mut().take(100_000).enumerate() {
        *x = (i as f32 - 50_000.0) * 2e-5;
    }
    let x = Tensor::from_vec(xs, &[n])?;
    let g = Tensor::random(&[n], DType::F32, RandomInit::uniform(2, -1.0, 1.0))?;
    let mut out = Vec::with_capacity(40 * n);
    out.extend(x.to_bytes()?);
    out.extend(g.to_bytes()?);
    let layers: [Box<dyn Module>; 4] = [
        Box::new(Gelu::new(GeluApproximation::None)),
        Box::new(Gelu::new(GeluApproximation::Tanh)),
        Box::new(Silu::new()),
        // The first training forward draws its mask with the layer's seed itself.
        Box::new(Dropout::new(0.3, 77)?),
    ];
    for mut f in layers {
        let y = f.forward(&x)?;
        let dx = f.backward(&g)?;
        out.extend(y.to_bytes()?);
        out.extend(dx.to_bytes()?);
    }
    for (momentum, dampening, weight_decay, nesterov) in SGD_CASES {
        let mut sgd = Sgd::new(SgdConfig {
            lr: 0.05,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        })?;
        // A copy: the steps write the parameter in place, and `x` must stay as it is.
        let mut param = Parameter::new("p", x.narrow(0, 0, SGD_LEN)?.deep_copy()?);
        for step in 0..3 {
            param.grad = Some(g.narrow(0, step * SGD_LEN, SGD_LEN)?.contiguous()?);
            sgd.step_param("p", &mut param)?;
            out.extend(param.data()?.to_bytes()?);
            let buffer = match sgd.momentum_buffer("p") {
                Some(buffer) => buffer.clone(),
                None => Tensor::zeros(&[SGD_LEN], DType::F32)?,
            };
            out.extend(buffer.to_bytes()?);
        }
    }
    std::fs::write(&path, out)?;
    Ok(())
}
