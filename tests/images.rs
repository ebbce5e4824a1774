//! Images in `/v1/chat/completions` (`image_url` parts with `data:` URLs), through `tessera
//! serve` and through `tessera up` (router, encoder, prefill and decode daemons as separate
//! processes): greedy tokens equal the `transformers` references of the `k25_tiny` fixture,
//! plain and streamed; two different images after the same text never share cached pages; bad
//! images get a 400 with the reason; embedding buffers return to zero on every path (consumed,
//! cancelled, expired, released).
//!
//! The fixture has no tokenizer: the test adds a word-level one whose word `tN` is token `N`,
//! and a chat template that writes text parts as they are and an image part as `t7` (the
//! model's `image_token_id`), so a chat request spells the fixture's prompt exactly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;
use crate::server::{http_request, metric_sum, sse_events, Server};

const SECRET: &str = "images-test-secret";

fn fixture() -> PathBuf {
    fixtures_dir().join("k25_tiny")
}

fn mm_reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("mm_reference.json")).unwrap())
        .unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// A copy of the fixture with the word-level tokenizer and chat template described above.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(), dir.path());
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    let vocab_size = cfg["text_config"]["vocab_size"].as_u64().unwrap();
    let image = cfg["image_token_id"].as_u64().unwrap();
    let vocab: serde_json::Map<String, Value> = (0..vocab_size)
        .map(|i| (format!("t{i}"), json!(i)))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = format!(
        "{{% for m in messages %}}{{% if m.content is string %}}{{{{ m.content }}}} \
         {{% else %}}{{% for p in m.content %}}{{% if p.type == 'text' %}}{{{{ p.text }}}} \
         {{% else %}}t{image} {{% endif %}}{{% endfor %}}{{% endif %}}{{% endfor %}}"
    );
    let config = json!({"chat_template": template, "eos_token": "t2"});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// CRC-32 (IEEE) of `bytes`, as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn image_bytes(name: &str) -> Vec<u8> {
    let r = mm_reference();
    let file = r["images"][name]["file"].as_str().unwrap();
    std::fs::read(fixture().join(file)).unwrap()
}

fn data_url(bytes: &[u8], mime: &str) -> String {
    format!("data:{mime};base64,{}", base64(bytes))
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// The chat content that spells `prompt` (runs of the placeholder are images, in order).
fn content(prompt: &[u32], placeholder: u32, urls: &[String]) -> Vec<Value> {
    let mut parts = Vec::new();
    let mut words = Vec::new();
    let mut urls = urls.iter();
    let mut i = 0;
    while i < prompt.len() {
        if prompt[i] == placeholder {
            if !words.is_empty() {
                parts.push(json!({"type": "text", "text": words.join(" ")}));
                words.clear();
            }
            parts.push(image_part(
                urls.next().expect("an image per placeholder run"),
            ));
            while i < prompt.len() && prompt[i] == placeholder {
                i += 1;
            }
        } else {
            words.push(format!("t{}", prompt[i]));
            i += 1;
        }
    }
    if !words.is_empty() {
        parts.push(json!({"type": "text", "text": words.join(" ")}));
    }
    parts
}

struct Case {
    name: String,
    prompt: Vec<u32>,
    images: Vec<String>,
    greedy: Vec<u32>,
    margins: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let r = mm_reference();
    r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Case {
            name: p["name"].as_str().unwrap().into(),
            prompt: serde_json::from_value(p["prompt_ids"].clone()).unwrap(),
            images: serde_json::from_value(p["images"].clone()).unwrap(),
            greedy: serde_json::from_value(p["greedy_ids"].clone()).unwrap(),
            margins: serde_json::from_value(p["greedy_margins"].clone()).unwrap(),
        })
        .collect()
}

fn placeholder() -> u32 {
    mm_reference()["placeholder_token_id"].as_u64().unwrap() as u32
}

fn chat_body(prompt: &[u32], urls: &[String], n: usize, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": content(prompt, placeholder(), urls)}],
        "max_tokens": n, "temperature": 0, "ignore_eos": true, "return_token_ids": true,
        "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
    })
}

/// Generated ids and usage of one chat request.
fn chat(s: &Server, body: &Value) -> (Vec<u32>, Value) {
    if body["stream"] == json!(true) {
        let (st, text) = s.request("POST", "/v1/chat/completions", Some(&body.to_string()));
        assert_eq!(st, 200, "{text}");
        let events = sse_events(&text);
        let ids = events
            .iter()
            .filter_map(|e| e["choices"].get(0).and_then(|c| c.get("token_ids")))
            .flat_map(|v| serde_json::from_value::<Vec<u32>>(v.clone()).unwrap())
            .collect();
        let usage = events.iter().rev().find(|e| !e["usage"].is_null()).unwrap()["usage"].clone();
        (ids, usage)
    } else {
        let (st, r) = s.post_json("/v1/chat/completions", body);
        assert_eq!(st, 200, "{r}");
        (
            serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap(),
            r["usage"].clone(),
        )
    }
}

fn urls(c: &Case) -> Vec<String> {
    c.images
        .iter()
        .map(|n| {
            let b = image_bytes(n);
            let mime = if n.starts_with("big") {
                "image/webp"
            } else {
                ""
            };
            data_url(&b, mime)
        })
        .collect()
}

/// Every fixture prompt, plain and streamed, equals the reference.
fn check_references(s: &Server) {
    for c in cases() {
        for stream in [false, true] {
            let body = chat_body(&c.prompt, &urls(&c), c.greedy.len(), stream);
            let (got, usage) = chat(s, &body);
            assert_greedy_matches(
                &got,
                &c.greedy,
                &c.margins,
                &format!("{} stream={stream}", c.name),
            );
            assert_eq!(got.len(), c.greedy.len(), "{}", c.name);
            assert_eq!(
                usage["prompt_tokens"],
                json!(c.prompt.len()),
                "{}: {usage}",
                c.name
            );
        }
    }
}

/// Same text, another image of the same size: no cached page may cover the image; the same
/// image again hits past it.
fn check_cache_isolation(s: &Server) {
    let c = &cases()[0];
    let first = c.prompt.iter().position(|&t| t == placeholder()).unwrap();
    let other = vec![data_url(&image_bytes("rgba_70x45"), "image/png")];
    let cached = |usage: &Value| {
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize
    };
    let body_a = chat_body(&c.prompt, &urls(c), c.greedy.len(), false);
    let (a, _) = chat(s, &body_a);
    assert_greedy_matches(&a, &c.greedy, &c.margins, "image A");
    // Image B was never sent: nothing past the text before the image may come from A's pages.
    let body_b = chat_body(&c.prompt, &other, c.greedy.len(), false);
    let (b, usage) = chat(s, &body_b);
    assert!(
        cached(&usage) <= first,
        "image B reused {} cached tokens, the image starts at {first}",
        cached(&usage)
    );
    assert_ne!(b, a, "another image, another answer");
    // B again hits its own pages, and answers the same.
    let (b2, usage) = chat(s, &body_b);
    assert!(cached(&usage) > first + 6, "{usage}");
    assert_eq!(b2, b);
    let (a2, usage) = chat(s, &body_a);
    assert_eq!(a2, a);
    assert!(
        cached(&usage) > first + 6,
        "image A again reuses its pages past the image: {usage}"
    );
}

/// Bad images: 400 with the reason, the server keeps serving.
fn check_bad_images(s: &Server) {
    let c = &cases()[0];
    let png = image_bytes("rgb_84x56");
    let mut big = vec![0u8; 300_000];
    big[..png.len()].copy_from_slice(&png);
    let cases: Vec<(String, &str)> = vec![
        (data_url(b"certainly not an image", "image/png"), "image"),
        (data_url(&png[..png.len() / 2], "image/png"), "image"),
        (data_url(&png[..20], "image/png"), "image"),
        ("data:image/png;base64,".into(), "empty"),
        (data_url(&big, "image/png"), "limit"),
        ("https://example.com/cat.png".into(), "not fetched"),
        ("http://127.0.0.1:1/x.png".into(), "not fetched"),
        (data_url(b"hello", "text/plain"), "not an image type"),
    ];
    for (url, want) in cases {
        let body = chat_body(&c.prompt, std::slice::from_ref(&url), 2, false);
        let (st, r) = s.post_json("/v1/chat/completions", &body);
        assert_eq!(st, 400, "{}: {r}", &url[..url.len().min(60)]);
        let msg = r["error"]["message"].as_str().unwrap().to_ascii_lowercase();
        assert!(msg.contains(want), "{}: {msg}", &url[..url.len().min(60)]);
    }
    // A zero-size image: a PNG whose header declares 0×0 (with a valid checksum).
    let mut zero = png.clone();
    zero[16..24].copy_from_slice(&[0; 8]);
    let crc = crc32(&zero[12..29]);
    zero[29..33].copy_from_slice(&crc.to_be_bytes());
    let (st, r) = s.post_json(
        "/v1/chat/completions",
        &chat_body(&c.prompt, &[data_url(&zero, "image/png")], 2, false),
    );
    assert_eq!(st, 400, "{r}");
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("dimensions") || msg.contains("zero size"),
        "{msg}"
    );
    // A placeholder typed as text: the prompt has more placeholders than images.
    let mut body = chat_body(&c.prompt, &urls(c), 2, false);
    body["messages"][0]["content"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "text", "text": format!("t1 t{}", placeholder())}));
    let (st, r) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(st, 400, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("placeholder"),
        "{r}"
    );
    // Still serving.
    let (got, _) = chat(s, &chat_body(&c.prompt, &urls(c), c.greedy.len(), false));
    assert_greedy_matches(&got, &c.greedy, &c.margins, "after the bad images");
}

#[test]
fn serve_takes_images_from_data_urls() {
    let s = Server::launch_prepared(
        model_dir(),
        &[
            "serve",
            "--port",
            "0",
            "--page-tokens",
            "4",
            "--snapshot-interval",
            "4",
            "--max-image-bytes",
            "200000",
        ],
        None,
    );
    check_references(&s);
    check_cache_isolation(&s);
    check_bad_images(&s);
}

/// A loopback HTTP server: `/cat.png` is the fixture's PNG, `/moved` redirects to it on another
/// host name, anything else is 404.
fn image_host() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let png = image_bytes("rgb_84x56");
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 2048];
            let n = s.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).to_string();
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let mut out = match path {
                "/cat.png" => format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\n\r\n",
                    png.len()
                )
                .into_bytes(),
                "/moved" => format!(
                    "HTTP/1.1 302 Found\r\nlocation: http://localhost:{port}/cat.png\r\n\
                     content-length: 0\r\n\r\n"
                )
                .into_bytes(),
                _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
            };
            if path == "/cat.png" {
                out.extend_from_slice(&png);
            }
            let _ = s.write_all(&out);
        }
    });
    addr
}

#[test]
fn serve_fetches_image_urls_from_allowed_hosts_only() {
    let host = image_host();
    let s = Server::launch_prepared(
        model_dir(),
        &["serve", "--port", "0", "--allowed-image-hosts", "127.0.0.1"],
        None,
    );
    let c = &cases()[0];
    let url = format!("http://{host}/cat.png");
    let (got, _) = chat(&s, &chat_body(&c.prompt, &[url], c.greedy.len(), false));
    assert_greedy_matches(&got, &c.greedy, &c.margins, "the image fetched by URL");
    let port = host.rsplit(':').next().unwrap();
    for (url, want) in [
        (
            format!("http://localhost:{port}/cat.png"),
            "not an allowed image host",
        ),
        (format!("http://{host}/moved"), "redirects are not followed"),
        (format!("http://{host}/nothing.png"), "404"),
        (format!("http://user:pw@{host}/cat.png"), "credentials"),
        (format!("ftp://{host}/cat.png"), "data url"),
    ] {
        let (st, r) = s.post_json(
            "/v1/chat/completions",
            &chat_body(&c.prompt, std::slice::from_ref(&url), 2, false),
        );
        assert_eq!(st, 400, "{url}: {r}");
        let msg = r["error"]["message"].as_str().unwrap().to_ascii_lowercase();
        assert!(msg.contains(want), "{url}: {msg}");
    }
}

/// The worker `role`'s metrics address from `tessera up`'s banner.
fn metrics_of(s: &Server, role: &str) -> String {
    let prefix = format!("tessera up: {role} ready, gRPC at ");
    let line = s
        .banner
        .iter()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {role} in {:?}", s.banner));
    line.split("metrics at ")
        .nth(1)
        .unwrap()
        .trim_end_matches(')')
        .to_string()
}

fn grpc_of(s: &Server, role: &str) -> String {
    let prefix = format!("tessera up: {role} ready, gRPC at ");
    s.banner
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {role} in {:?}", s.banner))
        .to_string()
}

fn worker_metric(addr: &str, name: &str) -> f64 {
    let (st, text) = http_request(addr, "GET", "/metrics", None);
    assert_eq!(st, 200);
    metric_sum(&text, name)
}

/// Waits until `f` holds (metrics settle after a response is sent).
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_cluster_takes_images_through_an_encoder_worker() {
    let _cluster = crate::cluster_beside_others();
    let s = Server::launch_prepared(
        model_dir(),
        &[
            "up",
            "--port",
            "0",
            "--snapshot-interval",
            "16",
            "--max-image-bytes",
            "200000",
        ],
        Some(SECRET),
    );
    let (encoder, prefill) = (metrics_of(&s, "encoder-0"), metrics_of(&s, "prefill-0"));
    check_references(&s);
    check_cache_isolation(&s);
    let encoded = worker_metric(&encoder, "tessera_encode_images_total");
    assert!(encoded >= 6.0, "the encoder encoded the images: {encoded}");
    assert!(worker_metric(&encoder, "tessera_encode_seconds_count") >= 1.0);
    check_bad_images(&s);
    assert!(worker_metric(&encoder, "tessera_encode_failures_total") >= 3.0);
    eventually("the prefill worker holds no embedding buffer", || {
        worker_metric(&prefill, "tessera_embedding_buffers") == 0.0
    });
    assert!(worker_metric(&prefill, "tessera_embedding_buffers_consumed_total") >= 6.0);
    // A client that hangs up mid-stream leaves nothing behind either.
    let c = &cases()[1];
    s.stream_and_hang_up(
        "/v1/chat/completions",
        &chat_body(&c.prompt, &urls(c), 64, true),
        2,
    );
    eventually("buffers freed after a cancelled request", || {
        worker_metric(&prefill, "tessera_embedding_buffers") == 0.0
    });
    release_paths(&s);
    let took = s.terminate();
    assert!(took.as_secs() <= 12, "tessera up took {took:?} to stop");
}

/// With `--transport ucx` the encoder speaks the prefill workers' transport: embeddings and
/// pages both move over UCX, and the answers are the fixture's.
#[cfg(feature = "ucx")]
#[test]
fn the_cluster_takes_images_over_ucx() {
    let _cluster = crate::cluster_beside_others();
    let s = Server::launch_prepared(
        model_dir(),
        &["up", "--port", "0", "--transport", "ucx"],
        Some(SECRET),
    );
    let (encoder, prefill) = (metrics_of(&s, "encoder-0"), metrics_of(&s, "prefill-0"));
    check_references(&s);
    assert!(worker_metric(&encoder, "tessera_encode_images_total") >= 3.0);
    eventually("the prefill worker holds no embedding buffer", || {
        worker_metric(&prefill, "tessera_embedding_buffers") == 0.0
    });
    s.terminate();
}

fn pid_of(s: &Server, role: &str) -> u32 {
    let prefix = format!("tessera up: {role} ready, gRPC at ");
    s.banner
        .iter()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.split("(pid ").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no {role} pid in {:?}", s.banner))
}

#[test]
fn encoders_take_images_by_hash_and_stand_in_for_each_other() {
    let _cluster = crate::cluster_beside_others();
    let s = Server::launch_prepared(
        model_dir(),
        &["up", "--port", "0", "--encoders", "2"],
        Some(SECRET),
    );
    let encoders = [metrics_of(&s, "encoder-0"), metrics_of(&s, "encoder-1")];
    let total = |name: &str| -> f64 { encoders.iter().map(|e| worker_metric(e, name)).sum() };
    let c = &cases()[0];
    let names = ["rgb_84x56", "rgba_70x45", "photo_60x50"];
    let body = |name: &str| {
        let url = data_url(&image_bytes(name), "");
        chat_body(&c.prompt, &[url], 4, false)
    };
    let answers: Vec<Vec<u32>> = names.iter().map(|n| chat(&s, &body(n)).0).collect();
    for (name, want) in names.iter().zip(&answers) {
        assert_eq!(&chat(&s, &body(name)).0, want, "{name} again");
    }
    // Each image went to the encoder its hash prefers: encoded once, then served from there.
    assert_eq!(total("tessera_encode_images_total"), 6.0);
    assert_eq!(total("tessera_encode_seconds_count"), 3.0);
    assert_eq!(total("tessera_encode_cache_hits_total"), 3.0);
    // The encoder that took most images dies: the other encodes them, the answers stay the same.
    let busy = (0..2)
        .max_by_key(|&i| worker_metric(&encoders[i], "tessera_encode_images_total") as u64)
        .unwrap();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid_of(&s, &format!("encoder-{busy}")).to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    for (name, want) in names.iter().zip(&answers) {
        let (got, _) = chat(&s, &body(name));
        assert_eq!(&got, want, "{name} after encoder-{busy} died");
    }
    let full = chat(&s, &chat_body(&c.prompt, &urls(c), c.greedy.len(), false)).0;
    assert_greedy_matches(&full, &c.greedy, &c.margins, "after an encoder died");
}

/// Embeddings an encoder pushed are freed by the prefill worker's `Cancel` and by their TTL;
/// those it keeps (no destination) by `Release` and by their TTL.
fn release_paths(s: &Server) {
    use tessera_prefill::runtime::ClusterToken;
    use tessera_proto::tonic::transport::Channel;
    use tessera_proto::v1;
    use tessera_proto::v1::encoder_worker_client::EncoderWorkerClient;
    use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;

    let (encoder_grpc, prefill_grpc) = (grpc_of(s, "encoder-0"), grpc_of(s, "prefill-0"));
    let (encoder, prefill) = (metrics_of(s, "encoder-0"), metrics_of(s, "prefill-0"));
    let image = v1::ImageData {
        data: image_bytes("rgb_84x56"),
        mime_type: "image/png".into(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let token = ClusterToken::new(SECRET).unwrap();
        let ch = |a: &str| {
            Channel::from_shared(format!("http://{a}"))
                .unwrap()
                .connect_lazy()
        };
        let mut enc = EncoderWorkerClient::with_interceptor(ch(&encoder_grpc), token.clone());
        let mut pre = PrefillWorkerClient::with_interceptor(ch(&prefill_grpc), token);
        let dest = v1::EmbeddingDestination {
            prefill_grpc_address: prefill_grpc.clone(),
            ..Default::default()
        };
        let encode =
            |id: &str, dest: Option<v1::EmbeddingDestination>, ttl_ms: u32| v1::EncodeRequest {
                request_id: id.into(),
                images: vec![image.clone()],
                destination: dest,
                ttl_ms,
                ..Default::default()
            };
        // Pushed, then cancelled on the prefill worker.
        let r = enc
            .encode(encode("r1", Some(dest.clone()), 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.handles.len(), 1);
        assert_eq!(r.handles[0].n_tokens, 6);
        assert_eq!(worker_metric(&prefill, "tessera_embedding_buffers"), 1.0);
        let cancel = v1::CancelRequest {
            request_id: "r1".into(),
            ..Default::default()
        };
        pre.cancel(cancel).await.unwrap();
        assert_eq!(worker_metric(&prefill, "tessera_embedding_buffers"), 0.0);
        // Pushed, never consumed: its TTL frees it.
        enc.encode(encode("r2", Some(dest), 300)).await.unwrap();
        assert_eq!(worker_metric(&prefill, "tessera_embedding_buffers"), 1.0);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(worker_metric(&prefill, "tessera_embedding_buffers"), 0.0);
        assert_eq!(
            worker_metric(&prefill, "tessera_embedding_buffers_expired_total"),
            1.0
        );
        // Kept on the encoder: released, or expired.
        let r = enc
            .encode(encode("r3", None, 0))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.handles[0].holder_worker_id, "encoder-0");
        assert_eq!(worker_metric(&encoder, "tessera_embeddings_held"), 1.0);
        let release = v1::ReleaseEmbeddingsRequest {
            request_id: "r3".into(),
            handle_ids: vec![r.handles[0].handle_id.clone()],
            ..Default::default()
        };
        assert_eq!(enc.release(release).await.unwrap().into_inner().released, 1);
        assert_eq!(worker_metric(&encoder, "tessera_embeddings_held"), 0.0);
        enc.encode(encode("r4", None, 300)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(worker_metric(&encoder, "tessera_embeddings_held"), 0.0);
        // A bad image is INVALID_ARGUMENT with the reason.
        let bad = v1::EncodeRequest {
            images: vec![v1::ImageData {
                data: b"GIF89a nope".to_vec(),
                mime_type: String::new(),
            }],
            ..encode("r5", None, 0)
        };
        let e = enc.encode(bad).await.unwrap_err();
        assert_eq!(
            e.code(),
            tessera_proto::tonic::Code::InvalidArgument,
            "{e:?}"
        );
    });
}

/// The official `openai` Python client sends an image as a data URL and gets a completion
/// (`tests/openai_client/check_openai.py --image`), through `tessera up`. Needs the client's
/// virtual environment (`target/py-venv`, which `scripts/test.sh` makes, or
/// `TESSERA_OPENAI_PYTHON`).
#[test]
fn the_openai_client_sends_an_image() {
    let _cluster = crate::cluster_beside_others();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("TESSERA_OPENAI_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/py-venv/bin/python"));
    if !python.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no Python with the openai client at {}: scripts/test.sh creates it",
            python.display()
        );
        eprintln!(
            "skipped: no Python with the openai client at {} (run scripts/test.sh)",
            python.display()
        );
        return;
    }
    let s = Server::launch_prepared(model_dir(), &["up", "--port", "0"], None);
    let out = std::process::Command::new(&python)
        .arg(root.join("tests/openai_client/check_openai.py"))
        .args([
            "--base-url",
            &format!("http://{}/v1", s.addr),
            "--multimodal",
            "--max-tokens",
            "8",
        ])
        .arg("--image")
        .arg(fixture().join("images/rgb_84x56.png"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("ok    chat with an image"), "{text}");
}
