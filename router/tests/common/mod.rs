//! In-process prefill and decode workers on the `kl_mixed` fixture, and the fixture's reference,
//! for the router's cluster tests.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tessera_prefill::runtime::WorkerArgs;
use tessera_router::cluster::Role;
use tessera_router::{ClusterConfig, GenerationRequest, PoolOptions, Sampling};
use tokio::sync::oneshot;

pub fn fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/kl_mixed"
    ))
}

/// (prompt ids, greedy ids) of the fixture's reference.
pub fn reference() -> Vec<(Vec<u32>, Vec<u32>)> {
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

/// Worker flags for the fixture with `--kv-memory kv`, the cluster `secret`, plus `extra`.
pub fn worker_args(secret: &str, kv: &str, extra: &[&str]) -> WorkerArgs {
    let model = fixture();
    let mut argv = vec![
        "t",
        "--model",
        model.to_str().unwrap(),
        "--kv-memory",
        kv,
        "--auth-secret",
        secret,
    ];
    argv.extend_from_slice(extra);
    WorkerArgs::try_parse_from(argv).unwrap()
}

/// A worker started in-process, with a handle to stop it.
pub struct Worker {
    pub grpc: String,
    pub stop: Option<oneshot::Sender<()>>,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Worker {
    pub async fn shut_down(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = tokio::time::timeout(Duration::from_secs(20), self.server).await;
    }
}

pub fn stopper() -> (
    oneshot::Sender<()>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

/// A worker of `role` (decode: 24M of pages, prefill: 8M) with `--transport <transport>`.
pub async fn start_on(secret: &str, role: Role, transport: &str) -> Result<Worker, String> {
    let (tx, stop) = stopper();
    let flags = ["--transport", transport];
    let (grpc, server) = match role {
        Role::Decode => tessera_decode::start(worker_args(secret, "24M", &flags), stop)
            .await
            .map(|d| (d.grpc, d.server)),
        Role::Prefill => tessera_prefill::start(worker_args(secret, "8M", &flags), stop)
            .await
            .map(|p| (p.grpc, p.server)),
        Role::Encoder => unreachable!("only page-transfer workers here"),
    }
    .map_err(|e| format!("{e:#}"))?;
    Ok(Worker {
        grpc: grpc.to_string(),
        stop: Some(tx),
        server,
    })
}

/// A router's cluster configuration for the fixture: these prefill and decode workers' gRPC
/// addresses, the shared `secret`, health probes every 300 ms and decode reservations that last
/// `reserve_ttl_ms` (0: the default).
pub fn cluster_config(
    secret: &str,
    prefill: &[&Worker],
    decode: &[&Worker],
    reserve_ttl_ms: u32,
) -> ClusterConfig {
    ClusterConfig {
        model_id: "kl_mixed".into(),
        max_model_len: 4096,
        prefill: prefill.iter().map(|w| w.grpc.clone()).collect(),
        decode: decode.iter().map(|w| w.grpc.clone()).collect(),
        pool: PoolOptions {
            auth_secret: Some(secret.into()),
            health_interval: Duration::from_millis(300),
            ..PoolOptions::default()
        },
        reserve_ttl_ms,
        encoder: vec![],
        image_token_id: None,
    }
}

/// A greedy request for `max_tokens` tokens after `prompt`, end-of-sequence ignored.
pub fn greedy(id: &str, prompt: &[u32], max_tokens: usize) -> GenerationRequest {
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
        logprobs: None,
    }
}
