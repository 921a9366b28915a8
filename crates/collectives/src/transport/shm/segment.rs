//! `Segment`: one shared mapping holding one ring: a control block of cache-line-padded
//! atomics followed by the data bytes.
//!
//! Layout (offsets in bytes): `0` identity line (magic, capacity), `64` the producer's head,
//! `128` the consumer's tail, `192` the consumer's park word, `256` the producer's park word,
//! `320` the producer's revocation word (single-copy transfers), [`CONTROL_BYTES`] the data area of `capacity` bytes. Head and tail are monotonic byte
//! counts (the ring index is `position % capacity`), each on its own cache line so the two
//! sides never write the same line.
//!
//! A named segment lives in [`SEGMENT_DIR`] as `hypershard-{pid}-{from}to{to}-{nonce}`
//! (mode 0600, created exclusively). The receiving rank unlinks it right after mapping it
//! (and the creator again after the handshake, in case the receiver failed), so during a job
//! nothing is left in the directory: a rank killed later leaves only mappings that the
//! kernel frees with the last process. [`sweep_stale`] removes files of creators that died
//! inside the short window before the receiver opened them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapMut;

/// Where named segments are created.
pub const SEGMENT_DIR: &str = "/dev/shm";

/// The prefix of every segment file name.
pub const SEGMENT_PREFIX: &str = "hypershard-";

/// The first word of a segment: ASCII `HSRG` and a layout version.
const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"HSRG\x01\0\0\0");

/// The data area's capacity is a multiple of this (so that payloads, which start 16-byte
/// aligned, wrap at element boundaries).
pub const CAPACITY_ALIGN: usize = 64;

/// The smallest data area a ring accepts.
pub const MIN_CAPACITY: usize = 256;

/// One cache line.
#[repr(C, align(64))]
#[derive(Debug)]
pub(crate) struct Padded<T>(pub(crate) T);

#[derive(Debug)]
#[repr(C)]
pub(crate) struct Identity {
    magic: AtomicU64,
    capacity: AtomicU64,
}

/// The control block at the start of every segment. Every field is an atomic, so any bit
/// pattern (a zero-filled new file included) is a valid value.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Control {
    identity: Padded<Identity>,
    /// Bytes the producer has published (written only by the producer).
    pub(crate) head: Padded<AtomicU64>,
    /// Bytes the consumer has released (written only by the consumer).
    pub(crate) tail: Padded<AtomicU64>,
    /// 1 while the consumer is (about to be) parked waiting for data.
    pub(crate) data_waiter: Padded<AtomicU32>,
    /// 1 while the producer is (about to be) parked waiting for space.
    pub(crate) space_waiter: Padded<AtomicU32>,
    /// Set (to 1, never back) by the producer when it gave up waiting for the release of a
    /// lent payload (a descriptor of [`super::cma`]): its buffer may change from then on, so
    /// the consumer, which checks this after every cross-memory read, must discard what it
    /// read and fail.
    pub(crate) revoked: Padded<AtomicU32>,
}

/// The bytes before the data area.
pub const CONTROL_BYTES: usize = std::mem::size_of::<Control>();

const _: () = assert!(CONTROL_BYTES.is_multiple_of(CAPACITY_ALIGN));

/// `bytes` rounded up to a valid data capacity (a multiple of [`CAPACITY_ALIGN`], at least
/// [`MIN_CAPACITY`]).
pub fn ring_capacity(bytes: usize) -> usize {
    bytes.max(MIN_CAPACITY).div_ceil(CAPACITY_ALIGN) * CAPACITY_ALIGN
}

/// A mapped segment: the control block and the data area of one ring.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Keeps the mapping alive; every pointer below points into it.
    _map: MmapMut,
    control: *const Control,
    data: *mut u8,
    capacity: usize,
}

// SAFETY: the mapping is owned by the segment and lives as long as it; all shared state in
// it is accessed through atomics (the control block) or through the ring protocol, under
// which the producer only writes the free part of the data area and the consumer only reads
// the published part, with Release/Acquire on head and tail ordering the bytes.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` hands out only atomics and raw pointers whose use the ring
// protocol (in `ring.rs`) restricts to one producer and one consumer.
unsafe impl Sync for Segment {}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Where a mapping's control block and data area start.
struct Pointers {
    control: *const Control,
    data: *mut u8,
}

/// The pointers into `map`, checked for size and alignment.
fn pointers(map: &mut MmapMut, capacity: usize) -> io::Result<Pointers> {
    if map.len() < CONTROL_BYTES + capacity {
        return Err(invalid("shared-memory segment smaller than its ring"));
    }
    let base = map.as_mut_ptr();
    if !(base as usize).is_multiple_of(std::mem::align_of::<Control>()) {
        return Err(invalid("shared-memory mapping is not cache-line aligned"));
    }
    Ok(Pointers {
        control: base.cast::<Control>(),
        // SAFETY: the mapping holds at least CONTROL_BYTES + capacity bytes (checked above),
        // so the data area starts inside it.
        data: unsafe { base.add(CONTROL_BYTES) },
    })
}

impl Segment {
    /// Wraps `map` (at least `CONTROL_BYTES + capacity` bytes) without touching it.
    fn wrap(mut map: MmapMut, capacity: usize) -> io::Result<Segment> {
        let Pointers { control, data } = pointers(&mut map, capacity)?;
        Ok(Segment {
            _map: map,
            control,
            data,
            capacity,
        })
    }

    /// Wraps a fresh zero-filled mapping and writes the identity line.
    fn init(map: MmapMut, capacity: usize) -> io::Result<Segment> {
        let segment = Segment::wrap(map, capacity)?;
        let identity = &segment.control().identity.0;
        identity.capacity.store(capacity as u64, Ordering::Relaxed);
        identity.magic.store(SEGMENT_MAGIC, Ordering::Release);
        Ok(segment)
    }

    /// An anonymous segment (threads of one process; the ring's unit tests).
    #[cfg(test)]
    pub(crate) fn anonymous(capacity: usize) -> io::Result<Segment> {
        let capacity = ring_capacity(capacity);
        let map = MmapMut::map_anon(CONTROL_BYTES + capacity)?;
        Segment::init(map, capacity)
    }

    /// Creates the named segment `dir/name` exclusively (mode 0600) with a ring of
    /// `capacity` bytes and maps it.
    pub(crate) fn create(path: &Path, capacity: usize) -> io::Result<Segment> {
        let capacity = ring_capacity(capacity);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let mapped = reserve(&file, CONTROL_BYTES + capacity).and_then(|()| map_file(&file));
        match mapped {
            Ok(map) => Segment::init(map, capacity),
            Err(e) => {
                // Nobody else knows the name yet, so nothing can be lost by removing it.
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
    }

    /// Maps the named segment another rank created, checking its identity line.
    pub(crate) fn open(path: &Path) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        let len = usize::try_from(len).map_err(|_| invalid("segment too large"))?;
        if len < CONTROL_BYTES + MIN_CAPACITY {
            return Err(invalid("shared-memory segment too small"));
        }
        let capacity = len - CONTROL_BYTES;
        let segment = Segment::wrap(map_file(&file)?, capacity)?;
        let identity = &segment.control().identity.0;
        if identity.magic.load(Ordering::Acquire) != SEGMENT_MAGIC
            || identity.capacity.load(Ordering::Relaxed) != capacity as u64
            || !capacity.is_multiple_of(CAPACITY_ALIGN)
        {
            return Err(invalid("not a hypershard ring segment"));
        }
        Ok(segment)
    }

    /// The control block.
    pub(crate) fn control(&self) -> &Control {
        // SAFETY: `control` points at the start of the live, page-aligned mapping, which is
        // at least CONTROL_BYTES long; `Control` is all atomics, valid for any bytes, and the
        // returned borrow cannot outlive `self`, which owns the mapping.
        unsafe { &*self.control }
    }

    /// The start of the data area (`capacity` bytes).
    pub(crate) fn data(&self) -> *mut u8 {
        self.data
    }

    /// The data area's size in bytes.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Sizes `file` to `len` bytes and reserves its pages now, so a full tmpfs is an error here
/// rather than a SIGBUS at the first write into the mapping.
fn reserve(file: &File, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| invalid("segment too large"))?;
    // SAFETY: the descriptor is open (borrowed from `file` for the call); posix_fallocate
    // only allocates the file's blocks and reads no memory of ours.
    let status = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if status == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(status))
    }
}

fn map_file(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the file is a shared-memory segment that only hypershard ranks of this job map;
    // its contents are only accessed through the atomics of the control block and the ring
    // protocol (a misbehaving peer can garble bytes, which the message headers' validation
    // catches, but cannot shrink the file under us: the ranks never truncate it).
    unsafe { MmapMut::map_mut(file) }
}

/// A fresh segment path for the ring from `from` to `to`.
pub(crate) fn segment_path(dir: &Path, from: usize, to: usize) -> PathBuf {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    dir.join(format!(
        "{SEGMENT_PREFIX}{}-{from}to{to}-{nonce:x}",
        std::process::id()
    ))
}

/// Whether `path` is a segment name this module would create inside `dir` (a store value
/// naming another file is refused instead of opened).
pub(crate) fn is_segment_path(dir: &Path, path: &Path) -> bool {
    path.parent() == Some(dir)
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(SEGMENT_PREFIX) && !n.contains('/'))
}

/// How old a segment file must be before [`sweep_stale`] may remove it: far longer than a
/// segment lives (its peer unlinks it within the rendezvous), so a file of a live job in
/// another pid namespace that shares this `/dev/shm` is never touched while it is in use.
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// Removes segment files in `dir` whose creating process no longer exists (it died between
/// creating a segment and its peer unlinking it) and that are older than [`STALE_AFTER`].
/// Returns how many it removed.
pub fn sweep_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SEGMENT_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= STALE_AFTER);
        if !alive && old && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_block_keeps_head_and_tail_on_separate_lines() {
        assert_eq!(CONTROL_BYTES, 6 * 64);
        assert_eq!(std::mem::offset_of!(Control, revoked), 320);
        assert_eq!(std::mem::offset_of!(Control, head), 64);
        assert_eq!(std::mem::offset_of!(Control, tail), 128);
        assert_eq!(ring_capacity(1), MIN_CAPACITY);
        assert_eq!(ring_capacity(1000), 1024);
    }

    #[test]
    fn a_named_segment_opens_with_its_capacity_and_shares_its_bytes() {
        let dir = std::env::temp_dir();
        let path = segment_path(&dir, 0, 1);
        let created = Segment::create(&path, 1000).unwrap();
        let opened = Segment::open(&path).unwrap();
        // Creation is exclusive: the same name cannot be created twice.
        assert!(Segment::create(&path, 1000).is_err());
        std::fs::remove_file(&path).unwrap();
        assert_eq!(opened.capacity(), 1024);
        created.control().head.0.store(42, Ordering::Release);
        assert_eq!(opened.control().head.0.load(Ordering::Acquire), 42);
        // SAFETY: both pointers are the starts of live 1024-byte data areas mapping the same
        // file; this thread is the only user.
        unsafe {
            *created.data().add(1023) = 9;
            assert_eq!(*opened.data().add(1023), 9);
        }
        // A file that is not a segment is refused.
        let junk = dir.join(format!("{SEGMENT_PREFIX}junk-{}", std::process::id()));
        std::fs::write(&junk, vec![0u8; 4096]).unwrap();
        assert!(Segment::open(&junk).is_err());
        std::fs::remove_file(&junk).unwrap();
        assert!(is_segment_path(&dir, &path));
        assert!(!is_segment_path(&dir, Path::new("/etc/passwd")));
    }

    #[test]
    fn stale_segments_of_dead_processes_are_swept() {
        let dir = std::env::temp_dir().join(format!("hypershard-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // No live process has pid u32::MAX - 1 (above the kernel's pid limit).
        let dead = dir.join(format!("{SEGMENT_PREFIX}{}-0to1-1", u32::MAX - 1));
        let fresh_dead = dir.join(format!("{SEGMENT_PREFIX}{}-0to1-2", u32::MAX - 1));
        let live = segment_path(&dir, 1, 0);
        for path in [&dead, &fresh_dead, &live] {
            std::fs::write(path, b"x").unwrap();
        }
        let long_ago = std::time::SystemTime::now() - STALE_AFTER * 2;
        for path in [&dead, &live] {
            let file = std::fs::File::options().write(true).open(path).unwrap();
            file.set_modified(long_ago).unwrap();
        }
        // Only the old file of a dead creator goes; a live creator's or a fresh one stays.
        assert_eq!(sweep_stale(&dir), 1);
        assert!(!dead.exists() && fresh_dead.exists() && live.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
