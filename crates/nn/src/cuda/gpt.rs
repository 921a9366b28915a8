//! `DeviceGpt`: nanoGPT's GPT ([`Gpt`]) forward and backward on one CUDA device, in f32.
//!
//! Every layer follows the CPU code of this crate operation by operation: the embeddings
//! (`wte[ids] + wpe[t]`), pre-LN blocks (`x + attn(ln_1(x))`, `x + mlp(ln_2(x))`) with causal
//! self-attention (`softmax(q kᵀ / √d + mask) v`, the scale applied inside the softmax as on the
//! CPU) and the exact GELU, the final layer norm, and the lm_head tied to `wte`. The linear
//! layers are [`DeviceLinear`]s (cuBLAS), the per-head attention products strided-batched
//! GEMMs, the rest the tensor crate's GPT kernels (`hypershard_tensor::cuda::layer_norm`,
//! `gelu`, `causal_softmax_`, `embedding`, `cross_entropy`, ...).

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use hypershard_tensor::cuda::{
    AdamWStep, CudaDevice, CudaTensor, LayerNormOutput, TokenIndex, Transpose, adamw_,
    causal_softmax_, causal_softmax_backward_, cross_entropy, embedding, embedding_backward, gelu,
    gelu_backward, gemm, gemm_strided_batched, layer_norm, layer_norm_backward, merge_heads,
    split_heads,
};
use hypershard_tensor::{DType, Tensor};

use super::error::{DeviceError, DeviceResult};
use super::linear::{DeviceLinear, host_param};
use crate::optim::AdamWConfig;
use crate::{DEFAULT_IGNORE_INDEX, Gpt, GptConfig, Module};

/// The eps of every layer norm of a [`Gpt`] (`Gpt::new` builds them all with torch's 1e-5).
const LAYER_NORM_EPS: f64 = 1e-5;

/// A layer norm's parameters on the device, with their gradients.
#[derive(Debug)]
pub struct DeviceNorm {
    /// The scale, `[C]`.
    pub weight: CudaTensor,
    /// The shift, `[C]`, if the model has biases.
    pub bias: Option<CudaTensor>,
    /// The accumulated gradient of the scale.
    pub grad_weight: CudaTensor,
    /// The accumulated gradient of the shift.
    pub grad_bias: Option<CudaTensor>,
}

/// One pre-LN transformer block on the device.
#[derive(Debug)]
pub struct DeviceBlock {
    /// `ln_1`.
    pub ln_1: DeviceNorm,
    /// `attn.c_attn`: `C → 3C`, the fused q, k, v projection.
    pub c_attn: DeviceLinear,
    /// `attn.c_proj`: `C → C`.
    pub attn_proj: DeviceLinear,
    /// `ln_2`.
    pub ln_2: DeviceNorm,
    /// `mlp.c_fc`: `C → 4C`.
    pub c_fc: DeviceLinear,
    /// `mlp.c_proj`: `4C → C`.
    pub mlp_proj: DeviceLinear,
}

/// What one block's backward needs from its forward.
struct BlockCache {
    ln_1: LayerNormOutput,
    q: CudaTensor,
    k: CudaTensor,
    v: CudaTensor,
    probs: CudaTensor,
    y: CudaTensor,
    ln_2: LayerNormOutput,
    fc_out: CudaTensor,
    act: CudaTensor,
}

/// What the model's backward needs from its forward.
struct ForwardCache {
    tokens: TokenIndex,
    blocks: Vec<BlockCache>,
    ln_f: LayerNormOutput,
    batch: usize,
    seq: usize,
}

/// The sizes of one forward pass.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    c: usize,
    n_head: usize,
}

impl Dims {
    fn tokens(self) -> usize {
        self.batch * self.seq
    }
    fn head_dim(self) -> usize {
        self.c / self.n_head
    }
    fn heads(self) -> usize {
        self.batch * self.n_head
    }
    /// The softmax scale `1/√d`, as the CPU's attention computes it (in f64, rounded to f32 by
    /// the kernel).
    fn scale(self) -> f64 {
        1.0 / (self.head_dim() as f64).sqrt()
    }
}

/// nanoGPT's GPT on one CUDA device, f32: forward, cross-entropy loss, backward, and SGD or
/// AdamW steps, copied from and back to a CPU [`Gpt`] with the same parameter names.
///
/// Dropout is not implemented on the device: the configuration's `dropout` must be 0
/// ([`DeviceError::UnsupportedConfig`] otherwise). Gradients always exist on the device and
/// accumulate over backward passes until [`zero_grad`](DeviceGpt::zero_grad).
pub struct DeviceGpt {
    device: CudaDevice,
    config: GptConfig,
    /// The token embedding `[V, C]`, also the lm_head.
    pub wte: CudaTensor,
    /// The gradient of `wte` (the embedding's and the head's contributions).
    pub grad_wte: CudaTensor,
    /// The position embedding `[block_size, C]`.
    pub wpe: CudaTensor,
    /// The gradient of `wpe`.
    pub grad_wpe: CudaTensor,
    /// The blocks, in order.
    pub blocks: Vec<DeviceBlock>,
    /// The final layer norm.
    pub ln_f: DeviceNorm,
    ones: Option<CudaTensor>,
    cache: Option<ForwardCache>,
    logits: Option<CudaTensor>,
    loss_grad: Option<CudaTensor>,
    moments: BTreeMap<String, (CudaTensor, CudaTensor)>,
    adam_steps: u64,
}

impl std::fmt::Debug for DeviceGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGpt")
            .field("config", &self.config)
            .field("device", &self.device.ordinal())
            .finish_non_exhaustive()
    }
}

/// Every parameter of a [`Gpt`] of `config`, with its shape, in the CPU model's visiting
/// order (`visit_params`): the device model reads and writes parameters in this order.
pub(crate) fn layout(config: &GptConfig) -> Vec<(String, Vec<usize>)> {
    let (c, v) = (config.n_embd, config.vocab_size);
    let mut out = vec![
        ("transformer.wte.weight".to_string(), vec![v, c]),
        (
            "transformer.wpe.weight".to_string(),
            vec![config.block_size, c],
        ),
    ];
    let norm = |out: &mut Vec<(String, Vec<usize>)>, prefix: &str| {
        out.push((format!("{prefix}.weight"), vec![c]));
        if config.bias {
            out.push((format!("{prefix}.bias"), vec![c]));
        }
    };
    let linear = |out: &mut Vec<(String, Vec<usize>)>, prefix: &str, i: usize, o: usize| {
        out.push((format!("{prefix}.weight"), vec![o, i]));
        if config.bias {
            out.push((format!("{prefix}.bias"), vec![o]));
        }
    };
    for layer in 0..config.n_layer {
        let p = format!("transformer.h.{layer}");
        norm(&mut out, &format!("{p}.ln_1"));
        linear(&mut out, &format!("{p}.attn.c_attn"), c, 3 * c);
        linear(&mut out, &format!("{p}.attn.c_proj"), c, c);
        norm(&mut out, &format!("{p}.ln_2"));
        linear(&mut out, &format!("{p}.mlp.c_fc"), c, 4 * c);
        linear(&mut out, &format!("{p}.mlp.c_proj"), 4 * c, c);
    }
    norm(&mut out, "transformer.ln_f");
    out
}

/// Reads a CPU GPT for the device: f32, no dropout, every parameter materialised, wanting a
/// gradient, and exactly the parameters of [`layout`] in its order and shapes. Returns the
/// host tensors in that order.
pub(crate) fn host_params(model: &Gpt) -> DeviceResult<Vec<Tensor>> {
    const OP: &str = "DeviceGpt::from_cpu";
    let config = *model.config();
    if config.dtype != DType::F32 {
        return Err(DeviceError::DTypeMismatch {
            op: OP,
            lhs: DType::F32,
            rhs: config.dtype,
        });
    }
    if config.dropout != 0.0 {
        return Err(DeviceError::UnsupportedConfig {
            op: OP,
            field: "dropout",
            value: config.dropout,
            reason: "the device GPT has no dropout; build the CPU model with dropout 0",
        });
    }
    if config.n_head == 0 || !config.n_embd.is_multiple_of(config.n_head) {
        return Err(DeviceError::UnsupportedConfig {
            op: OP,
            field: "n_head",
            value: config.n_head as f64,
            reason: "must be positive and divide n_embd",
        });
    }
    let mut found: Vec<(String, Result<Tensor, DeviceError>)> = Vec::new();
    model.visit_params("", &mut |name, param| {
        let tensor = host_param(OP, name, param).cloned();
        found.push((name.to_string(), tensor));
        Ok(())
    })?;
    let expected = layout(&config);
    let mut tensors = Vec::with_capacity(expected.len());
    for (index, (name, shape)) in expected.iter().enumerate() {
        let Some((got_name, tensor)) = found.get_mut(index) else {
            return Err(DeviceError::ParameterLayout {
                op: OP,
                name: name.clone(),
                reason: "missing from the CPU model".to_string(),
            });
        };
        if got_name != name {
            return Err(DeviceError::ParameterLayout {
                op: OP,
                name: got_name.clone(),
                reason: format!("found where {name} belongs"),
            });
        }
        let tensor = std::mem::replace(tensor, Err(DeviceError::NoParameters { op: OP }))?;
        if tensor.shape() != shape.as_slice() || tensor.dtype() != DType::F32 {
            return Err(DeviceError::ParameterLayout {
                op: OP,
                name: name.clone(),
                reason: format!(
                    "has shape {:?} and dtype {}, expected {shape:?} in f32",
                    tensor.shape(),
                    tensor.dtype()
                ),
            });
        }
        tensors.push(tensor);
    }
    if let Some((extra, _)) = found.get(expected.len()) {
        return Err(DeviceError::ParameterLayout {
            op: OP,
            name: extra.clone(),
            reason: "is not a parameter of a GPT of this configuration".to_string(),
        });
    }
    Ok(tensors)
}

/// A parameter on the device with its gradient, by name (for the optimizers and `to_cpu`).
type ParamMut<'a> = (String, &'a mut CudaTensor, &'a CudaTensor);
type ParamRef<'a> = (String, &'a CudaTensor, &'a CudaTensor);

impl DeviceNorm {
    fn from_host(
        device: &CudaDevice,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> DeviceResult<DeviceNorm> {
        let zeros = |t: &Tensor| CudaTensor::zeros(device, t.shape(), t.dtype());
        Ok(DeviceNorm {
            weight: CudaTensor::from_host(device, weight)?,
            bias: bias.map(|b| CudaTensor::from_host(device, b)).transpose()?,
            grad_weight: zeros(weight)?,
            grad_bias: bias.map(zeros).transpose()?,
        })
    }

    fn forward(&self, x: &CudaTensor) -> DeviceResult<LayerNormOutput> {
        Ok(layer_norm(
            x,
            &self.weight,
            self.bias.as_ref(),
            LAYER_NORM_EPS,
        )?)
    }

    fn backward(&mut self, grad: &CudaTensor, saved: &LayerNormOutput) -> DeviceResult<CudaTensor> {
        Ok(layer_norm_backward(
            grad,
            saved,
            &self.weight,
            &mut self.grad_weight,
            self.grad_bias.as_mut(),
        )?)
    }

    fn zero_grad(&mut self) -> DeviceResult<()> {
        self.grad_weight.zero_()?;
        if let Some(g) = &mut self.grad_bias {
            g.zero_()?;
        }
        Ok(())
    }

    fn params_mut<'a>(&'a mut self, prefix: &str, out: &mut Vec<ParamMut<'a>>) {
        out.push((
            format!("{prefix}.weight"),
            &mut self.weight,
            &self.grad_weight,
        ));
        if let (Some(b), Some(g)) = (&mut self.bias, &self.grad_bias) {
            out.push((format!("{prefix}.bias"), b, g));
        }
    }

    fn params<'a>(&'a self, prefix: &str, out: &mut Vec<ParamRef<'a>>) {
        out.push((format!("{prefix}.weight"), &self.weight, &self.grad_weight));
        if let (Some(b), Some(g)) = (&self.bias, &self.grad_bias) {
            out.push((format!("{prefix}.bias"), b, g));
        }
    }
}

fn linear_params_mut<'a>(prefix: &str, l: &'a mut DeviceLinear, out: &mut Vec<ParamMut<'a>>) {
    out.push((format!("{prefix}.weight"), &mut l.weight, &l.grad_weight));
    if let (Some(b), Some(g)) = (&mut l.bias, &l.grad_bias) {
        out.push((format!("{prefix}.bias"), b, g));
    }
}

fn linear_params<'a>(prefix: &str, l: &'a DeviceLinear, out: &mut Vec<ParamRef<'a>>) {
    out.push((format!("{prefix}.weight"), &l.weight, &l.grad_weight));
    if let (Some(b), Some(g)) = (&l.bias, &l.grad_bias) {
        out.push((format!("{prefix}.bias"), b, g));
    }
}

/// The input gradient of a [`DeviceLinear`] backward that was asked for one.
fn input_grad(grad: Option<CudaTensor>) -> DeviceResult<CudaTensor> {
    grad.ok_or(DeviceError::BackwardBeforeForward {
        module: "DeviceLinear",
    })
}

/// A new f32 tensor of zeros on `device`.
fn zeros(device: &CudaDevice, shape: &[usize]) -> DeviceResult<CudaTensor> {
    Ok(CudaTensor::zeros(device, shape, DType::F32)?)
}

impl DeviceBlock {
    fn forward(
        &self,
        mut x: CudaTensor,
        ones: &CudaTensor,
        dims: Dims,
    ) -> DeviceResult<(CudaTensor, BlockCache)> {
        let device = x.device().clone();
        let (n, c, h) = (dims.tokens(), dims.c, dims.n_head);
        let (bh, t, d) = (dims.heads(), dims.seq, dims.head_dim());
        let ln_1 = self.ln_1.forward(&x)?;
        let qkv = self
            .c_attn
            .forward(&ln_1.out, ones)?
            .reshape(&[dims.batch, t, 3 * c])?;
        let q = split_heads(&qkv, 0, 3, h)?;
        let k = split_heads(&qkv, 1, 3, h)?;
        let v = split_heads(&qkv, 2, 3, h)?;
        drop(qkv);
        let mut probs = zeros(&device, &[bh, t, t])?;
        gemm_strided_batched(1.0, &q, Transpose::No, &k, Transpose::Yes, 0.0, &mut probs)?;
        causal_softmax_(&mut probs, dims.scale())?;
        let mut heads = zeros(&device, &[bh, t, d])?;
        gemm_strided_batched(
            1.0,
            &probs,
            Transpose::No,
            &v,
            Transpose::No,
            0.0,
            &mut heads,
        )?;
        let mut y = zeros(&device, &[dims.batch, t, c])?;
        merge_heads(&heads, &mut y, 0, 1, h)?;
        let y = y.reshape(&[n, c])?;
        let a = self.attn_proj.forward(&y, ones)?;
        x.add_(&a)?;
        let ln_2 = self.ln_2.forward(&x)?;
        let fc_out = self.c_fc.forward(&ln_2.out, ones)?;
        let act = gelu(&fc_out)?;
        let m = self.mlp_proj.forward(&act, ones)?;
        x.add_(&m)?;
        let cache = BlockCache {
            ln_1,
            q,
            k,
            v,
            probs,
            y,
            ln_2,
            fc_out,
            act,
        };
        Ok((x, cache))
    }

    /// From the gradient of the block's output, accumulates every parameter gradient and
    /// returns the gradient of its input.
    fn backward(
        &mut self,
        grad: CudaTensor,
        cache: &BlockCache,
        ones: &CudaTensor,
        dims: Dims,
    ) -> DeviceResult<CudaTensor> {
        let device = grad.device().clone();
        let (n, c, h) = (dims.tokens(), dims.c, dims.n_head);
        let (bh, t, d) = (dims.heads(), dims.seq, dims.head_dim());
        // x_out = x_mid + mlp(ln_2(x_mid)).
        let d_act = input_grad(self.mlp_proj.backward(&cache.act, &grad, ones, true)?)?;
        let d_fc = gelu_backward(&cache.fc_out, &d_act)?;
        let d_ln2 = input_grad(self.c_fc.backward(&cache.ln_2.out, &d_fc, ones, true)?)?;
        let branch = self.ln_2.backward(&d_ln2, &cache.ln_2)?;
        let mut g = grad;
        g.add_(&branch)?;
        // x_mid = x + c_proj(attention(c_attn(ln_1(x)))).
        let dy = input_grad(self.attn_proj.backward(&cache.y, &g, ones, true)?)?;
        let dy = split_heads(&dy.reshape(&[dims.batch, t, c])?, 0, 1, h)?;
        let mut dp = zeros(&device, &[bh, t, t])?;
        gemm_strided_batched(
            1.0,
            &dy,
            Transpose::No,
            &cache.v,
            Transpose::Yes,
            0.0,
            &mut dp,
        )?;
        let mut dv = zeros(&device, &[bh, t, d])?;
        gemm_strided_batched(
            1.0,
            &cache.probs,
            Transpose::Yes,
            &dy,
            Transpose::No,
            0.0,
            &mut dv,
        )?;
        causal_softmax_backward_(&mut dp, &cache.probs, dims.scale())?;
        let mut dq = zeros(&device, &[bh, t, d])?;
        gemm_strided_batched(
            1.0,
            &dp,
            Transpose::No,
            &cache.k,
            Transpose::No,
            0.0,
            &mut dq,
        )?;
        let mut dk = zeros(&device, &[bh, t, d])?;
        gemm_strided_batched(
            1.0,
            &dp,
            Transpose::Yes,
            &cache.q,
            Transpose::No,
            0.0,
            &mut dk,
        )?;
        let mut dqkv = zeros(&device, &[dims.batch, t, 3 * c])?;
        merge_heads(&dq, &mut dqkv, 0, 3, h)?;
        merge_heads(&dk, &mut dqkv, 1, 3, h)?;
        merge_heads(&dv, &mut dqkv, 2, 3, h)?;
        let dqkv = dqkv.reshape(&[n, 3 * c])?;
        let d_ln1 = input_grad(self.c_attn.backward(&cache.ln_1.out, &dqkv, ones, true)?)?;
        let branch = self.ln_1.backward(&d_ln1, &cache.ln_1)?;
        g.add_(&branch)?;
        Ok(g)
    }

    fn zero_grad(&mut self) -> DeviceResult<()> {
        self.ln_1.zero_grad()?;
        self.c_attn.zero_grad()?;
        self.attn_proj.zero_grad()?;
        self.ln_2.zero_grad()?;
        self.c_fc.zero_grad()?;
        self.mlp_proj.zero_grad()
    }
}

impl DeviceGpt {
    /// Copies a CPU GPT to `device` (f32, dropout 0; gradients start at zero).
    pub fn from_cpu(device: &CudaDevice, model: &Gpt) -> DeviceResult<DeviceGpt> {
        let config = *model.config();
        let tensors = host_params(model)?;
        let mut next = tensors.iter();
        let mut take = || {
            next.next().ok_or(DeviceError::NoParameters {
                op: "DeviceGpt::from_cpu",
            })
        };
        let bias = config.bias;
        // Reads the next parameters, in `layout`'s order, as a norm or a linear layer.
        macro_rules! norm {
            () => {{
                let w = take()?;
                let b = if bias { Some(take()?) } else { None };
                DeviceNorm::from_host(device, w, b)?
            }};
        }
        macro_rules! linear {
            () => {{
                let w = take()?;
                let b = if bias { Some(take()?) } else { None };
                DeviceLinear::from_host(device, w, b)?
            }};
        }
        let wte = CudaTensor::from_host(device, take()?)?;
        let wpe = CudaTensor::from_host(device, take()?)?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            let ln_1 = norm!();
            let c_attn = linear!();
            let attn_proj = linear!();
            let ln_2 = norm!();
            let c_fc = linear!();
            let mlp_proj = linear!();
            blocks.push(DeviceBlock {
                ln_1,
                c_attn,
                attn_proj,
                ln_2,
                c_fc,
                mlp_proj,
            });
        }
        let ln_f = norm!();
        Ok(DeviceGpt {
            device: device.clone(),
            config,
            grad_wte: zeros(device, wte.shape())?,
            grad_wpe: zeros(device, wpe.shape())?,
            wte,
            wpe,
            blocks,
            ln_f,
            ones: None,
            cache: None,
            logits: None,
            loss_grad: None,
            moments: BTreeMap::new(),
            adam_steps: 0,
        })
    }

    /// Opens device `ordinal` and copies `model` to it: on a machine without CUDA (or without
    /// that device) `DeviceError::Cuda(CudaError::Unavailable { .. })`, never a panic.
    pub fn open(ordinal: usize, model: &Gpt) -> DeviceResult<DeviceGpt> {
        let device = CudaDevice::new(ordinal)?;
        DeviceGpt::from_cpu(&device, model)
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The configuration (of the CPU model it was copied from).
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// A `[rows, 1]` column of ones for the linear layers' bias GEMMs, kept while the token
    /// count stays the same.
    fn ones(&mut self, rows: usize) -> DeviceResult<()> {
        if self.ones.as_ref().is_none_or(|o| o.shape() != [rows, 1]) {
            let ones = Tensor::ones(&[rows, 1], DType::F32)?;
            self.ones = Some(CudaTensor::from_host(&self.device, &ones)?);
        }
        Ok(())
    }

    /// The forward pass for token ids `[B, T]` (I64, `T ≤ block_size`, each below the
    /// vocabulary size, else a typed error before any launch); returns the logits
    /// `[B, T, V]`, kept until the next forward.
    pub fn forward(&mut self, ids: &Tensor) -> DeviceResult<&CudaTensor> {
        const OP: &str = "DeviceGpt::forward";
        let (batch, seq) = match ids.shape() {
            &[batch, seq] if seq <= self.config.block_size => (batch, seq),
            other => {
                return Err(DeviceError::BadShape {
                    op: OP,
                    expected: format!("token ids [B, T] with T ≤ {}", self.config.block_size),
                    actual: other.to_vec(),
                });
            }
        };
        let tokens = TokenIndex::new(&self.device, ids, self.config.vocab_size)?;
        let dims = Dims {
            batch,
            seq,
            c: self.config.n_embd,
            n_head: self.config.n_head,
        };
        let n = dims.tokens();
        self.cache = None;
        self.logits = None;
        self.loss_grad = None;
        self.ones(n)?;
        let ones = self
            .ones
            .as_ref()
            .ok_or(DeviceError::NoParameters { op: OP })?;
        let mut x = embedding(&self.wte, &self.wpe, &tokens)?;
        let mut caches = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            let (out, cache) = block.forward(x, ones, dims)?;
            x = out;
            caches.push(cache);
        }
        let ln_f = self.ln_f.forward(&x)?;
        drop(x);
        let v = self.config.vocab_size;
        let mut logits = zeros(&self.device, &[n, v])?;
        gemm(
            1.0,
            &ln_f.out,
            Transpose::No,
            &self.wte,
            Transpose::Yes,
            0.0,
            &mut logits,
        )?;
        self.cache = Some(ForwardCache {
            tokens,
            blocks: caches,
            ln_f,
            batch,
            seq,
        });
        let logits = self.logits.insert(logits.reshape(&[batch, seq, v])?);
        Ok(logits)
    }

    /// The forward pass and the mean cross-entropy of its logits against `targets` (I64
    /// `[B, T]`; `DEFAULT_IGNORE_INDEX` (−100) is ignored, as on the CPU). The gradient of
    /// the logits is kept for [`backward`](DeviceGpt::backward).
    pub fn loss(&mut self, ids: &Tensor, targets: &Tensor) -> DeviceResult<f64> {
        let logits = self.forward(ids)?;
        let out = cross_entropy(logits, targets, DEFAULT_IGNORE_INDEX)?;
        self.loss_grad = Some(out.grad);
        Ok(out.loss)
    }

    /// The backward pass of the last [`loss`](DeviceGpt::loss): accumulates every parameter's
    /// gradient and frees the activations.
    pub fn backward(&mut self) -> DeviceResult<()> {
        let grad = self
            .loss_grad
            .take()
            .ok_or(DeviceError::BackwardBeforeForward {
                module: "DeviceGpt",
            })?;
        self.backward_from(grad)
    }

    /// The backward pass from the gradient of the last forward's logits (`[B, T, V]`, f32).
    pub fn backward_from(&mut self, grad_logits: CudaTensor) -> DeviceResult<()> {
        const OP: &str = "DeviceGpt::backward_from";
        // The checks read the cache without taking it, so a rejected gradient leaves the
        // forward's activations in place for a correct one.
        let (batch, seq) = self
            .cache
            .as_ref()
            .map(|cache| (cache.batch, cache.seq))
            .ok_or(DeviceError::BackwardBeforeForward {
                module: "DeviceGpt",
            })?;
        let (c, v) = (self.config.n_embd, self.config.vocab_size);
        if grad_logits.dtype() != DType::F32 {
            return Err(DeviceError::DTypeMismatch {
                op: OP,
                lhs: DType::F32,
                rhs: grad_logits.dtype(),
            });
        }
        if grad_logits.shape() != [batch, seq, v] {
            return Err(DeviceError::BadShape {
                op: OP,
                expected: format!("a gradient of the logits [{batch}, {seq}, {v}]"),
                actual: grad_logits.shape().to_vec(),
            });
        }
        let cache = self
            .cache
            .take()
            .ok_or(DeviceError::BackwardBeforeForward {
                module: "DeviceGpt",
            })?;
        self.logits = None;
        self.loss_grad = None;
        let dims = Dims {
            batch,
            seq,
            c,
            n_head: self.config.n_head,
        };
        let n = dims.tokens();
        let g = grad_logits.reshape(&[n, v])?;
        // The lm_head: dwte += gᵀ · h, dh = g · wte.
        gemm(
            1.0,
            &g,
            Transpose::Yes,
            &cache.ln_f.out,
            Transpose::No,
            1.0,
            &mut self.grad_wte,
        )?;
        let mut dh = zeros(&self.device, &[n, c])?;
        gemm(
            1.0,
            &g,
            Transpose::No,
            &self.wte,
            Transpose::No,
            0.0,
            &mut dh,
        )?;
        drop(g);
        let mut grad = self.ln_f.backward(&dh, &cache.ln_f)?;
        drop(dh);
        let ones = self
            .ones
            .as_ref()
            .ok_or(DeviceError::NoParameters { op: OP })?;
        for (block, block_cache) in self.blocks.iter_mut().zip(&cache.blocks).rev() {
            grad = block.backward(grad, block_cache, ones, dims)?;
        }
        embedding_backward(&grad, &cache.tokens, &mut self.grad_wte, &mut self.grad_wpe)?;
        Ok(())
    }

    /// Zeroes every gradient.
    pub fn zero_grad(&mut self) -> DeviceResult<()> {
        self.grad_wte.zero_()?;
        self.grad_wpe.zero_()?;
        for block in &mut self.blocks {
            block.zero_grad()?;
        }
        self.ln_f.zero_grad()
    }

    /// Every parameter with its gradient and name, in the CPU model's visiting order.
    fn params_mut(&mut self) -> Vec<ParamMut<'_>> {
        let mut out = Vec::new();
        out.push((
            "transformer.wte.weight".to_string(),
            &mut self.wte,
            &self.grad_wte,
        ));
        out.push((
            "transformer.wpe.weight".to_string(),
            &mut self.wpe,
            &self.grad_wpe,
        ));
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let p = format!("transformer.h.{i}");
            b.ln_1.params_mut(&format!("{p}.ln_1"), &mut out);
            linear_params_mut(&format!("{p}.attn.c_attn"), &mut b.c_attn, &mut out);
            linear_params_mut(&format!("{p}.attn.c_proj"), &mut b.attn_proj, &mut out);
            b.ln_2.params_mut(&format!("{p}.ln_2"), &mut out);
            linear_params_mut(&format!("{p}.mlp.c_fc"), &mut b.c_fc, &mut out);
            linear_params_mut(&format!("{p}.mlp.c_proj"), &mut b.mlp_proj, &mut out);
        }
        self.ln_f.params_mut("transformer.ln_f", &mut out);
        out
    }

    /// [`params_mut`](Self::params_mut), read-only.
    fn params(&self) -> Vec<ParamRef<'_>> {
        let mut out = vec![
            (
                "transformer.wte.weight".to_string(),
                &self.wte,
                &self.grad_wte,
            ),
            (
                "transformer.wpe.weight".to_string(),
                &self.wpe,
                &self.grad_wpe,
            ),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("transformer.h.{i}");
            b.ln_1.params(&format!("{p}.ln_1"), &mut out);
            linear_params(&format!("{p}.attn.c_attn"), &b.c_attn, &mut out);
            linear_params(&format!("{p}.attn.c_proj"), &b.attn_proj, &mut out);
            b.ln_2.params(&format!("{p}.ln_2"), &mut out);
            linear_params(&format!("{p}.mlp.c_fc"), &b.c_fc, &mut out);
            linear_params(&format!("{p}.mlp.c_proj"), &b.mlp_proj, &mut out);
        }
        self.ln_f.params("transformer.ln_f", &mut out);
        out
    }

    /// Plain SGD on every parameter: `p −= lr · grad` (one f32 rounding, as the CPU `Sgd`
    /// without momentum or weight decay).
    pub fn sgd_step(&mut self, lr: f64) -> DeviceResult<()> {
        for (_, value, grad) in self.params_mut() {
            value.axpy_(-lr, grad)?;
        }
        Ok(())
    }

    /// One AdamW step on every parameter with `config` (the CPU `AdamW`'s update, in f32 with
    /// f32 moments, which start at zero on the first call).
    pub fn adamw_step(&mut self, config: &AdamWConfig) -> DeviceResult<()> {
        self.adam_steps += 1;
        let step = AdamWStep {
            lr: config.lr,
            betas: config.betas,
            eps: config.eps,
            weight_decay: config.weight_decay,
            step: NonZeroU64::new(self.adam_steps).unwrap_or(NonZeroU64::MIN),
        };
        let device = self.device.clone();
        let mut moments = std::mem::take(&mut self.moments);
        let result: DeviceResult<()> = (|| {
            for (name, value, grad) in self.params_mut() {
                if !moments.contains_key(&name) {
                    let m = zeros(&device, value.shape())?;
                    let v = zeros(&device, value.shape())?;
                    moments.insert(name.clone(), (m, v));
                }
                if let Some((m, v)) = moments.get_mut(&name) {
                    adamw_(value, m, v, grad, &step)?;
                }
            }
            Ok(())
        })();
        self.moments = moments;
        result
    }

    /// One training step as the CPU trainer's with SGD: zero the gradients, forward, the
    /// cross-entropy loss, backward, `p −= lr · grad`. Returns the loss.
    pub fn train_step_sgd(&mut self, ids: &Tensor, targets: &Tensor, lr: f64) -> DeviceResult<f64> {
        self.zero_grad()?;
        let loss = self.loss(ids, targets)?;
        self.backward()?;
        self.sgd_step(lr)?;
        Ok(loss)
    }

    /// The model back on the host, as a CPU [`Gpt`] of the same configuration and parameter
    /// names; with `grads`, each parameter's `grad` is its device gradient.
    pub fn to_cpu(&self, grads: bool) -> DeviceResult<Gpt> {
        const OP: &str = "DeviceGpt::to_cpu";
        let mut host = BTreeMap::new();
        for (name, value, grad) in self.params() {
            let grad = if grads { Some(grad.to_host()?) } else { None };
            host.insert(name, (value.to_host()?, grad));
        }
        let mut model = Gpt::new(self.config)?;
        let mut missing = None;
        model.visit_params_mut("", &mut |name, param| {
            let Some((value, grad)) = host.remove(name) else {
                missing.get_or_insert_with(|| name.to_string());
                return Ok(());
            };
            let shape = param.data()?.shape().to_vec();
            param.data = Some(value.reshape(&shape)?);
            param.grad = grad.map(|g| g.reshape(&shape)).transpose()?;
            Ok(())
        })?;
        if let Some(name) = missing.or_else(|| host.into_keys().next()) {
            return Err(DeviceError::ParameterLayout {
                op: OP,
                name,
                reason: "differs between the device model and a CPU GPT of its configuration"
                    .to_string(),
            });
        }
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ParamVisitor;

    fn tiny(bias: bool) -> GptConfig {
        GptConfig {
            vocab_size: 11,
            block_size: 5,
            n_layer: 2,
            n_head: 2,
            n_embd: 6,
            bias,
            dropout: 0.0,
            dtype: DType::F32,
            seed: 3,
        }
    }

    #[test]
    fn layout_is_the_cpu_models() {
        for bias in [true, false] {
            let config = tiny(bias);
            let model = Gpt::new(config).unwrap();
            let mut cpu = Vec::new();
            let visit: &mut ParamVisitor<'_> = &mut |name, p| {
                cpu.push((name.to_string(), p.data()?.shape().to_vec()));
                Ok(())
            };
            model.visit_params("", visit).unwrap();
            assert_eq!(layout(&config), cpu, "bias {bias}");
            let tensors = host_params(&model).unwrap();
            assert_eq!(tensors.len(), cpu.len());
            for (t, (_, shape)) in tensors.iter().zip(&cpu) {
                assert_eq!(t.shape(), shape.as_slice());
            }
        }
        // 2 embeddings, per layer 2 norms and 4 linears with biases, and ln_f.
        assert_eq!(layout(&tiny(true)).len(), 2 + 2 * (4 + 8) + 2);
    }

    #[test]
    fn refuses_what_the_device_cannot_run() {
        let dropout = Gpt::new(GptConfig {
            dropout: 0.1,
            ..tiny(true)
        })
        .unwrap();
        assert!(matches!(
            host_params(&dropout),
            Err(DeviceError::UnsupportedConfig {
                field: "dropout",
                ..
            })
        ));
        let bf16 = Gpt::new(GptConfig {
            dtype: DType::BF16,
            ..tiny(true)
        })
        .unwrap();
        assert!(matches!(
            host_params(&bf16),
            Err(DeviceError::DTypeMismatch {
                lhs: DType::F32,
                rhs: DType::BF16,
                ..
            })
        ));
        let mut frozen = Gpt::new(tiny(true)).unwrap();
        frozen
            .visit_params_mut("", &mut |name, p| {
                if name == "transformer.h.1.mlp.c_fc.bias" {
                    p.requires_grad = false;
                }
                Ok(())
            })
            .unwrap();
        match host_params(&frozen) {
            Err(DeviceError::FrozenParameter { name, .. }) => {
                assert_eq!(name, "transformer.h.1.mlp.c_fc.bias")
            }
            other => panic!("{other:?}"),
        }
        let mut freed = Gpt::new(tiny(false)).unwrap();
        freed
            .visit_params_mut("", &mut |name, p| {
                if name == "transformer.ln_f.weight" {
                    p.data = None;
                }
                Ok(())
            })
            .unwrap();
        assert!(matches!(
            host_params(&freed),
            Err(DeviceError::Nn(crate::Error::NotMaterialised { .. }))
        ));
        let mut reshaped = Gpt::new(tiny(true)).unwrap();
        reshaped
            .visit_params_mut("", &mut |name, p| {
                if name == "transformer.wpe.weight" {
                    p.data = Some(Tensor::zeros(&[4, 6], DType::F32)?);
                }
                Ok(())
            })
            .unwrap();
        match host_params(&reshaped) {
            Err(DeviceError::ParameterLayout { name, .. }) => {
                assert_eq!(name, "transformer.wpe.weight")
            }
            other => panic!("{other:?}"),
        }
    }
}
