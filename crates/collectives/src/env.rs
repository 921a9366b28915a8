//! torchrun's launch variables, parsed into [`LaunchEnv`].

use crate::error::{EnvExpectation, Error, Result};

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
        let required = |variable: &'static str| -> Result<String> {
            lookup(variable).ok_or(Error::MissingEnv { variable })
        };
        let rank = parse_usize(
            "RANK",
            &required("RANK")?,
            EnvExpectation::NonNegativeInteger,
        )?;
        let world_size = parse_usize(
            "WORLD_SIZE",
            &required("WORLD_SIZE")?,
            EnvExpectation::PositiveInteger,
        )?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(text) => parse_usize("LOCAL_RANK", &text, EnvExpectation::NonNegativeInteger)?,
            None => rank,
        };
        let local_world_size = match lookup("LOCAL_WORLD_SIZE") {
            Some(text) => parse_usize("LOCAL_WORLD_SIZE", &text, EnvExpectation::PositiveInteger)?,
            None => world_size,
        };
        let master_addr = required("MASTER_ADDR")?.trim().to_string();
        if master_addr.is_empty() {
            return Err(Error::InvalidEnv {
                variable: "MASTER_ADDR",
                value: master_addr,
                expected: EnvExpectation::NonEmpty,
            });
        }
        let port_text = required("MASTER_PORT")?;
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
        check_below("RANK", rank, "WORLD_SIZE", world_size)?;
        check_below(
            "LOCAL_RANK",
            local_rank,
            "LOCAL_WORLD_SIZE",
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
}
