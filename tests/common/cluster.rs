//! Daemons of a loopback cluster as separate `tessera` processes (`router`, `prefill-worker`,
//! `decode-worker`): each is started with its flags and awaited on the `TESSERA_READY` line it
//! prints once it serves (a worker with `--etcd`: once it is registered). Its stderr goes to a
//! log file, shown when something fails. Dropping a [`Daemon`] kills the process.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::server::{http_request, metric_sum, try_http_request};

/// Cluster secret every daemon of a test cluster is given.
pub const SECRET: &str = "cluster-test-secret";

pub struct Daemon {
    pub name: String,
    child: Child,
    ready: mpsc::Receiver<(Instant, String)>,
    /// `key=value` fields of the ready line (`grpc`, `metrics`, `http`, …), once read.
    fields: Vec<(String, String)>,
    /// When the ready line arrived.
    pub ready_at: Option<Instant>,
    log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl Daemon {
    /// Starts `tessera <args> --auth-secret SECRET` without waiting for it (see [`Daemon::ready`]).
    pub fn start(name: &str, args: &[&str]) -> Daemon {
        let logdir = tempfile::tempdir().unwrap();
        let log = logdir.path().join("stderr.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(args)
            .args(["--auth-secret", SECRET])
            .env_remove("TESSERA_AUTH_SECRET")
            // `info` logs the drain's steps; one kernel thread per process (several share
            // few cores).
            .env("TESSERA_LOG", "info")
            .env("TESSERA_THREADS", "1")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("tessera starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, ready) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("TESSERA_READY") {
                    let _ = tx.send((Instant::now(), line));
                }
            }
        });
        Daemon {
            name: name.to_string(),
            child,
            ready,
            fields: Vec::new(),
            ready_at: None,
            log,
            _logdir: logdir,
        }
    }

    /// Starts a daemon and waits until it is ready.
    pub fn spawn(name: &str, args: &[&str]) -> Daemon {
        let mut d = Daemon::start(name, args);
        d.ready();
        d
    }

    /// Waits (at most 60 s) for the ready line; returns when it arrived.
    pub fn ready(&mut self) -> Instant {
        if let Some(t) = self.ready_at {
            return t;
        }
        let (at, line) = self
            .ready
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                panic!("{} not ready within 60 s; log:\n{}", self.name, self.log())
            });
        self.fields = line
            .split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.ready_at = Some(at);
        at
    }

    /// A field of the ready line.
    pub fn field(&self, key: &str) -> &str {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{}: no `{key}` in {:?}", self.name, self.fields))
    }

    /// The daemon's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its `/metrics` text (a worker's metrics listener; the router's HTTP port).
    pub fn metrics_text(&self) -> String {
        let addr = match self.fields.iter().find(|(k, _)| k == "metrics") {
            Some((_, m)) => m.as_str(),
            None => self.field("http"),
        };
        let (status, text) = http_request(addr, "GET", "/metrics", None);
        assert_eq!(status, 200, "{}: /metrics: {text}", self.name);
        text
    }

    /// One series of its `/metrics`, summed over label sets.
    pub fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.metrics_text(), name)
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGTERM (the graceful drain) and returns at once.
    pub fn terminate(&self) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "SIGTERM to {}", self.name);
    }

    /// Waits at most `limit` for the process to exit; its status.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                t0.elapsed() < limit,
                "{} still running {limit:?} after SIGTERM; log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `ok` every 20 ms until it holds; panics with `what` after `limit`. Returns how long it
/// took.
pub fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

/// Starts `tessera <kind>-worker` (`prefill` or `decode`) serving `model` with 16-token pages and
/// `/metrics` on a free port, plus `extra` flags; returns without waiting for it.
pub fn start_worker(kind: &str, id: &str, model: &Path, extra: &[&str]) -> Daemon {
    let sub = format!("{kind}-worker");
    let m = model.to_str().unwrap();
    let mut args = vec![sub.as_str(), "--model", m, "--worker-id", id];
    args.extend(["--metrics-listen", "127.0.0.1:0", "--page-tokens", "16"]);
    args.extend_from_slice(extra);
    Daemon::start(id, &args)
}

/// Starts `tessera router` for `model` on free ports with `extra` flags (discovery) and waits
/// until `/health` says it has a healthy prefill and decode worker.
pub fn spawn_router(model: &Path, extra: &[&str]) -> Daemon {
    let m = model.to_str().unwrap();
    let mut args = vec!["router", "--model", m, "--port", "0", "--grpc-port", "0"];
    args.extend(["--page-tokens", "16", "--health-interval", "1"]);
    args.extend_from_slice(extra);
    let r = Daemon::spawn("router", &args);
    let http = r.field("http").to_string();
    wait_until("the router is healthy", Duration::from_secs(20), || {
        http_request(&http, "GET", "/health", None).0 == 200
    });
    r
}

/// A greedy `/v1/completions` request for token ids; (token ids, text) or what went wrong.
pub fn complete(
    router: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<(Vec<u32>, String), String> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true});
    let (status, text) =
        try_http_request(router, "POST", "/v1/completions", Some(&body.to_string()))
            .map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("HTTP {status}: {text}"));
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    let c = &v["choices"][0];
    let ids = serde_json::from_value(c["token_ids"].clone()).map_err(|e| format!("{e}: {text}"))?;
    Ok((ids, c["text"].as_str().unwrap_or_default().to_string()))
}

/// [`complete`], streamed: the token ids of every SSE chunk in order, and the text; an error
/// event, a stream without a finish reason or without `[DONE]` is an `Err`.
pub fn complete_streamed(
    router: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<(Vec<u32>, String), String> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "return_token_ids": true, "stream": true});
    let (status, text) =
        try_http_request(router, "POST", "/v1/completions", Some(&body.to_string()))
            .map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("HTTP {status}: {text}"));
    }
    if !text.contains("data: [DONE]") {
        return Err(format!("the stream did not end with [DONE]: {text}"));
    }
    let events: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).map_err(|e| format!("{e}: {d}")))
        .collect::<Result<_, _>>()?;
    let (mut ids, mut out, mut finished) = (Vec::new(), String::new(), false);
    for e in &events {
        if e.get("error").is_some() {
            return Err(format!("error event: {e}"));
        }
        let Some(c) = e["choices"].get(0) else {
            continue;
        };
        if let Some(t) = c.get("token_ids") {
            ids.extend(serde_json::from_value::<Vec<u32>>(t.clone()).map_err(|e| e.to_string())?);
        }
        out.push_str(c["text"].as_str().unwrap_or_default());
        finished |= c["finish_reason"].is_string();
    }
    if !finished {
        return Err(format!("no finish reason in the stream: {text}"));
    }
    Ok((ids, out))
}

/// A request of the steady load and the answer it must get.
#[derive(Clone, Debug)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub ids: Vec<u32>,
    pub text: String,
}

/// A steady load: `clients` threads, each sending the jobs in turn (one at a time) until
/// stopped, checking every answer against its job.
pub struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    pub fn start(router: &str, jobs: &[Job], clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..clients)
            .map(|c| {
                let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
                let (router, jobs) = (router.to_string(), jobs.to_vec());
                std::thread::spawn(move || {
                    let mut i = c;
                    while !stop.load(Ordering::Acquire) {
                        let j = &jobs[i % jobs.len()];
                        match complete(&router, &j.prompt, j.max_tokens) {
                            Ok((ids, text)) if ids == j.ids && text == j.text => {
                                ok.fetch_add(1, Ordering::AcqRel);
                            }
                            r => failures.lock().unwrap().push(format!(
                                "client {c}, job {}: got {r:?}, want {:?}",
                                i % jobs.len(),
                                j.ids
                            )),
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failures,
            threads,
        }
    }

    /// Requests answered correctly so far.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Acquire)
    }

    /// Requests that failed or answered wrongly so far.
    pub fn failures(&self) -> Vec<String> {
        self.failures.lock().unwrap().clone()
    }

    /// Waits until `n` more requests succeeded (at most `limit`); fails at once, naming them,
    /// when any request failed.
    pub fn wait_for_more(&self, n: u64, limit: Duration) {
        let target = self.ok() + n;
        wait_until(&format!("{n} more requests answered"), limit, || {
            let failures = self.failures();
            assert!(
                failures.is_empty(),
                "requests failed:\n{}",
                failures.join("\n")
            );
            self.ok() >= target
        });
    }

    /// Stops the clients after their current request; (successes, failures).
    pub fn stop(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads {
            t.join().expect("a load client panicked");
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::Acquire), failures)
    }
}

/// `n` prompts of the given lengths (cycled), pseudo-random ids of the vocabulary of the model
/// in `dir`: different first pages, so prefix affinity spreads them over prefill workers.
pub fn prompts(dir: &Path, lens: &[usize], n: usize) -> Vec<Vec<u32>> {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|i| {
            (0..lens[i % lens.len()])
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab) as u32
                })
                .collect()
        })
        .collect()
}

/// The jobs for `prompts`: greedy ids from the single-process engine on `fixture` (the
/// reference), checked once through the cluster at `router`, whose text becomes the job's.
pub fn jobs(fixture: &Path, router: &str, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Job> {
    use tessera_engine::generate::{generate, GenerateRequest};
    let mut model = tessera_engine::Model::load(fixture).unwrap();
    model.set_batch_invariant(true);
    prompts
        .iter()
        .map(|p| {
            let ids = generate(
                &model,
                &GenerateRequest {
                    prompt: p.clone(),
                    max_new_tokens: max_tokens,
                    sampling: Default::default(),
                    stop_ids: vec![],
                    prefill_chunk: None,
                },
            )
            .unwrap();
            let (got, text) = complete(router, p, max_tokens).unwrap();
            assert_eq!(
                got, ids,
                "the cluster differs from the single-process engine"
            );
            Job {
                prompt: p.clone(),
                max_tokens,
                ids,
                text,
            }
        })
        .collect()
}
