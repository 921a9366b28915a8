//! Why a device backend cannot run ([`Unavailable`]) and which device library failed
//! ([`DeviceLibrary`]): the device side of [`Error`](super::Error), in a file of its own.

use std::fmt;

/// Why a backend is unavailable ([`Error::BackendUnavailable`](super::Error::BackendUnavailable)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unavailable {
    /// No file of the library could be loaded under any of the names that were tried.
    LibraryNotFound {
        /// The library (`"libcuda"`, `"libnccl"`).
        library: &'static str,
        /// The file names that were tried.
        tried: Vec<String>,
    },
    /// The library exists, but only under a name the loader does not try (pip's NCCL ships
    /// only `libnccl.so.2`).
    LibraryUnderOtherName {
        /// The library.
        library: &'static str,
        /// The file that was found.
        found: std::path::PathBuf,
    },
    /// The driver loaded but there is no device with the requested ordinal.
    NoDevice {
        /// The ordinal asked for.
        requested: usize,
        /// How many devices the driver reported.
        available: usize,
    },
    /// More ranks on this host than GPUs: NCCL refuses two ranks of one communicator on one
    /// device.
    SharedDevice {
        /// The ranks on this host (`LOCAL_WORLD_SIZE`).
        ranks: usize,
        /// The GPUs the driver reports.
        devices: usize,
    },
    /// The driver failed to initialise (`cuInit`), with this `CUresult`.
    DriverInit {
        /// The `CUresult` code.
        code: i32,
    },
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::LibraryNotFound { library, tried } => {
                write!(
                    f,
                    "{library} could not be loaded (tried {})",
                    tried.join(", ")
                )
            }
            Unavailable::LibraryUnderOtherName { library, found } => write!(
                f,
                "{library} exists as {} but is only loaded as {library}.so or {library}.so.<N> (N the CUDA major version); \
                 put a symlink named {library}.so to it in a directory on LD_LIBRARY_PATH before the process starts \
                 (cargo xtask gpu-check does this; see docs/gpu.md)",
                found.display()
            ),
            Unavailable::NoDevice {
                requested,
                available,
            } => write!(
                f,
                "no CUDA device {requested} (the driver reports {available})"
            ),
            Unavailable::SharedDevice { ranks, devices } => write!(
                f,
                "{ranks} ranks on this host but {devices} GPU(s): NCCL needs a GPU per rank; \
                 HYPERSHARD_BACKEND=tcp lets ranks share a GPU (collectives staged through host memory)"
            ),
            Unavailable::DriverInit { code } => write!(f, "cuInit failed with CUresult {code}"),
        }
    }
}

/// The device library of an [`Error::DeviceCall`](super::Error::DeviceCall).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceLibrary {
    /// The CUDA driver API (`libcuda`).
    Cuda,
    /// NCCL (`libnccl`).
    Nccl,
}

impl fmt::Display for DeviceLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceLibrary::Cuda => "CUDA",
            DeviceLibrary::Nccl => "NCCL",
        })
    }
}
