//! Tessera kernels: the one op API the engine calls, over compute backends.
//!
//! Each backend is a module exposing the same free functions with the same
//! shapes and semantics (row-major `f32` slices, torch weight layouts):
//!
//! * [`cpu`] — the reference backend, always built: f32 compute, rayon
//!   parallelism, runtime-dispatched AVX2+FMA with a portable fallback. It is
//!   the numerical ground truth the accelerator backends are tested against.
//! * [`cuda`] (feature `cuda`) — NVRTC-compiled kernels on NVIDIA GPUs, bf16 activations with
//!   f32 accumulation; checked against `cpu` by `examples/cuda_check_bench.rs` on a GPU.
//! * `hip` — planned; it will mirror the `cuda` kernels.
//!
//! Determinism: `cpu::linear` and `cpu::matmul` give bitwise identical results
//! for a row regardless of batch size, row position and thread count, which
//! batched serving relies on for reproducible outputs.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
