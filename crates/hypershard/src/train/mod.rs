//! `hypershard train`: nanoGPT's GPT trained under `fully_shard` (FSDP or HSDP) on a corpus,
//! with progress, per-step losses, checkpoints and resume.
//!
//! The parent process ([`crate::launch`]) starts one rank per process; every rank runs
//! [`run_rank`] over the tcp backend.

mod config;
mod estimate;
mod fault;
mod finite;
mod hf;
mod init_file;
mod memory;
mod optimizer;
mod plot;
mod report;
mod shards;
mod tensor_set;
mod worker;

pub use config::{
    LrSchedule, MODEL_PRESETS, MeshSpec, ModelConfig, ModelShape, OptimConfig, TrainConfig,
    TrainDevice, default_cuda_backend, gpu_count, worker_transport,
};
pub use estimate::{MemoryEstimate, check_fits, estimate};
pub use fault::{FAULT_ENV, Fault, FaultPoint};
pub use hf::{
    HF_CONFIG_FILE, HF_WEIGHTS_FILE, HfGpt2Config, attach_hf_init, export_hf, hf_config_json,
    is_conv1d_weight,
};
pub use init_file::attach_init_file;
pub use memory::{RankMemory, proc_status_bytes};
pub use optimizer::{Moments, ShardedAdamW};
pub use plot::plot_losses;
pub use report::{LossRecord, Reporter, ReporterConfig, TrainSummary, print_summary, read_losses};
pub use shards::{ShardPlace, global_shapes, load_whole, model_key, place};
pub use tensor_set::{check_model_tensors, gpt_tensor_shapes, saved_model_config};
pub use worker::{EVAL_FRACTION, checkpoint_root, run_rank};
