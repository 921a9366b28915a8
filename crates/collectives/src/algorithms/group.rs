//! [`Inner`]: the state of one TCP group that every op of it reads (its transport and
//! shared-memory links, members, algorithm knobs, sequence numbers and scratch memory),
//! shared between the communicator handle and its progress thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::agree::AlgorithmKnobs;
use crate::buffer::HostBuffer;
use crate::config::CommConfig;
use crate::dtype::DType;
use crate::error::Error;
use crate::op::BufferRole;
use crate::progress::{GroupSlot, ProgressBoard};
use crate::transport::shm::ShmLinks;
use crate::transport::tcp::config::{AllReduceAlgorithm, BroadcastAlgorithm};
use crate::transport::tcp::transport::Transport;

/// The backend name reported by [`Communicator::backend`](crate::Communicator::backend).
pub const BACKEND: &str = "tcp";

/// The group id of the world communicator.
pub(crate) const WORLD_GROUP: u32 = 0;

/// What a rank's jobs need, shared between the handle and its progress thread.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) transport: Arc<Transport>,
    /// The id every frame of this group carries.
    pub(crate) group_id: u32,
    /// `members[r]` is the world rank of group rank `r`.
    pub(crate) members: Vec<usize>,
    /// This rank in the group.
    pub(crate) rank: usize,
    pub(crate) config: CommConfig,
    pub(crate) segment_bytes: usize,
    pub(crate) all_reduce: AllReduceAlgorithm,
    pub(crate) small_all_reduce_bytes: usize,
    pub(crate) halving_doubling_bytes: usize,
    pub(crate) broadcast: BroadcastAlgorithm,
    pub(crate) tree_broadcast_bytes: usize,
    /// The world's shared-memory channels (split groups share them, as they share the
    /// sockets), when any peer is reached through shared memory.
    pub(crate) shm: Option<Arc<ShmLinks>>,
    pub(crate) name: String,
    pub(crate) next_collective: AtomicU64,
    /// How many splits this rank has made, for deriving the children's group ids.
    pub(crate) splits: AtomicU64,
    /// The process's progress board (shared by the world and its splits) and this group's
    /// slot on it, marked at every op's start and end for the stall watchdog.
    pub(crate) board: Arc<ProgressBoard>,
    pub(crate) slot: Arc<GroupSlot>,
    /// Working memory reused by every op of this group (ops run one at a time on the
    /// progress thread, so the lock is never contended). Fresh large allocations fault in
    /// every page, which on small VMs costs more than moving the data over loopback, so a
    /// reduce-scatter keeps its working copy here instead of allocating one per call.
    pub(crate) scratch: Mutex<HostBuffer>,
}

impl Inner {
    /// The knobs this group runs with, as every phase-0 descriptor carries them.
    pub(crate) fn algorithm_knobs(&self) -> AlgorithmKnobs {
        AlgorithmKnobs {
            segment_bytes: self.segment_bytes as u64,
            all_reduce: all_reduce_code(self.all_reduce),
            small_all_reduce_bytes: self.small_all_reduce_bytes as u64,
            halving_doubling_bytes: self.halving_doubling_bytes as u64,
            broadcast: broadcast_code(self.broadcast),
            tree_broadcast_bytes: self.tree_broadcast_bytes as u64,
        }
    }

    /// Runs `job` on `len` bytes of this group's scratch memory (64-byte aligned, contents
    /// unspecified), growing it first if it is smaller.
    pub(crate) fn with_scratch<T>(&self, len: usize, job: impl FnOnce(&mut [u8]) -> T) -> T {
        let mut scratch = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if scratch.byte_len() < len {
            *scratch = HostBuffer::zeros(DType::U8, len);
        }
        job(&mut scratch.as_bytes_mut()[..len])
    }

    /// An error about peers as the user sees it: the ops of a split group work in group
    /// ranks, but a message must name the rank the user can find (its global rank, the
    /// `RANK` of its process), so every peer an error names is mapped to the world here.
    pub(crate) fn global_view(&self, error: Error) -> Error {
        if self.group_id == WORLD_GROUP {
            return error;
        }
        let global = |rank: usize| self.members.get(rank).copied().unwrap_or(rank);
        let role = |role: BufferRole| match role {
            BufferRole::Peer { rank } => BufferRole::Peer { rank: global(rank) },
            other => other,
        };
        match error {
            Error::PeerLost { op, peer } => Error::PeerLost {
                op,
                peer: global(peer),
            },
            Error::Timeout { op, after, peer } => Error::Timeout {
                op,
                after,
                peer: peer.map(global),
            },
            Error::Protocol { peer, violation } => Error::Protocol {
                peer: peer.map(global),
                violation,
            },
            Error::ArgumentMismatch {
                op,
                argument,
                peer,
                reference,
            } => Error::ArgumentMismatch {
                op,
                argument,
                peer: global(peer),
                reference: global(reference),
            },
            Error::OpMismatch {
                seq,
                ours,
                theirs,
                peer,
            } => Error::OpMismatch {
                seq,
                ours,
                theirs,
                peer: global(peer),
            },
            Error::LengthMismatch {
                op,
                role: r,
                expected,
                got,
            } => Error::LengthMismatch {
                op,
                role: role(r),
                expected,
                got,
            },
            Error::DTypeMismatch {
                op,
                role: r,
                expected,
                got,
            } => Error::DTypeMismatch {
                op,
                role: role(r),
                expected,
                got,
            },
            other => other,
        }
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.next_collective.fetch_add(1, Ordering::Relaxed)
    }
}

/// The wire code of an all-reduce algorithm choice in [`AlgorithmKnobs`].
fn all_reduce_code(algorithm: AllReduceAlgorithm) -> u8 {
    match algorithm {
        AllReduceAlgorithm::Auto => 0,
        AllReduceAlgorithm::Ring => 1,
        AllReduceAlgorithm::RecursiveDoubling => 2,
        AllReduceAlgorithm::HalvingDoubling => 3,
    }
}

/// The wire code of a broadcast algorithm choice in [`AlgorithmKnobs`].
fn broadcast_code(algorithm: BroadcastAlgorithm) -> u8 {
    match algorithm {
        BroadcastAlgorithm::Auto => 0,
        BroadcastAlgorithm::Chain => 1,
        BroadcastAlgorithm::Tree => 2,
    }
}
