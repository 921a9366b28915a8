//! The TCP backend's collective algorithms over the transports, one algorithm per file.
//!
//! * `group`: [`Inner`](group::Inner), the state of one group that every op reads.
//! * `link`: one op's view of its group (sequence number, deadline, frames to and from
//!   peers, through TCP or shared memory) and its phase-0 exchange.
//! * `ring`: ring reduce-scatter, all-gather and all-reduce, and the all-reduce choice;
//!   `doubling`: recursive doubling (small all-reduces); `halving`: Rabenseifner's
//!   halving-doubling.
//! * `broadcast`: the chain broadcast and the choice; `tree`: the binomial tree.
//! * `alltoall`: pairwise all-to-all; `rooted`: direct gather, scatter and reduce;
//!   `barrier`: the dissemination barrier; `p2p`: tagged send and receive.
//!
//! This folder sits above agreement and the transports and below the backends.

pub(crate) mod alltoall;
pub(crate) mod barrier;
pub(crate) mod broadcast;
mod doubling;
pub(crate) mod group;
mod halving;
pub(crate) mod link;
pub(crate) mod p2p;
pub(crate) mod ring;
pub(crate) mod rooted;
mod tree;
