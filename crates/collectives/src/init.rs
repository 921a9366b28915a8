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
    /// The job's store (and its server, on rank 0) for a backend without a TCP world.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    _store: Option<crate::backend::tcp::JobStore>,
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
/// `mpi` uses `MPI_COMM_WORLD` (feature `mpi`, else [`Error::BackendNotBuilt`]); `nccl`
/// (feature `nccl`) joins the job's store for its ids and puts local rank `r` on GPU `r`
/// ([`Error::BackendUnavailable`] when the GPUs are fewer than the host's ranks). The op
/// deadline comes from `HYPERSHARD_TIMEOUT`.
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
                _store: None,
            })
        }
        BackendChoice::Mpi => mpi_world(backend),
        BackendChoice::Nccl => nccl_world(backend),
    }
}

/// The NCCL world: the job's store (for the NCCL ids) without a TCP mesh, and one GPU per rank
/// ([`device_for_local_rank`](crate::backend::nccl::device_for_local_rank)).
#[cfg(feature = "nccl")]
fn nccl_world(backend: BackendChoice) -> Result<DefaultWorld> {
    use crate::backend::nccl::{NcclCommunicator, NcclInit, device_count, device_for_local_rank};
    let env = crate::env::LaunchEnv::from_env()?;
    let config = crate::config::CommConfig::from_env()?;
    let device = device_for_local_rank(env.local_rank, env.local_world_size, device_count()?)?;
    let job =
        crate::backend::tcp::store_from_env(&env, &crate::backend::tcp::TcpConfig::default())?;
    let comm = NcclCommunicator::new(NcclInit {
        rank: env.rank,
        size: env.world_size,
        device,
        store: Arc::clone(&job.store),
        config,
    })?;
    Ok(DefaultWorld {
        comm: Arc::new(comm),
        backend,
        _tcp: None,
        _store: Some(job),
    })
}

#[cfg(not(feature = "nccl"))]
fn nccl_world(_backend: BackendChoice) -> Result<DefaultWorld> {
    Err(Error::BackendNotBuilt {
        backend: "nccl",
        reason: "this binary was built without the `nccl` cargo feature",
    })
}

#[cfg(feature = "mpi")]
fn mpi_world(backend: BackendChoice) -> Result<DefaultWorld> {
    let comm = crate::backend::mpi::MpiCommunicator::world(crate::config::CommConfig::from_env()?)?;
    Ok(DefaultWorld {
        comm: Arc::new(comm),
        backend,
        _tcp: None,
        _store: None,
    })
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(_backend: BackendChoice) -> Result<DefaultWorld> {
    Err(Error::BackendNotBuilt {
        backend: "mpi",
        reason: "this binary was built without the `mpi` cargo feature",
    })
}
