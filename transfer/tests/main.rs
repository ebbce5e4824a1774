//! The integration tests of `tessera-transfer`, one test binary: each file of `tests/` is a
//! module here (`cargo test -p tessera-transfer --test integration faults::` runs one file), over
//! the shared harness in `common/`.

mod common;

mod faults;
mod round_trip;
mod security;
mod ucx;
