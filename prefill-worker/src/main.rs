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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    runtime::init_tracing();
    let cli = Cli::parse();
    let running = tessera_prefill::start(cli.worker, runtime::shutdown_signal()).await?;
    running.server.await??;
    Ok(())
}
