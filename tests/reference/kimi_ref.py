"""Shared helpers for the Kimi Linear reference scripts (make_fixtures.py, check_cli.py).

Builds small random `KimiLinearForCausalLM` models with the pure-PyTorch implementation in
`transformers` (never `fla`), saves them in bf16 with checkpoint tensor names, and computes
reference outputs in f32 from the *saved* bf16 weights (the reference model is reloaded from
disk with `dtype=torch.float32`, so it sees exactly the bf16-rounded values upcast to f32).
"""

from __future__ import annotations

import copy
import json
import os

# Never reach out to the Hub (kernels, configs, ...): everything here is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GenerationConfig, KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_IDS = (PAD_ID, BOS_ID, EOS_ID)


def make_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    moe_intermediate_size: int,
    num_hidden_layers: int,
    full_attn_layers: list[int],  # 1-based, as checkpoints store them
    first_k_dense_replace: int,
    linear_num_heads: int,
    linear_head_dim: int,
    num_attention_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    kv_lora_rank: int,
    q_lora_rank: int | None,
    num_experts: int,
    num_experts_per_token: int,
    n_group: int,
    topk_group: int,
    n_shared_experts: int,
    routed_scaling_factor: float,
    moe_renormalize: bool,
    initializer_range: float,
    rms_norm_eps: float = 1e-5,
    conv_kernel: int = 4,
) -> KimiLinearConfig:
    kda_layers = [i for i in range(1, num_hidden_layers + 1) if i not in full_attn_layers]
    cfg = KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        num_local_experts=num_experts,
        num_experts_per_tok=num_experts_per_token,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=n_shared_experts,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=moe_renormalize,
        initializer_range=initializer_range,
        rms_norm_eps=rms_norm_eps,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        linear_attn_config={
            "head_dim": linear_head_dim,
            "num_heads": linear_num_heads,
            "short_conv_kernel_size": conv_kernel,
            "full_attn_layers": sorted(full_attn_layers),
            "kda_layers": kda_layers,
        },
        first_k_dense_replace=first_k_dense_replace,
    )
    cfg._attn_implementation = "eager"
    # Sanity: the config must reproduce what we asked for.
    want_types = [
        "full_attention" if (i + 1) in full_attn_layers else "linear_attention" for i in range(num_hidden_layers)
    ]
    assert cfg.layer_types == want_types, (cfg.layer_types, want_types)
    want_mlp = ["dense" if i < first_k_dense_replace else "sparse" for i in range(num_hidden_layers)]
    assert cfg.mlp_layer_types == want_mlp, (cfg.mlp_layer_types, want_mlp)
    return cfg


@torch.no_grad()
def build_random_model(cfg: KimiLinearConfig, seed: int) -> KimiLinearForCausalLM:
    """Random model (HF init) plus random norm weights and correction biases, in f32."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 7919)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or leaf in ("o_norm", "q_a_layernorm", "kv_a_layernorm"):
            # RMSNorm / gated o_norm weights: random around 1 so that they matter.
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def _dense_mlp_layers(cfg: KimiLinearConfig) -> set[int]:
    return {i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"}


def _checkpoint_name(name: str, dense_layers: set[int]) -> str:
    # transformers' save_pretrained reverses `.block_sparse_moe.` -> `.mlp.` for every layer,
    # but published Kimi Linear checkpoints keep dense layers under `.mlp.` (see vLLM's
    # KimiDecoderLayer): use the published spelling.
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "block_sparse_moe":
        if int(parts[2]) in dense_layers:
            parts[3] = "mlp"
    return ".".join(parts)


def save_bf16(
    model: KimiLinearForCausalLM,
    out_dir: str,
    *,
    max_shard_size: str | None = None,
    f32_correction_bias: bool = False,
) -> None:
    """save_pretrained in bf16, then rewrite tensor names to the published checkpoint spelling.

    With `f32_correction_bias`, `e_score_correction_bias` is stored in F32 (as DeepSeek-V3-style
    checkpoints do); everything else is BF16.
    """
    cfg = model.config
    bias_f32 = {}
    if f32_correction_bias:
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias_f32[int(name.split(".")[2])] = b.detach().to(torch.float32).clone()
    m16 = copy.deepcopy(model).to(torch.bfloat16)  # leave the caller's f32 model untouched
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    m16.save_pretrained(out_dir, **kwargs)
    del m16

    dense = _dense_mlp_layers(cfg)
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
    else:
        index = None
        files = ["model.safetensors"]
    new_map = {}
    total_bytes = 0
    for fname in files:
        path = os.path.join(out_dir, fname)
        tensors = {}
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                t = f.get_tensor(k)
                if k.endswith("e_score_correction_bias") and f32_correction_bias:
                    t = bias_f32[int(k.split(".")[2])]  # model.layers.N....
                tensors[_checkpoint_name(k, dense)] = t.contiguous()
        meta = dict(meta)
        meta.setdefault("format", "pt")
        save_file(tensors, path, metadata=meta)
        for k, t in tensors.items():
            new_map[k] = fname
            total_bytes += t.numel() * t.element_size()
    if index is not None:
        index["weight_map"] = dict(sorted(new_map.items()))
        index["metadata"]["total_size"] = total_bytes
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    # Documented fields of the published Kimi Linear config that transformers does not write.
    cpath = os.path.join(out_dir, "config.json")
    with open(cpath) as f:
        cj = json.load(f)
    cj.setdefault("mla_use_nope", True)
    cj.setdefault("moe_router_activation_func", "sigmoid")
    cj.setdefault("moe_layer_freq", 1)
    cj.setdefault("use_grouped_topk", True)
    with open(cpath, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")


@torch.no_grad()
def load_reference(model_dir: str) -> KimiLinearForCausalLM:
    """Reload the saved (bf16) model in f32 with eager attention, checking every tensor loads."""
    model, info = KimiLinearForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # `mismatched_keys`, `missing_keys`, `unexpected_keys`, `error_msgs` must all be empty.
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"loading {model_dir} was not clean: {bad}")
    model.eval()
    return model


@torch.no_grad()
def check_reload_exact(src: KimiLinearForCausalLM, ref: KimiLinearForCausalLM, f32_bias: bool) -> None:
    """The reloaded f32 model must hold exactly bf16(src) (or f32 for a stored-f32 bias)."""
    sd_ref = dict(ref.state_dict())
    for k, v in src.state_dict().items():
        if k not in sd_ref:
            raise RuntimeError(f"reloaded model lacks {k}")
        want = v if (f32_bias and k.endswith("e_score_correction_bias")) else v.to(torch.bfloat16).to(torch.float32)
        if not torch.equal(sd_ref[k], want):
            raise RuntimeError(f"reloaded {k} differs from the bf16-rounded original")


@torch.no_grad()
def prompt_logits(model: KimiLinearForCausalLM, ids: list[int]) -> np.ndarray:
    x = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    return out.logits[0].to(torch.float32).numpy().copy()


def _top2_margin(row: torch.Tensor) -> float:
    v = torch.topk(row, 2).values
    return float(v[0] - v[1])


@torch.no_grad()
def greedy_nocache(model: KimiLinearForCausalLM, ids: list[int], n: int):
    """Greedy by repeated full forwards without cache. Returns (tokens, margins, last-row logits)."""
    seq = list(ids)
    toks, margins, rows = [], [], []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False).logits[0, -1]
        logits = logits.to(torch.float32)
        t = int(torch.argmax(logits))
        toks.append(t)
        margins.append(_top2_margin(logits))
        rows.append(logits.clone())
        seq.append(t)
    return toks, margins, torch.stack(rows)


@torch.no_grad()
def greedy_cached_loop(model: KimiLinearForCausalLM, ids: list[int], n: int):
    """Greedy with the cache by hand: prefill, then one token per forward.

    Only for models without MLA layers: transformers 5.17's generate() (and its causal-mask
    helper) call Cache.get_seq_length(), which raises on a cache holding only linear-attention
    layers. KDA ignores masks and positions, so both are passed explicitly / as None here.
    """
    assert all(t == "linear_attention" for t in model.config.layer_types)
    from transformers import DynamicCache

    mask = {"full_attention": None, "linear_attention": None}
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=torch.tensor([ids], dtype=torch.long),
        past_key_values=cache,
        use_cache=True,
        position_ids=torch.arange(len(ids))[None],
        attention_mask=mask,
    )
    toks, rows = [], []
    pos = len(ids)
    for step in range(n):
        row = out.logits[0, -1].to(torch.float32)
        rows.append(row.clone())
        toks.append(int(torch.argmax(row)))
        if step + 1 == n:
            break
        out = model(
            input_ids=torch.tensor([[toks[-1]]], dtype=torch.long),
            past_key_values=out.past_key_values,
            use_cache=True,
            position_ids=torch.tensor([[pos]]),
            attention_mask=mask,
        )
        pos += 1
    return toks, torch.stack(rows)


@torch.no_grad()
def greedy_generate(model: KimiLinearForCausalLM, ids: list[int], n: int):
    """Greedy with model.generate and the cache (no EOS stop). Returns (tokens, raw logits [n, V], how).

    Falls back to greedy_cached_loop for KDA-only models (see there).
    """
    if all(t == "linear_attention" for t in model.config.layer_types):
        toks, rows = greedy_cached_loop(model, ids, n)
        return toks, rows, "manual cached loop (generate() rejects KDA-only caches in transformers 5.17)"
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    x = torch.tensor([ids], dtype=torch.long)
    # generate() falls back to model.generation_config for an unset eos_token_id; clear it there
    # too so that EOS never stops the reference (the greedy ids are compared position by position).
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved_eos
    if out.sequences.shape[1] != len(ids) + n:
        raise RuntimeError(f"generate() returned {out.sequences.shape[1] - len(ids)} tokens, wanted {n}")
    toks = out.sequences[0, len(ids):].tolist()
    logits = torch.stack([l[0].to(torch.float32) for l in out.logits])
    return toks, logits, "model.generate(do_sample=False, use_cache=True)"


def config_summary(cfg: KimiLinearConfig) -> dict:
    kinds = ["MLA" if t == "full_attention" else "KDA" for t in cfg.layer_types]
    ffn = ["dense" if t == "dense" else "moe" for t in cfg.mlp_layer_types]
    return {
        "layers": cfg.num_hidden_layers,
        "attn": kinds,
        "ffn": ffn,
        "vocab": cfg.vocab_size,
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "kda": {"heads": cfg.linear_num_heads, "head_dim": cfg.linear_head_dim, "conv": cfg.linear_conv_kernel_dim},
        "mla": {
            "heads": cfg.num_attention_heads,
            "qk_nope": cfg.qk_nope_head_dim,
            "qk_rope": cfg.qk_rope_head_dim,
            "v_head": cfg.v_head_dim,
            "kv_lora": cfg.kv_lora_rank,
            "q_lora": cfg.q_lora_rank,
        },
        "moe": {
            "experts": cfg.num_local_experts,
            "top_k": cfg.num_experts_per_tok,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "shared": cfg.n_shared_experts,
            "moe_intermediate": cfg.moe_intermediate_size,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "renormalize": cfg.norm_topk_prob,
        },
        "rms_norm_eps": cfg.rms_norm_eps,
    }
