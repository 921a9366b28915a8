//! The transformer block of nanoGPT: `MLP` and the pre-LN `Block`.

use hypershard_tensor::{DType, Tensor};

use crate::kernels::add_tensors;
use crate::module::{ChildVisitorMut, ParamVisitor, ParamVisitorMut, join_name};
use crate::{
    CausalSelfAttention, CausalSelfAttentionConfig, Dropout, Error, Gelu, GeluApproximation,
    LayerNorm, LayerNormConfig, Linear, LinearConfig, Module, Result,
};

/// How to build an [`Mlp`] or a [`Block`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockConfig {
    /// The model width `C`.
    pub n_embd: usize,
    /// The number of attention heads (unused by [`Mlp`]).
    pub n_head: usize,
    /// Whether the linear layers and layer norms have biases.
    pub bias: bool,
    /// The dropout probability (attention weights, residual branches).
    pub dropout: f64,
    /// The parameters' dtype.
    pub dtype: DType,
    /// The seed; a block uses seeds `seed .. seed + 16`.
    pub seed: u64,
}

/// nanoGPT's `MLP`: `dropout(c_proj(gelu(c_fc(x))))` with `c_fc: C → 4C`, exact GELU and
/// `c_proj: 4C → C`.
///
/// The children are `c_fc`, `gelu`, `c_proj` and `dropout`, called through [`Module`].
pub struct Mlp {
    c_fc: Box<dyn Module>,
    gelu: Box<dyn Module>,
    c_proj: Box<dyn Module>,
    dropout: Box<dyn Module>,
}

impl std::fmt::Debug for Mlp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mlp").finish_non_exhaustive()
    }
}

impl Mlp {
    /// An MLP with torch-initialised linear layers.
    pub fn new(config: BlockConfig) -> Result<Self> {
        let linear = |in_features, out_features, seed| {
            Linear::new(LinearConfig {
                in_features,
                out_features,
                bias: config.bias,
                dtype: config.dtype,
                seed,
            })
        };
        let c = config.n_embd;
        let hidden = c.checked_mul(4).ok_or(Error::SizeOverflow {
            op: "Mlp::new",
            size: c,
        })?;
        Ok(Mlp {
            c_fc: Box::new(linear(c, hidden, config.seed)?),
            gelu: Box::new(Gelu::new(GeluApproximation::None)),
            c_proj: Box::new(linear(hidden, c, config.seed.wrapping_add(2))?),
            dropout: Box::new(Dropout::new(config.dropout, config.seed.wrapping_add(4))?),
        })
    }
}

impl Module for Mlp {
    fn kind(&self) -> &'static str {
        "MLP"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.forward(input)?;
        let h = self.gelu.forward(&h)?;
        let h = self.c_proj.forward(&h)?;
        self.dropout.forward(&h)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let g = self.dropout.backward(grad_output)?;
        let g = self.c_proj.backward(&g)?;
        let g = self.gelu.backward(&g)?;
        self.c_fc.backward(&g)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.c_fc.visit_params(&join_name(prefix, "c_fc"), f)?;
        self.c_proj.visit_params(&join_name(prefix, "c_proj"), f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.c_fc.visit_params_mut(&join_name(prefix, "c_fc"), f)?;
        self.c_proj
            .visit_params_mut(&join_name(prefix, "c_proj"), f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        f("c_fc", &mut self.c_fc)?;
        f("gelu", &mut self.gelu)?;
        f("c_proj", &mut self.c_proj)?;
        f("dropout", &mut self.dropout)
    }
}

/// nanoGPT's pre-LN `Block`: `x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`.
///
/// The children are `ln_1`, `attn`, `ln_2` and `mlp`, called through [`Module`]; the residual
/// additions are done in the compute type and rounded once.
pub struct Block {
    ln_1: Box<dyn Module>,
    attn: Box<dyn Module>,
    ln_2: Box<dyn Module>,
    mlp: Box<dyn Module>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block").finish_non_exhaustive()
    }
}

impl Block {
    /// A block with torch-initialised layers (a GPT re-initialises them as nanoGPT).
    pub fn new(config: BlockConfig) -> Result<Self> {
        let norm = || {
            LayerNorm::new(LayerNormConfig {
                normalized_shape: config.n_embd,
                eps: 1e-5,
                bias: config.bias,
                dtype: config.dtype,
            })
        };
        let attn = CausalSelfAttention::new(CausalSelfAttentionConfig {
            n_embd: config.n_embd,
            n_head: config.n_head,
            bias: config.bias,
            dropout: config.dropout,
            dtype: config.dtype,
            seed: config.seed,
        })?;
        let mlp = Mlp::new(BlockConfig {
            seed: config.seed.wrapping_add(8),
            ..config
        })?;
        Ok(Block {
            ln_1: Box::new(norm()?),
            attn: Box::new(attn),
            ln_2: Box::new(norm()?),
            mlp: Box::new(mlp),
        })
    }
}

impl Module for Block {
    fn kind(&self) -> &'static str {
        "Block"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        let a = self.ln_1.forward(input)?;
        let a = self.attn.forward(&a)?;
        let x = add_tensors("Block::forward", input, &a)?;
        let m = self.ln_2.forward(&x)?;
        let m = self.mlp.forward(&m)?;
        add_tensors("Block::forward", &x, &m)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        // The residual passes the gradient through unchanged and adds each branch's input grad.
        let g_mlp = self.mlp.backward(grad_output)?;
        let g_mlp = self.ln_2.backward(&g_mlp)?;
        let g = add_tensors("Block::backward", grad_output, &g_mlp)?;
        let g_attn = self.attn.backward(&g)?;
        let g_attn = self.ln_1.backward(&g_attn)?;
        add_tensors("Block::backward", &g, &g_attn)
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.ln_1.visit_params(&join_name(prefix, "ln_1"), f)?;
        self.attn.visit_params(&join_name(prefix, "attn"), f)?;
        self.ln_2.visit_params(&join_name(prefix, "ln_2"), f)?;
        self.mlp.visit_params(&join_name(prefix, "mlp"), f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.ln_1.visit_params_mut(&join_name(prefix, "ln_1"), f)?;
        self.attn.visit_params_mut(&join_name(prefix, "attn"), f)?;
        self.ln_2.visit_params_mut(&join_name(prefix, "ln_2"), f)?;
        self.mlp.visit_params_mut(&join_name(prefix, "mlp"), f)
    }

    fn visit_children_mut(&mut self, f: &mut ChildVisitorMut<'_>) -> Result<()> {
        f("ln_1", &mut self.ln_1)?;
        f("attn", &mut self.attn)?;
        f("ln_2", &mut self.ln_2)?;
        f("mlp", &mut self.mlp)
    }
}
