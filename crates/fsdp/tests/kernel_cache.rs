//! After the last backward of a step the root frees its idle communication buffers (by
//! default) but leaves nn's cached kernel outputs alone: the next step reuses those without
//! faulting them in again. `release_cached_buffers` frees both on demand.
//!
//! nn's kernel-output cache is process-wide, so this binary holds this one test only (no other
//! test can fill or empty the cache while it reads it), and the two ranks, threads of this
//! process sharing that cache, meet at barriers around every reading.

mod common;

use common::*;
use hypershard_fsdp::FullyShardConfig;
use hypershard_nn::{cached_kernel_buffer_bytes, mse_loss};
use hypershard_tensor::DType;

/// Wide enough that each layer's unsharded weight gradient (160 × 160 f32, 100 KiB) is above
/// nn's smallest recycled size (64 KiB).
const WIDTH: usize = 160;

#[test]
fn the_post_backward_release_frees_comm_buffers_and_keeps_kernel_outputs() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("local world");
    let stats = hypershard_testkit::run_ranks(2, move |rank| {
        let comm = comms[rank].clone();
        let mesh = dp_mesh(&[2], comm.clone())?;
        let dims = [WIDTH; 4];
        let mut model = shard_model(mlp(&dims, DType::F32), &FullyShardConfig::new(mesh.clone()))?;
        let mut seen = Vec::new();
        for step in 0..2 {
            let (x, y) = batch(step, WIDTH, WIDTH, DType::F32);
            let x = local_rows(&x, mesh.rank(), mesh.world().size());
            let y = local_rows(&y, mesh.rank(), mesh.world().size());
            let output = model.forward(&x)?;
            model.backward(&mse_loss(&output, &y)?.grad)?;
            // Released by default: no idle communication buffer, kernel outputs kept.
            comm.barrier()?;
            seen.push((
                mesh.comm_buffer_stats().cached_bytes,
                cached_kernel_buffer_bytes(),
            ));
            comm.barrier()?;
            model.zero_grad()?;
        }
        model.release_cached_buffers();
        comm.barrier()?;
        seen.push((
            mesh.comm_buffer_stats().cached_bytes,
            cached_kernel_buffer_bytes(),
        ));
        Ok::<_, hypershard_fsdp::FsdpError>(seen)
    })
    .unwrap_or_else(|e| panic!("sharded run failed: {e}"));
    for (rank, seen) in stats.into_iter().enumerate() {
        for &(comm, kernel) in &seen[..2] {
            assert_eq!(comm, 0, "rank {rank}: {seen:?}");
            assert!(kernel > 0, "rank {rank}: {seen:?}");
        }
        assert_eq!(seen[2], (0, 0), "rank {rank}: {seen:?}");
    }
}
