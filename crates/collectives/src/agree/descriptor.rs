//! The wire form of a phase-0 descriptor: what a rank tells every peer about its call before
//! any data moves, so that every rank runs the same checks (`agree::validate`) over the same
//! descriptors and reaches the same verdict.
//!
//! Layout (little-endian): `op u8, dtype u8 (0xff = none), len opt-u64, root opt-u64,
//! reduce u8 (0 = none, 1 + index in ReduceOp::ALL) with f64 factor for PreMulSum,
//! counts opt-list, all-to-all counts opt-(list, list), split opt-(opt-u32, i64),
//! fault u8 (0 = none) + fields, knobs opt-(segment u64, all-reduce u8, small u64,
//! halving u64, broadcast u8, tree u64)`. An optional value is a presence byte (0 or 1) then the value;
//! a list is a u64 length then u64 items. Decoding is total: any malformed descriptor is an
//! [`Error::Protocol`] with [`ProtocolViolation::BadDescriptor`] naming the byte offset.

use super::Desc;
use crate::buffer::BufferLocation;
use crate::dtype::DType;
use crate::error::{Error, ProtocolViolation, Result};
use crate::op::{AllToAllCounts, BufferRole, Knob, OpKind, ReduceOp};

/// The knobs of a TCP group that decide which algorithm an op runs and how it cuts the data.
/// Every descriptor carries them, so ranks configured differently get
/// [`Argument::AlgorithmKnob`](crate::op::Argument::AlgorithmKnob) on every op instead of
/// running mismatched exchanges (garbage or a timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AlgorithmKnobs {
    pub(crate) segment_bytes: u64,
    pub(crate) all_reduce: u8,
    pub(crate) small_all_reduce_bytes: u64,
    pub(crate) halving_doubling_bytes: u64,
    pub(crate) broadcast: u8,
    pub(crate) tree_broadcast_bytes: u64,
}

impl AlgorithmKnobs {
    /// The first knob in which `other` differs from `self`, if any.
    pub(crate) fn first_difference(&self, other: &AlgorithmKnobs) -> Option<Knob> {
        let knobs = [
            (
                self.segment_bytes == other.segment_bytes,
                Knob::SegmentBytes,
            ),
            (
                self.all_reduce == other.all_reduce,
                Knob::AllReduceAlgorithm,
            ),
            (
                self.small_all_reduce_bytes == other.small_all_reduce_bytes,
                Knob::SmallAllReduceBytes,
            ),
            (
                self.halving_doubling_bytes == other.halving_doubling_bytes,
                Knob::HalvingDoublingBytes,
            ),
            (self.broadcast == other.broadcast, Knob::BroadcastAlgorithm),
            (
                self.tree_broadcast_bytes == other.tree_broadcast_bytes,
                Knob::TreeBroadcastBytes,
            ),
        ];
        knobs
            .into_iter()
            .find_map(|(same, knob)| (!same).then_some(knob))
    }
}

/// The backend name reported in [`Error::UnsupportedBuffer`] faults decoded from the wire.
const BACKEND: &str = "tcp";

const NONE_CODE: u8 = 0xff;

fn op_code(op: OpKind) -> u8 {
    // OpKind::ALL lists every kind once; its index is the wire code.
    OpKind::ALL
        .iter()
        .position(|k| *k == op)
        .map_or(NONE_CODE, |i| i as u8)
}

fn dtype_code(dtype: DType) -> u8 {
    DType::ALL
        .iter()
        .position(|d| *d == dtype)
        .map_or(NONE_CODE, |i| i as u8)
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Max => 3,
        ReduceOp::Min => 4,
        ReduceOp::Product => 5,
        ReduceOp::PreMulSum(_) => 6,
    }
}

fn location_code(location: BufferLocation) -> u8 {
    match location {
        BufferLocation::Host => 0,
        // Device ordinals travel as `1 + ordinal` (saturating: nobody has 255 devices a node).
        #[cfg(feature = "nccl")]
        BufferLocation::Cuda { device } => 1 + device.min(254) as u8,
    }
}

/// Fault codes: which error a rank's peers should report.
const FAULT_NONE: u8 = 0;
const FAULT_LENGTH: u8 = 1;
const FAULT_DTYPE: u8 = 2;
const FAULT_RANK: u8 = 3;
const FAULT_UNSUPPORTED_OP: u8 = 4;
const FAULT_UNSUPPORTED_BUFFER: u8 = 5;
const FAULT_LOST: u8 = 6;

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    fn opt_usize(&mut self, v: Option<usize>) {
        match v {
            Some(v) => {
                self.u8(1);
                self.usize(v);
            }
            None => self.u8(0),
        }
    }
    fn list(&mut self, items: &[usize]) {
        self.usize(items.len());
        for item in items {
            self.usize(*item);
        }
    }
    fn role_peer(&mut self, role: BufferRole) {
        // Faults on the wire are already in their peers' view (`BufferRole::Peer`); any other
        // role is sent as the sender's own rank by the caller, so only the rank travels.
        match role {
            BufferRole::Peer { rank } => {
                self.u8(1);
                self.usize(rank);
            }
            _ => self.u8(0),
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    peer: usize,
}

impl Reader<'_> {
    fn bad(&self) -> Error {
        Error::Protocol {
            peer: Some(self.peer),
            violation: ProtocolViolation::BadDescriptor { at: self.at },
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let slice = self
            .bytes
            .get(self.at..self.at + n)
            .ok_or_else(|| self.bad())?;
        self.at += n;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(w))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
    fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad())
    }
    fn flag(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.bad()),
        }
    }
    fn opt_usize(&mut self) -> Result<Option<usize>> {
        if self.flag()? {
            Ok(Some(self.usize()?))
        } else {
            Ok(None)
        }
    }
    fn list(&mut self) -> Result<Vec<usize>> {
        let n = self.usize()?;
        // Each item takes 8 bytes, so a length beyond what is left is malformed; checking it
        // first keeps a hostile length from reserving memory.
        if n > (self.bytes.len() - self.at) / 8 {
            return Err(self.bad());
        }
        (0..n).map(|_| self.usize()).collect()
    }
    fn op(&mut self) -> Result<OpKind> {
        let code = self.u8()?;
        OpKind::ALL
            .get(usize::from(code))
            .copied()
            .ok_or_else(|| self.bad())
    }
    fn dtype(&mut self) -> Result<DType> {
        let code = self.u8()?;
        DType::ALL
            .get(usize::from(code))
            .copied()
            .ok_or_else(|| self.bad())
    }
    fn opt_dtype(&mut self) -> Result<Option<DType>> {
        if self.bytes.get(self.at) == Some(&NONE_CODE) {
            self.at += 1;
            return Ok(None);
        }
        Ok(Some(self.dtype()?))
    }
    fn reduce(&mut self) -> Result<Option<ReduceOp>> {
        Ok(Some(match self.u8()? {
            0 => return Ok(None),
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            5 => ReduceOp::Product,
            6 => ReduceOp::PreMulSum(f64::from_bits(self.u64()?)),
            _ => return Err(self.bad()),
        }))
    }
    fn role_peer(&mut self) -> Result<BufferRole> {
        if self.flag()? {
            Ok(BufferRole::Peer {
                rank: self.usize()?,
            })
        } else {
            Ok(BufferRole::Peer { rank: self.peer })
        }
    }
}

fn write_fault(w: &mut Writer, fault: Option<&Error>) {
    match fault {
        None => w.u8(FAULT_NONE),
        Some(Error::LengthMismatch {
            op,
            role,
            expected,
            got,
        }) => {
            w.u8(FAULT_LENGTH);
            w.u8(op_code(*op));
            w.role_peer(*role);
            w.usize(*expected);
            w.usize(*got);
        }
        Some(Error::DTypeMismatch {
            op,
            role,
            expected,
            got,
        }) => {
            w.u8(FAULT_DTYPE);
            w.u8(op_code(*op));
            w.role_peer(*role);
            w.u8(dtype_code(*expected));
            w.u8(dtype_code(*got));
        }
        Some(Error::InvalidRank { op, rank, size }) => {
            w.u8(FAULT_RANK);
            w.u8(op_code(*op));
            w.usize(*rank);
            w.usize(*size);
        }
        Some(Error::UnsupportedOp { op, dtype }) => {
            w.u8(FAULT_UNSUPPORTED_OP);
            w.u8(reduce_code(*op));
            if let ReduceOp::PreMulSum(factor) = op {
                w.u64(factor.to_bits());
            }
            w.u8(dtype_code(*dtype));
        }
        Some(Error::UnsupportedBuffer { op, location, .. }) => {
            w.u8(FAULT_UNSUPPORTED_BUFFER);
            w.u8(op_code(*op));
            w.u8(location_code(*location));
        }
        // Any other fault has no peer form; the peers report the rank as lost (as local does).
        Some(_) => w.u8(FAULT_LOST),
    }
}

fn read_fault(r: &mut Reader<'_>, op: OpKind) -> Result<Option<Error>> {
    Ok(Some(match r.u8()? {
        FAULT_NONE => return Ok(None),
        FAULT_LENGTH => Error::LengthMismatch {
            op: r.op()?,
            role: r.role_peer()?,
            expected: r.usize()?,
            got: r.usize()?,
        },
        FAULT_DTYPE => Error::DTypeMismatch {
            op: r.op()?,
            role: r.role_peer()?,
            expected: r.dtype()?,
            got: r.dtype()?,
        },
        FAULT_RANK => Error::InvalidRank {
            op: r.op()?,
            rank: r.usize()?,
            size: r.usize()?,
        },
        FAULT_UNSUPPORTED_OP => {
            let reduce = r.reduce()?.ok_or_else(|| r.bad())?;
            Error::UnsupportedOp {
                op: reduce,
                dtype: r.dtype()?,
            }
        }
        FAULT_UNSUPPORTED_BUFFER => {
            let op = r.op()?;
            let location = match r.u8()? {
                0 => BufferLocation::Host,
                #[cfg(feature = "nccl")]
                code @ 1.. => BufferLocation::Cuda {
                    device: usize::from(code - 1),
                },
                #[cfg(not(feature = "nccl"))]
                _ => return Err(r.bad()),
            };
            Error::UnsupportedBuffer {
                op,
                location,
                backend: BACKEND,
            }
        }
        FAULT_LOST => Error::PeerLost { op, peer: r.peer },
        _ => return Err(r.bad()),
    }))
}

/// The wire bytes of `desc`.
pub(crate) fn encode(desc: &Desc) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    w.u8(op_code(desc.op));
    w.u8(desc.dtype.map_or(NONE_CODE, dtype_code));
    w.opt_usize(desc.len);
    w.opt_usize(desc.root);
    match desc.reduce {
        None => w.u8(0),
        Some(op) => {
            w.u8(reduce_code(op));
            if let ReduceOp::PreMulSum(factor) = op {
                w.u64(factor.to_bits());
            }
        }
    }
    match &desc.counts {
        None => w.u8(0),
        Some(counts) => {
            w.u8(1);
            w.list(counts);
        }
    }
    match &desc.a2a {
        None => w.u8(0),
        Some(counts) => {
            w.u8(1);
            w.list(&counts.send);
            w.list(&counts.recv);
        }
    }
    match desc.split {
        None => w.u8(0),
        Some((color, key)) => {
            w.u8(1);
            match color {
                None => w.u8(0),
                Some(color) => {
                    w.u8(1);
                    w.u32(color);
                }
            }
            w.u64(key as u64);
        }
    }
    write_fault(&mut w, desc.fault.as_ref());
    match desc.knobs {
        None => w.u8(0),
        Some(knobs) => {
            w.u8(1);
            w.u64(knobs.segment_bytes);
            w.u8(knobs.all_reduce);
            w.u64(knobs.small_all_reduce_bytes);
            w.u64(knobs.halving_doubling_bytes);
            w.u8(knobs.broadcast);
            w.u64(knobs.tree_broadcast_bytes);
        }
    }
    w.0
}

/// Parses the descriptor `peer` sent; every byte must be accounted for.
pub(crate) fn decode(bytes: &[u8], peer: usize) -> Result<Desc> {
    let mut r = Reader { bytes, at: 0, peer };
    let mut desc = Desc::new(r.op()?);
    desc.dtype = r.opt_dtype()?;
    desc.len = r.opt_usize()?;
    desc.root = r.opt_usize()?;
    desc.reduce = r.reduce()?;
    if r.flag()? {
        desc.counts = Some(r.list()?);
    }
    if r.flag()? {
        let send = r.list()?;
        let recv = r.list()?;
        desc.a2a = Some(AllToAllCounts { send, recv });
    }
    if r.flag()? {
        let color = if r.flag()? { Some(r.u32()?) } else { None };
        desc.split = Some((color, r.u64()? as i64));
    }
    desc.fault = read_fault(&mut r, desc.op)?;
    if r.flag()? {
        desc.knobs = Some(AlgorithmKnobs {
            segment_bytes: r.u64()?,
            all_reduce: r.u8()?,
            small_all_reduce_bytes: r.u64()?,
            halving_doubling_bytes: r.u64()?,
            broadcast: r.u8()?,
            tree_broadcast_bytes: r.u64()?,
        });
    }
    if r.at != bytes.len() {
        return Err(r.bad());
    }
    Ok(desc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(desc: &Desc, peer: usize) -> Desc {
        decode(&encode(desc), peer).unwrap()
    }

    fn same(a: &Desc, b: &Desc) -> bool {
        // Desc holds an Error, which is not PartialEq; compare the debug forms instead.
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn every_field_round_trips() {
        let mut desc = Desc::new(OpKind::AllToAllV);
        desc.dtype = Some(DType::BF16);
        desc.len = Some(12);
        desc.root = Some(3);
        desc.reduce = Some(ReduceOp::PreMulSum(0.25));
        desc.counts = Some(vec![1, 0, 7]);
        desc.a2a = Some(AllToAllCounts {
            send: vec![2, 3],
            recv: vec![4, 0],
        });
        desc.split = Some((Some(9), -5));
        desc.knobs = Some(AlgorithmKnobs {
            segment_bytes: 256,
            all_reduce: 3,
            small_all_reduce_bytes: 1 << 16,
            halving_doubling_bytes: 4 << 20,
            broadcast: 1,
            tree_broadcast_bytes: 7,
        });
        desc.fault = Some(Error::LengthMismatch {
            op: OpKind::AllToAllV,
            role: BufferRole::Peer { rank: 1 },
            expected: 10,
            got: 9,
        });
        assert!(same(&round_trip(&desc, 1), &desc));

        let bare = Desc::new(OpKind::Barrier);
        assert!(same(&round_trip(&bare, 0), &bare));
        for op in OpKind::ALL {
            assert_eq!(round_trip(&Desc::new(op), 0).op, op);
        }
        for reduce in ReduceOp::ALL {
            let mut d = Desc::new(OpKind::AllReduce);
            d.reduce = Some(reduce);
            assert_eq!(round_trip(&d, 0).reduce, Some(reduce));
        }
        let mut no_color = Desc::new(OpKind::Split);
        no_color.split = Some((None, i64::MIN));
        assert_eq!(round_trip(&no_color, 0).split, Some((None, i64::MIN)));
    }

    #[test]
    fn faults_round_trip_in_their_peer_form() {
        let faults = [
            Error::DTypeMismatch {
                op: OpKind::Gather,
                role: BufferRole::Peer { rank: 2 },
                expected: DType::F32,
                got: DType::I64,
            },
            Error::InvalidRank {
                op: OpKind::Broadcast,
                rank: 7,
                size: 4,
            },
            Error::UnsupportedOp {
                op: ReduceOp::Avg,
                dtype: DType::I32,
            },
            Error::UnsupportedBuffer {
                op: OpKind::AllReduce,
                location: BufferLocation::Host,
                backend: BACKEND,
            },
        ];
        for fault in faults {
            let mut desc = Desc::new(OpKind::AllReduce);
            desc.fault = Some(fault);
            assert!(same(&round_trip(&desc, 2), &desc));
        }
        // A fault without a peer form arrives as the sender being lost.
        let mut desc = Desc::new(OpKind::Scatter);
        desc.fault = Some(Error::EngineStopped {
            op: OpKind::Scatter,
        });
        assert!(matches!(
            round_trip(&desc, 3).fault,
            Some(Error::PeerLost {
                op: OpKind::Scatter,
                peer: 3
            })
        ));
    }

    #[test]
    fn malformed_descriptors_are_protocol_errors() {
        let mut desc = Desc::new(OpKind::AllGatherV);
        desc.counts = Some(vec![1, 2, 3]);
        let good = encode(&desc);
        for cut in 0..good.len() {
            assert!(
                matches!(
                    decode(&good[..cut], 1),
                    Err(Error::Protocol {
                        peer: Some(1),
                        violation: ProtocolViolation::BadDescriptor { .. }
                    })
                ),
                "cut at {cut}"
            );
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode(&trailing, 1).is_err());
        let mut bad_op = good.clone();
        bad_op[0] = 200;
        assert!(matches!(
            decode(&bad_op, 1),
            Err(Error::Protocol {
                violation: ProtocolViolation::BadDescriptor { at: 1 },
                ..
            })
        ));
        // A list length far beyond the bytes left is refused before anything is reserved.
        let mut huge = vec![op_code(OpKind::AllGatherV), NONE_CODE, 0, 0, 0, 1];
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode(&huge, 1).is_err());
    }
}
