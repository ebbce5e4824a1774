//! A real prefill → decode cluster on loopback: the decode daemon runs as its own process (the
//! `tessera-decode` binary), the prefill daemon in-process (its own engine, gRPC server and TCP
//! transport), and pages move between them over `tessera-transfer`'s TCP backend. Tokens must
//! equal the single-process engine, and both pools must return to baseline after completion,
//! a dropped stream, a released reservation and an expired one.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use tessera_engine::generate::{generate, GenerateRequest};
use tessera_engine::{Model, SamplingParams};
use tessera_prefill::runtime::WorkerArgs;
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

#[derive(Parser)]
struct A {
    #[command(flatten)]
    w: WorkerArgs,
}

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tessera-decode` and returns it with its gRPC address (from its ready line).
fn spawn_decode() -> (Daemon, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-decode"))
        .args(["--listen", "127.0.0.1:0", "--page-tokens", "16"])
        .env("TESSERA_MODEL", fixture())
        .env("TESSERA_KV_MEMORY", "24M")
        .env("TESSERA_AUTH_SECRET", "cluster-test")
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

struct Cluster {
    decode: DecodeWorkerClient<Channel>,
    prefill: PrefillWorkerClient<Channel>,
    decode_addr: String,
    last_cached: u32,
}

fn wire(s: &SamplingParams) -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: s.temperature,
        top_p: Some(s.top_p),
        top_k: s.top_k as u32,
        seed: Some(s.seed),
    }
}

impl Cluster {
    /// Reserve on decode, prefill into the reservation; returns (reservation id, first token).
    async fn reserve_and_prefill(
        &mut self,
        rid: &str,
        prompt: &[u32],
        s: &SamplingParams,
    ) -> (String, u32) {
        let r = self
            .decode
            .reserve_pages(v1::ReserveRequest {
                request_id: rid.into(),
                prompt_token_ids: prompt.to_vec(),
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
                destination: Some(v1::KvDestination {
                    decode_grpc_address: self.decode_addr.clone(),
                    decode_incarnation_id: r.incarnation_id,
                    reservation_id: r.reservation_id.clone(),
                    mla_page_ids: r.mla_page_ids.clone(),
                    kda_state_page_ids: r.kda_state_page_ids.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(p.transfer.unwrap().bytes > 0);
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
    let args = A::parse_from([
        "t",
        "--model",
        fixture().to_str().unwrap(),
        "--kv-memory",
        "8M",
        "--auth-secret",
        "cluster-test",
    ])
    .w;
    let prefill = tessera_prefill::start(args, std::future::pending())
        .await
        .unwrap();
    let mut c = Cluster {
        decode: DecodeWorkerClient::connect(format!("http://{decode_addr}"))
            .await
            .unwrap(),
        prefill: PrefillWorkerClient::connect(format!("http://{}", prefill.grpc))
            .await
            .unwrap(),
        decode_addr: decode_addr.clone(),
        last_cached: 0,
    };
    assert_eq!(c.live().await, (0, 0));

    let prompt: Vec<u32> = (0..70).map(|i| (i * 29 % 370) as u32 + 5).collect();
    let greedy = SamplingParams::default();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 0,
        seed: 7,
    };
    for (i, (p, s)) in [
        (prompt.clone(), greedy.clone()),
        (prompt[..37].to_vec(), greedy.clone()),
        (prompt.clone(), sampled.clone()),
        // Same prompt again: a prefix-cache hit on prefill, still the same tokens.
        (prompt.clone(), greedy.clone()),
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
    use tessera_proto::health::pb::{health_client::HealthClient, HealthCheckRequest};
    let channel = Channel::from_shared(format!("http://{decode_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let st = health
        .check(HealthCheckRequest {
            service: "tessera.v1.DecodeWorker".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
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

impl Cluster {
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
                destination: Some(v1::KvDestination {
                    decode_grpc_address: self.decode_addr.clone(),
                    decode_incarnation_id: r.incarnation_id,
                    reservation_id: r.reservation_id.clone(),
                    mla_page_ids: r.mla_page_ids.clone(),
                    kda_state_page_ids: r.kda_state_page_ids.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        (r.reservation_id, p.first_token)
    }
}
