//! etcd discovery (DESIGN §6) against a real `etcd` (Debian `etcd-server`, installed by
//! `scripts/test.sh`) that the test starts on loopback: in-process prefill and decode daemons
//! register under a lease; a router backend with no static workers finds them, routes to a
//! decode worker started later, drops a worker whose lease expired (within its TTL) and one that
//! drained (at once), and a steady trickle of requests never fails while ≥ 2 decode workers
//! are registered.

#[path = "../../tests/common/etcd.rs"]
mod etcd;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::start_etcd;
use tessera_prefill::runtime::WorkerArgs;
use tessera_router::cluster::Role;
use tessera_router::{ClusterBackend, GenerationBackend, GenerationRequest, TokenEvent};
use tokio::sync::oneshot;

use crate::common::{greedy, reference, stopper};

const SECRET: &str = "router-etcd-test";
const CLUSTER: &str = "etcdtest";
const TTL_S: u64 = 3;

/// Worker flags that register the worker as `id` in `etcd`, under a lease of [`TTL_S`].
fn worker_args(kv: &str, etcd: &str, id: &str) -> WorkerArgs {
    let ttl = TTL_S.to_string();
    let registration = [
        "--etcd",
        etcd,
        "--cluster",
        CLUSTER,
        "--etcd-ttl",
        &ttl,
        "--worker-id",
        id,
    ];
    crate::common::worker_args(SECRET, kv, &registration)
}

/// An in-process worker with its drain state (to abandon its registration) and a stop handle.
struct Worker {
    grpc: String,
    drain: Arc<tessera_prefill::runtime::Drain>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Worker {
    async fn shut_down(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = tokio::time::timeout(Duration::from_secs(20), self.server).await;
    }
}

async fn start_decode(etcd: &str, id: &str) -> Worker {
    let (tx, stop) = stopper();
    let d = tessera_decode::start(worker_args("24M", etcd, id), stop)
        .await
        .unwrap();
    Worker {
        grpc: d.grpc.to_string(),
        drain: d.service.drain().clone(),
        stop: Some(tx),
        server: d.server,
    }
}

async fn start_prefill(etcd: &str, id: &str) -> Worker {
    let (tx, stop) = stopper();
    let p = tessera_prefill::start(worker_args("8M", etcd, id), stop)
        .await
        .unwrap();
    Worker {
        grpc: p.grpc.to_string(),
        drain: p.service.drain().clone(),
        stop: Some(tx),
        server: p.server,
    }
}

/// Runs one request; its tokens, or why it failed.
async fn generate(b: &ClusterBackend, req: GenerationRequest) -> Result<Vec<u32>, String> {
    let mut rx = b.submit(req).map_err(|e| format!("submit: {e:?}"))?;
    let mut tokens = vec![];
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .map_err(|_| "no event within 60 s".to_string())?;
        match e {
            None => return Err("the stream ended without Finished".into()),
            Some(TokenEvent::Token(t)) => tokens.push(t),
            Some(TokenEvent::Finished { .. }) => return Ok(tokens),
            Some(TokenEvent::Failed(e)) => return Err(format!("{e:?}")),
            Some(TokenEvent::Prefilled { .. } | TokenEvent::Logprobs(_)) => {}
        }
    }
}

fn members(b: &ClusterBackend, role: Role) -> Vec<String> {
    b.pool()
        .workers(role)
        .iter()
        .map(|w| w.addr.clone())
        .collect()
}

/// Requests the router sent to the worker at `addr` (its metrics; 0 when not a member).
fn routed(b: &ClusterBackend, addr: &str) -> u64 {
    let needle = format!("worker=\"{addr}\"}} ");
    b.metrics_text()
        .lines()
        .filter(|l| l.starts_with("tessera_router_worker_requests_total{"))
        .find_map(|l| {
            l.split_once(&needle)
                .map(|(_, n)| n.trim().parse().unwrap())
        })
        .unwrap_or(0)
}

async fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_discovery_adds_and_drains_workers_live() {
    let _workers = crate::workers_alone().await;
    let etcd = start_etcd().await;
    let ep = etcd.endpoint.clone();
    let (prompt, want) = reference().swap_remove(0);
    let n = want.len().min(4);
    let want = want[..n].to_vec();

    // A router with no static worker at all.
    let b = tessera_router::discovery::build_backend(
        std::slice::from_ref(&ep),
        CLUSTER,
        crate::common::cluster_config(SECRET, &[], &[], 0),
    )
    .unwrap();
    let b = Arc::new(b);
    assert!(b.health().is_err(), "no worker yet");

    // 1 prefill + 1 decode register; requests succeed.
    let p0 = start_prefill(&ep, "p0").await;
    let d0 = start_decode(&ep, "d0").await;
    wait_until("p0 and d0 discovered", Duration::from_secs(5), || {
        members(&b, Role::Prefill) == std::slice::from_ref(&p0.grpc)
            && members(&b, Role::Decode) == std::slice::from_ref(&d0.grpc)
    })
    .await;
    wait_until("the pools are healthy", Duration::from_secs(5), || {
        b.health().is_ok()
    })
    .await;
    for i in 0..2 {
        let got = generate(&b, greedy(&format!("first{i}"), &prompt, n)).await;
        assert_eq!(got.as_deref(), Ok(&want[..]), "request {i} through p0/d0");
    }

    // A decode worker started later receives traffic within 5 s.
    let d1 = start_decode(&ep, "d1").await;
    let t0 = Instant::now();
    let mut i = 0;
    while routed(&b, &d1.grpc) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "d1 got no traffic within 5 s (decode members: {:?})",
            members(&b, Role::Decode)
        );
        let got = generate(&b, greedy(&format!("scale{i}"), &prompt, n)).await;
        assert_eq!(got.as_deref(), Ok(&want[..]), "request scale{i}");
        i += 1;
    }
    eprintln!("d1 received traffic {:?} after it was ready", t0.elapsed());

    // A steady trickle of requests from here on: none may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut trickle = Vec::new();
    for lane in 0..2 {
        let (b, stop, ok, failed) = (b.clone(), stop.clone(), ok.clone(), failed.clone());
        let (prompt, want) = (prompt.clone(), want.clone());
        trickle.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Acquire) {
                match generate(&b, greedy(&format!("trickle{lane}-{i}"), &prompt, n)).await {
                    Ok(t) if t == want => ok.fetch_add(1, Ordering::Relaxed),
                    r => {
                        eprintln!("trickle{lane}-{i} failed: {r:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    // d0 "crashes" as far as etcd can tell: its keep-alive stops without a revoke. It leaves
    // routing when the lease expires, within its TTL (plus etcd's expiry tick and the watch).
    d0.drain.abandon_registration();
    let gone = wait_until(
        "d0 left routing after its lease expired",
        Duration::from_secs(TTL_S) + Duration::from_millis(1500),
        || !members(&b, Role::Decode).contains(&d0.grpc),
    )
    .await;
    eprintln!("d0 left routing {gone:?} after its keep-alive stopped (TTL {TTL_S} s)");
    assert_eq!(members(&b, Role::Decode), std::slice::from_ref(&d1.grpc));
    let before = ok.load(Ordering::Relaxed);
    // Requests keep flowing through d1 alone.
    wait_until("requests after d0 left", Duration::from_secs(30), || {
        ok.load(Ordering::Relaxed) >= before + 3
    })
    .await;
    stop.store(true, Ordering::Release);
    for t in trickle {
        t.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("trickle: {ok} succeeded, {failed} failed");
    assert_eq!(failed, 0, "requests failed while workers came and went");
    assert!(ok >= 3);
    assert_eq!(routed(&b, &d0.grpc), 0, "d0 is no longer listed");
    d0.shut_down().await;

    // A graceful drain revokes the lease first: the worker leaves routing at once, well
    // before its TTL (d2 takes over).
    let d2 = start_decode(&ep, "d2").await;
    wait_until("d2 discovered", Duration::from_secs(5), || {
        members(&b, Role::Decode).contains(&d2.grpc)
    })
    .await;
    let t0 = Instant::now();
    let d1_addr = d1.grpc.clone();
    d1.shut_down().await;
    wait_until(
        "d1 left routing after its drain",
        Duration::from_secs(2),
        || !members(&b, Role::Decode).contains(&d1_addr),
    )
    .await;
    eprintln!("d1 left routing {:?} after its drain began", t0.elapsed());
    assert_eq!(members(&b, Role::Decode), std::slice::from_ref(&d2.grpc));

    // etcd goes away: the router keeps the last known membership and keeps serving.
    drop(etcd);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(members(&b, Role::Prefill), std::slice::from_ref(&p0.grpc));
    assert_eq!(members(&b, Role::Decode), std::slice::from_ref(&d2.grpc));
    let got = generate(&b, greedy("etcd-down", &prompt, n)).await;
    assert_eq!(
        got.as_deref(),
        Ok(&want[..]),
        "a request while etcd is down"
    );

    // Nothing to deregister from any more.
    for w in [d2, p0] {
        w.drain.abandon_registration();
        w.shut_down().await;
    }
}
