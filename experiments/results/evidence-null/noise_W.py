"""Pure-noise rewards on the embedded model: how far W moves when no reward can be told apart (issue 24, "must hold").

    # the main command's size -> embedded_main.json
    OMP_NUM_THREADS=1 python experiments/results/evidence-null/noise_W.py
    OMP_NUM_THREADS=1 python experiments/results/evidence-null/noise_W.py \
        --iterations 24 --prompts-per-iter 3 --seeds 5 \
        --out experiments/results/evidence-null/embedded_protocol.json              # recast-protocol's size, 5 seeds

The main command (`recast.py --budgets 0.4,0.3,0.2,0.1`, every default: tree, --gain-ema 0.999, 100 iterations x 8
prompt groups) with its four rewards replaced by four pure-noise rewards: each image's value is a standard normal
draw that does not depend on the image (one generator per run, seeded by the run's seed, so a run is reproducible).
No level can discriminate such a reward, so every measured gain is noise; the evidence test should find none and W
stay at its uniform lambda_k / T. Written per seed: the departure max |K T W / Lam - 1| and the evidence at every
iteration; over seeds: the final departures and how many iterations were off uniform.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import recast  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--iterations", type=int, default=100)
ap.add_argument("--prompts-per-iter", type=int, default=recast.Args().prompts_per_iter)
ap.add_argument("--seeds", type=int, default=1)
ap.add_argument("--out", default="experiments/results/evidence-null/embedded_main.json")
ap.add_argument("--run", default="runs/noise-W")
a = ap.parse_args()

NAMES = ["noise1", "noise2", "noise3", "noise4"]
per_seed = []
for seed in range(a.seeds):
    rng = np.random.default_rng(20261201 + seed)
    noise = {name: (lambda images, prompts: rng.standard_normal(len(images))) for name in NAMES}
    args = recast.parse_args(
        ["--rewards", ",".join(NAMES), "--budgets", "0.4,0.3,0.2,0.1", "--iterations", str(a.iterations)]
        + ["--prompts-per-iter", str(a.prompts_per_iter), "--seed", str(seed)]
        + ["--eval-every", "0", "--out", a.run, "--overwrite"]
    )
    recast.train(args, extra_rewards=noise, judges={})
    rows = [json.loads(line) for line in (Path(a.run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    W = [np.asarray(m["recast/W"]) for m in rows]
    departure = [float(np.abs(w / (w.sum(1, keepdims=True) / w.shape[1]) - 1).max()) for w in W]
    per_seed.append(
        {
            "seed": seed,
            "W_max_departure_per_iteration": departure,
            "W_max_departure_max": max(departure),
            "W_max_departure_final": departure[-1],
            "iterations_off_uniform": int(sum(d > 1e-3 for d in departure)),
            "last_iteration_off_uniform": max((i for i, d in enumerate(departure) if d > 1e-3), default=None),
            "evidence_final": rows[-1]["recast/evidence"],
            "evidence_max": float(max(max(m["recast/evidence"]) for m in rows)),
            "level_n_final": rows[-1]["recast/level_n"],
        }
    )
every = np.concatenate([s["W_max_departure_per_iteration"] for s in per_seed])
out = {
    "command": " ".join(["python", *sys.argv]),
    "iterations": a.iterations,
    "prompts_per_iter": a.prompts_per_iter,
    "seeds": a.seeds,
    "final_departure_per_seed": [s["W_max_departure_final"] for s in per_seed],
    "iterations_off_uniform_per_seed": [s["iterations_off_uniform"] for s in per_seed],
    "departure_over_all_iterations_p95": float(np.percentile(every, 95)),
    "departure_over_all_iterations_max": float(every.max()),
    "per_seed": per_seed,
}
print(json.dumps({k: v for k, v in out.items() if k != "per_seed"}, indent=1))
Path(a.out).write_text(json.dumps(out, indent=1))
