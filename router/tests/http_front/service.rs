//! `/health`, `/v1/models` and `/metrics`.

use axum::http::{Method, StatusCode};
use serde_json::{json, Value};
use tessera_router::BackendError;

use super::common::*;

#[tokio::test]
async fn health_and_models() {
    let h = harness();
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    let (status, text) = h.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"][0]["id"], "fake-model");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "tessera");
    // A refusing backend does not break /health (health is the backend's own signal).
    h.fake
        .set_reject(Some(BackendError::Overloaded("x".into())));
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
}

#[tokio::test]
async fn metrics_count_requests_tokens_and_latency() {
    let h = harness();
    for stream in [false, true] {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream});
        let (status, _) = h
            .send(Method::POST, "/v1/completions", body.to_string())
            .await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, _) = h.post("/v1/completions", &json!({"prompt": ""})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, text) = h.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for line in [
        "tessera_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2",
        "tessera_http_requests_total{endpoint=\"/v1/completions\",status=\"400\"} 1",
        "tessera_http_requests_in_flight 0",
        "tessera_http_prompt_tokens_total 6",
        "tessera_http_cached_prompt_tokens_total 6",
        "tessera_http_generation_tokens_total 8",
        "tessera_http_time_to_first_token_seconds_count 2",
        "tessera_http_time_per_output_token_seconds_count 2",
        "tessera_http_request_duration_seconds_count 2",
        "fake_backend_cancelled_total 0",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}
