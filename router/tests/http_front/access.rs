//! API keys and rate limits: who gets in, who is held back, and what they are told.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, Method, StatusCode};
use serde_json::{json, Value};
use tessera_router::{ApiKeys, BackendError, FrontOptions, RateLimit};

use super::common::*;

const KEYS: &str = "# test keys\nsk-alpha\nsk-beta\n";

fn keyed(rate_limit: Option<RateLimit>) -> Harness {
    let opts = FrontOptions {
        api_keys: Some(Arc::new(ApiKeys::parse(KEYS.as_bytes()).unwrap())),
        rate_limit,
        ..FrontOptions::default()
    };
    harness_with(fake_config(), opts, true)
}

/// Every guarded route with a body that would succeed (or 404, for the unknown route).
fn guarded() -> Vec<(Method, &'static str, String, StatusCode)> {
    let completion = json!({"prompt": [1, 2, 3], "max_tokens": 2}).to_string();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    vec![
        (Method::POST, "/v1/completions", completion, StatusCode::OK),
        (
            Method::POST,
            "/v1/chat/completions",
            chat.to_string(),
            StatusCode::OK,
        ),
        (Method::GET, "/v1/models", String::new(), StatusCode::OK),
        (
            Method::GET,
            "/v1/models/fake-model",
            String::new(),
            StatusCode::OK,
        ),
        (
            Method::POST,
            "/v1/embeddings",
            "{}".into(),
            StatusCode::NOT_FOUND,
        ),
    ]
}

fn error_of(text: &str) -> Value {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    v["error"].clone()
}

fn assert_unauthorized(status: StatusCode, headers: &HeaderMap, text: &str, code: &str) {
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{text}");
    let e = error_of(text);
    assert_eq!(e["type"], "authentication_error", "{text}");
    assert_eq!(e["code"], code, "{text}");
    assert!(e["message"].as_str().unwrap().contains("API key"), "{text}");
    assert_eq!(headers["www-authenticate"], "Bearer");
}

#[tokio::test]
async fn api_keys_guard_every_v1_route_but_not_health_or_metrics() {
    let h = keyed(None);
    for (method, path, body, ok) in guarded() {
        let send = |headers: &'static [(&'static str, &'static str)]| {
            h.send_from(None, headers, method.clone(), path, body.clone())
        };
        let (st, hd, text) = send(&[]).await;
        assert_unauthorized(st, &hd, &text, "missing_api_key");
        for wrong in [
            &[("authorization", "Bearer sk-gamma")][..],
            &[("authorization", "Bearer sk-alph")],
            &[("authorization", "sk-alpha")],
            &[("authorization", "Basic c2stYWxwaGE6")],
            &[("x-api-key", "sk-alpha ")],
            &[
                ("authorization", "Bearer sk-wrong"),
                ("x-api-key", "sk-alpha"),
            ],
        ] {
            let (st, hd, text) = send(wrong).await;
            assert_unauthorized(st, &hd, &text, "invalid_api_key");
        }
        for right in [
            &[("authorization", "Bearer sk-alpha")][..],
            &[("authorization", "bearer sk-beta")],
            &[("x-api-key", "sk-beta")],
        ] {
            let (st, _, text) = send(right).await;
            assert_eq!(st, ok, "{method} {path} {right:?}: {text}");
        }
    }
    // The body of a refused request is never read: malformed JSON without a key is a 401.
    let (st, hd, text) = h
        .send_from(None, &[], Method::POST, "/v1/completions", "{not json")
        .await;
    assert_unauthorized(st, &hd, &text, "missing_api_key");
    // Load balancers and Prometheus need no key.
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    let (st, metrics) = h.get("/metrics").await;
    assert_eq!(st, StatusCode::OK);
    // Only the authorized generation requests reached the backend: 3 keys × 2 routes.
    assert_eq!(h.fake.submitted().len(), 6);
    let n = guarded().len() as u64;
    assert_eq!(h.metrics.refused(401, "missing_api_key"), n + 1);
    assert_eq!(h.metrics.refused(401, "invalid_api_key"), 6 * n);
    assert!(metrics.contains(&format!(
        "tessera_http_refused_requests_total{{status=\"401\",reason=\"invalid_api_key\"}} {}",
        6 * n
    )));
}

#[tokio::test]
async fn without_keys_any_authorization_header_is_ignored() {
    let h = harness();
    for headers in [
        &[][..],
        &[("authorization", "Bearer anything")],
        &[("x-api-key", "whatever")],
    ] {
        let body = json!({"prompt": [1, 2], "max_tokens": 1}).to_string();
        let (st, _, text) = h
            .send_from(None, headers, Method::POST, "/v1/completions", body)
            .await;
        assert_eq!(st, StatusCode::OK, "{text}");
    }
}

/// Sends a completion with `key` from `peer`; returns the status, `Retry-After` and the body.
async fn call(h: &Harness, key: Option<&str>, peer: &str) -> (StatusCode, Option<u64>, String) {
    let auth = key.map(|k| format!("Bearer {k}")).unwrap_or_default();
    let headers = [("authorization", auth.as_str())];
    let headers = if key.is_some() { &headers[..] } else { &[] };
    let peer: SocketAddr = peer.parse().unwrap();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    let (st, hd, text) = h
        .send_from(Some(peer), headers, Method::POST, "/v1/completions", body)
        .await;
    let retry = hd
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (st, retry, text)
}

fn assert_rate_limited(got: (StatusCode, Option<u64>, String)) {
    let (st, retry, text) = got;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert_eq!(retry, Some(1), "Retry-After is whole seconds, at least 1");
    let e = error_of(&text);
    assert_eq!(e["type"], "rate_limit_error");
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert!(e["message"].as_str().unwrap().contains("Retry after 1 s"));
}

#[tokio::test]
async fn each_key_gets_its_burst_then_429_then_recovers() {
    // 3 at once, then one every 500 ms.
    let h = keyed(Some(RateLimit { rps: 2.0, burst: 3 }));
    let ip = "10.1.1.1:5000";
    for _ in 0..3 {
        assert_eq!(call(&h, Some("sk-alpha"), ip).await.0, StatusCode::OK);
    }
    assert_rate_limited(call(&h, Some("sk-alpha"), ip).await);
    assert_rate_limited(call(&h, Some("sk-alpha"), "10.9.9.9:1").await);
    // The other key, even from the same address, has its own bucket.
    assert_eq!(call(&h, Some("sk-beta"), ip).await.0, StatusCode::OK);
    // A refused key does not spend the limit (it never gets a bucket).
    for _ in 0..5 {
        assert_eq!(call(&h, Some("sk-x"), ip).await.0, StatusCode::UNAUTHORIZED);
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(call(&h, Some("sk-alpha"), ip).await.0, StatusCode::OK);
    assert_rate_limited(call(&h, Some("sk-alpha"), ip).await);
    assert_eq!(h.metrics.refused(429, "rate_limit_exceeded"), 3);
    assert_eq!(h.fake.submitted().len(), 5);
    // Open routes are never limited.
    for _ in 0..10 {
        assert_eq!(h.get("/health").await.0, StatusCode::OK);
    }
}

#[tokio::test]
async fn without_keys_each_client_address_gets_its_own_bucket() {
    let opts = FrontOptions {
        rate_limit: Some(RateLimit { rps: 2.0, burst: 2 }),
        ..FrontOptions::default()
    };
    let h = harness_with(fake_config(), opts, true);
    for _ in 0..2 {
        assert_eq!(call(&h, None, "192.0.2.1:1000").await.0, StatusCode::OK);
    }
    assert_rate_limited(call(&h, None, "192.0.2.1:1000").await);
    // Another port of the same host is the same client; another host is not.
    assert_rate_limited(call(&h, None, "192.0.2.1:2000").await);
    assert_eq!(call(&h, None, "192.0.2.2:1000").await.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(call(&h, None, "192.0.2.1:1000").await.0, StatusCode::OK);
}

#[tokio::test]
async fn an_overloaded_backend_also_says_when_to_retry() {
    let h = harness();
    h.fake
        .set_reject(Some(BackendError::Overloaded("queue full".into())));
    let (st, retry, text) = call(&h, None, "127.0.0.1:1").await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry, Some(1));
    assert_eq!(error_of(&text)["code"], "overloaded");
    assert_eq!(h.metrics.refused(429, "overloaded"), 1);
}
