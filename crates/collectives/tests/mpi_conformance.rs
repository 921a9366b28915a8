//! The conformance suite over MPI. Run under `mpirun -np N` (as `scripts/ci-mpi.sh` does), each
//! rank runs the whole suite on `MpiCommunicator::world` plus MPI-specific checks and exits
//! non-zero on any failure. Run directly (as `cargo test --features mpi` does), the binary
//! launches itself with `mpirun -np 2` and `-np 3` and fails unless every rank succeeds.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use hypershard_collectives::conformance::{self, SuiteParams};
use hypershard_collectives::mpi::MpiCommunicator;
use hypershard_collectives::{
    Buffer, BufferRole, CommConfig, Communicator, CommunicatorExt, DType, Error, ReduceOp,
};

/// Long enough for the suite on an oversubscribed 2-core machine; short enough that a hang
/// becomes an error (and a failing exit) instead of a stuck CI job.
const OP_TIMEOUT: Duration = Duration::from_secs(60);
/// The suite's "past two segments" size is derived from this (MPI has no segment knob).
const SEGMENT_BYTES: usize = 16 * 1024;

/// Whether this process was started by an MPI launcher.
fn under_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

/// MPI-specific checks beyond the suite: a receive of the wrong length fails with a typed
/// error and the next message still arrives whole; a second split of a split works; a rank
/// out of range is rejected on every rank.
fn extra_checks(comm: &dyn Communicator) -> Result<usize, String> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut cases = 0;
    if size >= 2 {
        let to = (rank + 1) % size;
        let from = (rank + size - 1) % size;
        let first = comm.send_async(Buffer::from_vec(vec![rank as f32; 5]), to, 3);
        let second = comm.send_async(Buffer::from_vec(vec![rank as i64 * 10; 2]), to, 3);
        match comm.recv(Buffer::zeros(DType::F32, 4), from, 3) {
            Err(Error::LengthMismatch {
                role: BufferRole::Message,
                expected: 4,
                got: 5,
                ..
            }) => {}
            other => return Err(format!("short recv gave {other:?}")),
        }
        match comm.recv(Buffer::zeros(DType::I64, 2), from, 3) {
            Ok(buffer) => {
                let got: Vec<i64> = buffer.into_vec().map_err(|e| e.to_string())?;
                if got != vec![from as i64 * 10; 2] {
                    return Err(format!("second message was {got:?}"));
                }
            }
            other => return Err(format!("second recv gave {other:?}")),
        }
        first.wait().map_err(|e| e.to_string())?;
        second.wait().map_err(|e| e.to_string())?;
        cases += 2;
    }
    match comm.broadcast(Buffer::zeros(DType::F32, 3), size) {
        Err(Error::InvalidRank { rank: r, .. }) if r == size => cases += 1,
        other => return Err(format!("broadcast from rank {size} gave {other:?}")),
    }
    let child = comm
        .split(Some(0), rank as i64)
        .map_err(|e| e.to_string())?
        .ok_or("split with one color left this rank out")?;
    let grandchild = child
        .split(Some((child.rank() % 2) as u32), 0)
        .map_err(|e| e.to_string())?
        .ok_or("second split left this rank out")?;
    let got = grandchild
        .all_reduce_vec(vec![1.0f64; 3], ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let members = (0..size).filter(|r| r % 2 == rank % 2).count() as f64;
    if got != vec![members; 3] {
        return Err(format!(
            "grandchild all-reduce gave {got:?}, expected {members}"
        ));
    }
    cases += 1;
    Ok(cases)
}

fn rank_main() -> ExitCode {
    let config = CommConfig::default().with_timeout(OP_TIMEOUT);
    let world = match MpiCommunicator::world(config) {
        Ok(world) => world,
        Err(e) => {
            eprintln!("mpi world: {e}");
            return ExitCode::from(4);
        }
    };
    let started = Instant::now();
    let rank = world.rank();
    let report = match conformance::run_all(&world, &SuiteParams::new(SEGMENT_BYTES)) {
        Ok(report) if report.cases > 1000 => report,
        Ok(report) => {
            eprintln!("rank {rank}: only {} cases", report.cases);
            return ExitCode::from(5);
        }
        Err(failure) => {
            eprintln!("rank {rank}: {failure}");
            return ExitCode::from(6);
        }
    };
    let extra = match extra_checks(&world) {
        Ok(extra) => extra,
        Err(message) => {
            eprintln!("rank {rank}: {message}");
            return ExitCode::from(7);
        }
    };
    if let Err(e) = world.barrier() {
        eprintln!("rank {rank}: final barrier: {e}");
        return ExitCode::from(8);
    }
    println!(
        "mpi_conformance: rank {rank}/{}: {} suite cases + {extra} extra ok in {:?}",
        world.size(),
        report.cases,
        started.elapsed()
    );
    ExitCode::SUCCESS
}

/// Runs this binary under `mpirun -np <ranks>`; true when every rank succeeded.
fn launch(ranks: usize) -> bool {
    let Ok(me) = std::env::current_exe() else {
        eprintln!("mpi_conformance: cannot find this binary");
        return false;
    };
    let status = Command::new("mpirun")
        .args(["--oversubscribe", "--allow-run-as-root", "-np"])
        .arg(ranks.to_string())
        .arg(me)
        .status();
    match status {
        Ok(status) if status.success() => true,
        Ok(status) => {
            eprintln!("mpi_conformance: mpirun -np {ranks} exited with {status}");
            false
        }
        Err(e) => {
            eprintln!("mpi_conformance: cannot run mpirun (install openmpi-bin): {e}");
            false
        }
    }
}

fn main() -> ExitCode {
    if under_mpi() {
        return rank_main();
    }
    // Run both worlds even when the first fails, so the log shows both.
    let results: Vec<bool> = [2, 3].into_iter().map(launch).collect();
    let ok = results.iter().all(|&ok| ok);
    if ok {
        println!("mpi_conformance: ok");
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
