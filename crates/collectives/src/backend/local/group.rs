//! The shared state of one local group: rendezvous rounds for collectives and mailboxes for
//! point-to-point messages, behind one mutex and condition variable.
//!
//! A collective with sequence number `seq` runs as numbered *phases*. In each phase every rank
//! posts an `Arc<Post>` and waits until all `size` ranks have posted; then each takes clones of
//! all posts. A rank drops its clones before it posts the next phase, and the slot forgets a
//! phase's posts once every rank has collected them, so after phase `p + 1` completes the posts
//! of phase `p` are held only by their authors — which is how a rank gets its input buffer back
//! without copying ([`reclaim`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::agree::Desc;
use crate::buffer::HostBuffer;
use crate::engine::JobContext;
use crate::error::{Error, Result};

/// One rank's contribution to one phase.
#[derive(Debug)]
pub(crate) struct Post {
    pub(crate) desc: Option<Desc>,
    pub(crate) data: Option<HostBuffer>,
    pub(crate) group: Option<Arc<Group>>,
}

impl Post {
    pub(crate) fn empty() -> Self {
        Post {
            desc: None,
            data: None,
            group: None,
        }
    }
}

/// Why a round was given up.
#[derive(Clone, Copy, Debug)]
enum AbandonCause {
    /// A rank's deadline passed while it waited.
    Timeout,
    /// A rank aborted or failed mid-op.
    Left,
}

#[derive(Clone, Copy, Debug)]
struct Abandon {
    by: usize,
    cause: AbandonCause,
}

#[derive(Debug)]
struct Phase {
    posts: Vec<Option<Arc<Post>>>,
    posted: usize,
    collected: usize,
}

#[derive(Debug)]
struct Round {
    phases: Vec<Phase>,
    abandoned: Option<Abandon>,
    left: usize,
}

impl Round {
    fn phase_mut(&mut self, phase: usize, size: usize) -> &mut Phase {
        while self.phases.len() <= phase {
            self.phases.push(Phase {
                posts: (0..size).map(|_| None).collect(),
                posted: 0,
                collected: 0,
            });
        }
        &mut self.phases[phase]
    }
}

#[derive(Debug, Default)]
struct GroupState {
    rounds: HashMap<u64, Round>,
    aborted: Vec<bool>,
    mailboxes: HashMap<(usize, usize, u32), VecDeque<HostBuffer>>,
}

/// The state the ranks of one local group share.
#[derive(Debug)]
pub(crate) struct Group {
    size: usize,
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl Group {
    pub(crate) fn new(size: usize) -> Self {
        Group {
            size,
            state: Mutex::new(GroupState {
                aborted: vec![false; size],
                ..GroupState::default()
            }),
            changed: Condvar::new(),
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Locks the state. Every update below leaves the state consistent before it can panic
    /// (they do not panic), so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks `rank` aborted and wakes every waiter, so its peers stop waiting for it.
    pub(crate) fn abort_rank(&self, rank: usize) {
        let mut state = self.lock();
        if let Some(flag) = state.aborted.get_mut(rank) {
            *flag = true;
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Deposits a copy of a message (eager send: never waits for the receiver).
    pub(crate) fn deposit(&self, from: usize, to: usize, tag: u32, message: HostBuffer) {
        self.lock()
            .mailboxes
            .entry((from, to, tag))
            .or_default()
            .push_back(message);
        self.changed.notify_all();
    }

    /// Takes the oldest message from `from` to `to` with `tag`, waiting until the deadline.
    pub(crate) fn take(
        &self,
        ctx: &JobContext,
        from: usize,
        to: usize,
        tag: u32,
    ) -> Result<HostBuffer> {
        let mut state = self.lock();
        loop {
            if let Some(message) = state
                .mailboxes
                .get_mut(&(from, to, tag))
                .and_then(VecDeque::pop_front)
            {
                return Ok(message);
            }
            if state.aborted.get(to).copied().unwrap_or(false) {
                return Err(Error::Aborted { op: ctx.op });
            }
            if state.aborted.get(from).copied().unwrap_or(false) {
                return Err(Error::PeerLost {
                    op: ctx.op,
                    peer: from,
                });
            }
            ctx.check(Some(from))?;
            let left = ctx.time_left();
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// One rank's participation in one collective round. Dropping it leaves the round; a session
/// dropped before [`Session::finish`] marks the round abandoned so its peers stop waiting.
pub(crate) struct Session<'a> {
    group: &'a Arc<Group>,
    ctx: &'a JobContext,
    rank: usize,
    seq: u64,
    phase: usize,
    finished: bool,
}

impl<'a> Session<'a> {
    pub(crate) fn new(group: &'a Arc<Group>, ctx: &'a JobContext, rank: usize, seq: u64) -> Self {
        Session {
            group,
            ctx,
            rank,
            seq,
            phase: 0,
            finished: false,
        }
    }

    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Posts `post` for the next phase and returns every rank's post of that phase, in rank
    /// order, once all have posted.
    pub(crate) fn exchange(&mut self, post: Arc<Post>) -> Result<Vec<Arc<Post>>> {
        let phase = self.phase;
        self.phase += 1;
        let size = self.group.size;
        let (me, op, seq) = (self.rank, self.ctx.op, self.seq);
        let mut state = self.group.lock();
        let complete = {
            let round = state.rounds.entry(seq).or_insert_with(|| Round {
                phases: Vec::new(),
                abandoned: None,
                left: 0,
            });
            let slot = round.phase_mut(phase, size);
            slot.posts[me] = Some(post);
            slot.posted += 1;
            // Waiters only care about a complete phase (or abandonment and aborts, which
            // notify on their own): waking all ranks on every post would cost size² wake-ups.
            slot.posted == size
        };
        if complete {
            self.group.changed.notify_all();
        }
        loop {
            let my_abort = state.aborted[me] || self.ctx.is_aborted();
            let aborted = state.aborted.clone();
            // invariant: the round is removed only after every rank left it, and this rank
            // has not left; the fallback error keeps the code total all the same.
            let Some(round) = state.rounds.get_mut(&seq) else {
                return Err(Error::Aborted { op });
            };
            if my_abort {
                retract(round.phase_mut(phase, size), me);
                round.abandoned = Some(Abandon {
                    by: me,
                    cause: AbandonCause::Left,
                });
                drop(state);
                self.group.changed.notify_all();
                return Err(Error::Aborted { op });
            }
            let abandoned = round.abandoned;
            let slot = round.phase_mut(phase, size);
            if slot.posted == size {
                let posts: Vec<Arc<Post>> = slot.posts.iter().flatten().cloned().collect();
                slot.collected += 1;
                if slot.collected == size {
                    slot.posts.iter_mut().for_each(|p| *p = None);
                }
                return Ok(posts);
            }
            if let Some(abandon) = abandoned {
                // The abandoner retracted its post; report the rank that was really missing
                // when there is one, else the abandoner itself.
                let missing = (0..size).find(|&r| r != abandon.by && slot.posts[r].is_none());
                return Err(match (abandon.cause, missing) {
                    (AbandonCause::Timeout, Some(peer)) => Error::Timeout {
                        op,
                        after: self.ctx.timeout,
                        peer: Some(peer),
                    },
                    _ => Error::PeerLost {
                        op,
                        peer: abandon.by,
                    },
                });
            }
            if let Some(peer) = (0..size).find(|&r| slot.posts[r].is_none() && aborted[r]) {
                round.abandoned = Some(Abandon {
                    by: peer,
                    cause: AbandonCause::Left,
                });
                drop(state);
                self.group.changed.notify_all();
                return Err(Error::PeerLost { op, peer });
            }
            let left = self.ctx.time_left();
            if left.is_zero() {
                let missing = (0..size).find(|&r| slot.posts[r].is_none());
                retract(slot, me);
                round.abandoned = Some(Abandon {
                    by: me,
                    cause: AbandonCause::Timeout,
                });
                drop(state);
                self.group.changed.notify_all();
                return Err(Error::Timeout {
                    op,
                    after: self.ctx.timeout,
                    peer: missing,
                });
            }
            state = self
                .group
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Marks the op as completed normally on this rank.
    pub(crate) fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let size = self.group.size;
        let mut state = self.group.lock();
        let mut abandoned_now = false;
        if let Some(round) = state.rounds.get_mut(&self.seq) {
            if !self.finished && round.abandoned.is_none() {
                round.abandoned = Some(Abandon {
                    by: self.rank,
                    cause: AbandonCause::Left,
                });
                abandoned_now = true;
            }
            round.left += 1;
            if round.left >= size {
                state.rounds.remove(&self.seq);
            }
        }
        drop(state);
        if abandoned_now {
            self.group.changed.notify_all();
        }
    }
}

/// Withdraws `rank`'s post from an incomplete phase, so that a late peer does not complete the
/// phase with a rank that has already given up.
fn retract(slot: &mut Phase, rank: usize) {
    if slot.posted < slot.posts.len() && slot.posts[rank].take().is_some() {
        slot.posted -= 1;
    }
}

/// Takes back the buffer a rank posted, once the posts of the phase after it have completed
/// (then this handle is the only one; see the module docs). Should another handle still exist,
/// the buffer is copied instead: correct, only slower.
pub(crate) fn reclaim(post: Arc<Post>) -> Option<HostBuffer> {
    match Arc::try_unwrap(post) {
        Ok(post) => post.data,
        Err(shared) => shared.data.clone(),
    }
}
