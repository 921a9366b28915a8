//! The guard that keeps NaN and infinity out of checkpoints: before a save, every rank counts
//! the non-finite values of its parameter shards and the counts are summed over the world, so
//! all ranks refuse (or go ahead) together.

use hypershard_collectives::{Communicator, CommunicatorExt, ReduceOp};
use hypershard_nn::Module;
use hypershard_tensor::DType;

use crate::error::{Error, Result};

/// Non-finite values in the local parameter shards of `model`.
pub(super) fn nonfinite_values(model: &dyn Module) -> Result<u64> {
    let mut count = 0u64;
    model.visit_params("", &mut |_, param| {
        // A device shard is copied to the host one parameter at a time (this runs only
        // before a save); a host shard is read where it is.
        let data = param.data()?.to_host()?;
        count += if data.dtype() == DType::F32 && data.is_contiguous() {
            // The common case, read in place: an f64 copy of every shard would add twice
            // the model's local bytes to the peak at each save.
            data.with_kernel_data::<f32, _>("count non-finite", |values| {
                values.iter().filter(|v| !v.is_finite()).count()
            })?
        } else {
            let values = data.to_f64_vec()?;
            values.iter().filter(|v| !v.is_finite()).count()
        } as u64;
        Ok(())
    })?;
    Ok(count)
}

/// Fails with [`Error::NonFiniteParameters`] on every rank when any rank's shards hold a NaN
/// or an infinity (a collective: every rank calls it before the save of `step`).
pub(super) fn check_finite_parameters(
    model: &dyn Module,
    world: &dyn Communicator,
    step: u64,
) -> Result<()> {
    let local = nonfinite_values(model)?;
    // Counts are far below 2⁵³, so the f64 sum is exact.
    let total = world.all_reduce_vec(vec![local as f64], ReduceOp::Sum)?;
    let count = total.first().copied().unwrap_or(0.0) as u64;
    if count > 0 {
        return Err(Error::NonFiniteParameters { step, count });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypershard_nn::{Linear, LinearConfig};
    use hypershard_tensor::Tensor;

    /// A 3→2 linear layer; `poison` puts a NaN and an infinity into its weight.
    fn linear(poison: bool) -> Linear {
        let mut linear = Linear::new(LinearConfig {
            in_features: 3,
            out_features: 2,
            bias: true,
            dtype: DType::F32,
            seed: 1,
        })
        .unwrap();
        if poison {
            linear
                .visit_params_mut("", &mut |name, param| {
                    if name == "weight" {
                        let data = param.data()?;
                        let mut values: Vec<f32> = data.to_vec()?;
                        values[0] = f32::NAN;
                        values[4] = f32::INFINITY;
                        data.copy_from(&Tensor::from_vec(values, data.shape())?)?;
                    }
                    Ok(())
                })
                .unwrap();
        }
        linear
    }

    fn check_on_two_ranks(poisoned_rank: Option<usize>) -> Vec<Result<()>> {
        let comms = hypershard_collectives::local::spawn_world(2).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let model = linear(poisoned_rank == Some(comm.rank()));
                    check_finite_parameters(&model, comm.as_ref(), 7)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn non_finite_values_are_counted_and_refused_on_every_rank() {
        assert_eq!(nonfinite_values(&linear(false)).unwrap(), 0);
        assert_eq!(nonfinite_values(&linear(true)).unwrap(), 2);
        // Rank 1 alone holds the bad values; both ranks refuse.
        for result in check_on_two_ranks(Some(1)) {
            assert!(
                matches!(
                    result,
                    Err(Error::NonFiniteParameters { step: 7, count: 2 })
                ),
                "{result:?}"
            );
        }
        for result in check_on_two_ranks(None) {
            result.unwrap();
        }
    }

    /// Shards on a device are copied to the host to be counted (the emulated device refuses a
    /// host read in place, as a GPU does).
    #[test]
    fn non_finite_values_on_a_device_are_counted() {
        let device = hypershard_tensor::Device::Emulated { ordinal: 0 };
        for (poison, want) in [(false, 0), (true, 2)] {
            let mut model = linear(poison);
            hypershard_nn::to_device(&mut model, &device).unwrap();
            model
                .visit_params("", &mut |_, param| {
                    assert_eq!(param.data()?.device(), device);
                    Ok(())
                })
                .unwrap();
            assert_eq!(nonfinite_values(&model).unwrap(), want);
        }
    }
}
