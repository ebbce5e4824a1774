use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tessera_engine::generate::{generate_with_images, GenerateRequest};
use tessera_engine::tokenizer::Tokenizer;
use tessera_engine::vision::{expand_placeholders, PlacedImage};
use tessera_engine::SamplingParams;

use super::model_arg::{parse_ids, ModelArg, TokenIds};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prompt token IDs, comma-separated.
    #[arg(long, value_parser = parse_ids, conflicts_with = "prompt", required_unless_present = "prompt")]
    pub prompt_ids: Option<TokenIds>,
    /// Prompt text (needs a tokenizer in the model directory).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 32, env = "TESSERA_MAX_NEW_TOKENS")]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 disables).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 disables).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass (default: the whole prompt at once).
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Print `{"token_ids": [...]}` (generated tokens only) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Image file (PNG, JPEG or WebP), repeatable: the n-th image goes to the prompt's n-th run
    /// of image placeholder tokens, written once (expanded to the image's token count) or
    /// already expanded.
    #[arg(long = "image", env = "TESSERA_IMAGES", value_delimiter = ',')]
    pub images: Vec<PathBuf>,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let (dir, model) = a.model.load()?;
    let tokenizer = || {
        Tokenizer::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer from {}", dir.display()))
    };
    let prompt = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.0.clone(),
        (None, Some(text)) => tokenizer()?.encode(text, false)?,
        (None, None) => anyhow::bail!("give --prompt-ids or --prompt"),
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt has no tokens");
    let (prompt, images) = place_images(&dir, prompt, &a.images)?;
    let req = GenerateRequest {
        prompt,
        max_new_tokens: a.max_new_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: a.seed,
            ..SamplingParams::default()
        },
        stop_ids: if a.ignore_eos {
            vec![]
        } else {
            model.config.eos_token_ids.clone()
        },
        prefill_chunk: a.prefill_chunk,
    };
    let out = generate_with_images(&model, &req, &images)?;
    if a.json {
        println!("{}", serde_json::json!({ "token_ids": out }));
    } else {
        println!("{}", tokenizer()?.decode(&out, true)?);
    }
    Ok(())
}

/// Encodes `files` and widens their placeholders in `prompt`.
fn place_images(
    dir: &std::path::Path,
    prompt: Vec<u32>,
    files: &[PathBuf],
) -> anyhow::Result<(Vec<u32>, Vec<PlacedImage>)> {
    if files.is_empty() {
        return Ok((prompt, Vec::new()));
    }
    let vision = super::encode::load_vision(dir)?;
    let mut embeds = Vec::with_capacity(files.len());
    for f in files {
        let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        let e = vision
            .encode_image(&bytes)
            .with_context(|| format!("encoding {}", f.display()))?;
        embeds.push(Arc::new(e));
    }
    let counts: Vec<usize> = embeds.iter().map(|e| e.n_tokens).collect();
    let (prompt, positions) = expand_placeholders(&prompt, vision.placeholder_token_id(), &counts)
        .with_context(|| {
            format!(
                "placing {} image(s) on placeholder token {}",
                files.len(),
                vision.placeholder_token_id()
            )
        })?;
    let images = positions
        .into_iter()
        .zip(embeds)
        .map(|(position, embedding)| PlacedImage {
            position,
            embedding,
        })
        .collect();
    Ok((prompt, images))
}
