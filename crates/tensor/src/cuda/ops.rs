//! The tensor ops with CUDA kernels: casts between the float dtypes, the in-place `add_`,
//! `axpy` and `scale_` (the CUDA arms of [`Tensor::add_`], [`Tensor::axpy`],
//! [`Tensor::scale_`] and [`Tensor::to_dtype`]) and ReLU with its backward for hypershard-nn.
//! Each checks dtypes and shapes on the host, then makes one kernel launch.

use cudarc::driver::PushKernelArg;

use super::kernels::{KERNEL_NAMES, launch_config};
use super::view::{Dev, launch};
use crate::{DType, Error, Result, Tensor};

/// The kernel name stem of a dtype with elementwise kernels.
fn arith_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        DType::F64 => Some("f64"),
        _ => None,
    }
}

/// The kernel named `name`, as the `'static` name in [`KERNEL_NAMES`] (so a name the ops ask
/// for always exists), or `None`.
fn kernel(name: &str) -> Option<&'static str> {
    KERNEL_NAMES.iter().copied().find(|k| *k == name)
}

/// The cast kernel from `from` to `to`, if there is one (identity casts need none).
pub(crate) fn cast_kernel(from: DType, to: DType) -> Option<&'static str> {
    let (f, t) = (arith_name(from)?, arith_name(to)?);
    (from != to).then(|| kernel(&format!("cast_{f}_{t}")))?
}

/// The kernel of an elementwise op (`"add"`, `"axpy"`, `"scale"`, `"relu"`, `"relu_grad"`)
/// for `dtype`.
pub(crate) fn arith_kernel(op: &'static str, stem: &str, dtype: DType) -> Result<&'static str> {
    arith_name(dtype)
        .and_then(|ty| kernel(&format!("{stem}_{ty}")))
        .ok_or(Error::UnsupportedDType { op, dtype })
}

/// The CUDA arm of [`Tensor::to_dtype`] for a contiguous tensor: f32 ↔ bf16, f32 ↔ f16,
/// bf16 ↔ f16, f32 ↔ f64, rounding to nearest even as the host does.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "to_dtype";
    let src = Dev::of(OP, t)?;
    let name = cast_kernel(src.dtype, dtype).ok_or(Error::UnsupportedDType {
        op: OP,
        dtype: if src.dtype.is_float() {
            dtype
        } else {
            src.dtype
        },
    })?;
    let (out, dst) = src.output(OP, &src.shape, dtype)?;
    if let Some(config) = launch_config(OP, src.numel, 1).map_err(src.error(OP))? {
        let n = src.numel as u64;
        // Checked: `cast_<from>_<to>(to* dst, const from* src, u64 n)`; src holds n elements
        // of its dtype, dst (new) n of `dtype`.
        launch!(OP, &src, name, config, |l| {
            l.arg(&dst.ptr).arg(&src.ptr).arg(&n);
        })?;
    }
    Ok(out)
}

/// Launches the in-place elementwise kernel `<stem>_<dtype>` over `dst`. Every such kernel in
/// kernels.cu takes `(t* dst, [compute alpha,] [const t* src,] u64 n)`: the scalar when
/// `alpha` is given (as f64 for the f64 kernel, f32 otherwise: the kernel's compute type) and
/// the second operand when `src` is given, which must have `dst`'s device, shape and dtype
/// (no broadcasting on the device).
pub(crate) fn elementwise_(
    op: &'static str,
    stem: &'static str,
    dst: &Tensor,
    alpha: Option<f64>,
    src: Option<&Tensor>,
) -> Result<()> {
    dst.check_writable(op)?;
    let d = Dev::of(op, dst)?;
    let s = src.map(|s| Dev::of(op, s)).transpose()?;
    if let Some(s) = &s {
        d.same_device(op, s)?;
        s.dtype_is(op, d.dtype)?;
        s.shape_is(op, &d.shape)?;
    }
    let name = arith_kernel(op, stem, d.dtype)?;
    let Some(config) = launch_config(op, d.numel, 1).map_err(d.error(op))? else {
        return Ok(());
    };
    let n = d.numel as u64;
    let alpha64 = alpha.unwrap_or(0.0);
    let alpha32 = alpha64 as f32;
    // Checked: dst and src hold n elements of one dtype, the kernel of that dtype.
    launch!(op, &d, name, config, |l| {
        l.arg(&d.ptr);
        if alpha.is_some() {
            if d.dtype == DType::F64 {
                l.arg(&alpha64);
            } else {
                l.arg(&alpha32);
            }
        }
        if let Some(s) = &s {
            l.arg(&s.ptr);
        }
        l.arg(&n);
    })
}

/// `x = max(x, 0)` in place on a CUDA tensor (f32, bf16, f16, f64; NaN and −0 become +0, as
/// hypershard-nn's host `Relu`).
pub fn relu_(x: &Tensor) -> Result<()> {
    elementwise_("cuda::relu_", "relu", x, None, None)
}

/// ReLU's backward in place on the gradient: `grad = output > 0 ? grad : 0`, where `output`
/// is the ReLU's output (same device, shape and dtype).
pub fn relu_grad_(grad: &Tensor, output: &Tensor) -> Result<()> {
    elementwise_("cuda::relu_grad_", "relu_grad", grad, None, Some(output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_the_ops_name_exists() {
        for from in DType::ALL {
            for to in DType::ALL {
                if let Some(name) = cast_kernel(from, to) {
                    assert!(KERNEL_NAMES.contains(&name), "{name}");
                    assert_ne!(from, to);
                }
            }
            for stem in ["add", "axpy", "scale", "relu", "relu_grad"] {
                match arith_kernel("t", stem, from) {
                    Ok(name) => {
                        assert!(KERNEL_NAMES.contains(&name), "{name}");
                        assert!(name.starts_with(stem), "{name} for {stem}");
                        assert!(from.is_float());
                    }
                    Err(Error::UnsupportedDType { dtype, .. }) => {
                        assert_eq!(dtype, from);
                        assert!(!from.is_float());
                    }
                    Err(other) => panic!("{other}"),
                }
            }
        }
        assert_eq!(cast_kernel(DType::F32, DType::BF16), Some("cast_f32_bf16"));
        assert_eq!(cast_kernel(DType::F64, DType::BF16), None);
        assert_eq!(cast_kernel(DType::I32, DType::F32), None);
        assert_eq!(arith_kernel("t", "axpy", DType::F16).unwrap(), "axpy_f16");
        assert_eq!(arith_kernel("t", "scale", DType::F64).unwrap(), "scale_f64");
    }
}
