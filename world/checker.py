"""The shapes world's checker: colour segmentation, connected components and a shape test per object, the texture
read from each object's inner pixels, and :func:`check`, a GenEval-like check of one image against its prompt (what
the world's rewards read). numpy, scipy and PIL only; every image is box-resized to RES x RES first.
"""

from __future__ import annotations

import contextlib

import numpy as np
from PIL import Image

from world.grammar import COLORS, HUE, RES, TEXTURE, _hue_deg, parse_prompt

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
    (sqrt(2) / 2) amp / (1 - amp / 2) = sqrt(2) texture_contrast() (the unit of the line rewards of
    experiments/late_reward_world.py); a flat fill 0.
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


def foreground(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1 and 2 of :func:`detect` on a (RES, RES, 3) float image: (fg, nearest), the foreground mask and each
    pixel's palette colour of nearest hue (an index into COLORS)."""
    chroma, hue = a.max(-1) - a.min(-1), _hue_deg(a)
    dist = np.stack([np.abs((hue - HUE[c] + 180) % 360 - 180) for c in COLORS], -1)
    nearest = dist.argmin(-1)
    return (chroma > 30) & (chroma > 0.5 * CHROMA[nearest]), nearest


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
    fg, nearest = foreground(a)
    names = list(COLORS)
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
