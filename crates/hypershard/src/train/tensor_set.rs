//! The tensors a checkpoint's model configuration implies, checked before `export` writes or
//! `sample` loads anything, so a checkpoint missing one tensor (or holding one of the wrong
//! shape) is a typed error naming it rather than a file with a tensor short.

use std::collections::BTreeMap;

use super::config::ModelConfig;
use super::shards::model_key;
use crate::checkpoint::{Checkpoint, METADATA_FILE};
use crate::error::{Error, Result};

/// Every parameter of nanoGPT's GPT for `config` (the names and global shapes
/// `hypershard_nn::Gpt` gives them), computed without allocating the model. `None` when a
/// size overflows `usize`.
pub fn gpt_tensor_shapes(config: &ModelConfig) -> Option<BTreeMap<String, Vec<usize>>> {
    let c = config.n_embd;
    let c3 = c.checked_mul(3)?;
    let c4 = c.checked_mul(4)?;
    let mut shapes = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>| {
        shapes.insert(name, shape);
    };
    add("transformer.wte.weight".into(), vec![config.vocab_size, c]);
    add("transformer.wpe.weight".into(), vec![config.block_size, c]);
    let linears = [
        ("attn.c_attn", c3, c),
        ("attn.c_proj", c, c),
        ("mlp.c_fc", c4, c),
        ("mlp.c_proj", c, c4),
    ];
    for layer in 0..config.n_layer {
        let prefix = format!("transformer.h.{layer}");
        for norm in ["ln_1", "ln_2"] {
            add(format!("{prefix}.{norm}.weight"), vec![c]);
            if config.bias {
                add(format!("{prefix}.{norm}.bias"), vec![c]);
            }
        }
        for (name, out_features, in_features) in linears {
            add(
                format!("{prefix}.{name}.weight"),
                vec![out_features, in_features],
            );
            if config.bias {
                add(format!("{prefix}.{name}.bias"), vec![out_features]);
            }
        }
    }
    add("transformer.ln_f.weight".into(), vec![c]);
    if config.bias {
        add("transformer.ln_f.bias".into(), vec![c]);
    }
    Some(shapes)
}

/// The model configuration a checkpoint records (its seed, left out on save, set to 0).
pub fn saved_model_config(checkpoint: &Checkpoint) -> Result<ModelConfig> {
    let mut fields = checkpoint.metadata().model_config.clone();
    if let Some(object) = fields.as_object_mut() {
        object.insert("seed".to_string(), serde_json::json!(0));
    }
    serde_json::from_value(fields).map_err(|source| Error::Json {
        path: checkpoint.dir().join(METADATA_FILE),
        source,
    })
}

/// Checks that `checkpoint` holds exactly the model tensors its model configuration implies
/// (`model/NAME` for every GPT parameter, each of its global shape, and no others), and
/// returns that configuration.
pub fn check_model_tensors(checkpoint: &Checkpoint) -> Result<ModelConfig> {
    let config = saved_model_config(checkpoint)?;
    let mismatch = |name: &str, expected: String, found: String| Error::ModelTensorMismatch {
        path: checkpoint.dir().to_path_buf(),
        name: name.to_string(),
        expected,
        found,
    };
    let expected = gpt_tensor_shapes(&config).ok_or_else(|| {
        mismatch(
            "transformer.wte.weight",
            "sizes that fit a machine word".to_string(),
            "sized by an overflowing configuration".to_string(),
        )
    })?;
    let tensors = &checkpoint.metadata().tensors;
    for (name, shape) in &expected {
        let key = model_key(name);
        match tensors.get(&key) {
            None => return Err(mismatch(&key, format!("shape {shape:?}"), "absent".into())),
            Some(entry) if entry.shape != *shape => {
                return Err(mismatch(
                    &key,
                    format!("shape {shape:?}"),
                    format!("shape {:?}", entry.shape),
                ));
            }
            Some(_) => {}
        }
    }
    let prefix = model_key("");
    if let Some(extra) = tensors.keys().find(|key| {
        key.strip_prefix(&prefix)
            .is_some_and(|name| !expected.contains_key(name))
    }) {
        return Err(mismatch(extra, "no such tensor".into(), "present".into()));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::global_shapes;
    use hypershard_nn::Gpt;

    #[test]
    fn the_shapes_are_those_of_the_model_the_nn_crate_builds() {
        for (bias, n_layer, n_embd, n_head) in [(true, 2, 32, 2), (false, 3, 24, 4)] {
            let config = ModelConfig {
                vocab_size: 67,
                block_size: 16,
                n_layer,
                n_head,
                n_embd,
                bias,
                dropout: 0.0,
                seed: 1,
            };
            let gpt = Gpt::new(config.gpt()).unwrap();
            let built = global_shapes(&gpt).unwrap();
            assert_eq!(gpt_tensor_shapes(&config).unwrap(), built, "bias {bias}");
            let count: usize = built.values().map(|s| s.iter().product::<usize>()).sum();
            assert_eq!(config.parameter_count(), Some(count), "bias {bias}");
        }
        let huge = ModelConfig {
            vocab_size: usize::MAX / 2,
            block_size: 16,
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            bias: true,
            dropout: 0.0,
            seed: 0,
        };
        assert_eq!(huge.parameter_count(), None);
    }
}
