//! Tokenizers: raw bytes (vocabulary 256) and GPT-2's BPE (r50k_base, vocabulary 50257,
//! through `tiktoken-rs`, which compiles the vocabulary into the binary: no download).

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
}

impl TokenizerKind {
    /// The name used on the command line and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            TokenizerKind::Bytes => "bytes",
            TokenizerKind::Gpt2 => "gpt2",
        }
    }
}

/// GPT-2's vocabulary size (50 000 merges + 256 bytes + `<|endoftext|>`).
pub const GPT2_VOCAB_SIZE: usize = 50_257;

enum Inner {
    Bytes,
    Gpt2(Box<tiktoken_rs::CoreBPE>),
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
    pub fn new(kind: TokenizerKind) -> Result<Tokenizer> {
        let inner = match kind {
            TokenizerKind::Bytes => Inner::Bytes,
            TokenizerKind::Gpt2 => {
                Inner::Gpt2(Box::new(tiktoken_rs::r50k_base().map_err(|error| {
                    Error::Tokenizer {
                        reason: error.to_string(),
                    }
                })?))
            }
        };
        Ok(Tokenizer { kind, inner })
    }

    /// Which tokenizer this is.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// Number of distinct token ids.
    pub fn vocab_size(&self) -> usize {
        match self.inner {
            Inner::Bytes => 256,
            Inner::Gpt2(_) => GPT2_VOCAB_SIZE,
        }
    }

    /// Token ids of `text` (gpt2: special tokens are encoded as ordinary text).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match &self.inner {
            Inner::Bytes => text.bytes().map(u32::from).collect(),
            Inner::Gpt2(bpe) => bpe.encode_ordinary(text),
        }
    }

    /// Token ids of raw bytes (the bytes tokenizer takes any bytes, not only UTF-8).
    pub fn encode_bytes(&self, bytes: &[u8]) -> Option<Vec<u32>> {
        match &self.inner {
            Inner::Bytes => Some(bytes.iter().map(|b| u32::from(*b)).collect()),
            Inner::Gpt2(_) => None,
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_reject_large_ids() {
        let t = Tokenizer::new(TokenizerKind::Bytes).unwrap();
        assert_eq!(t.encode("Ab"), vec![65, 98]);
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
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        assert_eq!(t.decode(&[15496, 995]).unwrap(), "Hello world");
        assert!(t.encode("<|endoftext|>").len() > 1);
    }
}
