//! `tessera up`: a real multi-process cluster on loopback — decode workers, prefill workers and
//! the router, each its own process, wired with static discovery and TCP page transfer.
//!
//! Children are this same binary run with a worker subcommand. Each prints a `TESSERA_READY`
//! line with its bound addresses; `up` waits for it, passes the addresses on, forwards the
//! children's output with a role prefix, and on Ctrl-C or SIGTERM stops them all (SIGTERM, a
//! drain, then SIGKILL for any still running after 10 s).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use super::model_arg::ModelArg;

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prefill worker processes.
    #[arg(long, default_value_t = 1, env = "TESSERA_PREFILL_WORKERS")]
    pub prefill: usize,
    /// Decode worker processes.
    #[arg(long, default_value_t = 1, env = "TESSERA_DECODE_WORKERS")]
    pub decode: usize,
    /// Address the router's HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1", env = "TESSERA_HOST")]
    pub host: String,
    /// Router HTTP port (0 picks a free one).
    #[arg(long, default_value_t = 8000, env = "TESSERA_PORT")]
    pub port: u16,
    /// Tokens per KV page (prefix caching, snapshots and transfer grain).
    #[arg(long, default_value_t = 16, env = "TESSERA_PAGE_TOKENS")]
    pub page_tokens: usize,
    /// KDA snapshot interval in tokens (0 = chunk ends and the prompt's last full page only).
    #[arg(long, default_value_t = 0, env = "TESSERA_SNAPSHOT_INTERVAL")]
    pub snapshot_interval: usize,
    /// KV page-pool memory per worker (bytes; K, M, G suffixes).
    #[arg(long, default_value = "256M", env = "TESSERA_KV_MEMORY")]
    pub kv_memory: String,
    /// Seconds to wait for each process to report ready.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout: u64,
}

struct Proc {
    role: String,
    child: Child,
}

/// Starts `tessera <args>`, forwards its output prefixed with `role`, and returns once it prints
/// its ready line (the line's `key=value` fields).
fn spawn_ready(
    exe: &Path,
    role: &str,
    args: &[String],
    secret: &str,
    timeout: Duration,
) -> anyhow::Result<(Proc, Vec<(String, String)>)> {
    let mut child = Command::new(exe)
        .args(args)
        .env("TESSERA_AUTH_SECRET", secret)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the {role}"))?;
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let tag = role.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("TESSERA_READY") {
                let _ = tx.send(line);
            } else {
                println!("[{tag}] {line}");
            }
        }
    });
    let tag = role.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[{tag}] {line}");
        }
    });
    let mut proc = Proc {
        role: role.to_string(),
        child,
    };
    let deadline = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let fields = line
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|kv| {
                        kv.split_once('=')
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                    })
                    .collect();
                return Ok((proc, fields));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(status) = proc.child.try_wait()? {
                    bail!("the {role} exited before it was ready ({status})");
                }
                if Instant::now() > deadline {
                    stop_all(std::slice::from_mut(&mut proc));
                    bail!(
                        "the {role} did not report ready within {}s",
                        timeout.as_secs()
                    );
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = proc.child.wait()?;
                bail!("the {role} exited before it was ready ({status})");
            }
        }
    }
}

fn field<'a>(fields: &'a [(String, String)], key: &str) -> anyhow::Result<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .with_context(|| format!("ready line without `{key}`"))
}

/// SIGTERM to every child, then SIGKILL to those still running after 10 s.
fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter() {
        // SAFETY: plain kill(2) on a child's pid.
        unsafe {
            libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in procs.iter_mut() {
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    eprintln!(
                        "tessera up: the {} did not stop in time; killing it",
                        p.role
                    );
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

fn random_secret() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    format!("{a:016x}{:016x}", h.finish())
}

pub fn run(a: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.prefill >= 1 && a.decode >= 1,
        "a cluster needs at least one prefill and one decode worker"
    );
    let model: PathBuf = a.model.dir()?;
    let exe = std::env::current_exe().context("locating the tessera binary")?;
    let secret = std::env::var("TESSERA_AUTH_SECRET").unwrap_or_else(|_| random_secret());
    let timeout = Duration::from_secs(a.ready_timeout);
    let worker_args = |kind: &str, i: usize| -> Vec<String> {
        vec![
            kind.into(),
            "--model".into(),
            model.display().to_string(),
            "--worker-id".into(),
            format!("{}-{i}", kind.trim_end_matches("-worker")),
            "--page-tokens".into(),
            a.page_tokens.to_string(),
            "--snapshot-interval".into(),
            a.snapshot_interval.to_string(),
            "--kv-memory".into(),
            a.kv_memory.clone(),
        ]
    };
    let mut procs: Vec<Proc> = Vec::new();
    let result = (|| -> anyhow::Result<String> {
        let mut decode_addrs = Vec::new();
        for i in 0..a.decode {
            let (p, f) = spawn_ready(
                &exe,
                &format!("decode-{i}"),
                &worker_args("decode-worker", i),
                &secret,
                timeout,
            )?;
            decode_addrs.push(field(&f, "grpc")?.to_string());
            procs.push(p);
        }
        let mut prefill_addrs = Vec::new();
        for i in 0..a.prefill {
            let (p, f) = spawn_ready(
                &exe,
                &format!("prefill-{i}"),
                &worker_args("prefill-worker", i),
                &secret,
                timeout,
            )?;
            prefill_addrs.push(field(&f, "grpc")?.to_string());
            procs.push(p);
        }
        let mut router = vec![
            "router".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--host".into(),
            a.host.clone(),
            "--port".into(),
            a.port.to_string(),
        ];
        for d in &decode_addrs {
            router.extend(["--decode".to_string(), d.clone()]);
        }
        for p in &prefill_addrs {
            router.extend(["--prefill".to_string(), p.clone()]);
        }
        let (p, f) = spawn_ready(&exe, "router", &router, &secret, timeout)?;
        procs.push(p);
        Ok(field(&f, "http")?.to_string())
    })();
    let http = match result {
        Ok(h) => h,
        Err(e) => {
            stop_all(&mut procs);
            return Err(e);
        }
    };
    println!(
        "tessera up: router at http://{http}/v1 ({} prefill, {} decode workers; model {})",
        a.prefill,
        a.decode,
        model.display()
    );
    println!(
        "  try: curl -s http://{http}/v1/completions -H 'content-type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'"
    );
    use std::io::Write;
    std::io::stdout().flush().ok();

    // Wait for a signal or for a child to die.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let died = rt.block_on(async {
        let signal = tessera_prefill::runtime::shutdown_signal();
        tokio::pin!(signal);
        loop {
            tokio::select! {
                _ = &mut signal => return None,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    for p in procs.iter_mut() {
                        if let Ok(Some(status)) = p.child.try_wait() {
                            return Some(format!("the {} exited ({status})", p.role));
                        }
                    }
                }
            }
        }
    });
    eprintln!("tessera up: stopping {} processes", procs.len());
    stop_all(&mut procs);
    match died {
        Some(why) => bail!("{why}; the cluster was stopped"),
        None => Ok(()),
    }
}
