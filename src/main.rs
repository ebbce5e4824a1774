//! `tessera`: the command line of the Tessera serving system.

mod cli;
mod serve;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    cli::init_logging(&args.log);
    if let Some(n) = args.threads {
        // Only fails if a pool exists already, which cannot happen this early.
        let _ = rayon_pool(n);
    }
    match cli::run(args.command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn rayon_pool(n: usize) -> Result<(), String> {
    tessera_engine::set_num_threads(n).map_err(|e| e.to_string())
}
