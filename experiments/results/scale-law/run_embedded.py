"""The embedded dose-response of PLAN.md part 2: grain's late-only against early-only step weights at 8 and 32 groups
per update, 40 iterations, paired seeds; each run's final checkpoint scored on held-out grain by
../late-reward/final_eval.py.

    nohup nice -n 19 python experiments/results/scale-law/run_embedded.py run --seeds 10 \
        > experiments/results/scale-law/run_embedded.log 2>&1 &        # restartable
    python experiments/results/scale-law/run_embedded.py read            # -> embedded/reading.md, summary.json

Seeds run one at a time, each seed's four runs (two arms x two sizes) before the next seed's, the two arms of a size
side by side (one thread each). A finished run (trained and evaluated) is one row of embedded/runs.csv; a restart
skips those and resumes an unfinished run from its last checkpoint (recast.py --resume).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
from experiments.protocol import EVAL_SEEDS as NOISE_SEEDS  # noqa: E402
from kit.checkpoints import checkpoint_dir  # noqa: E402

ARMS = ("late", "early")
SIZES = (8, 32)
ITERATIONS = 40
NOISES = 8  # final_eval's noises per held-out caption
EVAL_SEEDS = tuple(str(s) for s in NOISE_SEEDS)  # final_eval's keys for the two evaluation seeds
PLANNED = 10  # seeds (PLAN.md part 2)
OUT = HERE / "embedded"
WORK = HERE / "work" / "embedded"
FIELDS = ("seed", "groups", "arm", "grain_eval1", "grain_eval2", "judge_eval1", "judge_eval2", "wall_s")
EFFECT = 0.0166  # PLAN.md part 2: two noise floors of one evaluation (2 x 0.0083)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one thread per run, two runs side by side
W_FILE = {arm: ROOT / "experiments" / "results" / "late-reward" / f"grain_part3_W_{arm}.json" for arm in ARMS}


def name(arm, groups, seed):
    return f"{arm}-M{groups}-{seed}"


def last_checkpoint(arm, groups, seed):
    """The run's folder and its final state.pt (iteration ITERATIONS - 1)."""
    run = WORK / "runs" / name(arm, groups, seed)
    return run, checkpoint_dir(run, ITERATIONS - 1) / "state.pt"


def finished():
    """{(seed, groups, arm)} already in runs.csv."""
    path = OUT / "runs.csv"
    if not path.is_file():
        return set()
    with open(path) as f:
        return {(int(r["seed"]), int(r["groups"]), r["arm"]) for r in csv.DictReader(f)}


def train(arm, groups, seed):
    """recast.py to its last checkpoint (resumed in place when an earlier attempt stopped part way)."""
    run, last = last_checkpoint(arm, groups, seed)
    if last.is_file():
        return run
    if (run / "checkpoints" / "latest").is_file():
        cmd = ["--resume", str(run)]
    else:
        cmd = [
            "--rewards", "grain", "--budgets", "1", "--credit", "file", "--credit-file", str(W_FILE[arm]),
            "--base-reg", "1e-4", "--iterations", str(ITERATIONS), "--eval-every", "0", "--seed", str(seed),
            "--prompts-per-iter", str(groups), "--out", str(run), "--overwrite",
        ]  # fmt: skip
    log = WORK / "logs" / f"{name(arm, groups, seed)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        subprocess.run(
            [sys.executable, str(ROOT / "recast.py"), *cmd], cwd=ROOT, env=ENV, stdout=f, stderr=f, check=True
        )
    if not last.is_file():
        raise SystemExit(f"{run}: no checkpoint at iteration {ITERATIONS - 1} after training (see {log})")
    return run


def evaluate(run, lock):
    """final_eval.py on the run's last checkpoint -> {eval seed: (grain mean, judge mean)}. The first evaluation
    holds `lock` until the pretrained model's images are cached, so the two workers never both compute them."""
    out = WORK / "evals" / f"{run.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, str(HERE.parent / "late-reward" / "final_eval.py"), "--reward", "grain", "--scores", "grain",
        "--noises", str(NOISES), "--runs", str(run), "--cache", str(WORK / "cache"), "--out", str(out),
    ]  # fmt: skip
    cached = (WORK / "cache" / f"pretrained-n{NOISES}.json").is_file()
    with open(WORK / "logs" / f"{run.name}.log", "a") as f, contextlib.nullcontext() if cached else lock:
        subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=f, check=True)
    means = json.loads(out.read_text())["means"][run.name]
    return {s: (means[s]["grain"], means[s]["judge/cnn"]) for s in EVAL_SEEDS}


def run_all(seeds):
    OUT.mkdir(parents=True, exist_ok=True)
    lock, write = threading.Lock(), threading.Lock()
    done = finished()

    def one(job):
        seed, groups, arm = job
        t0 = time.time()
        run = train(arm, groups, seed)
        ev = evaluate(run, lock)
        row = dict(seed=seed, groups=groups, arm=arm, wall_s=round(time.time() - t0, 1))
        for i, s in enumerate(EVAL_SEEDS, 1):
            row[f"grain_eval{i}"], row[f"judge_eval{i}"] = ev[s]
        with write:
            path = OUT / "runs.csv"
            new = not path.is_file()
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    w.writeheader()
                w.writerow(row)
        print(f"{time.strftime('%H:%M:%S')} {name(arm, groups, seed)} {row}", flush=True)

    with ThreadPoolExecutor(2) as pool:
        for seed in range(seeds):
            for groups in SIZES:  # the two arms of one size side by side; the next size after both finish
                jobs = [(seed, groups, arm) for arm in ARMS if (seed, groups, arm) not in done]
                for future in [pool.submit(one, job) for job in jobs]:
                    future.result()


def fmt(m, lo, hi, p, digits=4):
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] p {p:.2g}"


def read():
    """PLAN.md part 2's reading over the seeds whose four runs are finished."""
    from experiments import stats

    with open(OUT / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    value = {}  # (seed, groups, arm) -> {"both": ..., "1": ..., "2": ...}
    for r in rows:
        g1, g2 = float(r["grain_eval1"]), float(r["grain_eval2"])
        value[(int(r["seed"]), int(r["groups"]), r["arm"])] = {"both": (g1 + g2) / 2, "1": g1, "2": g2}
    seeds = sorted({s for s, _, _ in value if all((s, g, a) in value for g in SIZES for a in ARMS)})
    k = len(seeds)
    out = {"seeds": seeds, "effect": EFFECT, "tests": {}, "per_eval_seed": {}, "per_arm": {}}
    lines = [
        "# The embedded dose-response (PLAN.md part 2): late - early on held-out grain, paired by seed",
        "",
        f"{k} of {PLANNED} planned seeds finished ({seeds}); each run's value its mean grain over every held-out caption x "
        f"{NOISES} noises, averaged over the two evaluation seeds. Generated by `run_embedded.py read` from "
        "`runs.csv`.",
        "",
        "| test | mean [95% t] p | exact p | Holm p (3) | sd | N80 at the observed sd |",
        "|---|---|---|---|---|---|",
    ]
    if k < 2:
        (OUT / "reading.md").write_text("\n".join(lines[:3]) + "\n")
        return

    def diffs(groups, key="both"):
        return np.array([value[(s, groups, "late")][key] - value[(s, groups, "early")][key] for s in seeds])

    tests = {"late - early, M = 8": diffs(8), "late - early, M = 32": diffs(32)}
    tests["interaction (M = 32 minus M = 8)"] = tests["late - early, M = 32"] - tests["late - early, M = 8"]
    ps = []
    for label, y in tests.items():
        m, lo, hi, n = stats.mean_ci(y)
        ps.append(stats.p_value(m, lo, hi, n))
        out["tests"][label] = dict(mean=m, lo=lo, hi=hi, n=n, p=ps[-1], exact=stats.sign_flip_p(y),
                                   sd=float(np.std(y, ddof=1)), per_seed=y.tolist())  # fmt: skip
    for (label, t), h in zip(out["tests"].items(), stats.holm(ps)):
        t["holm"] = float(h)
        t["n80"] = stats.seeds_for_power(EFFECT, t["sd"])
        lines.append(
            f"| {label} | {fmt(t['mean'], t['lo'], t['hi'], t['p'])} | {t['exact']:.2g} | {h:.2g} | {t['sd']:.4f} |"
            f" {t['n80']} |"
        )
    lines += ["", "Each arm's held-out grain (descriptive; mean and range over the seeds):", ""]
    for groups in SIZES:
        for arm in ARMS:
            v = [value[(s, groups, arm)]["both"] for s in seeds]
            out["per_arm"][f"{arm}-M{groups}"] = v
            lines.append(f"- {arm}, M = {groups}: {np.mean(v):.4f} ({min(v):.4f} to {max(v):.4f})")
    lines += ["", "Each evaluation seed alone (descriptive):", ""]
    for groups in SIZES:
        for key in EVAL_SEEDS:
            m, lo, hi, n = stats.mean_ci(diffs(groups, key))
            out["per_eval_seed"][f"M{groups}-eval{key}"] = dict(mean=m, lo=lo, hi=hi, n=n)
            lines.append(f"- M = {groups}, evaluation seed {key}: {fmt(m, lo, hi, stats.p_value(m, lo, hi, n))}")
    t8, t32, ti = out["tests"].values()
    pos = lambda t: t["lo"] > 0 and t["holm"] < 0.05  # noqa: E731
    if pos(t32) and pos(ti):
        verdict = "the law refuted on the embedded model: late credit pays at M = 32 and more than at M = 8"
    elif k < PLANNED:
        verdict = f"not shown at this size (partial: {k} of {PLANNED} seeds); the law's prediction (no gain at either size) is not contradicted so far"
    else:
        verdict = "consistent with the law (no resolved gain from late credit at 32 over 8 groups), not a confirmation"
    if pos(t8):
        verdict += "; late credit pays at M = 8 (M s = 0.02)"
    out["verdict"] = verdict
    lines += ["", f"**Verdict by PLAN.md part 2's rules: {verdict}.**"]
    (OUT / "reading.md").write_text("\n".join(lines) + "\n")
    (OUT / "summary.json").write_text(json.dumps(stats.rounded(out), indent=1) + "\n")
    plot(out)
    print("\n".join(lines))


def plot(out):
    """embedded/advantage_vs_M.png: late - early on grain against M with its 95% intervals, the effect that matters,
    and the crossing the law predicts from grain's measured s (measure.json, t = 0.278) far to the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crossing = json.loads((HERE / "measure.json").read_text())["predicted_crossing"]["embedded_grain"]["t=0.278"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    t8, t32 = out["tests"]["late - early, M = 8"], out["tests"]["late - early, M = 32"]
    y = np.array([t8["mean"], t32["mean"]])
    err = np.array([[t8["mean"] - t8["lo"], t32["mean"] - t32["lo"]], [t8["hi"] - t8["mean"], t32["hi"] - t32["mean"]]])
    ax.errorbar(SIZES, y, yerr=err, color="k", marker="o", capsize=3, label="late - early on grain (95% t)")
    ax.axvline(crossing["M_star"], color="tab:purple", lw=1.2, label=f"predicted M* = {crossing['M_star']:.0f}")
    ax.axvspan(*crossing["M_star_ci"], color="tab:purple", alpha=0.12)
    ax.axhline(0, color="grey", lw=0.6)
    ax.axhline(EFFECT, color="grey", lw=0.6, ls="--", label=f"effect that matters ({EFFECT})")
    ax.set_xscale("log")
    ax.set_xlim(4, 2000)
    ax.set_xlabel("groups per update M (8 leaves each)")
    ax.set_ylabel("held-out grain, late - early")
    ax.set_title(f"embedded model: late credit vs batch size ({len(out['seeds'])} paired seeds)", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(OUT / "advantage_vs_M.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run", "read"))
    p.add_argument("--seeds", type=int, default=PLANNED)
    a = p.parse_args(argv)
    run_all(a.seeds) if a.command == "run" else read()


if __name__ == "__main__":
    main()
