//! Fault injection for the reliability tests and `cargo xtask soak`: `HYPERSHARD_FAULT`
//! names a rank, a step and a point of the training step at which that rank kills (SIGKILL)
//! or stops (SIGSTOP) itself, so the tests can check what every other rank and the launcher
//! do when a peer dies or stalls at exactly that point.
//!
//! The value is `<point>@<step>:<rank>` or `<point>@<step>:<rank>:stop`, where `<point>` is
//! `forward` (before the step's first forward, so the peers are inside its parameter
//! all-gathers), `backward` (after the forward, so the peers are inside the backward's
//! reduce-scatters), `optimizer` (after the backward, before gradient clipping and the
//! optimizer step, so the peers are in the clipping's all-reduce) or `checkpoint` (after this rank wrote its shard of the checkpoint of
//! `<step>` but before the save commits). Unset: no fault (the only cost is one
//! comparison per point).

use crate::launch::{SIGKILL, signal_group};

/// The variable that arms a fault.
pub const FAULT_ENV: &str = "HYPERSHARD_FAULT";

/// The signal SIGSTOP (not exported by the launcher, which never sends it).
const SIGSTOP: i32 = libc::SIGSTOP;

/// Where in a training step a fault fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// Before the step's first forward.
    Forward,
    /// After the step's first forward, before its backward.
    Backward,
    /// After the backward, before gradient clipping and the optimizer step.
    Optimizer,
    /// After this rank's checkpoint shard is written, before the save commits.
    Checkpoint,
}

/// An armed fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Where it fires.
    pub point: FaultPoint,
    /// The step (for `checkpoint`: the step count the checkpoint is saved after).
    pub step: u64,
    /// The rank that fires it.
    pub rank: usize,
    /// SIGSTOP instead of SIGKILL.
    pub stop: bool,
}

impl Fault {
    /// Parses a [`FAULT_ENV`] value; `None` when it is malformed (then nothing fires, and
    /// the caller warns).
    pub fn parse(text: &str) -> Option<Fault> {
        let (point, rest) = text.split_once('@')?;
        let point = match point {
            "forward" => FaultPoint::Forward,
            "backward" => FaultPoint::Backward,
            "optimizer" => FaultPoint::Optimizer,
            "checkpoint" => FaultPoint::Checkpoint,
            _ => return None,
        };
        let mut parts = rest.split(':');
        let step = parts.next()?.parse().ok()?;
        let rank = parts.next()?.parse().ok()?;
        let stop = match parts.next() {
            None | Some("kill") => false,
            Some("stop") => true,
            Some(_) => return None,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Fault {
            point,
            step,
            rank,
            stop,
        })
    }

    /// The fault [`FAULT_ENV`] arms, if any.
    pub fn from_env() -> Option<Fault> {
        let text = std::env::var(FAULT_ENV).ok()?;
        let fault = Fault::parse(&text);
        if fault.is_none() {
            tracing::warn!(value = %text, "{FAULT_ENV} is malformed; no fault armed");
        }
        fault
    }

    /// Fires (kills or stops this process) when `point`, `step` and `rank` are this fault's.
    pub fn maybe_fire(fault: Option<&Fault>, point: FaultPoint, step: u64, rank: usize) {
        let Some(fault) = fault else { return };
        if fault.point != point || fault.step != step || fault.rank != rank {
            return;
        }
        eprintln!(
            "{FAULT_ENV}: rank {rank} {} itself at {point:?} of step {step} (pid {})",
            if fault.stop { "stops" } else { "kills" },
            std::process::id()
        );
        // Each rank leads its own process group (the launcher spawns it so), so signalling
        // the group signals exactly this rank.
        signal_group(
            std::process::id(),
            if fault.stop { SIGSTOP } else { SIGKILL },
        );
        // SIGKILL does not return; SIGSTOP returns once someone sends SIGCONT.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_values_parse_or_are_refused() {
        assert_eq!(
            Fault::parse("backward@3:1"),
            Some(Fault {
                point: FaultPoint::Backward,
                step: 3,
                rank: 1,
                stop: false
            })
        );
        assert_eq!(
            Fault::parse("forward@0:2:stop").map(|f| (f.point, f.stop)),
            Some((FaultPoint::Forward, true))
        );
        assert_eq!(
            Fault::parse("checkpoint@4:0").map(|f| f.point),
            Some(FaultPoint::Checkpoint)
        );
        assert_eq!(
            Fault::parse("optimizer@2:3:stop").map(|f| (f.point, f.stop)),
            Some((FaultPoint::Optimizer, true))
        );
        for bad in [
            "",
            "forward",
            "forward@x:1",
            "sideways@1:1",
            "forward@1:1:boom",
            "forward@1:1:stop:x",
        ] {
            assert_eq!(Fault::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_fault_for_another_point_step_or_rank_does_not_fire() {
        let fault = Fault::parse("backward@3:1").unwrap();
        // Each of these would kill the test process if it fired.
        Fault::maybe_fire(Some(&fault), FaultPoint::Forward, 3, 1);
        Fault::maybe_fire(Some(&fault), FaultPoint::Backward, 2, 1);
        Fault::maybe_fire(Some(&fault), FaultPoint::Backward, 3, 0);
        Fault::maybe_fire(None, FaultPoint::Backward, 3, 1);
    }
}
