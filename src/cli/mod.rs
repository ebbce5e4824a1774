//! Subcommands. Each file holds one command's flags (clap derive, every flag also from a
//! `TESSERA_*` environment variable) and its run function.

mod bench;
mod bench_http;
mod bench_plot;
mod encode;
mod generate;
mod init_model;
mod logits;
mod model_arg;
mod serve;
mod up;
mod workers;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tessera",
    version,
    about = "Disaggregated prefill/decode serving for Kimi-family hybrid models (KDA + MLA + MoE)",
    long_about = "Tessera serves Kimi-family hybrid models. Without --model, commands use the \
embedded tiny default model: random weights in the real checkpoint layout, written on first use \
to the cache directory. Its output is meaningless text; it exists to exercise the system."
)]
pub struct Cli {
    /// Log filter (tracing `EnvFilter` syntax, e.g. `info` or `tessera_engine=debug`).
    #[arg(long, env = "TESSERA_LOG", default_value = "warn", global = true)]
    pub log: String,
    /// CPU worker threads for the compute kernels (default: one per core).
    #[arg(long, env = "TESSERA_THREADS", global = true)]
    pub threads: Option<usize>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Write the prompt logits of a model to a .npy file (f32 [T, vocab]).
    Logits(logits::LogitsArgs),
    /// Generate tokens from a prompt (token IDs or text), optionally with images.
    Generate(generate::GenerateArgs),
    /// Write an image's embeddings (vision tower + projector) to a .npy file
    /// (f32 [n_image_tokens, text_hidden]).
    Encode(encode::EncodeArgs),
    /// Serve the OpenAI-compatible HTTP API from one process (engine, page pool, prefix cache).
    Serve(serve::ServeArgs),
    /// Start a local cluster: router, prefill and decode workers as separate processes on
    /// loopback (embedded tiny model unless --model is given). Ctrl-C stops everything.
    Up(up::UpArgs),
    /// Run a prefill worker daemon (what `tessera up` starts; also the `tessera-prefill` binary).
    PrefillWorker(workers::WorkerCmd),
    /// Run a decode worker daemon (what `tessera up` starts; also the `tessera-decode` binary).
    DecodeWorker(workers::WorkerCmd),
    /// Run a vision-encoder worker daemon (what `tessera up` starts for a model with a vision
    /// tower; also the `tessera-encoder` binary). Refuses a text-only model.
    EncoderWorker(workers::EncoderCmd),
    /// Run the router daemon: OpenAI HTTP API in front of prefill and decode worker pools (what
    /// `tessera up` starts; also the `tessera-router` binary).
    Router(workers::RouterCmd),
    /// Write a random-weight Kimi Linear model in the Hugging Face layout (output is meaningless).
    InitModel(init_model::InitModelArgs),
    /// Load-test a running server's completions API (`tessera serve`, `tessera up` or a router):
    /// TTFT, TPOT, end-to-end latency percentiles and throughput.
    Bench(bench::BenchArgs),
}

pub fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Logits(a) => logits::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Encode(a) => encode::run(a),
        Command::InitModel(a) => init_model::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Up(a) => up::run(a),
        Command::PrefillWorker(a) => workers::run_prefill(a),
        Command::DecodeWorker(a) => workers::run_decode(a),
        Command::EncoderWorker(a) => workers::run_encoder(a),
        Command::Router(a) => workers::run_router(a),
        Command::Bench(a) => bench::run(a),
    }
}

pub fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
