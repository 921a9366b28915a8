//! Training data: corpora ([`load_tokens`]), nanoGPT dataset folders ([`load_dataset`]), tokenizers ([`Tokenizer`]) and the order in which
//! ranks read windows ([`Batcher`], [`DataOrder`]).

mod corpus;
mod dataset;
mod order;
mod tokenizer;

pub use corpus::{
    TokenData, decode_u16_tokens, default_corpus_path, is_token_file, load_tokens, write_u16_tokens,
};
pub use dataset::{
    Dataset, DatasetMeta, META_FILE, TRAIN_FILE, VAL_FILE, dataset_meta, has_val_split,
    is_token_data, load_dataset, read_meta,
};
pub use order::{BatchLayout, Batcher, DataOrder, MicroBatch, window_start};
pub use tokenizer::{GPT2_VOCAB_SIZE, Tokenizer, TokenizerKind};
