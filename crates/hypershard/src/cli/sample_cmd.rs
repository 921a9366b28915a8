//! `hypershard sample`.

use std::path::PathBuf;

use clap::Args;
use hypershard::Error;
use hypershard::sample::{SampleConfig, sample_from_checkpoint};

/// Generate text from a trained checkpoint.
#[derive(Debug, Args)]
pub struct SampleArgs {
    /// A checkpoint directory, a checkpoint root, or a training output directory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k likeliest tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sampler seed.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
}

pub fn run(args: SampleArgs) -> Result<(), Error> {
    // A NaN or infinite temperature turns every logit into NaN or zero: refuse it up front.
    super::checks::positive_float("--temperature", args.temperature)?;
    let output = sample_from_checkpoint(
        &args.checkpoint,
        &args.prompt,
        &SampleConfig {
            max_new_tokens: args.max_new_tokens,
            temperature: args.temperature,
            top_k: args.top_k,
            seed: args.seed,
        },
    )?;
    println!("{}", output.text);
    Ok(())
}
