//! Deferred (shape-only) modules: built without storage, refused on use, materialised to
//! exactly the eager values. Every check runs on the host and on the emulated device: a
//! materialised model moved to either gives the eager values bit for bit, and a deferred one
//! is the same typed error on both.

mod common;

use std::sync::Arc;

use common::{EMULATED, host_values, same_on_both};
use hypershard_nn::{
    Error, Gpt, GptConfig, InitRequest, Linear, LinearConfig, Module, materialize_module, to_device,
};
use hypershard_tensor::memory::MemoryTracker;
use hypershard_tensor::{DType, Device, Tensor, deferred_init};

fn small_gpt() -> GptConfig {
    GptConfig {
        vocab_size: 67,
        block_size: 13,
        n_layer: 2,
        n_head: 2,
        n_embd: 10,
        bias: true,
        dropout: 0.0,
        dtype: DType::F32,
        seed: 5,
    }
}

fn bytes_by_name(module: &dyn Module) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    module
        .visit_params("", &mut |name, param| {
            // Read on the host whatever the device (one explicit copy).
            out.push((name.to_string(), param.data()?.to_host()?.to_bytes()?));
            Ok(())
        })
        .expect("every parameter has data");
    out
}

#[test]
fn a_deferred_gpt_costs_no_storage_and_knows_its_size() {
    let tracker = MemoryTracker::new();
    let gpt = {
        let _scope = tracker.enter();
        Gpt::new_deferred(GptConfig::gpt2()).expect("deferred gpt2")
    };
    assert_eq!(tracker.peak_bytes(), 0, "no parameter storage allocated");
    // Moving it to a device is refused before a byte is copied or allocated there.
    let mut gpt = gpt;
    for device in [Device::Cpu, EMULATED] {
        let _scope = tracker.enter();
        let refused = to_device(&mut gpt, &device).expect_err("deferred");
        assert!(matches!(refused, Error::Deferred { .. }), "{refused:?}");
        assert_eq!(tracker.device_stats(&device).peak_bytes, 0, "{device:?}");
    }
    assert_eq!(
        tracker.peak_bytes(),
        0,
        "no storage allocated by a refused move"
    );
    // nanoGPT's GPT-2 small with the padded vocabulary: 124,475,904 parameters (wte counted
    // once), 123,689,472 without wpe.
    assert_eq!(gpt.num_params(false).expect("count"), 124_475_904);
    assert_eq!(gpt.num_params(true).expect("count"), 123_689_472);
}

#[test]
fn materialising_a_deferred_gpt_gives_the_eager_values_bitwise() {
    for config in [
        small_gpt(),
        GptConfig {
            dtype: DType::BF16,
            bias: false,
            ..small_gpt()
        },
    ] {
        // Materialised on this rank, then moved as a user would: on either device the bytes
        // are the eager model's, and the device's equal the host's.
        same_on_both(|d| {
            let mut eager = Gpt::new(config).expect("eager");
            to_device(&mut eager, d).expect("eager to_device");
            let mut deferred = Gpt::new_deferred(config).expect("deferred");
            materialize_module(&mut deferred).expect("materialise");
            to_device(&mut deferred, d).expect("materialised to_device");
            let bytes = bytes_by_name(&deferred);
            assert_eq!(bytes, bytes_by_name(&eager), "{d:?}");
            bytes
        });
    }
}

#[test]
fn using_a_deferred_model_is_a_typed_error_naming_the_parameter() {
    // The same refusal, naming the same parameter, whichever device the input is on.
    same_on_both(|d| {
        let mut gpt = Gpt::new_deferred(small_gpt()).expect("deferred");
        let ids = Tensor::from_vec(vec![1i64, 2, 3], &[1, 3])
            .and_then(|t| t.to_device(d))
            .expect("ids");
        let refused = match gpt.forward(&ids) {
            Err(Error::Deferred { name }) => name,
            other => panic!("expected Error::Deferred on {d:?}, got {other:?}"),
        };
        assert_eq!(refused, "transformer.wte.weight");
        // Writing through the tensor names the tensor op.
        gpt.visit_params("", &mut |name, param| {
            if name == "transformer.ln_f.weight" {
                let error = param.tensor()?.fill_(0.0).expect_err("deferred");
                assert!(matches!(
                    error,
                    hypershard_tensor::Error::Deferred { op: "fill_" }
                ));
                let message = param.data().expect_err("deferred").to_string();
                assert!(message.contains("transformer.ln_f.weight"), "{message}");
            }
            Ok(())
        })
        .expect("visit");
        refused
    });
}

#[test]
fn an_init_hook_builds_any_block_and_a_wrong_block_is_refused() {
    let config = LinearConfig {
        in_features: 3,
        out_features: 5,
        bias: true,
        dtype: DType::F64,
        seed: 1,
    };
    let mut layer = deferred_init(|| Linear::new(config)).expect("deferred linear");
    // The user's init: weight[i][j] = 10 i + j, a pure function of the global index.
    layer
        .visit_params_mut("", &mut |name, param| {
            if name == "weight" {
                param.init = Some(Arc::new(|req: InitRequest<'_>| {
                    let (rows, cols) = (req.shape[0], req.shape[1]);
                    let values = (0..rows * cols)
                        .map(|k| {
                            let (i, j) = (req.offset[0] + k / cols, req.offset[1] + k % cols);
                            (10 * i + j) as f64
                        })
                        .collect();
                    Ok(Tensor::from_vec(values, req.shape)?)
                }));
            }
            if name == "bias" {
                // A hook that returns the wrong shape.
                param.init = Some(Arc::new(|_req: InitRequest<'_>| {
                    Ok(Tensor::zeros(&[1], DType::F64)?)
                }));
            }
            Ok(())
        })
        .expect("hooks");
    layer
        .visit_params("", &mut |name, param| {
            if name == "weight" {
                let rows = param.materialize_block(&[2, 0], &[2, 3])?;
                // The block is built on the host; on either device it keeps the hook's values.
                let values = same_on_both(|d| host_values(&rows.to_device(d).expect("rows")));
                assert_eq!(values, vec![20.0, 21.0, 22.0, 30.0, 31.0, 32.0]);
            } else {
                match param.materialize_block(&[0], &[5]) {
                    Err(Error::Materialize { name, reason }) => {
                        assert_eq!(name, "bias");
                        assert!(reason.contains("[1]"), "{reason}");
                    }
                    other => panic!("expected Error::Materialize, got {other:?}"),
                }
            }
            Ok(())
        })
        .expect("visit");
}
