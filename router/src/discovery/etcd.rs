//! etcd discovery (DESIGN §6): list `/tessera/<cluster>/workers/`, then watch it from the next
//! revision. A put adds the worker to the [`WorkerPool`] (or moves it, when its gRPC address
//! changed); a delete — the worker drained and revoked its lease, or the lease expired — removes
//! it from routing while its in-flight requests finish. When etcd is unreachable the last known
//! membership stays (health probes still take dead workers out of routing) and the loop retries;
//! a successful re-list reconciles whatever changed meanwhile.
//!
//! Key layout: `/tessera/<cluster>/workers/<role>/<id>` = JSON with at least `"grpc"` (the
//! worker's `host:port`); roles other than `prefill` and `decode` are ignored here.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tessera_proto::etcd::{pb, prefix_range_end, EtcdClient};

use crate::cluster::{Role, WorkerPool};

/// Pause between two attempts while etcd is unreachable.
const RETRY: Duration = Duration::from_millis(500);

/// The key prefix a router of `cluster` watches.
pub fn workers_prefix(cluster: &str) -> String {
    format!("/tessera/{cluster}/workers/")
}

/// One worker as its etcd key and value describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub role: Role,
    pub grpc: String,
    /// The registering process's incarnation (0 when the record has none). A new one under the
    /// same key is a restarted worker: it replaces the old member, breaker and counters included.
    pub incarnation: u64,
}

/// Parses a worker's key (relative to `prefix`) and JSON value; `None` for keys this router
/// does not route to (other roles, malformed records — logged).
pub fn parse_member(prefix: &str, key: &[u8], value: &[u8]) -> Option<Member> {
    let key = std::str::from_utf8(key).ok()?;
    let role = match key.strip_prefix(prefix)?.split('/').next()? {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        "encoder" => Role::Encoder,
        _ => return None,
    };
    let v: serde_json::Value = match serde_json::from_slice(value) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(key, error = %e, "ignoring a malformed worker record in etcd");
            return None;
        }
    };
    match v.get("grpc").and_then(|g| g.as_str()) {
        Some(g) if !g.is_empty() => Some(Member {
            role,
            grpc: g.to_string(),
            incarnation: v.get("incarnation").and_then(|i| i.as_u64()).unwrap_or(0),
        }),
        _ => {
            tracing::warn!(key, "ignoring a worker record without a `grpc` address");
            None
        }
    }
}

/// Starts the discovery task for `pool`; it ends when the pool is dropped.
pub fn spawn(
    endpoints: &[String],
    cluster: &str,
    pool: &Arc<WorkerPool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let client = EtcdClient::connect_lazy(endpoints, Duration::from_secs(3))
        .map_err(|e| anyhow::anyhow!("--etcd: {e}"))?;
    let prefix = workers_prefix(cluster);
    tracing::info!(?endpoints, %prefix, "etcd discovery");
    Ok(tokio::spawn(run(client, prefix, Arc::downgrade(pool))))
}

/// What this task added to the pool, by etcd key.
type Known = HashMap<Vec<u8>, Member>;

async fn run(client: EtcdClient, prefix: String, pool: Weak<WorkerPool>) {
    let mut known = Known::new();
    let mut reachable = true;
    loop {
        if pool.strong_count() == 0 {
            return;
        }
        match client.get_prefix(&prefix).await {
            Ok((kvs, rev)) => {
                if !reachable {
                    tracing::info!("etcd reachable again; reconciling membership");
                    reachable = true;
                }
                let Some(p) = pool.upgrade() else { return };
                reconcile(&p, &prefix, &mut known, kvs);
                drop(p);
                if let Err(e) = watch(&client, &prefix, rev + 1, &mut known, &pool).await {
                    tracing::warn!(error = %e, "etcd watch ended; listing again");
                    tokio::time::sleep(RETRY).await;
                }
            }
            Err(e) => {
                if reachable {
                    tracing::warn!(error = %e, workers = known.len(), "etcd unreachable; keeping the last known membership");
                    reachable = false;
                }
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Makes the pool's discovered members equal `kvs` (a full listing).
fn reconcile(pool: &WorkerPool, prefix: &str, known: &mut Known, kvs: Vec<pb::KeyValue>) {
    let listed: HashMap<Vec<u8>, &pb::KeyValue> =
        kvs.iter().map(|kv| (kv.key.clone(), kv)).collect();
    let gone: Vec<Vec<u8>> = known
        .keys()
        .filter(|k| !listed.contains_key(*k))
        .cloned()
        .collect();
    for k in gone {
        on_delete(pool, known, &k);
    }
    for kv in kvs.iter() {
        on_put(pool, prefix, known, kv);
    }
}

fn on_put(pool: &WorkerPool, prefix: &str, known: &mut Known, kv: &pb::KeyValue) {
    let Some(m) = parse_member(prefix, &kv.key, &kv.value) else {
        return;
    };
    if known.get(&kv.key) == Some(&m) {
        return;
    }
    // A new address under a known key: the worker restarted elsewhere.
    on_delete(pool, known, &kv.key);
    match pool.add_worker(m.role, &m.grpc) {
        Ok(Some(w)) => {
            w.observe_incarnation(m.incarnation);
            known.insert(kv.key.clone(), m);
        }
        // Already a member (a static flag names it): static membership owns it.
        Ok(None) => {}
        Err(e) => tracing::warn!(grpc = %m.grpc, error = %e, "cannot add a discovered worker"),
    }
}

fn on_delete(pool: &WorkerPool, known: &mut Known, key: &[u8]) {
    if let Some(m) = known.remove(key) {
        pool.remove_worker(m.role, &m.grpc);
    }
}

/// Applies the watch's events until the stream fails (`Err`) or the pool is dropped (`Ok`).
async fn watch(
    client: &EtcdClient,
    prefix: &str,
    start_revision: i64,
    known: &mut Known,
    pool: &Weak<WorkerPool>,
) -> Result<(), String> {
    let create = pb::WatchRequest {
        request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
            pb::WatchCreateRequest {
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_range_end(prefix.as_bytes()),
                start_revision,
                progress_notify: true,
                ..Default::default()
            },
        )),
    };
    // The request stream stays open while this future lives (an ended request stream cancels
    // the watch); it runs in the HTTP/2 connection's task, so it watches a liveness token.
    let alive = Arc::new(());
    let weak = Arc::downgrade(&alive);
    let requests = futures_util::StreamExt::chain(
        futures_util::stream::once(async move { create }),
        futures_util::stream::unfold(weak, |weak| async move {
            while weak.upgrade().is_some() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            None::<(pb::WatchRequest, _)>
        }),
    );
    let mut stream = client
        .watch()
        .watch(requests)
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    loop {
        // etcd sends a progress notification about every 10 min when idle; h2 keep-alives
        // catch a dead connection sooner.
        let msg = match tokio::time::timeout(Duration::from_secs(2), stream.message()).await {
            Ok(m) => m.map_err(|e| e.to_string())?,
            Err(_) if pool.strong_count() == 0 => {
                drop(alive);
                return Ok(());
            }
            Err(_) => continue,
        };
        let Some(r) = msg else {
            return Err("the watch stream ended".into());
        };
        if r.canceled {
            return Err(format!(
                "the watch was cancelled: {} (compacted at {})",
                r.cancel_reason, r.compact_revision
            ));
        }
        let Some(p) = pool.upgrade() else {
            return Ok(());
        };
        for ev in r.events {
            let Some(kv) = ev.kv else { continue };
            if ev.r#type == pb::event::EventType::Delete as i32 {
                on_delete(&p, known, &kv.key);
            } else {
                on_put(&p, prefix, known, &kv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_from_key_and_record() {
        let p = workers_prefix("c");
        let m = parse_member(
            &p,
            b"/tessera/c/workers/decode/d0",
            br#"{"grpc":"127.0.0.1:5","role":"decode","incarnation":99}"#,
        );
        assert_eq!(
            m,
            Some(Member {
                role: Role::Decode,
                grpc: "127.0.0.1:5".into(),
                incarnation: 99,
            })
        );
        assert_eq!(
            parse_member(&p, b"/tessera/c/workers/encoder/e0", br#"{"grpc":"x:1"}"#)
                .map(|m| m.role),
            Some(Role::Encoder)
        );
        assert_eq!(
            parse_member(&p, b"/tessera/c/workers/gateway/g0", br#"{"grpc":"x:1"}"#),
            None
        );
        assert_eq!(
            parse_member(&p, b"/tessera/c/workers/prefill/p0", b"not json"),
            None
        );
        assert_eq!(
            parse_member(
                &p,
                b"/tessera/other/workers/prefill/p0",
                br#"{"grpc":"x:1"}"#
            ),
            None
        );
    }
}
