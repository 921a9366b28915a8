//! `fully_shard` on CUDA over NCCL, where a unit's collectives run on its device memory
//! (`--features cuda`; brings its own main).
//!
//! Always: the binary says what it ran, and without a GPU it asks for none of it.
//!
//! With `HYPERSHARD_TEST_GPU=1` (`cargo xtask gpu-check`) a GPU must be there, else this FAILS:
//! 1. The hand-over of the device route on one GPU: a CUDA tensor last written by a kernel on
//!    the tensor crate's stream becomes an NCCL buffer without a copy, runs through all-reduce,
//!    all-gather and reduce-scatter on NCCL's own stream (a world of one rank), and comes back
//!    as a tensor that the tensor crate's stream reads next. The values are a closed form, so
//!    a missing wait between the two streams shows as wrong values.
//! 2. With two GPUs or more: the reference MLP trained with AdamW under FSDP (mesh `[2]`) and
//!    HSDP (`[2, 1]`) over NCCL, one rank per GPU, against the unsharded host run. NCCL refuses
//!    two ranks of one communicator on one GPU, so a one-GPU machine cannot run this part; the
//!    binary says so on its own line.

mod common;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hypershard_collectives::nccl::{DeviceBuffer, NcclCommunicator, NcclInit, device_count};
use hypershard_collectives::{Buffer, CommConfig, Communicator, MemoryStore, ReduceOp, Store};
use hypershard_fsdp::{FsdpModule, FullyShardConfig};
use hypershard_tensor::cuda::{into_cuda_bytes, tensor_from_cuda_bytes};
use hypershard_tensor::{DType, Device, Tensor};
use hypershard_testkit::device::{GPU_ENV, Outcome, Tally, contained, fail, gpu_asked};

const DIMS: [usize; 4] = [5, 3, 7, 2];
const TOL: f64 = 1e-5;

fn config() -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_secs(60))
}

/// f(i) = (i mod 13) − 6, exact in every float dtype.
fn f(i: usize) -> f32 {
    (i % 13) as f32 - 6.0
}

/// A tensor's bytes as an NCCL buffer (no copy when nothing else holds them).
fn to_buffer(t: Tensor) -> Result<Buffer, String> {
    let bytes = into_cuda_bytes(t, "cuda_nccl test").map_err(fail)?;
    Ok(Buffer::Cuda(
        DeviceBuffer::from_slice(bytes, hypershard_collectives::DType::F32).map_err(fail)?,
    ))
}

/// An NCCL buffer back as a tensor of `shape`.
fn to_tensor(buffer: Buffer, shape: &[usize]) -> Result<Tensor, String> {
    let Buffer::Cuda(memory) = buffer else {
        return Err("the collective returned host memory".to_string());
    };
    let bytes = memory.into_slice().map_err(fail)?;
    tensor_from_cuda_bytes(bytes, shape, DType::F32, "cuda_nccl test").map_err(fail)
}

fn expect_values(what: &str, t: &Tensor, want: impl Fn(usize) -> f32) -> Outcome {
    let got = t.to_host().and_then(|h| h.to_vec::<f32>()).map_err(fail)?;
    match (0..got.len()).find(|&i| got[i] != want(i)) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {}, expected {}",
            got[i],
            want(i)
        )),
    }
}

/// Part 1: tensor → NCCL buffer → collective → tensor, at world 1, across the two streams.
fn hand_over_between_the_tensor_and_nccl_streams() -> Outcome {
    let comm = NcclCommunicator::new(NcclInit {
        rank: 0,
        size: 1,
        device: 0,
        store: Arc::new(MemoryStore::new()),
        config: config(),
    })
    .map_err(fail)?;
    let gpu = Device::Cuda { ordinal: 0 };
    let n = 1 << 20;
    let values: Vec<f32> = (0..n).map(f).collect();
    for round in 0..3 {
        // The last write before the hand-over is a kernel on the tensor crate's stream.
        let t = Tensor::from_vec(values.clone(), &[n])
            .and_then(|t| t.to_device(&gpu))
            .map_err(fail)?;
        t.scale_(2.0).map_err(fail)?;
        let reduced = comm
            .all_reduce(to_buffer(t)?, ReduceOp::Sum)
            .map_err(fail)?;
        let back = to_tensor(reduced, &[n])?;
        // The next kernel on the tensor stream reads what NCCL's stream wrote.
        back.scale_(0.5).map_err(fail)?;
        expect_values(&format!("all_reduce round {round}"), &back, f)?;
        // An output made the way the route makes it: device zeros, handed over.
        let output = to_buffer(Tensor::zeros_on(&[n], DType::F32, &gpu).map_err(fail)?)?;
        let pair = comm.all_gather(to_buffer(back)?, output).map_err(fail)?;
        let gathered = to_tensor(pair.output, &[n])?;
        gathered
            .add_(&gathered.deep_copy().map_err(fail)?)
            .map_err(fail)?;
        expect_values("all_gather", &gathered, |i| 2.0 * f(i))?;
        let output = to_buffer(Tensor::zeros_on(&[n], DType::F32, &gpu).map_err(fail)?)?;
        let pair = comm
            .reduce_scatter(to_buffer(gathered)?, output, ReduceOp::Avg)
            .map_err(fail)?;
        expect_values("reduce_scatter", &to_tensor(pair.output, &[n])?, |i| {
            2.0 * f(i)
        })?;
    }
    Ok(())
}

/// Part 2: the MLP under FSDP/HSDP over NCCL, one rank per GPU, against the host reference.
fn fully_shard_over_nccl_matches_unsharded(mesh_shape: &[usize]) -> Outcome {
    let world: usize = mesh_shape.iter().product();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let comms = hypershard_testkit::run_ranks(world, move |rank| {
        NcclCommunicator::new(NcclInit {
            rank,
            size: world,
            device: rank,
            store: store.clone(),
            config: config(),
        })
        .map(|comm| Arc::new(comm) as Arc<dyn Communicator>)
    })
    .map_err(fail)?;
    let run = Arc::new(Run {
        dims: DIMS.to_vec(),
        dtype: DType::F32,
        opt: Opt::AdamW,
        steps: 3,
        micro: 2,
        mesh_shape: mesh_shape.to_vec(),
    });
    let configure: Arc<Configure> = Arc::new(|_: &mut FullyShardConfig| {});
    let hook: Arc<MicroHook> = Arc::new(|_: &mut FsdpModule, _, _| {});
    let results = {
        let run = run.clone();
        hypershard_testkit::run_ranks(world, move |rank| {
            train_rank_on(
                &run,
                comms[rank].clone(),
                Device::Cuda { ordinal: 0 },
                configure.as_ref(),
                hook.as_ref(),
            )
        })
        .map_err(fail)?
    };
    let want = reference(&DIMS, DType::F32, Opt::AdamW, 3, 2);
    let got = assemble(&results, &dim0, &none);
    let err = max_rel_err(&got, &want);
    if err <= TOL {
        Ok(())
    } else {
        Err(format!("mesh {mesh_shape:?}: max rel err {err} > {TOL}"))
    }
}

fn main() -> ExitCode {
    let mut tally = Tally::default();
    let asked = gpu_asked();
    let gpus = match device_count() {
        Ok(gpus) => gpus,
        Err(error) if asked => {
            tally.check("gpu_available", Err(error.to_string()));
            return tally.finish();
        }
        Err(error) => {
            println!(
                "cuda_nccl: {GPU_ENV}=1 is not set and NCCL is unavailable ({error}); nothing ran"
            );
            return tally.finish();
        }
    };
    if gpus == 0 {
        if asked {
            tally.check("gpu_available", Err("the driver reports no GPU".into()));
        } else {
            println!("cuda_nccl: {GPU_ENV}=1 is not set and there is no GPU; nothing ran");
        }
        return tally.finish();
    }
    tally.check(
        "hand_over_between_the_tensor_and_nccl_streams",
        contained(hand_over_between_the_tensor_and_nccl_streams),
    );
    if gpus >= 2 {
        for mesh in [vec![2], vec![2, 1]] {
            tally.check(
                &format!("fully_shard_over_nccl_matches_unsharded {mesh:?}"),
                contained(|| fully_shard_over_nccl_matches_unsharded(&mesh)),
            );
        }
    } else {
        println!(
            "cuda_nccl: one GPU, so FSDP over NCCL at world 2 cannot run here (NCCL needs a GPU per rank)"
        );
    }
    tally.finish()
}
