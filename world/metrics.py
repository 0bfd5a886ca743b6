"""The shapes world's measurements of itself: the checker, rewards and judges on ground truth and on the VAE's
reconstructions (world_metrics), on a pipeline's samples (evaluate, with the sample grid), and rollout / LoRA-step
timings (bench). What `python -m world.build build` and `eval` write to world/assets/*_metrics.json.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from world.checker import _as_array, check
from world.grammar import RES, TEMPLATES, TEXTURES, _template, parse_prompt, render, sample_prompts
from world.judges import frechet_distance, judge_cnn
from world.pipeline import PIPELINE_DIR, encode_prompts, generate, load_pipeline, vae_decode, vae_encode
from world.rewards import REWARDS, reward_geneval_strict


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a - b) ** 2)))


def world_metrics(vae, n: int = 500) -> dict:
    """Checker, rewards and judges on n train + n held-out ground-truth images (seeds 7, 8),
    and on their VAE reconstructions (PSNR in dB over 0..255 pixels)."""
    prompts = sample_prompts(n, "train", 7) + sample_prompts(n, "heldout", 8)
    gt = [render(p, 7_000_000 + i) for i, p in enumerate(prompts)]
    recs = vae_decode(vae, vae_encode(vae, gt))
    m = {
        "checker_gt_strict": float(reward_geneval_strict(gt, prompts).mean()),
        "checker_vae_strict": float(reward_geneval_strict(recs, prompts).mean()),
        "vae_psnr": float(np.mean([_psnr(_as_array(a), _as_array(b)) for a, b in zip(gt, recs)])),
    }
    for name in ("geneval", "sharpness", "jpeg", "saturation", "texture", "grain"):
        m[f"gt_{name}_mean"] = float(REWARDS[name](gt, prompts).mean())
        m[f"vae_{name}_mean"] = float(REWARDS[name](recs, prompts).mean())
    named = np.array(["texture" in parse_prompt(p) for p in prompts])
    for what, ims in (("gt", gt), ("vae", recs)):  # the texture survives the VAE round trip: named / plain captions
        r = REWARDS["texture"](ims, prompts)
        m[f"{what}_texture_named"], m[f"{what}_texture_plain"] = float(r[named].mean()), float(r[~named].mean())
    m.update(
        judge_gt=float(judge_cnn(gt, prompts).mean()),
        judge_vae=float(judge_cnn(recs, prompts).mean()),
        fd_gt=frechet_distance(gt, prompts, seed=9),
        fd_vae=frechet_distance(recs, prompts, seed=9),
    )
    for k, v in m.items():
        print(f"  {k:22s} {v:.4f}")
    return m


def sample_grid(pipe, prompts: list[str], path: Path, n_gen: int = 6, seed: int = 0, zoom: int = 3):
    """PNG grid: one row per prompt: caption, ground truth (framed), then n_gen samples."""
    gens = generate(pipe, [p for p in prompts for _ in range(n_gen)], seed=seed)
    cell, label_w = RES * zoom + 4, 230
    grid = Image.new("RGB", (label_w + cell * (n_gen + 1), cell * len(prompts)), "white")
    d = ImageDraw.Draw(grid)
    for r, p in enumerate(prompts):
        y = r * cell
        d.text((4, y + cell // 2 - 6), p, fill="black")
        gt = render(p, 99 + r).resize((RES * zoom, RES * zoom), Image.NEAREST)
        d.rectangle((label_w, y, label_w + cell - 1, y + cell - 1), fill="black")
        grid.paste(gt, (label_w + 2, y + 2))
        for c in range(n_gen):
            im = gens[r * n_gen + c].resize((RES * zoom, RES * zoom), Image.NEAREST)
            grid.paste(im, (label_w + cell * (c + 1) + 2, y + 2))
    grid.save(path)


def evaluate(
    pipe, n: int = 512, split: str = "heldout", seed: int = 0, grid_path: Path | None = None, path: Path = PIPELINE_DIR
) -> dict:
    """Checker, rewards and judges on n generated images for n prompts of ``split``
    (GEN_KWARGS: guidance 1.0, 10 steps), plus a reload-reproducibility check."""
    prompts = sample_prompts(n, split, seed)
    t0 = time.time()
    imgs = generate(pipe, prompts, seed=seed)
    m = {"eval_split": split, "eval_n": n, "eval_gen_seconds": time.time() - t0}
    checks = [check(i, p) for i, p in zip(imgs, prompts)]
    for k in ("strict", "partial", "count", "colour", "shape", "object"):
        m[f"gen_{k}"] = float(np.mean([c[k] for c in checks]))
    pos = [c["position"] for c in checks if "position" in c]
    m["gen_position"] = float(np.mean(pos)) if pos else None
    for t in TEMPLATES:
        sel = [c["strict"] for c, p in zip(checks, prompts) if _template(p) == t]
        m[f"gen_strict_{t}"] = float(np.mean(sel)) if sel else None
    for name in ("sharpness", "jpeg", "saturation", "texture", "grain"):
        m[f"gen_{name}_mean"] = float(REWARDS[name](imgs, prompts).mean())
    tex = REWARDS["texture"](imgs, prompts)
    for t in ("plain",) + TEXTURES:
        sel = [parse_prompt(p).get("texture", "plain") == t for p in prompts]
        m[f"gen_texture_{t}"] = float(tex[sel].mean()) if any(sel) else None
    m["gen_judge_cnn"] = float(judge_cnn(imgs, prompts).mean())
    m["gen_frechet"] = frechet_distance(imgs, prompts)
    # reproducibility: a fresh load with a fixed generator gives identical pixels
    again = generate(load_pipeline(path), prompts[:8], seed=123, output_type="np")
    first = generate(pipe, prompts[:8], seed=123, output_type="np")
    m["reload_identical"] = bool(np.array_equal(np.stack(again), np.stack(first)))
    if grid_path is not None:
        sample_grid(pipe, sorted(set(prompts), key=prompts.index)[:12], Path(grid_path))
        m["grid"] = str(grid_path)
    return m


def bench(pipe) -> dict:
    """Timings: rollout of 64 images x 10 steps (GEN_KWARGS, incl. text encoding and VAE
    decode), and one LoRA (peft, r=8 on attention to_q/to_k/to_v/to_out.0) flow-matching
    training step (forward + backward + AdamW) at batch 32."""
    import torch
    from peft import LoraConfig

    prompts = sample_prompts(64, "train", 0)
    generate(pipe, prompts[:8])  # warm-up
    ts = []
    for r in range(3):
        t0 = time.time()
        generate(pipe, prompts, seed=r)
        ts.append(time.time() - t0)
    tr = pipe.transformer
    tr.add_adapter(
        LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    )
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    pe, pooled = encode_prompts(pipe, prompts[:32])
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(32, 4, 16, 16, generator=g)
    lt = []
    for r in range(6):
        t0 = time.time()
        eps, t = torch.randn(x0.shape, generator=g), torch.rand(32, generator=g)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        v = tr(
            hidden_states=xt, timestep=1000 * t, encoder_hidden_states=pe, pooled_projections=pooled, return_dict=False
        )[0]
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        lt.append(time.time() - t0)
    return {
        "rollout_64x10_seconds": float(np.median(ts)),
        "lora_step_b32_seconds": float(np.median(lt[1:])),
        "lora_trainable_params": sum(p.numel() for p in params),
        "transformer_params": sum(p.numel() for p in tr.parameters()) - sum(p.numel() for p in params),
    }
