//! Pairing by page transport, against real workers: the router never sends a request to a
//! prefill and a decode worker that move pages over different transports (`--transport tcp` and
//! `--transport ucx`), and says so when no pair is left.
#![cfg(feature = "ucx")]

use std::time::Duration;

use tessera_router::cluster::Role;
use tessera_router::{
    BackendError, ClusterBackend, GenerationBackend, GenerationRequest, TokenEvent,
};

use crate::common::{self, Worker};

const SECRET: &str = "router-pairing-test";

async fn start_on(role: Role, transport: &str) -> Worker {
    common::start_on(SECRET, role, transport).await.unwrap()
}

async fn backend(prefill: &[&Worker], decode: &[&Worker]) -> ClusterBackend {
    let b = ClusterBackend::new(common::cluster_config(SECRET, prefill, decode, 0)).unwrap();
    // The first probe learns every worker's transport from its `Stats`.
    b.pool().probe_all().await;
    b
}

fn request(id: &str) -> GenerationRequest {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 13 % 300) as u32 + 5).collect();
    common::greedy(id, &prompt, 4)
}

/// The tokens of a request, or its error.
async fn run(b: &ClusterBackend, id: &str) -> Result<Vec<u32>, BackendError> {
    let mut rx = b.submit(request(id)).unwrap();
    let mut tokens = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("an event within 60 s")
    {
        match e {
            TokenEvent::Token(t) => tokens.push(t),
            TokenEvent::Failed(e) => return Err(e),
            _ => {}
        }
    }
    Ok(tokens)
}

/// Requests the router sent to `addr`, from its metrics.
fn routed_to(b: &ClusterBackend, role: Role, addr: &str) -> u64 {
    let key = format!(
        "tessera_router_worker_requests_total{{role=\"{}\",worker=\"{addr}\"}} ",
        role.name()
    );
    b.pool()
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in the router's metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_of_another_transport_get_no_requests_and_a_lone_one_gets_a_clear_error() {
    let _workers = crate::workers_alone().await;
    let p_tcp = start_on(Role::Prefill, "tcp").await;
    let p_ucx = start_on(Role::Prefill, "ucx").await;
    let d_tcp = start_on(Role::Decode, "tcp").await;
    let d_ucx = start_on(Role::Decode, "ucx").await;

    // Decode picked first: both decode workers are healthy and idle, only the tcp one may take
    // the tcp prefill worker's pages.
    let b = backend(&[&p_tcp], &[&d_tcp, &d_ucx]).await;
    let mut want = Vec::new();
    for i in 0..4 {
        let tokens = run(&b, &format!("tcp-{i}")).await.expect("a tcp pair");
        assert_eq!(tokens.len(), 4);
        want = tokens;
    }
    assert_eq!(routed_to(&b, Role::Decode, &d_tcp.grpc), 4);
    assert_eq!(routed_to(&b, Role::Decode, &d_ucx.grpc), 0);
    drop(b);

    // Prefill picked for the decode worker: only the ucx prefill worker, and the pages cross
    // over ucx to the same tokens.
    let b = backend(&[&p_tcp, &p_ucx], &[&d_ucx]).await;
    for i in 0..4 {
        let tokens = run(&b, &format!("ucx-{i}")).await.expect("a ucx pair");
        assert_eq!(tokens, want, "the same greedy tokens over ucx");
    }
    assert_eq!(routed_to(&b, Role::Prefill, &p_ucx.grpc), 4);
    assert_eq!(routed_to(&b, Role::Prefill, &p_tcp.grpc), 0);
    drop(b);

    // A ucx decode worker alone with a tcp prefill worker: the request fails at once, naming
    // both transports, and the decode worker never saw it.
    let b = backend(&[&p_tcp], &[&d_ucx]).await;
    let e = run(&b, "lonely").await.expect_err("no pair");
    let msg = e.to_string();
    assert!(matches!(e, BackendError::Unavailable(_)), "{e:?}");
    assert!(
        msg.contains("no decode worker speaks the page transport of a prefill worker")
            && msg.contains(&format!("{} (tcp)", p_tcp.grpc))
            && msg.contains(&format!("{} (ucx)", d_ucx.grpc))
            && msg.contains("--transport"),
        "{msg}"
    );
    assert_eq!(routed_to(&b, Role::Decode, &d_ucx.grpc), 0);
    drop(b);

    for w in [p_tcp, p_ucx, d_tcp, d_ucx] {
        w.shut_down().await;
    }
}
