//! Stall declarations and the report every rank and the launcher print from them: which ranks
//! have not entered the collective that a rank waited on, and what each was last doing.

use std::collections::BTreeMap;

use crate::progress::{GroupProgress, Record};

/// What to do once a stall is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallPolicy {
    /// Fail the job: every rank aborts its communicators, the launcher stops the ranks.
    Fail,
    /// Keep waiting (up to the op deadline).
    Wait,
}

impl StallPolicy {
    fn as_str(self) -> &'static str {
        match self {
            StallPolicy::Fail => "fail",
            StallPolicy::Wait => "wait",
        }
    }
}

/// One rank's declaration that a collective it runs has waited past the stall threshold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declaration {
    /// The global rank that waited.
    pub waiter: usize,
    /// Its entry for the group of the collective (at the time of the declaration).
    pub group: GroupProgress,
    /// How long it had waited, in ms.
    pub waited_ms: u64,
    /// What the job does about it.
    pub policy: StallPolicy,
    /// Global ranks of the group that had not entered the collective.
    pub missing: Vec<usize>,
    /// The declaring rank's watchdog tick, in ms (readers derive staleness from it).
    pub tick_ms: u64,
}

const DECLARATION_TAG: &str = "hswdstall1";

impl Declaration {
    /// The sequence number of the collective waited on.
    pub fn seq(&self) -> u64 {
        self.group.entered.saturating_sub(1)
    }

    /// The op waited on.
    pub fn op(&self) -> &str {
        self.group.op.as_deref().unwrap_or("an op")
    }

    /// The declaration as text: one line of fields, then the group as a record line.
    pub fn encode(&self) -> String {
        let missing: Vec<String> = self.missing.iter().map(usize::to_string).collect();
        let group = Record {
            rank: self.waiter,
            pid: 0,
            host: String::new(),
            phase: String::new(),
            step: 0,
            unix_ms: 0,
            groups: vec![self.group.clone()],
        }
        .encode();
        format!(
            "{DECLARATION_TAG}\t{}\t{}\t{}\t{}\t{}\n{group}",
            self.waiter,
            self.waited_ms,
            self.policy.as_str(),
            missing.join(","),
            self.tick_ms
        )
    }

    /// Parses [`Declaration::encode`]'s text; `None` when it is not one.
    pub fn decode(text: &str) -> Option<Declaration> {
        let (head, rest) = text.split_once('\n')?;
        let fields: Vec<&str> = head.split('\t').collect();
        let [tag, waiter, waited, policy, missing, tick] = fields.as_slice() else {
            return None;
        };
        if *tag != DECLARATION_TAG {
            return None;
        }
        let policy = match *policy {
            "fail" => StallPolicy::Fail,
            "wait" => StallPolicy::Wait,
            _ => return None,
        };
        let missing = if missing.is_empty() {
            Vec::new()
        } else {
            missing
                .split(',')
                .map(str::parse)
                .collect::<std::result::Result<_, _>>()
                .ok()?
        };
        let group = Record::decode(rest)?.groups.into_iter().next()?;
        Some(Declaration {
            waiter: waiter.parse().ok()?,
            group,
            waited_ms: waited.parse().ok()?,
            policy,
            missing,
            tick_ms: tick.parse().ok()?,
        })
    }

    /// How old a record may be before its rank counts as not responding: three missed ticks
    /// of the declaring rank's watchdog, and half a second.
    pub fn stale_ms(&self) -> u64 {
        self.tick_ms.saturating_mul(3).saturating_add(500)
    }
}

/// The members of `waiting`'s group (seen from global rank `waiter`) that have not entered its
/// running op: their record shows fewer ops started in that group, or there is no record.
pub fn missing_ranks(
    waiter: usize,
    waiting: &GroupProgress,
    records: &BTreeMap<usize, Record>,
) -> Vec<usize> {
    waiting
        .members
        .iter()
        .copied()
        .filter(|&m| m != waiter)
        .filter(|m| {
            match records
                .get(m)
                .and_then(|r| r.group(waiting.group_id))
                .map(|g| g.entered)
            {
                Some(entered) => entered < waiting.entered,
                None => true,
            }
        })
        .collect()
}

/// Whether a rank's record is older than `stale_ms`: the rank stopped publishing (stopped,
/// hung in the kernel, or gone).
fn is_stale(record: Option<&Record>, now_ms: u64, stale_ms: u64) -> bool {
    record.is_none_or(|r| r.age_ms(now_ms) > stale_ms)
}

/// Whether a rank is waiting inside a collective itself.
fn is_waiting(record: Option<&Record>) -> bool {
    record.is_some_and(|r| r.groups.iter().any(|g| g.running))
}

/// The ranks to blame, most likely first: ranks named as missing that stopped publishing,
/// then those that are not inside any collective (stuck in their own code), then any other
/// rank of the job that stopped publishing, then the rest of the missing; when nobody is
/// missing (every member entered and one of them stopped inside it), the ranks that stopped
/// publishing.
///
/// A missing rank that is alive and waiting inside another collective is held up itself: the
/// first declaration of a job (the one the launcher acts on) often comes from a rank two hops
/// from the stuck one, whose own group only shows the rank in between. A silent rank
/// anywhere in the job then comes before it.
pub fn culprits(
    declarations: &[Declaration],
    records: &BTreeMap<usize, Record>,
    now_ms: u64,
) -> Vec<usize> {
    let stale_ms = declarations
        .iter()
        .map(Declaration::stale_ms)
        .max()
        .unwrap_or(u64::MAX);
    let mut missing: Vec<usize> = declarations
        .iter()
        .flat_map(|d| d.missing.iter().copied())
        .collect();
    missing.sort_unstable();
    missing.dedup();
    let stale = |r: &usize| is_stale(records.get(r), now_ms, stale_ms);
    let mut ordered: Vec<usize> = missing.iter().copied().filter(stale).collect();
    ordered.extend(
        missing
            .iter()
            .copied()
            .filter(|r| !stale(r) && !is_waiting(records.get(r))),
    );
    if !missing.is_empty() {
        ordered.extend(
            records
                .keys()
                .copied()
                .filter(|r| !missing.contains(r) && stale(r)),
        );
    }
    ordered.extend(
        missing
            .iter()
            .copied()
            .filter(|r| !stale(r) && is_waiting(records.get(r))),
    );
    if ordered.is_empty() {
        let mut members: Vec<usize> = declarations
            .iter()
            .flat_map(|d| d.group.members.iter().copied())
            .collect();
        members.sort_unstable();
        members.dedup();
        ordered = members.into_iter().filter(stale).collect();
    }
    ordered
}

/// Describes global rank `rank` for a report: host, pid, what it was doing, how fresh that is.
pub fn describe(rank: usize, records: &BTreeMap<usize, Record>, now_ms: u64) -> String {
    match records.get(&rank) {
        Some(r) => format!(
            "rank {rank} (host {}, pid {}): {} [reported {:.1}s ago]",
            r.host,
            r.pid,
            r.doing(now_ms),
            r.age_ms(now_ms) as f64 / 1000.0
        ),
        None => format!("rank {rank}: never reported its progress"),
    }
}

/// The report, from `viewer`'s point of view (e.g. `"rank 1"`, `"launcher"`): the first
/// declaration's collective, who has not entered it and what each was last doing, then the
/// other ranks that declared a stall.
pub fn report(
    viewer: &str,
    declarations: &[Declaration],
    records: &BTreeMap<usize, Record>,
    now_ms: u64,
) -> String {
    let Some(first) = declarations.first() else {
        return format!("hypershard watchdog ({viewer}): no stall declared");
    };
    let group = &first.group;
    let local = |r: usize| {
        group
            .group_rank_of(r)
            .map(|l| format!(" (group rank {l})"))
            .unwrap_or_default()
    };
    let waiters: Vec<String> = declarations
        .iter()
        .map(|d| format!("{}", d.waiter))
        .collect();
    let mut text = format!(
        "hypershard watchdog ({viewer}): stall: rank {}{} waited {:.1}s in {} #{} of group {} \
         (global ranks {:?}); ranks that declared a stall: {}",
        first.waiter,
        local(first.waiter),
        first.waited_ms as f64 / 1000.0,
        first.op(),
        first.seq(),
        group.name,
        group.members,
        waiters.join(", ")
    );
    let blamed = culprits(declarations, records, now_ms);
    if first.missing.is_empty() {
        text.push_str("\n  every member entered it");
    } else {
        text.push_str("\n  not entered:");
        for &m in &first.missing {
            text.push_str(&format!(
                "\n    {}{}",
                describe(m, records, now_ms),
                local(m)
            ));
        }
    }
    // What the other declarations add: ranks that hold up another waiting rank.
    let mut named = first.missing.clone();
    for d in &declarations[1..] {
        for &m in &d.missing {
            if named.contains(&m) {
                continue;
            }
            named.push(m);
            text.push_str(&format!(
                "\n  not entered {} #{} of group {} (rank {} waits in it): {}",
                d.op(),
                d.seq(),
                d.group.name,
                d.waiter,
                describe(m, records, now_ms)
            ));
        }
    }
    for &b in blamed.iter().filter(|b| !named.contains(b)) {
        text.push_str(&format!(
            "\n  not responding: {}",
            describe(b, records, now_ms)
        ));
    }
    if let Some(&culprit) = blamed.first() {
        text.push_str(&format!("\n  most likely stuck: rank {culprit}"));
    }
    text.push_str(match first.policy {
        StallPolicy::Fail => "\n  the job fails (--on-stall wait keeps waiting)",
        StallPolicy::Wait => "\n  waiting on (--on-stall wait)",
    });
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(id: u32, entered: u64, running: bool, members: &[usize]) -> GroupProgress {
        GroupProgress {
            group_id: id,
            name: format!("g{id}"),
            members: members.to_vec(),
            entered,
            op: Some("all_gather".to_string()),
            running,
            age_ms: 10,
        }
    }

    fn record(rank: usize, unix_ms: u64, groups: Vec<GroupProgress>) -> Record {
        Record {
            rank,
            pid: 100 + rank as u32,
            host: "h".to_string(),
            phase: "forward".to_string(),
            step: 3,
            unix_ms,
            groups,
        }
    }

    /// Global rank `waiter`'s declaration, waiting in the first group of its record, with the
    /// ranks `missing_ranks` finds behind it.
    fn declaration_of(
        waiter: usize,
        records: &BTreeMap<usize, Record>,
        waited_ms: u64,
        policy: StallPolicy,
    ) -> Declaration {
        let group = records[&waiter].groups[0].clone();
        let missing = missing_ranks(waiter, &group, records);
        Declaration {
            waiter,
            group,
            waited_ms,
            policy,
            missing,
            tick_ms: 250,
        }
    }

    #[test]
    fn the_rank_behind_and_silent_is_blamed_and_described() {
        let members = [0, 1, 2, 3];
        let now = 10_000;
        let mut records = BTreeMap::new();
        records.insert(0, record(0, now, vec![group(0, 41, true, &members)]));
        records.insert(1, record(1, now, vec![group(0, 41, true, &members)]));
        // Rank 2 stopped 3 s ago, one collective behind.
        records.insert(
            2,
            record(2, now - 3_000, vec![group(0, 40, false, &members)]),
        );
        records.insert(3, record(3, now, vec![group(0, 41, true, &members)]));
        let declaration = declaration_of(1, &records, 3_100, StallPolicy::Fail);
        assert_eq!(declaration.missing, vec![2]);
        assert_eq!(
            Declaration::decode(&declaration.encode()),
            Some(declaration.clone())
        );
        assert_eq!(
            culprits(std::slice::from_ref(&declaration), &records, now),
            vec![2]
        );
        let text = report("launcher", &[declaration], &records, now);
        assert!(text.contains("rank 2 (host h, pid 102)"), "{text}");
        assert!(text.contains("all_gather #40 of group g0"), "{text}");
        assert!(text.contains("most likely stuck: rank 2"), "{text}");
    }

    #[test]
    fn when_everyone_entered_the_silent_member_is_blamed() {
        let members = [0, 1];
        let now = 50_000;
        let mut records = BTreeMap::new();
        records.insert(0, record(0, now, vec![group(5, 7, true, &members)]));
        records.insert(1, record(1, now - 9_000, vec![group(5, 7, true, &members)]));
        let declaration = declaration_of(0, &records, 9_000, StallPolicy::Wait);
        assert!(declaration.missing.is_empty());
        assert_eq!(culprits(&[declaration], &records, now), vec![1]);
        // A rank with no record at all counts as missing.
        records.remove(&1);
        assert_eq!(missing_ranks(0, &records[&0].groups[0], &records), vec![1]);
    }

    #[test]
    fn a_missing_rank_waiting_on_a_silent_one_is_not_blamed_first() {
        // HSDP 2x2: shard groups {0, 2} and {1, 3}, replicate groups {0, 1} and {2, 3}. Rank
        // 2 stopped (silent for 3.3 s) before the all-gather of {2, 3}; rank 3 waits in that
        // all-gather, and rank 1 waits in an all-reduce of {1, 3} that rank 3 has not
        // reached. Rank 1's declaration names only rank 3, which is alive and held up itself.
        let now = 20_000;
        let shard = [1, 3];
        let replicate = [2, 3];
        let mut records = BTreeMap::new();
        records.insert(1, record(1, now, vec![group(1, 6, true, &shard)]));
        records.insert(
            3,
            record(
                3,
                now,
                vec![group(1, 5, false, &shard), group(3, 18, true, &replicate)],
            ),
        );
        records.insert(
            2,
            record(2, now - 3_300, vec![group(3, 17, false, &replicate)]),
        );
        records.insert(0, record(0, now, vec![]));
        let declaration = declaration_of(1, &records, 3_200, StallPolicy::Fail);
        assert_eq!(declaration.missing, vec![3]);
        let declarations = [declaration];
        assert_eq!(culprits(&declarations, &records, now), vec![2, 3]);
        let text = report("launcher", &declarations, &records, now);
        assert!(text.contains("not responding: rank 2"), "{text}");
        assert!(text.contains("most likely stuck: rank 2"), "{text}");
        // A missing rank stuck in its own code (inside no collective) still comes first.
        records.insert(3, record(3, now, vec![group(1, 5, false, &shard)]));
        assert_eq!(culprits(&declarations, &records, now), vec![3, 2]);
    }

    #[test]
    fn garbage_is_not_a_declaration() {
        for bad in [
            "",
            "hswdstall1\t1\t2\tfail\t",
            "hswdstall1\t1\t2\tmaybe\t\t5\nx",
            "hswdstall1\t1\t2\tfail\t\tx\nhswd1\t1\t0\t\t\t0\t0",
        ] {
            assert_eq!(Declaration::decode(bad), None, "{bad:?}");
        }
    }
}
