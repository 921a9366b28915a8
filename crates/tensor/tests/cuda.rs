//! Device tensors on this machine (`--features cuda`; brings its own main).
//!
//! Always: opening a device returns a device or `CudaError::Unavailable`, never a panic; an
//! absent ordinal is `Unavailable` even where the driver exists, and on a machine without a
//! usable GPU opening device 0 is `Unavailable` too.
//!
//! Always: the kernel source compiles with NVRTC when libnvrtc is loadable (no GPU needed);
//! with `HYPERSHARD_TEST_NVRTC=1` (or `HYPERSHARD_TEST_GPU=1`) it must be.
//!
//! With `HYPERSHARD_TEST_GPU=1`: the device must be there (else this FAILS, loudly), and every
//! device operation of a `Tensor` on `Device::Cuda` is checked against the CPU tensor ops on
//! closed-form inputs f(i): round trips of every dtype, each cast and elementwise kernel
//! (`to_dtype`, `add_`, `axpy`, `scale_`) bit for bit, and cuBLAS GEMM at 37×53×29 with every
//! transpose combination and a strided batch; a tensor's bytes handed to cudarc and back
//! (`into_cuda_bytes`, `tensor_from_cuda_bytes`). Without the variable the device
//! checks run only when a GPU happens to be usable; the binary says which.

use std::process::ExitCode;

use hypershard_tensor::cuda::{
    CudaDevice, CudaError, KERNEL_NAMES, KernelImage, Transpose, Unavailable, compile_kernels,
    device_count, gemm, gemm_strided_batched, into_cuda_bytes, matmul, probe,
    tensor_from_cuda_bytes,
};
use hypershard_tensor::{DType, Device, Error, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

/// Asks for the NVRTC compile check (libnvrtc must then be loadable; no GPU needed).
const NVRTC_ENV: &str = "HYPERSHARD_TEST_NVRTC";

/// One device test: it gets the opened device.
type DeviceTest = fn(&Device) -> Outcome;

fn ensure(condition: bool, message: impl FnOnce() -> String) -> Outcome {
    if condition { Ok(()) } else { Err(message()) }
}

/// A closed-form value with fractional bits, signs, a wide range and exact ties for the half
/// types: f(i) = ((37 i mod 1009) − 504) / 8 · 2^((i mod 9) − 4), plus 1 + 2⁻⁸ (a bf16 tie)
/// every 17th element.
fn f(i: usize) -> f64 {
    if i % 17 == 5 {
        return 1.0 + 1.0 / 256.0;
    }
    let base = ((37 * i) % 1009) as f64 - 504.0;
    base / 8.0 * 2f64.powi((i % 9) as i32 - 4)
}

/// A host tensor of `dtype` holding f(i + salt) rounded from f64 (through f32 for the floats).
fn host(shape: &[usize], dtype: DType, salt: usize) -> Result<Tensor, String> {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| f(i + salt) as f32).collect();
    let t = Tensor::from_vec(values, shape).map_err(fail)?;
    t.to_dtype(dtype).map_err(fail)
}

fn same_bytes(what: &str, got: &Tensor, expected: &Tensor) -> Outcome {
    ensure(got.shape() == expected.shape(), || {
        format!("{what}: shape {:?} vs {:?}", got.shape(), expected.shape())
    })?;
    ensure(got.dtype() == expected.dtype(), || {
        format!("{what}: dtype {} vs {}", got.dtype(), expected.dtype())
    })?;
    let (g, e) = (
        got.to_bytes().map_err(fail)?,
        expected.to_bytes().map_err(fail)?,
    );
    let size = got.dtype().size_of();
    match g.chunks(size).zip(e.chunks(size)).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} differs: {:?} vs {:?}",
            got.to_f64_vec().map_err(fail)?[i],
            expected.to_f64_vec().map_err(fail)?[i]
        )),
    }
}

/// Opening a device never panics; a missing device is `Unavailable`.
fn creation_reports_unavailability() -> Outcome {
    match CudaDevice::new(4096) {
        Err(CudaError::Unavailable { reason }) => {
            if probe().is_ok()
                && device_count().is_ok()
                && !matches!(
                    reason,
                    Unavailable::NoDevice {
                        requested: 4096,
                        ..
                    }
                )
            {
                return Err(format!(
                    "driver present, so expected NoDevice, got {reason:?}"
                ));
            }
        }
        Err(other) => return Err(format!("expected Unavailable, got {other}")),
        Ok(device) => return Err(format!("device 4096 opened: {device:?}")),
    }
    let usable = matches!(device_count(), Ok(n) if n > 0);
    if !usable {
        match CudaDevice::new(0) {
            Err(CudaError::Unavailable { reason }) => {
                println!("cuda: no usable GPU here: {reason}");
            }
            Err(other) => return Err(format!("expected Unavailable for device 0, got {other}")),
            Ok(device) => return Err(format!("no devices reported, yet {device:?} opened")),
        }
    }
    Ok(())
}

/// The kernel source compiles with NVRTC (no GPU needed) for Ampere and Hopper, to PTX that
/// defines every kernel and to a CUBIN (ELF) that names every kernel; without libnvrtc,
/// `Unavailable` (a failure when it was asked for).
fn kernels_compile(asked: bool) -> Outcome {
    for (major, minor) in [(8, 0), (9, 0)] {
        let ptx = match compile_kernels(major, minor, KernelImage::Ptx) {
            Ok(ptx) => String::from_utf8(ptx).map_err(fail)?,
            Err(CudaError::Unavailable {
                reason:
                    Unavailable::LibraryNotFound {
                        library: "libnvrtc",
                        ..
                    },
            }) if !asked => {
                println!("cuda: libnvrtc is not loadable here, so the kernels were not compiled");
                return Ok(());
            }
            Err(other) => return Err(other.to_string()),
        };
        ensure(ptx.contains(&format!(".target sm_{major}{minor}")), || {
            format!("the PTX is not for sm_{major}{minor}")
        })?;
        let cubin = compile_kernels(major, minor, KernelImage::Cubin).map_err(fail)?;
        ensure(cubin.starts_with(b"\x7fELF"), || {
            format!("the CUBIN for sm_{major}{minor} is not an ELF image")
        })?;
        for name in KERNEL_NAMES {
            ensure(ptx.contains(&format!(".entry {name}(")), || {
                format!("the PTX for sm_{major}{minor} has no entry {name}")
            })?;
            let symbol = format!("{name}\0");
            ensure(
                cubin.windows(symbol.len()).any(|w| w == symbol.as_bytes()),
                || format!("the CUBIN for sm_{major}{minor} has no symbol {name}"),
            )?;
        }
    }
    Ok(())
}

/// Host → device → host for every dtype, contiguous and strided sources; device copies,
/// zeros and views on the device.
fn round_trip(device: &Device) -> Outcome {
    for dtype in DType::ALL {
        let t = host(&[3, 37], dtype, 0)?;
        let d = t.to_device(device).map_err(fail)?;
        ensure(
            d.shape() == [3, 37] && d.dtype() == dtype && d.device() == *device,
            || format!("{d:?}"),
        )?;
        same_bytes(
            &format!("round trip {dtype}"),
            &d.to_host().map_err(fail)?,
            &t,
        )?;
        // A strided (transposed) source arrives row-major.
        let strided = t.transpose(0, 1).map_err(fail)?;
        let ds = strided.to_device(device).map_err(fail)?;
        same_bytes(
            &format!("strided {dtype}"),
            &ds.to_host().map_err(fail)?,
            &strided.contiguous().map_err(fail)?,
        )?;
        let zeros = Tensor::zeros_on(&[3, 37], dtype, device).map_err(fail)?;
        same_bytes(
            "zeros_on",
            &zeros.to_host().map_err(fail)?,
            &Tensor::zeros(&[3, 37], dtype).map_err(fail)?,
        )?;
        let copy = d.deep_copy().map_err(fail)?;
        same_bytes("deep_copy", &copy.to_host().map_err(fail)?, &t)?;
        // A row of the device tensor is a view; its host copy is that row.
        let row = d.narrow(0, 1, 1).map_err(fail)?;
        same_bytes(
            "narrow",
            &row.to_host().map_err(fail)?,
            &t.narrow(0, 1, 1)
                .and_then(|r| r.contiguous())
                .map_err(fail)?,
        )?;
    }
    let empty = Tensor::zeros(&[0, 5], DType::F32)
        .and_then(|t| t.to_device(device))
        .map_err(fail)?;
    ensure(empty.to_host().map_err(fail)?.shape() == [0, 5], || {
        "empty".into()
    })?;
    // A host read of device data is refused.
    let bad = host(&[2], DType::F32, 0)?
        .to_device(device)
        .and_then(|d| d.to_vec::<f32>());
    ensure(matches!(bad, Err(Error::DeviceData { .. })), || {
        format!("{bad:?}")
    })
}

/// Every cast kernel against the CPU's `to_dtype`, bit for bit, on an odd length.
fn casts_match_the_cpu(device: &Device) -> Outcome {
    use DType::{BF16, F16, F32, F64};
    let n = 100_003;
    for (from, to) in [
        (F32, BF16),
        (BF16, F32),
        (F32, F16),
        (F16, F32),
        (BF16, F16),
        (F16, BF16),
        (F32, F64),
        (F64, F32),
    ] {
        let src = host(&[n], from, 1)?;
        let d = src.to_device(device).map_err(fail)?;
        let cast = d.to_dtype(to).map_err(fail)?;
        same_bytes(
            &format!("cast {from} -> {to}"),
            &cast.to_host().map_err(fail)?,
            &src.to_dtype(to).map_err(fail)?,
        )?;
    }
    let d = host(&[4], F32, 0)?.to_device(device).map_err(fail)?;
    let bad = d.to_dtype(DType::I32);
    ensure(matches!(bad, Err(Error::UnsupportedDType { .. })), || {
        format!("{bad:?}")
    })?;
    // A strided view is cast through a device copy only where one exists: refused here.
    let bad =
        Tensor::zeros_on(&[2, 3], F32, device).and_then(|t| t.transpose(0, 1)?.to_dtype(BF16));
    ensure(matches!(bad, Err(Error::DeviceUnsupported { .. })), || {
        format!("{bad:?}")
    })
}

/// `add_`, `axpy_`, `scale_` against the CPU ops, bit for bit, for every float dtype.
fn arith_matches_the_cpu(device: &Device) -> Outcome {
    let n = 70_001;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let y = host(&[n], dtype, 2)?;
        let x = host(&[n], dtype, 7)?;
        let dy = y.to_device(device).map_err(fail)?;
        let dx = x.to_device(device).map_err(fail)?;
        dy.add_(&dx).map_err(fail)?;
        y.add_(&x).map_err(fail)?;
        same_bytes(&format!("add_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
        dy.axpy(-0.37, &dx).map_err(fail)?;
        y.axpy(-0.37, &x).map_err(fail)?;
        same_bytes(&format!("axpy_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
        dy.scale_(1.7).map_err(fail)?;
        y.scale_(1.7).map_err(fail)?;
        same_bytes(&format!("scale_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
    }
    let a = Tensor::zeros_on(&[4], DType::F32, device).map_err(fail)?;
    let b = Tensor::zeros_on(&[5], DType::F32, device).map_err(fail)?;
    let bad = a.add_(&b);
    ensure(matches!(bad, Err(Error::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let c = Tensor::zeros_on(&[4], DType::BF16, device).map_err(fail)?;
    let bad = a.axpy(1.0, &c);
    ensure(matches!(bad, Err(Error::DTypeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let i = Tensor::zeros_on(&[4], DType::I32, device).map_err(fail)?;
    let bad = i.scale_(2.0);
    ensure(matches!(bad, Err(Error::UnsupportedDType { .. })), || {
        format!("{bad:?}")
    })
}

/// The CPU product through tensor ops: sum over k of a[m, k, 1] · b[1, k, n].
fn cpu_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor, String> {
    let product = a
        .unsqueeze(2)
        .and_then(|a3| b.unsqueeze(0).and_then(|b3| a3.mul(&b3)))
        .map_err(fail)?;
    product.sum(1, false).map_err(fail)
}

/// `|x|` elementwise, as an f64 tensor of the same shape.
fn abs64(t: &Tensor) -> Result<Tensor, String> {
    let values: Vec<f64> = t
        .to_f64_vec()
        .map_err(fail)?
        .into_iter()
        .map(f64::abs)
        .collect();
    Tensor::from_vec(values, t.shape()).map_err(fail)
}

/// Checks `got = alpha · a b + beta · c` to the standard f32 GEMM error bound: per element,
/// `|got − exact| ≤ (K + 2) · 2⁻²³ · (|alpha| Σ|a||b| + |beta| |c|)`, with `exact` computed
/// by the CPU tensor ops in f64 (whose own error is far below the bound).
fn within_gemm_bound(
    what: &str,
    got: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    alpha: f64,
    beta: f64,
) -> Outcome {
    let k = a.shape()[1];
    let wide = |t: &Tensor| t.to_dtype(DType::F64).map_err(fail);
    let (c_wide, c_abs) = (wide(c)?, abs64(c)?);
    let exact = cpu_matmul(&wide(a)?, &wide(b)?)?
        .scale(alpha)
        .and_then(|p| p.add(&c_wide.scale(beta)?))
        .and_then(|t| t.to_f64_vec())
        .map_err(fail)?;
    let magnitude = cpu_matmul(&abs64(a)?, &abs64(b)?)?
        .scale(alpha.abs())
        .and_then(|p| p.add(&c_abs.scale(beta.abs())?))
        .and_then(|t| t.to_f64_vec())
        .map_err(fail)?;
    let got = got.to_f64_vec().map_err(fail)?;
    let unit = (k + 2) as f64 * 2f64.powi(-23);
    for (i, ((g, e), m)) in got.iter().zip(&exact).zip(&magnitude).enumerate() {
        ensure((g - e).abs() <= unit * m, || {
            format!("{what}: element {i} is {g}, exact {e}, bound {}", unit * m)
        })?;
    }
    Ok(())
}

/// f32 GEMM at 37×53×29 (no dim a multiple of 32), every transpose combination, alpha/beta,
/// against the CPU: integer-valued inputs must match exactly, fractional ones to the f32 GEMM
/// error bound.
fn gemm_f32_matches_the_cpu(device: &Device) -> Outcome {
    let (m, k, n) = (37usize, 53usize, 29usize);
    let ints = |shape: &[usize], salt: usize| -> Result<Tensor, String> {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 7 + salt) % 9) as f32 - 4.0)
            .collect();
        Tensor::from_vec(values, shape).map_err(fail)
    };
    for op_a in [Transpose::No, Transpose::Yes] {
        for op_b in [Transpose::No, Transpose::Yes] {
            let a_shape = if op_a == Transpose::No {
                [m, k]
            } else {
                [k, m]
            };
            let b_shape = if op_b == Transpose::No {
                [k, n]
            } else {
                [n, k]
            };
            for integers in [true, false] {
                let (a, b) = if integers {
                    (ints(&a_shape, 1)?, ints(&b_shape, 5)?)
                } else {
                    (
                        host(&a_shape, DType::F32, 1)?,
                        host(&b_shape, DType::F32, 9)?,
                    )
                };
                let a_op = if op_a == Transpose::No {
                    a.clone()
                } else {
                    a.transpose(0, 1).map_err(fail)?
                };
                let b_op = if op_b == Transpose::No {
                    b.clone()
                } else {
                    b.transpose(0, 1).map_err(fail)?
                };
                let c0 = host(&[m, n], DType::F32, 3)?;
                // expected = 0.5 · op(a) op(b) + 2 · c0
                let expected = cpu_matmul(&a_op, &b_op)?
                    .scale(0.5)
                    .and_then(|p| p.add(&c0.scale(2.0)?))
                    .map_err(fail)?;
                let (da, db) = (
                    a.to_device(device).map_err(fail)?,
                    b.to_device(device).map_err(fail)?,
                );
                let dc = c0.to_device(device).map_err(fail)?;
                gemm(0.5, &da, op_a, &db, op_b, 2.0, &dc).map_err(fail)?;
                let got = dc.to_host().map_err(fail)?;
                let what = format!("gemm {op_a:?}/{op_b:?} integers={integers}");
                if integers {
                    same_bytes(&what, &got, &expected)?;
                } else {
                    within_gemm_bound(&what, &got, &a_op, &b_op, &c0, 0.5, 2.0)?;
                }
            }
        }
    }
    let a = ints(&[m, k], 0)?.to_device(device).map_err(fail)?;
    let b = ints(&[k, n], 0)?.to_device(device).map_err(fail)?;
    same_bytes(
        "matmul",
        &matmul(&a, &b).map_err(fail)?.to_host().map_err(fail)?,
        &cpu_matmul(&ints(&[m, k], 0)?, &ints(&[k, n], 0)?)?,
    )?;
    let bad = matmul(&b, &b);
    ensure(matches!(bad, Err(Error::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })
}

/// bf16 GEMM (f32 and bf16 results) against the CPU. The inputs have 3 significant bits
/// (small integers times 2⁻² .. 2²), so every product and partial sum is exact in f32: the f32
/// result must equal the CPU's exactly, and the bf16 result must be within one bf16 rounding
/// of it (a relative 2⁻⁸).
fn gemm_bf16_matches_the_cpu(device: &Device) -> Outcome {
    let (m, k, n) = (37usize, 53usize, 29usize);
    let coarse = |shape: &[usize], salt: usize| -> Result<Tensor, String> {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len)
            .map(|i| (((i * 7 + salt) % 9) as f32 - 4.0) * 2f32.powi((i % 5) as i32 - 2))
            .collect();
        Tensor::from_vec(values, shape)
            .and_then(|t| t.to_dtype(DType::BF16))
            .map_err(fail)
    };
    let a = coarse(&[m, k], 4)?;
    let b = coarse(&[k, n], 8)?;
    let reference = cpu_matmul(
        &a.to_dtype(DType::F32).map_err(fail)?,
        &b.to_dtype(DType::F32).map_err(fail)?,
    )?;
    let (da, db) = (
        a.to_device(device).map_err(fail)?,
        b.to_device(device).map_err(fail)?,
    );
    let wide = Tensor::zeros_on(&[m, n], DType::F32, device).map_err(fail)?;
    gemm(1.0, &da, Transpose::No, &db, Transpose::No, 0.0, &wide).map_err(fail)?;
    same_bytes(
        "bf16 x bf16 -> f32",
        &wide.to_host().map_err(fail)?,
        &reference,
    )?;
    let narrow = matmul(&da, &db).map_err(fail)?.to_host().map_err(fail)?;
    ensure(narrow.dtype() == DType::BF16, || {
        format!("{}", narrow.dtype())
    })?;
    let close = narrow
        .to_dtype(DType::F32)
        .map_err(fail)?
        .allclose(&reference, 1.0 / 256.0, 0.0)
        .map_err(fail)?;
    ensure(close, || {
        "bf16 x bf16 -> bf16 not within one bf16 rounding of the CPU".into()
    })
}

/// A batch of 5 products (`[5, 7, 11] · [5, 11, 3]`, the second transposed in memory) with
/// integer inputs, so the f32 result must equal the CPU's exactly.
fn batched_gemm_matches_the_cpu(device: &Device) -> Outcome {
    let ints = |shape: &[usize], salt: usize| -> Result<Tensor, String> {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 5 + salt) % 7) as f32 - 3.0)
            .collect();
        Tensor::from_vec(values, shape).map_err(fail)
    };
    let (batch, m, k, n) = (5usize, 7usize, 11usize, 3usize);
    let a = ints(&[batch, m, k], 1)?;
    let bt = ints(&[batch, n, k], 2)?;
    let c = Tensor::zeros_on(&[batch, m, n], DType::F32, device).map_err(fail)?;
    gemm_strided_batched(
        1.0,
        &a.to_device(device).map_err(fail)?,
        Transpose::No,
        &bt.to_device(device).map_err(fail)?,
        Transpose::Yes,
        0.0,
        &c,
    )
    .map_err(fail)?;
    let got = c.to_host().map_err(fail)?;
    for i in 0..batch {
        let pick = |t: &Tensor| t.narrow(0, i, 1).and_then(|s| s.squeeze(0)).map_err(fail);
        let expected = cpu_matmul(&pick(&a)?, &pick(&bt)?.transpose(0, 1).map_err(fail)?)?;
        same_bytes(
            &format!("batch {i}"),
            &pick(&got)?.contiguous().map_err(fail)?,
            &expected,
        )?;
    }
    let bad = gemm_strided_batched(1.0, &c, Transpose::No, &c, Transpose::No, 0.0, &c);
    ensure(matches!(bad, Err(Error::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })
}

/// A host or emulated tensor has no CUDA bytes to hand over: a typed error naming the op and
/// the device, with or without a GPU.
fn cuda_bytes_refuse_other_devices() -> Outcome {
    let emulated = Device::Emulated { ordinal: 0 };
    for device in [Device::Cpu, emulated] {
        let t = host(&[4, 3], DType::F32, 0)?
            .to_device(&device)
            .map_err(fail)?;
        match into_cuda_bytes(t, "exchange test") {
            Err(Error::DeviceUnsupported {
                op: "exchange test",
                device: d,
            }) if d == device => {}
            other => {
                return Err(format!(
                    "{device}: expected DeviceUnsupported, got {other:?}"
                ));
            }
        }
    }
    Ok(())
}

/// A device tensor's bytes out as cudarc memory and back as a tensor, for every dtype: the
/// values survive; a sole owner hands its allocation over (same device address), a shared
/// storage or a view is copied and the original keeps its values; a wrong length is refused.
fn cuda_bytes_exchange(device: &Device) -> Outcome {
    use cudarc::driver::DevicePtr;
    for dtype in DType::ALL {
        let t = host(&[5, 7], dtype, 3)?;
        let sole = t.to_device(device).map_err(fail)?;
        let address = |tensor: &Tensor| -> Result<u64, String> {
            let probe = into_cuda_bytes(tensor.clone(), "address").map_err(fail)?;
            let stream = probe.stream().clone();
            Ok(probe.device_ptr(&stream).0)
        };
        // Two handles (this clone and `sole`): copied, so the clone's address is new.
        let copied_address = address(&sole)?;
        let bytes = into_cuda_bytes(sole, "exchange test").map_err(fail)?;
        ensure(bytes.len() == 35 * dtype.size_of(), || {
            format!("{dtype}: {} bytes", bytes.len())
        })?;
        let stream = bytes.stream().clone();
        let moved_address = bytes.device_ptr(&stream).0;
        ensure(moved_address != copied_address, || {
            format!("{dtype}: a shared storage was handed over instead of copied")
        })?;
        let back = tensor_from_cuda_bytes(bytes, &[5, 7], dtype, "exchange test").map_err(fail)?;
        ensure(back.device() == *device, || format!("{back:?}"))?;
        same_bytes(
            &format!("exchange {dtype}"),
            &back.to_host().map_err(fail)?,
            &t,
        )?;
        // The sole owner's allocation moves out as it is.
        let again = into_cuda_bytes(back, "exchange test").map_err(fail)?;
        ensure(again.device_ptr(&stream).0 == moved_address, || {
            format!("{dtype}: a sole owner's allocation was copied")
        })?;
        // A view (row 2) is copied out; the source keeps its values.
        let whole = t.to_device(device).map_err(fail)?;
        let row =
            into_cuda_bytes(whole.narrow(0, 2, 1).map_err(fail)?, "exchange test").map_err(fail)?;
        let row = tensor_from_cuda_bytes(row, &[1, 7], dtype, "exchange test").map_err(fail)?;
        same_bytes(
            &format!("row {dtype}"),
            &row.to_host().map_err(fail)?,
            &t.narrow(0, 2, 1).map_err(fail)?,
        )?;
        same_bytes(
            &format!("source {dtype}"),
            &whole.to_host().map_err(fail)?,
            &t,
        )?;
        // Bytes that are not the shape's length are refused.
        let short = into_cuda_bytes(row, "exchange test").map_err(fail)?;
        let refused = tensor_from_cuda_bytes(short, &[2, 7], dtype, "exchange test");
        ensure(matches!(refused, Err(Error::NumelMismatch { .. })), || {
            format!("{dtype}: {refused:?}")
        })?;
    }
    let empty = Tensor::zeros_on(&[0, 3], DType::F32, device).map_err(fail)?;
    let refused = into_cuda_bytes(empty, "exchange test");
    ensure(matches!(refused, Err(Error::EmptyInput { .. })), || {
        format!("empty: {refused:?}")
    })
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    tally.check(
        "creation_reports_unavailability",
        creation_reports_unavailability(),
    );
    let asked = gpu_asked();
    let nvrtc_asked = asked || std::env::var(NVRTC_ENV).is_ok_and(|v| v == "1");
    tally.check("kernels_compile", kernels_compile(nvrtc_asked));
    tally.check(
        "cuda_bytes_refuse_other_devices",
        contained(cuda_bytes_refuse_other_devices),
    );
    match CudaDevice::new(0) {
        Ok(device) => {
            println!(
                "cuda: device 0 is {} (compute capability {:?}); running the device tests",
                device.name().unwrap_or_else(|e| e.to_string()),
                device.compute_capability()
            );
            let tests: [(&str, DeviceTest); 7] = [
                ("round_trip", round_trip),
                ("cuda_bytes_exchange", cuda_bytes_exchange),
                ("casts_match_the_cpu", casts_match_the_cpu),
                ("arith_matches_the_cpu", arith_matches_the_cpu),
                ("gemm_f32_matches_the_cpu", gemm_f32_matches_the_cpu),
                ("gemm_bf16_matches_the_cpu", gemm_bf16_matches_the_cpu),
                ("batched_gemm_matches_the_cpu", batched_gemm_matches_the_cpu),
            ];
            let gpu = Device::Cuda { ordinal: 0 };
            for (name, test) in tests {
                tally.check(name, contained(|| test(&gpu)));
            }
            tally.check("synchronize", device.synchronize().map_err(fail));
        }
        Err(error) if asked => {
            eprintln!(
                "cuda: {GPU_ENV}=1 asks for the GPU tests, but no CUDA device is usable: {error}"
            );
            tally.check("gpu_available", Err(error.to_string()));
        }
        Err(error) => {
            println!(
                "cuda: {GPU_ENV}=1 is not set and no GPU is usable ({error}), so the device tests did not run"
            );
        }
    }
    tally.finish()
}
