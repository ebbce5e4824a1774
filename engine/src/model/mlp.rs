//! Dense gated MLP: `down(act(gate(x), up(x)))` with SiLU-GLU (Kimi Linear) or SiTU (K3). Also
//! the shared and routed experts of MoE layers.

use tessera_kernels::cpu;

use super::k3::situ_mul;
use super::linear::Linear;
use super::mxfp4::Mxfp4Linear;
use crate::checkpoint::Checkpoint;
use crate::config::Activation;
use crate::error::Result;

/// A projection stored dense (f32) or packed MXFP4 (K3's quantized routed experts).
pub enum Proj {
    Dense(Linear),
    Mxfp4(Mxfp4Linear),
}

impl Proj {
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        match self {
            Proj::Dense(l) => l.forward(x, rows),
            Proj::Mxfp4(l) => l.forward(x, rows),
        }
    }

    pub fn parameter_count(&self) -> usize {
        match self {
            Proj::Dense(l) => l.w.len(),
            Proj::Mxfp4(l) => l.parameter_count(),
        }
    }
}

pub struct Mlp {
    pub(super) gate: Proj,
    pub(super) up: Proj,
    pub(super) down: Proj,
    pub(super) act: Activation,
}

impl Mlp {
    /// `prefix` ends with a dot, e.g. `model.layers.0.mlp.`.
    pub fn load(ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Self::from_parts(
            Linear::load(ck, &format!("{prefix}gate_proj.weight"), inter, hidden)?,
            Linear::load(ck, &format!("{prefix}up_proj.weight"), inter, hidden)?,
            Linear::load(ck, &format!("{prefix}down_proj.weight"), hidden, inter)?,
        )
    }

    pub fn from_parts(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        Ok(Mlp {
            gate: Proj::Dense(gate),
            up: Proj::Dense(up),
            down: Proj::Dense(down),
            act: Activation::Silu,
        })
    }

    pub fn from_mxfp4(gate: Mxfp4Linear, up: Mxfp4Linear, down: Mxfp4Linear) -> Self {
        Mlp {
            gate: Proj::Mxfp4(gate),
            up: Proj::Mxfp4(up),
            down: Proj::Mxfp4(down),
            act: Activation::Silu,
        }
    }

    pub fn with_activation(mut self, act: Activation) -> Self {
        self.act = act;
        self
    }

    pub fn parameter_count(&self) -> usize {
        self.gate.parameter_count() + self.up.parameter_count() + self.down.parameter_count()
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let g = self.gate.forward(x, rows);
        let u = self.up.forward(x, rows);
        let mut a = vec![0.0; g.len()];
        match self.act {
            Activation::Silu => cpu::silu_mul(&g, &u, &mut a),
            Activation::Situ { gate_beta, up_beta } => situ_mul(&g, &u, gate_beta, up_beta, &mut a),
        }
        self.down.forward(&a, rows)
    }
}
