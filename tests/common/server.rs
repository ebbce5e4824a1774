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
    /// What the process printed before its address.
    pub banner: Vec<String>,
    _model_copy: tempfile::TempDir,
}

/// The reference fixtures carry no tokenizer: serve a copy with the tiny Kimi-style one added.
pub fn with_tokenizer(model: &Path) -> tempfile::TempDir {
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
        Self::launch_prepared(with_tokenizer(model), args, None)
    }

    /// `tessera <args> --model <copy>` for a model directory the caller prepared; with
    /// `secret`, the cluster secret `tessera up` gives its children (else a random one).
    pub fn launch_prepared(copy: tempfile::TempDir, args: &[&str], secret: Option<&str>) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
        cmd.args(args)
            .arg("--model")
            .arg(copy.path())
            .env("TESSERA_LOG", "warn");
        match secret {
            Some(s) => cmd.env("TESSERA_AUTH_SECRET", s),
            // Hermetic: `tessera up` generates its own cluster secret.
            None => cmd.env_remove("TESSERA_AUTH_SECRET"),
        };
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("tessera starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut banner = Vec::new();
        let addr = loop {
            let line = lines.next().expect("tessera printed its address").unwrap();
            if let Some(rest) = line.split("http://").nth(1) {
                let url = rest.split_whitespace().next().unwrap();
                break url.trim_end_matches("/v1").to_string();
            }
            banner.push(line);
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            addr,
            banner,
            _model_copy: copy,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
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
        http_request(&self.addr, method, path, body)
    }

    /// Sends one request with `Authorization: Bearer <key>` when `key` is given; returns
    /// (status, response head, body).
    pub fn request_as(
        &self,
        key: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, String, String) {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| ("Authorization", a))
            .into_iter()
            .collect();
        http_exchange(&self.addr, method, path, &headers, body)
            .unwrap_or_else(|e| panic!("{method} http://{}{path}: {e}", self.addr))
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

    /// A Prometheus sample from `/metrics` (summed over its label sets).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", None);
        metric_sum(&text, name)
    }
}

impl Drop for Server {
    /// SIGTERM first, so `tessera up` stops its children too (a test that panicked never called
    /// [`Server::terminate`]); SIGKILL if it is still running after 15 s.
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return; // exited (and reaped) already
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while std::time::Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An API key file holding `text`, in a temporary directory removed on drop.
pub struct KeyFile {
    _dir: tempfile::TempDir,
    pub path: String,
}

impl KeyFile {
    pub fn new(text: &str) -> KeyFile {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, text).unwrap();
        KeyFile {
            path: path.to_str().unwrap().to_string(),
            _dir: dir,
        }
    }
}

/// One HTTP/1.1 request to `addr` (`host:port`), `Connection: close`; returns (status, body).
pub fn http_request(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    try_http_request(addr, method, path, body)
        .unwrap_or_else(|e| panic!("{method} http://{addr}{path}: {e}"))
}

/// [`http_request`], with connection errors returned rather than raised.
pub fn try_http_request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    http_exchange(addr, method, path, &[], body).map(|(status, _, body)| (status, body))
}

/// One HTTP/1.1 request with extra `headers`; returns (status, response head, body).
pub fn http_exchange(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<(u16, String, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.unwrap_or("");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let bad = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not an HTTP response: {text:?}"),
        )
    };
    let (head, rest) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Ok((status, head.to_string(), body))
}

/// The sum of every sample of metric `name` (any labels) in Prometheus text; 0 when absent.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
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
