//! FSDP's communication buffers come from the process mesh's pool: while idle it never holds
//! more than its cap, and once a step has run, repeating it allocates nothing new where the
//! step's buffers fit under the cap (and never more than the step before where they do not).

mod common;

use common::*;
use hypershard_fsdp::FullyShardConfig;
use hypershard_nn::mse_loss;
use hypershard_tensor::{DType, Device};

const STEPS: usize = 4;
const MICRO: usize = 3;

/// Per step: buffers allocated during the first micro-batch, during the later ones, and
/// whether the idle pool stayed under its cap at every check.
type Allocations = Vec<(usize, usize, bool)>;

fn allocations(
    mesh_shape: &[usize],
    dims: [usize; 4],
    device: Device,
    release: bool,
) -> Vec<Allocations> {
    let world: usize = mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    let mesh_shape = mesh_shape.to_vec();
    hypershard_testkit::run_ranks(world, move |rank| {
        let mesh = dp_mesh(&mesh_shape, comms[rank].clone())?;
        let config = FullyShardConfig::new(mesh.clone());
        let device = rank_device(device, rank);
        let mut model = shard_model(moved(mlp(&dims, DType::F32), device), &config)?;
        model.set_release_buffers_after_backward(release);
        let mut optimizer = Optimizer::new(Opt::Sgd);
        let pool = mesh.process_mesh().buffer_pool().clone();
        let (dp_rank, dp_world) = (mesh.rank(), mesh.world().size());
        let mut out = Allocations::new();
        for step in 0..STEPS {
            let start = pool.stats().misses;
            let mut first = 0;
            let mut capped = true;
            for m in 0..MICRO {
                model.set_is_last_backward(m + 1 == MICRO);
                let (x, y) = batch(step * MICRO + m, dims[0], dims[3], DType::F32);
                let x = on(&local_rows(&x, dp_rank, dp_world), device);
                let y = on(&local_rows(&y, dp_rank, dp_world), device);
                let output = model.forward(&x)?;
                let loss = mse_loss(&output, &y)?;
                model.backward(&loss.grad)?;
                let stats = pool.stats();
                capped &= stats.cached_bytes <= stats.idle_cap_bytes;
                if m == 0 {
                    first = stats.misses - start;
                }
            }
            optimizer.step(&mut model)?;
            model.zero_grad()?;
            let stats = pool.stats();
            capped &= stats.cached_bytes <= stats.idle_cap_bytes;
            out.push((first, stats.misses - start - first, capped));
        }
        Ok::<_, hypershard_fsdp::FsdpError>(out)
    })
    .unwrap_or_else(|e| panic!("sharded run failed: {e}"))
}

/// On a device the pool holds the host staging buffers of the collectives, recycled alike.
fn check(mesh_shape: &[usize]) {
    for device in DEVICES {
        check_on(mesh_shape, device);
    }
}

fn check_on(mesh_shape: &[usize], device: Device) {
    // Three like units (8 -> 8 Linear layers), as a transformer's blocks: their buffers share
    // sizes, so the step's buffers fit under the cap.
    for (rank, steps) in allocations(mesh_shape, [8, 8, 8, 8], device, true)
        .into_iter()
        .enumerate()
    {
        let context = format!("mesh {mesh_shape:?} on {device:?}, rank {rank}: {steps:?}");
        assert!(steps.iter().all(|&(_, _, capped)| capped), "{context}");
        assert!(steps[0].0 > 0, "{context}");
        if device != Device::Cpu {
            // On a device the pool holds only the collectives' host staging buffers (the
            // unsharded parameters and new gradients are device memory). Its idle cap, a
            // multiple of its largest request, is then below a step's staging buffers for
            // units this small, so it frees the oldest and allocates them again: the same
            // number every step, never more.
            assert!(steps[1..].iter().all(|&step| step == steps[1]), "{context}");
            continue;
        }
        // The first micro-batch of the first step allocates its buffers; the micro-batches
        // after it, in every step, find them all in the pool.
        assert!(steps.iter().all(|&(_, later, _)| later == 0), "{context}");
        // The end of every step's last backward frees the cache (the memory goes back before
        // the optimizer step; the gradients handed back by zero_grad stay); each later step
        // refills it alike, with less than the first.
        let refill = steps[1].0;
        assert!(refill < steps[0].0, "{context}");
        assert!(
            steps[1..].iter().all(|&(first, _, _)| first == refill),
            "{context}"
        );
    }
    // Units of three different shapes: keeping every size would hold the whole unsharded
    // model idle, so the cap frees the oldest buffers and they are allocated again. The pool
    // stays under its cap and every step allocates as many as the one before: no growth.
    for (rank, steps) in allocations(mesh_shape, [6, 10, 7, 3], device, true)
        .into_iter()
        .enumerate()
    {
        let context = format!("mesh {mesh_shape:?} on {device:?}, rank {rank}: {steps:?}");
        assert!(steps.iter().all(|&(_, _, capped)| capped), "{context}");
        assert!(steps[1..].iter().all(|&step| step == steps[1]), "{context}");
    }
}

/// With the buffers kept after backward, every step after the first allocates nothing at
/// all, the pool still within its cap; `release_cached_buffers` empties it on demand.
fn check_kept(mesh_shape: &[usize]) {
    for (rank, steps) in allocations(mesh_shape, [8, 8, 8, 8], Device::Cpu, false)
        .into_iter()
        .enumerate()
    {
        let context = format!("mesh {mesh_shape:?}, rank {rank}: {steps:?}");
        assert!(steps.iter().all(|&(_, _, capped)| capped), "{context}");
        assert!(steps[0].0 > 0, "{context}");
        assert!(
            steps[1..]
                .iter()
                .all(|&(first, later, _)| first == 0 && later == 0),
            "{context}"
        );
    }
    let world: usize = mesh_shape.iter().product();
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    let mesh_shape = mesh_shape.to_vec();
    let freed = hypershard_testkit::run_ranks(world, move |rank| {
        let mesh = dp_mesh(&mesh_shape, comms[rank].clone())?;
        let mut model = shard_model(
            mlp(&[8, 8, 8, 8], DType::F32),
            &FullyShardConfig::new(mesh.clone()),
        )?;
        model.set_release_buffers_after_backward(false);
        let (x, y) = batch(0, 8, 8, DType::F32);
        let x = local_rows(&x, mesh.rank(), mesh.world().size());
        let y = local_rows(&y, mesh.rank(), mesh.world().size());
        let output = model.forward(&x)?;
        model.backward(&mse_loss(&output, &y)?.grad)?;
        let cached = mesh.comm_buffer_stats().cached_bytes;
        let freed = model.release_cached_buffers();
        Ok::<_, hypershard_fsdp::FsdpError>((cached, freed, mesh.comm_buffer_stats().cached_bytes))
    })
    .unwrap_or_else(|e| panic!("sharded run failed: {e}"));
    for (rank, (cached, freed, after)) in freed.into_iter().enumerate() {
        assert!(
            cached > 0 && freed == cached && after == 0,
            "rank {rank}: {cached} {freed} {after}"
        );
    }
}

#[test]
fn kept_buffers_make_every_later_step_allocation_free() {
    check_kept(&[2]);
    check_kept(&[3]);
    check_kept(&[2, 2]);
}

#[test]
fn fsdp_steps_after_warm_up_allocate_nothing_new_and_the_idle_pool_stays_capped() {
    check(&[2]);
    check(&[3]);
    check(&[2, 2]);
}
