//! Micro-benchmarks of the local tensor kernels FSDP leans on: the bf16 cast of a parameter
//! shard before all-gather, the f32 gradient accumulation (`axpy`), and making a transposed
//! view contiguous.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hypershard_tensor::{DType, RandomInit, Tensor};
use std::hint::black_box;

/// One mebi-element: a mid-sized parameter shard.
const N: usize = 1 << 20;

fn kernels(c: &mut Criterion) {
    let x = Tensor::random(&[N], DType::F32, RandomInit::uniform(1, -1.0, 1.0))
        .expect("benchmark input");
    let acc = Tensor::zeros(&[N], DType::F32).expect("benchmark accumulator");
    let square = Tensor::random(&[1024, 1024], DType::F32, RandomInit::normal(2, 0.0, 1.0))
        .expect("benchmark matrix");

    let mut group = c.benchmark_group("tensor");
    group.throughput(Throughput::Bytes((N * 4) as u64));
    group.bench_function("cast_f32_to_bf16_1Mi", |b| {
        b.iter(|| black_box(x.to_dtype(DType::BF16).expect("cast")))
    });
    group.bench_function("axpy_f32_1Mi", |b| {
        b.iter(|| acc.axpy(0.5, black_box(&x)).expect("axpy"))
    });
    group.bench_function("add_f32_1Mi", |b| {
        b.iter(|| black_box(x.add(&x).expect("add")))
    });
    group.bench_function("transpose_contiguous_1024x1024", |b| {
        b.iter(|| {
            black_box(
                square
                    .transpose(0, 1)
                    .and_then(|t| t.contiguous())
                    .expect("contiguous"),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
