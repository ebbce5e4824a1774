"""Decode throughput of `transformers`' KimiLinearForCausalLM (bf16, eager) on a GPU: the anchor
beside `decode_bench` (tessera-engine example), with the same protocol: `batch` random prompts
of `prompt` tokens prefilled together, then `steps` greedy decode steps with the cache; prints
decode tokens/s per batch size. Each batch size is warmed up first (untimed). With FLA importable
(`pip install --no-index --no-deps --target /tmp/site fla_core flash_linear_attention einops`
wheels, `PYTHONPATH=/tmp/site`), transformers runs FLA's Triton KDA kernels instead of its
PyTorch fallbacks.

    python benches/transformers_decode.py MODEL_DIR [--batches 1,32] [--prompt 128] [--steps 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
import transformers
from transformers import KimiLinearForCausalLM


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    dev = "cuda"
    model = KimiLinearForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev).eval()
    vocab = model.config.vocab_size
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {a.model} on {dev}", flush=True)
    g = torch.Generator().manual_seed(7)
    fla = importlib.util.find_spec("fla") is not None
    print(f"flash-linear-attention (fla) importable: {fla}", flush=True)
    for b in [int(x) for x in a.batches.split(",")]:
        # Untimed warm-up at this batch size: kernels compiled on first use (FLA's Triton
        # kernels, cuBLAS heuristics) are not counted in the decode time.
        warm = torch.randint(0, vocab, (b, 16), generator=g).to(dev)
        out = model(input_ids=warm, use_cache=True)
        for _ in range(2):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        ids = torch.randint(0, vocab, (b, a.prompt), generator=g).to(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(a.steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        decode = time.perf_counter() - t
        print(
            f"batch {b:>3}: prefill {a.prompt} tokens x {b} in {prefill * 1e3:.1f} ms; decode {a.steps} steps in "
            f"{decode * 1e3:.1f} ms = {decode * 1e3 / a.steps:.2f} ms/step, {b * a.steps / decode:.1f} tokens/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
