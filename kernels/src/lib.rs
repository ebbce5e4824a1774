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
//! * [`hip`] (feature `hip`) — the same kernel sources compiled by hiprtc for AMD GPUs, with the
//!   op API of `cuda`; built and compiled for CDNA targets here, not yet run on AMD hardware.
//!
//! [`device::parse_device`] names a device (`cpu`, `cuda[:N]`, `hip[:N]`) in every build.
//!
//! Determinism: `cpu::linear` and `cpu::matmul` give bitwise identical results
//! for a row regardless of batch size, row position and thread count, which
//! batched serving relies on for reproducible outputs.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
#[cfg(any(feature = "cuda", feature = "hip"))]
pub mod gpu;
#[cfg(feature = "hip")]
pub mod hip;

pub use device::{parse_device, Device, DeviceError};
