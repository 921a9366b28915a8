//! `hypershard export`: one consolidated safetensors file with nanoGPT names.

use std::path::PathBuf;

use clap::Args;
use hypershard::Error;
use hypershard::checkpoint::{Checkpoint, export_consolidated};

/// Write a checkpoint's model as one safetensors file (nanoGPT parameter names).
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint directory, a checkpoint root, or a training output directory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The file to write.
    #[arg(long)]
    out: PathBuf,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(args: ExportArgs) -> Result<(), Error> {
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let summary = export_consolidated(&checkpoint, &args.out, args.force, |name| {
        name.strip_prefix("model/").map(str::to_string)
    })?;
    println!(
        "wrote {} ({} tensors, {} bytes) from {} (step {})",
        args.out.display(),
        summary.tensors,
        summary.bytes,
        checkpoint.dir().display(),
        checkpoint.step()
    );
    Ok(())
}
