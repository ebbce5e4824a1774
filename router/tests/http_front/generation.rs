//! Successful completions and chat, plain and streamed: text, token ids, usage, stops.

use axum::http::StatusCode;
use serde_json::{json, Value};
use tessera_router::fake::FakeConfig;
use tessera_router::FrontOptions;
use tessera_tokenizer::ChatMessage;

use super::common::*;

#[tokio::test]
async fn completion_text_prompt() {
    let h = harness();
    let prompt = "The old lighthouse stood";
    let prompt_ids = h.tok.encode(prompt, true).unwrap();
    let (status, v) = h
        .post(
            "/v1/completions",
            &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 5, "temperature": 0, "top_k": 4, "seed": 7}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let want = fake_ids(prompt_ids.len(), 5);
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "fake-model");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], h.tok.decode(&want, true).unwrap());
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice.get("token_ids").is_none());
    let usage = &v["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_ids.len());
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["total_tokens"], prompt_ids.len() + 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 3);

    let req = &h.fake.submitted()[0];
    assert_eq!(req.prompt_ids, prompt_ids);
    assert_eq!(req.max_tokens, 5);
    assert_eq!(req.sampling.temperature, 0.0);
    assert_eq!(req.sampling.top_k, 4);
    assert_eq!(req.sampling.seed, Some(7));
    assert_eq!(req.stop_token_ids, h.special.stop_ids());
    assert!(!req.ignore_eos);
}

#[tokio::test]
async fn completion_token_ids_and_defaults() {
    let h = harness();
    for prompt in [json!([1, 2, 3]), json!([[1, 2, 3]])] {
        let (status, v) = h
            .post(
                "/v1/completions",
                &json!({"prompt": prompt, "return_token_ids": true}),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        // No model field is fine; max_tokens defaults to 16.
        assert_eq!(ids_of(&v["choices"][0]["token_ids"]), fake_ids(3, 16));
        assert_eq!(ids_of(&v["choices"][0]["prompt_token_ids"]), vec![1, 2, 3]);
        assert_eq!(v["usage"]["completion_tokens"], 16);
    }
    let req = &h.fake.submitted()[0];
    assert_eq!(req.sampling.temperature, 1.0);
    assert_eq!(req.sampling.top_p, 1.0);
    assert_eq!(req.sampling.seed, None);
}

#[tokio::test]
async fn completion_stream_matches_plain() {
    let h = harness();
    let body = json!({"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "return_token_ids": true});
    let (_, plain) = h.post("/v1/completions", &body).await;
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let (status, events, done) = h.post_sse("/v1/completions", &stream_body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(done);
    let (usage_chunk, chunks) = events.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], plain["usage"]);
    let mut text = String::new();
    let mut ids = Vec::new();
    for c in chunks {
        assert_eq!(c["object"], "text_completion");
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
        ids.extend(ids_of(&c["choices"][0]["token_ids"]));
    }
    assert_eq!(text, plain["choices"][0]["text"].as_str().unwrap());
    assert_eq!(ids, ids_of(&plain["choices"][0]["token_ids"]));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks[0]["choices"][0]["prompt_token_ids"].is_array());
    // Without include_usage there is no usage chunk.
    stream_body["stream_options"] = json!(null);
    let (_, events, _) = h.post_sse("/v1/completions", &stream_body).await;
    assert!(events.iter().all(|e| e.get("usage").is_none()));
}

#[tokio::test]
async fn chat_plain_and_streamed() {
    let h = harness();
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}
    ]);
    let rendered = h
        .template
        .render(
            &serde_json::from_value::<Vec<ChatMessage>>(messages.clone()).unwrap(),
            true,
        )
        .unwrap();
    let prompt_ids = h.tok.encode(&rendered, true).unwrap();
    let body = json!({"model": "fake-model", "messages": messages, "max_completion_tokens": 9, "temperature": 0});
    let (status, v) = h.post("/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(h.fake.submitted()[0].prompt_ids, prompt_ids);
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["role"], "assistant");
    let want = h.tok.decode(&fake_ids(prompt_ids.len(), 9), true).unwrap();
    assert_eq!(msg["content"], want);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_ids.len());
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 3);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, events, done) = h.post_sse("/v1/chat/completions", &sbody).await;
    assert_eq!(status, StatusCode::OK);
    assert!(done);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, want);
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
    }
    let n = events.len();
    assert_eq!(events[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(events[n - 1]["usage"], v["usage"]);
}

#[tokio::test]
async fn chat_defaults_to_the_rest_of_the_context() {
    let config = FakeConfig {
        max_model_len: 300,
        ..fake_config()
    };
    let h = harness_with(config, FrontOptions::default(), true);
    let (status, v) = h
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let req = &h.fake.submitted()[0];
    assert_eq!(req.max_tokens, 300 - req.prompt_ids.len());
    assert_eq!(ids_of(&v["prompt_token_ids"]), req.prompt_ids);
    assert_eq!(
        ids_of(&v["choices"][0]["token_ids"]).len(),
        300 - req.prompt_ids.len()
    );
}

async fn scripted(text: &str) -> (Harness, Vec<u32>) {
    let h0 = harness();
    let script = h0.tok.encode(text, false).unwrap();
    let config = FakeConfig {
        script: script.clone(),
        ..fake_config()
    };
    (harness_with(config, FrontOptions::default(), true), script)
}

#[tokio::test]
async fn stop_strings_truncate_and_cancel() {
    let text = "The keeper climbed the steps to light the lamp.";
    let (h, script) = scripted(text).await;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let body = json!({"prompt": "x", "max_tokens": 100, "stop": ["climbed", "zzz"], "stream": stream, "return_token_ids": true});
        let out = if stream {
            let (status, events, done) = h.post_sse("/v1/completions", &body).await;
            assert_eq!(status, StatusCode::OK);
            assert!(done);
            let text: String = events
                .iter()
                .map(|e| e["choices"][0]["text"].as_str().unwrap())
                .collect();
            let ids: Vec<u32> = events
                .iter()
                .flat_map(|e| ids_of(&e["choices"][0]["token_ids"]))
                .collect();
            let last = &events.last().unwrap()["choices"][0];
            assert_eq!(last["finish_reason"], "stop");
            (text, ids)
        } else {
            let (status, v) = h.post("/v1/completions", &body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            let ids = ids_of(&v["choices"][0]["token_ids"]);
            assert_eq!(v["usage"]["completion_tokens"], ids.len());
            (v["choices"][0]["text"].as_str().unwrap().to_string(), ids)
        };
        assert_eq!(out.0, "The keeper ");
        assert_eq!(out.1, script[..out.1.len()]);
        assert!(out.1.len() < script.len());
        // The backend was told to stop: its receiver was dropped.
        h.wait_cancelled(i + 1).await;
    }
    // A single string works too, and chat applies stops the same way.
    let (status, v) = h
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 100, "stop": "steps"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "The keeper climbed the "
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn eos_and_stop_token_ids() {
    let h0 = harness();
    let eos = h0.special.im_end;
    let hello = h0.tok.encode("Hello", false).unwrap();
    let mut script = hello.clone();
    script.push(eos);
    script.extend(h0.tok.encode(" more", false).unwrap());
    let config = FakeConfig {
        script: script.clone(),
        ..fake_config()
    };
    let h = harness_with(config, FrontOptions::default(), true);
    let body = json!({"prompt": [5], "max_tokens": 50, "return_token_ids": true});
    let (_, v) = h.post("/v1/completions", &body).await;
    assert_eq!(v["choices"][0]["text"], "Hello");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        ids_of(&v["choices"][0]["token_ids"]),
        script[..hello.len() + 1]
    );
    assert_eq!(v["usage"]["completion_tokens"], hello.len() + 1);

    // ignore_eos: EOS is not a stop token any more, and special text is skipped.
    let mut b = body.clone();
    b["ignore_eos"] = json!(true);
    b["max_tokens"] = json!(script.len());
    let (_, v) = h.post("/v1/completions", &b).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["text"], "Hello more");
    let last = h.fake.submitted().pop().unwrap();
    assert!(last.ignore_eos && last.stop_token_ids.is_empty());

    // A requested stop token id ends generation without showing its text.
    let mut b = body.clone();
    b["stop_token_ids"] = json!([hello[0]]);
    let (_, v) = h.post("/v1/completions", &b).await;
    assert_eq!(v["choices"][0]["text"], "");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(ids_of(&v["choices"][0]["token_ids"]), vec![hello[0]]);
}

#[tokio::test]
async fn served_model_name_and_cached_tokens_from_backend() {
    let opts = FrontOptions {
        served_model_name: Some("kimi-tiny".into()),
        ..FrontOptions::default()
    };
    let config = FakeConfig {
        cached_tokens: 2,
        ..fake_config()
    };
    let h = harness_with(config, opts, true);
    let ok = json!({"model": "kimi-tiny", "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let (status, v) = h.post("/v1/completions", &ok).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "kimi-tiny");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    let (status, v) = h
        .post(
            "/v1/completions",
            &json!({"model": "fake-model", "prompt": [1], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    let (_, text) = h.get("/v1/models").await;
    let models: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "kimi-tiny");
    assert_eq!(models["data"][0]["max_model_len"], 4096);
}

/// Log lines written while `f` runs on this thread (every level, no colours).
async fn logs_of<F: std::future::Future<Output = ()>>(f: F) -> String {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // Other tests of this binary install and drop their own subscribers on other threads; a
    // callsite first hit while none listened keeps a stale "never" until the cache is rebuilt.
    tracing::callsite::rebuild_interest_cache();
    f.await;
    let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    text
}

#[tokio::test(flavor = "current_thread")]
async fn prompts_reach_the_logs_only_with_log_requests() {
    let secret = "The old lighthouse stood";
    for log_requests in [false, true] {
        let opts = FrontOptions {
            log_requests,
            ..FrontOptions::default()
        };
        let h = harness_with(fake_config(), opts, true);
        let logs = logs_of(async {
            let body = json!({"prompt": secret, "max_tokens": 2});
            let (status, v) = h.post("/v1/completions", &body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            let chat = json!({"messages": [{"role": "user", "content": secret}], "max_tokens": 2});
            let (status, v) = h.post("/v1/chat/completions", &chat).await;
            assert_eq!(status, StatusCode::OK, "{v}");
        })
        .await;
        assert!(logs.contains("request"), "the request is logged: {logs}");
        assert_eq!(
            logs.contains(secret),
            log_requests,
            "log_requests={log_requests}:\n{logs}"
        );
    }
}

#[tokio::test]
async fn several_choices_are_separate_requests_with_consecutive_seeds() {
    let h = harness();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 4, "n": 3, "best_of": 3, "seed": 41,
        "return_token_ids": true});
    let (status, v) = h.post("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(ids_of(&c["token_ids"]), fake_ids(3, 4));
        assert_eq!(c["finish_reason"], "length");
    }
    // The prompt's ids go out once; the prompt counts once, the completions of all three.
    assert_eq!(ids_of(&choices[0]["prompt_token_ids"]), vec![1, 2, 3]);
    assert!(choices[1..]
        .iter()
        .all(|c| c.get("prompt_token_ids").is_none()));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let sent = h.fake.submitted();
    let seeds: Vec<Option<u64>> = sent.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![Some(41), Some(42), Some(43)]);
    let id = v["id"].as_str().unwrap();
    for (i, r) in sent.iter().enumerate() {
        assert_eq!(r.request_id, format!("{id}-{i}"));
    }

    // Streamed chat: a role chunk per choice, each choice's content and finish, one usage.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
        "stream": true, "stream_options": {"include_usage": true}});
    let (status, events, done) = h.post_sse("/v1/chat/completions", &body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(done);
    let prompt_len = h.fake.submitted().last().unwrap().prompt_ids.len();
    let want = h.tok.decode(&fake_ids(prompt_len, 5), true).unwrap();
    for i in 0..2 {
        let of_choice: Vec<&Value> = events
            .iter()
            .filter_map(|e| e["choices"].as_array()?.iter().find(|c| c["index"] == i))
            .collect();
        assert_eq!(of_choice[0]["delta"]["role"], "assistant", "choice {i}");
        let content: String = of_choice
            .iter()
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, want, "choice {i}");
        let finishes: Vec<&Value> = of_choice
            .iter()
            .map(|c| &c["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes, vec!["length"], "choice {i}");
    }
    let usage: Vec<&Value> = events
        .iter()
        .map(|e| &e["usage"])
        .filter(|u| !u.is_null())
        .collect();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0]["completion_tokens"], 10);
    assert_eq!(usage[0]["prompt_tokens"], prompt_len);
    assert!(events.last().unwrap()["usage"].is_object());
}

#[tokio::test]
async fn penalties_and_logit_bias_reach_the_backend() {
    let h = harness();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "logit_bias": {"7": 5, "3": -100}});
    let (status, v) = h.post("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let s = &h.fake.submitted()[0].sampling;
    assert_eq!(s.presence_penalty, 0.5);
    assert_eq!(s.frequency_penalty, -0.25);
    assert_eq!(s.logit_bias, vec![(3, -100.0), (7, 5.0)]);
}

#[tokio::test]
async fn logprobs_in_both_endpoints_plain_and_streamed() {
    let h = harness();
    // The fake reports -(i + 1) / 8 for step i and alternatives a nat apart.
    let (status, v) = h
        .post(
            "/v1/completions",
            &json!({"prompt": [65, 66], "max_tokens": 3, "logprobs": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ids = fake_ids(2, 3);
    let spell = |t: u32| h.tok.decode(&[t], false).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<String> = ids.iter().map(|&t| spell(t)).collect();
    assert_eq!(lp["tokens"], json!(tokens));
    assert_eq!(lp["token_logprobs"], json!([-0.125, -0.25, -0.375]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    assert_eq!(lp["top_logprobs"][1][spell(ids[1])], json!(-0.25));
    assert_eq!(lp["top_logprobs"][1][spell(ids[1] + 1)], json!(-1.25));
    assert_eq!(h.fake.submitted()[0].logprobs, Some(2));
    // Without the field: null, and nothing asked of the backend.
    let (_, v) = h
        .post("/v1/completions", &json!({"prompt": [65], "max_tokens": 1}))
        .await;
    assert!(v["choices"][0]["logprobs"].is_null());
    assert_eq!(h.fake.submitted()[1].logprobs, None);

    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "logprobs": true, "top_logprobs": 1});
    let (status, v) = h.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let prompt_len = h.fake.submitted()[2].prompt_ids.len();
    let ids = fake_ids(prompt_len, 3);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for (i, c) in content.iter().enumerate() {
        assert_eq!(c["token"], spell(ids[i]));
        assert_eq!(c["logprob"], json!(-((i + 1) as f32) / 8.0));
        assert_eq!(c["bytes"], json!(spell(ids[i]).as_bytes()));
        assert_eq!(c["top_logprobs"].as_array().unwrap().len(), 1);
    }
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let (status, events, done) = h.post_sse("/v1/chat/completions", &streamed).await;
    assert_eq!(status, StatusCode::OK);
    assert!(done);
    let per_chunk: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(per_chunk, *content);
}
