//! Signals: what the launcher catches (SIGINT, SIGTERM) and how it stops rank processes.
//!
//! Every rank runs in its own process group, so a terminal's Ctrl-C reaches only the
//! launcher, which forwards it once; and stopping a rank stops whatever it started (a rank
//! command may be a shell or `cargo run`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// SIGINT.
pub const SIGINT: i32 = libc::SIGINT;
/// SIGTERM.
pub const SIGTERM: i32 = libc::SIGTERM;
/// SIGKILL.
pub const SIGKILL: i32 = libc::SIGKILL;

/// The last SIGINT/SIGTERM received (0: none), set from the signal handler.
#[derive(Clone, Debug)]
pub struct SignalLatch {
    received: Arc<AtomicUsize>,
}

impl SignalLatch {
    /// Installs handlers for SIGINT and SIGTERM that record the signal instead of dying, so
    /// the launcher can forward it and wait for the ranks.
    pub fn install() -> Result<SignalLatch> {
        let received = Arc::new(AtomicUsize::new(0));
        for signal in [SIGINT, SIGTERM] {
            // invariant: SIGINT and SIGTERM are small positive numbers.
            let value = usize::try_from(signal).unwrap_or(1);
            signal_hook::flag::register_usize(signal, Arc::clone(&received), value)
                .map_err(|source| Error::SignalHandler { source })?;
        }
        Ok(SignalLatch { received })
    }

    /// Takes the signal received since the last call, if any.
    pub fn take(&self) -> Option<i32> {
        match self.received.swap(0, Ordering::SeqCst) {
            0 => None,
            value => i32::try_from(value).ok(),
        }
    }
}

/// Sends `signal` to the process group led by `pid` (each rank leads its own group).
/// A group that is already gone is not an error: the rank has exited.
pub fn signal_group(pid: u32, signal: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid <= 0 {
        // A non-positive pid would address other groups; never send to those.
        return;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; `-pid` with pid > 0
    // addresses exactly the process group that the rank leads (it was spawned with
    // `process_group(0)`), never the launcher's own group.
    unsafe {
        libc::kill(-pid, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::Command;

    #[test]
    fn signalling_a_group_stops_its_leader_with_that_signal() {
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        signal_group(child.id(), SIGTERM);
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(SIGTERM));
    }

    #[test]
    fn signalling_a_gone_group_is_harmless() {
        let mut child = Command::new("true").process_group(0).spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        signal_group(pid, SIGTERM);
        signal_group(0, SIGTERM);
    }
}
