//! The worker daemons as subcommands of `tessera`, so one binary (`cargo run -- up`) can start a
//! whole cluster of separate processes. `tessera-prefill` and `tessera-decode` are the same
//! daemons as stand-alone binaries for deployments.

use clap::Args;
use tessera_prefill::runtime::{self, WorkerArgs};

#[derive(Args, Debug)]
pub struct WorkerCmd {
    #[command(flatten)]
    pub worker: WorkerArgs,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

pub fn run_prefill(a: WorkerCmd) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let running = tessera_prefill::start(a.worker, runtime::shutdown_signal()).await?;
        running.server.await??;
        anyhow::Ok(())
    })
}

pub fn run_decode(a: WorkerCmd) -> anyhow::Result<()> {
    runtime()?.block_on(async move {
        let running = tessera_decode::start(a.worker, runtime::shutdown_signal()).await?;
        running.server.await??;
        anyhow::Ok(())
    })
}

#[derive(Args, Debug)]
pub struct RouterCmd {
    #[command(flatten)]
    pub router: tessera_router::daemon::RouterArgs,
}

pub fn run_router(a: RouterCmd) -> anyhow::Result<()> {
    runtime()?.block_on(tessera_router::daemon::run(
        a.router,
        tessera_router::daemon::shutdown_signal(),
    ))
}
