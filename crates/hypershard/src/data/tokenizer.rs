//! Tokenizers: raw bytes (vocabulary 256), GPT-2's BPE (r50k_base, vocabulary 50257,
//! through `tiktoken-rs`, which compiles the vocabulary into the binary: no download), and a
//! nanoGPT dataset's characters (the `itos` table of its `meta.pkl`).

use std::collections::HashMap;

use crate::error::{Error, Result};

/// Which tokenizer to use (`--tokenizer`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per byte of UTF-8 (or any) text.
    Bytes,
    /// GPT-2's byte-pair encoding.
    Gpt2,
    /// One token per character of a dataset's vocabulary (nanoGPT's `meta.pkl`); chosen by
    /// the dataset, not on the command line.
    #[value(skip)]
    Char,
}

impl TokenizerKind {
    /// The name used on the command line and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            TokenizerKind::Bytes => "bytes",
            TokenizerKind::Gpt2 => "gpt2",
            TokenizerKind::Char => "char",
        }
    }
}

/// GPT-2's vocabulary size (50 000 merges + 256 bytes + `<|endoftext|>`).
pub const GPT2_VOCAB_SIZE: usize = 50_257;

enum Inner {
    Bytes,
    Gpt2(Box<tiktoken_rs::CoreBPE>),
    Chars {
        itos: Vec<String>,
        stoi: HashMap<String, u32>,
    },
}

/// A text ↔ token-id codec.
pub struct Tokenizer {
    kind: TokenizerKind,
    inner: Inner,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer (gpt2 parses its bundled vocabulary, a fraction of a second).
    /// The char tokenizer needs its vocabulary: see [`Tokenizer::chars`].
    pub fn new(kind: TokenizerKind) -> Result<Tokenizer> {
        let inner = match kind {
            TokenizerKind::Bytes => Inner::Bytes,
            TokenizerKind::Char => {
                return Err(Error::Tokenizer {
                    reason: "the char tokenizer needs a vocabulary (a dataset's meta.pkl)"
                        .to_string(),
                });
            }
            TokenizerKind::Gpt2 => {
                Inner::Gpt2(Box::new(tiktoken_rs::r50k_base().map_err(|error| {
                    Error::Tokenizer {
                        reason: format!("gpt2: {error}"),
                    }
                })?))
            }
        };
        Ok(Tokenizer { kind, inner })
    }

    /// The char tokenizer whose token `i` is `itos[i]` (nanoGPT's `meta.pkl` table).
    pub fn chars(itos: Vec<String>) -> Tokenizer {
        let stoi = itos
            .iter()
            .enumerate()
            // invariant: a vocabulary read from u16 token files has at most 65536 entries.
            .map(|(i, s)| (s.clone(), u32::try_from(i).unwrap_or(u32::MAX)))
            .collect();
        Tokenizer {
            kind: TokenizerKind::Char,
            inner: Inner::Chars { itos, stoi },
        }
    }

    /// The tokenizer a training run records: `kind`, with `vocabulary` for the char tokenizer.
    pub fn from_parts(kind: TokenizerKind, vocabulary: Option<&[String]>) -> Result<Tokenizer> {
        match (kind, vocabulary) {
            (TokenizerKind::Char, Some(itos)) => Ok(Tokenizer::chars(itos.to_vec())),
            (kind, _) => Tokenizer::new(kind),
        }
    }

    /// The char tokenizer's table (`itos`), or `None` for the others.
    pub fn vocabulary(&self) -> Option<&[String]> {
        match &self.inner {
            Inner::Chars { itos, .. } => Some(itos),
            _ => None,
        }
    }

    /// Which tokenizer this is.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// Number of distinct token ids.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Bytes => 256,
            Inner::Gpt2(_) => GPT2_VOCAB_SIZE,
            Inner::Chars { itos, .. } => itos.len(),
        }
    }

    /// Token ids of `text` (gpt2: special tokens are encoded as ordinary text). Only the char
    /// tokenizer can fail: a character outside its vocabulary is [`Error::NotInVocabulary`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.inner {
            Inner::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Inner::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Inner::Chars { stoi, .. } => text
                .chars()
                .map(|c| {
                    let key = c.to_string();
                    stoi.get(&key)
                        .copied()
                        .ok_or(Error::NotInVocabulary { text: key })
                })
                .collect(),
        }
    }

    /// Token ids of raw bytes (the bytes tokenizer takes any bytes, not only UTF-8).
    pub fn encode_bytes(&self, bytes: &[u8]) -> Option<Vec<u32>> {
        match &self.inner {
            Inner::Bytes => Some(bytes.iter().map(|b| u32::from(*b)).collect()),
            Inner::Gpt2(_) | Inner::Chars { .. } => None,
        }
    }

    /// The text of `tokens`; bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        if let Some(&token) = tokens.iter().find(|t| **t as usize >= self.vocab_size()) {
            return Err(Error::UnknownToken {
                token,
                tokenizer: self.kind.name(),
            });
        }
        match &self.inner {
            Inner::Bytes => {
                // invariant: every token was checked to be below 256 just above.
                let bytes: Vec<u8> = tokens.iter().map(|t| *t as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Inner::Gpt2(bpe) => {
                let bytes = bpe
                    ._decode_native_and_split(tokens.to_vec())
                    .flatten()
                    .collect::<Vec<u8>>();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            // invariant: every token was checked to be below the table's length above.
            Inner::Chars { itos, .. } => {
                Ok(tokens.iter().map(|t| itos[*t as usize].as_str()).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_reject_large_ids() {
        let t = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        assert_eq!(t.encode("Ab").unwrap(), vec![65, 98]);
        assert_eq!(t.decode(&[72, 105]).unwrap(), "Hi");
        assert!(matches!(
            t.decode(&[256]),
            Err(Error::UnknownToken { token: 256, .. })
        ));
    }

    #[test]
    fn gpt2_matches_known_ids() {
        let t = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        assert_eq!(t.vocab_size(), 50_257);
        // GPT-2's well-known ids: "Hello" = 15496, " world" = 995.
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.decode(&[15496, 995]).unwrap(), "Hello world");
        assert!(t.encode("<|endoftext|>").unwrap().len() > 1);
    }

    #[test]
    fn chars_follow_the_table_and_refuse_what_it_lacks() {
        let itos: Vec<String> = ["\n", " ", "a", "b", "é"].map(String::from).to_vec();
        let t = Tokenizer::chars(itos.clone());
        assert_eq!(t.kind(), TokenizerKind::Char);
        assert_eq!(t.vocab_size(), 5);
        assert_eq!(t.encode("ab é\n").unwrap(), vec![2, 3, 1, 4, 0]);
        assert_eq!(t.decode(&[3, 2, 0, 4]).unwrap(), "ba\né");
        assert!(matches!(
            t.encode("abc"),
            Err(Error::NotInVocabulary { text }) if text == "c"
        ));
        assert!(matches!(
            t.decode(&[5]),
            Err(Error::UnknownToken {
                token: 5,
                tokenizer: "char"
            })
        ));
        assert!(matches!(
            Tokenizer::new(TokenizerKind::Char),
            Err(Error::Tokenizer { .. })
        ));
        let rebuilt = Tokenizer::from_parts(TokenizerKind::Char, Some(&itos)).unwrap();
        assert_eq!(rebuilt.vocabulary(), Some(itos.as_slice()));
    }
}
