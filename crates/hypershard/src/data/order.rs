//! Which token windows each rank trains on at each step (`--data-order`).
//!
//! The global batch of a step holds `B = micro_batch × grad_accum × world_size` windows of
//! `block_size + 1` tokens (inputs plus the next-token targets). Window `b` of step `s` has the
//! global index `g = s·B + b`. Ranks take contiguous slices of the global batch in rank order
//! (rank `r` owns `g = s·B + r·B/W + j`), and within its slice, micro-step `m` takes windows
//! `m·micro_batch .. (m+1)·micro_batch`. So the windows of a step do not depend on how many
//! ranks share it, and a 1-rank run with 4-fold accumulation sees the same data as 4 ranks.
//!
//! * `sequential`: window `g` starts at `(g·block_size) mod (N − block_size − 1)`, `N` the
//!   number of tokens: reproducible in any framework from this one formula.
//! * `random`: window `g` starts at a seeded hash of `(seed, g)` mod `N − block_size − 1`;
//!   deterministic, and also independent of the rank count.

use super::corpus::TokenData;
use crate::error::{Error, Result};

/// The order in which windows are drawn (`--data-order`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DataOrder {
    /// A seeded pseudo-random start per window.
    Random,
    /// Start `(g·block_size) mod (N − block_size − 1)`.
    Sequential,
}

/// How a step's global batch is laid out over ranks and accumulation steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchLayout {
    /// Tokens of context per window (targets are shifted by one).
    pub block_size: usize,
    /// Windows per rank per micro-step (`--batch-size`).
    pub micro_batch: usize,
    /// Micro-steps per optimizer step (`--grad-accum`).
    pub grad_accum: usize,
    /// Ranks sharing a step.
    pub world_size: usize,
}

impl BatchLayout {
    /// `B`: windows per optimizer step over all ranks.
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.grad_accum * self.world_size
    }

    /// Tokens trained on per optimizer step over all ranks.
    pub fn tokens_per_step(&self) -> usize {
        self.global_batch() * self.block_size
    }

    /// The global window index of window `i` of micro-step `micro` on `rank` at `step`.
    pub fn global_index(&self, step: u64, rank: usize, micro: usize, i: usize) -> u64 {
        let per_rank = self.micro_batch * self.grad_accum;
        step * self.global_batch() as u64 + (rank * per_rank + micro * self.micro_batch + i) as u64
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of a counter.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The start offset of global window `g` in a corpus of `n_tokens` tokens.
///
/// `span = n_tokens − block_size − 1` must be positive (checked by [`Batcher::new`]).
pub fn window_start(
    order: DataOrder,
    seed: u64,
    g: u64,
    n_tokens: usize,
    block_size: usize,
) -> usize {
    let span = n_tokens.saturating_sub(block_size + 1).max(1) as u64;
    let start = match order {
        DataOrder::Sequential => {
            // (g·block_size) mod span, computed without overflow for any g.
            ((g % span) as u128 * block_size as u128 % span as u128) as u64
        }
        DataOrder::Random => mix64(seed ^ mix64(g)) % span,
    };
    // invariant: start < span ≤ n_tokens, which fits in usize.
    start as usize
}

/// One micro-batch: `rows × cols` input ids and the targets one position later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicroBatch {
    /// Input ids, row-major `[rows, cols]`.
    pub inputs: Vec<u32>,
    /// Target ids, row-major `[rows, cols]`.
    pub targets: Vec<u32>,
    /// Windows.
    pub rows: usize,
    /// Tokens per window (the block size).
    pub cols: usize,
    /// The start offset of each window.
    pub starts: Vec<usize>,
}

/// Cuts micro-batches out of a corpus by [`BatchLayout`] and [`DataOrder`].
#[derive(Clone, Debug)]
pub struct Batcher {
    data: std::sync::Arc<TokenData>,
    layout: BatchLayout,
    order: DataOrder,
    seed: u64,
}

impl Batcher {
    /// Checks the corpus holds at least `block_size + 2` tokens (one window and a non-empty
    /// span of starts) and that the layout is non-degenerate.
    pub fn new(
        data: std::sync::Arc<TokenData>,
        layout: BatchLayout,
        order: DataOrder,
        seed: u64,
    ) -> Result<Batcher> {
        let needed = layout.block_size + 2;
        if data.len() < needed {
            return Err(Error::DataTooShort {
                path: data.path.clone(),
                tokens: data.len(),
                block_size: layout.block_size,
                needed,
            });
        }
        if layout.micro_batch == 0 || layout.grad_accum == 0 || layout.world_size == 0 {
            return Err(Error::UnevenBatch {
                global_batch: layout.global_batch(),
                parts: layout.grad_accum * layout.world_size,
            });
        }
        Ok(Batcher {
            data,
            layout,
            order,
            seed,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The micro-batch `micro` of `rank` at optimizer step `step`.
    pub fn micro_batch(&self, step: u64, rank: usize, micro: usize) -> MicroBatch {
        let (rows, cols) = (self.layout.micro_batch, self.layout.block_size);
        let mut inputs = Vec::with_capacity(rows * cols);
        let mut targets = Vec::with_capacity(rows * cols);
        let mut starts = Vec::with_capacity(rows);
        for i in 0..rows {
            let g = self.layout.global_index(step, rank, micro, i);
            let start = window_start(self.order, self.seed, g, self.data.len(), cols);
            let window = &self.data.tokens[start..start + cols + 1];
            inputs.extend_from_slice(&window[..cols]);
            targets.extend_from_slice(&window[1..]);
            starts.push(start);
        }
        MicroBatch {
            inputs,
            targets,
            rows,
            cols,
            starts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn corpus(n: usize) -> Arc<TokenData> {
        Arc::new(TokenData {
            path: "mem".into(),
            tokens: (0..n as u32).collect(),
        })
    }

    #[test]
    fn sequential_offsets_follow_the_formula_by_hand() {
        // N = 100, block 8: span = 91. g·8 mod 91 for g = 0, 1, 11, 12, 100:
        // 0, 8, 88, 96 mod 91 = 5, 800 mod 91 = 800 − 728 = 72.
        let at = |g| window_start(DataOrder::Sequential, 0, g, 100, 8);
        assert_eq!([at(0), at(1), at(11), at(12), at(100)], [0, 8, 88, 5, 72]);
        // Huge g does not overflow: (10^15 mod 91)·8 mod 91, 10^15 mod 91 = 90 → 720 mod 91 = 83.
        assert_eq!(at(1_000_000_000_000_000), 83);
    }

    #[test]
    fn ranks_take_contiguous_slices_in_rank_order() {
        // micro 2, accum 3, world 4: B = 24; rank 2, micro-step 1, window 1 at step 5:
        // g = 5·24 + 2·6 + 1·2 + 1 = 135.
        let layout = BatchLayout {
            block_size: 4,
            micro_batch: 2,
            grad_accum: 3,
            world_size: 4,
        };
        assert_eq!(layout.global_batch(), 24);
        assert_eq!(layout.global_index(5, 2, 1, 1), 135);
        assert_eq!(layout.tokens_per_step(), 96);
    }

    #[test]
    fn micro_batches_hold_windows_and_shifted_targets() {
        let layout = BatchLayout {
            block_size: 4,
            micro_batch: 2,
            grad_accum: 1,
            world_size: 2,
        };
        let batcher = Batcher::new(corpus(20), layout, DataOrder::Sequential, 0).unwrap();
        // span = 15; step 1 rank 1: g = 1·4 + 2 + i = 6, 7 → starts 24 mod 15 = 9, 28 mod 15 = 13.
        let batch = batcher.micro_batch(1, 1, 0);
        assert_eq!(batch.starts, vec![9, 13]);
        assert_eq!(batch.inputs, vec![9, 10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(batch.targets, vec![10, 11, 12, 13, 14, 15, 16, 17]);
    }

    #[test]
    fn the_same_global_batch_at_one_rank_and_four() {
        let data = corpus(1000);
        let one = BatchLayout {
            block_size: 8,
            micro_batch: 2,
            grad_accum: 4,
            world_size: 1,
        };
        let four = BatchLayout {
            grad_accum: 1,
            world_size: 4,
            ..one
        };
        for order in [DataOrder::Sequential, DataOrder::Random] {
            let a = Batcher::new(Arc::clone(&data), one, order, 3).unwrap();
            let b = Batcher::new(Arc::clone(&data), four, order, 3).unwrap();
            for step in 0..3 {
                let from_one: Vec<usize> = (0..4)
                    .flat_map(|m| a.micro_batch(step, 0, m).starts)
                    .collect();
                let from_four: Vec<usize> = (0..4)
                    .flat_map(|r| b.micro_batch(step, r, 0).starts)
                    .collect();
                assert_eq!(from_one, from_four);
            }
        }
    }

    #[test]
    fn random_order_is_seeded_and_in_range() {
        let starts = |seed| -> Vec<usize> {
            (0..200)
                .map(|g| window_start(DataOrder::Random, seed, g, 100, 8))
                .collect()
        };
        assert_eq!(starts(1), starts(1));
        assert_ne!(starts(1), starts(2));
        assert!(starts(1).iter().all(|s| *s < 91));
        // Not degenerate: most of the 91 starts are hit by 200 draws.
        let distinct: std::collections::BTreeSet<_> = starts(1).into_iter().collect();
        assert!(distinct.len() > 60, "{}", distinct.len());
    }

    #[test]
    fn too_short_data_is_a_typed_error() {
        let layout = BatchLayout {
            block_size: 8,
            micro_batch: 1,
            grad_accum: 1,
            world_size: 1,
        };
        assert!(matches!(
            Batcher::new(corpus(9), layout, DataOrder::Sequential, 0),
            Err(Error::DataTooShort {
                tokens: 9,
                needed: 10,
                ..
            })
        ));
    }
}
