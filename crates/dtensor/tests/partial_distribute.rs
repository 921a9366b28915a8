//! `distribute_tensor` to `Partial(op)`: coordinate 0 holds the value, the other ranks the
//! op's identity (sum: 0, product: 1); avg, max and min give every rank the value. The
//! reduced tensor is the value, exactly, in every dtype (the crate README says how this
//! differs from PyTorch's even split).

use std::time::Duration;

use hypershard_dtensor::{
    DTensor, DType, Placement, ReduceOp, Tensor, distribute_tensor, init_process_mesh, run_local,
};

/// Rank r's input: a formula of (r, i), so only coordinate 0's values may survive.
fn input(rank: usize, dtype: DType) -> Tensor {
    let values: Vec<f64> = (0..7).map(|i| (10 * rank + i) as f64 + 0.25).collect();
    Tensor::from_vec(values, &[7])
        .and_then(|t| t.to_dtype(dtype))
        .expect("invariant: valid input")
}

#[test]
fn partials_put_the_value_at_coordinate_zero_and_the_identity_elsewhere() {
    for dtype in [DType::F32, DType::F64, DType::I64] {
        for (op, others) in [
            (ReduceOp::Sum, Some(0.0)),
            (ReduceOp::Product, Some(1.0)),
            (ReduceOp::Avg, None),
            (ReduceOp::Max, None),
            (ReduceOp::Min, None),
        ] {
            let run = run_local(3, Duration::from_secs(60), move |world| {
                let rank = world.rank();
                let mesh = init_process_mesh(world, &[3], &["dp"])?;
                let full = input(rank, dtype);
                let partial: DTensor = distribute_tensor(&full, &mesh, &[Placement::Partial(op)])?;
                let local = partial.to_local().to_f64_vec()?;
                let reduced = partial.full_tensor()?.to_bytes()?;
                Ok((rank, local, reduced))
            });
            if dtype == DType::I64 && op == ReduceOp::Avg {
                // An integer mean is not defined here: a typed error, not a truncated value.
                let message = run.err().map(|e| e.to_string()).unwrap_or_default();
                assert!(message.contains("avg"), "{message}");
                continue;
            }
            let out = run.unwrap_or_else(|e| panic!("{dtype} {op:?}: {e}"));
            let value = input(0, dtype);
            for (rank, local, reduced) in out {
                let expected = match (rank, others) {
                    (0, _) | (_, None) => value.to_f64_vec().expect("values"),
                    (_, Some(identity)) => vec![identity; 7],
                };
                assert_eq!(local, expected, "{dtype} {op:?} rank {rank}");
                assert_eq!(
                    reduced,
                    value.to_bytes().expect("bytes"),
                    "{dtype} {op:?}: the reduced tensor is exactly rank 0's value"
                );
            }
        }
    }
}
