//! The flags every daemon shares (each also from a `TESSERA_*` variable) and the test hooks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tessera_engine::serving::SchedulerConfig;
use tessera_kernels::Device;
use tessera_transfer::FaultInjection;

use super::NO_UCX;

/// The page transport of an engine daemon (`--transport`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportKind {
    /// tokio TCP streams (always built).
    #[default]
    Tcp,
    /// UCX RMA puts over the system libucx (cargo feature `ucx`); the staging region is UCX
    /// memory, so same-host peers put into it through shared memory.
    Ucx,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Ucx => "ucx",
        }
    }

    /// Fails for a backend this build lacks.
    pub fn check_built(self) -> anyhow::Result<()> {
        if self == TransportKind::Ucx && !cfg!(feature = "ucx") {
            anyhow::bail!(NO_UCX);
        }
        Ok(())
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Flags every daemon shares (encoder, prefill, decode): where it listens, who it is, the
/// cluster secret, drain and etcd registration.
#[derive(clap::Args, Clone, Debug)]
pub struct DaemonArgs {
    /// Model directory (Hugging Face layout: config.json, *.safetensors).
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: PathBuf,
    /// gRPC listen address (port 0 picks a free port; the ready line prints the bound one).
    #[arg(long, env = "TESSERA_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Page-transfer listen address (for `ucx`, its control listener; UCX's own listener takes
    /// the same IP).
    #[arg(long, env = "TESSERA_TRANSFER_LISTEN", default_value = "127.0.0.1:0")]
    pub transfer_listen: SocketAddr,
    /// Host name peers use to reach the transfer listener (default: its bound IP).
    #[arg(long, env = "TESSERA_TRANSFER_ADVERTISE_HOST")]
    pub transfer_advertise_host: Option<String>,
    /// Prometheus `/metrics` HTTP listen address; off when unset.
    #[arg(long, env = "TESSERA_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// This worker's id in the cluster (default: `<role>-<pid>`).
    #[arg(long, env = "TESSERA_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Cluster secret (set it from the environment in production). Peers prove it in the
    /// transfer handshake, and every gRPC call but `grpc.health.v1` must carry it as
    /// `authorization: Bearer <secret>` metadata (the router sends it), or it is refused with
    /// UNAUTHENTICATED.
    #[arg(
        long,
        env = "TESSERA_AUTH_SECRET",
        hide_env_values = true,
        default_value = DEV_SECRET
    )]
    pub auth_secret: String,
    /// Longest a graceful drain waits for in-flight requests after SIGTERM, in seconds.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT", default_value_t = 30)]
    pub drain_timeout: u64,
    /// etcd endpoints (comma-separated `host:port`); when set, the worker registers itself under
    /// `/tessera/<cluster>/workers/<role>/<id>` once ready (DESIGN §6).
    #[arg(long, env = "TESSERA_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Cluster name: the etcd key prefix is `/tessera/<cluster>/`.
    #[arg(long, env = "TESSERA_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// TTL of the etcd registration lease, in seconds (a dead worker leaves routing within it).
    #[arg(long, env = "TESSERA_ETCD_TTL", default_value_t = 5)]
    pub etcd_ttl: u64,
    /// Mutual TLS for this daemon's gRPC server and its own calls to other workers.
    #[command(flatten)]
    pub tls: tessera_proto::tls::TlsArgs,
    /// Fault hooks for tests; never set from the command line or the environment, and inert
    /// unless a test arms them.
    #[doc(hidden)]
    #[arg(skip)]
    pub test_hooks: Arc<TestHooks>,
}

/// The cluster secret a daemon uses when none is given (the router's default too).
pub const DEV_SECRET: &str = "tessera-insecure-dev-secret";

/// Flags of the daemons that run the engine (prefill, decode): [`DaemonArgs`] plus the page
/// pool and the scheduler.
#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Tokens per KV page (the grain of prefix matching, snapshots and transfer).
    #[arg(long, env = "TESSERA_PAGE_TOKENS", default_value_t = 16)]
    pub page_tokens: usize,
    /// Publish a KDA snapshot every N prompt tokens (0 = only at chunk ends and the last full page).
    #[arg(long, env = "TESSERA_SNAPSHOT_INTERVAL", default_value_t = 0)]
    pub snapshot_interval: usize,
    /// KV page-pool budget in bytes (suffixes K, M, G accepted).
    #[arg(long, env = "TESSERA_KV_MEMORY", default_value = "64M", value_parser = parse_bytes)]
    pub kv_memory: usize,
    /// Tokens per batch step (prefill chunk budget). Default: 256 on the CPU, 4096 on a GPU.
    #[arg(long, env = "TESSERA_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<usize>,
    /// Requests running at once.
    #[arg(long, env = "TESSERA_MAX_RUNNING", default_value_t = 32)]
    pub max_running: usize,
    /// Disable the prefix cache.
    #[arg(long, env = "TESSERA_NO_PREFIX_CACHE")]
    pub no_prefix_cache: bool,
    /// Page transport: `tcp`, or `ucx` (a build with the `ucx` feature). Every prefill and decode
    /// worker of a cluster must use the same one: the transfer handshake refuses a mixed pair.
    #[arg(long, env = "TESSERA_TRANSPORT", value_enum, default_value_t = TransportKind::Tcp)]
    pub transport: TransportKind,
    /// Where the model runs: cpu, or cuda[:N] (a build with the `cuda` feature): bf16 weights
    /// on the GPU, sequence state in the host page pool. hip[:N] is refused with the reason.
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
}

fn parse_device(s: &str) -> Result<Device, String> {
    tessera_kernels::parse_device(s).map_err(|e| e.to_string())
}

/// The step token budget when none is given: `cpu_default` on the CPU; on a GPU
/// [`GPU_MAX_BATCH_TOKENS`], since there a long prompt prefills several times faster in few
/// large steps than in many small ones (benches/RESULTS.md, "Long-prompt prefill").
pub fn default_max_batch_tokens(device: Device, cpu_default: usize) -> usize {
    match device {
        Device::Cpu => cpu_default,
        Device::Cuda(_) | Device::Hip(_) => GPU_MAX_BATCH_TOKENS,
    }
}

/// Default step token budget on a GPU.
pub const GPU_MAX_BATCH_TOKENS: usize = 4096;

/// Fails with the reason when a model cannot run on `device`: a GPU that is absent, whose
/// backend this build lacks, or whose backend has no whole-model forward (HIP: its kernels are
/// checked and benchmarked on their own).
pub fn check_model_device(device: Device) -> anyhow::Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => match device.probe() {
            Err(why) => anyhow::bail!("--device {device}: {why}"),
            Ok(name) => {
                tracing::info!(%device, gpu = %name, "model device");
                Ok(())
            }
        },
        Device::Hip(_) => match device.probe() {
            Err(why) => anyhow::bail!("--device {device}: {why}"),
            Ok(name) => anyhow::bail!(
                "--device {device}: found {name}, but whole-model execution on hip is not \
                 available; use --device cpu or cuda"
            ),
        },
    }
}

/// Test-only fault hooks of one daemon, shared with the test that armed them (see
/// [`DaemonArgs::test_hooks`]). Every hook is off by default.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct TestHooks {
    /// Given to this daemon's page transport: faults on the receiving side.
    pub transfer: Arc<FaultInjection>,
    /// Prefill: leave this part of the prompt's state out of every page transfer, as if the
    /// transfer lost it (the pages on decode then keep whatever they held).
    pub withhold: std::sync::Mutex<Option<Withhold>>,
    /// Decode: every decode stream fails like a worker that died (UNAVAILABLE, no detail) once
    /// it has streamed this many tokens; 0 leaves streams alone.
    pub break_streams_after: std::sync::atomic::AtomicU32,
}

/// One part of a prompt's handed-over state (see [`TestHooks::withhold`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withhold {
    /// The `n`-th MLA page of the prompt.
    MlaPage(usize),
    /// The KDA snapshot of group `g` (the `g`-th KDA group of the layout).
    KdaGroup(usize),
}

impl TestHooks {
    /// The armed [`Withhold`], if any.
    pub fn withheld(&self) -> Option<Withhold> {
        *self.withhold.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1usize << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("{s:?} is not a byte count: {e}"))
}

impl WorkerArgs {
    /// The flags in `argv` (its first item names the program), parsed as a daemon's command line
    /// (unset ones from `TESSERA_*` env).
    pub fn try_parse_from<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            worker: WorkerArgs,
        }
        <Cli as clap::Parser>::try_parse_from(argv).map(|c| c.worker)
    }

    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            page_tokens: self.page_tokens,
            snapshot_interval: self.snapshot_interval,
            kv_memory_bytes: self.kv_memory,
            max_batch_tokens: self
                .max_batch_tokens
                .unwrap_or(default_max_batch_tokens(self.device, 256)),
            max_running: self.max_running,
            prefix_cache: !self.no_prefix_cache,
        }
    }
}

impl DaemonArgs {
    pub fn worker_id(&self, role: &str) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(|| format!("{role}-{}", std::process::id()))
    }

    pub fn model_id(&self) -> String {
        self.model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.model.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> SchedulerConfig {
        let mut argv = vec!["worker", "--model", "/m"];
        argv.extend_from_slice(args);
        WorkerArgs::try_parse_from(argv).unwrap().scheduler_config()
    }

    #[test]
    fn the_step_token_budget_follows_the_device_unless_given() {
        assert_eq!(default_max_batch_tokens(Device::Cpu, 256), 256);
        assert_eq!(
            default_max_batch_tokens(Device::Cuda(1), 256),
            GPU_MAX_BATCH_TOKENS
        );
        assert_eq!(config(&[]).max_batch_tokens, 256);
        assert_eq!(config(&["--max-batch-tokens", "96"]).max_batch_tokens, 96);
    }
}
