//! What rank 0 shows and writes while training: a progress bar (loss, tokens/s, ETA) or, when
//! stderr is not a terminal, a line every tenth of the run; `--losses` JSONL, one line per
//! step; and the end summary and `OUT/loss.svg`.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use crate::error::{Error, FileAction, Result};

/// One step's line in the losses file.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossRecord {
    /// The optimizer step (0-based).
    pub step: u64,
    /// The mean training loss over the global batch.
    pub loss: f64,
    /// The learning rate used.
    pub lr: f64,
    /// Tokens trained on so far, over all ranks.
    pub tokens: u64,
}

/// The end-of-run figures; rank 0 also writes them to `OUT/summary.json`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TrainSummary {
    /// Steps run in this invocation.
    pub steps_run: u64,
    /// Ranks in the job.
    pub world_size: usize,
    /// Loss of the first step run.
    pub first_loss: f64,
    /// Loss of the last step run.
    pub last_loss: f64,
    /// Tokens per second over all ranks, averaged over the whole run: wall time from the
    /// reporter's start to the end, warm-up steps, evaluations and checkpoints included.
    pub tokens_per_second: f64,
    /// The first steps left out of [`Self::steady_tokens_per_second`] (the warm-up rule: a
    /// fifth of the run, between 2 and 5 steps, fewer only in runs of under three steps).
    pub warmup_steps: u64,
    /// Tokens per second over all ranks in steady state: the tokens of the steps after the
    /// warm-up over the summed time of those steps' `train_step` on rank 0 (forward, backward,
    /// gradient reduction, clipping, optimizer, loss all-reduce; not evaluation, checkpoints or
    /// logging). `None` when the run had no step after its warm-up.
    pub steady_tokens_per_second: Option<f64>,
    /// Median time of one steady-state step, in seconds (`None` as above).
    pub steady_step_seconds: Option<f64>,
    /// Bytes this rank sent through collectives per step.
    pub bytes_per_step: f64,
    /// Where each rank's memory went, in rank order.
    pub memory: Vec<super::memory::RankMemory>,
    /// The last evaluation loss, if evaluated.
    pub eval_loss: Option<f64>,
    /// The loss plot.
    pub plot: PathBuf,
}

/// Rank 0's reporter.
pub struct Reporter {
    bar: Option<ProgressBar>,
    losses: BufWriter<File>,
    losses_path: PathBuf,
    records: Vec<LossRecord>,
    /// Seconds of each recorded step's `train_step`, in step order.
    step_seconds: Vec<f64>,
    evals: Vec<(u64, f64)>,
    started: Instant,
    start_step: u64,
    total_steps: u64,
    tokens_per_step: u64,
}

impl std::fmt::Debug for Reporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reporter")
            .field("losses_path", &self.losses_path)
            .field("records", &self.records.len())
            .finish_non_exhaustive()
    }
}

/// What [`Reporter::new`] needs.
#[derive(Clone, Debug)]
pub struct ReporterConfig {
    /// The losses file.
    pub losses: PathBuf,
    /// Append to it (a resumed run) instead of starting it afresh.
    pub append: bool,
    /// The first step this run executes.
    pub start_step: u64,
    /// The step count to reach.
    pub total_steps: u64,
    /// Tokens per optimizer step, all ranks.
    pub tokens_per_step: u64,
}

impl Reporter {
    /// Opens the losses file and, on a terminal, draws the bar.
    pub fn new(config: ReporterConfig) -> Result<Reporter> {
        if let Some(parent) = config.losses.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::io(FileAction::CreateDir, parent, e))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(config.append)
            .truncate(!config.append)
            .open(&config.losses)
            .map_err(|e| Error::io(FileAction::Write, &config.losses, e))?;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(config.total_steps);
            bar.set_position(config.start_step);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
            ) {
                bar.set_style(style);
            }
            bar
        });
        Ok(Reporter {
            bar,
            losses: BufWriter::new(file),
            losses_path: config.losses,
            records: Vec::new(),
            step_seconds: Vec::new(),
            evals: Vec::new(),
            started: Instant::now(),
            start_step: config.start_step,
            total_steps: config.total_steps,
            tokens_per_step: config.tokens_per_step,
        })
    }

    /// Tokens per second since this run started.
    fn tokens_per_second(&self) -> f64 {
        let seconds = self.started.elapsed().as_secs_f64().max(1e-9);
        (self.records.len() as u64 * self.tokens_per_step) as f64 / seconds
    }

    /// Records one step that took `seconds` of compute and communication (the caller times
    /// its `train_step`): a JSONL line (flushed, so a crash keeps every finished step), the bar.
    pub fn step(&mut self, record: LossRecord, seconds: f64) -> Result<()> {
        let line = serde_json::to_string(&record).map_err(|source| Error::Json {
            path: self.losses_path.clone(),
            source,
        })?;
        writeln!(self.losses, "{line}")
            .and_then(|()| self.losses.flush())
            .map_err(|e| Error::io(FileAction::Write, &self.losses_path, e))?;
        self.records.push(record);
        self.step_seconds.push(seconds);
        let rate = self.tokens_per_second();
        let message = format!(
            "loss {:.4} lr {:.2e} {:.0} tok/s",
            record.loss, record.lr, rate
        );
        match &self.bar {
            Some(bar) => {
                bar.set_message(message);
                bar.set_position(record.step + 1);
            }
            None => {
                let every = ((self.total_steps - self.start_step) / 10).max(1);
                let done = record.step + 1;
                if (done - self.start_step).is_multiple_of(every) || done == self.total_steps {
                    eprintln!("step {done}/{} {message}", self.total_steps);
                }
            }
        }
        Ok(())
    }

    /// Records an evaluation.
    pub fn eval(&mut self, step: u64, loss: f64) {
        self.evals.push((step, loss));
        let line = format!("eval at step {}: loss {loss:.4}", step + 1);
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Prints a line without breaking the bar.
    pub fn note(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Ends the bar, draws `plot`, and returns the summary (printed by [`print_summary`]).
    pub fn finish(
        self,
        plot: &Path,
        bytes_per_step: f64,
        memory: Vec<super::memory::RankMemory>,
    ) -> Result<TrainSummary> {
        let world_size = memory.len();
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        // The plot shows the whole curve of this output directory, resumed runs included.
        let mut curve: Vec<(u64, f64)> = read_losses(&self.losses_path)
            .unwrap_or_default()
            .iter()
            .map(|r| (r.step, r.loss))
            .collect();
        if curve.is_empty() {
            curve = self.records.iter().map(|r| (r.step, r.loss)).collect();
        }
        super::plot::plot_losses(plot, &curve, &self.evals)?;
        let steady = SteadyState::of(&self.step_seconds, self.tokens_per_step);
        let summary = TrainSummary {
            steps_run: self.records.len() as u64,
            world_size,
            first_loss: self.records.first().map_or(f64::NAN, |r| r.loss),
            last_loss: self.records.last().map_or(f64::NAN, |r| r.loss),
            tokens_per_second: self.tokens_per_second(),
            warmup_steps: steady.warmup_steps,
            steady_tokens_per_second: steady.tokens_per_second,
            steady_step_seconds: steady.median_step_seconds,
            bytes_per_step,
            memory,
            eval_loss: self.evals.last().map(|(_, l)| *l),
            plot: plot.to_path_buf(),
        };
        // Next to the plot, for scripts and benchmarks (non-finite losses become null).
        let path = plot.with_file_name("summary.json");
        let text = serde_json::to_string_pretty(&summary).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&path, text + "\n").map_err(|e| Error::io(FileAction::Write, &path, e))?;
        Ok(summary)
    }
}

/// The most steps [`warmup_steps`] leaves out.
pub const MAX_WARMUP_STEPS: u64 = 5;

/// The fewest steps [`warmup_steps`] leaves out of a run of three steps or more.
pub const MIN_WARMUP_STEPS: u64 = 2;

/// How many of a run's first `steps_run` steps are warm-up: a fifth of the run, at least
/// [`MIN_WARMUP_STEPS`] and at most [`MAX_WARMUP_STEPS`], and never every step of a run of
/// two or more (a run of one step is all warm-up). The first step is always slower: it faults
/// in the pages of every activation and gradient buffer, allocates AdamW's moments, starts
/// the kernel threads, and hands nn's cached kernel outputs back before the moments are
/// allocated (so the two never stack on the resident peak). The second step therefore faults
/// its activations in afresh while it refills that cache: at gpt2 over 4 ranks it ran about
/// 15 % slower than the third. Five is also what PyTorch's peer script
/// (`bench_gpt_fsdp2.py --warmup`) leaves out by default, so the two steady-state figures
/// compare like for like.
pub fn warmup_steps(steps_run: u64) -> u64 {
    (steps_run / 5)
        .clamp(MIN_WARMUP_STEPS, MAX_WARMUP_STEPS)
        .min(steps_run.saturating_sub(1))
        .max(1)
}

/// Steady-state figures of one run's step times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SteadyState {
    /// Steps left out at the start.
    pub warmup_steps: u64,
    /// Tokens of the remaining steps over their summed time.
    pub tokens_per_second: Option<f64>,
    /// Median of the remaining step times.
    pub median_step_seconds: Option<f64>,
}

impl SteadyState {
    /// From each step's seconds, in order, and the tokens one step trains on (all ranks).
    pub fn of(step_seconds: &[f64], tokens_per_step: u64) -> SteadyState {
        let warmup = warmup_steps(step_seconds.len() as u64);
        let mut steady: Vec<f64> = step_seconds.iter().skip(warmup as usize).copied().collect();
        let total: f64 = steady.iter().sum();
        let tokens_per_second = (!steady.is_empty() && total > 0.0)
            .then(|| (steady.len() as u64 * tokens_per_step) as f64 / total);
        steady.sort_by(f64::total_cmp);
        let median_step_seconds = (!steady.is_empty()).then(|| {
            let mid = steady.len() / 2;
            if steady.len() % 2 == 1 {
                steady[mid]
            } else {
                (steady[mid - 1] + steady[mid]) / 2.0
            }
        });
        SteadyState {
            warmup_steps: warmup,
            tokens_per_second,
            median_step_seconds,
        }
    }
}

/// Reads a losses JSONL file (a later line for the same step replaces an earlier one, as a
/// resumed run re-does the steps after its checkpoint).
pub fn read_losses(path: &Path) -> Result<Vec<LossRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(FileAction::Read, path, e))?;
    let mut by_step = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let record: LossRecord = serde_json::from_str(line).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        by_step.insert(record.step, record);
    }
    Ok(by_step.into_values().collect())
}

fn human_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Prints where each rank's memory went: one line per rank when they differ, one line for
/// all when they agree to the MiB.
fn print_memory(memory: &[super::memory::RankMemory]) {
    let mib = |b: u64| human_bytes(b as f64);
    let line = |m: &super::memory::RankMemory| {
        format!(
            "state {}, comm buffers {}, activations >= {}; tracker peak {}; RSS peak {} \
             (start-up {}, idle {})",
            mib(m.state_bytes),
            mib(m.comm_buffer_bytes),
            mib(m.activation_bytes),
            mib(m.tracker_peak_bytes),
            mib(m.peak_rss_bytes),
            mib(m.startup_peak_rss_bytes),
            mib(m.idle_rss_bytes),
        )
    };
    // State is parameters + gradients + AdamW moments (the moments are plain vectors, outside
    // the tensor tracker); activations are the tracker's peak less the rest, a lower bound.
    println!("  peak memory per rank:");
    for (rank, m) in memory.iter().enumerate() {
        println!("    rank {rank}: {}", line(m));
    }
}

/// Prints the summary to stdout.
pub fn print_summary(summary: &TrainSummary) {
    println!("done: {} steps", summary.steps_run);
    println!(
        "  loss        {:.4} -> {:.4}",
        summary.first_loss, summary.last_loss
    );
    if let Some(eval) = summary.eval_loss {
        println!("  eval loss   {eval:.4}");
    }
    match summary.steady_tokens_per_second {
        Some(steady) => println!(
            "  throughput  {steady:.0} tokens/s steady state (after {} warm-up steps; \
             {:.0} tokens/s over the whole run)",
            summary.warmup_steps, summary.tokens_per_second
        ),
        None => println!(
            "  throughput  {:.0} tokens/s over the whole run (too few steps for a steady state \
             after {} warm-up)",
            summary.tokens_per_second, summary.warmup_steps
        ),
    }
    println!(
        "  comm        {} per step per rank",
        human_bytes(summary.bytes_per_step)
    );
    print_memory(&summary.memory);
    println!("  loss plot   {}", summary.plot.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_jsonl_and_resumed_steps_replace_earlier_ones() {
        let dir = std::env::temp_dir().join(format!("hypershard-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let losses = dir.join("losses.jsonl");
        let config = |append, start_step| ReporterConfig {
            losses: losses.clone(),
            append,
            start_step,
            total_steps: 4,
            tokens_per_step: 10,
        };
        let record = |step, loss| LossRecord {
            step,
            loss,
            lr: 0.1,
            tokens: (step + 1) * 10,
        };
        let mut first = Reporter::new(config(false, 0)).unwrap();
        for step in 0..3 {
            first.step(record(step, 4.0 - step as f64), 1.0).unwrap();
        }
        drop(first);
        let mut resumed = Reporter::new(config(true, 2)).unwrap();
        resumed.step(record(2, 2.5), 1.0).unwrap();
        resumed.step(record(3, 2.0), 0.5).unwrap();
        let summary = resumed
            .finish(
                &dir.join("loss.svg"),
                100.0,
                vec![super::super::memory::RankMemory::default(); 2],
            )
            .unwrap();
        assert_eq!((summary.first_loss, summary.last_loss), (2.5, 2.0));
        // Two steps: the first is warm-up, the second (0.5 s, 10 tokens) is the steady state.
        assert_eq!(summary.warmup_steps, 1);
        assert_eq!(summary.steady_tokens_per_second, Some(20.0));
        assert_eq!(summary.steady_step_seconds, Some(0.5));
        let read = read_losses(&losses).unwrap();
        let losses: Vec<f64> = read.iter().map(|r| r.loss).collect();
        assert_eq!(losses, vec![4.0, 3.0, 2.5, 2.0]);
        let first_line = std::fs::read_to_string(dir.join("losses.jsonl")).unwrap();
        assert!(first_line.starts_with(r#"{"step":0,"loss":4.0,"lr":0.1,"tokens":10}"#));
        assert!(dir.join("loss.svg").exists());
        assert_eq!(human_bytes(1536.0), "1.5 KiB");
    }

    #[test]
    fn warm_up_is_a_fifth_of_the_run_between_two_and_five_steps() {
        assert_eq!(
            [1, 2, 3, 4, 5, 12, 15, 25, 30, 400].map(warmup_steps),
            [1, 1, 2, 2, 2, 2, 3, 5, 5, 5]
        );
    }

    #[test]
    fn steady_state_leaves_out_the_warm_up_and_sums_the_rest() {
        // Ten steps: two warm-up (slow), then 8 steps of 0.1 s except one of 0.5 s.
        let mut seconds = vec![3.0, 1.0];
        seconds.extend([0.1, 0.1, 0.1, 0.5, 0.1, 0.1, 0.1, 0.1]);
        let steady = SteadyState::of(&seconds, 100);
        assert_eq!(steady.warmup_steps, 2);
        // 800 tokens over 1.2 s.
        let rate = steady.tokens_per_second.unwrap();
        assert!((rate - 800.0 / 1.2).abs() < 1e-9, "{rate}");
        assert_eq!(steady.median_step_seconds, Some(0.1));
        // One step only: it is the warm-up, and there is no steady state.
        let one = SteadyState::of(&[2.0], 100);
        assert_eq!((one.warmup_steps, one.tokens_per_second), (1, None));
        assert_eq!(one.median_step_seconds, None);
    }
}
