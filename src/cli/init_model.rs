use std::path::PathBuf;

use clap::Args;
use tessera_engine::init_model::{write_model_arch, Arch, Preset};

#[derive(Args, Debug)]
pub struct InitModelArgs {
    /// Directory to write (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Architecture: `kimi_linear`, `kimi_k3` (AttnRes, latent MoE with SiTU, gated MLA, bounded
    /// KDA gate; bf16 experts) or `kimi_k3_mxfp4` (the same with MXFP4 routed experts), in the
    /// real checkpoint layout.
    #[arg(long, default_value = "kimi_linear", env = "TESSERA_ARCH")]
    pub arch: Arch,
    /// Size: `tiny` (~1 M parameters, the embedded default), `small` (~50 M, for CPU
    /// benchmarks) or `medium` (~1.6 B as K3, for GPU benchmarks on one device; minutes to write).
    #[arg(long, default_value = "tiny", env = "TESSERA_PRESET")]
    pub preset: Preset,
    /// Seed of the random weights; the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(a: InitModelArgs) -> anyhow::Result<()> {
    write_model_arch(&a.out, a.arch, a.preset, a.seed)?;
    eprintln!(
        "wrote a random-weight {:?} {:?} model to {} (its output is meaningless)",
        a.preset,
        a.arch,
        a.out.display()
    );
    Ok(())
}
