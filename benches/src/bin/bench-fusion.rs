//! `cargo xtask bench fusion`: fused against per-parameter all-gather and reduce-scatter at
//! world 2 over tcp, for (a) 100 parameters of 4 KiB, (b) the parameter list of
//! hypershard-nn's GPT `Block` (n_embd 768 and 128), (c) a bucket-size sweep over the
//! 768-wide block; fused with copy-out against zero-copy.
//!
//! ```text
//! bench-fusion [--reps 20] [--warmup 3] [--embd 768,128] [--buckets 64K,256K,1M,4M,16M]
//!              [--transport tcp|auto|shm] [--no-collectives] [--json PATH] [--quick]
//! ```
//!
//! Two paths are timed:
//! - `fsdp`: the real FSDP path, through hypershard-fsdp's public API. The parameters sit in a
//!   "bag" module whose forward is the identity and whose backward hands each parameter a
//!   ready-made gradient, wrapped by `fully_shard` as the root unit with
//!   `reshard_after_forward = Keep`, so forward is exactly the unit's unshard (copy-in,
//!   all-gather per bucket, copy-out or zero-copy views) and backward exactly its gradient
//!   reduction (copy-in, reduce-scatter per bucket, copy-out into the sharded grads) and
//!   reshard. `CommFusionPolicy { enabled, zero_copy, bucket_bytes }` picks the variant.
//! - `collectives`: the bare collectives with the same copy-in and copy-out as FSDP (one
//!   flat buffer per pass against one collective per parameter), the floor under the fsdp
//!   path.
//!
//! Every rank is a thread of this process with its own tcp communicator over 127.0.0.1 and a
//! one-thread compute pool. Each repetition is `barrier; t0; pass; t1`, its time the maximum
//! over the ranks; the median over `--reps` repetitions after `--warmup` is reported, and
//! `speedup` = median(per-parameter) / median(variant). Results: `target/bench/fusion.json`
//! and a markdown table on stdout. `--quick` is the CI smoke (cases (a) and the 128-wide
//! block, two sweep points, 2 repetitions; no timing claims).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use hypershard_benches::world::{BoxError, max_over_ranks, on_rank_threads, tcp_thread_world};
use hypershard_benches::{TimingStats, write_json};
use hypershard_collectives::shm::TransportPolicy;
use hypershard_collectives::tcp::TcpConfig;
use hypershard_collectives::{Buffer, Communicator, DType as WireDType, ReduceOp};
use hypershard_fsdp::{
    CommFusionPolicy, DataParallelMesh, FullyShardConfig, ReshardAfterForward, fully_shard,
};
use hypershard_nn::{Block, BlockConfig, Module, ParamVisitor, ParamVisitorMut, Parameter};
use hypershard_tensor::{DType, RandomInit, Tensor};

const WORLD: usize = 2;

#[derive(Debug, Clone)]
struct Args {
    reps: usize,
    warmup: usize,
    embds: Vec<usize>,
    buckets: Vec<usize>,
    tcp: TcpConfig,
    transport: String,
    collectives: bool,
    json: Option<std::path::PathBuf>,
}

fn parse_size(text: &str) -> Result<usize, String> {
    let upper = text.trim().to_ascii_uppercase();
    let upper = upper.strip_suffix("IB").unwrap_or(&upper);
    let upper = upper.strip_suffix('B').unwrap_or(upper);
    let (digits, unit) = match upper.chars().last() {
        Some('K') => (&upper[..upper.len() - 1], 1usize << 10),
        Some('M') => (&upper[..upper.len() - 1], 1 << 20),
        Some('G') => (&upper[..upper.len() - 1], 1 << 30),
        _ => (upper, 1),
    };
    let value: usize = digits
        .parse()
        .map_err(|_| format!("cannot read size `{text}` (e.g. 64K, 4M)"))?;
    Ok(value * unit)
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        reps: 20,
        warmup: 3,
        embds: vec![768, 128],
        buckets: vec![64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
        tcp: TcpConfig::default(),
        transport: "tcp".to_string(),
        collectives: true,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |s: String| s.parse::<usize>().map_err(|e| format!("{s}: {e}"));
        match flag.as_str() {
            "--reps" => args.reps = number(value()?)?.max(1),
            "--warmup" => args.warmup = number(value()?)?,
            "--embd" => {
                args.embds = value()?
                    .split(',')
                    .map(|s| number(s.to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--buckets" => {
                args.buckets = value()?
                    .split(',')
                    .map(parse_size)
                    .collect::<Result<_, _>>()?
            }
            "--transport" => {
                let text = value()?;
                let policy = TransportPolicy::parse(&text)
                    .ok_or_else(|| format!("unknown transport `{text}` (tcp, auto, shm)"))?;
                args.tcp = args.tcp.with_transport(policy);
                args.transport = text;
            }
            "--no-collectives" => args.collectives = false,
            "--json" => args.json = Some(value()?.into()),
            // The CI smoke: the small cases, two sweep points, two repetitions after one
            // warm-up; later flags override.
            "--quick" => {
                args.reps = 2;
                args.warmup = 1;
                args.embds = vec![128];
                args.buckets = vec![64 << 10, 1 << 20];
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

/// A parameter list to move: names and shapes.
#[derive(Debug, Clone)]
struct Case {
    name: String,
    params: Vec<(String, Vec<usize>)>,
}

impl Case {
    fn numel(&self) -> usize {
        self.params
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

/// (a): 100 parameters of 4 KiB (1024 f32 each).
fn small_params_case() -> Case {
    Case {
        name: "100 x 4 KiB".to_string(),
        params: (0..100).map(|i| (format!("p{i}"), vec![1024])).collect(),
    }
}

/// (b): the parameter list of hypershard-nn's GPT `Block` at width `embd` (names and shapes
/// read off a real block).
fn block_case(embd: usize) -> Result<Case, BoxError> {
    let block = Block::new(BlockConfig {
        n_embd: embd,
        n_head: if embd.is_multiple_of(12) { 12 } else { 4 },
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 0,
    })?;
    let mut params = Vec::new();
    block.visit_params("", &mut |name: &str, p: &Parameter| {
        params.push((name.to_string(), p.data()?.shape().to_vec()));
        Ok(())
    })?;
    Ok(Case {
        name: format!("GPT block {embd}"),
        params,
    })
}

/// A unit whose compute is nothing: forward is the identity and backward hands every
/// parameter its ready-made gradient, so only FSDP's collectives and copies are timed.
struct ParamBag {
    params: Vec<Parameter>,
    grads: Vec<Tensor>,
}

impl ParamBag {
    fn new(case: &Case) -> Result<ParamBag, BoxError> {
        let mut params = Vec::new();
        let mut grads = Vec::new();
        for (i, (name, shape)) in case.params.iter().enumerate() {
            let data = Tensor::random(shape, DType::F32, RandomInit::uniform(i as u64, -0.1, 0.1))?;
            params.push(Parameter::new(name, data));
            grads.push(Tensor::ones(shape, DType::F32)?);
        }
        Ok(ParamBag { params, grads })
    }
}

impl Module for ParamBag {
    fn kind(&self) -> &'static str {
        "ParamBag"
    }
    fn forward(&mut self, input: &Tensor) -> hypershard_nn::Result<Tensor> {
        Ok(input.clone())
    }
    fn backward(&mut self, grad_output: &Tensor) -> hypershard_nn::Result<Tensor> {
        for (p, g) in self.params.iter_mut().zip(&self.grads) {
            p.accumulate_grad(g.clone())?;
        }
        Ok(grad_output.clone())
    }
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> hypershard_nn::Result<()> {
        for p in &self.params {
            f(&hypershard_nn::join_name(prefix, &p.name), p)?;
        }
        Ok(())
    }
    fn visit_params_mut(
        &mut self,
        prefix: &str,
        f: &mut ParamVisitorMut<'_>,
    ) -> hypershard_nn::Result<()> {
        for p in &mut self.params {
            let name = hypershard_nn::join_name(prefix, &p.name);
            f(&name, p)?;
        }
        Ok(())
    }
}

/// The all-gather and reduce-scatter pass times of one configuration.
struct PassTimes {
    all_gather: TimingStats,
    reduce_scatter: TimingStats,
}

fn stats(per_rank: &[Vec<Duration>], warmup: usize) -> Result<TimingStats, BoxError> {
    Ok(TimingStats::from_samples(&max_over_ranks(per_rank, warmup)).ok_or("no samples")?)
}

/// Splits per-rank `(all-gather, reduce-scatter)` time lists into pass statistics.
fn pass_times(
    per_rank: Vec<(Vec<Duration>, Vec<Duration>)>,
    warmup: usize,
) -> Result<PassTimes, BoxError> {
    let (gathers, scatters): (Vec<_>, Vec<_>) = per_rank.into_iter().unzip();
    Ok(PassTimes {
        all_gather: stats(&gathers, warmup)?,
        reduce_scatter: stats(&scatters, warmup)?,
    })
}

/// The fsdp path: forward of the root unit (its unshard) and backward (its gradient
/// reduction), timed separately.
fn fsdp_pass(args: &Args, case: &Case, policy: CommFusionPolicy) -> Result<PassTimes, BoxError> {
    let comms = tcp_thread_world(WORLD, &args.tcp)?;
    let (case, reps) = (case.clone(), args.warmup + args.reps);
    let per_rank = on_rank_threads(comms, move |_, comm| {
        let mesh = DataParallelMesh::fsdp(comm.clone())?;
        let mut config = FullyShardConfig::new(mesh);
        config.comm_fusion = policy;
        // Root units keep their parameters after forward anyway; saying so pins backward to
        // the reduction alone.
        config.reshard_after_forward = ReshardAfterForward::Keep;
        let mut root = fully_shard(Box::new(ParamBag::new(&case)?), config).map_err(|r| r.error)?;
        let x = Tensor::ones(&[1, 4], DType::F32)?;
        let (mut gathers, mut scatters) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            comm.barrier()?;
            let start = Instant::now();
            let y = root.forward(&x)?;
            gathers.push(start.elapsed());
            comm.barrier()?;
            let start = Instant::now();
            root.backward(&y)?;
            scatters.push(start.elapsed());
            root.zero_grad()?;
        }
        Ok((gathers, scatters))
    })?;
    pass_times(per_rank, args.warmup)
}

/// Per parameter: the shard each rank holds (padded to `slot` elements).
fn slots(case: &Case) -> Vec<usize> {
    case.params
        .iter()
        .map(|(_, s)| s.iter().product::<usize>().div_ceil(WORLD))
        .collect()
}

/// One fused all-gather: copy every shard into one flat buffer, gather, copy each
/// parameter's pieces out of the output (rank-major) into its own full-size storage.
fn fused_all_gather(comm: &dyn Communicator, shards: &[Vec<f32>]) -> Result<(), BoxError> {
    let per_rank: usize = shards.iter().map(Vec::len).sum();
    let mut flat = Vec::with_capacity(per_rank);
    for shard in shards {
        flat.extend_from_slice(shard);
    }
    let pair = comm.all_gather(
        Buffer::from_vec(flat),
        Buffer::zeros(WireDType::F32, per_rank * WORLD),
    )?;
    let output = pair.output.into_vec::<f32>()?;
    let mut offset = 0;
    let mut full: Vec<Vec<f32>> = Vec::with_capacity(shards.len());
    for shard in shards {
        let mut param = Vec::with_capacity(shard.len() * WORLD);
        for rank in 0..WORLD {
            let start = rank * per_rank + offset;
            param.extend_from_slice(&output[start..start + shard.len()]);
        }
        offset += shard.len();
        full.push(param);
    }
    drop(full);
    Ok(())
}

/// One all-gather per parameter, its output the parameter's storage.
fn per_param_all_gather(comm: &dyn Communicator, shards: &[Vec<f32>]) -> Result<(), BoxError> {
    for shard in shards {
        comm.all_gather(
            Buffer::from_vec(shard.clone()),
            Buffer::zeros(WireDType::F32, shard.len() * WORLD),
        )?;
    }
    Ok(())
}

/// One fused reduce-scatter: copy every gradient's rank-`r` slice into chunk `r` of one flat
/// buffer, reduce-scatter, copy each parameter's reduced shard out.
fn fused_reduce_scatter(comm: &dyn Communicator, grads: &[Vec<f32>]) -> Result<(), BoxError> {
    let slot_lens: Vec<usize> = grads.iter().map(|g| g.len() / WORLD).collect();
    let per_rank: usize = slot_lens.iter().sum();
    let mut flat = Vec::with_capacity(per_rank * WORLD);
    for rank in 0..WORLD {
        for (grad, &len) in grads.iter().zip(&slot_lens) {
            flat.extend_from_slice(&grad[rank * len..(rank + 1) * len]);
        }
    }
    let pair = comm.reduce_scatter(
        Buffer::from_vec(flat),
        Buffer::zeros(WireDType::F32, per_rank),
        ReduceOp::Sum,
    )?;
    let output = pair.output.into_vec::<f32>()?;
    let mut offset = 0;
    let shards: Vec<Vec<f32>> = slot_lens
        .iter()
        .map(|&len| {
            let shard = output[offset..offset + len].to_vec();
            offset += len;
            shard
        })
        .collect();
    drop(shards);
    Ok(())
}

/// One reduce-scatter per parameter (its gradient copied into the send buffer, as FSDP must
/// keep the gradient tensor).
fn per_param_reduce_scatter(comm: &dyn Communicator, grads: &[Vec<f32>]) -> Result<(), BoxError> {
    for grad in grads {
        comm.reduce_scatter(
            Buffer::from_vec(grad.clone()),
            Buffer::zeros(WireDType::F32, grad.len() / WORLD),
            ReduceOp::Sum,
        )?;
    }
    Ok(())
}

/// The collectives path, fused or per parameter.
fn collectives_pass(args: &Args, case: &Case, fused: bool) -> Result<PassTimes, BoxError> {
    let comms = tcp_thread_world(WORLD, &args.tcp)?;
    let slot_lens = slots(case);
    let reps = args.warmup + args.reps;
    let per_rank = on_rank_threads(comms, move |rank, comm| {
        let shards: Vec<Vec<f32>> = slot_lens
            .iter()
            .map(|&len| (0..len).map(|i| (rank + i) as f32).collect())
            .collect();
        let grads: Vec<Vec<f32>> = slot_lens
            .iter()
            .map(|&len| vec![1.0; len * WORLD])
            .collect();
        let (mut gathers, mut scatters) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            comm.barrier()?;
            let start = Instant::now();
            if fused {
                fused_all_gather(comm.as_ref(), &shards)?;
            } else {
                per_param_all_gather(comm.as_ref(), &shards)?;
            }
            gathers.push(start.elapsed());
            comm.barrier()?;
            let start = Instant::now();
            if fused {
                fused_reduce_scatter(comm.as_ref(), &grads)?;
            } else {
                per_param_reduce_scatter(comm.as_ref(), &grads)?;
            }
            scatters.push(start.elapsed());
        }
        Ok((gathers, scatters))
    })?;
    pass_times(per_rank, args.warmup)
}

/// Checks once, on closed-form data, that the fused collectives path moves the right bytes
/// (a fast but wrong copy would make the table meaningless).
fn check_fused_path(args: &Args) -> Result<(), BoxError> {
    let comms = tcp_thread_world(WORLD, &args.tcp)?;
    on_rank_threads(comms, |rank, comm| {
        let shards: Vec<Vec<f32>> = (0..3)
            .map(|p| (0..4).map(|i| (100 * p + 10 * rank + i) as f32).collect())
            .collect();
        let per_rank = 12;
        let mut flat = Vec::new();
        for shard in &shards {
            flat.extend_from_slice(shard);
        }
        let pair = comm.all_gather(
            Buffer::from_vec(flat),
            Buffer::zeros(WireDType::F32, per_rank * WORLD),
        )?;
        let output = pair.output.into_vec::<f32>()?;
        // Parameter p's piece from rank r sits at r * per_rank + 4p.
        for p in 0..3 {
            for r in 0..WORLD {
                for i in 0..4 {
                    let got = output[r * per_rank + 4 * p + i];
                    if got != (100 * p + 10 * r + i) as f32 {
                        return Err(format!("all-gather layout wrong at p{p} r{r} i{i}").into());
                    }
                }
            }
        }
        Ok(())
    })?;
    Ok(())
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    /// What the bar of the plot says.
    label: String,
    case: String,
    op: &'static str,
    /// `fsdp` (the public fully_shard path) or `collectives` (bare, same copies).
    path: &'static str,
    /// `per-parameter`, `fused`, `fused zero-copy`, `bucket 1 MiB`, ...
    variant: String,
    params: usize,
    /// Unsharded bytes of the whole list (f32).
    bytes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    bucket_bytes: Option<usize>,
    zero_copy: bool,
    median_ms: f64,
    min_ms: f64,
    /// median(per-parameter) / median(this); absent on the per-parameter rows themselves.
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup: Option<f64>,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    world: usize,
    transport: String,
    ranks_as: &'static str,
    reps: usize,
    rows: Vec<Row>,
}

fn human(bytes: usize) -> String {
    for (unit, factor) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= factor && bytes.is_multiple_of(factor) {
            return format!("{} {unit}", bytes / factor);
        }
    }
    format!("{bytes} B")
}

fn short_op(op: &str) -> &'static str {
    if op == "all_gather" { "AG" } else { "RS" }
}

/// Rows for one case and path: the per-parameter baseline and each variant against it.
struct RowSet<'a> {
    case: &'a Case,
    path: &'static str,
    baseline: &'a PassTimes,
}

impl RowSet<'_> {
    fn rows(&self, variant: &str, times: &PassTimes, policy: Option<CommFusionPolicy>) -> Vec<Row> {
        let is_baseline = variant == "per-parameter";
        [
            ("all_gather", &times.all_gather, &self.baseline.all_gather),
            (
                "reduce_scatter",
                &times.reduce_scatter,
                &self.baseline.reduce_scatter,
            ),
        ]
        .into_iter()
        .map(|(op, stats, base)| Row {
            label: format!(
                "{} {} {} {variant}",
                self.case.name,
                self.path,
                short_op(op)
            ),
            case: self.case.name.clone(),
            op,
            path: self.path,
            variant: variant.to_string(),
            params: self.case.params.len(),
            bytes: self.case.numel() * 4,
            bucket_bytes: policy.filter(|p| p.enabled).map(|p| p.bucket_bytes),
            zero_copy: policy.is_some_and(|p| p.zero_copy),
            median_ms: stats.median_s * 1e3,
            min_ms: stats.min_s * 1e3,
            speedup: (!is_baseline).then(|| base.median_s / stats.median_s),
        })
        .collect()
    }
}

fn policy(enabled: bool, zero_copy: bool, bucket_bytes: usize) -> CommFusionPolicy {
    CommFusionPolicy {
        enabled,
        zero_copy,
        bucket_bytes,
    }
}

fn run(args: &Args) -> Result<Report, BoxError> {
    check_fused_path(args)?;
    let mut cases = vec![small_params_case()];
    for &embd in &args.embds {
        cases.push(block_case(embd)?);
    }
    let all_in_one = CommFusionPolicy::default().bucket_bytes;
    let mut rows = Vec::new();
    for case in &cases {
        eprintln!(
            "bench-fusion: {} ({} params, {})",
            case.name,
            case.params.len(),
            human(case.numel() * 4)
        );
        let per_param_policy = policy(false, false, all_in_one);
        let baseline = fsdp_pass(args, case, per_param_policy)?;
        let set = RowSet {
            case,
            path: "fsdp",
            baseline: &baseline,
        };
        rows.extend(set.rows("per-parameter", &baseline, Some(per_param_policy)));
        for zero_copy in [false, true] {
            let p = policy(true, zero_copy, all_in_one);
            let times = fsdp_pass(args, case, p)?;
            let variant = if zero_copy {
                "fused zero-copy"
            } else {
                "fused"
            };
            rows.extend(set.rows(variant, &times, Some(p)));
        }
        // The sweep runs on the largest block only: that is where bucket size matters.
        if case.name == format!("GPT block {}", args.embds.iter().max().unwrap_or(&0)) {
            for &bucket in &args.buckets {
                let p = policy(true, false, bucket);
                let times = fsdp_pass(args, case, p)?;
                rows.extend(set.rows(&format!("bucket {}", human(bucket)), &times, Some(p)));
            }
        }
        if args.collectives {
            let baseline = collectives_pass(args, case, false)?;
            let set = RowSet {
                case,
                path: "collectives",
                baseline: &baseline,
            };
            rows.extend(set.rows("per-parameter", &baseline, None));
            let fused = collectives_pass(args, case, true)?;
            rows.extend(set.rows("fused", &fused, None));
        }
    }
    Ok(Report {
        world: WORLD,
        transport: args.transport.clone(),
        ranks_as: "threads",
        reps: args.reps,
        rows,
    })
}

fn print_table(report: &Report) {
    println!(
        "world {}, {} transport, ranks as threads, median of {} reps (max over ranks)",
        report.world, report.transport, report.reps
    );
    println!("| case | path | op | variant | median ms | min ms | speedup vs per-parameter |");
    println!("|---|---|---|---|---|---|---|");
    for row in &report.rows {
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {} |",
            row.case,
            row.path,
            row.op,
            row.variant,
            row.median_ms,
            row.min_ms,
            row.speedup.map_or("–".to_string(), |s| format!("{s:.2}×"))
        );
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench-fusion: {e}");
            return ExitCode::from(2);
        }
    };
    let report = match run(&args) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("bench-fusion: {e}");
            return ExitCode::FAILURE;
        }
    };
    print_table(&report);
    let written = match &args.json {
        Some(path) => serde_json::to_string_pretty(&report)
            .map_err(std::io::Error::other)
            .and_then(|text| std::fs::write(path, text + "\n"))
            .map(|()| path.clone()),
        None => write_json("fusion", &report),
    };
    match written {
        Ok(path) => {
            eprintln!("wrote {}", path.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-fusion: writing the results: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_cases() {
        assert_eq!(parse_size("64K").expect("size"), 64 << 10);
        assert_eq!(parse_size("4MiB").expect("size"), 4 << 20);
        assert!(parse_size("lots").is_err());
        let small = small_params_case();
        assert_eq!(small.params.len(), 100);
        assert_eq!(small.numel() * 4, 100 * 4096);
        let block = block_case(128).expect("block");
        // LayerNorms (2 × weight+bias), c_attn, attn c_proj, c_fc, mlp c_proj (weight+bias).
        assert_eq!(block.params.len(), 12);
        let e = 128;
        assert_eq!(
            block.numel(),
            4 * e + (3 * e * e + 3 * e) + (e * e + e) + (4 * e * e + 4 * e) + (4 * e * e + e)
        );
    }
}
