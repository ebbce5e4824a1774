//! What the cluster backend's tests share: in-process workers, backends over them, requests
//! and page counts.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_prefill::runtime::{ClusterToken, TestHooks, WorkerArgs};
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tessera_router::cluster::Role;
use tessera_router::{
    BackendError, ClusterBackend, FinishReason, GenerationBackend, GenerationRequest, TokenEvent,
    TokenLogprobs, Usage,
};
use tokio::sync::mpsc;

use crate::common::{self, fixture, stopper, Worker};
pub(super) const SECRET: &str = "router-cluster-test";

pub(super) fn worker_args(kv: &str) -> WorkerArgs {
    worker_args_with(kv, &[])
}

/// [`worker_args`] plus `extra` flags.
pub(super) fn worker_args_with(kv: &str, extra: &[&str]) -> WorkerArgs {
    common::worker_args(SECRET, kv, extra)
}

pub(super) async fn start_decode() -> Worker {
    start_decode_with(Default::default()).await
}

/// A decode worker whose test hooks (its transport's faults) the caller holds.
pub(super) async fn start_decode_with(hooks: Arc<TestHooks>) -> Worker {
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

pub(super) async fn start_prefill() -> Worker {
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

pub(super) async fn backend(prefill: &[&Worker], decode: &[&Worker]) -> Arc<ClusterBackend> {
    backend_with_ttl(prefill, decode, 0).await
}

/// A backend whose decode reservations (and so page transfers) last `reserve_ttl_ms`.
pub(super) async fn backend_with_ttl(
    prefill: &[&Worker],
    decode: &[&Worker],
    reserve_ttl_ms: u32,
) -> Arc<ClusterBackend> {
    let config = common::cluster_config(SECRET, prefill, decode, reserve_ttl_ms);
    let b = ClusterBackend::new(config).unwrap();
    b.pool().probe_all().await;
    b.health().unwrap();
    Arc::new(b)
}

/// Where a prefill worker writes the pages of reservation `r` on `decode`.
pub(super) fn destination(decode: &Worker, r: &v1::ReserveReply) -> v1::KvDestination {
    v1::KvDestination::for_reservation(decode.grpc.clone(), r)
}

pub(super) struct Outcome {
    pub(super) tokens: Vec<u32>,
    /// The log-probabilities sent before tokens, in order.
    pub(super) logprobs: Vec<TokenLogprobs>,
    pub(super) finish: Option<(FinishReason, Usage)>,
    pub(super) error: Option<BackendError>,
    pub(super) prefilled: bool,
}

pub(super) async fn collect(mut rx: mpsc::Receiver<TokenEvent>) -> Outcome {
    let mut o = Outcome {
        tokens: vec![],
        logprobs: vec![],
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
            TokenEvent::Logprobs(lp) => o.logprobs.push(lp),
            TokenEvent::Finished { reason, usage } => o.finish = Some((reason, usage)),
            TokenEvent::Failed(e) => o.error = Some(e),
        }
    }
    o
}

pub(super) async fn generate(b: &ClusterBackend, req: GenerationRequest) -> Outcome {
    collect(b.submit(req).unwrap()).await
}

pub(super) fn assert_reference(o: &Outcome, prompt: &[u32], want: &[u32], what: &str) {
    assert!(o.error.is_none(), "{what}: {:?}", o.error);
    assert!(o.prefilled, "{what}: Prefilled sent");
    assert_eq!(o.tokens, want, "{what}: greedy tokens equal the fixture");
    let (reason, usage) = o.finish.expect("finished");
    assert_eq!(reason, FinishReason::Length, "{what}");
    assert_eq!(usage.prompt_tokens, prompt.len(), "{what}");
    assert_eq!(usage.completion_tokens, want.len(), "{what}");
}

pub(super) type Authed = InterceptedService<Channel, ClusterToken>;

pub(super) async fn authed(addr: &str) -> Authed {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    InterceptedService::new(channel, ClusterToken::new(SECRET).unwrap())
}

/// Pages held by requests and reservations (not the prefix cache) on a worker, from `Stats`.
pub(super) async fn live_pages(addr: &str, role: Role) -> u64 {
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

pub(super) async fn wait_baseline(workers: &[(&Worker, Role)], b: &ClusterBackend, what: &str) {
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
pub(super) fn model_dir_with_tokenizer() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
    }
    tessera_tokenizer::write_tiny_tokenizer(dir.path(), 384).unwrap();
    dir
}

/// One HTTP/1.0 POST (close-delimited body, so SSE needs no chunked decoding); returns the body.
pub(super) fn http_post(addr: std::net::SocketAddr, path: &str, body: &Value) -> (u16, String) {
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
