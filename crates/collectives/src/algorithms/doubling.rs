//! Recursive-doubling all-reduce for small messages: `log2 p` rounds in which partners
//! `r` and `r ^ 2^k` swap their whole partial results and combine them, instead of the ring's
//! `2 (size - 1)` steps. Non-power-of-two sizes are folded first: with `p` the largest power
//! of two not above `size`, rank `p + i` hands its prepared data to rank `i` before the rounds
//! and gets the finished result back after them.
//!
//! Every rank ends with the same bytes: the two partners of a round combine the same two
//! partials (`combine` is commutative for every reduce op), so by induction all agree.

use super::link::Link;
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::ReducePlan;

/// The largest power of two not above `size` (at least 1).
pub(crate) fn power_of_two_below(size: usize) -> usize {
    let mut p = 1;
    while p * 2 <= size {
        p *= 2;
    }
    p
}

/// Sends this rank's first message of the algorithm if its first action is a send (the
/// fold-in of a rank `>= p`, or round 0 of a rank without a fold partner), and says whether
/// it did. The latency path calls it while phase 0 is still in flight; `work` must already
/// be prepared.
pub(crate) fn first_send(link: &Link<'_>, dtype: DType, work: &[u8]) -> Result<bool> {
    let (size, rank) = (link.size(), link.rank());
    let p = power_of_two_below(size);
    if rank >= p {
        link.send_data(rank - p, dtype, 0, work)?;
        return Ok(true);
    }
    if rank + p < size || p == 1 {
        return Ok(false);
    }
    link.send_data(rank ^ 1, dtype, 1, work)?;
    Ok(true)
}

/// All-reduces `work` (this rank's prepared contribution) in place and finishes it. Tags
/// `0..` name the rounds: 0 the fold-in, `1 + k` round `k`, and the last the fold-out.
/// `first_sent` says that [`first_send`] already sent this rank's first message.
pub(crate) fn all_reduce(
    link: &Link<'_>,
    plan: &ReducePlan,
    work: &mut [u8],
    first_sent: bool,
) -> Result<()> {
    let (size, rank) = (link.size(), link.rank());
    let dtype = plan.dtype();
    let p = power_of_two_below(size);
    let fold_out_tag = 1 + p.trailing_zeros();
    if rank >= p {
        if !first_sent {
            link.send_data(rank - p, dtype, 0, work)?;
        }
        link.recv_copy(rank - p, dtype, fold_out_tag, work, |_| Ok(()))?;
        return Ok(());
    }
    if rank + p < size {
        link.recv_data(rank + p, dtype, 0, work, |acc, incoming| {
            plan.combine(acc, incoming)
        })?;
    }
    let mut mask = 1;
    let mut round = 1u32;
    while mask < p {
        let partner = rank ^ mask;
        if !(first_sent && round == 1) {
            link.send_data(partner, dtype, round, work)?;
        }
        // The whole vector is already with the kernel, so the partner's segments can be
        // combined straight into it.
        link.recv_data(partner, dtype, round, work, |acc, incoming| {
            plan.combine(acc, incoming)
        })?;
        mask *= 2;
        round += 1;
    }
    plan.finish(work)?;
    if rank + p < size {
        link.send_data(rank + p, dtype, fold_out_tag, work)?;
    }
    Ok(())
}
