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
        "crates/collectives/src/backend/mpi/runtime.rs",
        "MPI may be initialised once per process",
    ),
    (
        "crates/collectives/src/transport/shm/channel/mod.rs",
        "a per-thread staging buffer reused across copies",
    ),
    (
        "crates/collectives/src/transport/shm/cma.rs",
        "test counters of cross-memory reads, and a probe constant",
    ),
    (
        "crates/collectives/src/transport/shm/futex.rs",
        "remembers that the kernel lacks futex_waitv",
    ),
    (
        "crates/collectives/src/progress.rs",
        "the training phase and step of this rank process, read by the stall watchdog",
    ),
    (
        "crates/nn/src/kernels/packed_gemm/mod.rs",
        "per-thread GEMM packing buffers reused across calls",
    ),
    (
        "crates/fsdp/src/module.rs",
        "unit ids unique across the process",
    ),
    (
        "crates/testkit/src/port.rs",
        "the test ports handed out in this process, so tests running in parallel get distinct ones",
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

/// The top-level modules of `crates/collectives/src` (folders, or files without `.rs`), bottom
/// layer first. A module may import from its own layer's and lower layers' modules only, so
/// the crate reads bottom-up: the shared types, then rendezvous, agreement, transports,
/// algorithms, backends, and what builds on the backends.
const COLLECTIVES_LAYERS: &[(&str, &[&str])] = &[
    (
        "core",
        &[
            "auth",
            "blocks",
            "buffer",
            "communicator",
            "config",
            "counter",
            "device_buffer",
            "dtype",
            "engine",
            "env",
            "error",
            "frame_key",
            "location",
            "op",
            "progress",
            "reduce",
            "work",
        ],
    ),
    ("rendezvous", &["rendezvous"]),
    ("agree", &["agree"]),
    ("transport", &["transport"]),
    ("algorithms", &["algorithms"]),
    ("backend", &["backend"]),
    (
        "top",
        &[
            "conformance",
            "fuzzing",
            "init",
            "lib",
            "store",
            "testing",
            "watchdog",
        ],
    ),
];

/// Imports that still run upward while the tree is being reorganised: `(file, module)`. A
/// ratchet like the lists above: every entry must still be needed.
const UPWARD_IMPORTS: &[(&str, &str)] = &[];

/// The layer of a top-level module of the collectives crate.
fn collectives_layer(module: &str) -> Option<usize> {
    COLLECTIVES_LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// The first path segment of every item a `use crate::...` statement brings in, with the
/// statement's line (1-based). Handles `use crate::{a, b::c}` over several lines; the unit
/// tests below the first `#[cfg(test)]` may import from anywhere and are not read.
fn crate_imports(text: &str) -> Vec<(usize, String)> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut found = Vec::new();
    let mut lines = code.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let trimmed = line.trim_start();
        let rest = ["use ", "pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|prefix| trimmed.strip_prefix(prefix))
            .and_then(|rest| rest.strip_prefix("crate::"));
        let Some(rest) = rest else { continue };
        let mut statement = rest.to_string();
        while !statement.contains(';') {
            match lines.next() {
                Some((_, more)) => statement.push_str(more),
                None => break,
            }
        }
        let statement = statement.split(';').next().unwrap_or_default();
        let heads: Vec<String> = match statement.strip_prefix('{') {
            Some(group) => {
                let mut heads = Vec::new();
                let mut depth = 0usize;
                let mut item = String::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            heads.push(std::mem::take(&mut item));
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                heads.push(item);
                heads
            }
            None => vec![statement.to_string()],
        };
        for head in heads {
            let module: String = head
                .trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !module.is_empty() {
                found.push((index + 1, module));
            }
        }
    }
    found
}

/// The imports of one collectives source file (`relative` to `src/`) that reach a higher
/// layer than the file's own: `(line, module)`.
fn upward_imports(relative: &str, text: &str) -> Vec<(usize, String)> {
    let own = relative
        .split('/')
        .next()
        .unwrap_or_default()
        .trim_end_matches(".rs");
    let Some(own_layer) = collectives_layer(own) else {
        return Vec::new();
    };
    crate_imports(text)
        .into_iter()
        .filter(|(_, module)| module != own)
        .filter(|(_, module)| collectives_layer(module).is_some_and(|layer| layer > own_layer))
        .collect()
}

#[test]
fn collectives_imports_run_only_down_the_layers() {
    let src = root().join("crates/collectives/src");
    let mut unknown = Vec::new();
    let mut upward = Vec::new();
    let mut violations = Vec::new();
    for path in sources() {
        let Ok(inside) = path.strip_prefix(&src) else {
            continue;
        };
        let inside = inside.to_string_lossy().replace('\\', "/");
        let own = inside.split('/').next().unwrap_or_default();
        if !own.is_empty() && collectives_layer(own.trim_end_matches(".rs")).is_none() {
            unknown.push(inside.clone());
            continue;
        }
        if inside.ends_with("/tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source");
        for (line, module) in upward_imports(&inside, &text) {
            let name = relative(&path);
            upward.push((name.clone(), module.clone()));
            if !UPWARD_IMPORTS.contains(&(name.as_str(), module.as_str())) {
                violations.push(format!("{name}:{line} imports crate::{module}"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "collectives modules in no layer: {unknown:?}; add them to COLLECTIVES_LAYERS"
    );
    assert!(
        violations.is_empty(),
        "imports from a higher layer (see COLLECTIVES_LAYERS):\n{}",
        violations.join("\n")
    );
    let stale: Vec<_> = UPWARD_IMPORTS
        .iter()
        .filter(|(file, module)| !upward.iter().any(|(f, m)| f == file && m == module))
        .collect();
    assert!(
        stale.is_empty(),
        "no longer imported upward: {stale:?}; remove them from UPWARD_IMPORTS"
    );
}

#[test]
fn the_layer_detector_flags_upward_imports_and_nothing_else() {
    let sample = "\
use std::sync::Arc;
use crate::error::Result;
use crate::backend::tcp::TcpConfig;
pub(crate) use crate::{
    agree::Desc,
    backend::local::LocalComm,
};
// use crate::backend::Nothing;
use super::ring;

#[cfg(test)]
mod tests {
    use crate::backend::local::spawn_world;
}
";
    assert_eq!(
        upward_imports("algorithms/ring.rs", sample),
        vec![(3, "backend".to_string()), (4, "backend".to_string())]
    );
    // The same imports are fine one layer up, and a module's own folder is never upward.
    assert!(upward_imports("backend/tcp/link.rs", sample).is_empty());
    assert_eq!(
        crate_imports("use crate::{a, b::{c, d}, e};\n"),
        vec![
            (1, "a".to_string()),
            (1, "b".to_string()),
            (1, "e".to_string())
        ]
    );
}

/// Module → the modules it imports from.
type ModuleGraph = std::collections::BTreeMap<String, std::collections::BTreeSet<String>>;

/// The import graph between the top-level modules (a file or a folder) of the crate whose
/// source folder is `src`: `module → modules it imports from`, from `use crate::…` lines.
fn module_graph(src: &Path) -> ModuleGraph {
    let mut graph = ModuleGraph::new();
    let files: Vec<(String, String)> = sources()
        .into_iter()
        .filter_map(|path| {
            let inside = path
                .strip_prefix(src)
                .ok()?
                .to_string_lossy()
                .replace('\\', "/");
            let text = std::fs::read_to_string(&path).ok()?;
            Some((inside, text))
        })
        .collect();
    for (inside, _) in &files {
        let own = inside
            .split('/')
            .next()
            .unwrap_or_default()
            .trim_end_matches(".rs");
        if own != "lib" && own != "main" {
            graph.entry(own.to_string()).or_default();
        }
    }
    for (inside, text) in &files {
        let own = inside
            .split('/')
            .next()
            .unwrap_or_default()
            .trim_end_matches(".rs");
        if !graph.contains_key(own) || inside.ends_with("/tests.rs") {
            continue;
        }
        let imported: Vec<String> = crate_imports(text)
            .into_iter()
            .map(|(_, module)| module)
            .filter(|module| module != own && graph.contains_key(module))
            .collect();
        graph.entry(own.to_string()).or_default().extend(imported);
    }
    graph
}

/// One import cycle of `graph` (`a → b → … → a`), if it has any.
fn find_cycle(graph: &ModuleGraph) -> Option<Vec<String>> {
    // Depth-first search with the path on a stack: an edge back into the path is a cycle.
    fn visit(
        node: &str,
        graph: &ModuleGraph,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_modules_of_each_layered_crate_import_without_cycles() {
    let mut cycles = Vec::new();
    for krate in ["fsdp", "collectives", "dtensor", "nn", "tensor"] {
        let graph = module_graph(&root().join("crates").join(krate).join("src"));
        assert!(graph.len() > 3, "{krate}: only {graph:?}");
        if let Some(cycle) = find_cycle(&graph) {
            cycles.push(format!("crates/{krate}/src: {}", cycle.join(" → ")));
        }
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_cycle_finder_finds_a_cycle_and_only_a_cycle() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = ModuleGraph::new();
        for (from, to) in edges {
            g.entry(from.to_string())
                .or_default()
                .insert(to.to_string());
            g.entry(to.to_string()).or_default();
        }
        g
    };
    // A diamond is no cycle.
    assert_eq!(
        find_cycle(&graph(&[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])),
        None
    );
    let cycle = find_cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]))
        .expect("a → b → c → a");
    assert_eq!(cycle, vec!["a", "b", "c", "a"]);
}
