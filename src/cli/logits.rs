use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::model_arg::{parse_ids, ModelArg, TokenIds};

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prompt token IDs, comma-separated (e.g. `1,2,3`).
    #[arg(long, env = "TESSERA_PROMPT_IDS", value_parser = parse_ids)]
    pub prompt_ids: TokenIds,
    /// Output file: f32 array [T, vocab] in .npy format.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: LogitsArgs) -> anyhow::Result<()> {
    let ids: Vec<u32> = a.prompt_ids.0;
    anyhow::ensure!(!ids.is_empty(), "--prompt-ids must name at least one token");
    let (_, model) = a.model.load()?;
    let logits = tessera_engine::generate::prompt_logits(&model, &ids)?;
    let vocab = model.config.vocab_size;
    tessera_engine::npy::write_f32(&a.out, &[ids.len(), vocab], &logits)
        .with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}
