//! [`init_default_from_env`]: the world communicator of the backend `HYPERSHARD_BACKEND`
//! names, built from the launcher's environment ([`LaunchEnv`](crate::LaunchEnv)). It sits above the backends
//! (feature `tcp`).

use std::sync::Arc;

use crate::communicator::Communicator;
use crate::env::{BACKEND_ENV, BackendChoice};
use crate::error::{Error, Result};

/// A world built by [`init_default_from_env`]: the communicator plus whatever must stay alive
/// with it (the TCP store and its server on rank 0). Keep it until every rank is done.
pub struct DefaultWorld {
    /// The world communicator.
    pub comm: Arc<dyn Communicator>,
    /// The backend chosen.
    pub backend: BackendChoice,
    _tcp: Option<crate::backend::tcp::TcpWorld>,
}

impl DefaultWorld {
    /// The TCP world (store, server, communicator) when the backend is `tcp`.
    pub fn tcp(&self) -> Option<&crate::backend::tcp::TcpWorld> {
        self._tcp.as_ref()
    }
}

impl std::fmt::Debug for DefaultWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DefaultWorld")
            .field("backend", &self.backend)
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .finish()
    }
}

/// Builds the world communicator of the backend `HYPERSHARD_BACKEND` names (default `tcp`):
/// `tcp` rendezvouses through [`LaunchEnv`](crate::LaunchEnv) (any launcher above, default [`TcpConfig`](crate::backend::tcp::TcpConfig));
/// `mpi` uses `MPI_COMM_WORLD` (feature `mpi`, else [`Error::BackendNotBuilt`]); `nccl` is
/// [`Error::BackendNotBuilt`] for now. The op deadline comes from `HYPERSHARD_TIMEOUT`.
pub fn init_default_from_env() -> Result<DefaultWorld> {
    let backend = BackendChoice::from_var(std::env::var(BACKEND_ENV).ok().as_deref())?;
    match backend {
        BackendChoice::Tcp => {
            let world =
                crate::backend::tcp::init_from_env(&crate::backend::tcp::TcpConfig::default())?;
            Ok(DefaultWorld {
                comm: world.comm.clone(),
                backend,
                _tcp: Some(world),
            })
        }
        BackendChoice::Mpi => mpi_world(backend),
        BackendChoice::Nccl => Err(Error::BackendNotBuilt {
            backend: "nccl",
            reason: "init_default_from_env does not build NCCL worlds yet (no GPU path here); use collectives::nccl directly",
        }),
    }
}

#[cfg(feature = "mpi")]
fn mpi_world(backend: BackendChoice) -> Result<DefaultWorld> {
    let comm = crate::backend::mpi::MpiCommunicator::world(crate::config::CommConfig::from_env()?)?;
    Ok(DefaultWorld {
        comm: Arc::new(comm),
        backend,
        _tcp: None,
    })
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_backend: BackendChoice) -> Result<DefaultWorld> {
    Err(Error::BackendNotBuilt {
        backend: "mpi",
        reason: "this binary was built without the `mpi` cargo feature",
    })
}
