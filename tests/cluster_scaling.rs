//! Scaling the pools under load (DESIGN §6; what the Helm chart's autoscalers rely on): a real
//! etcd on loopback, `tessera router --etcd` and every worker as a separate process with
//! `--etcd`. While client threads send a steady stream of greedy completions, the decode pool
//! goes 1 → 3 → 1 and the prefill pool 1 → 2 → 1, only by starting daemons and stopping them
//! with SIGTERM. No request fails and every answer equals the single-process engine's; a new
//! worker receives traffic within 5 s of registering; a worker stopped by SIGTERM deregisters,
//! finishes what it has in flight and exits 0 — for decode, stopped while a request has
//! reserved pages on it and is still being prefilled, that request then decodes there.

use std::path::Path;
use std::time::{Duration, Instant};

use tessera_proto::etcd::EtcdClient;

use crate::cluster::{jobs, prompts, spawn_router, start_worker, wait_until, Daemon, Load};
use crate::common::fixtures_dir;
use crate::etcd;
use crate::server::{self, metric_sum, try_http_request};

const CLUSTER: &str = "scaling";
/// Tokens each request generates: enough that a request outlives a few `/metrics` scrapes.
const MAX_TOKENS: usize = 40;
/// Concurrent clients of the steady load.
const CLIENTS: usize = 3;

fn worker(kind: &str, id: &str, model: &Path, etcd: &str) -> Daemon {
    let flags = ["--etcd", etcd, "--cluster", CLUSTER, "--kv-memory", "16M"];
    start_worker(kind, id, model, &flags)
}

/// Asserts that `w` receives traffic (its `counter` moves) within 5 s of registering: the ready
/// line comes right after the etcd put.
fn assert_gets_traffic(w: &mut Daemon, counter: &str) {
    let registered = w.ready();
    while w.metric(counter) == 0.0 {
        assert!(
            registered.elapsed() < Duration::from_secs(5),
            "{} got no traffic within 5 s of registering",
            w.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "{} received traffic {:?} after registering",
        w.name,
        registered.elapsed()
    );
}

/// The worker ids registered in etcd under this test's cluster, as `<role>/<id>`.
struct Registry {
    rt: tokio::runtime::Runtime,
    client: EtcdClient,
}

impl Registry {
    fn workers(&self) -> Vec<String> {
        let prefix = format!("/tessera/{CLUSTER}/workers/");
        let (kvs, _) = self.rt.block_on(self.client.get_prefix(&prefix)).unwrap();
        let mut ids: Vec<String> = kvs
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key[prefix.len()..]).into_owned())
            .collect();
        ids.sort();
        ids
    }

    fn assert_workers(&self, want: &[&str]) {
        assert_eq!(self.workers(), want, "workers registered in etcd");
    }
}

/// What a worker's `/metrics` said while it drained.
struct Drained {
    /// The most requests in flight on it that a scrape showing it draining saw (None: it exited
    /// before a scrape saw it draining).
    inflight: Option<f64>,
    took: Duration,
}

/// Waits until `w`'s gauge `busy` shows work (at most 10 s), sends SIGTERM, then checks the
/// drain: `/metrics` reports `tessera_draining 1`, the process exits 0 within the drain
/// timeout, and its log shows the drain finished rather than timed out.
fn stop(w: &mut Daemon, busy: &str) -> Drained {
    wait_until(
        &format!("{busy} on {}", w.name),
        Duration::from_secs(10),
        || w.metric(busy) >= 1.0,
    );
    w.terminate();
    let t0 = Instant::now();
    let metrics = w.field("metrics").to_string();
    let mut inflight: Option<f64> = None;
    while w.running() {
        if let Ok((200, text)) = try_http_request(&metrics, "GET", "/metrics", None) {
            if metric_sum(&text, "tessera_draining") == 1.0 {
                let now = metric_sum(&text, "tessera_inflight_requests");
                inflight = Some(inflight.map_or(now, |m| m.max(now)));
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = w.wait(Duration::from_secs(25));
    let took = t0.elapsed();
    let log = w.log();
    assert!(
        status.success(),
        "{} exited with {status}; log:\n{log}",
        w.name
    );
    assert!(
        log.contains("deregistered from etcd")
            && log.contains("drained; stopping")
            && !log.contains("drain timed out"),
        "{}: the drain did not deregister and finish cleanly; log:\n{log}",
        w.name
    );
    eprintln!(
        "{} drained in {took:?} (most requests in flight while draining: {inflight:?})",
        w.name
    );
    Drained { inflight, took }
}

#[test]
fn pools_scale_up_and_down_under_load_without_failing_a_request() {
    let _cluster = crate::cluster_alone();
    let fixture = fixtures_dir().join("kl_mixed");
    let model = server::with_tokenizer(&fixture);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let etcd = rt.block_on(etcd::start_etcd());
    let ep = etcd.endpoint.as_str();
    let client = {
        // The client's connection task needs the runtime's context.
        let _in_rt = rt.enter();
        EtcdClient::connect_lazy(&[ep.to_string()], Duration::from_secs(3)).unwrap()
    };
    let registry = Registry { rt, client };

    // 1 prefill + 1 decode, found by the router through etcd.
    let mut p0 = worker("prefill", "p0", model.path(), ep);
    let mut d0 = worker("decode", "d0", model.path(), ep);
    p0.ready();
    d0.ready();
    registry.assert_workers(&["decode/d0", "prefill/p0"]);
    let router = spawn_router(model.path(), &["--etcd", ep, "--cluster", CLUSTER]);
    let http = router.field("http").to_string();

    // Prompts with different first pages (prefix affinity spreads them over prefill workers),
    // two shorter than a page (placed by load alone).
    let prompts = prompts(&fixture, &[40, 9, 230, 64, 17, 12, 160, 48], 8);
    let jobs = jobs(&fixture, &http, &prompts, MAX_TOKENS);
    let load = Load::start(&http, &jobs, CLIENTS);
    load.wait_for_more(6, Duration::from_secs(30));

    // Decode 1 → 3.
    let mut d1 = worker("decode", "d1", model.path(), ep);
    let mut d2 = worker("decode", "d2", model.path(), ep);
    assert_gets_traffic(&mut d1, "tessera_generated_tokens_total");
    assert_gets_traffic(&mut d2, "tessera_generated_tokens_total");

    // Prefill 1 → 2.
    let mut p1 = worker("prefill", "p1", model.path(), ep);
    assert_gets_traffic(&mut p1, "tessera_transfers_total");
    registry.assert_workers(&[
        "decode/d0",
        "decode/d1",
        "decode/d2",
        "prefill/p0",
        "prefill/p1",
    ]);
    load.wait_for_more(20, Duration::from_secs(30));

    // Decode 3 → 1: the original worker first, then one of the new ones, each stopped while a
    // request has reserved pages there and is being prefilled for it (it decodes there after
    // the signal).
    let mut drains = vec![stop(&mut d0, "tessera_reservations")];
    load.wait_for_more(10, Duration::from_secs(30));
    drains.push(stop(&mut d1, "tessera_reservations"));
    load.wait_for_more(10, Duration::from_secs(30));

    // Prefill 2 → 1, stopped while it prefills.
    stop(&mut p0, "tessera_inflight_requests");
    registry.assert_workers(&["decode/d2", "prefill/p1"]);

    // Everything now goes through p1 and d2.
    let (d2_before, p1_before) = (
        d2.metric("tessera_generated_tokens_total"),
        p1.metric("tessera_transfers_total"),
    );
    load.wait_for_more(20, Duration::from_secs(30));
    let (ok, failures) = load.stop();
    eprintln!("steady load: {ok} requests answered correctly");
    assert!(
        failures.is_empty(),
        "{} requests failed while the pools scaled:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(d2.metric("tessera_generated_tokens_total") > d2_before);
    assert!(p1.metric("tessera_transfers_total") > p1_before);
    // The drained decode workers said they were draining with a request in flight, and every
    // request succeeded: each finished its in-flight work before exiting.
    for (d, w) in drains.iter().zip(["d0", "d1"]) {
        let inflight = d
            .inflight
            .unwrap_or_else(|| panic!("{w} exited before a scrape saw it draining ({:?})", d.took));
        assert!(
            inflight >= 1.0,
            "{w}: nothing in flight when it began draining"
        );
    }
    drop(router);
    drop(etcd);
}
