//! Invalid configs and misuse give typed errors, and a refused module comes back unchanged.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use hypershard_fsdp::{
    DataParallelMesh, FsdpError, FullyShardConfig, ReshardAfterForward, fully_shard,
};
use hypershard_mesh::DeviceMesh;
use hypershard_nn::{Linear, LinearConfig, Module};
use hypershard_tensor::{DType, Device, Tensor};

fn one_rank_mesh() -> Arc<DataParallelMesh> {
    let comm = hypershard_collectives::local::spawn_world(1)
        .expect("world")
        .remove(0);
    DataParallelMesh::fsdp(comm).expect("mesh")
}

fn linear() -> Box<dyn Module> {
    Box::new(
        Linear::new(LinearConfig {
            in_features: 3,
            out_features: 2,
            bias: true,
            dtype: DType::F32,
            seed: 1,
        })
        .expect("layer"),
    )
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_three_dim_mesh_and_mismatched_worlds_are_refused() {
    let comm = hypershard_collectives::local::spawn_world(1)
        .expect("world")
        .remove(0);
    let mesh = DeviceMesh::new(&[1, 1, 1], &[]).expect("mesh");
    assert!(matches!(
        DataParallelMesh::new(mesh, comm.clone()),
        Err(FsdpError::MeshDims { ndim: 3 })
    ));
    let mesh = DeviceMesh::new(&[2], &[]).expect("mesh");
    assert!(matches!(
        DataParallelMesh::new(mesh, comm),
        Err(FsdpError::WorldSizeMismatch {
            mesh_ranks: 2,
            comm_size: 1,
            rank: 0
        })
    ));
}

#[test]
fn bad_configs_are_refused_and_the_module_comes_back_intact() {
    let mesh = one_rank_mesh();
    let before = params_of(linear().as_ref());

    let mut config = FullyShardConfig::new(mesh.clone());
    config.shard_placement_fn = Some(Arc::new(|_, _| Some(2)));
    let rejected = fully_shard(linear(), config).expect_err("dim 2 of a 2-d weight");
    assert!(matches!(
        &rejected.error,
        FsdpError::ShardDimOutOfRange { param, dim: 2, .. } if param == "weight"
    ));
    assert_eq!(params_of(rejected.module.as_ref()), before);

    let mut config = FullyShardConfig::new(mesh.clone());
    config.ignored_params = names(&["bias"]);
    config.replicate_params = names(&["bias"]);
    let rejected = fully_shard(linear(), config).expect_err("both lists");
    assert!(
        matches!(&rejected.error, FsdpError::IgnoredAndReplicated { param } if param == "bias")
    );

    let mut config = FullyShardConfig::new(mesh.clone());
    config.ignored_params = names(&["nope"]);
    let rejected = fully_shard(linear(), config).expect_err("unknown name");
    assert!(matches!(
        &rejected.error,
        FsdpError::UnknownParam { list: "ignored_params", param } if param == "nope"
    ));

    let unit = fully_shard(linear(), FullyShardConfig::new(mesh.clone())).expect("first wrap");
    let rejected =
        fully_shard(Box::new(unit), FullyShardConfig::new(mesh.clone())).expect_err("twice");
    assert!(matches!(rejected.error, FsdpError::AlreadySharded));
    assert_eq!(rejected.module.kind(), "FsdpModule");
}

#[test]
fn a_post_forward_group_that_does_not_divide_the_shard_group_is_refused() {
    let comms = hypershard_collectives::local::spawn_world(4).expect("world");
    hypershard_testkit::run_ranks(4, move |rank| {
        let mesh = DataParallelMesh::fsdp(comms[rank].clone())?;
        let mut config = FullyShardConfig::new(mesh);
        config.reshard_after_forward = ReshardAfterForward::ToGroupOf(3);
        match fully_shard(linear(), config) {
            Err(rejected) => match rejected.error {
                FsdpError::ReshardSize {
                    value: 3,
                    shard_world: 4,
                } => Ok(()),
                other => Err(other),
            },
            Ok(_) => Err(FsdpError::AlreadySharded),
        }
    })
    .expect("every rank refuses");
}

#[test]
fn misuse_gives_typed_errors() {
    let mesh = one_rank_mesh();
    let config = FullyShardConfig::new(mesh);
    let mut unit =
        fully_shard(Box::new(mlp(&[3, 2, 2], DType::F32)), config.clone()).expect("wrap");
    // Backward before any forward.
    assert!(matches!(
        unit.backward(&Tensor::ones(&[1, 2], DType::F32).expect("t")),
        Err(FsdpError::Nn(
            hypershard_nn::Error::BackwardBeforeForward { .. }
        ))
    ));
    // A parameter replaced behind fully_shard's back is detected at the next unshard.
    unit.visit_params_mut("", &mut |name, p| {
        if name == "0.bias" {
            p.data = Some(Tensor::zeros(&[2], DType::F32)?);
        }
        Ok(())
    })
    .expect("visit");
    let x = Tensor::ones(&[1, 3], DType::F32).expect("t");
    assert!(matches!(
        unit.forward(&x),
        Err(FsdpError::ParamReplaced { param }) if param == "0.bias"
    ));
}

#[test]
fn a_nested_hook_error_reaches_the_root_typed() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("world");
    hypershard_testkit::run_ranks(2, move |rank| {
        let mesh = DataParallelMesh::fsdp(comms[rank].clone())?;
        let config = FullyShardConfig::new(mesh);
        let mut root = shard_model(mlp(&[3, 4, 2], DType::F32), &config)?;
        // Replace the second unit's weight shard with a tensor of another storage.
        root.visit_params_mut("", &mut |name, p| {
            if name == "2.weight" {
                let shard = p.data()?.deep_copy()?;
                p.data = Some(shard);
            }
            Ok(())
        })?;
        let x = Tensor::ones(&[2, 3], DType::F32)?;
        // Through the `Module` trait the error is nn's `Foreign`, carrying the typed error.
        match hypershard_nn::Module::forward(&mut root, &x) {
            Err(hypershard_nn::Error::Foreign { op, source }) => {
                assert_eq!(op, "fully_shard hook");
                let typed = source.downcast::<FsdpError>().expect("an FsdpError inside");
                assert!(
                    matches!(&*typed, FsdpError::ParamReplaced { param } if param == "weight"),
                    "{typed:?}"
                );
            }
            other => panic!("expected a Foreign error, got {other:?}"),
        }
        // The inherent method unwraps it again.
        match root.forward(&x) {
            Err(FsdpError::ParamReplaced { param }) if param == "weight" => Ok(()),
            Err(other) => Err(other),
            Ok(_) => Err(FsdpError::AlreadySharded),
        }
    })
    .expect("the root reports the nested unit's typed error");
}

#[test]
fn calling_the_wrapped_module_directly_sees_shards_and_fails_typed() {
    let comms = hypershard_collectives::local::spawn_world(2).expect("world");
    hypershard_testkit::run_ranks(2, move |rank| {
        let mesh = DataParallelMesh::fsdp(comms[rank].clone())?;
        let mut unit = fully_shard(linear(), FullyShardConfig::new(mesh))?;
        let x = Tensor::ones(&[2, 3], DType::F32)?;
        // The weight is a [1, 3] shard: the bias [1] no longer matches the output [2, 2]...
        // whatever the layer reports, it is a typed nn error, not a panic.
        match unit.inner_mut().forward(&x) {
            Err(_) => Ok(()),
            Ok(_) => Err(FsdpError::AlreadySharded),
        }
    })
    .expect("typed error");
}

#[test]
fn a_module_with_parameters_on_two_devices_is_refused_naming_both() {
    let emulated = Device::Emulated { ordinal: 0 };
    // The weight on the emulated device, the bias on the host.
    let mixed = || {
        let mut layer = linear();
        layer
            .visit_params_mut("", &mut |name, p| {
                if name == "weight" {
                    p.data = Some(p.data()?.to_device(&emulated)?);
                }
                Ok(())
            })
            .expect("move the weight");
        layer
    };
    let before = params_of(mixed().as_ref());
    let rejected =
        fully_shard(mixed(), FullyShardConfig::new(one_rank_mesh())).expect_err("two devices");
    assert!(
        matches!(
            &rejected.error,
            FsdpError::ParamDevice { param, expected, actual }
                if param == "bias" && *expected == emulated && *actual == Device::Cpu
        ),
        "{:?}",
        rejected.error
    );
    let message = rejected.error.to_string();
    assert!(message.contains("bias") && message.contains("Emulated") && message.contains("Cpu"));
    // Nothing changed: the weight is still on the device, the bias on the host.
    assert_eq!(params_of(rejected.module.as_ref()), before);
    let mut devices = Vec::new();
    rejected
        .module
        .visit_params("", &mut |_, p| {
            devices.push(p.data()?.device());
            Ok(())
        })
        .expect("visit");
    assert_eq!(devices, vec![emulated, Device::Cpu]);

    // A module on one device but not the configured one is refused the same way.
    let mut config = FullyShardConfig::new(one_rank_mesh());
    config.device = Some(emulated);
    let rejected = fully_shard(linear(), config).expect_err("host parameters");
    assert!(matches!(
        &rejected.error,
        FsdpError::ParamDevice { param, expected, actual }
            if param == "weight" && *expected == emulated && *actual == Device::Cpu
    ));
    // Ignored parameters may live anywhere.
    let mut config = FullyShardConfig::new(one_rank_mesh());
    config.ignored_params = names(&["bias"]);
    let unit = fully_shard(mixed(), config).expect("the bias is not managed");
    assert_eq!(unit.params().len(), 1);
}

#[test]
fn inputs_on_another_device_than_the_unit_are_typed_errors() {
    for (unit_device, input_device) in [
        (Device::Cpu, Device::Emulated { ordinal: 0 }),
        (Device::Emulated { ordinal: 0 }, Device::Cpu),
    ] {
        let mut unit = fully_shard(
            Box::new(moved(mlp(&[3, 2, 2], DType::F32), unit_device)),
            FullyShardConfig::new(one_rank_mesh()),
        )
        .expect("wrap");
        let x = on(&Tensor::ones(&[1, 3], DType::F32).expect("t"), input_device);
        let error = unit.forward(&x).expect_err("input on another device");
        assert!(
            matches!(
                &error,
                FsdpError::Nn(hypershard_nn::Error::Tensor(
                    hypershard_tensor::Error::DeviceMismatch { .. }
                )) | FsdpError::Tensor(hypershard_tensor::Error::DeviceMismatch { .. })
            ),
            "{unit_device:?} unit, {input_device:?} input: {error:?}"
        );
        // The unit is still usable with an input where it is.
        let x = on(&Tensor::ones(&[1, 3], DType::F32).expect("t"), unit_device);
        unit.reshard().expect("reshard after the failed forward");
        let y = unit.forward(&x).expect("forward on the unit's device");
        assert_eq!(y.device(), unit_device);
    }
}
