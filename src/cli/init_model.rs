use std::path::PathBuf;

use clap::Args;
use tessera_engine::init_model::{write_model, Preset};

#[derive(Args, Debug)]
pub struct InitModelArgs {
    /// Directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Size: `tiny` (~1 M parameters, the embedded default) or `small` (~50 M, for benchmarks).
    #[arg(long, default_value = "tiny", env = "TESSERA_PRESET")]
    pub preset: Preset,
    /// Seed of the random weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(a: InitModelArgs) -> anyhow::Result<()> {
    write_model(&a.out, a.preset, a.seed)?;
    eprintln!(
        "wrote a random-weight {:?} Kimi Linear model to {} (its output is meaningless)",
        a.preset,
        a.out.display()
    );
    Ok(())
}
