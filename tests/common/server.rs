//! A `tessera serve` child process on a free loopback port, and a minimal HTTP/1.1 client
//! (requests are tiny and local; a full client library would only add build time).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Server {
    child: Child,
    pub addr: String,
    _model_copy: tempfile::TempDir,
}

/// The reference fixtures carry no tokenizer: serve a copy with the tiny Kimi-style one added.
fn with_tokenizer(model: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(model).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    tessera_engine::tokenizer::tiny::write_tiny_tokenizer(dir.path(), vocab).unwrap();
    dir
}

impl Server {
    /// `tessera serve` on a free port.
    pub fn start(model: &Path, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "--port", "0"];
        args.extend_from_slice(extra);
        Self::launch(model, &args)
    }

    /// `tessera <args> --model <copy of model>`; returns once it prints its `http://` address.
    pub fn launch(model: &Path, args: &[&str]) -> Server {
        let copy = with_tokenizer(model);
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(args)
            .arg("--model")
            .arg(copy.path())
            .env("TESSERA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("tessera starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines.next().expect("tessera printed its address").unwrap();
            if let Some(rest) = line.split("http://").nth(1) {
                let url = rest.split_whitespace().next().unwrap();
                break url.trim_end_matches("/v1").to_string();
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            addr,
            _model_copy: copy,
        }
    }

    /// Sends SIGTERM and waits; returns how long the process took to exit.
    pub fn terminate(mut self) -> Duration {
        let start = std::time::Instant::now();
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        start.elapsed()
    }

    /// Sends one request; returns (status, body).
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n").expect("an HTTP response");
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        (status, body)
    }

    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (st, text) = self.request("POST", path, Some(&body.to_string()));
        (
            st,
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON ({st}): {text}")),
        )
    }

    /// Starts a streamed request and reads only `events` SSE events, then drops the connection.
    pub fn stream_and_hang_up(&self, path: &str, body: &serde_json::Value, events: usize) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        let body = body.to_string();
        write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let mut r = BufReader::new(s);
        let mut seen = 0;
        let mut line = String::new();
        while seen < events {
            line.clear();
            if r.read_line(&mut line).unwrap() == 0 {
                break;
            }
            if line.contains("data: ") {
                seen += 1;
            }
        }
    }

    /// A Prometheus sample from `/metrics` (the first line starting with `name`).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", None);
        text.lines()
            .filter(|l| l.starts_with(name))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The `data:` payloads of an SSE body, `[DONE]` excluded.
pub fn sse_events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}
