//! How a unit's collectives reach its memory: the [`CommRoute`], and the copy-in buckets,
//! collective buffers and copy-out tensors of each route.
//!
//! * [`CommRoute::Host`]: host tensors. A bucket is a buffer of the mesh's pool viewed as a
//!   tensor, handed to the collective and adopted back without a copy.
//! * [`CommRoute::Staged`]: device tensors over a backend that takes host buffers only
//!   (local, tcp, shm, MPI). One device → host copy into a pool buffer before the collective,
//!   one host → device copy after it.
//! * `CommRoute::Device` (feature `cuda`): CUDA tensors over NCCL. The bucket's device memory
//!   is the collective's buffer, and its output becomes the copy-out tensor, with no copy and
//!   no trip through the host.

use hypershard_collectives::{Buffer, Communicator};
use hypershard_tensor::{DType, Device, Storage, Tensor};

use super::{ParamGroup, buffer_dtype, host_bytes, host_bytes_mut};
use crate::error::{FsdpError, Result};

/// Where a unit's collective buffers live (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommRoute {
    /// Host tensors and host buffers, shared without copies.
    Host,
    /// Device tensors, host buffers: a copy each way.
    Staged,
    /// CUDA tensors, NCCL device buffers: no copies.
    #[cfg(feature = "cuda")]
    Device,
}

impl CommRoute {
    /// The route of a unit on `device` whose collectives run on `comm`. Tensor parallelism
    /// stages: its all-reduce of a bucket's tail works on host bytes.
    pub(crate) fn choose(device: &Device, comm: &dyn Communicator, tensor_parallel: bool) -> Self {
        if device.is_cpu() {
            return CommRoute::Host;
        }
        #[cfg(feature = "cuda")]
        if matches!(device, Device::Cuda { .. })
            && !tensor_parallel
            && hypershard_collectives::nccl::DeviceBuffer::accepted_by(comm)
        {
            return CommRoute::Device;
        }
        let _ = (comm, tensor_parallel);
        CommRoute::Staged
    }
}

impl ParamGroup {
    /// A flat bucket of `len` elements of `dtype` on the unit's device, for a copy-in. On the
    /// host it is a buffer of the mesh's pool, which [`stage_out`](Self::stage_out) hands to
    /// the collective without a copy; on a device it is device memory. Its contents are
    /// stale: the caller writes all of it.
    pub(super) fn bucket(&self, dtype: DType, len: usize) -> Result<Tensor> {
        if self.route == CommRoute::Host {
            let wire = buffer_dtype(dtype, &self.unit)?;
            // A view without a way home: the buffer stays on loan while the tensor holds it,
            // and `stage_out` takes it back out as the same loan, which the collective's
            // caller ends with `give`.
            let buffer = self.mesh.pool().take(wire, len);
            return Ok(hypershard_dtensor::bridge::buffer_to_tensor(
                buffer,
                &[len],
                dtype,
            )?);
        }
        Ok(Tensor::zeros_on(&[len], dtype, &self.device)?)
    }

    /// A bucket as a collective's buffer: the pool's own buffer on the host (no copy), one
    /// device → host copy into a pool buffer when staged, the device memory itself over NCCL.
    pub(super) fn stage_out(&self, flat: Tensor, op: &'static str) -> Result<Buffer> {
        let dtype = flat.dtype();
        let wire = buffer_dtype(dtype, &self.unit)?;
        match self.route {
            CommRoute::Host => Ok(match hypershard_dtensor::bridge::reclaim_buffer(flat)? {
                Ok(buffer) => buffer,
                Err(flat) => hypershard_dtensor::bridge::tensor_to_buffer(&flat)?,
            }),
            CommRoute::Staged => {
                let mut buffer = self.mesh.pool().take(wire, flat.numel());
                let start = flat.offset() * dtype.size_of();
                let guard = flat.storage().read();
                let Storage::Device(memory) = &*guard else {
                    return Err(FsdpError::NotHostStorage { op });
                };
                memory.copy_to_host(op, start, host_bytes_mut(&mut buffer, op)?)?;
                Ok(buffer)
            }
            // CUDA has no empty allocation: an empty bucket travels as an empty host buffer
            // (which `stage_in` takes back through the staged branch).
            #[cfg(feature = "cuda")]
            CommRoute::Device if flat.numel() == 0 => Ok(self.mesh.pool().take(wire, 0)),
            #[cfg(feature = "cuda")]
            CommRoute::Device => {
                use hypershard_collectives::nccl::DeviceBuffer;
                let bytes = hypershard_tensor::cuda::into_cuda_bytes(flat, op)?;
                Ok(Buffer::Cuda(DeviceBuffer::from_slice(bytes, wire)?))
            }
        }
    }

    /// A collective's buffer back as a flat tensor of `dtype` on the unit's device: adopted on
    /// the host (no copy), one host → device copy when staged (the buffer returns to the
    /// pool), the device memory itself over NCCL.
    pub(super) fn stage_in(
        &self,
        buffer: Buffer,
        dtype: DType,
        op: &'static str,
    ) -> Result<Tensor> {
        match (self.route, buffer) {
            (CommRoute::Host, buffer) => Ok(self.mesh.pool().adopt(buffer, dtype)?),
            #[cfg(feature = "cuda")]
            (CommRoute::Device, Buffer::Cuda(memory)) => {
                let len = memory.len();
                Ok(hypershard_tensor::cuda::tensor_from_cuda_bytes(
                    memory.into_slice()?,
                    &[len],
                    dtype,
                    op,
                )?)
            }
            (_, buffer) => {
                let flat = Tensor::zeros_on(&[buffer.len()], dtype, &self.device)?;
                {
                    let mut guard = flat.storage().write();
                    let Storage::Device(memory) = &mut *guard else {
                        return Err(FsdpError::NotHostStorage { op });
                    };
                    memory.copy_from_host(op, 0, host_bytes(&buffer, op)?)?;
                }
                self.mesh.pool().give(buffer);
                Ok(flat)
            }
        }
    }

    /// A collective's output buffer of `len` elements of `dtype`, which the collective
    /// overwrites in full: a pool buffer, or device memory over NCCL.
    pub(super) fn comm_output(&self, dtype: DType, len: usize) -> Result<Buffer> {
        #[cfg(feature = "cuda")]
        if self.route == CommRoute::Device && len > 0 {
            let flat = Tensor::zeros_on(&[len], dtype, &self.device)?;
            return self.stage_out(flat, "collective output");
        }
        Ok(self.mesh.pool().take(buffer_dtype(dtype, &self.unit)?, len))
    }

    /// `acc + other`, two reduce-scatter outputs of one bucket (an HSDP unit whose replicate
    /// all-reduce is deferred sums them), on the memory they are in.
    pub(super) fn add_outputs(&self, acc: Buffer, other: Buffer, dtype: DType) -> Result<Buffer> {
        super::check_len(&other, acc.len(), "partial reduce-scatter sum")?;
        if let (Buffer::Host(_), Buffer::Host(_)) = (&acc, &other) {
            let mut acc = acc;
            add_host_buffers(&mut acc, &other, dtype)?;
            self.mesh.pool().give(other);
            return Ok(acc);
        }
        let sum = self.stage_in(acc, dtype, "partial reduce-scatter sum")?;
        let other = self.stage_in(other, dtype, "partial reduce-scatter sum")?;
        sum.add_(&other)?;
        self.stage_out(sum, "partial reduce-scatter sum")
    }

    /// A tensor of `shape` for a copy-out to overwrite in full: pool memory on the host,
    /// device memory elsewhere.
    pub(super) fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if self.route == CommRoute::Host {
            return Ok(self.mesh.pool().tensor(shape, dtype)?);
        }
        Ok(Tensor::zeros_on(shape, dtype, &self.device)?)
    }
}

/// `acc += other` elementwise for two host buffers of one dtype.
fn add_host_buffers(acc: &mut Buffer, other: &Buffer, dtype: DType) -> Result<()> {
    let shape = [acc.len()];
    let a = Tensor::from_bytes(host_bytes(acc, "partial sum")?, &shape, dtype)?;
    let b = Tensor::from_bytes(host_bytes(other, "partial sum")?, &shape, dtype)?;
    a.add_(&b)?;
    hypershard_dtensor::bridge::with_bytes(&a, |bytes| -> Result<()> {
        host_bytes_mut(acc, "partial sum")?.copy_from_slice(bytes);
        Ok(())
    })??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_tensors_share_buffers_and_device_tensors_stage_over_host_backends() {
        let world = hypershard_collectives::local::spawn_world(1)
            .expect("invariant: a local world of one rank always spawns")
            .remove(0);
        assert_eq!(
            CommRoute::choose(&Device::Cpu, world.as_ref(), false),
            CommRoute::Host
        );
        assert_eq!(
            CommRoute::choose(&Device::Cpu, world.as_ref(), true),
            CommRoute::Host
        );
        let emulated = Device::Emulated { ordinal: 0 };
        assert_eq!(
            CommRoute::choose(&emulated, world.as_ref(), false),
            CommRoute::Staged
        );
        #[cfg(feature = "cuda")]
        assert_eq!(
            CommRoute::choose(&Device::Cuda { ordinal: 0 }, world.as_ref(), false),
            CommRoute::Staged,
            "the local backend takes host buffers only"
        );
    }
}
