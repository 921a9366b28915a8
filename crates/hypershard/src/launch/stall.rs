//! The launcher's side of the stall watchdog: it hosts the job's store, so it sees a rank's
//! stall declaration as soon as it is made, prints its own report, and (under
//! `--on-stall fail`) kills the rank that holds the job up once the ranks have had time to
//! print theirs. A stopped process can only be ended by SIGKILL, so the blamed rank gets that
//! at once; the others abort on their own and get the usual SIGTERM.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hypershard_collectives::MemoryStore;
use hypershard_collectives::watchdog::{
    Declaration, StallPolicy, culprits, read_declarations, read_records, report, stall_declared,
    unix_ms,
};

/// A stall the launcher decided to act on.
#[derive(Clone, Debug)]
pub(super) struct Stall {
    /// The rank blamed (global).
    pub rank: usize,
    /// Its pid and host as it reported them (empty host: it never reported).
    pub pid: Option<u32>,
    pub host: String,
    /// The first declaration.
    pub declaration: Declaration,
    /// Whether the job fails (`--on-stall fail`) or waits on.
    pub fail: bool,
    /// When to kill the blamed rank: the ranks' watchdogs print their reports before that.
    pub act_at: Instant,
}

/// Watches the store for the first stall declaration.
pub(super) struct StallWatch {
    store: Arc<MemoryStore>,
    world_size: usize,
    seen: bool,
}

impl StallWatch {
    pub(super) fn new(store: Arc<MemoryStore>, world_size: usize) -> StallWatch {
        StallWatch {
            store,
            world_size,
            seen: false,
        }
    }

    /// The first stall declared since the job started (once): prints the launcher's report.
    pub(super) fn poll(&mut self) -> Option<Stall> {
        if self.seen || !stall_declared(self.store.as_ref()) {
            return None;
        }
        self.seen = true;
        let declarations = read_declarations(self.store.as_ref(), self.world_size);
        let first = declarations.first()?.clone();
        let records = read_records(self.store.as_ref(), self.world_size);
        let now = unix_ms();
        eprintln!("{}", report("launcher", &declarations, &records, now));
        let blamed = culprits(&declarations, &records, now);
        // Nobody to blame (every member is alive and entered): the waiter itself is named,
        // which is the most that can be said.
        let rank = blamed.first().copied().unwrap_or(first.waiter);
        let fail = declarations.iter().any(|d| d.policy == StallPolicy::Fail);
        let grace = Duration::from_millis(first.tick_ms.saturating_mul(2).saturating_add(200));
        Some(Stall {
            rank,
            pid: records.get(&rank).map(|r| r.pid),
            host: records
                .get(&rank)
                .map(|r| r.host.clone())
                .unwrap_or_default(),
            declaration: first,
            fail,
            act_at: Instant::now() + grace,
        })
    }
}
