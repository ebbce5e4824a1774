//! The worker daemons as subcommands of `tessera`, so one binary (`cargo run -- up`) can start a
//! whole cluster of separate processes. `tessera-prefill`, `tessera-decode` and
//! `tessera-encoder` are the same daemons as stand-alone binaries for deployments.

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

/// Runs a daemon until its server stops (SIGTERM or Ctrl-C drain it first).
fn run_daemon<S>(
    start: impl std::future::Future<Output = anyhow::Result<runtime::Running<S>>>,
) -> anyhow::Result<()> {
    runtime()?.block_on(async move { start.await?.server.await? })
}

pub fn run_prefill(a: WorkerCmd) -> anyhow::Result<()> {
    run_daemon(tessera_prefill::start(a.worker, runtime::shutdown_signal()))
}

pub fn run_decode(a: WorkerCmd) -> anyhow::Result<()> {
    run_daemon(tessera_decode::start(a.worker, runtime::shutdown_signal()))
}

#[derive(Args, Debug)]
pub struct EncoderCmd {
    #[command(flatten)]
    pub encoder: tessera_encoder::EncoderArgs,
}

pub fn run_encoder(a: EncoderCmd) -> anyhow::Result<()> {
    run_daemon(tessera_encoder::start(
        a.encoder,
        runtime::shutdown_signal(),
    ))
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
