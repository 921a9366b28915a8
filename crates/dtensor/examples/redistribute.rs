//! Every move between `Shard`, `Replicate` and `Partial` on a 2×2 mesh, each checked against
//! the full tensor. Run: `cargo run -p hypershard-dtensor --example redistribute`.

use std::time::Duration;

use hypershard_dtensor::{
    DTensor, DType, Placement, ReduceOp, Tensor, init_process_mesh, run_local,
};

fn main() -> Result<(), hypershard_dtensor::Error> {
    let layouts = [
        [Placement::Shard(0), Placement::Shard(1)],
        [Placement::Replicate, Placement::Shard(0)],
        [Placement::Shard(1), Placement::Replicate],
        [Placement::Partial(ReduceOp::Sum), Placement::Shard(0)],
        [Placement::Replicate, Placement::Replicate],
    ];
    let report = run_local(4, Duration::from_secs(60), move |world| {
        let mesh = init_process_mesh(world, &[2, 2], &["dp", "tp"])?;
        // 5×3 does not divide by 2: uneven shards on both dims.
        let full = Tensor::arange(15, DType::F64)?.view(&[5, 3])?;
        let mut lines = Vec::new();
        for from in &layouts {
            let source = DTensor::distribute_local(&full, &mesh, from)?;
            for to in &layouts {
                let moved = source.redistribute(to)?;
                let ok = moved.full_tensor()?.to_vec::<f64>()? == full.to_vec::<f64>()?;
                lines.push(format!(
                    "{from:?} -> {to:?}: {}",
                    if ok { "ok" } else { "WRONG" }
                ));
            }
        }
        Ok(lines)
    })?;
    for line in &report[0] {
        println!("{line}");
    }
    let wrong = report
        .iter()
        .flatten()
        .filter(|l| l.ends_with("WRONG"))
        .count();
    println!(
        "{} moves checked on 4 ranks, {wrong} wrong",
        report[0].len()
    );
    Ok(())
}
