//! The `tessera-encoder` binary as an operator runs it: it refuses a text-only model with a clear
//! error, and for a model that declares a vision tower it serves the worker runtime (health,
//! cluster-secret check, `Stats`, `/metrics`, drain on SIGTERM) with `Encode` answering
//! UNIMPLEMENTED.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// A model directory whose config declares a vision tower (the tower's weights are not needed:
/// the encoder cannot run one yet).
fn vision_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-vl");
    std::fs::create_dir(&model).unwrap();
    let config = serde_json::json!({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_linear", "vocab_size": 384, "hidden_size": 64},
        "vision_config": {"hidden_size": 32, "patch_size": 14, "num_hidden_layers": 2},
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model
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
    let tmp = tempfile::tempdir().unwrap();
    let mut child = encoder(&vision_model(tmp.path()))
        .args(["--metrics-listen", "127.0.0.1:0"])
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
    assert_eq!(info.model_id, "tiny-vl");
    assert!(info.transfer_endpoint.starts_with("tcp://"));

    let e = client
        .encode(v1::EncodeRequest {
            request_id: "img".into(),
            images: vec![v1::ImageData {
                data: vec![0x89, b'P', b'N', b'G'],
                mime_type: "image/png".into(),
            }],
            ..Default::default()
        })
        .await
        .expect_err("no vision tower to run");
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    assert!(
        e.message()
            .contains("vision tower of model `tiny-vl` (kimi_k25)"),
        "{e:?}"
    );
    let e = client
        .encode(v1::EncodeRequest::default())
        .await
        .expect_err("no image");
    assert_eq!(e.code(), Code::InvalidArgument);
    let released = client
        .release(v1::ReleaseEmbeddingsRequest {
            request_id: "img".into(),
            handle_ids: vec!["h0".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .released;
    assert_eq!(released, 0);

    let text = tokio::task::spawn_blocking(move || http_get(&metrics, "/metrics"))
        .await
        .unwrap();
    assert!(
        text.contains("tessera_encode_images_total{role=\"encoder\"} 1"),
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
