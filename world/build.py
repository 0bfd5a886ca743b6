"""Build the shapes world's assets from scratch, deterministically, on a CPU (and evaluate or time them).

The tokenizers, the tiny random SD3 pipeline (:func:`tiny_sd3`), the VAE, the judges and the transformer trained on
the world, and the CLI:

    python -m world.build build        # regenerate world/assets/ from scratch (28-47 min on 1 thread)
    python -m world.build eval         # checker accuracy on held-out prompts + assets/samples.png
    python -m world.build bench        # rollout and LoRA-step timings
    python -m world.build pref-judge   # retrain the pairwise preference judge (~2 min)

Flow matching as in NOTES.md §1: ``x_t = (1-t) x0 + t eps``, target ``eps - x0``, transformer timestep ``1000 t``.
A world variant is built by its experiment (experiments/late_reward_world.py) with this module's training loops.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from world import judges
from world.checker import _as_array, texture_amplitude
from world.grammar import COLORS, RES, SHAPES, SPLITS, TEXTURE, all_captions, render, sample_prompts
from world.judges import (
    _judge_forward,
    _judge_net,
    _judge_targets,
    _pref_forward,
    _pref_net,
    _pref_scores,
    _prompt_vector,
    preference_pairs,
)
from world.metrics import bench, evaluate, world_metrics
from world.pipeline import (
    ASSETS,
    PREF_PATH,
    TEXT_LEN,
    _images_to_tensor,
    encode_prompts,
    load_pipeline,
    vae_decode,
    vae_encode,
    write_world_file,
)

# ================================================ model components ====
WORLD_WORDS = sorted({w for cap in all_captions() for w in cap.split()} | {"one", "an"})


def build_tokenizers():
    """Tokenizers where each world word is one token, built from a vocabulary (no files).

    CLIP BPE: characters (plain and with the end-of-word suffix "</w>") plus merges built
    from each word's end ("d</w>" <- "e"+"d</w>" <- ...), so a world word becomes one
    token and other words fall back to characters. T5 unigram: pieces "▁word" score -1,
    characters score -10. Both truncate/pad to 10 tokens in the pipeline.
    """
    from transformers import CLIPTokenizer, T5Tokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in letters:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges = []
    for w in WORLD_WORDS:
        suf = w[-1] + "</w>"
        for i in range(len(w) - 2, -1, -1):
            if (w[i], suf) not in merges:
                merges.append((w[i], suf))
            suf = w[i:] + "</w>"
            vocab.setdefault(suf, len(vocab))
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TEXT_LEN)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -1.0) for w in WORLD_WORDS]
    pieces += [(c, -10.0) for c in "▁" + letters]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TEXT_LEN)
    return clip, t5


SEED_ORDER = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer")  # seed, seed + 1, ...


def tiny_sd3(
    clip_tokenizer,
    t5_tokenizer,
    seed: int = 0,
    res: int = RES,
    text_len: int = TEXT_LEN,
    clip_width: int = 32,
    clip_layers: int = 2,
    clip_heads: int = 4,
    t5_width: int = 64,
    t5_layers: int = 2,
    t5_heads: int = 4,
    vae_channels: tuple = (32, 64),
    transformer_layers: int = 4,
    transformer_heads: int = 4,
    head_dim: int = 32,
    caption_dim: int = 128,
) -> dict:
    """A tiny random SD3.5-M pipeline's components, of the real diffusers classes (diffusers' get_dummy_components
    pattern), random init from fixed seeds (seed .. seed + 4: the CLIPs, the T5, the VAE, the transformer): two CLIP
    text encoders (``clip_width`` wide, projection ``clip_width``), a gated-GELU T5 (``t5_width``, d_kv 16, d_ff
    2 t5_width), an AutoencoderKL res x res x 3 -> (res / 2)^2 x 4 (``vae_channels``, scaling 1, shift 0: set after
    its training), an SD3 MMDiT transformer (patch 2, ``transformer_layers`` x ``transformer_heads`` heads of
    ``head_dim``, joint attention t5_width, pooled 2 clip_width), a shift-3 flow-matching scheduler; the text
    encoders frozen (requires_grad off, eval). Text of ``text_len`` tokens. The defaults are the shipped world's.
    Built by the project's one builder of random SD3 pipelines, `sd3.pipeline_from_configs`."""
    import sd3

    pipe = sd3.pipeline_from_configs(
        transformer=dict(
            sample_size=res // 2,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=transformer_layers,
            attention_head_dim=head_dim,
            num_attention_heads=transformer_heads,
            joint_attention_dim=t5_width,
            caption_projection_dim=caption_dim,
            pooled_projection_dim=2 * clip_width,
            pos_embed_max_size=res // 2,
            qk_norm="rms_norm",
        ),
        vae=dict(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=tuple(vae_channels),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=16,
            sample_size=res,
            mid_block_add_attention=False,
            scaling_factor=1.0,
            shift_factor=0.0,
        ),
        clips=[
            dict(
                vocab_size=len(clip_tokenizer),
                hidden_size=clip_width,
                intermediate_size=2 * clip_width,
                num_hidden_layers=clip_layers,
                num_attention_heads=clip_heads,
                max_position_embeddings=text_len,
                projection_dim=clip_width,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        ]
        * 2,
        t5=dict(
            vocab_size=len(t5_tokenizer),
            d_model=t5_width,
            d_kv=16,
            d_ff=2 * t5_width,
            num_layers=t5_layers,
            num_heads=t5_heads,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        tokenizers=(clip_tokenizer, clip_tokenizer, t5_tokenizer),
        seed={name: seed + k for k, name in enumerate(SEED_ORDER)},
    )
    for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        m.requires_grad_(False).eval()
    return {name: getattr(pipe, name) for name in (*SEED_ORDER, "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler")}


def build_components(seed: int = 0) -> dict:
    """All pipeline components of the shipped world: its tokenizers (build_tokenizers) and :func:`tiny_sd3` at the
    world's sizes. Text encoders stay frozen at their random init; VAE and transformer are trained."""
    return tiny_sd3(*build_tokenizers(), seed=seed)


# ============================================================ build ====
def _world_dataset(n: int, split: str, seed: int, variant: str | None = None):
    """n (prompt, image) ground-truth pairs: prompts from sample_prompts, image seeds seed*10^6+i."""
    prompts = sample_prompts(n, split, seed)
    return prompts, [render(p, seed * 1_000_000 + i, variant) for i, p in enumerate(prompts)]


def _warmup_cosine(opt, steps: int, warm: int):
    """lr factor: linear warm-up over ``warm`` steps, then cosine from 1 to 0.1."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warm)
            * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, steps - warm)))))
        ),
    )


def _laplacian(x):
    """4-neighbour Laplacian of (B, C, H, W) over the interior (B, C, H-2, W-2)."""
    c = x[..., 1:-1, 1:-1]
    return 4 * c - x[..., :-2, 1:-1] - x[..., 2:, 1:-1] - x[..., 1:-1, :-2] - x[..., 1:-1, 2:]


VAE_HF_WEIGHT = 1.0
VAE_TEXTURE_AMP = 0.3
"""The texture amplitude of the VAE's training images (the world's own when larger). Trained on the world's 0.1 the
VAE averaged the lines away (named textures read back from 11% of its reconstructions; the transformer then drew
none); trained on 0.3 it carries 0.1 as well (100% of named and of plain reconstructions in the shipped build).
results/world-design/candidates/candidates.md."""


def train_vae(
    vae,
    images: list,
    steps: int,
    batch: int = 64,
    seed: int = 0,
    hf_weight: float | None = None,
    decoder_only: bool = False,
    lr: float = 2e-3,
):
    """Reconstruction training: loss = mean(w |x - x'|) + mean(w (x - x')^2) + hf mean(w |lap x - lap x'|)
    + 1e-6 KL, w = 1 + 3 * foreground (shapes matter more than flat background), lap the 4-neighbour
    Laplacian (fine detail: the texture inside the shapes), hf = VAE_HF_WEIGHT; AdamW lr (2e-3), warm-up + cosine.
    decoder_only: the encoder (and quant_conv) frozen, so that the latents of every image stay what they were."""
    hf_weight = VAE_HF_WEIGHT if hf_weight is None else hf_weight
    import torch
    from tqdm import tqdm

    torch.manual_seed(seed)
    x_all = _images_to_tensor(images)
    a = np.stack([_as_array(i) for i in images])
    mx, mn = a.max(-1), a.min(-1)
    w_all = torch.from_numpy(1 + 3 * ((mx - mn) / np.maximum(mx, 1e-6) > 0.15)).float()[:, None]
    params = list(vae.parameters())
    if decoder_only:
        vae.requires_grad_(False)
        for m in (vae.decoder, vae.post_quant_conv):
            m.requires_grad_(True)
        params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = _warmup_cosine(opt, steps, warm=max(1, steps // 20))
    g = torch.Generator().manual_seed(seed)
    vae.train()
    bar = tqdm(range(steps), desc="vae", mininterval=5)
    for step in bar:
        idx = torch.randint(len(x_all), (batch,), generator=g)
        x, w = x_all[idx], w_all[idx]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        loss = (w * (rec - x).abs()).mean() + (w * (rec - x) ** 2).mean() + 1e-6 * post.kl().mean()
        if hf_weight:
            loss = loss + hf_weight * (w[..., 1:-1, 1:-1] * (_laplacian(rec) - _laplacian(x)).abs()).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    vae.eval().requires_grad_(False)


def train_judge(images: list, prompts: list[str], steps: int, seed: int = 0):
    """Judge CNN: cross-entropy on count and texture + BCE on colour/shape presence; AdamW 2e-3, warm-up + cosine."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    torch.manual_seed(seed)
    net = _judge_net()
    x_all = _images_to_tensor(images)
    y_all = torch.from_numpy(np.stack([_judge_targets(p) for p in prompts]))
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = _warmup_cosine(opt, steps, warm=max(1, steps // 20))
    g = torch.Generator().manual_seed(seed)
    for step in tqdm(range(steps), desc="judge", mininterval=5):
        idx = torch.randint(len(x_all), (128,), generator=g)
        x, y = x_all[idx], y_all[idx]
        x = torch.where(torch.rand(len(x), 1, 1, 1, generator=g) < 0.5, x, x.flip(-1))  # h-flip
        lg = net["head"](net["features"](x))
        npres = len(COLORS) + len(SHAPES)
        loss = (
            F.cross_entropy(lg[:, :3], y[:, 0].long())
            + F.binary_cross_entropy_with_logits(lg[:, 3 : 3 + npres], y[:, 1 : 1 + npres])
            + F.cross_entropy(lg[:, 3 + npres :], y[:, 1 + npres].long())
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net.eval().requires_grad_(False)


def train_transformer(
    transformer,
    latents,
    cap_idx,
    prompt_embeds,
    pooled,
    steps: int,
    batch: int = 64,
    lr: float = 1e-3,
    ema_decay: float = 0.999,
    seed: int = 0,
):
    """Rectified flow matching (NOTES.md §1), VAE and text encoders frozen.

    x_t = (1-t) x0 + t eps, t ~ logit-normal(0, 1) (sigmoid of a standard normal);
    loss = mean (v(x_t, 1000 t, c) - (eps - x0))^2; captions dropped to the empty prompt
    with prob. 0.1 (last row of prompt_embeds); AdamW (lr 1e-3, wd 0.01, warm-up 200 then
    cosine to 10%), grad clip 1; returns the EMA (0.999) weights' state dict.
    latents (N, 4, 16, 16) scaled; cap_idx (N,) rows of prompt_embeds (C+1, 20, 64).
    """
    import copy

    import torch
    from tqdm import tqdm

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    empty = len(prompt_embeds) - 1
    ema = copy.deepcopy(transformer).requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    sched = _warmup_cosine(opt, steps, warm=200)
    transformer.train()
    bar = tqdm(range(steps), desc="transformer", mininterval=5)
    for step in bar:
        idx = torch.randint(len(latents), (batch,), generator=g)
        x0 = latents[idx]
        ci = cap_idx[idx].clone()
        ci[torch.rand(batch, generator=g) < 0.1] = empty
        eps = torch.randn(x0.shape, generator=g)
        t = torch.sigmoid(torch.randn(batch, generator=g))
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        v = transformer(
            hidden_states=xt,
            timestep=1000 * t,
            encoder_hidden_states=prompt_embeds[ci],
            pooled_projections=pooled[ci],
            return_dict=False,
        )[0]
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            d = min(ema_decay, (1 + step) / (10 + step))
            for pe, p in zip(ema.parameters(), transformer.parameters()):
                pe.lerp_(p, 1 - d)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    return ema.state_dict()


WORLD_NOTE = "the shipped shapes world: its rewards, judges and prompts are the package world/ (world/__init__.py)"

BUILD = dict(n_images=24_000, vae_steps=600, judge_steps=600, transformer_steps=3_500, threads=1)
"""Build settings. One torch thread: bit-reproducible and robust when the 2 cores are shared. 3,500 transformer steps
(was 2,000 before the texture; ~2.5 steps/s on one thread): the texture is the last thing the model learns (a
800-step prototype drew a plaid on every caption, results/world-design/tables.md)."""


def build(out_dir: Path = ASSETS, **overrides) -> dict:
    """Regenerate every asset from scratch, deterministically; returns the metrics."""
    import torch
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import save_file

    cfg = {**BUILD, **overrides}
    torch.set_num_threads(cfg["threads"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics, t_start = {"config": cfg}, time.time()

    print("[1/6] world: rendering ground truth")
    prompts, images = _world_dataset(cfg["n_images"], "train", seed=1)

    print("[2/6] VAE")
    comps = build_components(seed=0)
    vae = comps["vae"]
    with texture_amplitude(max(TEXTURE["amp"], VAE_TEXTURE_AMP)):  # the same images, their textures at 0.3: the
        vae_images = [render(p, 1_000_000 + i) for i, p in enumerate(prompts[:16_000])]  # VAE keeps fainter lines too
    train_vae(vae, vae_images, cfg["vae_steps"], batch=32)
    z = vae_encode(vae, images)
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (z - shift) * scale  # (N, 4, 16, 16), ~N(0, 1)
    metrics.update(latent_shift=shift, latent_scale=scale)

    print("[3/6] judge CNN")
    jp = sample_prompts(6_000, "heldout", 3)
    j_prompts = prompts[:10_000] + jp
    j_images = images[:10_000] + [render(p, 3_000_000 + i) for i, p in enumerate(jp)]
    j_images = j_images + vae_decode(vae, z[10_000:15_000])  # reconstructions: robustness to blur
    j_prompts = j_prompts + prompts[10_000:15_000]
    net = train_judge(j_images, j_prompts, cfg["judge_steps"])
    ref_p, ref_i = _world_dataset(5_000, "train", seed=5)
    f_ref, _ = _judge_forward(ref_i, net)
    sd = {k: v.contiguous() for k, v in net.state_dict().items()}
    sd["ref_mu"] = torch.from_numpy(f_ref.mean(0)).float()
    sd["ref_sigma"] = torch.from_numpy(np.cov(f_ref, rowvar=False)).float()
    save_file(sd, str(out_dir / "judge.safetensors"))
    judges._JUDGE = (net, f_ref.mean(0), np.cov(f_ref, rowvar=False))  # what load_judge() will return
    metrics.update(world_metrics(vae))
    print("[4/6] text embeddings (pipe.encode_prompt, as at sampling)")
    pipe = StableDiffusion3Pipeline(**comps)
    pipe.set_progress_bar_config(disable=True)
    caps = SPLITS["train"]
    pe, pooled = encode_prompts(pipe, caps + [""])
    cap_idx = torch.tensor([caps.index(p) for p in prompts])

    print("[5/6] transformer (flow matching)")
    ema_sd = train_transformer(comps["transformer"], latents, cap_idx, pe, pooled, cfg["transformer_steps"])
    comps["transformer"].load_state_dict(ema_sd)
    comps["transformer"].eval().requires_grad_(False)
    pipe.save_pretrained(str(out_dir / "shapes-sd3"), safe_serialization=True)
    write_world_file(out_dir / "shapes-sd3", "world", WORLD_NOTE)

    print("[6/6] evaluation")
    pipe = load_pipeline(out_dir / "shapes-sd3")
    metrics.update(evaluate(pipe, grid_path=out_dir / "samples.png", path=out_dir / "shapes-sd3"))
    metrics["build_minutes"] = (time.time() - t_start) / 60
    (out_dir / "build_metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1))
    return metrics


# ------------------------------------------------ pairwise preference judge ----
PREF_BUILD = dict(steps=1500, batch=64, lr=2e-3, pool=4000)


def train_pref_judge(steps: int, batch: int, lr: float, pool: int, seed: int = 0):
    """Fit the Bradley-Terry judge on `pool` fresh training-split pairs (-log sigmoid(s_better - s_worse),
    AdamW, cosine schedule). Returns the net."""
    import torch

    torch.manual_seed(seed)
    net = _pref_net()
    better, worse, prompts = preference_pairs(pool, "train", seed)
    xb, xw = _images_to_tensor(better), _images_to_tensor(worse)
    v = torch.from_numpy(np.stack([_prompt_vector(p) for p in prompts]))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = _warmup_cosine(opt, steps, steps // 20)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(prompts), (batch,), generator=gen)
        flip = torch.rand(batch, generator=gen) < 0.5  # horizontal flips (side prompts keep their side: none flipped)
        flip &= v[idx, 19] > 0
        a, b = xb[idx], xw[idx]
        a, b = (
            torch.where(flip[:, None, None, None], a.flip(-1), a),
            torch.where(flip[:, None, None, None], b.flip(-1), b),
        )
        s = _pref_forward(net, torch.cat([a, b]), v[idx].repeat(2, 1))
        loss = torch.nn.functional.softplus(s[batch:] - s[:batch]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return net.eval()


def build_pref_judge(path: Path = PREF_PATH, seed: int = 0) -> dict:
    """Train the preference judge and save it; returns its accuracy on fresh held-out-split pairs."""
    import torch
    from safetensors.torch import save_file

    net = train_pref_judge(**PREF_BUILD, seed=seed)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    better, worse, prompts = preference_pairs(1000, "heldout", seed + 1)
    with torch.no_grad():
        acc = float((_pref_scores(net, better, prompts) > _pref_scores(net, worse, prompts)).float().mean())
    metrics = {"pref_heldout_pair_accuracy": acc, **PREF_BUILD}
    path.with_suffix(".json").write_text(json.dumps(metrics, indent=1))
    return metrics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="regenerate assets/ from scratch (a world variant: its experiment builds it)")
    b.add_argument("--out", default=None, help="default: assets/")
    for k in BUILD:
        b.add_argument(f"--{k}", type=int, default=None, help=f"default {BUILD[k]}")
    e = sub.add_parser(
        "eval", help="checker accuracy on held-out prompts + sample grid (+ eval_metrics.json next to it)"
    )
    e.add_argument("--n", type=int, default=512)
    e.add_argument("--split", default="heldout", choices=["train", "heldout"])
    e.add_argument("--grid", default=str(ASSETS / "samples.png"))
    sub.add_parser("bench", help="rollout and LoRA-step timings")
    sub.add_parser("pref-judge", help="retrain assets/pref_judge.safetensors (the pairwise preference judge, ~2 min)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        given = {k: getattr(a, k) for k in BUILD if getattr(a, k) is not None}
        build(Path(a.out or ASSETS), **given)
    elif a.cmd == "pref-judge":
        print(json.dumps(build_pref_judge(), indent=1))
    elif a.cmd == "eval":
        pipe = load_pipeline()
        m = world_metrics(pipe.vae)
        m.update(evaluate(pipe, n=a.n, split=a.split, grid_path=Path(a.grid)))
        Path(a.grid).with_name("eval_metrics.json").write_text(json.dumps(m, indent=1))
        print(json.dumps(m, indent=1))
    else:
        print(json.dumps(bench(load_pipeline()), indent=1))


if __name__ == "__main__":
    main()
