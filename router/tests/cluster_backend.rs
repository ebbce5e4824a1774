//! The router's cluster backend against real workers: in-process `tessera-prefill` and
//! `tessera-decode` daemons (their own engines, gRPC servers and TCP page transport) on
//! loopback. Greedy tokens must equal the `transformers` fixture; pages must return to baseline
//! on both sides after cancellations; a dead prefill worker must not fail requests.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::Value;
use tessera_prefill::runtime::{ClusterToken, TestHooks, WorkerArgs};
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tessera_router::cluster::Role;
use tessera_router::{
    BackendError, ClusterBackend, ClusterConfig, FinishReason, GenerationBackend,
    GenerationRequest, PoolOptions, Sampling, TokenEvent, Usage,
};
use tokio::sync::mpsc;

use crate::common::{self, fixture, stopper, Worker};

const SECRET: &str = "router-cluster-test";

/// (prompt ids, greedy ids) of the fixture's reference.
fn reference() -> Vec<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |x: &Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["prompt_ids"]), ids(&p["greedy_ids"])))
        .collect()
}

fn worker_args(kv: &str) -> WorkerArgs {
    worker_args_with(kv, &[])
}

/// [`worker_args`] plus `extra` flags.
fn worker_args_with(kv: &str, extra: &[&str]) -> WorkerArgs {
    common::worker_args(SECRET, kv, extra)
}

async fn start_decode() -> Worker {
    start_decode_with(Default::default()).await
}

/// A decode worker whose test hooks (its transport's faults) the caller holds.
async fn start_decode_with(hooks: Arc<TestHooks>) -> Worker {
    let (tx, stop) = stopper();
    let mut args = worker_args("24M");
    args.daemon.test_hooks = hooks;
    let d = tessera_decode::start(args, stop).await.unwrap();
    Worker {
        grpc: d.grpc.to_string(),
        stop: Some(tx),
        server: d.server,
    }
}

async fn start_prefill() -> Worker {
    let (tx, stop) = stopper();
    let p = tessera_prefill::start(worker_args("8M"), stop)
        .await
        .unwrap();
    Worker {
        grpc: p.grpc.to_string(),
        stop: Some(tx),
        server: p.server,
    }
}

async fn backend(prefill: &[&Worker], decode: &[&Worker]) -> Arc<ClusterBackend> {
    backend_with_ttl(prefill, decode, 0).await
}

/// A backend whose decode reservations (and so page transfers) last `reserve_ttl_ms`.
async fn backend_with_ttl(
    prefill: &[&Worker],
    decode: &[&Worker],
    reserve_ttl_ms: u32,
) -> Arc<ClusterBackend> {
    let b = ClusterBackend::new(ClusterConfig {
        model_id: "kl_mixed".into(),
        max_model_len: 4096,
        prefill: prefill.iter().map(|w| w.grpc.clone()).collect(),
        decode: decode.iter().map(|w| w.grpc.clone()).collect(),
        pool: PoolOptions {
            auth_secret: Some(SECRET.into()),
            health_interval: Duration::from_millis(300),
            ..PoolOptions::default()
        },
        reserve_ttl_ms,
        encoder: vec![],
        image_token_id: None,
    })
    .unwrap();
    b.pool().probe_all().await;
    b.health().unwrap();
    Arc::new(b)
}

fn greedy(id: &str, prompt: &[u32], max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        request_id: id.into(),
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling: Sampling {
            temperature: 0.0,
            ..Sampling::default()
        },
        stop_token_ids: vec![],
        ignore_eos: true,
        images: vec![],
    }
}

struct Outcome {
    tokens: Vec<u32>,
    finish: Option<(FinishReason, Usage)>,
    error: Option<BackendError>,
    prefilled: bool,
}

async fn collect(mut rx: mpsc::Receiver<TokenEvent>) -> Outcome {
    let mut o = Outcome {
        tokens: vec![],
        finish: None,
        error: None,
        prefilled: false,
    };
    while let Some(e) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("an event within 60 s")
    {
        match e {
            TokenEvent::Prefilled { .. } => o.prefilled = true,
            TokenEvent::Token(t) => o.tokens.push(t),
            TokenEvent::Finished { reason, usage } => o.finish = Some((reason, usage)),
            TokenEvent::Failed(e) => o.error = Some(e),
        }
    }
    o
}

async fn generate(b: &ClusterBackend, req: GenerationRequest) -> Outcome {
    collect(b.submit(req).unwrap()).await
}

fn assert_reference(o: &Outcome, prompt: &[u32], want: &[u32], what: &str) {
    assert!(o.error.is_none(), "{what}: {:?}", o.error);
    assert!(o.prefilled, "{what}: Prefilled sent");
    assert_eq!(o.tokens, want, "{what}: greedy tokens equal the fixture");
    let (reason, usage) = o.finish.expect("finished");
    assert_eq!(reason, FinishReason::Length, "{what}");
    assert_eq!(usage.prompt_tokens, prompt.len(), "{what}");
    assert_eq!(usage.completion_tokens, want.len(), "{what}");
}

type Authed = InterceptedService<Channel, ClusterToken>;

async fn authed(addr: &str) -> Authed {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    InterceptedService::new(channel, ClusterToken::new(SECRET).unwrap())
}

/// Pages held by requests and reservations (not the prefix cache) on a worker, from `Stats`.
async fn live_pages(addr: &str, role: Role) -> u64 {
    let stats = match role {
        Role::Decode => DecodeWorkerClient::new(authed(addr).await)
            .stats(v1::StatsRequest {})
            .await
            .unwrap()
            .into_inner(),
        Role::Prefill => PrefillWorkerClient::new(authed(addr).await)
            .stats(v1::StatsRequest {})
            .await
            .unwrap()
            .into_inner(),
        Role::Encoder => unreachable!("encoders hold no pages"),
    };
    let p = stats.pool.unwrap();
    p.groups.iter().map(|g| g.live_pages).sum::<u64>() - p.cached_pages + p.reserved_pages
}

async fn wait_baseline(workers: &[(&Worker, Role)], b: &ClusterBackend, what: &str) {
    let t = Instant::now();
    loop {
        let mut live = vec![];
        for (w, role) in workers {
            live.push(live_pages(&w.grpc, *role).await);
        }
        let inflight: usize = [Role::Prefill, Role::Decode]
            .iter()
            .flat_map(|&r| b.pool().workers(r).into_iter().map(|w| w.inflight()))
            .sum();
        if live.iter().all(|&n| n == 0) && inflight == 0 {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what}: pages leaked {live:?}, router in-flight {inflight}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Model dir for the HTTP front: the fixture plus a tiny tokenizer of its vocabulary size.
fn model_dir_with_tokenizer() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    tessera_tokenizer::write_tiny_tokenizer(dir.path(), 384).unwrap();
    dir
}

/// One HTTP/1.0 POST (close-delimited body, so SSE needs no chunked decoding); returns the body.
fn http_post(addr: std::net::SocketAddr, path: &str, body: &Value) -> (u16, String) {
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_matches_the_fixture_over_the_backend_and_http() {
    let _workers = crate::workers_beside_others().await;
    let decode = start_decode().await;
    let prefill = start_prefill().await;
    let b = backend(&[&prefill], &[&decode]).await;
    let workers = [(&prefill, Role::Prefill), (&decode, Role::Decode)];

    for (i, (prompt, want)) in reference().iter().enumerate() {
        let o = generate(&b, greedy(&format!("ref{i}"), prompt, want.len())).await;
        assert_reference(&o, prompt, want, &format!("prompt {i}"));
    }
    wait_baseline(&workers, &b, "after completions").await;

    // max_tokens 1: the first token finishes it; decode never starts and frees its reservation.
    let (prompt, want) = &reference()[1];
    let o = generate(&b, greedy("one", prompt, 1)).await;
    assert_reference(&o, prompt, &want[..1], "max_tokens 1");
    // A stop token equal to the first token: Stop.
    let mut r = greedy("stop", prompt, 8);
    r.stop_token_ids = vec![want[0]];
    let o = generate(&b, r).await;
    assert_eq!(o.tokens, &want[..1]);
    assert_eq!(o.finish.unwrap().0, FinishReason::Stop);
    wait_baseline(&workers, &b, "after first-token finishes").await;

    // Cancel mid-decode: drop the receiver after a few tokens.
    let (long_prompt, _) = &reference()[2];
    let mut rx = b.submit(greedy("cancel", long_prompt, 3000)).unwrap();
    let mut seen = 0;
    while let Some(e) = rx.recv().await {
        if matches!(e, TokenEvent::Token(_)) {
            seen += 1;
            if seen == 4 {
                break;
            }
        }
    }
    assert_eq!(seen, 4);
    drop(rx);
    wait_baseline(&workers, &b, "after a cancelled decode").await;

    // Cancel right after submit (during reserve/prefill).
    for i in 0..3 {
        let rx = b
            .submit(greedy(&format!("early{i}"), long_prompt, 50))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(5 * i)).await;
        drop(rx);
    }
    wait_baseline(&workers, &b, "after early cancellations").await;
    let metrics = b.metrics_text();
    assert!(metrics.contains("tessera_router_worker_requests_total{role=\"decode\""));
    assert!(metrics.contains(&format!(
        "tessera_router_worker_inflight{{role=\"decode\",worker=\"{}\"}} 0",
        decode.grpc
    )));

    // Through the daemon's HTTP front, plain and streamed.
    let dir = model_dir_with_tokenizer();
    #[derive(Parser)]
    struct R {
        #[command(flatten)]
        r: tessera_router::RouterArgs,
    }
    let args = R::parse_from([
        "tessera-router",
        "--model",
        dir.path().to_str().unwrap(),
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--prefill",
        &prefill.grpc,
        "--decode",
        &decode.grpc,
        "--auth-secret",
        SECRET,
    ])
    .r;
    let (stop_router, stop) = stopper();
    let router = tessera_router::daemon::start(args, stop).await.unwrap();
    router.backend.pool().probe_all().await;
    let addr = router.addr;
    let (prompt, want) = reference()[1].clone();
    let model_name = dir
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let body = |stream: bool| {
        serde_json::json!({
            "model": model_name,
            "prompt": prompt,
            "max_tokens": want.len(),
            "temperature": 0,
            "ignore_eos": true,
            "return_token_ids": true,
            "stream": stream,
        })
    };
    let (plain_body, stream_body) = (body(false), body(true));
    let (plain, streamed) = tokio::task::spawn_blocking(move || {
        (
            http_post(addr, "/v1/completions", &plain_body),
            http_post(addr, "/v1/completions", &stream_body),
        )
    })
    .await
    .unwrap();
    assert_eq!(plain.0, 200, "{}", plain.1);
    let v: Value = serde_json::from_str(&plain.1).unwrap();
    let got: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(got, want, "plain HTTP");
    assert_eq!(v["usage"]["completion_tokens"], want.len());
    assert_eq!(streamed.0, 200, "{}", streamed.1);
    let mut got = vec![];
    for line in streamed.1.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(ids) = v["choices"][0]["token_ids"].as_array() {
            got.extend(ids.iter().map(|t| t.as_u64().unwrap() as u32));
        }
    }
    assert_eq!(got, want, "streamed HTTP");

    // Through the daemon's gRPC `Generate` service (token-ID prompt, streamed and not).
    use tessera_proto::v1::generate_client::GenerateClient;
    use tessera_proto::v1::generate_request::Prompt;
    let mut client = GenerateClient::connect(format!("http://{}", router.grpc_addr))
        .await
        .unwrap();
    for stream in [true, false] {
        let req = v1::GenerateRequest {
            model: model_name.clone(),
            prompt: Some(Prompt::TokenIds(v1::TokenIds {
                ids: prompt.clone(),
            })),
            sampling: Some(v1::SamplingParams::default()),
            max_tokens: want.len() as u32,
            ignore_eos: true,
            stream,
            ..Default::default()
        };
        let mut responses = client.generate(req).await.unwrap().into_inner();
        let (mut got, mut last) = (vec![], None);
        while let Some(r) = responses.message().await.unwrap() {
            got.extend(r.token_ids.iter().copied());
            last = Some(r);
        }
        assert_eq!(got, want, "gRPC, stream {stream}");
        let last = last.unwrap();
        assert_eq!(last.finish_reason(), v1::FinishReason::Length);
        let usage = last.usage.unwrap();
        assert_eq!(usage.prompt_tokens as usize, prompt.len());
        assert_eq!(usage.completion_tokens as usize, want.len());
    }
    drop(client);
    let _ = stop_router.send(());
    router.server.await.unwrap().unwrap();

    wait_baseline(&workers, &b, "after HTTP").await;
    prefill.shut_down().await;
    decode.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_by_two_spreads_load_and_survives_a_dead_prefill_worker() {
    let _workers = crate::workers_beside_others().await;
    let (d0, d1) = (start_decode().await, start_decode().await);
    let (p0, p1) = (start_prefill().await, start_prefill().await);
    let b = backend(&[&p0, &p1], &[&d0, &d1]).await;
    let workers = [
        (&p0, Role::Prefill),
        (&p1, Role::Prefill),
        (&d0, Role::Decode),
        (&d1, Role::Decode),
    ];
    let refs = reference();

    // 8 concurrent requests: all exact, spread over both decode workers.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let b = b.clone();
            let (prompt, want) = refs[i % refs.len()].clone();
            tokio::spawn(async move {
                let o = generate(&b, greedy(&format!("c{i}"), &prompt, want.len())).await;
                assert_reference(&o, &prompt, &want, &format!("concurrent {i}"));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let metrics = b.metrics_text();
    for d in [&d0, &d1] {
        let line = format!(
            "tessera_router_worker_requests_total{{role=\"decode\",worker=\"{}\"}} ",
            d.grpc
        );
        let n: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            n >= 2,
            "decode {} got {n} of 8 requests:\n{metrics}",
            d.grpc
        );
    }
    wait_baseline(&workers, &b, "after concurrent requests").await;

    // Kill one prefill worker: every request still succeeds, via the other.
    let p1_addr = p1.grpc.clone();
    p1.shut_down().await;
    for i in 0..6 {
        let (prompt, want) = &refs[i % refs.len()];
        let o = generate(&b, greedy(&format!("dead{i}"), prompt, want.len())).await;
        assert_reference(&o, prompt, want, &format!("after the prefill died, {i}"));
    }
    let prefill_workers = b.pool().workers(Role::Prefill);
    let dead = prefill_workers.iter().find(|w| w.addr == p1_addr).unwrap();
    assert!(
        !dead.is_healthy(),
        "the dead prefill worker is out of routing"
    );
    let workers = [
        (&p0, Role::Prefill),
        (&d0, Role::Decode),
        (&d1, Role::Decode),
    ];
    wait_baseline(&workers, &b, "after the prefill failover").await;

    // No decode worker alive at all: Unavailable, not a hang.
    d0.shut_down().await;
    d1.shut_down().await;
    b.pool().probe_all().await;
    match b.submit(greedy("none", &refs[1].0, 4)) {
        Err(BackendError::Unavailable(_)) => {}
        Err(e) => panic!("expected Unavailable, got {e:?}"),
        Ok(rx) => {
            let o = collect(rx).await;
            assert!(
                matches!(o.error, Some(BackendError::Unavailable(_))),
                "{:?}",
                o.error
            );
        }
    }
    p0.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_that_misses_its_deadline_fails_the_request_and_frees_both_sides() {
    let _workers = crate::workers_beside_others().await;
    use std::sync::atomic::Ordering;
    let hooks = Arc::new(TestHooks::default());
    let decode = start_decode_with(hooks.clone()).await;
    let prefill = start_prefill().await;
    // Reservations (and so transfers) routed by this backend last 1.5 s.
    let b = backend_with_ttl(&[&prefill], &[&decode], 1500).await;
    let workers = [(&prefill, Role::Prefill), (&decode, Role::Decode)];
    let (prompt, want) = reference()[2].clone();
    // From now on decode's transport accepts transfers and never completes one.
    hooks.transfer.stall_receive.store(true, Ordering::Relaxed);

    // Worker to worker: a reservation held for a minute, a transfer allowed 300 ms.
    let mut d = DecodeWorkerClient::new(authed(&decode.grpc).await);
    let r = d
        .reserve_pages(v1::ReserveRequest {
            request_id: "late".into(),
            prompt_token_ids: prompt.clone(),
            ttl_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let started = Instant::now();
    let e = PrefillWorkerClient::new(authed(&prefill.grpc).await)
        .prefill(v1::PrefillRequest {
            request_id: "late".into(),
            prompt_token_ids: prompt.clone(),
            destination: Some(v1::KvDestination {
                decode_grpc_address: decode.grpc.clone(),
                decode_incarnation_id: r.incarnation_id,
                reservation_id: r.reservation_id.clone(),
                mla_page_ids: r.mla_page_ids.clone(),
                kda_state_page_ids: r.kda_state_page_ids.clone(),
                transfer_timeout_ms: 300,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect_err("the transfer cannot complete");
    assert_eq!(
        v1::ErrorDetail::from_status(&e).map(|d| d.code),
        Some(v1::ErrorCode::TransferTimeout as i32),
        "{e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the deadline ended the call ({:?})",
        started.elapsed()
    );
    // Both sides free the pages now, not when the reservation's minute is up.
    wait_baseline(&workers, &b, "after a missed transfer deadline").await;
    let Err(gone) = d
        .start_decode(v1::StartDecodeRequest {
            request_id: "late".into(),
            reservation_id: r.reservation_id,
            prompt_token_ids: prompt.clone(),
            max_tokens: 4,
            ..Default::default()
        })
        .await
    else {
        panic!("the freed reservation started decoding");
    };
    assert_eq!(
        v1::ErrorDetail::from_status(&gone).map(|d| d.code),
        Some(v1::ErrorCode::ReservationExpired as i32)
    );

    // Through the router: the client gets an error naming the transfer, not a hang.
    let started = Instant::now();
    let o = generate(&b, greedy("late-routed", &prompt, want.len())).await;
    let err = o.error.expect("the request fails");
    assert!(o.tokens.is_empty(), "no token was sent: {:?}", o.tokens);
    assert!(err.to_string().contains("page transfer"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the request ended by the reservation's deadline ({:?})",
        started.elapsed()
    );
    wait_baseline(
        &workers,
        &b,
        "after a routed request missed its transfer deadline",
    )
    .await;

    // Once transfers complete again, the same workers serve the request exactly.
    hooks.transfer.stall_receive.store(false, Ordering::Relaxed);
    let o = generate(&b, greedy("on-time", &prompt, want.len())).await;
    assert_reference(&o, &prompt, &want, "after the fault cleared");
    wait_baseline(&workers, &b, "after the fault cleared").await;
    prefill.shut_down().await;
    decode.shut_down().await;
}

/// The router's migration counter.
fn migrations(b: &ClusterBackend) -> u64 {
    b.metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix("tessera_router_migrations_total "))
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_failing_mid_stream_migrates_the_request_without_a_seam() {
    let _workers = crate::workers_beside_others().await;
    use std::sync::atomic::Ordering;
    let hooks = Arc::new(TestHooks::default());
    let (flaky, sound) = (start_decode_with(hooks.clone()).await, start_decode().await);
    let prefill = start_prefill().await;
    let b = backend(&[&prefill], &[&flaky, &sound]).await;
    let only_sound = backend(&[&prefill], &[&sound]).await;
    let workers = [
        (&prefill, Role::Prefill),
        (&flaky, Role::Decode),
        (&sound, Role::Decode),
    ];
    let refs = reference();
    let sampled = |id: &str, prompt: &[u32], n: usize| GenerationRequest {
        sampling: Sampling {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(1234),
            ..Sampling::default()
        },
        ..greedy(id, prompt, n)
    };
    // Seeded sampling through healthy workers only: what a migrated request must reproduce.
    let (prompt, want) = refs[1].clone();
    let sampled_want = generate(&only_sound, sampled("s-ref", &prompt, want.len())).await;
    assert!(sampled_want.error.is_none(), "{:?}", sampled_want.error);

    // Every stream on the flaky worker dies after 3 tokens (4 counting the first one).
    hooks.break_streams_after.store(3, Ordering::Relaxed);
    let mut i = 0;
    while migrations(&b) < 2 {
        assert!(i < 12, "no request was routed to the flaky decode worker");
        // A failed worker is out of routing until its next probe.
        b.pool().probe_all().await;
        let (prompt, want) = &refs[i % refs.len()];
        let o = generate(&b, greedy(&format!("m{i}"), prompt, want.len())).await;
        assert_reference(&o, prompt, want, &format!("request {i}"));
        i += 1;
    }
    // A sampled request continues the same random stream on the other worker.
    let mut j = 0;
    let before = migrations(&b);
    while migrations(&b) == before {
        assert!(
            j < 12,
            "no sampled request was routed to the flaky decode worker"
        );
        b.pool().probe_all().await;
        let o = generate(&b, sampled(&format!("s{j}"), &prompt, want.len())).await;
        assert!(o.error.is_none(), "{:?}", o.error);
        assert_eq!(o.tokens, sampled_want.tokens, "sampled request {j}");
        let (_, usage) = o.finish.unwrap();
        assert_eq!(
            (usage.prompt_tokens, usage.completion_tokens),
            (prompt.len(), want.len())
        );
        j += 1;
    }
    wait_baseline(&workers, &b, "after migrations").await;

    // When every decode worker fails, the request fails with a clear error after its attempts,
    // having sent each token at most once.
    let bad = backend(&[&prefill], &[&flaky]).await;
    let o = generate(&bad, greedy("doomed", &refs[2].0, refs[2].1.len())).await;
    assert!(o.error.is_some(), "the request cannot finish");
    assert!(o.tokens.len() <= 4 && o.tokens[..] == refs[2].1[..o.tokens.len()]);
    wait_baseline(&workers, &b, "after a failed request").await;
    for w in [prefill, flaky, sound] {
        w.shut_down().await;
    }
}

/// PEM files of a test PKI: a CA, and a certificate it signed for 127.0.0.1 (and localhost).
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let node = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let write = |name: &str, text: String| std::fs::write(dir.path().join(name), text).unwrap();
        write("ca.pem", ca_cert.pem());
        write("node.pem", node.pem());
        write("node.key", key.serialize_pem());
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// The `--tls-*` flags of a process of this PKI.
    fn flags(&self) -> [String; 6] {
        [
            "--tls-cert".into(),
            self.path("node.pem"),
            "--tls-key".into(),
            self.path("node.key"),
            "--tls-ca".into(),
            self.path("ca.pem"),
        ]
    }

    fn load(&self) -> tessera_proto::tls::MutualTls {
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            tls: tessera_proto::tls::TlsArgs,
        }
        let mut argv = vec!["t".to_string()];
        argv.extend(self.flags());
        T::parse_from(argv).tls.load().unwrap().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_between_router_and_workers_refuses_strangers() {
    let _workers = crate::workers_beside_others().await;
    let pki = Pki::new();
    let tls: Vec<String> = pki.flags().into_iter().collect();
    let tls: Vec<&str> = tls.iter().map(String::as_str).collect();
    let with_tls = |kv: &str| worker_args_with(kv, &tls);
    let (tx_d, stop_d) = stopper();
    let d = tessera_decode::start(with_tls("24M"), stop_d)
        .await
        .unwrap();
    let (tx_p, stop_p) = stopper();
    let p = tessera_prefill::start(with_tls("8M"), stop_p)
        .await
        .unwrap();
    let (decode, prefill) = (
        Worker {
            grpc: d.grpc.to_string(),
            stop: Some(tx_d),
            server: d.server,
        },
        Worker {
            grpc: p.grpc.to_string(),
            stop: Some(tx_p),
            server: p.server,
        },
    );
    // The router with the PKI's certificate: requests (router → both, prefill → decode) work.
    let b = ClusterBackend::new(ClusterConfig {
        model_id: "kl_mixed".into(),
        max_model_len: 4096,
        prefill: vec![prefill.grpc.clone()],
        decode: vec![decode.grpc.clone()],
        pool: PoolOptions {
            auth_secret: Some(SECRET.into()),
            tls: Some(pki.load()),
            ..PoolOptions::default()
        },
        reserve_ttl_ms: 0,
        encoder: vec![],
        image_token_id: None,
    })
    .unwrap();
    b.pool().probe_all().await;
    b.health().unwrap();
    for (i, (prompt, want)) in reference().iter().enumerate() {
        let o = generate(&b, greedy(&format!("tls{i}"), prompt, want.len())).await;
        assert_reference(&o, prompt, want, &format!("over mutual TLS, prompt {i}"));
    }
    // A health check gets through with the PKI's certificate; without TLS, or with a
    // certificate of another CA, not a single call does.
    use tessera_proto::health::pb::{health_client::HealthClient, HealthCheckRequest};
    let stranger = Pki::new();
    for (what, tls, ok) in [
        ("the cluster's certificate", Some(pki.load()), true),
        ("plain HTTP/2", None, false),
        ("another CA", Some(stranger.load()), false),
    ] {
        for addr in [&decode.grpc, &prefill.grpc] {
            let channel = tessera_proto::tls::endpoint(addr, tls.as_ref())
                .unwrap()
                .connect()
                .await;
            let answered = match channel {
                Err(_) => false,
                Ok(ch) => HealthClient::new(ch)
                    .check(HealthCheckRequest::default())
                    .await
                    .is_ok(),
            };
            assert_eq!(answered, ok, "{what}: a health check of {addr}");
        }
    }
    prefill.shut_down().await;
    decode.shut_down().await;
}

/// A worker of `role` with `--transport <transport>`.
async fn start_on(role: Role, transport: &str) -> Result<Worker, String> {
    common::start_on(SECRET, role, transport).await
}

#[cfg(not(feature = "ucx"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_ucx_without_the_feature_fails_at_start() {
    let _workers = crate::workers_beside_others().await;
    for role in [Role::Decode, Role::Prefill] {
        match start_on(role, "ucx").await {
            Ok(_) => panic!(
                "a {} worker started with --transport ucx without UCX",
                role.name()
            ),
            Err(e) => assert!(
                e.contains("built without UCX support: rebuild with --features ucx"),
                "{e}"
            ),
        }
    }
}

#[cfg(feature = "ucx")]
async fn worker_info(addr: &str, role: Role) -> v1::WorkerInfo {
    let req = v1::StatsRequest {};
    let stats = match role {
        Role::Decode => DecodeWorkerClient::new(authed(addr).await).stats(req).await,
        Role::Prefill => {
            PrefillWorkerClient::new(authed(addr).await)
                .stats(req)
                .await
        }
        Role::Encoder => unreachable!("only page-transfer workers here"),
    };
    stats.unwrap().into_inner().info.unwrap()
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_over_ucx_match_the_fixture_and_free_every_page() {
    let _workers = crate::workers_beside_others().await;
    let decode = start_on(Role::Decode, "ucx").await.unwrap();
    let prefill = start_on(Role::Prefill, "ucx").await.unwrap();
    for (w, role) in [(&decode, Role::Decode), (&prefill, Role::Prefill)] {
        let info = worker_info(&w.grpc, role).await;
        assert_eq!(info.transfer_backend(), v1::TransferBackend::Ucx);
        assert!(
            info.transfer_endpoint.starts_with("ucx://"),
            "{}",
            info.transfer_endpoint
        );
    }
    let b = backend(&[&prefill], &[&decode]).await;
    let workers = [(&prefill, Role::Prefill), (&decode, Role::Decode)];
    // The second round hits prefill's prefix cache and reuses its source regions.
    for round in 0..2 {
        for (i, (prompt, want)) in reference().iter().enumerate() {
            let o = generate(&b, greedy(&format!("ucx-{round}-{i}"), prompt, want.len())).await;
            assert_reference(
                &o,
                prompt,
                want,
                &format!("over ucx, round {round}, prompt {i}"),
            );
        }
        wait_baseline(&workers, &b, &format!("after ucx round {round}")).await;
    }
    prefill.shut_down().await;
    decode.shut_down().await;
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_prefill_and_a_ucx_decode_fail_the_handshake_with_a_mismatch() {
    let _workers = crate::workers_beside_others().await;
    let decode = start_on(Role::Decode, "ucx").await.unwrap();
    let prefill = start_on(Role::Prefill, "tcp").await.unwrap();
    let b = backend(&[&prefill], &[&decode]).await;
    let mut d = DecodeWorkerClient::new(authed(&decode.grpc).await);
    let mut p = PrefillWorkerClient::new(authed(&prefill.grpc).await);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 % 300) as u32 + 5).collect();
    let r = d
        .reserve_pages(v1::ReserveRequest {
            request_id: "mixed".into(),
            prompt_token_ids: prompt.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let call = p.prefill(v1::PrefillRequest {
        request_id: "mixed".into(),
        prompt_token_ids: prompt,
        destination: Some(v1::KvDestination {
            decode_grpc_address: decode.grpc.clone(),
            decode_incarnation_id: r.incarnation_id,
            reservation_id: r.reservation_id.clone(),
            mla_page_ids: r.mla_page_ids.clone(),
            kda_state_page_ids: r.kda_state_page_ids.clone(),
            ..Default::default()
        }),
        ..Default::default()
    });
    let status = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("the mismatch is reported, not waited on")
        .expect_err("a tcp prefill cannot write into a ucx decode worker");
    let detail = v1::ErrorDetail::from_status(&status).expect("an ErrorDetail");
    assert_eq!(detail.code(), v1::ErrorCode::LayoutMismatch, "{status:?}");
    assert!(
        detail.message.contains("transport mismatch")
            && detail.message.contains("ucx")
            && detail.message.contains("tcp"),
        "{}",
        detail.message
    );
    d.release_reservation(v1::ReleaseReservationRequest {
        request_id: "mixed".into(),
        reservation_id: r.reservation_id,
        ..Default::default()
    })
    .await
    .unwrap();
    wait_baseline(
        &[(&prefill, Role::Prefill), (&decode, Role::Decode)],
        &b,
        "after the refused handshake",
    )
    .await;
    prefill.shut_down().await;
    decode.shut_down().await;
}
