//! `Embedding`: a lookup table of rows indexed by integer ids.

use hypershard_tensor::{DType, RandomInit, Tensor};

use crate::elementwise::check_float;
use crate::kernels::{Float, load, read_all, same_device, store, with_float};
use crate::module::{ParamVisitor, ParamVisitorMut, join_name};
use crate::{Error, Module, Parameter, Result};

/// How to build an [`Embedding`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbeddingConfig {
    /// The number of rows (the vocabulary size).
    pub num_embeddings: usize,
    /// The width of each row.
    pub embedding_dim: usize,
    /// The weight's dtype.
    pub dtype: DType,
    /// The seed of the `N(0, 1)` initialisation (torch's default for `nn.Embedding`).
    pub seed: u64,
}

/// torch's `nn.Embedding`: `weight` is `[num_embeddings, embedding_dim]`; the input is an I64
/// tensor of ids of any shape and the output is `[*ids, embedding_dim]`.
///
/// Ids have no gradient: `backward` scatter-adds the output gradient into the weight's rows
/// and returns a zero tensor of the ids' shape in the weight's dtype, a placeholder that keeps
/// the [`Module`] contract (torch returns no gradient for integer inputs).
#[derive(Debug)]
pub struct Embedding {
    /// The table, `[num_embeddings, embedding_dim]`.
    pub weight: Parameter,
    ids: Option<Tensor>,
}

impl Embedding {
    /// A table initialised from `N(0, 1)`, as torch does.
    pub fn new(config: EmbeddingConfig) -> Result<Self> {
        check_float("Embedding::new", config.dtype)?;
        let weight = Tensor::random(
            &[config.num_embeddings, config.embedding_dim],
            config.dtype,
            RandomInit::normal(config.seed, 0.0, 1.0),
        )?;
        Ok(Embedding {
            weight: Parameter::new("weight", weight),
            ids: None,
        })
    }

    /// The ids as row numbers, checked against the table size.
    pub(crate) fn rows(ids: &Tensor, size: usize) -> Result<Vec<usize>> {
        if ids.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                op: "Embedding::forward",
                lhs: DType::I64,
                rhs: ids.dtype(),
            });
        }
        read_all::<i64>("Embedding::forward", ids)?
            .into_iter()
            .enumerate()
            .map(|(position, index)| {
                usize::try_from(index).ok().filter(|&row| row < size).ok_or(
                    Error::IndexOutOfRange {
                        op: "Embedding::forward",
                        position,
                        index,
                        size,
                    },
                )
            })
            .collect()
    }
}

/// The rows `rows` of a row-major `[_, dim]` table, concatenated. The rows must be in range
/// (checked by [`Embedding::rows`]).
pub(crate) fn gather_rows<F: Float>(table: &[F], rows: &[usize], dim: usize) -> Vec<F> {
    let mut out = Vec::with_capacity(rows.len() * dim);
    for &row in rows {
        out.extend_from_slice(&table[row * dim..(row + 1) * dim]);
    }
    out
}

/// `grad[rows[i]] += g[i]` for a `[size, dim]` table gradient: the backward of
/// [`gather_rows`]. The rows must be in range (checked by [`Embedding::rows`]).
pub(crate) fn scatter_add_rows<F: Float>(
    g: &[F],
    rows: &[usize],
    size: usize,
    dim: usize,
) -> Vec<F> {
    let mut grad = vec![F::ZERO; size * dim];
    if dim == 0 {
        return grad;
    }
    for (&row, g_row) in rows.iter().zip(g.chunks_exact(dim)) {
        crate::kernels::add_assign(&mut grad[row * dim..(row + 1) * dim], g_row);
    }
    grad
}

/// The `[rows, width]` of a table, which must be 2-D (the field is public, so check).
fn table_shape(weight: &Tensor) -> Result<[usize; 2]> {
    match weight.shape() {
        &[rows, width] => Ok([rows, width]),
        other => Err(Error::BadShape {
            op: "Embedding",
            expected: "a 2-D weight [num_embeddings, embedding_dim]".to_string(),
            actual: other.to_vec(),
        }),
    }
}

impl Module for Embedding {
    fn kind(&self) -> &'static str {
        "Embedding"
    }

    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        const OP: &str = "Embedding::forward";
        let weight = self.weight.data()?;
        let [size, dim] = table_shape(weight)?;
        let device = same_device(OP, &[weight, input])?;
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            use crate::kernels::cuda;
            if input.dtype() != DType::I64 {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    lhs: DType::I64,
                    rhs: input.dtype(),
                });
            }
            let tokens = cuda::token_index(OP, &device, input, size)?;
            let out = cuda::embedding(weight, &tokens, input.shape())?;
            self.ids = Some(input.clone());
            return Ok(out);
        }
        let rows = Embedding::rows(input, size)?;
        let mut shape = input.shape().to_vec();
        shape.push(dim);
        let out = with_float!("Embedding::forward", weight.dtype(), F => {
            store(gather_rows(&load::<F>(weight)?, &rows, dim), &shape, weight.dtype(), &device)?
        });
        self.ids = Some(input.clone());
        Ok(out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        let ids = self.ids.take().ok_or(Error::BackwardBeforeForward {
            module: "Embedding",
        })?;
        let weight = self.weight.data()?;
        let [size, dim] = table_shape(weight)?;
        let mut expected = ids.shape().to_vec();
        expected.push(dim);
        if grad_output.shape() != expected.as_slice() {
            return Err(Error::ShapeMismatch {
                op: "Embedding::backward",
                lhs: expected,
                rhs: grad_output.shape().to_vec(),
            });
        }
        if grad_output.dtype() != weight.dtype() {
            return Err(Error::DTypeMismatch {
                op: "Embedding::backward",
                lhs: weight.dtype(),
                rhs: grad_output.dtype(),
            });
        }
        let dtype = weight.dtype();
        let device = same_device("Embedding::backward", &[weight, grad_output])?;
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            use crate::kernels::cuda;
            if self.weight.requires_grad {
                let tokens = cuda::token_index("Embedding::backward", &device, &ids, size)?;
                let grad = cuda::embedding_backward(&grad_output.contiguous()?, &tokens, weight)?;
                self.weight.accumulate_grad(grad)?;
            }
            return Ok(Tensor::zeros_on(ids.shape(), dtype, &device)?);
        }
        if self.weight.requires_grad {
            let rows = Embedding::rows(&ids, size)?;
            let grad = with_float!("Embedding::backward", dtype, F => {
                let g = load::<F>(grad_output)?;
                store(scatter_add_rows(&g, &rows, size, dim), &[size, dim], dtype, &device)?
            });
            self.weight.accumulate_grad(grad)?;
        }
        Ok(Tensor::zeros_on(ids.shape(), dtype, &device)?)
    }

    fn clear_cache(&mut self) -> Result<()> {
        self.ids = None;
        Ok(())
    }

    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &self.weight)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        f(&join_name(prefix, "weight"), &mut self.weight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Embedding {
        let weight =
            Tensor::from_vec((0..8).map(f64::from).collect::<Vec<_>>(), &[4, 2]).expect("tensor");
        Embedding {
            weight: Parameter::new("weight", weight),
            ids: None,
        }
    }

    #[test]
    fn looks_up_rows_and_scatter_adds_gradients() {
        let mut emb = table();
        let ids = Tensor::from_vec(vec![3i64, 0, 3], &[1, 3]).expect("ids");
        let out = emb.forward(&ids).expect("forward");
        assert_eq!(out.shape(), &[1, 3, 2]);
        assert_eq!(
            out.to_vec::<f64>().expect("f64"),
            vec![6.0, 7.0, 0.0, 1.0, 6.0, 7.0]
        );
        let g = Tensor::from_vec(vec![1.0f64, 2.0, 10.0, 20.0, 100.0, 200.0], &[1, 3, 2])
            .expect("grad");
        let gx = emb.backward(&g).expect("backward");
        assert_eq!(gx.shape(), &[1, 3]);
        // Row 3 is used twice, so its gradient is the sum of both output rows.
        let grad = emb
            .weight
            .grad
            .as_ref()
            .expect("grad")
            .to_vec::<f64>()
            .expect("f64");
        assert_eq!(grad, vec![10.0, 20.0, 0.0, 0.0, 0.0, 0.0, 101.0, 202.0]);
    }

    #[test]
    fn rejects_bad_ids_and_initialises_normally() {
        let mut emb = table();
        let ids = Tensor::from_vec(vec![1i64, 4], &[2]).expect("ids");
        assert!(matches!(
            emb.forward(&ids),
            Err(Error::IndexOutOfRange {
                position: 1,
                index: 4,
                size: 4,
                ..
            })
        ));
        let float_ids = Tensor::zeros(&[2], DType::F32).expect("zeros");
        assert!(matches!(
            emb.forward(&float_ids),
            Err(Error::DTypeMismatch { .. })
        ));
        let config = EmbeddingConfig {
            num_embeddings: 64,
            embedding_dim: 64,
            dtype: DType::F32,
            seed: 3,
        };
        let emb = Embedding::new(config).expect("embedding");
        let w = emb.weight.data().expect("data").to_f64_vec().expect("f64");
        let mean = w.iter().sum::<f64>() / w.len() as f64;
        let var = w.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / w.len() as f64;
        // 4096 N(0, 1) samples: the mean's standard error is 1/64.
        assert!(
            mean.abs() < 0.07 && (var - 1.0).abs() < 0.1,
            "mean {mean}, var {var}"
        );
    }
}
