//! Every bad input gets the right status and OpenAI's error JSON naming the problem, and the
//! server keeps serving. `docs/RELIABILITY.md` lists the inputs.

use axum::http::{Method, StatusCode};
use serde_json::{json, Value};
use tessera_router::fake::FakeConfig;
use tessera_router::{BackendError, FrontOptions};

use super::common::*;

const C: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn user(content: Value) -> Value {
    json!({"messages": [{"role": "user", "content": content}]})
}

/// `(path, raw body, status, expected param, substring of the message)`.
fn bad_requests() -> Vec<(
    &'static str,
    String,
    u16,
    Option<&'static str>,
    &'static str,
)> {
    let j = |v: Value| v.to_string();
    let hi = |k: &str, v: Value| {
        let mut b = json!({"prompt": "hi"});
        b[k] = v;
        b.to_string()
    };
    let say = |k: &str, v: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "x"}]});
        b[k] = v;
        b.to_string()
    };
    // Past the model's context (512) but within --max-prompt-tokens (1000, set above the
    // context so that both limits can be reached).
    let long_prompt: Vec<u32> = vec![7; 600];
    let longer_prompt: Vec<u32> = vec![7; 1001];
    let many_stops: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    let many_stop_ids: Vec<u32> = (0..257).collect();
    vec![
        (
            C,
            r#"{"prompt": "hi", "#.into(),
            400,
            None,
            "Invalid JSON in request body: EOF while parsing a value at line 1 column 17",
        ),
        (
            C,
            "{\n  \"prompt\": \"hi\",\n  \"max_tokens\": 3,,\n}".into(),
            400,
            None,
            "at line 3 column 19",
        ),
        (
            C,
            "not json at all".into(),
            400,
            None,
            "Invalid JSON in request body: expected ident at line 1 column 2",
        ),
        (
            C,
            r#"{"prompt": "hi", "temperature": NaN}"#.into(),
            400,
            None,
            "Invalid JSON in request body: expected value at line 1 column 33",
        ),
        (
            C,
            r#"{"prompt": "hi", "temperature": 1e400}"#.into(),
            400,
            None,
            "number out of range at line 1 column",
        ),
        (C, "[1, 2]".into(), 400, None, "JSON object"),
        (C, "null".into(), 400, None, "JSON object"),
        (C, "".into(), 400, None, "Invalid JSON"),
        (
            C,
            hi("top_p", json!("high")),
            400,
            Some("top_p"),
            "invalid type: string \"high\", expected f64",
        ),
        (
            C,
            hi("max_tokens", json!(1.5)),
            400,
            Some("max_tokens"),
            "invalid type: floating point",
        ),
        (
            C,
            hi("seed", json!("abc")),
            400,
            Some("seed"),
            "invalid type",
        ),
        (
            C,
            hi("top_k", json!(1.5)),
            400,
            Some("top_k"),
            "invalid type",
        ),
        (
            C,
            hi("ignore_eos", json!("yes")),
            400,
            Some("ignore_eos"),
            "expected a boolean",
        ),
        (
            C,
            hi("return_token_ids", json!(1)),
            400,
            Some("return_token_ids"),
            "expected a boolean",
        ),
        (
            C,
            hi("presence_penalty", json!("x")),
            400,
            Some("presence_penalty"),
            "invalid type",
        ),
        (C, hi("top_p", json!(-0.5)), 400, Some("top_p"), "(0, 1]"),
        (
            C,
            hi("n", json!(0)),
            400,
            Some("n"),
            "n must be between 1 and 16, got 0",
        ),
        (
            C,
            hi("frequency_penalty", json!(2.5)),
            400,
            Some("frequency_penalty"),
            "frequency_penalty must be in [-2, 2], got 2.5",
        ),
        (
            C,
            hi("logit_bias", json!({"5": 101})),
            400,
            Some("logit_bias"),
            "the bias of token 5 must be a number in [-100, 100], got 101",
        ),
        (
            C,
            hi("logit_bias", json!({"five": 1})),
            400,
            Some("logit_bias"),
            "logit_bias keys are token ids, got \"five\"",
        ),
        (
            C,
            hi("logit_bias", json!({"5": 1, "05": 2})),
            400,
            Some("logit_bias"),
            "token 5 is named twice",
        ),
        (
            C,
            hi("logit_bias", json!({"100000": 1})),
            400,
            Some("logit_bias"),
            "out of range for the vocabulary",
        ),
        (C, hi("suffix", json!("end")), 400, Some("suffix"), "suffix"),
        (
            C,
            hi("max_tokens", json!(1_000_000_000_000_i64)),
            400,
            Some("max_tokens"),
            "maximum context length is 512 tokens",
        ),
        (
            C,
            hi("stop", json!(many_stops)),
            400,
            Some("stop"),
            "at most 16 stop sequences are allowed, got 17",
        ),
        (
            C,
            hi("stop", json!("z".repeat(300))),
            400,
            Some("stop"),
            "at most 256 characters, got one of 300",
        ),
        (
            C,
            hi("stop", json!([1, 2])),
            400,
            Some("stop"),
            "did not match any variant",
        ),
        (
            C,
            hi("stop_token_ids", json!(many_stop_ids)),
            400,
            Some("stop_token_ids"),
            "at most 256 stop token ids are allowed, got 257",
        ),
        (
            C,
            hi("stream_options", json!({"include_usage": true})),
            400,
            Some("stream_options"),
            "only allowed when stream is true",
        ),
        (
            C,
            j(json!({"prompt": true})),
            400,
            Some("prompt"),
            "must be",
        ),
        (
            C,
            j(json!({"prompt": [1.5]})),
            400,
            Some("prompt"),
            "not an integer",
        ),
        (
            C,
            j(json!({"prompt": longer_prompt, "max_tokens": 1})),
            400,
            Some("prompt"),
            "at most 1000 tokens (--max-prompt-tokens). However, your prompt has 1001 tokens",
        ),
        (
            C,
            j(json!({"prompt": "hi", "temperature": "hot"})),
            400,
            Some("temperature"),
            "invalid type",
        ),
        (
            C,
            j(json!({"prompt": "hi", "max_tokens": "ten"})),
            400,
            Some("max_tokens"),
            "invalid type",
        ),
        (
            C,
            j(json!({"prompt": "hi", "stream": "yes"})),
            400,
            Some("stream"),
            "invalid type",
        ),
        (
            C,
            j(json!({"prompt": "hi", "stop": 5})),
            400,
            Some("stop"),
            "Invalid value for `stop`",
        ),
        (
            C,
            j(json!({"prompt": "hi", "n": 17})),
            400,
            Some("n"),
            "got 17",
        ),
        (
            C,
            j(json!({"prompt": "hi", "best_of": 3})),
            400,
            Some("best_of"),
            "best_of=3 is not supported",
        ),
        (
            C,
            j(json!({"prompt": "hi", "max_tokens": -5})),
            400,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            C,
            j(json!({"prompt": "hi", "max_tokens": 0})),
            400,
            Some("max_tokens"),
            "at least 1",
        ),
        (
            C,
            j(json!({"prompt": "hi", "temperature": 5})),
            400,
            Some("temperature"),
            "[0, 2]",
        ),
        (
            C,
            j(json!({"prompt": "hi", "temperature": -0.1})),
            400,
            Some("temperature"),
            "[0, 2]",
        ),
        (
            C,
            j(json!({"prompt": "hi", "top_p": 0})),
            400,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            C,
            j(json!({"prompt": "hi", "top_p": 1.5})),
            400,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            C,
            j(json!({"prompt": "hi", "top_k": -3})),
            400,
            Some("top_k"),
            "top_k must be -1 (disabled) or at least 1, got -3",
        ),
        (
            C,
            j(json!({"prompt": "hi", "presence_penalty": -3})),
            400,
            Some("presence_penalty"),
            "presence_penalty must be in [-2, 2], got -3",
        ),
        (
            C,
            j(json!({"prompt": "hi", "echo": true})),
            400,
            Some("echo"),
            "echo is not supported",
        ),
        (
            C,
            j(json!({"prompt": "hi", "logprobs": 21})),
            400,
            Some("logprobs"),
            "logprobs must be between 0 and 20, got 21",
        ),
        (C, j(json!({"prompt": ""})), 400, Some("prompt"), "empty"),
        (C, j(json!({"prompt": []})), 400, Some("prompt"), "empty"),
        (
            C,
            j(json!({"max_tokens": 3})),
            400,
            Some("prompt"),
            "missing",
        ),
        (
            C,
            j(json!({"prompt": [1, 5000]})),
            400,
            Some("prompt"),
            "5000",
        ),
        (C, j(json!({"prompt": [-1]})), 400, Some("prompt"), "-1"),
        (
            C,
            j(json!({"prompt": ["a", "b"]})),
            400,
            Some("prompt"),
            "batch",
        ),
        (
            C,
            j(json!({"prompt": {"text": "a"}})),
            400,
            Some("prompt"),
            "must be",
        ),
        (
            C,
            j(json!({"prompt": "hi", "stop_token_ids": [99999]})),
            400,
            Some("stop_token_ids"),
            "99999",
        ),
        (
            C,
            j(json!({"prompt": "hi", "model": "gpt-4"})),
            404,
            Some("model"),
            "gpt-4",
        ),
        (
            C,
            j(json!({"prompt": long_prompt, "max_tokens": 1})),
            400,
            Some("prompt"),
            "maximum context length is 512 tokens. However, your prompt has 600 tokens",
        ),
        (
            C,
            j(json!({"prompt": [1, 2], "max_tokens": 511})),
            400,
            Some("max_tokens"),
            "maximum context length",
        ),
        (C, "x".repeat(20_000), 413, None, "too large"),
        (
            CHAT,
            j(user(
                json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]),
            )),
            400,
            Some("messages[0].content"),
            "images are not supported by this model",
        ),
        (
            CHAT,
            j(user(json!([{"type": "input_audio"}]))),
            400,
            Some("messages[0].content"),
            "input_audio",
        ),
        (
            CHAT,
            j(json!({"messages": []})),
            400,
            Some("messages"),
            "empty",
        ),
        (
            CHAT,
            j(json!({"messages": "hello"})),
            400,
            Some("messages"),
            "invalid type",
        ),
        (
            CHAT,
            j(json!({"prompt": "hello"})),
            400,
            Some("messages"),
            "missing",
        ),
        (
            CHAT,
            j(json!({"messages": [{"role": "robot", "content": "x"}]})),
            400,
            Some("messages[0].role"),
            "robot",
        ),
        (
            CHAT,
            j(json!({"messages": [{"content": "x"}]})),
            400,
            Some("messages[0]"),
            "role",
        ),
        (
            CHAT,
            j(json!({"messages": [{"role": "user", "content": 5}]})),
            400,
            Some("messages[0].content"),
            "a string, a list of content parts, or null",
        ),
        (
            CHAT,
            j(
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}),
            ),
            400,
            Some("top_logprobs"),
            "top_logprobs must be between 0 and 20, got -1",
        ),
        (
            CHAT,
            j(json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})),
            400,
            Some("max_tokens"),
            "max_tokens must be at least 1, got 0",
        ),
        (
            CHAT,
            j(
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
            ),
            400,
            Some("response_format"),
            "only response_format {\"type\": \"text\"} is supported",
        ),
        (
            CHAT,
            j(json!({"messages": [{"role": "user", "content": "x"}], "model": "nope"})),
            404,
            Some("model"),
            "nope",
        ),
        (
            CHAT,
            j(json!({"messages": null})),
            400,
            Some("messages"),
            "missing field `messages`",
        ),
        (
            CHAT,
            j(json!({"messages": [{"role": 5, "content": "x"}]})),
            400,
            Some("messages[0].role"),
            "invalid type",
        ),
        (
            CHAT,
            j(user(json!([{"text": "no type"}]))),
            400,
            Some("messages[0].content"),
            "needs a string `type`",
        ),
        (
            CHAT,
            j(
                json!({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": null}]}),
            ),
            400,
            Some("messages[1].content"),
            "a `user` message needs content",
        ),
        (
            CHAT,
            say("top_logprobs", json!(3)),
            400,
            Some("top_logprobs"),
            "top_logprobs needs logprobs: true",
        ),
        (
            CHAT,
            say("chat_template_kwargs", json!("thinking")),
            400,
            Some("chat_template_kwargs"),
            "invalid type",
        ),
        (
            CHAT,
            say("response_format", json!("json")),
            400,
            Some("response_format"),
            "only response_format",
        ),
        (
            CHAT,
            say("temperature", json!(-1)),
            400,
            Some("temperature"),
            "temperature must be in [0, 2], got -1",
        ),
        (
            CHAT,
            say("best_of", json!(4)),
            400,
            Some("best_of"),
            "best_of=4 is not supported: only best_of equal to n (1) is",
        ),
        (
            CHAT,
            say("stop", json!(vec!["a"; 20])),
            400,
            Some("stop"),
            "at most 16 stop sequences",
        ),
        ("/v1/nope", "{}".into(), 404, None, "/v1/nope"),
    ]
}

fn assert_openai_error(v: &Value, status: u16) {
    let e = &v["error"];
    assert!(!e["message"].as_str().unwrap().is_empty(), "{v}");
    let ty = e["type"].as_str().unwrap();
    let want = match status {
        401 => "authentication_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    };
    assert_eq!(ty, want, "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

/// A normal request still gets exactly the fake's output: ids 70 and 71 after a 70-token
/// prompt, which are the bytes `F` and `G`.
async fn still_serves(h: &Harness) {
    let body = json!({"prompt": vec![7; 70], "max_tokens": 2, "return_token_ids": true});
    let (status, v) = h.post(C, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], "FG", "{v}");
    assert_eq!(ids_of(&v["choices"][0]["token_ids"]), fake_ids(70, 2));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn bad_inputs_get_openai_errors() {
    let config = FakeConfig {
        max_model_len: 512,
        ..fake_config()
    };
    let opts = FrontOptions {
        max_body_bytes: 16 << 10,
        max_prompt_tokens: Some(1000),
        ..FrontOptions::default()
    };
    let h = harness_with(config, opts, true);
    let cases = bad_requests();
    assert!(cases.len() >= 80, "{} cases", cases.len());
    let distinct: std::collections::HashSet<_> = cases.iter().map(|c| (c.0, &c.1)).collect();
    assert_eq!(distinct.len(), cases.len(), "a bad input is listed twice");
    let completion_400s = cases.iter().filter(|c| c.0 == C && c.2 == 400).count() as u64;
    for (path, body, status, param, msg) in cases {
        let (got, text) = h.send(Method::POST, path, body.clone()).await;
        let short = &body[..body.len().min(120)];
        assert_eq!(got.as_u16(), status, "{path} {short}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_openai_error(&v, status);
        assert_eq!(v["error"]["param"].as_str(), param, "{path} {short}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(msg), "{path} {short}: {message}");
        still_serves(&h).await;
    }
    // Nothing that was rejected reached the backend.
    assert_eq!(h.fake.submitted().len(), bad_requests().len());
    assert_eq!(h.metrics.requests("/v1/completions", 400), completion_400s);
    // Every refusal was counted by reason.
    let text = h.get("/metrics").await.1;
    let refused: u64 = text
        .lines()
        .filter(|l| l.starts_with("tessera_http_refused_requests_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(refused, bad_requests().len() as u64, "{text}");
    assert_eq!(h.metrics.refused(400, "context_length_exceeded"), 4);
    assert_eq!(h.metrics.refused(413, "request_too_large"), 1);
    assert_eq!(h.metrics.refused(404, "model_not_found"), 2);
}

#[tokio::test]
async fn wrong_methods_and_routes() {
    let h = harness();
    let (status, text) = h.get(C).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_openai_error(&serde_json::from_str(&text).unwrap(), 405);
    let (status, text) = h.get("/nothing/here").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_openai_error(&serde_json::from_str(&text).unwrap(), 404);
    let (status, _) = h.get("/v1/models/fake-model").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h.get("/v1/models/other").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    still_serves(&h).await;
}

#[tokio::test]
async fn backend_refusals_and_failures() {
    let h = harness();
    let body = json!({"prompt": "hi", "max_tokens": 4});
    for (err, status) in [
        (BackendError::Overloaded("queue full".into()), 429),
        (BackendError::Unavailable("no decode workers".into()), 503),
        (BackendError::InvalidRequest("bad".into()), 400),
        (
            BackendError::PromptTooLong {
                prompt_tokens: 9,
                limit: 4,
            },
            400,
        ),
        (BackendError::Internal("boom".into()), 500),
    ] {
        h.fake.set_reject(Some(err));
        for stream in [false, true] {
            let mut b = body.clone();
            b["stream"] = json!(stream);
            let (got, v) = h.post(C, &b).await;
            assert_eq!(got.as_u16(), status, "{v}");
            assert_openai_error(&v, status);
        }
        let (got, _) = h.post(CHAT, &user(json!("hi"))).await;
        assert_eq!(got.as_u16(), status);
        h.fake.set_reject(None);
        still_serves(&h).await;
    }
    // Health follows the backend.
    assert_eq!(h.get("/health").await.0, StatusCode::OK);

    // A failure before any token: a real status, even when streaming.
    h.fake.set_fail_after(Some(0));
    let (got, v) = h.post(C, &json!({"prompt": "hi", "stream": true})).await;
    assert_eq!(got, StatusCode::INTERNAL_SERVER_ERROR);
    assert_openai_error(&v, 500);
    // A failure mid-stream: an error event, then [DONE].
    h.fake.set_fail_after(Some(3));
    let (got, events, done) = h
        .post_sse(
            C,
            &json!({"prompt": "hi", "stream": true, "max_tokens": 10}),
        )
        .await;
    assert_eq!(got, StatusCode::OK);
    assert!(done);
    assert_openai_error(events.last().unwrap(), 500);
    let (got, _) = h.post(C, &json!({"prompt": "hi", "max_tokens": 10})).await;
    assert_eq!(got, StatusCode::INTERNAL_SERVER_ERROR);
    h.fake.set_fail_after(None);
    still_serves(&h).await;
}

#[tokio::test]
async fn chat_without_template_is_a_clear_400() {
    let h = harness_with(fake_config(), FrontOptions::default(), false);
    let (status, v) = h.post(CHAT, &user(json!("hi"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no chat template"));
}
