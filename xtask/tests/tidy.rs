//! Keeps ARCHITECTURE.md's invariants true where a test can: source files stay short enough to
//! read, process-wide state exists only where a reason is written down, and the code map names
//! every crate. Each list below is a ratchet: an entry that is no longer needed fails the test
//! too, so the lists only shrink.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("invariant: xtask sits in the workspace root")
        .to_path_buf()
}

/// Every `.rs` file under a `src/` folder of the workspace's crates, benches, xtask and fuzz.
fn sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() {
                if name != "target" && name != "tests" {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs")
                && path.components().any(|c| c.as_os_str() == "src")
            {
                out.push(path);
            }
        }
    }
    let root = root();
    let mut out = Vec::new();
    for top in ["crates", "benches", "xtask", "fuzz"] {
        walk(&root.join(top), &mut out);
    }
    out.sort();
    out
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root())
        .expect("invariant: sources are under the root")
        .to_string_lossy()
        .replace('\\', "/")
}

/// The longest a source file may be.
const MAX_LINES: usize = 800;

/// Files still over [`MAX_LINES`], each with why and what will split it.
const LONG_FILES: &[(&str, &str)] = &[
    (
        "crates/collectives/src/conformance.rs",
        "test suite; moves behind a `testing` feature with the collectives tree",
    ),
    (
        "crates/collectives/src/shm/channel.rs",
        "split into ring and channel with the transport tree",
    ),
    (
        "crates/collectives/src/store/tcp.rs",
        "split into wire, server and client with the rendezvous tree",
    ),
    (
        "crates/collectives/src/tcp/transport.rs",
        "split with the transport tree",
    ),
    (
        "crates/fsdp/src/device/model.rs",
        "the separate GPU path, replaced by device storage in the tensor",
    ),
    (
        "crates/nn/src/cuda/gpt.rs",
        "the separate GPU path, replaced by device storage in the tensor",
    ),
    (
        "crates/tensor/src/cuda/nn_ops.rs",
        "GPU kernels; split per op family with device storage",
    ),
    (
        "crates/tensor/src/dtype.rs",
        "one macro table per dtype; split into dtype and element conversions",
    ),
    (
        "benches/src/bin/bench-nccl.rs",
        "GPU benchmark, unsplit until it runs on a GPU",
    ),
    (
        "benches/src/nccl_sweep.rs",
        "GPU benchmark, unsplit until it runs on a GPU",
    ),
    (
        "xtask/src/gpu_check.rs",
        "GPU check runner, unsplit until it runs on a GPU",
    ),
];

/// Process-wide or thread-local state, each with the reason it is not a value the user holds.
const STATICS: &[(&str, &str)] = &[
    (
        "crates/collectives/src/buffer.rs",
        "an environment switch read once",
    ),
    (
        "crates/collectives/src/mpi/runtime.rs",
        "MPI may be initialised once per process",
    ),
    (
        "crates/collectives/src/shm/channel.rs",
        "a per-thread staging buffer reused across copies",
    ),
    (
        "crates/collectives/src/shm/cma.rs",
        "test counters of cross-memory reads, and a probe constant",
    ),
    (
        "crates/collectives/src/shm/futex.rs",
        "remembers that the kernel lacks futex_waitv",
    ),
    (
        "crates/collectives/src/watchdog/board.rs",
        "the training phase and step of this rank process, read by the stall watchdog",
    ),
    (
        "crates/dtensor/src/pack.rs",
        "one background thread that frees large wire buffers",
    ),
    (
        "crates/fsdp/src/module.rs",
        "unit ids unique across the process",
    ),
    (
        "crates/nn/src/kernels/recycle.rs",
        "a bounded free list of kernel output storage",
    ),
    (
        "crates/tensor/src/cuda/device.rs",
        "one context per CUDA device per process",
    ),
    (
        "crates/tensor/src/deferred.rs",
        "the deferred_init scope of the calling thread",
    ),
    (
        "crates/tensor/src/device.rs",
        "the stream scope of the calling thread, as with deferred_init",
    ),
    (
        "crates/tensor/src/emulated.rs",
        "one stream bookkeeping per emulated device, which is named by a plain value",
    ),
    (
        "crates/tensor/src/memory.rs",
        "the allocator tracker: per thread (rank) and per process",
    ),
];

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .lines()
        .count()
}

#[test]
fn source_files_stay_under_the_line_limit_and_the_exceptions_shrink() {
    let mut over = Vec::new();
    for path in sources() {
        let lines = line_count(&path);
        if lines > MAX_LINES {
            over.push((relative(&path), lines));
        }
    }
    let unlisted: Vec<_> = over
        .iter()
        .filter(|(name, _)| !LONG_FILES.iter().any(|(listed, _)| listed == name))
        .collect();
    assert!(
        unlisted.is_empty(),
        "files over {MAX_LINES} lines: {unlisted:?}; split them by role"
    );
    let stale: Vec<_> = LONG_FILES
        .iter()
        .filter(|(listed, _)| !over.iter().any(|(name, _)| name == listed))
        .map(|(listed, _)| listed)
        .collect();
    assert!(
        stale.is_empty(),
        "no longer over {MAX_LINES} lines (or gone): {stale:?}; remove them from LONG_FILES"
    );
}

/// Whether a line declares a `static` item or opens a `thread_local!` block.
fn declares_static(line: &str) -> bool {
    let code = line.trim_start();
    if code.starts_with("//") {
        return false;
    }
    let code = code
        .strip_prefix("pub(crate) ")
        .or_else(|| code.strip_prefix("pub "))
        .unwrap_or(code);
    code.starts_with("static ") || code.starts_with("thread_local!")
}

#[test]
fn process_wide_state_lives_only_where_a_reason_is_written_down() {
    let mut found = Vec::new();
    for path in sources() {
        let name = relative(&path);
        // Tests and the fuzz targets may keep what they like.
        if name.ends_with("/tests.rs") || name.starts_with("fuzz/") || name.starts_with("xtask/") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source");
        // Only code before the unit-test module counts.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        if code.lines().any(declares_static) && !found.contains(&name) {
            found.push(name);
        }
    }
    let unlisted: Vec<_> = found
        .iter()
        .filter(|name| !STATICS.iter().any(|(listed, _)| listed == name))
        .collect();
    assert!(
        unlisted.is_empty(),
        "new process-wide state in {unlisted:?}: hold it in a value, or add it to STATICS \
         with the reason it cannot be one"
    );
    let stale: Vec<_> = STATICS
        .iter()
        .filter(|(listed, _)| !found.contains(&listed.to_string()))
        .map(|(listed, _)| listed)
        .collect();
    assert!(
        stale.is_empty(),
        "no static left in {stale:?}; remove them from STATICS"
    );
}

#[test]
fn the_code_map_names_every_crate() {
    let architecture =
        std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let crates = std::fs::read_dir(root().join("crates")).expect("crates/");
    for entry in crates.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let heading = format!("### `crates/{name}`");
        assert!(
            architecture.contains(&heading),
            "ARCHITECTURE.md's code map has no `{heading}` section"
        );
    }
}

#[test]
fn the_static_detector_sees_declarations_and_not_comments() {
    assert!(declares_static("static FREE: Mutex<u8> = Mutex::new(0);"));
    assert!(declares_static("    pub(crate) static X: u8 = 0;"));
    assert!(declares_static("thread_local! {"));
    assert!(!declares_static("// static in a comment"));
    assert!(!declares_static("let s: &'static str = \"\";"));
}
