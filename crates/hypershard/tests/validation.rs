//! Hostile and mistaken input to `hypershard train`, `sample`, `export` and `launch`, run as a
//! user runs them: every bad number, path or resume request is one `hypershard: error:` line
//! naming what was wrong, a non-zero exit, and nothing written or overwritten.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hypershard::checkpoint::Checkpoint;
use hypershard::train::read_losses;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hypershard-validation-{}-{test}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(hypershard())
        .args(args)
        .env("HYPERSHARD_TIMEOUT", "60")
        .stdin(Stdio::null())
        .output()
        .expect("hypershard runs")
}

/// `train --model tiny` on one rank into `out`, with `extra` flags.
fn train_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train", "--model", "tiny", "--nproc", "1", "--mesh", "1", "--out", out,
    ];
    args.extend_from_slice(extra);
    args
}

fn train_ok(out: &Path, extra: &[&str]) {
    let output = run(&train_args(out.to_str().unwrap(), extra));
    assert!(
        output.status.success(),
        "train {extra:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Asserts a run failed with exactly one error line containing `needle`.
fn assert_one_error_line(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("hypershard: error: "), "{stderr}");
    assert!(stderr.contains(needle), "wanted {needle:?} in {stderr}");
}

/// Every file under `dir` with its bytes, to show a refused command changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                files.push((path, bytes));
            }
        }
    }
    files.sort();
    files
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Rewrites the `metadata.json` of the newest checkpoint under `out` with `edit`.
fn edit_metadata(out: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let dir = Checkpoint::open(out).unwrap().dir().to_path_buf();
    let path = dir.join("metadata.json");
    let mut value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(&path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
}

/// Asserts a run that started training failed with one error line, its last, containing
/// `needle` (the lines before it are the run's progress notes).
fn assert_stopped_with(output: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("hypershard: error: "))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert_eq!(stderr.lines().last(), Some(errors[0]), "{stderr}");
    assert!(errors[0].contains(needle), "wanted {needle:?} in {stderr}");
}

#[test]
fn bad_numbers_are_refused_before_anything_is_written() {
    let dir = scratch("numbers");
    let out = dir.join("out");
    let out_text = out.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--lr", "nan"],
            "invalid --lr NaN: must be a finite number above 0",
        ),
        (
            &["--lr", "inf"],
            "invalid --lr inf: must be a finite number above 0",
        ),
        (
            &["--lr=-1"],
            "invalid --lr -1: must be a finite number above 0",
        ),
        (&["--lr", "0"], "invalid --lr 0:"),
        (
            &["--weight-decay", "nan"],
            "invalid --weight-decay NaN: must be a finite number of at least 0",
        ),
        (
            &["--grad-clip", "nan"],
            "invalid --grad-clip NaN: must be a finite number of at least 0",
        ),
        (&["--grad-clip=-1"], "invalid --grad-clip -1:"),
        (
            &["--beta1", "2"],
            "invalid --beta1 2: must be a finite number of at least 0 and below 1",
        ),
        (&["--beta2", "1"], "invalid --beta2 1:"),
        (
            &["--min-lr", "1"],
            "invalid --min-lr 1: must be a finite number of at least 0 and at most 0.003",
        ),
        (
            &["--warmup-steps", "18446744073709551615"],
            "invalid --warmup-steps 18446744073709551615: must be a step count from 0 to 9007199254740992",
        ),
        (&["--steps", "0"], "invalid --steps 0:"),
        (&["--lr-decay-steps", "0"], "invalid --lr-decay-steps 0:"),
        (
            &["--batch-size", "0"],
            "invalid --batch-size 0: must be at least 1",
        ),
        (
            &["--grad-accum", "0"],
            "invalid --grad-accum 0: must be at least 1",
        ),
        (
            &["--batch-size", "9223372036854775807"],
            "invalid --batch-size 9223372036854775807: the tokens per step",
        ),
        (
            &["--batch-size", "1000000000", "--steps", "9007199254740992"],
            "invalid --steps 9007199254740992: times 32000000000 tokens per step overflows",
        ),
    ];
    for (extra, needle) in cases {
        assert_one_error_line(&run(&train_args(out_text, extra)), needle);
    }
    // The mesh's rank count must not wrap around to match --nproc.
    assert_one_error_line(
        &run(&[
            "train",
            "--nproc",
            "4",
            "--mesh",
            "4611686018427387905x4",
            "--out",
            out_text,
        ]),
        "invalid --mesh \"4611686018427387905x4\": the rank count (the product) overflows",
    );
    assert_one_error_line(
        &run(&[
            "train",
            "--nproc",
            "4611686018427387905",
            "--nnodes",
            "4",
            "--mesh",
            "4",
            "--out",
            out_text,
        ]),
        "invalid --nnodes 4: the world size (the product with the flags before it) overflows",
    );
    assert_one_error_line(
        &run(&["train", "--nproc", "0", "--out", out_text]),
        "invalid --nproc 0: must be at least 1",
    );
    assert!(!out.exists(), "a refused run must not create --out");
    // `sample` and `launch` check theirs before touching a checkpoint or starting a rank.
    assert_one_error_line(
        &run(&["sample", "--checkpoint", out_text, "--temperature", "nan"]),
        "invalid --temperature NaN: must be a finite number above 0",
    );
    assert_one_error_line(
        &run(&[
            "launch",
            "--nproc-per-node",
            "4611686018427387905",
            "--nnodes",
            "4",
            "--",
            "true",
        ]),
        "invalid --nnodes 4: the world size",
    );
}

#[test]
fn a_bad_model_file_is_named_with_its_parse_error() {
    let dir = scratch("model");
    let out = dir.join("out");
    let out_text = out.to_str().unwrap();
    let model = dir.join("model.json");
    let model_text = model.to_str().unwrap();
    let cases: &[(&str, &str)] = &[
        (
            "{\"block_size\": 16,",
            "not a model config (nanoGPT GPTConfig fields): EOF while parsing",
        ),
        (
            r#"{"block_size": 16, "n_layer": 1, "n_head": 2}"#,
            "missing field `n_embd`",
        ),
        (
            r#"{"block_size": 16, "n_layer": 1, "n_head": 5, "n_embd": 12}"#,
            "n_head 5 must divide n_embd 12",
        ),
        (
            r#"{"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 12, "dropout": 2.0}"#,
            "dropout 2 must be in [0, 1)",
        ),
    ];
    for (json, needle) in cases {
        std::fs::write(&model, json).unwrap();
        let output = run(&["train", "--model", model_text, "--out", out_text]);
        assert_one_error_line(&output, &format!("invalid --model {model_text:?}: "));
        assert_one_error_line(&output, needle);
        // Not a Rust Debug dump of the parsed shape.
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("ModelShape"), "{stderr}");
    }
    assert!(!out.exists());
}

#[test]
fn output_and_init_paths_get_their_own_messages() {
    let dir = scratch("paths");
    let out = dir.join("out");
    let out_text = out.to_str().unwrap();
    let losses_dir = dir.join("losses-dir");
    std::fs::create_dir_all(&losses_dir).unwrap();
    assert_one_error_line(
        &run(&train_args(
            out_text,
            &["--losses", losses_dir.to_str().unwrap()],
        )),
        &format!("--losses {}: is a directory", losses_dir.display()),
    );
    assert_one_error_line(
        &run(&train_args(out_text, &["--losses", "/dev/full"])),
        "--losses /dev/full: is not a regular file",
    );
    let existing = dir.join("existing.jsonl");
    std::fs::write(&existing, b"keep me\n").unwrap();
    assert_one_error_line(
        &run(&train_args(
            out_text,
            &["--losses", existing.to_str().unwrap()],
        )),
        "already exists (name a new file, or pass --resume to append to it)",
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me\n");
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"garbage!!").unwrap();
    assert_one_error_line(
        &run(&train_args(
            out_text,
            &["--init", garbage.to_str().unwrap()],
        )),
        &format!("{}: safetensors: header length", garbage.display()),
    );
    assert_one_error_line(
        &run(&train_args(
            out_text,
            &["--init", losses_dir.to_str().unwrap()],
        )),
        &format!(
            "invalid --init {}: is not a regular file",
            losses_dir.display()
        ),
    );
    assert_one_error_line(
        &run(&train_args(existing.to_str().unwrap(), &[])),
        &format!(
            "--out {}: is not a directory (the run's outputs go into one)",
            existing.display()
        ),
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me\n");
    assert!(!out.exists());
    // `export --out` that exists (without --force) or is a directory.
    train_ok(&out, &["--steps", "1"]);
    assert_one_error_line(
        &run(&[
            "export",
            "--checkpoint",
            out_text,
            "--out",
            existing.to_str().unwrap(),
        ]),
        &format!(
            "--out {}: already exists (pass --force to replace it)",
            existing.display()
        ),
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep me\n");
    assert_one_error_line(
        &run(&[
            "export",
            "--checkpoint",
            out_text,
            "--out",
            losses_dir.to_str().unwrap(),
        ]),
        "is a directory",
    );
}

#[test]
fn a_non_finite_loss_stops_the_run_without_checkpointing_it() {
    let dir = scratch("nonfinite");
    // lr 1e300 makes the first update overflow f32: the parameters become infinite, so the
    // loss of step 1 is not finite.
    let blowup = ["--lr", "1e300", "--warmup-steps", "0", "--steps", "3"];
    let out = dir.join("loss");
    let output = run(&train_args(out.to_str().unwrap(), &blowup));
    assert_stopped_with(&output, "the loss of step 1 is NaN (not finite)");
    assert_stopped_with(&output, "stopped without saving a checkpoint of it");
    assert!(!out.join("checkpoints").exists());
    // Step 0's loss was finite and is recorded; step 1's is not.
    let steps: Vec<u64> = read_losses(&out.join("losses.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, vec![0]);
    // A checkpoint due right after the overflowing update is refused too.
    let out = dir.join("params");
    let output = run(&train_args(
        out.to_str().unwrap(),
        &[&blowup[..], &["--checkpoint-every", "1"]].concat(),
    ));
    assert_stopped_with(&output, "parameter values are not finite after step 1");
    assert!(!out.join("checkpoints/latest").exists());
    // --allow-nonfinite runs to the end and saves.
    let out = dir.join("allowed");
    train_ok(&out, &[&blowup[..], &["--allow-nonfinite"]].concat());
    assert_eq!(Checkpoint::open(&out).unwrap().step(), 3);
}

#[test]
fn resume_refuses_what_does_not_continue_the_checkpoint() {
    let dir = scratch("resume");
    let straight = dir.join("straight");
    train_ok(&straight, &["--steps", "6"]);
    let straight_losses = read_losses(&straight.join("losses.jsonl")).unwrap();
    let base = dir.join("base");
    train_ok(&base, &["--steps", "4", "--lr-decay-steps", "6"]);
    let before = snapshot(&base);
    let base_text = base.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--steps", "4"],
            "it was saved after step 4, and --steps 4 is not beyond it",
        ),
        (
            &["--steps", "3"],
            "it was saved after step 4, and --steps 3 is not beyond it",
        ),
        (
            &["--steps", "6", "--seed", "7"],
            "it was trained with --seed 1337, not 7",
        ),
        (
            &["--steps", "6", "--data-order", "sequential"],
            "it was trained with --data-order random, not sequential",
        ),
    ];
    for (extra, needle) in cases {
        let output = run(&train_args(base_text, &[&["--resume"], *extra].concat()));
        assert_one_error_line(&output, "cannot --resume from ");
        assert_one_error_line(&output, needle);
    }
    // The override flags only make sense with --resume.
    let output = run(&train_args(
        dir.join("fresh").to_str().unwrap(),
        &["--reset-optimizer"],
    ));
    assert!(!output.status.success());
    assert!(!dir.join("fresh").exists());
    assert_eq!(snapshot(&base), before, "a refused resume changed the run");

    // --override-resume-config continues with the new seed from the checkpoint's step.
    let overridden = dir.join("overridden");
    copy_dir(&base, &overridden);
    train_ok(
        &overridden,
        &[
            "--resume",
            "--steps",
            "6",
            "--seed",
            "7",
            "--override-resume-config",
        ],
    );
    let steps: Vec<u64> = read_losses(&overridden.join("losses.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, (0..6).collect::<Vec<_>>());

    // A checkpoint without optimizer state resumes only with --reset-optimizer.
    let bare = dir.join("bare");
    copy_dir(&base, &bare);
    edit_metadata(&bare, |meta| {
        let tensors = meta["tensors"].as_object_mut().unwrap();
        tensors.retain(|name, _| !name.starts_with("optim/"));
    });
    let output = run(&train_args(
        bare.to_str().unwrap(),
        &["--resume", "--steps", "6"],
    ));
    assert_one_error_line(&output, "holds no optimizer state for transformer.h.0.");
    assert_one_error_line(&output, "pass --reset-optimizer");
    train_ok(&bare, &["--resume", "--steps", "6", "--reset-optimizer"]);
    let resumed = read_losses(&bare.join("losses.jsonl")).unwrap();
    // Step 4's loss is computed from the checkpoint's weights before any update: the same as
    // the straight run's. Step 5 follows an update with fresh moments (and bias correction
    // from step 1), which differs from the straight run's.
    assert_eq!(resumed[4].step, 4);
    assert_eq!(resumed[4].loss, straight_losses[4].loss);
    assert_ne!(resumed[5].loss, straight_losses[5].loss);
    // On a checkpoint that has moments, --reset-optimizer ignores them: the same losses as
    // the checkpoint without any.
    let reset = dir.join("reset");
    copy_dir(&base, &reset);
    train_ok(&reset, &["--resume", "--steps", "6", "--reset-optimizer"]);
    let reset_losses = read_losses(&reset.join("losses.jsonl")).unwrap();
    assert_eq!(reset_losses[5].loss, resumed[5].loss);
}

#[test]
fn export_and_sample_check_the_tensor_set_against_the_model_config() {
    let dir = scratch("tensors");
    let out = dir.join("run");
    train_ok(&out, &["--steps", "1"]);
    let file = dir.join("model.safetensors");
    let export = || {
        run(&[
            "export",
            "--checkpoint",
            out.to_str().unwrap(),
            "--out",
            file.to_str().unwrap(),
        ])
    };
    let sample = || {
        run(&[
            "sample",
            "--checkpoint",
            out.to_str().unwrap(),
            "--max-new-tokens",
            "2",
        ])
    };
    // One tensor dropped from the metadata: both name it, and nothing is exported.
    edit_metadata(&out, |meta| {
        let tensors = meta["tensors"].as_object_mut().unwrap();
        assert!(tensors.remove("model/transformer.ln_f.bias").is_some());
    });
    for output in [export(), sample()] {
        assert_one_error_line(
            &output,
            "tensor model/transformer.ln_f.bias is absent, the model needs shape [32]",
        );
    }
    assert!(!file.exists());
    // A model config that does not fit the tensors: the first one that differs is named.
    std::fs::remove_dir_all(&out).unwrap();
    train_ok(&out, &["--steps", "1"]);
    edit_metadata(&out, |meta| meta["model_config"]["n_embd"] = 16.into());
    for output in [export(), sample()] {
        assert_one_error_line(
            &output,
            "tensor model/transformer.h.0.attn.c_attn.bias is shape [96], the model needs shape [48]",
        );
    }
    assert!(!file.exists());
}
