//! Recursive halving-doubling all-reduce (Rabenseifner's algorithm) for medium messages:
//! a reduce-scatter by recursive halving, then an all-gather by recursive doubling. Each rank
//! sends and receives `2 (p - 1) / p` of the vector, like the ring, but in `2 log2 p` rounds
//! instead of `2 (p - 1)` steps.
//!
//! The vector is cut into `p` blocks ([`even_block`]), `p` the largest power of two not above
//! the group size. In halving round `k` (distance `d = p / 2^(k+1)`), partners `r` and `r ^ d`
//! split their current window of blocks in two: the rank whose bit `d` is clear keeps the
//! lower half, the other the upper half; each sends the half it gives up and combines the
//! partner's copy of the half it keeps. After `log2 p` rounds rank `r` holds block `r`, fully
//! combined; it finishes it, and the doubling rounds (distance `1, 2, ..`) swap ever larger
//! windows until every rank has the whole vector. Each block is combined by exactly one rank
//! and then copied, so every rank ends with the same bytes. Non-power-of-two sizes fold in
//! first as in [`doubling`](super::doubling): rank `p + i` hands its prepared vector to rank
//! `i` and gets the result back at the end.
//!
//! Tags: 0 the fold-in, `1..=log2 p` the halving rounds, then the doubling rounds, then the
//! fold-out.

use std::ops::Range;

use super::doubling::power_of_two_below;
use super::link::{Exchange, Link};
use crate::blocks::{even_block, send_and_recv_views};
use crate::error::Result;
use crate::reduce::ReducePlan;

/// All-reduces `work` (this rank's prepared contribution) in place and finishes it.
pub(crate) fn all_reduce(link: &Link<'_>, plan: &ReducePlan, work: &mut [u8]) -> Result<()> {
    let (size, rank) = (link.size(), link.rank());
    let dtype = plan.dtype();
    let element = dtype.size_bytes();
    let n = work.len() / element;
    let p = power_of_two_below(size);
    let rounds = p.trailing_zeros();
    let fold_out_tag = 2 * rounds + 1;
    if rank >= p {
        link.send_data(rank - p, dtype, 0, work)?;
        link.recv_copy(rank - p, dtype, fold_out_tag, work, |_| Ok(()))?;
        return Ok(());
    }
    if rank + p < size {
        link.recv_data(rank + p, dtype, 0, work, |acc, incoming| {
            plan.combine(acc, incoming)
        })?;
    }
    // The bytes of blocks `lo..hi` (a window always holds at least one block).
    let window = |(lo, hi): (usize, usize)| -> Range<usize> {
        even_block(n, p, lo).0 * element..even_block(n, p, hi - 1).1 * element
    };
    let (mut lo, mut hi) = (0, p);
    let mut distance = p / 2;
    let mut tag = 1u32;
    while distance >= 1 {
        let partner = rank ^ distance;
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if rank & distance == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        let (outgoing, incoming) = send_and_recv_views(work, window(give), window(keep));
        let step = Exchange {
            to: partner,
            from: partner,
            dtype,
            tag,
            outgoing,
        };
        link.exchange(step, incoming, |acc, segment| plan.combine(acc, segment))?;
        (lo, hi) = keep;
        distance /= 2;
        tag += 1;
    }
    plan.finish(&mut work[window((lo, hi))])?;
    let mut distance = 1;
    while distance < p {
        let partner = rank ^ distance;
        let width = hi - lo;
        let theirs = if rank & distance == 0 {
            (hi, hi + width)
        } else {
            (lo - width, lo)
        };
        let (outgoing, incoming) = send_and_recv_views(work, window((lo, hi)), window(theirs));
        let step = Exchange {
            to: partner,
            from: partner,
            dtype,
            tag,
            outgoing,
        };
        link.exchange_copy(step, incoming)?;
        (lo, hi) = (lo.min(theirs.0), hi.max(theirs.1));
        distance *= 2;
        tag += 1;
    }
    if rank + p < size {
        link.send_data(rank + p, dtype, fold_out_tag, work)?;
    }
    Ok(())
}
