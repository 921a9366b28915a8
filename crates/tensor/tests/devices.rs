//! One test body, two devices: every op of the crate on the host and on the emulated device,
//! with the same values bit for bit; the typed errors of device misuse; explicit copies at odd
//! sizes; the emulated device's stream-order check.

use half::{bf16, f16};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device, Error, Result, Stream, Tensor};

/// The emulated device the shared-op tests use. Stream tests take ordinals of their own, so
/// that no other test's synchronisation can order their streams.
const EMULATED: Device = Device::Emulated { ordinal: 0 };

/// Runs `body` on the host and on the emulated device, checks that every tensor it returns is
/// on the device it ran on, and that both runs give the same bytes; returns the host run's
/// tensors for the caller's value checks.
fn on_both(body: impl Fn(&Device) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    let host = body(&Device::Cpu)?;
    let device = body(&EMULATED)?;
    assert_eq!(host.len(), device.len());
    for (i, (h, d)) in host.iter().zip(&device).enumerate() {
        assert_eq!(h.device(), Device::Cpu, "output {i}");
        assert_eq!(d.device(), EMULATED, "output {i}");
        assert_eq!(h.shape(), d.shape(), "output {i}");
        assert_eq!(h.dtype(), d.dtype(), "output {i}");
        let back = d.to_host()?;
        assert_eq!(back.device(), Device::Cpu);
        assert_eq!(h.to_bytes()?, back.to_bytes()?, "output {i}: bits differ");
    }
    Ok(host)
}

/// A host tensor moved to `device`.
fn on(device: &Device, t: Tensor) -> Result<Tensor> {
    t.to_device(device)
}

#[test]
fn elementwise_ops_match_on_both_devices() -> Result<()> {
    let out = on_both(|d| {
        let a = on(d, Tensor::arange(6, DType::F32)?.view(&[2, 3])?)?;
        let row = on(d, Tensor::from_vec(vec![10.0f32, 20.0, 30.0], &[3])?)?;
        let col = on(d, Tensor::from_vec(vec![0.5f32, -2.0], &[2, 1])?)?;
        let at = a.transpose(0, 1)?;
        let i = on(d, Tensor::from_vec(vec![7i32, -9, 12], &[3])?)?;
        let three = on(d, Tensor::from_vec(vec![2i32, 4, 5], &[3])?)?;
        let h = on(
            d,
            Tensor::random(
                &[5],
                DType::BF16,
                hypershard_tensor::RandomInit::normal(3, 0.0, 1.0),
            )?,
        )?;
        Ok(vec![
            a.add(&row)?,
            a.sub(&col)?,
            col.mul(&row)?,
            a.div(&col)?,
            at.add(&at)?,
            a.scale(0.25)?,
            i.div(&three)?,
            h.mul(&h)?,
        ])
    })?;
    assert_eq!(out[0].to_vec::<f32>()?, vec![10., 21., 32., 13., 24., 35.]);
    assert_eq!(out[1].to_vec::<f32>()?, vec![-0.5, 0.5, 1.5, 5., 6., 7.]);
    assert_eq!(
        out[2].to_vec::<f32>()?,
        vec![5., 10., 15., -20., -40., -60.]
    );
    assert_eq!(out[4].to_vec::<f32>()?, vec![0., 6., 2., 8., 4., 10.]);
    assert_eq!(out[6].to_vec::<i32>()?, vec![3, -2, 2]);
    assert_eq!(out[7].dtype(), DType::BF16);
    Ok(())
}

#[test]
fn in_place_ops_match_on_both_devices() -> Result<()> {
    let out = on_both(|d| {
        let m = Tensor::zeros_on(&[2, 3], DType::F32, d)?;
        m.add_(&on(d, Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?)?)?;
        m.transpose(0, 1)?
            .narrow(0, 0, 1)?
            .mul_(&on(d, Tensor::scalar(10.0f32))?)?;
        m.sub_(&on(d, Tensor::ones(&[2, 1], DType::F32)?)?)?;
        m.div_(&on(d, Tensor::full(&[1], 2.0, DType::F32)?)?)?;
        m.axpy(-0.5, &on(d, Tensor::arange(3, DType::F32)?)?)?; // [[4.5, 0, 0]; 2]
        m.narrow(1, 1, 2)?.scale_(4.0)?;
        // Source and destination in one storage: the source is detached first.
        m.narrow(0, 0, 1)?.add_(&m.narrow(0, 1, 1)?)?;
        let filled = Tensor::zeros_on(&[3, 4], DType::F16, d)?;
        filled.narrow(1, 1, 2)?.fill_(1.5)?;
        filled.narrow(0, 2, 1)?.zero_()?;
        Ok(vec![m, filled])
    })?;
    assert_eq!(out[0].to_vec::<f32>()?, vec![9., 0., 0., 4.5, 0., 0.]);
    let f = out[1].to_vec::<f16>()?;
    assert_eq!(f[1], f16::from_f32(1.5));
    assert_eq!(f[9], f16::ZERO);
    Ok(())
}

#[test]
fn reductions_match_on_both_devices() -> Result<()> {
    let out = on_both(|d| {
        let t = on(d, Tensor::arange(24, DType::F64)?.view(&[2, 3, 4])?)?;
        let tt = t.permute(&[2, 0, 1])?;
        let b = on(d, Tensor::ones(&[300], DType::BF16)?)?;
        let i = on(d, Tensor::from_vec(vec![i32::MAX, 1, -5], &[3])?)?;
        Ok(vec![
            t.sum(1, false)?,
            t.mean(2, true)?,
            t.max(0, false)?,
            tt.sum(2, false)?,
            t.sum_all()?,
            tt.max_all()?,
            b.sum_all()?,
            i.sum(0, false)?,
        ])
    })?;
    assert_eq!(
        out[0].to_vec::<f64>()?,
        vec![12., 15., 18., 21., 48., 51., 54., 57.]
    );
    assert_eq!(out[1].shape(), &[2, 3, 1]);
    assert_eq!(out[4].item::<f64>()?, 276.0);
    assert_eq!(out[5].item::<f64>()?, 23.0);
    assert_eq!(out[6].item::<bf16>()?, bf16::from_f32(300.0));
    Ok(())
}

#[test]
fn copies_and_casts_match_on_both_devices() -> Result<()> {
    let out = on_both(|d| {
        let mut outs = Vec::new();
        let values = Tensor::from_vec(vec![0.0, 1.0, 2.5, -3.0, 100.0], &[5])?;
        for from in DType::ALL {
            let src = on(d, values.to_dtype(from)?)?;
            for to in DType::ALL {
                outs.push(src.to_dtype(to)?);
            }
        }
        let m = on(d, Tensor::arange(12, DType::I64)?.view(&[3, 4])?)?;
        outs.push(m.transpose(0, 1)?.contiguous()?);
        outs.push(m.narrow(1, 1, 2)?.deep_copy()?);
        // Not expressible as a view: reshape copies, on the device.
        outs.push(m.transpose(0, 1)?.reshape(&[12])?);
        let dst = Tensor::zeros_on(&[3, 4], DType::F32, d)?;
        dst.transpose(0, 1)?
            .narrow(0, 2, 1)?
            .copy_from(&m.narrow(1, 0, 1)?.transpose(0, 1)?)?;
        dst.narrow(1, 0, 2)?
            .copy_from(&on(d, Tensor::from_vec(vec![7.0f64, 8.0], &[2])?)?)?;
        outs.push(dst);
        let parts = [&m.narrow(0, 0, 1)?, &m.narrow(0, 2, 1)?, &m];
        outs.push(Tensor::cat(&parts, 0)?);
        // Contiguous copies, which a device does as byte copies and fills in its backend.
        outs.push(m.narrow(0, 1, 2)?.deep_copy()?);
        let flat = Tensor::zeros_on(&[10], DType::I64, d)?;
        flat.narrow(0, 1, 4)?
            .copy_from(&m.narrow(0, 2, 1)?.view(&[4])?)?;
        flat.narrow(0, 6, 4)?.copy_from(&flat.narrow(0, 1, 4)?)?;
        flat.narrow(0, 2, 2)?.zero_()?;
        outs.push(flat);
        // A contiguous copy with a cast into a slot of a flat buffer (mixed precision's
        // copy-in): a cast kernel and a byte copy on a device.
        let slots = Tensor::zeros_on(&[8], DType::BF16, d)?;
        slots
            .narrow(0, 2, 5)?
            .copy_from(&on(d, values.to_dtype(DType::F32)?)?)?;
        outs.push(slots);
        Ok(outs)
    })?;
    let n = DType::ALL.len();
    assert_eq!(
        out[n * n].to_vec::<i64>()?,
        vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    );
    assert_eq!(
        out[n * n + 3].to_vec::<f32>()?,
        vec![7., 8., 0., 0., 7., 8., 4., 0., 7., 8., 8., 0.]
    );
    assert_eq!(out[n * n + 4].shape(), &[5, 4]);
    assert_eq!(out[n * n + 5].to_vec::<i64>()?, (4..12).collect::<Vec<_>>());
    assert_eq!(
        out[n * n + 6].to_vec::<i64>()?,
        vec![0, 8, 0, 0, 11, 0, 8, 9, 10, 11]
    );
    assert_eq!(out[n * n + 7].dtype(), DType::BF16);
    assert_eq!(
        out[n * n + 7].to_f64_vec()?,
        vec![0.0, 0.0, 0.0, 1.0, 2.5, -3.0, 100.0, 0.0]
    );
    Ok(())
}

#[test]
fn views_are_layout_only_on_a_device() -> Result<()> {
    let host = Tensor::arange(24, DType::I32)?.view(&[2, 3, 4])?;
    let dev = host.to_device(&EMULATED)?;
    let pairs = [
        (host.narrow(2, 1, 2)?, dev.narrow(2, 1, 2)?),
        (host.transpose(0, 2)?, dev.transpose(0, 2)?),
        (host.reshape(&[6, 4])?, dev.reshape(&[6, 4])?),
        (
            host.narrow(1, 1, 1)?.expand(&[2, 5, 4])?,
            dev.narrow(1, 1, 1)?.expand(&[2, 5, 4])?,
        ),
        (
            host.permute(&[1, 2, 0])?.narrow(0, 1, 2)?,
            dev.permute(&[1, 2, 0])?.narrow(0, 1, 2)?,
        ),
        (host.chunk(2, 2)?[1].clone(), dev.chunk(2, 2)?[1].clone()),
    ];
    for (i, (h, d)) in pairs.iter().enumerate() {
        assert!(d.shares_storage(&dev), "view {i} copied");
        assert_eq!(d.device(), EMULATED);
        assert_eq!(
            (d.shape(), d.strides(), d.offset()),
            (h.shape(), h.strides(), h.offset())
        );
        assert_eq!(
            d.to_host()?.to_vec::<i32>()?,
            h.to_vec::<i32>()?,
            "view {i}"
        );
    }
    Ok(())
}

#[test]
fn round_trips_at_odd_sizes() -> Result<()> {
    let other = Device::Emulated { ordinal: 1 };
    for len in [0usize, 1, 3, 7, 63, 65, 1001] {
        for dtype in [DType::U8, DType::Bool, DType::F16, DType::F64, DType::I32] {
            let host = Tensor::random(
                &[len],
                DType::F64,
                hypershard_tensor::RandomInit::uniform(len as u64, -50.0, 50.0),
            )?
            .to_dtype(dtype)?;
            let dev = host.to_device(&EMULATED)?;
            assert_eq!(dev.device(), EMULATED);
            assert_eq!(
                dev.to_host()?.to_bytes()?,
                host.to_bytes()?,
                "{dtype} x {len}"
            );
            // Device to device is staged through the host.
            let moved = dev.to_device(&other)?;
            assert_eq!(moved.device(), other);
            assert_eq!(
                moved.to_host()?.to_bytes()?,
                host.to_bytes()?,
                "{dtype} x {len}"
            );
            // Already there: the same storage, no copy.
            assert!(dev.to_device(&EMULATED)?.shares_storage(&dev));
            assert!(host.to_host()?.shares_storage(&host));
        }
    }
    // Strided views go up gathered and come back from an offset span.
    let m = Tensor::arange(35, DType::F32)?.view(&[5, 7])?;
    let view = m.narrow(1, 2, 3)?.transpose(0, 1)?;
    let up = view.to_device(&EMULATED)?;
    assert!(up.is_contiguous());
    assert_eq!(up.to_host()?.to_vec::<f32>()?, view.to_vec::<f32>()?);
    let dev = m.to_device(&EMULATED)?;
    let down = dev.narrow(0, 3, 2)?.narrow(1, 5, 2)?;
    assert_eq!(down.to_host()?.to_vec::<f32>()?, vec![26., 27., 33., 34.]);
    Ok(())
}

#[test]
fn mixed_devices_are_typed_errors_naming_both() -> Result<()> {
    let host = Tensor::ones(&[3], DType::F32)?;
    let dev = host.to_device(&EMULATED)?;
    let other = host.to_device(&Device::Emulated { ordinal: 1 })?;
    let mismatch = |r: Result<()>, op: &str, l: Device, rr: Device| match r {
        Err(Error::DeviceMismatch { op: o, lhs, rhs }) => {
            assert_eq!((o, lhs, rhs), (op, l, rr));
        }
        other => panic!("{op}: expected a device mismatch, got {other:?}"),
    };
    mismatch(host.add(&dev).map(drop), "add", Device::Cpu, EMULATED);
    mismatch(dev.mul(&host).map(drop), "mul", EMULATED, Device::Cpu);
    mismatch(
        dev.sub(&other).map(drop),
        "sub",
        EMULATED,
        Device::Emulated { ordinal: 1 },
    );
    mismatch(dev.add_(&host), "add_", EMULATED, Device::Cpu);
    mismatch(host.axpy(1.0, &dev), "axpy", Device::Cpu, EMULATED);
    mismatch(dev.copy_from(&host), "copy_from", EMULATED, Device::Cpu);
    mismatch(
        Tensor::cat(&[&dev, &host], 0).map(drop),
        "copy_from",
        EMULATED,
        Device::Cpu,
    );
    let message = host.add(&dev).expect_err("mixed").to_string();
    assert!(
        message.contains("cpu") && message.contains("emulated:0"),
        "{message}"
    );
    // Nothing was written by the refused in-place ops.
    assert_eq!(dev.to_host()?.to_vec::<f32>()?, vec![1.0; 3]);
    Ok(())
}

#[test]
fn host_reads_of_device_data_are_typed_errors() -> Result<()> {
    let dev = Tensor::from_bools(&[true, false], &[2])?.to_device(&EMULATED)?;
    let f = Tensor::ones(&[1], DType::F32)?.to_device(&EMULATED)?;
    let refused = |r: std::result::Result<(), Error>, op: &str| match r {
        Err(Error::DeviceData { op: o, device }) => assert_eq!((o, device), (op, EMULATED)),
        other => panic!("{op}: expected a host-read error, got {other:?}"),
    };
    refused(dev.to_bools().map(drop), "to_bools");
    refused(dev.to_bytes().map(drop), "to_bytes");
    refused(dev.to_f64_vec().map(drop), "to_f64_vec");
    refused(f.to_vec::<f32>().map(drop), "to_vec");
    refused(f.item::<f32>().map(drop), "item");
    refused(f.item_f64().map(drop), "item_f64");
    refused(f.with_data(|_: &[f32]| ()), "with_data");
    refused(f.with_data_mut(|_: &mut [f32]| ()), "with_data_mut");
    let message = f.to_vec::<f32>().expect_err("device data").to_string();
    assert!(
        message.contains("to_vec") && message.contains("emulated:0"),
        "{message}"
    );
    Ok(())
}

#[test]
fn deferred_tensors_do_not_move() -> Result<()> {
    let meta = hypershard_tensor::deferred_init(|| Tensor::ones(&[4], DType::F32))?;
    assert_eq!(meta.device(), Device::Cpu);
    assert!(matches!(
        meta.to_device(&EMULATED),
        Err(Error::Deferred { op: "to_device" })
    ));
    Ok(())
}

#[test]
fn stream_order_is_checked() -> Result<()> {
    let device = Device::Emulated { ordinal: 10 };
    let side = Stream::new(&device)?;
    let default = device.current_stream();
    assert_eq!(default.id(), 0);
    assert_ne!(side.id(), 0);
    let t = {
        let _scope = side.enter();
        assert_eq!(device.current_stream(), side);
        let t = Tensor::arange(4, DType::F32)?.to_device(&device)?;
        // Same stream: ordered by the stream itself.
        t.scale_(2.0)?;
        t
    };
    assert_eq!(device.current_stream(), default);
    // The default stream reads memory `side` may still be writing: refused, every time.
    match t.to_host() {
        Err(Error::StreamOrder { op, writer, reader }) => {
            assert_eq!((op, writer, reader), ("to_host", side, default));
        }
        other => panic!("expected a stream-order error, got {other:?}"),
    }
    assert!(matches!(
        t.add(&t),
        Err(Error::StreamOrder { op: "add", .. })
    ));
    assert!(matches!(
        t.fill_(0.0),
        Err(Error::StreamOrder { op: "fill_", .. })
    ));
    // A wait orders the default stream after the side stream's work so far.
    default.wait_for(&side)?;
    assert_eq!(t.to_host()?.to_vec::<f32>()?, vec![0., 2., 4., 6.]);
    // A later side-stream write needs a new wait, or a synchronisation.
    {
        let _scope = side.enter();
        t.add_(&Tensor::ones(&[4], DType::F32)?.to_device(&device)?)?;
    }
    assert!(matches!(t.to_host(), Err(Error::StreamOrder { .. })));
    side.synchronize()?;
    assert_eq!(t.to_host()?.to_vec::<f32>()?, vec![1., 3., 5., 7.]);
    Ok(())
}

#[test]
fn stream_misuse_is_typed() -> Result<()> {
    let a = Device::Emulated { ordinal: 11 };
    let b = Device::Emulated { ordinal: 12 };
    let on_a = Stream::new(&a)?;
    let on_b = Stream::new(&b)?;
    assert!(matches!(
        on_a.wait_for(&on_b),
        Err(Error::DeviceMismatch { op: "wait_for", .. })
    ));
    assert!(matches!(
        Stream::new(&Device::Cpu),
        Err(Error::DeviceUnsupported {
            device: Device::Cpu,
            ..
        })
    ));
    // Streams of another device do not change where this device's work goes.
    let _scope = on_b.enter();
    assert_eq!(a.current_stream().id(), 0);
    Ok(())
}

#[test]
fn device_memory_is_tracked_under_its_own_label() -> Result<()> {
    let device = Device::Emulated { ordinal: 13 };
    let tracker = MemoryTracker::new();
    let _scope = tracker.enter();
    let host = Tensor::zeros(&[100], DType::F32)?;
    let before = tracker.stats();
    let dev = host.to_device(&device)?;
    let doubled = dev.add(&dev)?;
    assert_eq!(
        tracker.stats().live_bytes,
        before.live_bytes,
        "no host bytes"
    );
    let stats = tracker.device_stats(&device);
    assert_eq!((stats.live_bytes, stats.allocations), (800, 2));
    drop((dev, doubled));
    let stats = tracker.device_stats(&device);
    assert_eq!((stats.live_bytes, stats.peak_bytes), (0, 800));
    assert_eq!(
        tracker
            .device_stats(&Device::Emulated { ordinal: 14 })
            .allocations,
        0
    );
    assert!(hypershard_tensor::memory::process_device(&device).peak_bytes >= 800);
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_storage_is_typed_without_a_gpu() -> Result<()> {
    let cuda = Device::Cuda { ordinal: 0 };
    let host = Tensor::arange(5, DType::F32)?;
    match host.to_device(&cuda) {
        // No GPU here (the machines that run `cargo test`): a typed error, no panic.
        Err(Error::DeviceFailed { op, device, .. }) => {
            assert_eq!((op, device), ("to_device", cuda));
        }
        Ok(on_gpu) => {
            assert_eq!(on_gpu.device(), cuda);
            assert_eq!(on_gpu.to_host()?.to_vec::<f32>()?, host.to_vec::<f32>()?);
            let copy = on_gpu.narrow(0, 1, 3)?.deep_copy()?;
            copy.narrow(0, 0, 1)?.zero_()?;
            assert_eq!(copy.to_host()?.to_vec::<f32>()?, vec![0.0, 2.0, 3.0]);
            assert!(matches!(
                on_gpu.sum_all(),
                Err(Error::DeviceUnsupported { op: "sum", .. })
            ));
        }
        Err(other) => panic!("expected a typed device error, got {other:?}"),
    }
    Ok(())
}
