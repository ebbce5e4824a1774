//! `Kimi_K25ImageProcessor` in Rust: navit resize (shrink, never enlarge, until the patch count
//! fits the budget and each side fits `max_size_per_side` patches), zero-pad bottom and right to
//! a multiple of `merge × patch`, normalise `(x/255 - mean) / std`, and cut into patches.
//! Settings come from `preprocessor_config.json` (transformers' or Moonshot's `media_proc_cfg`
//! spelling), with the processor's defaults for anything absent.

use std::path::Path;

use serde_json::Value;

use super::decode::RgbImage;
use super::resize::{resize_bicubic, Precision};
use crate::error::EngineError;

#[derive(Clone, Debug, PartialEq)]
pub struct PreprocessConfig {
    pub patch_size: usize,
    pub merge_size: usize,
    /// Patch budget of one image.
    pub max_patches: usize,
    /// Largest side, in patches.
    pub max_patches_per_side: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub rescale_factor: f64,
}

impl Default for PreprocessConfig {
    fn default() -> Self {
        PreprocessConfig {
            patch_size: 14,
            merge_size: 2,
            max_patches: 16384,
            max_patches_per_side: 512,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
        }
    }
}

impl PreprocessConfig {
    /// Reads `preprocessor_config.json` from `dir` if it exists; `patch_size` and `merge_size`
    /// default to the vision config's.
    pub fn from_dir(dir: &Path, patch_size: usize, merge_size: usize) -> Result<Self, EngineError> {
        let mut cfg = PreprocessConfig {
            patch_size,
            merge_size,
            ..Default::default()
        };
        let path = dir.join("preprocessor_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(cfg);
        };
        let err = |message: String| EngineError::Config {
            path: path.clone(),
            message,
        };
        let root: Value =
            serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        // Moonshot's remote-code processor nests its settings under `media_proc_cfg`.
        let v = root.get("media_proc_cfg").unwrap_or(&root);
        let uint = |names: &[&str]| -> Result<Option<usize>, EngineError> {
            match names
                .iter()
                .find_map(|n| v.get(*n).filter(|x| !x.is_null()))
            {
                None => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|&x| x > 0)
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| err(format!("`{}` must be a positive integer", names[0]))),
            }
        };
        let triple = |name: &str| -> Result<Option<[f32; 3]>, EngineError> {
            match v.get(name).filter(|x| !x.is_null()) {
                None => Ok(None),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    Ok(Some([0, 1, 2].map(|i| a[i].as_f64().unwrap() as f32)))
                }
                Some(Value::Number(n)) => Ok(Some([n.as_f64().unwrap() as f32; 3])),
                Some(other) => Err(err(format!("`{name}` must be 3 numbers, got {other}"))),
            }
        };
        if let Some(p) = uint(&["patch_size"])? {
            cfg.patch_size = p;
        }
        if let Some(m) = uint(&["merge_size", "merge_kernel_size"])? {
            cfg.merge_size = m;
        }
        if let Some(m) = uint(&["max_patches", "in_patch_limit"])? {
            cfg.max_patches = m;
        }
        if let Some(s) = uint(&["patch_limit_on_one_side"])? {
            cfg.max_patches_per_side = s;
        }
        if let Some(size) = v.get("size").filter(|x| x.is_object()) {
            let h = size.get("max_height").and_then(Value::as_u64);
            let w = size.get("max_width").and_then(Value::as_u64);
            match (h, w) {
                (Some(h), Some(w)) if h == w && h > 0 => cfg.max_patches_per_side = h as usize,
                _ => {
                    return Err(err(
                        "`size` must hold equal positive `max_height` and `max_width`".into(),
                    ))
                }
            }
        }
        if let Some(m) = triple("image_mean")? {
            cfg.image_mean = m;
        }
        if let Some(s) = triple("image_std")? {
            if s.iter().any(|&x| x <= 0.0) {
                return Err(err("`image_std` must be positive".into()));
            }
            cfg.image_std = s;
        }
        if let Some(r) = v.get("rescale_factor").and_then(Value::as_f64) {
            cfg.rescale_factor = r;
        }
        Ok(cfg)
    }

    /// `(resized, padded)` sizes as `(height, width)`: transformers' `navit_resize`.
    pub fn target_size(&self, height: usize, width: usize) -> ((usize, usize), (usize, usize)) {
        let p = self.patch_size;
        let patches_h = (height / p).max(1) as f64;
        let patches_w = (width / p).max(1) as f64;
        let by_total = (self.max_patches as f64 / (patches_h * patches_w)).sqrt();
        let side = (self.max_patches_per_side * p) as f64;
        let scale = 1.0f64
            .min(by_total)
            .min(side / height as f64)
            .min(side / width as f64);
        let cap = self.max_patches_per_side * p;
        let new_h = ((height as f64 * scale) as usize).max(1).min(cap);
        let new_w = ((width as f64 * scale) as usize).max(1).min(cap);
        let factor = self.merge_size * p;
        (
            (new_h, new_w),
            (
                new_h.next_multiple_of(factor),
                new_w.next_multiple_of(factor),
            ),
        )
    }
}

/// A preprocessed image: `grid[1] * grid[2]` patches of `3 × patch × patch` floats each
/// (channel, row, column), in raster order of the patch grid.
#[derive(Clone, Debug, PartialEq)]
pub struct Patches {
    /// `[t, h, w]` in patches.
    pub grid: [usize; 3],
    pub values: Vec<f32>,
}

impl Patches {
    pub fn count(&self) -> usize {
        self.grid.iter().product()
    }
}

pub fn preprocess(img: &RgbImage, cfg: &PreprocessConfig) -> Patches {
    let ((rh, rw), (ph, pw)) = cfg.target_size(img.height, img.width);
    let resized = resize_bicubic(&img.pixels, img.width, img.height, rw, rh, Precision::Torch);
    // Fused rescale + normalise as transformers does it: (x - mean/r) / (std/r) in f32.
    let inv = (1.0 / cfg.rescale_factor) as f32;
    let mean = cfg.image_mean.map(|m| m * inv);
    let std = cfg.image_std.map(|s| s * inv);
    let p = cfg.patch_size;
    let (gh, gw) = (ph / p, pw / p);
    let mut values = vec![0.0f32; gh * gw * 3 * p * p];
    for gy in 0..gh {
        for gx in 0..gw {
            let base = (gy * gw + gx) * 3 * p * p;
            for c in 0..3 {
                for py in 0..p {
                    for px in 0..p {
                        let (y, x) = (gy * p + py, gx * p + px);
                        let raw = if y < rh && x < rw {
                            resized[(y * rw + x) * 3 + c]
                        } else {
                            0
                        };
                        values[base + (c * p + py) * p + px] = (raw as f32 - mean[c]) / std[c];
                    }
                }
            }
        }
    }
    Patches {
        grid: [1, gh, gw],
        values,
    }
}
