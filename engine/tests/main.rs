//! The integration tests of `tessera-engine`, one test binary: each file of `tests/` is a module
//! here (`cargo test -p tessera-engine --test integration vision_serving::` runs one file).

mod bad_checkpoints;
mod k3_fixtures;
mod k3_serving;
mod model_device;
mod serving_support;
mod vision_fixtures;
mod vision_serving;
