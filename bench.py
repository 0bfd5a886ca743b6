"""Side-by-side benchmark on the embedded model: DiffusionNFT vs ReCAST vs DiffusionRVGE.

    python bench.py                 # the full comparison (sized for ~40 min on 2 CPU cores)
    python bench.py --quick         # seconds; what the tests run so that this script cannot rot

Every method runs with the same seeds, prompts, rollout budget (same trees: n_roots x n_branch^L
leaves per prompt, same prompts per iteration) and iteration count, one after the other in this
process, so their wall-clock numbers come from the same machine state. Writes to --out:
results.json (every run's metrics), table.md (the tables below, also printed), reward_vs_time.png,
W_final.png. Nothing in the tables is typed in: it is all computed from the runs' metrics.jsonl.
"""
import argparse
import json
from pathlib import Path

import numpy as np

import recast
import rvge

METHODS = {  # name -> (module, extra flags)
    "nft": (recast, ["--credit", "nft"]),
    "uniform": (recast, ["--credit", "uniform"]),
    "recast": (recast, ["--credit", "recast"]),
    "rvge": (rvge, []),
    "rvge_kl": (rvge, ["--kl-beta", "5"]),
    "rvge_recast": (rvge, ["--credit", "recast"]),
}
PHASES = ["time/rollout", "time/reward", "time/gains_W", "time/regression", "time/update"]


def run_all(args):
    """Train every (budgets, method, seed); returns {budgets: {method: [metrics rows per seed]}}."""
    results = {}
    for budgets in args.budgets:
        results[budgets] = {}
        for method in args.methods:
            module, flags = METHODS[method]
            results[budgets][method] = []
            for seed in range(args.seeds):
                out = Path(args.out) / "runs" / f"{budgets.replace(',', '_')}-{method}-{seed}"
                argv = ["--budgets", budgets, "--seed", str(seed), "--iterations", str(args.iterations), "--out", str(out),
                        "--prompts-per-iter", str(args.prompts_per_iter), "--eval-every", str(args.iterations),
                        "--save-every", str(args.iterations), "--overwrite", "--n-roots", "4", "--n-branch", "2", "--branch-steps", "7", *flags]
                module.train(module.parse_args(argv))
                results[budgets][method].append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    return results


def elapsed(rows):
    """Cumulative training seconds at the end of each iteration (rollout + reward + credit + update; eval excluded)."""
    return np.cumsum([sum(m.get(p, 0.0) for p in PHASES) for m in rows])


def smooth(y, k=3):
    y = np.asarray(y, dtype=float)
    return np.array([y[max(0, i - k + 1): i + 1].mean() for i in range(len(y))])


def first_reach(rows, target):
    """(seconds, iterations) at which the smoothed budget-weighted reward first reaches target; NaN if never."""
    y, t = smooth([m["reward/weighted"] for m in rows]), elapsed(rows)
    hit = np.flatnonzero(y >= target)
    return (t[hit[0]], hit[0] + 1) if len(hit) else (np.nan, np.nan)


def mean_std(values):
    v = np.asarray(values, dtype=float)
    return f"{np.nanmean(v):.4f} ± {np.nanstd(v):.4f}" if np.isfinite(v).any() else "n/a"


def tables(results):
    """Markdown tables: final rewards and judges at equal iterations and at equal wall-clock, the
    time to reach DiffusionNFT's final reward, and the share of each phase."""
    lines = []
    for budgets, by_method in results.items():
        first = next(iter(by_method.values()))[0][-1]
        names = [k[len("reward/"):] for k in first if k.startswith("reward/")]
        evals = sorted(k for k in first if k.startswith("eval/"))
        lines += [f"## budgets {budgets}", "", "Equal iterations (final iteration; training rewards of the rollouts, "
                  "then held-out evaluation: ODE sampler, fixed prompts and seeds):", "",
                  "| method | " + " | ".join(names + evals) + " |", "|---" * (1 + len(names) + len(evals)) + "|"]
        for method, runs in by_method.items():
            cells = [mean_std([smooth([m[f"reward/{n}"] for m in rows])[-1] for rows in runs]) for n in names]
            cells += [mean_std([rows[-1].get(e, np.nan) for rows in runs]) for e in evals]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        budget_s = min(min(elapsed(rows)[-1] for rows in runs) for runs in by_method.values())
        lines += ["", f"Equal wall-clock ({budget_s:.1f} s of training, the shortest run): smoothed training rewards", "",
                  "| method | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
        for method, runs in by_method.items():
            cells = []
            for n in names:
                vals = [np.interp(budget_s, elapsed(rows), smooth([m[f"reward/{n}"] for m in rows])) for rows in runs]
                cells.append(mean_std(vals))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        if "nft" in by_method:
            target = np.mean([smooth([m["reward/weighted"] for m in rows])[-1] for rows in by_method["nft"]])
            lines += ["", f"Time to reach DiffusionNFT's final budget-weighted reward ({target:.4f}, smoothed over 3 iterations); "
                      "speed-up = NFT's time / the method's time, paired by seed (n/a: not reached within the run):", "",
                      "| method | seconds | iterations | speed-up vs nft | runs that reached it |", "|---|---|---|---|---|"]
            nft_t = np.array([first_reach(rows, target)[0] for rows in by_method["nft"]])
            for method, runs in by_method.items():
                reach = np.array([first_reach(rows, target) for rows in runs])
                ratio = nft_t / reach[:, 0]  # paired by seed: same prompts and noise, measured in the same invocation
                lines.append(f"| {method} | {mean_std(reach[:, 0])} | {mean_std(reach[:, 1])} | {mean_std(ratio)} | "
                             f"{int(np.isfinite(reach[:, 0]).sum())}/{len(runs)} |")
        lines += ["", "Share of an iteration's time per phase:", "", "| method | " + " | ".join(p[5:] for p in PHASES) + " |",
                  "|---" * (1 + len(PHASES)) + "|"]
        for method, runs in by_method.items():
            totals = np.array([[sum(m.get(p, 0.0) for m in rows) for p in PHASES] for rows in runs]).sum(0)
            lines.append(f"| {method} | " + " | ".join(f"{100 * x / totals.sum():.1f}%" for x in totals) + " |")
        lines.append("")
    return "\n".join(lines)


def figures(results, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for budgets, by_method in results.items():
        tag = budgets.replace(",", "_")
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, runs in by_method.items():
            grid = np.linspace(0, min(elapsed(rows)[-1] for rows in runs), 50)
            curves = [np.interp(grid, elapsed(rows), smooth([m["reward/weighted"] for m in rows])) for rows in runs]
            ax.plot(grid, np.mean(curves, 0), label=method)
        ax.set(xlabel="training seconds", ylabel="budget-weighted reward (smoothed)", title=f"budgets {budgets}")
        ax.legend(fontsize=7)
        fig.savefig(out / f"reward_vs_time_{tag}.png", dpi=120, bbox_inches="tight")
        fig, axes = plt.subplots(1, len(by_method), figsize=(3.2 * len(by_method), 2.6), squeeze=False)
        for ax, (method, runs) in zip(axes[0], by_method.items()):
            ax.imshow(np.array(runs[0][-1]["recast/W"]), aspect="auto", cmap="viridis")
            ax.set(title=method, xlabel="step j", ylabel="reward k")
        fig.savefig(out / f"W_final_{tag}.png", dpi=120, bbox_inches="tight")
        plt.close("all")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench", help="output folder")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per method")
    parser.add_argument("--iterations", type=int, default=30, help="iterations per run")
    parser.add_argument("--prompts-per-iter", type=int, default=4, help="prompt groups per iteration (8 leaves each)")
    parser.add_argument("--budgets", nargs="+", default=["0.4,0.3,0.2,0.1", "0.1,0.2,0.3,0.4"], help="budget vectors")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to run")
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 iterations, 1 prompt, first budget vector only")
    parser.add_argument("--tables-only", action="store_true", help="recompute table.md and figures from --out's results.json")
    args = parser.parse_args(argv)
    for flag in ("seeds", "iterations", "prompts_per_iter"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    if args.quick:
        args.seeds, args.iterations, args.prompts_per_iter, args.budgets = 1, 2, 1, args.budgets[:1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tables_only:
        if not (out / "results.json").is_file():
            parser.error(f"--tables-only: no {out / 'results.json'} yet; run the benchmark first (without --tables-only)")
        results = json.loads((out / "results.json").read_text())
    else:
        results = run_all(args)
        (out / "results.json").write_text(json.dumps(results))
    table = tables(results)
    (out / "table.md").write_text(table)
    figures(results, out)
    print(table)
    return results


if __name__ == "__main__":
    main()
