//! The device operations FSDP needs: casts, `add_`/`axpy_`/`scale_`, and copy-in/copy-out of
//! flat buffers. Each checks dtypes, lengths and the launch geometry on the host, then makes
//! one kernel launch (copy-in/out: one per 65 535 parts).

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};

use super::error::{CudaError, CudaResult, driver};
use super::kernels::{check_len, check_parts, copy_width, launch_config};
use super::tensor::CudaTensor;
use crate::DType;

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

/// The cast kernel from `from` to `to`, if there is one (identity casts need none).
pub(crate) fn cast_kernel(from: DType, to: DType) -> Option<&'static str> {
    use DType::{BF16, F16, F32, F64};
    match (from, to) {
        (F32, BF16) => Some("cast_f32_bf16"),
        (BF16, F32) => Some("cast_bf16_f32"),
        (F32, F16) => Some("cast_f32_f16"),
        (F16, F32) => Some("cast_f16_f32"),
        (BF16, F16) => Some("cast_bf16_f16"),
        (F16, BF16) => Some("cast_f16_bf16"),
        (F32, F64) => Some("cast_f32_f64"),
        (F64, F32) => Some("cast_f64_f32"),
        _ => None,
    }
}

/// The kernel of an elementwise op (`"add"`, `"axpy"`, `"scale"`, `"relu"`, `"relu_grad"`)
/// for `dtype`.
pub(crate) fn arith_kernel(
    op: &'static str,
    stem: &'static str,
    dtype: DType,
) -> CudaResult<&'static str> {
    let ty = arith_name(dtype).ok_or(CudaError::UnsupportedDType {
        op,
        from: dtype,
        to: dtype,
    })?;
    // The names are spelled out so that they are `'static` and match KERNEL_NAMES.
    Ok(match (stem, ty) {
        ("add", "f32") => "add_f32",
        ("add", "bf16") => "add_bf16",
        ("add", "f16") => "add_f16",
        ("add", "f64") => "add_f64",
        ("axpy", "f32") => "axpy_f32",
        ("axpy", "bf16") => "axpy_bf16",
        ("axpy", "f16") => "axpy_f16",
        ("axpy", "f64") => "axpy_f64",
        ("scale", "f32") => "scale_f32",
        ("scale", "bf16") => "scale_bf16",
        ("scale", "f16") => "scale_f16",
        ("scale", "f64") => "scale_f64",
        ("relu", "f32") => "relu_f32",
        ("relu", "bf16") => "relu_bf16",
        ("relu", "f16") => "relu_f16",
        ("relu", "f64") => "relu_f64",
        ("relu_grad", "f32") => "relu_grad_f32",
        ("relu_grad", "bf16") => "relu_grad_bf16",
        ("relu_grad", "f16") => "relu_grad_f16",
        ("relu_grad", "f64") => "relu_grad_f64",
        _ => {
            return Err(CudaError::UnsupportedDType {
                op,
                from: dtype,
                to: dtype,
            });
        }
    })
}

/// The kernels of the flat copies for `dtype`'s element size.
fn copy_kernels(op: &'static str, dtype: DType) -> CudaResult<(&'static str, &'static str)> {
    Ok(match copy_width(dtype.size_of()) {
        Some("b1") => ("copy_in_b1", "copy_out_b1"),
        Some("b2") => ("copy_in_b2", "copy_out_b2"),
        Some("b4") => ("copy_in_b4", "copy_out_b4"),
        Some("b8") => ("copy_in_b8", "copy_out_b8"),
        _ => {
            return Err(CudaError::UnsupportedDType {
                op,
                from: dtype,
                to: dtype,
            });
        }
    })
}

impl CudaTensor {
    /// The elements converted to `dtype` in a new tensor (f32 ↔ bf16, f32 ↔ f16, bf16 ↔ f16,
    /// f32 ↔ f64; rounding to nearest even, like [`Tensor::to_dtype`](crate::Tensor::to_dtype)).
    pub fn to_dtype(&self, dtype: DType) -> CudaResult<CudaTensor> {
        let mut out = self.output("CudaTensor::to_dtype", &self.shape, dtype)?;
        self.cast_into(&mut out)?;
        Ok(out)
    }

    /// Writes the elements, converted, into `out` (same device and shape, any dtype with a
    /// kernel; the identity cast is a device copy).
    pub fn cast_into(&self, out: &mut CudaTensor) -> CudaResult<()> {
        let op = "CudaTensor::cast_into";
        self.device.check_same(op, &out.device)?;
        if out.shape != self.shape {
            return Err(CudaError::ShapeMismatch {
                op,
                lhs: self.shape.clone(),
                rhs: out.shape.clone(),
            });
        }
        if out.dtype == self.dtype {
            return out.copy_from(self);
        }
        let name = cast_kernel(self.dtype, out.dtype).ok_or(CudaError::UnsupportedDType {
            op,
            from: self.dtype,
            to: out.dtype,
        })?;
        check_len(op, "output", self.numel, out.numel)?;
        let Some(config) = launch_config(op, self.numel, 1)? else {
            return Ok(());
        };
        let kernels = self.device.kernels(op)?;
        let function = kernels.function(op, name)?;
        let n = self.numel as u64;
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(function);
        launch.arg(&mut out.data).arg(&self.data).arg(&n);
        // SAFETY: the kernel `cast_<from>_<to>(to* dst, const from* src, u64 n)` reads `n`
        // elements of `self.dtype` from `self.data` and writes `n` of `out.dtype` to
        // `out.data`; both buffers hold exactly `n` elements of their dtype (checked above:
        // same shape, `check_len`), are distinct allocations (`&mut out` and `&self`), and
        // live until the launch has been ordered (cudarc frees on the same stream). Tested by
        // the device test `casts_match_the_cpu`.
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
        Ok(())
    }

    /// `self += other` elementwise (same device, shape and dtype; f32, bf16, f16, f64;
    /// half types compute in f32 with one rounding, like [`Tensor::add_`](crate::Tensor::add_)).
    pub fn add_(&mut self, other: &CudaTensor) -> CudaResult<()> {
        self.elementwise_("CudaTensor::add_", "add", None, Some(other))
    }

    /// `self += alpha * x` elementwise (same device, shape and dtype). `alpha` is rounded to
    /// the compute type first (f32 for f32/bf16/f16), like [`Tensor::axpy`](crate::Tensor::axpy).
    pub fn axpy_(&mut self, alpha: f64, x: &CudaTensor) -> CudaResult<()> {
        self.elementwise_("CudaTensor::axpy_", "axpy", Some(alpha), Some(x))
    }

    /// `self *= alpha` elementwise (f32, bf16, f16, f64), like
    /// [`Tensor::scale_`](crate::Tensor::scale_).
    pub fn scale_(&mut self, alpha: f64) -> CudaResult<()> {
        self.elementwise_("CudaTensor::scale_", "scale", Some(alpha), None)
    }

    /// `self = max(self, 0)` elementwise, in place (f32, bf16, f16, f64; NaN and −0 become
    /// +0, like hypershard-nn's CPU `Relu`). For hypershard-nn's device layers.
    pub fn relu_(&mut self) -> CudaResult<()> {
        self.elementwise_("CudaTensor::relu_", "relu", None, None)
    }

    /// ReLU's backward in place on the gradient: `self = output > 0 ? self : 0`, where
    /// `output` is the ReLU's output (same device, shape and dtype).
    pub fn relu_grad_(&mut self, output: &CudaTensor) -> CudaResult<()> {
        self.elementwise_("CudaTensor::relu_grad_", "relu_grad", None, Some(output))
    }

    /// Launches the in-place elementwise kernel `<stem>_<dtype>` over `self`. Every such
    /// kernel in kernels.cu takes `(t* dst, [compute alpha,] [const t* src,] u64 n)`: the
    /// scalar when `alpha` is given (as f64 for the f64 kernel, f32 otherwise: the kernel's
    /// compute type) and the second operand when `src` is given, which must match `self`'s
    /// device, shape and dtype.
    fn elementwise_(
        &mut self,
        op: &'static str,
        stem: &'static str,
        alpha: Option<f64>,
        src: Option<&CudaTensor>,
    ) -> CudaResult<()> {
        if let Some(src) = src {
            self.device.check_same(op, &src.device)?;
            self.check_like(op, &src.shape, src.dtype)?;
        }
        let name = arith_kernel(op, stem, self.dtype)?;
        let Some(config) = launch_config(op, self.numel, 1)? else {
            return Ok(());
        };
        let kernels = self.device.kernels(op)?;
        let function = kernels.function(op, name)?;
        let n = self.numel as u64;
        let alpha64 = alpha.unwrap_or(0.0);
        let alpha32 = alpha64 as f32;
        let stream = self.device.stream().clone();
        let mut launch = stream.launch_builder(function);
        launch.arg(&mut self.data);
        if alpha.is_some() {
            if self.dtype == DType::F64 {
                launch.arg(&alpha64);
            } else {
                launch.arg(&alpha32);
            }
        }
        if let Some(src) = src {
            launch.arg(&src.data);
        }
        launch.arg(&n);
        // SAFETY: the arguments are pushed in the order every elementwise kernel declares
        // (`add_`, `axpy_`, `scale_`, `relu_`, `relu_grad_` in kernels.cu: destination, the
        // scalar in the kernel's compute type when it takes one, the source when it takes one,
        // the length), and `arith_kernel` picked the kernel of `self.dtype`. The kernel reads
        // and writes `n` elements of `self.data` and reads `n` of `src.data`; both hold
        // exactly `n` elements of that dtype (same shape and dtype, checked above) and are
        // distinct allocations (`&mut self` against `&CudaTensor`). Both live until the launch
        // has been ordered on the stream (cudarc frees on the same stream). Tested by the
        // device tests `arith_matches_the_cpu` (crates/tensor/tests/cuda.rs) and
        // `relu_matches_the_cpu` (crates/nn/tests/cuda_mlp.rs).
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
        Ok(())
    }
}

/// Every part of a flat copy must be on `flat`'s device and have its dtype.
fn check_parts_match<'a>(
    op: &'static str,
    flat: &CudaTensor,
    parts: impl Iterator<Item = &'a CudaTensor>,
) -> CudaResult<()> {
    for part in parts {
        flat.device.check_same(op, &part.device)?;
        if part.dtype != flat.dtype {
            return Err(CudaError::DTypeMismatch {
                op,
                lhs: flat.dtype,
                rhs: part.dtype,
            });
        }
    }
    Ok(())
}

/// Copy-in: writes each `parts[i]` (flattened) into `flat` at element offset `offsets[i]`,
/// in one kernel launch (FSDP's all-gather input, or the reduce-scatter input of gradients).
///
/// Every part must be on `flat`'s device with its dtype, lie inside it, and not overlap another
/// part (else [`CudaError::OutOfBounds`] / [`CudaError::OverlappingParts`]); elements of `flat`
/// outside the parts are left as they are.
pub fn copy_in(flat: &mut CudaTensor, parts: &[&CudaTensor], offsets: &[usize]) -> CudaResult<()> {
    let op = "cuda::copy_in";
    check_parts_match(op, flat, parts.iter().copied())?;
    let lens: Vec<usize> = parts.iter().map(|p| p.numel).collect();
    let longest = check_parts(op, flat.numel, &lens, offsets, true)?;
    let (copy_in_name, _) = copy_kernels(op, flat.dtype)?;
    let Some(config) = launch_config(op, longest, parts.len().min(super::kernels::MAX_GRID_Y))?
    else {
        return Ok(());
    };
    let device = flat.device.clone();
    let stream = device.stream();
    // The table: (device address, offset, length) per part. The read guards make the stream
    // wait for earlier writes to each part and record the read after the launch.
    let mut table = Vec::with_capacity(3 * parts.len());
    let mut guards = Vec::with_capacity(parts.len());
    for (part, &offset) in parts.iter().zip(offsets) {
        let (address, guard) = part.data.device_ptr(stream);
        table.extend([address, offset as u64, part.numel as u64]);
        guards.push(guard);
    }
    let table = stream
        .clone_htod(&table)
        .map_err(driver(op, "cuMemcpyHtoDAsync"))?;
    let kernels = device.kernels(op)?;
    let function = kernels.function(op, copy_in_name)?;
    for first in (0..parts.len()).step_by(super::kernels::MAX_GRID_Y) {
        let rows = (parts.len() - first).min(super::kernels::MAX_GRID_Y);
        let mut config = config;
        config.grid_dim.1 = rows as u32;
        let first = first as u32;
        let mut launch = stream.launch_builder(function);
        launch.arg(&mut flat.data).arg(&table).arg(&first);
        // SAFETY: `copy_in_bN(T* flat, const u64* table, u32 first)` runs block row `y` over
        // part `first + y < parts.len()` (the grid has `rows` rows); the table holds 3 u64 per
        // part: a live device address of `len` elements of the element size N (each part's
        // own allocation, kept alive by `parts` and its guard until after the launch), its
        // offset and its length, with `offset + len <= flat.numel` and no two parts
        // overlapping (check_parts). `flat` is distinct from every part (`&mut` vs `&`).
        // Tested by the device test `flat_copies_round_trip`.
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
    }
    drop(guards);
    Ok(())
}

/// Copy-out: fills each `parts[i]` from `flat` starting at element offset `offsets[i]`, in one
/// kernel launch (FSDP's unsharded parameters out of the all-gather output, or gradient shards
/// out of the reduce-scatter output). Parts may overlap in `flat`; each must lie inside it.
pub fn copy_out(
    flat: &CudaTensor,
    parts: &mut [&mut CudaTensor],
    offsets: &[usize],
) -> CudaResult<()> {
    let op = "cuda::copy_out";
    check_parts_match(op, flat, parts.iter().map(|p| &**p))?;
    let lens: Vec<usize> = parts.iter().map(|p| p.numel).collect();
    let longest = check_parts(op, flat.numel, &lens, offsets, false)?;
    let (_, copy_out_name) = copy_kernels(op, flat.dtype)?;
    let Some(config) = launch_config(op, longest, parts.len().min(super::kernels::MAX_GRID_Y))?
    else {
        return Ok(());
    };
    let device = flat.device.clone();
    let stream = device.stream();
    let count = parts.len();
    let mut table = Vec::with_capacity(3 * count);
    let mut guards = Vec::with_capacity(count);
    for (part, &offset) in parts.iter_mut().zip(offsets) {
        let numel = part.numel as u64;
        let (address, guard) = part.data.device_ptr_mut(stream);
        table.extend([address, offset as u64, numel]);
        guards.push(guard);
    }
    let table = stream
        .clone_htod(&table)
        .map_err(driver(op, "cuMemcpyHtoDAsync"))?;
    let kernels = device.kernels(op)?;
    let function = kernels.function(op, copy_out_name)?;
    for first in (0..count).step_by(super::kernels::MAX_GRID_Y) {
        let rows = (count - first).min(super::kernels::MAX_GRID_Y);
        let mut config = config;
        config.grid_dim.1 = rows as u32;
        let first = first as u32;
        let mut launch = stream.launch_builder(function);
        launch.arg(&flat.data).arg(&table).arg(&first);
        // SAFETY: as in `copy_in`, with the roles swapped: block row `y` writes part
        // `first + y` (a live, exclusively borrowed allocation of `len` elements) from
        // `flat[offset..offset + len]`, which lies inside `flat` (check_parts). The parts are
        // distinct `&mut` borrows, so no two writes alias. Tested by the device test
        // `flat_copies_round_trip`.
        unsafe { launch.launch(config) }.map_err(driver(op, "cuLaunchKernel"))?;
    }
    drop(guards);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::KERNEL_NAMES;

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
                    Err(CudaError::UnsupportedDType { from: f, to, .. }) => {
                        assert_eq!((f, to), (from, from));
                        assert!(!from.is_float());
                    }
                    Err(other) => panic!("{other}"),
                }
            }
            let (copy_in_name, copy_out_name) = copy_kernels("t", from).unwrap();
            assert!(KERNEL_NAMES.contains(&copy_in_name));
            assert!(KERNEL_NAMES.contains(&copy_out_name));
        }
        assert_eq!(cast_kernel(DType::F32, DType::BF16), Some("cast_f32_bf16"));
        assert_eq!(cast_kernel(DType::F64, DType::BF16), None);
        assert_eq!(cast_kernel(DType::I32, DType::F32), None);
        assert_eq!(arith_kernel("t", "axpy", DType::F16).unwrap(), "axpy_f16");
        assert_eq!(arith_kernel("t", "scale", DType::F64).unwrap(), "scale_f64");
    }
}
