//! The NCCL backend on this machine (`--features nccl`; brings its own main).
//!
//! Always: creating an NCCL communicator returns a communicator or
//! `Error::BackendUnavailable`, never a panic; an absent device is `BackendUnavailable` even
//! where the libraries exist.
//!
//! With `HYPERSHARD_TEST_GPU=1`: the device must be there (else this FAILS, loudly), and the
//! conformance suite runs over NCCL at world 1 (NCCL refuses two ranks of one communicator on
//! one device, and the test machines have one GPU), with host buffers staged through the
//! device, plus device-buffer checks of all-reduce (sum, avg, premul-sum), a fused group,
//! broadcast and copy-on-write sharing. Without the variable the device checks are not asked
//! for: the binary says so and exits 0.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use hypershard_collectives::conformance::{SuiteParams, run_all};
use hypershard_collectives::nccl::{NcclCommunicator, NcclInit, probe};
use hypershard_collectives::{
    Buffer, BufferLocation, CommConfig, Communicator, DType, Error, HostBuffer, MemoryStore,
    ReduceOp, Unavailable,
};
use hypershard_testkit::device::{GPU_ENV, Tally, gpu_asked};

fn init(device: usize) -> NcclInit {
    NcclInit {
        rank: 0,
        size: 1,
        device,
        store: Arc::new(MemoryStore::new()),
        config: CommConfig::default().with_timeout(Duration::from_secs(60)),
    }
}

/// Creating a communicator never panics; a missing device is `BackendUnavailable`.
fn creation_reports_unavailability() -> Result<(), String> {
    let absent = NcclCommunicator::new(init(4096));
    match absent {
        Err(Error::BackendUnavailable {
            backend: "nccl",
            reason,
        }) => {
            if probe().is_ok()
                && !matches!(
                    reason,
                    Unavailable::NoDevice {
                        requested: 4096,
                        ..
                    }
                )
            {
                return Err(format!(
                    "libraries present, so expected NoDevice, got {reason:?}"
                ));
            }
        }
        Err(other) => {
            return Err(format!(
                "device 4096: expected BackendUnavailable, got {other}"
            ));
        }
        Ok(_) => return Err("device 4096 exists?".to_string()),
    }
    match (probe(), NcclCommunicator::new(init(0))) {
        (Err(_), Err(Error::BackendUnavailable { .. })) | (Ok(()), _) => Ok(()),
        (Err(_), Err(other)) => Err(format!("libraries missing, yet got {other}")),
        (Err(_), Ok(_)) => Err("libraries missing, yet a communicator was made".to_string()),
    }
}

fn device_values(comm: &NcclCommunicator, values: &[f32]) -> Result<Buffer, String> {
    comm.upload(&HostBuffer::from_slice(values))
        .map_err(|e| e.to_string())
}

fn host_values(buffer: &Buffer) -> Result<Vec<f32>, String> {
    buffer
        .to_host()
        .and_then(|host| host.into_vec::<f32>())
        .map_err(|e| e.to_string())
}

fn expect_values(what: &str, got: Vec<f32>, expected: &[f32]) -> Result<(), String> {
    if got == expected {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {expected:?}"))
    }
}

fn device_buffers(comm: &NcclCommunicator) -> Result<(), String> {
    let values: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
    let buffer = device_values(comm, &values)?;
    if buffer.location()
        != (BufferLocation::Cuda {
            device: comm.device(),
        })
    {
        return Err(format!("location {}", buffer.location()));
    }
    // World 1: sum and avg are the identity, premul-sum scales by its factor.
    let summed = comm
        .all_reduce(buffer, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    expect_values("sum", host_values(&summed)?, &values)?;
    let averaged = comm
        .all_reduce(summed, ReduceOp::Avg)
        .map_err(|e| e.to_string())?;
    expect_values("avg", host_values(&averaged)?, &values)?;
    let scaled = comm
        .all_reduce(averaged, ReduceOp::PreMulSum(0.5))
        .map_err(|e| e.to_string())?;
    let halves: Vec<f32> = values.iter().map(|v| v * 0.5).collect();
    expect_values("premul_sum(0.5)", host_values(&scaled)?, &halves)?;
    // Copy-on-write: an op on a shared handle leaves the other handle's memory alone.
    let kept = scaled.clone();
    let doubled = comm
        .all_reduce(scaled, ReduceOp::PreMulSum(2.0))
        .map_err(|e| e.to_string())?;
    expect_values("shared original", host_values(&kept)?, &halves)?;
    expect_values("premul_sum(2)", host_values(&doubled)?, &values)?;
    let broadcast = comm.broadcast(doubled, 0).map_err(|e| e.to_string())?;
    expect_values("broadcast", host_values(&broadcast)?, &values)
}

fn fused_group(comm: &NcclCommunicator) -> Result<(), String> {
    let inputs: Vec<Vec<f32>> = (0..3).map(|k| vec![k as f32 + 1.0; 257]).collect();
    let buffers: Vec<Buffer> = inputs
        .iter()
        .map(|v| device_values(comm, v))
        .collect::<Result<_, _>>()?;
    let works = comm.group(|comm| {
        buffers
            .into_iter()
            .map(|b| comm.all_reduce_async(b, ReduceOp::PreMulSum(3.0)))
            .collect::<Vec<_>>()
    });
    for (k, work) in works.into_iter().enumerate() {
        let out = work.wait().map_err(|e| e.to_string())?;
        expect_values(
            "fused premul",
            host_values(&out)?,
            &vec![3.0 * (k as f32 + 1.0); 257],
        )?;
    }
    Ok(())
}

fn conformance(comm: &NcclCommunicator) -> Result<(), String> {
    let mut params = SuiteParams::new(1 << 20);
    params.dtypes = DType::ALL.to_vec();
    let report = run_all(comm, &params).map_err(|e| e.to_string())?;
    println!(
        "nccl_gpu: conformance ran {} cases at world 1",
        report.cases
    );
    Ok(())
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    tally.check(
        "creation_reports_unavailability",
        creation_reports_unavailability(),
    );
    let asked = gpu_asked();
    if !asked {
        println!("nccl_gpu: {GPU_ENV}=1 is not set, so the device tests were not asked for");
    } else {
        match NcclCommunicator::new(init(0)) {
            Ok(comm) => {
                tally.check("device_buffers", device_buffers(&comm));
                tally.check("fused_group", fused_group(&comm));
                tally.check("conformance_world_1", conformance(&comm));
            }
            Err(error) => {
                eprintln!(
                    "nccl_gpu: {GPU_ENV}=1 asks for the GPU tests, but no NCCL device is usable: {error}"
                );
                tally.check("gpu_available", Err(error.to_string()));
            }
        }
    }
    tally.finish()
}
