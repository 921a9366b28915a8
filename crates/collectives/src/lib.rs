//! Backend-agnostic collectives for hypershard.
