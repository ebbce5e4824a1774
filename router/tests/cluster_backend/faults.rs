//! Faults between the hops: a transfer past its deadline, a decode worker failing mid-stream,
//! strangers refused by mutual TLS.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tessera_prefill::runtime::TestHooks;
use tessera_proto::v1;
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tessera_router::cluster::Role;
use tessera_router::{ClusterBackend, GenerationBackend, GenerationRequest, Sampling};

use crate::common::{greedy, reference, stopper, Worker};

use super::common::*;

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
                transfer_timeout_ms: 300,
                ..destination(&decode, &r)
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
    // Penalties and a bias too: the new decode worker counts the streamed tokens it resumes
    // from as completion tokens, as the first worker did.
    let sampled = |id: &str, prompt: &[u32], n: usize| GenerationRequest {
        sampling: Sampling {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(1234),
            presence_penalty: 0.8,
            frequency_penalty: 0.6,
            logit_bias: vec![(prompt[2], 2.0)],
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
    let mut config = crate::common::cluster_config(SECRET, &[&prefill], &[&decode], 0);
    config.pool.tls = Some(pki.load());
    let b = ClusterBackend::new(config).unwrap();
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
