//! The engine's one error type. Callers at the edge (CLI, HTTP) map it to exit codes or status
//! codes; inside the engine every failure names what it is about (a tensor, a field, a file).

use std::path::PathBuf;

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("checkpoint: tensor `{name}` is missing (looked in {looked_in})")]
    MissingTensor { name: String, looked_in: String },
    #[error("checkpoint: tensor `{name}` has shape {found:?}, the config implies {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("checkpoint: tensor `{name}` has dtype {dtype}, only BF16, F16 and F32 are supported")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("checkpoint file {path} is not valid safetensors: {message}")]
    CorruptCheckpoint { path: PathBuf, message: String },
    /// The compute device failed or cannot run the model (no driver, out of memory, a kernel
    /// that does not take the model's shapes).
    #[error("device: {0}")]
    Device(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("kv cache: {0}")]
    Kv(#[from] crate::kv::KvError),
    #[error(transparent)]
    Kernel(#[from] tessera_kernels::cpu::KernelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
