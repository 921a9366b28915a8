//! Choosing and checking the rendezvous port.

use std::net::TcpListener;

use crate::error::{Error, Result};

/// Asks the OS for a free TCP port on `addr` and releases it, so rank 0 can bind it next.
///
/// There is a short window in which another program could take the port; torchrun has the
/// same window, and rank 0's bind then fails with a clear error instead of hanging.
pub fn free_port(addr: &str) -> Result<u16> {
    let listener = TcpListener::bind((addr, 0)).map_err(|source| Error::NoFreePort {
        addr: addr.to_string(),
        source,
    })?;
    let port = listener
        .local_addr()
        .map_err(|source| Error::NoFreePort {
            addr: addr.to_string(),
            source,
        })?
        .port();
    Ok(port)
}

/// Checks that `port` can be bound on `addr` now, so that a port in use becomes one clear
/// error before any rank starts.
pub fn check_port_free(addr: &str, port: u16) -> Result<()> {
    match TcpListener::bind((addr, port)) {
        Ok(listener) => {
            drop(listener);
            Ok(())
        }
        Err(source) => Err(Error::PortInUse {
            addr: addr.to_string(),
            port,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_port_can_be_bound_and_a_bound_one_is_reported() {
        let port = free_port("127.0.0.1").unwrap();
        assert!(port > 0);
        check_port_free("127.0.0.1", port).unwrap();
        let _held = TcpListener::bind(("127.0.0.1", port)).unwrap();
        match check_port_free("127.0.0.1", port) {
            Err(Error::PortInUse { port: p, .. }) => assert_eq!(p, port),
            other => panic!("expected PortInUse, got {other:?}"),
        }
    }
}
