//! TP + FSDP (2-d, dp × tp): column/row-parallel MLP blocks sharded again over the
//! data-parallel dim, trained N steps, equal the same MLP trained unsharded on one rank.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use hypershard_collectives::{CommCounter, Communicator, OpKind};
use hypershard_dtensor::{Placement, ProcessMesh};
use hypershard_fsdp::{
    DataParallelMesh, FsdpError, FsdpModule, FullyShardConfig, GradReduceOp, SavedShard,
    TensorParallelConfig, TpLinear, fully_shard, fully_shard_children, has_params,
};
use hypershard_mesh::DeviceMesh;
use hypershard_nn::{Linear, LinearConfig, Module, Relu, Sequential, mse_loss};
use hypershard_tensor::DType;

/// Two Megatron blocks: column 5→7, row 7→4, column 4→5, row 5→3 (ReLU between). The hidden
/// sizes 7 and 5 divide by none of the TP sizes used, and the data-parallel shards of the
/// TP-local pieces are uneven too.
const DIMS: [usize; 5] = [5, 7, 4, 5, 3];
const TOL: f64 = 1e-5;
const STEPS: usize = 3;

/// The same layers as `common::mlp(&DIMS)` (same seeds), each cut for TP: even positions
/// column-parallel, odd ones row-parallel.
fn tp_mlp(tp_mesh: &ProcessMesh) -> Result<Sequential, FsdpError> {
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    for (i, pair) in DIMS.windows(2).enumerate() {
        let full = Linear::new(LinearConfig {
            in_features: pair[0],
            out_features: pair[1],
            bias: true,
            dtype: DType::F32,
            seed: 100 + 2 * i as u64,
        })?;
        let layer = if i % 2 == 0 {
            TpLinear::column(&full, tp_mesh)?
        } else {
            TpLinear::row(&full, tp_mesh)?
        };
        layers.push(Box::new(layer));
        if i + 2 < DIMS.len() {
            layers.push(Box::new(Relu::new()));
        }
    }
    Ok(Sequential::new(layers))
}

/// The `[dp, tp]` world mesh, its data-parallel mesh and the config.
fn meshes(
    dp: usize,
    tp: usize,
    comm: Arc<dyn Communicator>,
) -> Result<(ProcessMesh, Arc<DataParallelMesh>, FullyShardConfig), FsdpError> {
    let world = ProcessMesh::new(DeviceMesh::new(&[dp, tp], &["dp", "tp"])?, comm)?;
    let dp_mesh = DataParallelMesh::from_process_mesh(world.select(&["dp"])?)?;
    let mut config = FullyShardConfig::new(dp_mesh.clone());
    config.tensor_parallel = Some(TensorParallelConfig::new(world.clone(), "tp"));
    Ok((world, dp_mesh, config))
}

struct TpRun {
    /// The global gradient norm before clipping, per step (with clipping).
    norms: Vec<f64>,
    /// This rank's pieces, for loading at another shape.
    saved: BTreeMap<String, SavedShard>,
    /// The parameters reassembled from the sharded state dict (on every rank).
    full: Params,
    /// The full state dict (rank 0 only).
    full_state_dict: Option<Params>,
    /// (name, global shape, TP placement) of every managed parameter.
    infos: Vec<(String, Vec<usize>, Option<Placement>)>,
}

fn to_params(map: BTreeMap<String, hypershard_tensor::Tensor>) -> Params {
    map.into_iter()
        .map(|(name, t)| {
            let values = t.to_f64_vec().expect("f64");
            (name, (t.shape().to_vec(), values))
        })
        .collect()
}

/// The TP MLP on this rank, each layer a unit, under a root.
fn build(
    setup: Setup,
    comm: Arc<dyn Communicator>,
) -> Result<(ProcessMesh, Arc<DataParallelMesh>, FsdpModule), FsdpError> {
    let (world, dp_mesh, mut config) = meshes(setup.dp, setup.tp, comm)?;
    if let Some(tp_config) = &mut config.tensor_parallel {
        tp_config.replicated_grad_op = setup.replicated_grad_op;
    }
    let mut model = tp_mlp(&world.select(&["tp"])?)?;
    hypershard_nn::to_device(&mut model, &setup.device.rank(world.rank()))?;
    fully_shard_children(&mut model, &config, &mut |_, m| has_params(m))?;
    let model = fully_shard(Box::new(model), config)?;
    Ok((world, dp_mesh, model))
}

/// Every parameter gathered whole from the sharded state dict's DTensors (collective).
fn full_params(model: &mut FsdpModule) -> Result<Params, FsdpError> {
    let mut full = Params::new();
    for (name, dtensor) in model.sharded_state_dict()? {
        // Read on the host whatever the device (one explicit copy).
        let t = dtensor.full_tensor()?.to_host()?;
        full.insert(name, (t.shape().to_vec(), t.to_f64_vec()?));
    }
    Ok(full)
}

/// How a run is set up: mesh, optimizer, steps and how TP-replicated gradients combine.
#[derive(Clone, Copy)]
struct Setup {
    dp: usize,
    tp: usize,
    opt: Opt,
    steps: usize,
    replicated_grad_op: GradReduceOp,
    clip: Option<f64>,
    /// Where every rank's model and batches live (a device of its own per rank).
    device: RankDevice,
}

/// The host, or an emulated device per rank.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RankDevice {
    Host,
    Emulated,
}

impl RankDevice {
    fn rank(self, rank: usize) -> hypershard_tensor::Device {
        match self {
            RankDevice::Host => hypershard_tensor::Device::Cpu,
            RankDevice::Emulated => {
                rank_device(hypershard_tensor::Device::Emulated { ordinal: 0 }, rank)
            }
        }
    }
}

impl Setup {
    fn new(dp: usize, tp: usize, opt: Opt) -> Self {
        Setup {
            dp,
            tp,
            opt,
            steps: STEPS,
            replicated_grad_op: GradReduceOp::Avg,
            clip: None,
            device: RankDevice::Host,
        }
    }
}

/// Trains on this rank; `after_training` runs before the state dicts are taken.
fn train_rank(
    setup: Setup,
    comm: Arc<dyn Communicator>,
    after_training: &mut dyn FnMut(),
) -> Result<TpRun, FsdpError> {
    let Setup { dp, opt, .. } = setup;
    let (world, dp_mesh, mut model) = build(setup, comm)?;
    let mut norms = Vec::new();
    let mut optimizer = Optimizer::new(opt);
    let dp_rank = dp_mesh.shard_rank();
    assert_eq!(dp_rank, world.coordinate()[0]);
    assert_eq!(dp_mesh.world().size(), dp);
    for step in 0..setup.steps {
        let (x, y) = batch(step, DIMS[0], DIMS[4], DType::F32);
        let device = setup.device.rank(world.rank());
        let (x, y) = (
            on(&local_rows(&x, dp_rank, dp), device),
            on(&local_rows(&y, dp_rank, dp), device),
        );
        let out = model.forward(&x)?;
        let loss = mse_loss(&out, &y)?;
        model.backward(&loss.grad)?;
        if let Some(max_norm) = setup.clip {
            norms.push(model.clip_grad_norm(max_norm)?);
        }
        optimizer.step(&mut model)?;
        model.zero_grad()?;
    }
    after_training();
    let full = full_params(&mut model)?;
    let saved = model.saved_shards()?;
    let full_state_dict = model.full_state_dict()?;
    if world.rank() != 0 {
        assert!(full_state_dict.is_empty(), "rank {}", world.rank());
    }
    let full_state_dict = (world.rank() == 0).then(|| to_params(full_state_dict));
    let mut infos = Vec::new();
    for unit in model.units() {
        for p in unit.params() {
            infos.push((p.name, p.global_shape, p.tp_placement));
        }
    }
    Ok(TpRun {
        norms,
        saved,
        full,
        full_state_dict,
        infos,
    })
}

fn run(setup: Setup) -> Vec<TpRun> {
    let world = setup.dp * setup.tp;
    let comms = hypershard_collectives::local::spawn_world(world).expect("local world");
    hypershard_testkit::run_ranks(world, move |rank| {
        train_rank(setup, comms[rank].clone(), &mut || {})
    })
    .unwrap_or_else(|e| panic!("dp {} x tp {}: {e}", setup.dp, setup.tp))
}

fn check(dp: usize, tp: usize, opt: Opt) {
    let want = reference(&DIMS, DType::F32, opt, STEPS, 1);
    let runs = run(Setup::new(dp, tp, opt));
    // The same run with every rank on an emulated device of its own: the same values.
    let device_runs = run(Setup {
        device: RankDevice::Emulated,
        ..Setup::new(dp, tp, opt)
    });
    for (rank, (host, device)) in runs.iter().zip(&device_runs).enumerate() {
        assert_eq!(
            host.full, device.full,
            "rank {rank}: the emulated run differs"
        );
        assert_eq!(host.full_state_dict, device.full_state_dict, "rank {rank}");
    }
    for (rank, run) in runs.iter().enumerate() {
        let err = max_rel_err(&run.full, &want);
        assert!(
            err <= TOL,
            "dp {dp} x tp {tp} {opt:?}, rank {rank}: max rel err {err}"
        );
        match (&run.full_state_dict, rank) {
            (Some(full), 0) => {
                let err = max_rel_err(full, &want);
                assert!(err <= TOL, "full state dict: max rel err {err}");
            }
            (None, r) if r > 0 => {}
            _ => panic!("the full state dict belongs on rank 0 only"),
        }
        // Every unit reports its parameters' global shapes and TP placements.
        let expected: Vec<(String, Vec<usize>, Option<Placement>)> = (0..4)
            .flat_map(|i| {
                let (out, inp) = (DIMS[i + 1], DIMS[i]);
                let (w, b) = if i % 2 == 0 {
                    (Placement::Shard(0), Placement::Shard(0))
                } else {
                    (Placement::Shard(1), Placement::Replicate)
                };
                [
                    ("weight".to_string(), vec![out, inp], Some(w)),
                    ("bias".to_string(), vec![out], Some(b)),
                ]
            })
            .collect();
        assert_eq!(run.infos, expected);
    }
}

#[test]
fn tp_fsdp_2x2_matches_unsharded() {
    check(2, 2, Opt::Sgd);
    check(2, 2, Opt::AdamW);
}

#[test]
fn tp_fsdp_2x2_over_tcp_matches_unsharded() {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, STEPS, 1);
    let comms = tcp_world(4);
    let runs = hypershard_testkit::run_ranks(4, move |rank| {
        train_rank(Setup::new(2, 2, Opt::Sgd), comms[rank].clone(), &mut || {})
    })
    .unwrap_or_else(|e| panic!("tcp 2x2: {e}"));
    for run in runs {
        let err = max_rel_err(&run.full, &want);
        assert!(err <= TOL, "tcp 2x2: max rel err {err}");
    }
}

#[test]
fn tp_only_1x2_and_fsdp_only_3x1_match_unsharded() {
    check(1, 2, Opt::Sgd);
    check(3, 1, Opt::Sgd);
}

#[test]
fn tp_fsdp_2x3_with_empty_data_parallel_shards_matches_unsharded() {
    // Hidden 7 over TP 3 is 3, 3, 1 rows; the 1-row piece over dp 2 leaves rank 1 empty.
    check(2, 3, Opt::Sgd);
}

#[test]
fn summed_replicated_gradients_scale_the_row_parallel_bias_step_by_tp() {
    // One SGD step (the momentum buffer starts as the gradient, so the update is lr·grad):
    // with `Sum` the replicated biases' gradients are tp times the reference's, every other
    // parameter's are the reference's. This shows the TP all-reduce covers exactly them.
    let (dp, tp) = (2, 2);
    let initial = reference(&DIMS, DType::F32, Opt::Sgd, 0, 1);
    let want = reference(&DIMS, DType::F32, Opt::Sgd, 1, 1);
    let mut setup = Setup::new(dp, tp, Opt::Sgd);
    setup.steps = 1;
    setup.replicated_grad_op = GradReduceOp::Sum;
    for run in run(setup) {
        for (name, (_, got)) in &run.full {
            let scale = if name == "2.bias" || name == "6.bias" {
                tp as f64
            } else {
                1.0
            };
            let (p0, want) = (&initial[name].1, &want[name].1);
            for ((g, w), p) in got.iter().zip(want).zip(p0) {
                let expected = p - scale * (p - w);
                assert!(
                    (g - expected).abs() <= 1e-5 * (1.0 + expected.abs()),
                    "{name}: got {g}, expected {expected}"
                );
            }
        }
    }
}

#[test]
fn clipping_the_global_norm_matches_unsharded() {
    const MAX_NORM: f64 = 0.05;
    // The reference: the plain MLP with nn's clip_grad_norm before each step.
    let mut model = mlp(&DIMS, DType::F32);
    let mut optimizer = Optimizer::new(Opt::Sgd);
    let mut want_norms = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, DIMS[0], DIMS[4], DType::F32);
        let out = model.forward(&x).expect("forward");
        let loss = mse_loss(&out, &y).expect("loss");
        model.backward(&loss.grad).expect("backward");
        want_norms.push(hypershard_nn::optim::clip_grad_norm(&mut model, MAX_NORM).expect("clip"));
        optimizer.step(&mut model).expect("step");
        hypershard_nn::zero_grad(&mut model).expect("zero_grad");
    }
    let want = params_of(&model);
    assert!(
        want_norms.iter().all(|n| *n > MAX_NORM),
        "clipping must act"
    );
    for (dp, tp) in [(2, 2), (1, 3), (3, 1)] {
        let mut setup = Setup::new(dp, tp, Opt::Sgd);
        setup.clip = Some(MAX_NORM);
        for run in run(setup) {
            for (got, want) in run.norms.iter().zip(&want_norms) {
                assert!(
                    (got - want).abs() <= 1e-5 * want,
                    "{dp}x{tp}: norm {got} vs {want}"
                );
            }
            let err = max_rel_err(&run.full, &want);
            assert!(err <= TOL, "{dp}x{tp}: max rel err {err}");
        }
    }
}

#[test]
fn pieces_saved_at_2x2_and_a_full_state_dict_load_at_other_shapes() {
    let want = reference(&DIMS, DType::F32, Opt::Sgd, STEPS, 1);
    let mut saved: BTreeMap<String, Vec<SavedShard>> = BTreeMap::new();
    for run in run(Setup::new(2, 2, Opt::Sgd)) {
        for (name, piece) in run.saved {
            saved.entry(name).or_default().push(piece);
        }
    }
    let saved = Arc::new(saved);
    let global: Arc<BTreeMap<String, hypershard_tensor::Tensor>> = Arc::new(
        want.iter()
            .map(|(name, (shape, values))| {
                let t = hypershard_tensor::Tensor::from_vec(
                    values.iter().map(|v| *v as f32).collect::<Vec<f32>>(),
                    shape,
                )
                .expect("tensor");
                (name.clone(), t)
            })
            .collect(),
    );
    for (dp, tp) in [(3, 1), (1, 2), (2, 3)] {
        let comms = hypershard_collectives::local::spawn_world(dp * tp).expect("world");
        let (saved, global) = (saved.clone(), global.clone());
        let results = hypershard_testkit::run_ranks(dp * tp, move |rank| {
            let setup = Setup::new(dp, tp, Opt::Sgd);
            let (_, _, mut from_pieces) = build(setup, comms[rank].clone())?;
            from_pieces.load_saved_shards(&saved)?;
            let (_, _, mut from_full) = build(setup, comms[rank].clone())?;
            from_full.load_state_dict(&global)?;
            Ok::<_, FsdpError>((full_params(&mut from_pieces)?, full_params(&mut from_full)?))
        })
        .unwrap_or_else(|e| panic!("{dp}x{tp}: {e}"));
        for (pieces, full) in results {
            let err = max_rel_err(&pieces, &want);
            assert!(err <= TOL, "{dp}x{tp} from pieces: max rel err {err}");
            let err = max_rel_err(&full, &want);
            assert!(
                err <= TOL,
                "{dp}x{tp} from the full state dict: max rel err {err}"
            );
        }
    }
}

/// Counts per rank after training (before the state dicts): all-gathers, reduce-scatters and
/// all-reduces on the dp group and on the tp group.
#[test]
fn each_unit_adds_one_tp_all_reduce_for_its_replicated_bias_per_backward() {
    let (dp, tp) = (2, 2);
    let counters: Vec<Arc<CommCounter>> = counted_world(dp * tp);
    let results = hypershard_testkit::run_ranks(dp * tp, move |rank| {
        let comm: Arc<dyn Communicator> = counters[rank].clone();
        let counter = counters[rank].clone();
        let mut children: Vec<(u64, u64, u64)> = Vec::new();
        train_rank(Setup::new(dp, tp, Opt::Sgd), comm, &mut || {
            children = counter
                .children()
                .iter()
                .map(|c| {
                    (
                        c.calls(OpKind::AllGather),
                        c.calls(OpKind::ReduceScatter),
                        c.calls(OpKind::AllReduce),
                    )
                })
                .collect();
        })?;
        Ok::<_, FsdpError>(children)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let steps = STEPS as u64;
    for children in results {
        // Split order: the dp group, then the tp group (one communicator per mesh dim).
        assert_eq!(children.len(), 2, "{children:?}");
        // Four units, each gathered in forward and again in backward; one reduce-scatter per
        // unit per backward; no all-reduce over dp.
        assert_eq!(children[0], (8 * steps, 4 * steps, 0));
        let (tp_ag, tp_rs, tp_ar) = children[1];
        assert_eq!((tp_ag, tp_rs), (0, 0));
        // Per step: two row-parallel forwards and two column-parallel backwards all-reduce
        // activations; the two row-parallel units all-reduce their replicated bias's reduced
        // shard.
        assert_eq!(tp_ar, steps * (2 + 2 + 2));
    }
}

#[test]
fn misconfigured_tensor_parallelism_gives_typed_errors() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("world");
    hypershard_testkit::run_ranks(2, move |rank| {
        let (world, dp_mesh, config) = meshes(1, 2, comms[rank].clone())?;
        let tp_mesh = world.select(&["tp"])?;
        // TP layers without the TP config.
        let plain = FullyShardConfig::new(dp_mesh.clone());
        let rejected = fully_shard(Box::new(tp_mlp(&tp_mesh)?), plain).expect_err("no tp config");
        assert!(matches!(
            rejected.error,
            FsdpError::TpConfigMissing { ref param } if param == "0.bias"
        ));
        // A layer over another TP group: the dp group (both ranks) instead of the tp one.
        let full = Linear::new(LinearConfig {
            in_features: 4,
            out_features: 3,
            bias: true,
            dtype: DType::F32,
            seed: 1,
        })?;
        let wrong = world.select(&["dp"])?;
        let layer = TpLinear::column(&full, &wrong)?;
        let rejected = fully_shard(Box::new(layer), config.clone()).expect_err("wrong mesh");
        assert!(matches!(rejected.error, FsdpError::TpMeshMismatch { .. }));
        // A TP mesh must be 1-d.
        assert!(matches!(
            TpLinear::row(&full, &world),
            Err(FsdpError::TpMeshDims { ndim: 2 })
        ));
        // replicate_params are not built for TP.
        let mut replicated = config.clone();
        replicated.replicate_params = ["bias".to_string()].into();
        let rejected = fully_shard(Box::new(TpLinear::column(&full, &tp_mesh)?), replicated)
            .expect_err("replicate_params");
        assert!(matches!(
            rejected.error,
            FsdpError::TpUnsupported {
                what: "replicate_params"
            }
        ));
        // The module came back unchanged: its TP-local weight shape.
        let mut shapes = Vec::new();
        rejected.module.visit_params("", &mut |_, p| {
            shapes.push(p.data()?.shape().to_vec());
            Ok(())
        })?;
        assert_eq!(shapes, vec![vec![2 - rank, 4], vec![2 - rank]]);
        Ok::<_, FsdpError>(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
}
