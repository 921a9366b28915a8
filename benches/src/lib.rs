//! Criterion benchmarks for hypershard live in `benches/benches/`; this library is empty so the
//! package has a target to hang them on.
