//! The progress board: what one rank process is doing, kept in memory by the TCP backend (one
//! slot per communicator group, written when an op starts and ends on the progress thread)
//! and by the training loop (the phase and step), and the text record the watchdog publishes
//! of it in the job's store.
//!
//! Writing costs one uncontended lock per op start and end, and two relaxed atomic stores per
//! phase change: nothing the job would notice.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::op::OpKind;

/// Where in a training step a rank is, as the training loop reports it with [`set_phase`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Phase {
    /// Before the first step (building the model, loading a checkpoint) or between steps.
    Setup,
    /// The forward pass.
    Forward,
    /// The backward pass.
    Backward,
    /// Gradient clipping and the optimizer step.
    Optimizer,
    /// Saving a checkpoint.
    Checkpoint,
    /// Evaluating on held-out data.
    Eval,
}

impl Phase {
    const ALL: [Phase; 6] = [
        Phase::Setup,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::Checkpoint,
        Phase::Eval,
    ];

    /// The name used in records and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Checkpoint => "checkpoint",
            Phase::Eval => "eval",
        }
    }

    fn index(self) -> u8 {
        // invariant: ALL lists every variant once, so the position exists and is below 6.
        Phase::ALL.iter().position(|p| *p == self).unwrap_or(0) as u8
    }

    fn from_index(index: u8) -> Phase {
        Phase::ALL
            .get(usize::from(index))
            .copied()
            .unwrap_or(Phase::Setup)
    }
}

// The phase and step are process-wide: under the TCP backend a process is one rank, so they
// describe that rank. (Ranks that are threads of one process share them; only the TCP
// watchdog reads them.)
static PHASE: AtomicU8 = AtomicU8::new(0);
static STEP: AtomicU64 = AtomicU64::new(0);

/// Records that this rank process entered `phase` of training step `step`.
pub fn set_phase(phase: Phase, step: u64) {
    STEP.store(step, Ordering::Relaxed);
    PHASE.store(phase.index(), Ordering::Relaxed);
}

/// The phase and step last recorded with [`set_phase`].
pub fn current_phase() -> (Phase, u64) {
    (
        Phase::from_index(PHASE.load(Ordering::Relaxed)),
        STEP.load(Ordering::Relaxed),
    )
}

/// The state of one group's op stream.
#[derive(Clone, Copy, Debug)]
struct SlotState {
    /// Ops started so far (the last started op has sequence number `entered - 1`).
    entered: u64,
    /// The last started op.
    op: Option<OpKind>,
    /// Whether it is still running.
    running: bool,
    /// When it started (or, once it ended, when it ended).
    since: Instant,
}

/// One communicator group's entry on the board.
#[derive(Debug)]
pub(crate) struct GroupSlot {
    group_id: u32,
    name: String,
    /// Global ranks of the members, in group-rank order.
    members: Vec<usize>,
    state: Mutex<SlotState>,
}

/// Ends the op on drop (also when the op's job unwinds).
pub(crate) struct Entered<'a>(&'a GroupSlot);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.running = false;
        state.since = Instant::now();
    }
}

impl GroupSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks op `seq` of this group as started; it ends when the guard drops.
    pub(crate) fn enter(&self, seq: u64, op: OpKind) -> Entered<'_> {
        let mut state = self.lock();
        state.entered = seq.saturating_add(1);
        state.op = Some(op);
        state.running = true;
        state.since = Instant::now();
        drop(state);
        Entered(self)
    }
}

/// Every group slot of one rank process.
#[derive(Debug)]
pub struct ProgressBoard {
    rank: usize,
    slots: Mutex<Vec<Arc<GroupSlot>>>,
}

impl ProgressBoard {
    /// An empty board of global rank `rank`.
    pub(crate) fn new(rank: usize) -> ProgressBoard {
        ProgressBoard {
            rank,
            slots: Mutex::new(Vec::new()),
        }
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Adds a group (the world, or a split of it) to the board.
    pub(crate) fn register(&self, group_id: u32, name: &str, members: &[usize]) -> Arc<GroupSlot> {
        let slot = Arc::new(GroupSlot {
            group_id,
            name: name.to_string(),
            members: members.to_vec(),
            state: Mutex::new(SlotState {
                entered: 0,
                op: None,
                running: false,
                since: Instant::now(),
            }),
        });
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&slot));
        slot
    }

    /// A copy of what the board holds now.
    pub fn snapshot(&self, host: &str) -> Record {
        let slots = self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let now = Instant::now();
        let groups = slots
            .iter()
            .map(|slot| {
                let state = *slot.lock();
                GroupProgress {
                    group_id: slot.group_id,
                    name: slot.name.clone(),
                    members: slot.members.clone(),
                    entered: state.entered,
                    op: state.op.map(|op| op.as_str().to_string()),
                    running: state.running,
                    age_ms: millis(now.saturating_duration_since(state.since)),
                }
            })
            .collect();
        let (phase, step) = current_phase();
        Record {
            rank: self.rank,
            pid: std::process::id(),
            host: clean(host),
            phase: phase.as_str().to_string(),
            step,
            unix_ms: unix_ms(),
            groups,
        }
    }
}

/// One group's progress in a [`Record`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupProgress {
    /// The group's id (the same on every member).
    pub group_id: u32,
    /// The group's name.
    pub name: String,
    /// Global ranks of the members, in group-rank order.
    pub members: Vec<usize>,
    /// Ops started in this group (the last one has sequence number `entered - 1`).
    pub entered: u64,
    /// The last started op, if any.
    pub op: Option<String>,
    /// Whether that op is still running.
    pub running: bool,
    /// How long it has been running (or how long ago it ended), in ms, when recorded.
    pub age_ms: u64,
}

impl GroupProgress {
    /// This rank's position in the group (its group-local rank), if it is a member.
    pub fn group_rank_of(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&m| m == rank)
    }
}

/// What one rank published about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Global rank.
    pub rank: usize,
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub host: String,
    /// Training phase ([`Phase::as_str`]).
    pub phase: String,
    /// Training step.
    pub step: u64,
    /// Wall-clock time of the record, ms since the Unix epoch.
    pub unix_ms: u64,
    /// One entry per communicator group.
    pub groups: Vec<GroupProgress>,
}

const RECORD_TAG: &str = "hswd1";

impl Record {
    /// The record as text (one line for the rank, one per group; tab-separated fields).
    pub fn encode(&self) -> String {
        let mut out = format!(
            "{RECORD_TAG}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            self.rank, self.pid, self.host, self.phase, self.step, self.unix_ms
        );
        for g in &self.groups {
            let members: Vec<String> = g.members.iter().map(usize::to_string).collect();
            out.push_str(&format!(
                "g\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                g.group_id,
                clean(&g.name),
                g.entered,
                g.op.as_deref().unwrap_or("-"),
                u8::from(g.running),
                g.age_ms,
                members.join(",")
            ));
        }
        out
    }

    /// Parses [`Record::encode`]'s text; `None` when it is not such a record.
    pub fn decode(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        let head: Vec<&str> = lines.next()?.split('\t').collect();
        let [tag, rank, pid, host, phase, step, unix_ms] = head.as_slice() else {
            return None;
        };
        if *tag != RECORD_TAG {
            return None;
        }
        let mut record = Record {
            rank: rank.parse().ok()?,
            pid: pid.parse().ok()?,
            host: (*host).to_string(),
            phase: (*phase).to_string(),
            step: step.parse().ok()?,
            unix_ms: unix_ms.parse().ok()?,
            groups: Vec::new(),
        };
        for line in lines {
            let fields: Vec<&str> = line.split('\t').collect();
            let ["g", id, name, entered, op, running, age, members] = fields.as_slice() else {
                return None;
            };
            let members = if members.is_empty() {
                Vec::new()
            } else {
                members
                    .split(',')
                    .map(str::parse)
                    .collect::<std::result::Result<_, _>>()
                    .ok()?
            };
            record.groups.push(GroupProgress {
                group_id: id.parse().ok()?,
                name: (*name).to_string(),
                members,
                entered: entered.parse().ok()?,
                op: (*op != "-").then(|| (*op).to_string()),
                running: *running == "1",
                age_ms: age.parse().ok()?,
            });
        }
        Some(record)
    }

    /// The entry of group `group_id`, if this rank is in it.
    pub fn group(&self, group_id: u32) -> Option<&GroupProgress> {
        self.groups.iter().find(|g| g.group_id == group_id)
    }

    /// How old the record is at `now_unix_ms` (zero when the clocks disagree).
    pub fn age_ms(&self, now_unix_ms: u64) -> u64 {
        now_unix_ms.saturating_sub(self.unix_ms)
    }

    /// What the rank was doing, in words: its phase and step, and its latest op.
    pub fn doing(&self, now_unix_ms: u64) -> String {
        let age = self.age_ms(now_unix_ms);
        let mut text = format!("{} of step {}", self.phase, self.step);
        // An op still running is what the rank is doing; otherwise the op that ended last.
        let running = self
            .groups
            .iter()
            .filter(|g| g.running)
            .max_by_key(|g| g.age_ms);
        let latest = || {
            self.groups
                .iter()
                .filter(|g| g.op.is_some())
                .min_by_key(|g| g.age_ms)
        };
        if let Some(g) = running.or_else(latest) {
            let op = g.op.as_deref().unwrap_or("-");
            let seq = g.entered.saturating_sub(1);
            let for_s = (g.age_ms + age) as f64 / 1000.0;
            if g.running {
                text.push_str(&format!(
                    ", inside {op} #{seq} of group {} for {for_s:.1}s",
                    g.name
                ));
            } else {
                text.push_str(&format!(
                    ", last op {op} #{seq} of group {} (finished {for_s:.1}s ago)",
                    g.name
                ));
            }
        }
        text
    }
}

/// Keeps tabs and newlines out of a field.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '_' } else { c })
        .collect()
}

fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Wall-clock ms since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(millis)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_show_the_running_op() {
        let board = ProgressBoard::new(2);
        let world = board.register(0, "world", &[0, 1, 2, 3]);
        let shard = board.register(77, "world/c1#0", &[1, 2]);
        drop(world.enter(0, OpKind::Split));
        let _running = shard.enter(4, OpKind::AllGather);
        let record = board.snapshot("host\tA");
        assert_eq!(record.host, "host_A");
        let decoded = Record::decode(&record.encode()).unwrap();
        assert_eq!(decoded, record);
        let shard = decoded.group(77).unwrap();
        assert_eq!((shard.entered, shard.running), (5, true));
        assert_eq!(shard.op.as_deref(), Some("all_gather"));
        assert_eq!(shard.group_rank_of(2), Some(1));
        let world = decoded.group(0).unwrap();
        assert_eq!((world.entered, world.running), (1, false));
        let doing = decoded.doing(decoded.unix_ms);
        assert!(
            doing.contains("inside all_gather #4 of group world/c1#0"),
            "{doing}"
        );
    }

    #[test]
    fn garbage_is_not_a_record() {
        for bad in [
            "",
            "hswd1\t1",
            "other\t1\t2\th\tforward\t0\t0",
            "hswd1\t1\t2\th\tforward\t0\t0\ng\tx",
            "hswd1\t1\t2\th\tforward\t0\t0\ng\t1\tw\t1\t-\t0\t0\t1,x",
        ] {
            assert_eq!(Record::decode(bad), None, "{bad:?}");
        }
    }

    /// What the progress board costs a collective: entering and leaving a group slot, timed
    /// over many ops (run with `--nocapture` to see the figure). The bound is loose (the
    /// machine may be loaded); the figure is what the cost target is checked with.
    #[test]
    fn marking_an_op_costs_well_under_a_microsecond() {
        let board = ProgressBoard::new(0);
        let slot = board.register(0, "world", &[0, 1, 2, 3]);
        const OPS: u64 = 1_000_000;
        let start = Instant::now();
        for seq in 0..OPS {
            drop(std::hint::black_box(slot.enter(seq, OpKind::AllGather)));
        }
        let per_op = start.elapsed().as_secs_f64() / OPS as f64;
        println!(
            "progress mark (enter + leave): {:.1} ns per op",
            per_op * 1e9
        );
        assert_eq!(board.snapshot("h").groups[0].entered, OPS);
        assert!(per_op < 2e-6, "{:.1} ns per op", per_op * 1e9);
    }

    #[test]
    fn phases_round_trip_through_their_index() {
        for phase in Phase::ALL {
            assert_eq!(Phase::from_index(phase.index()), phase);
        }
    }
}
