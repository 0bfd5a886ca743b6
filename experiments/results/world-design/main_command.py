"""The main command's credit at its end, from its metrics.jsonl (issue 24, step 4):

    python experiments/results/world-design/main_command.py RUN_DIR [--late texture] [--out FILE.json]

Reads the last line of RUN_DIR/metrics.jsonl: W (recast/W), its departure from uniform max |K T W / Lam - 1|
(= max_kj |W_kj / (lambda_k / T) - 1|), the evidence rho per reward, the discounted level counts (recast/level_n),
the late reward's W over the last three sampler steps against its uniform share, the pretrained model's held-out
evaluation (eval_before/*, logged with iteration 0) as "eval_before", eval/* at the first in-run and the last
evaluation, and the mean per-iteration times (time/*) over all iterations.
"""

import argparse
import json
from pathlib import Path

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("run")
ap.add_argument("--late", default="texture")
ap.add_argument("--out", default="")
a = ap.parse_args()
run = Path(a.run)
lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
cfg = json.loads((run / "config.json").read_text())
last = lines[-1]
names = cfg["rewards"]
W = np.asarray(last["recast/W"])
K, T = W.shape
ratio = W / (W.sum(1, keepdims=True) / T)
out = {
    "run": str(run),
    "iterations": len(lines),
    "names": names,
    "W_max_departure": float(np.abs(ratio - 1).max()),
    "W_ratio": ratio.round(3).tolist(),
    "evidence": last["recast/evidence"],
    "level_n": last["recast/level_n"],
    "time_mean": {k: float(np.mean([m[k] for m in lines if k in m])) for k in last if k.startswith("time/")},
    "time_total_s": float(sum(sum(m[k] for k in m if k.startswith("time/")) for m in lines)),
}
evals = [m for m in lines if "eval/weighted" in m]
before = {k.replace("eval_before/", "eval/"): v for k, v in lines[0].items() if k.startswith("eval_before/")}
if before:
    out["eval_before"] = before  # the pretrained model: the "before" of a before -> after
if evals:
    out["eval_first"] = {k: v for k, v in evals[0].items() if k.startswith("eval/")}
    out["eval_last"] = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
if names and a.late in names:
    k = names.index(a.late)
    out["late"] = a.late
    out["late_last3_vs_uniform"] = float(W[k, -3:].sum() / (W[k].sum() * 3 / T))
print(json.dumps(out, indent=1))
if a.out:
    Path(a.out).write_text(json.dumps(out, indent=1))
