//! The image path of `kimi_k25`-layout models (Kimi K2.5, K3): decode an image, preprocess it
//! as `transformers`' `Kimi_K25ImageProcessor` does, run the MoonViT tower, merge 2×2 patches
//! and project into the text model's embedding space. The rows that come out replace the
//! embeddings of the prompt's image placeholder tokens during prefill.

mod decode;
mod error;
mod ops;
mod placeholders;
mod preprocess;
mod projector;
mod resize;
mod tower;

use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::EngineError;
use projector::Projector;
use tower::Tower;

pub use decode::{decode_rgb, RgbImage};
pub use error::ImageError;
pub use placeholders::{check_placed, expand_placeholders, page_marks, splices_in};
pub use preprocess::{preprocess, Patches, PreprocessConfig};
pub use resize::{resize_bicubic, Precision};

/// What one image contributes to a prompt: `n_tokens` rows of the text model's hidden size.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageEmbedding {
    /// SHA-256 of the image bytes as received; part of prefix-cache keys.
    pub content_hash: [u8; 32],
    pub n_tokens: usize,
    pub hidden: usize,
    /// Row-major `[n_tokens, hidden]`.
    pub values: Vec<f32>,
}

impl ImageEmbedding {
    /// Row `i` (one image token's embedding).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.hidden..(i + 1) * self.hidden]
    }
}

/// Limits checked before an image is fully decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// Encoded size.
    pub max_bytes: usize,
    /// Decoded `width * height`.
    pub max_pixels: u64,
    /// Largest width or height.
    pub max_side: u32,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_bytes: 20 << 20,
            max_pixels: 40_000_000,
            max_side: 16_384,
        }
    }
}

/// An image placed in a prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacedImage {
    /// Index in the (expanded) prompt of the image's first placeholder token.
    pub position: usize,
    pub embedding: Arc<ImageEmbedding>,
}

/// Vision tower + patch merger + projector, loaded once per process.
pub struct VisionModel {
    tower: Tower,
    projector: Projector,
    preprocess: PreprocessConfig,
    hidden: usize,
    placeholder: u32,
    limits: ImageLimits,
}

impl VisionModel {
    /// Loads the vision part of a model directory. `Ok(None)` when `config.json` has no
    /// `vision_config` (a text-only model).
    pub fn load(model_dir: &Path) -> Result<Option<VisionModel>, EngineError> {
        let Some(vc) = ModelConfig::vision_from_dir(model_dir)? else {
            return Ok(None);
        };
        let vc = &vc;
        let placeholder = vc.placeholder_token_id.ok_or_else(|| EngineError::Config {
            path: model_dir.join("config.json"),
            message: "vision_config is present but neither media_placeholder_token_id nor \
                      image_token_id is set"
                .into(),
        })?;
        let ck = Checkpoint::open(model_dir)?;
        let tower = Tower::load(&ck, vc)?;
        let projector = Projector::load(&ck, vc)?;
        if vc.merge_kernel[0] != vc.merge_kernel[1] {
            return Err(EngineError::Config {
                path: model_dir.join("config.json"),
                message: format!(
                    "vision_config.merge_kernel_size {:?} must be square (the processor pads both \
                     sides to one multiple)",
                    vc.merge_kernel
                ),
            });
        }
        let preprocess = PreprocessConfig::from_dir(model_dir, vc.patch_size, vc.merge_kernel[0])?;
        if preprocess.patch_size != vc.patch_size {
            return Err(EngineError::Config {
                path: model_dir.join("preprocessor_config.json"),
                message: format!(
                    "patch_size {} differs from vision_config.patch_size {}",
                    preprocess.patch_size, vc.patch_size
                ),
            });
        }
        tracing::info!(
            tower_layers = vc.num_layers,
            tower_hidden = tower.hidden(),
            parameters = tower.parameter_count() + projector.parameter_count(),
            "vision tower loaded"
        );
        Ok(Some(VisionModel {
            tower,
            projector,
            preprocess,
            hidden: vc.text_hidden_size,
            placeholder,
            limits: ImageLimits::default(),
        }))
    }

    /// Decodes (PNG/JPEG/WebP, sniffed from the bytes), preprocesses, runs the tower, merges
    /// and projects one image.
    pub fn encode_image(&self, bytes: &[u8]) -> Result<ImageEmbedding, ImageError> {
        let patches = self.preprocess_image(bytes)?;
        let values = self.encode_patches(&patches);
        Ok(ImageEmbedding {
            content_hash: Sha256::digest(bytes).into(),
            n_tokens: values.len() / self.hidden,
            hidden: self.hidden,
            values,
        })
    }

    /// Decoding and preprocessing alone: what `Kimi_K25ImageProcessor` returns.
    pub fn preprocess_image(&self, bytes: &[u8]) -> Result<Patches, ImageError> {
        let img = decode_rgb(bytes, &self.limits)?;
        Ok(preprocess(&img, &self.preprocess))
    }

    /// Tower, merge and projector on preprocessed patches: `[tokens, hidden_size]` row-major.
    pub fn encode_patches(&self, patches: &Patches) -> Vec<f32> {
        let [t, rows, cols] = patches.grid;
        assert_eq!(t, 1, "images have one frame");
        let h = self.tower.forward(&patches.values, rows, cols);
        self.projector.forward(&h, rows, cols)
    }

    /// Tokens an image of `width × height` pixels becomes, without decoding it.
    pub fn tokens_for_size(&self, width: usize, height: usize) -> usize {
        let (_, (ph, pw)) = self.preprocess.target_size(height, width);
        let p = self.preprocess.patch_size;
        self.projector.tokens(ph / p, pw / p)
    }

    pub fn preprocess_config(&self) -> &PreprocessConfig {
        &self.preprocess
    }

    /// The text model's hidden size (columns of every embedding).
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }

    /// The token that marks where an image goes in a prompt.
    pub fn placeholder_token_id(&self) -> u32 {
        self.placeholder
    }

    pub fn limits(&self) -> &ImageLimits {
        &self.limits
    }

    /// Replaces the limits checked by [`encode_image`](Self::encode_image).
    pub fn set_limits(&mut self, limits: ImageLimits) {
        self.limits = limits;
    }
}
