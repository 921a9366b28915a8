//! Training data: corpora ([`load_tokens`]), tokenizers ([`Tokenizer`]) and the order in which
//! ranks read windows ([`Batcher`], [`DataOrder`]).

mod corpus;
mod order;
mod tokenizer;

pub use corpus::{
    TokenData, decode_u16_tokens, default_corpus_path, is_token_file, load_tokens, write_u16_tokens,
};
pub use order::{BatchLayout, Batcher, DataOrder, MicroBatch, window_start};
pub use tokenizer::{GPT2_VOCAB_SIZE, Tokenizer, TokenizerKind};
