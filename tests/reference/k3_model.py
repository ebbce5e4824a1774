"""Kimi K3 in plain PyTorch (K3-SPEC §3): the building blocks and `K3Model`, with the K3
extensions as switches, loaded from a checkpoint in the published layout. The checks against
transformers and the tiny fixtures that use it are in `k3_reference.py`."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

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
