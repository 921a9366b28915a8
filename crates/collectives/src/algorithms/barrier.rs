//! Barrier by dissemination: in round `k` every rank signals rank `+2^k` and waits for rank
//! `-2^k`, so after `ceil(log2 size)` rounds every rank has (transitively) heard from all.

use super::link::Link;
use crate::agree::{Desc, Faults};
use crate::algorithms::group::Inner;
use crate::dtype::DType;
use crate::engine::JobContext;
use crate::error::Result;
use crate::op::OpKind;
use crate::transport::tcp::frame::FrameKind;

pub(crate) fn barrier(inner: &Inner, ctx: &JobContext) -> Result<()> {
    let kind = OpKind::Barrier;
    let link = Link::collective(inner, ctx, kind);
    link.open(Desc::new(kind), Faults::new(kind))?;
    let mut distance = 1;
    let mut round = 0u32;
    while distance < link.size() {
        link.send_frame(link.right(distance), FrameKind::Data, DType::U8, round, &[])?;
        link.recv_frame(link.left(distance), FrameKind::Data, round)?;
        distance *= 2;
        round += 1;
    }
    Ok(())
}
