//! Stands in for the TCP backend's algorithm knobs when the crate is built without the `tcp`
//! feature.
//!
//! Phase-0 descriptors carry the TCP backend's algorithm knobs (`None` on `local`, whose ranks
//! share one config). Without the TCP backend no group can have knobs, so the type is
//! uninhabited: `Option<AlgorithmKnobs>` is always `None` and the comparison below can never
//! run.

use crate::op::Knob;

/// The TCP backend's algorithm knobs; no value exists without that backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AlgorithmKnobs {}

impl AlgorithmKnobs {
    /// Mirrors the TCP build's method; unreachable, as no `AlgorithmKnobs` exists.
    pub(crate) fn first_difference(&self, _other: &AlgorithmKnobs) -> Option<Knob> {
        match *self {}
    }
}
