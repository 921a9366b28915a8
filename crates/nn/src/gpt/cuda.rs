//! The GPT's forward on a CUDA device (feature `cuda`).

use hypershard_tensor::Tensor;

use super::{Gpt, GptCache, HeadCache};
use crate::kernels::same_device;
use crate::{Module, Result};

impl Gpt {
    /// The forward on a CUDA device: the embeddings by their kernel, the blocks and `ln_f`
    /// as on any device, the lm_head through cuBLAS.
    ///
    /// With the fused loss (see [`Gpt::fused_loss`]) there is no tiled head kernel: the
    /// logits are formed whole, the cross-entropy kernel turns them into the mean loss and its
    /// gradient, and when a backward follows the head's two backward GEMMs run at once, so the
    /// logits and their gradient are freed before the blocks' backward. The peak holds
    /// `[B·T, V]` twice for that moment, which a GPU's memory affords where a host rank's
    /// budget does not.
    pub(super) fn forward_cuda(&mut self, input: &Tensor, dims: [usize; 4]) -> Result<Tensor> {
        use crate::kernels::cuda;
        const OP: &str = "Gpt::forward";
        let [batch, seq, _, v] = dims;
        let device = input.device();
        let tokens = cuda::token_index(OP, &device, input, v)?;
        let x = cuda::gpt_embed(self.wte.data()?, self.wpe.data()?, &tokens)?;
        let mut x = self.drop.forward(&x)?;
        for block in self.h.iter_mut() {
            x = block.forward(&x)?;
        }
        let final_hidden = self.ln_f.forward(&x)?.contiguous()?;
        let logits = cuda::gpt_head(&final_hidden, self.wte.data()?, dims)?;
        if let Some(fused) = &self.fused {
            let pending = fused.targets.take("GPT")?;
            same_device(OP, &[&final_hidden, &pending.targets])?;
            let rows = logits.reshape(&[batch * seq, v])?;
            let targets = pending.targets.reshape(&[batch * seq])?;
            let (loss, grad_logits) = cuda::cross_entropy(OP, &rows, &targets, fused.ignore_index)?;
            drop((logits, rows));
            self.cache = if pending.backward {
                let (head_grad, hidden_grad) =
                    cuda::gpt_head_backward(&grad_logits, &final_hidden, self.wte.data()?, dims)?;
                Some(GptCache {
                    rows: Vec::new(),
                    batch,
                    seq,
                    head: HeadCache::CudaLoss {
                        hidden_grad,
                        head_grad,
                        tokens,
                    },
                })
            } else {
                None
            };
            return Ok(Tensor::from_vec_on(vec![loss], &[1], &device)?);
        }
        self.cache = Some(GptCache {
            rows: Vec::new(),
            batch,
            seq,
            head: HeadCache::Cuda {
                final_hidden,
                tokens,
            },
        });
        Ok(logits)
    }
}
