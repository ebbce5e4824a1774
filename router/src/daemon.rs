//! The router daemon (`tessera-router`): the HTTP front over a [`ClusterBackend`] with static
//! discovery. [`run`] is what the binary calls, and what the root `tessera` binary embeds.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tessera_tokenizer::{ChatTemplate, Tokenizer};

use crate::cluster::{ClusterBackend, ClusterConfig, PoolOptions};
use crate::http::args::FrontArgs;
use crate::http::{FrontOptions, HttpFront};

/// The default secret of the worker daemons (`tessera_prefill::runtime::DEV_SECRET`).
const DEV_SECRET: &str = "tessera-insecure-dev-secret";

/// Flags of `tessera-router` (each also from `TESSERA_*` env).
#[derive(clap::Args, Clone, Debug)]
pub struct RouterArgs {
    /// Model directory: tokenizer, chat template, config.json (the weights stay on the workers).
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: PathBuf,
    /// Model name clients send (default: the model directory's name).
    #[arg(long, env = "TESSERA_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// HTTP listen host.
    #[arg(long, env = "TESSERA_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP listen port (0 picks a free one; the ready line prints it).
    #[arg(long, env = "TESSERA_PORT", default_value_t = 8000)]
    pub port: u16,
    /// gRPC port of the public `tessera.v1.Generate` service and `grpc.health.v1`, on the HTTP
    /// host (0 picks a free one; the ready line prints it). Default: 8001, or 0 when `--port`
    /// is 0 (so ephemeral routers never collide on a fixed gRPC port).
    #[arg(long, env = "TESSERA_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// gRPC address of a prefill worker (repeatable, or comma-separated).
    #[arg(
        long = "prefill",
        env = "TESSERA_PREFILL",
        value_delimiter = ',',
        required_unless_present = "etcd"
    )]
    pub prefill: Vec<String>,
    /// gRPC address of a decode worker (repeatable, or comma-separated).
    #[arg(
        long = "decode",
        env = "TESSERA_DECODE",
        value_delimiter = ',',
        required_unless_present = "etcd"
    )]
    pub decode: Vec<String>,
    /// gRPC address of an encoder worker (repeatable, or comma-separated): images of chat
    /// requests are encoded there. Without one, requests with images get 503.
    #[arg(long = "encoder", env = "TESSERA_ENCODER", value_delimiter = ',')]
    pub encoder: Vec<String>,
    /// Cluster secret, sent to workers as `authorization: Bearer` metadata.
    #[arg(
        long,
        env = "TESSERA_AUTH_SECRET",
        hide_env_values = true,
        default_value = DEV_SECRET
    )]
    pub auth_secret: String,
    /// Prompt plus generated tokens per request at most.
    #[arg(long, env = "TESSERA_MAX_MODEL_LEN", default_value_t = 32768)]
    pub max_model_len: usize,
    /// API keys, rate limit and request limits of the HTTP and gRPC fronts.
    #[command(flatten)]
    pub front: FrontArgs,
    /// Mutual TLS for the connections to the workers (they must be started with it too).
    #[command(flatten)]
    pub tls: tessera_proto::tls::TlsArgs,
    /// Tokens per KV page on the workers (the prefix-affinity grain).
    #[arg(long, env = "TESSERA_PAGE_TOKENS", default_value_t = 16)]
    pub page_tokens: usize,
    /// etcd endpoints (comma-separated `host:port`): also route to the workers registered under
    /// `/tessera/<cluster>/workers/`, added and drained live (DESIGN §6). With it, `--prefill`
    /// and `--decode` are optional; both kinds of membership may be combined.
    #[arg(long, env = "TESSERA_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: the etcd prefix is `/tessera/<cluster>/`.
    #[arg(long, env = "TESSERA_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// Seconds between two health probes of each worker.
    #[arg(long, env = "TESSERA_HEALTH_INTERVAL", default_value_t = 2)]
    pub health_interval: u64,
}

impl RouterArgs {
    /// The gRPC port to bind: `--grpc-port`, else 8001, else 0 when `--port` is 0.
    pub fn grpc_port(&self) -> u16 {
        self.grpc_port
            .unwrap_or(if self.port == 0 { 0 } else { DEFAULT_GRPC_PORT })
    }
}

/// The public gRPC service's port when `--grpc-port` is not given.
pub const DEFAULT_GRPC_PORT: u16 = 8001;

/// What the front needs from the model directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// `eos_token_id` of `config.json` and `generation_config.json` (int or list), united.
    pub eos_ids: Vec<u32>,
    pub vocab_size: Option<usize>,
    /// The token images replace (`media_placeholder_token_id` or `image_token_id`), for a model
    /// with a vision tower (`vision_config`); `None` for a text-only model.
    pub image_token_id: Option<u32>,
}

/// Reads [`ModelInfo`] with serde_json (no engine).
pub fn read_model_info(dir: &Path) -> anyhow::Result<ModelInfo> {
    let mut eos = Vec::new();
    let mut vocab_size = None;
    let mut image_token_id = None;
    for (name, required) in [("config.json", true), ("generation_config.json", false)] {
        let path = dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        // Multimodal configs nest the language model's fields.
        let lm = v.get("text_config").unwrap_or(&v);
        for src in [&v, lm] {
            match src.get("eos_token_id") {
                Some(Value::Number(n)) => eos.extend(n.as_u64()),
                Some(Value::Array(a)) => eos.extend(a.iter().filter_map(Value::as_u64)),
                _ => {}
            }
        }
        if name == "config.json" {
            vocab_size = lm
                .get("vocab_size")
                .and_then(Value::as_u64)
                .map(|n| n as usize);
            if v.get("vision_config").is_some_and(Value::is_object) {
                image_token_id = ["media_placeholder_token_id", "image_token_id"]
                    .iter()
                    .find_map(|k| v.get(*k).or_else(|| lm.get(*k)).and_then(Value::as_u64))
                    .map(|n| n as u32);
            }
        }
    }
    let mut eos_ids: Vec<u32> = eos.into_iter().map(|n| n as u32).collect();
    eos_ids.sort_unstable();
    eos_ids.dedup();
    Ok(ModelInfo {
        eos_ids,
        vocab_size,
        image_token_id,
    })
}

/// A started router (for embedding and tests).
pub struct RunningRouter {
    /// Where the HTTP front listens.
    pub addr: SocketAddr,
    /// Where the gRPC `Generate` service listens.
    pub grpc_addr: SocketAddr,
    pub backend: Arc<ClusterBackend>,
    /// Ends after `shutdown` resolved and in-flight HTTP and gRPC requests finished.
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Runs the router until `shutdown` resolves (then finishes in-flight HTTP and gRPC requests).
pub async fn run(
    args: RouterArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    start(args, shutdown).await?.server.await?
}

/// Loads the model's tokenizer and config, builds the cluster backend, binds the HTTP and gRPC
/// listeners, prints the ready lines and serves in a task until `shutdown` resolves.
pub async fn start(
    args: RouterArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<RunningRouter> {
    let dir = args.model.clone();
    let tokenizer = Tokenizer::from_dir(&dir)
        .with_context(|| format!("loading the tokenizer from {}", dir.display()))?;
    let template = ChatTemplate::from_dir(&dir).context("loading the chat template")?;
    let info = read_model_info(&dir)?;
    let front_options = args.front.options()?;
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name().map_or_else(
            || "tessera".to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    });
    if args.auth_secret == DEV_SECRET {
        tracing::warn!("TESSERA_AUTH_SECRET is not set: using the insecure development secret");
    }
    let cluster = ClusterConfig {
        model_id: model_id.clone(),
        max_model_len: args.max_model_len,
        prefill: args.prefill.clone(),
        decode: args.decode.clone(),
        pool: PoolOptions {
            auth_secret: Some(args.auth_secret.clone()),
            health_interval: Duration::from_secs(args.health_interval.max(1)),
            page_tokens: args.page_tokens,
            tls: args.tls.load().map_err(anyhow::Error::msg)?,
            ..PoolOptions::default()
        },
        reserve_ttl_ms: 0,
        encoder: args.encoder.clone(),
        image_token_id: info.image_token_id,
    };
    let backend = crate::discovery::build_backend(&args.etcd, &args.cluster, cluster)?;
    let backend = Arc::new(backend);
    let front = HttpFront::new(
        backend.clone(),
        tokenizer,
        template,
        info.eos_ids,
        FrontOptions {
            served_model_name: Some(model_id.clone()),
            vocab_size: info.vocab_size,
            image_token_id: info.image_token_id,
            ..front_options
        },
    );
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    let grpc_port = args.grpc_port();
    let grpc_listener = tokio::net::TcpListener::bind((args.host.as_str(), grpc_port))
        .await
        .with_context(|| format!("binding {}:{grpc_port} (gRPC)", args.host))?;
    let grpc_addr: SocketAddr = grpc_listener.local_addr()?;
    let grpc = front.grpc();
    tracing::info!(%addr, %grpc_addr, prefill = ?args.prefill, decode = ?args.decode, encoder = ?args.encoder, "router listening");
    println!("tessera router: model `{model_id}` at http://{addr}/v1");
    println!("tessera router: gRPC Generate at {grpc_addr}");
    println!("TESSERA_READY role=router http={addr} grpc={grpc_addr}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // One shutdown signal for both servers.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|&s| s).await;
        }
    };
    let (http_stop, grpc_stop) = (stopped(), stopped());
    let server = tokio::spawn(async move {
        let signal = tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let (http, grpc) = tokio::join!(
            front.serve(listener, http_stop),
            grpc.serve(grpc_listener, grpc_stop)
        );
        signal.abort();
        http.context("serving HTTP")?;
        grpc.context("serving gRPC")?;
        Ok(())
    });
    Ok(RunningRouter {
        addr,
        grpc_addr,
        backend,
        server,
    })
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Starts `tracing` (`RUST_LOG`, default `info`) on stderr; safe to call twice.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_port_defaults_to_8001_or_free_with_an_ephemeral_http_port() {
        #[derive(clap::Parser)]
        struct A {
            #[command(flatten)]
            r: RouterArgs,
        }
        let parse = |extra: &[&str]| {
            let mut argv = vec!["r", "--model", "m", "--prefill", "p:1", "--decode", "d:1"];
            argv.extend_from_slice(extra);
            <A as clap::Parser>::parse_from(argv).r.grpc_port()
        };
        if std::env::var_os("TESSERA_GRPC_PORT").is_none() {
            assert_eq!(parse(&[]), 8001);
            assert_eq!(parse(&["--port", "0"]), 0);
        }
        assert_eq!(parse(&["--port", "0", "--grpc-port", "9001"]), 9001);
        assert_eq!(parse(&["--grpc-port", "0"]), 0);
    }

    #[test]
    fn the_front_flags_are_router_flags() {
        #[derive(clap::Parser)]
        struct A {
            #[command(flatten)]
            r: RouterArgs,
        }
        let argv = [
            "r",
            "--model",
            "m",
            "--prefill",
            "p:1",
            "--decode",
            "d:1",
            "--api-key-file",
            "/run/keys",
            "--rate-limit-rps",
            "3",
            "--max-prompt-tokens",
            "100",
        ];
        let front = <A as clap::Parser>::parse_from(argv).r.front;
        assert_eq!(front.api_key_file.as_deref(), Some(Path::new("/run/keys")));
        assert_eq!(front.rate_limit_rps, Some(3.0));
        assert_eq!(front.max_prompt_tokens, Some(100));
    }

    #[test]
    fn eos_ids_are_the_union_of_both_configs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"eos_token_id": 2, "vocab_size": 384}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [7, 2]}"#,
        )
        .unwrap();
        let info = read_model_info(dir.path()).unwrap();
        assert_eq!(info.eos_ids, vec![2, 7]);
        assert_eq!(info.vocab_size, Some(384));
    }
}
