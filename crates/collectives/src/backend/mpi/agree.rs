//! Phase 0 of every MPI op: the ranks exchange their op descriptors (the same wire form as the
//! TCP backend's, `tcp::descriptor`) with two nonblocking all-gathers, and every rank runs the
//! same checks (`local::validate`) over the same descriptors. Mismatched lengths, dtypes,
//! roots, reduce ops or counts therefore become the same typed error on every rank instead of
//! MPI's undefined behaviour (a truncation error on one rank and a hang on another).

use std::ffi::c_int;

use mpi::datatype::Equivalence;
use mpi::raw::AsRaw;

use super::communicator::Inner;
use super::raw::{self, read_ptr, write_ptr};
use super::types::{int_blocks, movement_type};
use crate::agree::descriptor::{decode, encode};
use crate::agree::{Desc, Faults, peer_view, validate};
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::{Error, ProtocolViolation, Result};

/// The most bytes one descriptor may have (counts of a large group fit easily; a bigger one is
/// a protocol error rather than an allocation the size of a corrupted length).
const DESCRIPTOR_LIMIT: u64 = 1 << 24;

/// Every rank's descriptor, in rank order, once phase 0 has passed.
pub(crate) struct Agreed {
    pub(crate) descs: Vec<Desc>,
}

/// Exchanges `desc` (with this rank's first local fault, as its peers should report it) and
/// validates every rank's. Returns this rank's own fault first, then the peers' verdict.
pub(crate) fn agree(
    inner: &Inner,
    ctx: &JobContext,
    mut desc: Desc,
    faults: Faults,
) -> Result<Agreed> {
    let op = faults.op;
    let size = inner.size;
    desc.fault = faults
        .first
        .as_ref()
        .map(|error| peer_view(error, op, inner.rank));
    let mine = encode(&desc);
    let lengths = vec![0u64; size];
    let own_length = [mine.len() as u64];
    let u64_type = u64::equivalent_datatype().as_raw();
    let (lengths, _) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Iallgather",
        (lengths, own_length),
        |(lengths, own), call| {
            // SAFETY: `own` holds 1 u64 and `lengths` holds `size` u64s, both owned by `keep`
            // for the whole call; the datatype is u64's.
            unsafe {
                mpi::ffi::MPI_Iallgather(
                    own.as_ptr().cast(),
                    1,
                    u64_type,
                    lengths.as_mut_ptr().cast(),
                    1,
                    u64_type,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    for (peer, &length) in lengths.iter().enumerate() {
        if length > DESCRIPTOR_LIMIT {
            return Err(Error::Protocol {
                peer: Some(peer),
                violation: ProtocolViolation::FrameTooLarge {
                    limit: DESCRIPTOR_LIMIT,
                    got: length,
                },
            });
        }
    }
    let counts: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
    let blocks = int_blocks(op, &counts)?;
    let total: usize = counts.iter().sum();
    let own_count = blocks.counts[inner.rank];
    let byte_type = movement_type(DType::U8);
    let (all, _, _) = raw::run(
        ctx,
        &inner.comm,
        "MPI_Iallgatherv",
        (vec![0u8; total], mine, blocks),
        |(all, mine, blocks), call| {
            // SAFETY: `mine` holds `own_count` bytes; `all` holds sum(counts) bytes laid out by
            // `blocks` (checked to fit c_int); all three live in `keep` until completion.
            unsafe {
                mpi::ffi::MPI_Iallgatherv(
                    read_ptr(mine),
                    own_count,
                    byte_type,
                    write_ptr(all),
                    blocks.counts.as_ptr(),
                    blocks.displs.as_ptr(),
                    byte_type,
                    call.comm,
                    call.request,
                )
            }
        },
    )?;
    let mut descs = Vec::with_capacity(size);
    let mut offset = 0;
    for (peer, &count) in counts.iter().enumerate() {
        let desc = decode(&all[offset..offset + count], peer)?;
        offset += count;
        descs.push(desc);
    }
    let views: Vec<Option<&Desc>> = descs.iter().map(Some).collect();
    validate(inner.rank, ctx.seq, op, &views, faults.first)?;
    Ok(Agreed { descs })
}

/// The `c_int` rank of `rank` (a group never has more than `c_int::MAX` ranks: MPI made it).
pub(crate) fn c_rank(rank: usize) -> c_int {
    // invariant: ranks come from MPI_Comm_rank/size, which are C ints.
    c_int::try_from(rank).unwrap_or(c_int::MAX)
}
