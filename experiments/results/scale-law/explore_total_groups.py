"""EXPLORATORY, written after the dose-response was read (not in PLAN.md): does the toy's late-credit advantage follow
the groups a run has seen, M x iterations, rather than the groups per update M?

    python experiments/results/scale-law/explore_total_groups.py   # -> explore_total_groups.md, .png

No new runs. The toy's runs are deterministic per seed and their schedule does not depend on the run's length (constant
learning rate, `nft.old_decay` by iteration), so a run read up to iteration I is the run of length I. For every size M
and I in 5, 10, 15, 20, 30, 40, 60 the primary of PLAN.md is recomputed on the runs cut at I: exact - uniform at equal
KL (0.5 x uniform's median KL at I), paired over the 64 seeds, as a share of uniform's gain there. Then the shares are
set against M s and M I s (s = the fine reward's s at t = 0.25 from measure.json). No test decides anything here: the
intervals are per cell (95% t), uncorrected, and the reading is a hypothesis for a planned experiment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE))

from kit.stats import mean_ci  # noqa: E402
from summarize import at_level, read_runs  # noqa: E402

from experiments import toy_train as tt  # noqa: E402

CUTS = (5, 10, 15, 20, 30, 40, 60)


def main():
    records = read_runs(HERE / "toy" / "runs.csv")
    measure = json.loads((HERE / "measure.json").read_text())
    s = next(
        r["s"]
        for r in measure["rows"]
        if r["model"] == "toy" and r["reward"] == "fine" and r["space"] == "params" and abs(r["t"] - 0.25) < 1e-6
    )
    sizes = sorted({r["groups"] for r in records})
    cells = []
    for M in sizes:
        for cut in CUTS:
            sub = [r for r in records if r["groups"] == M and r["iteration"] <= cut]
            at, level, ug = at_level(sub, M)
            seeds = sorted(set(at["exact"]) & set(at["uniform"]))
            m, lo, hi, n = mean_ci([(at["exact"][x] - at["uniform"][x]) / ug for x in seeds])
            cells.append(dict(groups=M, iterations=cut, Ms=M * s, MIs=M * cut * s, share=m, lo=lo, hi=hi, n=n))
    L = [
        "# EXPLORATORY: the toy's late-credit advantage against groups per update and groups per run",
        "",
        "Written after the dose-response was read; not in PLAN.md (`explore_total_groups.py`, from toy/runs.csv only).",
        f"s = {s:.4f} (the fine reward at t = 0.25, parameters). exact - uniform at equal KL (0.5 x uniform's median KL at",
        "the cut), share of uniform's gain there, mean [95% t] over the seeds, uncorrected.",
        "",
    ]
    L += tt.table_header("M", "iterations", "M s", "M x iterations x s", "exact - uniform", "n")
    for c in cells:
        L.append(
            f"| {c['groups']} | {c['iterations']} | {c['Ms']:.2f} | {c['MIs']:.1f} | "
            f"{100 * c['share']:+.2f}% [{100 * c['lo']:+.2f}, {100 * c['hi']:+.2f}] | {c['n']} |"
        )
    (HERE / "explore_total_groups.md").write_text("\n".join(L) + "\n")
    (HERE / "explore_total_groups.json").write_text(json.dumps(dict(s=s, cells=cells), indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, lab in ((axes[0], "Ms", "M s (per update)"), (axes[1], "MIs", "M x iterations x s (per run)")):
        for M in sizes:
            cs = [c for c in cells if c["groups"] == M]
            x = np.array([c[key] for c in cs])
            y = np.array([c["share"] for c in cs]) * 100
            e = np.array([[c["share"] - c["lo"], c["hi"] - c["share"]] for c in cs]).T * 100
            ax.errorbar(x * (1 + 0.02 * sizes.index(M)), y, yerr=e, marker="o", ms=3, capsize=2, label=f"M = {M}")
        ax.set_xscale("log"), ax.axvline(1, color="tab:purple", lw=1), ax.axhline(0, color="grey", lw=0.6)
        ax.set_xlabel(lab)
    axes[0].set_ylabel("exact - uniform at equal KL, % of uniform's gain")
    axes[0].set_title("points of one M: iterations 5 ... 60 (same M s)", fontsize=8)
    axes[1].set_title("EXPLORATORY (after the plan's result)", fontsize=8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "explore_total_groups.png", dpi=110)
    print((HERE / "explore_total_groups.md").read_text())


if __name__ == "__main__":
    main()
