"""The shapes world's rewards: programs, each (images: list[PIL.Image], prompts: list[str]) -> np.ndarray (N,)
float64, every image box-resized to RES x RES first (so they also score 512 px images). REWARDS names them all,
DEFAULT_REWARDS / DEFAULT_BUDGETS are the embedded model's defaults. An experiment may register more rewards into
REWARDS (experiments/late_reward_world.py). numpy, scipy and PIL only.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from world.checker import _as_array, check
from world.grammar import RES


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
}
"""name -> callable (images: list[PIL.Image], prompts: list[str]) -> np.ndarray (N,) float64. The world's own; the
late-reward experiment's candidates (texture_soft, ..., lines_phase, signed) are registered by
experiments/late_reward_world.py when it is imported."""

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
