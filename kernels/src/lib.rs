//! Tessera kernels: the one op API the engine calls, over compute backends.
//!
//! Each backend is a module exposing the same free functions with the same
//! shapes and semantics (row-major `f32` slices, torch weight layouts):
//!
//! * [`cpu`] — the reference backend, always built: f32 compute, rayon
//!   parallelism, runtime-dispatched AVX2+FMA with a portable fallback. It is
//!   the numerical ground truth the accelerator backends are tested against.
//! * `cuda` / `hip` — planned; they will mirror the `cpu` signatures.
//!
//! Determinism: `cpu::linear` and `cpu::matmul` give bitwise identical results
//! for a row regardless of batch size, row position and thread count, which
//! batched serving relies on for reproducible outputs.

pub mod cpu;
