//! CPU reference backend: f32 compute, rayon over the global pool,
//! AVX2+FMA chosen at run time with a portable fallback.
//!
//! All tensors are row-major `f32` slices; weights use torch layouts. Shape
//! mismatches panic (cheap `assert!`s); the only recoverable error is a bad
//! token id in [`embedding`].

pub(crate) mod simd;

mod activation;
mod attention;
mod conv;
mod embedding;
mod gemm;
mod kda;
mod matmul;
mod moe;
mod norm;
mod sample;

#[cfg(test)]
pub(crate) mod testutil;

pub use activation::{argmax, sigmoid_inplace, silu_inplace, silu_mul, softmax_inplace};
pub use attention::{attention_causal, mla_absorbed_attention};
pub use conv::short_conv_silu;
pub use embedding::embedding;
pub use gemm::linear;
pub use kda::{kda_chunked, kda_recurrent};
pub use matmul::matmul;
pub use moe::{route_sigmoid_grouped, MoeRouting};
pub use norm::{l2_normalize, rms_norm, rms_norm_gated};
pub use sample::sample_row;

/// Recoverable kernel errors (everything else is a caller bug and panics).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A token id is not a row of the embedding table.
    #[error("token id {id} out of range for vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
}
