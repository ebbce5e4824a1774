use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tessera_engine::serving::{EngineHandle, SchedulerConfig};
use tessera_engine::tokenizer::{ChatTemplate, Tokenizer};
use tessera_engine::vision::{ImageLimits, VisionModel};
use tessera_router::{FrontArgs, FrontOptions, HttpFront};

use super::model_arg::ModelArg;
use crate::serve::engine_backend::EngineBackend;
use crate::serve::memory::parse_kv_memory;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "TESSERA_HOST")]
    pub host: String,
    /// HTTP port (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8000, env = "TESSERA_PORT")]
    pub port: u16,
    /// Tokens per KV page: the grain of prefix caching, KDA snapshots and transfer.
    #[arg(long, default_value_t = 64, env = "TESSERA_PAGE_TOKENS")]
    pub page_tokens: usize,
    /// Publish a KDA snapshot every N tokens (a multiple of --page-tokens); 0 = only at prefill
    /// chunk ends and at the prompt's last full page.
    #[arg(long, default_value_t = 0, env = "TESSERA_SNAPSHOT_INTERVAL")]
    pub snapshot_interval: usize,
    /// Memory of the flat KV page pool: bytes with a unit (512MiB, 2GiB) or a fraction of the
    /// memory available at start (0.2).
    #[arg(long, default_value = "512MiB", env = "TESSERA_KV_MEMORY", value_parser = parse_kv_memory)]
    pub kv_memory: usize,
    /// Tokens one engine step may process (decode tokens plus prefill chunks). Default: 512 on
    /// the CPU, 4096 on a GPU (where a long prompt's prefill in few large steps is several times
    /// faster than in many small ones).
    #[arg(long, env = "TESSERA_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<usize>,
    /// Requests in the running batch at most.
    #[arg(long, default_value_t = 64, env = "TESSERA_MAX_RUNNING")]
    pub max_running: usize,
    /// Requests allowed to wait for admission; more are refused with 429.
    #[arg(long, default_value_t = 256, env = "TESSERA_MAX_WAITING")]
    pub max_waiting: usize,
    /// Prompt plus generated tokens per request at most.
    #[arg(long, default_value_t = 32768, env = "TESSERA_MAX_MODEL_LEN")]
    pub max_model_len: usize,
    /// Turn the prefix cache off.
    #[arg(long, env = "TESSERA_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Model name clients send (default: the model directory's name).
    #[arg(long, env = "TESSERA_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// API keys, rate limit and request limits of the HTTP front.
    #[command(flatten)]
    pub front: FrontArgs,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    // Before the model loads: a bad key file should fail at once.
    let front_options = a.front.options()?;
    let (dir, model) = a.model.load()?;
    let tokenizer = Tokenizer::from_dir(&dir)
        .with_context(|| format!("loading the tokenizer from {}", dir.display()))?;
    let template = ChatTemplate::from_dir(&dir).context("loading the chat template")?;
    let eos = model.config.eos_token_ids.clone();
    let vocab = model.config.vocab_size;
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name().map_or_else(
            || "tessera".to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    });
    let cfg = SchedulerConfig {
        page_tokens: a.page_tokens,
        snapshot_interval: a.snapshot_interval,
        kv_memory_bytes: a.kv_memory,
        max_batch_tokens: a.max_batch_tokens.unwrap_or(
            tessera_prefill::runtime::default_max_batch_tokens(a.model.device, 512),
        ),
        max_running: a.max_running,
        prefix_cache: !a.no_prefix_cache,
    };
    let vision = VisionModel::load(&dir)
        .with_context(|| format!("loading the vision tower of {}", dir.display()))?
        .map(|mut v| {
            v.set_limits(ImageLimits {
                max_bytes: a.front.max_image_bytes,
                ..v.limits().clone()
            });
            v
        });
    let image_token_id = vision.as_ref().map(VisionModel::placeholder_token_id);
    let engine = EngineHandle::spawn(model, cfg).context("starting the engine")?;
    eprintln!("{}", engine.layout_report());
    let mut backend = EngineBackend::new(engine, model_id.clone(), a.max_model_len, a.max_waiting);
    if let Some(v) = vision {
        backend = backend.with_vision(v);
    }
    let backend = Arc::new(backend);
    let front = HttpFront::new(
        backend,
        tokenizer,
        template,
        eos,
        FrontOptions {
            served_model_name: Some(model_id.clone()),
            vocab_size: Some(vocab),
            image_token_id,
            ..front_options
        },
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", a.host, a.port)
            .parse()
            .with_context(|| format!("bad address {}:{}", a.host, a.port))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        // Scripts wait for this line.
        println!("tessera serve: model `{model_id}` at http://{local}/v1");
        use std::io::Write;
        std::io::stdout().flush().ok();
        front
            .serve(listener, shutdown_signal())
            .await
            .context("HTTP server")?;
        anyhow::Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
