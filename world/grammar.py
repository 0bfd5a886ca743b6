"""The shapes world's grammar and ground truth: captions, the train / held-out split, prompt sampling and parsing,
and the renderer (each prompt drawn deterministically from a seed). numpy and PIL only.

Images are PIL RGB, RES x RES pixels. A world variant (an experiment's world, e.g.
experiments/late_reward_world.py's ``signed``) registers a rendering hook in VARIANT_HOOKS and is rendered with
``render(prompt, seed, variant=NAME)``; the shipped world has none.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

RES = 32  # image side in pixels; latents are 16x16x4

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


class VariantHook(NamedTuple):
    """How a world variant renders the shipped world's image for the same seed (the same layouts, fills, colours and
    random draws) with its changes: ``texture_phase`` None keeps the texture's random phase per object, an int fixes
    it (see :func:`_texture_pattern`); ``paint(a, masks, seed, **kw)`` returns the (RES, RES, 3) float image ``a``
    (after the texture) with the variant's additions, ``masks`` each object's pixel coverage in [0, 1], ``kw`` the
    variant's own arguments of :func:`render_spec`."""

    texture_phase: int | None
    paint: Callable


VARIANT_HOOKS: dict[str, VariantHook] = {}
"""World variants' rendering hooks, name -> VariantHook: empty in the shipped world; an experiment's world registers
its own (experiments/late_reward_world.py: ``signed``)."""


def render_spec(spec: dict, seed: int, variant: str | None = None, **variant_kw) -> Image.Image:
    """Draw a spec deterministically from ``seed``: light tinted background; each shape
    drawn at 4x and box-downsampled (anti-aliased). Squares are axis-aligned with half-side
    0.85 r; triangles point up, apex at the top of their bounding box. A textured spec then
    darkens, inside each object (weighted by its pixel coverage), the pixels of the texture's
    pattern by the factor 1 - TEXTURE["amp"] (all three channels: hue unchanged).
    variant: None (the shipped world) or a key of VARIANT_HOOKS (its hook's texture phase and paint, given
    ``variant_kw``: the ``signed`` variant's ``sign``, experiments/late_reward_world.py)."""
    if variant is not None and variant not in VARIANT_HOOKS:
        raise ValueError(f"unknown world variant {variant!r}; known: {sorted(VARIANT_HOOKS)}")
    hook = None if variant is None else VARIANT_HOOKS[variant]
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
        m = Image.new("L", im.size, 0) if texture or hook else None
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
    if not texture and hook is None:
        return out
    a = np.asarray(out, np.float64)
    if texture:
        fixed = hook is not None and hook.texture_phase is not None
        dark = np.zeros((RES, RES))
        for cov in masks:
            pattern = _texture_pattern(texture, rng)  # drawn in every case: the rest of the stream stays the same
            dark += cov * (_texture_pattern(texture, None, phase=hook.texture_phase) if fixed else pattern)
        a = a * (1.0 - TEXTURE["amp"] * np.clip(dark, 0, 1))[..., None]
    if hook is not None:
        a = hook.paint(a, masks, seed, **variant_kw)
    return Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8))


def render(prompt: str, seed: int, variant: str | None = None) -> Image.Image:
    """Ground-truth image for ``prompt`` (deterministic in ``seed``); ``variant``: a world variant's (VARIANT_HOOKS)."""
    return render_spec(parse_prompt(prompt), seed, variant)
