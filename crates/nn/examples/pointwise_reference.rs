//! Writes the CPU's f32 pointwise layers that have CUDA kernels (the exact GELU, the tanh
//! GELU, SiLU, and a training `Dropout(0.3)` with seed 77) with their backwards for 400 000
//! inputs, as raw little-endian f32 arrays: `x`, `g`, then `f(x)` and the input gradient for
//! the output gradient `g`, per layer in that order, to the path given as the only argument.
//! The host emulation of the device kernels (crates/tensor/tests/cuda_emulate/run.sh)
//! compares the device kernels with these bit for bit.

use hypershard_nn::{Dropout, Gelu, GeluApproximation, Module, Silu};
use hypershard_tensor::{DType, RandomInit, Tensor};

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
    std::fs::write(&path, out)?;
    Ok(())
}
