//! `hypershard export`: one consolidated safetensors file with nanoGPT names, or a Hugging
//! Face GPT-2 folder.

use std::path::{Path, PathBuf};

use clap::Args;
use hypershard::Error;
use hypershard::checkpoint::{Checkpoint, export_consolidated};
use hypershard::train::{HF_CONFIG_FILE, HF_WEIGHTS_FILE, check_model_tensors, export_hf};

/// What `export` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// One safetensors file with nanoGPT parameter names.
    Nanogpt,
    /// A Hugging Face GPT-2 folder: config.json and model.safetensors for
    /// transformers' GPT2LMHeadModel.from_pretrained.
    Hf,
}

/// Write a checkpoint's model as one safetensors file (nanoGPT parameter names) or as a
/// Hugging Face GPT-2 folder.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint directory, a checkpoint root, or a training output directory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The file to write (--format nanogpt) or the folder (--format hf).
    #[arg(long)]
    out: PathBuf,
    /// The layout written.
    #[arg(long, value_enum, default_value_t = Format::Nanogpt)]
    format: Format,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(args: ExportArgs) -> Result<(), Error> {
    if args.format == Format::Hf {
        return run_hf(&args);
    }
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

/// `--format hf`: `--out` is a folder (created if absent) whose config.json and
/// model.safetensors are replaced only with `--force`.
fn run_hf(args: &ExportArgs) -> Result<(), Error> {
    let refuse = |path: &Path, reason: &str| Error::InvalidOutput {
        flag: "--out",
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    if args.out.exists() && !args.out.is_dir() {
        return Err(refuse(
            &args.out,
            "is not a directory (--format hf writes a folder)",
        ));
    }
    for file in [HF_CONFIG_FILE, HF_WEIGHTS_FILE] {
        let path = args.out.join(file);
        if path.exists() && !args.force {
            return Err(refuse(&path, "already exists (pass --force to replace it)"));
        }
    }
    let checkpoint = Checkpoint::open(&args.checkpoint)?;
    let summary = export_hf(&checkpoint, &args.out, args.force)?;
    println!(
        "wrote {} ({} tensors, {} bytes, Hugging Face GPT-2 layout) from {} (step {})",
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
