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
//! device operation is checked against the CPU tensor ops on closed-form inputs f(i): round
//! trips of every dtype (pageable and pinned), each cast and elementwise kernel bit for bit,
//! copy-in/copy-out of flat buffers (including more parts than one launch's grid rows), and
//! cuBLAS GEMM at 37×53×29 with every transpose combination. Without the variable the device
//! checks run only when a GPU happens to be usable; the binary says which.

use std::process::ExitCode;

use hypershard_tensor::cuda::{
    CudaDevice, CudaError, CudaTensor, KERNEL_NAMES, KernelImage, PinnedBuffer, Transpose,
    Unavailable, compile_kernels, copy_in, copy_out, device_count, gemm, matmul, probe,
};
use hypershard_tensor::{DType, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

/// Asks for the NVRTC compile check (libnvrtc must then be loadable; no GPU needed).
const NVRTC_ENV: &str = "HYPERSHARD_TEST_NVRTC";

/// One device test: it gets the opened device.
type DeviceTest = fn(&CudaDevice) -> Outcome;

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

/// Host → device → host for every dtype, contiguous and strided sources, pageable copies.
fn round_trip(device: &CudaDevice) -> Outcome {
    for dtype in DType::ALL {
        let t = host(&[3, 37], dtype, 0)?;
        let d = CudaTensor::from_host(device, &t).map_err(fail)?;
        ensure(d.shape() == [3, 37] && d.dtype() == dtype, || {
            format!("{d:?}")
        })?;
        same_bytes(
            &format!("round trip {dtype}"),
            &d.to_host().map_err(fail)?,
            &t,
        )?;
        // A strided (transposed) source arrives row-major.
        let strided = t.transpose(0, 1).map_err(fail)?;
        let ds = CudaTensor::from_host(device, &strided).map_err(fail)?;
        same_bytes(
            &format!("strided {dtype}"),
            &ds.to_host().map_err(fail)?,
            &strided.contiguous().map_err(fail)?,
        )?;
        // copy_from, try_clone, copy_from_host, zero_.
        let mut other = CudaTensor::zeros(device, &[3, 37], dtype).map_err(fail)?;
        same_bytes(
            "zeros",
            &other.to_host().map_err(fail)?,
            &Tensor::zeros(&[3, 37], dtype).map_err(fail)?,
        )?;
        other.copy_from(&d).map_err(fail)?;
        same_bytes("copy_from", &other.to_host().map_err(fail)?, &t)?;
        let clone = other.try_clone().map_err(fail)?;
        other.zero_().map_err(fail)?;
        same_bytes("try_clone", &clone.to_host().map_err(fail)?, &t)?;
        same_bytes(
            "zero_",
            &other.to_host().map_err(fail)?,
            &Tensor::zeros(&[3, 37], dtype).map_err(fail)?,
        )?;
        other.copy_from_host(&t).map_err(fail)?;
        same_bytes("copy_from_host", &other.to_host().map_err(fail)?, &t)?;
    }
    // Empty tensors and reshape.
    let empty = CudaTensor::from_host(device, &Tensor::zeros(&[0, 5], DType::F32).map_err(fail)?)
        .map_err(fail)?;
    ensure(empty.to_host().map_err(fail)?.shape() == [0, 5], || {
        "empty".into()
    })?;
    let r = CudaTensor::from_host(device, &host(&[6], DType::F32, 0)?).map_err(fail)?;
    let r = r.reshape(&[2, 3]).map_err(fail)?;
    same_bytes(
        "reshape",
        &r.to_host().map_err(fail)?,
        &host(&[2, 3], DType::F32, 0)?,
    )?;
    // Length and shape errors, before any copy.
    let bad = CudaTensor::from_bytes(device, &[0u8; 7], &[2], DType::F32);
    ensure(
        matches!(
            bad,
            Err(CudaError::LengthMismatch {
                expected: 8,
                got: 7,
                ..
            })
        ),
        || format!("from_bytes with 7 bytes: {bad:?}"),
    )?;
    let mut short = [0u8; 23];
    let bad = r.copy_to_host_bytes(&mut short);
    ensure(
        matches!(
            bad,
            Err(CudaError::LengthMismatch {
                expected: 24,
                got: 23,
                ..
            })
        ),
        || format!("copy_to_host_bytes into 23 bytes: {bad:?}"),
    )?;
    let mut r = r;
    let bad = r.copy_from_host(&host(&[3, 2], DType::F32, 0)?);
    ensure(matches!(bad, Err(CudaError::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let bad = r.copy_from_host(&host(&[2, 3], DType::F64, 0)?);
    ensure(matches!(bad, Err(CudaError::DTypeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let bad = r.reshape(&[7]);
    ensure(matches!(bad, Err(CudaError::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    Ok(())
}

/// Device → pinned → device (offload and reload), asynchronous copies ordered on the stream.
fn pinned_offload(device: &CudaDevice) -> Outcome {
    let t = host(&[1000, 3], DType::BF16, 3)?;
    let d = CudaTensor::from_host(device, &t).map_err(fail)?;
    let mut pinned = PinnedBuffer::zeroed(device, d.nbytes()).map_err(fail)?;
    ensure(
        pinned.as_bytes().map_err(fail)?.iter().all(|&b| b == 0),
        || "pinned not zeroed".into(),
    )?;
    d.copy_to_pinned(&mut pinned).map_err(fail)?;
    same_bytes(
        "offload",
        &pinned.to_tensor(&[1000, 3], DType::BF16).map_err(fail)?,
        &t,
    )?;
    // Change the host copy, reload it into a fresh device tensor.
    let u = host(&[1000, 3], DType::BF16, 11)?;
    pinned
        .as_bytes_mut()
        .map_err(fail)?
        .copy_from_slice(&u.to_bytes().map_err(fail)?);
    let mut back = CudaTensor::zeros(device, &[1000, 3], DType::BF16).map_err(fail)?;
    back.copy_from_pinned(&pinned).map_err(fail)?;
    same_bytes("reload", &back.to_host().map_err(fail)?, &u)?;
    let from_tensor = PinnedBuffer::from_tensor(device, &t).map_err(fail)?;
    back.copy_from_pinned(&from_tensor).map_err(fail)?;
    same_bytes("from_tensor", &back.to_host().map_err(fail)?, &t)?;
    let mut small = PinnedBuffer::zeroed(device, 10).map_err(fail)?;
    let bad = d.copy_to_pinned(&mut small);
    ensure(
        matches!(
            bad,
            Err(CudaError::LengthMismatch {
                expected: 6000,
                got: 10,
                ..
            })
        ),
        || format!("{bad:?}"),
    )?;
    let empty = PinnedBuffer::zeroed(device, 0).map_err(fail)?;
    ensure(
        empty.is_empty() && empty.as_bytes().map_err(fail)?.is_empty(),
        || "empty pinned".into(),
    )
}

/// Every cast kernel against `Tensor::to_dtype`, bit for bit, over several blocks.
fn casts_match_the_cpu(device: &CudaDevice) -> Outcome {
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
        let d = CudaTensor::from_host(device, &src).map_err(fail)?;
        let cast = d.to_dtype(to).map_err(fail)?;
        same_bytes(
            &format!("cast {from} -> {to}"),
            &cast.to_host().map_err(fail)?,
            &src.to_dtype(to).map_err(fail)?,
        )?;
    }
    let d = CudaTensor::from_host(device, &host(&[4], F32, 0)?).map_err(fail)?;
    let bad = d.to_dtype(DType::I32);
    ensure(
        matches!(bad, Err(CudaError::UnsupportedDType { .. })),
        || format!("{bad:?}"),
    )?;
    let mut wrong = CudaTensor::zeros(device, &[5], BF16).map_err(fail)?;
    let bad = d.cast_into(&mut wrong);
    ensure(matches!(bad, Err(CudaError::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })
}

/// `add_`, `axpy_`, `scale_` against the CPU ops, bit for bit, for every float dtype.
fn arith_matches_the_cpu(device: &CudaDevice) -> Outcome {
    let n = 70_001;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let y = host(&[n], dtype, 2)?;
        let x = host(&[n], dtype, 7)?;
        let mut dy = CudaTensor::from_host(device, &y).map_err(fail)?;
        let dx = CudaTensor::from_host(device, &x).map_err(fail)?;
        dy.add_(&dx).map_err(fail)?;
        y.add_(&x).map_err(fail)?;
        same_bytes(&format!("add_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
        dy.axpy_(-0.37, &dx).map_err(fail)?;
        y.axpy(-0.37, &x).map_err(fail)?;
        same_bytes(&format!("axpy_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
        dy.scale_(1.7).map_err(fail)?;
        y.scale_(1.7).map_err(fail)?;
        same_bytes(&format!("scale_ {dtype}"), &dy.to_host().map_err(fail)?, &y)?;
    }
    let mut a = CudaTensor::zeros(device, &[4], DType::F32).map_err(fail)?;
    let b = CudaTensor::zeros(device, &[5], DType::F32).map_err(fail)?;
    let bad = a.add_(&b);
    ensure(matches!(bad, Err(CudaError::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let c = CudaTensor::zeros(device, &[4], DType::BF16).map_err(fail)?;
    let bad = a.axpy_(1.0, &c);
    ensure(matches!(bad, Err(CudaError::DTypeMismatch { .. })), || {
        format!("{bad:?}")
    })?;
    let mut i = CudaTensor::zeros(device, &[4], DType::I32).map_err(fail)?;
    let bad = i.scale_(2.0);
    ensure(
        matches!(bad, Err(CudaError::UnsupportedDType { .. })),
        || format!("{bad:?}"),
    )
}

/// Copy-in of many parts into a flat buffer at offsets (with gaps), copy-out back, against the
/// same layout built with CPU views.
fn flat_copies_round_trip(device: &CudaDevice) -> Outcome {
    let sizes = [5usize, 0, 37, 1, 300, 64];
    let gaps = [3usize, 0, 1, 7, 0, 2];
    for dtype in [DType::F32, DType::BF16, DType::I64, DType::U8, DType::F64] {
        let mut offsets = Vec::new();
        let mut at = 0;
        for (&size, &gap) in sizes.iter().zip(&gaps) {
            at += gap;
            offsets.push(at);
            at += size;
        }
        let total = at + 4;
        let parts: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(p, &s)| host(&[s], dtype, 100 * p))
            .collect::<Result<_, _>>()?;
        // CPU expectation: a sentinel-filled flat buffer with each part copied into its view.
        let expected = Tensor::full(&[total], 9.0, dtype).map_err(fail)?;
        for (part, &offset) in parts.iter().zip(&offsets) {
            expected
                .narrow(0, offset, part.numel())
                .map_err(fail)?
                .copy_from(part)
                .map_err(fail)?;
        }
        let device_parts: Vec<CudaTensor> = parts
            .iter()
            .map(|p| CudaTensor::from_host(device, p))
            .collect::<Result<_, _>>()
            .map_err(fail)?;
        let mut flat =
            CudaTensor::from_host(device, &Tensor::full(&[total], 9.0, dtype).map_err(fail)?)
                .map_err(fail)?;
        let refs: Vec<&CudaTensor> = device_parts.iter().collect();
        copy_in(&mut flat, &refs, &offsets).map_err(fail)?;
        same_bytes(
            &format!("copy_in {dtype}"),
            &flat.to_host().map_err(fail)?,
            &expected,
        )?;
        let mut outs: Vec<CudaTensor> = sizes
            .iter()
            .map(|&s| CudaTensor::zeros(device, &[s], dtype))
            .collect::<Result<_, _>>()
            .map_err(fail)?;
        let mut out_refs: Vec<&mut CudaTensor> = outs.iter_mut().collect();
        copy_out(&flat, &mut out_refs, &offsets).map_err(fail)?;
        for (p, (out, part)) in outs.iter().zip(&parts).enumerate() {
            same_bytes(
                &format!("copy_out {dtype} part {p}"),
                &out.to_host().map_err(fail)?,
                part,
            )?;
        }
        // Overlapping and out-of-bounds parts are refused before any launch.
        let mut bad_offsets = offsets.clone();
        bad_offsets[2] = offsets[0] + 1;
        let bad = copy_in(&mut flat, &refs, &bad_offsets);
        ensure(
            matches!(bad, Err(CudaError::OverlappingParts { .. })),
            || format!("{bad:?}"),
        )?;
        let mut bad_offsets = offsets.clone();
        bad_offsets[4] = total - 10;
        let mut out_refs: Vec<&mut CudaTensor> = outs.iter_mut().collect();
        let bad = copy_out(&flat, &mut out_refs, &bad_offsets);
        ensure(
            matches!(bad, Err(CudaError::OutOfBounds { part: 4, .. })),
            || format!("{bad:?}"),
        )?;
    }
    // More parts than one launch has grid rows (65 535): one element each.
    let count = 65_600;
    let parts: Vec<CudaTensor> = (0..count)
        .map(|i| CudaTensor::from_host(device, &Tensor::from_vec(vec![i as i32], &[1])?))
        .collect::<Result<_, CudaError>>()
        .map_err(fail)?;
    let refs: Vec<&CudaTensor> = parts.iter().collect();
    let offsets: Vec<usize> = (0..count).map(|i| count - 1 - i).collect();
    let mut flat = CudaTensor::zeros(device, &[count], DType::I32).map_err(fail)?;
    copy_in(&mut flat, &refs, &offsets).map_err(fail)?;
    let got = flat
        .to_host()
        .map_err(fail)?
        .to_vec::<i32>()
        .map_err(fail)?;
    let expected: Vec<i32> = (0..count as i32).rev().collect();
    ensure(got == expected, || {
        let i = got
            .iter()
            .zip(&expected)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        format!(
            "copy_in of {count} parts: element {i} is {}, expected {}",
            got[i], expected[i]
        )
    })?;
    let bf = CudaTensor::zeros(device, &[3], DType::BF16).map_err(fail)?;
    let bad = copy_in(&mut flat, &[&bf], &[0]);
    ensure(matches!(bad, Err(CudaError::DTypeMismatch { .. })), || {
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
fn gemm_f32_matches_the_cpu(device: &CudaDevice) -> Outcome {
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
                    CudaTensor::from_host(device, &a).map_err(fail)?,
                    CudaTensor::from_host(device, &b).map_err(fail)?,
                );
                let mut dc = CudaTensor::from_host(device, &c0).map_err(fail)?;
                gemm(0.5, &da, op_a, &db, op_b, 2.0, &mut dc).map_err(fail)?;
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
    let a = CudaTensor::from_host(device, &ints(&[m, k], 0)?).map_err(fail)?;
    let b = CudaTensor::from_host(device, &ints(&[k, n], 0)?).map_err(fail)?;
    same_bytes(
        "matmul",
        &matmul(&a, &b).map_err(fail)?.to_host().map_err(fail)?,
        &cpu_matmul(&ints(&[m, k], 0)?, &ints(&[k, n], 0)?)?,
    )?;
    let bad = matmul(&b, &b);
    ensure(matches!(bad, Err(CudaError::ShapeMismatch { .. })), || {
        format!("{bad:?}")
    })
}

/// bf16 GEMM (f32 and bf16 results) against the CPU. The inputs have 3 significant bits
/// (small integers times 2⁻² .. 2²), so every product and partial sum is exact in f32: the f32
/// result must equal the CPU's exactly, and the bf16 result must be within one bf16 rounding
/// of it (a relative 2⁻⁸).
fn gemm_bf16_matches_the_cpu(device: &CudaDevice) -> Outcome {
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
        CudaTensor::from_host(device, &a).map_err(fail)?,
        CudaTensor::from_host(device, &b).map_err(fail)?,
    );
    let mut wide = CudaTensor::zeros(device, &[m, n], DType::F32).map_err(fail)?;
    gemm(1.0, &da, Transpose::No, &db, Transpose::No, 0.0, &mut wide).map_err(fail)?;
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

fn main() -> ExitCode {
    let mut tally = Tally::default();
    tally.check(
        "creation_reports_unavailability",
        creation_reports_unavailability(),
    );
    let asked = gpu_asked();
    let nvrtc_asked = asked || std::env::var(NVRTC_ENV).is_ok_and(|v| v == "1");
    tally.check("kernels_compile", kernels_compile(nvrtc_asked));
    match CudaDevice::new(0) {
        Ok(device) => {
            println!(
                "cuda: device 0 is {} (compute capability {:?}); running the device tests",
                device.name().unwrap_or_else(|e| e.to_string()),
                device.compute_capability()
            );
            let tests: [(&str, DeviceTest); 7] = [
                ("round_trip", round_trip),
                ("pinned_offload", pinned_offload),
                ("casts_match_the_cpu", casts_match_the_cpu),
                ("arith_matches_the_cpu", arith_matches_the_cpu),
                ("flat_copies_round_trip", flat_copies_round_trip),
                ("gemm_f32_matches_the_cpu", gemm_f32_matches_the_cpu),
                ("gemm_bf16_matches_the_cpu", gemm_bf16_matches_the_cpu),
            ];
            for (name, test) in tests {
                tally.check(name, contained(|| test(&device)));
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
