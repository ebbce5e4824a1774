//! A client that disconnects mid-stream cancels the backend request (over real TCP).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tessera_router::fake::{FakeBackend, FakeConfig};
use tessera_router::{FrontOptions, HttpFront};
use tessera_tokenizer::Tokenizer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::common::*;

fn request(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Read until `needle` appears in what the server sent (bounded).
async fn read_until(conn: &mut TcpStream, needle: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&got).contains(needle) {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .expect("server too slow")
            .unwrap();
        assert!(
            n > 0,
            "connection closed early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_backend() {
    let dir = tempfile::tempdir().unwrap();
    tessera_tokenizer::write_tiny_tokenizer(dir.path(), VOCAB).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let fake = Arc::new(FakeBackend::new(FakeConfig {
        token_delay: Duration::from_millis(5),
        ..fake_config()
    }));
    let front = HttpFront::new(fake.clone(), tok, None, vec![], FrontOptions::default());
    let metrics = front.metrics();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(front.serve(listener, async {
        let _ = stop_rx.await;
    }));

    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 3000, "stream": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 3000}),
        ),
    ] {
        let before = fake.cancelled();
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(request(path, &body.to_string()).as_bytes())
            .await
            .unwrap();
        if body["stream"] == json!(true) {
            let head = read_until(&mut conn, "data: ").await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(conn);
        for _ in 0..500 {
            if fake.cancelled() > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(fake.cancelled(), before + 1, "{path} {body}");
    }
    assert_eq!(fake.finished(), 0);
    assert_eq!(
        metrics.in_flight.load(std::sync::atomic::Ordering::SeqCst),
        0
    );

    // The server still answers.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    conn.write_all(request("/v1/completions", &body).as_bytes())
        .await
        .unwrap();
    let mut resp = String::new();
    conn.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"completion_tokens\":2"), "{resp}");

    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}
