//! `split` without `ncclCommSplit`: the ranks agree on the new groups through the [`Store`]
//! and each new group's first rank publishes a fresh NCCL unique id for the others.
//!
//! cudarc has no safe `ncclCommSplit`, and going through the store keeps the same code for the
//! world and every split: each rank writes its `(color, key)`, reads everyone's, and computes
//! the same [`SplitPlan`] (ordering like `MPI_Comm_split`: by `(key, old rank)`).

use std::time::Duration;

use crate::error::{Error, ProtocolViolation, Result};
use crate::rendezvous::Store;

/// The length of an NCCL unique id (`ncclUniqueId::internal`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// What one rank passed to `split`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitEntry {
    pub color: Option<u32>,
    pub key: i64,
}

impl SplitEntry {
    /// 13 bytes: a presence flag, the color, the key (little-endian).
    pub fn encode(self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(13);
        bytes.push(u8::from(self.color.is_some()));
        bytes.extend_from_slice(&self.color.unwrap_or(0).to_le_bytes());
        bytes.extend_from_slice(&self.key.to_le_bytes());
        bytes
    }

    /// The inverse of [`encode`](Self::encode); a malformed value is a protocol error.
    pub fn decode(bytes: &[u8], peer: usize) -> Result<SplitEntry> {
        let bad = || Error::Protocol {
            peer: Some(peer),
            violation: ProtocolViolation::BadDescriptor { at: bytes.len() },
        };
        let [flag, rest @ ..] = bytes else {
            return Err(bad());
        };
        let (color, key) = rest.split_at_checked(4).ok_or_else(bad)?;
        let color = u32::from_le_bytes(color.try_into().map_err(|_| bad())?);
        let key = i64::from_le_bytes(key.try_into().map_err(|_| bad())?);
        match flag {
            0 => Ok(SplitEntry { color: None, key }),
            1 => Ok(SplitEntry {
                color: Some(color),
                key,
            }),
            _ => Err(bad()),
        }
    }
}

/// This rank's new group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    pub color: u32,
    /// This rank's index in the new group.
    pub rank: usize,
    /// The parent ranks of the new group, in new-rank order.
    pub members: Vec<usize>,
}

/// The new group of parent rank `rank` given every rank's entry, or `None` for no color.
pub(crate) fn split_plan(entries: &[SplitEntry], rank: usize) -> Option<SplitPlan> {
    let color = entries.get(rank)?.color?;
    let mut members: Vec<(i64, usize)> = entries
        .iter()
        .enumerate()
        .filter(|(_, entry)| entry.color == Some(color))
        .map(|(parent, entry)| (entry.key, parent))
        .collect();
    members.sort_unstable();
    let members: Vec<usize> = members.into_iter().map(|(_, parent)| parent).collect();
    let new_rank = members.iter().position(|&parent| parent == rank)?;
    Some(SplitPlan {
        color,
        rank: new_rank,
        members,
    })
}

/// Publishes this rank's entry under `prefix` and returns every rank's, in rank order.
pub(crate) fn exchange_entries(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    size: usize,
    entry: SplitEntry,
    timeout: Duration,
) -> Result<Vec<SplitEntry>> {
    store.set(&format!("{prefix}/entry/{rank}"), &entry.encode())?;
    (0..size)
        .map(|peer| {
            let bytes = store.get(&format!("{prefix}/entry/{peer}"), timeout)?;
            SplitEntry::decode(&bytes, peer)
        })
        .collect()
}

/// The group's unique id: rank 0 makes it with `make` and publishes it under `key`; the
/// others wait for it. A value of the wrong length is a protocol error, never a short id.
pub(crate) fn exchange_id(
    store: &dyn Store,
    key: &str,
    rank: usize,
    timeout: Duration,
    make: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES]>,
) -> Result<[u8; UNIQUE_ID_BYTES]> {
    if rank == 0 {
        let id = make()?;
        store.set(key, &id)?;
        return Ok(id);
    }
    let bytes = store.get(key, timeout)?;
    bytes.as_slice().try_into().map_err(|_| Error::Protocol {
        peer: Some(0),
        violation: ProtocolViolation::PayloadLengthMismatch {
            declared: UNIQUE_ID_BYTES as u64,
            actual: bytes.len() as u64,
        },
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::rendezvous::MemoryStore;

    #[test]
    fn entries_round_trip_and_reject_garbage() {
        for entry in [
            SplitEntry {
                color: Some(7),
                key: -3,
            },
            SplitEntry {
                color: None,
                key: i64::MAX,
            },
        ] {
            assert_eq!(SplitEntry::decode(&entry.encode(), 1).unwrap(), entry);
        }
        assert!(SplitEntry::decode(&[1, 2, 3], 2).is_err());
        let mut bad_flag = SplitEntry {
            color: None,
            key: 0,
        }
        .encode();
        bad_flag[0] = 9;
        assert!(SplitEntry::decode(&bad_flag, 2).is_err());
    }

    #[test]
    fn plan_orders_by_key_then_parent_rank() {
        let e = |color: Option<u32>, key: i64| SplitEntry { color, key };
        let entries = [
            e(Some(1), 5),
            e(Some(2), 0),
            e(Some(1), -1),
            e(None, 0),
            e(Some(1), 5),
        ];
        assert_eq!(
            split_plan(&entries, 0),
            Some(SplitPlan {
                color: 1,
                rank: 1,
                members: vec![2, 0, 4]
            })
        );
        assert_eq!(split_plan(&entries, 4).unwrap().rank, 2);
        assert_eq!(
            split_plan(&entries, 1),
            Some(SplitPlan {
                color: 2,
                rank: 0,
                members: vec![1]
            })
        );
        assert_eq!(split_plan(&entries, 3), None);
    }

    #[test]
    fn ranks_agree_on_groups_and_ids_through_a_store() {
        // Five "ranks" as threads: colors by parity, keys reversing the order; each new group's
        // first rank makes an id from its color, the others must read exactly that id.
        let store = Arc::new(MemoryStore::new());
        let size = 5;
        let timeout = Duration::from_secs(10);
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let store = Arc::clone(&store);
                thread::spawn(move || {
                    let entry = SplitEntry {
                        color: Some((rank % 2) as u32),
                        key: -(rank as i64),
                    };
                    let entries =
                        exchange_entries(store.as_ref(), "g/s0", rank, size, entry, timeout)
                            .unwrap();
                    let plan = split_plan(&entries, rank).unwrap();
                    let key = format!("g/s0/color/{}/id", plan.color);
                    let id = exchange_id(store.as_ref(), &key, plan.rank, timeout, || {
                        Ok([plan.color as u8 + 40; UNIQUE_ID_BYTES])
                    })
                    .unwrap();
                    (plan, id)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (rank, (plan, id)) in results.iter().enumerate() {
            assert_eq!(plan.color, (rank % 2) as u32);
            let expected_members: Vec<usize> = if rank % 2 == 0 {
                vec![4, 2, 0]
            } else {
                vec![3, 1]
            };
            assert_eq!(plan.members, expected_members);
            assert_eq!(plan.members[plan.rank], rank);
            assert_eq!(*id, [plan.color as u8 + 40; UNIQUE_ID_BYTES]);
        }
    }

    #[test]
    fn a_short_id_is_a_protocol_error() {
        let store = MemoryStore::new();
        store.set("id", &[1, 2, 3]).unwrap();
        let result = exchange_id(&store, "id", 1, Duration::from_secs(1), || {
            Ok([0; UNIQUE_ID_BYTES])
        });
        assert!(matches!(
            result,
            Err(Error::Protocol {
                peer: Some(0),
                violation: ProtocolViolation::PayloadLengthMismatch {
                    declared: 128,
                    actual: 3
                }
            })
        ));
    }
}
