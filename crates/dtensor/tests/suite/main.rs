//! The multi-rank test suite of hypershard-dtensor, as one test binary (one link on CI).

mod common;
mod construct;
mod op_properties;
mod ops;
mod process_mesh;
mod properties;
// Ranks as processes over the TCP backend (feature `tcp`, on by default).
#[cfg(feature = "tcp")]
mod tcp;
mod transitions;
