//! Spin-then-park waiting for a ring condition, bounded by the op's deadline and watching for
//! a lost peer or an abort (the [`Watch`] the caller supplies, normally the TCP transport's
//! view of the peer: a killed rank's sockets close, which is how its loss is noticed).

use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use super::futex;
use crate::error::{Error, Result};
use crate::op::OpKind;

/// Condition checks with a CPU pause between them before the first yield (about 10 µs). Kept
/// short on purpose: on an oversubscribed machine the peer is often not running, and a
/// long spin (or many yields, each of which can hand the core away for a whole time slice)
/// measured slower than parking at once, which the peer's futex wake ends within
/// microseconds (2000 spins + 20 yields: 4 KiB all-reduce 119-304 µs; 300 + 2: 108 µs).
const SPINS: u32 = 300;
/// `yield_now` rounds after spinning, before parking.
const YIELDS: u32 = 2;
/// The longest one park lasts; every wake-up re-checks the condition and the [`Watch`].
const PARK_SLICE: Duration = Duration::from_millis(2);

/// What a wait must watch besides its ring: the op's deadline, an abort of the
/// communicator, and the loss of the peer (by world rank).
pub trait Watch {
    /// The op the wait belongs to (named by errors).
    fn op(&self) -> OpKind;
    /// Why a wait on world rank `peer` must stop now (aborted, peer lost, deadline passed),
    /// if it must.
    fn interrupted(&self, peer: usize) -> Option<Error>;
    /// Why a send to world rank `peer` must not start (aborted, peer lost), if it must.
    fn refuses_send(&self, peer: usize) -> Option<Error>;
}

/// How a wait ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    /// The condition holds.
    Ready,
    /// `until` passed first (the caller lets other threads at the ring and tries again).
    SliceOver,
}

/// What one wait is about.
pub(crate) struct WaitFor<'w> {
    /// The word this side parks on (its side's waiter word in the segment).
    pub(crate) word: &'w AtomicU32,
    /// The peer at the other end, by world rank.
    pub(crate) peer: usize,
    /// The watch.
    pub(crate) watch: &'w dyn Watch,
    /// When to give up with [`Waited::SliceOver`], if ever.
    pub(crate) until: Option<Instant>,
    /// More words that end a park when woken: the park words of this rank's incoming rings,
    /// for a sender whose `stall` drains them (so a peer's message wakes it at once instead
    /// of at the end of a park slice). They are announced (set to 1) like `word`, but left
    /// for their wakers to clear, since other threads of this rank may park on them too.
    pub(crate) doorbells: &'w [&'w AtomicU32],
}

/// Waits until `ready` returns true: spins, then yields, then parks on the futex word in
/// slices, calling `stall` whenever it is about to yield or park (a sender uses it to drain
/// its incoming rings so two ranks that both send first cannot deadlock). Data that is there
/// wins over an error: the condition is checked before the watch.
pub(crate) fn wait_until(
    what: &WaitFor<'_>,
    mut ready: impl FnMut() -> Result<bool>,
    stall: &mut dyn FnMut(),
) -> Result<Waited> {
    for _ in 0..SPINS {
        if ready()? {
            return Ok(Waited::Ready);
        }
        std::hint::spin_loop();
    }
    for _ in 0..YIELDS {
        stall();
        if ready()? {
            return Ok(Waited::Ready);
        }
        std::thread::yield_now();
    }
    loop {
        // Doorbells are announced before the drain, so a message published after the drain
        // looked finds them set and wakes the park below.
        for bell in what.doorbells.iter().take(futex::WAITV_MAX - 1) {
            bell.store(1, Ordering::Relaxed);
        }
        if !what.doorbells.is_empty() {
            fence(Ordering::SeqCst);
        }
        stall();
        what.word.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if ready()? {
            what.word.store(0, Ordering::Relaxed);
            return Ok(Waited::Ready);
        }
        let now = Instant::now();
        let slice = what
            .until
            .map_or(PARK_SLICE, |until| {
                until.saturating_duration_since(now).min(PARK_SLICE)
            })
            .max(Duration::from_micros(50));
        park(what, slice);
        what.word.store(0, Ordering::Relaxed);
        if ready()? {
            return Ok(Waited::Ready);
        }
        if let Some(error) = what.watch.interrupted(what.peer) {
            return Err(error);
        }
        if what.until.is_some_and(|until| Instant::now() >= until) {
            return Ok(Waited::SliceOver);
        }
    }
}

/// Parks on `what.word` and, where the kernel can (`futex_waitv`), its doorbells too, for at
/// most `slice`. The caller has announced all of them and re-checked its condition.
fn park(what: &WaitFor<'_>, slice: Duration) {
    let count = what.doorbells.len().min(futex::WAITV_MAX - 1);
    if count > 0 {
        let mut words = Vec::with_capacity(count + 1);
        words.push(what.word);
        words.extend(what.doorbells[..count].iter().copied());
        if futex::wait_any(&words, 1, slice) {
            return;
        }
    }
    futex::wait(what.word, 1, slice);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A watch with a deadline and a switch that marks the peer lost.
    pub(crate) struct TestWatch {
        pub(crate) deadline: Instant,
        pub(crate) lost: AtomicBool,
    }

    impl TestWatch {
        pub(crate) fn new(timeout: Duration) -> TestWatch {
            TestWatch {
                deadline: Instant::now() + timeout,
                lost: AtomicBool::new(false),
            }
        }
    }

    impl Watch for TestWatch {
        fn op(&self) -> OpKind {
            OpKind::AllReduce
        }
        fn interrupted(&self, peer: usize) -> Option<Error> {
            if self.lost.load(Ordering::SeqCst) {
                return Some(Error::PeerLost {
                    op: OpKind::AllReduce,
                    peer,
                });
            }
            (Instant::now() >= self.deadline).then_some(Error::Timeout {
                op: OpKind::AllReduce,
                after: Duration::ZERO,
                peer: Some(peer),
            })
        }
        fn refuses_send(&self, peer: usize) -> Option<Error> {
            self.lost.load(Ordering::SeqCst).then_some(Error::PeerLost {
                op: OpKind::AllReduce,
                peer,
            })
        }
    }

    #[test]
    fn a_wait_ends_at_the_deadline_or_the_slice() {
        let word = AtomicU32::new(0);
        let watch = TestWatch::new(Duration::from_millis(40));
        let what = WaitFor {
            word: &word,
            peer: 3,
            watch: &watch,
            until: None,
            doorbells: &[],
        };
        let started = Instant::now();
        let error = wait_until(&what, || Ok(false), &mut || {}).unwrap_err();
        assert!(
            matches!(error, Error::Timeout { peer: Some(3), .. }),
            "{error:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        let watch = TestWatch::new(Duration::from_secs(10));
        let what = WaitFor {
            until: Some(Instant::now() + Duration::from_millis(10)),
            watch: &watch,
            ..what
        };
        assert!(matches!(
            wait_until(&what, || Ok(false), &mut || {}),
            Ok(Waited::SliceOver)
        ));
        let mut calls = 0;
        let ready = wait_until(
            &what,
            || {
                calls += 1;
                Ok(calls > 5)
            },
            &mut || {},
        );
        assert!(matches!(ready, Ok(Waited::Ready)));
        assert_eq!(calls, 6);
    }
}
