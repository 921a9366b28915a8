//! Tiled (flash) causal self-attention on CUDA, f32: the memory-lean attention of nn's host
//! kernel (`attention/flash.rs`) on a GPU. The kernels read the heads straight from the fused
//! projection `[B, T, 3C]` and write the output `[B, T, C]` (and the gradient `[B, T, 3C]`)
//! straight into their places, keeping one log-sum-exp per query row, so neither the split
//! heads nor the `[B·H, T, T]` weights are ever held. The dropout of the weights draws its
//! mask inside the kernels from the counter each weight has in the `[B, H, T, T]` row-major
//! order, the mask nn's host kernel draws.
//!
//! The backward recomputes the weights twice (once for the queries' gradient, once for the
//! keys' and values'), so that each thread owns the rows it writes and no kernel needs
//! atomics: every result is the same from run to run.

use cudarc::driver::{LaunchConfig, PushKernelArg};

#[cfg(test)]
use super::KERNEL_NAMES;
use super::error::CudaError;
use super::kernels::{MAX_GRID_X, launch_config};
use super::nn_ops::head_dims;
use super::view::{Dev, launch};
use crate::{DType, Result, Tensor};

/// The kernels this module launches (all in [`KERNEL_NAMES`]; a unit test checks).
const FORWARD: &str = "flash_forward_f32";
const DELTA: &str = "flash_backward_delta_f32";
const DQ: &str = "flash_backward_dq_f32";
const DKV: &str = "flash_backward_dkv_f32";

/// The widest head the kernels take (`FLASH_MAX_D` in kernels.cu): each thread keeps its
/// row's vectors of this length.
pub const FLASH_MAX_HEAD_DIM: usize = 128;

/// Query (or key) rows per block (`FLASH_ROWS` in kernels.cu): one thread each.
const FLASH_ROWS: usize = 64;

/// The dropout of the attention weights: weight `(b, h, i, j)` is dropped when the uniform of
/// `(seed, ((b·H + h)·T + i)·T + j)` is below `p`, else scaled by `keep_scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashDropout {
    /// The mask's seed.
    pub seed: u64,
    /// The drop probability.
    pub p: f64,
    /// `1/(1 − p)` (0 when `p` is 1).
    pub keep_scale: f64,
}

/// What the forward gives: the output and what the backward needs besides the inputs.
#[derive(Debug)]
pub struct FlashForward {
    /// The attention output `[B, T, C]`.
    pub out: Tensor,
    /// `m + ln l` per query row, `[B, H, T]`.
    pub lse: Tensor,
}

/// The kernels' arguments: `[batch, t, heads, d]` and the softmax scale `1/√D`.
struct Geometry {
    dims: [usize; 4],
    scale: f32,
}

fn geometry(op: &'static str, qkv: &Dev, n_head: usize) -> Result<Geometry> {
    let dims = head_dims(op, qkv, 0, 3, n_head)?;
    let d = dims[3];
    if d > FLASH_MAX_HEAD_DIM {
        return Err(qkv.error(op)(CudaError::TooLarge {
            op,
            what: "head width",
            value: d,
            max: FLASH_MAX_HEAD_DIM,
        }));
    }
    // As the host computes it: 1/√D in f64, rounded once.
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    Ok(Geometry { dims, scale })
}

/// One block of [`FLASH_ROWS`] threads per (batch, head, tile of rows), at most
/// `MAX_GRID_X` blocks (the kernels loop over the rest); `None` when there is no row.
fn tile_config([batch, t, heads, _]: [usize; 4]) -> Option<LaunchConfig> {
    let work = batch * heads * t.div_ceil(FLASH_ROWS);
    if work == 0 {
        return None;
    }
    // Fits in u32: at most MAX_GRID_X, below 2¹⁶.
    Some(LaunchConfig {
        grid_dim: (work.min(MAX_GRID_X) as u32, 1, 1),
        block_dim: (FLASH_ROWS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The dropout's kernel arguments: seed, p, keep scale and the on flag.
fn dropout_args(dropout: Option<FlashDropout>) -> (u64, f64, f64, u32) {
    match dropout {
        Some(FlashDropout {
            seed,
            p,
            keep_scale,
        }) => (seed, p, keep_scale, 1),
        None => (0, 0.0, 1.0, 0),
    }
}

/// Causal self-attention of the fused projection `qkv` (`[B, T, 3C]`, f32, contiguous) with
/// `n_head` heads of width at most [`FLASH_MAX_HEAD_DIM`]: `dropout(softmax(q kᵀ/√D + mask))
/// v` per head, merged to `[B, T, C]`, and the rows' log-sum-exps.
pub fn flash_attention(
    qkv: &Tensor,
    n_head: usize,
    dropout: Option<FlashDropout>,
) -> Result<FlashForward> {
    const OP: &str = "cuda::flash_attention";
    let x = Dev::of(OP, qkv)?;
    let Geometry { dims, scale } = geometry(OP, &x, n_head)?;
    let [batch, t, heads, d] = dims;
    let (out, out_dev) = x.output(OP, &[batch, t, heads * d], DType::F32)?;
    let (lse, lse_dev) = x.output(OP, &[batch, heads, t], DType::F32)?;
    let Some(config) = tile_config(dims) else {
        return Ok(FlashForward { out, lse });
    };
    let sizes = dims.map(|v| v as u64);
    let (seed, p, keep, on) = dropout_args(dropout);
    // Checked: qkv holds B·T·3·H·D f32, out B·T·H·D and lse B·H·T; D ≤ FLASH_MAX_D.
    launch!(OP, &x, FORWARD, config, |l| {
        l.arg(&out_dev.ptr).arg(&lse_dev.ptr).arg(&x.ptr);
        for v in &sizes {
            l.arg(v);
        }
        l.arg(&scale).arg(&seed).arg(&p).arg(&keep).arg(&on);
    })?;
    Ok(FlashForward { out, lse })
}

/// The gradient of the fused projection (`[B, T, 3C]`) from the gradient of the output of
/// [`flash_attention`] on the same `qkv`, `n_head` and `dropout`, given its output and
/// log-sum-exps.
pub fn flash_attention_backward(
    qkv: &Tensor,
    forward: &FlashForward,
    grad_out: &Tensor,
    n_head: usize,
    dropout: Option<FlashDropout>,
) -> Result<Tensor> {
    const OP: &str = "cuda::flash_attention_backward";
    let x = Dev::of(OP, qkv)?;
    let Geometry { dims, scale } = geometry(OP, &x, n_head)?;
    let [batch, t, heads, d] = dims;
    let out = Dev::of(OP, &forward.out)?;
    let lse = Dev::of(OP, &forward.lse)?;
    let dy = Dev::of(OP, grad_out)?;
    for (dev, shape) in [
        (&out, [batch, t, heads * d]),
        (&dy, [batch, t, heads * d]),
        (&lse, [batch, heads, t]),
    ] {
        dev.f32(OP)?;
        x.same_device(OP, dev)?;
        dev.shape_is(OP, &shape)?;
    }
    let (dqkv, dqkv_dev) = x.output(OP, &[batch, t, 3 * heads * d], DType::F32)?;
    let Some(config) = tile_config(dims) else {
        return Ok(dqkv);
    };
    let (delta, delta_dev) = x.output(OP, &[batch, heads, t], DType::F32)?;
    let sizes = dims.map(|v| v as u64);
    if let Some(rows) = launch_config(OP, batch * heads * t, 1).map_err(x.error(OP))? {
        // Checked: out and grad_out hold B·T·H·D f32, delta B·H·T.
        launch!(OP, &x, DELTA, rows, |l| {
            l.arg(&delta_dev.ptr).arg(&out.ptr).arg(&dy.ptr);
            for v in &sizes {
                l.arg(v);
            }
        })?;
    }
    let (seed, p, keep, on) = dropout_args(dropout);
    for kernel in [DQ, DKV] {
        // Checked: dqkv and qkv hold B·T·3·H·D f32, grad_out B·T·H·D, lse and delta B·H·T;
        // D ≤ FLASH_MAX_D. The two kernels write disjoint columns of dqkv (q; k and v).
        launch!(OP, &x, kernel, config, |l| {
            l.arg(&dqkv_dev.ptr)
                .arg(&x.ptr)
                .arg(&dy.ptr)
                .arg(&lse.ptr)
                .arg(&delta_dev.ptr);
            for v in &sizes {
                l.arg(v);
            }
            l.arg(&scale).arg(&seed).arg(&p).arg(&keep).arg(&on);
        })?;
    }
    // `delta` was read by both kernels; it is freed on the stream they are ordered on.
    drop(delta);
    Ok(dqkv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_exists() {
        for name in [FORWARD, DELTA, DQ, DKV] {
            assert!(KERNEL_NAMES.contains(&name), "{name}");
        }
    }

    #[test]
    fn tiles_cover_every_row_of_every_head() {
        assert!(tile_config([2, 0, 3, 8]).is_none());
        let config = tile_config([2, 65, 3, 8]).expect("rows");
        // Two tiles of 64 rows per (batch, head).
        assert_eq!(config.grid_dim, (12, 1, 1));
        assert_eq!(config.block_dim, (64, 1, 1));
        let huge = tile_config([1 << 20, 1024, 16, 64]).expect("rows");
        assert_eq!(huge.grid_dim.0 as usize, MAX_GRID_X);
    }
}
