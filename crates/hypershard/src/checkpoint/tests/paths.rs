//! A crafted `metadata.json` (or `latest`) cannot make a reader open a file outside the
//! checkpoint directory, or block on a FIFO: each is a typed error from `Checkpoint::open`.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use hypershard_tensor::Tensor;
use serde_json::json;

use crate::checkpoint::*;
use crate::error::Error;

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hypershard-ckpt-path-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One rank saves `model/w` = [[0, 1, 2], [3, 4, 5]] as step 1; returns the checkpoint dir.
fn save_one(root: &Path) -> PathBuf {
    let dir = CheckpointDir::new(root);
    let staging = dir.prepare_staging(1).unwrap();
    let mut writer = ShardWriter::new(&staging, 0);
    let w = Tensor::from_vec((0..6).map(|v| v as f32).collect::<Vec<_>>(), &[2, 3]).unwrap();
    writer
        .add(
            BlockSpec {
                name: "model/w",
                global_shape: &[2, 3],
                offset: &[0, 0],
                placement: None,
            },
            &w,
        )
        .unwrap();
    writer.finish().unwrap();
    dir.commit(CommitInfo {
        step: 1,
        world_size: 1,
        model_config: json!({}),
        state: json!({}),
    })
    .unwrap()
}

/// Points the block of `model/w` at `file` in the checkpoint's metadata.json.
fn point_at(dir: &Path, file: &str) {
    let path = dir.join(METADATA_FILE);
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    meta["tensors"]["model/w"]["blocks"][0]["file"] = json!(file);
    std::fs::write(&path, serde_json::to_vec(&meta).unwrap()).unwrap();
}

/// Opens `dir` on another thread and waits at most 10 s: a FIFO opened for reading would
/// block forever, which must show up as a failure, not a hung test.
fn open_promptly(dir: &Path) -> Result<Checkpoint, Error> {
    let (send, receive) = mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        // The receiver is gone only once the wait below has failed the test.
        let _ = send.send(Checkpoint::open(&dir));
    });
    receive
        .recv_timeout(Duration::from_secs(10))
        .expect("Checkpoint::open returned within 10 s")
}

fn refusal(result: Result<Checkpoint, Error>) -> (String, String) {
    match result {
        Err(Error::UnsafeCheckpointPath {
            named_in,
            file,
            reason,
            ..
        }) => {
            assert_eq!(named_in, METADATA_FILE);
            (file, reason)
        }
        other => panic!("expected UnsafeCheckpointPath, got {other:?}"),
    }
}

#[test]
fn shard_files_outside_the_directory_or_not_regular_are_refused_at_open() {
    let root = scratch("confined");
    let dir = save_one(&root);
    let good = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        good.read_tensor("model/w").unwrap().to_f64_vec().unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    let shard = "rank-00000.safetensors";
    // Lexically wrong names.
    for (file, reason) in [
        ("/etc/passwd", "is an absolute path"),
        (
            "../step-00000001/rank-00000.safetensors",
            "climbs out of the directory with `..`",
        ),
        ("sub/../../x", "climbs out"),
        ("", "is empty"),
    ] {
        point_at(&dir, file);
        let (named, why) = refusal(open_promptly(&dir));
        assert_eq!(named, file);
        assert!(why.starts_with(reason), "{file}: {why}");
    }
    // A symlink out of the directory (to a copy of the real shard).
    let outside = root.join("outside.safetensors");
    std::fs::copy(dir.join(shard), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("escape.safetensors")).unwrap();
    point_at(&dir, "escape.safetensors");
    let (_, why) = refusal(open_promptly(&dir));
    assert!(why.contains("outside the checkpoint directory"), "{why}");
    // A symlinked subdirectory that leads out is refused the same way.
    std::os::unix::fs::symlink(&root, dir.join("up")).unwrap();
    point_at(&dir, "up/outside.safetensors");
    let (_, why) = refusal(open_promptly(&dir));
    assert!(why.contains("outside the checkpoint directory"), "{why}");
    // A FIFO: refused before it is opened (opening it would block without a writer).
    let fifo = dir.join("fifo.safetensors");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    point_at(&dir, "fifo.safetensors");
    let (_, why) = refusal(open_promptly(&dir));
    assert_eq!(why, "is not a regular file (it is a FIFO)");
    // A directory.
    std::fs::create_dir(dir.join("sub")).unwrap();
    point_at(&dir, "sub");
    let (_, why) = refusal(open_promptly(&dir));
    assert_eq!(why, "is not a regular file (it is a directory)");
    // A symlink that stays inside the directory is followed, and reads the same values.
    std::os::unix::fs::symlink(shard, dir.join("alias.safetensors")).unwrap();
    point_at(&dir, "alias.safetensors");
    let aliased = open_promptly(&dir).unwrap();
    assert_eq!(
        aliased
            .read_tensor("model/w")
            .unwrap()
            .to_f64_vec()
            .unwrap(),
        vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    // A missing file opens (the error comes when a block of it is read) and names the path.
    point_at(&dir, "gone.safetensors");
    let missing = open_promptly(&dir).unwrap();
    assert!(matches!(
        missing.read_tensor("model/w"),
        Err(Error::Io { path, .. }) if path == dir.join("gone.safetensors")
    ));
}

#[test]
fn a_latest_pointer_that_leaves_the_root_is_refused() {
    let root = scratch("latest");
    save_one(&root);
    Checkpoint::open(&root).unwrap();
    for pointer in ["../elsewhere", "/tmp"] {
        std::fs::write(root.join(LATEST_FILE), pointer).unwrap();
        match Checkpoint::open(&root) {
            Err(Error::UnsafeCheckpointPath { named_in, file, .. }) => {
                assert_eq!((named_in, file.as_str()), (LATEST_FILE, pointer));
            }
            other => panic!("{pointer}: expected UnsafeCheckpointPath, got {other:?}"),
        }
    }
}
