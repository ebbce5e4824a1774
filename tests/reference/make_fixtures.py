#!/usr/bin/env python3
"""Regenerate tests/fixtures/<name>/: tiny random Kimi Linear checkpoints + f32 reference outputs.

Each fixture directory holds what `save_pretrained` writes in bf16 (config.json,
generation_config.json, model.safetensors or an index + shards), with tensor names in the
published checkpoint spelling, plus reference.json and logits_<i>.npy computed in f32 from the
saved bf16 weights by transformers' pure-PyTorch KimiLinearForCausalLM (eager attention, CPU).

Usage: python tests/reference/make_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kimi_ref as kr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

N_NEW = 12
# Prompts are redrawn (next seed) when the greedy continuation hits a special id, when the
# cached and uncached greedy paths disagree, or when a step is a near-tie below this margin.
MIN_MARGIN = 1e-3
MAX_DRAWS = 40

FIXTURES = {
    # Kimi-Linear-like: KDA:MLA 3:1, MLA at 1-based 4 and 8, layer 0 dense, rest MoE.
    "kl_mixed": dict(
        seed=1001,
        prompt_lens=[1, 20, 200],
        cfg=dict(
            vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=8, full_attn_layers=[4, 8], first_k_dense_replace=1,
            linear_num_heads=4, linear_head_dim=16,
            num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            kv_lora_rank=32, q_lora_rank=None,
            num_experts=8, num_experts_per_token=2, n_group=1, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=2.446, moe_renormalize=True,
            initializer_range=0.06, rms_norm_eps=1e-5,
        ),
        save=dict(max_shard_size=None, f32_correction_bias=False),
    ),
    # Grouped routing, q_lora path, different head dims, sharded checkpoint, f32 correction bias.
    "kl_grouped": dict(
        seed=2002,
        prompt_lens=[1, 20, 193],
        cfg=dict(
            vocab_size=512, hidden_size=96, intermediate_size=192, moe_intermediate_size=24,
            num_hidden_layers=6, full_attn_layers=[2, 5], first_k_dense_replace=2,
            linear_num_heads=3, linear_head_dim=32,
            num_attention_heads=4, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
            kv_lora_rank=48, q_lora_rank=32,
            num_experts=16, num_experts_per_token=4, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=2.5, moe_renormalize=True,
            initializer_range=0.05, rms_norm_eps=1e-6,
        ),
        save=dict(max_shard_size="400KB", f32_correction_bias=True),
    ),
    # Only KDA layers, only dense MLPs (the MoE fields are present but unused).
    "kl_kda_only": dict(
        seed=3003,
        prompt_lens=[1, 20, 64, 150],
        cfg=dict(
            vocab_size=256, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
            num_hidden_layers=3, full_attn_layers=[], first_k_dense_replace=3,
            linear_num_heads=2, linear_head_dim=32,
            num_attention_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            kv_lora_rank=32, q_lora_rank=None,
            num_experts=4, num_experts_per_token=2, n_group=1, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=2.446, moe_renormalize=True,
            initializer_range=0.08, rms_norm_eps=1e-5,
        ),
        save=dict(max_shard_size=None, f32_correction_bias=False),
    ),
    # Only MLA layers, all MoE, no top-k renormalisation, grouped routing with 2 groups.
    "kl_mla_only": dict(
        seed=4004,
        prompt_lens=[1, 20, 90],
        cfg=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, full_attn_layers=[1, 2], first_k_dense_replace=0,
            linear_num_heads=2, linear_head_dim=16,
            num_attention_heads=2, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            kv_lora_rank=64, q_lora_rank=None,
            num_experts=8, num_experts_per_token=3, n_group=2, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=1.7, moe_renormalize=False,
            initializer_range=0.08, rms_norm_eps=1e-5,
        ),
        save=dict(max_shard_size=None, f32_correction_bias=False),
    ),
    # KDA heads of 128 (the width the GPU's chunked prefill is built for), one MLA layer, dense
    # MLPs; prompts from under one chunk of 64 tokens to several.
    "kl_kda128": dict(
        seed=5005,
        prompt_lens=[1, 40, 150, 300],
        cfg=dict(
            vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
            num_hidden_layers=3, full_attn_layers=[2], first_k_dense_replace=3,
            linear_num_heads=2, linear_head_dim=128,
            num_attention_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            kv_lora_rank=32, q_lora_rank=None,
            num_experts=4, num_experts_per_token=2, n_group=1, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=2.446, moe_renormalize=True,
            initializer_range=0.06, rms_norm_eps=1e-5,
        ),
        save=dict(max_shard_size=None, f32_correction_bias=False),
    ),
}


def draw_prompt(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    lo = max(kr.SPECIAL_IDS) + 1
    return [int(x) for x in rng.integers(lo, vocab, size=n)]


def run_prompt(model, vocab: int, n: int, seed: int):
    """Draw a prompt of length n whose greedy continuation is clean; return its reference record."""
    last_err = None
    for draw in range(MAX_DRAWS):
        rng = np.random.default_rng([seed, n, draw])
        ids = draw_prompt(rng, vocab, n)
        nc_toks, margins, nc_rows = kr.greedy_nocache(model, ids, N_NEW)
        gen_toks, gen_rows, how = kr.greedy_generate(model, ids, N_NEW)
        if nc_toks != gen_toks:
            last_err = f"cache/no-cache greedy differ: {nc_toks} vs {gen_toks}"
            continue
        if any(t in kr.SPECIAL_IDS for t in nc_toks):
            last_err = f"greedy hits a special id: {nc_toks}"
            continue
        if min(margins) < MIN_MARGIN:
            last_err = f"near-tie, min margin {min(margins):.2e}"
            continue
        logits = kr.prompt_logits(model, ids)
        # The last prompt row is the first greedy step's row (same computation).
        assert np.allclose(logits[-1], nc_rows[0].numpy(), rtol=0, atol=1e-5)
        cache_diff = float((gen_rows - nc_rows).abs().max())
        return dict(ids=ids, logits=logits, toks=nc_toks, margins=margins, cache_diff=cache_diff, draw=draw, how=how)
    raise RuntimeError(f"no clean prompt of length {n} in {MAX_DRAWS} draws; last: {last_err}")


def make_fixture(name: str, spec: dict, out_root: str) -> dict:
    out = os.path.join(out_root, name)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    cfg = kr.make_config(**spec["cfg"])
    src = kr.build_random_model(cfg, spec["seed"])
    kr.save_bf16(src, out, **spec["save"])
    ref = kr.load_reference(out)
    kr.check_reload_exact(src, ref, spec["save"]["f32_correction_bias"])
    del src

    prompts = []
    for i, n in enumerate(spec["prompt_lens"]):
        r = run_prompt(ref, cfg.vocab_size, n, spec["seed"])
        fname = f"logits_{i}.npy"
        np.save(os.path.join(out, fname), r["logits"].astype(np.float32))
        prompts.append(
            {
                "name": f"len{n}",
                "prompt_ids": r["ids"],
                "logits_file": fname,
                "greedy_ids": r["toks"],
                "greedy_margins": [round(float(m), 6) for m in r["margins"]],
                "min_greedy_margin": round(float(min(r["margins"])), 6),
                "logits_max_abs": float(np.abs(r["logits"]).max()),
                "cache_vs_nocache_max_abs_logit_diff": r["cache_diff"],
                "cached_greedy_checked_with": r["how"],
            }
        )
        print(
            f"  {name} len{n}: greedy {r['toks']} min margin {min(r['margins']):.4f} "
            f"(draw {r['draw']}, cache diff {r['cache_diff']:.1e})",
            flush=True,
        )
    refj = {
        "model_type": "kimi_linear",
        "fixture": name,
        "weights_dtype": "bfloat16" + (" (e_score_correction_bias float32)" if spec["save"]["f32_correction_bias"] else ""),
        "reference_dtype": "float32",
        "max_new_tokens": N_NEW,
        "greedy_note": "greedy_ids: argmax of f32 logits by repeated full forwards, checked equal to "
        "greedy with the cache (model.generate(do_sample=False, use_cache=True), or a manual cached "
        "loop for KDA-only models); EOS does not stop generation. "
        "greedy_margins: top1 - top2 logit at each step.",
        "config_summary": kr.config_summary(cfg),
        "prompts": prompts,
        "generator": "tests/reference/make_fixtures.py",
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(refj, f, indent=1)
        f.write("\n")
    return refj


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "fixtures")))
    ap.add_argument("--only", nargs="*", default=None, help="fixture names to regenerate")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.only or list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            ap.error(f"unknown fixture {n}; known: {', '.join(FIXTURES)}")
    os.makedirs(args.out, exist_ok=True)
    for n in names:
        print(f"fixture {n}", flush=True)
        make_fixture(n, FIXTURES[n], args.out)
        size = sum(os.path.getsize(os.path.join(args.out, n, f)) for f in os.listdir(os.path.join(args.out, n)))
        print(f"  {n}: {size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
