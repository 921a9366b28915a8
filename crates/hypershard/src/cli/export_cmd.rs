//! `hypershard export`: one consolidated safetensors file with nanoGPT names.

use std::path::{Path, PathBuf};

use clap::Args;
use hypershard::Error;
use hypershard::checkpoint::{Checkpoint, export_consolidated};
use hypershard::train::check_model_tensors;

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
    check_out(&args.out, args.force)?;
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    // Every tensor of the model, with its shape, before anything is written.
    check_model_tensors(&checkpoint)?;
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

/// Refuses an `--out` that is a directory, or a file that exists without `--force`.
fn check_out(out: &Path, force: bool) -> Result<(), Error> {
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return Ok(());
    };
    let reason = if meta.is_dir() {
        "is a directory (name the file to write)"
    } else if !force {
        "already exists (pass --force to replace it)"
    } else if !meta.is_file() {
        "is not a regular file; --force replaces only files"
    } else {
        return Ok(());
    };
    Err(Error::InvalidOutput {
        flag: "--out",
        path: out.to_path_buf(),
        reason: reason.to_string(),
    })
}
