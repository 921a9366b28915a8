//! Argument parsing and dispatch for the `hypershard` binary.

mod checks;
mod export_cmd;
mod launch_cmd;
mod resume;
mod sample_cmd;
mod stall_flags;
mod train_cmd;

use clap::{Parser, Subcommand};
use hypershard::{Error, ExitKind};

/// Fully sharded data-parallel training in Rust.
#[derive(Debug, Parser)]
#[command(name = "hypershard", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train nanoGPT's GPT under fully_shard on N local ranks (default: 4 ranks, a 2x2 mesh).
    Train(Box<train_cmd::TrainArgs>),
    /// Run a command on N ranks with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...).
    Launch(launch_cmd::LaunchArgs),
    /// Generate text from a checkpoint.
    Sample(sample_cmd::SampleArgs),
    /// Write a checkpoint's model as one safetensors file with nanoGPT names.
    Export(export_cmd::ExportArgs),
}

/// Sends `tracing` output to stderr, filtered by `RUST_LOG` (default: warnings).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<(), Error> {
    match cli.command {
        Command::Train(args) => train_cmd::run(*args),
        Command::Launch(args) => launch_cmd::run(args),
        Command::Sample(args) => sample_cmd::run(args),
        Command::Export(args) => export_cmd::run(args),
    }
}

/// The process exit status for an error: a failed rank's own code where it has one,
/// 128 + signal for signals (the shell's convention), 1 otherwise.
pub fn exit_code(error: &Error) -> u8 {
    let code = match error {
        Error::RankFailed {
            status: ExitKind::Code(code),
            ..
        } => *code,
        Error::RankFailed {
            status: ExitKind::Signal(signal),
            ..
        }
        | Error::Interrupted { signal } => 128 + signal,
        _ => 1,
    };
    u8::try_from(code).ok().filter(|c| *c != 0).unwrap_or(1)
}
