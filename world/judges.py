"""The shapes world's held-out judges, never trained on: the CNN judge (JUDGES["cnn"]: count, colours, shapes,
texture), the Fréchet distance in its feature space (frechet_distance), and the pairwise preference judge
(judge_preference, a Bradley-Terry stand-in for an LLM judge) with the pairs it learns from. Their weights are in
world/assets/ (world/build.py trains them). torch is imported inside the functions that need it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from world.checker import _as_array
from world.grammar import COLORS, RES, SHAPES, TEXTURES, parse_prompt, render, render_spec, sample_prompts
from world.pipeline import JUDGE_PATH, PREF_PATH, _images_to_tensor


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
