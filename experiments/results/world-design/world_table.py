"""The rebuilt world's numbers as a markdown table, from the files its commands write (issue 24, step 3):
assets/build_metrics.json (`python -m world.build build`), assets/pref_judge.json (`python -m world.build
pref-judge`), assets/eval_metrics.json (`python -m world.build eval`). Writes experiments/results/world-design/world.md.

    python experiments/results/world-design/world_table.py
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parents[2] / "assets"
b = json.loads((ASSETS / "build_metrics.json").read_text())
p = json.loads((ASSETS / "pref_judge.json").read_text())
e = json.loads((ASSETS / "eval_metrics.json").read_text())


def f(x, d=3):
    return "n/a" if x is None else f"{x:.{d}f}"


rows = [
    ("build: minutes on one thread (config)", f"{b['build_minutes']:.1f} ({b['config']})"),
    (
        "checker strict on ground truth / on VAE reconstructions",
        f"{f(e['checker_gt_strict'])} / {f(e['checker_vae_strict'])}",
    ),
    ("VAE PSNR (dB)", f(e["vae_psnr"], 2)),
    (
        "texture verdict on ground truth: named / plain captions",
        f"{f(e['gt_texture_named'])} / {f(e['gt_texture_plain'])}",
    ),
    (
        "texture verdict on VAE reconstructions: named / plain captions",
        f"{f(e['vae_texture_named'])} / {f(e['vae_texture_plain'])}",
    ),
    ("grain on ground truth / VAE reconstructions (mean)", f"{f(e['gt_grain_mean'])} / {f(e['vae_grain_mean'])}"),
    (
        f"pretrained, {e['eval_n']} {e['eval_split']} prompts: strict / partial",
        f"{f(e['gen_strict'])} / {f(e['gen_partial'])}",
    ),
    (
        "pretrained strict per template: single / position / two / three / pair",
        " / ".join(f(e[f"gen_strict_{t}"]) for t in ("single", "position", "two", "three", "pair")),
    ),
    (
        "pretrained texture (0/1 reward) mean; per caption texture plain / striped / barred",
        f"{f(e['gen_texture_mean'])}; " + " / ".join(f(e[f"gen_texture_{t}"]) for t in ("plain", "striped", "barred")),
    ),
    ("pretrained grain / saturation mean", f"{f(e['gen_grain_mean'])} / {f(e['gen_saturation_mean'])}"),
    (
        "CNN judge on ground truth / VAE / generated",
        f"{f(e['judge_gt'])} / {f(e['judge_vae'])} / {f(e['gen_judge_cnn'])}",
    ),
    (
        "Fréchet (judge features) ground truth / VAE / generated",
        f"{f(e['fd_gt'], 1)} / {f(e['fd_vae'], 1)} / {f(e['gen_frechet'], 1)}",
    ),
    ("preference judge: accuracy on 1,000 held-out-caption pairs", f(p["pref_heldout_pair_accuracy"])),
    ("reload with a fixed generator gives identical pixels", str(e["reload_identical"])),
]
lines = ["| measured (assets/eval_metrics.json unless said) | value |", "|---|---|"]
lines += [f"| {k} | {v} |" for k, v in rows]
(HERE / "world.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
