//! The one error type of the `hypershard` crate: launcher, data, checkpoint and CLI failures.

use std::path::PathBuf;

/// What a file-system call was doing when it failed, so an error names the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileAction {
    /// Opening or reading a file.
    Read,
    /// Creating or writing a file.
    Write,
    /// Flushing a file or directory to stable storage.
    Sync,
    /// Creating a directory.
    CreateDir,
    /// Renaming a file or directory.
    Rename,
    /// Removing a file or directory.
    Remove,
    /// Listing a directory.
    List,
}

impl std::fmt::Display for FileAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileAction::Read => "read",
            FileAction::Write => "write",
            FileAction::Sync => "sync",
            FileAction::CreateDir => "create directory",
            FileAction::Rename => "rename",
            FileAction::Remove => "remove",
            FileAction::List => "list",
        })
    }
}

/// How a rank process ended, as the launcher reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExitKind {
    /// The process exited with this code.
    Code(i32),
    /// The process was killed by this signal.
    Signal(i32),
}

impl std::fmt::Display for ExitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitKind::Code(code) => write!(f, "exit code {code}"),
            ExitKind::Signal(signal) => write!(f, "signal {signal}"),
        }
    }
}

/// Errors of the `hypershard` crate and CLI. Each names the rank, path, tensor or flag at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rendezvous port is already taken on this host.
    #[error("port {port} on {addr} is already in use (pick another with --master-port)")]
    PortInUse {
        /// The master address.
        addr: String,
        /// The port that could not be bound.
        port: u16,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// A launch option is invalid (for example `--node-rank` not below `--nnodes`).
    #[error("invalid launch option {option}: {reason}")]
    InvalidLaunchOption {
        /// The flag.
        option: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A rank process could not be started.
    #[error("could not start rank {rank} ({program}): {source}")]
    Spawn {
        /// The global rank.
        rank: usize,
        /// The program.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Waiting on a rank process failed.
    #[error("could not wait for rank {rank}: {source}")]
    Wait {
        /// The global rank.
        rank: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A rank failed; the launcher stopped the others.
    #[error("rank {rank} failed with {status}; stopped the other ranks")]
    RankFailed {
        /// The global rank that failed first.
        rank: usize,
        /// How it ended.
        status: ExitKind,
    },
    /// The stall watchdog found a collective held up by this rank; the launcher stopped it
    /// and the others.
    #[error(
        "rank {rank} (pid {pid} on host {host}) stalled the job: rank {waiter} waited \
         {waited_s:.1}s for it in {op} #{seq} of group {group}; stopped the other ranks"
    )]
    RankStalled {
        /// The global rank blamed.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// Its host.
        host: String,
        /// The global rank that declared the stall.
        waiter: usize,
        /// How long it had waited, in seconds.
        waited_s: f64,
        /// The op it waited in.
        op: String,
        /// The op's sequence number in its group.
        seq: u64,
        /// The group's name.
        group: String,
    },
    /// A rank went over `--max-rank-memory` and the kernel stopped it.
    #[error(
        "rank {rank} went over --max-rank-memory ({limit_mib:.1} MiB) and was killed ({status}); \
         stopped the other ranks"
    )]
    RankOverMemory {
        /// The global rank.
        rank: usize,
        /// The limit, in MiB.
        limit_mib: f64,
        /// How it ended.
        status: ExitKind,
    },
    /// The launcher was interrupted by a signal, which it forwarded to the ranks.
    #[error("interrupted by signal {signal}; forwarded it to every rank")]
    Interrupted {
        /// The signal number.
        signal: i32,
    },
    /// Installing the SIGINT/SIGTERM handler failed.
    #[error("could not install the signal handler: {source}")]
    SignalHandler {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file-system step failed.
    #[error("could not {action} {path}: {source}", path = path.display())]
    Io {
        /// What was being done.
        action: FileAction,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A nanoGPT `.bin` token file has an odd number of bytes (it must hold little-endian u16s).
    #[error("{path} is not a token file: {bytes} bytes is not a whole number of u16 tokens", path = path.display())]
    CorruptTokenFile {
        /// The file.
        path: PathBuf,
        /// Its length in bytes.
        bytes: u64,
    },
    /// A token id in the data is not below the vocabulary size.
    #[error("{path}: token {token} at position {position} is not below the vocabulary size {vocab_size}", path = path.display())]
    TokenOutOfRange {
        /// The file.
        path: PathBuf,
        /// The offending token id.
        token: u32,
        /// Its position in the file, in tokens.
        position: usize,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A text file is not valid UTF-8, which the gpt2 tokenizer needs.
    #[error("{path} is not UTF-8 text at byte {valid_up_to} (the gpt2 tokenizer needs UTF-8)", path = path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Bytes that were valid before the first bad one.
        valid_up_to: usize,
    },
    /// The data holds too few tokens for one training window.
    #[error("{path} holds {tokens} tokens; a block size of {block_size} needs at least {needed}", path = path.display())]
    DataTooShort {
        /// The file.
        path: PathBuf,
        /// Tokens in the file.
        tokens: usize,
        /// The block size.
        block_size: usize,
        /// The minimum number of tokens.
        needed: usize,
    },
    /// A batch layout does not divide evenly.
    #[error("the global batch of {global_batch} sequences does not split into {parts} equal parts")]
    UnevenBatch {
        /// The global batch size in sequences.
        global_batch: usize,
        /// Ranks × accumulation steps.
        parts: usize,
    },
    /// A tokenizer could not be built.
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// What went wrong.
        reason: String,
    },
    /// A text was tokenised into ids the tokenizer cannot decode.
    #[error("token {token} is not in the {tokenizer} vocabulary")]
    UnknownToken {
        /// The token id.
        token: u32,
        /// The tokenizer name.
        tokenizer: &'static str,
    },
    /// A `--mesh` string is not `N` or `AxB`, or its rank count overflows.
    #[error("invalid --mesh {text:?}: {reason}")]
    InvalidMesh {
        /// The text given.
        text: String,
        /// Why it is rejected.
        reason: String,
    },
    /// The device `--device` names cannot be used: a build without its support, or no such
    /// device on this machine.
    #[error("--device {device}: {reason}")]
    DeviceUnavailable {
        /// The device kind asked for (`cuda`).
        device: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
    /// A command-line value is out of range, not finite, or overflows what it sizes.
    #[error("invalid {flag} {value}: {reason}")]
    InvalidFlag {
        /// The flag (`--lr`).
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What it must be.
        reason: String,
    },
    /// The training loss (mean over the ranks) is NaN or infinite: the run stops before
    /// recording or checkpointing the step.
    #[error(
        "the loss of step {step} is {loss} (not finite); stopped without saving a checkpoint of it (lower --lr, or pass --allow-nonfinite to continue anyway)"
    )]
    NonFiniteLoss {
        /// The step whose loss is not finite.
        step: u64,
        /// The loss.
        loss: f64,
    },
    /// Parameters became NaN or infinite: a checkpoint of them is refused.
    #[error(
        "{count} parameter values are not finite after step {step}; refused to save a checkpoint of them (pass --allow-nonfinite to save anyway)"
    )]
    NonFiniteParameters {
        /// The step whose checkpoint was refused.
        step: u64,
        /// Non-finite values over every rank's shards.
        count: u64,
    },
    /// `--resume` was asked for a run the checkpoint does not continue.
    #[error("cannot --resume from {path}: {reason}", path = path.display())]
    ResumeRefused {
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs, and the flag that overrides it if one does.
        reason: String,
    },
    /// A checkpoint's `metadata.json` (or a root's `latest` pointer) names a path outside its
    /// directory, or one that is not a regular file.
    #[error("checkpoint {dir}: {named_in} names {file:?}, which {reason}", dir = dir.display())]
    UnsafeCheckpointPath {
        /// The checkpoint directory (or root, for `latest`).
        dir: PathBuf,
        /// The file holding the name: `metadata.json` or `latest`.
        named_in: &'static str,
        /// The name as written.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint's model tensors do not match its own model configuration.
    #[error("checkpoint {path} does not match its model config: tensor {name} is {found}, the model needs {expected}", path = path.display())]
    ModelTensorMismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// The tensor's checkpoint name.
        name: String,
        /// What the model configuration needs (`shape [..]`, or `absent`).
        expected: String,
        /// What the checkpoint holds.
        found: String,
    },
    /// An output path given on the command line cannot be written as asked.
    #[error("{flag} {path}: {reason}", path = path.display())]
    InvalidOutput {
        /// The flag.
        flag: &'static str,
        /// The path.
        path: PathBuf,
        /// Why (a directory, not a regular file, exists, not writable).
        reason: String,
    },
    /// The mesh does not hold `--nproc` ranks.
    #[error("--mesh {mesh} holds {mesh_ranks} ranks but --nproc is {nproc}")]
    MeshMismatch {
        /// The mesh as given.
        mesh: String,
        /// Ranks the mesh holds.
        mesh_ranks: usize,
        /// The process count.
        nproc: usize,
    },
    /// A metadata or index JSON file could not be parsed or written.
    #[error("{path}: invalid JSON: {source}", path = path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file could not be encoded or decoded.
    #[error("{path}: safetensors: {reason}", path = path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The decoder's message.
        reason: String,
    },
    /// A tensor operation failed.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// The tensor error.
        #[source]
        source: hypershard_tensor::Error,
    },
    /// A checkpoint is not in a format this version reads.
    #[error("{path} is not a hypershard checkpoint (format {format:?}, version {version})", path = path.display())]
    CheckpointFormat {
        /// The checkpoint directory.
        path: PathBuf,
        /// The format tag found.
        format: String,
        /// The version found.
        version: u32,
    },
    /// The checkpoint was saved for another model configuration.
    #[error("checkpoint {path} was saved for another model: {field} is {saved} there but {requested} here", path = path.display())]
    ConfigMismatch {
        /// The checkpoint directory.
        path: PathBuf,
        /// The differing configuration field.
        field: String,
        /// Its value in the checkpoint.
        saved: String,
        /// Its value in this run.
        requested: String,
    },
    /// The `--init` file does not match the model.
    #[error("--init {path}: {reason}", path = path.display())]
    InitFile {
        /// The `--init` file.
        path: PathBuf,
        /// What is wrong with it, naming the tensor.
        reason: String,
    },
    /// A Hugging Face GPT-2 folder (`config.json` + `model.safetensors`) cannot be read as, or
    /// does not match, the model.
    #[error("Hugging Face GPT-2 checkpoint {path}: {reason}", path = path.display())]
    HfCheckpoint {
        /// The folder or the file in it.
        path: PathBuf,
        /// What is wrong, naming the field or tensor.
        reason: String,
    },
    /// A nanoGPT dataset's `meta.pkl` cannot be read or is not what nanoGPT writes.
    #[error("{path}: {reason}", path = path.display())]
    DatasetMeta {
        /// The `meta.pkl` file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A text holds a character the dataset's vocabulary (`meta.pkl`) does not.
    #[error("{text:?} is not in the dataset's character vocabulary")]
    NotInVocabulary {
        /// The character.
        text: String,
    },
    /// A tensor is not in the checkpoint.
    #[error("tensor {name} is not in the checkpoint")]
    MissingTensor {
        /// The tensor's name.
        name: String,
    },
    /// A saved block's bytes do not match the CRC32C its checkpoint recorded: the shard file
    /// was corrupted (or changed) after it was written.
    #[error(
        "checkpoint shard {} is corrupt: tensor {tensor} (key {key}) has CRC32C {actual:#010x}, expected {expected:#010x}",
        file.display()
    )]
    ChecksumMismatch {
        /// The shard file.
        file: std::path::PathBuf,
        /// The global tensor.
        tensor: String,
        /// Its key inside the file.
        key: String,
        /// The checksum recorded at save time.
        expected: u32,
        /// The checksum of the bytes read now.
        actual: u32,
    },
    /// A tensor was described twice with different global shapes or dtypes.
    #[error("tensor {name}: inconsistent descriptions ({reason})")]
    InconsistentTensor {
        /// The tensor's name.
        name: String,
        /// What differs.
        reason: String,
    },
    /// A block does not lie inside its tensor.
    #[error(
        "tensor {name}: block at {offset:?} of shape {shape:?} is outside the global shape {global_shape:?}"
    )]
    BlockOutOfBounds {
        /// The tensor's name.
        name: String,
        /// The block's offset.
        offset: Vec<usize>,
        /// The block's shape.
        shape: Vec<usize>,
        /// The tensor's global shape.
        global_shape: Vec<usize>,
    },
    /// The saved blocks of a tensor overlap or leave a gap.
    #[error("tensor {name}: the saved blocks cover {covered} of {numel} elements exactly once")]
    BlockCoverage {
        /// The tensor's name.
        name: String,
        /// Elements covered (sum of block volumes, counted only if disjoint).
        covered: usize,
        /// Elements in the tensor.
        numel: usize,
    },
    /// A rank's index of saved blocks is missing from the staging directory.
    #[error("rank {rank} did not finish its checkpoint shard in {path}", path = path.display())]
    MissingShard {
        /// The rank.
        rank: usize,
        /// The staging directory.
        path: PathBuf,
    },
    /// No checkpoint was found where one was expected.
    #[error("no checkpoint in {path}", path = path.display())]
    NoCheckpoint {
        /// The directory searched.
        path: PathBuf,
    },
    /// A collective operation failed.
    #[error("collective: {0}")]
    Collective(Box<hypershard_collectives::Error>),
    /// A model or optimizer operation failed.
    #[error("model: {0}")]
    Model(Box<hypershard_nn::Error>),
    /// A fully_shard operation failed.
    #[error("fsdp: {0}")]
    Fsdp(Box<hypershard_fsdp::FsdpError>),
    /// A plot could not be drawn.
    #[error("plot {path}: {reason}", path = path.display())]
    Plot {
        /// The output file.
        path: PathBuf,
        /// The drawing backend's message.
        reason: String,
    },
    /// A model preset name or config file is invalid.
    #[error("invalid --model {text:?}: {reason}")]
    InvalidModel {
        /// The text given.
        text: String,
        /// Why it is rejected.
        reason: String,
    },
    /// An output path would overwrite something the command must not touch.
    #[error("{path} already exists and holds a previous run (use --resume, or another --out)", path = path.display())]
    WouldOverwrite {
        /// The path.
        path: PathBuf,
    },
    /// A buffer whose size came from a file or a peer cannot be allocated.
    #[error("cannot allocate {bytes} bytes for {what}: {reason}")]
    AllocationRefused {
        /// What the buffer was for (a tensor and its file, a data file, a peer's frame).
        what: String,
        /// Its size.
        bytes: u64,
        /// Why not: over a limit (named), or refused by the allocator.
        reason: String,
    },
    /// The estimated memory of one training rank exceeds what it may use.
    #[error(
        "each rank needs about {needed}, more than the {limit}; the size comes from {drivers} \
         (--no-memory-check starts anyway)"
    )]
    MemoryEstimate {
        /// The estimate and its terms, human-readable.
        needed: String,
        /// The limit and where it comes from, human-readable.
        limit: String,
        /// The flags (and model fields) that drive the largest term, with their values.
        drivers: String,
    },
    /// A size computed from the flags and the model does not fit a 64-bit byte count.
    #[error("the {term} of one rank overflows a 64-bit byte count: reduce {drivers}")]
    MemoryOverflow {
        /// Which term overflowed (the logits, the activations, the training state, ...).
        term: &'static str,
        /// The flags (and model fields) it is a product of, with their values.
        drivers: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

// The wrapped errors of the layers below are boxed: they are large, and `Result<_, Error>`
// travels through every function of the crate.
impl From<hypershard_collectives::Error> for Error {
    fn from(error: hypershard_collectives::Error) -> Error {
        Error::Collective(Box::new(error))
    }
}

impl From<hypershard_nn::Error> for Error {
    fn from(error: hypershard_nn::Error) -> Error {
        Error::Model(Box::new(error))
    }
}

impl From<hypershard_fsdp::FsdpError> for Error {
    fn from(error: hypershard_fsdp::FsdpError) -> Error {
        Error::Fsdp(Box::new(error))
    }
}

impl Error {
    /// Wraps an I/O error with the action and path it concerned.
    pub fn io(action: FileAction, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
