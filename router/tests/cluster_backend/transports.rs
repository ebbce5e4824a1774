//! The page transport each worker runs: UCX without the feature refused at start, workers over
//! UCX equal to the fixture, a mixed pair refused at the handshake.

#[cfg(feature = "ucx")]
use std::time::Duration;

#[cfg(feature = "ucx")]
use tessera_proto::v1;
#[cfg(feature = "ucx")]
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
#[cfg(feature = "ucx")]
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tessera_router::cluster::Role;

#[cfg(feature = "ucx")]
use crate::common::reference;
use crate::common::{self, Worker};

use super::common::*;

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
            let o = generate(
                &b,
                common::greedy(&format!("ucx-{round}-{i}"), prompt, want.len()),
            )
            .await;
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
        destination: Some(destination(&decode, &r)),
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
