//! nanoGPT's `GPT`: token and position embeddings, pre-LN blocks, a final LayerNorm and an
//! lm_head tied to the token embedding.

#[cfg(feature = "cuda")]
mod cuda;
mod embeddings;

use std::collections::BTreeMap;
use std::path::Path;

use hypershard_tensor::{DType, RandomInit, Tensor};

use crate::checkpoint::{load_state_dict, save_safetensors};
use crate::elementwise::check_float;
use crate::embedding::Embedding;
use crate::fused_loss::{
    FusedHead, HeadGradTargets, LossTargets, WeightGradTarget, fused_head, weight_grad_into,
};
use crate::kernels::{
    Float, load, load_f64, overwrite_target, same_device, store, with_float, with_values,
    with_values2,
};
use crate::linalg::{GemmShape, MatmulOptions, gemm};
use crate::loss::TargetClasses;
use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{
    Block, BlockConfig, Dropout, Error, LayerNorm, LayerNormConfig, Module, ModuleList, Parameter,
    Result, qualify_parameter_names,
};
use embeddings::{add_token_rows, embed, position_grad};

/// The shape of a [`Gpt`] (nanoGPT's `GPTConfig`) plus the dtype and the seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// The vocabulary size `V` (rows of `wte`, width of the logits).
    pub vocab_size: usize,
    /// The longest sequence `T` (rows of `wpe`).
    pub block_size: usize,
    /// The number of blocks.
    pub n_layer: usize,
    /// The number of attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// The model width `C`.
    pub n_embd: usize,
    /// Whether linear layers and layer norms have biases.
    pub bias: bool,
    /// The dropout probability (embeddings, attention weights, residual branches).
    pub dropout: f64,
    /// The parameters' dtype.
    pub dtype: DType,
    /// The seed of the initialisation and the dropout masks.
    pub seed: u64,
}

impl GptConfig {
    /// nanoGPT's defaults for GPT-2 small (124M parameters), in f32 without dropout.
    pub fn gpt2() -> Self {
        GptConfig {
            vocab_size: 50304,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            bias: true,
            dropout: 0.0,
            dtype: DType::F32,
            seed: 0,
        }
    }
}

/// nanoGPT's `GPT`: `logits = ln_f(blocks(drop(wte[ids] + wpe[pos]))) · wteᵀ`.
///
/// Input: token ids `[B, T]` (I64, `T ≤ block_size`); output: logits `[B, T, V]` in the
/// parameters' dtype. Parameter names and shapes are nanoGPT's (`transformer.wte.weight`
/// `[V, C]`, `transformer.wpe.weight` `[block_size, C]`, `transformer.h.{i}.ln_1.weight`,
/// `transformer.h.{i}.attn.c_attn.weight` `[3C, C]`, ..., `transformer.ln_f.weight`); the
/// lm_head is the token embedding itself, so there is one `wte` parameter and its gradient
/// gets both the embedding's and the head's contribution (nanoGPT's `lm_head.weight` is the
/// same tensor and is not listed separately, as in its `named_parameters`).
///
/// The blocks are children named `transformer.h.{i}` and are only ever called through
/// [`Module`], so `fully_shard` can wrap each block in place; `wte`, `wpe` and `ln_f` belong
/// to the GPT itself. Every parameter is read at call time, so a wrapper may swap its storage
/// between calls.
pub struct Gpt {
    config: GptConfig,
    wte: Parameter,
    wpe: Parameter,
    drop: Dropout,
    h: ModuleList,
    ln_f: LayerNorm,
    /// Set by [`Gpt::fused_loss`]: the forward returns the loss instead of the logits.
    fused: Option<FusedLoss>,
    /// Set by [`Gpt::keep_head_grad_in_gathered_weight`].
    head_grad_in_weight: bool,
    cache: Option<GptCache>,
}

/// The fused loss head's targets handle and ignored class.
struct FusedLoss {
    targets: LossTargets,
    ignore_index: i64,
}

impl std::fmt::Debug for Gpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What backward needs: the token rows and what the head left.
struct GptCache {
    rows: Vec<usize>,
    batch: usize,
    seq: usize,
    head: HeadCache,
}

/// The head's part of the cache.
enum HeadCache {
    /// Logits were returned: the output of `ln_f`, for the head's backward.
    Logits { final_hidden: Tensor },
    /// The fused loss was returned: its gradients with respect to the output of `ln_f`
    /// (`[B·T, C]`) and to `wte` as the head weight (`[V, C]`), for a loss gradient of one.
    Loss {
        hidden_grad: Tensor,
        head_grad: Tensor,
    },
    /// Logits were returned on a CUDA device: the output of `ln_f` and the token ids indexed
    /// for the embeddings' backward.
    #[cfg(feature = "cuda")]
    Cuda {
        final_hidden: Tensor,
        tokens: hypershard_tensor::cuda::TokenIndex,
    },
    /// The fused loss was returned on a CUDA device: its gradients (as in `Loss`, the hidden
    /// one shaped `[B, T, C]`) and the token ids indexed for the embeddings' backward.
    #[cfg(feature = "cuda")]
    CudaLoss {
        hidden_grad: Tensor,
        head_grad: Tensor,
        tokens: hypershard_tensor::cuda::TokenIndex,
    },
}

/// The standard deviation of nanoGPT's initialisation.
const INIT_STD: f64 = 0.02;

impl Gpt {
    /// A GPT initialised as nanoGPT: every linear weight and both embeddings from
    /// `N(0, 0.02)`, the `c_proj` weights from `N(0, 0.02/√(2·n_layer))`, biases zero, layer
    /// norms weight one and bias zero. Each parameter draws from its own seed derived from
    /// `config.seed` and its position in visiting order.
    pub fn new(config: GptConfig) -> Result<Self> {
        const OP: &str = "Gpt::new";
        check_float(OP, config.dtype)?;
        let positive = |field, value: usize| {
            if value == 0 {
                Err(Error::InvalidConfig {
                    op: OP,
                    field,
                    value: 0.0,
                    reason: "must be positive",
                })
            } else {
                Ok(())
            }
        };
        positive("vocab_size", config.vocab_size)?;
        positive("block_size", config.block_size)?;
        positive("n_embd", config.n_embd)?;
        let c = config.n_embd;
        let mut h = ModuleList::default();
        for layer in 0..config.n_layer {
            let block = Block::new(BlockConfig {
                n_embd: c,
                n_head: config.n_head,
                bias: config.bias,
                dropout: config.dropout,
                dtype: config.dtype,
                seed: config.seed.wrapping_add(16 * (layer as u64 + 1)),
            })?;
            h.push(Box::new(block));
        }
        let mut gpt = Gpt {
            config,
            wte: Parameter::new(
                "transformer.wte.weight",
                Tensor::zeros(&[config.vocab_size, c], config.dtype)?,
            ),
            wpe: Parameter::new(
                "transformer.wpe.weight",
                Tensor::zeros(&[config.block_size, c], config.dtype)?,
            ),
            drop: Dropout::new(config.dropout, config.seed)?,
            h,
            ln_f: LayerNorm::new(LayerNormConfig {
                normalized_shape: c,
                eps: 1e-5,
                bias: config.bias,
                dtype: config.dtype,
            })?,
            fused: None,
            head_grad_in_weight: false,
            cache: None,
        };
        gpt.init_weights()?;
        qualify_parameter_names(&mut gpt)?;
        Ok(gpt)
    }

    /// nanoGPT's `_init_weights` followed by its scaled init of the `c_proj` weights.
    fn init_weights(&mut self) -> Result<()> {
        let config = self.config;
        let proj_std = INIT_STD / (2.0 * config.n_layer.max(1) as f64).sqrt();
        let mut index = 0u64;
        self.visit_params_mut("", &mut |name, param| {
            index += 1;
            let is_norm = name.contains(".ln_") || name.starts_with("transformer.ln_f");
            if is_norm {
                return Ok(());
            }
            // `tensor`, not `data`: inside `deferred_init` the parameter has only a shape, and
            // the fresh tensors below are deferred too, remembering their recipe.
            let data = param.tensor()?;
            let (shape, dtype) = (data.shape().to_vec(), data.dtype());
            if name.ends_with(".bias") {
                param.data = Some(Tensor::zeros(&shape, dtype)?);
                return Ok(());
            }
            let std = if name.ends_with("c_proj.weight") {
                proj_std
            } else {
                INIT_STD
            };
            let seed = config.seed.wrapping_mul(0x1_0000).wrapping_add(index);
            param.data = Some(Tensor::random(
                &shape,
                dtype,
                RandomInit::normal(seed, 0.0, std),
            )?);
            Ok(())
        })
    }

    /// The same model as [`Gpt::new`], built deferred: every parameter has its shape, dtype
    /// and init recipe but no storage, so the model costs no memory until `fully_shard`
    /// materialises each rank's shard (or [`materialize_module`](crate::materialize_module)
    /// the whole of it). Any block materialised alone equals, bit for bit, the same block of
    /// [`Gpt::new`]'s parameter; `wte` stays one parameter, so the lm_head stays tied.
    pub fn new_deferred(config: GptConfig) -> Result<Self> {
        hypershard_tensor::deferred_init(|| Gpt::new(config))
    }

    /// Fuses the lm_head with the cross-entropy (torch's `cross_entropy(ignore_index=…)`,
    /// mean over the counted targets): from now on the forward returns the mean loss as an
    /// F64 tensor `[1]` against the targets set on the returned handle before each forward,
    /// and the backward takes that loss's gradient `[1]` (the loss scale, e.g. `1/accum`).
    ///
    /// The `[B, T, V]` logits are never held: the head runs in blocks of token rows (see
    /// `fused_loss.rs`). The loss equals the unfused `cross_entropy(logits)` bit for bit.
    pub fn fused_loss(&mut self, ignore_index: i64) -> LossTargets {
        let targets = LossTargets::default();
        self.fused = Some(FusedLoss {
            targets: targets.clone(),
            ignore_index,
        });
        targets
    }

    /// Lets the fused loss head (see [`Gpt::fused_loss`]) keep its gradient of the head weight
    /// in the memory of the token embedding it has just read, once it no longer needs the
    /// weight, instead of in a `[V, C]` buffer of its own.
    ///
    /// Only for a model whose `wte` the forward reads is a gathered copy that nothing reads
    /// again before it is freed after backward: `fully_shard` with its default
    /// `reshard_after_backward`, the gradient synchronised every backward, `wte` sharded (not
    /// in `replicate_params` or `ignored_params`). `hypershard train` is such a user. There, the
    /// fused head's backward needs none of the weight (only its gradient), so the unsharded
    /// weight held from the forward to the root's post-backward would be dead memory through
    /// every block's backward: `V·C` elements (196 MiB at GPT-2's vocabulary and width 1024) of
    /// a rank's peak. On a model whose `wte` is the parameter itself this would overwrite the
    /// weight with its gradient, so it is off by default. It applies when the parameters are in
    /// the compute dtype (f32 or f64; a bf16 weight is too narrow to hold the f32 gradient) and
    /// only to forwards that compute gradients.
    pub fn keep_head_grad_in_gathered_weight(&mut self, on: bool) {
        self.head_grad_in_weight = on;
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// The number of parameters, counting the tied `wte` once; with `non_embedding` the
    /// position embedding is left out, as nanoGPT's `get_num_params`.
    pub fn num_params(&self, non_embedding: bool) -> Result<usize> {
        let mut total = 0;
        self.visit_params("", &mut |_, param| {
            total += param.tensor()?.numel();
            Ok(())
        })?;
        if non_embedding {
            total -= self.wpe.tensor()?.numel();
        }
        Ok(total)
    }

    /// The blocks, in order.
    pub fn blocks_mut(&mut self) -> &mut ModuleList {
        &mut self.h
    }

    /// The parameters as safetensors bytes with nanoGPT's names (no separate
    /// `lm_head.weight`: it is `transformer.wte.weight`).
    pub fn save_safetensors(&self) -> Result<Vec<u8>> {
        save_safetensors(self)
    }

    /// Writes [`save_safetensors`](Gpt::save_safetensors)'s bytes to `path`.
    pub fn save_safetensors_file(&self, path: &Path) -> Result<()> {
        crate::checkpoint::save_safetensors_file(self, path)
    }

    /// Loads nanoGPT-named tensors, with [`load_state_dict`]'s checks (a config mismatch is
    /// [`Error::CheckpointShape`] naming the tensor).
    ///
    /// A nanoGPT `state_dict` also holds `lm_head.weight` (the same tensor as
    /// `transformer.wte.weight`) and, in versions without flash attention, the causal-mask
    /// buffers `*.attn.bias`; those are skipped.
    pub fn load_tensors(&mut self, tensors: BTreeMap<String, Tensor>) -> Result<()> {
        let params: BTreeMap<String, Tensor> = tensors
            .into_iter()
            .filter(|(name, _)| {
                name != "lm_head.weight"
                    && !name.ends_with(".attn.bias")
                    && !name.ends_with(".attn.masked_bias")
            })
            .collect();
        load_state_dict(self, &params)
    }

    /// Loads safetensors bytes (see [`load_tensors`](Gpt::load_tensors)).
    pub fn load_safetensors(&mut self, bytes: &[u8]) -> Result<()> {
        self.load_tensors(hypershard_tensor::load_safetensors(bytes)?)
    }

    /// Loads a safetensors file (see [`load_tensors`](Gpt::load_tensors)).
    pub fn load_safetensors_file(&mut self, path: &Path) -> Result<()> {
        self.load_tensors(hypershard_tensor::load_safetensors_file(path)?)
    }

    /// The batch and sequence sizes of an id tensor, checked.
    fn input_dims(&self, ids: &Tensor) -> Result<[usize; 2]> {
        match ids.shape() {
            &[batch, seq] if seq <= self.config.block_size => Ok([batch, seq]),
            other => Err(Error::BadShape {
                op: "Gpt::forward",
                expected: format!("token ids [B, T] with T ≤ {}", self.config.block_size),
                actual: other.to_vec(),
            }),
        }
    }
}

/// The unfused lm_head's backward from the logits' gradient `g` `[B, T, V]`: `dwte_head =
/// gᵀ · h`, `[V, N]·[N, C]` (in the compute dtype), and `dh = g · wte`, `[N, V]·[V, C]`.
fn head_backward(
    grad_output: &Tensor,
    final_hidden: &Tensor,
    wte: &Tensor,
    [batch, seq, c, v]: [usize; 4],
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "Gpt::backward";
    let expected = [batch, seq, v];
    if grad_output.shape() != expected {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: expected.to_vec(),
            rhs: grad_output.shape().to_vec(),
        });
    }
    let dtype = wte.dtype();
    if grad_output.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op: OP,
            lhs: dtype,
            rhs: grad_output.dtype(),
        });
    }
    let tokens = batch * seq;
    let device = same_device(OP, &[wte, grad_output, final_hidden])?;
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let dims = [batch, seq, c, v];
        return crate::kernels::cuda::gpt_head_backward(
            &grad_output.contiguous()?,
            final_hidden,
            wte,
            dims,
        );
    }
    Ok(with_float!(OP, dtype, F => {
        let g = load::<F>(grad_output)?;
        let dw_shape = GemmShape::new(
            v,
            tokens,
            c,
            MatmulOptions {
                transpose_a: true,
                transpose_b: false,
            },
        )?;
        let head = with_values::<F, _>(final_hidden, |h| gemm(&g, h, dw_shape))??;
        let dh_shape = GemmShape::new(tokens, v, c, MatmulOptions::default())?;
        let dh = with_values::<F, _>(wte, |w| gemm(&g, w, dh_shape))??;
        (
            Tensor::from_vec_on(head, &[v, c], &device)?,
            store(dh, &[batch, seq, c], dtype, &device)?,
        )
    }))
}

/// The gradient of the fused loss given to [`Gpt`]'s backward (the loss scale): one value, on
/// any device. The fused head computed its gradients for a loss gradient of one, and they are
/// scaled by this.
fn loss_gradient(op: &'static str, grad_output: &Tensor) -> Result<f64> {
    let expected = [1];
    let values = if grad_output.shape() == expected {
        load_f64(&grad_output.to_host()?).ok()
    } else {
        None
    };
    match values.as_deref() {
        Some(&[scale]) => Ok(scale),
        _ => Err(Error::ShapeMismatch {
            op,
            lhs: expected.to_vec(),
            rhs: grad_output.shape().to_vec(),
        }),
    }
}

impl Module for Gpt {
    fn kind(&self) -> &'static str {
        "GPT"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        const OP: &str = "Gpt::forward";
        let [batch, seq] = self.input_dims(input)?;
        let c = self.config.n_embd;
        let v = self.config.vocab_size;
        let wte = self.wte.data()?;
        let dtype = wte.dtype();
        let device = same_device(OP, &[wte, self.wpe.data()?, input])?;
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return self.forward_cuda(input, [batch, seq, c, v]);
        }
        let rows = Embedding::rows(input, v)?;
        let x = with_float!(OP, dtype, F => {
            // Borrowed, not loaded: a copy of the whole `[V, C]` table to read `B·T` rows of
            // it would double the root's largest buffer at the start of every forward.
            let x = with_values2::<F, _>(wte, self.wpe.data()?, |w, p| {
                embed(w, p, &rows, seq, c)
            })?;
            store(x, &[batch, seq, c], dtype, &device)?
        });
        let mut x = self.drop.forward(&x)?;
        for block in self.h.iter_mut() {
            x = block.forward(&x)?;
        }
        let final_hidden = self.ln_f.forward(&x)?;
        // The lm_head reads the token embedding afresh: a wrapper may have swapped it.
        let wte = self.wte.data()?;
        if let Some(fused) = &self.fused {
            let pending = fused.targets.take("GPT")?;
            same_device(OP, &[wte, &final_hidden, &pending.targets])?;
            let classes = TargetClasses::new(OP, &pending.targets, v, fused.ignore_index)?;
            let tokens = batch * seq;
            let dtype = wte.dtype();
            // The weight's memory may take its gradient (see
            // `keep_head_grad_in_gathered_weight`) when it has the compute dtype.
            let in_weight = self.head_grad_in_weight
                && pending.backward
                && wte.is_contiguous()
                && wte.numel() == v * c;
            let (loss, head) = with_float!(OP, dtype, F => {
                let hidden = load::<F>(&final_hidden)?;
                let in_weight = in_weight && dtype == F::COMPUTE_DTYPE;
                // Every token's logit gradients (`tokens·V`) instead of a `[V, C]` gradient
                // next to the weight, when they are no larger: the gradient is then formed in
                // the weight's memory once the head has read it for the last time.
                let defer = in_weight && tokens <= c;
                // The gradients' tensors, made before the head writes them: stale recycled
                // memory on the host, since every element is overwritten.
                let targets = if pending.backward {
                    let hidden_grad = overwrite_target::<F>(&[tokens, c], &device)?;
                    let weight_grad = if defer {
                        None
                    } else {
                        Some(overwrite_target::<F>(&[v, c], &device)?)
                    };
                    Some((hidden_grad, weight_grad))
                } else {
                    None
                };
                let mut logit_grads = Vec::new();
                let dims = [tokens, c, v];
                let head = with_values::<F, _>(wte, |w| -> Result<FusedHead> {
                    let Some((hidden_grad, weight_grad)) = &targets else {
                        return fused_head(OP, &hidden, w, &classes, dims, None);
                    };
                    hidden_grad.with_kernel_data_mut::<F, _>(OP, |hidden_out| {
                        let Some(weight_grad) = weight_grad else {
                            let weight = WeightGradTarget::Defer(&mut logit_grads);
                            let grads = HeadGradTargets { hidden: hidden_out, weight };
                            return fused_head(OP, &hidden, w, &classes, dims, Some(grads));
                        };
                        weight_grad.with_kernel_data_mut::<F, _>(OP, |weight_out| {
                            let weight = WeightGradTarget::Into(weight_out);
                            let grads = HeadGradTargets { hidden: hidden_out, weight };
                            fused_head(OP, &hidden, w, &classes, dims, Some(grads))
                        })?
                    })?
                })??;
                let loss = head.loss_sum / head.counted as f64;
                let grads = match targets {
                    Some((hidden_grad, weight_grad)) => {
                        let head_grad = match weight_grad {
                            None => {
                                wte.with_kernel_data_mut::<F, _>(OP, |w| {
                                    weight_grad_into(&logit_grads, &hidden, dims, w)
                                })??;
                                wte.clone()
                            }
                            Some(weight_grad) if in_weight => {
                                // The weight is dead from here on: its memory takes the
                                // gradient, and the gradient's own buffer is freed now.
                                weight_grad.with_kernel_data::<F, _>(OP, |g| {
                                    wte.with_kernel_data_mut::<F, _>(OP, |w| {
                                        w.copy_from_slice(g)
                                    })
                                })??;
                                wte.clone()
                            }
                            Some(weight_grad) => weight_grad,
                        };
                        Some((hidden_grad, head_grad))
                    }
                    None => None,
                };
                (loss, grads)
            });
            self.cache = head.map(|(hidden_grad, head_grad)| GptCache {
                rows,
                batch,
                seq,
                head: HeadCache::Loss {
                    hidden_grad,
                    head_grad,
                },
            });
            return Ok(Tensor::from_vec_on(vec![loss], &[1], &device)?);
        }
        let shape = GemmShape::new(
            batch * seq,
            c,
            v,
            MatmulOptions {
                transpose_a: false,
                transpose_b: true,
            },
        )?;
        let device = same_device(OP, &[wte, &final_hidden])?;
        let logits = with_float!(OP, wte.dtype(), F => {
            let logits =
                with_values2::<F, _>(&final_hidden, wte, |h, w| gemm(h, w, shape))??;
            store(logits, &[batch, seq, v], wte.dtype(), &device)?
        });
        self.cache = Some(GptCache {
            rows,
            batch,
            seq,
            head: HeadCache::Logits { final_hidden },
        });
        Ok(logits)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        const OP: &str = "Gpt::backward";
        let cache = self
            .cache
            .take()
            .ok_or(Error::BackwardBeforeForward { module: "GPT" })?;
        let (batch, seq) = (cache.batch, cache.seq);
        let (c, v) = (self.config.n_embd, self.config.vocab_size);
        let wte = self.wte.data()?;
        let dtype = wte.dtype();
        #[cfg(feature = "cuda")]
        let mut cuda_tokens = None;
        let (head_grad, grad_hidden) = match cache.head {
            HeadCache::Logits { final_hidden } => {
                head_backward(grad_output, &final_hidden, wte, [batch, seq, c, v])?
            }
            #[cfg(feature = "cuda")]
            HeadCache::Cuda {
                final_hidden,
                tokens,
            } => {
                cuda_tokens = Some(tokens);
                head_backward(grad_output, &final_hidden, wte, [batch, seq, c, v])?
            }
            #[cfg(feature = "cuda")]
            HeadCache::CudaLoss {
                hidden_grad,
                head_grad,
                tokens,
            } => {
                cuda_tokens = Some(tokens);
                let scale = loss_gradient(OP, grad_output)?;
                head_grad.scale_(scale)?;
                hidden_grad.scale_(scale)?;
                (head_grad, hidden_grad)
            }
            HeadCache::Loss {
                hidden_grad,
                head_grad,
            } => {
                let scale = loss_gradient(OP, grad_output)?;
                head_grad.scale_(scale)?;
                let grad_hidden = hidden_grad.scale(scale)?.to_dtype(dtype)?;
                (head_grad, grad_hidden.view(&[batch, seq, c])?)
            }
        };
        let mut g = self.ln_f.backward(&grad_hidden)?;
        for block in self.h.iter_mut().rev() {
            g = block.backward(&g)?;
        }
        let g = self.drop.backward(&g)?;
        let block_size = self.config.block_size;
        #[cfg(feature = "cuda")]
        if let Some(tokens) = cuda_tokens {
            let g = g.contiguous()?;
            let wpe_grad =
                crate::kernels::cuda::gpt_embed_backward(&g, &tokens, &head_grad, block_size)?;
            self.wte.accumulate_grad(head_grad)?;
            self.wpe.accumulate_grad(wpe_grad)?;
            return Ok(Tensor::zeros_on(&[batch, seq], dtype, &g.device())?);
        }
        let device = same_device(OP, &[wte, &g])?;
        let (wte_grad, wpe_grad) = with_float!(OP, dtype, F => {
            let gv = load::<F>(&g)?;
            // The embedding's rows are added into the head's gradient in place: scattered
            // into a `[V, C]` of zeros first, they would make a third `[V, C]` buffer next to
            // the head's gradient and the (unsharded) weight, at the root's peak.
            let head_grad = if head_grad.dtype() == F::COMPUTE_DTYPE && head_grad.is_contiguous()
            {
                head_grad
            } else {
                store(load::<F>(&head_grad)?, &[v, c], F::COMPUTE_DTYPE, &device)?
            };
            head_grad.with_kernel_data_mut::<F, _>(OP, |head| {
                add_token_rows(head, &gv, &cache.rows, c)
            })?;
            let wpe_grad = position_grad(&gv, seq, block_size, c);
            (
                if dtype == F::COMPUTE_DTYPE {
                    head_grad
                } else {
                    head_grad.to_dtype(dtype)?
                },
                store(wpe_grad, &[block_size, c], dtype, &device)?,
            )
        });
        self.wte.accumulate_grad(wte_grad)?;
        self.wpe.accumulate_grad(wpe_grad)?;
        // Token ids have no gradient; a zero placeholder keeps the Module contract (as
        // Embedding does).
        Ok(Tensor::zeros_on(&[batch, seq], dtype, &device)?)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        f(&join_name(prefix, "transformer.wte.weight"), &self.wte)?;
        f(&join_name(prefix, "transformer.wpe.weight"), &self.wpe)?;
        self.h
            .visit_params(&join_name(prefix, "transformer.h"), f)?;
        self.ln_f
            .visit_params(&join_name(prefix, "transformer.ln_f"), f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        f(&join_name(prefix, "transformer.wte.weight"), &mut self.wte)?;
        f(&join_name(prefix, "transformer.wpe.weight"), &mut self.wpe)?;
        self.h
            .visit_params_mut(&join_name(prefix, "transformer.h"), f)?;
        self.ln_f
            .visit_params_mut(&join_name(prefix, "transformer.ln_f"), f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        self.h.visit_children_mut("transformer.h", f)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.cache = None;
        self.drop.clear_cache()?;
        self.ln_f.clear_cache()?;
        for block in self.h.iter_mut() {
            block.clear_cache()?;
        }
        Ok(())
    }

    fn visit_rng_counters_mut(&mut self, f: &mut dyn FnMut(&mut u64)) -> Result<()> {
        self.drop.visit_rng_counters_mut(f)?;
        for block in self.h.iter_mut() {
            block.visit_rng_counters_mut(f)?;
        }
        Ok(())
    }

    fn set_training(&mut self, training: bool) -> Result<()> {
        self.drop.training = training;
        for block in self.h.iter_mut() {
            block.set_training(training)?;
        }
        Ok(())
    }
}
