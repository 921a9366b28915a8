//! Where a rank's memory goes: training state, communication buffers, activations, and the
//! process's resident set next to the allocator tracker's figure.

use hypershard_collectives::{Communicator, CommunicatorExt};
use hypershard_nn::Module;

use super::optimizer::ShardedAdamW;
use crate::error::Result;

/// One rank's memory over a run, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankMemory {
    /// The global rank these figures are of.
    pub rank: usize,
    /// Parameters, gradients and optimizer moments this rank holds (its shards), at the
    /// largest they were: measured after an optimizer step, when all three exist.
    pub state_bytes: u64,
    /// The most bytes FSDP's communication buffers had in use at once (all-gather outputs,
    /// which hold the unsharded parameters while a unit computes, and reduce-scatter inputs).
    pub comm_buffer_bytes: u64,
    /// Activations and temporaries: the tracker's peak less the training state (parameters,
    /// gradients and AdamW moments) and the communication buffers. A lower bound, since the
    /// parts need not peak together.
    pub activation_bytes: u64,
    /// The peak of all tensor storage the allocator tracker counted on this rank.
    pub tracker_peak_bytes: u64,
    /// The process's peak resident set (`VmHWM`) once the model was built and sharded,
    /// before the first step: the start-up cost.
    pub startup_peak_rss_bytes: u64,
    /// The process's peak resident set (`VmHWM`) over the whole run, everything included.
    pub peak_rss_bytes: u64,
    /// The process's resident set before the model was built (code, libraries, runtime).
    pub idle_rss_bytes: u64,
}

/// A field of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`); 0 where there is no procfs.
pub fn proc_status_bytes(field: &str) -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    text.lines()
        .find_map(|line| {
            let rest = line.strip_prefix(field)?.strip_prefix(':')?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib.saturating_mul(1024))
        })
        .unwrap_or(0)
}

/// Bytes of this rank's parameter shards and their gradients.
pub fn param_and_grad_bytes(model: &dyn Module) -> Result<u64> {
    let mut bytes = 0u64;
    model.visit_params("", &mut |_, param| {
        if let Some(data) = &param.data {
            bytes += data.nbytes() as u64;
        }
        if let Some(grad) = &param.grad {
            bytes += grad.nbytes() as u64;
        }
        Ok(())
    })?;
    Ok(bytes)
}

/// Tracks the figures of one rank through a run.
#[derive(Debug, Default)]
pub struct MemoryMeter {
    idle_rss: u64,
    startup_peak_rss: u64,
    /// Parameters and gradients, and moments, at the largest measured state.
    params_and_grads: u64,
    moments: u64,
}

impl MemoryMeter {
    /// Starts metering: call before the model is built.
    pub fn start() -> MemoryMeter {
        MemoryMeter {
            idle_rss: proc_status_bytes("VmRSS"),
            ..MemoryMeter::default()
        }
    }

    /// Records the start-up peak: call once the model is built and sharded.
    pub fn after_build(&mut self) {
        self.startup_peak_rss = proc_status_bytes("VmHWM");
    }

    /// Measures the training state: call after an optimizer step, before gradients are
    /// cleared.
    pub fn after_step(&mut self, model: &dyn Module, optimizer: &ShardedAdamW) -> Result<()> {
        let params_and_grads = param_and_grad_bytes(model)?;
        let moments = optimizer.moment_bytes();
        if params_and_grads + moments > self.params_and_grads + self.moments {
            self.params_and_grads = params_and_grads;
            self.moments = moments;
        }
        Ok(())
    }

    /// This rank's figures.
    pub fn report(&self, rank: usize, comm_buffer_peak: usize) -> RankMemory {
        let tracker_peak = hypershard_tensor::memory::process().peak_bytes as u64;
        let comm = comm_buffer_peak as u64;
        RankMemory {
            rank,
            state_bytes: self.params_and_grads + self.moments,
            comm_buffer_bytes: comm,
            activation_bytes: tracker_peak
                .saturating_sub(self.params_and_grads + self.moments + comm),
            tracker_peak_bytes: tracker_peak,
            startup_peak_rss_bytes: self.startup_peak_rss,
            peak_rss_bytes: proc_status_bytes("VmHWM"),
            idle_rss_bytes: self.idle_rss,
        }
    }
}

/// The fields of [`RankMemory`], as sent between ranks.
const FIELDS: usize = 7;

/// Every rank's figures, in rank order (collective over `world`).
pub fn gather_memory(world: &dyn Communicator, own: RankMemory) -> Result<Vec<RankMemory>> {
    let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let fields = vec![
        to_i64(own.state_bytes),
        to_i64(own.comm_buffer_bytes),
        to_i64(own.activation_bytes),
        to_i64(own.tracker_peak_bytes),
        to_i64(own.startup_peak_rss_bytes),
        to_i64(own.peak_rss_bytes),
        to_i64(own.idle_rss_bytes),
    ];
    let all = world.all_gather_vec(fields)?;
    let back = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(all
        .chunks_exact(FIELDS)
        .enumerate()
        .map(|(rank, f)| RankMemory {
            rank,
            state_bytes: back(f[0]),
            comm_buffer_bytes: back(f[1]),
            activation_bytes: back(f[2]),
            tracker_peak_bytes: back(f[3]),
            startup_peak_rss_bytes: back(f[4]),
            peak_rss_bytes: back(f[5]),
            idle_rss_bytes: back(f[6]),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_fields_parse_and_the_peak_is_at_least_the_current() {
        let rss = proc_status_bytes("VmRSS");
        let peak = proc_status_bytes("VmHWM");
        assert!(rss > 1 << 20, "a test process holds more than 1 MiB: {rss}");
        assert!(peak >= rss, "{peak} < {rss}");
        assert_eq!(proc_status_bytes("NoSuchField"), 0);
    }

    #[test]
    fn a_large_allocation_shows_in_the_peak_rss() {
        let before = proc_status_bytes("VmHWM");
        let block = vec![1u8; 64 << 20];
        let after = proc_status_bytes("VmHWM");
        assert!(block.iter().all(|&b| b == 1));
        assert!(after >= before.max(64 << 20), "{before} -> {after}");
    }
}
