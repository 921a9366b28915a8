//! Property: the GEMM equals the triple loop for random shapes and transposes, and gives the
//! same bits on the emulated device.

// Test code: a failed unwrap is a failed property, reported with its inputs by proptest.

use hypershard_nn::linalg::{MatmulOptions, matmul_with};
use hypershard_tensor::{DType, Device, RandomInit, Tensor};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn gemm_matches_triple_loop(
        m in 0usize..12,
        k in 0usize..12,
        n in 0usize..12,
        transpose_a: bool,
        transpose_b: bool,
        seed in 0u64..1000,
    ) {
        let a_shape = if transpose_a { [k, m] } else { [m, k] };
        let b_shape = if transpose_b { [n, k] } else { [k, n] };
        let a = Tensor::random(&a_shape, DType::F64, RandomInit::uniform(seed, -1.0, 1.0)).unwrap();
        let b = Tensor::random(&b_shape, DType::F64, RandomInit::uniform(seed + 1, -1.0, 1.0)).unwrap();
        let options = MatmulOptions { transpose_a, transpose_b };
        let c = matmul_with(&a, &b, options).unwrap();
        prop_assert_eq!(c.shape(), &[m, n]);
        let device = Device::Emulated { ordinal: 0 };
        let on_device = matmul_with(&a.to_device(&device).unwrap(), &b.to_device(&device).unwrap(), options).unwrap();
        prop_assert_eq!(on_device.device(), device);
        prop_assert_eq!(on_device.to_host().unwrap().to_bytes().unwrap(), c.to_bytes().unwrap());
        let av = a.to_vec::<f64>().unwrap();
        let bv = b.to_vec::<f64>().unwrap();
        let at = |i: usize, p: usize| if transpose_a { av[p * m + i] } else { av[i * k + p] };
        let bt = |p: usize, j: usize| if transpose_b { bv[j * k + p] } else { bv[p * n + j] };
        let cv = c.to_vec::<f64>().unwrap();
        for i in 0..m {
            for j in 0..n {
                let expected: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                prop_assert!((cv[i * n + j] - expected).abs() < 1e-12);
            }
        }
    }
}
