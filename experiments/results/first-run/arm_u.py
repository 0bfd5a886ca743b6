"""Arm U's reading (README.md here, "Arm U"): M - U per seed on the held-out weighted change (budgets 0.4, 0.3, 0.2,
0.1 over geneval, grain, detail, shape), each noise set and their mean, and per reward; paired 95% t interval over the
seeds that both arms finished. Reads final/main-M-S.json and final/main-U-S.json only; writes arm_u.json.

    python experiments/results/first-run/arm_u.py
"""

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import stats  # noqa: E402

REWARDS, BUDGETS = ["geneval", "grain", "detail", "shape"], np.array([0.4, 0.3, 0.2, 0.1])


def weighted(scores):
    return float(BUDGETS @ [scores[r] for r in REWARDS] / BUDGETS.sum())


def main():
    seeds = [s for s in range(3) if all((HERE / "final" / f"main-{a}-{s}.json").is_file() for a in "MU")]
    read = {(a, s): json.loads((HERE / "final" / f"main-{a}-{s}.json").read_text()) for a in "MU" for s in seeds}
    out = {"seeds": seeds, "effect_that_matters": 0.01, "rows": {}}
    for key in ["weighted", *REWARDS]:
        for noise in ["1", "2", "mean"]:

            def value(a, s):
                sets = ["1", "2"] if noise == "mean" else [noise]
                return float(
                    np.mean([weighted(read[a, s][n]) if key == "weighted" else read[a, s][n][key] for n in sets])
                )

            diffs = [value("M", s) - value("U", s) for s in seeds]
            mean, lo, hi, _ = stats.mean_ci(diffs) if len(diffs) > 1 else (float(np.mean(diffs)), np.nan, np.nan, None)
            out["rows"][f"{key} (noise {noise})"] = {"per_seed": diffs, "mean": mean, "lo": lo, "hi": hi}
    (HERE / "arm_u.json").write_text(json.dumps(stats.rounded(out), indent=1) + "\n")
    for name, r in out["rows"].items():
        print(
            f"{name:<22} M - U {r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]  per seed {np.round(r['per_seed'], 4)}"
        )


if __name__ == "__main__":
    main()
