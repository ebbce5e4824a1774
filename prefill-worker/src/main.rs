//! `tessera-prefill`: the prefill daemon. See the crate docs; `--help` lists the flags (each
//! also from `TESSERA_*` env).

use clap::Parser;
use tessera_prefill::runtime::{self, WorkerArgs};

/// Tessera prefill worker: runs prompts and writes their KV pages (MLA history + KDA snapshots)
/// into the pages a decode worker reserved. Stops gracefully on SIGTERM (drain).
#[derive(Parser, Debug)]
#[command(name = "tessera-prefill", version)]
struct Cli {
    #[command(flatten)]
    worker: WorkerArgs,
}

fn main() -> anyhow::Result<()> {
    runtime::daemon_main(|cli: Cli| tessera_prefill::start(cli.worker, runtime::shutdown_signal()))
}
