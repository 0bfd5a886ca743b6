"""When does each attribute become visible in x_t? An ideal observer on the shipped VAE's latents (issue 24).

    OMP_NUM_THREADS=1 python experiments/results/world-design/ideal_observer.py [--pairs 200] [--out FILE.json]

For each attribute, pairs of ground-truth images that differ in that attribute only (same seed: same layout,
fills and texture phase), encoded by the shipped VAE into the pipeline's latent scale, x = (z - shift) * scale.
Under the rectified-flow noising x_t = (1 - t) x + t eps, two known latents x_a, x_b are told apart from x_t with
the discriminability d'(t) = (1 - t) |x_a - x_b| / t (two Gaussians with common covariance t^2 I), so the attribute
becomes visible near the noise level t_d where d'(t_d) = d, t_d = |dx| / (d + |dx|). Known means make this a bound
on what any model can do (the model also has to guess the phase of a texture), so it is used for comparisons:
between attributes, against the measured profiles of the rebuilt world (share of D(0) decided, 192 groups per level,
`profiles192/profiles.json`), and between texture amplitudes, which is the design choice issue 24 leaves open
("texture is 0.6 decided at t = 0.465; target <= 0.3"). Lower amplitudes are rendered with the world's renderer,
encoded by the same VAE (trained on amplitude 0.3 with the Laplacian loss), and also decoded and read by the checker
with its thresholds scaled to the amplitude (does the attribute survive the VAE at that amplitude?).

Attributes: texture (a named texture vs plain, the same caption otherwise), orientation (striped vs barred),
colour (the first object's colour changed), shape (the first object's shape changed).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import world as sw  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--pairs", type=int, default=200)
ap.add_argument("--amps", default="0.3,0.2,0.15,0.1,0.075")
ap.add_argument("--out", default="experiments/results/world-design/ideal_observer.json")
a = ap.parse_args()

import torch  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402

torch.set_num_threads(1)
vae = AutoencoderKL.from_pretrained(str(sw.PIPELINE_DIR / "vae"), local_files_only=True).eval()
scale, shift = vae.config.scaling_factor, vae.config.shift_factor
rng = np.random.default_rng(0)
prompts = [p for p in sw.sample_prompts(4 * a.pairs, "train", seed=7) if "texture" in sw.parse_prompt(p)][: a.pairs]
seeds = [int(s) for s in rng.integers(0, 2**31, len(prompts))]
specs = [sw.parse_prompt(p) for p in prompts]


def latents(images):
    return ((sw.vae_encode(vae, images) - shift) * scale).flatten(1).double().numpy()


def distance(spec_pairs, amp=None):
    with sw.texture_amplitude(sw.TEXTURE["amp"] if amp is None else amp):
        ia = [sw.render_spec(s, seed) for (s, _), seed in zip(spec_pairs, seeds)]
        ib = [sw.render_spec(s, seed) for (_, s), seed in zip(spec_pairs, seeds)]
    return np.linalg.norm(latents(ia) - latents(ib), axis=1), ia


def changed(spec, key):
    s = dict(spec, objects=list(spec["objects"]))
    c, sh = s["objects"][0]
    if key == "colour":
        others = [k for k in sw.COLORS if k != c]
        s["objects"] = [(others[0], shape) if (col, shape) == (c, sh) else (col, shape) for col, shape in s["objects"]]
    elif key == "shape":
        others = [k for k in sw.SHAPES if k != sh]
        s["objects"] = [(col, others[0]) if (col, shape) == (c, sh) else (col, shape) for col, shape in s["objects"]]
    elif key == "plain":
        s.pop("texture")
    elif key == "orientation":
        s["texture"] = "barred" if s["texture"] == "striped" else "striped"
    return s


def t_at(dist, d):
    return dist / (d + dist)


def summary(dist):
    return {
        "median_distance": float(np.median(dist)),
        "t_at_d1": float(np.median(t_at(dist, 1.0))),
        "t_at_d2": float(np.median(t_at(dist, 2.0))),
        "t_at_d2_quartiles": [float(np.quantile(t_at(dist, 2.0), q)) for q in (0.25, 0.75)],
    }


def survives(images, amp):
    """Checker's texture verdict on VAE reconstructions, its thresholds at amplitude amp (they scale with
    sw.texture_contrast): the share of textured images read back as their texture."""
    rec = sw.vae_decode(vae, sw.vae_encode(vae, images))
    with sw.texture_amplitude(amp):
        gt = np.mean([sw.check(im, p)["texture"] for im, p in zip(images, prompts)])
        back = np.mean([sw.check(im, p)["texture"] for im, p in zip(rec, prompts)])
    return float(gt), float(back)


out = {"command": " ".join(["python", *sys.argv]), "pairs": len(prompts), "attributes": {}, "texture_by_amp": {}}
for key in ("colour", "shape"):
    dist, _ = distance([(s, changed(s, key)) for s in specs])
    out["attributes"][key] = summary(dist)
for amp in [float(x) for x in a.amps.split(",")]:
    dist, imgs = distance([(s, changed(s, "plain")) for s in specs], amp)
    dist_o, _ = distance([(s, changed(s, "orientation")) for s in specs], amp)
    gt, back = survives(imgs, amp)
    out["texture_by_amp"][f"{amp:g}"] = {
        "texture_vs_plain": summary(dist),
        "striped_vs_barred": summary(dist_o),
        "checker_on_ground_truth": gt,
        "checker_on_vae_reconstructions": back,
    }
    print(amp, out["texture_by_amp"][f"{amp:g}"], flush=True)

prof = json.loads((Path(__file__).parent / "profiles192" / "profiles.json").read_text())
sig, D = np.asarray(prof["sigmas"]), np.asarray(prof["D"])
out["measured_t_half"] = {}  # the noise level where half of D(0) is decided (linear between measured levels)
for name in ("colour", "shape", "texture", "saturation", "geneval"):
    share = D[prof["names"].index(name)] / D[prof["names"].index(name)][-1]
    k = next(j for j in range(1, len(share)) if share[j] >= 0.5)
    f = (0.5 - share[k - 1]) / (share[k] - share[k - 1])
    out["measured_t_half"][name] = float(sig[k - 1] + f * (sig[k] - sig[k - 1]))
# One threshold d* fitted to texture at the shipped amplitude (its measured t_half), the same d* for every amplitude:
# texture's median distance scales with the amplitude, so t_half(amp) = |dx(amp)| / (d* + |dx(amp)|) predicts where
# a rebuilt world at that amplitude would have half of texture's D(0) decided (a model, not a measurement).
dist03 = out["texture_by_amp"][f"{sw.TEXTURE['amp']:g}"]["texture_vs_plain"]["median_distance"]
t_half = out["measured_t_half"]["texture"]
d_star = dist03 * (1 - t_half) / t_half
out["texture_t_half_predicted"] = {"d_star": d_star}
for amp, v in out["texture_by_amp"].items():
    dist = v["texture_vs_plain"]["median_distance"]
    out["texture_t_half_predicted"][amp] = dist / (d_star + dist)
for key in ("colour", "shape"):  # the same fitted d* applied to them: how far one threshold explains the others
    dist = out["attributes"][key]["median_distance"]
    out["texture_t_half_predicted"][f"{key} (same d*)"] = dist / (d_star + dist)
print(json.dumps(out, indent=1))
Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
