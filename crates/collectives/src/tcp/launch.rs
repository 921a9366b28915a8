//! [`rendezvous_from_env`]: the store and mesh of a job launched by torchrun (or anything that
//! sets the same variables).

use std::sync::Arc;

use super::config::TcpConfig;
use super::mesh::Mesh;
use crate::env::LaunchEnv;
use crate::error::Result;
use crate::store::{Store, TcpStore, TcpStoreServer};

/// What [`rendezvous_from_env`] builds. Rank 0 hosts the store server in `server`; it must
/// keep this value alive for as long as other ranks may use the store (dropping it closes
/// their store connections, not the mesh).
#[non_exhaustive]
pub struct Rendezvous {
    /// The job's store (rank 0: the server's in-process store; others: a TCP client).
    pub store: Arc<dyn Store>,
    /// The store server, on rank 0 only.
    pub server: Option<TcpStoreServer>,
    /// One handshaken connection to every other rank.
    pub mesh: Mesh,
}

// `dyn Store` has no `Debug`, so the store is left out of the printout.
impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("server", &self.server)
            .field("mesh", &self.mesh)
            .finish_non_exhaustive()
    }
}

/// The variable torchrun's agent sets (to `True`) when it hosts the store itself, so that rank 0
/// connects as a client like every other rank. `hypershard launch` sets it too.
pub const AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// Whether [`AGENT_STORE_VAR`] says the launcher hosts the store (`True`, `true` or `1`).
pub fn agent_hosts_store() -> bool {
    std::env::var(AGENT_STORE_VAR)
        .is_ok_and(|value| value.eq_ignore_ascii_case("true") || value == "1")
}

/// Rank 0 hosts a [`TcpStoreServer`] at `MASTER_ADDR:MASTER_PORT` unless the launcher already
/// does ([`agent_hosts_store`]); every other rank connects to it (retrying until
/// `config.rendezvous_timeout`); then all ranks build the [`Mesh`].
pub fn rendezvous_from_env(env: &LaunchEnv, config: &TcpConfig) -> Result<Rendezvous> {
    rendezvous(env, config, agent_hosts_store())
}

/// [`rendezvous_from_env`] with the hosting decision made by the caller.
fn rendezvous(env: &LaunchEnv, config: &TcpConfig, agent_hosts: bool) -> Result<Rendezvous> {
    let master = (env.master_addr.as_str(), env.master_port);
    let (store, server): (Arc<dyn Store>, Option<TcpStoreServer>) = if env.rank == 0 && !agent_hosts
    {
        let server = TcpStoreServer::bind(master)?;
        (server.store(), Some(server))
    } else {
        (
            Arc::new(TcpStore::connect(master, config.rendezvous_timeout)?),
            None,
        )
    };
    let mesh = Mesh::establish(&*store, env.rank, env.world_size, config)?;
    Ok(Rendezvous {
        store,
        server,
        mesh,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::thread;
    use std::time::Duration;

    #[test]
    fn with_an_agent_hosted_store_every_rank_is_a_client() {
        let server = TcpStoreServer::bind(("127.0.0.1", 0)).unwrap();
        let port = server.local_addr().port();
        let world = 2;
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let config = config.clone();
                thread::spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world_size: world,
                        local_rank: rank,
                        local_world_size: world,
                        master_addr: "127.0.0.1".to_string(),
                        master_port: port,
                    };
                    let rdv = rendezvous(&env, &config, true).unwrap();
                    assert!(rdv.server.is_none(), "rank {rank} must not host");
                    rdv.store.add("arrived", 1).unwrap();
                    rdv
                })
            })
            .collect();
        let rdvs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // The agent's own view of the store saw both ranks arrive.
        assert_eq!(server.store().add("arrived", 0).unwrap(), world as i64);
        drop(rdvs);
    }

    #[test]
    fn three_ranks_meet_through_the_master_port() {
        // Ask the OS for a free port, then release it for rank 0's server.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let world = 3;
        let config = TcpConfig::default().with_rendezvous_timeout(Duration::from_secs(10));
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let config = config.clone();
                thread::spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world_size: world,
                        local_rank: rank,
                        local_world_size: world,
                        master_addr: "127.0.0.1".to_string(),
                        master_port: port,
                    };
                    let rdv = rendezvous_from_env(&env, &config).unwrap();
                    // Everyone counts in through the store; the total proves it is shared.
                    rdv.store.add("arrived", 1).unwrap();
                    for p in 0..world {
                        if let Some(mut s) = rdv.mesh.peer(p) {
                            s.write_all(&[rank as u8]).unwrap();
                        }
                    }
                    for p in 0..world {
                        if let Some(mut s) = rdv.mesh.peer(p) {
                            let mut b = [0u8; 1];
                            s.read_exact(&mut b).unwrap();
                            assert_eq!(b[0] as usize, p);
                        }
                    }
                    rdv
                })
            })
            .collect();
        let rdvs: Vec<Rendezvous> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(rdvs[0].server.is_some());
        assert!(rdvs[1].server.is_none() && rdvs[2].server.is_none());
        assert_eq!(rdvs[2].store.add("arrived", 0).unwrap(), 3);
    }
}
