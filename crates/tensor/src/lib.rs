//! The local dense tensor of hypershard.
#![deny(missing_docs)]
