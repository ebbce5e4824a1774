//! `tessera-decode`: the decode daemon. See the crate docs; `--help` lists the flags (each also
//! from `TESSERA_*` env).

use clap::Parser;
use tessera_prefill::runtime::{self, WorkerArgs};

/// Tessera decode worker: reserves pages for incoming prefills, receives their KV state over
/// the page transport, continues decoding with continuous batching and streams tokens. Stops
/// gracefully on SIGTERM (drain).
#[derive(Parser, Debug)]
#[command(name = "tessera-decode", version)]
struct Cli {
    #[command(flatten)]
    worker: WorkerArgs,
}

fn main() -> anyhow::Result<()> {
    runtime::daemon_main(|cli: Cli| tessera_decode::start(cli.worker, runtime::shutdown_signal()))
}
