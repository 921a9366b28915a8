//! Phase-0 checks of every backend: every rank runs the same checks over the same
//! descriptors, so every rank reaches the same verdict and nobody is left waiting.

use super::Desc;
use crate::error::{Error, Result};
use crate::op::{Argument, BufferRole, OpKind};

/// How this rank's peers report one of its local argument errors: the same error, pointing at
/// the peer's buffer. Errors that have no peer form become [`Error::PeerLost`].
pub(crate) fn peer_view(error: &Error, op: OpKind, peer: usize) -> Error {
    match error {
        Error::LengthMismatch {
            op, expected, got, ..
        } => Error::LengthMismatch {
            op: *op,
            role: BufferRole::Peer { rank: peer },
            expected: *expected,
            got: *got,
        },
        Error::DTypeMismatch {
            op, expected, got, ..
        } => Error::DTypeMismatch {
            op: *op,
            role: BufferRole::Peer { rank: peer },
            expected: *expected,
            got: *got,
        },
        Error::InvalidRank { op, rank, size } => Error::InvalidRank {
            op: *op,
            rank: *rank,
            size: *size,
        },
        Error::UnsupportedOp { op, dtype } => Error::UnsupportedOp {
            op: *op,
            dtype: *dtype,
        },
        Error::UnsupportedBuffer {
            op,
            location,
            backend,
        } => Error::UnsupportedBuffer {
            op: *op,
            location: *location,
            backend,
        },
        _ => Error::PeerLost { op, peer },
    }
}

/// Checks the phase-0 descriptors of collective `seq` on rank `me`, whose own local error (if
/// any) is `my_fault`. `posts[p]` is rank `p`'s descriptor (`None` when its phase-0 post
/// carried none). Rank 0's descriptor is the reference.
pub(crate) fn validate(
    me: usize,
    seq: u64,
    op: OpKind,
    posts: &[Option<&Desc>],
    my_fault: Option<Error>,
) -> Result<()> {
    let descs: Vec<&Desc> = posts.iter().filter_map(|p| *p).collect();
    let Some(&reference) = descs.first() else {
        return Err(Error::PeerLost { op, peer: 0 });
    };
    if descs.len() != posts.len() {
        // invariant: every phase-0 post carries a descriptor; report the first that lacks one.
        let peer = posts.iter().position(Option::is_none).unwrap_or(0);
        return Err(Error::PeerLost { op, peer });
    }
    if let Some(peer) = descs.iter().position(|d| d.op != reference.op) {
        let (theirs, peer) = if peer == me {
            (reference.op, 0)
        } else {
            (descs[peer].op, peer)
        };
        return Err(Error::OpMismatch {
            seq,
            ours: descs[me].op,
            theirs,
            peer,
        });
    }
    if let Some(fault) = my_fault {
        return Err(fault);
    }
    if let Some((peer, fault)) = descs
        .iter()
        .enumerate()
        .find_map(|(p, d)| d.fault.as_ref().map(|f| (p, f)))
    {
        return Err(peer_view(fault, op, peer));
    }
    for (peer, desc) in descs.iter().enumerate().skip(1) {
        if let (Some(expected), Some(got)) = (reference.dtype, desc.dtype)
            && expected != got
        {
            return Err(Error::DTypeMismatch {
                op,
                role: BufferRole::Peer { rank: peer },
                expected,
                got,
            });
        }
        if let (Some(expected), Some(got)) = (reference.len, desc.len)
            && expected != got
        {
            return Err(Error::LengthMismatch {
                op,
                role: BufferRole::Peer { rank: peer },
                expected,
                got,
            });
        }
        let mismatch = |argument| Error::ArgumentMismatch {
            op,
            argument,
            peer,
            reference: 0,
        };
        if desc.root != reference.root {
            return Err(mismatch(Argument::Root));
        }
        if desc.reduce != reference.reduce {
            return Err(mismatch(Argument::ReduceOp));
        }
        if desc.counts != reference.counts {
            return Err(mismatch(Argument::Counts));
        }
        if let (Some(expected), Some(got)) = (reference.knobs, desc.knobs)
            && let Some(knob) = expected.first_difference(&got)
        {
            return Err(mismatch(Argument::AlgorithmKnob(knob)));
        }
    }
    // All-to-all-v: what rank i sends to rank j must be what rank j expects from rank i.
    for (i, sender) in descs.iter().enumerate() {
        let Some(sent) = &sender.a2a else { continue };
        for (j, receiver) in descs.iter().enumerate() {
            let Some(received) = &receiver.a2a else {
                continue;
            };
            if sent.send.get(j) != received.recv.get(i) {
                return Err(Error::ArgumentMismatch {
                    op,
                    argument: Argument::Counts,
                    peer: j,
                    reference: i,
                });
            }
        }
    }
    Ok(())
}
