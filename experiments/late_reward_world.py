"""The late-reward experiment's world (experiments/results/late-reward/README.md): the shipped shapes world plus the
experiment's candidate late rewards and its world variant, registered into the world when this module is imported.

- Candidate rewards, added to ``world.REWARDS``: ``texture_soft``, ``texture_along``, ``texture_named`` (fine
  energy along / across the caption's texture), ``texture_lines``, ``lines_along`` (period-4 line amplitudes),
  ``lines_locked`` (a diagnostic at one fixed phase), ``lines_phase`` (candidate (a)) and ``signed`` (candidate (b)'s
  reward, read from the ``signed`` variant's background).
- The world variant ``signed`` (candidate (b), README section 8): a rendering hook in ``world.VARIANT_HOOKS``
  (``world.render(prompt, seed, "signed")``), the sign's ideal observer that chose its depth, and its build, a
  fine-tune of the shipped world into its own folder, whose ``world.json`` names this module as its world:

    OMP_NUM_THREADS=1 python -m experiments.late_reward_world build --variant signed [--out world/assets-signed]

This module offers the world's interface (world/__init__.py: REWARDS, DEFAULT_REWARDS, JUDGES, frechet_distance,
GEN_KWARGS, parse_prompt, sample_prompts, splits, PROFILES_PATH, world_id, ...), so that a variant's pipeline folder
can name it as its world. The shipped world renders and scores as before: nothing here changes what it draws.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from world import (  # (the world's interface, offered again: a variant's folder names this module)
    ASSETS,
    DEFAULT_BUDGETS,
    DEFAULT_REWARDS,
    GEN_KWARGS,
    JUDGES,
    PIPELINE_DIR,
    PROFILES_PATH,
    RES,
    REWARDS,
    ROOT,
    SPLITS,
    TEXTURE,
    VARIANT_HOOKS,
    VariantHook,
    encode_prompts,
    frechet_distance,
    generate,
    judge_cnn,
    judge_preference,
    load_pipeline,
    parse_prompt,
    render,
    sample_prompts,
    splits,
    texture_amplitude,
    vae_decode,
    vae_encode,
    world_id,
    write_world_file,
)
from world.build import VAE_TEXTURE_AMP, _world_dataset, train_transformer, train_vae
from world.checker import _as_array, _line_features, foreground
from world.rewards import _checked, reward_geneval_strict

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_REWARDS",
    "GEN_KWARGS",
    "JUDGES",
    "PROFILES_PATH",
    "RES",
    "REWARDS",
    "frechet_distance",
    "judge_cnn",
    "judge_preference",
    "parse_prompt",
    "sample_prompts",
    "splits",
    "world_id",
]

MODULE = "experiments.late_reward_world"  # what a variant's world.json names

# ============================================================ the variant ====
VARIANTS = {"signed": dict(depth=1)}
"""World variants (issue 44 section 1, candidate (b); experiments/results/late-reward/README.md section 8). Each
renders the shipped world's images (the same layouts, fills and colours for the same seed) with one change, builds
into its own asset folder (``build --variant NAME``) and so has its own world id. ``signed``: the texture's phase is
fixed (dark rows / columns at 0, 1 mod 4: no random phase left to decide late), and the background carries faint
horizontal 2-pixel lines every 4 rows at one fixed phase of the image grid whose sign is random per image (+1: dark
rows at 2, 3 mod 4; -1: at 0, 1 mod 4; both the same energy), never named in a caption: ``depth`` grey levels (of
255) darker, weighted by the pixel's background coverage. Read by the reward ``signed`` (:func:`reward_signed`).
depth 1 (the smallest 8-bit step; a latent norm of 0.34 through the shipped encoder) is the ideal observer's choice
for t_half ~ 0.3 (README section 8)."""


def variant_sign(seed: int) -> int:
    """The ``signed`` variant's sign for the image of ``seed``: +1 or -1 with probability 1/2, from a stream of its
    own (the image's other draws are the shipped world's)."""
    return 1 if np.random.default_rng([seed, 44]).random() < 0.5 else -1


def signed_rows(sign: int) -> np.ndarray:
    """(32, 32) 0/1 mask of the rows the ``signed`` variant darkens: rows 2, 3 mod 4 for +1, 0, 1 mod 4 for -1."""
    yy = np.mgrid[:RES, :RES][0]
    return ((yy % 4 >= 2) if sign > 0 else (yy % 4 < 2)).astype(np.float64)


def sign_share_decided(kappa) -> np.ndarray:
    """The ideal observer of a sign (NOTES.md, "A late reward by design: the sign's ideal observer"): s = +-1 seen as
    y = s mu + w, w ~ N(0, var), kappa = mu^2 / var. E[s | y] = tanh(mu y / var), and the share of the sign's D(0)
    decided, Var(E[s | y]) / Var(s) = E[tanh^2(kappa + sqrt(kappa) Z)], Z ~ N(0, 1) (Gauss-Hermite, 80 nodes)."""
    z, w = np.polynomial.hermite_e.hermegauss(80)
    k = np.asarray(kappa, np.float64)[..., None]
    return (np.tanh(k + np.sqrt(k) * z) ** 2 * w).sum(-1) / w.sum()


def sign_kappa(t, amp: float, noise_var) -> np.ndarray:
    """kappa of the sign of a pattern of latent norm ``amp`` in x_t = (1 - t) x0 + t eps, read along its unit
    direction u against noise of variance ``noise_var`` (in x_t units: t^2 + (1 - t)^2 v for data whose other
    variance along u, given everything else x_t shows, is v): (1 - t)^2 amp^2 / noise_var."""
    t = np.asarray(t, np.float64)
    return (1 - t) ** 2 * amp**2 / np.asarray(noise_var, np.float64)


def sign_amplitude_for(t_half: float, noise_var: float) -> float:
    """The latent norm at which the sign's ideal observer has half of its D(0) decided at t_half (bisection on
    :func:`sign_share_decided`; kappa* = 0.851 there)."""
    lo, hi = 1e-6, 1e3
    for _ in range(200):
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if sign_share_decided(sign_kappa(t_half, mid, noise_var)) < 0.5 else (lo, mid)
    return float(np.sqrt(lo * hi))


def _paint_signed(a: np.ndarray, masks: list, seed: int, sign: int | None = None) -> np.ndarray:
    """The ``signed`` variant's rendering hook (world.VariantHook.paint): the background's signed lines, ``sign`` +-1
    (default :func:`variant_sign` of ``seed``; sign 0: no lines), ``depth`` grey levels deep, weighted by each
    pixel's background coverage (1 - the objects' coverage ``masks``)."""
    sign = variant_sign(seed) if sign is None else int(sign)
    if sign:
        background = 1.0 - np.clip(sum(masks, np.zeros((RES, RES))), 0, 1)
        a = a - (VARIANTS["signed"]["depth"] * background * signed_rows(sign))[..., None]
    return a


# ================================================ the candidate rewards ====
def _along_across(images: list, prompts: list[str], kx: str, ky: str, kn: str):
    """(along, across, n, named) from :func:`check`'s per-image features kx, ky (x and y direction) and count kn:
    along = the feature of the caption's texture's lines (ky for striped, whose horizontal lines vary along y; kx for
    barred), across = the other direction's; for captions that name no texture along = across = max(kx, ky). named:
    whether the caption names a texture. n: kn (0 when nothing was measured; then along = across = 0)."""
    fx, fy = _checked(images, prompts, kx, 0.0), _checked(images, prompts, ky, 0.0)
    n = _checked(images, prompts, kn, 0.0)
    tex = np.array([parse_prompt(p).get("texture") for p in prompts], object)
    striped, barred = tex == "striped", tex == "barred"
    named = striped | barred
    along = np.where(striped, fy, np.where(barred, fx, np.maximum(fx, fy)))
    across = np.where(striped, fx, np.where(barred, fy, np.maximum(fx, fy)))
    return along, across, n, named


def _fine_energy(images: list, prompts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per image, from :func:`check`'s pooled inner pixels, in units of ground truth's contrast texture_contrast():
    (along, across, n_inner, named) of the fine energies ex, ey (:func:`_along_across`). n_inner: 0 when no object's
    inner pixels were found."""
    return _along_across(images, prompts, "fine_x", "fine_y", "n_inner")


def reward_texture_soft(images: list, prompts: list[str]) -> np.ndarray:
    """The caption's texture, smooth (the late attribute). With a = the fine energy along the named lines and
    x = across them, in units of ground truth's contrast (:func:`_fine_energy`; 1 = ground truth's lines):
    named texture: min(a, 1) - min(x, 1)  (the lines' contrast up to ground truth's, less the other orientation's);
    plain caption: 1 - min(max(ex, ey) / c, 1)  (fine energy inside a plain fill penalised).
    Range [-1, 1]; ground truth ~1 (named and plain), a flat fill 0 for a named texture and 1 for a plain caption;
    0 when no object is detected."""
    along, across, n, named = _fine_energy(images, prompts)
    r = np.where(named, np.minimum(along, 1.0) - np.minimum(across, 1.0), 1.0 - np.minimum(along, 1.0))
    return np.where(n > 0, r, 0.0)


def reward_texture_along(images: list, prompts: list[str]) -> np.ndarray:
    """The caption's texture, smooth, without the orientation penalty: min(a, 1) for a named texture (a = the fine
    energy along its lines / ground truth's), 1 - min(max(ex, ey) / c, 1) for a plain caption (:func:`_fine_energy`).
    Range [0, 1]; ground truth ~1; 0 when no object is detected."""
    along, across, n, named = _fine_energy(images, prompts)
    r = np.where(named, np.minimum(along, 1.0), 1.0 - np.minimum(along, 1.0))
    return np.where(n > 0, r, 0.0)


def reward_texture_named(images: list, prompts: list[str]) -> np.ndarray:
    """:func:`reward_texture_soft`'s named-texture term alone, min(a, 1) - min(x, 1), and a constant 0.5 for plain
    captions (no signal from them): whether the named captions' term carries a gradient on its own. Range [-1, 1];
    0 when no object is detected."""
    along, across, n, named = _fine_energy(images, prompts)
    r = np.where(named, np.minimum(along, 1.0) - np.minimum(across, 1.0), 0.5)
    return np.where(n > 0, r, 0.0)


def _line_energy(images: list, prompts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """As :func:`_fine_energy` with the period-4 line amplitudes of :func:`_line_features` (pooled over the detected
    objects, weighted by their inner pixels) in units of ground truth's, sqrt(2) texture_contrast():
    (along, across, n, named)."""
    return _along_across(images, prompts, "line_x", "line_y", "n_lines")


def reward_texture_lines(images: list, prompts: list[str]) -> np.ndarray:
    """The caption's texture, smooth, read by a line detector: with a, x the period-4 line amplitudes along and
    across the named texture's lines in units of ground truth's (:func:`_line_energy`, :func:`_line_features`):
    named texture: min(a, 1) - min(x, 1); plain caption: 1 - min(max(lx, ly), 1). Range [-1, 1]; ground truth ~1,
    flat fill 0 (named) / 1 (plain); 0 when no object is detected."""
    along, across, n, named = _line_energy(images, prompts)
    r = np.where(named, np.minimum(along, 1.0) - np.minimum(across, 1.0), 1.0 - np.minimum(along, 1.0))
    return np.where(n > 0, r, 0.0)


def reward_lines_along(images: list, prompts: list[str]) -> np.ndarray:
    """:func:`reward_texture_lines` without the across term: min(a, 1) for a named texture, 1 - min(max(lx, ly), 1)
    for a plain caption. Range [0, 1]; 0 when no object is detected."""
    along, across, n, named = _line_energy(images, prompts)
    r = np.where(named, np.minimum(along, 1.0), 1.0 - np.minimum(along, 1.0))
    return np.where(n > 0, r, 0.0)


def _locked_lines(images: list, prompts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(p, along, n, named): p the signed amplitude of the named texture's lines at one fixed phase of the image grid
    (:func:`_line_features` with phase=True, pooled over the objects, in units of ground truth's; dark rows / columns
    at 2, 3 mod 4 give +1, at 0, 1 mod 4 -1, a quarter period off 0), along / n / named as :func:`_line_energy`."""
    along, across, n, named = _line_energy(images, prompts)
    lx, ly = _checked(images, prompts, "lock_x", 0.0), _checked(images, prompts, "lock_y", 0.0)
    tex = np.array([parse_prompt(p).get("texture") for p in prompts], object)
    return np.where(tex == "striped", ly, lx), along, n, named


def reward_lines_locked(images: list, prompts: list[str]) -> np.ndarray:
    """Diagnostic, not a world reward (ground truth's lines have a random phase per object, so ground truth scores
    ~0 on average): the named texture's lines at one fixed phase of the image grid, clip(p, -1, 1)
    (:func:`_locked_lines`); plain captions as :func:`reward_texture_lines`. It asks for the same lines as
    lines_along, but where the image's lines must go is fixed: the test of whether the random phase is what keeps
    line rewards from giving DiffusionNFT a consistent gradient."""
    locked, along, n, named = _locked_lines(images, prompts)
    r = np.where(named, np.clip(locked, -1.0, 1.0), 1.0 - np.minimum(along, 1.0))
    return np.where(n > 0, r, 0.0)


def reward_lines_phase(images: list, prompts: list[str]) -> np.ndarray:
    """A late reward shaped for DiffusionNFT's gradient (NOTES.md, "A learnable late reward"): for a caption that
    names a texture, the signed amplitude of its lines at one fixed phase of the image grid, clip(p, -1, 1)
    (:func:`_locked_lines`: +1 for ground truth's lines dark at rows / columns 2, 3 mod 4, -1 for the opposite
    phase, 0 a quarter period off or without lines); 0 for a caption that names none (its group ties: no signal).
    Signed and linear in one fixed pattern (the latent grid's finest alternation), the same sign for every caption,
    both phases of equal energy, and ~50/50 under the pretrained model (the world draws the phase uniformly), so
    that the groups' updates add instead of cancelling. Range [-1, 1]; 0 when no object is detected."""
    locked, _, n, named = _locked_lines(images, prompts)
    return np.where(named & (n > 0), np.clip(locked, -1.0, 1.0), 0.0)


def signed_amplitude(img: Image.Image) -> float:
    """The ``signed`` variant's background lines, read from the pixels: over the background (the pixels detect() does
    not call foreground, eroded by 2 pixels so that anti-aliased edges never count), each row's mean brightness, and
    its period-4 Fourier coefficient projected on the variant's + phase (dark rows at 2, 3 mod 4)
    (:func:`_line_features` with phase=True), in grey levels and in units of ground truth's (2-pixel lines ``depth``
    levels deep: sqrt(2) depth / 2): +1 / -1 for ground truth's two signs, 0 on a flat background or lines a quarter
    period off. 0 when fewer than 2 rows have background."""
    from scipy import ndimage

    a = _as_array(img)
    fg, _ = foreground(a)
    background = ndimage.binary_erosion(~fg, iterations=1, border_value=1)
    v = a.max(-1) / 255.0
    _, py, n = _line_features(v, background, phase=True)
    if not n:
        return 0.0
    level = 255.0 * float(v[ndimage.binary_erosion(background)].mean())  # the mean _line_features divided by
    return float(py * level / (np.sqrt(2) * VARIANTS["signed"]["depth"] / 2))


def reward_signed(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """The ``signed`` world variant's late reward (issue 44 section 1, candidate (b)): clip(signed_amplitude, -1, 1),
    the background's faint fixed-phase lines read with their sign. Linear in one fixed pattern, the same sign for
    every caption (the caption is not read), both signs of equal energy, and ~50/50 in the variant's data, so that
    DiffusionNFT's groups add (NOTES.md, "A learnable late reward"). Range [-1, 1]; ~0 on the shipped world."""
    return np.array([np.clip(signed_amplitude(img), -1.0, 1.0) for img in images], np.float64)


LATE_REWARDS = {
    "texture_soft": reward_texture_soft,
    "texture_along": reward_texture_along,
    "texture_named": reward_texture_named,
    "texture_lines": reward_texture_lines,
    "lines_along": reward_lines_along,
    "lines_locked": reward_lines_locked,
    "lines_phase": reward_lines_phase,
    "signed": reward_signed,
}
"""The experiment's candidate rewards (README sections 2-8), same interface as world.REWARDS."""


def register() -> None:
    """Add the candidate rewards to world.REWARDS (after the world's own, in this order) and the ``signed`` variant's
    rendering hook to world.VARIANT_HOOKS (the texture at phase 0, then :func:`_paint_signed`). Run on import;
    running it again changes nothing."""
    REWARDS.update(LATE_REWARDS)
    VARIANT_HOOKS["signed"] = VariantHook(texture_phase=0, paint=_paint_signed)


register()


# ============================================================ the build ====
VARIANT_FILE = "world_variant.json"
"""A world variant's pipeline folder holds this file ({variant, depth, base_world, config}): what it was built from.
Beside it the folder's world.json (world.WORLD_FILE, the plugin contract) names this module as its world, which makes
the scripts treat the folder as the embedded model (kit.worlds.is_embedded)."""
VARIANT_BUILD = dict(n_images=8_000, vae_steps=600, vae_lr=1e-3, transformer_steps=800, lr=3e-4, eval_n=256, threads=1)
"""A variant is a fine-tune of the shipped world, not a build from scratch (README of results/late-reward, section 8):
the shipped encoder is kept frozen, so every latent the shipped transformer learned stays the same, and only the
decoder learns to draw what the variant adds (the shipped decoder draws back 4% of the signed lines' amplitude,
300 decoder-only steps at 1e-3 already 45% with 98% of the signs right: signed_decoder.json); the transformer starts
from the shipped weights (lr 3e-4, 800 steps: the shipped build's loop, 1/4 of its steps) and learns the variant's one
change. ~10 min on one thread instead of 30-47."""


def build_variant(variant: str, out_dir: Path, base: Path = PIPELINE_DIR, **overrides) -> dict:
    """A world variant (VARIANTS) built from the shipped world into out_dir/shapes-sd3 (its own world id), the
    shipped assets untouched: ground truth of the variant; the shipped VAE's decoder fine-tuned on it (encoder
    frozen); the shipped transformer fine-tuned on its latents (train_transformer); then its metrics
    (variant_metrics) in out_dir/build_metrics.json. Returns the metrics."""
    import torch

    if variant not in VARIANTS:
        raise SystemExit(f"--variant {variant}: unknown; known: {sorted(VARIANTS)}")
    out_dir = Path(out_dir)
    if out_dir.resolve() == ASSETS.resolve() or Path(base).resolve().is_relative_to(out_dir.resolve()):
        raise SystemExit(f"--out {out_dir}: a variant is built into its own folder, never the shipped assets")
    cfg = {**VARIANT_BUILD, **{k: v for k, v in overrides.items() if v is not None}}
    torch.set_num_threads(cfg["threads"])
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics, t_start = (
        {"variant": variant, **VARIANTS[variant], "config": cfg, "base_world": world_id(base)},
        time.time(),
    )
    print(f"[1/4] world variant {variant}: rendering ground truth")
    prompts, images = _world_dataset(cfg["n_images"], "train", seed=1, variant=variant)
    print("[2/4] VAE decoder (encoder frozen)")
    pipe = load_pipeline(base)
    vae = pipe.vae
    with texture_amplitude(max(TEXTURE["amp"], VAE_TEXTURE_AMP)):  # as the shipped VAE: textures at 0.3
        vae_images = [render(p, 1_000_000 + i, variant) for i, p in enumerate(prompts)]
    train_vae(vae, vae_images, cfg["vae_steps"], batch=32, decoder_only=True, lr=cfg["vae_lr"])
    latents = (vae_encode(vae, images) - vae.config.shift_factor) * vae.config.scaling_factor
    print("[3/4] transformer (flow matching, from the shipped weights)")
    caps = SPLITS["train"]
    pe, pooled = encode_prompts(pipe, caps + [""])
    cap_idx = torch.tensor([caps.index(p) for p in prompts])
    tr = pipe.transformer
    tr.requires_grad_(True)
    ema_sd = train_transformer(tr, latents, cap_idx, pe, pooled, cfg["transformer_steps"], lr=cfg["lr"])
    tr.load_state_dict(ema_sd)
    tr.eval().requires_grad_(False)
    path = out_dir / "shapes-sd3"
    pipe.save_pretrained(str(path), safe_serialization=True)
    marker = {"variant": variant, **VARIANTS[variant], "base_world": metrics["base_world"], "config": cfg}
    (path / VARIANT_FILE).write_text(json.dumps(marker, indent=1) + "\n")
    write_world_file(path, MODULE, f"world variant {variant} of the shapes world (experiments/late_reward_world.py)")
    print("[4/4] evaluation")
    metrics.update(variant_metrics(load_pipeline(path), variant, cfg["eval_n"]))
    metrics["world"] = world_id(path)
    metrics["build_minutes"] = (time.time() - t_start) / 60
    (out_dir / "build_metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1))
    return metrics


def variant_metrics(pipe, variant: str, n: int = 256, seed: int = 0) -> dict:
    """What a variant must show before its gate runs: its reward on ground truth, on the VAE's reconstructions (does
    the round trip carry it?) and on n samples of held-out prompts (the pretrained variant's choice: the share of
    samples with reward > 0 among those with |reward| >= 0.5, and the mean |reward|: ~1 if it draws the pattern,
    ~0 if not), and the checker on the samples (the rest of the world kept)."""
    prompts = sample_prompts(n, "heldout", seed)
    gt = [render(p, 9_000_000 + i, variant) for i, p in enumerate(prompts)]
    signs = np.array([variant_sign(9_000_000 + i) for i in range(n)])
    rec = vae_decode(pipe.vae, vae_encode(pipe.vae, gt))
    gen = generate(pipe, prompts, seed=seed)
    r_gt, r_rec, r_gen = (REWARDS[variant](ims, prompts) for ims in (gt, rec, gen))
    decided = np.abs(r_gen) >= 0.5
    return {
        "reward_gt_times_sign": float((r_gt * signs).mean()),
        "reward_vae_times_sign": float((r_rec * signs).mean()),
        "vae_sign_read_back": float((np.sign(r_rec) == signs).mean()),
        "gen_reward_mean": float(r_gen.mean()),
        "gen_reward_abs_mean": float(np.abs(r_gen).mean()),
        "gen_decided_share": float(decided.mean()),
        "gen_positive_share_of_decided": float((r_gen[decided] > 0).mean()) if decided.any() else None,
        "gen_strict": float(reward_geneval_strict(gen, prompts).mean()),
        "gen_texture": float(REWARDS["texture"](gen, prompts).mean()),
        "vae_strict": float(reward_geneval_strict(rec, prompts).mean()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description="Build a world variant of the late-reward experiment (fine-tuned).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fine-tune the shipped world into a world variant's own folder")
    b.add_argument("--variant", required=True, choices=sorted(VARIANTS), help="a world variant (VARIANTS)")
    b.add_argument("--out", default=None, help="default: world/assets-NAME/")
    for k, v in VARIANT_BUILD.items():
        b.add_argument(f"--{k}", type=float if k.endswith("lr") else int, default=None, help=f"default {v}")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else ROOT / f"assets-{a.variant}"
    build_variant(a.variant, out, **{k: getattr(a, k) for k in VARIANT_BUILD})


if __name__ == "__main__":
    main()
