//! Single-copy transfers of large payloads with Linux cross-memory attach
//! (`process_vm_readv`): the sender puts a small descriptor (the address of its payload) into
//! the ring instead of the bytes, the receiver copies them straight out of the sender's
//! address space into its destination, and only then releases the descriptor's ring bytes;
//! the sender waits for that release before its buffer may change (see docs/shm.md).
//!
//! Whether a pair may use it is probed once during the segment handshake (`advert` and
//! `probe`): each rank reads a known pattern out of its peer, so a kernel without the call
//! (`ENOSYS`), a denial (`EPERM`: ptrace rules, another user, seccomp) or a peer in another
//! PID namespace (where its pid means nothing here) all make the pair stay on the ring copy.
//! It is off unless `HYPERSHARD_SHM_CMA=1` (a rank that has it off keeps its pairs on the
//! ring copy): the kernel pins the sender's pages one by one, and on 4 KiB pages that made
//! the single copy slower than the ring's two cache-friendly copies; on transparent huge
//! pages it is faster (docs/shm.md). `HYPERSHARD_SHM_CMA_MIN_BYTES` sets the smallest
//! payload sent this way.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::env::parse_switch;
use crate::error::{EnvExpectation, Error, Result};

/// Turns the single-copy path on or off (`1`, `true`, `on`, `yes` / `0`, `false`, `off`,
/// `no`); off when unset: it pays only when the senders' buffers sit on transparent huge
/// pages (docs/shm.md has the measurements).
pub const CMA_ENV: &str = "HYPERSHARD_SHM_CMA";

/// The smallest payload, in bytes, sent by descriptor instead of through the ring.
pub const CMA_MIN_BYTES_ENV: &str = "HYPERSHARD_SHM_CMA_MIN_BYTES";

/// The default of [`CMA_MIN_BYTES_ENV`]: below this, the two ring copies (both in cache) cost
/// less than the kernel's page pinning and the round trip of the release (docs/shm.md).
pub const DEFAULT_CMA_MIN_BYTES: usize = 256 << 10;

/// Whether this rank offers single-copy transfers, and from which payload size on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmaConfig {
    /// Whether this rank offers (and accepts) descriptors at all.
    pub enabled: bool,
    /// The smallest payload this rank sends by descriptor.
    pub min_bytes: usize,
}

impl Default for CmaConfig {
    fn default() -> Self {
        CmaConfig {
            enabled: false,
            min_bytes: DEFAULT_CMA_MIN_BYTES,
        }
    }
}

impl CmaConfig {
    /// The defaults, overridden by [`CMA_ENV`] and [`CMA_MIN_BYTES_ENV`] when set; a value
    /// that does not parse is an [`Error::InvalidEnv`].
    pub fn from_env() -> Result<CmaConfig> {
        CmaConfig::from_values(
            std::env::var(CMA_ENV).ok().as_deref(),
            std::env::var(CMA_MIN_BYTES_ENV).ok().as_deref(),
        )
    }

    /// The defaults overridden by the given variable values (as [`CmaConfig::from_env`]).
    pub fn from_values(switch: Option<&str>, min_bytes: Option<&str>) -> Result<CmaConfig> {
        let mut config = CmaConfig::default();
        if let Some(value) = switch {
            config.enabled = parse_switch(value).ok_or_else(|| Error::InvalidEnv {
                variable: CMA_ENV,
                value: value.to_string(),
                expected: EnvExpectation::Switch,
            })?;
        }
        if let Some(value) = min_bytes {
            config.min_bytes = value
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Error::InvalidEnv {
                    variable: CMA_MIN_BYTES_ENV,
                    value: value.to_string(),
                    expected: EnvExpectation::PositiveInteger,
                })?;
        }
        Ok(config)
    }
}

/// Lent payloads this process has copied out of a peer so far.
static READS: AtomicU64 = AtomicU64::new(0);

/// How many lent payloads this process has copied out of its peers (all channels, since it
/// started): the tests check with it that the single-copy path really ran.
#[cfg(any(test, feature = "testing"))]
pub fn cross_memory_reads() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// Counts one lent payload copied.
pub(crate) fn count_read() {
    READS.fetch_add(1, Ordering::Relaxed);
}

/// Lends this process cancelled because the receiver did not claim them in time.
static CANCELS: AtomicU64 = AtomicU64::new(0);

/// How many lends this process has cancelled (sent through the ring after all) because the
/// receiver did not claim them within the sender's patience.
#[cfg(test)]
pub fn cancelled_lends() -> u64 {
    CANCELS.load(Ordering::Relaxed)
}

/// Counts one cancelled lend.
pub(crate) fn count_cancel() {
    CANCELS.fetch_add(1, Ordering::Relaxed);
}

/// A peer process whose memory this process reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Remote {
    pid: libc::pid_t,
}

impl Remote {
    /// The process with id `pid` (in this process's PID namespace).
    pub(crate) fn new(pid: libc::pid_t) -> Remote {
        Remote { pid }
    }

    /// This process itself (the tests' ranks as threads).
    #[cfg(test)]
    pub(crate) fn this_process() -> Remote {
        Remote::new(this_pid())
    }

    /// Copies `dst.len()` bytes starting at address `addr` of the peer's address space into
    /// `dst`. A partial read (the kernel may stop at a page it cannot access, or early for
    /// its own reasons) continues where it stopped; a read that moves nothing, or that fails,
    /// is an error (`ESRCH` once the peer is gone, `EFAULT` for an address it does not map).
    pub(crate) fn read(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < dst.len() {
            let rest = &mut dst[done..];
            let from = addr
                .checked_add(done as u64)
                .and_then(|a| usize::try_from(a).ok())
                .filter(|a| a.checked_add(rest.len()).is_some())
                .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
            let local = libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            };
            let remote = libc::iovec {
                iov_base: from as *mut libc::c_void,
                iov_len: rest.len(),
            };
            // SAFETY: the local iovec is exactly `rest`, a live, exclusively borrowed slice of
            // `rest.len()` bytes, so the kernel writes nothing outside it; the remote iovec
            // only names addresses in the other process, which the kernel checks (an address
            // it does not map is EFAULT, not a fault here), and `from + rest.len()` does not
            // overflow (checked above). The call reads no other memory of this process.
            let moved = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
            if moved < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            // invariant: moved >= 0 here, and the kernel never moves more than asked.
            let moved = (moved as usize).min(rest.len());
            if moved == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "process_vm_readv moved no bytes",
                ));
            }
            done += moved;
        }
        Ok(())
    }
}

fn this_pid() -> libc::pid_t {
    // invariant: pids fit in pid_t (the kernel's pid_max is at most 2^22).
    libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX)
}

/// The bytes a peer reads out of this process to prove that it can.
static PROBE: [u8; 16] = *b"hypershard-cma-1";

fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// What this rank publishes for its peers' probes: `off`, or `{pid}|{address of the probe
/// pattern, hex}|{pid namespace}`.
pub(crate) fn advert(config: &CmaConfig) -> String {
    if !config.enabled {
        return "off".to_string();
    }
    format!(
        "{}|{:x}|{}",
        this_pid(),
        PROBE.as_ptr() as usize,
        pid_namespace()
    )
}

/// The peer that published `advert`, once this process has proved it can read it by reading
/// its probe pattern; why not when the peer is off, in another PID namespace, or the read
/// fails (`EPERM`, `ENOSYS`, ...) or returns other bytes.
pub(crate) fn probe(advert: &[u8]) -> std::result::Result<Remote, String> {
    let text = String::from_utf8_lossy(advert);
    if text == "off" {
        return Err("the peer turned cross-memory attach off".to_string());
    }
    let mut parts = text.splitn(3, '|');
    let (Some(pid), Some(addr), Some(namespace)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("unreadable advert {text:?}"));
    };
    if namespace != pid_namespace() {
        return Err("the peer is in another PID namespace".to_string());
    }
    let (Ok(pid), Ok(addr)) = (pid.parse::<libc::pid_t>(), u64::from_str_radix(addr, 16)) else {
        return Err(format!("unreadable advert {text:?}"));
    };
    if pid <= 0 {
        return Err(format!("bad pid {pid}"));
    }
    let remote = Remote::new(pid);
    let mut seen = [0u8; 16];
    remote
        .read(addr, &mut seen)
        .map_err(|e| format!("process_vm_readv: {e}"))?;
    if seen != PROBE {
        return Err("the probe read other bytes".to_string());
    }
    Ok(remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_and_sizes_parse_and_garbage_is_a_typed_error() {
        assert_eq!(
            CmaConfig::from_values(None, None).unwrap(),
            CmaConfig::default()
        );
        let off = CmaConfig::from_values(Some(" OFF "), Some("4096")).unwrap();
        assert_eq!(
            off,
            CmaConfig {
                enabled: false,
                min_bytes: 4096
            }
        );
        assert!(!CmaConfig::default().enabled, "off unless asked for");
        assert!(CmaConfig::from_values(Some("1"), None).unwrap().enabled);
        for (switch, min) in [(Some("maybe"), None), (None, Some("0")), (None, Some("-3"))] {
            let error = CmaConfig::from_values(switch, min).unwrap_err();
            assert!(matches!(error, Error::InvalidEnv { .. }), "{error:?}");
        }
    }

    #[test]
    fn reads_of_this_process_copy_exactly_and_bad_addresses_fail() {
        let remote = Remote::this_process();
        // 3 MiB + 5: several pages, an odd tail.
        let source: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i * 7 % 251) as u8).collect();
        let mut guarded = vec![0xAAu8; source.len() + 64];
        let (dst, guard) = guarded.split_at_mut(source.len());
        remote.read(source.as_ptr() as u64, dst).unwrap();
        assert_eq!(dst, &source[..]);
        assert!(
            guard.iter().all(|&b| b == 0xAA),
            "nothing past the destination"
        );
        remote.read(source.as_ptr() as u64, &mut []).unwrap();
        let error = remote.read(8, &mut [0u8; 16]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFAULT), "{error}");
        let error = remote.read(u64::MAX - 4, &mut [0u8; 16]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFAULT), "{error}");
    }

    #[test]
    fn a_read_that_crosses_into_unmapped_memory_fails_after_the_mapped_part() {
        // A mapped page followed by an unmapped one: the kernel copies the first page and
        // stops (a partial read), and the retry at the unmapped page fails with EFAULT.
        let page = 4096;
        // SAFETY: a fresh private anonymous mapping of two pages, unmapped below; the
        // pointers are only used inside it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the first page is ours and mapped; the second is unmapped with munmap and
        // never touched by this process again.
        unsafe {
            std::ptr::write_bytes(base.cast::<u8>(), 0x5C, page);
            assert_eq!(libc::munmap(base.cast::<u8>().add(page).cast(), page), 0);
        }
        let mut dst = vec![0u8; 2 * page];
        let error = Remote::this_process()
            .read(base as u64, &mut dst)
            .unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFAULT), "{error}");
        assert!(
            dst[..page].iter().all(|&b| b == 0x5C),
            "the mapped part came"
        );
        // SAFETY: the first page is still mapped by the mmap above.
        unsafe { assert_eq!(libc::munmap(base, page), 0) };
    }

    #[test]
    fn the_probe_reads_this_process_and_refuses_off_and_garbage() {
        let config = CmaConfig {
            enabled: true,
            ..CmaConfig::default()
        };
        let remote = probe(advert(&config).as_bytes()).unwrap();
        assert_eq!(remote, Remote::this_process());
        let off = CmaConfig {
            enabled: false,
            ..config
        };
        assert!(probe(advert(&off).as_bytes()).is_err());
        assert!(probe(b"12|zz|x").is_err());
        let wrong_address = format!("{}|8|{}", this_pid(), pid_namespace());
        assert!(probe(wrong_address.as_bytes()).is_err());
        let elsewhere = format!("{}|{:x}|pid:[1]", this_pid(), PROBE.as_ptr() as usize);
        assert!(probe(elsewhere.as_bytes()).is_err());
    }

    #[test]
    fn a_finished_process_cannot_be_read() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = libc::pid_t::try_from(child.id()).unwrap();
        child.wait().unwrap();
        let error = Remote::new(pid).read(PROBE.as_ptr() as u64, &mut [0u8; 16]);
        assert!(error.is_err(), "a reaped child is gone");
    }
}
