//! [`rendezvous_from_env`]: the store and mesh of a job launched by torchrun (or anything that
//! sets the same variables).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;

use crate::env::LaunchEnv;
use crate::error::Result;
use crate::rendezvous::{Store, TcpStore, TcpStoreServer};
use crate::transport::tcp::config::TcpConfig;
use crate::transport::tcp::mesh::Mesh;

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
/// `config.rendezvous_timeout`); then all ranks build the [`Mesh`]. Each rank's mesh listener
/// binds `config.bind_ip`, except that when the rendezvous host is not loopback (the job spans
/// hosts) and `config.bind_ip` is the loopback default, it binds the local address that routes
/// to the rendezvous host, so peers on other hosts can reach it.
pub fn rendezvous_from_env(env: &LaunchEnv, config: &TcpConfig) -> Result<Rendezvous> {
    rendezvous(env, config, agent_hosts_store())
}

/// [`rendezvous_from_env`] with the hosting decision made by the caller.
fn rendezvous(env: &LaunchEnv, config: &TcpConfig, agent_hosts: bool) -> Result<Rendezvous> {
    let master = (env.master_addr.as_str(), env.master_port);
    let JobStore { store, server } = job_store(env, config, agent_hosts)?;
    let mut mesh_config = config.clone();
    mesh_config.bind_ip = mesh_bind_ip(master, config);
    let mesh = Mesh::establish(&*store, env.rank, env.world_size, &mesh_config)?;
    Ok(Rendezvous {
        store,
        server,
        mesh,
    })
}

/// The job's store without a mesh: what a backend with its own transport (NCCL) needs to
/// exchange its ids. Rank 0 hosts the server unless the launcher does ([`AGENT_STORE_VAR`]).
#[non_exhaustive]
pub struct JobStore {
    /// The job's store (rank 0: the server's in-process store; others: a TCP client).
    pub store: Arc<dyn Store>,
    /// The store server, on rank 0 only; keep it while other ranks may use the store.
    pub server: Option<TcpStoreServer>,
}

/// [`JobStore`] of a launched job: the store at `MASTER_ADDR:MASTER_PORT`, hosted or joined
/// as for `rendezvous_from_env`.
pub fn store_from_env(env: &LaunchEnv, config: &TcpConfig) -> Result<JobStore> {
    job_store(env, config, agent_hosts_store())
}

fn job_store(env: &LaunchEnv, config: &TcpConfig, agent_hosts: bool) -> Result<JobStore> {
    let master = (env.master_addr.as_str(), env.master_port);
    if env.rank == 0 && !agent_hosts {
        let server = TcpStoreServer::bind(master)?;
        return Ok(JobStore {
            store: server.store(),
            server: Some(server),
        });
    }
    Ok(JobStore {
        store: Arc::new(TcpStore::connect(master, config.rendezvous_timeout)?),
        server: None,
    })
}

/// The address a rank's mesh listener binds. `config.bind_ip` wins when it is not loopback
/// (the caller chose it). Otherwise, when the rendezvous host is not a loopback address the
/// job spans hosts, and peers on other hosts must reach this rank: the listener binds the
/// local address the kernel would send from to reach the rendezvous host (the interface on
/// the job's network, found by connecting a UDP socket, which sends nothing), never the
/// wildcard. A rendezvous host that is loopback, does not resolve or has no route keeps
/// `config.bind_ip` (then the Store connection is what fails, with its own error).
fn mesh_bind_ip(master: (&str, u16), config: &TcpConfig) -> IpAddr {
    if !config.bind_ip.is_loopback() {
        return config.bind_ip;
    }
    let Some(target) = master.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return config.bind_ip;
    };
    if target.ip().is_loopback() {
        return config.bind_ip;
    }
    let any = if target.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    UdpSocket::bind((any, 0))
        .and_then(|socket| {
            socket.connect(target)?;
            socket.local_addr()
        })
        .map(|local| local.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(config.bind_ip)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
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
        // A port for rank 0's server; see `unused_port` for why not port 0's.
        let port = hypershard_testkit::unused_port();
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

    #[test]
    fn the_mesh_binds_loopback_for_a_loopback_master_and_keeps_a_chosen_address() {
        let config = TcpConfig::default();
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(mesh_bind_ip(("127.0.0.1", 29500), &config), loopback);
        assert_eq!(mesh_bind_ip(("127.0.0.2", 29500), &config), loopback);
        assert_eq!(mesh_bind_ip(("localhost", 29500), &config), loopback);
        // A name that cannot resolve keeps the default instead of failing here.
        assert_eq!(
            mesh_bind_ip(("no-such-host.invalid", 29500), &config),
            loopback
        );
        let mut chosen = config.clone();
        chosen.bind_ip = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(mesh_bind_ip(("127.0.0.1", 29500), &chosen), chosen.bind_ip);
    }

    #[test]
    fn for_a_remote_master_the_mesh_binds_the_address_that_reaches_it() {
        // The address the kernel would send from towards 192.0.2.1 (TEST-NET-1; connecting a
        // UDP socket sends nothing): where there is a route that is one of this host's own
        // addresses, so a listener can bind it, and it is not 127.0.0.1.
        let config = TcpConfig::default();
        let ip = mesh_bind_ip(("192.0.2.1", 29500), &config);
        if ip.is_loopback() {
            // No route off this host (a sandbox without networking): nothing to reach.
            assert!(
                UdpSocket::bind("0.0.0.0:0")
                    .unwrap()
                    .connect("192.0.2.1:9")
                    .is_err()
            );
        } else {
            assert!(!ip.is_unspecified());
            std::net::TcpListener::bind((ip, 0)).unwrap();
        }
    }
}
