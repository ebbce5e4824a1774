"""How far the references themselves land from their f32 results when they run in bf16.

For each Kimi Linear fixture (a directory with `reference.json`) `transformers` reloads the model
in bf16; for each Kimi K3 fixture (`k3_reference.json`) `k3_reference.py` runs with bf16 as the
default dtype. Prints, per prompt, max |logits_bf16 - logits_f32| / max |logits_f32| and how many greedy steps
(from the reference's prompt) agree. This is the yardstick for a bf16 forward pass such as
tessera's GPU path: on tiny random models a router score near a tie flips an expert choice,
and then one token's logits move far, in any bf16 implementation.

    python tests/reference/bf16_spread.py --out tests/fixtures/bf16_spread.json tests/fixtures/*/

`examples/cuda_model_check.rs` (tessera-engine) reads that file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import k3_reference as k3  # noqa: E402
import kimi_ref as kr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    out = {}
    for d in args.dirs:
        is_k3 = os.path.exists(os.path.join(d, "k3_reference.json"))
        ref_path = os.path.join(d, "k3_reference.json" if is_k3 else "reference.json")
        if not os.path.exists(ref_path):
            continue
        ref = json.load(open(ref_path))
        if is_k3:
            torch.set_default_dtype(torch.bfloat16)
            model = k3.load_k3(d)
        else:
            model = kr.load_reference(d).to(torch.bfloat16)
        name = os.path.basename(os.path.normpath(d))
        for p in ref["prompts"]:
            want = np.load(os.path.join(d, p["logits_file"]))
            n = len(p["greedy_ids"])
            if is_k3:
                got = model.forward(p["prompt_ids"]).to(torch.float32).numpy()
                toks, _, _ = k3.greedy_full(model, p["prompt_ids"], n)
            else:
                got = kr.prompt_logits(model, p["prompt_ids"])
                toks, _, _ = kr.greedy_nocache(model, p["prompt_ids"], n)
            same = next((i for i, (a, b) in enumerate(zip(toks, p["greedy_ids"])) if a != b), len(toks))
            err = rel_err(got, want)
            out[f"{name}/{p['name']}"] = {"rel_err": err, "greedy_equal_steps": same}
            print(f"{name}/{p['name']}: bf16 rel err {err:.2e}, greedy equal {same}/{n}", flush=True)
        torch.set_default_dtype(torch.float32)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
