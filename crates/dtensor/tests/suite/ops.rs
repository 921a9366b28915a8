//! Sharded ops: the sharded result's full tensor equals the op on the full tensors, the output
//! placements follow the propagation rules, and unsupported layouts are typed errors unless
//! auto-redistribute is asked for.

use hypershard_dtensor::collectives::OpKind;
use hypershard_dtensor::tensor::Tensor;
use hypershard_dtensor::{DTensor, Error, OpConfig, Placement, ReduceOp};

use crate::common::{F64, Snapshot, on_mesh};

const R: Placement = Placement::Replicate;
const S0: Placement = Placement::Shard(0);
const S1: Placement = Placement::Shard(1);
const S2: Placement = Placement::Shard(2);
const PSUM: Placement = Placement::Partial(ReduceOp::Sum);

/// A full test tensor with values that differ per element and per `salt`.
fn values(shape: &[usize], salt: f64) -> Tensor {
    let numel: usize = shape.iter().product();
    let v: Vec<f64> = (0..numel)
        .map(|i| (i as f64 * 0.5 + salt) % 7.0 - 3.0)
        .collect();
    Tensor::from_vec(v, shape).expect("numel matches")
}

/// The reference batched matmul on full tensors (last two dims; batch from either side).
fn reference_matmul(a: &Tensor, b: &Tensor) -> Tensor {
    let (ar, br) = (a.ndim() - 2, b.ndim() - 2);
    let (m, k, n) = (a.shape()[ar], a.shape()[ar + 1], b.shape()[br + 1]);
    let batch: Vec<usize> = if ar >= br {
        a.shape()[..ar].to_vec()
    } else {
        b.shape()[..br].to_vec()
    };
    let batches: usize = batch.iter().product();
    let (x, y) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
    let mut out = vec![0.0; batches * m * n];
    for t in 0..batches {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for p in 0..k {
                    let xa = if ar == 0 {
                        x[i * k + p]
                    } else {
                        x[t * m * k + i * k + p]
                    };
                    let yb = if br == 0 {
                        y[p * n + j]
                    } else {
                        y[t * k * n + p * n + j]
                    };
                    acc += xa * yb;
                }
                out[t * m * n + i * n + j] = acc;
            }
        }
    }
    let mut shape = batch;
    shape.extend([m, n]);
    Tensor::from_vec(out, &shape).unwrap()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Add,
    Sub,
    Mul,
    Matmul,
}

struct BinaryCase {
    mesh: &'static [usize],
    a: (&'static [usize], &'static [Placement]),
    b: (&'static [usize], &'static [Placement]),
    op: Op,
    auto: bool,
}

/// Runs a binary op on every rank; returns per rank the output placements (or the error's
/// name), whether the full tensor matched the reference, and the collectives issued.
fn run_binary(case: BinaryCase) -> Vec<(Result<Vec<Placement>, String>, bool, u64)> {
    let BinaryCase {
        mesh,
        a,
        b,
        op,
        auto,
    } = case;
    on_mesh(mesh, &[], move |ctx| {
        let (fa, fb) = (values(a.0, 0.0), values(b.0, 3.0));
        let x = DTensor::distribute_local(&fa, &ctx.mesh, a.1)?;
        let y = DTensor::distribute_local(&fb, &ctx.mesh, b.1)?;
        let config = OpConfig::default().with_auto_redistribute(auto);
        ctx.reset();
        let result = match op {
            Op::Add => x.add_with(&y, config),
            Op::Sub => x.sub_with(&y, config),
            Op::Mul => x.mul_with(&y, config),
            Op::Matmul => x.matmul_with(&y, config),
        };
        let collectives: u64 = ctx.counts().values().sum();
        let z = match result {
            Ok(z) => z,
            Err(Error::UnsupportedSharding { .. }) => {
                return Ok((Err("unsupported".to_string()), true, collectives));
            }
            Err(e) => return Err(e),
        };
        let reference = match op {
            Op::Add => fa.add(&fb)?,
            Op::Sub => fa.sub(&fb)?,
            Op::Mul => fa.mul(&fb)?,
            Op::Matmul => reference_matmul(&fa, &fb),
        };
        let got = z.full_tensor()?;
        let close = got.shape() == reference.shape() && got.allclose(&reference, 1e-12, 1e-12)?;
        Ok((Ok(z.placements().to_vec()), close, collectives))
    })
}

fn expect(case: BinaryCase, placements: &[Placement], collectives: u64) {
    for (got, close, issued) in run_binary(case) {
        assert_eq!(got, Ok(placements.to_vec()));
        assert!(close, "full tensor differs from the reference");
        assert_eq!(issued, collectives, "collectives issued by the op");
    }
}

fn expect_unsupported(case: BinaryCase) {
    for (got, _, issued) in run_binary(case) {
        assert_eq!(got, Err("unsupported".to_string()));
        assert_eq!(issued, 0);
    }
}

#[test]
fn elementwise_rules_with_broadcasting() {
    // Uneven rows (5 over 2) and a broadcast row vector.
    let mesh: &[usize] = &[2];
    for op in [Op::Add, Op::Sub, Op::Mul] {
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[S0]),
                b: (&[5, 3], &[S0]),
                op,
                auto: false,
            },
            &[S0],
            0,
        );
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[S0]),
                b: (&[1, 3], &[R]),
                op,
                auto: false,
            },
            &[S0],
            0,
        );
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[S0]),
                b: (&[3], &[R]),
                op,
                auto: false,
            },
            &[S0],
            0,
        );
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 1], &[R]),
                b: (&[5, 3], &[S1]),
                op,
                auto: false,
            },
            &[S1],
            0,
        );
        expect_unsupported(BinaryCase {
            mesh,
            a: (&[3], &[R]),
            b: (&[5, 3], &[S1]),
            op,
            auto: false,
        });
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[R]),
                b: (&[5, 3], &[R]),
                op,
                auto: false,
            },
            &[R],
            0,
        );
        // A full-extent replica against a shard has no rule; auto chunks it locally.
        expect_unsupported(BinaryCase {
            mesh,
            a: (&[5, 3], &[S0]),
            b: (&[5, 3], &[R]),
            op,
            auto: false,
        });
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[S0]),
                b: (&[5, 3], &[R]),
                op,
                auto: true,
            },
            &[S0],
            0,
        );
        // Shards of different dims: auto moves the right side with one all-to-all.
        expect(
            BinaryCase {
                mesh,
                a: (&[5, 3], &[S0]),
                b: (&[5, 3], &[S1]),
                op,
                auto: true,
            },
            &[S0],
            1,
        );
    }
    expect(
        BinaryCase {
            mesh,
            a: (&[4, 3], &[PSUM]),
            b: (&[4, 3], &[PSUM]),
            op: Op::Add,
            auto: false,
        },
        &[PSUM],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[4, 3], &[PSUM]),
            b: (&[3], &[R]),
            op: Op::Mul,
            auto: false,
        },
        &[PSUM],
        0,
    );
    expect_unsupported(BinaryCase {
        mesh,
        a: (&[4, 3], &[PSUM]),
        b: (&[4, 3], &[PSUM]),
        op: Op::Mul,
        auto: false,
    });
    expect_unsupported(BinaryCase {
        mesh,
        a: (&[4, 3], &[PSUM]),
        b: (&[4, 3], &[R]),
        op: Op::Add,
        auto: false,
    });
    // P + R with auto: the replica becomes a partial locally (no collective).
    expect(
        BinaryCase {
            mesh,
            a: (&[4, 3], &[PSUM]),
            b: (&[4, 3], &[R]),
            op: Op::Add,
            auto: true,
        },
        &[PSUM],
        0,
    );
    // P * P with auto: one side is all-reduced.
    expect(
        BinaryCase {
            mesh,
            a: (&[4, 3], &[PSUM]),
            b: (&[4, 3], &[PSUM]),
            op: Op::Mul,
            auto: true,
        },
        &[PSUM],
        1,
    );
}

#[test]
fn matmul_rules() {
    let mesh: &[usize] = &[3];
    let m = Op::Matmul;
    // 7 x 5 · 5 x 4 with uneven shards on every dim (7 -> 3,3,1; 5 -> 2,2,1; 4 -> 2,2,0).
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[S0]),
            b: (&[5, 4], &[R]),
            op: m,
            auto: false,
        },
        &[S0],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[R]),
            b: (&[5, 4], &[S1]),
            op: m,
            auto: false,
        },
        &[S1],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[S1]),
            b: (&[5, 4], &[S0]),
            op: m,
            auto: false,
        },
        &[PSUM],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[R]),
            b: (&[5, 4], &[R]),
            op: m,
            auto: false,
        },
        &[R],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[PSUM]),
            b: (&[5, 4], &[R]),
            op: m,
            auto: false,
        },
        &[PSUM],
        0,
    );
    // Batched: [2, 7, 5] · [2, 5, 4] sharded on the batch; a batched lhs with a 2-d rhs.
    expect(
        BinaryCase {
            mesh,
            a: (&[2, 7, 5], &[S0]),
            b: (&[2, 5, 4], &[S0]),
            op: m,
            auto: false,
        },
        &[S0],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[4, 7, 5], &[S0]),
            b: (&[5, 4], &[R]),
            op: m,
            auto: false,
        },
        &[S0],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[2, 7, 5], &[S2]),
            b: (&[2, 5, 4], &[S1]),
            op: m,
            auto: false,
        },
        &[PSUM],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[2, 7, 5], &[S1]),
            b: (&[2, 5, 4], &[R]),
            op: m,
            auto: false,
        },
        &[S1],
        0,
    );
    // S(0) · S(0) shards m and k: no rule; auto replicates the rhs (one all-gather).
    expect_unsupported(BinaryCase {
        mesh,
        a: (&[7, 5], &[S0]),
        b: (&[5, 4], &[S0]),
        op: m,
        auto: false,
    });
    expect(
        BinaryCase {
            mesh,
            a: (&[7, 5], &[S0]),
            b: (&[5, 4], &[S0]),
            op: m,
            auto: true,
        },
        &[S0],
        1,
    );
}

#[test]
fn matmul_on_a_two_d_mesh_mixes_shard_and_partial() {
    let mesh: &[usize] = &[2, 2];
    expect(
        BinaryCase {
            mesh,
            a: (&[5, 6], &[S0, S1]),
            b: (&[6, 3], &[R, S0]),
            op: Op::Matmul,
            auto: false,
        },
        &[S0, PSUM],
        0,
    );
    expect(
        BinaryCase {
            mesh,
            a: (&[5, 6], &[S1, R]),
            b: (&[6, 3], &[S0, S1]),
            op: Op::Matmul,
            auto: false,
        },
        &[PSUM, S1],
        0,
    );
}

#[test]
fn matmul_shape_errors_are_typed() {
    let out = on_mesh(&[2], &[], |ctx| {
        let a = DTensor::zeros(&ctx.mesh, &[3, 4], F64, &[R])?;
        let b = DTensor::zeros(&ctx.mesh, &[5, 2], F64, &[R])?;
        let v = DTensor::zeros(&ctx.mesh, &[4], F64, &[R])?;
        let f = DTensor::zeros(&ctx.mesh, &[4, 2], hypershard_dtensor::DType::F32, &[R])?;
        Ok((
            matches!(a.matmul(&b), Err(Error::ShapeMismatch { .. })),
            matches!(a.matmul(&v), Err(Error::ShapeMismatch { .. })),
            matches!(a.matmul(&f), Err(Error::DTypeMismatch { .. })),
        ))
    });
    assert_eq!(out, vec![(true, true, true); 2]);
}

#[test]
fn reductions_turn_sharded_dims_into_partial_sums() {
    let out = on_mesh(&[2, 2], &[], |ctx| {
        let full = values(&[5, 3], 1.0);
        let x = DTensor::distribute_local(&full, &ctx.mesh, &[S0, S1])?;
        let mut rows = Vec::new();
        for keepdim in [false, true] {
            for dim in 0..2 {
                let s = x.sum(dim, keepdim)?;
                let m = x.mean(dim, keepdim)?;
                let s_ok = s
                    .full_tensor()?
                    .allclose(&full.sum(dim, keepdim)?, 1e-12, 1e-12)?;
                let m_ok = m
                    .full_tensor()?
                    .allclose(&full.mean(dim, keepdim)?, 1e-12, 1e-12)?;
                rows.push((
                    s.placements().to_vec(),
                    m.placements().to_vec(),
                    s_ok && m_ok,
                ));
            }
        }
        let pmax =
            DTensor::distribute_local(&full, &ctx.mesh, &[Placement::Partial(ReduceOp::Max), R])?;
        let strict = matches!(pmax.sum(0, false), Err(Error::UnsupportedSharding { .. }));
        let auto = pmax.sum_with(0, false, OpConfig::default().with_auto_redistribute(true))?;
        let auto_ok = auto
            .full_tensor()?
            .allclose(&full.sum(0, false)?, 1e-12, 1e-12)?;
        Ok((rows, strict, auto_ok))
    });
    for (rows, strict, auto_ok) in out {
        assert_eq!(rows[0].0, vec![PSUM, S0]);
        assert_eq!(rows[1].0, vec![S0, PSUM]);
        assert_eq!(rows[2].0, vec![PSUM, S1]);
        assert_eq!(rows[3].0, vec![S0, PSUM]);
        assert!(rows.iter().all(|r| r.0 == r.1 && r.2));
        assert!(strict && auto_ok);
    }
}

#[test]
fn transpose_and_reshape_move_the_shard_dims() {
    let out = on_mesh(&[2], &[], |ctx| {
        let full = values(&[6, 4], 2.0);
        let x = DTensor::distribute_local(&full, &ctx.mesh, &[S1])?;
        let t = x.transpose(0, 1)?;
        let t_ok =
            Snapshot::of(&t.full_tensor()?) == Snapshot::of(&full.transpose(0, 1)?.contiguous()?);
        let y = DTensor::distribute_local(&full, &ctx.mesh, &[S0])?;
        let r = y.reshape(&[6, 2, 2])?;
        let r_ok = Snapshot::of(&r.full_tensor()?) == Snapshot::of(&full.reshape(&[6, 2, 2])?);
        let merged = y.reshape(&[24]);
        let split = x.reshape(&[3, 2, 4])?;
        let split_ok =
            Snapshot::of(&split.full_tensor()?) == Snapshot::of(&full.reshape(&[3, 2, 4])?);
        Ok((
            t.placements().to_vec(),
            t_ok,
            r.placements().to_vec(),
            r_ok,
            matches!(merged, Err(Error::UnsupportedReshape { .. })),
            split.placements().to_vec(),
            split_ok,
            matches!(x.transpose(0, 2), Err(Error::DimOutOfRange { .. })),
        ))
    });
    for row in out {
        assert_eq!(
            row,
            (vec![S0], true, vec![S0], true, true, vec![S2], true, true)
        );
    }
}

#[test]
fn elementwise_on_a_nested_two_d_layout_is_local() {
    let out = on_mesh(&[2, 3], &[], |ctx| {
        let (fa, fb) = (values(&[10, 4], 0.0), values(&[10, 4], 5.0));
        let x = DTensor::distribute_local(&fa, &ctx.mesh, &[S0, S0])?;
        let y = DTensor::distribute_local(&fb, &ctx.mesh, &[S0, S0])?;
        ctx.reset();
        let z = x.add(&y)?;
        let silent = !ctx.counts().contains_key(&OpKind::AllGather);
        Ok((
            z.placements().to_vec(),
            silent,
            z.full_tensor()?.allclose(&fa.add(&fb)?, 0.0, 0.0)?,
        ))
    });
    assert_eq!(out, vec![(vec![S0, S0], true, true); 6]);
}
