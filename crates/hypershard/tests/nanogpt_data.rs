//! nanoGPT dataset folders: a character-level dataset (train.bin, val.bin, and a meta.pkl
//! pickled here as nanoGPT's prepare.py pickles it) trains a model of its own small
//! vocabulary, evaluates on val.bin about ten times by default, and samples decoded text.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hypershard::checkpoint::Checkpoint;
use hypershard::data::{Tokenizer, TokenizerKind, default_corpus_path, write_u16_tokens};
use hypershard::train::checkpoint_root;
use serde::Serialize;

fn hypershard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hypershard"))
}

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hypershard-data-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch");
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

/// nanoGPT's meta.pkl: `{'vocab_size': n, 'itos': {i: ch}, 'stoi': {ch: i}}`.
#[derive(Serialize)]
struct Meta {
    vocab_size: usize,
    itos: BTreeMap<i64, String>,
    stoi: BTreeMap<String, i64>,
}

/// Writes a character-level dataset of the shipped Shakespeare's first 60 000 characters as
/// prepare.py does (sorted characters, first 90 % train, the rest val); returns the characters.
fn write_char_dataset(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(default_corpus_path()).expect("corpus");
    let text: String = text.chars().take(60_000).collect();
    let chars: Vec<String> = text
        .chars()
        .collect::<BTreeSet<char>>()
        .into_iter()
        .map(String::from)
        .collect();
    let stoi: BTreeMap<String, i64> = chars.iter().cloned().zip(0..).collect();
    let ids: Vec<u32> = text.chars().map(|c| stoi[&c.to_string()] as u32).collect();
    let split = ids.len() * 9 / 10;
    write_u16_tokens(&dir.join("train.bin"), &ids[..split]).expect("train.bin");
    write_u16_tokens(&dir.join("val.bin"), &ids[split..]).expect("val.bin");
    let meta = Meta {
        vocab_size: chars.len(),
        itos: (0..).zip(chars.iter().cloned()).collect(),
        stoi,
    };
    let bytes = serde_pickle::to_vec(&meta, serde_pickle::SerOptions::new()).expect("pickle");
    std::fs::write(dir.join("meta.pkl"), bytes).expect("meta.pkl");
    chars
}

#[test]
fn a_char_dataset_trains_its_own_vocabulary_evaluates_on_val_and_samples_text() {
    let dir = scratch("char");
    let data = dir.join("shakespeare_char");
    std::fs::create_dir_all(&data).expect("dir");
    let chars = write_char_dataset(&data);
    assert!(chars.len() < 100, "a small vocabulary: {}", chars.len());
    let out = dir.join("run");
    let s = |p: &Path| p.to_str().expect("utf-8").to_string();
    let output = run(&[
        "train",
        "--data",
        &s(&data),
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "20",
        "--batch-size",
        "4",
        "--warmup-steps",
        "2",
        "--out",
        &s(&out),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "train failed: {stderr}");
    // Without --eval-every, a run with val.bin evaluates every steps/10 = 2 steps.
    let evals: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("eval at step"))
        .collect();
    assert_eq!(evals.len(), 10, "{stderr}");
    assert!(evals[0].contains("eval at step 2:"), "{evals:?}");
    let svg = std::fs::read_to_string(out.join("loss.svg")).expect("loss.svg");
    assert!(svg.contains("eval") && svg.contains("train"));
    // The model has the dataset's vocabulary, and the checkpoint its table.
    let checkpoint = Checkpoint::open(&checkpoint_root(&out)).expect("checkpoint");
    let metadata = checkpoint.metadata();
    assert_eq!(
        metadata.model_config["vocab_size"].as_u64(),
        Some(chars.len() as u64)
    );
    assert_eq!(metadata.state["tokenizer"], "char");
    assert_eq!(metadata.state["vocabulary"], serde_json::json!(chars));
    // Sampling decodes characters of the vocabulary: the prompt, then 80 of them.
    let sample = run(&[
        "sample",
        "--checkpoint",
        &s(&out),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "80",
    ]);
    assert!(
        sample.status.success(),
        "sample failed: {}",
        String::from_utf8_lossy(&sample.stderr)
    );
    let text = String::from_utf8(sample.stdout).expect("utf-8");
    let text = text.strip_suffix('\n').expect("println's newline");
    assert!(text.starts_with("ROMEO:"), "{text:?}");
    assert_eq!(text.chars().count(), 6 + 80, "{text:?}");
    let known: BTreeSet<String> = chars.iter().cloned().collect();
    assert!(
        text.chars().all(|c| known.contains(&c.to_string())),
        "{text:?}"
    );
    // A prompt character outside the vocabulary is refused, naming it.
    let bad = run(&["sample", "--checkpoint", &s(&out), "--prompt", "~"]);
    assert!(!bad.status.success());
    let message = String::from_utf8_lossy(&bad.stderr);
    assert!(
        message.contains("\"~\" is not in the dataset's character vocabulary"),
        "{message}"
    );
    // The same table decodes the sample through the library.
    let tokenizer = Tokenizer::chars(chars.clone());
    assert_eq!(tokenizer.kind(), TokenizerKind::Char);
    let ids = tokenizer.encode(text).expect("encode");
    assert_eq!(tokenizer.decode(&ids).expect("decode"), text);
}

#[test]
fn token_files_may_use_a_vocabulary_below_the_tokenizers_and_eval_every_zero_turns_eval_off() {
    let dir = scratch("small-vocab");
    let data = dir.join("ids");
    std::fs::create_dir_all(&data).expect("dir");
    // A folder without meta.pkl: ids below 50, a model of vocabulary 50 (< the bytes
    // tokenizer's 256) given in a --model file.
    let ids: Vec<u32> = (0..4000u32).map(|i| (i * 7 + i / 13) % 50).collect();
    write_u16_tokens(&data.join("train.bin"), &ids).expect("train");
    write_u16_tokens(&data.join("val.bin"), &ids[..500]).expect("val");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"vocab_size": 50, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}"#,
    )
    .expect("model");
    let s = |p: &Path| p.to_str().expect("utf-8").to_string();
    let out = dir.join("run");
    let output = run(&[
        "train",
        "--data",
        &s(&data),
        "--model",
        &s(&model),
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--out",
        &s(&out),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(!stderr.contains("eval at step"), "{stderr}");
    // The bytes tokenizer decodes ids below 50 (control characters here); a prompt byte
    // at or above 50 is refused, naming the vocabulary size.
    let bad = run(&["sample", "--checkpoint", &s(&out), "--prompt", "z"]);
    assert!(!bad.status.success());
    let message = String::from_utf8_lossy(&bad.stderr);
    assert!(
        message.contains("not below the model's vocabulary size 50"),
        "{message}"
    );
    let good = run(&[
        "sample",
        "--checkpoint",
        &s(&out),
        "--prompt",
        "\u{1}",
        "--max-new-tokens",
        "5",
    ]);
    assert!(
        good.status.success(),
        "{}",
        String::from_utf8_lossy(&good.stderr)
    );
    let text = String::from_utf8(good.stdout).expect("utf-8");
    assert_eq!(text.len(), 1 + 5 + 1, "{text:?}");
    assert!(text.bytes().take(6).all(|b| b < 50));
    // A text corpus still needs the tokenizer's ids.
    let text_out = dir.join("text");
    let refused = run(&[
        "train",
        "--model",
        &s(&model),
        "--nproc",
        "1",
        "--mesh",
        "1",
        "--steps",
        "1",
        "--out",
        &s(&text_out),
    ]);
    assert!(!refused.status.success());
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(
        message.contains("vocab_size 50 is smaller than the tokenizer's 256"),
        "{message}"
    );
}
