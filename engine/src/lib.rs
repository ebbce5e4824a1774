//! Tessera's engine: model configs, checkpoint loading, the forward pass of Kimi-family hybrid
//! models (KDA linear attention + MLA + MoE), per-request state, sampling, tokenizer and chat
//! template. The compute itself lives in `tessera-kernels`; this crate composes it by config.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod generate;
pub mod init_model;
pub mod kv;
pub mod model;
pub mod npy;
pub mod reference;
pub mod rng;
pub mod sampler;
pub mod serving;
pub mod state;
pub mod vision;

/// Tokenizers and chat templates live in their own crate so the router can use them without
/// linking the engine.
pub use tessera_tokenizer as tokenizer;

pub use checkpoint::Checkpoint;
pub use config::{AttnKind, FfnKind, ModelConfig};
pub use error::{EngineError, Result};
pub use model::Model;
pub use sampler::SamplingParams;
pub use state::SequenceState;

/// Sets the number of CPU threads the kernels use. Call once, before any model work.
pub fn set_num_threads(n: usize) -> std::result::Result<(), rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
}
