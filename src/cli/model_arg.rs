//! The `--model` flag shared by commands that load a model, and token-ID list parsing.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tessera_kernels::Device;

#[derive(Args, Debug, Clone)]
pub struct ModelArg {
    /// Model directory in the Hugging Face layout (config.json, *.safetensors, tokenizer).
    /// Default: the embedded tiny random-weight model (its output is meaningless).
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// Where the model runs: cpu, or cuda[:N] (a build with the `cuda` feature: bf16 weights on
    /// the GPU, f32 activations and state). hip[:N] is refused with the reason: the HIP backend's
    /// kernels are checked and benchmarked on their own.
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
}

fn parse_device(s: &str) -> Result<Device, String> {
    tessera_kernels::parse_device(s).map_err(|e| e.to_string())
}

impl ModelArg {
    /// Fails with the reason when the model cannot run on `--device`.
    pub fn check_device(&self) -> anyhow::Result<()> {
        tessera_prefill::runtime::check_model_device(self.device)
    }

    pub fn dir(&self) -> anyhow::Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => tessera_engine::init_model::ensure_default_model()
                .context("preparing the embedded default model"),
        }
    }

    pub fn load(&self) -> anyhow::Result<(PathBuf, tessera_engine::Model)> {
        self.check_device()?;
        let dir = self.dir()?;
        let model = tessera_engine::Model::load_on(&dir, self.device).with_context(|| {
            format!("loading model from {} onto {}", dir.display(), self.device)
        })?;
        Ok((dir, model))
    }
}

/// A comma-separated token-ID list as given on the command line.
#[derive(Clone, Debug)]
pub struct TokenIds(pub Vec<u32>);

/// Parses `1,2,3` (spaces allowed) into token IDs.
pub fn parse_ids(s: &str) -> Result<TokenIds, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().map_err(|_| format!("`{t}` is not a token ID (expected a comma-separated list of non-negative integers)")))
        .collect::<Result<Vec<u32>, String>>()
        .map(TokenIds)
}
