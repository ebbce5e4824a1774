//! Worker discovery (DESIGN §6). Static mode is the `--prefill/--decode` lists the
//! [`WorkerPool`] starts with; [`etcd`] mode adds the workers registered under
//! `/tessera/<cluster>/workers/` and drains them when their key goes away. Both may be combined.

pub mod etcd;

use crate::cluster::{ClusterBackend, ClusterConfig};

/// The router's cluster backend: static workers from `cfg`, plus, when `etcd` lists endpoints,
/// the workers registered in etcd under `cluster` (then the static lists may be empty).
pub fn build_backend(
    etcd_endpoints: &[String],
    cluster: &str,
    cfg: ClusterConfig,
) -> anyhow::Result<ClusterBackend> {
    if etcd_endpoints.is_empty() {
        return ClusterBackend::new(cfg);
    }
    let backend = ClusterBackend::new_dynamic(cfg)?;
    etcd::spawn(etcd_endpoints, cluster, backend.pool())?;
    Ok(backend)
}
