//! The stall watchdog of TCP jobs: finds the rank that holds a collective up, names it, and
//! fails the job long before the op deadline.
//!
//! Every rank keeps a [`ProgressBoard`] (the TCP backend marks each op's start and end per
//! group; the training loop sets the [`Phase`]), and a watchdog thread publishes it in the
//! job's store as a [`Record`] every tick (a fraction of the stall threshold, at most 1 s).
//! When an op of this rank has run longer than the stall threshold, the thread reads every
//! rank's record, works out which members of the op's group have not entered it
//! (`missing_ranks`) and publishes a [`Declaration`]. Every rank's thread (and the launcher,
//! which hosts the store) notices the first declaration, prints one [`report`] naming the
//! missing ranks by global rank, host and pid with what each was last doing, and then, under
//! [`StallPolicy::Fail`], aborts its communicators a short grace later (so the other ranks'
//! reports get out first). The launcher kills the blamed rank ([`culprits`]): a stopped
//! process cannot act on anything else.
//!
//! Cost: one store write per rank per tick plus one check of a counter, on the watchdog's
//! own thread; the ops themselves pay one uncontended lock at start and end.

mod report;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

pub use crate::progress::{GroupProgress, Phase, ProgressBoard, Record, set_phase, unix_ms};
pub(crate) use report::missing_ranks;
pub use report::{Declaration, StallPolicy, culprits, report};

use crate::backend::tcp::TcpWorld;
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::rendezvous::Store;

/// The stall threshold when none is given.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The store key of global rank `rank`'s [`Record`].
pub(crate) fn progress_key(rank: usize) -> String {
    format!("watchdog/progress/{rank}")
}

/// The store key of global rank `rank`'s [`Declaration`].
pub(crate) fn stall_key(rank: usize) -> String {
    format!("watchdog/stall/{rank}")
}

/// The counter of declarations (a key whose presence says some rank declared a stall).
pub(crate) const STALL_COUNT_KEY: &str = "watchdog/stalls";

/// How often a rank publishes its record for a stall threshold of `stall`.
pub(crate) fn tick_for(stall: Duration) -> Duration {
    (stall / 12).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Every rank's latest record in `store` (ranks that never published are absent).
pub fn read_records(store: &dyn Store, world_size: usize) -> BTreeMap<usize, Record> {
    (0..world_size)
        .filter_map(|rank| {
            let bytes = store.get(&progress_key(rank), Duration::ZERO).ok()?;
            let record = Record::decode(std::str::from_utf8(&bytes).ok()?)?;
            (record.rank == rank).then_some((rank, record))
        })
        .collect()
}

/// Every declaration in `store`, in global-rank order of the declaring rank.
pub fn read_declarations(store: &dyn Store, world_size: usize) -> Vec<Declaration> {
    (0..world_size)
        .filter_map(|rank| {
            let key = stall_key(rank);
            if !store.check(&[key.as_str()]).ok()? {
                return None;
            }
            let bytes = store.get(&key, Duration::ZERO).ok()?;
            Declaration::decode(std::str::from_utf8(&bytes).ok()?)
        })
        .collect()
}

/// Whether any rank declared a stall.
pub fn stall_declared(store: &dyn Store) -> bool {
    store.check(&[STALL_COUNT_KEY]).unwrap_or(false)
}

/// The watchdog's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// How long an op may run before it counts as stalled.
    pub stall_timeout: Duration,
    /// What to do then.
    pub policy: StallPolicy,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig {
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            policy: StallPolicy::Fail,
        }
    }
}

/// How long dropping a [`Watchdog`] waits for its thread, which may be inside a store call
/// to a store that is unreachable: after that the thread is left to end with the process.
const DROP_WAIT: Duration = Duration::from_secs(1);

/// A running watchdog thread; dropping it stops the thread.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Watchdog {
    /// Starts the watchdog of this rank of `world` (collective in effect: every rank should
    /// start one, or the others see this rank's silence as a stall once they wait on it).
    pub fn start(world: &TcpWorld, config: WatchdogConfig) -> Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = Context {
            comm: Arc::clone(&world.comm),
            store: Arc::clone(&world.store),
            board: world.comm.progress_board(),
            world_size: world.comm.size(),
            config,
            host: hostname(),
            stop: Arc::clone(&stop),
        };
        let rank = ctx.board.rank();
        let handle = thread::Builder::new()
            .name(format!("hs-watchdog-{rank}"))
            .spawn(move || ctx.run())
            .map_err(|source| Error::SpawnFailed {
                group: format!("watchdog of rank {rank}"),
                source,
            })?;
        Ok(Watchdog {
            stop,
            handle: Mutex::new(Some(handle)),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let handle = self
            .handle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            handle.thread().unpark();
            let deadline = Instant::now() + DROP_WAIT;
            while !handle.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if handle.is_finished() {
                // A panicked watchdog has nothing to clean up; Drop must not panic.
                let _ = handle.join();
            }
        }
    }
}

/// What the watchdog thread works with.
struct Context {
    comm: Arc<crate::backend::tcp::TcpCommunicator>,
    store: Arc<dyn Store>,
    board: Arc<ProgressBoard>,
    world_size: usize,
    config: WatchdogConfig,
    host: String,
    stop: Arc<AtomicBool>,
}

impl Context {
    fn run(self) {
        let tick = tick_for(self.config.stall_timeout);
        let stall_ms = u64::try_from(self.config.stall_timeout.as_millis()).unwrap_or(u64::MAX);
        let tick_ms = u64::try_from(tick.as_millis()).unwrap_or(u64::MAX);
        let rank = self.board.rank();
        let mut declared: Vec<(u32, u64)> = Vec::new();
        let mut reported = false;
        let mut abort_at: Option<Instant> = None;
        while !self.stop.load(Ordering::SeqCst) {
            let record = self.board.snapshot(&self.host);
            // The store may be gone at the very end of a job; the next tick tries again.
            let _ = self
                .store
                .set(&progress_key(rank), record.encode().as_bytes());
            for group in record
                .groups
                .iter()
                .filter(|g| g.running && g.age_ms >= stall_ms)
            {
                if declared.contains(&(group.group_id, group.entered)) {
                    continue;
                }
                declared.push((group.group_id, group.entered));
                let records = read_records(self.store.as_ref(), self.world_size);
                let declaration = Declaration {
                    waiter: rank,
                    missing: missing_ranks(rank, group, &records),
                    group: group.clone(),
                    waited_ms: group.age_ms,
                    policy: self.config.policy,
                    tick_ms,
                };
                let _ = self
                    .store
                    .set(&stall_key(rank), declaration.encode().as_bytes());
                let _ = self.store.add(STALL_COUNT_KEY, 1);
            }
            if !reported && stall_declared(self.store.as_ref()) {
                reported = true;
                let declarations = self.print_report();
                let fail = self.config.policy == StallPolicy::Fail
                    || declarations.iter().any(|d| d.policy == StallPolicy::Fail);
                if fail {
                    // Two ticks: every other live rank's watchdog sees the declaration and
                    // prints its report before the aborts tear the connections down.
                    abort_at = Some(Instant::now() + tick * 2);
                }
            }
            if let Some(at) = abort_at
                && Instant::now() >= at
            {
                tracing::debug!(rank, "watchdog: aborting the communicators after a stall");
                self.comm.abort();
                return;
            }
            thread::park_timeout(tick);
        }
        // The rank is ending (often because a peer's abort reached it before this thread's
        // next tick): a stall declared meanwhile still gets this rank's one report.
        if !reported && stall_declared(self.store.as_ref()) {
            self.print_report();
        }
    }

    /// Prints this rank's report of the declared stalls; returns the declarations.
    fn print_report(&self) -> Vec<Declaration> {
        let declarations = read_declarations(self.store.as_ref(), self.world_size);
        let records = read_records(self.store.as_ref(), self.world_size);
        let viewer = format!(
            "rank {}, host {}, pid {}",
            self.board.rank(),
            self.host,
            std::process::id()
        );
        eprintln!("{}", report(&viewer, &declarations, &records, unix_ms()));
        declarations
    }
}

/// This host's name (empty when the system will not say).
pub(crate) fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into the buffer we own and
    // pass with its length; the result is read only up to the first NUL within the buffer.
    // Tested by `hostname_is_not_empty`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostname_is_not_empty() {
        assert!(!hostname().is_empty());
    }

    #[test]
    fn ticks_scale_with_the_threshold_within_bounds() {
        assert_eq!(tick_for(Duration::from_secs(30)), Duration::from_secs(1));
        assert_eq!(tick_for(Duration::from_secs(3)), Duration::from_millis(250));
        assert_eq!(
            tick_for(Duration::from_millis(10)),
            Duration::from_millis(50)
        );
    }
}
