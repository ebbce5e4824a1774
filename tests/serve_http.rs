//! `tessera serve` over HTTP: prefix-cache accounting, reference outputs, concurrency, streaming
//! and cancellation, as a client sees them.

use serde_json::{json, Value};

use crate::common::*;
use crate::server::{sse_events, KeyFile, Server};

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn completion(s: &Server, prompt: &[u32], max_tokens: usize) -> Value {
    let (st, r) = s.post_json(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(st, 200, "{r}");
    r
}

#[test]
fn prefix_hits_are_reported_in_cached_tokens() {
    let s = Server::start(
        &fixtures_dir().join("kl_mixed"),
        &["--page-tokens", "64", "--snapshot-interval", "64"],
    );
    let prompt: Vec<u32> = (0..300).map(|i| (i * 37 % 370) as u32 + 5).collect();
    let first = completion(&s, &prompt, 6);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = completion(&s, &prompt, 6);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        256
    );
    assert_eq!(
        first["choices"][0]["token_ids"],
        second["choices"][0]["token_ids"]
    );
    let mut shared = prompt[..150].to_vec();
    shared.extend((0..150).map(|i| (i * 11 % 370) as u32 + 5));
    let third = completion(&s, &shared, 6);
    assert_eq!(
        third["usage"]["prompt_tokens_details"]["cached_tokens"],
        128
    );
    assert!(s.metric("tessera_prefix_cache_hit_tokens_total") >= 384.0);
}

#[test]
fn greedy_outputs_equal_the_reference_sequentially_and_six_at_a_time() {
    let dir = fixtures_dir().join("kl_mixed");
    let refs = reference(&dir).prompts;
    let s = Server::start(&dir, &["--page-tokens", "64", "--snapshot-interval", "64"]);
    let mut sequential = Vec::new();
    for p in &refs {
        let r = completion(&s, &p.prompt_ids, p.greedy_ids.len());
        let got = ids(&r["choices"][0]["token_ids"]);
        assert_greedy_matches(&got, &p.greedy_ids, &p.greedy_margins, &p.name);
        sequential.push(got);
    }
    // Six at once (each reference prompt twice), on a server with a warm prefix cache.
    let jobs: Vec<usize> = (0..6).map(|i| i % refs.len()).collect();
    let concurrent: Vec<Vec<u32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = jobs
            .iter()
            .map(|&j| {
                let (s, p) = (&s, &refs[j]);
                sc.spawn(move || {
                    ids(
                        &completion(s, &p.prompt_ids, p.greedy_ids.len())["choices"][0]
                            ["token_ids"],
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (k, &j) in jobs.iter().enumerate() {
        assert_eq!(
            concurrent[k], sequential[j],
            "concurrent request {k} differs from the sequential one"
        );
    }
}

#[test]
fn streaming_carries_the_same_tokens_and_usage() {
    let dir = fixtures_dir().join("kl_mixed");
    let p = reference(&dir).prompts.into_iter().nth(1).unwrap();
    let s = Server::start(&dir, &[]);
    let plain = completion(&s, &p.prompt_ids, 8);
    let body = json!({"prompt": p.prompt_ids, "max_tokens": 8, "temperature": 0, "ignore_eos": true, "stream": true,
        "return_token_ids": true, "stream_options": {"include_usage": true}});
    let (st, text) = s.request("POST", "/v1/completions", Some(&body.to_string()));
    assert_eq!(st, 200);
    let events = sse_events(&text);
    let streamed: Vec<u32> = events
        .iter()
        .filter_map(|e| e["choices"].get(0).and_then(|c| c.get("token_ids")))
        .flat_map(ids)
        .collect();
    assert_eq!(streamed, ids(&plain["choices"][0]["token_ids"]));
    let text_streamed: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0).and_then(|c| c["text"].as_str()))
        .collect();
    assert_eq!(text_streamed, plain["choices"][0]["text"].as_str().unwrap());
    assert!(events.iter().any(|e| e["usage"]["completion_tokens"] == 8));
    assert!(text.trim_end().ends_with("data: [DONE]"));
}

#[test]
fn cancelled_streams_and_errors_leave_no_pages_behind() {
    let dir = fixtures_dir().join("kl_mixed");
    let s = Server::start(&dir, &["--no-prefix-cache", "--page-tokens", "16"]);
    let prompt: Vec<u32> = (0..120).map(|i| (i * 7 % 370) as u32 + 5).collect();
    for _ in 0..4 {
        s.stream_and_hang_up(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true}),
            2,
        );
    }
    // Bad requests in between must not disturb anything.
    let (st, _) = s.request("POST", "/v1/completions", Some("{not json"));
    assert_eq!(st, 400);
    let (st, _) = s.post_json(
        "/v1/completions",
        &json!({"prompt": [99999], "max_tokens": 2}),
    );
    assert_eq!(st, 400);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let used = s.metric("tessera_kv_pages_used");
        let running = s.metric("tessera_requests_running") + s.metric("tessera_requests_waiting");
        if used == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pages still used after cancellation: {used}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // And the server still answers correctly.
    let r = completion(&s, &prompt[..10], 3);
    assert_eq!(ids(&r["choices"][0]["token_ids"]).len(), 3);
}

/// `tessera serve --api-key-file … --rate-limit-… --max-…`: keys, limits and refusals as a
/// client sees them, then a normal request still gets the reference tokens.
#[test]
fn api_keys_rate_limit_and_request_limits_of_tessera_serve() {
    let dir = fixtures_dir().join("kl_mixed");
    let keys = KeyFile::new("# clients\nsk-serve-limited\nsk-serve-other\n");
    let s = Server::start(
        &dir,
        &[
            "--api-key-file",
            &keys.path,
            "--rate-limit-rps",
            "0.5",
            "--rate-limit-burst",
            "12",
            "--max-prompt-tokens",
            "64",
            "--max-body-bytes",
            "4096",
        ],
    );
    let send = |key: Option<&str>, method: &str, path: &str, body: Option<&str>| {
        s.request_as(key, method, path, body)
    };
    let error = |body: &str| -> Value {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        v["error"].clone()
    };
    // Open routes.
    assert_eq!(send(None, "GET", "/health", None).0, 200);
    assert_eq!(send(None, "GET", "/metrics", None).0, 200);
    // No key, a wrong key.
    let ok_body = json!({"prompt": [5, 6, 7], "max_tokens": 2}).to_string();
    for (key, code) in [
        (None, "missing_api_key"),
        (Some("sk-nope"), "invalid_api_key"),
    ] {
        for (method, path, body) in [
            ("POST", "/v1/completions", Some(ok_body.as_str())),
            ("GET", "/v1/models", None),
        ] {
            let (st, head, body) = send(key, method, path, body);
            assert_eq!(st, 401, "{key:?} {path}: {body}");
            assert_eq!(error(&body)["code"], code);
            assert!(head
                .to_ascii_lowercase()
                .contains("www-authenticate: bearer"));
        }
    }
    // Limits and validation, with a right key.
    let other = Some("sk-serve-other");
    let long_prompt = json!({"prompt": vec![5; 65], "max_tokens": 1}).to_string();
    let big_body = json!({"prompt": "x".repeat(5000)}).to_string();
    let cases: [(&str, u16, Option<&str>, &str); 6] = [
        (
            &long_prompt,
            400,
            Some("context_length_exceeded"),
            "at most 64 tokens",
        ),
        (&big_body, 413, Some("request_too_large"), "too large"),
        (r#"{"prompt": [5], "n": 17}"#, 400, None, "got 17"),
        (
            r#"{"prompt": [5], "model": "gpt-x"}"#,
            404,
            Some("model_not_found"),
            "gpt-x",
        ),
        (r#"{"prompt": [5],, }"#, 400, None, "at line 1 column 16"),
        (r#"{"prompt": [5], "top_p": -1}"#, 400, None, "top_p"),
    ];
    for (body, status, code, says) in cases {
        let (st, _, text) = send(other, "POST", "/v1/completions", Some(body));
        assert_eq!(st, status, "{text}");
        let e = error(&text);
        assert_eq!(e["code"].as_str(), code, "{text}");
        assert!(e["message"].as_str().unwrap().contains(says), "{text}");
    }
    // A normal request still gets the reference's greedy tokens.
    let p = reference(&dir).prompts.into_iter().nth(1).unwrap();
    let body = json!({"prompt": p.prompt_ids, "max_tokens": p.greedy_ids.len(), "temperature": 0,
        "ignore_eos": true, "return_token_ids": true});
    let (st, _, text) = send(other, "POST", "/v1/completions", Some(&body.to_string()));
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let got = ids(&v["choices"][0]["token_ids"]);
    assert_greedy_matches(&got, &p.greedy_ids, &p.greedy_margins, &p.name);

    // The burst of one key, then 429 with Retry-After, then recovery after waiting.
    let limited = Some("sk-serve-limited");
    for i in 0..12 {
        let (st, _, text) = send(limited, "GET", "/v1/models", None);
        assert_eq!(st, 200, "request {i}: {text}");
    }
    let (st, head, text) = send(limited, "GET", "/v1/models", None);
    assert_eq!(st, 429, "{text}");
    assert_eq!(error(&text)["type"], "rate_limit_error");
    let retry: u64 = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("retry-after: ")
                .map(str::to_string)
        })
        .expect("a Retry-After header")
        .trim()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry), "Retry-After {retry}");
    // The other key is not held back.
    assert_eq!(send(other, "GET", "/v1/models", None).0, 200);
    std::thread::sleep(std::time::Duration::from_secs(retry));
    assert_eq!(send(limited, "GET", "/v1/models", None).0, 200);

    let (_, _, metrics) = send(None, "GET", "/metrics", None);
    for line in [
        "tessera_http_refused_requests_total{status=\"401\",reason=\"missing_api_key\"} 2",
        "tessera_http_refused_requests_total{status=\"401\",reason=\"invalid_api_key\"} 2",
        "tessera_http_refused_requests_total{status=\"429\",reason=\"rate_limit_exceeded\"} 1",
        "tessera_http_refused_requests_total{status=\"413\",reason=\"request_too_large\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
}

#[test]
fn each_of_several_choices_equals_a_request_alone_with_its_seed() {
    let dir = fixtures_dir().join("kl_mixed");
    let p = reference(&dir).prompts.into_iter().next().unwrap();
    let s = Server::start(&dir, &[]);
    let body = |n: usize, seed: u64, stream: bool| {
        let mut b = json!({"prompt": p.prompt_ids, "max_tokens": 8, "temperature": 1.0,
            "seed": seed, "n": n, "ignore_eos": true, "return_token_ids": true});
        if stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    };
    let alone: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            let (st, r) = s.post_json("/v1/completions", &body(1, 40 + i, false));
            assert_eq!(st, 200, "{r}");
            ids(&r["choices"][0]["token_ids"])
        })
        .collect();
    assert!(
        alone[0] != alone[1] || alone[1] != alone[2],
        "three seeds drew the same tokens: {alone:?}"
    );

    let (st, r) = s.post_json("/v1/completions", &body(3, 40, false));
    assert_eq!(st, 200, "{r}");
    let together: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            assert_eq!(r["choices"][i]["index"], i);
            ids(&r["choices"][i]["token_ids"])
        })
        .collect();
    assert_eq!(together, alone);
    assert_eq!(r["usage"]["prompt_tokens"], p.prompt_ids.len());
    assert_eq!(r["usage"]["completion_tokens"], 24);

    let (st, text) = s.request(
        "POST",
        "/v1/completions",
        Some(&body(3, 40, true).to_string()),
    );
    assert_eq!(st, 200);
    let events = sse_events(&text);
    let streamed: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            events
                .iter()
                .filter_map(|e| e["choices"].as_array()?.iter().find(|c| c["index"] == i))
                .filter_map(|c| c.get("token_ids"))
                .flat_map(ids)
                .collect()
        })
        .collect();
    assert_eq!(streamed, alone);
    let usage: Vec<&Value> = events
        .iter()
        .map(|e| &e["usage"])
        .filter(|u| !u.is_null())
        .collect();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0]["completion_tokens"], 24);
    assert!(text.trim_end().ends_with("data: [DONE]"));
}

#[test]
fn logit_bias_and_penalties_steer_the_engine() {
    let dir = fixtures_dir().join("kl_mixed");
    let p = reference(&dir).prompts.into_iter().next().unwrap();
    let s = Server::start(&dir, &[]);
    let greedy = |extra: Value| {
        let mut b = json!({"prompt": p.prompt_ids, "max_tokens": 6, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (st, r) = s.post_json("/v1/completions", &b);
        assert_eq!(st, 200, "{r}");
        ids(&r["choices"][0]["token_ids"])
    };
    // A bias of 100 makes its token the greedy choice every time, and a presence penalty of 2
    // cannot undo it; -100 on the unbiased run's first token keeps it out of the output.
    assert_eq!(greedy(json!({"logit_bias": {"42": 100}})), vec![42; 6]);
    let plain = greedy(json!({}));
    let banned = greedy(json!({"logit_bias": {plain[0].to_string(): -100}}));
    assert_ne!(banned[0], plain[0]);
    assert!(!banned.contains(&plain[0]));
    assert_eq!(
        greedy(json!({"logit_bias": {"42": 100}, "presence_penalty": 2})),
        vec![42; 6]
    );
}

#[test]
fn logprobs_equal_the_reference_log_softmax() {
    let dir = fixtures_dir().join("kl_mixed");
    let s = Server::start(&dir, &[]);
    for p in reference(&dir).prompts {
        // The first generated token's distribution is the softmax of the reference's logits at
        // the prompt's last position.
        let (shape, logits) = tessera_engine::npy::read_f32(&dir.join(&p.logits_file)).unwrap();
        let vocab = shape[1];
        let last = &logits[(shape[0] - 1) * vocab..];
        let max = last.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
        let lse = max
            + last
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let mut want: Vec<f64> = last.iter().map(|&l| l as f64 - lse).collect();

        let (st, r) = s.post_json(
            "/v1/completions",
            &json!({"prompt": p.prompt_ids, "max_tokens": 3, "temperature": 1.0, "seed": 5,
                "logprobs": 5, "return_token_ids": true, "ignore_eos": true}),
        );
        assert_eq!(st, 200, "{r}");
        let c = &r["choices"][0];
        let first = ids(&c["token_ids"])[0] as usize;
        let got = c["logprobs"]["token_logprobs"][0].as_f64().unwrap();
        assert!(
            (got - want[first]).abs() < 1e-4,
            "{}: token {first}: {got} against {}",
            p.name,
            want[first]
        );
        let mut top: Vec<f64> = c["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        top.sort_by(|a, b| b.total_cmp(a));
        want.sort_by(|a, b| b.total_cmp(a));
        // Alternatives whose texts coincide are listed once, so compare the likeliest.
        assert!(!top.is_empty());
        assert!((top[0] - want[0]).abs() < 1e-4, "{}: {top:?}", p.name);
        assert_eq!(
            c["logprobs"]["tokens"].as_array().unwrap().len(),
            3,
            "one entry per token"
        );
    }
}
