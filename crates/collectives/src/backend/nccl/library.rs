//! Finding libcuda and libnccl before cudarc touches them.
//!
//! cudarc's dynamic loader panics when a library is missing, so every entry point of this
//! backend calls [`probe`] first and turns a missing library into
//! [`Error::BackendUnavailable`]. cudarc loads NCCL only as `libnccl.so` or `libnccl.so.<N>`
//! with `N` a CUDA major version (12, 11, ...), never as `libnccl.so.2`, which is the only name
//! pip's `nvidia-nccl-cu12` wheel ships. The dynamic loader reads `LD_LIBRARY_PATH` once, when
//! the process starts, so this module cannot fix that from inside the process; it finds the
//! `.so.2` (at `HYPERSHARD_NCCL_LIB`, or in the usual places) and says how to expose it, and
//! `cargo xtask gpu-check` does that for its child processes (a `libnccl.so` symlink in a
//! directory put on `LD_LIBRARY_PATH`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result, Unavailable};

/// The backend name in errors.
pub(crate) use crate::device_buffer::NCCL_BACKEND as BACKEND;

/// The variable that names pip's `libnccl.so.2` (or any NCCL library file) explicitly.
pub const NCCL_LIB_ENV: &str = "HYPERSHARD_NCCL_LIB";

/// The file name of the NCCL library as pip's wheel and most distributions ship it.
const NCCL_SONAME: &str = "libnccl.so.2";

/// Checks that libcuda and libnccl can be loaded under the names cudarc tries; the error
/// says which one is missing and, for NCCL, where an unloadable copy was found.
pub fn probe() -> Result<()> {
    // SAFETY: `is_culib_present` only tries `dlopen` on a list of library names and drops each
    // handle it opened; it touches no CUDA state.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    if !cuda {
        return Err(unavailable(Unavailable::LibraryNotFound {
            library: "libcuda",
            tried: cudarc::get_lib_name_candidates("cuda"),
        }));
    }
    // SAFETY: as above, for the NCCL names.
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    if !nccl {
        let reason = match find_nccl_soname(&search_dirs()) {
            Some(found) => Unavailable::LibraryUnderOtherName {
                library: "libnccl",
                found,
            },
            None => Unavailable::LibraryNotFound {
                library: "libnccl",
                tried: cudarc::get_lib_name_candidates("nccl"),
            },
        };
        return Err(unavailable(reason));
    }
    Ok(())
}

pub(crate) fn unavailable(reason: Unavailable) -> Error {
    Error::BackendUnavailable {
        backend: BACKEND,
        reason,
    }
}

/// Where `libnccl.so.2` may live: the file or directory `HYPERSHARD_NCCL_LIB` names, the
/// directories of `LD_LIBRARY_PATH`, the system library directories, and pip's wheel in the
/// site-packages of a virtual environment (`$VIRTUAL_ENV`) or of the usual Python prefixes.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(named) = std::env::var_os(NCCL_LIB_ENV) {
        let named = PathBuf::from(named);
        // A file names itself; its directory is searched too (the soname may differ).
        if let Some(parent) = named.parent().filter(|_| named.is_file()) {
            dirs.push(parent.to_path_buf());
        }
        dirs.push(named);
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths));
    }
    for system in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/lib",
    ] {
        dirs.push(PathBuf::from(system));
    }
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.push(PathBuf::from(venv));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        dirs.extend(wheel_dirs(&prefix));
    }
    dirs
}

/// `<prefix>/lib/python3.*/{site,dist}-packages/nvidia/nccl/lib` for every Python found.
fn wheel_dirs(prefix: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("python3") {
            for packages in ["site-packages", "dist-packages"] {
                dirs.push(entry.path().join(packages).join("nvidia/nccl/lib"));
            }
        }
    }
    dirs
}

/// The first `libnccl.so.2` among `candidates` (each a directory to look in, or the file
/// itself).
pub fn find_nccl_soname(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates.iter().find_map(|candidate| {
        if candidate.is_file() {
            return Some(candidate.clone());
        }
        let file = candidate.join(NCCL_SONAME);
        file.is_file().then_some(file)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_soname_in_a_directory_or_as_a_named_file() {
        let dir =
            std::env::temp_dir().join(format!("hypershard-nccl-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("nothing-here");
        assert_eq!(find_nccl_soname(std::slice::from_ref(&missing)), None);
        assert_eq!(find_nccl_soname(std::slice::from_ref(&dir)), None);
        let lib = dir.join(NCCL_SONAME);
        std::fs::write(&lib, b"not really a library").unwrap();
        assert_eq!(
            find_nccl_soname(&[missing.clone(), dir.clone()]),
            Some(lib.clone())
        );
        assert_eq!(
            find_nccl_soname(std::slice::from_ref(&lib)),
            Some(lib.clone())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn search_covers_the_system_and_wheel_locations() {
        let dirs = search_dirs();
        assert!(dirs.contains(&PathBuf::from("/usr/lib/x86_64-linux-gnu")));
        assert!(dirs.contains(&PathBuf::from("/usr/local/cuda/lib64")));
    }
}
