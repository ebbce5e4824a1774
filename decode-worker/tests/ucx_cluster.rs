//! The worker daemons over the UCX page transport (`--transport ucx`, cargo feature `ucx`): a
//! decode and a prefill worker in-process, requests through the router's cluster backend. Greedy
//! tokens must equal the `transformers` fixture and both pools must return to baseline; a
//! prefill worker on TCP must be refused by a decode worker on UCX with LAYOUT_MISMATCH naming
//! the transports. Without the feature, `--transport ucx` must fail at start with a clear
//! message.

use std::path::PathBuf;

use clap::Parser;
use tessera_prefill::runtime::WorkerArgs;

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

const SECRET: &str = "ucx-cluster-test";

fn worker_args(kv: &str, transport: &str) -> WorkerArgs {
    A::parse_from([
        "t",
        "--model",
        fixture().to_str().unwrap(),
        "--kv-memory",
        kv,
        "--auth-secret",
        SECRET,
        "--transport",
        transport,
    ])
    .w
}

#[cfg(not(feature = "ucx"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_ucx_without_the_feature_fails_at_start() {
    let e = match tessera_decode::start(worker_args("8M", "ucx"), std::future::pending()).await {
        Ok(_) => panic!("a decode worker started with --transport ucx in a build without UCX"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("built without UCX support: rebuild with --features ucx"),
        "{e}"
    );
    let e = match tessera_prefill::start(worker_args("8M", "ucx"), std::future::pending()).await {
        Ok(_) => panic!("a prefill worker started with --transport ucx in a build without UCX"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("rebuild with --features ucx"), "{e}");
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use serde_json::Value;
    use tessera_prefill::runtime::ClusterToken;
    use tessera_proto::tonic::service::interceptor::InterceptedService;
    use tessera_proto::tonic::transport::Channel;
    use tessera_proto::v1;
    use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
    use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
    use tessera_router::cluster::Role;
    use tessera_router::{
        ClusterBackend, ClusterConfig, FinishReason, GenerationBackend, GenerationRequest,
        PoolOptions, Sampling, TokenEvent,
    };
    use tokio::sync::oneshot;

    use super::{fixture, worker_args, SECRET};

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

    struct Worker {
        grpc: String,
        stop: Option<oneshot::Sender<()>>,
        server: tokio::task::JoinHandle<anyhow::Result<()>>,
    }

    impl Worker {
        async fn shut_down(mut self) {
            let _ = self.stop.take().unwrap().send(());
            let _ = tokio::time::timeout(Duration::from_secs(20), self.server).await;
        }
    }

    async fn start(role: Role, transport: &str) -> Worker {
        let (tx, rx) = oneshot::channel::<()>();
        let stop = async move {
            let _ = rx.await;
        };
        let (grpc, server) = match role {
            Role::Decode => {
                let d = tessera_decode::start(worker_args("24M", transport), stop)
                    .await
                    .unwrap();
                (d.grpc, d.server)
            }
            Role::Prefill => {
                let p = tessera_prefill::start(worker_args("8M", transport), stop)
                    .await
                    .unwrap();
                (p.grpc, p.server)
            }
        };
        Worker {
            grpc: grpc.to_string(),
            stop: Some(tx),
            server,
        }
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

    async fn stats(addr: &str, role: Role) -> v1::WorkerStats {
        match role {
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
        }
    }

    /// Pages held by requests and reservations (not the prefix cache), from `Stats`.
    async fn live_pages(addr: &str, role: Role) -> u64 {
        let p = stats(addr, role).await.pool.unwrap();
        p.groups.iter().map(|g| g.live_pages).sum::<u64>() - p.cached_pages + p.reserved_pages
    }

    async fn wait_baseline(workers: &[(&Worker, Role)], what: &str) {
        let t = Instant::now();
        loop {
            let mut live = vec![];
            for (w, role) in workers {
                live.push(live_pages(&w.grpc, *role).await);
            }
            if live.iter().all(|&n| n == 0) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}: pages leaked {live:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn backend(prefill: &Worker, decode: &Worker) -> Arc<ClusterBackend> {
        let b = ClusterBackend::new(ClusterConfig {
            model_id: "kl_mixed".into(),
            max_model_len: 4096,
            prefill: vec![prefill.grpc.clone()],
            decode: vec![decode.grpc.clone()],
            pool: PoolOptions {
                auth_secret: Some(SECRET.into()),
                health_interval: Duration::from_millis(300),
                ..PoolOptions::default()
            },
            reserve_ttl_ms: 0,
        })
        .unwrap();
        b.pool().probe_all().await;
        b.health().unwrap();
        Arc::new(b)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn workers_over_ucx_match_the_fixture_and_free_every_page() {
        let decode = start(Role::Decode, "ucx").await;
        let prefill = start(Role::Prefill, "ucx").await;
        for (w, role) in [(&decode, Role::Decode), (&prefill, Role::Prefill)] {
            let info = stats(&w.grpc, role).await.info.unwrap();
            assert_eq!(info.transfer_backend(), v1::TransferBackend::Ucx);
            assert!(
                info.transfer_endpoint.starts_with("ucx://"),
                "{}",
                info.transfer_endpoint
            );
        }
        let b = backend(&prefill, &decode).await;
        let workers = [(&prefill, Role::Prefill), (&decode, Role::Decode)];

        for round in 0..2 {
            // The second round hits prefill's prefix cache and reuses its source regions.
            for (i, (prompt, want)) in reference().iter().enumerate() {
                let what = format!("round {round}, prompt {i}");
                let mut rx = b
                    .submit(GenerationRequest {
                        request_id: format!("ucx-{round}-{i}"),
                        prompt_ids: prompt.clone(),
                        max_tokens: want.len(),
                        sampling: Sampling {
                            temperature: 0.0,
                            ..Sampling::default()
                        },
                        stop_token_ids: vec![],
                        ignore_eos: true,
                    })
                    .unwrap();
                let (mut tokens, mut finish, mut failed) = (vec![], None, None);
                while let Some(e) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                    .await
                    .expect("an event within 60 s")
                {
                    match e {
                        TokenEvent::Token(t) => tokens.push(t),
                        TokenEvent::Finished { reason, usage } => finish = Some((reason, usage)),
                        TokenEvent::Failed(e) => failed = Some(e),
                        TokenEvent::Prefilled { .. } => {}
                    }
                }
                assert!(failed.is_none(), "{what}: {failed:?}");
                assert_eq!(&tokens, want, "{what}: greedy tokens equal the fixture");
                let (reason, usage) = finish.expect("finished");
                assert_eq!(reason, FinishReason::Length, "{what}");
                assert_eq!(usage.completion_tokens, want.len(), "{what}");
            }
            wait_baseline(&workers, &format!("after round {round}")).await;
        }
        drop(b);
        prefill.shut_down().await;
        decode.shut_down().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tcp_prefill_and_a_ucx_decode_fail_the_handshake_with_a_mismatch() {
        let decode = start(Role::Decode, "ucx").await;
        let prefill = start(Role::Prefill, "tcp").await;
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
            "after the refused handshake",
        )
        .await;
        prefill.shut_down().await;
        decode.shut_down().await;
    }
}
