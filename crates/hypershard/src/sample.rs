//! `hypershard sample`: text from a trained model (nanoGPT's `generate`: temperature, top-k,
//! multinomial sampling), with a seeded generator so a sample can be reproduced.

use std::path::Path;

use hypershard_nn::{Gpt, GptConfig, Module};
use hypershard_tensor::{DType, Tensor};

use crate::checkpoint::Checkpoint;
use crate::data::{Tokenizer, TokenizerKind};
use crate::error::{Error, Result};
use crate::train::load_whole;

/// How to sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleConfig {
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// Softmax temperature (> 0; lower is greedier).
    pub temperature: f64,
    /// Keep only the `k` likeliest tokens (0: all).
    pub top_k: usize,
    /// Seed of the sampler.
    pub seed: u64,
}

/// A small counter-based generator (SplitMix64): uniform f64 in [0, 1).
struct Sampler {
    state: u64,
}

impl Sampler {
    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks the next token from one row of logits.
fn pick(logits: &[f32], config: &SampleConfig, sampler: &mut Sampler) -> u32 {
    let temperature = config.temperature.max(1e-6);
    let mut scaled: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, l)| (i, f64::from(*l) / temperature))
        .collect();
    if config.top_k > 0 && config.top_k < scaled.len() {
        scaled.sort_by(|a, b| b.1.total_cmp(&a.1));
        scaled.truncate(config.top_k);
    }
    let max = scaled
        .iter()
        .map(|(_, l)| *l)
        .fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scaled.iter().map(|(_, l)| (l - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut target = sampler.next_f64() * total;
    for ((index, _), weight) in scaled.iter().zip(&weights) {
        if target < *weight {
            // invariant: indices come from a vocabulary that fits in u32 (checked by the model).
            return u32::try_from(*index).unwrap_or(0);
        }
        target -= weight;
    }
    scaled
        .last()
        .map_or(0, |(i, _)| u32::try_from(*i).unwrap_or(0))
}

/// Continues `prompt` by `config.max_new_tokens` tokens.
pub fn generate(model: &mut Gpt, prompt: &[u32], config: &SampleConfig) -> Result<Vec<u32>> {
    model.set_training(false)?;
    let block_size = model.config().block_size;
    let vocab = model.config().vocab_size;
    let mut tokens = prompt.to_vec();
    let mut sampler = Sampler { state: config.seed };
    for _ in 0..config.max_new_tokens {
        let context = &tokens[tokens.len().saturating_sub(block_size)..];
        let ids: Vec<i64> = context.iter().map(|t| i64::from(*t)).collect();
        let input = Tensor::from_vec(ids, &[1, context.len()]).map_err(|source| Error::Tensor {
            name: "prompt ids".to_string(),
            source,
        })?;
        let logits = model.forward(&input)?;
        let last = logits
            .narrow(1, context.len() - 1, 1)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_vec::<f32>())
            .map_err(|source| Error::Tensor {
                name: "logits".to_string(),
                source,
            })?;
        let next = pick(&last[..vocab.min(last.len())], config, &mut sampler);
        tokens.push(next);
    }
    Ok(tokens)
}

/// What [`sample_from_checkpoint`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SampleOutput {
    /// The prompt followed by the generated text.
    pub text: String,
    /// The step of the checkpoint used.
    pub step: u64,
}

/// Loads the model of a checkpoint (any layout) and samples from it.
pub fn sample_from_checkpoint(
    path: &Path,
    prompt: &str,
    config: &SampleConfig,
) -> Result<SampleOutput> {
    let checkpoint = Checkpoint::open(path)?;
    let meta = checkpoint.metadata();
    // Every tensor of the model is present with its shape before any is read.
    let model_config = crate::train::check_model_tensors(&checkpoint)?;
    let tokenizer_kind: TokenizerKind =
        serde_json::from_value(meta.state["tokenizer"].clone()).unwrap_or(TokenizerKind::Bytes);
    // A char-level run records its dataset's table, so sampling needs no dataset.
    let vocabulary: Option<Vec<String>> =
        serde_json::from_value(meta.state["vocabulary"].clone()).unwrap_or(None);
    let tokenizer = Tokenizer::from_parts(tokenizer_kind, vocabulary.as_deref())?;
    let gpt_config: GptConfig = model_config.gpt();
    let mut model = Gpt::new(gpt_config)?;
    load_whole(&checkpoint, &mut model)?;
    let mut prompt_ids = tokenizer.encode(prompt)?;
    if prompt_ids.is_empty() {
        // nanoGPT starts from a newline when given no prompt.
        prompt_ids = tokenizer.encode("\n")?;
    }
    // A model trained on token files may have fewer ids than its tokenizer.
    if let Some(token) = prompt_ids
        .iter()
        .find(|t| **t as usize >= model_config.vocab_size)
    {
        return Err(Error::InvalidFlag {
            flag: "--prompt",
            value: format!("{prompt:?}"),
            reason: format!(
                "encodes to token {token}, not below the model's vocabulary size {}",
                model_config.vocab_size
            ),
        });
    }
    let tokens = generate(&mut model, &prompt_ids, config)?;
    Ok(SampleOutput {
        text: tokenizer.decode(&tokens)?,
        step: checkpoint.step(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picking_respects_top_k_and_the_seed() {
        let logits = [0.0f32, 5.0, 4.9, -3.0];
        let config = SampleConfig {
            max_new_tokens: 1,
            temperature: 1.0,
            top_k: 2,
            seed: 7,
        };
        let draws = |seed| -> Vec<u32> {
            let mut sampler = Sampler { state: seed };
            (0..200)
                .map(|_| pick(&logits, &config, &mut sampler))
                .collect()
        };
        let a = draws(7);
        assert_eq!(a, draws(7));
        assert!(a.iter().all(|t| *t == 1 || *t == 2));
        assert!(a.contains(&1) && a.contains(&2));
        // Near-zero temperature is greedy.
        let greedy = SampleConfig {
            temperature: 1e-9,
            top_k: 0,
            ..config
        };
        let mut sampler = Sampler { state: 1 };
        assert!((0..20).all(|_| pick(&logits, &greedy, &mut sampler) == 1));
    }
}
