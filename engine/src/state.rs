//! Per-request model state: what a sequence carries from one forward call to the next.
//!
//! KDA layers carry a short-conv window and an f32 recurrent state of fixed size; MLA layers carry
//! the latent history `[c_kv | k_pe]`, one row per token. This owned form is what a single
//! sequence needs; the flat page pool stores the same bytes in pages.

use crate::config::{AttnKind, ModelConfig};

#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// `[3·proj_dim, conv_kernel-1]`: the last inputs of the q, k and v short convolutions.
    pub conv: Vec<f32>,
    /// `[heads, head_dim, head_dim]`, f32.
    pub recurrent: Vec<f32>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlaState {
    /// `[tokens, kv_lora_rank]`, after `kv_a_layernorm`.
    pub ckv: Vec<f32>,
    /// `[tokens, qk_rope_head_dim]` (never rotated: Kimi's MLA is NoPE).
    pub kpe: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

#[derive(Clone, Debug, PartialEq)]
pub struct SequenceState {
    /// Tokens already folded into the state.
    pub len: usize,
    pub layers: Vec<LayerState>,
}

impl SequenceState {
    pub fn new(cfg: &ModelConfig) -> Self {
        let layers = cfg
            .attn
            .iter()
            .map(|kind| match kind {
                AttnKind::Kda => {
                    let p = cfg.kda.proj_dim();
                    LayerState::Kda(KdaState {
                        conv: vec![0.0; 3 * p * (cfg.kda.conv_kernel - 1)],
                        recurrent: vec![
                            0.0;
                            cfg.kda.num_heads * cfg.kda.head_dim * cfg.kda.head_dim
                        ],
                    })
                }
                AttnKind::Mla => LayerState::Mla(MlaState::default()),
            })
            .collect();
        SequenceState { len: 0, layers }
    }
}
