//! Seeded random tensors from a counter-based generator.
//!
//! The value at global flat index `i` of a tensor made with seed `s` depends only on `(s, i)`:
//! there is no generator state to advance, so any block of a large tensor can be produced on
//! its own (a DTensor shard on its rank) and equals the same block of the full tensor.
//!
//! The bits for counter `c` are `mix(key + (c + 1) * GAMMA)` with `key = mix(seed)`, where
//! `mix` is the SplitMix64 finaliser and `GAMMA = 0x9E37_79B9_7F4A_7C15`; that is, counter `c`
//! is the `c`-th output of a SplitMix64 stream started at a hashed seed. A uniform in
//! `[0, 1)` takes the top 53 bits. Uniform element `i` uses counter `i`; normal element `i`
//! uses counters `2i` and `2i + 1` in a Box–Muller transform (the cosine branch only).

use crate::dtype::{Arith, with_arith};
use crate::layout::{checked_numel, contiguous_strides};
use crate::{DType, Error, Result, Tensor};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output finaliser: a bijective, well-avalanching 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits for `(seed, counter)`.
pub fn random_bits(seed: u64, counter: u64) -> u64 {
    mix(mix(seed).wrapping_add(counter.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// A uniform `f64` in `[0, 1)` for `(seed, counter)`, with 53 random bits.
pub fn random_unit(seed: u64, counter: u64) -> f64 {
    (random_bits(seed, counter) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The distribution of a random tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Uniform on `[low, high)`.
    Uniform {
        /// Inclusive lower bound.
        low: f64,
        /// Exclusive upper bound.
        high: f64,
    },
    /// Normal with the given mean and standard deviation.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation (≥ 0).
        std: f64,
    },
}

/// What to fill a random tensor with: a seed and a distribution.
///
/// ```
/// use hypershard_tensor::{DType, RandomInit, Tensor};
/// let init = RandomInit::uniform(7, -1.0, 1.0);
/// let t = Tensor::random(&[4, 4], DType::F32, init)?;
/// assert!(t.to_vec::<f32>()?.iter().all(|x| (-1.0..1.0).contains(x)));
/// assert_eq!(t.to_vec::<f32>()?, Tensor::random(&[4, 4], DType::F32, init)?.to_vec::<f32>()?);
/// # Ok::<(), hypershard_tensor::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomInit {
    /// The seed; equal seeds give equal tensors.
    pub seed: u64,
    /// The distribution.
    pub dist: Distribution,
}

impl RandomInit {
    /// Uniform on `[low, high)`.
    pub fn uniform(seed: u64, low: f64, high: f64) -> Self {
        RandomInit {
            seed,
            dist: Distribution::Uniform { low, high },
        }
    }

    /// Normal with mean `mean` and standard deviation `std`.
    pub fn normal(seed: u64, mean: f64, std: f64) -> Self {
        RandomInit {
            seed,
            dist: Distribution::Normal { mean, std },
        }
    }

    /// The value of global element `index` in `f64`, before rounding to a dtype.
    pub fn value_at(&self, index: u64) -> f64 {
        match self.dist {
            Distribution::Uniform { low, high } => {
                low + (high - low) * random_unit(self.seed, index)
            }
            Distribution::Normal { mean, std } => {
                let u1 = random_unit(self.seed, index.wrapping_mul(2));
                let u2 = random_unit(self.seed, index.wrapping_mul(2).wrapping_add(1));
                // 1 - u1 lies in (0, 1], so the logarithm is finite.
                let radius = (-2.0 * (1.0 - u1).ln()).sqrt();
                mean + std * radius * (std::f64::consts::TAU * u2).cos()
            }
        }
    }

    fn validate(&self, op: &'static str) -> Result<()> {
        let (first, second, ok) = match self.dist {
            Distribution::Uniform { low, high } => {
                (low, high, low.is_finite() && high.is_finite() && low < high)
            }
            Distribution::Normal { mean, std } => {
                (mean, std, mean.is_finite() && std.is_finite() && std >= 0.0)
            }
        };
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidDistribution { op, first, second })
        }
    }
}

/// A block of a larger (global) tensor: its offset along every dim and its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block<'a> {
    /// The shape of the global tensor.
    pub global_shape: &'a [usize],
    /// The index of the block's first element along every dim.
    pub offset: &'a [usize],
    /// The shape of the block.
    pub shape: &'a [usize],
}

/// Rounds a value into `T`, keeping a uniform sample below its exclusive upper bound (rounding
/// to a narrow dtype could otherwise land exactly on `high`).
fn round_into<T: Arith>(value: f64, high: Option<f64>) -> T {
    let x = T::from_f64(value);
    match high {
        Some(h) if x.to_f64() >= h => T::next_down(T::from_f64(h)),
        _ => x,
    }
}

impl Tensor {
    /// A random tensor of `shape`: element `i` (row-major) is `init.value_at(i)` rounded to
    /// `dtype` (float dtypes only). See the [`random`](crate::random) module for the generator.
    ///
    /// Inside [`deferred_init`](crate::deferred_init) it allocates nothing and returns a
    /// deferred tensor that remembers `init` (checked now, as the eager path would).
    pub fn random(shape: &[usize], dtype: DType, init: RandomInit) -> Result<Tensor> {
        if crate::deferred::in_deferred_init() {
            init.validate("random")?;
            if !dtype.is_float() {
                return Err(Error::UnsupportedDType {
                    op: "random",
                    dtype,
                });
            }
            return Tensor::deferred_with(
                "random",
                shape,
                dtype,
                Some(crate::deferred::Fill::Random(init)),
            );
        }
        let zeros = vec![0; shape.len()];
        Tensor::random_block(
            Block {
                global_shape: shape,
                offset: &zeros,
                shape,
            },
            dtype,
            init,
        )
    }

    /// The block of the random tensor `Tensor::random(block.global_shape, dtype, init)` at
    /// `block.offset` with shape `block.shape`, computed without making the global tensor.
    ///
    /// ```
    /// use hypershard_tensor::{Block, DType, RandomInit, Tensor};
    /// let init = RandomInit::normal(3, 0.0, 1.0);
    /// let full = Tensor::random(&[4, 6], DType::F64, init)?;
    /// let block = Tensor::random_block(
    ///     Block { global_shape: &[4, 6], offset: &[2, 1], shape: &[2, 3] },
    ///     DType::F64,
    ///     init,
    /// )?;
    /// let expected = full.narrow(0, 2, 2)?.narrow(1, 1, 3)?;
    /// assert_eq!(block.to_vec::<f64>()?, expected.to_vec::<f64>()?);
    /// # Ok::<(), hypershard_tensor::Error>(())
    /// ```
    pub fn random_block(block: Block<'_>, dtype: DType, init: RandomInit) -> Result<Tensor> {
        let op = "random_block";
        init.validate(op)?;
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType { op, dtype });
        }
        checked_numel(op, block.global_shape)?;
        let fits = block.offset.len() == block.global_shape.len()
            && block.shape.len() == block.global_shape.len()
            && block
                .offset
                .iter()
                .zip(block.shape)
                .zip(block.global_shape)
                .all(|((&o, &s), &g)| o.checked_add(s).is_some_and(|end| end <= g));
        if !fits {
            return Err(Error::BlockOutOfBounds {
                op,
                global_shape: block.global_shape.to_vec(),
                offset: block.offset.to_vec(),
                block_shape: block.shape.to_vec(),
            });
        }
        let global_strides = contiguous_strides(block.global_shape);
        let base: usize = block
            .offset
            .iter()
            .zip(&global_strides)
            .map(|(o, s)| o * s)
            .sum();
        // The global flat index of every block element: the block is a strided view of the
        // global row-major index space.
        let indices = crate::layout::StridedIndices::new(block.shape, &global_strides, base);
        let high = match init.dist {
            Distribution::Uniform { high, .. } => Some(high),
            Distribution::Normal { .. } => None,
        };
        with_arith!(dtype, op, T => Tensor::build::<T>(op, block.shape, |out| {
            for (o, g) in out.iter_mut().zip(indices) {
                *o = round_into::<T>(init.value_at(g as u64), high);
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn bits_depend_on_seed_and_counter_only() {
        assert_eq!(random_bits(1, 5), random_bits(1, 5));
        assert_ne!(random_bits(1, 5), random_bits(2, 5));
        assert_ne!(random_bits(1, 5), random_bits(1, 6));
        // Seed 0 counter 0 is the first SplitMix64 output from state mix(0) = 0.
        assert_eq!(random_bits(0, 0), mix(GAMMA));
        assert_eq!(mix(GAMMA), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn uniform_statistics_and_range() -> Result<()> {
        let t = Tensor::random(&[10_000], DType::F64, RandomInit::uniform(42, 2.0, 4.0))?;
        let v = t.to_vec::<f64>()?;
        assert!(v.iter().all(|x| (2.0..4.0).contains(x)));
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        // The standard error of the mean is (2/sqrt(12))/100 ~ 0.006.
        assert!((mean - 3.0).abs() < 0.03, "mean {mean}");
        Ok(())
    }

    #[test]
    fn normal_statistics() -> Result<()> {
        let t = Tensor::random(&[20_000], DType::F32, RandomInit::normal(9, 1.0, 2.0))?;
        let v = t.to_f64_vec()?;
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        assert!((mean - 1.0).abs() < 0.06, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.06, "std {}", var.sqrt());
        Ok(())
    }

    #[test]
    fn narrow_dtypes_stay_below_high() -> Result<()> {
        let t = Tensor::random(&[5000], DType::BF16, RandomInit::uniform(1, 0.0, 1.0))?;
        assert!(
            t.to_vec::<bf16>()?
                .iter()
                .all(|x| x.to_f32() >= 0.0 && x.to_f32() < 1.0)
        );
        let h = Tensor::random(&[5000], DType::F16, RandomInit::uniform(1, -1.0, 0.0))?;
        assert!(h.to_f64_vec()?.iter().all(|x| (-1.0..0.0).contains(x)));
        Ok(())
    }

    #[test]
    fn blocks_tile_the_global_tensor() -> Result<()> {
        let init = RandomInit::uniform(5, -1.0, 1.0);
        let global = [5, 3, 4];
        let full = Tensor::random(&global, DType::F32, init)?;
        let pieces: Vec<Tensor> = (0..5)
            .step_by(2)
            .map(|start| {
                let rows = 2.min(5 - start);
                Tensor::random_block(
                    Block {
                        global_shape: &global,
                        offset: &[start, 1, 0],
                        shape: &[rows, 2, 4],
                    },
                    DType::F32,
                    init,
                )
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = pieces.iter().collect();
        let joined = Tensor::cat(&refs, 0)?;
        assert_eq!(
            joined.to_vec::<f32>()?,
            full.narrow(1, 1, 2)?.to_vec::<f32>()?
        );
        Ok(())
    }

    #[test]
    fn bad_parameters_are_errors() {
        let bad_block = Block {
            global_shape: &[4],
            offset: &[3],
            shape: &[2],
        };
        assert!(matches!(
            Tensor::random_block(bad_block, DType::F32, RandomInit::uniform(0, 0.0, 1.0)),
            Err(Error::BlockOutOfBounds { .. })
        ));
        let wrong_rank = Block {
            global_shape: &[4, 4],
            offset: &[0],
            shape: &[2, 2],
        };
        assert!(matches!(
            Tensor::random_block(wrong_rank, DType::F32, RandomInit::uniform(0, 0.0, 1.0)),
            Err(Error::BlockOutOfBounds { .. })
        ));
        assert!(matches!(
            Tensor::random(&[2], DType::F32, RandomInit::uniform(0, 1.0, 1.0)),
            Err(Error::InvalidDistribution { .. })
        ));
        assert!(matches!(
            Tensor::random(&[2], DType::F32, RandomInit::normal(0, 0.0, -1.0)),
            Err(Error::InvalidDistribution { .. })
        ));
        assert!(matches!(
            Tensor::random(&[2], DType::F32, RandomInit::normal(0, f64::NAN, 1.0)),
            Err(Error::InvalidDistribution { .. })
        ));
        assert!(matches!(
            Tensor::random(&[2], DType::I32, RandomInit::uniform(0, 0.0, 1.0)),
            Err(Error::UnsupportedDType { .. })
        ));
    }
}
