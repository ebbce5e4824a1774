//! The integration tests of `tessera-kernels`, one test binary: each file of `tests/` is a
//! module here, compiled in with its backend's feature (`cuda`, `hip`).

mod cuda_sources_compile;
mod hip_sources_compile;
