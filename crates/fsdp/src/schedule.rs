//! The schedule one root shares with every unit below it: the order units ran in, the
//! reductions in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::error::Result;
use crate::group::{ParamGroup, PendingReduce};

/// A unit as the schedule knows it.
#[derive(Clone)]
pub(crate) struct ScheduledUnit {
    pub id: usize,
    pub group: Arc<Mutex<ParamGroup>>,
}

#[derive(Default)]
struct ScheduleState {
    /// Every unit, root first, then the nested ones in pre-order.
    units: Vec<ScheduledUnit>,
    /// The order of pre-forward hooks in the last completed forward (for forward prefetch).
    last_forward_order: Vec<usize>,
    /// The order of pre-forward hooks in the current forward.
    forward_order: Vec<usize>,
    /// The order of post-forward hooks in the current forward; reversed, it is the order of
    /// backward hooks (for backward prefetch).
    post_forward_order: Vec<usize>,
    /// Reductions issued and not yet finished, oldest first.
    pending: VecDeque<(Arc<Mutex<ParamGroup>>, PendingReduce)>,
    /// Whether the root's backward has begun and no forward has begun since: a nested unit's
    /// forward now is a recomputation (activation checkpointing), not a new step.
    in_backward: bool,
}

/// Shared by a root and every unit it discovered.
#[derive(Default)]
pub(crate) struct Schedule {
    state: Mutex<ScheduleState>,
}

/// Locks a group; a poisoned lock only means a panic elsewhere, and the group's data is still
/// consistent at every unlock, so the poison is ignored.
pub(crate) fn lock(group: &Mutex<ParamGroup>) -> MutexGuard<'_, ParamGroup> {
    group.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Schedule {
    fn state(&self) -> MutexGuard<'_, ScheduleState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn register(&self, unit: ScheduledUnit) {
        let mut state = self.state();
        if !state.units.iter().any(|u| u.id == unit.id) {
            state.units.push(unit);
        }
    }

    pub fn units(&self) -> Vec<ScheduledUnit> {
        self.state().units.clone()
    }

    fn unit(&self, id: usize) -> Option<ScheduledUnit> {
        self.state().units.iter().find(|u| u.id == id).cloned()
    }

    /// At the root's pre-forward: finish leftovers of an earlier backward and start a fresh
    /// order record.
    pub fn begin_forward(&self) -> Result<()> {
        self.drain()?;
        let mut state = self.state();
        if !state.forward_order.is_empty() {
            state.last_forward_order = std::mem::take(&mut state.forward_order);
        }
        state.post_forward_order.clear();
        state.in_backward = false;
        Ok(())
    }

    /// At the root's pre-backward: from now until the next forward, nested forwards are
    /// recomputations.
    pub fn begin_backward(&self) {
        self.state().in_backward = true;
    }

    /// Whether the root's backward is running (or ran, with no forward since).
    pub fn in_backward(&self) -> bool {
        self.state().in_backward
    }

    pub fn record_pre_forward(&self, id: usize) {
        self.state().forward_order.push(id);
    }

    pub fn record_post_forward(&self, id: usize) {
        self.state().post_forward_order.push(id);
    }

    /// The unit expected to run its forward after `id`: from the last forward's order when
    /// one completed, else from registration (pre-order) order.
    pub fn next_in_forward(&self, id: usize) -> Option<ScheduledUnit> {
        let next = {
            let state = self.state();
            let order: Vec<usize> = if state.last_forward_order.is_empty() {
                state.units.iter().map(|u| u.id).collect()
            } else {
                state.last_forward_order.clone()
            };
            order
                .iter()
                .position(|&u| u == id)
                .and_then(|i| order.get(i + 1).copied())
        };
        next.and_then(|n| self.unit(n))
    }

    /// The unit expected to run its backward after `id`: the one before it in post-forward
    /// order.
    pub fn next_in_backward(&self, id: usize) -> Option<ScheduledUnit> {
        let next = {
            let state = self.state();
            let order = &state.post_forward_order;
            order
                .iter()
                .position(|&u| u == id)
                .and_then(|i| i.checked_sub(1))
                .map(|i| order[i])
        };
        next.and_then(|n| self.unit(n))
    }

    pub fn push_pending(&self, group: Arc<Mutex<ParamGroup>>, pending: PendingReduce) {
        self.state().pending.push_back((group, pending));
    }

    /// Finishes every reduction in flight, oldest first.
    pub fn finish_pending(&self) -> Result<()> {
        loop {
            // Take one entry and drop the schedule lock before locking the group, so the
            // lock order is always schedule → nothing, group → nothing.
            let next = self.state().pending.pop_front();
            let Some((group, pending)) = next else {
                return Ok(());
            };
            lock(&group).finish_reduce(pending)?;
        }
    }

    /// Finishes all reductions and discards unconsumed prefetches (root, after the last
    /// backward, and before a new forward).
    pub fn drain(&self) -> Result<()> {
        let _span = tracing::debug_span!("fsdp.drain").entered();
        self.finish_pending()?;
        for unit in self.units() {
            lock(&unit.group).discard_pending_gather()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hypershard_nn::{Linear, LinearConfig};
    use hypershard_tensor::DType;

    use super::{Schedule, ScheduledUnit};
    use crate::{DataParallelMesh, FsdpModule, FullyShardConfig, fully_shard};

    /// `n` one-Linear units on a world of 1, registered with a fresh schedule in id order.
    fn scheduled(n: usize) -> crate::Result<(Schedule, Vec<FsdpModule>)> {
        let comm = hypershard_collectives::local::spawn_world(1)?.remove(0);
        let mesh = DataParallelMesh::fsdp(comm)?;
        let schedule = Schedule::default();
        let mut units = Vec::new();
        for id in 0..n {
            let linear = Linear::new(LinearConfig {
                in_features: 2,
                out_features: 3,
                bias: true,
                dtype: DType::F32,
                seed: id as u64,
            })?;
            let unit = fully_shard(Box::new(linear), FullyShardConfig::new(mesh.clone()))?;
            schedule.register(ScheduledUnit {
                id,
                group: Arc::clone(unit.group_arc()),
            });
            units.push(unit);
        }
        Ok((schedule, units))
    }

    fn next_forward(schedule: &Schedule, id: usize) -> Option<usize> {
        schedule.next_in_forward(id).map(|u| u.id)
    }

    fn next_backward(schedule: &Schedule, id: usize) -> Option<usize> {
        schedule.next_in_backward(id).map(|u| u.id)
    }

    #[test]
    fn forward_prefetch_follows_registration_then_the_last_forward() -> crate::Result<()> {
        let (schedule, _units) = scheduled(4)?;
        // Registering a unit twice keeps one entry.
        let again = schedule.units()[2].clone();
        schedule.register(again);
        assert_eq!(schedule.units().len(), 4);
        // Before any forward completed: pre-order (registration) order.
        assert_eq!(
            (0..4)
                .map(|id| next_forward(&schedule, id))
                .collect::<Vec<_>>(),
            vec![Some(1), Some(2), Some(3), None]
        );
        // A forward that ran the units in another order is the order of the next one.
        schedule.begin_forward()?;
        for id in [0, 3, 1, 2] {
            schedule.record_pre_forward(id);
        }
        schedule.begin_forward()?;
        assert_eq!(next_forward(&schedule, 0), Some(3));
        assert_eq!(next_forward(&schedule, 3), Some(1));
        assert_eq!(next_forward(&schedule, 2), None);
        // An unknown unit has no successor.
        assert_eq!(next_forward(&schedule, 9), None);
        Ok(())
    }

    #[test]
    fn backward_prefetch_is_the_reverse_post_forward_order() -> crate::Result<()> {
        let (schedule, _units) = scheduled(3)?;
        schedule.begin_forward()?;
        for id in [0, 1, 2] {
            schedule.record_pre_forward(id);
            schedule.record_post_forward(id);
        }
        assert!(!schedule.in_backward());
        schedule.begin_backward();
        assert!(schedule.in_backward());
        assert_eq!(next_backward(&schedule, 2), Some(1));
        assert_eq!(next_backward(&schedule, 1), Some(0));
        assert_eq!(next_backward(&schedule, 0), None);
        // A new forward ends the backward and forgets the post-forward order.
        schedule.begin_forward()?;
        assert!(!schedule.in_backward());
        assert_eq!(next_backward(&schedule, 2), None);
        Ok(())
    }

    #[test]
    fn draining_with_nothing_in_flight_is_a_no_op() -> crate::Result<()> {
        let (schedule, units) = scheduled(2)?;
        schedule.drain()?;
        schedule.finish_pending()?;
        assert!(units.iter().all(|u| !u.handle().gather_in_flight()));
        Ok(())
    }
}
