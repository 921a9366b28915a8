//! [`ShmLinks`]: a rank's shared-memory channels, one per co-located peer (by world rank).

use std::sync::atomic::AtomicU32;

use super::channel::ShmPeer;
use super::wait::Watch;
use crate::error::Result;
use crate::transport::tcp::frame::FrameHeader;
use crate::transport::tcp::transport::{Frame, MailboxKey};

/// The shared-memory channels of one rank, by world rank (`None`: that peer uses TCP, or it
/// is this rank itself). Split groups share their world's links, as they share its sockets.
#[derive(Debug)]
pub struct ShmLinks {
    peers: Vec<Option<ShmPeer>>,
}

impl ShmLinks {
    /// Links over the given channels (`peers[p]` leads to world rank `p`).
    pub(crate) fn new(peers: Vec<Option<ShmPeer>>) -> ShmLinks {
        ShmLinks { peers }
    }

    /// The channel to world rank `peer`, when that pair moves data through shared memory.
    pub fn peer(&self, peer: usize) -> Option<&ShmPeer> {
        self.peers.get(peer).and_then(Option::as_ref)
    }

    /// The world ranks this rank reaches through shared memory.
    pub fn shm_peers(&self) -> Vec<usize> {
        self.peers
            .iter()
            .enumerate()
            .filter_map(|(p, channel)| channel.as_ref().map(|_| p))
            .collect()
    }

    /// Sends one message to world rank `peer` (which must have a channel; see
    /// [`ShmLinks::peer`]). While the ring is full, every incoming ring is drained into its
    /// stash, so ranks that all send before receiving make progress.
    pub(crate) fn send(
        &self,
        channel: &ShmPeer,
        header: FrameHeader,
        payload: &[u8],
        watch: &dyn Watch,
    ) -> Result<()> {
        let mut stall = || {
            for incoming in self.peers.iter().flatten() {
                incoming.drain(watch);
            }
        };
        // A message from any peer wakes a sender waiting for the release of a lent payload,
        // which drains it (the receiver may be waiting for this rank's release in turn).
        let doorbells: Vec<&AtomicU32> = if channel.uses_cma() {
            self.peers.iter().flatten().map(ShmPeer::doorbell).collect()
        } else {
            Vec::new()
        };
        channel.send(header, payload, watch, &mut stall, &doorbells)
    }

    /// Takes back every post of op (`group`, `seq`) this thread made, on every channel.
    pub(crate) fn withdraw_op(&self, group: u32, seq: u64) {
        for channel in self.peers.iter().flatten() {
            channel.withdraw_op(group, seq);
        }
    }

    /// Receives the next message under `key` from `channel` as a whole frame.
    pub(crate) fn recv_frame(
        &self,
        channel: &ShmPeer,
        key: MailboxKey,
        watch: &dyn Watch,
    ) -> Result<Frame> {
        channel.recv_frame(key, watch)
    }
}
