"""Pure-noise rewards on the embedded model keep W uniform (issue 24, "must hold"):

    OMP_NUM_THREADS=1 python results/world-design/noise_W.py [--iterations 100] [--out results/world-design/noise_W.json]

The main command (`recast.py --budgets 0.4,0.3,0.2,0.1`, every default: tree, --gain-ema 0.999, 100 iterations)
with its four rewards replaced by four pure-noise rewards: each image's value is a standard normal draw that does
not depend on the image (a generator seeded once, so the run is reproducible). No level can discriminate such a
reward, so every measured gain is noise, the evidence test must find none and W must stay at its uniform
lambda_k / T. Written: the departure max |K T W / Lam - 1| and the evidence of every iteration, and their maxima.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import recast  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--iterations", type=int, default=100)
ap.add_argument("--out", default="results/world-design/noise_W.json")
ap.add_argument("--run", default="runs/noise-W")
a = ap.parse_args()

rng = np.random.default_rng(20261201)
NAMES = ["noise1", "noise2", "noise3", "noise4"]
noise = {name: (lambda images, prompts: rng.standard_normal(len(images))) for name in NAMES}
args = recast.parse_args(
    ["--rewards", ",".join(NAMES), "--budgets", "0.4,0.3,0.2,0.1", "--iterations", str(a.iterations)]
    + ["--eval-every", "0", "--out", a.run, "--overwrite"]
)
recast.train(args, extra_rewards=noise, judges={})
rows = [json.loads(line) for line in (Path(a.run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
W = [np.asarray(m["recast/W"]) for m in rows]
departure = [float(np.abs(w / (w.sum(1, keepdims=True) / w.shape[1]) - 1).max()) for w in W]
out = {
    "command": " ".join(["python", *sys.argv]),
    "iterations": len(rows),
    "W_max_departure_per_iteration": departure,
    "W_max_departure_max": max(departure),
    "W_max_departure_final": departure[-1],
    "evidence_final": rows[-1]["recast/evidence"],
    "evidence_max": float(max(max(m["recast/evidence"]) for m in rows)),
    "level_n_final": rows[-1]["recast/level_n"],
}
print(json.dumps({k: v for k, v in out.items() if k != "W_max_departure_per_iteration"}, indent=1))
Path(a.out).write_text(json.dumps(out, indent=1))
