//! Recursive-doubling all-reduce for small messages: `log2 p` rounds in which partners
//! `r` and `r ^ 2^k` swap their whole partial results and combine them, instead of the ring's
//! `2 (size - 1)` steps. Non-power-of-two sizes are folded first: with `p` the largest power
//! of two not above `size`, rank `p + i` hands its prepared data to rank `i` before the rounds
//! and gets the finished result back after them.
//!
//! Every rank ends with the same bytes: the two partners of a round combine the same two
//! partials (`combine` is commutative for every reduce op), so by induction all agree.

use super::link::Link;
use crate::error::Result;
use crate::reduce::ReducePlan;

fn copy(dst: &mut [u8], src: &[u8]) -> Result<()> {
    dst.copy_from_slice(src);
    Ok(())
}

/// All-reduces `work` (this rank's prepared contribution) in place and finishes it. Tags
/// `0..` name the rounds: 0 the fold-in, `1 + k` round `k`, and the last the fold-out.
pub(crate) fn all_reduce(link: &Link<'_>, plan: &ReducePlan, work: &mut [u8]) -> Result<()> {
    let (size, rank) = (link.size(), link.rank());
    let dtype = plan.dtype();
    let mut p = 1;
    while p * 2 <= size {
        p *= 2;
    }
    let fold_out_tag = 1 + p.trailing_zeros();
    if rank >= p {
        link.send_data(rank - p, dtype, 0, work)?;
        link.recv_data(rank - p, dtype, fold_out_tag, work, copy)?;
        return Ok(());
    }
    if rank + p < size {
        link.recv_data(rank + p, dtype, 0, work, |acc, incoming| {
            plan.combine(acc, incoming)
        })?;
    }
    let mut incoming = vec![0u8; work.len()];
    let mut mask = 1;
    let mut round = 1u32;
    while mask < p {
        let partner = rank ^ mask;
        link.send_data(partner, dtype, round, work)?;
        link.recv_data(partner, dtype, round, &mut incoming, copy)?;
        plan.combine(work, &incoming)?;
        mask *= 2;
        round += 1;
    }
    plan.finish(work)?;
    if rank + p < size {
        link.send_data(rank + p, dtype, fold_out_tag, work)?;
    }
    Ok(())
}
