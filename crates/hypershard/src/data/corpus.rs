//! Loading a training corpus: a text file through a [`Tokenizer`], or a nanoGPT `.bin` file
//! (little-endian `u16` token ids, as nanoGPT's `prepare.py` writes them).

use std::path::{Path, PathBuf};

use super::tokenizer::Tokenizer;
use crate::error::{Error, FileAction, Result};

/// The corpus that ships with hypershard (four Shakespeare plays, public domain; see
/// `data/README.md`), found relative to this crate's sources.
pub fn default_corpus_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt")
}

/// A corpus as token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenData {
    /// Where it was read from (for error messages).
    pub path: PathBuf,
    /// The token ids, in file order.
    pub tokens: Vec<u32>,
}

impl TokenData {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Checks every id is below `vocab_size` (a `.bin` file may come from a larger vocabulary).
    pub fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        match self.tokens.iter().position(|t| *t as usize >= vocab_size) {
            None => Ok(()),
            Some(position) => Err(Error::TokenOutOfRange {
                path: self.path.clone(),
                token: self.tokens[position],
                position,
                vocab_size,
            }),
        }
    }

    /// Splits off the last `fraction` of the tokens (a held-out set for evaluation).
    pub fn split_tail(self, fraction: f64) -> (TokenData, TokenData) {
        let keep = ((self.tokens.len() as f64) * (1.0 - fraction)).round() as usize;
        let keep = keep.min(self.tokens.len());
        let mut head = self.tokens;
        let tail = head.split_off(keep);
        (
            TokenData {
                path: self.path.clone(),
                tokens: head,
            },
            TokenData {
                path: self.path,
                tokens: tail,
            },
        )
    }
}

/// Whether `path` names a nanoGPT token file (extension `.bin`).
pub fn is_token_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "bin")
}

/// Reads `path`: a `.bin` file as little-endian `u16` ids, anything else as text encoded with
/// `tokenizer` (the bytes tokenizer takes any bytes; gpt2 needs UTF-8).
pub fn load_tokens(path: &Path, tokenizer: &Tokenizer) -> Result<TokenData> {
    let bytes = crate::launch::read_file(path)?;
    let tokens = if is_token_file(path) {
        decode_u16_tokens(path, &bytes)?
    } else if let Some(tokens) = tokenizer.encode_bytes(&bytes) {
        tokens
    } else {
        let text = std::str::from_utf8(&bytes).map_err(|e| Error::NotUtf8 {
            path: path.to_path_buf(),
            valid_up_to: e.valid_up_to(),
        })?;
        tokenizer.encode(text)?
    };
    Ok(TokenData {
        path: path.to_path_buf(),
        tokens,
    })
}

/// Decodes nanoGPT's `.bin` layout: consecutive little-endian `u16`s, no header.
pub fn decode_u16_tokens(path: &Path, bytes: &[u8]) -> Result<Vec<u32>> {
    if !bytes.len().is_multiple_of(2) {
        return Err(Error::CorruptTokenFile {
            path: path.to_path_buf(),
            bytes: bytes.len() as u64,
        });
    }
    // Twice the file's size in memory: reserved fallibly, as the file itself was read.
    let count = bytes.len() / 2;
    let mut tokens: Vec<u32> = Vec::new();
    tokens
        .try_reserve_exact(count)
        .map_err(|e| Error::AllocationRefused {
            what: format!("the token ids of {}", path.display()),
            bytes: (count as u64).saturating_mul(4),
            reason: format!("the allocator refused it ({e})"),
        })?;
    tokens.extend(
        bytes
            .chunks_exact(2)
            .map(|pair| u32::from(u16::from_le_bytes([pair[0], pair[1]]))),
    );
    Ok(tokens)
}

/// Writes `tokens` as a nanoGPT `.bin` file (every id must fit in `u16`).
pub fn write_u16_tokens(path: &Path, tokens: &[u32]) -> Result<()> {
    let mut bytes = Vec::with_capacity(tokens.len() * 2);
    for (position, token) in tokens.iter().enumerate() {
        let value = u16::try_from(*token).map_err(|_| Error::TokenOutOfRange {
            path: path.to_path_buf(),
            token: *token,
            position,
            vocab_size: usize::from(u16::MAX) + 1,
        })?;
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    std::fs::write(path, bytes).map_err(|e| Error::io(FileAction::Write, path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TokenizerKind;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hypershard-corpus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn bin_files_are_little_endian_u16() {
        let path = scratch("t.bin");
        std::fs::write(&path, [1u8, 0, 0, 1, 0xff, 0xff]).unwrap();
        let bytes = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        let data = load_tokens(&path, &bytes).unwrap();
        assert_eq!(data.tokens, vec![1, 256, 65535]);
        assert!(matches!(
            data.check_vocab(50_257),
            Err(Error::TokenOutOfRange {
                token: 65535,
                position: 2,
                ..
            })
        ));
        write_u16_tokens(&path, &[7, 300]).unwrap();
        assert_eq!(load_tokens(&path, &bytes).unwrap().tokens, vec![7, 300]);
    }

    #[test]
    fn corrupt_and_missing_files_are_typed_errors() {
        let path = scratch("odd.bin");
        std::fs::write(&path, [1u8, 2, 3]).unwrap();
        let bytes = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        assert!(matches!(
            load_tokens(&path, &bytes),
            Err(Error::CorruptTokenFile { bytes: 3, .. })
        ));
        let missing = scratch("does-not-exist.txt");
        assert!(matches!(
            load_tokens(&missing, &bytes),
            Err(Error::Io {
                action: FileAction::Read,
                ..
            })
        ));
        let bad_utf8 = scratch("bad.txt");
        std::fs::write(&bad_utf8, [b'a', 0xff, b'b']).unwrap();
        assert_eq!(
            load_tokens(&bad_utf8, &bytes).unwrap().tokens,
            vec![97, 255, 98]
        );
        let gpt2 = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        assert!(matches!(
            load_tokens(&bad_utf8, &gpt2),
            Err(Error::NotUtf8 { valid_up_to: 1, .. })
        ));
    }

    #[test]
    fn the_shipped_corpus_is_large_english_text() {
        let bytes = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        let data = load_tokens(&default_corpus_path(), &bytes).unwrap();
        assert!(data.len() >= 200_000);
        let text = bytes.decode(&data.tokens[..2000]).unwrap();
        assert!(text.contains("HAMLET"));
    }
}
