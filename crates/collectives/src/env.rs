//! Where this process sits in a launched job ([`LaunchEnv`]), read from the variables of the
//! launcher that started it, and the backend choice (`init_default_from_env`).
//!
//! # Launchers and precedence
//! The first launcher whose rank *and* size variables are both set wins:
//!
//! 1. **torchrun / `hypershard launch`**: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!    `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (the address and port are required).
//! 2. **Open MPI** (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`.
//! 3. **PMIx** (`PMIX_RANK` with `PMI_SIZE` or `OMPI_COMM_WORLD_SIZE`) and **PMI**
//!    (`PMI_RANK`, `PMI_SIZE`; MPICH's Hydra, Intel MPI).
//! 4. **Slurm** (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, and the tasks on
//!    this node from `SLURM_NTASKS_PER_NODE` or the first count of `SLURM_TASKS_PER_NODE`
//!    (`"4(x2),3"` → 4).
//!
//! For launchers 2–4 the rendezvous host is `MASTER_ADDR` when set (Slurm: else
//! `SLURM_LAUNCH_NODE_IPADDR`; others: else `127.0.0.1`, right for one host only), and the
//! port is `MASTER_PORT` when set, else [`DEFAULT_MASTER_PORT`] (29500, torchrun's default).
//! Local rank and size default to the global ones (one host).

use crate::error::{EnvExpectation, Error, Result};

/// The rendezvous port used when a cluster launcher sets no `MASTER_PORT` (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The variable that chooses the backend of `init_default_from_env`.
pub const BACKEND_ENV: &str = "HYPERSHARD_BACKEND";

/// Which launcher's variables [`LaunchEnv::from_lookup`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// torchrun or `hypershard launch` (`RANK`, `WORLD_SIZE`, ...).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// A PMIx launcher (`PMIX_RANK`).
    Pmix,
    /// A PMI launcher (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
    Slurm,
}

/// The variable names one launcher uses.
struct Names {
    rank: &'static str,
    size: &'static str,
    local_rank: Option<&'static str>,
    local_size: Option<&'static str>,
}

impl Launcher {
    /// The launcher whose rank and size variables are set, in the documented precedence.
    pub fn detect(lookup: &impl Fn(&str) -> Option<String>) -> Option<Launcher> {
        [
            Launcher::Torchrun,
            Launcher::OpenMpi,
            Launcher::Pmix,
            Launcher::Pmi,
            Launcher::Slurm,
        ]
        .into_iter()
        .find(|launcher| {
            let names = launcher.names(lookup);
            lookup(names.rank).is_some() && lookup(names.size).is_some()
        })
    }

    fn names(self, lookup: &impl Fn(&str) -> Option<String>) -> Names {
        match self {
            Launcher::Torchrun => Names {
                rank: "RANK",
                size: "WORLD_SIZE",
                local_rank: Some("LOCAL_RANK"),
                local_size: Some("LOCAL_WORLD_SIZE"),
            },
            Launcher::OpenMpi => Names {
                rank: "OMPI_COMM_WORLD_RANK",
                size: "OMPI_COMM_WORLD_SIZE",
                local_rank: Some("OMPI_COMM_WORLD_LOCAL_RANK"),
                local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
            },
            Launcher::Pmix => Names {
                rank: "PMIX_RANK",
                size: if lookup("PMI_SIZE").is_some() {
                    "PMI_SIZE"
                } else {
                    "OMPI_COMM_WORLD_SIZE"
                },
                local_rank: Some("PMIX_LOCAL_RANK"),
                local_size: Some("PMIX_LOCAL_SIZE"),
            },
            Launcher::Pmi => Names {
                rank: "PMI_RANK",
                size: "PMI_SIZE",
                local_rank: Some("MPI_LOCALRANKID"),
                local_size: Some("MPI_LOCALNRANKS"),
            },
            Launcher::Slurm => Names {
                rank: "SLURM_PROCID",
                size: "SLURM_NTASKS",
                local_rank: Some("SLURM_LOCALID"),
                local_size: None,
            },
        }
    }
}

/// The first task count of Slurm's `SLURM_TASKS_PER_NODE` (`"4(x2),3"` → `"4"`).
fn first_task_count(text: &str) -> &str {
    text.split([',', '(']).next().unwrap_or(text).trim()
}

/// Where this process sits in a launched job, read from the variables torchrun sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`: this process's global rank.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes in the job.
    pub world_size: usize,
    /// `LOCAL_RANK`: the rank on this host (defaults to `rank` when unset: one host).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: processes on this host (defaults to `world_size` when unset).
    pub local_world_size: usize,
    /// `MASTER_ADDR`: the host of the rendezvous store.
    pub master_addr: String,
    /// `MASTER_PORT`: the port of the rendezvous store.
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<Self> {
        LaunchEnv::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup` (`None`: unset), the pure half of
    /// [`LaunchEnv::from_env`], which tests use instead of mutating the environment.
    ///
    /// `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are required; `LOCAL_RANK` and
    /// `LOCAL_WORLD_SIZE` default to the global values (a single-host job). Ranks must be below
    /// their sizes.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let launcher = Launcher::detect(&lookup).unwrap_or(Launcher::Torchrun);
        let names = launcher.names(&lookup);
        let required = |variable: &'static str| -> Result<String> {
            lookup(variable).ok_or(Error::MissingEnv { variable })
        };
        let rank = parse_usize(
            names.rank,
            &required(names.rank)?,
            EnvExpectation::NonNegativeInteger,
        )?;
        let world_size = parse_usize(
            names.size,
            &required(names.size)?,
            EnvExpectation::PositiveInteger,
        )?;
        let local_rank_name = names.local_rank.filter(|name| lookup(name).is_some());
        let local_rank = match local_rank_name {
            Some(name) => parse_usize(name, &required(name)?, EnvExpectation::NonNegativeInteger)?,
            None => rank,
        };
        let local_size = match launcher {
            Launcher::Slurm => ["SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
                .into_iter()
                .find_map(|name| lookup(name).map(|text| (name, text))),
            _ => names
                .local_size
                .and_then(|name| lookup(name).map(|text| (name, text))),
        };
        let local_size_name = local_size.as_ref().map_or("LOCAL_WORLD_SIZE", |(n, _)| n);
        let local_world_size = match &local_size {
            Some((name, text)) => parse_usize(
                name,
                first_task_count(text),
                EnvExpectation::PositiveInteger,
            )?,
            None => world_size,
        };
        let (master_addr_name, master_addr) = match (launcher, lookup("MASTER_ADDR")) {
            (_, Some(addr)) => ("MASTER_ADDR", addr),
            (Launcher::Torchrun, None) => {
                return Err(Error::MissingEnv {
                    variable: "MASTER_ADDR",
                });
            }
            (Launcher::Slurm, None) => (
                "SLURM_LAUNCH_NODE_IPADDR",
                required("SLURM_LAUNCH_NODE_IPADDR")?,
            ),
            (_, None) => ("MASTER_ADDR", "127.0.0.1".to_string()),
        };
        let master_addr = master_addr.trim().to_string();
        if master_addr.is_empty() {
            return Err(Error::InvalidEnv {
                variable: master_addr_name,
                value: master_addr,
                expected: EnvExpectation::NonEmpty,
            });
        }
        let port_text = match (launcher, lookup("MASTER_PORT")) {
            (_, Some(text)) => text,
            (Launcher::Torchrun, None) => {
                return Err(Error::MissingEnv {
                    variable: "MASTER_PORT",
                });
            }
            (_, None) => DEFAULT_MASTER_PORT.to_string(),
        };
        let master_port = match port_text.trim().parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => {
                return Err(Error::InvalidEnv {
                    variable: "MASTER_PORT",
                    value: port_text,
                    expected: EnvExpectation::Port,
                });
            }
        };
        check_below(names.rank, rank, names.size, world_size)?;
        check_below(
            local_rank_name.unwrap_or(names.rank),
            local_rank,
            local_size_name,
            local_world_size,
        )?;
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }
}

/// Which backend `init_default_from_env` builds (`HYPERSHARD_BACKEND`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendChoice {
    /// The TCP backend (default on CPU).
    Tcp,
    /// The MPI backend (needs the `mpi` cargo feature and an MPI launcher).
    Mpi,
    /// NCCL (needs the `nccl` feature and a GPU per rank on each host).
    Nccl,
}

impl BackendChoice {
    /// Parses `HYPERSHARD_BACKEND`'s value (`None`: unset → [`BackendChoice::Tcp`]).
    pub fn from_var(value: Option<&str>) -> Result<BackendChoice> {
        match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            None | Some("") | Some("tcp") => Ok(BackendChoice::Tcp),
            Some("mpi") => Ok(BackendChoice::Mpi),
            Some("nccl") => Ok(BackendChoice::Nccl),
            Some(_) => Err(Error::InvalidEnv {
                variable: BACKEND_ENV,
                value: value.unwrap_or_default().to_string(),
                expected: EnvExpectation::BackendName,
            }),
        }
    }
}

fn parse_usize(variable: &'static str, text: &str, expected: EnvExpectation) -> Result<usize> {
    let invalid = || Error::InvalidEnv {
        variable,
        value: text.to_string(),
        expected,
    };
    let value: usize = text.trim().parse().map_err(|_| invalid())?;
    if expected == EnvExpectation::PositiveInteger && value == 0 {
        return Err(invalid());
    }
    Ok(value)
}

fn check_below(
    rank_variable: &'static str,
    rank: usize,
    size_variable: &'static str,
    size: usize,
) -> Result<()> {
    if rank < size {
        Ok(())
    } else {
        Err(Error::InconsistentEnv {
            rank_variable,
            rank,
            size_variable,
            size,
        })
    }
}

/// Parses an on/off switch: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no` (any case,
/// surrounding blanks ignored).
pub(crate) fn parse_switch(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    const FULL: [(&str, &str); 6] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn parses_torchrun_variables() {
        let parsed = LaunchEnv::from_lookup(env(&FULL)).unwrap();
        assert_eq!(
            parsed,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                local_world_size: 2,
                master_addr: "10.0.0.1".to_string(),
                master_port: 29500,
            }
        );
    }

    #[test]
    fn local_variables_default_to_one_host() {
        let parsed = LaunchEnv::from_lookup(env(&FULL[..2]
            .iter()
            .chain(&FULL[4..])
            .copied()
            .collect::<Vec<_>>()))
        .unwrap();
        assert_eq!((parsed.local_rank, parsed.local_world_size), (3, 8));
    }

    #[test]
    fn missing_and_garbled_variables_are_named() {
        let without_rank: Vec<_> = FULL.iter().copied().filter(|(k, _)| *k != "RANK").collect();
        assert!(matches!(
            LaunchEnv::from_lookup(env(&without_rank)),
            Err(Error::MissingEnv { variable: "RANK" })
        ));
        for (variable, bad) in [
            ("RANK", "-1"),
            ("WORLD_SIZE", "0"),
            ("LOCAL_RANK", "one"),
            ("MASTER_PORT", "70000"),
            ("MASTER_PORT", "0"),
            ("MASTER_ADDR", " "),
        ] {
            let pairs: Vec<_> = FULL
                .iter()
                .map(|&(k, v)| if k == variable { (k, bad) } else { (k, v) })
                .collect();
            match LaunchEnv::from_lookup(env(&pairs)) {
                Err(Error::InvalidEnv { variable: v, .. }) => assert_eq!(v, variable),
                other => panic!("{variable}={bad:?} gave {other:?}"),
            }
        }
        let pairs: Vec<_> = FULL
            .iter()
            .map(|&(k, v)| if k == "RANK" { (k, "8") } else { (k, v) })
            .collect();
        assert!(matches!(
            LaunchEnv::from_lookup(env(&pairs)),
            Err(Error::InconsistentEnv {
                rank_variable: "RANK",
                rank: 8,
                size: 8,
                ..
            })
        ));
    }

    fn parsed(pairs: &[(&str, &str)]) -> LaunchEnv {
        LaunchEnv::from_lookup(env(pairs)).unwrap()
    }

    #[test]
    fn parses_open_mpi_variables_with_defaults_for_the_master() {
        let pairs = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        assert_eq!(Launcher::detect(&env(&pairs)), Some(Launcher::OpenMpi));
        assert_eq!(
            parsed(&pairs),
            LaunchEnv {
                rank: 2,
                world_size: 4,
                local_rank: 0,
                local_world_size: 2,
                master_addr: "127.0.0.1".to_string(),
                master_port: DEFAULT_MASTER_PORT,
            }
        );
        let with_master: Vec<_> = pairs
            .iter()
            .copied()
            .chain([("MASTER_ADDR", "node7"), ("MASTER_PORT", "4000")])
            .collect();
        let got = parsed(&with_master);
        assert_eq!((got.master_addr.as_str(), got.master_port), ("node7", 4000));
    }

    #[test]
    fn parses_pmix_and_pmi_variables() {
        let pmix = parsed(&[("PMIX_RANK", "1"), ("PMI_SIZE", "3")]);
        assert_eq!((pmix.rank, pmix.world_size, pmix.local_rank), (1, 3, 1));
        assert_eq!(
            Launcher::detect(&env(&[("PMIX_RANK", "1"), ("PMI_SIZE", "3")])),
            Some(Launcher::Pmix)
        );
        let pmi_pairs = [
            ("PMI_RANK", "5"),
            ("PMI_SIZE", "6"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "10.1.1.1"),
        ];
        assert_eq!(Launcher::detect(&env(&pmi_pairs)), Some(Launcher::Pmi));
        let pmi = parsed(&pmi_pairs);
        assert_eq!(
            (
                pmi.rank,
                pmi.world_size,
                pmi.local_rank,
                pmi.local_world_size
            ),
            (5, 6, 1, 2)
        );
        assert_eq!(pmi.master_addr, "10.1.1.1");
    }

    #[test]
    fn parses_slurm_variables() {
        let pairs = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.9"),
        ];
        assert_eq!(Launcher::detect(&env(&pairs)), Some(Launcher::Slurm));
        assert_eq!(
            parsed(&pairs),
            LaunchEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                master_addr: "10.0.0.9".to_string(),
                master_port: DEFAULT_MASTER_PORT,
            }
        );
        // SLURM_NTASKS_PER_NODE and MASTER_ADDR take precedence over their fallbacks.
        let preferred: Vec<_> = pairs
            .iter()
            .copied()
            .chain([("SLURM_NTASKS_PER_NODE", "2"), ("MASTER_ADDR", "head")])
            .collect();
        let got = parsed(&preferred);
        assert_eq!(
            (got.local_world_size, got.master_addr.as_str()),
            (2, "head")
        );
        // Without any master variable Slurm's is required.
        assert!(matches!(
            LaunchEnv::from_lookup(env(&pairs[..4])),
            Err(Error::MissingEnv {
                variable: "SLURM_LAUNCH_NODE_IPADDR"
            })
        ));
        assert!(matches!(
            LaunchEnv::from_lookup(env(&[
                ("SLURM_PROCID", "8"),
                ("SLURM_NTASKS", "8"),
                ("MASTER_ADDR", "h")
            ])),
            Err(Error::InconsistentEnv {
                rank_variable: "SLURM_PROCID",
                ..
            })
        ));
        assert_eq!(first_task_count("4(x2),3"), "4");
        assert_eq!(first_task_count("3"), "3");
    }

    #[test]
    fn torchrun_takes_precedence_over_cluster_variables() {
        let pairs: Vec<_> = FULL
            .iter()
            .copied()
            .chain([
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2"),
            ])
            .collect();
        assert_eq!(Launcher::detect(&env(&pairs)), Some(Launcher::Torchrun));
        assert_eq!(parsed(&pairs).rank, 3);
        let mpi_and_slurm = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
        ];
        assert_eq!(
            Launcher::detect(&env(&mpi_and_slurm)),
            Some(Launcher::OpenMpi)
        );
        assert_eq!(Launcher::detect(&env(&[])), None);
    }

    #[test]
    fn backend_choice_parses_and_rejects_garbage() {
        assert_eq!(BackendChoice::from_var(None).unwrap(), BackendChoice::Tcp);
        assert_eq!(
            BackendChoice::from_var(Some("MPI")).unwrap(),
            BackendChoice::Mpi
        );
        assert_eq!(
            BackendChoice::from_var(Some("nccl")).unwrap(),
            BackendChoice::Nccl
        );
        assert!(matches!(
            BackendChoice::from_var(Some("gloo")),
            Err(Error::InvalidEnv {
                variable: BACKEND_ENV,
                expected: EnvExpectation::BackendName,
                ..
            })
        ));
    }
}
