//! [`Faults`]: the first local argument error of a rank, which phase 0 posts to the peers
//! instead of returning it, so that every rank fails the op together.

use crate::buffer::{Buffer, HostBuffer};
use crate::dtype::DType;
use crate::error::Error;
use crate::op::{BufferRole, OpKind, ReduceOp};
use crate::reduce::ReducePlan;

/// Collects the first local argument error of a rank.
pub(crate) struct Faults {
    pub(crate) op: OpKind,
    pub(crate) first: Option<Error>,
}

impl Faults {
    pub(crate) fn new(op: OpKind) -> Self {
        Faults { op, first: None }
    }

    pub(crate) fn add(&mut self, error: Error) {
        self.first.get_or_insert(error);
    }

    pub(crate) fn length(&mut self, role: BufferRole, expected: usize, got: usize) {
        if expected != got {
            let op = self.op;
            self.add(Error::LengthMismatch {
                op,
                role,
                expected,
                got,
            });
        }
    }

    pub(crate) fn dtype(&mut self, role: BufferRole, expected: DType, got: DType) {
        if expected != got {
            let op = self.op;
            self.add(Error::DTypeMismatch {
                op,
                role,
                expected,
                got,
            });
        }
    }

    pub(crate) fn rank(&mut self, rank: usize, size: usize) {
        if rank >= size {
            let op = self.op;
            self.add(Error::InvalidRank { op, rank, size });
        }
    }

    /// The host memory of `buffer`; a device buffer becomes a fault naming `backend` and an
    /// empty placeholder.
    pub(crate) fn host(&mut self, buffer: Buffer, backend: &'static str) -> HostBuffer {
        let dtype = buffer.dtype();
        let location = buffer.location();
        match buffer.into_host() {
            Ok(host) => host,
            Err(_) => {
                let op = self.op;
                self.add(Error::UnsupportedBuffer {
                    op,
                    location,
                    backend,
                });
                HostBuffer::zeros(dtype, 0)
            }
        }
    }

    pub(crate) fn plan(&mut self, op: ReduceOp, dtype: DType, world: usize) -> Option<ReducePlan> {
        match ReducePlan::new(op, dtype, world) {
            Ok(plan) => Some(plan.for_op(self.op)),
            Err(error) => {
                self.add(error);
                None
            }
        }
    }
}
