//! Dense SiLU-gated MLP: `down(silu(gate(x)) · up(x))`. Also the shared experts of MoE layers.

use tessera_kernels::cpu;

use super::linear::Linear;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// `prefix` ends with a dot, e.g. `model.layers.0.mlp.`.
    pub fn load(ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: Linear::load(ck, &format!("{prefix}gate_proj.weight"), inter, hidden)?,
            up: Linear::load(ck, &format!("{prefix}up_proj.weight"), inter, hidden)?,
            down: Linear::load(ck, &format!("{prefix}down_proj.weight"), hidden, inter)?,
        })
    }

    pub fn from_parts(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        Ok(Mlp { gate, up, down })
    }

    pub fn parameter_count(&self) -> usize {
        self.gate.w.len() + self.up.w.len() + self.down.w.len()
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let g = self.gate.forward(x, rows);
        let u = self.up.forward(x, rows);
        let mut a = vec![0.0; g.len()];
        cpu::silu_mul(&g, &u, &mut a);
        self.down.forward(&a, rows)
    }
}
