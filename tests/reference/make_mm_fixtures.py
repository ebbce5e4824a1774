#!/usr/bin/env python3
"""Regenerate tests/fixtures/k25_tiny/: a tiny random Kimi K2.5-layout (`kimi_k25`) checkpoint
whose text model is Kimi Linear (KDA + MLA + MoE), test images, and reference outputs computed
by transformers' `Kimi_K25ImageProcessor` and `Kimi_K25ForConditionalGeneration` (f32, CPU,
eager attention) from the saved bf16 weights.

Tensor names: the vision tower and projector are stored exactly as transformers' save_pretrained
writes them (`vision_tower.encoder.blocks.N.wqkv`, `vision_tower.encoder.patch_embed.proj`,
`vision_tower.patch_embed.pos_emb.weight`, `mm_projector.proj.0/2`, `model.mm_projector.pre_norm`).
The text model sits under save_pretrained's `language_model.model.blocks.N.` prefix with the
published Kimi Linear per-layer names: transformers 5.17's `kimi_k25` save mapping fuses the
Kimi Linear q/k/v projections into `self_wqkv` (and cannot load that file back), so the per-layer
names come from `kimi_ref.save_bf16` instead. The Rust tests also rename a copy to the original
Moonshot spelling (`language_model.model.layers.N.`, `vision_tower.patch_embed.proj`,
`mm_projector.pre_norm`).

Outputs (tests/fixtures/k25_tiny/):
  config.json, preprocessor_config.json, model.safetensors
  images/*.png|jpg|webp
  mm_reference.json                 per image: file, grid_thw, n_tokens, files below; prompts
  pixels_<name>.npy                 f32 [patches, 3, 14, 14] (pixel_values)
  embeds_<name>.npy                 f32 [n_tokens, text_hidden] (after the projector)
  logits_<prompt>.npy               f32 [T, vocab] (one full forward of the prompt with its images)

Usage: python tests/reference/make_mm_fixtures.py [--out tests/fixtures]
Needs: torch==2.11.0 transformers==5.17.0 torchvision==0.26.0 pillow numpy safetensors
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kimi_ref as kr  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25ImageProcessor  # noqa: E402

NAME = "k25_tiny"
SEED = 5005
N_NEW = 8
MIN_MARGIN = 1e-2
MAX_DRAWS = 40
PLACEHOLDER, VISION_START, VISION_END = 7, 5, 6

TEXT_CFG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, full_attn_layers=[2, 4], first_k_dense_replace=1,
    linear_num_heads=2, linear_head_dim=16,
    num_attention_heads=2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    kv_lora_rank=32, q_lora_rank=None,
    num_experts=4, num_experts_per_token=2, n_group=1, topk_group=1, n_shared_experts=1,
    routed_scaling_factor=2.446, moe_renormalize=True,
    initializer_range=0.06, rms_norm_eps=1e-5,
)
VISION_CFG = dict(
    patch_size=14, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4,
    num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=64,
    hidden_act="gelu_pytorch_tanh", merge_kernel_size=[2, 2],
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
# A small patch budget so that a 300x200 image is resized (transformers' default is 16384).
MAX_PATCHES = 64


def make_images(rng: np.random.Generator) -> dict[str, bytes]:
    """Smooth gradients plus noise: resampling and chroma handling both matter."""

    def pattern(h: int, w: int, channels: int) -> np.ndarray:
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        base = [
            128 + 100 * np.sin(x / 7.0 + y / 11.0),
            128 + 90 * np.cos(x / 5.0 - y / 9.0),
            (x * 255.0 / max(w - 1, 1) + y * 0.5) % 256,
            200 - y * 150.0 / max(h - 1, 1),
        ][:channels]
        img = np.stack(base, axis=-1) + rng.normal(0, 12, size=(h, w, channels))
        return np.clip(np.round(img), 0, 255).astype(np.uint8)

    out = {}
    buf = io.BytesIO()
    Image.fromarray(pattern(56, 84, 3), "RGB").save(buf, format="PNG")
    out["rgb_84x56.png"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(pattern(45, 70, 4), "RGBA").save(buf, format="PNG")
    out["rgba_70x45.png"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(pattern(50, 60, 3), "RGB").save(buf, format="JPEG", quality=90, subsampling=0)
    out["photo_60x50.jpg"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(pattern(200, 300, 3), "RGB").save(buf, format="WEBP", lossless=True)
    out["big_300x200.webp"] = buf.getvalue()
    return out


@torch.no_grad()
def build_model(text_ref) -> Kimi_K25ForConditionalGeneration:
    cfg = Kimi_K25Config(
        text_config=text_ref.config.to_dict(),
        vision_config=VISION_CFG,
        projection_hidden_size=VISION_CFG["hidden_size"],
        projection_layer_norm_eps=1e-5,
        image_token_id=PLACEHOLDER,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Kimi_K25ForConditionalGeneration(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, p in model.named_parameters():
        if name.startswith("model.language_model.") or name.startswith("lm_head."):
            continue
        if "norm" in name and name.endswith(".weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        elif name.endswith("position_embeddings"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.model.language_model.load_state_dict(text_ref.model.state_dict())
    model.lm_head.weight.copy_(text_ref.lm_head.weight)
    return model


def write_checkpoint(model, text_dir: str, out: str) -> None:
    tensors = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                if k.startswith(("vision_tower.", "mm_projector.", "model.mm_projector.")):
                    t = f.get_tensor(k)
                    b = t.to(torch.bfloat16)
                    assert torch.equal(b.to(torch.float32), t), k
                    tensors[k] = b.contiguous()
        with open(os.path.join(tmp, "config.json")) as f:
            cj = json.load(f)
    with safe_open(os.path.join(text_dir, "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.startswith("model.layers."):
                name = "language_model.model.blocks." + k[len("model.layers."):]
            elif k.startswith("model."):
                name = "language_model." + k
            elif k == "lm_head.weight":
                name = "language_model.lm_head.weight"
            else:
                raise RuntimeError(f"unexpected text tensor {k}")
            tensors[name] = f.get_tensor(k).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(text_dir, "config.json")) as f:
        text_cj = json.load(f)
    cj["text_config"] = text_cj
    cj["dtype"] = "bfloat16"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")


def draw_prompt(rng, vocab: int, n: int) -> list[int]:
    taken = set(kr.SPECIAL_IDS) | {PLACEHOLDER, VISION_START, VISION_END}
    ids = []
    while len(ids) < n:
        t = int(rng.integers(3, vocab))
        if t not in taken:
            ids.append(t)
    return ids


@torch.no_grad()
def forward_logits(model, ids, pixel_values, grid_thw) -> torch.Tensor:
    kw = {}
    if pixel_values is not None:
        kw = dict(pixel_values=pixel_values, image_grid_thw=grid_thw)
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, **kw)
    return out.logits[0].to(torch.float32)


@torch.no_grad()
def greedy(model, ids, pixel_values, grid_thw, n):
    seq = list(ids)
    toks, margins = [], []
    for _ in range(n):
        row = forward_logits(model, seq, pixel_values, grid_thw)[-1]
        t = int(torch.argmax(row))
        v = torch.topk(row, 2).values
        toks.append(t)
        margins.append(float(v[0] - v[1]))
        seq.append(t)
    return toks, margins


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "fixtures")))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    out = os.path.join(args.out, NAME)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "images"))

    tcfg = kr.make_config(**TEXT_CFG)
    with tempfile.TemporaryDirectory() as text_dir:
        kr.save_bf16(kr.build_random_model(tcfg, SEED), text_dir)
        text_ref = kr.load_reference(text_dir)
        model = build_model(text_ref)
        write_checkpoint(model, text_dir, out)
    proc = Kimi_K25ImageProcessor(max_patches=MAX_PATCHES)
    proc.save_pretrained(out)

    rng = np.random.default_rng(SEED)
    images = make_images(rng)
    merge = VISION_CFG["merge_kernel_size"][0] * VISION_CFG["merge_kernel_size"][1]
    records = {}
    for fname, data in images.items():
        with open(os.path.join(out, "images", fname), "wb") as f:
            f.write(data)
        stem = fname.rsplit(".", 1)[0]
        pil = Image.open(io.BytesIO(data))
        feats = proc(images=[pil], return_tensors="pt")
        pv, grid = feats["pixel_values"].to(torch.float32), feats["image_grid_thw"]
        with torch.no_grad():
            emb = model.model.get_image_features(pv, grid).pooler_output[0].to(torch.float32)
        np.save(os.path.join(out, f"pixels_{stem}.npy"), pv.numpy())
        np.save(os.path.join(out, f"embeds_{stem}.npy"), emb.numpy())
        t, h, w = (int(v) for v in grid[0])
        records[stem] = dict(
            file=f"images/{fname}",
            size=[pil.width, pil.height],
            mode=pil.mode,
            grid_thw=[t, h, w],
            n_tokens=t * h * w // merge,
            resized=bool(h * 14 < pil.height or w * 14 < pil.width or h * w > MAX_PATCHES),
            pixels_file=f"pixels_{stem}.npy",
            embeds_file=f"embeds_{stem}.npy",
        )
        print(f"  {fname}: {pil.mode} {pil.width}x{pil.height} grid {t}x{h}x{w} -> {emb.shape[0]} tokens", flush=True)

    prompts = []
    for pname, stems in (("one_image", ["rgb_84x56"]), ("two_images", ["big_300x200", "photo_60x50"])):
        pv = torch.cat([torch.from_numpy(np.load(os.path.join(out, records[s]["pixels_file"]))) for s in stems])
        grid = torch.tensor([records[s]["grid_thw"] for s in stems], dtype=torch.long)
        for draw in range(MAX_DRAWS):
            r = np.random.default_rng([SEED, len(prompts), draw])
            ids = draw_prompt(r, tcfg.vocab_size, 6)
            for s in stems:
                ids += [VISION_START] + [PLACEHOLDER] * records[s]["n_tokens"] + [VISION_END]
                ids += draw_prompt(r, tcfg.vocab_size, 3)
            toks, margins = greedy(model, ids, pv, grid, N_NEW)
            if min(margins) >= MIN_MARGIN and not any(t in kr.SPECIAL_IDS or t == PLACEHOLDER for t in toks):
                break
        else:
            raise RuntimeError(f"no clean prompt for {pname}")
        logits = forward_logits(model, ids, pv, grid).numpy()
        # Same text, no image features (placeholders embedded as token 0): the images must matter.
        text_only = forward_logits(model, [0 if t == PLACEHOLDER else t for t in ids], None, None).numpy()
        assert np.abs(logits - text_only).max() > 1e-2, "images do not change the logits"
        np.save(os.path.join(out, f"logits_{pname}.npy"), logits.astype(np.float32))
        prompts.append(
            dict(
                name=pname,
                images=stems,
                prompt_ids=ids,
                logits_file=f"logits_{pname}.npy",
                greedy_ids=toks,
                greedy_margins=[round(m, 6) for m in margins],
            )
        )
        print(f"  {pname}: {len(ids)} tokens, greedy {toks}, min margin {min(margins):.4f}", flush=True)

    ref = dict(
        model_type="kimi_k25",
        fixture=NAME,
        weights_dtype="bfloat16",
        reference_dtype="float32",
        placeholder_token_id=PLACEHOLDER,
        max_patches=MAX_PATCHES,
        max_new_tokens=N_NEW,
        images=records,
        prompts=prompts,
        greedy_note="greedy_ids: argmax of f32 logits by repeated full forwards with the images; "
        "EOS does not stop generation.",
        generator="tests/reference/make_mm_fixtures.py",
        torch=torch.__version__.split("+")[0],
        transformers=transformers.__version__,
    )
    with open(os.path.join(out, "mm_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(out) for fn in fns)
    print(f"wrote {out} ({total / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
