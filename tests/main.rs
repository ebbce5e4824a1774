//! The cross-crate tests of the `tessera` package, one test binary: each file of `tests/` is a
//! module here, grouped by concern (`cargo test --test integration cluster_up::` runs one file).
//! One binary instead of one per file: each of those linked the whole workspace again.
//!
//! The tests of one binary run on parallel threads, where separate binaries ran one after
//! another. A test that starts a cluster of `tessera` processes therefore first takes
//! [`cluster_alone`] (it was alone in its file) or [`cluster_beside_others`] (its file had
//! several): one that was alone still runs beside no other cluster, the others may overlap as
//! their files' tests did.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[path = "common/cluster.rs"]
mod cluster;
mod common;
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/server.rs"]
mod server;

mod bench_cli;
mod cli_commands;
mod cli_vision;
mod cluster_chaos;
mod cluster_scaling;
mod cluster_up;
mod disaggregated_handoff;
mod images;
mod reference_fixtures;
mod serve_http;
mod serving_scheduler;
mod test_layout;
mod worker_metrics;

/// Taken by every test that starts a cluster of `tessera` processes, for as long as it runs.
/// Each cluster is several processes on a machine of few cores, and these tests bound how fast
/// things happen (`up` stops within 12 s, a new worker gets traffic within 5 s of registering);
/// they were written for the load of their own file's tests only.
static CLUSTERS: RwLock<()> = RwLock::new(());

/// For a cluster test that was alone in its file: no other cluster runs beside it.
pub fn cluster_alone() -> RwLockWriteGuard<'static, ()> {
    // A test that failed while holding it poisons it; the others still run.
    CLUSTERS.write().unwrap_or_else(PoisonError::into_inner)
}

/// For a cluster test that shared its file with others: it may run beside those, as it did.
pub fn cluster_beside_others() -> RwLockReadGuard<'static, ()> {
    CLUSTERS.read().unwrap_or_else(PoisonError::into_inner)
}
