"""The first run confirmed out of sample (README.md here, "Confirmation"): the main command at fresh seeds (3, 4, 5),
evaluated with the pretrained model on fresh noise sets (FRESH: noise seeds no earlier evaluation here used), on every
held-out caption x 8 noises as `first_run.py eval` does; then the reading the plan names.

    OMP_NUM_THREADS=1 python experiments/results/first-run/confirm.py eval RUN [RUN ...]  # confirm/<run>.json
    python experiments/results/first-run/confirm.py read                                 # confirm.json

eval caches nothing but the per-model files in confirm/ (scores per noise set, the run's settings, its checkpoint)
and the run's metrics.jsonl beside them (confirm/<run>.jsonl.gz); read needs no run folder.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE))
import first_run  # noqa: E402
from arm_u import weighted  # noqa: E402  (budgets 0.4, 0.3, 0.2, 0.1 over geneval, grain, detail, shape)

from experiments import stats  # noqa: E402

FRESH = (3, 4)  # first_run.py's evaluations used protocol.EVAL_SEEDS = (1, 2)
SEEDS = (3, 4, 5)  # first-run's arms trained seeds 0-2 (and kernel runs of seed 0)
EFFECT = 0.01  # the effect that matters, as arm U's: a quarter of the in-sample +0.038
REWARDS = ("geneval", "grain", "detail", "shape")


def evaluate(runs):
    """`first_run.evaluate` at the fresh noise seeds, into confirm/ (each model's scores and each run's metrics)."""
    first_run.evaluate(runs, FRESH, HERE / "confirm", HERE / "confirm")


def welch(a, b):
    """Mean difference a - b of two independent sets of seeds, with Welch's 95% interval and p (scipy)."""
    from scipy import stats as st

    res = st.ttest_ind(a, b, equal_var=False)
    lo, hi = res.confidence_interval(0.95)
    return {"mean": float(np.mean(a) - np.mean(b)), "lo": float(lo), "hi": float(hi), "p": float(res.pvalue)}


def read():
    folder = HERE / "confirm"
    base = json.loads((folder / "pretrained.json").read_text())
    labels = [f"confirm-M-{s}" for s in SEEDS]
    done = [x for x in labels if (folder / f"{x}.json").is_file()]
    runs = {x: json.loads((folder / f"{x}.json").read_text()) for x in done}

    def value(scores, key):
        return weighted(scores) if key == "weighted" else scores[key]

    out = {"seeds": [int(x.rsplit("-", 1)[1]) for x in done], "not_finished": sorted(set(labels) - set(done))}
    out |= {"noise_seeds": list(FRESH), "effect_that_matters": EFFECT, "rows": {}}
    for key in ["weighted", *REWARDS, "judge/cnn"]:
        for noise in [*map(str, FRESH), "mean"]:
            sets = list(map(str, FRESH)) if noise == "mean" else [noise]
            diffs = [float(np.mean([value(runs[x][n], key) - value(base[n], key) for n in sets])) for x in done]
            mean, lo, hi, _ = stats.mean_ci(diffs)
            out["rows"][f"{key} (noise {noise})"] = {"per_seed": diffs, "mean": mean, "lo": lo, "hi": hi}
    # in sample: arm M's seeds 0-2 on the noise sets the defaults were chosen on (final/, first_run.py eval)
    insample = []
    for s in range(3):
        m, p = (json.loads((HERE / "final" / f"{x}.json").read_text()) for x in (f"main-M-{s}", "pretrained"))
        insample.append(float(np.mean([weighted(m[n]) - weighted(p[n]) for n in ("1", "2")])))
    fresh = out["rows"]["weighted (noise mean)"]["per_seed"]
    out["in_sample"] = {"per_seed": insample, "mean": float(np.mean(insample))}
    out["fresh_minus_in_sample"] = welch(fresh, insample)
    r = out["rows"]["weighted (noise mean)"]
    verdict = (
        "confirmed"
        if r["lo"] > EFFECT
        else "not confirmed (a gain of 0.01 excluded)"
        if r["hi"] < EFFECT
        else "not shown at this size"
    )
    out["verdict"] = verdict
    (HERE / "confirm.json").write_text(json.dumps(stats.rounded(out), indent=1) + "\n")
    for name, row in out["rows"].items():
        print(
            f"{name:<24} {row['mean']:+.4f} [{row['lo']:+.4f}, {row['hi']:+.4f}]  per seed {np.round(row['per_seed'], 4)}"
        )
    print(f"in sample (seeds 0-2, noise sets 1-2): {np.mean(insample):+.4f}; verdict: {verdict}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["eval", "read"])
    ap.add_argument("runs", nargs="*")
    a = ap.parse_args(argv)
    evaluate(a.runs) if a.part == "eval" else read()


if __name__ == "__main__":
    main()
