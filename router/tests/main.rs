//! The integration tests of `tessera-router`, one test binary: each file of `tests/` is a module
//! here (`cargo test -p tessera-router --test integration grpc_front::` runs one file);
//! `common/` starts in-process workers, `http_front/` groups the HTTP front's tests by concern.
//!
//! The tests of one binary run on parallel threads, where separate binaries ran one after
//! another. A test that starts workers therefore first takes [`workers_alone`] (it was alone in
//! its file) or [`workers_beside_others`] (its file had several): one that was alone still runs
//! beside no other test's workers, the others may overlap as their files' tests did.

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

mod common;

mod cluster_backend;
mod etcd_discovery;
mod grpc_front;
mod http_front;
mod transport_pairing;

/// Taken by every test that starts in-process workers (each its own engine on the shared rayon
/// pool), for as long as they run. These tests bound how fast things happen (a new worker gets
/// traffic within 5 s, a lease expires within its TTL) and were written for the load of their
/// own file's tests only.
static WORKERS: RwLock<()> = RwLock::const_new(());

/// For a workers test that was alone in its file: no other test's workers run beside it.
pub async fn workers_alone() -> RwLockWriteGuard<'static, ()> {
    WORKERS.write().await
}

/// For a workers test that shared its file with others: it may run beside those, as it did.
pub async fn workers_beside_others() -> RwLockReadGuard<'static, ()> {
    WORKERS.read().await
}
