"""The texture amplitudes built in full, side by side (issue 24, step 2): which one the world ships.

    python experiments/results/world-design/candidates.py        # -> candidates/candidates.md

Each folder candidates/amp<A>/ holds one full build's files: build_metrics.json, eval_metrics.json and
pref_judge.json (`python -m world.build build`, `pref-judge`, `eval` with TEXTURE["amp"] = A) and profiles.json
(`python experiments/results/world-design/profiles_pretrained.py 96` on that build: 96 groups per inner level).
amp0.3 is the
world of commit 29c9cab (the first textured one, profiles at 96 groups); amp0.1_vae0.1 and amp0.075_vae0.075 were
built at commit 296931d with the VAE trained on their own amplitude (only build_metrics.json: they failed before
their evaluation); amp0.1_vae0.3 is the shipped world (commit 6451545, profiles at 192 groups).
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent / "candidates"
LEVELS = (0.790, 0.602, 0.465, 0.278)  # the inner levels the targets and the README talk about
REWARDS = ("saturation", "geneval", "texture", "grain")


def share(prof, name, t):
    """(share of D(0) decided at the level nearest t, its se), both / D(0)."""
    k, j = prof["names"].index(name), int(np.argmin(np.abs(np.asarray(prof["sigmas"]) - t)))
    D, se = np.asarray(prof["D"])[k], np.asarray(prof["se"])[k]
    return D[j] / D[-1], se[j] / D[-1]


def column(folder):
    if not (folder / "eval_metrics.json").is_file():  # a build that failed before its evaluation: its own metrics
        b = json.loads((folder / "build_metrics.json").read_text())
        return {
            "VAE PSNR (dB)": f"{b['vae_psnr']:.2f}",
            "texture on VAE reconstructions: named / plain": (
                f"{b['vae_texture_named']:.3f} / {b['vae_texture_plain']:.3f}"
            ),
            "pretrained texture (0/1) mean": f"{b['gen_texture_mean']:.3f} (first thresholds)",
            "  per caption: plain / striped / barred": " / ".join(
                f"{b[f'gen_texture_{t}']:.3f}" for t in ("plain", "striped", "barred")
            ),
        }
    b, e, p, prof = (
        json.loads((folder / f).read_text())
        for f in ("build_metrics.json", "eval_metrics.json", "pref_judge.json", "profiles.json")
    )
    rows = {
        "build minutes (one thread)": f"{b['build_minutes']:.1f}",
        "VAE PSNR (dB)": f"{e['vae_psnr']:.2f}",
        "checker strict on ground truth / VAE": f"{e['checker_gt_strict']:.3f} / {e['checker_vae_strict']:.3f}",
        "texture on VAE reconstructions: named / plain": f"{e['vae_texture_named']:.3f} / {e['vae_texture_plain']:.3f}",
        "pretrained geneval_strict (512 held-out)": f"{e['gen_strict']:.3f}",
        "pretrained texture (0/1) mean": f"{e['gen_texture_mean']:.3f}",
        "  per caption: plain / striped / barred": " / ".join(
            f"{e[f'gen_texture_{t}']:.3f}" for t in ("plain", "striped", "barred")
        ),
        "pretrained grain mean": f"{e['gen_grain_mean']:.3f}",
        "CNN judge on generated": f"{e['gen_judge_cnn']:.3f}",
        "preference judge, held-out pairs": f"{p['pref_heldout_pair_accuracy']:.3f}",
        "profile groups per inner level": f"{int(np.asarray(prof['n'])[1])}",
    }
    for name in REWARDS:
        for t in LEVELS:
            m, s = share(prof, name, t)
            rows[f"{name}: share of D(0) decided at t ~ {t:.2f}"] = f"{m:.2f} ± {s:.2f}"
    return rows


folders = sorted((f for f in HERE.glob("amp*") if f.is_dir()), key=lambda f: -float(f.name[3:].split("_")[0]))
cols = {f.name[3:].replace("_", ", ").replace("vae", "VAE trained at "): column(f) for f in folders}
keys = list(max(cols.values(), key=len))
lines = [
    "# Texture amplitude candidates, each built in full",
    "",
    "From `python experiments/results/world-design/candidates.py`. 'First thresholds': TEX_PLAIN 0.45, TEX_FULL 0.8,",
    "TEX_ANISO 2.5 (the builds that failed before their evaluation); amp 0.3 used its own thresholds of the time",
    "(0.06 and 0.14 absolute, TEX_ANISO 2.5); the shipped amp 0.1 uses 0.6, 0.6, 1.6 (thresholds.txt).",
    "",
    "| measured | " + " | ".join(f"amp {a}" for a in cols) + " |",
    "|---" * (1 + len(cols)) + "|",
]
lines += [f"| {k} | " + " | ".join(c.get(k, "") for c in cols.values()) + " |" for k in keys]
(HERE / "candidates.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
