//! The logits of hypershard's GPT for a batch of token ids, with the weights of a Hugging Face
//! GPT-2 folder (read as `train --init-from-hf` reads it) or of a nanoGPT-named safetensors
//! file, written to a safetensors file. `crates/hypershard/scripts/hf_gpt2_parity.py` compares
//! them with `transformers`' logits.
//!
//! ```text
//! cargo run --release -p hypershard --example hf_logits -- HF_DIR IDS OUT [NANOGPT_FILE]
//! ```
//!
//! `IDS` is rows of comma-separated ids separated by `;` (`"1,2,3;4,5,6"`); the model is the one
//! `HF_DIR/config.json` describes; with `NANOGPT_FILE` the weights come from that file instead.

use std::path::PathBuf;

use hypershard::nn::{Gpt, Module};
use hypershard::tensor::Tensor;
use hypershard::train::{HfGpt2Config, attach_hf_init};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [hf, ids, out, rest @ ..] = args.as_slice() else {
        return Err("usage: hf_logits HF_DIR IDS OUT [NANOGPT_FILE]".into());
    };
    let hf = PathBuf::from(hf);
    let rows: Vec<Vec<i64>> = ids
        .split(';')
        .map(|row| row.split(',').map(|t| t.trim().parse::<i64>()).collect())
        .collect::<Result<_, _>>()?;
    let cols = rows.first().map_or(0, Vec::len);
    if rows.iter().any(|r| r.len() != cols) {
        return Err("every row of IDS must hold as many ids".into());
    }
    let shape = HfGpt2Config::load(&hf)?.model_shape();
    let config = shape.config(0, 0)?;
    let mut model = Gpt::new(config.gpt())?;
    match rest.first() {
        Some(file) => model.load_safetensors_file(std::path::Path::new(file))?,
        None => drop(attach_hf_init(&mut model, &hf)?),
    }
    model.set_training(false)?;
    let input = Tensor::from_vec(rows.concat(), &[rows.len(), cols])?;
    let logits = model.forward(&input)?.contiguous()?;
    hypershard::tensor::save_safetensors_file([("logits", &logits)], &PathBuf::from(out))?;
    Ok(())
}
