//! [`BufferLocation`]: where a buffer's memory lives. Its own module so that errors can name
//! it without importing the buffers.

use std::fmt;

/// Where a buffer's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BufferLocation {
    /// Ordinary host memory.
    Host,
    /// Memory of CUDA device `device` (the NCCL backend's [`Buffer::Cuda`](crate::Buffer::Cuda)).
    #[cfg(feature = "nccl")]
    Cuda {
        /// The device ordinal.
        device: usize,
    },
}

impl fmt::Display for BufferLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferLocation::Host => f.write_str("host"),
            #[cfg(feature = "nccl")]
            BufferLocation::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}
