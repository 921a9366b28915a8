//! Hugging Face GPT-2 checkpoints: a folder with `config.json` and `model.safetensors` as
//! `transformers`' `GPT2LMHeadModel.save_pretrained` writes it.
//!
//! The layout differs from nanoGPT's in three ways, all handled here: the four linear weights
//! of a block are `Conv1D`s stored `[in, out]` (ours are `[out, in]`), the causal-mask buffers
//! `attn.bias` / `attn.masked_bias` may be saved alongside the parameters, and `lm_head.weight`
//! is tied to `wte` (left out of the file, or saved as a copy). Files saved from the bare
//! `GPT2Model` name tensors without the `transformer.` prefix; both spellings are read.
//!
//! Reading is sharded like `--init`: every parameter gets an init hook that reads only the
//! block `fully_shard` asks for. For a transposed weight a rank's `Shard(0)` rows are columns
//! of the stored tensor; they are read one strided run per stored row, so a rank still reads
//! only its own elements.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hypershard_nn::{InitRequest, Module};
use hypershard_tensor::Tensor;
use serde::Deserialize;
use serde_json::json;

use super::config::{ModelConfig, ModelShape};
use super::init_file::{load_param, read_block};
use super::tensor_set::check_model_tensors;
use crate::checkpoint::{
    Checkpoint, ExportAs, ExportSummary, SafetensorsIndex, export_tensors, write_atomically,
};
use crate::error::{Error, FileAction, Result};

/// The weights file of a Hugging Face model folder.
pub const HF_WEIGHTS_FILE: &str = "model.safetensors";
/// The configuration file of a Hugging Face model folder.
pub const HF_CONFIG_FILE: &str = "config.json";

/// The linear weights `transformers` keeps as `Conv1D`, stored `[in, out]`.
const CONV1D_WEIGHTS: [&str; 4] = [
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
];

/// The layer norm epsilon of nanoGPT's GPT (torch's default), which a config must match.
const LAYER_NORM_EPSILON: f64 = 1e-5;

/// Whether the parameter `name` (nanoGPT names) is stored transposed in Hugging Face files.
pub fn is_conv1d_weight(name: &str) -> bool {
    name.starts_with("transformer.h.") && CONV1D_WEIGHTS.iter().any(|s| name.ends_with(s))
}

/// Tensors of a Hugging Face file that are not parameters here.
fn is_skipped(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

fn hf_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::HfCheckpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The fields of `transformers`' `GPT2Config` that decide the model. Fields it does not read
/// (dropouts, token ids, `architectures`, ...) are ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct HfGpt2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Positions (nanoGPT's `block_size`).
    pub n_positions: usize,
    /// Model width.
    pub n_embd: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// MLP width; `None` is `4 · n_embd`, the only width nanoGPT's GPT has.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The MLP activation (`gelu_new` in OpenAI's GPT-2).
    #[serde(default)]
    pub activation_function: Option<String>,
    /// Layer norm epsilon.
    #[serde(default)]
    pub layer_norm_epsilon: Option<f64>,
    /// Whether `lm_head` is tied to `wte` (default true).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Attention scaled by `1/√head_dim` (default true).
    #[serde(default)]
    pub scale_attn_weights: Option<bool>,
    /// Attention also scaled by `1/(layer + 1)` (default false).
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: Option<bool>,
    /// Cross-attention layers (default false).
    #[serde(default)]
    pub add_cross_attention: Option<bool>,
    /// `gpt2` for GPT-2.
    #[serde(default)]
    pub model_type: Option<String>,
}

impl HfGpt2Config {
    /// Reads `DIR/config.json` and checks it describes a model nanoGPT's GPT computes.
    pub fn load(dir: &Path) -> Result<HfGpt2Config> {
        let path = dir.join(HF_CONFIG_FILE);
        let bytes = crate::launch::read_file(&path)?;
        let config: HfGpt2Config = serde_json::from_slice(&bytes)
            .map_err(|e| hf_error(&path, format!("not a GPT-2 config: {e}")))?;
        config.check().map_err(|reason| hf_error(&path, reason))?;
        Ok(config)
    }

    /// Refuses what nanoGPT's GPT does not compute; the reason names the field.
    fn check(&self) -> std::result::Result<(), String> {
        if let Some(kind) = self.model_type.as_deref().filter(|k| *k != "gpt2") {
            return Err(format!("model_type is {kind:?}, not \"gpt2\""));
        }
        if let Some(inner) = self
            .n_inner
            .filter(|n| Some(*n) != self.n_embd.checked_mul(4))
        {
            return Err(format!(
                "n_inner {inner} is not 4 · n_embd = {} (the only MLP width supported)",
                self.n_embd.saturating_mul(4)
            ));
        }
        if self.tie_word_embeddings == Some(false) {
            return Err("tie_word_embeddings is false; lm_head must be tied to wte".to_string());
        }
        if self.scale_attn_weights == Some(false) {
            return Err("scale_attn_weights is false; attention is scaled by 1/√head_dim".into());
        }
        if self.scale_attn_by_inverse_layer_idx == Some(true) {
            return Err("scale_attn_by_inverse_layer_idx is true, which is not supported".into());
        }
        if self.add_cross_attention == Some(true) {
            return Err("add_cross_attention is true, which is not supported".into());
        }
        if let Some(eps) = self.layer_norm_epsilon
            && (eps - LAYER_NORM_EPSILON).abs() > 1e-12
        {
            return Err(format!(
                "layer_norm_epsilon {eps} is not {LAYER_NORM_EPSILON} (nanoGPT's)"
            ));
        }
        match self.activation_function.as_deref() {
            None | Some("gelu" | "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => Ok(()),
            Some(other) => Err(format!(
                "activation_function {other:?} is not a GELU (the MLP computes the exact GELU)"
            )),
        }
    }

    /// Whether the config asks for a tanh approximation of GELU: the model computes the exact
    /// GELU (as nanoGPT does when it loads GPT-2), so its logits differ slightly from
    /// `transformers`'.
    pub fn approximates_gelu(&self) -> bool {
        self.activation_function
            .as_deref()
            .is_some_and(|a| a != "gelu")
    }

    /// The model shape this config describes (biases on, no dropout).
    pub fn model_shape(&self) -> ModelShape {
        ModelShape {
            vocab_size: Some(self.vocab_size),
            block_size: self.n_positions,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            bias: true,
            dropout: 0.0,
        }
    }

    /// Checks a shape given with `--model` against this config: the same layers, heads,
    /// width and vocabulary (when it names one), biases on, and a block size no longer than
    /// `n_positions` (a shorter one keeps the first positions, as nanoGPT's `crop_block_size`).
    pub fn check_shape(&self, shape: &ModelShape) -> std::result::Result<(), String> {
        let pairs = [
            ("n_layer", shape.n_layer, self.n_layer),
            ("n_head", shape.n_head, self.n_head),
            ("n_embd", shape.n_embd, self.n_embd),
            (
                "vocab_size",
                shape.vocab_size.unwrap_or(self.vocab_size),
                self.vocab_size,
            ),
        ];
        for (field, ours, theirs) in pairs {
            if ours != theirs {
                return Err(format!(
                    "--model has {field} {ours}, the checkpoint's config.json {theirs}"
                ));
            }
        }
        if shape.block_size > self.n_positions {
            return Err(format!(
                "--model has block_size {}, more than the checkpoint's n_positions {}",
                shape.block_size, self.n_positions
            ));
        }
        if !shape.bias {
            return Err("--model has bias false; GPT-2 has biases".to_string());
        }
        Ok(())
    }
}

/// Where one parameter is in the file.
#[derive(Clone, Debug)]
struct Source {
    /// The name in the file.
    stored: String,
    /// Stored `[in, out]`.
    transposed: bool,
}

/// Reads the block `request` asks for: rows of dim 0 as in `--init`, or for a transposed
/// weight the matching columns of the stored `[in, out]` tensor, transposed back.
fn read_hf_block(
    index: &SafetensorsIndex,
    source: &Source,
    request: InitRequest<'_>,
) -> std::result::Result<Tensor, Error> {
    if !source.transposed {
        return read_block(index, &source.stored, request);
    }
    let tensor_error = |source| Error::Tensor {
        name: request.name.to_string(),
        source,
    };
    let (&[out_start, in_start], &[out_len, in_len]) = (request.offset, request.shape) else {
        return Err(hf_error(
            index.path(),
            format!("{} is asked for a block that is not 2-d", request.name),
        ));
    };
    let (stored, bytes) =
        index.read_submatrix(&source.stored, (in_start, in_len), (out_start, out_len))?;
    Tensor::from_bytes(&bytes, &[in_len, out_len], stored.dtype)
        .and_then(|t| t.transpose(0, 1))
        .and_then(|t| t.contiguous())
        .and_then(|t| t.to_dtype(request.dtype))
        .map_err(tensor_error)
}

/// Matches the model's parameters with the file's tensors: every parameter present (with or
/// without the `transformer.` prefix) in its stored shape, and nothing else but skipped buffers.
fn match_sources(
    expected: &[(String, Vec<usize>)],
    index: &SafetensorsIndex,
) -> Result<Vec<Source>> {
    let path = index.path();
    let mut sources = Vec::with_capacity(expected.len());
    for (name, shape) in expected {
        let bare = name.strip_prefix("transformer.").unwrap_or(name);
        let stored_name = [name.as_str(), bare]
            .into_iter()
            .find(|n| index.tensors().contains_key(*n))
            .ok_or_else(|| hf_error(path, format!("tensor {name} is missing")))?;
        let stored = &index.tensors()[stored_name];
        let transposed = is_conv1d_weight(name);
        let fits = match (&stored.shape[..], &shape[..]) {
            ([rows, cols], [out, inp]) if transposed => rows == inp && cols == out,
            // Positions beyond block_size are left out (nanoGPT's crop_block_size).
            ([rows, cols], [want_rows, want_cols]) if name == "transformer.wpe.weight" => {
                rows >= want_rows && cols == want_cols
            }
            (stored_shape, shape) => stored_shape == shape,
        };
        if !fits {
            let layout = if transposed { " ([in, out])" } else { "" };
            return Err(hf_error(
                path,
                format!(
                    "tensor {stored_name} has shape {:?}{layout}, the model's {name} is {shape:?}",
                    stored.shape
                ),
            ));
        }
        sources.push(Source {
            stored: stored_name.to_string(),
            transposed,
        });
    }
    let used: BTreeSet<&str> = sources.iter().map(|s| s.stored.as_str()).collect();
    if let Some(extra) = index
        .tensors()
        .keys()
        .find(|n| !used.contains(n.as_str()) && !is_skipped(n))
    {
        return Err(hf_error(
            path,
            format!("tensor {extra} is not a parameter of GPT-2"),
        ));
    }
    Ok(sources)
}

/// Checks `DIR/model.safetensors` against `module`'s parameters and makes every parameter read
/// its values from it: deferred ones lazily (only the blocks later asked for), others at
/// once. Nothing in the module changes unless the whole file matches. Returns the file's
/// index, whose [`bytes_read`](SafetensorsIndex::bytes_read) counts what was read.
pub fn attach_hf_init(module: &mut dyn Module, dir: &Path) -> Result<SafetensorsIndex> {
    let index = SafetensorsIndex::open(&dir.join(HF_WEIGHTS_FILE))?;
    let mut expected = Vec::new();
    module.visit_params("", &mut |name, param| {
        expected.push((name.to_string(), param.tensor()?.shape().to_vec()));
        Ok(())
    })?;
    let sources = match_sources(&expected, &index)?;
    let mut next = sources.into_iter();
    let mut failure = None;
    module.visit_params_mut("", &mut |name, param| {
        // invariant: visit_params_mut visits the parameters visit_params listed, in order.
        let Some(source) = next.next() else {
            return Ok(());
        };
        if failure.is_none() {
            let reader = index.clone();
            failure = load_param(name, param, move |request| {
                read_hf_block(&reader, &source, request)
            })?
            .err();
        }
        Ok(())
    })?;
    match failure {
        Some(error) => Err(error),
        None => Ok(index),
    }
}

/// The `config.json` `transformers` needs to build `GPT2LMHeadModel` for `config`: exact GELU
/// (what the model computes), tied embeddings, nanoGPT's epsilon.
pub fn hf_config_json(config: &ModelConfig) -> serde_json::Value {
    let mut value = json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": null,
        "activation_function": "gelu",
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    // GPT-2's end-of-text id where the vocabulary has it; otherwise none (transformers'
    // default, 50256, would lie outside a smaller vocabulary).
    let end_of_text = (config.vocab_size > 50_256).then_some(50_256);
    if let Some(object) = value.as_object_mut() {
        object.insert("bos_token_id".into(), json!(end_of_text));
        object.insert("eos_token_id".into(), json!(end_of_text));
    }
    value
}

/// Writes a checkpoint's model as a Hugging Face GPT-2 folder `dir` (`config.json` and
/// `model.safetensors`, `Conv1D` weights transposed, `lm_head` left to the tie). Refuses to
/// replace either file unless `overwrite`, and a model without biases (GPT-2 has them).
pub fn export_hf(checkpoint: &Checkpoint, dir: &Path, overwrite: bool) -> Result<ExportSummary> {
    let config = check_model_tensors(checkpoint)?;
    if !config.bias {
        return Err(hf_error(
            checkpoint.dir(),
            "the model has no biases (bias false); GPT2LMHeadModel has them",
        ));
    }
    let weights: PathBuf = dir.join(HF_WEIGHTS_FILE);
    let config_path = dir.join(HF_CONFIG_FILE);
    for path in [&weights, &config_path] {
        if path.exists() && !overwrite {
            return Err(Error::WouldOverwrite { path: path.clone() });
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(FileAction::CreateDir, dir, e))?;
    let summary = export_tensors(checkpoint, &weights, overwrite, |key| {
        let name = key.strip_prefix("model/")?;
        Some(ExportAs {
            name: name.to_string(),
            transpose: is_conv1d_weight(name),
        })
    })?;
    let text =
        serde_json::to_vec_pretty(&hf_config_json(&config)).map_err(|source| Error::Json {
            path: config_path.clone(),
            source,
        })?;
    write_atomically(&config_path, &text)?;
    Ok(summary)
}
