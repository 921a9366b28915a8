//! A rank program for `hypershard launch`: joins the job through `init_from_env`, all-reduces
//! `rank + 1` and checks the sum against the closed form `n(n+1)/2`.
//!
//! `HYPERSHARD_EXAMPLE_FAIL_RANK=k` makes rank `k` exit with code 7 before joining (the others
//! then wait in the rendezvous until the launcher stops them), and `HYPERSHARD_EXAMPLE_HANG=1`
//! makes every other rank sleep instead of joining, so a test can see the launcher stop them.
//! `HYPERSHARD_EXAMPLE_READY_DIR=d` makes every rank, after the first all-reduce, create
//! `d/ready-<rank>` and wait (up to 60 s) for `d/go`, then all-reduce once more: a test can
//! poke at the running job in between and check that it carries on.

use hypershard_collectives::tcp::{TcpConfig, init_from_env};
use hypershard_collectives::{CommunicatorExt, LaunchEnv, ReduceOp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = LaunchEnv::from_env()?;
    if std::env::var("HYPERSHARD_EXAMPLE_FAIL_RANK").ok() == Some(env.rank.to_string()) {
        eprintln!("rank {} failing on purpose", env.rank);
        std::process::exit(7);
    }
    if std::env::var("HYPERSHARD_EXAMPLE_HANG").is_ok() {
        println!("rank {} sleeping", env.rank);
        std::thread::sleep(std::time::Duration::from_secs(600));
    }
    let world = init_from_env(&TcpConfig::default())?;
    let sum = world
        .comm
        .all_reduce_vec(vec![(env.rank + 1) as f64], ReduceOp::Sum)?;
    let n = env.world_size as f64;
    let expected = n * (n + 1.0) / 2.0;
    if sum[0] != expected {
        eprintln!("rank {}: sum {} != {expected}", env.rank, sum[0]);
        std::process::exit(2);
    }
    if let Some(dir) = std::env::var_os("HYPERSHARD_EXAMPLE_READY_DIR") {
        let dir = std::path::PathBuf::from(dir);
        // The file holds the rank's pid, so a test can watch the process.
        std::fs::write(
            dir.join(format!("ready-{}", env.rank)),
            std::process::id().to_string(),
        )?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !dir.join("go").exists() {
            if std::time::Instant::now() > deadline {
                return Err("no go file within 60 s".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let again = world
            .comm
            .all_reduce_vec(vec![(env.rank + 1) as f64], ReduceOp::Sum)?;
        if again[0] != sum[0] {
            eprintln!("rank {}: second sum {} != {}", env.rank, again[0], sum[0]);
            std::process::exit(2);
        }
    }
    println!(
        "rank {} of {} local {} sum {}",
        env.rank, env.world_size, env.local_rank, sum[0]
    );
    // The store lives in rank 0's process: wait for every rank before rank 0 drops it.
    hypershard_collectives::Communicator::barrier(&*world.comm)?;
    Ok(())
}
