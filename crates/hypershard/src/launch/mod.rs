//! `hypershard launch`: a torchrun-compatible process launcher.
//!
//! It starts `nproc_per_node` copies of a command on this node with the variables torchrun
//! sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`),
//! so any program that calls `hypershard_collectives::tcp::init_from_env()` runs under it
//! unchanged. It prefixes every output line with `[rank N] `, forwards SIGINT/SIGTERM to the
//! ranks, and when one rank fails it stops the others and reports the failed rank and how it
//! ended.
//!
//! Node 0's launcher hosts the rendezvous store (as torchrun's agent does); it picks the port
//! (a free one by default) and checks that a given port is free before any rank starts.
//!
//! Every connection of the job (Store and mesh) is authenticated with a per-job secret
//! (`hypershard_collectives::auth`): the launcher takes it from `HYPERSHARD_JOB_SECRET_FILE` or
//! `HYPERSHARD_JOB_SECRET` when set (multi-node jobs must set the same one on every node), and
//! otherwise, on a single node, generates a fresh random one and hands it to the ranks in
//! `HYPERSHARD_JOB_SECRET`. It never prints it.

mod limits;
mod memory_limit;
mod output;
mod signal;
mod stall;

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub use limits::{
    LimitSource, MemoryLimit, human_bytes, rank_limits, read_file, reserve, zeroed_buffer,
};
pub use memory_limit::{RankCgroups, parse_size};
pub use output::Sink;
pub use signal::{SIGINT, SIGKILL, SIGTERM, SignalLatch, signal_group};

use hypershard_collectives::auth::{JobSecret, SECRET_ENV, SECRET_FILE_ENV};
use hypershard_collectives::store::TcpStoreServer;
use hypershard_collectives::{Error as CollectivesError, IoAction};

use crate::error::{Error, ExitKind, Result};

/// How often the launcher polls its ranks and the signal latch.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// How long the launcher waits for the last output lines after every rank has exited.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// What to launch and where it sits in the job.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Processes on this node (`--nproc-per-node`).
    pub nproc_per_node: usize,
    /// Nodes in the job (`--nnodes`).
    pub nnodes: usize,
    /// This node's index (`--node-rank`).
    pub node_rank: usize,
    /// The host of global rank 0 (`--master-addr`).
    pub master_addr: String,
    /// The rendezvous port (`--master-port`); `None` picks a free one (single node only).
    pub master_port: Option<u16>,
    /// The program to run.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra variables for every rank.
    pub extra_env: Vec<(OsString, OsString)>,
    /// How long stopped ranks get between SIGTERM and SIGKILL.
    pub stop_timeout: Duration,
    /// Local rank 0 writes straight to the launcher's terminal, unprefixed, so that a progress
    /// bar it draws works (`hypershard train` sets this); the other ranks stay prefixed.
    pub rank0_owns_terminal: bool,
    /// Each rank's memory budget in bytes (`--max-rank-memory`), enforced by a memory cgroup
    /// per rank; `None`: no limit.
    pub max_rank_memory: Option<u64>,
}

impl LaunchConfig {
    /// A single-node launch of `program args` on `nproc_per_node` ranks, free port, 127.0.0.1.
    pub fn local(nproc_per_node: usize, program: OsString, args: Vec<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: None,
            program,
            args,
            extra_env: Vec::new(),
            stop_timeout: Duration::from_secs(5),
            rank0_owns_terminal: false,
            max_rank_memory: None,
        }
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node.saturating_mul(self.nnodes)
    }

    fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            return Err(Error::InvalidLaunchOption {
                option: "--nproc-per-node",
                reason: "must be at least 1".to_string(),
            });
        }
        if self.nnodes == 0 {
            return Err(Error::InvalidLaunchOption {
                option: "--nnodes",
                reason: "must be at least 1".to_string(),
            });
        }
        if self.node_rank >= self.nnodes {
            return Err(Error::InvalidLaunchOption {
                option: "--node-rank",
                reason: format!("{} is not below --nnodes {}", self.node_rank, self.nnodes),
            });
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return Err(Error::InvalidLaunchOption {
                option: "--master-port",
                reason: "is required with --nnodes > 1 (every node must use the same port)"
                    .to_string(),
            });
        }
        if self.master_port == Some(0) {
            return Err(Error::InvalidLaunchOption {
                option: "--master-port",
                reason: "must be between 1 and 65535".to_string(),
            });
        }
        Ok(())
    }
}

/// How a launch that ran every rank to completion went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchReport {
    /// The rendezvous port used.
    pub master_port: u16,
    /// Ranks in the job.
    pub world_size: usize,
}

/// One running rank process.
struct RankProcess {
    rank: usize,
    child: Child,
    exited: Option<ExitStatus>,
    /// The signals the launcher sent it: a rank that dies of one of them is a bystander.
    sent: Vec<i32>,
}

impl RankProcess {
    /// Sends `signal` to the rank's process group and remembers it.
    fn signal(&mut self, signal: i32) {
        if !self.sent.contains(&signal) {
            self.sent.push(signal);
        }
        signal_group(self.child.id(), signal);
    }

    /// How much a failure of this rank says about the cause of the job's end: 3 for a
    /// signal the launcher did not send (killed from outside: kill -9, the OOM killer),
    /// 1 for a non-zero exit before the launcher signalled it, 0 for a bystander.
    fn blame(&self, kind: ExitKind) -> u8 {
        match kind {
            ExitKind::Signal(signal) if !self.sent.contains(&signal) => 3,
            ExitKind::Code(_) if self.sent.is_empty() => 1,
            _ => 0,
        }
    }
}

/// Why the launcher is stopping the ranks early.
#[derive(Clone, Debug)]
enum StopReason {
    RankFailed {
        rank: usize,
        status: ExitKind,
        blame: u8,
    },
    Stalled(stall::Stall),
    Interrupted {
        signal: i32,
    },
}

impl StopReason {
    /// Which reason wins when several appear: an interrupt is never replaced, then a rank
    /// killed from outside, a stall, a rank that failed on its own, a bystander.
    fn weight(&self) -> u8 {
        match self {
            StopReason::Interrupted { .. } => 5,
            StopReason::RankFailed { blame, .. } => *blame + u8::from(*blame >= 3),
            StopReason::Stalled(_) => 3,
        }
    }
}

/// Keeps the weightier of the current reason and `candidate`; returns whether it changed.
fn offer(reason: &mut Option<StopReason>, candidate: StopReason) -> bool {
    match reason {
        Some(current) if current.weight() >= candidate.weight() => false,
        _ => {
            *reason = Some(candidate);
            true
        }
    }
}

fn exit_kind(status: ExitStatus) -> ExitKind {
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitKind::Code(code),
        (None, Some(signal)) => ExitKind::Signal(signal),
        // invariant: on Unix a finished process has either a code or a signal.
        (None, None) => ExitKind::Code(-1),
    }
}

/// Makes the rank receive SIGKILL when the launcher dies (Linux `PR_SET_PDEATHSIG`), so a
/// launcher killed by SIGKILL (which it cannot forward) takes its ranks with it instead of
/// leaving them orphaned, waiting on a Store that no longer exists.
fn die_with_launcher(command: &mut Command) {
    let launcher = std::process::id();
    // SAFETY: the closure runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: prctl(2), getppid(2) and raise(3) are, and the closure allocates
    // nothing and touches no lock.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl; then nobody will signal us.
            if u32::try_from(libc::getppid()).ok() != Some(launcher) {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
}

/// The job's secret and whether the ranks still need to be given it.
struct LaunchSecret {
    secret: Option<JobSecret>,
    /// Set when the launcher generated the secret: the ranks get it in [`SECRET_ENV`].
    generated: bool,
}

/// The secret of the job: the one in the environment, else (single node) a fresh one, else
/// none (a multi-node job without one runs unauthenticated, with a warning).
fn launch_secret(config: &LaunchConfig) -> Result<LaunchSecret> {
    if let Some(secret) = JobSecret::from_env()? {
        return Ok(LaunchSecret {
            secret: Some(secret),
            generated: false,
        });
    }
    if config.nnodes == 1 {
        return Ok(LaunchSecret {
            secret: Some(JobSecret::generate()?),
            generated: true,
        });
    }
    tracing::warn!(
        "neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set: this multi-node job's connections \
         are not authenticated (set the same secret on every node)"
    );
    Ok(LaunchSecret {
        secret: None,
        generated: false,
    })
}

/// Runs the job's ranks on this node until all have exited. Returns `Ok` when every rank
/// exited with status 0, [`Error::RankFailed`] naming the first rank that did not (after
/// stopping the others: SIGTERM, then SIGKILL after `stop_timeout`), and
/// [`Error::Interrupted`] when SIGINT/SIGTERM arrived (forwarded to every rank).
pub fn launch(config: &LaunchConfig) -> Result<LaunchReport> {
    config.validate()?;
    let LaunchSecret { secret, generated } = launch_secret(config)?;
    // Node 0's launcher hosts the job's store, as torchrun's agent does, so the store outlives
    // any one rank (rank 0 included) and every rank connects to it as a client. Binding the
    // server is also the port check, and with no port given the OS picks a free one, so there
    // is no window between probing a port and using it.
    let (store_server, master_port) = if config.node_rank == 0 {
        let wanted = config.master_port.unwrap_or(0);
        let server =
            TcpStoreServer::bind_with_secret((config.master_addr.as_str(), wanted), secret.clone())
                .map_err(|error| match error {
                    CollectivesError::Io {
                        action: IoAction::Bind,
                        source,
                        ..
                    } if wanted != 0 => Error::PortInUse {
                        addr: config.master_addr.clone(),
                        port: wanted,
                        source,
                    },
                    other => Error::from(other),
                })?;
        let port = server.local_addr().port();
        (Some(server), port)
    } else {
        // `validate` requires --master-port whenever --nnodes > 1, which a node rank above 0
        // implies, so this error only guards against a future change to `validate`.
        let port = config
            .master_port
            .ok_or_else(|| Error::InvalidLaunchOption {
                option: "--master-port",
                reason: "is required on nodes other than node 0".to_string(),
            })?;
        (None, port)
    };
    let latch = SignalLatch::install()?;
    let world_size = config.world_size();
    let cgroups = match config.max_rank_memory {
        Some(limit) => Some(RankCgroups::create(config.nproc_per_node, limit)?),
        None => None,
    };
    let (done_sender, done_receiver) = mpsc::channel();
    let mut streams = 0usize;
    let mut ranks: Vec<RankProcess> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let rank = config.node_rank * config.nproc_per_node + local_rank;
        let owns_terminal = config.rank0_owns_terminal && local_rank == 0;
        let mut command = Command::new(&config.program);
        command
            .args(&config.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("GROUP_RANK", config.node_rank.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .env(hypershard_collectives::tcp::AGENT_STORE_VAR, "True")
            .envs(config.extra_env.iter().map(|(k, v)| (k, v)));
        die_with_launcher(&mut command);
        if generated && let Some(text) = secret.as_ref().and_then(JobSecret::expose_text) {
            command.env(SECRET_ENV, text).env_remove(SECRET_FILE_ENV);
        }
        command
            .stdin(if owns_terminal {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .process_group(0);
        if !owns_terminal {
            command.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(source) => {
                stop_all(&mut ranks, config.stop_timeout);
                return Err(Error::Spawn {
                    rank,
                    program: config.program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        let pipes = [
            child
                .stdout
                .take()
                .map(|s| (Box::new(s) as Box<dyn std::io::Read + Send>, Sink::Stdout)),
            child
                .stderr
                .take()
                .map(|s| (Box::new(s) as Box<dyn std::io::Read + Send>, Sink::Stderr)),
        ];
        for (reader, sink) in pipes.into_iter().flatten() {
            if output::forward_lines(rank, reader, sink, done_sender.clone()).is_ok() {
                streams += 1;
            }
        }
        // Into its cgroup before it allocates anything large: the rank's first act is the
        // rendezvous, which waits for every rank to be spawned.
        if let Some(cgroups) = &cgroups
            && let Err(error) = cgroups.add(local_rank, child.id())
        {
            let _ = child.kill();
            let _ = child.wait();
            stop_all(&mut ranks, config.stop_timeout);
            return Err(error);
        }
        ranks.push(RankProcess {
            rank,
            child,
            exited: None,
            sent: Vec::new(),
        });
    }
    drop(done_sender);
    tracing::info!(
        world_size,
        master_port,
        node_rank = config.node_rank,
        authenticated = secret.is_some(),
        "launched ranks"
    );

    let watch = store_server
        .as_ref()
        .map(|server| stall::StallWatch::new(server.store(), world_size));
    let outcome = supervise(&mut ranks, &latch, config.stop_timeout, watch);
    drop(store_server);
    // The ranks have exited; give their last lines a moment to come through before the
    // launcher prints its own verdict.
    let drain_deadline = Instant::now() + OUTPUT_DRAIN;
    for _ in 0..streams {
        let left = drain_deadline.saturating_duration_since(Instant::now());
        if done_receiver.recv_timeout(left).is_err() {
            break;
        }
    }
    match outcome? {
        None => Ok(LaunchReport {
            master_port,
            world_size,
        }),
        Some(StopReason::Stalled(stall)) => {
            let local_pid = ranks
                .iter()
                .find(|p| p.rank == stall.rank)
                .map(|p| p.child.id());
            let declaration = &stall.declaration;
            Err(Error::RankStalled {
                rank: stall.rank,
                pid: local_pid.or(stall.pid).unwrap_or(0),
                host: if stall.host.is_empty() {
                    "unknown".to_string()
                } else {
                    stall.host.clone()
                },
                waiter: declaration.waiter,
                waited_s: declaration.waited_ms as f64 / 1000.0,
                op: declaration.op().to_string(),
                seq: declaration.seq(),
                group: declaration.group.name.clone(),
            })
        }
        Some(StopReason::RankFailed { rank, status, .. }) => {
            let local_rank = rank - config.node_rank * config.nproc_per_node;
            match &cgroups {
                Some(cgroups) if cgroups.hit_limit(local_rank) => Err(Error::RankOverMemory {
                    rank,
                    limit_mib: cgroups.limit() as f64 / (1u64 << 20) as f64,
                    status,
                }),
                _ => Err(Error::RankFailed { rank, status }),
            }
        }
        Some(StopReason::Interrupted { signal }) => Err(Error::Interrupted { signal }),
    }
}

/// Polls the ranks until all have exited, stopping the rest on the first failure, stall or
/// signal. The reason returned names the rank most likely at fault, not the first to exit:
/// when one rank is killed its peers fail within milliseconds (PeerLost), sometimes before
/// the killed rank's own exit is visible, so a later-seen rank killed from outside still
/// takes the blame from a rank that merely exited non-zero ([`StopReason::weight`]).
fn supervise(
    ranks: &mut [RankProcess],
    latch: &SignalLatch,
    stop_timeout: Duration,
    mut watch: Option<stall::StallWatch>,
) -> Result<Option<StopReason>> {
    let mut reason: Option<StopReason> = None;
    let mut kill_at: Option<Instant> = None;
    let mut pending_stall: Option<stall::Stall> = None;
    loop {
        if let Some(signal) = latch.take() {
            for process in ranks.iter_mut().filter(|p| p.exited.is_none()) {
                process.signal(signal);
            }
            offer(&mut reason, StopReason::Interrupted { signal });
            kill_at.get_or_insert(Instant::now() + stop_timeout);
        }
        if let Some(stall) = watch.as_mut().and_then(stall::StallWatch::poll)
            && stall.fail
        {
            pending_stall = Some(stall);
        }
        if pending_stall
            .as_ref()
            .is_some_and(|s| Instant::now() >= s.act_at)
            && let Some(stall) = pending_stall.take()
        {
            act_on_stall(ranks, &stall);
            offer(&mut reason, StopReason::Stalled(stall));
            kill_at.get_or_insert(Instant::now() + stop_timeout);
        }
        // Every rank that failed since the last poll; the weightiest (then the lowest rank)
        // is this poll's candidate.
        let mut failed: Option<(usize, ExitKind, u8)> = None;
        for process in ranks.iter_mut() {
            if process.exited.is_some() {
                continue;
            }
            let rank = process.rank;
            let status = process
                .child
                .try_wait()
                .map_err(|source| Error::Wait { rank, source })?;
            let Some(status) = status else { continue };
            process.exited = Some(status);
            if !status.success() {
                let kind = exit_kind(status);
                let blame = process.blame(kind);
                if failed.is_none_or(|(_, _, b)| blame > b) {
                    failed = Some((rank, kind, blame));
                }
            }
        }
        if let Some((rank, kind, blame)) = failed {
            let first = reason.is_none();
            let candidate = StopReason::RankFailed {
                rank,
                status: kind,
                blame,
            };
            if offer(&mut reason, candidate) {
                tracing::info!(rank, status = %kind, "rank failed; stopping the others");
            }
            // While a stall's grace runs the ranks are printing their reports and aborting
            // on their own; otherwise the first failure stops everyone.
            if first && pending_stall.is_none() {
                for process in ranks.iter_mut().filter(|p| p.exited.is_none()) {
                    process.signal(SIGTERM);
                }
                kill_at = Some(Instant::now() + stop_timeout);
            }
        }
        if ranks.iter().all(|p| p.exited.is_some()) {
            if let Some(stall) = pending_stall.take() {
                offer(&mut reason, StopReason::Stalled(stall));
            }
            return Ok(reason);
        }
        if let Some(deadline) = kill_at
            && Instant::now() >= deadline
        {
            for process in ranks.iter_mut().filter(|p| p.exited.is_none()) {
                process.signal(SIGKILL);
            }
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Kills the rank a stall is blamed on (SIGKILL: it may be stopped, and a stopped process
/// acts on no other signal) and asks the others to stop.
fn act_on_stall(ranks: &mut [RankProcess], stall: &stall::Stall) {
    for process in ranks.iter_mut().filter(|p| p.exited.is_none()) {
        process.signal(if process.rank == stall.rank {
            SIGKILL
        } else {
            SIGTERM
        });
    }
}

/// Stops every started rank (used when a later rank cannot even be spawned).
fn stop_all(ranks: &mut [RankProcess], stop_timeout: Duration) {
    for process in ranks.iter() {
        signal_group(process.child.id(), SIGTERM);
    }
    let deadline = Instant::now() + stop_timeout;
    for process in ranks.iter_mut() {
        loop {
            match process.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    signal_group(process.child.id(), SIGKILL);
                    let _ = process.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(POLL_INTERVAL),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_options_are_named() {
        let base = LaunchConfig::local(2, "true".into(), Vec::new());
        let mut bad = base.clone();
        bad.nproc_per_node = 0;
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidLaunchOption {
                option: "--nproc-per-node",
                ..
            })
        ));
        let mut bad = base.clone();
        bad.nnodes = 2;
        bad.node_rank = 2;
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidLaunchOption {
                option: "--node-rank",
                ..
            })
        ));
        let mut bad = base.clone();
        bad.nnodes = 2;
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidLaunchOption {
                option: "--master-port",
                ..
            })
        ));
        assert_eq!(base.world_size(), 2);
        base.validate().unwrap();
    }

    #[test]
    fn exit_kinds_distinguish_codes_and_signals() {
        assert_eq!(exit_kind(ExitStatus::from_raw(3 << 8)), ExitKind::Code(3));
        assert_eq!(exit_kind(ExitStatus::from_raw(15)), ExitKind::Signal(15));
    }
}
