//! Writes the CPU's f32 exact GELU and its backward for 400 000 inputs, as raw little-endian
//! f32 arrays `x, g, gelu(x), g·gelu'(x)`, to the path given as the only argument. The host
//! emulation of the device kernels (crates/tensor/tests/cuda_emulate/run.sh) compares the
//! device GELU with these bit for bit.

use hypershard_nn::{Gelu, GeluApproximation, Module};
use hypershard_tensor::{DType, RandomInit, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: gelu_reference <output file>")?;
    let n = 400_000;
    let mut xs =
        Tensor::random(&[n], DType::F32, RandomInit::uniform(1, -12.0, 12.0))?.to_vec::<f32>()?;
    // A dense sweep through zero and the series/formula switch of erf at |x/√2| = 0.5.
    for (i, x) in xs.iter_mut().take(100_000).enumerate() {
        *x = (i as f32 - 50_000.0) * 2e-5;
    }
    let x = Tensor::from_vec(xs, &[n])?;
    let g = Tensor::random(&[n], DType::F32, RandomInit::uniform(2, -1.0, 1.0))?;
    let mut gelu = Gelu::new(GeluApproximation::None);
    let y = gelu.forward(&x)?;
    let dx = gelu.backward(&g)?;
    let mut out = Vec::with_capacity(16 * n);
    for t in [&x, &g, &y, &dx] {
        out.extend(t.to_bytes()?);
    }
    std::fs::write(&path, out)?;
    Ok(())
}
