//! Property tests of the sharded ops with auto-redistribute: on random meshes and random input
//! layouts every op resolves, and its full tensor equals the op on the full tensors.

use hypershard_dtensor::tensor::Tensor;
use hypershard_dtensor::{DTensor, OpConfig, Placement, ReduceOp};
use proptest::prelude::*;

use crate::common::on_mesh;

fn mesh_shapes() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=3, 1..=2)
}

fn placement(ndim: usize) -> impl Strategy<Value = Placement> {
    prop_oneof![
        Just(Placement::Replicate),
        (0..ndim).prop_map(Placement::Shard),
        Just(Placement::Partial(ReduceOp::Sum)),
    ]
}

/// Exact small values (multiples of 0.5), so sums and products compare exactly.
fn values(shape: &[usize], salt: usize) -> Tensor {
    let numel: usize = shape.iter().product();
    let v: Vec<f64> = (0..numel)
        .map(|i| ((i * 3 + salt) % 7) as f64 * 0.5 - 1.0)
        .collect();
    Tensor::from_vec(v, shape).expect("numel matches")
}

#[derive(Debug, Clone, Copy)]
enum Rhs {
    Same,
    Row,
    Column,
}

#[derive(Debug, Clone)]
struct Case {
    mesh: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    a: Vec<Placement>,
    b: Vec<Placement>,
    c: Vec<Placement>,
    rhs: Rhs,
    reduce_dim: usize,
}

fn cases() -> impl Strategy<Value = Case> {
    mesh_shapes().prop_flat_map(|mesh| {
        let d = mesh.len();
        (
            Just(mesh),
            (0usize..=5, 0usize..=5, 0usize..=5),
            prop::collection::vec(placement(2), d),
            prop::collection::vec(placement(2), d),
            prop::collection::vec(placement(2), d),
            prop_oneof![Just(Rhs::Same), Just(Rhs::Row), Just(Rhs::Column)],
            0usize..2,
        )
            .prop_map(|(mesh, (m, k, n), a, b, c, rhs, reduce_dim)| Case {
                mesh,
                m,
                k,
                n,
                a,
                b,
                c,
                rhs,
                reduce_dim,
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn ops_with_auto_redistribute_match_the_full_ops(case in cases()) {
        let shared = case.clone();
        let out = on_mesh(&case.mesh, &[], move |ctx| {
            let case = &shared;
            let auto = OpConfig::default().with_auto_redistribute(true);
            let fa = values(&[case.m, case.k], 1);
            let fb = values(&[case.k, case.n], 2);
            let a = DTensor::distribute_local(&fa, &ctx.mesh, &case.a)?;
            let b = DTensor::distribute_local(&fb, &ctx.mesh, &case.b)?;
            let product = a.matmul_with(&b, auto)?.full_tensor()?;
            // Elementwise with a broadcast right side of the matching kind.
            let (rhs_shape, rhs_placements): (Vec<usize>, Vec<Placement>) = match case.rhs {
                Rhs::Same => (vec![case.m, case.k], case.c.clone()),
                Rhs::Row => (vec![case.k], case.c.iter().map(|p| match p {
                    Placement::Shard(_) => Placement::Shard(0),
                    other => *other,
                }).collect()),
                Rhs::Column => (vec![case.m, 1], case.c.clone()),
            };
            let fc = values(&rhs_shape, 3);
            let c = DTensor::distribute_local(&fc, &ctx.mesh, &rhs_placements)?;
            let sum = a.add_with(&c, auto)?.full_tensor()?;
            let prod = a.mul_with(&c, auto)?.full_tensor()?;
            let diff = c.sub_with(&a, auto)?.full_tensor()?;
            let reduced = a.sum(case.reduce_dim, false)?.full_tensor()?;
            // A transposed (non-contiguous) local goes through a redistribute.
            let t = a.transpose(0, 1)?.redistribute(&case.c)?.full_tensor()?;
            let checks = [
                (product, reference_matmul(&fa, &fb)),
                (sum, fa.add(&fc)?),
                (prod, fa.mul(&fc)?),
                (diff, fc.sub(&fa)?),
                (reduced, fa.sum(case.reduce_dim, false)?),
                (t, fa.transpose(0, 1)?.contiguous()?),
            ];
            let mut ok = Vec::new();
            for (got, want) in checks {
                ok.push(got.shape() == want.shape() && got.allclose(&want, 0.0, 1e-12)?);
            }
            Ok(ok)
        });
        for rank in out {
            prop_assert!(rank.iter().all(|&ok| ok), "{:?}: {:?}", case, rank);
        }
    }
}

fn reference_matmul(a: &Tensor, b: &Tensor) -> Tensor {
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let (x, y) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| x[i * k + p] * y[p * n + j]).sum();
        }
    }
    Tensor::from_vec(out, &[m, n]).unwrap()
}
