use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tessera_engine::vision::VisionModel;

use super::model_arg::ModelArg;

#[derive(Args, Debug)]
pub struct EncodeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Image file (PNG, JPEG or WebP; the format is read from the bytes).
    #[arg(long, env = "TESSERA_IMAGE")]
    pub image: PathBuf,
    /// Output file: f32 array [n_image_tokens, text_hidden] in .npy format (the embeddings that
    /// replace the image's placeholder tokens).
    #[arg(long, env = "TESSERA_OUT")]
    pub out: PathBuf,
}

/// Loads the vision tower of `dir`, failing with a clear message for a text-only model.
pub fn load_vision(dir: &std::path::Path) -> anyhow::Result<VisionModel> {
    VisionModel::load(dir)
        .with_context(|| format!("loading the vision tower from {}", dir.display()))?
        .with_context(|| {
            format!(
                "{} is a text-only model (config.json has no vision_config)",
                dir.display()
            )
        })
}

pub fn run(a: EncodeArgs) -> anyhow::Result<()> {
    a.model.check_device()?;
    let dir = a.model.dir()?;
    let vision = load_vision(&dir)?;
    let bytes =
        std::fs::read(&a.image).with_context(|| format!("reading {}", a.image.display()))?;
    let e = vision
        .encode_image(&bytes)
        .with_context(|| format!("encoding {}", a.image.display()))?;
    tessera_engine::npy::write_f32(&a.out, &[e.n_tokens, e.hidden], &e.values)
        .with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}
