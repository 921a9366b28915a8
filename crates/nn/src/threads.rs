//! Choosing how many threads the kernels use.

use crate::{Error, Result};

/// Runs `f` with the kernels (GEMM row blocks, attention heads) spread over `threads`
/// threads, as `torch.set_num_threads` does for a region of code.
///
/// The kernels use rayon's current pool: by default the global one, sized by
/// `RAYON_NUM_THREADS` or the number of CPUs. This builds a dedicated pool for the call; a
/// caller that runs many steps should wrap the whole loop, not each step. Each rank of a
/// multi-rank job on one machine should pass its share of the cores.
pub fn with_num_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> Result<R> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|source| Error::ThreadPool { threads, source })?;
    Ok(pool.install(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_a_pool_of_the_requested_size() {
        for threads in [1, 3] {
            let seen = with_num_threads(threads, rayon::current_num_threads).expect("pool");
            assert_eq!(seen, threads);
        }
    }
}
