//! Worlds of ranks for the suites. Rank threads, for the suites that run every rank inside one
//! process: each thread gets its own `TcpCommunicator` over 127.0.0.1 (the same sockets,
//! framing and, with `--transport shm`, shared-memory rings as separate processes would use)
//! and a one-thread compute pool, as PyTorch runs one intra-op thread per rank. Rank
//! processes ([`run_rank_processes`]): the suite's binary re-executed once per rank.

use std::sync::Arc;
use std::time::Duration;

use hypershard_collectives::tcp::{TcpCommunicator, TcpConfig};
use hypershard_collectives::{CommConfig, Communicator, MemoryStore, Store};

/// The error type of the bench helpers: any error, with its message.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Connects `world` tcp communicators through an in-memory store, one per thread.
pub fn tcp_thread_world(
    world: usize,
    tcp: &TcpConfig,
) -> Result<Vec<Arc<dyn Communicator>>, BoxError> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tcp = tcp.clone().with_rendezvous_timeout(Duration::from_secs(30));
    let config = CommConfig::default().with_timeout(Duration::from_secs(120));
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, tcp, config) = (store.clone(), tcp.clone(), config.clone());
            std::thread::spawn(move || {
                TcpCommunicator::connect(store.as_ref(), rank, world, &tcp, config)
                    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            })
        })
        .collect();
    let mut comms = Vec::with_capacity(world);
    for handle in handles {
        comms.push(handle.join().map_err(|_| "rendezvous thread panicked")??);
    }
    Ok(comms)
}

/// Runs `f(rank, comm)` on one thread per rank, each with a one-thread compute pool, and
/// returns the results in rank order.
pub fn on_rank_threads<T: Send + 'static>(
    comms: Vec<Arc<dyn Communicator>>,
    f: impl Fn(usize, Arc<dyn Communicator>) -> Result<T, BoxError> + Send + Sync + 'static,
) -> Result<Vec<T>, BoxError> {
    let f = Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let f = f.clone();
            std::thread::spawn(move || -> Result<T, BoxError> {
                hypershard_nn::with_num_threads(1, || f(rank, comm))?
            })
        })
        .collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.join().map_err(|_| "rank thread panicked")??);
    }
    Ok(out)
}

/// The per-repetition maximum over ranks of `per_rank[rank][rep]`, skipping `warmup` reps:
/// a collective is as slow as its slowest rank.
pub fn max_over_ranks(per_rank: &[Vec<Duration>], warmup: usize) -> Vec<Duration> {
    let reps = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (warmup.min(reps)..reps)
        .map(|rep| {
            per_rank
                .iter()
                .map(|times| times[rep])
                .max()
                .unwrap_or_default()
        })
        .collect()
}

/// Runs a world of rank processes: this binary re-executed `world` times with `args`, `rank_var`
/// set to the rank (so the child knows it is a rank), torchrun's variables pointing at a free
/// 127.0.0.1 port for rank 0's store, and `env` on top. Returns the lines rank 0 printed that
/// start with `prefix` (prefix removed), once every rank has exited successfully; otherwise an
/// error naming each failed rank. If a rank cannot be started, the ones already started are
/// killed, since they could never complete the rendezvous without it.
pub fn run_rank_processes(
    world: usize,
    args: &[String],
    rank_var: &str,
    env: &[(&str, &str)],
    prefix: &str,
) -> Result<Vec<String>, String> {
    use std::io::{BufRead, BufReader};

    let mut children = spawn_ranks(world, args, rank_var, env)?;
    let mut lines = Vec::new();
    let mut read_error = None;
    if let Some(stdout) = children[0].stdout.take() {
        for line in BufReader::new(stdout).lines() {
            match line {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        lines.push(rest.to_string());
                    }
                }
                Err(e) => read_error = Some(format!("rank 0 output: {e}")),
            }
        }
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        match child.wait() {
            Ok(status) if status.success() => {}
            Ok(status) => failed.push(format!("rank {rank}: {status}")),
            Err(e) => failed.push(format!("rank {rank}: {e}")),
        }
    }
    if !failed.is_empty() {
        return Err(failed.join(", "));
    }
    read_error.map_or(Ok(lines), Err)
}

/// [`run_rank_processes`] under a deadline, for suites that must end in a fixed time (the GPU
/// check): every rank still running at `deadline` after the start is killed, and so are the
/// others as soon as one rank fails (they would wait for it until their own timeouts). The
/// error names the failed or killed ranks.
pub fn run_rank_processes_until(
    world: usize,
    args: &[String],
    rank_var: &str,
    env: &[(&str, &str)],
    prefix: &str,
    deadline: Duration,
) -> Result<Vec<String>, String> {
    use std::io::{BufRead, BufReader};

    let started = std::time::Instant::now();
    let mut children = spawn_ranks(world, args, rank_var, env)?;
    // Rank 0's output is read on a thread, so a full pipe never blocks it and the loop below
    // can watch the clock.
    let reader = children[0].stdout.take().map(|stdout| {
        let prefix = prefix.to_string();
        std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(line) => {
                        if let Some(rest) = line.strip_prefix(&prefix) {
                            lines.push(rest.to_string());
                        }
                    }
                    Err(e) => return Err(format!("rank 0 output: {e}")),
                }
            }
            Ok(lines)
        })
    });
    let mut status: Vec<Option<String>> = vec![None; world];
    let mut failed = Vec::new();
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if status[rank].is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(exit)) if exit.success() => status[rank] = Some(String::new()),
                Ok(Some(exit)) => {
                    failed.push(format!("rank {rank}: {exit}"));
                    status[rank] = Some(exit.to_string());
                }
                Ok(None) => {}
                Err(e) => {
                    failed.push(format!("rank {rank}: {e}"));
                    status[rank] = Some(e.to_string());
                }
            }
        }
        let running: Vec<usize> = (0..world).filter(|&r| status[r].is_none()).collect();
        if running.is_empty() {
            break;
        }
        let late = started.elapsed() > deadline;
        if late || !failed.is_empty() {
            for &rank in &running {
                let _ = children[rank].kill();
                let _ = children[rank].wait();
                failed.push(if late {
                    format!("rank {rank}: killed after {deadline:?}")
                } else {
                    format!("rank {rank}: killed because another rank failed")
                });
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let lines = match reader.map(|r| r.join()) {
        Some(Ok(lines)) => lines,
        Some(Err(_)) => Err("the reader of rank 0's output panicked".to_string()),
        None => Ok(Vec::new()),
    };
    if !failed.is_empty() {
        return Err(failed.join(", "));
    }
    lines
}

/// Starts the rank processes of [`run_rank_processes`] (rank 0's standard output piped, the
/// others' discarded); if one cannot be started, kills the ones already started.
fn spawn_ranks(
    world: usize,
    args: &[String],
    rank_var: &str,
    env: &[(&str, &str)],
) -> Result<Vec<std::process::Child>, String> {
    use std::process::{Command, Stdio};

    // A free port for the store: bind port 0, read it, release it for rank 0 to take.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        let child = Command::new(&exe)
            .args(args)
            .env(rank_var, rank.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .envs(env.iter().copied())
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn();
        match child {
            Ok(child) => children.push(child),
            Err(e) => {
                for mut started in children {
                    let _ = started.kill();
                    let _ = started.wait();
                }
                return Err(format!("spawn rank {rank}: {e}"));
            }
        }
    }
    if children.is_empty() {
        return Err("a world of 0 ranks".to_string());
    }
    Ok(children)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_rank_counts_and_warmup_is_dropped() {
        let ms = Duration::from_millis;
        let per_rank = vec![vec![ms(9), ms(1), ms(5)], vec![ms(2), ms(3), ms(4), ms(7)]];
        assert_eq!(max_over_ranks(&per_rank, 1), vec![ms(3), ms(5)]);
        assert_eq!(max_over_ranks(&per_rank, 5), Vec::<Duration>::new());
        assert!(max_over_ranks(&[], 0).is_empty());
    }

    /// Both sides of [`run_rank_processes_until`]'s test: with `RANK_MODE` set this process is
    /// a rank (this test binary re-executed with a filter that selects only this test) and
    /// behaves as the mode says; without it, it is the parent and checks the three outcomes.
    #[test]
    fn ranks_under_a_deadline() {
        const MODE: &str = "HYPERSHARD_WORLD_TEST_MODE";
        if let Ok(mode) = std::env::var(MODE) {
            let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
            match (mode.as_str(), rank) {
                ("sleep", _) => std::thread::sleep(Duration::from_secs(30)),
                ("fail1", 1) => std::process::exit(3),
                ("fail1", _) => std::thread::sleep(Duration::from_secs(30)),
                // libtest has printed `test NAME ... ` without a newline.
                _ => println!(
                    "\nROW rank {rank} of {}",
                    std::env::var("WORLD_SIZE").unwrap()
                ),
            }
            return;
        }
        let args: Vec<String> = [
            "--exact",
            "world::tests::ranks_under_a_deadline",
            "--nocapture",
            "--test-threads",
            "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let run = |mode: &str, deadline: Duration| {
            let started = std::time::Instant::now();
            let out = run_rank_processes_until(
                3,
                &args,
                "HYPERSHARD_WORLD_TEST_RANK",
                &[(MODE, mode)],
                "ROW ",
                deadline,
            );
            (out, started.elapsed())
        };
        let (out, _) = run("ok", Duration::from_secs(60));
        assert_eq!(out, Ok(vec!["rank 0 of 3".to_string()]));
        let (out, took) = run("sleep", Duration::from_millis(300));
        let err = out.unwrap_err();
        assert!(err.contains("rank 2: killed after"), "{err}");
        assert!(took < Duration::from_secs(20), "{took:?}");
        let (out, took) = run("fail1", Duration::from_secs(60));
        let err = out.unwrap_err();
        assert!(err.contains("rank 1: exit status: 3"), "{err}");
        assert!(
            err.contains("rank 0: killed because another rank failed"),
            "{err}"
        );
        assert!(took < Duration::from_secs(20), "{took:?}");
    }

    #[test]
    fn rank_threads_see_their_rank_and_a_working_communicator() {
        let comms = tcp_thread_world(2, &TcpConfig::default()).expect("world");
        let sums = on_rank_threads(comms, |rank, comm| {
            let mine = hypershard_collectives::Buffer::from_vec(vec![rank as f32 + 1.0; 4]);
            let sum = comm.all_reduce(mine, hypershard_collectives::ReduceOp::Sum)?;
            Ok((rank, sum.into_vec::<f32>()?))
        })
        .expect("ranks");
        assert_eq!(sums, vec![(0, vec![3.0; 4]), (1, vec![3.0; 4])]);
    }
}
