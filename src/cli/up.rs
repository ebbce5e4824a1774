//! `tessera up`: a real multi-process cluster on loopback — decode workers, prefill workers and
//! the router (plus an encoder worker when the model has a vision tower), each its own process,
//! wired with static discovery and TCP page transfer (`--transport ucx`: UCX, in a build with the
//! `ucx` feature). Every child gets the same cluster secret (`TESSERA_AUTH_SECRET`, a random one
//! when it is not set): workers refuse gRPC calls without it, and the router sends it.
//!
//! Children are this same binary run with a worker subcommand. Each prints a `TESSERA_READY`
//! line with its bound addresses; `up` waits for it, passes the addresses on, forwards the
//! children's output with a role prefix, and on Ctrl-C or SIGTERM stops them all (SIGTERM, a
//! drain, then SIGKILL for any still running after 10 s).
//!
//! A worker that dies is started again at the same gRPC address (a new incarnation, so nothing
//! meant for its previous life reaches it), as a Kubernetes Deployment would; the router keeps
//! serving on the others meanwhile and routes to it again once it is healthy. A router that dies
//! is started again at its ports (it holds no state). The cluster stops when a process cannot be
//! restarted or keeps dying.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use tessera_prefill::runtime::TransportKind;

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
    /// Encoder worker processes (default: one when the model has a vision tower, else none; a
    /// text-only model takes none).
    #[arg(long, env = "TESSERA_ENCODER_WORKERS")]
    pub encoders: Option<usize>,
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
    /// Transport of the encoder, prefill and decode workers (`ucx`: a build with `--features ucx`).
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp, env = "TESSERA_TRANSPORT")]
    pub transport: TransportKind,
    /// Seconds to wait for each process to report ready.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout: u64,
    /// Restart a worker that exits (at most `MAX_RESTARTS` times each); `false` stops the whole
    /// cluster instead.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "TESSERA_RESTART_WORKERS")]
    pub restart_workers: bool,
    /// API keys, rate limit and request limits, passed on to the router.
    #[command(flatten)]
    pub front: tessera_router::FrontArgs,
    /// Mutual TLS between the router and the workers, passed on to every process (each presents
    /// the same certificate, which must name the host they listen on, 127.0.0.1 by default).
    #[command(flatten)]
    pub tls: tessera_proto::tls::TlsArgs,
}

struct Proc {
    role: String,
    child: Child,
    /// The arguments that start it again where it was (workers only).
    restart: Option<Vec<String>>,
    restarts: u32,
}

/// Restarts per worker before `up` gives up and stops the cluster.
const MAX_RESTARTS: u32 = 5;

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
        restart: None,
        restarts: 0,
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

/// Restarts `p` if it exited and may be restarted; `Err` says why the cluster must stop.
fn supervise(
    p: &mut Proc,
    exe: &Path,
    secret: &str,
    timeout: Duration,
    restart: bool,
) -> Result<(), String> {
    let status = match p.child.try_wait() {
        Ok(Some(status)) => status,
        _ => return Ok(()),
    };
    let args = match &p.restart {
        Some(args) if restart && p.restarts < MAX_RESTARTS => args.clone(),
        Some(_) if restart => {
            return Err(format!(
                "the {} exited ({status}) after {MAX_RESTARTS} restarts",
                p.role
            ))
        }
        _ => return Err(format!("the {} exited ({status})", p.role)),
    };
    eprintln!(
        "tessera up: the {} exited ({status}); starting it again at the same address",
        p.role
    );
    let (mut fresh, _) = spawn_ready(exe, &p.role, &args, secret, timeout).map_err(|e| {
        format!(
            "the {} exited ({status}) and did not restart: {e:#}",
            p.role
        )
    })?;
    fresh.restart = Some(args);
    fresh.restarts = p.restarts + 1;
    println!(
        "tessera up: {} restarted (pid {})",
        p.role,
        fresh.child.id()
    );
    *p = fresh;
    Ok(())
}

/// Encoder processes to start: `asked`, or one when the model has a vision tower (images need an
/// encoder pool, DESIGN §4 step 2); none for a text-only model, which an encoder refuses.
fn encoder_workers(model: &Path, asked: Option<usize>) -> anyhow::Result<usize> {
    let vision = tessera_encoder::vision_tower(model)?.is_some();
    match asked {
        Some(n) if n > 0 && !vision => {
            bail!(
                "--encoders {n}: the model at {} has no vision tower",
                model.display()
            )
        }
        Some(n) => Ok(n),
        None => Ok(usize::from(vision)),
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
    a.transport.check_built()?;
    a.model.check_device()?;
    let model: PathBuf = a.model.dir()?;
    let exe = std::env::current_exe().context("locating the tessera binary")?;
    let secret = std::env::var("TESSERA_AUTH_SECRET").unwrap_or_else(|_| random_secret());
    let timeout = Duration::from_secs(a.ready_timeout);
    // `<kind> --model M --worker-id <role>-<i>`, and the page-pool flags for engine workers.
    let daemon_args = |kind: &str, i: usize| -> Vec<String> {
        let mut v = vec![
            kind.into(),
            "--model".into(),
            model.display().to_string(),
            "--worker-id".into(),
            format!("{}-{i}", kind.trim_end_matches("-worker")),
        ];
        v.extend(a.tls.to_args());
        v.extend(["--transport".into(), a.transport.to_string()]);
        if kind != "encoder-worker" {
            v.extend([
                "--page-tokens".into(),
                a.page_tokens.to_string(),
                "--snapshot-interval".into(),
                a.snapshot_interval.to_string(),
                "--kv-memory".into(),
                a.kv_memory.clone(),
                "--device".into(),
                a.model.device.to_string(),
            ]);
        }
        v
    };
    let mut procs: Vec<Proc> = Vec::new();
    let result = (|| -> anyhow::Result<String> {
        // Starts `count` workers of `kind`; returns their gRPC addresses.
        let mut start = |kind: &str, count: usize| -> anyhow::Result<Vec<String>> {
            let mut addrs = Vec::new();
            for i in 0..count {
                let role = format!("{}-{i}", kind.trim_end_matches("-worker"));
                let mut args = daemon_args(kind, i);
                let mut first = args.clone();
                first.extend(["--metrics-listen".into(), format!("{}:0", a.host)]);
                let (mut p, f) = spawn_ready(&exe, &role, &first, &secret, timeout)?;
                let grpc = field(&f, "grpc")?.to_string();
                let metrics = field(&f, "metrics")?.to_string();
                println!(
                    "tessera up: {role} ready, gRPC at {grpc} (pid {}, metrics at {metrics})",
                    p.child.id()
                );
                // Started again, it binds the same addresses (the router knows them).
                args.extend([
                    "--listen".into(),
                    grpc.clone(),
                    "--metrics-listen".into(),
                    metrics,
                ]);
                p.restart = Some(args);
                procs.push(p);
                addrs.push(grpc);
            }
            Ok(addrs)
        };
        let encoder_addrs = start("encoder-worker", encoder_workers(&model, a.encoders)?)?;
        let decode_addrs = start("decode-worker", a.decode)?;
        let prefill_addrs = start("prefill-worker", a.prefill)?;
        let mut router = vec![
            "router".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--host".into(),
            a.host.clone(),
            "--port".into(),
            a.port.to_string(),
        ];
        router.extend(a.front.to_args());
        router.extend(a.tls.to_args());
        for d in &decode_addrs {
            router.extend(["--decode".to_string(), d.clone()]);
        }
        for p in &prefill_addrs {
            router.extend(["--prefill".to_string(), p.clone()]);
        }
        for e in &encoder_addrs {
            router.extend(["--encoder".to_string(), e.clone()]);
        }
        let (mut p, f) = spawn_ready(&exe, "router", &router, &secret, timeout)?;
        let http = field(&f, "http")?.to_string();
        let grpc = field(&f, "grpc")?.to_string();
        // The router holds no state: started again, at the ports it bound, it serves on.
        let port_of = |addr: &str| addr.rsplit(':').next().unwrap_or_default().to_string();
        if let Some(i) = router.iter().position(|a| a == "--port") {
            router[i + 1] = port_of(&http);
        }
        router.extend(["--grpc-port".to_string(), port_of(&grpc)]);
        p.restart = Some(router);
        procs.push(p);
        Ok(http)
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
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    for p in procs.iter_mut() {
                        if let Err(why) = supervise(p, &exe, &secret, timeout, a.restart_workers) {
                            return Some(why);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encoder_only_for_a_model_with_a_vision_tower() {
        let text_only = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kl_mixed");
        assert_eq!(encoder_workers(&text_only, None).unwrap(), 0);
        assert_eq!(encoder_workers(&text_only, Some(0)).unwrap(), 0);
        assert!(encoder_workers(&text_only, Some(1)).is_err());
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "kimi_k25", "vision_config": {"hidden_size": 32}}"#,
        )
        .unwrap();
        assert_eq!(encoder_workers(dir.path(), None).unwrap(), 1);
        assert_eq!(encoder_workers(dir.path(), Some(3)).unwrap(), 3);
    }
}
