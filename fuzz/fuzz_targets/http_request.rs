//! Arbitrary request bodies through the real OpenAI HTTP front (`/v1/completions` and
//! `/v1/chat/completions`: JSON parsing, field validation, chat templating, tokenization,
//! admission, generation, detokenization with stop strings, and the response, streamed or not)
//! over the deterministic fake backend. The first byte picks the route and what the backend
//! generates (ASCII, multi-byte text, broken UTF-8 and special tokens); every answer must be a
//! success or a client error in OpenAI's error JSON, never a panic or a 5xx.

#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tessera_router::fake::{FakeBackend, FakeConfig};
use tessera_router::{FrontOptions, HttpFront};
use tessera_tokenizer::{ChatTemplate, Tokenizer};
use tower::ServiceExt;

const VOCAB: usize = 1024;
const MAX_MODEL_LEN: usize = 96;
const MAX_BODY_BYTES: usize = 4096;

struct Front {
    runtime: tokio::runtime::Runtime,
    router: Router,
    backend: Arc<FakeBackend>,
    /// What the backend generates, picked per input; empty: `(prompt_len + i) % 128`.
    scripts: [Vec<u32>; 4],
}

fn front() -> &'static Front {
    static FRONT: OnceLock<Front> = OnceLock::new();
    FRONT.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        tessera_tokenizer::write_tiny_tokenizer(dir.path(), VOCAB).expect("tiny tokenizer");
        let tokenizer = Tokenizer::from_dir(dir.path()).expect("tokenizer");
        let template = ChatTemplate::from_dir(dir.path())
            .expect("chat template")
            .expect("the tiny tokenizer has a chat template");
        let backend = Arc::new(FakeBackend::new(FakeConfig {
            max_model_len: MAX_MODEL_LEN,
            token_modulus: 128,
            ..FakeConfig::default()
        }));
        let special = tessera_tokenizer::tiny_special_ids(VOCAB);
        let unicode = tokenizer
            .encode("Ünïcödé 🎉 wörds <think>hm</think> end.\n", true)
            .expect("encode");
        let broken_utf8 = vec![0xF0, 0x9F, 0x8E, b'a'.into(), 0xC3, 0xE2, 0x82, 0x80, 0xFF];
        let specials = vec![
            b'H'.into(),
            special.bos,
            0xC3,
            special.media_pad,
            0xA9,
            special.think,
            special.im_end,
            special.pad,
        ];
        let scripts = [Vec::new(), unicode, broken_utf8, specials];
        let front = HttpFront::new(
            backend.clone(),
            tokenizer,
            Some(template),
            special.stop_ids(),
            FrontOptions {
                served_model_name: Some("fuzz-model".into()),
                max_body_bytes: MAX_BODY_BYTES,
                max_prompt_tokens: Some(64),
                ..FrontOptions::default()
            },
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        Front {
            runtime,
            router: front.router(),
            backend,
            scripts,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let path = if selector & 1 == 0 {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    let front = front();
    let script = front.scripts[usize::from(selector >> 1) % front.scripts.len()].clone();
    front.backend.update(|c| c.script = script);
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
        .expect("request");
    let (status, is_sse, bytes) = front.runtime.block_on(async {
        let response = front
            .router
            .clone()
            .oneshot(request)
            .await
            .expect("the router is infallible");
        let status = response.status();
        let is_sse = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("response body")
            .to_bytes();
        (status, is_sse, bytes)
    });
    assert!(
        !status.is_server_error(),
        "{status} for {path} {:?}: {}",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(&bytes)
    );
    if is_sse {
        assert_eq!(status, StatusCode::OK);
        let text = std::str::from_utf8(&bytes).expect("SSE is UTF-8");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        for event in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
            if event == "[DONE]" {
                continue;
            }
            let chunk: serde_json::Value = serde_json::from_str(event)
                .unwrap_or_else(|e| panic!("an SSE event is not JSON ({e}): {event}"));
            assert!(chunk.get("error").is_none(), "{chunk}");
        }
        return;
    }
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!("{status}: the response is not JSON ({e}): {bytes:?}");
    });
    if status.is_success() {
        assert!(json["choices"].is_array(), "{json}");
    } else {
        assert!(status.is_client_error(), "{status}");
        assert!(json["error"]["message"].is_string(), "{json}");
        assert!(json["error"]["type"].is_string(), "{json}");
    }
});
