//! `distribute_tensor` from rank 0's data, and factories whose values do not depend on the
//! mesh. Run: `cargo run -p hypershard-dtensor --example distribute`.

use std::time::Duration;

use hypershard_dtensor::tensor::RandomInit;
use hypershard_dtensor::{
    DTensor, DType, Placement, Tensor, distribute_tensor, init_process_mesh, run_local,
};

fn main() -> Result<(), hypershard_dtensor::Error> {
    let lines = run_local(3, Duration::from_secs(60), |world| {
        let rank = world.rank();
        let mesh = init_process_mesh(world, &[3], &["dp"])?;
        // Only rank 0's values count: the others pass a tensor of the same shape.
        let data = Tensor::full(&[7, 2], rank as f64, DType::F32)?;
        let rows = distribute_tensor(&data, &mesh, &[Placement::Shard(0)])?;
        // A random tensor drawn by global index: the same values on any mesh or layout.
        let init = RandomInit::normal(7, 0.0, 1.0);
        let random = DTensor::rand(&mesh, &[7, 2], DType::F32, init, &[Placement::Shard(0)])?;
        let same = random.full_tensor()?.to_vec::<f32>()?
            == Tensor::random(&[7, 2], DType::F32, init)?.to_vec::<f32>()?;
        Ok(format!(
            "rank {rank}: {} rows of rank 0's data {:?}; random tensor equals the unsharded one: {same}",
            rows.to_local().shape()[0],
            rows.to_local().to_vec::<f32>()?,
        ))
    })?;
    for line in lines {
        println!("{line}");
    }
    Ok(())
}
