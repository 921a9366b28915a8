//! Which GPU a rank uses: one per rank, local rank `r` on GPU `r` (torchrun's convention).

use cudarc::driver::CudaContext;

use super::library::{self, unavailable};
use crate::error::{Result, Unavailable};

/// The GPU of local rank `local_rank` among `local_ranks` ranks on a host with `devices` GPUs:
/// GPU `local_rank`, torchrun's convention. NCCL needs a GPU per rank, so more ranks than GPUs
/// is [`Unavailable::SharedDevice`] on every rank (each rank sees the same counts, so none is
/// left waiting for the others in NCCL's initialisation), and no GPU is
/// [`Unavailable::NoDevice`].
pub fn device_for_local_rank(
    local_rank: usize,
    local_ranks: usize,
    devices: usize,
) -> Result<usize> {
    if devices > 0 && local_ranks > devices {
        return Err(unavailable(Unavailable::SharedDevice {
            ranks: local_ranks,
            devices,
        }));
    }
    if local_rank >= devices {
        return Err(unavailable(Unavailable::NoDevice {
            requested: local_rank,
            available: devices,
        }));
    }
    Ok(local_rank)
}

/// The number of CUDA devices, or [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) when the libraries are missing.
pub fn device_count() -> Result<usize> {
    library::probe()?;
    let count = CudaContext::device_count()
        .map_err(|e| unavailable(Unavailable::DriverInit { code: e.0 as i32 }))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn reason(result: Result<usize>) -> Unavailable {
        match result {
            Err(Error::BackendUnavailable {
                backend: "nccl",
                reason,
            }) => reason,
            other => panic!("expected BackendUnavailable, got {other:?}"),
        }
    }

    #[test]
    fn local_rank_r_takes_gpu_r_while_every_rank_has_one() {
        assert_eq!(device_for_local_rank(0, 1, 1).unwrap(), 0);
        assert_eq!(device_for_local_rank(3, 4, 8).unwrap(), 3);
        assert_eq!(device_for_local_rank(7, 8, 8).unwrap(), 7);
    }

    #[test]
    fn more_ranks_than_gpus_is_refused_on_every_rank() {
        // Every rank of a two-rank host with one GPU gets the same refusal, rank 0 included
        // (it must not go on into NCCL's initialisation and wait for rank 1).
        for rank in 0..2 {
            let why = reason(device_for_local_rank(rank, 2, 1));
            assert_eq!(
                why,
                Unavailable::SharedDevice {
                    ranks: 2,
                    devices: 1
                }
            );
            assert!(why.to_string().contains("HYPERSHARD_BACKEND=tcp"), "{why}");
        }
        // A local rank past LOCAL_WORLD_SIZE's GPUs (a launcher's inconsistent variables).
        assert_eq!(
            reason(device_for_local_rank(2, 2, 2)),
            Unavailable::NoDevice {
                requested: 2,
                available: 2
            }
        );
        assert_eq!(
            reason(device_for_local_rank(0, 1, 0)),
            Unavailable::NoDevice {
                requested: 0,
                available: 0
            }
        );
    }
}
