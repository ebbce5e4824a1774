//! etcd registration of a worker (DESIGN §6): the worker's record, as JSON, at
//! `/tessera/<cluster>/workers/<role>/<worker id>`, attached to a lease of `--etcd-ttl` seconds
//! that a background task keeps alive. If the lease is lost (etcd restarted, a long partition),
//! the task grants a new one and writes the record again. The drain revokes the lease before it
//! waits for in-flight work, so routers stop sending new requests at once; a worker that dies
//! without draining leaves routing when its lease expires.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tessera_proto::etcd::{pb, EtcdClient};
use tessera_proto::v1;

use crate::runtime::DaemonArgs;

/// The key prefix of every worker of `cluster` (a router watches it).
pub fn workers_prefix(cluster: &str) -> String {
    format!("/tessera/{cluster}/workers/")
}

/// The record a worker writes (what the router needs to route to it).
pub fn record(role: &str, info: &v1::WorkerInfo) -> serde_json::Value {
    serde_json::json!({
        "id": info.worker_id,
        "role": role,
        "grpc": info.grpc_address,
        "transfer": info.transfer_endpoint,
        "model": info.model_id,
        "incarnation": info.incarnation_id,
        "max_running": info.max_running,
        "pages": info.layout.as_ref().map_or(0, |l| l.parents),
        "version": info.version,
    })
}

/// A live registration; dropping it stops the keep-alive without revoking (the lease expires).
pub struct Registration {
    client: EtcdClient,
    key: String,
    lease: Arc<AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Grants the lease, writes the record and starts the keep-alive.
    pub async fn register(
        args: &DaemonArgs,
        role: &str,
        info: &v1::WorkerInfo,
    ) -> anyhow::Result<Self> {
        let ttl = args.etcd_ttl.max(1) as i64;
        let client = EtcdClient::connect_lazy(&args.etcd, Duration::from_secs(3))
            .map_err(|e| anyhow::anyhow!("--etcd: {e}"))?;
        let key = format!("{}{role}/{}", workers_prefix(&args.cluster), info.worker_id);
        let value = serde_json::to_vec(&record(role, info))?;
        let id = put_with_lease(&client, &key, &value, ttl)
            .await
            .with_context(|| format!("registering {key} in etcd at {:?}", args.etcd))?;
        let lease = Arc::new(AtomicI64::new(id));
        let task = tokio::spawn(keep_alive(
            client.clone(),
            key.clone(),
            value,
            ttl,
            lease.clone(),
        ));
        tracing::info!(%key, lease = id, ttl, "registered in etcd");
        Ok(Registration {
            client,
            key,
            lease,
            task,
        })
    }

    /// The etcd key of this worker.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stops the keep-alive and revokes the lease: the record disappears at once.
    pub async fn deregister(self) {
        self.task.abort();
        let id = self.lease.load(Ordering::Acquire);
        match self.client.revoke(id).await {
            Ok(()) => tracing::info!(key = %self.key, "deregistered from etcd"),
            Err(e) => {
                tracing::warn!(key = %self.key, error = %e, "could not revoke the etcd lease; it expires on its own")
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn put_with_lease(
    client: &EtcdClient,
    key: &str,
    value: &[u8],
    ttl: i64,
) -> Result<i64, tessera_proto::tonic::Status> {
    let id = client.grant(ttl).await?;
    client.put(key, value.to_vec(), id).await?;
    Ok(id)
}

enum KeepAliveEnd {
    /// etcd no longer knows the lease (it expired): register again.
    Lost,
    /// The stream failed or ended: retry with the same lease.
    Error(String),
}

async fn keep_alive(
    client: EtcdClient,
    key: String,
    value: Vec<u8>,
    ttl: i64,
    lease: Arc<AtomicI64>,
) {
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(300));
    loop {
        let id = lease.load(Ordering::Acquire);
        match keep_alive_stream(&client, id, period).await {
            KeepAliveEnd::Lost => {
                tracing::warn!(%key, "etcd lease lost; registering again");
                match put_with_lease(&client, &key, &value, ttl).await {
                    Ok(new) => lease.store(new, Ordering::Release),
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "etcd registration failed; retrying");
                        tokio::time::sleep(period).await;
                    }
                }
            }
            KeepAliveEnd::Error(e) => {
                tracing::warn!(%key, error = %e, "etcd keep-alive failed; retrying");
                tokio::time::sleep(period.min(Duration::from_millis(500))).await;
            }
        }
    }
}

async fn keep_alive_stream(client: &EtcdClient, id: i64, period: Duration) -> KeepAliveEnd {
    // The request stream lives in the HTTP/2 connection's task, not in this one: it ends as soon
    // as this future is dropped (the keep-alive task aborted), so a dropped registration really
    // stops refreshing the lease.
    let alive = Arc::new(());
    let weak = Arc::downgrade(&alive);
    let requests = futures_util::stream::unfold(true, move |first| {
        let weak = weak.clone();
        async move {
            if !first {
                tokio::time::sleep(period).await;
            }
            weak.upgrade()?;
            Some((pb::LeaseKeepAliveRequest { id }, false))
        }
    });
    let mut stream = match client.lease().lease_keep_alive(requests).await {
        Ok(r) => r.into_inner(),
        Err(e) => return KeepAliveEnd::Error(e.to_string()),
    };
    loop {
        // A healthy stream answers every `period`; a silent one is treated as broken.
        match tokio::time::timeout(period * 3, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl <= 0 => return KeepAliveEnd::Lost,
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return KeepAliveEnd::Error("the keep-alive stream ended".into()),
            Ok(Err(e)) => return KeepAliveEnd::Error(e.to_string()),
            Err(_) => return KeepAliveEnd::Error("no keep-alive answer".into()),
        }
        let _ = &alive;
    }
}
