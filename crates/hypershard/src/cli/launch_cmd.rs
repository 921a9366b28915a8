//! `hypershard launch`.

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use hypershard::Error;
use hypershard::launch::{LaunchConfig, launch};

/// torchrun-compatible options.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Processes to start on this node.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0-based (node 0 runs global rank 0, which hosts the store).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Rendezvous port on node 0 (default: a free port; required with --nnodes > 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// Each rank's memory budget (e.g. `1.25GiB`): a memory cgroup per rank with this limit.
    #[arg(long, value_name = "SIZE", value_parser = hypershard::launch::parse_size)]
    max_rank_memory: Option<u64>,
    /// Seconds a stopped rank gets between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    stop_timeout: f64,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<OsString>,
}

pub fn run(args: LaunchArgs) -> Result<(), Error> {
    super::checks::product(
        &[
            ("--nproc-per-node", args.nproc_per_node),
            ("--nnodes", args.nnodes),
        ],
        "the world size",
    )?;
    let mut command = args.command.into_iter();
    // invariant: clap requires at least one value for `command`.
    let program = command.next().unwrap_or_default();
    let stop_timeout =
        Duration::try_from_secs_f64(args.stop_timeout).map_err(|_| Error::InvalidLaunchOption {
            option: "--stop-timeout",
            reason: format!("{} is not a number of seconds", args.stop_timeout),
        })?;
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        program,
        args: command.collect(),
        extra_env: Vec::new(),
        stop_timeout,
        rank0_owns_terminal: false,
        max_rank_memory: args.max_rank_memory,
    };
    launch(&config)?;
    Ok(())
}
