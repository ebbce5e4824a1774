//! The public gRPC `tessera.v1.Generate` service over the fake backend, through a generated
//! client on loopback: the same tokens and text as the HTTP front, usage, error codes,
//! cancellation, `ListModels` and `grpc.health.v1`, API keys and the rate limit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request as HttpRequest};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tessera_proto::health::pb::health_check_response::ServingStatus;
use tessera_proto::health::pb::health_client::HealthClient;
use tessera_proto::health::pb::HealthCheckRequest;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::tonic::Code;
use tessera_proto::v1::generate_client::GenerateClient;
use tessera_proto::v1::generate_request::Prompt;
use tessera_proto::v1::{
    FinishReason, GenerateRequest, GenerateResponse, ListModelsRequest, LogitBias, SamplingParams,
    TokenIds,
};
use tessera_router::fake::{FakeBackend, FakeConfig};
use tessera_router::{ApiKeys, BackendError, FrontOptions, HttpFront, RateLimit};
use tessera_tokenizer::{ChatTemplate, Tokenizer};
use tower::ServiceExt;

const VOCAB: usize = 1024;

struct Harness {
    _dir: tempfile::TempDir,
    fake: Arc<FakeBackend>,
    http: Router,
    tok: Tokenizer,
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Harness {
    async fn start(config: FakeConfig) -> Harness {
        Self::start_with(config, FrontOptions::default()).await
    }

    async fn start_with(config: FakeConfig, opts: FrontOptions) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        tessera_tokenizer::write_tiny_tokenizer(dir.path(), VOCAB).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let special = tessera_tokenizer::tiny_special_ids(VOCAB);
        let fake = Arc::new(FakeBackend::new(config));
        let front = HttpFront::new(
            fake.clone(),
            tok.clone(),
            ChatTemplate::from_dir(dir.path()).unwrap(),
            special.stop_ids(),
            opts,
        );
        let grpc = front.grpc();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            grpc.serve(listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Harness {
            _dir: dir,
            fake,
            http: front.router(),
            tok,
            addr,
            stop: Some(tx),
            server,
        }
    }

    async fn client(&self) -> GenerateClient<Channel> {
        GenerateClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    async fn http_post(&self, body: &Value) -> Value {
        let req = HttpRequest::builder()
            .method(Method::POST)
            .uri("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = self.http.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), self.server)
            .await
            .expect("the gRPC server stops")
            .unwrap();
    }
}

fn fake_config() -> FakeConfig {
    FakeConfig {
        token_modulus: 128,
        cached_tokens: 3,
        ..FakeConfig::default()
    }
}

fn text_request(prompt: &str, max_tokens: u32, stream: bool) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(Prompt::Text(prompt.into())),
        max_tokens,
        stream,
        sampling: Some(SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    }
}

async fn generate(
    client: &mut GenerateClient<Channel>,
    req: GenerateRequest,
) -> Result<Vec<GenerateResponse>, tessera_proto::tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(r) = stream.message().await? {
        out.push(r);
    }
    Ok(out)
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_output_equals_the_http_front() {
    let h = Harness::start(fake_config()).await;
    let mut client = h.client().await;
    let prompt = "The keeper climbed the stairs";
    // A stop string from the middle of the unstopped output.
    let plain = h
        .http_post(&json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}))
        .await;
    let plain = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let cut = plain.char_indices().map(|(i, _)| i).nth(8).unwrap();
    let stop_str: String = plain[cut..].chars().take(2).collect();
    let with_stop = Some(stop_str.as_str());
    for (stop, stream) in [
        (None, true),
        (None, false),
        (with_stop, true),
        (with_stop, false),
    ] {
        let mut req = text_request(prompt, 24, stream);
        let mut body = json!({
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": true,
        });
        if let Some(s) = stop {
            req.stop = vec![s.into()];
            body["stop"] = json!(s);
        }
        let http = h.http_post(&body).await;
        let want_text = http["choices"][0]["text"].as_str().unwrap().to_string();
        let want_ids = ids_of(&http["choices"][0]["token_ids"]);
        let want_finish = http["choices"][0]["finish_reason"].as_str().unwrap();

        let out = generate(&mut client, req).await.unwrap();
        let what = format!("stop {stop:?}, stream {stream}");
        if stream {
            assert!(out.len() > 1, "{what}: several responses");
        } else {
            assert_eq!(out.len(), 1, "{what}: one response");
        }
        let (last, rest) = out.split_last().unwrap();
        for r in rest {
            assert_eq!(r.finish_reason(), FinishReason::Unspecified, "{what}");
            assert!(r.usage.is_none(), "{what}");
        }
        let text: String = out.iter().map(|r| r.text.as_str()).collect();
        let ids: Vec<u32> = out.iter().flat_map(|r| r.token_ids.clone()).collect();
        assert_eq!(text, want_text, "{what}");
        assert_eq!(ids, want_ids, "{what}");
        let finish = match last.finish_reason() {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            other => panic!("{what}: {other:?}"),
        };
        assert_eq!(finish, want_finish, "{what}");
        let usage = last.usage.expect("usage on the last response");
        assert_eq!(
            usage.prompt_tokens as u64,
            http["usage"]["prompt_tokens"].as_u64().unwrap()
        );
        assert_eq!(
            usage.completion_tokens as u64,
            http["usage"]["completion_tokens"].as_u64().unwrap()
        );
        assert_eq!(usage.cached_tokens, 3, "{what}");
        assert!(out
            .iter()
            .all(|r| r.model == "fake-model" && !r.request_id.is_empty()));
        if stop.is_some() {
            assert_eq!(finish, "stop", "{what}: the stop string ends it");
        }
    }
    // The HTTP and gRPC requests reached the backend identically.
    let subs = &h.fake.submitted()[1..];
    assert_eq!(subs[0].prompt_ids, subs[1].prompt_ids);
    assert_eq!(subs[0].max_tokens, subs[1].max_tokens);
    assert_eq!(subs[0].sampling, subs[1].sampling);
    assert_eq!(subs[0].stop_token_ids, subs[1].stop_token_ids);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_prompts_sampling_and_request_fields_reach_the_backend() {
    let h = Harness::start(fake_config()).await;
    let mut client = h.client().await;
    let req = GenerateRequest {
        model: "fake-model".into(),
        prompt: Some(Prompt::TokenIds(TokenIds {
            ids: vec![10, 11, 12, 13],
        })),
        sampling: Some(SamplingParams {
            temperature: 0.7,
            top_p: Some(0.9),
            top_k: 40,
            seed: Some(u64::MAX - 1),
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![LogitBias {
                token_id: 3,
                bias: 2.5,
            }],
        }),
        max_tokens: 5,
        stop_token_ids: vec![7],
        ignore_eos: true,
        stream: true,
        skip_text: true,
        request_id: "client-id-1".into(),
        ..GenerateRequest::default()
    };
    let out = generate(&mut client, req).await.unwrap();
    let ids: Vec<u32> = out.iter().flat_map(|r| r.token_ids.clone()).collect();
    assert_eq!(
        ids,
        vec![4, 5, 6, 7],
        "stops after stop token 7, which is included"
    );
    assert_eq!(out.last().unwrap().finish_reason(), FinishReason::Stop);
    assert!(out
        .iter()
        .all(|r| r.text.is_empty() && r.request_id == "client-id-1"));
    let sub = h.fake.submitted().pop().unwrap();
    assert_eq!(sub.request_id, "client-id-1");
    assert_eq!(sub.prompt_ids, vec![10, 11, 12, 13]);
    assert_eq!(sub.max_tokens, 5);
    assert!(sub.ignore_eos);
    assert_eq!(
        sub.stop_token_ids,
        vec![7],
        "ignore_eos leaves the EOS ids out"
    );
    assert_eq!(sub.sampling.temperature, 0.7);
    assert_eq!(sub.sampling.top_p, 0.9);
    assert_eq!(sub.sampling.top_k, 40);
    assert_eq!(sub.sampling.seed, Some(u64::MAX - 1));
    assert_eq!(sub.sampling.presence_penalty, 0.5);
    assert_eq!(sub.sampling.frequency_penalty, 0.25);
    assert_eq!(sub.sampling.logit_bias, vec![(3, 2.5)]);
    // Default max_tokens (0) is the router's completion default, text prompts are tokenized as
    // /v1/completions does.
    let out = generate(&mut client, text_request("hello", 0, false))
        .await
        .unwrap();
    let sub = h.fake.submitted().pop().unwrap();
    assert_eq!(sub.max_tokens, 16);
    assert_eq!(sub.prompt_ids, h.tok.encode("hello", true).unwrap());
    assert_eq!(out[0].usage.unwrap().completion_tokens, 16);
    // Log-probabilities, one per token, streamed and whole alike: the fake's -(i + 1) / 8 and
    // alternatives a nat apart.
    for stream in [true, false] {
        let req = GenerateRequest {
            logprobs: Some(2),
            ..text_request("hello", 3, stream)
        };
        let out = generate(&mut client, req).await.unwrap();
        let ids: Vec<u32> = out.iter().flat_map(|r| r.token_ids.clone()).collect();
        let lps: Vec<_> = out.iter().flat_map(|r| r.logprobs.clone()).collect();
        assert_eq!(lps.len(), 3, "stream {stream}");
        for (i, (lp, &id)) in lps.iter().zip(&ids).enumerate() {
            assert_eq!(lp.token_id, id);
            assert_eq!(lp.logprob, -((i + 1) as f32) / 8.0);
            assert_eq!(lp.top_ids, vec![id, (id + 1) % 128]);
            assert_eq!(lp.top_logprobs, vec![lp.logprob, lp.logprob - 1.0]);
        }
        assert_eq!(h.fake.submitted().pop().unwrap().logprobs, Some(2));
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_map_to_grpc_codes() {
    let h = Harness::start(fake_config()).await;
    let mut client = h.client().await;
    let base = text_request("hello", 4, true);
    let cases: Vec<(GenerateRequest, Code)> = vec![
        (
            GenerateRequest {
                model: "nope".into(),
                ..base.clone()
            },
            Code::NotFound,
        ),
        (
            GenerateRequest {
                prompt: None,
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                prompt: Some(Prompt::Text(String::new())),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                prompt: Some(Prompt::TokenIds(TokenIds { ids: vec![] })),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                prompt: Some(Prompt::TokenIds(TokenIds {
                    ids: vec![1, VOCAB as u32],
                })),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    temperature: 3.0,
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    top_p: Some(0.0),
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    frequency_penalty: 2.5,
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                logprobs: Some(21),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    logit_bias: vec![LogitBias {
                        token_id: 1 << 20,
                        bias: 1.0,
                    }],
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                stop_token_ids: vec![VOCAB as u32 + 5],
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                max_tokens: 100_000,
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    temperature: f32::NAN,
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                sampling: Some(SamplingParams {
                    top_p: Some(-0.5),
                    ..SamplingParams::default()
                }),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
        (
            GenerateRequest {
                stop: (0..17).map(|i| format!("s{i}")).collect(),
                ..base.clone()
            },
            Code::InvalidArgument,
        ),
    ];
    for (req, code) in cases {
        let e = generate(&mut client, req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
    }
    assert!(
        h.fake.submitted().is_empty(),
        "nothing invalid reached the backend"
    );
    // Backend refusals.
    for (err, code) in [
        (
            BackendError::Overloaded("busy".into()),
            Code::ResourceExhausted,
        ),
        (BackendError::Unavailable("down".into()), Code::Unavailable),
        (BackendError::Internal("bug".into()), Code::Internal),
    ] {
        h.fake.set_reject(Some(err));
        let e = generate(&mut client, base.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
    }
    h.fake.set_reject(None);
    // A failure after output started ends the stream with INTERNAL.
    h.fake.set_fail_after(Some(2));
    let mut stream = client
        .generate(text_request("hello", 8, true))
        .await
        .unwrap()
        .into_inner();
    let mut got = 0;
    let err = loop {
        match stream.message().await {
            Ok(Some(_)) => got += 1,
            Ok(None) => panic!("the stream ended without the error"),
            Err(e) => break e,
        }
    };
    assert!(got >= 1);
    assert_eq!(err.code(), Code::Internal);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_cancels_the_backend_request() {
    let h = Harness::start(FakeConfig {
        token_delay: Duration::from_millis(20),
        ..fake_config()
    })
    .await;
    let mut client = h.client().await;
    let mut stream = client
        .generate(text_request("hello", 2000, true))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        assert!(stream.message().await.unwrap().is_some());
    }
    drop(stream);
    for _ in 0..500 {
        if h.fake.cancelled() >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.fake.cancelled(), 1, "the backend saw the cancellation");
    assert_eq!(h.fake.finished(), 0);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_models_and_health() {
    let h = Harness::start(fake_config()).await;
    let mut client = h.client().await;
    let models = client
        .list_models(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].id, "fake-model");
    assert_eq!(models[0].max_context_tokens, 4096);
    assert_eq!(models[0].owned_by, "tessera");
    assert!(models[0].created > 0);
    let channel = Channel::from_shared(format!("http://{}", h.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "tessera.v1.Generate"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{service:?}");
    }
    h.stop().await;
}

/// `Generate` with `(name, value)` metadata.
async fn generate_with(
    client: &mut GenerateClient<Channel>,
    metadata: &[(&'static str, &str)],
    req: GenerateRequest,
) -> Result<Vec<GenerateResponse>, tessera_proto::tonic::Status> {
    let mut r = tessera_proto::tonic::Request::new(req);
    for (k, v) in metadata {
        r.metadata_mut().insert(*k, v.parse().unwrap());
    }
    let mut stream = client.generate(r).await?.into_inner();
    let mut out = Vec::new();
    while let Some(r) = stream.message().await? {
        out.push(r);
    }
    Ok(out)
}

fn keys() -> Option<Arc<ApiKeys>> {
    Some(Arc::new(ApiKeys::parse(b"sk-alpha\nsk-beta\n").unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_generate_and_list_models_but_not_health() {
    let opts = FrontOptions {
        api_keys: keys(),
        ..FrontOptions::default()
    };
    let h = Harness::start_with(fake_config(), opts).await;
    let mut client = h.client().await;
    let req = text_request("hello", 4, false);
    for (metadata, message) in [
        (&[][..], "didn't provide an API key"),
        (&[("authorization", "Bearer sk-gamma")], "Incorrect API key"),
        (
            &[("authorization", "sk-alpha")],
            "must be `Bearer <API key>`",
        ),
        (&[("x-api-key", "sk-alph")], "Incorrect API key"),
    ] {
        let e = generate_with(&mut client, metadata, req.clone())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{metadata:?}: {e:?}");
        assert!(e.message().contains(message), "{metadata:?}: {e:?}");
    }
    assert!(h.fake.submitted().is_empty(), "nothing reached the backend");
    let n = h.tok.encode("hello", true).unwrap().len();
    let want: Vec<u32> = (0..4).map(|i| ((n + i) % 128) as u32).collect();
    for metadata in [
        &[("authorization", "Bearer sk-alpha")][..],
        &[("x-api-key", "sk-beta")],
    ] {
        let out = generate_with(&mut client, metadata, req.clone())
            .await
            .unwrap();
        assert_eq!(out[0].token_ids, want, "{metadata:?}");
        assert_eq!(out[0].finish_reason(), FinishReason::Length);
    }
    let e = client.list_models(ListModelsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut r = tessera_proto::tonic::Request::new(ListModelsRequest {});
    r.metadata_mut()
        .insert("authorization", "Bearer sk-beta".parse().unwrap());
    assert_eq!(
        client
            .list_models(r)
            .await
            .unwrap()
            .into_inner()
            .models
            .len(),
        1
    );
    // Health needs no key.
    let channel = Channel::from_shared(format!("http://{}", h.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "tessera.v1.Generate".into(),
        })
        .await
        .unwrap();
    assert_eq!(r.into_inner().status(), ServingStatus::Serving);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_holds_a_key_back_with_retry_after() {
    let opts = FrontOptions {
        api_keys: keys(),
        rate_limit: Some(RateLimit { rps: 2.0, burst: 2 }),
        ..FrontOptions::default()
    };
    let h = Harness::start_with(fake_config(), opts).await;
    let mut client = h.client().await;
    let alpha = [("authorization", "Bearer sk-alpha")];
    let req = text_request("hello", 2, false);
    for _ in 0..2 {
        generate_with(&mut client, &alpha, req.clone())
            .await
            .unwrap();
    }
    let e = generate_with(&mut client, &alpha, req.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(e.metadata().get("retry-after").unwrap(), "1");
    assert!(e.message().contains("Rate limit"), "{e:?}");
    // The other key is not held back; the first recovers after the wait.
    generate_with(&mut client, &[("x-api-key", "sk-beta")], req.clone())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    generate_with(&mut client, &alpha, req.clone())
        .await
        .unwrap();
    assert_eq!(h.fake.submitted().len(), 4);
    h.stop().await;
}
