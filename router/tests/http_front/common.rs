//! Shared harness for the HTTP front tests: the tiny tokenizer, a fake backend, and small
//! request helpers over `tower::ServiceExt::oneshot`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tessera_router::fake::{FakeBackend, FakeConfig};
use tessera_router::{FrontOptions, HttpFront, Metrics};
use tessera_tokenizer::{ChatTemplate, TinySpecialIds, Tokenizer};
use tower::ServiceExt;

pub const VOCAB: usize = 1024;

pub struct Harness {
    _dir: tempfile::TempDir,
    pub fake: Arc<FakeBackend>,
    pub router: Router,
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    pub special: TinySpecialIds,
    pub metrics: Arc<Metrics>,
}

/// Byte tokens below 128 decode to ASCII, so expected text is easy to compute.
pub fn fake_config() -> FakeConfig {
    FakeConfig {
        token_modulus: 128,
        cached_tokens: 3,
        ..FakeConfig::default()
    }
}

pub fn harness() -> Harness {
    harness_with(fake_config(), FrontOptions::default(), true)
}

pub fn harness_with(config: FakeConfig, opts: FrontOptions, with_template: bool) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    tessera_tokenizer::write_tiny_tokenizer(dir.path(), VOCAB).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    let special = tessera_tokenizer::tiny_special_ids(VOCAB);
    let fake = Arc::new(FakeBackend::new(config));
    let front = HttpFront::new(
        fake.clone(),
        tok.clone(),
        with_template.then(|| ChatTemplate::from_dir(dir.path()).unwrap().unwrap()),
        special.stop_ids(),
        opts,
    );
    let metrics = front.metrics();
    Harness {
        _dir: dir,
        fake,
        router: front.router(),
        tok,
        template,
        special,
        metrics,
    }
}

impl Harness {
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Body>,
    ) -> (StatusCode, String) {
        let (status, _, text) = self.send_from(None, &[], method, path, body).await;
        (status, text)
    }

    /// A request from `peer` (as the server sees the TCP peer) with extra `headers`; returns
    /// the response headers too.
    pub async fn send_from(
        &self,
        peer: Option<SocketAddr>,
        headers: &[(&str, &str)],
        method: Method,
        path: &str,
        body: impl Into<Body>,
    ) -> (StatusCode, HeaderMap, String) {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let mut req = req.body(body.into()).unwrap();
        if let Some(peer) = peer {
            req.extensions_mut().insert(ConnectInfo(peer));
        }
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    pub async fn get(&self, path: &str) -> (StatusCode, String) {
        self.send(Method::GET, path, Body::empty()).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let (status, text) = self.send(Method::POST, path, body.to_string()).await;
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        (status, v)
    }

    /// POST with `stream: true`; returns the status, the JSON events before `[DONE]`, and
    /// whether `[DONE]` ended the stream.
    pub async fn post_sse(&self, path: &str, body: &Value) -> (StatusCode, Vec<Value>, bool) {
        let (status, text) = self.send(Method::POST, path, body.to_string()).await;
        let (events, done) = parse_sse(&text);
        (status, events, done)
    }

    /// Wait (bounded) until the fake has seen `n` cancellations.
    pub async fn wait_cancelled(&self, n: usize) {
        for _ in 0..500 {
            if self.fake.cancelled() >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("expected {n} cancellations, saw {}", self.fake.cancelled());
    }
}

pub fn parse_sse(text: &str) -> (Vec<Value>, bool) {
    let mut events = Vec::new();
    let mut done = false;
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let data = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data event: {block:?}"));
        assert!(!done, "event after [DONE]: {data}");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    (events, done)
}

/// The ids the fake generates for a prompt of `prompt_len` tokens (modulus 128, no stops).
pub fn fake_ids(prompt_len: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((prompt_len + i) % 128) as u32).collect()
}

pub fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
