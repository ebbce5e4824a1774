//! The whole-model forward's glue kernels (`model.cu`) for any model width: f32 activations,
//! bf16 weights and GEMM inputs, f32 recurrent state — or, loaded `exact`, f32 throughout (GEMM
//! inputs, the embedding table and MLA's `kv_b` as f32), the mode that is held to the f32
//! reference's tolerance. Buffers are passed as device addresses ([`DevPtr`], from
//! [`dptr`]) so callers can hand in sub-ranges and leave optional inputs null; each wrapper
//! documents the extents its kernel reads and writes, and the caller owns that contract.

use cudarc::driver::{CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::model_mla::FlashKernels;
use super::{CudaDevice, CudaError};

/// The glue kernels' source.
pub const MODEL_SOURCE: &str = include_str!("model.cu");

/// A device address (`CUdeviceptr`); 0 stands for "none" where a kernel takes an optional input.
pub type DevPtr = u64;

/// The device address of a buffer's first element, as seen from `stream`.
pub fn base_ptr<T, S: DevicePtr<T>>(stream: &CudaStream, s: &S) -> DevPtr {
    s.device_ptr(stream).0
}

/// The device address of a buffer (or a view of one), element `offset` onward.
pub fn dptr<T, S: DevicePtr<T>>(dev: &CudaDevice, s: &S, offset: usize) -> DevPtr {
    let (p, _sync) = s.device_ptr(dev.stream());
    p + (offset * std::mem::size_of::<T>()) as u64
}

pub(super) const MT: u32 = 128;
/// Widest short-conv kernel `short_conv_silu_seg` keeps in registers.
pub const MAX_CONV_KERNEL: usize = 17;
/// Tokens per thread of `short_conv_silu_seg` (`CONV_TILE`).
const CONV_TILE: usize = 64;
/// Widest KDA head `kda_recurrent_seg` keeps in registers (`KDA_MAX_DK`).
pub const KDA_MAX_HEAD_DIM: usize = 128;
/// Value columns and row parts of one `kda_recurrent_seg` block (`KDA_COLS`, `KDA_PARTS`).
const KDA_COLS: usize = 16;
const KDA_PARTS: usize = 8;
/// Most AttnRes sources (`blocks + 1`) `attnres_mix` takes.
pub const MAX_ATTN_RES_SOURCES: usize = 64;

pub(super) enum Arg {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

pub(super) fn i(v: usize) -> Arg {
    Arg::I(v as i32)
}

/// Launches `f` with `args` pushed in order (nothing when the grid is empty).
///
/// # Safety
/// `args` must be `f`'s parameter list, in order and with its types, and every buffer they
/// address must hold the extents the kernel reads and writes.
pub(super) unsafe fn launch_fn(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<(), CudaError> {
    // SAFETY: the caller's contract.
    unsafe { launch_fn_on(dev.stream(), f, cfg, args) }
}

/// [`launch_fn`] on a stream of the caller's choice (same contract; the caller orders it against
/// the device's stream).
pub(super) unsafe fn launch_fn_on(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<(), CudaError> {
    if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
        return Ok(());
    }
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::P(v) => b.arg(v),
            Arg::I(v) => b.arg(v),
            Arg::L(v) => b.arg(v),
            Arg::F(v) => b.arg(v),
        };
    }
    // SAFETY: the caller's contract above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The compiled glue kernels.
pub struct ModelKernels {
    f: std::collections::HashMap<&'static str, CudaFunction>,
    exact: bool,
    /// The flash MLA kernels (not compiled in the exact mode, which never takes them).
    pub(super) flash: Option<FlashKernels>,
    /// Whether MLA attention takes the flash kernel where it applies (see [`super::model_mla`]).
    pub(super) mla_flash: bool,
}

/// The entry points of `model.cu`.
pub const MODEL_KERNELS: &[&str] = &[
    "embed_rows",
    "to_act",
    "from_bf16",
    "add_inplace",
    "mul_sigmoid",
    "sigmoid_inplace",
    "rmsnorm_rows",
    "short_conv_silu_seg",
    "short_conv_state",
    "kda_gate",
    "l2norm_heads",
    "kda_recurrent_seg",
    "mla_absorb_q",
    "mla_store_rows",
    "mla_attend",
    "mla_unabsorb",
    "glu_act",
    "gather_act",
    "scatter_add_weighted",
    "mxfp4_linear",
    "attnres_mix",
];

/// A 3-D grid of `block`-thread blocks.
pub(super) fn grid3(x: usize, y: usize, z: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn grid(x: usize, y: usize, block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Grid-stride launch for `n` elements.
fn flat(n: usize) -> LaunchConfig {
    grid(n.div_ceil(256).clamp(1, 65_535), 1, 256, 0)
}

impl ModelKernels {
    /// `exact`: f32 GEMM inputs and weights (see the module docs).
    pub fn load(dev: &CudaDevice, exact: bool) -> Result<Self, CudaError> {
        let m = dev.module("model", MODEL_SOURCE, &[])?;
        let mut f = std::collections::HashMap::new();
        for &n in MODEL_KERNELS {
            f.insert(n, m.load_function(n)?);
        }
        Ok(ModelKernels {
            f,
            exact,
            flash: if exact {
                None
            } else {
                Some(FlashKernels::load(dev)?)
            },
            mla_flash: std::env::var("TESSERA_MLA_PATH").as_deref() != Ok("generic"),
        })
    }

    /// Whether GEMM inputs and the weights these kernels read are f32.
    pub fn exact(&self) -> bool {
        self.exact
    }

    /// Bytes of one GEMM-input element: 2 (bf16), or 4 when exact.
    pub fn act_bytes(&self) -> usize {
        if self.exact {
            4
        } else {
            2
        }
    }

    pub(super) fn ex(&self) -> Arg {
        Arg::I(self.exact as i32)
    }

    pub(super) fn launch(
        &self,
        dev: &CudaDevice,
        name: &str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        // SAFETY: every wrapper below passes the argument list of its kernel in `model.cu`, in
        // order and with the kernel's types; the extents are the callers' documented contract.
        unsafe { launch_fn(dev, &self.f[name], cfg, args) }
    }

    /// `out[rows, dim]` f32 ← `table` rows `ids[rows]` (i32 device array, ids < vocab; the table
    /// bf16, or f32 when exact).
    pub fn embed_rows(
        &self,
        dev: &CudaDevice,
        ids: DevPtr,
        table: DevPtr,
        out: DevPtr,
        rows: usize,
        dim: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(ids), Arg::P(table), Arg::P(out), i(dim), self.ex()];
        self.launch(dev, "embed_rows", grid(rows, 1, MT, 0), &a)
    }

    /// `y[n]` (a GEMM input) ← `x[n]` f32.
    pub fn to_act(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        y: DevPtr,
        n: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(x), Arg::P(y), Arg::L(n as i64), self.ex()];
        self.launch(dev, "to_act", flat(n), &a)
    }

    /// `y[n]` f32 ← `x[n]` bf16 (the tuned kernels' outputs).
    pub fn from_bf16(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        y: DevPtr,
        n: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(x), Arg::P(y), Arg::L(n as i64)];
        self.launch(dev, "from_bf16", flat(n), &a)
    }

    /// `acc[n] += x[n]`.
    pub fn add(&self, dev: &CudaDevice, acc: DevPtr, x: DevPtr, n: usize) -> Result<(), CudaError> {
        let a = [Arg::P(acc), Arg::P(x), Arg::L(n as i64)];
        self.launch(dev, "add_inplace", flat(n), &a)
    }

    /// `x[n] *= σ(g[n])`.
    pub fn mul_sigmoid(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        g: DevPtr,
        n: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(x), Arg::P(g), Arg::L(n as i64)];
        self.launch(dev, "mul_sigmoid", flat(n), &a)
    }

    /// `x[n] = σ(x[n])`.
    pub fn sigmoid(&self, dev: &CudaDevice, x: DevPtr, n: usize) -> Result<(), CudaError> {
        let a = [Arg::P(x), Arg::L(n as i64)];
        self.launch(dev, "sigmoid_inplace", flat(n), &a)
    }

    /// RMSNorm of `rows` rows; see [`NormRows`].
    pub fn rms_norm(&self, dev: &CudaDevice, n: &NormRows) -> Result<(), CudaError> {
        let a = [
            Arg::P(n.x),
            Arg::P(n.in_rows),
            i(n.in_stride),
            Arg::P(n.weight),
            i(n.dim),
            Arg::F(n.eps),
            Arg::P(n.gate),
            Arg::P(n.out_f32),
            Arg::P(n.out_rows),
            i(n.out_stride),
            Arg::P(n.out_act),
            self.ex(),
        ];
        self.launch(dev, "rmsnorm_rows", grid(n.rows, 1, MT, 0), &a)
    }

    /// Causal depthwise conv + SiLU for `segments` sequences: `x, out [N, channels]` f32, rows of
    /// segment `s` at `seg_start[s]..seg_start[s+1]` (i32 device array of `segments + 1`; the
    /// longest segment has `longest` rows), `weight [channels, kernel]` f32, each segment's state
    /// `[channels, kernel-1]` f32 where `state` says (read, advanced, written; in place too).
    #[allow(clippy::too_many_arguments)]
    pub fn short_conv_silu(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        weight: DevPtr,
        state: &SegState,
        seg_start: DevPtr,
        out: DevPtr,
        (segments, longest): (usize, usize),
        channels: usize,
        kernel: usize,
    ) -> Result<(), CudaError> {
        if kernel == 0 || kernel > MAX_CONV_KERNEL {
            return Err(CudaError::Shape(format!(
                "short conv: kernel {kernel} outside 1..={MAX_CONV_KERNEL}"
            )));
        }
        let a = [
            Arg::P(x),
            Arg::P(weight),
            Arg::P(state.src),
            Arg::P(state.src_off),
            Arg::P(seg_start),
            Arg::P(out),
            i(channels),
            i(kernel),
        ];
        let tiles = longest.div_ceil(CONV_TILE).max(1);
        let cfg = grid3(channels.div_ceil(MT as usize), segments, tiles, MT);
        self.launch(dev, "short_conv_silu_seg", cfg, &a)?;
        let a = [
            Arg::P(x),
            Arg::P(state.src),
            Arg::P(state.dst),
            Arg::P(state.src_off),
            Arg::P(state.dst_off),
            Arg::P(seg_start),
            i(channels),
            i(kernel),
        ];
        let cfg = grid(channels.div_ceil(MT as usize), segments, MT, 0);
        self.launch(dev, "short_conv_state", cfg, &a)
    }

    /// KDA forget gate in place over `g [n / proj, proj]`: `dt_bias [proj]`, `rate [heads]`
    /// (`exp(A_log)`), the bounded form when `lower_bound` is given.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_gate(
        &self,
        dev: &CudaDevice,
        g: DevPtr,
        dt_bias: DevPtr,
        rate: DevPtr,
        proj: usize,
        head_dim: usize,
        n: usize,
        lower_bound: Option<f32>,
    ) -> Result<(), CudaError> {
        let a = [
            Arg::P(g),
            Arg::P(dt_bias),
            Arg::P(rate),
            i(proj),
            i(head_dim),
            Arg::L(n as i64),
            Arg::I(lower_bound.is_some() as i32),
            Arg::F(lower_bound.unwrap_or(0.0)),
        ];
        self.launch(dev, "kda_gate", flat(n), &a)
    }

    /// In place L2 normalisation of `heads` runs of `dim` starting at column `col0` of each of
    /// `rows` rows of `stride` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn l2norm_heads(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        rows: usize,
        stride: usize,
        col0: usize,
        heads: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(x), i(stride), i(col0), i(dim), Arg::F(eps)];
        self.launch(dev, "l2norm_heads", grid(rows, heads, MT, 0), &a)
    }

    /// The KDA recurrence; see [`KdaRecurrent`].
    pub fn kda_recurrent(&self, dev: &CudaDevice, k: &KdaRecurrent) -> Result<(), CudaError> {
        if k.head_dim == 0 || k.head_dim > KDA_MAX_HEAD_DIM {
            return Err(CudaError::Shape(format!(
                "kda recurrent: head_dim {} outside 1..={KDA_MAX_HEAD_DIM}",
                k.head_dim
            )));
        }
        let a = [
            Arg::P(k.qkv),
            Arg::P(k.g),
            Arg::P(k.beta),
            Arg::P(k.state.src),
            Arg::P(k.state.dst),
            Arg::P(k.state.src_off),
            Arg::P(k.state.dst_off),
            Arg::P(k.seg_start),
            Arg::P(k.out),
            i(k.heads),
            i(k.head_dim),
            Arg::F(k.scale),
        ];
        // Blocks of KDA_COLS value columns × KDA_PARTS row parts (model.cu).
        let cfg = LaunchConfig {
            grid_dim: (
                k.segments as u32,
                k.heads as u32,
                k.head_dim.div_ceil(KDA_COLS) as u32,
            ),
            block_dim: ((KDA_COLS * KDA_PARTS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(dev, "kda_recurrent_seg", cfg, &a)
    }

    /// Writes `rows` new latent rows `[c_kv | k_pe]` (`ckv [rows, rank]`, the k_pe tail of `kv
    /// [rows, rank + rope]`) to `base + dst[t]` floats (`dst`: i64 device array).
    #[allow(clippy::too_many_arguments)]
    pub fn mla_store_rows(
        &self,
        dev: &CudaDevice,
        kv: DevPtr,
        ckv: DevPtr,
        base: DevPtr,
        dst: DevPtr,
        rows: usize,
        rank: usize,
        rope: usize,
    ) -> Result<(), CudaError> {
        let a = [
            Arg::P(kv),
            Arg::P(ckv),
            Arg::P(base),
            Arg::P(dst),
            i(rank),
            i(rope),
        ];
        self.launch(dev, "mla_store_rows", grid(rows, 1, MT, 0), &a)
    }

    /// `out [rows, inter]` (a GEMM input) ← activation of the stacked `gate_up [rows, 2·inter]` f32:
    /// SiLU-GLU, or SiTU with `situ = Some((β1, β2))`.
    pub fn glu(
        &self,
        dev: &CudaDevice,
        gate_up: DevPtr,
        out: DevPtr,
        rows: usize,
        inter: usize,
        situ: Option<(f32, f32)>,
    ) -> Result<(), CudaError> {
        let (b1, b2) = situ.unwrap_or((1.0, 1.0));
        let n = rows * inter;
        let a = [
            Arg::P(gate_up),
            Arg::P(out),
            i(inter),
            Arg::L(n as i64),
            Arg::I(situ.is_some() as i32),
            Arg::F(b1),
            Arg::F(b2),
            self.ex(),
        ];
        self.launch(dev, "glu_act", flat(n), &a)
    }

    /// `out[i, :]` (a GEMM input) ← `src[rows[i], :]` f32 for `n` indices (i32 device array; a
    /// negative index gives a row of zeros).
    pub fn gather_act(
        &self,
        dev: &CudaDevice,
        src: DevPtr,
        rows: DevPtr,
        out: DevPtr,
        n: usize,
        dim: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(src), Arg::P(rows), Arg::P(out), i(dim), self.ex()];
        self.launch(dev, "gather_act", grid(n, 1, MT, 0), &a)
    }

    /// `acc[rows[i], :] += w[i] · y[i, :]` for `n` distinct rows.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter_add_weighted(
        &self,
        dev: &CudaDevice,
        acc: DevPtr,
        y: DevPtr,
        rows: DevPtr,
        w: DevPtr,
        n: usize,
        dim: usize,
    ) -> Result<(), CudaError> {
        let a = [Arg::P(acc), Arg::P(y), Arg::P(rows), Arg::P(w), i(dim)];
        self.launch(dev, "scatter_add_weighted", grid(n, 1, MT, 0), &a)
    }

    /// `out [rows, out_dim]` f32 (row `r` at `out + r·out_stride`) ← the GEMM input `x [rows,
    /// in_dim]` times the packed MXFP4 weight (`packed [out_dim, in_dim/2]`, `scale [out_dim,
    /// in_dim/32]`)ᵀ.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_linear(
        &self,
        dev: &CudaDevice,
        x: DevPtr,
        packed: DevPtr,
        scale: DevPtr,
        out: DevPtr,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out_stride: usize,
    ) -> Result<(), CudaError> {
        if !in_dim.is_multiple_of(32) || out_stride < out_dim {
            return Err(CudaError::Shape(format!(
                "mxfp4 linear: in_dim {in_dim} is not a multiple of 32, or output stride \
                 {out_stride} below {out_dim}"
            )));
        }
        let a = [
            Arg::P(x),
            Arg::P(packed),
            Arg::P(scale),
            Arg::P(out),
            i(in_dim),
            i(out_dim),
            i(out_stride),
            self.ex(),
        ];
        let warps = (MT / 32) as usize;
        self.launch(
            dev,
            "mxfp4_linear",
            grid(out_dim.div_ceil(warps), rows, MT, 0),
            &a,
        )
    }

    /// AttnRes mix of `rows` rows of `dim`: sources `blocks [n_blocks, rows, dim]` and, when not
    /// null, `p [rows, dim]`; pseudo-query `q [dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_res_mix(
        &self,
        dev: &CudaDevice,
        blocks: DevPtr,
        n_blocks: usize,
        p: DevPtr,
        q: DevPtr,
        eps: f32,
        out: DevPtr,
        rows: usize,
        dim: usize,
    ) -> Result<(), CudaError> {
        if n_blocks + 1 > MAX_ATTN_RES_SOURCES {
            return Err(CudaError::Shape(format!(
                "attn_res: {n_blocks} blocks exceed {}",
                MAX_ATTN_RES_SOURCES - 1
            )));
        }
        let a = [
            Arg::P(blocks),
            i(n_blocks),
            Arg::P(p),
            Arg::P(q),
            Arg::F(eps),
            Arg::P(out),
            i(rows),
            i(dim),
        ];
        self.launch(dev, "attnres_mix", grid(rows, 1, MT, 0), &a)
    }
}

/// One RMSNorm launch: row `r` reads `x + in_row(r)·in_stride` (`dim` values), scales by the f32
/// `weight`, multiplies by `σ(gate[r·dim ..])` when `gate` is not null, and writes f32 to
/// `out_f32 + out_row(r)·out_stride` and/or a GEMM input to `out_act + r·dim` (null skips
/// either).
/// Null row maps are the identity.
pub struct NormRows {
    pub x: DevPtr,
    pub in_rows: DevPtr,
    pub in_stride: usize,
    pub weight: DevPtr,
    pub dim: usize,
    pub eps: f32,
    pub gate: DevPtr,
    pub out_f32: DevPtr,
    pub out_rows: DevPtr,
    pub out_stride: usize,
    pub out_act: DevPtr,
    pub rows: usize,
}

impl NormRows {
    /// Contiguous rows in and out, no gate, no outputs yet.
    pub fn plain(x: DevPtr, weight: DevPtr, rows: usize, dim: usize, eps: f32) -> Self {
        NormRows {
            x,
            in_rows: 0,
            in_stride: dim,
            weight,
            dim,
            eps,
            gate: 0,
            out_f32: 0,
            out_rows: 0,
            out_stride: dim,
            out_act: 0,
            rows,
        }
    }
}

/// Where each segment's fixed-size state lives, in a page arena or a scratch buffer: segment `s`
/// reads it at `src + src_off[s]` (zeros when `src_off[s] < 0`) and writes the advanced state to
/// `dst + dst_off[s]`, which may be the same place. The offsets are i64 device arrays, in f32
/// elements.
#[derive(Clone, Copy, Debug)]
pub struct SegState {
    pub src: DevPtr,
    pub dst: DevPtr,
    pub src_off: DevPtr,
    pub dst_off: DevPtr,
}

/// A paged latent history: row `j` of the sequence whose page list starts at entry `first[t]`
/// of `pages` lies at `base + pages[first[t] + j / page_tokens] + (j % page_tokens)·width`
/// floats (`pages` i64, `first` i32 per query row, device arrays).
#[derive(Clone, Copy, Debug)]
pub struct PagedHistory {
    pub base: DevPtr,
    pub pages: DevPtr,
    pub first: DevPtr,
    pub page_tokens: usize,
}

/// The KDA delta rule over `segments` sequences: `qkv [N, 3·heads·head_dim]` (q, k, v column
/// blocks; q and k already L2-normalised), `g [N, heads·head_dim]`, `beta [N, heads]`, each
/// segment's state `[heads, head_dim, head_dim]` where `state` says, `out [N,
/// heads·head_dim]`; rows of segment `s` at `seg_start[s]..seg_start[s+1]`.
pub struct KdaRecurrent {
    pub qkv: DevPtr,
    pub g: DevPtr,
    pub beta: DevPtr,
    pub state: SegState,
    pub seg_start: DevPtr,
    pub out: DevPtr,
    pub segments: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}
