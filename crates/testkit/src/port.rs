//! Ports for tests that must name a port before anything binds it (a store that rank 0 or a
//! child process binds later).
//!
//! Binding port 0, reading the port and releasing it leaves a window in which the kernel can
//! hand the same port to another test's `bind(0)` or outgoing connection, which then makes the
//! later bind fail with `AddrInUse`. The kernel only hands out ports from its ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`), so [`unused_port`] picks one below it: nothing
//! but an explicit bind can take such a port, and within one process every call returns a
//! different port.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU16, Ordering};

/// The lowest port handed out; below it lie the well-known and common service ports.
const FIRST: u16 = 10_000;
/// Where the ephemeral range starts when `/proc` does not say (Linux's default).
const DEFAULT_EPHEMERAL_START: u16 = 32_768;
/// Ports tried before giving up; every try is one `bind` on 127.0.0.1.
const ATTEMPTS: u16 = 512;

static NEXT: AtomicU16 = AtomicU16::new(0);

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .filter(|&start: &u16| start > FIRST + ATTEMPTS)
        .unwrap_or(DEFAULT_EPHEMERAL_START)
}

/// A port on 127.0.0.1 that is free now and below the ephemeral range, so that it stays free
/// until the test binds it (see the module docs). Calls in one process return distinct ports;
/// the process id spreads concurrent test processes apart.
///
/// # Panics
/// When none of the 512 ports it tries can be bound: a test cannot run without one.
pub fn unused_port() -> u16 {
    let span = ephemeral_start() - FIRST;
    // invariant: a pid modulo a u16 span fits in u16.
    let offset =
        u16::try_from(std::process::id() % u32::from(span)).expect("invariant: below span");
    for _ in 0..ATTEMPTS {
        let step = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (offset.wrapping_add(step.wrapping_mul(7))) % span;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range after {ATTEMPTS} tries");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let start = ephemeral_start();
        let ports: Vec<u16> = (0..8).map(|_| unused_port()).collect();
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "{ports:?}");
        for &port in &ports {
            assert!(
                (FIRST..start).contains(&port),
                "{port} not in {FIRST}..{start}"
            );
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
