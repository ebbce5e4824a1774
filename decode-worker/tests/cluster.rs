//! A real prefill → decode cluster on loopback: the decode daemon runs as its own process (the
//! `tessera-decode` binary), the prefill daemon in-process (its own engine, gRPC server and TCP
//! transport), and pages move between them over `tessera-transfer`'s TCP backend. Tokens must
//! equal the single-process engine, and both pools must return to baseline after completion,
//! a dropped stream, a released reservation and an expired one. Withholding any one part of the
//! state from the transfer must change the tokens; calls without the cluster secret are refused.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tessera_engine::generate::{generate, GenerateRequest};
use tessera_engine::{Model, SamplingParams};
use tessera_prefill::runtime::{ClusterToken, TestHooks, Withhold, WorkerArgs};
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;

fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/kl_mixed"
    ))
}

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tessera-decode` (its own process, its own fresh pool and staging region) and returns
/// it with its gRPC address (from its ready line).
fn spawn_decode() -> (Daemon, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-decode"))
        .args(["--listen", "127.0.0.1:0", "--page-tokens", "16"])
        .env("TESSERA_MODEL", fixture())
        .env("TESSERA_KV_MEMORY", "24M")
        .env("TESSERA_AUTH_SECRET", SECRET)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start tessera-decode");
    let stdout = child.stdout.take().unwrap();
    let daemon = Daemon(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("TESSERA_READY ") {
                let grpc = rest
                    .split_whitespace()
                    .find_map(|kv| kv.strip_prefix("grpc="))
                    .unwrap()
                    .to_string();
                let _ = tx.send(grpc);
            }
        }
    });
    let grpc = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("tessera-decode became ready");
    (daemon, grpc)
}

fn solo(prompt: &[u32], n: usize, sampling: SamplingParams) -> Vec<u32> {
    let mut m = Model::load(&fixture()).unwrap();
    m.set_batch_invariant(true);
    generate(
        &m,
        &GenerateRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: n,
            sampling,
            stop_ids: vec![],
            prefill_chunk: None,
        },
    )
    .unwrap()
}

const SECRET: &str = "cluster-test";

type Authed = InterceptedService<Channel, ClusterToken>;

/// A channel to `addr` whose calls carry the cluster secret `secret`.
async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn token(secret: &str) -> ClusterToken {
    ClusterToken::new(secret).unwrap()
}

/// The `grpc.health.v1` status of `service` at `addr`, asked without the cluster secret.
async fn health(addr: &str, service: &str) -> i32 {
    use tessera_proto::health::pb::{health_client::HealthClient, HealthCheckRequest};
    HealthClient::new(channel(addr).await)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

struct Cluster {
    decode: DecodeWorkerClient<Authed>,
    prefill: PrefillWorkerClient<Authed>,
    decode_addr: String,
    last_cached: u32,
    /// Bytes the last prefill moved to decode.
    last_bytes: u64,
}

fn wire(s: &SamplingParams) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: s.temperature,
        top_p: Some(s.top_p),
        top_k: s.top_k as u32,
        seed: Some(s.seed),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: v1::LogitBias::from_pairs(&s.logit_bias),
    }
}

impl Cluster {
    /// Starts a prefill daemon in-process (its test hooks shared with the caller) and connects
    /// to it and to the decode daemon at `decode_addr`, with the cluster secret.
    async fn connect(
        decode_addr: &str,
        hooks: Arc<TestHooks>,
    ) -> (Cluster, tessera_prefill::RunningPrefill) {
        let mut args = WorkerArgs::try_parse_from([
            "t",
            "--model",
            fixture().to_str().unwrap(),
            "--kv-memory",
            "8M",
            "--auth-secret",
            SECRET,
        ])
        .unwrap();
        args.daemon.test_hooks = hooks;
        let prefill = tessera_prefill::start(args, std::future::pending())
            .await
            .unwrap();
        let c = Cluster {
            decode: DecodeWorkerClient::with_interceptor(channel(decode_addr).await, token(SECRET)),
            prefill: PrefillWorkerClient::with_interceptor(
                channel(&prefill.grpc.to_string()).await,
                token(SECRET),
            ),
            decode_addr: decode_addr.to_string(),
            last_cached: 0,
            last_bytes: 0,
        };
        (c, prefill)
    }

    /// Reserve on decode, prefill into the reservation; returns (reservation id, first token).
    async fn reserve_and_prefill(
        &mut self,
        rid: &str,
        prompt: &[u32],
        s: &SamplingParams,
    ) -> (String, u32) {
        self.reserve_and_prefill_ttl(rid, prompt, s, 0).await
    }

    /// [`Cluster::reserve_and_prefill`] with a reservation that lasts `ttl_ms` (0: the decode
    /// worker's default).
    async fn reserve_and_prefill_ttl(
        &mut self,
        rid: &str,
        prompt: &[u32],
        s: &SamplingParams,
        ttl_ms: u32,
    ) -> (String, u32) {
        let r = self
            .decode
            .reserve_pages(v1::ReserveRequest {
                request_id: rid.into(),
                prompt_token_ids: prompt.to_vec(),
                ttl_ms,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let p = self
            .prefill
            .prefill(v1::PrefillRequest {
                request_id: rid.into(),
                prompt_token_ids: prompt.to_vec(),
                sampling: Some(wire(s)),
                destination: Some(v1::KvDestination::for_reservation(
                    self.decode_addr.clone(),
                    &r,
                )),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        self.last_bytes = p.transfer.unwrap().bytes;
        assert!(self.last_bytes > 0);
        self.last_cached = p.cached_tokens;
        (r.reservation_id, p.first_token)
    }

    async fn start(
        &mut self,
        rid: &str,
        res: String,
        prompt: &[u32],
        first: u32,
        n: usize,
        s: &SamplingParams,
    ) -> tessera_proto::tonic::Streaming<v1::TokenChunk> {
        self.decode
            .start_decode(v1::StartDecodeRequest {
                request_id: rid.into(),
                reservation_id: res,
                prompt_token_ids: prompt.to_vec(),
                first_token: first,
                sampling: Some(wire(s)),
                max_tokens: n as u32,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    }

    async fn run(&mut self, rid: &str, prompt: &[u32], n: usize, s: SamplingParams) -> Vec<u32> {
        let (res, first) = self.reserve_and_prefill(rid, prompt, &s).await;
        let mut stream = self.start(rid, res, prompt, first, n, &s).await;
        let mut out = vec![first];
        let mut finished = false;
        while let Some(c) = stream.next().await {
            let c = c.unwrap();
            out.extend(c.token_ids);
            finished |= c.finish_reason != 0;
        }
        assert!(finished, "the stream ends with a finish reason");
        out
    }

    /// Live pages on (prefill, decode), from their `Stats`.
    async fn live(&mut self) -> (u64, u64) {
        // Pages held by requests, reservations and handoffs (the prefix cache may keep the rest).
        let sum = |s: v1::WorkerStats| -> u64 {
            let p = s.pool.unwrap();
            p.groups.iter().map(|g| g.live_pages).sum::<u64>() - p.cached_pages
        };
        let p = sum(self
            .prefill
            .stats(v1::StatsRequest {})
            .await
            .unwrap()
            .into_inner());
        let d = sum(self
            .decode
            .stats(v1::StatsRequest {})
            .await
            .unwrap()
            .into_inner());
        (p, d)
    }

    async fn wait_baseline(&mut self, what: &str) {
        let t = Instant::now();
        loop {
            let l = self.live().await;
            if l == (0, 0) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}: pages leaked {l:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_daemons_equal_the_single_process_engine() {
    let (mut decode_proc, decode_addr) = spawn_decode();
    let (mut c, _prefill) = Cluster::connect(&decode_addr, Default::default()).await;
    assert_eq!(c.live().await, (0, 0));

    let prompt: Vec<u32> = (0..70).map(|i| (i * 29 % 370) as u32 + 5).collect();
    let greedy = SamplingParams::default();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 0,
        seed: 7,
        ..Default::default()
    };
    // Penalties and a bias, applied by prefill to the first token and by decode to the rest.
    let penalized = SamplingParams {
        presence_penalty: 1.0,
        frequency_penalty: 0.5,
        logit_bias: vec![(prompt[5], 3.0)],
        ..sampled.clone()
    };
    for (i, (p, s)) in [
        (prompt.clone(), greedy.clone()),
        (prompt[..37].to_vec(), greedy.clone()),
        (prompt.clone(), sampled.clone()),
        // Same prompt again: a prefix-cache hit on prefill, still the same tokens.
        (prompt.clone(), greedy.clone()),
        (prompt[..50].to_vec(), penalized.clone()),
    ]
    .into_iter()
    .enumerate()
    {
        let n = 24;
        let got = c.run(&format!("r{i}"), &p, n, s.clone()).await;
        assert_eq!(got, solo(&p, n, s), "request {i}");
        if i == 3 {
            assert!(
                c.last_cached > 0,
                "the repeated prompt hits prefill's prefix cache"
            );
        }
        c.wait_baseline("after completion").await;
    }

    // A client that drops its stream mid-decode: pages freed on both sides.
    let (res, first) = c.reserve_and_prefill("drop", &prompt, &greedy).await;
    let mut stream = c.start("drop", res, &prompt, first, 400, &greedy).await;
    let _ = stream.next().await.unwrap().unwrap();
    drop(stream);
    c.wait_baseline("after a dropped stream").await;

    // Cancel by request id.
    let (res, first) = c.reserve_and_prefill("cancel", &prompt, &greedy).await;
    let mut stream = c.start("cancel", res, &prompt, first, 400, &greedy).await;
    let _ = stream.next().await.unwrap().unwrap();
    let found = c
        .decode
        .cancel(v1::CancelRequest {
            request_id: "cancel".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .found;
    assert!(found);
    while stream.next().await.is_some() {}
    c.wait_baseline("after Cancel").await;

    // A released reservation, and one left to expire.
    let r = c
        .decode
        .reserve_pages(v1::ReserveRequest {
            request_id: "rel".into(),
            prompt_token_ids: prompt.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(c.live().await.1, 0);
    let rel = c
        .decode
        .release_reservation(v1::ReleaseReservationRequest {
            request_id: "rel".into(),
            reservation_id: r.reservation_id,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(rel.released);
    c.wait_baseline("after ReleaseReservation").await;
    let (res, first) = c
        .reserve_and_prefill_ttl("ttl", &prompt, &greedy, 300)
        .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    c.wait_baseline("after the reservation's TTL").await;
    let err = c
        .decode
        .start_decode(v1::StartDecodeRequest {
            request_id: "ttl".into(),
            reservation_id: res,
            prompt_token_ids: prompt.clone(),
            first_token: first,
            max_tokens: 4,
            ..Default::default()
        })
        .await
        .expect_err("an expired reservation cannot start");
    assert_eq!(
        v1::ErrorDetail::from_status(&err).unwrap().code,
        v1::ErrorCode::ReservationExpired as i32
    );

    // Health, then a graceful drain on SIGTERM: the daemon exits cleanly.
    let st = health(&decode_addr, "tessera.v1.DecodeWorker").await;
    assert_eq!(st, 1, "SERVING");
    let pid = decode_proc.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t = Instant::now();
    loop {
        if let Some(status) = decode_proc.0.try_wait().unwrap() {
            assert!(status.success(), "drained and exited: {status}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withholding_one_page_of_the_state_over_the_wire_changes_the_output() {
    let hooks = Arc::new(TestHooks::default());
    let prompt: Vec<u32> = (0..70).map(|i| (i * 29 % 370) as u32 + 5).collect();
    let greedy = SamplingParams::default();
    let n = 24;
    let want = solo(&prompt, n, greedy.clone());
    let mla_pages = prompt.len().div_ceil(16);

    // Every case gets a fresh decode process: its staging slots and pages hold no earlier copy
    // of this prompt's state that a withheld page could silently fall back on.
    let (mut decode, mut addr) = spawn_decode();
    let (mut c, _prefill) = Cluster::connect(&addr, hooks.clone()).await;
    let layout = c
        .decode
        .stats(v1::StatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap()
        .layout
        .unwrap();
    let kda_groups = layout
        .groups
        .iter()
        .filter(|g| g.kind == v1::CacheGroupKind::Kda as i32)
        .count();
    assert!(kda_groups >= 2, "the fixture has several KDA groups");

    // The whole state: exact.
    assert_eq!(c.run("all", &prompt, n, greedy.clone()).await, want);
    let full_bytes = c.last_bytes;

    let mut cases = vec![Withhold::MlaPage(0), Withhold::MlaPage(mla_pages - 1)];
    cases.extend((0..kda_groups).map(Withhold::KdaGroup));
    for (i, w) in cases.into_iter().enumerate() {
        drop(decode);
        (decode, addr) = spawn_decode();
        c.decode = DecodeWorkerClient::with_interceptor(channel(&addr).await, token(SECRET));
        c.decode_addr = addr.clone();
        *hooks.withhold.lock().unwrap() = Some(w);
        let got = c
            .run(&format!("withheld{i}"), &prompt, n, greedy.clone())
            .await;
        assert!(
            c.last_bytes < full_bytes,
            "{w:?}: the transfer left something out ({} of {full_bytes} bytes)",
            c.last_bytes
        );
        assert_ne!(
            got, want,
            "decode ignored the withheld {w:?}: the equality check cannot tell a missing state"
        );
        *hooks.withhold.lock().unwrap() = None;
        c.wait_baseline(&format!("after withholding {w:?}")).await;
    }

    // With the hook disarmed, the same decode worker is exact again.
    assert_eq!(c.run("again", &prompt, n, greedy).await, want);
    assert_eq!(c.last_bytes, full_bytes);
}

/// An interceptor that sends `secret` (none: no `authorization` at all) as the bearer token.
fn bearer(secret: Option<&'static str>) -> impl tessera_proto::tonic::service::Interceptor + Clone {
    move |mut r: tessera_proto::tonic::Request<()>| {
        if let Some(s) = secret {
            let v = format!("Bearer {s}").parse().unwrap();
            r.metadata_mut().insert("authorization", v);
        }
        Ok(r)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_refuse_calls_without_the_cluster_secret() {
    use tessera_proto::tonic::Code;

    let (_decode, decode_addr) = spawn_decode();
    let (mut c, prefill) = Cluster::connect(&decode_addr, Default::default()).await;
    let prefill_addr = prefill.grpc.to_string();
    let prompt: Vec<u32> = (0..40).map(|i| i as u32 + 5).collect();
    let unauthenticated = |r: Result<_, tessera_proto::tonic::Status>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert_eq!(e.code(), Code::Unauthenticated, "{what}: {e:?}");
    };

    for secret in [None, Some("not-the-cluster-secret")] {
        let what = |call: &str| format!("{call} with secret {secret:?}");
        let mut decode =
            DecodeWorkerClient::with_interceptor(channel(&decode_addr).await, bearer(secret));
        let mut prefill =
            PrefillWorkerClient::with_interceptor(channel(&prefill_addr).await, bearer(secret));
        let reserve = decode
            .reserve_pages(v1::ReserveRequest {
                request_id: "intruder".into(),
                prompt_token_ids: prompt.clone(),
                ..Default::default()
            })
            .await;
        unauthenticated(reserve.map(drop), &what("ReservePages"));
        unauthenticated(
            decode.stats(v1::StatsRequest {}).await.map(drop),
            &what("decode Stats"),
        );
        unauthenticated(
            decode
                .transfer_handshake(v1::TransferHandshakeRequest::default())
                .await
                .map(drop),
            &what("TransferHandshake"),
        );
        let p = prefill
            .prefill(v1::PrefillRequest {
                request_id: "intruder".into(),
                prompt_token_ids: prompt.clone(),
                ..Default::default()
            })
            .await;
        unauthenticated(p.map(drop), &what("Prefill"));
        unauthenticated(
            prefill.stats(v1::StatsRequest {}).await.map(drop),
            &what("prefill Stats"),
        );
    }
    // Nothing was reserved or run by the refused calls.
    assert_eq!(c.live().await, (0, 0));

    // Health stays open to anyone (load balancers and probes carry no secret).
    for (addr, service) in [
        (&decode_addr, "tessera.v1.DecodeWorker"),
        (&prefill_addr, "tessera.v1.PrefillWorker"),
    ] {
        let st = health(addr, service).await;
        assert_eq!(st, 1, "{service} is SERVING to an unauthenticated probe");
    }

    // With the secret, the whole path works (prefill's own calls to decode carry it too).
    let want = solo(&prompt, 8, SamplingParams::default());
    assert_eq!(
        c.run("member", &prompt, 8, SamplingParams::default()).await,
        want
    );
}
