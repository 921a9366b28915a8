//! The conformance suite every backend must pass.
//!
//! Every rank of a world calls the same function with its own communicator (a thread per rank
//! for `local`, a process per rank for `tcp`); the calls issue the same collectives in the same
//! order. Rank `r` writes a closed-form value `f(r, i)` into element `i`, so each expected
//! output is a formula, never a recorded value. Values are small integers (≤ 6, or 1–2 for
//! products), so every dtype — bf16 and f16 included — represents inputs and sums exactly for
//! worlds up to 8; `Avg` is compared within one rounding of the dtype.
//!
//! [`run_all`] covers every op × dtype × reduce op × size in {0, 1, 7, 4096 + 3, a length past
//! [`SuiteParams::segment_bytes`]} plus async ordering, concurrent splits and mismatched
//! arguments. [`check_timeout_when_a_rank_is_absent`] is separate because it leaves the
//! communicator out of step; call it last, with a short deadline.

mod checks;

use std::fmt;

use crate::buffer::{Buffer, HostBuffer};
use crate::communicator::Communicator;
use crate::dtype::DType;
use crate::error::Error;
use crate::op::{AllToAllCounts, BufferRole, OpKind, ReduceOp, StridedBlocks, block_offsets};
pub use checks::{
    check_async_ordering, check_mismatched_arguments, check_split_concurrent,
    check_timeout_when_a_rank_is_absent,
};

/// What the suite covers.
#[derive(Clone, Debug)]
pub struct SuiteParams {
    /// The backend's segment (pipelining chunk) size in bytes; the suite adds a length just past
    /// two segments so multi-segment paths run.
    pub segment_bytes: usize,
    /// The dtypes to cover (default: all).
    pub dtypes: Vec<DType>,
    /// The reduce ops to cover (default: all, `PreMulSum(0.5)`).
    pub reduce_ops: Vec<ReduceOp>,
    /// Whether to cover the large sizes (4096 + 3 and past two segments); default true. Very
    /// large worlds turn it off to keep the `size²` data volume of gathers small.
    pub large_sizes: bool,
}

impl SuiteParams {
    /// Every dtype and reduce op, with the given segment size.
    pub fn new(segment_bytes: usize) -> Self {
        SuiteParams {
            segment_bytes,
            dtypes: DType::ALL.to_vec(),
            reduce_ops: ReduceOp::ALL.to_vec(),
            large_sizes: true,
        }
    }

    /// The element counts covered for `dtype`.
    pub fn sizes(&self, dtype: DType) -> Vec<usize> {
        vec![
            0,
            1,
            7,
            4096 + 3,
            2 * self.segment_bytes / dtype.size_bytes() + 3,
        ]
    }
}

/// How many cases ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SuiteReport {
    /// Cases checked on this rank.
    pub cases: usize,
}

/// One case of the suite, for failure messages.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Case {
    /// The op.
    pub op: OpKind,
    /// The dtype, when the op has one.
    pub dtype: Option<DType>,
    /// The reduce op, when the op reduces.
    pub reduce: Option<ReduceOp>,
    /// The per-rank element count (or block size).
    pub len: usize,
    /// The world size.
    pub world: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} world={} len={}", self.op, self.world, self.len)?;
        if let Some(dtype) = self.dtype {
            write!(f, " dtype={dtype}")?;
        }
        if let Some(reduce) = self.reduce {
            write!(f, " reduce={reduce}")?;
        }
        Ok(())
    }
}

/// A case that did not behave. This is a test report, not a library error: it wraps the
/// communicator's [`Error`] when an op failed unexpectedly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConformanceFailure {
    /// An op failed that should have succeeded.
    #[error("{case} on rank {rank}: {source}")]
    Comm {
        /// The case.
        case: Case,
        /// The rank.
        rank: usize,
        /// The error.
        #[source]
        source: Error,
    },
    /// An output element is wrong.
    #[error("{case} on rank {rank}: element {index} is {got}, expected {expected}")]
    WrongValue {
        /// The case.
        case: Case,
        /// The rank.
        rank: usize,
        /// The element index.
        index: usize,
        /// What the op produced.
        got: f64,
        /// The closed form.
        expected: f64,
    },
    /// An output has the wrong length or dtype.
    #[error(
        "{case} on rank {rank}: output is {got_len} × {got_dtype}, expected {expected_len} × {expected_dtype}"
    )]
    WrongShape {
        /// The case.
        case: Case,
        /// The rank.
        rank: usize,
        /// The output length.
        got_len: usize,
        /// The expected length.
        expected_len: usize,
        /// The output dtype.
        got_dtype: DType,
        /// The expected dtype.
        expected_dtype: DType,
    },
    /// An op succeeded (or failed differently) where a specific error was required.
    #[error("{case} on rank {rank}: expected {expected}, got {got}")]
    WrongOutcome {
        /// The case.
        case: Case,
        /// The rank.
        rank: usize,
        /// The error required.
        expected: ExpectedError,
        /// What happened instead: an error, or `None` for success.
        got: Outcome,
    },
    /// A property of the API (ordering, split layout) does not hold.
    #[error("{case} on rank {rank}: {property}")]
    Property {
        /// The case.
        case: Case,
        /// The rank.
        rank: usize,
        /// The property that failed.
        property: Property,
    },
}

/// The error a negative case requires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExpectedError {
    /// [`Error::LengthMismatch`].
    LengthMismatch,
    /// [`Error::DTypeMismatch`].
    DTypeMismatch,
    /// [`Error::UnsupportedOp`].
    UnsupportedOp,
    /// [`Error::Timeout`] or [`Error::PeerLost`].
    TimeoutOrPeerLost,
}

impl fmt::Display for ExpectedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What a negative case observed.
#[derive(Debug)]
pub struct Outcome(pub Option<Error>);

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(error) => write!(f, "error `{error}`"),
            None => f.write_str("success"),
        }
    }
}

/// A structural property the suite checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Property {
    /// An op issued earlier was not complete when a later one had completed.
    IssueOrder {
        /// The index (in issue order) of the op found incomplete.
        incomplete: usize,
    },
    /// A split produced the wrong size or rank.
    SplitLayout {
        /// The size it should have.
        expected_size: usize,
        /// The rank it should have.
        expected_rank: usize,
        /// The size it has (0: no communicator).
        size: usize,
        /// The rank it has.
        rank: usize,
    },
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Property::IssueOrder { incomplete } => {
                write!(
                    f,
                    "op #{incomplete} was incomplete after a later op completed"
                )
            }
            Property::SplitLayout {
                expected_size,
                expected_rank,
                size,
                rank,
            } => write!(
                f,
                "split gave rank {rank} of {size}, expected rank {expected_rank} of {expected_size}"
            ),
        }
    }
}

type Check = Result<(), ConformanceFailure>;

/// The value rank `rank` writes at element `i` for every op except products.
pub fn value(rank: usize, i: usize) -> f64 {
    ((rank * 3 + i) % 7) as f64
}

/// The value rank `rank` writes at element `i` for products (1 or 2, so products are powers of
/// two that every dtype holds exactly for worlds up to 8).
pub fn product_value(rank: usize, i: usize) -> f64 {
    (1 + (rank + i) % 2) as f64
}

/// The per-rank count of the uneven ops: empty for ranks ≡ 1 (mod 3), otherwise `n + rank`.
pub fn uneven_count(rank: usize, n: usize) -> usize {
    if rank % 3 == 1 { 0 } else { n + rank }
}

/// Elements rank `from` sends to rank `to` in all-to-all-v (zeros included).
pub fn a2a_count(from: usize, to: usize, n: usize) -> usize {
    (n + from + 2 * to) % (n + 2)
}

fn input_value(op: ReduceOp, rank: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => product_value(rank, i),
        _ => value(rank, i),
    }
}

/// The reduction over ranks of element `i`, rounded into `dtype` (integers wrap).
fn reduced(op: ReduceOp, dtype: DType, world: usize, i: usize) -> f64 {
    let column = (0..world).map(|r| input_value(op, r, i));
    let exact = match op {
        ReduceOp::Sum => column.sum::<f64>(),
        ReduceOp::Avg => column.sum::<f64>() / world as f64,
        ReduceOp::Max => column.fold(f64::MIN, f64::max),
        ReduceOp::Min => column.fold(f64::MAX, f64::min),
        ReduceOp::Product => column.product(),
        ReduceOp::PreMulSum(factor) => column.map(|v| v * factor).sum(),
    };
    let wrapped = match dtype {
        DType::I32 => (exact as i64) as i32 as f64,
        DType::U8 => (exact as i64) as u8 as f64,
        _ => exact,
    };
    HostBuffer::from_f64(dtype, &[wrapped]).to_f64_vec()[0]
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        DType::I32 | DType::I64 | DType::U8 => 0.0,
    }
}

fn buffer(dtype: DType, len: usize, f: impl Fn(usize) -> f64) -> Buffer {
    let values: Vec<f64> = (0..len).map(f).collect();
    Buffer::Host(HostBuffer::from_f64(dtype, &values))
}

struct Checker<'a> {
    comm: &'a dyn Communicator,
    rank: usize,
    size: usize,
    cases: usize,
}

impl Checker<'_> {
    fn case(&self, op: OpKind, dtype: DType, reduce: Option<ReduceOp>, len: usize) -> Case {
        Case {
            op,
            dtype: Some(dtype),
            reduce,
            len,
            world: self.size,
        }
    }

    fn comm_err(&self, case: Case) -> impl FnOnce(Error) -> ConformanceFailure + '_ {
        move |source| ConformanceFailure::Comm {
            case,
            rank: self.rank,
            source,
        }
    }

    /// Compares `got` with `expected(i)` for every element.
    fn check_elements(
        &mut self,
        case: Case,
        got: &Buffer,
        dtype: DType,
        len: usize,
        expected: impl Fn(usize) -> f64,
    ) -> Check {
        self.cases += 1;
        if got.len() != len || got.dtype() != dtype {
            return Err(ConformanceFailure::WrongShape {
                case,
                rank: self.rank,
                got_len: got.len(),
                expected_len: len,
                got_dtype: got.dtype(),
                expected_dtype: dtype,
            });
        }
        let values = got.as_host().map_err(self.comm_err(case))?.to_f64_vec();
        let tol = tolerance(dtype);
        for (index, &g) in values.iter().enumerate() {
            let e = expected(index);
            let equal = if tol == 0.0 {
                g == e
            } else {
                (g - e).abs() <= tol * e.abs().max(1.0)
            };
            if !equal {
                return Err(ConformanceFailure::WrongValue {
                    case,
                    rank: self.rank,
                    index,
                    got: g,
                    expected: e,
                });
            }
        }
        Ok(())
    }

    /// A reduce op that the dtype does not support must fail with `UnsupportedOp`.
    fn expect_unsupported<T>(&mut self, case: Case, result: crate::Result<T>) -> Check {
        self.cases += 1;
        match result {
            Err(Error::UnsupportedOp { .. }) => Ok(()),
            Err(other) => Err(ConformanceFailure::WrongOutcome {
                case,
                rank: self.rank,
                expected: ExpectedError::UnsupportedOp,
                got: Outcome(Some(other)),
            }),
            Ok(_) => Err(ConformanceFailure::WrongOutcome {
                case,
                rank: self.rank,
                expected: ExpectedError::UnsupportedOp,
                got: Outcome(None),
            }),
        }
    }

    fn all_reduce(&mut self, dtype: DType, op: ReduceOp, n: usize) -> Check {
        let case = self.case(OpKind::AllReduce, dtype, Some(op), n);
        let rank = self.rank;
        let result = self
            .comm
            .all_reduce(buffer(dtype, n, |i| input_value(op, rank, i)), op);
        if !supported(op, dtype) {
            return self.expect_unsupported(case, result);
        }
        let out = result.map_err(self.comm_err(case))?;
        let size = self.size;
        self.check_elements(case, &out, dtype, n, |i| reduced(op, dtype, size, i))
    }

    fn reduce(&mut self, dtype: DType, op: ReduceOp, n: usize) -> Check {
        let case = self.case(OpKind::Reduce, dtype, Some(op), n);
        let (rank, size) = (self.rank, self.size);
        let root = n % size;
        let result = self
            .comm
            .reduce(buffer(dtype, n, |i| input_value(op, rank, i)), root, op);
        if !supported(op, dtype) {
            return self.expect_unsupported(case, result);
        }
        let out = result.map_err(self.comm_err(case))?;
        if rank == root {
            self.check_elements(case, &out, dtype, n, |i| reduced(op, dtype, size, i))
        } else {
            let round = |v: f64| HostBuffer::from_f64(dtype, &[v]).to_f64_vec()[0];
            self.check_elements(case, &out, dtype, n, |i| round(input_value(op, rank, i)))
        }
    }

    fn reduce_scatter(&mut self, dtype: DType, op: ReduceOp, m: usize) -> Check {
        let case = self.case(OpKind::ReduceScatter, dtype, Some(op), m);
        let (rank, size) = (self.rank, self.size);
        let input = buffer(dtype, size * m, |i| input_value(op, rank, i));
        let result = self.comm.reduce_scatter(input, Buffer::zeros(dtype, m), op);
        if !supported(op, dtype) {
            return self.expect_unsupported(case, result);
        }
        let pair = result.map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, m, |i| {
            reduced(op, dtype, size, rank * m + i)
        })
    }

    fn reduce_scatter_v(&mut self, dtype: DType, op: ReduceOp, n: usize) -> Check {
        let case = self.case(OpKind::ReduceScatterV, dtype, Some(op), n);
        let (rank, size) = (self.rank, self.size);
        let counts: Vec<usize> = (0..size).map(|r| uneven_count(r, n)).collect();
        let total = counts.iter().sum();
        let offset = block_offsets(&counts)[rank];
        let input = buffer(dtype, total, |i| input_value(op, rank, i));
        let result = self.comm.reduce_scatter_v(
            input,
            Buffer::zeros(dtype, counts[rank]),
            counts.clone(),
            op,
        );
        if !supported(op, dtype) {
            return self.expect_unsupported(case, result);
        }
        let pair = result.map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, counts[rank], |i| {
            reduced(op, dtype, size, offset + i)
        })
    }

    fn all_gather(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::AllGather, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let pair = self
            .comm
            .all_gather(
                buffer(dtype, n, |i| value(rank, i)),
                Buffer::zeros(dtype, size * n),
            )
            .map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, size * n, |i| {
            value(i / n.max(1), i % n.max(1))
        })?;
        self.check_elements(case, &pair.input, dtype, n, |i| value(rank, i))
    }

    fn all_gather_v(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::AllGatherV, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let counts: Vec<usize> = (0..size).map(|r| uneven_count(r, n)).collect();
        let offsets = block_offsets(&counts);
        let total = counts.iter().sum();
        let pair = self
            .comm
            .all_gather_v(
                buffer(dtype, counts[rank], |i| value(rank, i)),
                Buffer::zeros(dtype, total),
                counts.clone(),
            )
            .map_err(self.comm_err(case))?;
        let owner = |i: usize| offsets.iter().rposition(|&o| o <= i).unwrap_or(0);
        self.check_elements(case, &pair.output, dtype, total, |i| {
            // The last block starting at or before `i` that is non-empty owns element `i`.
            let mut r = owner(i);
            while counts[r] == 0 && r > 0 {
                r -= 1;
            }
            value(r, i - offsets[r])
        })
    }

    fn broadcast(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::Broadcast, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let root = n % size;
        // Non-roots start from a recognisably different value (100 + rank).
        let input = if rank == root {
            buffer(dtype, n, |i| value(root, i))
        } else {
            buffer(dtype, n, |_| 100.0 + rank as f64)
        };
        let out = self
            .comm
            .broadcast(input, root)
            .map_err(self.comm_err(case))?;
        self.check_elements(case, &out, dtype, n, |i| value(root, i))
    }

    fn gather(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::Gather, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let root = (n + 1) % size;
        let out_len = if rank == root { size * n } else { 0 };
        let pair = self
            .comm
            .gather(
                buffer(dtype, n, |i| value(rank, i)),
                Buffer::zeros(dtype, out_len),
                root,
            )
            .map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, out_len, |i| {
            value(i / n.max(1), i % n.max(1))
        })
    }

    fn scatter(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::Scatter, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let root = (n + 2) % size;
        // Block j of the root's input holds value(j, i): what rank j must receive.
        let input = if rank == root {
            buffer(dtype, size * n, |i| value(i / n.max(1), i % n.max(1)))
        } else {
            Buffer::zeros(dtype, 0)
        };
        let pair = self
            .comm
            .scatter(input, Buffer::zeros(dtype, n), root)
            .map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, n, |i| value(rank, i))
    }

    fn all_to_all(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::AllToAll, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        // Block j element i of rank r's input: value(r, 5j + i).
        let block = n.max(1);
        let input = buffer(dtype, size * n, |k| {
            value(rank, 5 * (k / block) + k % block)
        });
        let pair = self
            .comm
            .all_to_all(input, Buffer::zeros(dtype, size * n))
            .map_err(self.comm_err(case))?;
        // Block r element i of the output came from rank r's block `rank`.
        self.check_elements(case, &pair.output, dtype, size * n, |k| {
            value(k / block, 5 * rank + k % block)
        })
    }

    fn all_to_all_v(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::AllToAllV, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let send: Vec<usize> = (0..size).map(|to| a2a_count(rank, to, n)).collect();
        let recv: Vec<usize> = (0..size).map(|from| a2a_count(from, rank, n)).collect();
        let send_offsets = block_offsets(&send);
        let recv_offsets = block_offsets(&recv);
        let mut input = vec![0.0; send.iter().sum()];
        for to in 0..size {
            for i in 0..send[to] {
                input[send_offsets[to] + i] = value(rank, 5 * to + i);
            }
        }
        let mut expected = vec![0.0; recv.iter().sum()];
        for from in 0..size {
            for i in 0..recv[from] {
                expected[recv_offsets[from] + i] = value(from, 5 * rank + i);
            }
        }
        let total = expected.len();
        let pair = self
            .comm
            .all_to_all_v(
                Buffer::Host(HostBuffer::from_f64(dtype, &input)),
                Buffer::zeros(dtype, total),
                AllToAllCounts { send, recv },
            )
            .map_err(self.comm_err(case))?;
        self.check_elements(case, &pair.output, dtype, total, |i| expected[i])
    }

    /// The strided all-to-all: every rank holds `n` rows of `size × width` columns plus
    /// three gap columns, and sends peer `j` the `width` columns at an offset that is shifted
    /// (and, for the narrow case, reversed), so offsets, widths and strides all matter.
    fn all_to_all_strided(&mut self, dtype: DType, n: usize) -> Check {
        let size = self.size;
        // Narrow rows (two elements, reversed peer order) and a few wide ones (640
        // elements: wide enough in bytes for a backend to send them in place).
        self.all_to_all_strided_rows(dtype, n, 2, |j| (size - 1 - j) * 2 + 1)?;
        self.all_to_all_strided_rows(dtype, n.min(3), 640, |j| j * 640 + 2)
    }

    /// One strided all-to-all of `n` rows of `width` elements per block, block `j` at column
    /// `offset(j)` of rows `size × width + 3` elements long. Element `i` of rank `r`'s input
    /// is `(5r + i) mod 97`: a period that no width, offset or stride here divides, so a row
    /// read from the wrong place shows (every dtype holds these integers exactly).
    fn all_to_all_strided_rows(
        &mut self,
        dtype: DType,
        n: usize,
        width: usize,
        offset: impl Fn(usize) -> usize,
    ) -> Check {
        let case = self.case(OpKind::AllToAll, dtype, None, n * width);
        let (rank, size) = (self.rank, self.size);
        let stride = size * width + 3;
        let offsets: Vec<usize> = (0..size).map(offset).collect();
        let blocks = StridedBlocks {
            rows: n,
            width,
            stride,
            offsets: offsets.clone(),
        };
        let strided_value = |r: usize, i: usize| ((5 * r + i) % 97) as f64;
        let input = buffer(dtype, n * stride, |i| strided_value(rank, i));
        let block = n * width;
        let pair = self
            .comm
            .all_to_all_strided(input, Buffer::zeros(dtype, size * block), blocks)
            .map_err(self.comm_err(case))?;
        // Element k of the block from rank i is rank i's row k / width, column
        // offsets[rank] + k % width.
        self.check_elements(case, &pair.output, dtype, size * block, |k| {
            let (from, k) = (k / block.max(1), k % block.max(1));
            strided_value(from, (k / width) * stride + offsets[rank] + k % width)
        })
    }

    fn send_recv(&mut self, dtype: DType, n: usize) -> Check {
        let case = self.case(OpKind::Send, dtype, None, n);
        let (rank, size) = (self.rank, self.size);
        let to = (rank + 1) % size;
        let from = (rank + size - 1) % size;
        // Issue both before waiting: a send must not wait for its receive to be posted.
        let sent = self
            .comm
            .send_async(buffer(dtype, n, |i| value(rank, i)), to, 7);
        let received = self.comm.recv_async(Buffer::zeros(dtype, n), from, 7);
        let received = received.wait().map_err(self.comm_err(case))?;
        let sent = sent.wait().map_err(self.comm_err(case))?;
        self.check_elements(case, &received, dtype, n, |i| value(from, i))?;
        self.check_elements(case, &sent, dtype, n, |i| value(rank, i))
    }
}

fn supported(op: ReduceOp, dtype: DType) -> bool {
    dtype.is_float() || !matches!(op, ReduceOp::Avg | ReduceOp::PreMulSum(_))
}

/// Runs the whole suite (except the timeout check) on this rank.
pub fn run_all(
    comm: &dyn Communicator,
    params: &SuiteParams,
) -> Result<SuiteReport, ConformanceFailure> {
    let mut checker = Checker {
        comm,
        rank: comm.rank(),
        size: comm.size(),
        cases: 0,
    };
    for &dtype in &params.dtypes {
        for n in params.sizes(dtype) {
            for &op in &params.reduce_ops {
                checker.all_reduce(dtype, op, n)?;
                checker.reduce(dtype, op, n)?;
                checker.reduce_scatter(dtype, op, n)?;
                checker.reduce_scatter_v(dtype, op, n)?;
            }
            checker.all_gather(dtype, n)?;
            checker.all_gather_v(dtype, n)?;
            checker.broadcast(dtype, n)?;
            checker.gather(dtype, n)?;
            checker.scatter(dtype, n)?;
            checker.all_to_all(dtype, n)?;
            checker.all_to_all_v(dtype, n)?;
            checker.all_to_all_strided(dtype, n)?;
            if checker.size > 1 {
                checker.send_recv(dtype, n)?;
            }
        }
    }
    let mut cases = checker.cases;
    comm.barrier().map_err(|source| ConformanceFailure::Comm {
        case: barrier_case(checker.size),
        rank: checker.rank,
        source,
    })?;
    cases += 1;
    cases += check_async_ordering(comm)?;
    cases += check_split_concurrent(comm)?;
    cases += check_mismatched_arguments(comm)?;
    Ok(SuiteReport { cases })
}

fn barrier_case(world: usize) -> Case {
    Case {
        op: OpKind::Barrier,
        dtype: None,
        reduce: None,
        len: 0,
        world,
    }
}
