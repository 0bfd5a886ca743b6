"""The tables of experiments/results/evidence-null/README.md, from this folder's JSON files:

python experiments/results/evidence-null/summarize.py        # -> experiments/results/evidence-null/table.md
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def load(name):
    path = HERE / name
    return json.loads(path.read_text()) if path.is_file() else None


def embedded_row(label, d):
    if d is None:
        return f"| {label} | not measured yet | | | |"
    if "per_seed" in d:  # the script's current format
        finals, off = d["final_departure_per_seed"], d["iterations_off_uniform_per_seed"]
        every = d["departure_over_all_iterations_p95"]
    else:  # its first version (one seed, main size): the same quantities from the per-iteration departures
        x = np.asarray(d["W_max_departure_per_iteration"])
        finals, off, every = [d["W_max_departure_final"]], [int((x > 1e-3).sum())], float(np.percentile(x, 95))
    its = d["iterations"]
    return (
        f"| {label} | {len(finals)} | {', '.join(f'{v:.3f}' for v in finals)} | "
        f"{', '.join(f'{v} of {its}' for v in off)} | {every:.3f} |"
    )


lines = [
    "## Embedded model: four pure-noise rewards through recast.py (`noise_W.py`)",
    "",
    "| size, evidence rule | seeds | final max abs(K T W / Lam - 1) per seed | iterations off uniform per seed | "
    "95th percentile over all iterations |",
    "|---|---|---|---|---|",
    embedded_row("main command (8 groups x 100 its), raw z (before)", load("embedded_main_before.json")),
    embedded_row("main command (8 groups x 100 its), t-scored z, each reward alone", load("embedded_main_t.json")),
    embedded_row("main command (8 groups x 100 its), t-scored z, family threshold", load("embedded_main.json")),
    embedded_row("recast-protocol (3 groups x 24 its), raw z (before)", load("embedded_protocol_before.json")),
    embedded_row(
        "recast-protocol (3 groups x 24 its), t-scored z, each reward alone", load("embedded_protocol_t.json")
    ),
    embedded_row("recast-protocol (3 groups x 24 its), t-scored z, family threshold", load("embedded_protocol.json")),
    "",
    "## Gaussian toy: the same rules through the shipped credit code (`toy_null.py`)",
    "",
    "| rewards, size, gain_ema, runs | rule | final: median / 95th pct / max | 95th pct over all iterations | "
    "iterations off uniform (mean) |",
    "|---|---|---|---|---|",
]
for name in ("toy_K2_check8c.json", "toy_K4_protocol.json", "toy_K4_main.json"):
    d = load(name)
    if d is None:
        continue
    size = f"K = {d['K']}, {d['prompts']} groups x {d['iterations']} its, {d['gain_ema']}, {d['reps']}"
    for rule, v in d["rules"].items():
        lines.append(
            f"| {size} | {rule} | {v['final_median']:.3f} / {v['final_p95']:.3f} / {v['final_max']:.3f} | "
            f"{v['all_iterations_p95']:.3f} | {v['iterations_off_uniform_mean']:.1f} of {d['iterations']} |"
        )
lines += [
    "",
    "## Gaussian toy, the power side: coarse vs fine reward, exact W known (`toy_null.py --signal`)",
    "",
    "| size, gain_ema, runs | rule | final mean abs(W - W*) / (lambda / T) | share of the way from uniform to exact |",
    "|---|---|---|---|",
]
for name in ("toy_signal_protocol.json", "toy_signal_8b.json"):
    d = load(name)
    if d is None:
        continue
    size = f"{d['prompts']} groups x {d['iterations']} its, {d['gain_ema']}, {d['reps']}"
    size += f" (uniform W: {d['uniform_W_error']:.3f})"
    for rule, v in d["rules"].items():
        lines.append(f"| {size} | {rule} | {v['error_mean']:.3f} | {v['share_of_the_way']:.3f} |")
(HERE / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
