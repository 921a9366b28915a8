//! The GPT: nanoGPT names and shapes, finite-difference backward, tied lm_head, children for
//! wrapping, safetensors round trip, dtypes, dropout modes. The forward-level tests run on the
//! host and on the emulated device (`same_on_both`), with the same values on both.

mod common;

use common::{check_params, same_on_both};
use hypershard_nn::{
    Error, Gpt, GptConfig, Identity, Module, ParamVisitor, ParamVisitorMut, Result,
    parameter_names, replace_module,
};
use hypershard_tensor::{DType, Device, Tensor};

fn tiny(dtype: DType, bias: bool) -> GptConfig {
    GptConfig {
        vocab_size: 7,
        block_size: 4,
        n_layer: 2,
        n_head: 2,
        n_embd: 4,
        bias,
        dropout: 0.0,
        dtype,
        seed: 3,
    }
}

fn ids(values: &[i64], shape: &[usize]) -> Tensor {
    // invariant: the tests pass matching lengths.
    Tensor::from_vec(values.to_vec(), shape).expect("ids")
}

fn gpt(config: GptConfig) -> Gpt {
    // invariant: the tests' configs are valid.
    Gpt::new(config).expect("gpt")
}

/// A GPT of `config` on `device`.
fn gpt_on(config: GptConfig, device: &Device) -> Gpt {
    let mut model = gpt(config);
    // invariant: a materialised model moves to any device this machine has.
    hypershard_nn::to_device(&mut model, device).expect("to_device");
    model
}

/// The device of the model's parameters.
fn device_of(model: &Gpt) -> Device {
    let mut device = Device::Cpu;
    model
        .visit_params("", &mut |_, p| {
            device = p.data()?.device();
            Ok(())
        })
        .expect("visit");
    device
}

/// The logits for `input` (moved to the model's device), read on the host.
fn logits(model: &mut Gpt, input: &Tensor) -> Vec<f64> {
    let input = input.to_device(&device_of(model)).expect("input");
    model
        .forward(&input)
        .and_then(|y| Ok(y.to_host()?.to_f64_vec()?))
        .expect("forward")
}

#[test]
fn names_and_shapes_are_nanogpts() {
    let model = gpt(tiny(DType::F32, true));
    let mut got = Vec::new();
    model
        .visit_params("", &mut |name, p| {
            got.push((name.to_string(), p.data()?.shape().to_vec(), p.name.clone()));
            Ok(())
        })
        .expect("visit");
    let mut expected: Vec<(String, Vec<usize>)> = vec![
        ("transformer.wte.weight".into(), vec![7, 4]),
        ("transformer.wpe.weight".into(), vec![4, 4]),
    ];
    for i in 0..2 {
        let p = |s: &str| format!("transformer.h.{i}.{s}");
        expected.extend([
            (p("ln_1.weight"), vec![4]),
            (p("ln_1.bias"), vec![4]),
            (p("attn.c_attn.weight"), vec![12, 4]),
            (p("attn.c_attn.bias"), vec![12]),
            (p("attn.c_proj.weight"), vec![4, 4]),
            (p("attn.c_proj.bias"), vec![4]),
            (p("ln_2.weight"), vec![4]),
            (p("ln_2.bias"), vec![4]),
            (p("mlp.c_fc.weight"), vec![16, 4]),
            (p("mlp.c_fc.bias"), vec![16]),
            (p("mlp.c_proj.weight"), vec![4, 16]),
            (p("mlp.c_proj.bias"), vec![4]),
        ]);
    }
    expected.push(("transformer.ln_f.weight".into(), vec![4]));
    expected.push(("transformer.ln_f.bias".into(), vec![4]));
    let names: Vec<(String, Vec<usize>)> =
        got.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
    assert_eq!(names, expected);
    // Errors name parameters by their full path.
    assert!(got.iter().all(|(name, _, stored)| name == stored));

    // Parameter counts: V·C + T·C + L·(12C² + 13C) + 2C with biases; without, the linear
    // biases and norm biases go: L·(12C² + 2C) + C.
    let (v, t, c, l) = (7, 4, 4, 2);
    assert_eq!(
        model.num_params(false).expect("count"),
        v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c
    );
    assert_eq!(
        model.num_params(true).expect("count"),
        v * c + l * (12 * c * c + 13 * c) + 2 * c
    );
    let no_bias = gpt(tiny(DType::F32, false));
    assert_eq!(
        no_bias.num_params(false).expect("count"),
        v * c + t * c + l * (12 * c * c + 2 * c) + c
    );
    assert!(
        !parameter_names(&no_bias)
            .expect("names")
            .iter()
            .any(|n| n.ends_with("bias"))
    );
}

#[test]
fn full_backward_matches_finite_differences() {
    for bias in [true, false] {
        let mut model = gpt(tiny(DType::F64, bias));
        // Token 5 appears twice, so its wte row collects two embedding contributions plus the
        // lm_head's; T = 3 < block_size leaves the last wpe row with a zero gradient.
        let input = ids(&[5, 0, 5, 2, 6, 1], &[2, 3]);
        check_params(&mut model, &input, 17);
    }
}

#[test]
fn init_follows_nanogpt() {
    let config = GptConfig {
        vocab_size: 64,
        block_size: 32,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        ..tiny(DType::F64, true)
    };
    let model = gpt(config);
    model
        .visit_params("", &mut |name, p| {
            let values = p.data()?.to_f64_vec()?;
            let n = values.len() as f64;
            let mean = values.iter().sum::<f64>() / n;
            let std = (values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n).sqrt();
            if name.contains("ln_") {
                let expected = if name.ends_with("weight") { 1.0 } else { 0.0 };
                assert!(values.iter().all(|v| *v == expected), "{name}");
            } else if name.ends_with("bias") {
                assert!(values.iter().all(|v| *v == 0.0), "{name}");
            } else {
                let want = if name.ends_with("c_proj.weight") {
                    0.02 / (2.0f64 * 2.0).sqrt() // 0.02/√(2·n_layer), n_layer = 2
                } else {
                    0.02
                };
                // At least 1024 samples: the sample std is within 10% with overwhelming odds.
                assert!(
                    (std / want - 1.0).abs() < 0.1,
                    "{name}: std {std} vs {want}"
                );
                assert!(mean.abs() < want * 0.2, "{name}: mean {mean}");
            }
            Ok(())
        })
        .expect("visit");
    // The same seed gives the same model, another seed another one.
    let again = gpt(config);
    let other = gpt(GptConfig { seed: 4, ..config });
    let first = |m: &Gpt| {
        let mut v = Vec::new();
        m.visit_params("", &mut |_, p| {
            v.extend(p.data()?.to_f64_vec()?);
            Ok(())
        })
        .expect("visit");
        v
    };
    assert_eq!(first(&model), first(&again));
    assert_ne!(first(&model), first(&other));
}

/// A wrapper that counts calls, standing in for a `fully_shard` unit.
struct Counting {
    inner: Box<dyn Module>,
    forwards: usize,
    backwards: usize,
}

impl Module for Counting {
    fn kind(&self) -> &'static str {
        "Counting"
    }
    fn forward(&mut self, input: &Tensor) -> Result<Tensor> {
        self.forwards += 1;
        self.inner.forward(input)
    }
    fn backward(&mut self, grad_output: &Tensor) -> Result<Tensor> {
        self.backwards += 1;
        self.inner.backward(grad_output)
    }
    fn visit_params(&self, prefix: &str, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.inner.visit_params(prefix, f)
    }
    fn visit_params_mut(&mut self, prefix: &str, f: &mut ParamVisitorMut<'_>) -> Result<()> {
        self.inner.visit_params_mut(prefix, f)
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

#[test]
fn blocks_are_children_that_wrappers_replace_in_place() {
    let mut model = gpt(tiny(DType::F32, true));
    let input = ids(&[1, 2, 3, 4], &[1, 4]);
    let before = logits(&mut model, &input);
    let names_before = parameter_names(&model).expect("names");
    let mut children = Vec::new();
    model
        .visit_children_mut(&mut |name, child| {
            children.push(name.to_string());
            replace_module(child, |inner| {
                Ok(Box::new(Counting {
                    inner,
                    forwards: 0,
                    backwards: 0,
                }))
            })
        })
        .expect("wrap");
    assert_eq!(children, ["transformer.h.0", "transformer.h.1"]);
    assert_eq!(parameter_names(&model).expect("names"), names_before);
    let after = model.forward(&input).expect("forward");
    assert_eq!(after.to_f64_vec().expect("f64"), before);
    model
        .backward(&Tensor::ones(after.shape(), DType::F32).expect("ones"))
        .expect("backward");
    let mut counts = Vec::new();
    model
        .visit_children_mut(&mut |_, child| {
            let any = child.as_any_mut().expect("a Counting wrapper");
            let counting = any.downcast_mut::<Counting>().expect("Counting");
            counts.push((counting.forwards, counting.backwards));
            Ok(())
        })
        .expect("visit");
    assert_eq!(counts, [(1, 1), (1, 1)]);
    // Replacing a block by the identity changes the logits: the forward really calls it.
    model
        .visit_children_mut(&mut |name, child| {
            if name == "transformer.h.1" {
                *child = Box::new(Identity);
            }
            Ok(())
        })
        .expect("replace");
    assert_ne!(logits(&mut model, &input), before);
}

#[test]
fn parameters_are_read_at_call_time() {
    same_on_both(|d| {
        let mut model = gpt_on(tiny(DType::F32, true), d);
        let input = ids(&[0, 1], &[1, 2]);
        let before = logits(&mut model, &input);
        // A wrapper frees a parameter between calls: the next forward names it.
        let mut saved = None;
        model
            .visit_params_mut("", &mut |name, p| {
                if name == "transformer.h.0.attn.c_attn.weight" {
                    saved = p.data.take();
                }
                Ok(())
            })
            .expect("visit");
        match model.forward(&input.to_device(d).expect("input")) {
            Err(Error::NotMaterialised { name }) => {
                assert_eq!(name, "transformer.h.0.attn.c_attn.weight")
            }
            other => panic!("expected NotMaterialised, got {other:?}"),
        }
        // Swapping in a doubled token embedding changes the logits.
        model
            .visit_params_mut("", &mut |name, p| {
                if name == "transformer.h.0.attn.c_attn.weight" {
                    p.data = saved.take();
                }
                if name == "transformer.wte.weight" {
                    p.data = Some(p.data()?.scale(2.0)?);
                }
                Ok(())
            })
            .expect("visit");
        let after = logits(&mut model, &input);
        assert_ne!(after, before);
        after
    });
}

#[test]
fn save_load_gives_identical_logits_and_mismatches_are_named() {
    same_on_both(|d| {
        let config = tiny(DType::F32, true);
        let mut model = gpt_on(config, d);
        let input = ids(&[6, 5, 4, 3, 2, 1, 0, 6], &[2, 4]);
        let expected = logits(&mut model, &input);
        let bytes = model.save_safetensors().expect("save");

        let mut loaded = gpt_on(GptConfig { seed: 99, ..config }, d);
        assert_ne!(logits(&mut loaded, &input), expected);
        loaded.load_safetensors(&bytes).expect("load");
        assert_eq!(logits(&mut loaded, &input), expected);

        // Through a file, with the extra keys of a torch nanoGPT state dict.
        let dir = std::env::temp_dir().join(format!(
            "hypershard-nn-gpt-{}-{}",
            std::process::id(),
            d.to_string().replace(':', "-")
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("model.safetensors");
        model.save_safetensors_file(&path).expect("save file");
        let mut tensors = hypershard_tensor::load_safetensors_file(&path).expect("read");
        let wte = tensors["transformer.wte.weight"].clone();
        tensors.insert("lm_head.weight".into(), wte);
        tensors.insert(
            "transformer.h.0.attn.bias".into(),
            Tensor::ones(&[1, 1, 4, 4], DType::F32).expect("ones"),
        );
        let mut from_file = gpt_on(GptConfig { seed: 7, ..config }, d);
        from_file.load_tensors(tensors).expect("load");
        assert_eq!(logits(&mut from_file, &input), expected);
        std::fs::remove_dir_all(&dir).expect("cleanup");

        // A wider model cannot take these tensors; the error names the first mismatching one.
        let mut wider = gpt(GptConfig {
            n_embd: 8,
            ..config
        });
        match wider.load_safetensors(&bytes) {
            Err(Error::CheckpointShape {
                name,
                expected,
                actual,
                ..
            }) => {
                assert_eq!(name, "transformer.wte.weight");
                assert_eq!((expected, actual), (vec![7, 8], vec![7, 4]));
            }
            other => panic!("expected CheckpointShape, got {other:?}"),
        }
        let mut deeper = gpt(GptConfig {
            n_layer: 3,
            ..config
        });
        assert!(matches!(
            deeper.load_safetensors(&bytes),
            Err(Error::MissingTensor { name, .. }) if name == "transformer.h.2.ln_1.weight"
        ));
        let mut shallower = gpt(GptConfig {
            n_layer: 1,
            ..config
        });
        assert!(matches!(
            shallower.load_safetensors(&bytes),
            Err(Error::UnexpectedTensor { name, .. }) if name.starts_with("transformer.h.1.")
        ));
        // A failed load leaves the model as it was.
        let mut fresh = gpt_on(config, d);
        let fresh_logits = logits(&mut fresh, &input);
        let mut bad = hypershard_tensor::load_safetensors(&bytes).expect("read");
        bad.insert(
            "transformer.h.5.ln_1.weight".into(),
            Tensor::ones(&[4], DType::F32).expect("ones"),
        );
        assert!(fresh.load_tensors(bad).is_err());
        assert_eq!(logits(&mut fresh, &input), fresh_logits);
        expected
    });
}

#[test]
fn half_precision_params_compute_in_f32() {
    let config = tiny(DType::F32, true);
    let mut reference = gpt(config);
    let input = ids(&[1, 3, 5, 0], &[1, 4]);
    let expected = logits(&mut reference, &input);
    let bytes = reference.save_safetensors().expect("save");
    let mut half = gpt(GptConfig {
        dtype: DType::BF16,
        ..config
    });
    half.load_safetensors(&bytes).expect("load casts to bf16");
    let out = half.forward(&input).expect("forward");
    assert_eq!(out.dtype(), DType::BF16);
    for (got, want) in out.to_f64_vec().expect("f64").iter().zip(&expected) {
        // Logits are O(0.1) with 0.02-std weights; bf16 keeps 8 bits.
        assert!((got - want).abs() < 1e-2, "{got} vs {want}");
    }
    half.backward(&Tensor::ones(out.shape(), DType::BF16).expect("ones"))
        .expect("backward");
    half.visit_params("", &mut |name, p| {
        let grad = p.grad.as_ref().expect("grad");
        assert_eq!(grad.dtype(), DType::BF16, "{name}");
        Ok(())
    })
    .expect("visit");
}

#[test]
fn dropout_is_active_in_training_and_off_in_eval() {
    same_on_both(|d| {
        let config = GptConfig {
            dropout: 0.5,
            ..tiny(DType::F32, true)
        };
        let mut model = gpt_on(config, d);
        let mut plain = gpt_on(
            GptConfig {
                dropout: 0.0,
                ..config
            },
            d,
        );
        let input = ids(&[1, 2, 3, 4], &[1, 4]);
        let reference = logits(&mut plain, &input);
        assert_ne!(logits(&mut model, &input), reference);
        model.set_training(false).expect("eval");
        assert_eq!(logits(&mut model, &input), reference);
        model.set_training(true).expect("train");
        let trained = logits(&mut model, &input);
        assert_ne!(trained, reference);
        (reference, trained)
    });
}

#[test]
fn bad_inputs_are_typed_errors() {
    let mut model = gpt(tiny(DType::F32, true));
    assert!(matches!(
        model.forward(&ids(&[0; 5], &[1, 5])),
        Err(Error::BadShape { .. })
    ));
    assert!(matches!(
        model.forward(&ids(&[0, 7], &[1, 2])),
        Err(Error::IndexOutOfRange { index: 7, .. })
    ));
    assert!(matches!(
        model.backward(&Tensor::zeros(&[1, 2, 7], DType::F32).expect("zeros")),
        Err(Error::BackwardBeforeForward { .. })
    ));
    assert!(matches!(
        Gpt::new(GptConfig {
            n_head: 3,
            ..tiny(DType::F32, true)
        }),
        Err(Error::InvalidConfig {
            field: "n_head",
            ..
        })
    ));
}
