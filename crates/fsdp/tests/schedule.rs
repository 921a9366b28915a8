//! The one schedule, observed from inside the units: every unit is gathered before it
//! computes and freed after, the next unit's all-gather is issued before the current one
//! computes (forward and backward prefetch), at most two units hold unsharded parameters at
//! once, and a step issues exactly one all-gather per unit per pass and one reduce-scatter per
//! unit when gradients synchronise (none when they do not). Host and emulated device alike.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::*;
use hypershard_collectives::{Communicator, OpKind};
use hypershard_fsdp::{
    FullyShardConfig, ReshardAfterForward, UnitHandle, fully_shard, fully_shard_children,
    has_params,
};
use hypershard_nn::{
    Linear, LinearConfig, Module, ParamVisitor, ParamVisitorMut, Sequential, mse_loss,
};
use hypershard_tensor::{DType, Device, Tensor};

/// What one probe saw when its layer ran: the pass, its index, and per nested unit whether
/// it was unsharded and whether its all-gather was in flight.
#[derive(Debug, Clone)]
struct Seen {
    backward: bool,
    index: usize,
    unsharded: Vec<bool>,
    in_flight: Vec<bool>,
}

#[derive(Default)]
struct Log {
    units: Vec<UnitHandle>,
    seen: Vec<Seen>,
}

fn record(log: &Mutex<Log>, index: usize, backward: bool) {
    let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
    let unsharded = log.units.iter().map(UnitHandle::is_unsharded).collect();
    let in_flight = log.units.iter().map(UnitHandle::gather_in_flight).collect();
    log.seen.push(Seen {
        backward,
        index,
        unsharded,
        in_flight,
    });
}

/// A Linear layer that records the units' states before it computes.
struct Probe {
    inner: Linear,
    index: usize,
    log: Arc<Mutex<Log>>,
}

impl Module for Probe {
    fn kind(&self) -> &'static str {
        "Probe"
    }

    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        record(&self.log, self.index, false);
        self.inner.forward(input)
    }

    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        record(&self.log, self.index, true);
        self.inner.backward(grad_output)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        self.inner.visit_params(prefix, f)
    }

    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        self.inner.visit_params_mut(prefix, f)
    }
}

/// One step of `n` probed units at world 2 on `device`; returns rank 0's observations and
/// its (all-gather, reduce-scatter) counts.
fn step(
    n: usize,
    sync: bool,
    policy: ReshardAfterForward,
    device: Device,
) -> (Vec<Seen>, u64, u64) {
    let counters = counted_world(2);
    let rank_counters = counters.clone();
    let results = hypershard_testkit::run_ranks(2, move |rank| {
        let log = Arc::new(Mutex::new(Log::default()));
        let layers: Vec<Box<dyn Module>> = (0..n)
            .map(|index| {
                let inner = Linear::new(LinearConfig {
                    in_features: 4,
                    out_features: 4,
                    bias: true,
                    dtype: DType::F32,
                    seed: index as u64,
                })
                .expect("invariant: valid layer");
                Box::new(Probe {
                    inner,
                    index,
                    log: log.clone(),
                }) as Box<dyn Module>
            })
            .collect();
        let device = rank_device(device, rank);
        let mut model = moved(Sequential::new(layers), device);
        let comm: Arc<dyn Communicator> = rank_counters[rank].clone();
        let mut config = FullyShardConfig::new(dp_mesh(&[2], comm)?);
        config.reshard_after_forward = policy;
        fully_shard_children(&mut model, &config, &mut |_, m| has_params(m))?;
        let mut root = fully_shard(Box::new(model), config)?;
        // The root (no parameters) comes first; the probes' units follow in order.
        log.lock().unwrap_or_else(PoisonError::into_inner).units = root.units()[1..].to_vec();
        root.set_requires_gradient_sync(sync);
        let x = on(&Tensor::ones(&[2, 4], DType::F32)?, device);
        let y = root.forward(&x)?;
        let loss = mse_loss(&y, &Tensor::zeros_on(y.shape(), DType::F32, &device)?)?;
        root.backward(&loss.grad)?;
        let log = log.lock().unwrap_or_else(PoisonError::into_inner);
        for unit in &log.units {
            assert!(!unit.is_unsharded() && !unit.gather_in_flight());
            assert!(!unit.reduction_in_flight());
        }
        Ok::<_, hypershard_fsdp::FsdpError>(log.seen.clone())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let counter = &counters[0];
    (
        results[0].clone(),
        counter.calls(OpKind::AllGather),
        counter.calls(OpKind::ReduceScatter),
    )
}

#[test]
fn units_gather_before_compute_prefetch_the_next_and_free_after() {
    for device in DEVICES {
        for n in 1usize..6 {
            for sync in [true, false] {
                for policy in [ReshardAfterForward::Reshard, ReshardAfterForward::Keep] {
                    let label = format!("{device:?}, {n} units, sync {sync}, {policy:?}");
                    let reshard = policy == ReshardAfterForward::Reshard;
                    let (seen, gathers, reduces) = step(n, sync, policy, device);
                    // One forward and one backward probe per unit, forward in order and
                    // backward in reverse.
                    let order: Vec<(bool, usize)> =
                        seen.iter().map(|s| (s.backward, s.index)).collect();
                    let want: Vec<(bool, usize)> = (0..n)
                        .map(|g| (false, g))
                        .chain((0..n).rev().map(|g| (true, g)))
                        .collect();
                    assert_eq!(order, want, "{label}");
                    for (i, s) in seen.iter().enumerate() {
                        assert!(s.unsharded[s.index], "{label}: probe {i} ran sharded");
                        let live = s.unsharded.iter().filter(|&&u| u).count();
                        if reshard {
                            assert!(live <= 2, "{label}: {live} units unsharded at probe {i}");
                        }
                        // The unit that runs next was prefetched before this one computed.
                        let next = if s.backward {
                            s.index.checked_sub(1)
                        } else {
                            Some(s.index + 1).filter(|&g| g < n)
                        };
                        let gathers_again = !s.backward || reshard;
                        if let Some(next) = next.filter(|_| gathers_again) {
                            assert!(
                                s.in_flight[next] || s.unsharded[next],
                                "{label}: unit {next} not prefetched at probe {i}"
                            );
                        }
                    }
                    let expected = if reshard { 2 * n } else { n };
                    assert_eq!(gathers, expected as u64, "{label}: all-gathers");
                    assert_eq!(reduces, if sync { n as u64 } else { 0 }, "{label}");
                }
            }
        }
    }
}
