//! [`init_from_env`]: the default TCP world of a launched job, torchrun-style.

use std::sync::Arc;

use super::communicator::TcpCommunicator;
use super::launch::rendezvous_from_env;
use crate::config::CommConfig;
use crate::env::LaunchEnv;
use crate::error::Result;
use crate::rendezvous::{Store, TcpStoreServer};
use crate::transport::tcp::config::TcpConfig;

/// What [`init_from_env`] builds. Rank 0 hosts the store server in `server`; keep this value
/// alive while other ranks may still use the store.
#[non_exhaustive]
pub struct TcpWorld {
    /// The world communicator.
    pub comm: Arc<TcpCommunicator>,
    /// The job's store (rank 0: the server's in-process store; others: a TCP client).
    pub store: Arc<dyn Store>,
    /// The store server, on rank 0 only.
    pub server: Option<TcpStoreServer>,
}

// `dyn Store` has no `Debug`, so the store is left out of the printout.
impl std::fmt::Debug for TcpWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpWorld")
            .field("comm", &self.comm)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

/// Reads the launch variables ([`LaunchEnv::from_env`]: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `MASTER_PORT`, ...) and the op timeout ([`CommConfig::from_env`]), runs
/// `rendezvous_from_env` and builds the world [`TcpCommunicator`]. Collective over the job.
pub fn init_from_env(tcp: &TcpConfig) -> Result<TcpWorld> {
    let env = LaunchEnv::from_env()?;
    let config = CommConfig::from_env()?;
    let rendezvous = rendezvous_from_env(&env, tcp)?;
    let comm = TcpCommunicator::from_mesh_with_store(
        rendezvous.mesh,
        rendezvous.store.as_ref(),
        tcp,
        config,
    )?;
    Ok(TcpWorld {
        comm: Arc::new(comm),
        store: rendezvous.store,
        server: rendezvous.server,
    })
}
