"""Shapes world: the embedded default model, its rewards and its held-out judges.

The training scripts must run on a laptop CPU with no downloads, so the repo ships
its own tiny text-to-image model built from the SAME diffusers classes as
SD3.5-Medium (``StableDiffusion3Pipeline``: SD3 MMDiT transformer, AutoencoderKL,
two CLIP text encoders + one T5 encoder, FlowMatchEulerDiscreteScheduler with
shift 3.0), pretrained here on a procedural world whose rewards are real programs.

    pipe = StableDiffusion3Pipeline.from_pretrained("assets/shapes-sd3", local_files_only=True)
    images = pipe(prompts, generator=torch.Generator().manual_seed(0), **GEN_KWARGS).images
    scores = REWARDS["geneval_strict"](images, prompts)          # (N,) float64

Contents (top to bottom): world (grammar, prompts, rendering) · checker (colour
segmentation + connected components + shape test) · rewards · held-out judges
(a CNN and a Fréchet distance in its feature space) · model components (tokenizers,
text encoders, VAE, transformer) · build (VAE -> judge -> transformer) · eval/bench · CLI.

Commands (all deterministic, fixed seeds, CPU):
    python world/shapes_world.py build   # regenerate assets/ from scratch (~30 min on 1 thread)
    python world/shapes_world.py eval    # checker accuracy on held-out prompts + assets/samples.png
    python world/shapes_world.py bench   # rollout and LoRA-step timings

Conventions: images are PIL RGB; every reward/judge resizes to 32x32 (box filter) first,
so they also score 512 px images. Latents follow SD3: the pipeline's scaled latent is
``x = (z - shift_factor) * scaling_factor`` with z the VAE posterior mean; the VAE config's
factors are set so that x has about zero mean and unit variance over the world.
Flow matching as in NOTES.md §1: ``x_t = (1-t) x0 + t eps``, target ``eps - x0``,
transformer timestep ``1000 t``.

`import shapes_world` is cheap: numpy/scipy/PIL only; torch and diffusers are imported
inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import re
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent
ASSETS = ROOT / "assets"
PIPELINE_DIR = ASSETS / "shapes-sd3"
JUDGE_PATH = ASSETS / "judge.safetensors"
PREF_PATH = ASSETS / "pref_judge.safetensors"
PROFILES_PATH = ASSETS / "profiles.json"
"""The pretrained model's level statistics (experiments/protocol.py's measure_profiles: 192 groups per inner level, the
default tree sampler, 10 steps; a copy of experiments/results/world-design/profiles192/profiles.json): recast.py's
--gain-init world starts W from them."""

RES = 32  # image side in pixels; latents are 16x16x4
GEN_KWARGS = dict(height=RES, width=RES, num_inference_steps=10, guidance_scale=1.0, max_sequence_length=10)
"""Pipeline-call arguments the model was trained for: ``pipe(prompts, **GEN_KWARGS)``.
``max_sequence_length=10`` matters: the transformer saw 10 T5 tokens; the pipeline's
default 256 lets the random T5 turn padding into features (accuracy falls to ~6%)."""
TEXT_LEN = 10  # CLIP and T5 tokens per prompt (incl. special tokens)

# ============================================================ world ====
COLORS = {"red": (215, 45, 45), "green": (40, 160, 60), "blue": (45, 85, 215), "yellow": (235, 195, 35)}
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
COUNT_WORD = {1: "a", 2: "two", 3: "three"}
SIDES = ("left", "right")
TEXTURES = ("striped", "barred")
"""Fine, low-contrast texture inside every object of a caption (the late attribute): named in the caption
("a red striped circle", "two blue barred squares"), plain when unnamed. See :func:`_texture_pattern`."""
TEXTURE = dict(kind="C", amp=0.1)
"""The texture design, chosen by measurement (results/world-design/README.md). Kind C (the world's): striped =
2-pixel horizontal lines every 4 pixel rows, barred = 2-pixel vertical lines every 4 columns, each with a random
phase per object. The prototypes that lost: kind A = 1-pixel lines every 2nd row (striped) and a dot every 2nd
pixel in x and y (the VAE averaged both away); 2x2 dots or a 2x2 checkerboard on the 4-pixel grid (the VAE
averaged them away; lines survive). Kind B = kind A's lines and a random speckle (not prototyped). ``amp``: the
darkened pixels' brightness factor is 1 - amp (hue kept); the checker's texture thresholds follow it
(:func:`texture_contrast`). 0.3 was the first amplitude the VAE carried, and it left texture decided too early
(0.6 of its D(0) by t = 0.465); 0.1 was chosen by an ideal observer on the VAE's latents and then measured
(results/world-design/README.md)."""


def _hue_deg(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees [0, 360) of an (..., 3) float RGB array (HSV definition)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    mx, mn = rgb.max(-1), rgb.min(-1)
    d = np.maximum(mx - mn, 1e-6)
    h = np.where(mx == r, ((g - b) / d) % 6, np.where(mx == g, (b - r) / d + 2, (r - g) / d + 4))
    return (60.0 * h) % 360.0


HUE = {c: float(_hue_deg(np.array(v, float))) for c, v in COLORS.items()}  # palette hues (degrees)


def all_captions() -> list[str]:
    """Every caption of the grammar (252), in a fixed order.

    Templates, each plain or with a texture word x in TEXTURES before the shape: "a {c} [x] {s}" (36) ·
    "a {c} [x] {s} on the {left|right}" (72) · "two {c} [x] {s}s" (36) · "three {c} [x] {s}s" (36) ·
    "a {c1} {s1} and a {c2} {s2}" with c1 != c2, s1 != s2 (72, plain: 8 words is the 10-token limit).
    """
    caps = []
    for c in COLORS:
        for s in SHAPES:
            for x in ("",) + tuple(t + " " for t in TEXTURES):
                caps.append(f"a {c} {x}{s}")
                caps += [f"a {c} {x}{s} on the {side}" for side in SIDES]
                caps += [f"two {c} {x}{s}s", f"three {c} {x}{s}s"]
    for c1 in COLORS:
        for s1 in SHAPES:
            for c2 in COLORS:
                for s2 in SHAPES:
                    if c1 != c2 and s1 != s2:
                        caps.append(f"a {c1} {s1} and a {c2} {s2}")
    return caps


def _template(caption: str) -> str:
    if " and " in caption:
        return "pair"
    if " on the " in caption:
        return "position"
    return {"a": "single", "two": "two", "three": "three"}[caption.split()[0]]


def splits() -> dict[str, list[str]]:
    """Train / held-out captions: a fixed 20% of each template is held out (seed 1234).

    Held-out captions are combinations training never sees (e.g. "two yellow triangles"),
    while every word still occurs in training captions.
    """
    rng = np.random.default_rng(1234)
    by_t: dict[str, list[str]] = {}
    for cap in all_captions():
        by_t.setdefault(_template(cap), []).append(cap)
    out = {"train": [], "heldout": []}
    for t, caps in by_t.items():
        held = set(rng.choice(len(caps), size=round(0.2 * len(caps)), replace=False).tolist())
        for i, cap in enumerate(caps):
            out["heldout" if i in held else "train"].append(cap)
    return out


SPLITS = splits()
TEMPLATES = ("single", "position", "two", "three", "pair")


def sample_prompts(n: int, split: str = "train", seed: int = 0) -> list[str]:
    """n prompts of a split ("train" | "heldout"): template uniform, then caption uniform."""
    rng = np.random.default_rng(seed)
    by_t: dict[str, list[str]] = {}
    for cap in SPLITS[split]:
        by_t.setdefault(_template(cap), []).append(cap)
    ts = sorted(by_t)
    out = []
    for _ in range(n):
        caps = by_t[ts[rng.integers(len(ts))]]
        out.append(caps[rng.integers(len(caps))])
    return out


def parse_prompt(prompt: str) -> dict:
    """Prompt -> spec ``{"objects": [(colour, shape), ...], "side": None|"left"|"right"}``, plus
    ``"texture": "striped"|"barred"`` when the caption names one (absent: plain).

    Accepts the grammar of :func:`all_captions` (also unseen combinations, e.g. a texture word in a
    pair); raises ValueError otherwise (two different textures in one caption included).
    """
    p = prompt.lower().strip().rstrip(".")
    side = None
    m = re.fullmatch(r"(.*) on the (left|right)", p)
    if m:
        p, side = m.group(1), m.group(2)
    objects, textures = [], set()
    for part in p.split(" and "):
        w = part.split()
        if len(w) == 4 and w[2] in TEXTURES:
            textures.add(w.pop(2))
        if len(w) != 3 or w[0] not in NUMBER_WORDS or w[1] not in COLORS:
            raise ValueError(f"prompt outside the shapes grammar: {prompt!r}")
        n, shape = NUMBER_WORDS[w[0]], w[2]
        shape = shape[:-1] if n > 1 and shape.endswith("s") else shape
        if shape not in SHAPES:
            raise ValueError(f"unknown shape in {prompt!r}")
        objects += [(w[1], shape)] * n
    if len(textures) > 1:
        raise ValueError(f"two textures in {prompt!r}")
    spec = {"objects": objects, "side": side}
    if textures:
        spec["texture"] = textures.pop()
    return spec


def _layout(spec: dict, rng: np.random.Generator) -> list[tuple[float, float, float]]:
    """Centres and radii (cx, cy, r) in pixels, non-overlapping with a >= 2 px gap."""
    n = len(spec["objects"])
    rmin, rmax = {1: (6.0, 10.0), 2: (5.0, 8.0), 3: (4.5, 6.0)}[min(n, 3)]
    for attempt in range(1000):
        shrink = 1.0 - 0.15 * min(attempt / 500, 1.0)
        out = []
        for _ in range(n):
            r = rng.uniform(rmin, rmax) * shrink
            lo, hi = r + 1.0, RES - r - 1.0
            xlo, xhi = lo, hi
            if spec["side"] == "left":
                xhi = min(hi, RES / 2 - 3.0)
            elif spec["side"] == "right":
                xlo = max(lo, RES / 2 + 3.0)
            out.append((rng.uniform(xlo, xhi), rng.uniform(lo, hi), r))
        ok = all(
            abs(a[0] - b[0]) > a[2] + b[2] + 2 or abs(a[1] - b[1]) > a[2] + b[2] + 2
            for i, a in enumerate(out)
            for b in out[i + 1 :]
        )
        if ok:
            return out
    raise RuntimeError("layout failed")


def _texture_pattern(
    texture: str, rng: np.random.Generator | None, kind: str | None = None, phase: int | None = None
) -> np.ndarray:
    """(32, 32) 0/1 mask of the pixels a texture darkens, its phase drawn from rng (see TEXTURE); kind C with
    ``phase`` given (rng unused): that phase (0: dark rows / columns at 0, 1 mod 4)."""
    kind = kind or TEXTURE["kind"]
    yy, xx = np.mgrid[:RES, :RES]
    if kind == "C":  # 2-pixel horizontal lines every 4 rows (striped) / vertical ones every 4 columns (barred)
        py, px = (int(rng.integers(4)), int(rng.integers(4))) if phase is None else (phase, phase)
        return ((yy + py) % 4 < 2 if texture == "striped" else (xx + px) % 4 < 2).astype(np.float64)
    py, px = int(rng.integers(2)), int(rng.integers(2))
    if texture == "striped":
        return ((yy + py) % 2 == 0).astype(np.float64)
    if kind == "A":
        return (((yy + py) % 2 == 0) & ((xx + px) % 2 == 0)).astype(np.float64)
    return (rng.random((RES, RES)) < 0.3).astype(np.float64)


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


def render_spec(spec: dict, seed: int, variant: str | None = None, sign: int | None = None) -> Image.Image:
    """Draw a spec deterministically from ``seed``: light tinted background; each shape
    drawn at 4x and box-downsampled (anti-aliased). Squares are axis-aligned with half-side
    0.85 r; triangles point up, apex at the top of their bounding box. A textured spec then
    darkens, inside each object (weighted by its pixel coverage), the pixels of the texture's
    pattern by the factor 1 - TEXTURE["amp"] (all three channels: hue unchanged).
    variant: None (the shipped world) or a key of VARIANTS (``signed``: the texture at its fixed phase and the
    background's signed lines, ``sign`` +-1, default :func:`variant_sign` of ``seed``; sign 0: no lines)."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"unknown world variant {variant!r}; known: {sorted(VARIANTS)}")
    rng = np.random.default_rng(seed)
    ss = 4
    base = rng.uniform(222, 248)
    bg = tuple(int(np.clip(base + rng.uniform(-6, 6), 0, 255)) for _ in range(3))
    im = Image.new("RGB", (RES * ss, RES * ss), bg)
    d = ImageDraw.Draw(im)
    texture = spec.get("texture")
    masks = []
    for (colour, shape), (cx, cy, r) in zip(spec["objects"], _layout(spec, rng)):
        fill = tuple(int(np.clip(v + rng.uniform(-12, 12), 0, 255)) for v in COLORS[colour])
        cx, cy, r = cx * ss, cy * ss, r * ss
        m = Image.new("L", im.size, 0) if texture or variant else None
        for dd, f in ((d, fill),) + (((ImageDraw.Draw(m), 255),) if m is not None else ()):
            if shape == "circle":
                dd.ellipse((cx - r, cy - r, cx + r, cy + r), fill=f)
            elif shape == "square":
                h = 0.85 * r
                dd.rectangle((cx - h, cy - h, cx + h, cy + h), fill=f)
            else:
                dd.polygon([(cx, cy - r), (cx - r, cy + 0.8 * r), (cx + r, cy + 0.8 * r)], fill=f)
        if m is not None:
            masks.append(np.asarray(m.resize((RES, RES), Image.BOX), np.float64) / 255.0)
    out = im.resize((RES, RES), Image.BOX)
    if not texture and variant is None:
        return out
    a = np.asarray(out, np.float64)
    if texture:
        dark = np.zeros((RES, RES))
        for cov in masks:
            pattern = _texture_pattern(texture, rng)  # drawn in every case: the rest of the stream stays the same
            dark += cov * (pattern if variant is None else _texture_pattern(texture, None, phase=0))
        a = a * (1.0 - TEXTURE["amp"] * np.clip(dark, 0, 1))[..., None]
    if variant == "signed":
        sign = variant_sign(seed) if sign is None else int(sign)
        if sign:
            background = 1.0 - np.clip(sum(masks, np.zeros((RES, RES))), 0, 1)
            a = a - (VARIANTS["signed"]["depth"] * background * signed_rows(sign))[..., None]
    return Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8))


def render(prompt: str, seed: int, variant: str | None = None) -> Image.Image:
    """Ground-truth image for ``prompt`` (deterministic in ``seed``); ``variant``: a world variant's (VARIANTS)."""
    return render_spec(parse_prompt(prompt), seed, variant)


# ========================================================== checker ====
CHROMA = np.array([max(v) - min(v) for v in COLORS.values()], float)  # palette chroma
MIN_AREA = 6  # components smaller than this (pixels) are ignored
TEX_PLAIN, TEX_FULL, TEX_ANISO = 0.6, 0.6, 1.6
"""Texture thresholds of :func:`_texture_of`, the first two as fractions of ground truth's contrast
:func:`texture_contrast`: the fine energy ex + ey below which a fill is plain, and the contrast along the lines a
texture needs to count; the last, how much stronger along than across. Chosen on the rebuilt world
(results/world-design/README.md, "thresholds"): at amplitude 0.1 the pretrained model's fills carry fine noise of
~0.3 of the contrast in each direction, and it draws the named lines at a median 0.55 of it; these values read
ground truth and the VAE's reconstructions right (1.000 / 1.000 named / plain on 400 held-out images) and leave the
pretrained 0/1 texture reward room to learn (0.23 named / 0.53 plain)."""


@contextlib.contextmanager
def texture_amplitude(amp: float):
    """Render (and read) textures at amplitude ``amp`` inside the block; TEXTURE["amp"] is restored after."""
    old, TEXTURE["amp"] = TEXTURE["amp"], amp
    try:
        yield
    finally:
        TEXTURE["amp"] = old


def texture_contrast(amp: float | None = None) -> float:
    """ex (or ey) of a ground-truth texture at amplitude ``amp`` (default TEXTURE["amp"]): across 2-pixel lines
    every inner pixel is amp V / 2 from the mean of its two neighbours, and the mean brightness is V (1 - amp / 2),
    so the relative second difference is (amp / 2) / (1 - amp / 2). The unit of TEX_PLAIN, TEX_FULL and grain."""
    amp = TEXTURE["amp"] if amp is None else amp
    return (amp / 2) / (1 - amp / 2)


def _texture_features(v: np.ndarray, m: np.ndarray) -> tuple[float, float, int]:
    """Fine-scale contrast inside one object: (ex, ey, n). v: brightness max(RGB) / 255 (32, 32);
    m: the object's pixels. Over the n pixels whose 4-neighbourhood lies in the object's 1-pixel
    erosion (so anti-aliased edges never count), ey = mean |v - (v_up + v_down) / 2| / mean v and
    ex the same along x: relative second differences, 0 on a flat fill, ~amp on 1-pixel lines."""
    from scipy import ndimage

    inner = ndimage.binary_erosion(m)
    ok = np.zeros_like(inner)
    ok[1:-1, 1:-1] = inner[1:-1, 1:-1] & inner[:-2, 1:-1] & inner[2:, 1:-1] & inner[1:-1, :-2] & inner[1:-1, 2:]
    n = int(ok.sum())
    if n == 0:
        return 0.0, 0.0, 0
    dy = np.abs(v[1:-1, 1:-1] - 0.5 * (v[:-2, 1:-1] + v[2:, 1:-1]))
    dx = np.abs(v[1:-1, 1:-1] - 0.5 * (v[1:-1, :-2] + v[1:-1, 2:]))
    sel = ok[1:-1, 1:-1]
    mean_v = max(float(v[1:-1, 1:-1][sel].mean()), 1e-6)
    return float(dx[sel].mean() / mean_v), float(dy[sel].mean() / mean_v), n


def _line_features(v: np.ndarray, m: np.ndarray, phase: bool = False) -> tuple[float, float, int]:
    """Amplitude of period-4 lines inside one object, phase-free: (lx, ly, n). v: brightness max(RGB) / 255 (32, 32);
    m: the object's pixels. Over its 1-pixel erosion (n pixels): for horizontal lines (striped), each row's mean
    brightness p_y over its inner pixels (rows with >= 2), centred on the rows' weighted mean, then the magnitude of
    its Fourier coefficient at period 4, 2 |sum_y w_y (p_y - p) exp(-i pi y / 2)| / sum_y w_y (w_y: the row's inner
    pixels), / the object's mean inner brightness: ly; lx the same over columns (vertical lines, barred). Averaging
    along a line before the transform keeps the lines and averages pixel noise down, and the period-4 coefficient
    ignores finer (period-2) noise. Ground truth's 2-on-2-off lines at amplitude amp give the fundamental
    (sqrt(2) / 2) amp / (1 - amp / 2) = sqrt(2) texture_contrast() (the unit of :func:`_line_energy`); a flat fill 0.
    phase=True: the signed projection of the same coefficient on one fixed phase of the image grid instead (lines
    dark at rows / columns 2, 3 mod 4: +amplitude; the opposite phase: -amplitude; a quarter period off: 0)."""
    from scipy import ndimage

    inner = ndimage.binary_erosion(m)
    n = int(inner.sum())
    if n == 0:
        return 0.0, 0.0, 0
    mean_v = max(float(v[inner].mean()), 1e-6)
    out = []
    for axis in (1, 0):  # lx: columns' means (vertical lines); ly: rows' means (horizontal lines)
        w = inner.sum(axis=1 - axis).astype(np.float64)  # inner pixels per column (axis 1) or per row (axis 0)
        p = np.where(w > 0, (v * inner).sum(axis=1 - axis) / np.maximum(w, 1), 0.0)
        w = np.where(w >= 2, w, 0.0)
        if w.sum() == 0:
            out.append(0j)
            continue
        k = np.arange(len(w))
        c = (w * (p - (w * p).sum() / w.sum()) * np.exp(-0.5j * np.pi * k)).sum()
        out.append(2 * c / w.sum() / mean_v)
    if not phase:
        return abs(out[0]), abs(out[1]), n
    return tuple(float((z * np.exp(0.25j * np.pi)).real) for z in out) + (n,)


def _texture_of(ex: float, ey: float, n: int, plain=None, full=None, aniso=None) -> str:
    """With c = texture_contrast(): plain if the fine energy ex + ey < TEX_PLAIN c (or no inner pixels); striped
    (horizontal lines) if ey >= TEX_FULL c and ey > TEX_ANISO ex; barred (vertical lines) if ex >= TEX_FULL c and
    ex > TEX_ANISO ey; else faint (a texture fainter than TEX_FULL c, or lines both ways: matches no caption).
    plain, full, aniso: other thresholds than the shipped ones (results/world-design/thresholds.py tries them)."""
    plain = TEX_PLAIN if plain is None else plain
    full = TEX_FULL if full is None else full
    aniso = TEX_ANISO if aniso is None else aniso
    c = texture_contrast()
    if n == 0 or ex + ey < plain * c:
        return "plain"
    if ey >= full * c and ey > aniso * ex:
        return "striped"
    return "barred" if ex >= full * c and ex > aniso * ey else "faint"


def pooled_texture(objs: list[dict]) -> tuple[float, float, int]:
    """(ex, ey, n) over every detected object's inner pixels (ex, ey weighted by n_inner): what the texture verdict
    and grain of :func:`check` read."""
    n = sum(o["n_inner"] for o in objs)
    ex, ey = (sum(o["n_inner"] * o[k] for o in objs) / max(n, 1) for k in ("ex", "ey"))
    return ex, ey, n


def _as_array(img: Image.Image) -> np.ndarray:
    """PIL image -> float64 (32, 32, 3) in [0, 255]; other sizes are box-resized to 32."""
    img = img.convert("RGB")
    if img.size != (RES, RES):
        img = img.resize((RES, RES), Image.BOX)
    return np.asarray(img, dtype=np.float64)


def detect(img: Image.Image) -> list[dict]:
    """Objects in an image: list of {colour, shape, cx, cy, area, fill, texture, ex, ey, n_inner}.

    1. each pixel takes the palette colour of nearest hue (HSV hue, circular distance);
    2. foreground = chroma (max-min of RGB) > 30 and > half the palette colour's chroma
       (i.e. the pixel is at least ~half covered by the shape);
    3. per colour, 4-connected components (``scipy.ndimage.label``), area >= 6 px;
    4. shape from the component's bounding box (h x w) and area A, fill = A/(h w):
       diag = (range(x+y) + range(x-y)) / (2 (range(x) + range(y))) over the pixel centres
       (1 for an axis-aligned square, 1/sqrt(2) for a disc, ~0.74 for the triangle);
       square if diag >= 0.84; triangle if fill < 0.55 or the top third of rows is much
       narrower than the bottom third (mean width ratio < 0.5); else circle.
       (Ground truth: square diag >= 0.87, circle diag <= 0.8 and width ratio >= 0.62,
       triangle width ratio <= 0.36. The diagonal test survives blur and rounded corners,
       e.g. VAE reconstructions: square diag >= 0.85 in 99.5% of cases.)
    5. texture from the fine contrast inside the component (:func:`_texture_features`,
       :func:`_texture_of`): plain, striped, barred (or faint).
    """
    from scipy import ndimage

    a = _as_array(img)
    chroma = a.max(-1) - a.min(-1)
    hue = _hue_deg(a)
    names = list(COLORS)
    dist = np.stack([np.abs((hue - HUE[c] + 180) % 360 - 180) for c in names], -1)
    nearest = dist.argmin(-1)
    fg = (chroma > 30) & (chroma > 0.5 * CHROMA[nearest])
    v = a.max(-1) / 255.0
    objs = []
    for ci, colour in enumerate(names):
        lab, n = ndimage.label(fg & (nearest == ci))
        for k in range(1, n + 1):
            m = lab == k
            area = int(m.sum())
            if area < MIN_AREA:
                continue
            ys, xs = np.nonzero(m)
            y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
            h, w = y1 - y0, x1 - x0
            fill = area / (h * w)
            widths = m[y0:y1, x0:x1].sum(1).astype(float)
            third = max(1, h // 3)
            taper = widths[:third].mean() / max(widths[-third:].mean(), 1e-6)
            # diagonal extent: corners reach out along both diagonals only for squares
            diag = (np.ptp(xs + ys) + np.ptp(xs - ys)) / max(2 * (np.ptp(xs) + np.ptp(ys)), 1)
            if diag >= 0.84:
                shape = "square"
            elif fill < 0.55 or taper < 0.5:
                shape = "triangle"
            else:
                shape = "circle"
            ex, ey, n_inner = _texture_features(v, m)
            lx, ly, n_lines = _line_features(v, m)
            px, py, _ = _line_features(v, m, phase=True)
            objs.append(
                dict(
                    colour=colour,
                    shape=shape,
                    cx=float(xs.mean() + 0.5),
                    cy=float(ys.mean() + 0.5),
                    area=area,
                    fill=float(fill),
                    texture=_texture_of(ex, ey, n_inner),
                    ex=ex,
                    ey=ey,
                    n_inner=n_inner,
                    lx=lx,
                    ly=ly,
                    n_lines=n_lines,
                    px=px,
                    py=py,
                )
            )
    return objs


def _dice(a: list, b: list) -> float:
    """Multiset Dice overlap 2|a ∩ b| / (|a| + |b|) in [0, 1]."""
    if not a and not b:
        return 1.0
    from collections import Counter

    inter = sum((Counter(a) & Counter(b)).values())
    return 2.0 * inter / (len(a) + len(b))


def check(img: Image.Image, prompt: str) -> dict:
    """GenEval-like check of one image against its prompt.

    Attribute scores in [0, 1]:
      count    = 1 - min(1, |n_det - n_exp| / n_exp)
      colour   = Dice of colour multisets, shape = Dice of shape multisets,
      object   = Dice of (colour, shape) multisets,
      position = 1 if the prompt's object (matching colour, preferring matching shape)
                 has its centroid on the named half of the image (only for "on the ..." prompts).
    ``partial`` = mean of the applicable attributes; ``strict`` = 1 iff the detected
    (colour, shape) multiset equals the prompt's exactly and the position holds.
    Texture (the late attribute; in neither partial nor strict):
      texture = 1 iff objects are detected and the texture read from their inner pixels pooled
                (ex, ey weighted by n_inner; :func:`_texture_of`) is the prompt's (plain when it
                names none; the caption's texture is every object's); else 0;
      grain   = fine contrast inside the detected objects, max(ex, ey) of their inner pixels
                pooled, / texture_contrast() (0 with no inner pixels, ~1 on ground truth).
    """
    spec, objs = parse_prompt(prompt), detect(img)
    exp = spec["objects"]
    det_cs = [(o["colour"], o["shape"]) for o in objs]
    s = dict(
        count=1.0 - min(1.0, abs(len(objs) - len(exp)) / len(exp)),
        colour=_dice([o[0] for o in det_cs], [e[0] for e in exp]),
        shape=_dice([o[1] for o in det_cs], [e[1] for e in exp]),
        object=_dice(det_cs, exp),
    )
    pos_ok = True
    if spec["side"] is not None:
        cands = [o for o in objs if (o["colour"], o["shape"]) == exp[0]] or [
            o for o in objs if o["colour"] == exp[0][0]
        ]
        if cands:
            o = max(cands, key=lambda o: o["area"])
            pos_ok = (o["cx"] < RES / 2) if spec["side"] == "left" else (o["cx"] > RES / 2)
        else:
            pos_ok = False
        s["position"] = float(pos_ok)
    s["partial"] = float(np.mean(list(s.values())))
    s["strict"] = float(sorted(det_cs) == sorted(exp) and pos_ok)
    ex, ey, n_in = pooled_texture(objs)
    s["texture"] = float(bool(objs) and _texture_of(ex, ey, n_in) == spec.get("texture", "plain"))
    s["grain"] = max(ex, ey) / texture_contrast()
    s["fine_x"], s["fine_y"], s["n_inner"] = ex / texture_contrast(), ey / texture_contrast(), n_in
    n_l = sum(o["n_lines"] for o in objs)
    unit = np.sqrt(2) * texture_contrast()
    s["line_x"], s["line_y"] = (sum(o["n_lines"] * o[k] for o in objs) / max(n_l, 1) / unit for k in ("lx", "ly"))
    s["n_lines"] = n_l
    s["lock_x"], s["lock_y"] = (sum(o["n_lines"] * o[k] for o in objs) / max(n_l, 1) / unit for k in ("px", "py"))
    return s


# ========================================================== rewards ====
def _gray(img: Image.Image) -> np.ndarray:
    return _as_array(img).mean(-1) / 255.0


def reward_geneval(images: list, prompts: list[str]) -> np.ndarray:
    """Partial GenEval-like score: mean of the attribute scores of :func:`check`
    (count, colour, shape, object[, position]). Range [0, 1]; ground truth ~1."""
    return _checked(images, prompts, "partial")  # one detection per image, shared with the other checker rewards


def reward_geneval_strict(images: list, prompts: list[str]) -> np.ndarray:
    """Strict GenEval-like score: 1 iff exactly the prompt's objects (colour and shape,
    counted) are present and the position holds, else 0. Values {0, 1}."""
    return _checked(images, prompts, "strict")


SHARP_SCALE = 0.06


def reward_sharpness(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """Edge contrast / fine detail: ``mean |lap(g)| / 0.06`` with g the grey image in [0, 1]
    at 32x32 and lap(g) = 4 g[i,j] - g[i-1,j] - g[i+1,j] - g[i,j-1] - g[i,j+1] over the 30x30
    interior. Range [0, 133]; flat image 0, world ground truth 0.95 +- 0.35. Decided by the
    last denoising steps (edges), so it becomes informative late."""
    out = []
    for img in images:
        g = _gray(img)
        lap = 4 * g[1:-1, 1:-1] - g[:-2, 1:-1] - g[2:, 1:-1] - g[1:-1, :-2] - g[1:-1, 2:]
        out.append(np.abs(lap).mean() / SHARP_SCALE)
    return np.array(out, np.float64)


JPEG_FLAT_BYTES = None  # size of a flat grey 32x32 JPEG (quality 95), computed lazily
JPEG_SCALE = 500.0


def _jpeg_bytes(img: Image.Image) -> int:
    buf = io.BytesIO()
    Image.fromarray(_as_array(img).astype(np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.tell()


def reward_jpeg(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """JPEG compressibility (global): ``1 - (B - B_flat) / 500`` with B the bytes of the
    32x32 image saved by Pillow as JPEG quality 95 and B_flat the bytes of a flat grey
    image. Range (-inf, 1] (in practice about [-2, 1]); flat image 1, ground truth 0.08 +- 0.25.
    Global (background tint, number and length of edges); conflicts with sharpness: edges
    cost bytes."""
    global JPEG_FLAT_BYTES
    if JPEG_FLAT_BYTES is None:
        JPEG_FLAT_BYTES = _jpeg_bytes(Image.new("RGB", (RES, RES), (128, 128, 128)))
    return np.array([1.0 - (_jpeg_bytes(i) - JPEG_FLAT_BYTES) / JPEG_SCALE for i in images], np.float64)


def reward_saturation(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """Colourfulness: ``mean over pixels of HSV saturation (max-min)/max`` at 32x32.
    Range [0, 1]; grey image 0, ground truth 0.16 +- 0.04. Set by how much coloured area there
    is, i.e. by the layout and colours, so informative early in denoising."""
    out = []
    for img in images:
        a = _as_array(img)
        mx, mn = a.max(-1), a.min(-1)
        out.append(((mx - mn) / np.maximum(mx, 1e-6)).mean())
    return np.array(out, np.float64)


_CHECKS: dict = {}  # (image bytes, prompt) -> check(): the split checker scores share one detection per image


def _checked(images: list, prompts: list[str], key: str, default: float = 1.0) -> np.ndarray:
    """One attribute score of :func:`check` per image (``default`` where it does not apply)."""
    if len(_CHECKS) > 4096:
        _CHECKS.clear()
    out = []
    for img, prompt in zip(images, prompts):
        k = (_as_array(img).astype(np.uint8).tobytes(), prompt)
        if k not in _CHECKS:
            _CHECKS[k] = check(img, prompt)
        out.append(_CHECKS[k].get(key, default))
    return np.array(out, np.float64)


def reward_count(images: list, prompts: list[str]) -> np.ndarray:
    """Object count score of :func:`check`: 1 - min(1, |n_det - n_exp| / n_exp). Set by the layout."""
    return _checked(images, prompts, "count")


def reward_colour(images: list, prompts: list[str]) -> np.ndarray:
    """Colour score of :func:`check`: Dice of the detected and the prompt's colour multisets."""
    return _checked(images, prompts, "colour")


def reward_shape(images: list, prompts: list[str]) -> np.ndarray:
    """Shape score of :func:`check`: Dice of the detected and the prompt's shape multisets (outlines)."""
    return _checked(images, prompts, "shape")


def reward_position(images: list, prompts: list[str]) -> np.ndarray:
    """Position score of :func:`check` (1 iff the named object sits on the named half) for the
    "... on the left/right" prompts; 1 for prompts without a position (nothing to get wrong)."""
    return _checked(images, prompts, "position")


DETAIL_SCALE = 0.05


def reward_texture(images: list, prompts: list[str]) -> np.ndarray:
    """The caption's texture (the late attribute), 0/1: 1 iff objects are detected and the texture read from
    their inner pixels is the one the prompt names, at >= TEX_FULL = 0.6 of ground truth's contrast, or plain
    when it names none (:func:`check`). Fine, low-contrast detail: decided by the last denoising steps."""
    return _checked(images, prompts, "texture", 0.0)


def reward_grain(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """Fine-detail contrast inside the shapes (smooth): the ``grain`` of :func:`check`, i.e. the mean relative
    second difference of brightness over the detected objects' inner pixels / texture_contrast(). 0 on flat fills,
    ~1 on ground-truth textured objects; prompt-independent (more fine contrast scores more)."""
    return _checked(images, prompts if prompts is not None else ["a red circle"] * len(images), "grain", 0.0)


def reward_detail(images: list, prompts: list[str] | None = None) -> np.ndarray:
    """Colour-edge crispness (fine detail): ``mean |lap(c)| / 0.05`` with c = (max - min) / 255 of RGB
    per pixel (the chroma) at 32x32, over the 30x30 interior. Flat or grey image 0. Like sharpness but
    on colour rather than grey edges; decided early, with the shapes' outlines (0.68 of its D(0) by t = 0.79,
    experiments/results/world-design/profiles192/profiles.md)."""
    out = []
    for img in images:
        a = _as_array(img)
        c = (a.max(-1) - a.min(-1)) / 255.0
        lap = 4 * c[1:-1, 1:-1] - c[:-2, 1:-1] - c[2:, 1:-1] - c[1:-1, :-2] - c[1:-1, 2:]
        out.append(np.abs(lap).mean() / DETAIL_SCALE)
    return np.array(out, np.float64)


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
    chroma = a.max(-1) - a.min(-1)
    dist = np.stack([np.abs((_hue_deg(a) - HUE[c] + 180) % 360 - 180) for c in COLORS], -1)
    fg = (chroma > 30) & (chroma > 0.5 * CHROMA[dist.argmin(-1)])
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


REWARDS = {
    "geneval": reward_geneval,
    "geneval_strict": reward_geneval_strict,
    "sharpness": reward_sharpness,
    "jpeg": reward_jpeg,
    "saturation": reward_saturation,
    # the checker split into its attributes, and colour-edge detail: candidates for a second setting
    "count": reward_count,
    "colour": reward_colour,
    "shape": reward_shape,
    "position": reward_position,
    "detail": reward_detail,
    # the late attribute: the caption's texture (0/1) and fine contrast inside shapes (smooth)
    "texture": reward_texture,
    "grain": reward_grain,
    "texture_soft": reward_texture_soft,
    "texture_along": reward_texture_along,
    "texture_named": reward_texture_named,
    "texture_lines": reward_texture_lines,
    "lines_along": reward_lines_along,
    "lines_locked": reward_lines_locked,
    "lines_phase": reward_lines_phase,
    "signed": reward_signed,
}
"""name -> callable (images: list[PIL.Image], prompts: list[str]) -> np.ndarray (N,) float64."""

DEFAULT_REWARDS = ["geneval", "grain", "detail", "shape"]
"""Used with budgets 0.4, 0.3, 0.2, 0.1 (and recast.py's --base-reg 0.1 and --gain-init world), chosen by measurement
(experiments/results/first-run/README.md, arms L and M): geneval (the composition the caption asks for: count, colour,
shape, position; decided early-mid; the largest budget), grain (fine contrast inside the shapes, smooth: decided late),
detail (crisp colour edges: decided early) and shape (the caption's shapes: decided mid-late); each is learnable
alone by DiffusionNFT (first-run's item 6). detail took saturation's place: saturation is learned by growing the
shapes, which pulled the samples away from the world's images. The caption's texture (`texture`, 0/1) is not
learnable here and left the defaults (experiments/results/late-reward/README.md). The experiments' setting A is the
earlier default set, geneval, saturation, texture, grain (experiments/bench.py SETTINGS)."""
DEFAULT_BUDGETS = [0.4, 0.3, 0.2, 0.1]


# =========================================================== judges ====
def _judge_net():
    """Small CNN (~100k params): 32x32x3 -> 64 features -> heads
    count (3-way: 1, 2, 3 objects), colour presence (4 logits), shape presence (3 logits),
    texture (3-way: plain, striped, barred)."""
    import torch.nn as nn

    return nn.ModuleDict(
        dict(
            features=nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1),
                nn.GELU(),
                nn.Conv2d(32, 32, 3, stride=2, padding=1),
                nn.GELU(),  # 16x16
                nn.Conv2d(32, 64, 3, padding=1),
                nn.GELU(),
                nn.Conv2d(64, 64, 3, stride=2, padding=1),
                nn.GELU(),  # 8x8
                nn.Conv2d(64, 64, 3, padding=1),
                nn.GELU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            ),  # (B, 64)
            head=nn.Linear(64, 3 + len(COLORS) + len(SHAPES) + 1 + len(TEXTURES)),
        )
    )


def _texture_index(spec: dict) -> int:
    """0 plain, 1 + TEXTURES.index(texture) otherwise."""
    return 0 if spec.get("texture") is None else 1 + TEXTURES.index(spec["texture"])


def _judge_targets(prompt: str) -> np.ndarray:
    """[count index (0..2), colour presence (4), shape presence (3), texture index (0..2)] for a prompt."""
    spec = parse_prompt(prompt)
    cols = {c for c, _ in spec["objects"]}
    shps = {s for _, s in spec["objects"]}
    return np.array(
        [min(len(spec["objects"]), 3) - 1]
        + [c in cols for c in COLORS]
        + [s in shps for s in SHAPES]
        + [_texture_index(spec)],
        np.float32,
    )


def _images_to_tensor(images: list):
    import torch

    a = np.stack([_as_array(i) for i in images]) / 127.5 - 1.0
    return torch.from_numpy(a).permute(0, 3, 1, 2).float()


_JUDGE = None


def load_judge():
    """The shipped judge: (net, reference feature mean (64,), covariance (64, 64))."""
    global _JUDGE
    if _JUDGE is None:
        from safetensors.torch import load_file

        sd = load_file(str(JUDGE_PATH))
        net = _judge_net()
        net.load_state_dict({k: v for k, v in sd.items() if not k.startswith("ref_")})
        net.eval()
        _JUDGE = (net, sd["ref_mu"].double().numpy(), sd["ref_sigma"].double().numpy())
    return _JUDGE


def _judge_forward(images: list, net=None):
    import torch

    net = net if net is not None else load_judge()[0]
    feats, logits = [], []
    with torch.no_grad():
        for i in range(0, len(images), 256):
            f = net["features"](_images_to_tensor(images[i : i + 256]))
            feats.append(f)
            logits.append(net["head"](f))
    return torch.cat(feats).double().numpy(), torch.cat(logits).double()


def judge_cnn(images: list, prompts: list[str]) -> np.ndarray:
    """Learned judge (never used as a training reward): mean of four probabilities from
    the CNN: p(count = n), mean over colours of p(presence is as the prompt says), the
    same over shapes, and p(texture = the prompt's, plain when unnamed). Range [0, 1]; ground truth ~0.95+."""
    import torch

    _, logits = _judge_forward(images)
    out = []
    for lg, p in zip(logits, prompts):
        t = torch.from_numpy(_judge_targets(p)).double()
        npres = len(COLORS) + len(SHAPES)
        p_count = torch.softmax(lg[:3], 0)[int(t[0])]
        pres = torch.sigmoid(lg[3 : 3 + npres])
        p_pres = torch.where(t[1 : 1 + npres] > 0, pres, 1 - pres)
        p_tex = torch.softmax(lg[3 + npres :], 0)[int(t[1 + npres])]
        out.append(float((p_count + p_pres[: len(COLORS)].mean() + p_pres[len(COLORS) :].mean() + p_tex) / 4))
    return np.array(out, np.float64)


JUDGES = {"cnn": judge_cnn}
"""Held-out per-image judges, same interface as REWARDS."""


# ------------------------------------------------ pairwise preference judge ----
# The LLM-as-a-judge stand-in: shown two images for one prompt, which is better? A Bradley-Terry
# model p(a > b | prompt) = sigmoid(s(a, prompt) - s(b, prompt)) with s a small CNN + the prompt's
# attribute vector, trained on its own data: a ground-truth render against a corrupted one (wrong
# content: one colour, shape, count, side or texture changed; or degraded: blur, pixel noise, washed-out
# colour, a smudge; blur and noise also wash out or fake the texture), and a mild against a strong
# degradation. It never calls the checker, the rewards or the CNN judge, and it is never a training reward.
PREF_BUILD = dict(steps=1500, batch=64, lr=2e-3, pool=4000)


def _pref_net():
    """CNN (~70k params) 32x32x3 -> 64 features f; the prompt vector v (25) -> 64 by a small MLP g;
    score = <f, g(v)> (does the image show the prompt?) + q(f) (is it a clean image?)."""
    import torch.nn as nn

    return nn.ModuleDict(
        dict(
            features=nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1),
                nn.GELU(),
                nn.Conv2d(32, 48, 3, stride=2, padding=1),
                nn.GELU(),  # 16x16
                nn.Conv2d(48, 64, 3, stride=2, padding=1),
                nn.GELU(),  # 8x8
                nn.Conv2d(64, 64, 3, padding=1),
                nn.GELU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            ),
            prompt=nn.Sequential(nn.Linear(PROMPT_DIM, 64), nn.GELU(), nn.Linear(64, 64)),
            quality=nn.Linear(64, 1),
        )
    )


PROMPT_DIM = 25


def _prompt_vector(prompt: str) -> np.ndarray:
    """(25,) counts per colour (4), per shape (3), per (colour, shape) (12), side one-hot (none, left, right),
    texture one-hot (plain, striped, barred)."""
    spec = parse_prompt(prompt)
    objs = spec["objects"]
    v = [sum(c == k for c, _ in objs) for k in COLORS] + [sum(s == k for _, s in objs) for k in SHAPES]
    v += [sum(o == (c, k) for o in objs) for c in COLORS for k in SHAPES]
    v += [spec["side"] is None, spec["side"] == "left", spec["side"] == "right"]
    v += [_texture_index(spec) == i for i in range(1 + len(TEXTURES))]
    return np.array(v, np.float32)


def _mutate(spec: dict, rng: np.random.Generator) -> dict:
    """The spec with one thing wrong: an object's colour or shape, the count (one more or one fewer), the side,
    or the texture (another of plain, striped, barred)."""
    objs, side, texture = list(spec["objects"]), spec["side"], spec.get("texture")
    kinds = ["colour", "shape", "count", "texture"] + (["side"] if side else [])
    kind = kinds[rng.integers(len(kinds))]
    i = int(rng.integers(len(objs)))
    if kind == "colour":
        objs[i] = (str(rng.choice([c for c in COLORS if c != objs[i][0]])), objs[i][1])
    elif kind == "shape":
        objs[i] = (objs[i][0], str(rng.choice([k for k in SHAPES if k != objs[i][1]])))
    elif kind == "count":
        objs = (
            objs[:i] + objs[i + 1 :] if len(objs) > 1 and (len(objs) == 3 or rng.random() < 0.5) else objs + [objs[i]]
        )
    elif kind == "texture":
        texture = [t for t in (None,) + TEXTURES if t != texture][int(rng.integers(len(TEXTURES)))]
    else:
        side = "left" if side == "right" else "right"
    out = {"objects": objs, "side": side}
    if texture is not None:
        out["texture"] = texture
    return out


def _degrade(img: Image.Image, rng: np.random.Generator, strength: float, kind: int | None = None) -> Image.Image:
    """Blur (kind 0), pixel noise (1), washed-out colour (2) or a smudge of the median colour (3), of the
    given strength in (0, 1]; kind None: drawn from rng."""
    from PIL import ImageFilter

    kind = int(rng.integers(4)) if kind is None else kind
    if kind == 0:
        return img.filter(ImageFilter.GaussianBlur(0.4 + 1.2 * strength))
    a = _as_array(img)
    if kind == 1:
        a = a + rng.normal(0, 6 + 24 * strength, a.shape)
    elif kind == 2:
        a = a + (0.25 + 0.6 * strength) * (a.mean(-1, keepdims=True) - a)
    else:
        cy, cx, r = *rng.uniform(6, RES - 6, 2), 3 + 6 * strength
        yy, xx = np.mgrid[:RES, :RES]
        m = (((yy - cy) ** 2 + (xx - cx) ** 2) < r * r)[..., None]
        a = np.where(m, np.median(a.reshape(-1, 3), 0), a)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def preference_pairs(n: int, split: str = "train", seed: int = 0) -> tuple[list, list, list[str]]:
    """n (better, worse, prompt) triples: a render against a render with one thing wrong (same seed, 30%),
    against a render of another caption (20%), against a degraded copy (30%), or a mild against a
    strong degradation (20%)."""
    rng = np.random.default_rng(seed)
    prompts = sample_prompts(n, split, seed)
    others = sample_prompts(n, split, seed + 1)
    better, worse = [], []
    for i, p in enumerate(prompts):
        img_seed = 10_000_000 * (seed + 1) + i
        gt, u = render(p, img_seed), rng.random()
        if u < 0.3:
            better.append(gt)
            worse.append(render_spec(_mutate(parse_prompt(p), rng), img_seed))
        elif u < 0.5:
            better.append(gt)
            worse.append(render(others[i] if others[i] != p else others[i - 1], img_seed))
        elif u < 0.8:
            better.append(gt)
            worse.append(_degrade(gt, rng, rng.uniform(0.2, 1.0)))
        else:
            mild, more = rng.uniform(0.0, 0.4), rng.uniform(0.4, 0.6)
            state = rng.bit_generator.state  # the same kind of degradation, two strengths
            better.append(_degrade(gt, rng, mild))
            rng.bit_generator.state = state
            worse.append(_degrade(gt, rng, mild + more))
    return better, worse, prompts


def _pref_forward(net, x, v):
    """Scores (B,) of image tensors x (B, 3, 32, 32) under prompt vectors v (B, 22)."""
    f = net["features"](x)
    return (f * net["prompt"](v)).sum(1) / 8.0 + net["quality"](f)[:, 0]


def _pref_scores(net, images: list, prompts: list[str]):
    import torch

    return _pref_forward(
        net, _images_to_tensor(images), torch.from_numpy(np.stack([_prompt_vector(p) for p in prompts]))
    )


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


_PREF = None


def judge_preference(images: list, prompts: list[str]) -> np.ndarray:
    """Per-image Bradley-Terry score s(image, prompt) of the shipped preference judge: image a is
    preferred to image b for the same prompt iff s(a) > s(b), with probability sigmoid(s(a) - s(b)).
    Only differences between images of one prompt mean anything."""
    import torch

    global _PREF
    if _PREF is None:
        from safetensors.torch import load_file

        _PREF = _pref_net()
        _PREF.load_state_dict(load_file(str(PREF_PATH)))
        _PREF.eval()
    with torch.no_grad():
        return np.concatenate(
            [
                _pref_scores(_PREF, images[i : i + 256], prompts[i : i + 256]).double().numpy()
                for i in range(0, len(images), 256)
            ]
        )


def judge_features(images: list) -> np.ndarray:
    """(N, 64) penultimate features of the judge CNN."""
    return _judge_forward(images)[0]


def _frechet(mu1, s1, mu2, s2) -> float:
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^{1/2}) (FID formula); 1e-6 I added to both
    covariances so the matrix square root exists when features are degenerate."""
    from scipy import linalg

    s1, s2 = s1 + 1e-6 * np.eye(len(s1)), s2 + 1e-6 * np.eye(len(s2))
    covmean = np.real(linalg.sqrtm(s1 @ s2))
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def frechet_distance(images: list, prompts: list[str] | None = None, seed: int = 0) -> float:
    """Fréchet distance |mu - mu_ref|^2 + tr(S + S_ref - 2 (S S_ref)^{1/2}) between judge-CNN
    features (64-d) of ``images`` and of world ground truth. Detects drift and reward
    hacking; >= 0, lower is better. Needs N >= 2.

    Reference: with ``prompts``, ground-truth renders of those same prompts (seeds
    seed*10^6 + i), so the prompt mix matches exactly (use this for held-out prompts);
    without, the shipped statistics of 5,000 train-split world images.
    Scale (N = 1000): ground truth ~15-30 (sampling noise), uniform noise images ~1e4.
    """
    f = judge_features(images)
    if prompts is None:
        _, mu, sigma = load_judge()
    else:
        g = judge_features([render(p, seed * 1_000_000 + i) for i, p in enumerate(prompts)])
        mu, sigma = g.mean(0), np.cov(g, rowvar=False)
    return _frechet(f.mean(0), np.cov(f, rowvar=False), mu, sigma)


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


def build_components(seed: int = 0) -> dict:
    """All pipeline components, random init from fixed seeds (diffusers' get_dummy_components
    pattern). Text encoders stay frozen at this random init; VAE and transformer are trained."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok, t5_tok = build_tokenizers()
    clip_cfg = dict(
        vocab_size=len(clip_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TEXT_LEN,
        projection_dim=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    te1 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    torch.manual_seed(seed + 1)
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    torch.manual_seed(seed + 2)
    te3 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=RES,
        mid_block_add_attention=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    torch.manual_seed(seed + 4)
    transformer = SD3Transformer2DModel(
        sample_size=RES // 2,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=128,
        pooled_projection_dim=64,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    for m in (te1, te2, te3):
        m.requires_grad_(False).eval()
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=te1,
        text_encoder_2=te2,
        text_encoder_3=te3,
        tokenizer=clip_tok,
        tokenizer_2=clip_tok,
        tokenizer_3=t5_tok,
        scheduler=scheduler,
    )


def world_id(path: str | Path = PIPELINE_DIR) -> str:
    """Which embedded world a result was measured on: the first 12 hex digits of the SHA-256 of every file of the
    pipeline folder (names and bytes; hidden files such as locks skipped). A rebuild gives a new id; bench.py
    refuses to mix results of two worlds."""
    path, h = Path(path), hashlib.sha256()
    files = (p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".") and p.name != "world.json")
    for f in sorted(files):
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def load_pipeline(path: str | Path = PIPELINE_DIR, device: str = "cpu"):
    """The shipped pipeline, loaded exactly as the real one (offline), progress bar off."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_prompts(pipe, prompts: list[str]):
    """(prompt_embeds (N, 20, 64), pooled (N, 64)) exactly as the pipeline computes them
    under GEN_KWARGS (``pipe.encode_prompt`` with max_sequence_length=10, no CFG)."""
    import torch

    with torch.no_grad():
        pe, _, pooled, _ = pipe.encode_prompt(
            prompts,
            None,
            None,
            do_classifier_free_guidance=False,
            max_sequence_length=GEN_KWARGS["max_sequence_length"],
            device=pipe._execution_device,
        )
    return pe, pooled


def generate(pipe, prompts: list[str], seed: int = 0, batch: int = 64, **overrides) -> list:
    """Images for prompts with GEN_KWARGS (overridable); one CPU generator seeded once."""
    import torch

    g = torch.Generator().manual_seed(seed)
    kw = {**GEN_KWARGS, **overrides}
    out = []
    for i in range(0, len(prompts), batch):
        out += list(pipe(prompts[i : i + batch], generator=g, **kw).images)
    return out


# ============================================================ build ====
def _world_dataset(n: int, split: str, seed: int, variant: str | None = None):
    """n (prompt, image) ground-truth pairs: prompts from sample_prompts, image seeds seed*10^6+i."""
    prompts = sample_prompts(n, split, seed)
    return prompts, [render(p, seed * 1_000_000 + i, variant) for i, p in enumerate(prompts)]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a - b) ** 2)))


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


def vae_encode(vae, images: list):
    """Raw VAE posterior means z (N, 4, 16, 16) (unscaled)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [vae.encode(_images_to_tensor(images[i : i + 256])).latent_dist.mode() for i in range(0, len(images), 256)]
        )


def vae_decode(vae, z) -> list:
    """PIL images from raw (unscaled) latents z (N, 4, 16, 16)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(z), 256):
            out += _tensor_to_images(vae.decode(z[i : i + 256]).sample)
    return out


def _tensor_to_images(x) -> list:
    a = ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(v) for v in a]


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
    global _JUDGE
    _JUDGE = (net, f_ref.mean(0), np.cov(f_ref, rowvar=False))  # what load_judge() will return
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

    print("[6/6] evaluation")
    pipe = load_pipeline(out_dir / "shapes-sd3")
    metrics.update(evaluate(pipe, grid_path=out_dir / "samples.png", path=out_dir / "shapes-sd3"))
    metrics["build_minutes"] = (time.time() - t_start) / 60
    (out_dir / "build_metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics, indent=1))
    return metrics


VARIANT_FILE = "world_variant.json"
"""A world variant's pipeline folder holds this file ({variant, amp, base_world, config}): what makes the scripts
treat the folder as the embedded model (kit.worlds.is_embedded) and names what it was built from."""
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
    (path / "world.json").write_text('{"module": "world.shapes_world"}\n')
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


# ===================================================== eval, bench ====
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="regenerate assets/ from scratch (--variant NAME: a world variant, its own folder)"
    )
    b.add_argument("--out", default=None, help="default: assets/ (a variant: assets-NAME/)")
    b.add_argument("--variant", default=None, choices=sorted(VARIANTS), help="a world variant (VARIANTS), fine-tuned")
    for k in {**BUILD, **VARIANT_BUILD}:
        kind = float if k.endswith("lr") else int
        b.add_argument(
            f"--{k}", type=kind, default=None, help=f"default {BUILD.get(k)} (variant {VARIANT_BUILD.get(k)})"
        )
    e = sub.add_parser(
        "eval", help="checker accuracy on held-out prompts + sample grid (+ eval_metrics.json next to it)"
    )
    e.add_argument("--n", type=int, default=512)
    e.add_argument("--split", default="heldout", choices=["train", "heldout"])
    e.add_argument("--grid", default=str(ASSETS / "samples.png"))
    sub.add_parser("bench", help="rollout and LoRA-step timings")
    sub.add_parser("pref-judge", help="retrain assets/pref_judge.safetensors (the pairwise preference judge, ~2 min)")
    a = ap.parse_args(argv)
    if a.cmd == "build" and a.variant:
        out = Path(a.out) if a.out else ROOT / f"assets-{a.variant}"
        build_variant(a.variant, out, **{k: getattr(a, k) for k in VARIANT_BUILD})
    elif a.cmd == "build":
        extra = [f"--{k}" for k in VARIANT_BUILD if k not in BUILD and getattr(a, k) is not None]
        if extra:
            raise SystemExit(f"{', '.join(extra)}: only for a variant's build (--variant NAME)")
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
