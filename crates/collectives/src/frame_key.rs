//! Which frame a transport error is about: [`FrameKind`] and [`FrameKey`], as read from a
//! frame header. They live below the transports because [`Error`](crate::Error) names them.

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameKind {
    /// A phase-0 descriptor: the sender's view of the op's arguments.
    Descriptor,
    /// A chunk of op data.
    Data,
    /// The sender failed the op; the payload names why.
    Failure,
    /// A point-to-point message (send/recv), filed by its user tag.
    Message,
}

impl FrameKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            FrameKind::Descriptor => 1,
            FrameKind::Data => 2,
            FrameKind::Failure => 3,
            FrameKind::Message => 4,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<FrameKind> {
        match code {
            1 => Some(FrameKind::Descriptor),
            2 => Some(FrameKind::Data),
            3 => Some(FrameKind::Failure),
            4 => Some(FrameKind::Message),
            _ => None,
        }
    }
}

/// Which frame: the communicator it belongs to, the op's sequence number, the tag
/// (user tag for send/recv, step of an algorithm otherwise) and the frame kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrameKey {
    /// The communicator (world or split group).
    pub group: u32,
    /// The op's sequence number in its group.
    pub seq: u64,
    /// The tag or algorithm step.
    pub tag: u32,
    /// What the frame carries.
    pub kind: FrameKind,
}
