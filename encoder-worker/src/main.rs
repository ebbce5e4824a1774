//! `tessera-encoder`: the vision-encoder daemon. See the crate docs; `--help` lists the flags
//! (each also from `TESSERA_*` env).

use clap::Parser;
use tessera_encoder::EncoderArgs;
use tessera_prefill::runtime;

/// Tessera encoder worker: runs a vision model's image tower for the router's encoder pool.
/// Refuses to start for a text-only model (one without a vision tower). Stops gracefully on
/// SIGTERM (drain).
#[derive(Parser, Debug)]
#[command(name = "tessera-encoder", version)]
struct Cli {
    #[command(flatten)]
    encoder: EncoderArgs,
}

fn main() -> std::process::ExitCode {
    let served = runtime::daemon_main(|cli: Cli| {
        tessera_encoder::start(cli.encoder, runtime::shutdown_signal())
    });
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A refusal to start (a text-only model) is an operator's error: one line, no backtrace.
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
