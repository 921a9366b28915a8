//! Helpers shared by the tests that run `hypershard train` as real processes (faults.rs,
//! netns.rs): reading what a run recorded in its `losses.jsonl`.

use std::collections::BTreeMap;
use std::path::Path;

use hypershard::train::{LossRecord, read_losses};

/// The steps of the records in `losses.jsonl`, in file order, duplicates kept (unlike
/// `read_losses`, which keeps the last record of each step): a resumed run appends, so this
/// shows where it started.
pub fn recorded_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("losses.jsonl"))
        .unwrap()
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str::<LossRecord>(line).unwrap().step)
        .collect()
}

/// Losses by step (a resumed run appends to the interrupted run's file; the last record of
/// a step wins).
pub fn losses(out: &Path) -> BTreeMap<u64, f64> {
    read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| (r.step, r.loss))
        .collect()
}
