//! nanoGPT dataset folders (`data/shakespeare_char` and the like): `train.bin` and `val.bin`
//! (little-endian `u16` token ids) and, when the dataset has its own vocabulary, `meta.pkl` (a
//! pickled dict with `vocab_size` and, for character-level data, the `itos` / `stoi` tables).
//! The pickle is read with `serde-pickle`: no Python at run time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_pickle::{DeOptions, HashableValue, Value};

use super::corpus::{TokenData, decode_u16_tokens, load_tokens};
use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};

/// The training split of a dataset folder.
pub const TRAIN_FILE: &str = "train.bin";
/// The validation split of a dataset folder.
pub const VAL_FILE: &str = "val.bin";
/// The vocabulary of a dataset folder.
pub const META_FILE: &str = "meta.pkl";

/// What a dataset's `meta.pkl` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetMeta {
    /// The vocabulary size (the model's `vocab_size` by default).
    pub vocab_size: usize,
    /// The character of every token id (`itos`), for character-level datasets.
    pub itos: Option<Vec<String>>,
}

/// A corpus split into training and (when the dataset has one) validation tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dataset {
    /// What training windows are cut from.
    pub train: TokenData,
    /// `val.bin`, when present.
    pub val: Option<TokenData>,
}

fn meta_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::DatasetMeta {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn key(name: &str) -> HashableValue {
    HashableValue::String(name.to_string())
}

fn as_index(value: &HashableValue) -> Option<usize> {
    match value {
        HashableValue::I64(i) => usize::try_from(*i).ok(),
        _ => None,
    }
}

/// The `itos` table from `itos` (id → char) or, without it, from `stoi` (char → id); the ids
/// must be exactly `0..n`, and the two tables must agree when both are there.
fn char_table(path: &Path, dict: &BTreeMap<HashableValue, Value>) -> Result<Option<Vec<String>>> {
    let bad = |reason: &str| meta_error(path, reason);
    let mut by_id: BTreeMap<usize, String> = BTreeMap::new();
    if let Some(itos) = dict.get(&key("itos")) {
        let Value::Dict(itos) = itos else {
            return Err(bad("itos is not a dict of int to str"));
        };
        for (id, text) in itos {
            match (as_index(id), text) {
                (Some(id), Value::String(text)) => by_id.insert(id, text.clone()),
                _ => return Err(bad("itos is not a dict of int to str")),
            };
        }
    }
    if let Some(stoi) = dict.get(&key("stoi")) {
        let Value::Dict(stoi) = stoi else {
            return Err(bad("stoi is not a dict of str to int"));
        };
        let from_itos = !by_id.is_empty();
        for (text, id) in stoi {
            let (HashableValue::String(text), Value::I64(id)) = (text, id) else {
                return Err(bad("stoi is not a dict of str to int"));
            };
            let id = usize::try_from(*id).map_err(|_| bad("stoi holds a negative id"))?;
            if !from_itos {
                by_id.insert(id, text.clone());
            } else if by_id.get(&id) != Some(text) {
                return Err(meta_error(
                    path,
                    format!("stoi maps {text:?} to {id}, which itos does not map back to it"),
                ));
            }
        }
        if from_itos && stoi.len() != by_id.len() {
            return Err(bad("stoi and itos hold different numbers of entries"));
        }
    }
    if by_id.is_empty() {
        return Ok(None);
    }
    if by_id.keys().copied().ne(0..by_id.len()) {
        return Err(bad(
            "the token ids of itos / stoi are not 0, 1, 2, ... without gaps",
        ));
    }
    Ok(Some(by_id.into_values().collect()))
}

/// Reads a `meta.pkl` as nanoGPT's `prepare.py` writes it (any pickle protocol).
pub fn read_meta(path: &Path) -> Result<DatasetMeta> {
    let bytes = crate::launch::read_file(path)?;
    let value = serde_pickle::value_from_slice(&bytes, DeOptions::new())
        .map_err(|e| meta_error(path, format!("not a pickle nanoGPT writes: {e}")))?;
    let Value::Dict(dict) = value else {
        return Err(meta_error(path, "the pickle is not a dict"));
    };
    let itos = char_table(path, &dict)?;
    let vocab_size = match dict.get(&key("vocab_size")) {
        Some(Value::I64(n)) => {
            usize::try_from(*n).map_err(|_| meta_error(path, "vocab_size is negative"))?
        }
        Some(_) => return Err(meta_error(path, "vocab_size is not an int")),
        None => itos
            .as_ref()
            .map(Vec::len)
            .ok_or_else(|| meta_error(path, "it holds neither vocab_size nor itos / stoi"))?,
    };
    if let Some(itos) = &itos
        && itos.len() > vocab_size
    {
        return Err(meta_error(
            path,
            format!(
                "itos has {} entries, more than vocab_size {vocab_size}",
                itos.len()
            ),
        ));
    }
    if vocab_size == 0 {
        return Err(meta_error(path, "vocab_size is 0"));
    }
    Ok(DatasetMeta { vocab_size, itos })
}

/// The `meta.pkl` of a dataset folder, if `data` is one and has it.
pub fn dataset_meta(data: &Path) -> Result<Option<DatasetMeta>> {
    let path = data.join(META_FILE);
    if data.is_dir() && path.exists() {
        read_meta(&path).map(Some)
    } else {
        Ok(None)
    }
}

/// Whether `data` is a dataset folder with a validation split.
pub fn has_val_split(data: &Path) -> bool {
    data.is_dir() && data.join(VAL_FILE).is_file()
}

/// Whether `data` holds token ids (a `.bin` file or a dataset folder) rather than text.
pub fn is_token_data(data: &Path) -> bool {
    data.is_dir() || super::corpus::is_token_file(data)
}

fn read_bin(path: &Path) -> Result<TokenData> {
    let bytes = crate::launch::read_file(path)?;
    Ok(TokenData {
        path: path.to_path_buf(),
        tokens: decode_u16_tokens(path, &bytes)?,
    })
}

/// Loads `data`: a dataset folder's `train.bin` and `val.bin` (if any), or one file as
/// [`load_tokens`] reads it (no validation split).
pub fn load_dataset(data: &Path, tokenizer: &Tokenizer) -> Result<Dataset> {
    if !data.is_dir() {
        return Ok(Dataset {
            train: load_tokens(data, tokenizer)?,
            val: None,
        });
    }
    let train: PathBuf = data.join(TRAIN_FILE);
    let val = data.join(VAL_FILE);
    Ok(Dataset {
        train: read_bin(&train)?,
        val: if val.exists() {
            Some(read_bin(&val)?)
        } else {
            None
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hypershard-meta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    /// `pickle.dumps({'vocab_size': 3, 'itos': {0: '\n', 1: 'a', 2: 'b'}, 'stoi': {'\n': 0,
    /// 'a': 1, 'b': 2}})` as Python 3.11 writes it (its default, protocol 4, with a frame and
    /// memo opcodes): what nanoGPT's `prepare.py` leaves in `meta.pkl`.
    const PYTHON_PROTOCOL_4: [u8; 83] = [
        128, 4, 149, 72, 0, 0, 0, 0, 0, 0, 0, 125, 148, 40, 140, 10, 118, 111, 99, 97, 98, 95, 115,
        105, 122, 101, 148, 75, 3, 140, 4, 105, 116, 111, 115, 148, 125, 148, 40, 75, 0, 140, 1,
        10, 148, 75, 1, 140, 1, 97, 148, 75, 2, 140, 1, 98, 148, 117, 140, 4, 115, 116, 111, 105,
        148, 125, 148, 40, 104, 4, 75, 0, 104, 5, 75, 1, 104, 6, 75, 2, 117, 117, 46,
    ];

    #[test]
    fn a_meta_pkl_python_wrote_is_read() {
        let path = scratch("python.pkl");
        std::fs::write(&path, PYTHON_PROTOCOL_4).unwrap();
        let meta = read_meta(&path).unwrap();
        assert_eq!(meta.vocab_size, 3);
        assert_eq!(
            meta.itos,
            Some(vec!["\n".to_string(), "a".to_string(), "b".to_string()])
        );
    }

    fn pickle(value: Value) -> Vec<u8> {
        serde_pickle::value_to_vec(&value, serde_pickle::SerOptions::new()).unwrap()
    }

    fn dict(entries: Vec<(&str, Value)>) -> Value {
        Value::Dict(entries.into_iter().map(|(k, v)| (key(k), v)).collect())
    }

    fn itos(entries: &[(i64, &str)]) -> Value {
        Value::Dict(
            entries
                .iter()
                .map(|(i, s)| (HashableValue::I64(*i), Value::String(s.to_string())))
                .collect(),
        )
    }

    #[test]
    fn tables_that_do_not_fit_are_refused_naming_why() {
        let path = scratch("bad.pkl");
        let reason = |value: Value| {
            std::fs::write(&path, pickle(value)).unwrap();
            match read_meta(&path) {
                Err(Error::DatasetMeta { reason, .. }) => reason,
                other => panic!("expected DatasetMeta, got {other:?}"),
            }
        };
        assert!(reason(Value::List(vec![])).contains("not a dict"));
        assert!(reason(dict(vec![("itos", itos(&[(0, "a"), (2, "b")]))])).contains("gaps"));
        assert!(
            reason(dict(vec![
                ("vocab_size", Value::I64(1)),
                ("itos", itos(&[(0, "a"), (1, "b")]))
            ]))
            .contains("more than vocab_size 1")
        );
        let stoi = Value::Dict(
            [("a", 1), ("b", 0)]
                .iter()
                .map(|(s, i)| (key(s), Value::I64(*i)))
                .collect(),
        );
        assert!(
            reason(dict(vec![
                ("itos", itos(&[(0, "a"), (1, "b")])),
                ("stoi", stoi)
            ]))
            .contains("itos does not map back")
        );
        assert!(reason(dict(vec![("other", Value::None)])).contains("neither vocab_size"));
        std::fs::write(&path, b"not a pickle").unwrap();
        assert!(matches!(read_meta(&path), Err(Error::DatasetMeta { .. })));
        // A vocabulary size alone (a BPE dataset) is fine: no char table.
        std::fs::write(&path, pickle(dict(vec![("vocab_size", Value::I64(50257))]))).unwrap();
        assert_eq!(
            read_meta(&path).unwrap(),
            DatasetMeta {
                vocab_size: 50257,
                itos: None
            }
        );
    }
}
