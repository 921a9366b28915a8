//! The bodies of the local backend's ops. Each runs on the rank's progress thread.
//!
//! Every collective follows one pattern: check the local arguments (an error is *posted*, not
//! returned, so the peers learn of it), post phase 0 with a descriptor and the rank's data,
//! [`validate`] the posts, read what this rank needs from its peers' posts, then run one more
//! phase so that every rank is done reading before anyone takes its buffer back.

use std::sync::Arc;

use super::group::{Group, Post, Session, reclaim};
use super::{Inner, LocalComm};
use crate::agree::{Desc, Faults, args, block, copy_into, elements, peer_view, validate};
use crate::buffer::BufferPair;
use crate::buffer::{Buffer, HostBuffer};
use crate::communicator::Communicator;
use crate::engine::JobContext;
use crate::error::{Error, Result};
use crate::op::{AllToAllCounts, BufferRole, OpKind, ReduceOp, block_offsets};

/// Posts phase 0 and validates it. Returns this rank's post (to reclaim its data later) and
/// every rank's phase-0 post.
fn open(
    session: &mut Session<'_>,
    rank: usize,
    mut desc: Desc,
    faults: Faults,
    data: Option<HostBuffer>,
) -> Result<(Arc<Post>, Vec<Arc<Post>>)> {
    let op = faults.op;
    desc.fault = faults.first.as_ref().map(|e| peer_view(e, op, rank));
    let mine = Arc::new(Post {
        desc: Some(desc),
        data,
        group: None,
    });
    let posts = session.exchange(mine.clone())?;
    let descs: Vec<Option<&Desc>> = posts.iter().map(|p| p.desc.as_ref()).collect();
    validate(rank, session.seq(), op, &descs, faults.first)?;
    Ok((mine, posts))
}

/// The payload of a post (empty when it carries none).
fn payload(post: &Post) -> &[u8] {
    post.data.as_ref().map(HostBuffer::as_bytes).unwrap_or(&[])
}

/// The group's size and this rank in it, for the shared argument checks.
fn place(inner: &Inner) -> args::Place {
    args::Place::new(inner.group.size(), inner.rank, super::BACKEND)
}

fn empty_post() -> Arc<Post> {
    Arc::new(Post::empty())
}

pub(super) fn all_reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    op: ReduceOp,
) -> Result<Buffer> {
    let kind = OpKind::AllReduce;
    let size = inner.group.size();
    let args::Single {
        faults,
        desc,
        host,
        plan,
    } = args::all_reduce(place(inner), buffer, op);
    let (dtype, n) = (host.dtype(), host.len());
    let mut session = Session::new(&inner.group, ctx, inner.rank, inner.next_seq());
    let (mine, posts) = open(&mut session, inner.rank, desc, faults, Some(host))?;
    // invariant: a failed plan is a posted fault, and validate returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;

    let (start, end) = block(n, size, inner.rank);
    let mut partial = HostBuffer::zeros(dtype, end - start);
    if end > start {
        let inputs = posts
            .iter()
            .map(|p| elements(kind, payload(p), dtype, start, end - start))
            .collect::<Result<Vec<_>>>()?;
        plan.reduce_many(partial.as_bytes_mut(), &inputs)?;
    }
    drop(posts);
    let partials = session.exchange(Arc::new(Post {
        desc: None,
        data: Some(partial),
        group: None,
    }))?;
    let mut out = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, n));
    for (r, post) in partials.iter().enumerate() {
        copy_into(kind, &mut out, block(n, size, r).0, payload(post))?;
    }
    drop(partials);
    session.finish();
    Ok(Buffer::Host(out))
}

pub(super) fn all_gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::AllGatherV
    } else {
        OpKind::AllGather
    };
    let rank = inner.rank;
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        counts,
        ..
    } = args::all_gather(place(inner), input, output, counts);
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (mine, posts) = open(&mut session, rank, desc, faults, Some(input))?;
    let offsets = block_offsets(&counts);
    for (r, post) in posts.iter().enumerate() {
        copy_into(kind, &mut output, offsets[r], payload(post))?;
    }
    drop(posts);
    session.exchange(empty_post())?;
    let input = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, 0));
    session.finish();
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(super) fn reduce_scatter(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<Vec<usize>>,
    op: ReduceOp,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::ReduceScatterV
    } else {
        OpKind::ReduceScatter
    };
    let rank = inner.rank;
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        counts,
        plan,
    } = args::reduce_scatter(place(inner), input, output, counts, op);
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (mine, posts) = open(&mut session, rank, desc, faults, Some(input))?;
    // invariant: a failed plan is a posted fault, and validate returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let offsets = block_offsets(&counts);
    if counts[rank] > 0 {
        let inputs = posts
            .iter()
            .map(|p| elements(kind, payload(p), dtype, offsets[rank], counts[rank]))
            .collect::<Result<Vec<_>>>()?;
        plan.reduce_many(output.as_bytes_mut(), &inputs)?;
    }
    drop(posts);
    session.exchange(empty_post())?;
    let input = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, 0));
    session.finish();
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(super) fn broadcast(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
) -> Result<Buffer> {
    let kind = OpKind::Broadcast;
    let rank = inner.rank;
    let args::Single {
        faults,
        desc,
        mut host,
        ..
    } = args::broadcast(place(inner), buffer, root);
    let dtype = host.dtype();
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    if rank == root {
        let (mine, posts) = open(&mut session, rank, desc, faults, Some(host))?;
        drop(posts);
        session.exchange(empty_post())?;
        let host = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, 0));
        session.finish();
        return Ok(Buffer::Host(host));
    }
    let (_, posts) = open(&mut session, rank, desc, faults, None)?;
    copy_into(kind, &mut host, 0, payload(&posts[root]))?;
    drop(posts);
    session.exchange(empty_post())?;
    session.finish();
    Ok(Buffer::Host(host))
}

pub(super) fn reduce(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    root: usize,
    op: ReduceOp,
) -> Result<Buffer> {
    let rank = inner.rank;
    let args::Single {
        faults,
        desc,
        host,
        plan,
    } = args::reduce(place(inner), buffer, root, op);
    let (dtype, n) = (host.dtype(), host.len());
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (mine, posts) = open(&mut session, rank, desc, faults, Some(host))?;
    // invariant: a failed plan is a posted fault, and validate returned it above.
    let plan = plan.ok_or(Error::UnsupportedOp { op, dtype })?;
    let result = if rank == root {
        let mut result = HostBuffer::zeros(dtype, n);
        let inputs: Vec<&[u8]> = posts.iter().map(|p| payload(p)).collect();
        plan.reduce_many(result.as_bytes_mut(), &inputs)?;
        Some(result)
    } else {
        None
    };
    drop(posts);
    session.exchange(empty_post())?;
    let own = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, n));
    session.finish();
    Ok(Buffer::Host(result.unwrap_or(own)))
}

pub(super) fn gather(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    root: usize,
) -> Result<BufferPair> {
    let kind = OpKind::Gather;
    let rank = inner.rank;
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        ..
    } = args::gather(place(inner), input, output, root);
    let n = input.len();
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (mine, posts) = open(&mut session, rank, desc, faults, Some(input))?;
    if rank == root {
        for (r, post) in posts.iter().enumerate() {
            copy_into(kind, &mut output, r * n, payload(post))?;
        }
    }
    drop(posts);
    session.exchange(empty_post())?;
    let input = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, n));
    session.finish();
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(super) fn scatter(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    root: usize,
) -> Result<BufferPair> {
    let kind = OpKind::Scatter;
    let rank = inner.rank;
    let args::Pair {
        faults,
        desc,
        input,
        mut output,
        dtype,
        ..
    } = args::scatter(place(inner), input, output, root);
    let n = output.len();
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    if rank == root {
        let (mine, posts) = open(&mut session, rank, desc, faults, Some(input))?;
        let own = elements(kind, payload(&posts[root]), dtype, rank * n, n)?;
        copy_into(kind, &mut output, 0, own)?;
        drop(posts);
        session.exchange(empty_post())?;
        let input = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, 0));
        session.finish();
        return Ok(BufferPair {
            input: Buffer::Host(input),
            output: Buffer::Host(output),
        });
    }
    let (_, posts) = open(&mut session, rank, desc, faults, None)?;
    let block = elements(kind, payload(&posts[root]), dtype, rank * n, n)?;
    copy_into(kind, &mut output, 0, block)?;
    drop(posts);
    session.exchange(empty_post())?;
    session.finish();
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(super) fn all_to_all(
    inner: &Inner,
    ctx: &JobContext,
    input: Buffer,
    output: Buffer,
    counts: Option<AllToAllCounts>,
) -> Result<BufferPair> {
    let kind = if counts.is_some() {
        OpKind::AllToAllV
    } else {
        OpKind::AllToAll
    };
    let (size, rank) = (inner.group.size(), inner.rank);
    let args::AllToAll {
        pair:
            args::Pair {
                faults,
                desc,
                input,
                mut output,
                dtype,
                ..
            },
        ..
    } = args::all_to_all(place(inner), input, output, counts);
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (mine, posts) = open(&mut session, rank, desc, faults, Some(input))?;
    let even = |len: usize| AllToAllCounts {
        send: vec![len / size; size],
        recv: vec![len / size; size],
    };
    // Each rank's counts: its own for the v variant, the even split otherwise.
    let counts_of = |post: &Post| -> AllToAllCounts {
        match post.desc.as_ref().and_then(|d| d.a2a.clone()) {
            Some(counts) => counts,
            None => even(payload(post).len() / dtype.size_bytes()),
        }
    };
    let my_counts = counts_of(&posts[rank]);
    let recv_offsets = block_offsets(&my_counts.recv);
    for (i, post) in posts.iter().enumerate() {
        let theirs = counts_of(post);
        let send_offsets = block_offsets(&theirs.send);
        let block = elements(
            kind,
            payload(post),
            dtype,
            send_offsets[rank],
            theirs.send[rank],
        )?;
        copy_into(kind, &mut output, recv_offsets[i], block)?;
    }
    drop(posts);
    session.exchange(empty_post())?;
    let input = reclaim(mine).unwrap_or_else(|| HostBuffer::zeros(dtype, 0));
    session.finish();
    Ok(BufferPair {
        input: Buffer::Host(input),
        output: Buffer::Host(output),
    })
}

pub(super) fn barrier(inner: &Inner, ctx: &JobContext) -> Result<()> {
    let mut session = Session::new(&inner.group, ctx, inner.rank, inner.next_seq());
    let (_, posts) = open(
        &mut session,
        inner.rank,
        Desc::new(OpKind::Barrier),
        Faults::new(OpKind::Barrier),
        None,
    )?;
    drop(posts);
    session.finish();
    Ok(())
}

pub(super) fn send(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Send;
    let size = inner.group.size();
    if peer >= size {
        return Err(Error::InvalidRank {
            op,
            rank: peer,
            size,
        });
    }
    ctx.check(Some(peer))?;
    let location = buffer.location();
    let host = buffer.into_host().map_err(|_| Error::UnsupportedBuffer {
        op,
        location,
        backend: super::BACKEND,
    })?;
    inner.group.deposit(inner.rank, peer, tag, host.clone());
    Ok(Buffer::Host(host))
}

pub(super) fn recv(
    inner: &Inner,
    ctx: &JobContext,
    buffer: Buffer,
    peer: usize,
    tag: u32,
) -> Result<Buffer> {
    let op = OpKind::Recv;
    let size = inner.group.size();
    if peer >= size {
        return Err(Error::InvalidRank {
            op,
            rank: peer,
            size,
        });
    }
    let location = buffer.location();
    let mut host = buffer.into_host().map_err(|_| Error::UnsupportedBuffer {
        op,
        location,
        backend: super::BACKEND,
    })?;
    let message = inner.group.take(ctx, peer, inner.rank, tag)?;
    if message.dtype() != host.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            role: BufferRole::Message,
            expected: host.dtype(),
            got: message.dtype(),
        });
    }
    if message.len() != host.len() {
        return Err(Error::LengthMismatch {
            op,
            role: BufferRole::Message,
            expected: host.len(),
            got: message.len(),
        });
    }
    host.as_bytes_mut().copy_from_slice(message.as_bytes());
    Ok(Buffer::Host(host))
}

pub(super) fn split(
    inner: &Inner,
    ctx: &JobContext,
    color: Option<u32>,
    key: i64,
) -> Result<Option<Arc<dyn Communicator>>> {
    let kind = OpKind::Split;
    let rank = inner.rank;
    let split_index = inner
        .splits
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut desc = Desc::new(kind);
    desc.split = Some((color, key));
    let mut session = Session::new(&inner.group, ctx, rank, inner.next_seq());
    let (_, posts) = open(&mut session, rank, desc, Faults::new(kind), None)?;
    // Members of this rank's color, ordered by (key, old rank) as MPI_Comm_split orders them.
    let members: Vec<usize> = match color {
        None => Vec::new(),
        Some(_) => {
            let mut members: Vec<(i64, usize)> = posts
                .iter()
                .enumerate()
                .filter_map(|(r, p)| match p.desc.as_ref().and_then(|d| d.split) {
                    Some((c, k)) if c == color => Some((k, r)),
                    _ => None,
                })
                .collect();
            members.sort_unstable();
            members.into_iter().map(|(_, r)| r).collect()
        }
    };
    drop(posts);
    let leader = members.first().copied();
    let post = if leader == Some(rank) {
        Arc::new(Post {
            desc: None,
            data: None,
            group: Some(Arc::new(Group::new(members.len()))),
        })
    } else {
        empty_post()
    };
    let groups = session.exchange(post)?;
    let (Some(color), Some(leader)) = (color, leader) else {
        session.finish();
        return Ok(None);
    };
    let group = groups[leader].group.clone().ok_or(Error::PeerLost {
        op: kind,
        peer: leader,
    })?;
    drop(groups);
    session.finish();
    // invariant: `members` holds this rank, since its own color matched itself above.
    let new_rank = members.iter().position(|&r| r == rank).unwrap_or(0);
    let name = format!("{}/c{color}#{split_index}", inner.name);
    let comm = LocalComm::new(group, new_rank, inner.config.clone(), name)?;
    Ok(Some(Arc::new(comm)))
}
