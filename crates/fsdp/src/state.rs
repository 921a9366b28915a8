//! The named states of FSDP's two state machines: where a parameter's values live
//! ([`ShardedState`]) and which hook a unit is in ([`TrainingState`], whose transitions are
//! asserted). Apart from the parameter and the group so that errors can name them without an
//! import loop.

/// Where a parameter's values live right now (FSDP2's `ShardedState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardedState {
    /// Only the local shard exists; the module sees the shard.
    Sharded,
    /// After forward with `reshard_after_forward = int`: a larger shard over a smaller group
    /// is kept for backward; the module sees the shard.
    ShardedPostForward,
    /// The whole parameter exists (in `param_dtype`); the module sees it during forward and
    /// backward.
    Unsharded,
}

/// Which hook a unit is in (FSDP2's `TrainingState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrainingState {
    /// Between hooks.
    Idle,
    /// Inside the unit's forward.
    Forward,
    /// The unit's forward ran again during backward (activation checkpointing recomputes it)
    /// and its backward has not started: the parameters stay unsharded for that backward, so
    /// the recomputation's all-gather is the backward's.
    ForwardInBackward,
    /// Inside the unit's backward, before the wrapped module's backward returned.
    PreBackward,
    /// Reducing gradients after the wrapped module's backward.
    PostBackward,
}

impl TrainingState {
    /// Whether a unit may go from `self` to `next`: `Idle → Forward → Idle` in forward,
    /// `Idle → ForwardInBackward → PreBackward` when backward recomputes the forward, and
    /// `Idle | ForwardInBackward → PreBackward → PostBackward → Idle` in backward.
    pub(crate) fn may_enter(self, next: TrainingState) -> bool {
        use TrainingState::*;
        matches!(
            (self, next),
            (Idle, Forward | ForwardInBackward | PreBackward)
                | (Forward, Idle)
                | (ForwardInBackward, PreBackward)
                | (PreBackward, PostBackward)
                | (PostBackward, Idle)
        )
    }
}
