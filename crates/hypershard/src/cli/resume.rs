//! What `train --resume` must agree on with the checkpoint it continues: a step count beyond
//! it, the seed and data order it was trained with (the windows drawn after the resume depend
//! on both), and the AdamW moments it saved.

use hypershard::Error;
use hypershard::checkpoint::Checkpoint;
use hypershard::data::DataOrder;
use hypershard::train::{TrainConfig, model_key};
use serde_json::Value;

/// Checks `config` continues `checkpoint`; `override_config` accepts another seed or data
/// order (the run then draws other windows than an uninterrupted one would).
pub fn check(
    checkpoint: &Checkpoint,
    config: &TrainConfig,
    override_config: bool,
) -> Result<(), Error> {
    let refuse = |reason: String| Error::ResumeRefused {
        path: checkpoint.dir().to_path_buf(),
        reason,
    };
    let saved_step = checkpoint.step();
    if config.steps <= saved_step {
        return Err(refuse(format!(
            "it was saved after step {saved_step}, and --steps {} is not beyond it (pass a larger --steps)",
            config.steps
        )));
    }
    let state = &checkpoint.metadata().state;
    if !override_config {
        let seed = state["data"]["seed"].as_u64().or(state["seed"].as_u64());
        if let Some(seed) = seed
            && seed != config.seed
        {
            return Err(refuse(format!(
                "it was trained with --seed {seed}, not {} (pass --seed {seed}, or --override-resume-config to draw other data)",
                config.seed
            )));
        }
        let order = serde_json::from_value::<DataOrder>(state["data"]["order"].clone()).ok();
        if let Some(order) = order
            && order != config.data_order
        {
            return Err(refuse(format!(
                "it was trained with --data-order {}, not {} (pass --data-order {0}, or --override-resume-config to draw other data)",
                order_name(order),
                order_name(config.data_order)
            )));
        }
    }
    if !config.reset_optimizer {
        let tensors = &checkpoint.metadata().tensors;
        let prefix = model_key("");
        for name in tensors.keys().filter_map(|key| key.strip_prefix(&prefix)) {
            for which in ["exp_avg", "exp_avg_sq"] {
                let key = format!("optim/{which}/{name}");
                if !tensors.contains_key(&key) {
                    return Err(refuse(format!(
                        "it holds no optimizer state for {name} ({key} is absent; pass --reset-optimizer to resume with fresh AdamW moments)"
                    )));
                }
            }
        }
        if state.get("optimizer_step").is_none_or(Value::is_null) {
            return Err(refuse(
                "it records no optimizer step count (pass --reset-optimizer to resume with fresh AdamW state)"
                    .to_string(),
            ));
        }
    }
    Ok(())
}

fn order_name(order: DataOrder) -> &'static str {
    match order {
        DataOrder::Random => "random",
        DataOrder::Sequential => "sequential",
    }
}
