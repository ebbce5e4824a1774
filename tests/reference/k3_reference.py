#!/usr/bin/env python3
"""Kimi K3 reference: a plain-PyTorch implementation of K3-SPEC §3 and the tiny K3 fixtures.

One model, `K3Model`, with the K3 extensions as switches (as the engine has them):

    attn_res_block_size   AttnRes instead of residual adds (§3.1)
    situ                  SiTU(g, u) = [b1·tanh(g/b1)·σ(g)]·[b2·tanh(u/b2)] instead of silu(g)·u (§3.4)
    latent_moe            routed experts between a down and an up projection, latent RMSNorm (§3.4)
    mla_output_gate       o ⊙ σ(g_proj(x)) before o_proj (§3.3)
    gate_lower_bound      KDA decay g = lb·σ(exp(A_log)·(f + dt_bias)) instead of −exp(A_log)·softplus(·) (§3.2)
    full_rank_gate        KDA output gate g_proj(x) instead of g_b_proj(g_a_proj(x)) (§3.2)

Checks run every time (the script exits non-zero on any failure, before writing anything):

1. With every switch off, the model loads a random `KimiLinearForCausalLM` from its saved checkpoint
   (published tensor names) and matches transformers piece by piece (each KDA, MLA, dense MLP and
   MoE sublayer on the inputs transformers fed it) and end to end (logits), on two configs (plain
   and grouped routing + q LoRA).
2. Reductions of the K3 pieces to their Kimi Linear counterparts: SiTU with huge betas is SiLU;
   the latent MoE with identity projections and no norm is the plain MoE.
3. Incremental decoding (KDA conv/recurrent state, MLA latent cache) gives the same logits as one
   full forward, for the K3 model (AttnRes keeps no state across tokens).

Then it writes, for each fixture in FIXTURES, a tiny random K3 model in the real checkpoint layout
(`config.json` with `model_type: kimi_k3`, `model.safetensors` with `language_model.` names, bf16,
F32 for A_log / dt_bias / conv / o_norm / e_score_correction_bias as the real shards store them;
the MXFP4 fixture stores routed experts as compressed-tensors `weight_packed` + `weight_scale`),
plus `k3_reference.json` and `logits_<i>.npy`: f32 logits of full forwards computed from the
stored weights, greedy tokens by repeated full forwards (checked equal to cached decoding), and
the margins that make them comparable.

Numerics (K3-SPEC §7.1): the checks against transformers run in f32 (like for like); the fixtures'
references are computed in f64 from the stored weights (so that their own rounding is negligible
next to the f32 engine's), with the AttnRes partial sum and block array unrounded.

Usage: python tests/reference/k3_reference.py [--out tests/fixtures] [--only NAME ...] [--check-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kimi_ref as kr  # noqa: E402  (sets the offline environment before transformers loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

N_NEW = 12
MIN_MARGIN = 1e-3
# A prompt is redrawn when some token's k-th and (k+1)-th biased router scores are closer than
# this: an implementation summing in another order could pick the other expert.
MIN_ROUTER_GAP = 1e-4
MAX_DRAWS = 40

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# Tensors the real shards store in F32 (K3-SPEC §7.9); every other weight is BF16.
F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def situ_glu(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


class Weights:
    """Checkpoint tensors by name, as f32, with the names that were read recorded."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = tensors
        self.used: set[str] = set()

    @classmethod
    def load(cls, model_dir: str) -> "Weights":
        files = [f for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")]
        t = {}
        for fname in files:
            with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
                for k in f.keys():
                    t[k] = f.get_tensor(k)
        return cls(t)

    def has(self, name: str) -> bool:
        return name in self.t

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.t:
            raise KeyError(f"missing tensor {name}")
        self.used.add(name)
        return self.t[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        x = self.raw(name).to(torch.get_default_dtype())
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {shape}")
        return x

    def unused(self) -> list[str]:
        return sorted(set(self.t) - self.used)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, in_dim: int) -> torch.Tensor:
    """compressed-tensors `mxfp4-pack-quantized`: element j of a row is the low nibble of byte j/2
    for even j, the high nibble for odd j; bit 3 is the sign, bits 0-2 index E2M1; each group of 32
    columns shares the E8M0 scale 2^(s - 127)."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    assert codes.shape[1] == in_dim, (codes.shape, in_dim)
    mag = E2M1[codes & 0x7]
    val = torch.where((codes & 0x8) != 0, -mag, mag)
    exp = scale.to(torch.int64).to(torch.float32) - 127.0
    out = val * torch.repeat_interleave(torch.exp2(exp), 32, dim=1)
    return out.to(torch.get_default_dtype())


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 of a [out, in] weight (in % 32 == 0): per group of 32 the scale is
    the power of two that maps the group's largest magnitude into (3, 6]."""
    out_dim, in_dim = w.shape
    assert in_dim % 32 == 0
    g = w.reshape(out_dim, in_dim // 32, 32)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0))
    e = e.clamp(-127, 127)
    scaled = g / torch.exp2(e)[..., None]
    idx = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = idx | torch.where(scaled < 0, 8, 0)
    codes = codes.reshape(out_dim, in_dim).to(torch.int64)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = (e + 127).to(torch.uint8)
    return packed, scale


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class Cfg:
    """The text config as the model uses it (from a kimi_linear or kimi_k3 config.json)."""

    def __init__(self, cj: dict):
        root = cj
        self.k3 = cj.get("model_type") == "kimi_k3"
        t = cj["text_config"] if self.k3 else cj
        self.vocab = t["vocab_size"]
        self.d = t["hidden_size"]
        self.layers = t["num_hidden_layers"]
        self.eps = t.get("rms_norm_eps", 1e-5)
        lin = t.get("linear_attn_config", {})
        self.kda_heads = lin.get("num_heads", t.get("linear_num_heads"))
        self.kda_dim = lin.get("head_dim", t.get("linear_head_dim"))
        self.conv = lin.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4))
        full = set(lin["full_attn_layers"])
        self.mla_layers = [l for l in range(self.layers) if (l + 1) in full]
        self.gate_lower_bound = lin.get("gate_lower_bound") if self.k3 else None
        self.full_rank_gate = bool(lin.get("use_full_rank_gate", False)) if self.k3 else False
        self.heads = t["num_attention_heads"]
        self.q_lora = t.get("q_lora_rank")
        self.kv_lora = t["kv_lora_rank"]
        self.nope = t["qk_nope_head_dim"]
        self.rope = t["qk_rope_head_dim"]
        self.vdim = t["v_head_dim"]
        # §7.8: kimi_k3 uses rms_norm_eps for the MLA latent norms; kimi_linear (transformers) 1e-6.
        self.latent_eps = self.eps if self.k3 else 1e-6
        self.mla_output_gate = bool(t.get("mla_use_output_gate", False)) if self.k3 else False
        self.inter = t["intermediate_size"]
        self.first_dense = t.get("first_k_dense_replace", 1)
        self.experts = t.get("num_experts", t.get("num_local_experts", 0))
        self.top_k = t.get("num_experts_per_token", t.get("num_experts_per_tok", 0))
        self.moe_inter = t.get("moe_intermediate_size", 0)
        self.shared = t.get("num_shared_experts", t.get("n_shared_experts", 0))
        self.n_group = t.get("num_expert_group", t.get("n_group", 1))
        self.topk_group = t.get("topk_group", 1)
        self.renorm = t.get("moe_renormalize", t.get("norm_topk_prob", True))
        self.scaling = t.get("routed_scaling_factor", 1.0)
        self.situ = t.get("hidden_act", "silu") == "situ"
        self.b1 = t.get("activation_situ_beta", 4.0)
        self.b2 = t.get("activation_situ_linear_beta", 25.0)
        self.latent = t.get("routed_expert_hidden_size") if self.k3 else None
        self.latent_norm = bool(t.get("latent_moe_use_norm", False)) if self.k3 else False
        self.attn_res = t.get("attn_res_block_size") if self.k3 else None
        q = t.get("quantization_config") or root.get("quantization_config")
        self.mxfp4 = bool(q) and self.k3
        self.tie = root.get("tie_word_embeddings", t.get("tie_word_embeddings", False))

    def is_mla(self, l: int) -> bool:
        return l in self.mla_layers

    def is_moe(self, l: int) -> bool:
        return self.experts > 0 and l >= self.first_dense

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return situ_glu(g, u, self.b1, self.b2) if self.situ else silu_glu(g, u)


class Mlp:
    def __init__(self, gate, up, down, cfg: Cfg):
        self.gate, self.up, self.down, self.cfg = gate, up, down, cfg

    @classmethod
    def load(cls, w: Weights, p: str, cfg: Cfg, d: int, inter: int) -> "Mlp":
        return cls(
            w.get(f"{p}gate_proj.weight", (inter, d)),
            w.get(f"{p}up_proj.weight", (inter, d)),
            w.get(f"{p}down_proj.weight", (d, inter)),
            cfg,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.cfg.act(x @ self.gate.T, x @ self.up.T) @ self.down.T


class Moe:
    def __init__(self, w: Weights, p: str, cfg: Cfg):
        c, d = cfg, cfg.d
        self.cfg = c
        self.router = w.get(f"{p}gate.weight", (c.experts, d))
        bias = f"{p}gate.e_score_correction_bias"
        self.bias = w.get(bias, (c.experts,)) if w.has(bias) else torch.zeros(c.experts)
        ed = c.latent or d
        self.ed = ed
        if c.latent:
            self.down = w.get(f"{p}routed_expert_down_proj.weight", (ed, d))
            self.up = w.get(f"{p}routed_expert_up_proj.weight", (d, ed))
            self.norm = w.get(f"{p}routed_expert_norm.weight", (ed,)) if c.latent_norm else None
        self.experts = []
        for e in range(c.experts):
            ep = f"{p}experts.{e}."
            if c.mxfp4:
                mats = [
                    mxfp4_dequant(w.raw(f"{ep}{n}.weight_packed"), w.raw(f"{ep}{n}.weight_scale"), i)
                    for n, i in (("w1", ed), ("w3", ed), ("w2", c.moe_inter))
                ]
                assert mats[0].shape == (c.moe_inter, ed) and mats[2].shape == (ed, c.moe_inter)
            else:
                mats = [
                    w.get(f"{ep}w1.weight", (c.moe_inter, ed)),
                    w.get(f"{ep}w3.weight", (c.moe_inter, ed)),
                    w.get(f"{ep}w2.weight", (ed, c.moe_inter)),
                ]
            self.experts.append(Mlp(*mats, cfg=c))
        self.shared = Mlp.load(w, f"{p}shared_experts.", c, d, c.moe_inter * c.shared) if c.shared else None
        self.min_gap = math.inf

    def route(self, y: torch.Tensor):
        c = self.cfg
        scores = torch.sigmoid(y @ self.router.T)
        choice = scores + self.bias
        t, e = choice.shape
        per = e // c.n_group
        grouped = choice.view(t, c.n_group, per)
        group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)
        keep = torch.zeros(t, c.n_group, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
        masked = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        ranked = masked.sort(dim=-1, descending=True)
        idx = ranked.indices[:, : c.top_k]
        if c.top_k < e:
            nxt = ranked.values[:, c.top_k]
            gap = (ranked.values[:, c.top_k - 1] - nxt)[torch.isfinite(nxt)]
            if gap.numel():
                self.min_gap = min(self.min_gap, float(gap.min()))
        wts = scores.gather(1, idx)
        if c.renorm:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return idx, wts * c.scaling

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        idx, wts = self.route(y)
        z = y @ self.down.T if c.latent else y
        r = torch.zeros(y.shape[0], self.ed)
        for tok in range(y.shape[0]):
            for j in range(c.top_k):
                r[tok] += wts[tok, j] * self.experts[int(idx[tok, j])](z[tok : tok + 1])[0]
        if c.latent:
            if self.norm is not None:
                r = rms_norm(r, self.norm, c.eps)
            r = r @ self.up.T
        return r + (self.shared(y) if self.shared else 0.0)


class Kda:
    def __init__(self, w: Weights, p: str, cfg: Cfg):
        c, d = cfg, cfg.d
        h, dk = c.kda_heads, c.kda_dim
        pd = h * dk
        self.cfg, self.h, self.dk = c, h, dk
        self.qkv = torch.cat([w.get(f"{p}{n}_proj.weight", (pd, d)) for n in "qkv"])
        self.conv_w = torch.cat([w.get(f"{p}{n}_conv1d.weight", (pd, 1, c.conv))[:, 0] for n in "qkv"])
        self.f_a = w.get(f"{p}f_a_proj.weight", (dk, d))
        self.f_b = w.get(f"{p}f_b_proj.weight", (pd, dk))
        self.dt_bias = w.get(f"{p}dt_bias", (pd,))
        a_log = w.get(f"{p}A_log").flatten()
        if c.k3:
            # §6.1 / §7.4: K3 stores A_log as [head_dim]; the first H entries are per-head decays and
            # the tail must be zero.
            assert a_log.numel() == dk and h <= dk, a_log.shape
            assert torch.all(a_log[h:] == 0), "A_log tail is not zero"
            a_log = a_log[:h]
        assert a_log.numel() == h
        self.decay = torch.exp(a_log)
        self.b = w.get(f"{p}b_proj.weight", (h, d))
        if c.full_rank_gate:
            self.g = w.get(f"{p}g_proj.weight", (pd, d))
        else:
            self.g_a = w.get(f"{p}g_a_proj.weight", (dk, d))
            self.g_b = w.get(f"{p}g_b_proj.weight", (pd, dk))
        self.o_norm = w.get(f"{p}o_norm.weight", (dk,))
        self.o = w.get(f"{p}o_proj.weight", (d, pd))

    def new_state(self):
        return {
            "conv": torch.zeros(self.cfg.conv - 1, self.qkv.shape[0]),
            "rec": torch.zeros(self.h, self.dk, self.dk),  # [H, K, V]
        }

    def __call__(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        c, h, dk = self.cfg, self.h, self.dk
        t = x.shape[0]
        u = x @ self.qkv.T
        win = torch.cat([st["conv"], u])  # pre-conv inputs, oldest first
        k = c.conv
        y = torch.stack([(win[i : i + k].T * self.conv_w).sum(-1) for i in range(t)])
        y = F.silu(y)  # §7.6: SiLU whatever hidden_act is
        st["conv"] = win[-(k - 1) :].clone()
        q, kk, v = y.view(t, 3, h, dk).unbind(1)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
        kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
        f = ((x @ self.f_a.T) @ self.f_b.T + self.dt_bias).view(t, h, dk)
        if c.gate_lower_bound is not None:
            g = c.gate_lower_bound * torch.sigmoid(self.decay[:, None] * f)
        else:
            sp = torch.where(f > 20.0, f, torch.log1p(torch.exp(f)))
            g = -self.decay[:, None] * sp
        beta = torch.sigmoid(x @ self.b.T)
        s = st["rec"]
        outs = []
        for i in range(t):
            s = s * torch.exp(g[i])[..., None]
            kv_mem = (s * kk[i][..., None]).sum(-2)
            delta = (v[i] - kv_mem) * beta[i][:, None]
            s = s + kk[i][..., None] * delta[:, None, :]
            outs.append((s * q[i][..., None]).sum(-2))
        st["rec"] = s
        o = torch.stack(outs)  # [t, h, dk]
        gate = x @ self.g.T if c.full_rank_gate else (x @ self.g_a.T) @ self.g_b.T
        o = rms_norm(o, self.o_norm, c.eps) * torch.sigmoid(gate.view(t, h, dk))
        return o.reshape(t, -1) @ self.o.T


class Mla:
    def __init__(self, w: Weights, p: str, cfg: Cfg):
        c, d = cfg, cfg.d
        self.cfg = c
        qd = c.heads * (c.nope + c.rope)
        if c.q_lora:
            self.q_a = w.get(f"{p}q_a_proj.weight", (c.q_lora, d))
            self.q_norm = w.get(f"{p}q_a_layernorm.weight", (c.q_lora,))
            self.q_b = w.get(f"{p}q_b_proj.weight", (qd, c.q_lora))
        else:
            self.q = w.get(f"{p}q_proj.weight", (qd, d))
        self.kv_a = w.get(f"{p}kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, d))
        self.kv_norm = w.get(f"{p}kv_a_layernorm.weight", (c.kv_lora,))
        self.kv_b = w.get(f"{p}kv_b_proj.weight", (c.heads * (c.nope + c.vdim), c.kv_lora))
        if c.mla_output_gate:
            self.g = w.get(f"{p}g_proj.weight", (c.heads * c.vdim, d))
        self.o = w.get(f"{p}o_proj.weight", (d, c.heads * c.vdim))

    def new_state(self):
        return {"c": torch.zeros(0, self.cfg.kv_lora), "kpe": torch.zeros(0, self.cfg.rope)}

    def __call__(self, x: torch.Tensor, st: dict) -> torch.Tensor:
        c = self.cfg
        t, h = x.shape[0], c.heads
        if c.q_lora:
            q = rms_norm(x @ self.q_a.T, self.q_norm, c.latent_eps) @ self.q_b.T
        else:
            q = x @ self.q.T
        q = q.view(t, h, c.nope + c.rope)
        kv = x @ self.kv_a.T
        st["c"] = torch.cat([st["c"], rms_norm(kv[:, : c.kv_lora], self.kv_norm, c.latent_eps)])
        st["kpe"] = torch.cat([st["kpe"], kv[:, c.kv_lora :]])  # NoPE: never rotated
        s = st["c"].shape[0]
        kvb = (st["c"] @ self.kv_b.T).view(s, h, c.nope + c.vdim)
        k = torch.cat([kvb[..., : c.nope], st["kpe"][:, None, :].expand(s, h, c.rope)], -1)
        v = kvb[..., c.nope :]
        scores = torch.einsum("thd,shd->hts", q, k) * (c.nope + c.rope) ** -0.5
        pos_q = torch.arange(s - t, s)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos_q, float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v).reshape(t, h * c.vdim)
        if c.mla_output_gate:
            o = o * torch.sigmoid(x @ self.g.T)  # gate from the layer input (§3.3)
        return o @ self.o.T


def attn_res_mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """§3.1 mix: softmax over sources of <RMSNorm-without-weight(v), wn ⊙ wp>, weighted sum of the
    unnormalised sources."""
    v = torch.stack(sources)  # [S, T, D]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax((normed * query).sum(-1), dim=0)  # [S, T]
    return (alpha[..., None] * v).sum(0)


class Layer:
    pass


class K3Model:
    """Kimi Linear with the K3 switches; `prefix` is where the text model's tensors start."""

    def __init__(self, cfg: Cfg, w: Weights, prefix: str, head: str):
        c = self.cfg = cfg
        d = c.d
        self.embed = w.get(f"{prefix}embed_tokens.weight", (c.vocab, d))
        self.norm = w.get(f"{prefix}norm.weight", (d,))
        self.lm_head = self.embed if c.tie else w.get(head, (c.vocab, d))
        self.layers = []
        for l in range(c.layers):
            p = f"{prefix}layers.{l}."
            L = Layer()
            L.input_norm = w.get(f"{p}input_layernorm.weight", (d,))
            L.post_norm = w.get(f"{p}post_attention_layernorm.weight", (d,))
            L.attn = (Mla if c.is_mla(l) else Kda)(w, f"{p}self_attn.", c)
            if c.is_moe(l):
                L.mlp = Moe(w, f"{p}block_sparse_moe.", c)
            else:
                mp = f"{p}mlp." if w.has(f"{p}mlp.gate_proj.weight") else f"{p}block_sparse_moe."
                L.mlp = Mlp.load(w, mp, c, d, c.inter)
            if c.attn_res:
                # The pseudo-query is norm ⊙ proj, folded at load (§3.1).
                L.attn_query = w.get(f"{p}self_attention_res_norm.weight", (d,)) * w.get(
                    f"{p}self_attention_res_proj.weight", (1, d)
                )[0]
                L.mlp_query = w.get(f"{p}mlp_res_norm.weight", (d,)) * w.get(f"{p}mlp_res_proj.weight", (1, d))[0]
            self.layers.append(L)
        if c.attn_res:
            self.out_query = w.get(f"{prefix}output_attn_res_norm.weight", (d,)) * w.get(
                f"{prefix}output_attn_res_proj.weight", (1, d)
            )[0]
        unused = w.unused()
        if unused:
            raise RuntimeError(f"checkpoint tensors not used: {unused[:5]} ({len(unused)})")

    def new_state(self):
        return [L.attn.new_state() for L in self.layers]

    def min_router_gap(self) -> float:
        return min((L.mlp.min_gap for L in self.layers if isinstance(L.mlp, Moe)), default=math.inf)

    def reset_router_gap(self):
        for L in self.layers:
            if isinstance(L.mlp, Moe):
                L.mlp.min_gap = math.inf

    @torch.no_grad()
    def forward(self, ids: list[int], state=None, taps=None) -> torch.Tensor:
        """Logits [T, vocab] of the new tokens `ids`; `state` (from new_state) carries KDA and MLA
        history between calls. `taps`, if a dict, receives each sublayer's input and output."""
        c = self.cfg
        if state is None:
            state = self.new_state()
        e = self.embed[torch.tensor(ids)]
        if c.attn_res:
            h = self._forward_attn_res(e, state, taps)
        else:
            h = e
            for l, L in enumerate(self.layers):
                x = rms_norm(h, L.input_norm, c.eps)
                a = L.attn(x, state[l])
                h = h + a
                y = rms_norm(h, L.post_norm, c.eps)
                m = L.mlp(y)
                h = h + m
                if taps is not None:
                    taps[l] = (x, a, y, m)
        return rms_norm(h, self.norm, c.eps) @ self.lm_head.T

    def _forward_attn_res(self, e, state, taps):
        c, b = self.cfg, self.cfg.attn_res
        blocks: list[torch.Tensor] = []
        p, delta = e, None
        for l, L in enumerate(self.layers):
            if l > 0:
                p = p + delta
            if l % b == 0:
                blocks.append(p)  # R[l/B] = p; p appears once among the sources
                sources = list(blocks)
            else:
                sources = blocks + [p]
            x = rms_norm(attn_res_mix(sources, L.attn_query, c.eps), L.input_norm, c.eps)
            a = L.attn(x, state[l])
            p = a if l % b == 0 else p + a
            y = rms_norm(attn_res_mix(blocks + [p], L.mlp_query, c.eps), L.post_norm, c.eps)
            delta = L.mlp(y)
            if taps is not None:
                taps[l] = (x, a, y, delta)
        p = p + delta
        return attn_res_mix(blocks + [p], self.out_query, c.eps)


# --------------------------------------------------------------------------------------------
# Check 1: switches off == transformers' Kimi Linear
# --------------------------------------------------------------------------------------------

KL_CHECKS = {
    "plain": dict(
        seed=11,
        cfg=dict(
            vocab_size=192, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=5, full_attn_layers=[2, 5], first_k_dense_replace=1,
            linear_num_heads=3, linear_head_dim=16,
            num_attention_heads=3, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            kv_lora_rank=24, q_lora_rank=None,
            num_experts=8, num_experts_per_token=2, n_group=1, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=2.446, moe_renormalize=True, initializer_range=0.06, rms_norm_eps=1e-5,
        ),
    ),
    "grouped_qlora": dict(
        seed=12,
        cfg=dict(
            vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
            num_hidden_layers=4, full_attn_layers=[1, 3], first_k_dense_replace=2,
            linear_num_heads=2, linear_head_dim=32,
            num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
            kv_lora_rank=32, q_lora_rank=40,
            num_experts=16, num_experts_per_token=4, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=1.5, moe_renormalize=False, initializer_range=0.05, rms_norm_eps=1e-6,
        ),
    ),
}


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> float:
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if not err <= tol:
        raise AssertionError(f"{name}: relative error {err:.2e} > {tol:.0e}")
    return err


@torch.no_grad()
def check_against_transformers() -> None:
    for name, spec in KL_CHECKS.items():
        hf_cfg = kr.make_config(**spec["cfg"])
        src = kr.build_random_model(hf_cfg, spec["seed"])
        with tempfile.TemporaryDirectory() as tmp:
            kr.save_bf16(src, tmp)
            ref = kr.load_reference(tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                cfg = Cfg(json.load(f))
            ours = K3Model(cfg, Weights.load(tmp), "model.", "lm_head.weight")
        ids = [int(x) for x in np.random.default_rng(spec["seed"]).integers(3, cfg.vocab, size=37)]

        # Piece by piece: every sublayer on exactly the input transformers gave it.
        seen: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        hooks = []
        for l, layer in enumerate(ref.model.layers):
            def grab(kind, l=l):
                def hook(_m, args, kwargs, out):
                    x = kwargs.get("hidden_states", args[0] if args else None)
                    seen[(l, kind)] = (x[0].clone(), (out[0] if isinstance(out, tuple) else out)[0].clone())
                return hook
            hooks.append(layer.self_attn.register_forward_hook(grab("attn"), with_kwargs=True))
            hooks.append(layer.mlp.register_forward_hook(grab("mlp"), with_kwargs=True))
        want = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        for hk in hooks:
            hk.remove()
        worst = 0.0
        for l, L in enumerate(ours.layers):
            x, out = seen[(l, "attn")]
            kind = "MLA" if cfg.is_mla(l) else "KDA"
            worst = max(worst, _close(f"{name} layer {l} {kind}", L.attn(x, L.attn.new_state()), out))
            y, out = seen[(l, "mlp")]
            kind = "MoE" if cfg.is_moe(l) else "MLP"
            worst = max(worst, _close(f"{name} layer {l} {kind}", L.mlp(y), out))
        err = _close(f"{name} logits", ours.forward(ids), want)
        print(f"  transformers Kimi Linear ({name}): sublayers max rel err {worst:.1e}, logits {err:.1e}", flush=True)


# --------------------------------------------------------------------------------------------
# Check 2: reductions of the K3 pieces
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def check_reductions() -> None:
    gen = torch.Generator().manual_seed(5)
    g, u = torch.randn(64, 32, generator=gen) * 3, torch.randn(64, 32, generator=gen) * 3
    _close("SiTU(beta=1e6) vs SiLU", situ_glu(g, u, 1e6, 1e6), silu_glu(g, u), 1e-6)
    # SiTU's clipping is real at K3's betas: |gate| < 4, |up| < 25.
    big = torch.tensor([100.0])
    assert float(situ_glu(big, big, 4.0, 25.0)) < 4.0 * 25.0 + 1e-3

    # Latent MoE with identity projections and no latent norm is the plain MoE.
    d, e = 32, 6
    c = Cfg(_tiny_k3_config(dict(hidden=d, latent=d, experts=e, latent_norm=False, layers=2, block=1)))
    c.first_dense = 0
    t = {}
    t["gate.weight"] = torch.randn(e, d, generator=gen) * 0.3
    t["gate.e_score_correction_bias"] = torch.randn(e, generator=gen) * 0.1
    t["routed_expert_down_proj.weight"] = torch.eye(d)
    t["routed_expert_up_proj.weight"] = torch.eye(d)
    for i in range(e):
        for n, shape in (("w1", (c.moe_inter, d)), ("w3", (c.moe_inter, d)), ("w2", (d, c.moe_inter))):
            t[f"experts.{i}.{n}.weight"] = torch.randn(*shape, generator=gen) * 0.2
    for n, shape in (("gate_proj", (64, d)), ("up_proj", (64, d)), ("down_proj", (d, 64))):
        t[f"shared_experts.{n}.weight"] = torch.randn(*shape, generator=gen) * 0.2
    latent = Moe(Weights(t), "", c)
    c_plain = Cfg(_tiny_k3_config(dict(hidden=d, latent=d, experts=e, latent_norm=False, layers=2, block=1)))
    c_plain.latent = None
    plain = Moe(Weights({k: v for k, v in t.items() if "routed_expert" not in k}), "", c_plain)
    y = torch.randn(9, d, generator=gen)
    _close("latent MoE with identity projections vs plain MoE", latent(y), plain(y), 1e-6)

    # MXFP4 layout pinned on one byte: 0xA3 = high nibble 0xA (−, index 2: −1.0), low nibble 0x3
    # (+, index 3: 1.5); element 0 is the low nibble; scale byte 128 = 2^1.
    packed = torch.tensor([[0xA3] * 16], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)
    row = mxfp4_dequant(packed, scale, 32)[0]
    assert row[:4].tolist() == [3.0, -2.0, 3.0, -2.0], row[:4]
    w = torch.randn(8, 64, generator=gen)
    back = mxfp4_dequant(*mxfp4_quantize(w), 64)
    assert torch.equal(mxfp4_dequant(*mxfp4_quantize(back), 64), back), "MXFP4 values must round-trip"
    rel = ((back - w).abs() / w.abs().reshape(8, 2, 32).amax(-1).repeat_interleave(32, 1)).max()
    # Half the widest E2M1 step (4 -> 6) is 1 in units of a scale that puts the group max in (3, 6].
    assert float(rel) <= 1.0 / 3.0 + 1e-6, float(rel)

    # The bounded gate stays in (lb, 0) where the softplus gate is unbounded below.
    f = torch.linspace(-50, 50, 101)
    gb = -5.0 * torch.sigmoid(16.0 * f)
    assert float(gb.min()) >= -5.0 and float(gb.max()) <= 0.0
    print("  reductions: SiTU -> SiLU, latent MoE -> MoE, MXFP4 layout, bounded gate range: ok", flush=True)


# --------------------------------------------------------------------------------------------
# Tiny K3 models
# --------------------------------------------------------------------------------------------


def _tiny_k3_config(o: dict) -> dict:
    layers = o.get("layers", 7)
    full = o.get("full", [4, layers])
    kda = [n for n in range(1, layers + 1) if n not in full]
    text = {
        "model_type": "kimi_linear",
        "vocab_size": o.get("vocab", 256),
        "hidden_size": o["hidden"],
        "intermediate_size": o.get("inter", 96),
        "num_hidden_layers": layers,
        "num_attention_heads": o.get("heads", 2),
        "num_key_value_heads": o.get("heads", 2),
        "q_lora_rank": o.get("q_lora", 24),
        "kv_lora_rank": o.get("kv_lora", 16),
        "qk_nope_head_dim": o.get("nope", 8),
        "qk_rope_head_dim": o.get("rope", 4),
        "v_head_dim": o.get("vdim", 8),
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": o["block"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": o["experts"],
        "num_experts_per_token": o.get("top_k", 2),
        "num_shared_experts": 2,
        "moe_intermediate_size": o.get("moe_inter", 32),
        "routed_expert_hidden_size": o["latent"],
        "latent_moe_use_norm": o.get("latent_norm", True),
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "bos_token_id": kr.BOS_ID,
        "eos_token_id": kr.EOS_ID,
        "pad_token_id": kr.PAD_ID,
        "dtype": "bfloat16",
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": kda,
            "num_heads": o.get("kda_heads", 2),
            "head_dim": o.get("kda_dim", 16),
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
    }
    if o.get("mxfp4"):
        text["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "input_activations": None,
                    "weights": {
                        "num_bits": 4, "type": "float", "group_size": 32, "symmetric": True,
                        "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8",
                    },
                }
            },
            "ignore": [
                "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
            ],
        }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": kr.BOS_ID,
        "eos_token_id": kr.EOS_ID,
        "pad_token_id": kr.PAD_ID,
        "tie_word_embeddings": False,
        "text_config": text,
    }


FIXTURES = {
    # 7 layers (MLA at 1-based 4 and 7), AttnRes blocks of 3 (3 stored blocks, a partial last one),
    # layer 0 dense, MoE elsewhere, bf16 experts.
    "k3_tiny": dict(
        seed=7001,
        prompt_lens=[1, 19, 75],
        model=dict(hidden=48, latent=32, experts=8, block=3, layers=7, vocab=256),
    ),
    # The same shapes with MXFP4 routed experts (compressed-tensors).
    "k3_tiny_mxfp4": dict(
        seed=7002,
        prompt_lens=[1, 23, 64],
        model=dict(hidden=48, latent=32, experts=8, block=3, layers=7, vocab=256, mxfp4=True),
    ),
}


def _shapes(cj: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the real checkpoint layout (§2) for a config, in f32-or-bf16 form (MXFP4
    experts listed by their logical [out, in] under `.weight`; quantized at save)."""
    c = Cfg(cj)
    d, h, dk = c.d, c.kda_heads, c.kda_dim
    pd = h * dk
    s: dict[str, tuple[int, ...]] = {}
    m = "language_model.model."
    s[f"{m}embed_tokens.weight"] = (c.vocab, d)
    s[f"{m}norm.weight"] = (d,)
    s[f"{m}output_attn_res_norm.weight"] = (d,)
    s[f"{m}output_attn_res_proj.weight"] = (1, d)
    s["language_model.lm_head.weight"] = (c.vocab, d)
    for l in range(c.layers):
        p = f"{m}layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            s[f"{p}{n}.weight"] = (d,)
        s[f"{p}self_attention_res_proj.weight"] = (1, d)
        s[f"{p}mlp_res_proj.weight"] = (1, d)
        a = f"{p}self_attn."
        if c.is_mla(l):
            s[f"{a}q_a_proj.weight"] = (c.q_lora, d)
            s[f"{a}q_a_layernorm.weight"] = (c.q_lora,)
            s[f"{a}q_b_proj.weight"] = (c.heads * (c.nope + c.rope), c.q_lora)
            s[f"{a}kv_a_proj_with_mqa.weight"] = (c.kv_lora + c.rope, d)
            s[f"{a}kv_a_layernorm.weight"] = (c.kv_lora,)
            s[f"{a}kv_b_proj.weight"] = (c.heads * (c.nope + c.vdim), c.kv_lora)
            s[f"{a}g_proj.weight"] = (c.heads * c.vdim, d)
            s[f"{a}o_proj.weight"] = (d, c.heads * c.vdim)
        else:
            for n in "qkv":
                s[f"{a}{n}_proj.weight"] = (pd, d)
                s[f"{a}{n}_conv1d.weight"] = (pd, 1, c.conv)
            s[f"{a}f_a_proj.weight"] = (dk, d)
            s[f"{a}f_b_proj.weight"] = (pd, dk)
            s[f"{a}b_proj.weight"] = (h, d)
            s[f"{a}g_proj.weight"] = (pd, d)
            s[f"{a}A_log"] = (dk,)
            s[f"{a}dt_bias"] = (pd,)
            s[f"{a}o_norm.weight"] = (dk,)
            s[f"{a}o_proj.weight"] = (d, pd)
        if c.is_moe(l):
            b = f"{p}block_sparse_moe."
            s[f"{b}gate.weight"] = (c.experts, d)
            s[f"{b}gate.e_score_correction_bias"] = (c.experts,)
            s[f"{b}routed_expert_down_proj.weight"] = (c.latent, d)
            s[f"{b}routed_expert_norm.weight"] = (c.latent,)
            s[f"{b}routed_expert_up_proj.weight"] = (d, c.latent)
            for n in ("gate_proj", "up_proj"):
                s[f"{b}shared_experts.{n}.weight"] = (c.moe_inter * c.shared, d)
            s[f"{b}shared_experts.down_proj.weight"] = (d, c.moe_inter * c.shared)
            for e in range(c.experts):
                s[f"{b}experts.{e}.w1.weight"] = (c.moe_inter, c.latent)
                s[f"{b}experts.{e}.w3.weight"] = (c.moe_inter, c.latent)
                s[f"{b}experts.{e}.w2.weight"] = (c.latent, c.moe_inter)
        else:
            for n in ("gate_proj", "up_proj"):
                s[f"{p}mlp.{n}.weight"] = (c.inter, d)
            s[f"{p}mlp.down_proj.weight"] = (d, c.inter)
    return s


def random_k3(cj: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights, already rounded to what the checkpoint stores (bf16, or f32 for the F32
    tensors; MXFP4 experts are rounded at save). Drawn in f32 whatever the default dtype."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return _random_k3(cj, seed)
    finally:
        torch.set_default_dtype(prev)


def _random_k3(cj: dict, seed: int) -> dict[str, torch.Tensor]:
    c = Cfg(cj)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _shapes(cj).items():
        leaf = name.rsplit(".", 1)[0] if name.endswith(".weight") else name
        if name.endswith("A_log"):
            t = torch.zeros(shape)
            t[: c.kda_heads] = torch.log(torch.empty(c.kda_heads).uniform_(1.0, 16.0, generator=gen))
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=gen) * 0.5 - 1.0
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("_res_proj.weight"):
            # Pseudo-query scale: source scores of order 1, so the mixes are not one-hot.
            t = torch.randn(shape, generator=gen) * 1.5 / math.sqrt(c.d)
        elif leaf.endswith(("norm", "layernorm")) or name.endswith("o_norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        keep_f32 = name.endswith(F32_SUFFIXES)
        out[name] = t.float() if keep_f32 else t.to(torch.bfloat16)
    return out


def save_k3(cj: dict, tensors: dict[str, torch.Tensor], out_dir: str) -> None:
    c = Cfg(cj)
    stored = {}
    for name, t in tensors.items():
        if c.mxfp4 and ".experts." in name:
            packed, scale = mxfp4_quantize(t.float())
            base = name[: -len(".weight")]
            stored[f"{base}.weight_packed"] = packed
            stored[f"{base}.weight_scale"] = scale
        else:
            stored[name] = t.contiguous()
    save_file(dict(sorted(stored.items())), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    gen_cfg = {"bos_token_id": kr.BOS_ID, "eos_token_id": kr.EOS_ID, "pad_token_id": kr.PAD_ID}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")


def load_k3(model_dir: str) -> K3Model:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Cfg(json.load(f))
    return K3Model(cfg, Weights.load(model_dir), "language_model.model.", "language_model.lm_head.weight")


def _margin(row: torch.Tensor) -> float:
    v = torch.topk(row, 2).values
    return float(v[0] - v[1])


@torch.no_grad()
def greedy_full(model: K3Model, ids: list[int], n: int):
    seq, toks, margins, rows = list(ids), [], [], []
    for _ in range(n):
        row = model.forward(seq)[-1]
        toks.append(int(row.argmax()))
        margins.append(_margin(row))
        rows.append(row)
        seq.append(toks[-1])
    return toks, margins, torch.stack(rows)


@torch.no_grad()
def greedy_cached(model: K3Model, ids: list[int], n: int):
    st = model.new_state()
    row = model.forward(ids, st)[-1]
    toks, rows = [], []
    for step in range(n):
        rows.append(row)
        toks.append(int(row.argmax()))
        if step + 1 < n:
            row = model.forward([toks[-1]], st)[-1]
    return toks, torch.stack(rows)


@torch.no_grad()
def check_incremental(model: K3Model, ids: list[int]) -> float:
    """Token-by-token decoding with state equals one forward over the prompt."""
    full = model.forward(ids)
    st = model.new_state()
    split = max(1, len(ids) // 3)
    parts = [model.forward(ids[:split], st)] + [model.forward([t], st) for t in ids[split:]]
    return _close("incremental vs full forward", torch.cat(parts), full, 1e-4)


def run_prompt(model: K3Model, vocab: int, n: int, seed: int) -> dict:
    last = None
    for draw in range(MAX_DRAWS):
        rng = np.random.default_rng([seed, n, draw])
        ids = [int(x) for x in rng.integers(max(kr.SPECIAL_IDS) + 1, vocab, size=n)]
        model.reset_router_gap()
        toks, margins, rows = greedy_full(model, ids, N_NEW)
        logits = model.forward(ids)
        gap = model.min_router_gap()
        cached, cached_rows = greedy_cached(model, ids, N_NEW)
        if cached != toks:
            last = f"cached greedy differs: {cached} vs {toks}"
            continue
        if any(t in kr.SPECIAL_IDS for t in toks):
            last = f"greedy hits a special id: {toks}"
            continue
        if min(margins) < MIN_MARGIN:
            last = f"near-tie, min margin {min(margins):.2e}"
            continue
        if gap < MIN_ROUTER_GAP:
            last = f"router near-tie, gap {gap:.2e}"
            continue
        _close("last prompt row vs first greedy step", logits[-1], rows[0], 1e-6)
        return dict(
            ids=ids,
            logits=logits.numpy().astype(np.float32),
            toks=toks,
            margins=margins,
            router_gap=gap,
            cache_diff=float((cached_rows - rows).abs().max()),
            draw=draw,
        )
    raise RuntimeError(f"no clean prompt of length {n} in {MAX_DRAWS} draws; last: {last}")


def make_fixture(name: str, spec: dict, out_root: str) -> None:
    out = os.path.join(out_root, name)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    cj = _tiny_k3_config(spec["model"])
    save_k3(cj, random_k3(cj, spec["seed"]), out)
    model = load_k3(out)  # the reference sees exactly the stored (bf16 / MXFP4 / f32) values
    c = model.cfg
    prompts = []
    for i, n in enumerate(spec["prompt_lens"]):
        r = run_prompt(model, c.vocab, n, spec["seed"])
        inc = check_incremental(model, r["ids"]) if n > 1 else 0.0
        fname = f"logits_{i}.npy"
        np.save(os.path.join(out, fname), r["logits"])
        prompts.append(
            {
                "name": f"len{n}",
                "prompt_ids": r["ids"],
                "logits_file": fname,
                "greedy_ids": r["toks"],
                "greedy_margins": [round(float(m), 6) for m in r["margins"]],
                "min_greedy_margin": round(float(min(r["margins"])), 6),
                "min_router_gap": float(r["router_gap"]),
                "logits_max_abs": float(np.abs(r["logits"]).max()),
                "cache_vs_nocache_max_abs_logit_diff": r["cache_diff"],
                "incremental_vs_full_rel_err": inc,
            }
        )
        print(
            f"  {name} len{n}: greedy {r['toks']} min margin {min(r['margins']):.4f} router gap "
            f"{r['router_gap']:.1e} (draw {r['draw']}, cache diff {r['cache_diff']:.1e}, incremental {inc:.1e})",
            flush=True,
        )
    refj = {
        "model_type": "kimi_k3",
        "fixture": name,
        "weights_dtype": "bfloat16; F32 for A_log, dt_bias, *_conv1d, o_norm, e_score_correction_bias"
        + ("; routed experts MXFP4 (compressed-tensors mxfp4-pack-quantized)" if c.mxfp4 else ""),
        "reference_dtype": "float64 from the stored weights, logits saved as float32 (AttnRes partial sum "
        "and blocks unrounded, K3-SPEC §7.1)",
        "max_new_tokens": N_NEW,
        "greedy_note": "greedy_ids: argmax of f32 logits by repeated full forwards, checked equal to "
        "cached decoding (KDA/MLA state carried between calls); EOS does not stop generation. "
        "greedy_margins: top1 - top2 logit per step. min_router_gap: smallest gap between the k-th and "
        "(k+1)-th biased router score over every MoE layer and token of the prompt's greedy run.",
        "config_summary": {
            "layers": c.layers,
            "attn": ["MLA" if c.is_mla(l) else "KDA" for l in range(c.layers)],
            "ffn": ["moe" if c.is_moe(l) else "dense" for l in range(c.layers)],
            "attn_res_block_size": c.attn_res,
            "latent": c.latent,
            "mxfp4": c.mxfp4,
        },
        "prompts": prompts,
        "generator": "tests/reference/k3_reference.py",
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }
    with open(os.path.join(out, "k3_reference.json"), "w") as f:
        json.dump(refj, f, indent=1)
        f.write("\n")


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "fixtures")))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--check-only", action="store_true", help="run the checks, write nothing")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("checks", flush=True)
    check_against_transformers()
    check_reductions()
    if args.check_only:
        return 0
    torch.set_default_dtype(torch.float64)
    names = args.only or list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            ap.error(f"unknown fixture {n}; known: {', '.join(FIXTURES)}")
    for n in names:
        print(f"fixture {n}", flush=True)
        make_fixture(n, FIXTURES[n], args.out)
        d = os.path.join(args.out, n)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"  {n}: {size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
