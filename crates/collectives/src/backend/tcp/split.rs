//! `split`: the (color, key) of every rank travel in the phase-0 descriptors (an all-gather),
//! every member of a color orders the members by (key, old rank) as `MPI_Comm_split` does,
//! and the child reuses the parent's sockets under a group id that every member derives
//! alike from the parent's id, the parent's split count and the color.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::communicator::TcpCommunicator;
use crate::agree::{Desc, Faults};
use crate::algorithms::group::Inner;
use crate::algorithms::link::Link;
use crate::communicator::Communicator;
use crate::engine::JobContext;
use crate::error::Result;
use crate::op::OpKind;

/// The child's group id: a 32-bit FNV-1a hash of (parent id, split index, color), never the
/// world's id 0. Every member computes the same value without talking.
fn child_group_id(parent: u32, split_index: u64, color: u32) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    let bytes = parent
        .to_le_bytes()
        .into_iter()
        .chain(split_index.to_le_bytes())
        .chain(color.to_le_bytes());
    for byte in bytes {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash.max(1)
}

pub(crate) fn split(
    inner: &Inner,
    ctx: &JobContext,
    color: Option<u32>,
    key: i64,
) -> Result<Option<Arc<dyn Communicator>>> {
    let kind = OpKind::Split;
    let split_index = inner.splits.fetch_add(1, Ordering::Relaxed);
    let link = Link::collective(inner, ctx, kind);
    let mut desc = Desc::new(kind);
    desc.split = Some((color, key));
    let descs = link.open(desc, Faults::new(kind))?;
    let Some(color) = color else {
        return Ok(None);
    };
    let mut members: Vec<(i64, usize)> = descs
        .iter()
        .enumerate()
        .filter_map(|(r, d)| match d.split {
            Some((Some(c), k)) if c == color => Some((k, r)),
            _ => None,
        })
        .collect();
    members.sort_unstable();
    // invariant: this rank's own descriptor has its color, so it is among the members.
    let new_rank = members
        .iter()
        .position(|&(_, r)| r == inner.rank)
        .unwrap_or(0);
    let world_members = members.iter().map(|&(_, r)| inner.members[r]).collect();
    let group_id = child_group_id(inner.group_id, split_index, color);
    let name = format!("{}/c{color}#{split_index}", inner.name);
    let child = TcpCommunicator::child(inner, group_id, world_members, new_rank, name)?;
    Ok(Some(Arc::new(child)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_differ_by_parent_split_and_color_and_avoid_the_world() {
        let ids = [
            child_group_id(0, 0, 0),
            child_group_id(0, 0, 1),
            child_group_id(0, 1, 0),
            child_group_id(7, 0, 0),
        ];
        for (i, a) in ids.iter().enumerate() {
            assert_ne!(*a, 0);
            for b in &ids[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(child_group_id(3, 2, 1), child_group_id(3, 2, 1));
    }
}
