//! Host-side planning of FSDP on device: which Linear layers form a parameter group, where
//! each parameter's shard sits in a rank's block of the group's flat buffer, the copy ranges
//! that move parameters in and out of that buffer, and whether collectives take device
//! buffers. Nothing here touches CUDA, so CI checks it on machines without a GPU.
//!
//! The layout is the CPU FSDP's, from the same code: each parameter is cut along dim 0 by
//! [`ShardLayout`] (`torch.chunk`, every slot padded to the chunk size with zeros), and the
//! slots of a group's parameters are packed into one block per rank by [`plan_buckets`]
//! (offsets aligned to 64 bytes), exactly as a CPU `fully_shard` unit of the same parameters
//! fuses them into one all-gather.

use hypershard_tensor::DType;
use hypershard_tensor::cuda::FlatRange;

use super::error::{DeviceFsdpError, DeviceFsdpResult};
use crate::bucket::{BucketItem, plan_buckets};
use crate::layout::ShardLayout;

/// Where collectives of FSDP on device take their buffers from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Staging {
    /// Device buffers when the communicator takes them (the NCCL backend), else host
    /// buffers.
    #[default]
    Auto,
    /// Always device buffers: an error at construction for a backend that takes host buffers
    /// only.
    Device,
    /// Always host buffers: every collective's input is copied to host memory, and its output
    /// back to the device (the NCCL backend accepts host buffers too, and stages them itself).
    Host,
}

/// Decides whether collectives run on device buffers: `accepts_device` says whether the
/// communicator (of backend `backend`, on rank `rank`) takes them.
pub(crate) fn uses_device_buffers(
    staging: Staging,
    accepts_device: bool,
    backend: &'static str,
    rank: usize,
) -> DeviceFsdpResult<bool> {
    match (staging, accepts_device) {
        (Staging::Auto, accepts) => Ok(accepts),
        (Staging::Device, true) => Ok(true),
        (Staging::Device, false) => {
            Err(DeviceFsdpError::DeviceBuffersUnsupported { rank, backend })
        }
        (Staging::Host, _) => Ok(false),
    }
}

/// One Linear layer as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LinearShape {
    /// The layer's index in the `Sequential` (its parameters are `{index}.weight`, ...).
    pub layer: usize,
    /// Output features (the weight's rows, the bias's length).
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

/// One parameter of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MemberPlan {
    /// The CPU model's dotted name (`0.weight`, `0.bias`, ...).
    pub name: String,
    /// Its dim-0 layout over the world (the shape is the CPU shape: `[out, in]` or `[out]`).
    pub layout: ShardLayout,
    /// Its slot's element offset inside every rank's block.
    pub offset: usize,
}

impl MemberPlan {
    /// Elements per unit of dim 0 (a weight row, or 1 for a bias).
    fn row(&self) -> usize {
        self.layout.shape.iter().skip(1).product()
    }

    /// The number of elements of the unsharded parameter.
    #[cfg(test)]
    pub fn numel(&self) -> usize {
        self.layout.shape.iter().product()
    }
}

/// One parameter group: the Linear layers whose parameters share one flat buffer, one
/// all-gather per unshard and one reduce-scatter per backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupPlan {
    /// The layers (indices into the `Sequential`), in order.
    pub layers: Vec<usize>,
    /// The parameters, layer by layer: weight then bias. A copy's part `i` is member `i`.
    pub members: Vec<MemberPlan>,
    /// Elements in one rank's block (the shard each rank keeps); the flat buffer of the whole
    /// group is `world × per_rank`.
    pub per_rank: usize,
    /// The number of ranks.
    pub world: usize,
}

impl GroupPlan {
    /// The elements of the unsharded flat buffer (every rank's block).
    pub fn flat_numel(&self) -> usize {
        self.world * self.per_rank
    }

    /// The ranges between the unsharded parameters and the full flat buffer: for every member
    /// and every rank, the rank's dim-0 shard of the parameter (a contiguous range of it) and
    /// its place in that rank's block. Copy-out of these rebuilds the parameters from an
    /// all-gather output; copy-in of the gradients builds a reduce-scatter input (whose
    /// padding the caller zeroes). Empty shards give no range.
    pub fn unshard_ranges(&self) -> DeviceFsdpResult<Vec<FlatRange>> {
        let mut ranges = Vec::with_capacity(self.members.len() * self.world);
        for (part, member) in self.members.iter().enumerate() {
            for rank in 0..self.world {
                if let Some(range) = self.range(part, member, rank, rank * self.per_rank)? {
                    ranges.push(range);
                }
            }
        }
        Ok(ranges)
    }

    /// The ranges between the unsharded parameters and `rank`'s own block (its shard, offsets
    /// relative to the block's start): copy-in of the full parameters through these cuts the
    /// shard at initialisation.
    pub fn shard_ranges(&self, rank: usize) -> DeviceFsdpResult<Vec<FlatRange>> {
        let mut ranges = Vec::with_capacity(self.members.len());
        for (part, member) in self.members.iter().enumerate() {
            if let Some(range) = self.range(part, member, rank, 0)? {
                ranges.push(range);
            }
        }
        Ok(ranges)
    }

    /// Member `part`'s range for shard `rank`, whose block starts at element `block`.
    fn range(
        &self,
        part: usize,
        member: &MemberPlan,
        rank: usize,
        block: usize,
    ) -> DeviceFsdpResult<Option<FlatRange>> {
        let span = member.layout.span(rank)?;
        let row = member.row();
        let len = span.len * row;
        Ok((len > 0).then_some(FlatRange {
            part,
            start: span.offset * row,
            len,
            flat: block + member.offset,
        }))
    }
}

/// Cuts `linears` into groups of `layers_per_group` consecutive layers (the last may be
/// shorter) and plans each group's block for `world` ranks, in `dtype` (the sharded
/// parameters' dtype, which sets the 64-byte alignment of the slots).
pub(crate) fn plan_groups(
    linears: &[LinearShape],
    layers_per_group: usize,
    world: usize,
    dtype: DType,
    rank: usize,
) -> DeviceFsdpResult<Vec<GroupPlan>> {
    if layers_per_group == 0 {
        return Err(DeviceFsdpError::ZeroGroupSize { rank });
    }
    let mut groups = Vec::with_capacity(linears.len().div_ceil(layers_per_group));
    for chunk in linears.chunks(layers_per_group) {
        let mut members = Vec::with_capacity(2 * chunk.len());
        for linear in chunk {
            members.push(MemberPlan {
                name: format!("{}.weight", linear.layer),
                layout: ShardLayout {
                    shape: vec![linear.out_features, linear.in_features],
                    dim: 0,
                    world,
                },
                offset: 0,
            });
            if linear.bias {
                members.push(MemberPlan {
                    name: format!("{}.bias", linear.layer),
                    layout: ShardLayout {
                        shape: vec![linear.out_features],
                        dim: 0,
                        world,
                    },
                    offset: 0,
                });
            }
        }
        let items = members
            .iter()
            .enumerate()
            .map(|(index, member)| {
                Ok(BucketItem {
                    index,
                    dtype,
                    slot_numel: member.layout.slot_numel()?,
                })
            })
            .collect::<DeviceFsdpResult<Vec<_>>>()?;
        // One dtype and no cap: exactly one bucket, the group's block.
        let plan = plan_buckets(&items, true, usize::MAX);
        let (per_rank, offsets) = match plan.as_slice() {
            [bucket] => (bucket.per_rank, bucket.offsets.clone()),
            _ => (0, Vec::new()),
        };
        let layers: Vec<usize> = chunk.iter().map(|l| l.layer).collect();
        if per_rank == 0 {
            return Err(DeviceFsdpError::EmptyGroup { rank, layers });
        }
        for (member, offset) in members.iter_mut().zip(offsets) {
            member.offset = offset;
        }
        groups.push(GroupPlan {
            layers,
            members,
            per_rank,
            world,
        });
    }
    Ok(groups)
}

/// Whether a group's parameters are gathered, as the schedule sees it (an all-gather in
/// flight counts as sharded until its [`Action::Unshard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// Only the shard exists.
    Sharded,
    /// The Linear layers hold the gathered parameters.
    Unsharded,
}

/// One step of a forward or backward pass over the groups, in the order the model runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Issue group `g`'s all-gather (copy-in and the collective, left in flight).
    Gather(usize),
    /// Wait for group `g`'s all-gather (issuing it first if it was not) and copy its
    /// parameters out of the flat buffer.
    Unshard(usize),
    /// Run group `g`'s layers (in reverse for the backward).
    Compute(usize),
    /// Copy group `g`'s gradients into a flat buffer and issue its reduce-scatter.
    Reduce(usize),
    /// Free group `g`'s gathered parameters.
    Reshard(usize),
}

/// The order of collectives and computation of FSDP on device, decided on the host from the
/// groups' state, so that the model runs exactly what the unit tests check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// Issue the next group's all-gather before computing the current one.
    pub prefetch: bool,
    /// Free each group but the last after its forward.
    pub reshard_after_forward: bool,
}

impl Schedule {
    /// The forward pass, groups in order; `held` is updated to the state after it.
    pub fn forward(&self, held: &mut [Held]) -> Vec<Action> {
        let n = held.len();
        let mut actions = Vec::with_capacity(4 * n);
        let mut issued = vec![false; n];
        for g in 0..n {
            self.unshard(g, held, &mut issued, &mut actions);
            if self.prefetch && g + 1 < n {
                Self::prefetch(g + 1, held, &mut issued, &mut actions);
            }
            actions.push(Action::Compute(g));
            if self.reshard_after_forward && g + 1 < n {
                actions.push(Action::Reshard(g));
                held[g] = Held::Sharded;
            }
        }
        actions
    }

    /// The backward pass, groups in reverse; every group ends sharded, with its gradients
    /// reduce-scattered when `sync`.
    pub fn backward(&self, held: &mut [Held], sync: bool) -> Vec<Action> {
        let n = held.len();
        let mut actions = Vec::with_capacity(5 * n);
        let mut issued = vec![false; n];
        for g in (0..n).rev() {
            self.unshard(g, held, &mut issued, &mut actions);
            if self.prefetch && g > 0 {
                Self::prefetch(g - 1, held, &mut issued, &mut actions);
            }
            actions.push(Action::Compute(g));
            if sync {
                actions.push(Action::Reduce(g));
            }
            actions.push(Action::Reshard(g));
            held[g] = Held::Sharded;
        }
        actions
    }

    fn unshard(&self, g: usize, held: &mut [Held], issued: &mut [bool], actions: &mut Vec<Action>) {
        if held[g] == Held::Sharded {
            if !issued[g] {
                actions.push(Action::Gather(g));
            }
            actions.push(Action::Unshard(g));
            held[g] = Held::Unsharded;
            issued[g] = false;
        }
    }

    fn prefetch(g: usize, held: &[Held], issued: &mut [bool], actions: &mut Vec<Action>) {
        if held[g] == Held::Sharded && !issued[g] {
            actions.push(Action::Gather(g));
            issued[g] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypershard_tensor::Tensor;

    fn linear(layer: usize, in_features: usize, out_features: usize) -> LinearShape {
        LinearShape {
            layer,
            out_features,
            in_features,
            bias: true,
        }
    }

    /// The widths of the device parity test: 37 → 53 → 53 → 53 → 37, none divisible by 2 or 3.
    fn parity_model() -> Vec<LinearShape> {
        vec![
            linear(0, 37, 53),
            linear(2, 53, 53),
            linear(4, 53, 53),
            linear(6, 53, 37),
        ]
    }

    #[test]
    fn staging_follows_the_backend() {
        assert!(uses_device_buffers(Staging::Auto, true, "nccl", 0).unwrap());
        assert!(!uses_device_buffers(Staging::Auto, false, "local", 0).unwrap());
        assert!(uses_device_buffers(Staging::Device, true, "nccl", 0).unwrap());
        assert!(!uses_device_buffers(Staging::Host, true, "nccl", 0).unwrap());
        match uses_device_buffers(Staging::Device, false, "tcp", 2) {
            Err(DeviceFsdpError::DeviceBuffersUnsupported { rank: 2, backend }) => {
                assert_eq!(backend, "tcp")
            }
            other => panic!("{other:?}"),
        }
        // The real decision for host-only backends: a local communicator takes no device
        // buffers.
        let comm = hypershard_collectives::local::spawn_world(1)
            .unwrap()
            .remove(0);
        assert!(!hypershard_collectives::nccl::DeviceBuffer::accepted_by(
            comm.as_ref()
        ));
    }

    #[test]
    fn groups_cut_consecutive_layers() {
        let groups = plan_groups(&parity_model(), 3, 2, DType::F32, 0).unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].layers, vec![0, 2, 4]);
        assert_eq!(groups[1].layers, vec![6]);
        let names: Vec<&str> = groups[0].members.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"
            ]
        );
        assert!(matches!(
            plan_groups(&parity_model(), 0, 2, DType::F32, 1),
            Err(DeviceFsdpError::ZeroGroupSize { rank: 1 })
        ));
        let empty = [LinearShape {
            layer: 0,
            out_features: 0,
            in_features: 4,
            bias: false,
        }];
        assert!(matches!(
            plan_groups(&empty, 1, 2, DType::F32, 0),
            Err(DeviceFsdpError::EmptyGroup { .. })
        ));
    }

    #[test]
    fn blocks_follow_the_cpu_layout() {
        // Layer 0 (weight [53, 37], bias [53]) over 3 ranks: chunks of 18 rows (18, 18, 17),
        // so the weight slot is 18 · 37 = 666 elements, the bias slot 18, and the bias starts
        // at the next multiple of 16 f32 (64 bytes): 672.
        let groups = plan_groups(&parity_model()[..1], 1, 3, DType::F32, 0).unwrap();
        let group = &groups[0];
        assert_eq!(group.members[0].offset, 0);
        assert_eq!(group.members[1].offset, 672);
        assert_eq!(group.per_rank, 672 + 18);
        assert_eq!(group.flat_numel(), 3 * 690);
        // In bf16 the alignment is 32 elements: 666 → 672 as well.
        let bf16 = plan_groups(&parity_model()[..1], 1, 3, DType::BF16, 0).unwrap();
        assert_eq!(bf16[0].members[1].offset, 672);
    }

    #[test]
    fn ranges_rebuild_every_parameter_from_the_blocks() {
        // For worlds that do and do not divide the widths, a host simulation of the device
        // copies: cut each rank's block through `shard_ranges`, lay the blocks side by side
        // (the all-gather), and copy every parameter back out through `unshard_ranges`. The
        // blocks must also equal the CPU FSDP's packing of the same parameters
        // (`ShardLayout::pack_from_full` into each slot), padding zero.
        for world in [1usize, 2, 3, 4, 5] {
            for per_group in [1usize, 2, 4] {
                let groups = plan_groups(&parity_model(), per_group, world, DType::F32, 0).unwrap();
                for group in &groups {
                    let params: Vec<Vec<f32>> = group
                        .members
                        .iter()
                        .enumerate()
                        .map(|(m, member)| {
                            (0..member.numel())
                                .map(|i| (1000 * m + i) as f32 + 0.5)
                                .collect()
                        })
                        .collect();
                    let mut flat = vec![0.0f32; group.flat_numel()];
                    for rank in 0..world {
                        let block = &mut flat[rank * group.per_rank..(rank + 1) * group.per_rank];
                        for range in group.shard_ranges(rank).unwrap() {
                            block[range.flat..range.flat + range.len].copy_from_slice(
                                &params[range.part][range.start..range.start + range.len],
                            );
                        }
                        // The CPU FSDP's slots of this rank.
                        for (m, member) in group.members.iter().enumerate() {
                            let full =
                                Tensor::from_vec(params[m].clone(), &member.layout.shape).unwrap();
                            let slot = member.layout.slot_numel().unwrap();
                            let mut bytes = vec![0u8; slot * 4];
                            member
                                .layout
                                .pack_from_full(&full, rank, DType::F32, &mut bytes)
                                .unwrap();
                            let cpu: Vec<f32> = bytes
                                .chunks_exact(4)
                                .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                                .collect();
                            assert_eq!(
                                &block[member.offset..member.offset + slot],
                                cpu.as_slice(),
                                "world {world}, {}, rank {rank}",
                                member.name
                            );
                        }
                    }
                    let mut rebuilt: Vec<Vec<f32>> =
                        params.iter().map(|p| vec![f32::NAN; p.len()]).collect();
                    let ranges = group.unshard_ranges().unwrap();
                    for range in &ranges {
                        rebuilt[range.part][range.start..range.start + range.len]
                            .copy_from_slice(&flat[range.flat..range.flat + range.len]);
                    }
                    assert_eq!(rebuilt, params, "world {world}, {per_group} per group");
                    // Every flat element outside the ranges is padding, and zero.
                    let mut covered = vec![false; flat.len()];
                    for range in &ranges {
                        covered[range.flat..range.flat + range.len].fill(true);
                    }
                    for (i, value) in flat.iter().enumerate() {
                        assert!(covered[i] || *value == 0.0, "world {world}: element {i}");
                    }
                }
            }
        }
    }
    /// Runs one forward and one backward from all-sharded and checks the schedule's
    /// invariants: every computation sees its group gathered, every unshard consumes one
    /// gather, prefetches come before the computation they overlap, at most two groups are
    /// gathered at once, and everything ends sharded.
    #[test]
    fn schedule_gathers_before_compute_and_frees_after() {
        for n in 1usize..6 {
            for prefetch in [false, true] {
                for reshard_after_forward in [false, true] {
                    for sync in [false, true] {
                        let schedule = Schedule {
                            prefetch,
                            reshard_after_forward,
                        };
                        let mut held = vec![Held::Sharded; n];
                        let forward = schedule.forward(&mut held);
                        let after_forward = held.clone();
                        let backward = schedule.backward(&mut held, sync);
                        let label = format!(
                            "{n} groups, prefetch {prefetch}, reshard {reshard_after_forward}, sync {sync}"
                        );
                        assert_eq!(held, vec![Held::Sharded; n], "{label}");
                        let gathers = |a: &[Action]| {
                            a.iter().filter(|x| matches!(x, Action::Gather(_))).count()
                        };
                        let reduces = backward
                            .iter()
                            .filter(|x| matches!(x, Action::Reduce(_)))
                            .count();
                        // The counts the device test asserts per step.
                        let expected = if reshard_after_forward { 2 * n - 1 } else { n };
                        assert_eq!(gathers(&forward) + gathers(&backward), expected, "{label}");
                        assert_eq!(gathers(&forward), n, "{label}");
                        assert_eq!(reduces, if sync { n } else { 0 }, "{label}");
                        assert!(!forward.iter().any(|x| matches!(x, Action::Reduce(_))));
                        // Only the last group stays gathered after the forward when resharding.
                        for (g, state) in after_forward.iter().enumerate() {
                            let kept = !reshard_after_forward || g + 1 == n;
                            assert_eq!(*state == Held::Unsharded, kept, "{label}: group {g}");
                        }
                        let mut gathered = vec![false; n];
                        let mut in_flight = vec![false; n];
                        let mut computed = Vec::new();
                        let mut seen_reduce = vec![false; n];
                        for (pass, actions) in [(0, &forward), (1, &backward)] {
                            for (i, action) in actions.iter().enumerate() {
                                match *action {
                                    Action::Gather(g) => {
                                        assert!(!gathered[g] && !in_flight[g], "{label}: {i}");
                                        in_flight[g] = true;
                                    }
                                    Action::Unshard(g) => {
                                        assert!(
                                            in_flight[g],
                                            "{label}: unshard {g} without gather"
                                        );
                                        in_flight[g] = false;
                                        gathered[g] = true;
                                    }
                                    Action::Compute(g) => {
                                        assert!(gathered[g], "{label}: compute {g} sharded");
                                        computed.push((pass, g));
                                        if prefetch {
                                            // The group computed next is gathered or in flight.
                                            let next = if pass == 0 {
                                                (g + 1 < n).then_some(g + 1)
                                            } else {
                                                g.checked_sub(1)
                                            };
                                            if let Some(next) = next {
                                                assert!(
                                                    gathered[next] || in_flight[next],
                                                    "{label}: no prefetch of {next} before {g}"
                                                );
                                            }
                                        }
                                    }
                                    Action::Reduce(g) => {
                                        assert_eq!(pass, 1);
                                        assert_eq!(computed.last(), Some(&(1, g)), "{label}");
                                        assert!(!seen_reduce[g]);
                                        seen_reduce[g] = true;
                                    }
                                    Action::Reshard(g) => {
                                        assert!(gathered[g], "{label}: reshard {g} twice");
                                        gathered[g] = false;
                                    }
                                }
                                let live = gathered.iter().filter(|&&x| x).count()
                                    + in_flight.iter().filter(|&&x| x).count();
                                if reshard_after_forward {
                                    assert!(live <= 2, "{label}: {live} groups gathered at once");
                                }
                            }
                        }
                        let order: Vec<(usize, usize)> = (0..n)
                            .map(|g| (0, g))
                            .chain((0..n).rev().map(|g| (1, g)))
                            .collect();
                        assert_eq!(computed, order, "{label}");
                        assert!(
                            in_flight.iter().all(|x| !x),
                            "{label}: a gather left in flight"
                        );
                    }
                }
            }
        }
        // A second step from the state the first left behind runs the same actions.
        let schedule = Schedule {
            prefetch: true,
            reshard_after_forward: true,
        };
        let mut held = vec![Held::Sharded; 4];
        let first = schedule.forward(&mut held);
        schedule.backward(&mut held, true);
        assert_eq!(schedule.forward(&mut held), first);
        assert_eq!(
            first,
            vec![
                Action::Gather(0),
                Action::Unshard(0),
                Action::Gather(1),
                Action::Compute(0),
                Action::Reshard(0),
                Action::Unshard(1),
                Action::Gather(2),
                Action::Compute(1),
                Action::Reshard(1),
                Action::Unshard(2),
                Action::Gather(3),
                Action::Compute(2),
                Action::Reshard(2),
                Action::Unshard(3),
                Action::Compute(3),
            ]
        );
    }
}
