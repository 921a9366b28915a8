//! Property tests: views, casts, safetensors, broadcasting and random blocks, each checked
//! against a reference computed from explicit index arithmetic (never from strides).

use half::{bf16, f16};
use hypershard_tensor::{Block, DType, RandomInit, Tensor, load_safetensors, save_safetensors};
use proptest::prelude::*;

/// A row-major array given by its shape and data, transformed by index arithmetic only.
#[derive(Debug, Clone)]
struct Reference {
    shape: Vec<usize>,
    data: Vec<i64>,
}

/// Every multi-index of `shape`, row-major.
fn multi_indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut flat| {
            let mut idx = vec![0; shape.len()];
            for d in (0..shape.len()).rev() {
                idx[d] = flat % shape[d];
                flat /= shape[d];
            }
            idx
        })
        .collect()
}

fn flat_index(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &s)| acc * s + i)
}

impl Reference {
    /// The array of `out_shape` whose element at `i` is `self` at `source(i)`.
    fn map(&self, out_shape: Vec<usize>, source: impl Fn(&[usize]) -> Vec<usize>) -> Reference {
        let data = multi_indices(&out_shape)
            .iter()
            .map(|i| self.data[flat_index(&self.shape, &source(i))])
            .collect();
        Reference {
            shape: out_shape,
            data,
        }
    }
}

/// One step of a view chain, its parameters reduced modulo the current shape when applied.
#[derive(Debug, Clone)]
struct Step {
    kind: u8,
    a: usize,
    b: usize,
}

fn step() -> impl Strategy<Value = Step> {
    (0u8..7, any::<u16>(), any::<u16>()).prop_map(|(kind, a, b)| Step {
        kind,
        a: a as usize,
        b: b as usize,
    })
}

/// Applies one step to both the tensor and the reference.
fn apply(
    step: &Step,
    t: &Tensor,
    r: &Reference,
) -> Result<(Tensor, Reference), hypershard_tensor::Error> {
    let ndim = r.shape.len();
    if ndim == 0 {
        return Ok((
            t.unsqueeze(0)?,
            Reference {
                shape: vec![1],
                data: r.data.clone(),
            },
        ));
    }
    let dim = step.a % ndim;
    let size = r.shape[dim];
    Ok(match step.kind {
        // narrow
        0 => {
            let start = step.b % (size + 1);
            let len = (step.b / 7) % (size - start + 1);
            let mut shape = r.shape.clone();
            shape[dim] = len;
            let reference = r.map(shape, |i| {
                let mut j = i.to_vec();
                j[dim] += start;
                j
            });
            (t.narrow(dim, start, len)?, reference)
        }
        // transpose
        1 => {
            let other = step.b % ndim;
            let mut shape = r.shape.clone();
            shape.swap(dim, other);
            let reference = r.map(shape, |i| {
                let mut j = i.to_vec();
                j.swap(dim, other);
                j
            });
            (t.transpose(dim, other)?, reference)
        }
        // permute: a rotation by `b`
        2 => {
            let perm: Vec<usize> = (0..ndim).map(|k| (k + step.b) % ndim).collect();
            let shape = perm.iter().map(|&p| r.shape[p]).collect();
            let reference = r.map(shape, |i| {
                let mut j = vec![0; ndim];
                for (k, &p) in perm.iter().enumerate() {
                    j[p] = i[k];
                }
                j
            });
            (t.permute(&perm)?, reference)
        }
        // expand: a size-1 dim to 1..=3, or a new leading dim of 2
        3 => {
            if let Some(one) = r.shape.iter().position(|&s| s == 1) {
                let mut shape = r.shape.clone();
                shape[one] = 1 + step.b % 3;
                let reference = r.map(shape.clone(), |i| {
                    let mut j = i.to_vec();
                    j[one] = 0;
                    j
                });
                (t.expand(&shape)?, reference)
            } else if ndim < 4 {
                let mut shape = vec![2];
                shape.extend_from_slice(&r.shape);
                let reference = r.map(shape.clone(), |i| i[1..].to_vec());
                (t.expand(&shape)?, reference)
            } else {
                (t.clone(), r.clone())
            }
        }
        // chunk, keeping piece `b` (torch.chunk arithmetic written out independently)
        4 => {
            let chunks = 1 + step.b % 4;
            let pieces = t.chunk(chunks, dim)?;
            let piece_len = size.div_ceil(chunks);
            let count = if size == 0 {
                1
            } else {
                size.div_ceil(piece_len)
            };
            assert_eq!(pieces.len(), count);
            let k = (step.b / 4) % count;
            let start = k * piece_len;
            let len = if size == 0 {
                0
            } else {
                piece_len.min(size - start)
            };
            let mut shape = r.shape.clone();
            shape[dim] = len;
            let reference = r.map(shape, |i| {
                let mut j = i.to_vec();
                j[dim] += start;
                j
            });
            (pieces[k].clone(), reference)
        }
        // unsqueeze / squeeze
        5 => {
            if ndim < 4 {
                let at = step.b % (ndim + 1);
                let mut shape = r.shape.clone();
                shape.insert(at, 1);
                (
                    t.unsqueeze(at)?,
                    Reference {
                        shape,
                        data: r.data.clone(),
                    },
                )
            } else {
                let mut shape = r.shape.clone();
                if shape[dim] == 1 {
                    shape.remove(dim);
                }
                (
                    t.squeeze(dim)?,
                    Reference {
                        shape,
                        data: r.data.clone(),
                    },
                )
            }
        }
        // reshape: merge dims dim..=dim+1 (flatten), a view when possible
        _ => {
            let end = (dim + 1).min(ndim - 1);
            let merged: usize = r.shape[dim..=end].iter().product();
            let mut shape = r.shape[..dim].to_vec();
            shape.push(merged);
            shape.extend_from_slice(&r.shape[end + 1..]);
            // `flatten` is a view when the strides allow and a copy otherwise; the chain then
            // continues on the copy.
            (
                t.flatten(dim, end)?,
                Reference {
                    shape,
                    data: r.data.clone(),
                },
            )
        }
    })
}

fn small_shape(max_dims: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..5, 0..=max_dims)
}

fn check_cast_f32(x: f32, back: f32, rel: f32, abs: f32) -> bool {
    if x.is_nan() {
        back.is_nan()
    } else {
        (x - back).abs() <= rel * x.abs() + abs
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A random chain of views reads the same elements as the index-computed reference, its
    /// contiguous copy agrees, and writes through it land on the right base elements.
    #[test]
    fn view_chains_match_reference(shape in small_shape(3), steps in prop::collection::vec(step(), 0..6)) {
        let n: usize = shape.iter().product();
        let base = Tensor::arange(n, DType::I64).and_then(|t| t.view(&shape)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut t = base.clone();
        let mut r = Reference { shape: shape.clone(), data: (0..n as i64).collect() };
        for s in &steps {
            let (nt, nr) = apply(s, &t, &r).map_err(|e| TestCaseError::fail(format!("{s:?}: {e}")))?;
            if !nt.shares_storage(&t) {
                // A copy happens exactly when the requested view is not expressible.
                prop_assert!(s.kind == 6 && t.view(nt.shape()).is_err(), "{:?} copied", s);
            }
            t = nt;
            r = nr;
        }
        prop_assert_eq!(t.shape(), &r.shape[..]);
        // Only a flatten of a non-viewable layout copies (checked in its own step below).
        let copied = !t.shares_storage(&base);
        prop_assert_eq!(t.to_vec::<i64>().map_err(|e| TestCaseError::fail(e.to_string()))?, r.data.clone());
        let c = t.contiguous().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(c.is_contiguous());
        prop_assert_eq!(c.to_vec::<i64>().map_err(|e| TestCaseError::fail(e.to_string()))?, r.data.clone());

        let overlapping = t.numel() > 0 && t.shape().iter().zip(t.strides()).any(|(&s, &st)| s > 1 && st == 0);
        let negated = t.scale(-1.0).and_then(|m| m.sub(&Tensor::scalar(1i64))).map_err(|e| TestCaseError::fail(e.to_string()))?;
        match t.copy_from(&negated) {
            Ok(()) if copied => prop_assert!(!overlapping),
            Ok(()) => {
                prop_assert!(!overlapping);
                let mut expected: Vec<i64> = (0..n as i64).collect();
                for &v in &r.data {
                    expected[v as usize] = -v - 1;
                }
                prop_assert_eq!(base.to_vec::<i64>().map_err(|e| TestCaseError::fail(e.to_string()))?, expected);
            }
            Err(hypershard_tensor::Error::OverlappingWrite { .. }) => prop_assert!(overlapping),
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        }
    }

    /// f32 -> f64 -> f32 is exact; f32 -> bf16/f16 -> f32 is within half an ulp of the narrow
    /// type, and narrow -> f32 -> narrow is exact.
    #[test]
    fn cast_round_trips(values in prop::collection::vec(any::<f32>(), 1..40), small in prop::collection::vec(-60000.0f32..60000.0, 1..40)) {
        let t = Tensor::from_slice(&values, &[values.len()]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let cast = |t: &Tensor, d: DType| t.to_dtype(d).map_err(|e| TestCaseError::fail(e.to_string()));
        let via64 = cast(&cast(&t, DType::F64)?, DType::F32)?.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (x, y) in values.iter().zip(&via64) {
            prop_assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
        }
        let bf = cast(&t, DType::BF16)?;
        let via_bf = cast(&bf, DType::F32)?.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (&x, &y) in values.iter().zip(&via_bf) {
            if !x.is_finite() {
                prop_assert!(check_cast_f32(x, y, 0.0, 0.0), "{x} -> {y}");
            } else if y.is_infinite() {
                // Only values beyond bf16's largest finite value (about 3.39e38) overflow.
                prop_assert!(x.abs() > 3.38e38 && x.signum() == y.signum(), "{x} -> {y}");
            } else {
                // bf16 has 8 significant bits (unit roundoff 2^-8) and f32's exponent range.
                prop_assert!(check_cast_f32(x, y, 2f32.powi(-8), 2f32.powi(-133)), "{x} -> {y}");
            }
        }
        let bf_again = cast(&cast(&bf, DType::F32)?, DType::BF16)?.to_vec::<bf16>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let bf_vals = bf.to_vec::<bf16>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (a, b) in bf_vals.iter().zip(&bf_again) {
            prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
        }
        let s = Tensor::from_slice(&small, &[small.len()]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h = cast(&s, DType::F16)?;
        let via_h = cast(&h, DType::F32)?.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (&x, &y) in small.iter().zip(&via_h) {
            // f16: relative error 2^-11 for normals, absolute 2^-25 in the subnormal range.
            prop_assert!(check_cast_f32(x, y, 2f32.powi(-11), 2f32.powi(-25)), "{x} -> {y}");
        }
        let h_vals = h.to_vec::<f16>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let h_again = cast(&cast(&h, DType::F64)?, DType::F16)?.to_vec::<f16>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(h_vals, h_again);
    }

    /// Any set of tensors (every dtype, random shapes including empty and 0-d, strided views)
    /// survives a safetensors round trip bit for bit.
    #[test]
    fn safetensors_round_trip(specs in prop::collection::vec((prop::collection::vec(0usize..4, 0..4), 0usize..8, any::<u64>(), any::<bool>()), 1..5)) {
        let mut tensors = Vec::new();
        for (i, (shape, d, seed, transpose)) in specs.iter().enumerate() {
            let dtype = DType::ALL[*d];
            let values = Tensor::random(shape, DType::F64, RandomInit::uniform(*seed, -100.0, 100.0))
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| if *transpose && shape.len() >= 2 { t.transpose(0, 1) } else { Ok(t) })
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            tensors.push((format!("p{i}"), values));
        }
        let bytes = save_safetensors(tensors.iter().map(|(n, t)| (n.as_str(), t))).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let loaded = load_safetensors(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(loaded.len(), tensors.len());
        for (name, t) in &tensors {
            let l = &loaded[name];
            prop_assert_eq!(l.dtype(), t.dtype());
            prop_assert_eq!(l.shape(), t.shape());
            prop_assert_eq!(l.to_bytes().map_err(|e| TestCaseError::fail(e.to_string()))?, t.to_bytes().map_err(|e| TestCaseError::fail(e.to_string()))?);
        }
    }

    /// Broadcasting add and mul equal a naive loop over the output's multi-indices.
    #[test]
    fn broadcasting_matches_reference(out in prop::collection::vec(1usize..4, 0..4), mask_a in any::<u8>(), mask_b in any::<u8>(), drop_a in 0usize..3, drop_b in 0usize..3) {
        let derive = |mask: u8, drop: usize| -> Vec<usize> {
            let kept = &out[drop.min(out.len())..];
            kept.iter().enumerate().map(|(k, &s)| if mask >> k & 1 == 1 { 1 } else { s }).collect()
        };
        let (sa, sb) = (derive(mask_a, drop_a), derive(mask_b, drop_b));
        let make = |shape: &[usize], base: i32| {
            let n: usize = shape.iter().product();
            Tensor::from_vec((0..n).map(|i| (i as i32 * 7 + base) as f32).collect::<Vec<f32>>(), shape)
        };
        let a = make(&sa, 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let b = make(&sb, -3).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let sum = a.add(&b).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let prod = b.mul(&a).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // The broadcast shape: the longer operand's rank, size = max (sizes are equal or 1).
        let ndim = sa.len().max(sb.len());
        let pad = |s: &[usize]| { let mut p = vec![1; ndim - s.len()]; p.extend_from_slice(s); p };
        let (pa, pb) = (pad(&sa), pad(&sb));
        let shape: Vec<usize> = pa.iter().zip(&pb).map(|(&x, &y)| x.max(y)).collect();
        prop_assert_eq!(sum.shape(), &shape[..]);
        let av = a.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let bv = b.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let pick = |p: &[usize], i: &[usize]| -> usize {
            let j: Vec<usize> = i.iter().zip(p).map(|(&x, &s)| if s == 1 { 0 } else { x }).collect();
            flat_index(p, &j)
        };
        let expected_sum: Vec<f32> = multi_indices(&shape).iter().map(|i| av[pick(&pa, i)] + bv[pick(&pb, i)]).collect();
        let expected_prod: Vec<f32> = multi_indices(&shape).iter().map(|i| bv[pick(&pb, i)] * av[pick(&pa, i)]).collect();
        prop_assert_eq!(sum.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?, expected_sum);
        prop_assert_eq!(prod.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?, expected_prod);
        // Summing along a dim equals the naive sum of the reference.
        if let Some(dim) = (!shape.is_empty()).then(|| mask_a as usize % shape.len()) {
            let reduced = sum.sum(dim, true).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let sv = sum.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut rshape = shape.clone();
            rshape[dim] = 1;
            let expected: Vec<f32> = multi_indices(&rshape).iter().map(|i| {
                (0..shape[dim]).map(|k| { let mut j = i.clone(); j[dim] = k; sv[flat_index(&shape, &j)] }).sum()
            }).collect();
            prop_assert_eq!(reduced.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?, expected);
        }
    }

    /// A random block equals the same block of the full random tensor, for any block.
    #[test]
    fn random_blocks_match_the_global_tensor(global in prop::collection::vec(1usize..6, 1..4), cuts in prop::collection::vec((any::<u16>(), any::<u16>()), 3), seed in any::<u64>(), normal in any::<bool>()) {
        let init = if normal { RandomInit::normal(seed, 0.5, 2.0) } else { RandomInit::uniform(seed, -3.0, 5.0) };
        let full = Tensor::random(&global, DType::F32, init).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut offset = Vec::new();
        let mut shape = Vec::new();
        let mut expected = full.clone();
        for (d, &g) in global.iter().enumerate() {
            let (x, y) = cuts[d];
            let start = x as usize % (g + 1);
            let len = y as usize % (g - start + 1);
            offset.push(start);
            shape.push(len);
            expected = expected.narrow(d, start, len).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let block = Tensor::random_block(Block { global_shape: &global, offset: &offset, shape: &shape }, DType::F32, init).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(block.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?, expected.to_vec::<f32>().map_err(|e| TestCaseError::fail(e.to_string()))?);
    }
}
