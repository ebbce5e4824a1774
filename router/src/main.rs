//! `tessera-router`: the OpenAI-compatible front of a disaggregated cluster. `--help` lists the
//! flags (each also from `TESSERA_*` env).

use clap::Parser;
use tessera_router::daemon::{self, RouterArgs};

/// Tessera router: serves the OpenAI-compatible HTTP API and routes each request to a decode
/// worker (reserve pages) and a prefill worker (prefill into them), then streams decode's tokens.
/// Stops gracefully on SIGTERM or Ctrl-C.
#[derive(Parser, Debug)]
#[command(name = "tessera-router", version)]
struct Cli {
    #[command(flatten)]
    router: RouterArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    daemon::init_tracing();
    let cli = Cli::parse();
    daemon::run(cli.router, daemon::shutdown_signal()).await
}
