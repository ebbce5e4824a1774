//! The `tessera-encoder` binary as an operator runs it: it refuses a text-only model with a clear
//! error, and for a model with a vision tower (the `k25_tiny` fixture) it serves the worker
//! runtime (health, cluster-secret check, `Stats`, `/metrics` with its own encode metrics, drain
//! on SIGTERM) and encodes images, keeping the embeddings under handles until `Release`. Its
//! flags come from `TESSERA_*` env too.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tessera_prefill::runtime::ClusterToken;
use tessera_proto::health::pb::{health_client::HealthClient, HealthCheckRequest};
use tessera_proto::tonic::transport::Channel;
use tessera_proto::tonic::Code;
use tessera_proto::v1;
use tessera_proto::v1::encoder_worker_client::EncoderWorkerClient;

const SECRET: &str = "encoder-test";

fn text_only_fixture() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/kl_mixed"
    ))
}

/// The tiny Kimi-K2.5 fixture (vision tower, projector, Kimi Linear text model).
fn vision_model() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/k25_tiny"
    ))
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(vision_model().join("images").join(name)).unwrap()
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn encoder(model: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera-encoder"));
    c.arg("--model")
        .arg(model)
        .env("TESSERA_AUTH_SECRET", SECRET)
        .env("RUST_LOG", "warn");
    c
}

/// Waits for `child` to exit, killing it after `limit`.
fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn refuses_a_text_only_model_with_a_clear_error() {
    let mut child = encoder(&text_only_fixture())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(30));
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "started for a text-only model: {out}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("error: model `kl_mixed` has no vision tower")),
        "one error line names the model and says why: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.contains("TESSERA_READY"), "{out}");
}

/// One HTTP/1.0 GET; returns the body.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n").unwrap().1.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_the_worker_runtime_for_a_model_with_a_vision_tower() {
    let mut child = encoder(&vision_model())
        .args(["--metrics-listen", "127.0.0.1:0"])
        // Flags from the environment: the big WebP (134 KB) is over this limit.
        .env("TESSERA_MAX_IMAGE_BYTES", "100000")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut daemon = Daemon(child);
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("TESSERA_READY "))
        .expect("a ready line");
    let field = |k: &str| {
        ready
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_string()
    };
    assert_eq!(field("role"), "encoder");
    let (grpc, metrics) = (field("grpc"), field("metrics"));
    let channel = Channel::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    // Health is open; the encoder service needs the cluster secret.
    let st = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: "tessera.v1.EncoderWorker".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(st, 1, "SERVING");
    let refused = EncoderWorkerClient::new(channel.clone())
        .stats(v1::StatsRequest {})
        .await
        .expect_err("no secret, no stats");
    assert_eq!(refused.code(), Code::Unauthenticated);

    let mut client =
        EncoderWorkerClient::with_interceptor(channel, ClusterToken::new(SECRET).unwrap());
    let stats = client
        .stats(v1::StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let info = stats.info.unwrap();
    assert_eq!(info.role, v1::Role::Encoder as i32);
    assert_eq!(info.model_id, "k25_tiny");
    assert!(info.transfer_endpoint.starts_with("tcp://"));

    // Two images, kept here (no destination): one handle each, in order.
    let (png, jpg) = (image("rgb_84x56.png"), image("photo_60x50.jpg"));
    let encode = |id: &str, images: Vec<Vec<u8>>| v1::EncodeRequest {
        request_id: id.into(),
        images: images
            .into_iter()
            .map(|data| v1::ImageData {
                data,
                mime_type: String::new(),
            })
            .collect(),
        ..Default::default()
    };
    let reply = client
        .encode(encode("img", vec![png.clone(), jpg.clone()]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.handles.len(), 2);
    for (h, bytes) in reply.handles.iter().zip([&png, &jpg]) {
        assert_eq!((h.n_tokens, h.hidden), (6, 64), "{h:?}");
        assert_eq!(h.dtype, v1::Dtype::F32 as i32);
        assert_eq!(h.content_hash, Sha256::digest(bytes).to_vec());
        assert_eq!(h.holder_worker_id, info.worker_id);
        assert_eq!(h.holder_incarnation_id, info.incarnation_id);
    }
    // The same image again comes from the embedding cache.
    client
        .encode(encode("img2", vec![png.clone()]))
        .await
        .unwrap();

    // Bad images: INVALID_ARGUMENT with the reason; nothing is held for them.
    for (data, want) in [
        (b"not an image at all".to_vec(), "not recognised"),
        (png[..png.len() / 3].to_vec(), "cannot decode"),
        (image("big_300x200.webp"), "limit"),
        (Vec::new(), "empty"),
    ] {
        let e = client
            .encode(encode("bad", vec![png.clone(), data]))
            .await
            .expect_err("a bad image");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains("image 1") && e.message().contains(want),
            "{e:?}"
        );
    }
    let e = client
        .encode(v1::EncodeRequest::default())
        .await
        .expect_err("no image");
    assert_eq!(e.code(), Code::InvalidArgument);

    let held = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("tessera_embeddings_held{"))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    let m = metrics.clone();
    let text = tokio::task::spawn_blocking(move || http_get(&m, "/metrics"))
        .await
        .unwrap();
    assert_eq!(held(&text).as_deref(), Some("3"), "{text}");
    let release = |id: &str, handles: Vec<String>| v1::ReleaseEmbeddingsRequest {
        request_id: id.into(),
        handle_ids: handles,
        ..Default::default()
    };
    let first = reply.handles[0].handle_id.clone();
    let released = |r: v1::ReleaseEmbeddingsReply| r.released;
    assert_eq!(
        released(
            client
                .release(release("other", vec![first.clone()]))
                .await
                .unwrap()
                .into_inner()
        ),
        0,
        "another request's handle"
    );
    assert_eq!(
        released(
            client
                .release(release("img", vec![first.clone()]))
                .await
                .unwrap()
                .into_inner()
        ),
        1
    );
    assert_eq!(
        released(
            client
                .release(release("img", vec![first]))
                .await
                .unwrap()
                .into_inner()
        ),
        0,
        "idempotent"
    );
    assert_eq!(
        released(
            client
                .release(release("img", vec![]))
                .await
                .unwrap()
                .into_inner()
        ),
        1,
        "no handle named: all of the request's"
    );
    assert_eq!(
        released(
            client
                .release(release("img2", vec![]))
                .await
                .unwrap()
                .into_inner()
        ),
        1
    );

    let text = tokio::task::spawn_blocking(move || http_get(&metrics, "/metrics"))
        .await
        .unwrap();
    assert_eq!(held(&text).as_deref(), Some("0"), "{text}");
    // 3 encoded, then 4 requests with a good and a bad image (the good one from the cache).
    assert!(
        text.contains("tessera_encode_images_total{role=\"encoder\"} 11"),
        "{text}"
    );
    assert!(
        text.contains("tessera_encode_failures_total{role=\"encoder\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("tessera_encode_cache_hits_total{role=\"encoder\"} 5"),
        "{text}"
    );
    assert!(
        text.contains("tessera_encode_seconds_count{role=\"encoder\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("tessera_draining{role=\"encoder\"} 0"),
        "{text}"
    );

    // SIGTERM: a drain, then a clean exit.
    let pid = daemon.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = wait_exit(&mut daemon.0, Duration::from_secs(10));
    assert!(status.success(), "drained and exited: {status}");
}
