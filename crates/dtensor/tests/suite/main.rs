//! The multi-rank test suite of hypershard-dtensor, as one test binary (one link on CI).

mod common;
mod construct;
mod op_properties;
mod ops;
mod process_mesh;
mod properties;
mod tcp;
mod transitions;
