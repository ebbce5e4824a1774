#!/usr/bin/env python3
"""Differential check of the `tessera` CLI against transformers on fresh random Kimi Linear models.

For each seed: draw a config (2-6 layers, random KDA/MLA placement, head dims, dense/MoE split,
expert grouping, with/without q_lora), build a random model, save it in bf16 to a temp dir, and
compute the reference in f32 from the saved weights. Then run

    TESSERA logits   --model DIR --prompt-ids 5,17,... --out F.npy
    TESSERA generate --model DIR --prompt-ids 5,17,... --max-new-tokens 8 --temperature 0 --json

and require
  * logits: max|tessera - ref| / max|ref| <= --tol (1e-4), over all prompt positions
    ([T, vocab] or [1, T, vocab]; an output of only the last row is compared as such and noted);
  * generate: the printed {"token_ids": [...]} (generated tokens only) equals the reference greedy
    tokens up to the first step whose reference top1-top2 margin is < --tie (1e-3) (a near tie;
    later steps are not compared). Stopping early is accepted only right after emitting EOS (id 2)
    when the tokens so far match.

Usage:
    check_cli.py --tessera target/release/tessera [--seed N | --seeds K [--start S]] [--keep]
    check_cli.py --dry-run --seeds 5        # only build/save models and compute references
Exit status: 0 when every seed passes, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kimi_ref as kr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

# Lengths that sit on or next to the 64-token KDA chunk boundaries are drawn more often.
EDGE_LENGTHS = [63, 64, 65, 127, 128, 129, 192, 193]


def random_config(seed: int):
    r = random.Random(seed)
    n_layers = r.randint(2, 6)
    full_attn = [i + 1 for i in range(n_layers) if r.random() < 0.35]
    experts = r.choice([4, 6, 8, 12, 16])
    groups = [g for g in range(1, experts + 1) if experts % g == 0 and experts // g >= 2]
    n_group = r.choice(groups)
    topk_group = r.randint(1, n_group)
    top_k = r.randint(1, min(8, topk_group * (experts // n_group)))
    kw = dict(
        vocab_size=r.randint(64, 512),
        hidden_size=r.choice([32, 48, 64, 96, 128]),
        intermediate_size=r.choice([64, 96, 128, 192]),
        moe_intermediate_size=r.choice([16, 32, 48]),
        num_hidden_layers=n_layers,
        full_attn_layers=full_attn,
        first_k_dense_replace=r.randint(0, n_layers),
        linear_num_heads=r.choice([1, 2, 4]),
        linear_head_dim=r.choice([8, 16, 32, 64]),
        num_attention_heads=r.choice([1, 2, 4, 8]),
        qk_nope_head_dim=r.choice([8, 16, 32]),
        qk_rope_head_dim=r.choice([4, 8, 16]),
        v_head_dim=r.choice([8, 16, 32]),
        kv_lora_rank=r.choice([16, 32, 64]),
        q_lora_rank=r.choice([None, 16, 32, 48]),
        num_experts=experts,
        num_experts_per_token=top_k,
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=r.choice([1, 2]),
        routed_scaling_factor=round(r.uniform(1.0, 3.0), 3),
        moe_renormalize=r.random() < 0.6,
        initializer_range=round(r.uniform(0.04, 0.1), 4),
        rms_norm_eps=r.choice([1e-5, 1e-6]),
    )
    save = dict(
        max_shard_size=r.choice([None, None, "300KB"]),
        f32_correction_bias=r.random() < 0.3,
    )
    short_len = r.randint(1, 16)
    long_len = r.choice(EDGE_LENGTHS) if r.random() < 0.4 else r.randint(17, 200)
    return kw, save, [short_len, long_len]


def describe(kw: dict, save: dict) -> str:
    n = kw["num_hidden_layers"]
    attn = "".join("M" if (i + 1) in kw["full_attn_layers"] else "K" for i in range(n))
    ffn = "".join("d" if i < kw["first_k_dense_replace"] else "e" for i in range(n))
    return (
        f"layers={n} attn={attn} ffn={ffn} vocab={kw['vocab_size']} hidden={kw['hidden_size']} "
        f"kda={kw['linear_num_heads']}x{kw['linear_head_dim']} "
        f"mla=h{kw['num_attention_heads']} nope{kw['qk_nope_head_dim']} rope{kw['qk_rope_head_dim']} "
        f"v{kw['v_head_dim']} kv_lora{kw['kv_lora_rank']} q_lora{kw['q_lora_rank']} "
        f"moe={kw['num_experts']}e top{kw['num_experts_per_token']} groups{kw['n_group']}/{kw['topk_group']} "
        f"shared{kw['n_shared_experts']} scale{kw['routed_scaling_factor']} renorm={kw['moe_renormalize']} "
        f"eps={kw['rms_norm_eps']} shards={save['max_shard_size'] or 'single'} "
        f"bias={'f32' if save['f32_correction_bias'] else 'bf16'}"
    )


def run_cmd(cmd: list[str], timeout: float) -> tuple[int, str, str, float]:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return 124, out, err + f"\n[timed out after {timeout}s]", time.time() - t0
    except OSError as e:
        return 127, "", f"cannot run {cmd[0]}: {e}", time.time() - t0


def tail(text: str, n: int = 15) -> str:
    lines = text.strip().splitlines()
    return "\n".join("      | " + ln for ln in lines[-n:])


def show_failure(cmd: list[str], output: str) -> None:
    print("      $ " + " ".join(cmd), flush=True)
    if output.strip():
        print(tail(output), flush=True)


def parse_token_ids(stdout: str) -> list[int] | None:
    """The last JSON object on stdout carrying "token_ids" (whole stdout tried first)."""
    candidates = [stdout.strip()] + [ln.strip() for ln in reversed(stdout.strip().splitlines())]
    for c in candidates:
        if not c.startswith("{"):
            continue
        try:
            obj = json.loads(c)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("token_ids"), list):
            return [int(x) for x in obj["token_ids"]]
    return None


def compare_logits(got: np.ndarray, ref: np.ndarray, tol: float) -> tuple[bool, str]:
    g = np.asarray(got, dtype=np.float64)
    T, V = ref.shape
    note = ""
    if g.ndim == 3 and g.shape[0] == 1:
        g = g[0]
    if g.ndim == 1:
        g = g[None]
    if g.shape == (T, V):
        r = ref
    elif g.shape == (1, V):
        r = ref[-1:]
        if T > 1:
            note = " (last row only)"
    else:
        return False, f"shape {tuple(got.shape)}, expected ({T}, {V})"
    if not np.all(np.isfinite(g)):
        return False, "non-finite values"
    r = r.astype(np.float64)
    err = float(np.abs(g - r).max())
    scale = float(np.abs(r).max())
    rel = err / scale
    row = int(np.unravel_index(np.argmax(np.abs(g - r)), g.shape)[0])
    ok = rel <= tol
    return ok, f"max-abs-err {err:.3e} / max-abs-ref {scale:.3f} = {rel:.2e} (worst row {row}){note}"


def compare_tokens(got: list[int], ref: list[int], margins: list[float], tie: float) -> tuple[bool, str]:
    n = len(ref)
    n_cmp = next((i for i, m in enumerate(margins) if m < tie), n)
    tie_note = f", near tie at step {n_cmp} (margin {margins[n_cmp]:.1e}): compared {n_cmp}" if n_cmp < n else ""
    if len(got) > n:
        return False, f"{len(got)} tokens for max-new-tokens {n}: {got}"
    if len(got) < n:
        k = len(got)
        if k > 0 and got[-1] == kr.EOS_ID and k <= n_cmp and got == ref[:k]:
            return True, f"stopped at EOS after {k} matching tokens{tie_note}"
        if k < n_cmp or not got or got[-1] != kr.EOS_ID:
            return False, f"got {k} tokens {got}, expected {ref}{tie_note}"
    if got[:n_cmp] != ref[:n_cmp]:
        first = next(i for i in range(n_cmp) if i >= len(got) or got[i] != ref[i])
        return False, (
            f"differs at step {first} (ref margin {margins[first]:.2e}): got {got}, expected {ref}{tie_note}"
        )
    return True, f"{n_cmp}/{n} tokens equal{tie_note}"


def check_seed(seed: int, args) -> bool:
    kw, save, lens = random_config(seed)
    print(f"seed {seed}: {describe(kw, save)}", flush=True)
    root = tempfile.mkdtemp(prefix=f"tessera_check_{seed}_")
    model_dir = os.path.join(root, "model")
    ok_all = True
    try:
        cfg = kr.make_config(**kw)
        src = kr.build_random_model(cfg, seed)
        kr.save_bf16(src, model_dir, **save)
        ref = kr.load_reference(model_dir)
        kr.check_reload_exact(src, ref, save["f32_correction_bias"])
        del src
        rng = np.random.default_rng([seed, 99])
        for n in lens:
            ids = [int(x) for x in rng.integers(max(kr.SPECIAL_IDS) + 1, cfg.vocab_size, size=n)]
            ids_arg = ",".join(map(str, ids))
            ref_logits = kr.prompt_logits(ref, ids)
            ref_toks, margins, _ = kr.greedy_nocache(ref, ids, args.max_new_tokens)
            cache_toks, _, _ = kr.greedy_generate(ref, ids, args.max_new_tokens)
            m_note = f"ref greedy {ref_toks}, min margin {min(margins):.1e}"
            if cache_toks != ref_toks:
                m_note += f" [reference cache path differs: {cache_toks}]"
            print(f"  prompt len {n}: {m_note}", flush=True)
            if args.dry_run:
                continue

            out_npy = os.path.join(root, f"logits_len{n}.npy")
            cmd = [args.tessera, "logits", "--model", model_dir, "--prompt-ids", ids_arg, "--out", out_npy]
            rc, so, se, dt = run_cmd(cmd, args.timeout)
            if rc != 0 or not os.path.exists(out_npy):
                ok_all = False
                why = f"exit {rc}" + ("" if os.path.exists(out_npy) else f", no {os.path.basename(out_npy)} written")
                print(f"    logits   FAIL: {why}", flush=True)
                show_failure(cmd, so + se)
            else:
                try:
                    ok, msg = compare_logits(np.load(out_npy), ref_logits, args.tol)
                except Exception as e:  # unreadable .npy etc.
                    ok, msg = False, f"cannot read {out_npy}: {e}"
                ok_all &= ok
                print(f"    logits   {'PASS' if ok else 'FAIL'}: {msg} [{dt:.1f}s]", flush=True)
                if not ok:
                    show_failure(cmd, "")

            cmd = [
                args.tessera, "generate", "--model", model_dir, "--prompt-ids", ids_arg,
                "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0", "--json",
            ]
            rc, so, se, dt = run_cmd(cmd, args.timeout)
            got = parse_token_ids(so) if rc == 0 else None
            if got is None:
                ok_all = False
                why = f"exit {rc}" if rc != 0 else 'no {"token_ids": [...]} JSON on stdout'
                print(f"    generate FAIL: {why}", flush=True)
                show_failure(cmd, so + se)
            else:
                ok, msg = compare_tokens(got, ref_toks, margins, args.tie)
                ok_all &= ok
                print(f"    generate {'PASS' if ok else 'FAIL'}: {msg} [{dt:.1f}s]", flush=True)
                if not ok:
                    show_failure(cmd, "")
    except Exception as e:
        ok_all = False
        print(f"  ERROR building the reference: {type(e).__name__}: {e}", flush=True)
    finally:
        keep = args.keep or (not ok_all and not args.dry_run)
        if keep:
            print(f"  model kept in {model_dir}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    verdict = "OK (dry run)" if args.dry_run and ok_all else ("PASS" if ok_all else "FAIL")
    print(f"seed {seed}: {verdict}", flush=True)
    return ok_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", help="path to the tessera binary (required unless --dry-run)")
    ap.add_argument("--seed", type=int, default=None, help="the seed to check (default 0)")
    ap.add_argument("--seeds", type=int, default=None, help="check this many consecutive seeds")
    ap.add_argument("--start", type=int, default=None, help="first seed for --seeds (default: --seed or 0)")
    ap.add_argument("--dry-run", action="store_true", help="only build/save models and compute references")
    ap.add_argument("--keep", action="store_true", help="keep the temp model dirs (failed ones are always kept)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max-abs-err / max-abs-ref bound for logits")
    ap.add_argument("--tie", type=float, default=1e-3, help="reference top1-top2 margin counted as a near tie")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per tessera command")
    ap.add_argument("--threads", type=int, default=4, help="torch CPU threads for the reference")
    args = ap.parse_args()
    if not args.dry_run:
        if not args.tessera:
            ap.error("--tessera PATH is required (or --dry-run)")
        if not (os.path.isfile(args.tessera) and os.access(args.tessera, os.X_OK)):
            ap.error(f"--tessera {args.tessera}: not an executable file")
        args.tessera = os.path.abspath(args.tessera)
    torch.set_num_threads(args.threads)
    start = args.start if args.start is not None else (args.seed if args.seed is not None else 0)
    seeds = list(range(start, start + args.seeds)) if args.seeds else [start]

    results = {s: check_seed(s, args) for s in seeds}
    failed = [s for s, ok in results.items() if not ok]
    print(
        f"SUMMARY: {len(seeds) - len(failed)}/{len(seeds)} seeds "
        f"{'built' if args.dry_run else 'passed'}"
        + (f"; failed: {', '.join(map(str, failed))}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
