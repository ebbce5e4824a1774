//! Requests through prefill and decode workers: greedy tokens equal to the fixture over the
//! backend and HTTP, load spread over two by two workers, a dead prefill worker survived.

use std::time::Duration;

use clap::Parser;
use serde_json::Value;
use tessera_proto::v1;
use tessera_router::cluster::Role;
use tessera_router::{BackendError, FinishReason, GenerationBackend, TokenEvent};

use crate::common::{greedy, reference, stopper};

use super::common::*;

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

    // Log-probabilities: the first token's from prefill, the rest from decode, one per token
    // and in step with it; greedy tokens are their steps' likeliest.
    let (prompt, want) = &reference()[0];
    let mut r = greedy("lp", prompt, want.len());
    r.logprobs = Some(3);
    let o = generate(&b, r).await;
    assert_reference(&o, prompt, want, "with logprobs");
    assert_eq!(o.logprobs.len(), o.tokens.len());
    for (lp, &t) in o.logprobs.iter().zip(&o.tokens) {
        assert_eq!(lp.token, t);
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0], (t, lp.logprob));
        assert!(lp.logprob <= 0.0 && lp.top[1].1 <= lp.top[0].1);
    }
    wait_baseline(&workers, &b, "after logprobs").await;

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
