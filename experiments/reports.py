"""Reports: table.md and figures of each experiment, regenerated from its results alone.

`bench.py` runs an experiment and calls its report (`Experiment.report` names the function: here, or ReCAST's protocol
in `protocol.py`) with a `Results`: the metrics rows of every finished run, grouped by cell and seed, and the files
beside them. A report returns the lines of table.md and draws its figures next to it; `results_block` and
`write_results_md` put table.md, with the command and commits that made it, between the markers of the experiment's
section in its Markdown file (the results folder's README.md, beside the hand-written design and reading). The
statistics are `stats.py`'s.

Reads nothing of `bench.py` (which imports this module): what a report needs of the experiment comes in `Results`.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np

import world as shapes_world
from experiments.stats import (
    ALPHA,
    below_claim,
    censored_speedup,
    fmt_ci,
    fmt_exact,
    fmt_speedup,
    gain_margin,
    holm,
    km_median,
    log_ratios_at_most,
    mean_ci,
    mean_std,
    non_inferiority,
    p_value,
    paired,
    paired_speedup,
    sign_flip_p,
    smooth,
    time_to_reach,
)

# =============================================================================
# What a report reads: result records, files beside them, metrics rows
# =============================================================================


PHASES = [
    "time/rollout",
    "time/reward",
    "time/gains_W",
    "time/regression",
    "time/update",
]  # training time; eval excluded


def slug(text):
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def cell_iterations(exp, cell):
    return max(1, round(exp.iterations * cell.compute))


def flag_value(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


def portable(settings, exp_dir) -> list[str]:
    """Settings with the experiment's folder written {exp_dir} (as in the cells' flags): a result keeps its identity
    when its results folder moves (e.g. an earlier world's results to results/world-amp0.3/)."""
    return [str(x).replace(str(exp_dir), "{exp_dir}") for x in settings]


def record_settings(record: dict) -> list[str]:
    made_in = re.search(r"--out (\S+)/work/", record.get("command") or "")  # where the results folder was then
    return portable(record["settings"], made_in[1]) if made_in else [str(x) for x in record["settings"]]


def read_json(path: Path):
    """(the parsed JSON, None), or (None, what is wrong) for a damaged or unreadable file."""
    try:
        return json.loads(path.read_text()), None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    except ValueError as err:
        return None, f"not JSON ({type(err).__name__}: {str(err)[:80]}; a write cut short?)"


def set_aside(files: dict, exp_dir: Path, why: str) -> Path:
    """Move files ({path: reason}) and their final evaluations (<run>.final.json) to exp_dir/set-aside/<UTC time>-why/,
    with WHY.txt naming each file's reason; nothing is deleted. Returns the folder."""
    where = exp_dir / "set-aside" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{why}"
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "WHY.txt", "a") as f:
        for path, reason in files.items():
            f.write(f"{path.name}: {reason}\n")
            final_eval = path.with_name(path.name.removesuffix(".json.gz") + ".final.json")
            for p in (path, final_eval):
                if p.exists():
                    os.replace(p, where / p.name)
    return where


def elapsed(rows):
    """Cumulative training seconds at the end of each iteration (rollout + reward + credit + update; eval excluded)."""
    return np.cumsum([sum(m.get(p, 0.0) for p in PHASES) for m in rows])


def eval_curve(rows, metric="eval/weighted"):
    """Held-out curve of one run: (iterations, training seconds, values); the pretrained value
    (eval_before/..., logged with iteration 0) at iteration 0 and 0 s when present."""
    name = metric.split("/", 1)[1]
    t = elapsed(rows)
    pts = [(0, 0.0, rows[0][f"eval_before/{name}"])] if rows and f"eval_before/{name}" in rows[0] else []
    pts += [(m["iteration"] + 1, t[i], m[metric]) for i, m in enumerate(rows) if metric in m]
    return tuple(np.array(col, dtype=float) for col in zip(*pts)) if pts else (np.zeros(0),) * 3


def final(rows, metric):
    """The metric at the last evaluation of the run (NaN if never evaluated)."""
    return next((m[metric] for m in reversed(rows) if metric in m), np.nan)


READ = (  # the metrics the reports read from a run's rows (prefixes): what a result must not lack
    "eval/",
    "eval_before/",
    "reward/",
    "loss/base_reg",
    "recast/W",
    "recast/evidence",
    "rvge/direction_rms/",
    "rvge/bandwidth/",
)


def incomplete_results(records: list[dict]) -> dict[str, str]:
    """{run_id: what it lacks} of the results that hold fewer rows than the other seeds of their cell, or lack at some
    row a metric the reports read (`READ`) that those seeds have there: a key removed, an evaluation cut. Tables and
    figures skip what is missing (a mean over fewer seeds, a shorter curve), so each is named instead (issue 47.3).
    A cell with one seed has nothing to compare with."""
    cells, out = {}, {}
    for r in records:
        cells.setdefault((r["group"], r["label"]), []).append(r)
    for recs in cells.values():
        if len(recs) < 2:
            continue
        n = max(len(r["rows"]) for r in recs)
        for r in recs:
            lacking = {}
            for i, row in enumerate(r["rows"]):
                want = {
                    k for o in recs if o is not r and i < len(o["rows"]) for k in o["rows"][i] if k.startswith(READ)
                }
                for k in want - set(row):
                    lacking[k] = lacking.get(k, 0) + 1
            what = [f"{k} at {c} of its {len(r['rows'])} rows" for k, c in sorted(lacking.items())[:3]]
            what += [f"{len(lacking) - 3} more metrics"] if len(lacking) > 3 else []
            what += [f"{len(r['rows'])} of {n} rows"] if len(r["rows"]) < n else []
            if what:
                out[r.get("run_id")] = "lacks " + ", ".join(what)
    return out


class Results:
    """What a report reads: the finished runs of one experiment, runs[group][label] = {seed: metrics rows} (ids: their
    run ids), and what bench.build_report passes besides. `exp` is the bench.Experiment, `records` the results read
    (each with its run_id, group, label and seed), `planned` every bench.Run the command plans (those without a
    record are `missing`), `exp_dir` the experiment's results folder. ReCAST's protocol also reads `finished` (the
    runs whose results were read: each has a final evaluation), `settings` (setting -> its rewards: bench.SETTINGS),
    `profiles` (the profiles.json its prior was measured in) and `together` (the experiments whose summaries are read
    together: both settings)."""

    def __init__(
        self,
        exp,
        records: list[dict],
        planned: list,
        exp_dir: Path = Path("."),
        finished=(),
        settings: dict | None = None,
        profiles: Path | None = None,
        together: tuple[str, ...] = (),
    ):
        self.exp, self.records, self.exp_dir = exp, records, exp_dir
        self.finished, self.settings, self.profiles, self.together = list(finished), settings or {}, profiles, together
        self.ids: dict[str, dict[str, dict[int, str]]] = {}
        self.runs: dict[str, dict[str, dict[int, list]]] = {}
        for cell in exp.cells:  # spec order, whatever has finished
            self.runs.setdefault(cell.group, {}).setdefault(cell.label, {})
        for r in records:
            self.runs[r["group"]][r["label"]][r["seed"]] = r["rows"]
            self.ids.setdefault(r["group"], {}).setdefault(r["label"], {})[r["seed"]] = r.get("run_id")
        self.missing = [run.run_id for run in planned if not any(r["run_id"] == run.run_id for r in records)]
        self.incomplete = incomplete_results(records)  # run_id -> what it lacks; protocol.py adds final evaluations
        self.cells = {(c.group, c.label): c for c in exp.cells}

    def values(self, group, label, fn):
        return {s: fn(rows) for s, rows in self.runs[group][label].items()}

    def banner(self):
        n = len(self.records) + len(self.missing)
        head = [
            f"# {self.exp.name}",
            "",
            f"{len(self.records)} of {n} runs; seeds paired across methods (same prompts and noise); "
            f"{self.exp.iterations} iterations x {self.exp.prompts_per_iter} prompt groups, held-out eval every "
            f"{self.exp.eval_every}; "
            "intervals: t, 95%, over seeds of paired differences; each table of differences states its "
            "multiple-comparison correction.",
            "",
        ]
        if self.missing:
            head += [
                f"**PARTIAL: {len(self.missing)} run(s) missing** ({', '.join(self.missing[:8])}"
                f"{', ...' if len(self.missing) > 8 else ''}); rerun the command to complete them.",
                "",
            ]
        if self.incomplete:
            named = [f"{k}: {v}" for k, v in list(self.incomplete.items())[:8]]
            head += [
                f"**PARTIAL: {len(self.incomplete)} result(s) incomplete** ({'; '.join(named)}"
                f"{'; ...' if len(self.incomplete) > 8 else ''}): what they lack is missing from the tables and "
                "figures (fewer seeds there); restore those files or rerun their runs.",
                "",
            ]
        return head


# =============================================================================
# The reports of multi, rvge-single, rvge-joint(-why, -eta), rvge-drift, recast-100, nft-steps
# =============================================================================


def curve_figure(res: Results, path: Path, metric="eval/weighted", x="seconds"):
    """Held-out metric vs training seconds (or iterations), one panel per group (and per metric when `metric` is a
    tuple): mean over seeds, band +- 1 sd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (metric,) if isinstance(metric, str) else metric
    panels = [(g, m) for g, by in res.runs.items() if any(by.values()) for m in metrics]
    if not panels:
        return
    cols = min(len(panels), 5)
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3 * rows_n), squeeze=False)
    for ax, (group, metric) in zip(axes.flat, panels):
        for label, by_seed in res.runs[group].items():
            curves = [eval_curve(rows, metric) for rows in by_seed.values()]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            if x == "seconds":
                grid = np.linspace(0, min(c[1][-1] for c in curves), 40)
                ys = np.array([np.interp(grid, c[1], c[2]) for c in curves])
            else:
                n = min(len(c[0]) for c in curves)
                grid, ys = curves[0][0][:n], np.array([c[2][:n] for c in curves])
            mean, sd = ys.mean(0), ys.std(0)
            ax.plot(grid, mean, marker="." if x != "seconds" else None, label=f"{label} (n={len(ys)})")
            ax.fill_between(grid, mean - sd, mean + sd, alpha=0.2)
        ax.set(
            title=group, xlabel="training seconds" if x == "seconds" else "iteration", ylabel=f"held-out {metric[5:]}"
        )
        if ax.get_legend_handles_labels()[0]:  # a metric no run logged leaves the panel empty
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_multi(res: Results, out: Path):
    """Today's tables per budget vector: final rewards and judges at equal iterations and at equal
    wall-clock, the time to reach DiffusionNFT's final training reward, the share of each phase."""
    lines = res.banner()
    for budgets, by_label in res.runs.items():
        by_label = {k: v for k, v in by_label.items() if v}
        if not by_label:
            continue
        first = next(iter(next(iter(by_label.values())).values()))[-1]
        names = [k[len("reward/") :] for k in first if k.startswith("reward/")]
        evals = sorted(k for k in first if k.startswith("eval/"))
        lines += [
            f"## budgets {budgets}",
            "",
            "Equal iterations (final iteration; training rewards of the rollouts smoothed over 3 "
            "iterations, then held-out evaluation: ODE sampler, fixed prompts and seeds), mean ± sd over seeds:",
            "",
            "| method | n | " + " | ".join(names + evals) + " |",
            "|---" * (2 + len(names) + len(evals)) + "|",
        ]
        for label, runs in by_label.items():
            cells = [mean_std([smooth([m[f"reward/{n}"] for m in rows])[-1] for rows in runs.values()]) for n in names]
            cells += [mean_std([final(rows, e) for rows in runs.values()]) for e in evals]
            lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
        budget_s = min(elapsed(rows)[-1] for runs in by_label.values() for rows in runs.values())
        lines += [
            "",
            f"Equal wall-clock ({budget_s:.1f} s of training, the shortest run): smoothed training rewards",
            "",
            "| method | " + " | ".join(names) + " |",
            "|---" * (1 + len(names)) + "|",
        ]
        for label, runs in by_label.items():
            cells = [
                mean_std(
                    [
                        np.interp(budget_s, elapsed(rows), smooth([m[f"reward/{n}"] for m in rows]))
                        for rows in runs.values()
                    ]
                )
                for n in names
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if "nft" in by_label:
            target = np.mean([smooth([m["reward/weighted"] for m in rows])[-1] for rows in by_label["nft"].values()])

            def reach(rows):
                return time_to_reach(elapsed(rows), smooth([m["reward/weighted"] for m in rows]), target)

            nft_t = {s: reach(rows) for s, rows in by_label["nft"].items()}
            times = {label: {s: reach(rows) for s, rows in runs.items()} for label, runs in by_label.items()}
            speed = {label: censored_speedup(nft_t, t) for label, t in times.items() if label != "nft"}
            pair = {label: paired_speedup(nft_t, t) for label, t in times.items() if label != "nft"}
            adjusted = dict(zip(pair, holm([v[4] for v in pair.values()])))
            exact = dict(zip(pair, holm([v[5] for v in pair.values()])))
            lines += [
                "",
                f"Time to reach DiffusionNFT's final budget-weighted training reward ({target:.4f}, smoothed over 3 "
                "iterations): Kaplan-Meier median seconds (runs that never reach it censored at their end; inf: the "
                "median is not reached); speed-up: KM = NFT's median / the method's [95% paired bootstrap over seeds]; "
                "paired = the geometric mean of the per-seed ratios [95% t], its paired t p and exact sign-flip p "
                f"(`paired_speedup`), each with Holm over the {len(speed)} methods:",
                "",
                "| method | median seconds | speed-up vs nft | runs that reached it |",
                "|---|---|---|---|",
            ]
            for label, t in times.items():
                cell = fmt_speedup(speed[label], pair[label], adjusted[label], exact[label]) if label in speed else "1"
                lines.append(f"| {label} | {km_median(*zip(*t.values())):.1f} | {cell} | {reach_counts(t)} |")
        lines += [
            "",
            "Share of an iteration's time per phase:",
            "",
            "| method | " + " | ".join(p[5:] for p in PHASES) + " |",
            "|---" * (1 + len(PHASES)) + "|",
        ]
        for label, runs in by_label.items():
            totals = np.array([[sum(m.get(p, 0.0) for m in rows) for p in PHASES] for rows in runs.values()]).sum(0)
            lines.append(f"| {label} | " + " | ".join(f"{100 * x / totals.sum():.1f}%" for x in totals) + " |")
        lines.append("")
        multi_figures(budgets, by_label, out)
    return lines


def multi_figures(budgets, by_label, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = slug(budgets)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, runs in by_label.items():
        grid = np.linspace(0, min(elapsed(rows)[-1] for rows in runs.values()), 50)
        curves = np.array(
            [np.interp(grid, elapsed(rows), smooth([m["reward/weighted"] for m in rows])) for rows in runs.values()]
        )
        ax.plot(grid, curves.mean(0), label=label)
        ax.fill_between(grid, curves.mean(0) - curves.std(0), curves.mean(0) + curves.std(0), alpha=0.15)
    ax.set(xlabel="training seconds", ylabel="budget-weighted training reward (smoothed)", title=f"budgets {budgets}")
    ax.legend(fontsize=7)
    fig.savefig(out / f"reward_vs_time_{tag}.png", dpi=120, bbox_inches="tight")
    fig, axes = plt.subplots(1, len(by_label), figsize=(3.2 * len(by_label), 2.6), squeeze=False)
    for ax, (label, runs) in zip(axes[0], by_label.items()):
        ax.imshow(np.array(next(iter(runs.values()))[-1]["recast/W"]), aspect="auto", cmap="viridis")
        ax.set(title=label, xlabel="step j", ylabel="reward k")
    fig.savefig(out / f"W_final_{tag}.png", dpi=120, bbox_inches="tight")
    plt.close("all")


def reach_counts(reach: dict) -> str:
    return f"{sum(r for _, r in reach.values())}/{len(reach)}"


THRESHOLD_SHARES = (1 / 3, 2 / 3, 1.0)  # matched levels: pretrained + share x (NFT's final - pretrained)


CLAIMED_SPEEDUP = 2.1  # the RVGE abstract's smallest single-reward speed-up ("2.1-6.7x faster")


def speedup_table(by_label, labels, base, pre, top, clocks, claim=CLAIMED_SPEEDUP) -> tuple[int, list[str]]:
    """The matched-level rows of rvge-single and rvge-drift: per level pre + share (top - pre) (THRESHOLD_SHARES) and
    method, the Kaplan-Meier median of each of two clocks (name, rows -> the clock at each evaluation, format) at
    which the held-out reward first reaches the level (runs that never reach it censored, `time_to_reach`), how many
    reach it, and the speed-up base / method on each clock: the ratio of KM medians with its paired bootstrap
    (`censored_speedup`) and the paired test (`paired_speedup`), Holm over all of them for its t test and for its
    exact sign-flip test. Then the claim's test: per level and clock, the one-sided paired test of "the speed-up is at
    least `claim`" (`below_claim`), Holm over those. Returns (how many speed-ups, the table's rows)."""
    reach = {  # (share, label, clock) -> {seed: (x, reached)}
        (share, label, i): {
            s: time_to_reach(clock(rows), eval_curve(rows)[2], pre + share * (top - pre))
            for s, rows in by_label[label].items()
        }
        for share in THRESHOLD_SHARES
        for label in labels
        for i, (_, clock, _) in enumerate(clocks)
    }
    keys = [k for k in reach if k[1] != base]
    speed = {k: censored_speedup(reach[(k[0], base, k[2])], reach[k]) for k in keys}
    pair = {k: paired_speedup(reach[(k[0], base, k[2])], reach[k]) for k in keys}
    adjusted = dict(zip(keys, holm([pair[k][4] for k in keys])))
    exact = dict(zip(keys, holm([pair[k][5] for k in keys])))
    rows = []
    for share in THRESHOLD_SHARES:
        for label in labels:
            medians = [km_median(*zip(*reach[(share, label, i)].values())) for i in range(len(clocks))]
            cells = [
                fmt_speedup(speed[k], pair[k], adjusted[k], exact[k]) if label != base else "1"
                for k in ((share, label, i) for i in range(len(clocks)))
            ]
            rows.append(
                f"| {share:.0%} ({pre + share * (top - pre):.4f}) | {label} | "
                + " | ".join(f"{m:{fmt}}" for m, (_, _, fmt) in zip(medians, clocks))
                + f" | {reach_counts(reach[(share, label, 0)])} | {cells[0]} | {cells[1]} |"
            )
    tests = {k: below_claim(log_ratios_at_most(reach[(k[0], base, k[2])], reach[k]), claim) for k in keys}
    t_holm = dict(zip(keys, holm([v[0] for v in tests.values()])))
    e_holm = dict(zip(keys, holm([v[1] for v in tests.values()])))
    rows += [
        "",
        f'The claim at its smallest, "{claim}x faster": one-sided paired test of H0 "the speed-up is at least '
        f'{claim}x" (`below_claim`: paired t on log ratio − log {claim}, and the exact sign-flip test of the same), '
        f"Holm over the {sum(np.isfinite(v[0]) for v in tests.values())} tested; a Holm p below 0.05 excludes "
        f"{claim}x. Each seed counts by the largest log ratio its data allow (`log_ratios_at_most`: a method that "
        f"never reaches the level by its bound, unclipped), so a level {base} does not reach in every seed (its "
        f"time unknown, the ratio unbounded) is not tested.",
        "",
        "| threshold | method | " + " | ".join(f"below {claim}x in {name}" for name, _, _ in clocks) + " |",
        "|---|---|" + "---|" * len(clocks),
    ]
    for share in THRESHOLD_SHARES:
        for label in labels:
            if label == base:
                continue
            ks = [(share, label, i) for i in range(len(clocks))]
            untested = f"not tested: {base} reaches it in {reach_counts(reach[(share, base, 0)])} seeds"
            rows.append(
                f"| {share:.0%} | {label} | "
                + " | ".join(
                    f"p {tests[k][0]:.2g} Holm {t_holm[k]:.2g}{fmt_exact(tests[k][1], e_holm[k])}"
                    if np.isfinite(tests[k][0])
                    else untested
                    for k in ks
                )
                + " |"
            )
    return len(speed), rows


def report_rvge_single(res: Results, out: Path):
    """Per reward: final held-out reward, then the time and iterations each method needs to reach
    matched thresholds (NFT's final value and two intermediate levels) and the speed-up, runs that never reach a
    level counted as censored (Kaplan-Meier medians; the paired test of `paired_speedup`, Holm over the reward's
    thresholds x measures; the claim's 2.1x tested one-sided)."""
    lines = res.banner() + [
        "Single-reward training (budget 1, so `eval/weighted` is the reward itself); thresholds on the held-out "
        "curve (evaluations linearly interpolated; training seconds exclude evaluation). `final − nft`: one "
        "comparison per reward, no correction; exact: the sign-flip test's p beside the paired t's; N80 at the "
        "observed difference (no noise floor is measured here) [over the sd's 95% interval].",
        "",
    ]
    base = res.exp.baseline
    for reward, by_label in res.runs.items():
        if not by_label.get(base):
            lines += [f"## {reward}", "", f"no {base} run finished yet", ""]
            continue
        pre = np.nanmean([eval_curve(rows)[2][0] for rows in by_label[base].values()])
        top = np.nanmean([final(rows, "eval/weighted") for rows in by_label[base].values()])
        lines += [
            f"## {reward}",
            "",
            f"Pretrained {pre:.4f}; {base}'s final {top:.4f}.",
            "",
            "| method | n | final held-out | training seconds | final − " + base + " [95%] |",
            "|---|---|---|---|---|",
        ]
        for label, runs in by_label.items():
            fin = res.values(reward, label, lambda r: final(r, "eval/weighted"))
            secs = [elapsed(rows)[-1] for rows in runs.values()]
            d = paired(fin, res.values(reward, base, lambda r: final(r, "eval/weighted")))
            diff = fmt_ci(*mean_ci(d), exact=sign_flip_p(d)) if label != base else "—"
            lines.append(f"| {label} | {len(runs)} | {mean_std(list(fin.values()))} | {mean_std(secs, 1)} | {diff} |")
        if top <= pre:
            lines += ["", f"{base} did not improve on the pretrained model here, so no threshold is meaningful.", ""]
            continue
        clocks = (
            ("seconds", lambda rows: eval_curve(rows)[1], ".1f"),
            ("iterations", lambda rows: eval_curve(rows)[0], ".1f"),
        )
        n_speed, table = speedup_table(by_label, list(by_label), base, pre, top, clocks)
        lines += [
            "",
            f"Kaplan-Meier median time to each level (runs that never reach it censored at their last evaluation; "
            f"inf: the median is not reached); speed-up: KM = {base}'s median / the method's [95% paired bootstrap "
            f"over seeds; a resample where neither median is reached counts as 0 and as inf]; paired = the geometric "
            f"mean of the per-seed ratios {base}'s time / the method's [95% t] (a run that never reaches the level "
            f"counted at its last evaluation: a bound nearer 1), its paired t p and exact sign-flip p, each with Holm "
            f"over this reward's {n_speed} speed-ups:",
            "",
            "| threshold | method | median seconds | median iterations | reached | speed-up in time | in iterations |",
            "|---|---|---|---|---|---|---|",
            *table,
            "",
        ]
    curve_figure(res, out / "reward_vs_time.png")
    return lines + ["![](reward_vs_time.png)", ""]


LOWER_IS_BETTER = ("judge/frechet",)  # with or without the "eval/" of metrics.jsonl


def better_sign(metric):
    """-1 for a metric where lower is better (the Fréchet distance, named "eval/judge/frechet" in a run's metrics and
    "judge/frechet" in the final evaluation), else +1. Until 2026-12-02 only the first name was known, so the
    protocol's summaries counted a higher Fréchet distance as an improvement."""
    return -1.0 if metric.removeprefix("eval/") in LOWER_IS_BETTER else 1.0


def is_frechet(metric):
    return metric.removeprefix("eval/") == "judge/frechet"


UNEQUAL_N = "n/a (unequal N)"  # a Fréchet distance depends on the number of images: never compared across N


def eval_set(record: dict):
    """The held-out prompts a run's in-run evaluations used: its --eval-prompts, or None for the embedded held-out
    split (the same N images in every run of an experiment)."""
    return flag_value(record_settings(record), "--eval-prompts")


def equal_n(res, group: str, labels) -> bool:
    """Whether every run of these labels in the group was evaluated on the same prompts (so the same N images):
    the condition for comparing their Fréchet distances."""
    return len({eval_set(r) for r in res.records if r["group"] == group and r["label"] in labels}) <= 1


def verdict(metric, lo, hi):
    """+1: the interval lies wholly on the better side of 0; -1: wholly on the worse side; 0: it
    holds 0, or there is no interval (fewer than 2 paired seeds)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return 0
    lo, hi = sorted((better_sign(metric) * lo, better_sign(metric) * hi))
    return 1 if lo > 0 else -1 if hi < 0 else 0


def report_rvge_joint(res: Results, out: Path):
    """Every held-out metric at the end of each run; RVGE (full and 1/5 compute) minus NFT, paired."""
    lines = res.banner()
    base, floor = res.exp.baseline, eval_floor(res)
    for group, by_label in res.runs.items():
        any_rows = next((rows for runs in by_label.values() for rows in runs.values()), None)
        if any_rows is None:
            continue
        metrics = sorted(k for k in any_rows[-1] if k.startswith("eval/"))
        lines += [
            f"## {group}: final held-out metrics (mean ± sd over seeds; frechet: lower is better)",
            "",
            "| method | n | iterations | training seconds | distance to base | "
            + " | ".join(m[5:] for m in metrics)
            + " |",
            "|---" * (5 + len(metrics)) + "|",
        ]
        before = {m: any_rows[0].get(m.replace("eval/", "eval_before/")) for m in metrics}
        lines.append(
            "| pretrained | | 0 | 0 | 0 | "
            + " | ".join(f"{v:.4f}" if v is not None else "" for v in before.values())
            + " |"
        )
        for label, runs in by_label.items():
            cell = res.cells[(group, label)]
            lines.append(
                f"| {label} | {len(runs)} | {cell_iterations(res.exp, cell)} | "
                f"{mean_std([elapsed(r)[-1] for r in runs.values()], 1)} | "
                f"{mean_std([distance_to_base(r) for r in runs.values()], 5)} | "
                + " | ".join(mean_std([final(r, m) for r in runs.values()]) for m in metrics)
                + " |"
            )
        rows = [(label, base) for label in by_label if label != base]
        rows += [(a, b) for a, b in res.exp.pairs if a in by_label and b in by_label]
        values = {
            (label, other): {
                m: paired(
                    res.values(group, label, lambda r, m=m: final(r, m)),
                    res.values(group, other, lambda r, m=m: final(r, m)),
                )
                for m in metrics
                if not is_frechet(m) or equal_n(res, group, (label, other))
            }
            for label, other in rows
        }
        diffs = {r: {m: mean_ci(v) for m, v in by_m.items()} for r, by_m in values.items()}
        floors = floor.get("sd", {})
        adjusted = {  # Holm per metric over every comparison of this table
            m: dict(zip(rows, holm([p_value(*diffs[r][m]) if m in diffs[r] else np.nan for r in rows])))
            for m in metrics
        }
        exact = {m: {r: sign_flip_p(values[r][m]) if m in values[r] else np.nan for r in rows} for m in metrics}
        exact_holm = {m: dict(zip(rows, holm([exact[m][r] for r in rows]))) for m in metrics}
        lines += [
            "",
            f"Paired differences method − {base}, then between methods (the variants against their parents) [95%]; "
            f"Holm per metric over these {len(rows)} comparisons, for the paired t and for the exact sign-flip test "
            "(`exact`: no normal model; at 4 seeds its smallest p is 0.125, so nothing is resolved without the normal "
            "model here); N80 at "
            + (
                "the larger of the observed difference and two noise floors of one in-run evaluation "
                "(`eval_floor.json`)"
                if floors
                else "the observed difference (no noise floor is measured for the in-run evaluation)"
            )
            + f" and level 0.05 / {len(rows)}:",
            "",
            "| method | " + " | ".join(m[5:] for m in metrics) + " |",
            "|---" * (1 + len(metrics)) + "|",
        ]
        summary = []
        for label, other in rows:
            d, name = diffs[(label, other)], label if other == base else f"{label} − {other}"
            cells = [
                fmt_ci(
                    *d[m],
                    floor=floors.get(m),
                    p_holm=adjusted[m][(label, other)],
                    family=len(rows),
                    exact=exact[m][(label, other)],
                    exact_holm=exact_holm[m][(label, other)],
                )
                if m in d
                else UNEQUAL_N
                for m in metrics
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            better = sum(better_sign(m) * v[0] > 0 for m, v in d.items() if np.isfinite(v[0]))
            sig = [verdict(m, v[1], v[2]) if adjusted[m][(label, other)] < ALPHA else 0 for m, v in d.items()]
            summary.append(
                f"- {label} vs {other}: better on average on {better} of {len(d)} held-out metrics; "
                + (
                    f"resolved better on {sig.count(1)}, resolved worse on {sig.count(-1)}, unresolved on "
                    f"{sig.count(0)} (after Holm; unresolved is not a match)."
                    if any(np.isfinite(v[1]) for v in d.values())
                    else "no intervals (fewer than 2 paired seeds)."
                )
            )
        lines += [""] + summary + [""] + non_inferiority_lines(res, group, floor, metrics, values, rows)
        lines += along_the_run(res, group, by_label, base)
        lines += [
            "Distance to base: `loss/base_reg`, mean |v_theta - v_base|^2 of the trained velocity against the frozen",
            "pretrained one on the training queries, averaged over the run's last 10 iterations (how far it moved).",
            "",
        ] + direction_sizes(by_label)
    curve_figure(res, out / "reward_vs_time.png", metric=ALONG)
    return lines + ["![](reward_vs_time.png)", ""]


EVAL_FLOOR_NOISES = 16  # noise sets of the in-run evaluation's noise floor (`measure_eval_floor`)


def measure_eval_floor(exp, exp_dir: Path, noises=EVAL_FLOOR_NOISES) -> dict:
    """The noise floor of one in-run held-out evaluation: the pretrained model evaluated as every run evaluates
    (`session.evaluate`: the held-out prompts, the ODE sampler, the first cell's rewards and judges) from `noises`
    noise sets (session.EVAL_SEED, the runs' own, and the next noises - 1 seeds); per metric the sd over them.
    report_rvge_joint's non-inferiority margin is two of these. Cached in exp_dir/eval_floor.json (measured again
    when the settings, the world or `noises` differ). The model is imported only when something is measured."""
    path, cell = exp_dir / "eval_floor.json", exp.cells[0]
    settings, world = [*exp.common, *cell.flags], shapes_world.world_id()
    cached, problem = read_json(path) if path.is_file() else (None, None)
    if isinstance(cached, dict) and [cached.get(k) for k in ("settings", "world", "noises")] == [
        settings,
        world,
        noises,
    ]:
        return cached
    import importlib
    import tempfile

    import nft
    from kit import checks, records, session

    script = importlib.import_module(cell.script)
    seeds = [session.EVAL_SEED + k for k in range(noises)]
    values, default = {}, session.EVAL_SEED
    with tempfile.TemporaryDirectory() as tmp:
        args = script.parse_args([*settings, "--out", str(Path(tmp) / "run")])
        names, budgets, branch = checks.check_common(args)
        run = session.load_run(args, names, budgets, branch, cell.script, lock=False)
        try:
            for seed in seeds:
                session.EVAL_SEED = seed
                for m, v in session.evaluate(run, args, nft.ode_sample)[0].items():
                    values.setdefault(m, []).append(float(v))
        finally:
            session.EVAL_SEED = default
    record = {
        "what": "the pretrained model's in-run held-out evaluation from several noise sets "
        "(reports.measure_eval_floor)",
        "settings": settings,
        "world": world,
        "noises": noises,
        "seeds": seeds,
        "values": values,
        "sd": {m: float(np.std(v, ddof=1)) for m, v in values.items()},
    }
    exp_dir.mkdir(parents=True, exist_ok=True)
    records.write_atomic(path, json.dumps(record, indent=1) + "\n")
    return record


def eval_floor(res: Results) -> dict:
    """The experiment's eval_floor.json (`measure_eval_floor`: its "sd" per metric is the sd of one in-run
    evaluation); {} when it was not measured (an earlier world's results) or cannot be read (with a warning)."""
    path = res.exp_dir / "eval_floor.json"
    record, problem = read_json(path) if path.is_file() else (None, None)
    if problem or record is not None and not (isinstance(record, dict) and isinstance(record.get("sd"), dict)):
        print(f"warning: {path}: {problem or 'no sd field'}; no noise floor or non-inferiority margin is used")
        return {}
    return record or {}


NI_FRACTION = 0.5  # the non-inferiority margin: this fraction of the lower 95% bound of the baseline's own gain


def non_inferiority_lines(res: Results, group, floor, metrics, values, rows) -> list[str]:
    """Markdown: "matches" as a test, on the runs' own last held-out evaluation (`non_inferiority_table`): each method −
    baseline against the margin from the baseline's gain over the pretrained model (iteration 0's evaluation), Holm
    per metric over the methods. Beside it, for comparison, the earlier rule's margin (two noise floors of one in-run
    evaluation, `floor`, which mostly cancels in paired differences)."""
    base = res.exp.baseline
    befores = {
        m: paired(
            res.values(group, base, lambda r, m=m: final(r, m)),
            res.values(group, base, lambda r, m=m: r[0].get(m.replace("eval/", "eval_before/"), np.nan)),
        )
        for m in metrics
    }
    old_rule = {m: 2 * floor["sd"][m] for m in metrics if floor and m in floor.get("sd", {})}
    diffs = {r[0]: values[r] for r in rows if r[1] == base}
    return non_inferiority_table(base, metrics, diffs, befores, old_rule)


def non_inferiority_table(base, metrics, diffs, gains, old_rule=None, family="methods") -> list[str]:
    """Markdown: "matches" as a test. Each method − baseline (`diffs`: {method: {metric: per-seed differences}})
    against a non-inferiority margin set by the effect that matters: NI_FRACTION of the lower 95% bound of the
    baseline's own gain over the pretrained model on that metric (`gains`: {metric: per-seed baseline − pretrained};
    `gain_margin`; no margin, and no test, where that gain is not resolved); one-sided paired t and one-sided exact
    sign-flip test, Holm per metric over the methods (`family` "methods") or per method over the testable metrics
    ("metrics"). `old_rule`: an earlier margin per metric, shown in brackets; the pretrained model as the control.
    Nothing testable with fewer than 2 paired seeds."""
    mine, old_rule = list(diffs), old_rule or {}
    gain = {m: mean_ci([better_sign(m) * v for v in gains[m]]) for m in metrics}
    if not any(g[3] > 1 for g in gain.values()):
        return [
            f'Non-inferiority to {base} ("matches or beats"): not testable here, fewer than 2 paired seeds (no '
            f"interval of {base}'s gain to set a margin from).",
            "",
        ]
    margins = {m: gain_margin(gain[m], NI_FRACTION) for m in metrics}
    testable = [m for m in metrics if np.isfinite(margins[m])]
    old_rule = {m: v for m, v in old_rule.items() if m in testable}

    def tests(diff_values, m):
        shifted = [better_sign(m) * v + margins[m] for v in diff_values]
        return non_inferiority(mean_ci(diff_values), margins[m], better_sign(m)), sign_flip_p(
            shifted, alternative="greater"
        )

    p = {m: {r: tests(diffs[r][m], m) if m in diffs[r] else (np.nan, np.nan) for r in mine} for m in testable}
    t_holm, e_holm = {m: {} for m in testable}, {m: {} for m in testable}
    if family == "metrics":  # one family per method: its testable metrics
        for r in mine:
            for k, adjusted in ((0, t_holm), (1, e_holm)):
                for m, q in zip(testable, holm([p[m][r][k] for m in testable])):
                    adjusted[m][r] = q
        correction = f"Holm per method over the {len(testable)} metrics on which {base}'s gain is resolved"
    else:
        for m in testable:
            t_holm[m] = dict(zip(mine, holm([p[m][r][0] for r in mine])))
            e_holm[m] = dict(zip(mine, holm([p[m][r][1] for r in mine])))
        correction = f"Holm per metric over these {len(mine)} methods"
    lines = [
        f'Non-inferiority to {base} ("matches or beats"), the margin from the effect that matters: '
        f"{NI_FRACTION:g} x the lower 95% bound of {base}'s own gain over the pretrained model on that metric "
        f"(paired over seeds; `gain_margin`); a metric on which {base}'s gain is not resolved has no margin and is not "
        f'testable ("matches" means nothing there). One-sided paired t of H0 "worse by the margin or more" (and the '
        f"exact one-sided sign-flip test of the same), {correction}; ✓ "
        "non-inferior (t Holm p < 0.05; `exact` says whether that rests on the normal model)."
        + (
            " In brackets, the earlier rule's margin, two noise floors of one in-run evaluation "
            "(`eval_floor.json`), which a paired difference mostly cancels."
            if old_rule
            else ""
        ),
        "",
        f"| metric | {base}'s gain over the pretrained model (better > 0) [95%] | margin | "
        + " | ".join(mine)
        + " | pretrained (control: no training) |",
        "|---" * (3 + len(mine) + 1) + "|",
    ]
    for m in metrics:
        g, name = gain[m], m.removeprefix("eval/")
        shown = f"{g[0]:+.4g} [{g[1]:+.4g}, {g[2]:+.4g}]" if g[3] > 1 else "n/a"
        margin = f"{margins[m]:.4g}" if m in testable else "none (gain not resolved)"
        margin += f" [{old_rule[m]:.4g}]" if m in old_rule else ""
        if m not in testable:
            lines.append(f"| {name} | {shown} | {margin} | " + " | ".join("—" for _ in mine) + " | — |")
            continue
        cells = [
            f"{'✓ ' if t_holm[m][r] < ALPHA else ''}Holm {t_holm[m][r]:.2g}{fmt_exact(p[m][r][1], e_holm[m][r])}"
            if np.isfinite(t_holm[m][r])
            else "n/a"
            for r in mine
        ]
        control = non_inferiority(mean_ci([-v for v in gains[m]]), margins[m], better_sign(m))
        lines.append(
            f"| {name} | {shown} | {margin} | "
            + " | ".join(cells)
            + f" | {'✓ ' if control < ALPHA else ''}p {control:.2g} |"
        )
    ok = {r: [m for m in testable if t_holm[m][r] < ALPHA] for r in mine}
    return lines + [
        "",
        "Non-inferior on: "
        + "; ".join(
            f"{r} {len(ok[r])} of {len(testable)} testable "
            f"({', '.join(x.removeprefix('eval/') for x in ok[r]) or 'none'})"
            for r in mine
        )
        + f"; {len(metrics) - len(testable)} of {len(metrics)} metrics not testable. The control row tests the "
        "pretrained model (iteration 0) against the same margin: with the margin below the baseline's resolved gain "
        "it should fail, and a ✓ there would say the margin is too wide.",
        "",
    ]


def distance_to_base(rows, last=10):
    """Mean `loss/base_reg` (|v_theta - v_base|^2 on the training queries) over the run's last `last` iterations."""
    return float(np.mean([m["loss/base_reg"] for m in rows[-last:] if "loss/base_reg" in m] or [np.nan]))


def distance_curve(rows, k=5):
    """The distance to the base model along a run, at each held-out evaluation (`eval_curve`'s points): `loss/base_reg`
    averaged over the `k` iterations up to the evaluation, as a running maximum (the farthest the run has been by
    then, so that "distance needed to reach a level" is well defined); 0 at the pretrained model."""
    base = [m.get("loss/base_reg", np.nan) for m in rows]
    pts = [0.0] if rows and "eval_before/weighted" in rows[0] else []
    pts += [float(np.mean(base[max(0, i - k + 1) : i + 1])) for i, m in enumerate(rows) if "eval/weighted" in m]
    return np.maximum.accumulate(np.array(pts, dtype=float)) if pts else np.zeros(0)


DRIFT_CONTRASTS = (  # (method, against): distance to base, compared as a ratio; one Holm family
    ("rvge_permuted", "rvge"),  # a noisy direction drifts as far with the reward shuffled within groups
    ("rvge_permuted", "nft_permuted"),  # RVGE's noise against NFT's
    ("nft_permuted", "nft"),
    ("rvge_eta_0.1", "rvge"),  # a longer step: a smaller eta moves less
    ("rvge_eta_0.05", "rvge"),
)


def report_rvge_drift(res: Results, out: Path):
    """RVGE's drift on one reward, decided: distance to the base model of RVGE and NFT with the reward and with it
    shuffled within groups, and of RVGE at smaller --eta (ratios over paired seeds, Holm over `DRIFT_CONTRASTS`);
    the held-out reward against that distance; speed-ups at matched iterations and at matched distance (censored)."""
    lines = res.banner()
    base = res.exp.baseline
    for reward, by_label in res.runs.items():
        if not by_label.get(base):
            lines += [f"## {reward}", "", f"no {base} run finished yet", ""]
            continue
        metric = "eval/weighted"

        def value(label, fn):
            return res.values(reward, label, fn)

        dist = {label: value(label, distance_to_base) for label in by_label}
        fin = {label: value(label, lambda r: final(r, metric)) for label in by_label}
        pre = np.nanmean([eval_curve(rows)[2][0] for rows in by_label[base].values()])
        top = np.nanmean(list(fin[base].values()))
        lines += [
            f"## {reward}",
            "",
            f"Pretrained {pre:.4f}; {base}'s final {top:.4f}. Distance to base: `loss/base_reg` (mean |v_theta - "
            "v_base|^2 on the training queries) over the run's last 10 iterations. Held-out reward: the true reward "
            "for every arm (the permuted arms shuffle only their training scores). Final − " + base + ": paired t, "
            "no correction.",
            "",
            "| method | n | final held-out | distance to base | final Fréchet | final CNN judge | final − "
            + base
            + " [95%] |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, runs in by_label.items():
            if not runs:
                continue
            d = paired(fin[label], fin[base])
            diff = fmt_ci(*mean_ci(d), exact=sign_flip_p(d)) if label != base else "—"
            frechet = [final(r, "eval/judge/frechet") for r in runs.values()]
            cnn = [final(r, "eval/judge/cnn") for r in runs.values()]
            lines.append(
                f"| {label} | {len(runs)} | {mean_std(list(fin[label].values()))} | "
                f"{mean_std(list(dist[label].values()), 5)} | {mean_std(frechet, 0)} | {mean_std(cnn)} | {diff} |"
            )
        contrasts = [(a, b) for a, b in DRIFT_CONTRASTS if by_label.get(a) and by_label.get(b)]
        log_diffs = {
            (a, b): paired({s: np.log(v) for s, v in dist[a].items()}, {s: np.log(v) for s, v in dist[b].items()})
            for a, b in contrasts
        }
        logs = {c: mean_ci(v) for c, v in log_diffs.items()}
        adjusted = holm([p_value(*logs[c]) for c in contrasts])
        exact = [sign_flip_p(log_diffs[c]) for c in contrasts]
        lines += [
            "",
            f"Distance to base as a ratio (paired over seeds on the log scale: exp of the mean log ratio [95% t "
            f"interval]); Holm over these {len(contrasts)} comparisons, for the paired t and for the exact sign-flip "
            "test. A noisy direction predicts rvge_permuted / "
            "rvge near 1; a longer step predicts it well below 1 and smaller ratios at smaller --eta.",
            "",
            "| distance ratio | n | ratio [95%] | log ratio, its sd, p, Holm |",
            "|---|---|---|---|",
        ]
        for (a, b), p_holm, e, e_holm in zip(contrasts, adjusted, exact, holm(exact)):
            m, lo, hi, n = logs[(a, b)]
            lines.append(
                f"| {a} / {b} | {n} | {np.exp(m):.3g} [{np.exp(lo):.3g}, {np.exp(hi):.3g}] | "
                f"{fmt_ci(m, lo, hi, n, digits=3, p_holm=p_holm, family=len(contrasts), exact=e, exact_holm=e_holm)} |"
            )
        if top <= pre:
            lines += ["", f"{base} did not improve on the pretrained model here, so no threshold is meaningful.", ""]
            continue
        movers = [label for label in by_label if label != base and "permuted" not in label and by_label[label]]
        clocks = (("iterations", lambda rows: eval_curve(rows)[0], ".1f"), ("distance", distance_curve, ".5f"))
        n_speed, table = speedup_table(by_label, [base, *movers], base, pre, top, clocks)
        lines += [
            "",
            f"Matched iterations and matched distance: the Kaplan-Meier median iterations, and distance to base "
            f"(`distance_curve`: its running maximum), at which the held-out reward first reaches each level (runs "
            f"that never reach it censored, never dropped); speed-up = {base}'s median / the method's (> 1: the "
            f"method needs fewer iterations, or moves less far from the base model): KM = the ratio of medians [95% "
            f"paired bootstrap; a resample where neither median is reached counts as 0 and as inf]; paired = the "
            f"geometric mean of the per-seed ratios [95% t] (a run that never reaches the level counted at its last "
            f"evaluation), its paired t p and exact sign-flip p, each with Holm over these {n_speed} speed-ups:",
            "",
            "| threshold | method | median iterations | median distance | reached | speed-up in iterations | "
            "in distance |",
            "|---|---|---|---|---|---|---|",
            *table,
            "",
        ]
        drift_figure(reward, by_label, out / f"reward_vs_distance_{slug(reward)}.png")
        lines += [f"![](reward_vs_distance_{slug(reward)}.png)", ""]
    return lines


def drift_figure(reward, by_label, path):
    """Held-out reward against distance to the base model (`distance_curve`, log scale), one line per run, and its
    Fréchet distance against the same."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, (label, runs) in enumerate(by_label.items()):
        for j, rows in enumerate(runs.values()):
            x = distance_curve(rows)
            for ax, metric in zip(axes, ("eval/weighted", "eval/judge/frechet")):
                y = eval_curve(rows, metric)[2]
                n = min(len(x), len(y))
                ax.plot(
                    x[1:n], y[1:n], color=f"C{k}", alpha=0.7, lw=1, label=f"{label} (n={len(runs)})" if j == 0 else None
                )
    for ax, name in zip(axes, (f"held-out {reward}", "held-out Fréchet distance")):
        ax.set(xscale="log", xlabel="distance to base (running max of loss/base_reg)", ylabel=name)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def direction_sizes(by_label: dict) -> list[str]:
    """Markdown: per RVGE method, each reward's `rvge/direction_rms` (mean over iterations and seeds), its bandwidth."""
    lines = []
    for label, runs in by_label.items():
        rows = [m for r in runs.values() for m in r]
        names = [k.split("/", 2)[2] for k in (rows[0] if rows else {}) if k.startswith("rvge/direction_rms/")]
        if names:
            rms = {n: np.nanmean([m[f"rvge/direction_rms/{n}"] for m in rows]) for n in names}
            sizes = [f"{n} {rms[n]:.4f} ({rows[-1][f'rvge/bandwidth/{n}']})" for n in names]
            lines.append(
                f"- {label}: direction rms per reward (mean over iterations and seeds; bandwidth) " + ", ".join(sizes)
            )
    return lines + [""] if lines else []


ALONG = ("eval/weighted", "eval/judge/cnn", "eval/judge/frechet")


def along_the_run(res: Results, group: str, by_label: dict, base: str) -> list[str]:
    """Markdown: at each held-out evaluation, each full-length method minus the baseline at the same iteration
    (paired over seeds, 95% t) for `ALONG`'s metrics: where along the run one overtakes the other."""
    full = [lbl for lbl in by_label if lbl != base and res.cells[(group, lbl)].compute == 1.0]
    if not full or not by_label.get(base):
        return []
    iters = eval_curve(next(iter(by_label[base].values())), ALONG[0])[0]
    lines = [
        f"Along the run: method − {base} at the same iteration [95%] (iteration 0: the pretrained model, identical); "
        "no correction: read as a curve, not as tests; N80 at the observed difference.",
        "",
        "| iteration | " + " | ".join(f"{lbl}: {m[5:]}" for lbl in full for m in ALONG) + " |",
        "|---" * (1 + len(full) * len(ALONG)) + "|",
    ]
    for i, it in enumerate(iters[1:], start=1):

        def at(label, m, i=i):
            return res.values(
                group, label, lambda r: eval_curve(r, m)[2][i] if len(eval_curve(r, m)[2]) > i else np.nan
            )

        cells = [
            fmt_ci(*mean_ci(paired(at(lbl, m), at(base, m))), digits=4 if not is_frechet(m) else 0)
            if not is_frechet(m) or equal_n(res, group, (lbl, base))
            else UNEQUAL_N
            for lbl in full
            for m in ALONG
        ]
        lines.append(f"| {int(it)} | " + " | ".join(cells) + " |")
    return lines + [""]


JUDGES = ("eval/judge/cnn", "eval/judge/frechet")


def w_ratio(W) -> np.ndarray:
    """W_kj / (lambda_k / T): W against the uniform W of its own budgets (its row sums), 1 where uniform."""
    W = np.asarray(W, dtype=float)
    return W / (W.sum(1, keepdims=True) / W.shape[1])


def w_departure(W) -> float:
    """max_kj |W_kj / (lambda_k / T) - 1|: how far a logged W is from the uniform W of its own budgets."""
    return float(np.abs(w_ratio(W) - 1).max())


def report_recast_100(res: Results, out: Path):
    """The embedded default, 100 iterations: final held-out metrics per method, paired differences with
    95% intervals, the noise floor of one evaluation, and how far ReCAST's W left uniform."""
    lines = res.banner()
    by_label = res.runs["A"]
    labels = [lbl for lbl, runs in by_label.items() if runs]
    rows0 = next(iter(by_label[labels[0]].values()))
    metrics = (
        ["eval/weighted"]
        + sorted(k for k in rows0[-1] if k.startswith("eval/") and k != "eval/weighted" and k not in JUDGES)
        + list(JUDGES)
    )
    before = {m: rows0[0].get(m.replace("eval/", "eval_before/")) for m in metrics}
    lines += [
        "Final held-out evaluation (iteration 100; 16 held-out prompts, fixed seeds; mean ± sd over seeds). "
        "`frechet` is lower-is-better (drift from the data).",
        "",
        "| method | " + " | ".join(m[5:] for m in metrics) + " |",
        "|---" * (1 + len(metrics)) + "|",
        "| pretrained | " + " | ".join(f"{before[m]:.4f}" if before[m] is not None else "" for m in metrics) + " |",
    ]
    for label in labels:
        lines.append(
            f"| {label} (n={len(by_label[label])}) | "
            + " | ".join(mean_std(list(res.values("A", label, lambda r, m=m: final(r, m)).values())) for m in metrics)
            + " |"
        )
    pairs = [
        (a, b) for a, b in (("recast", "nft"), ("recast", "uniform"), ("uniform", "nft")) if a in labels and b in labels
    ]
    diffs = {
        (a, b): {
            m: mean_ci(
                paired(res.values("A", a, lambda r, m=m: final(r, m)), res.values("A", b, lambda r, m=m: final(r, m)))
            )
            for m in metrics
            if not is_frechet(m) or equal_n(res, "A", (a, b))
        }
        for a, b in pairs
    }
    adjusted = {
        m: dict(zip(pairs, holm([p_value(*diffs[k][m]) if m in diffs[k] else np.nan for k in pairs]))) for m in metrics
    }
    lines += [
        "",
        "Paired differences at the final evaluation (same seeds: same prompts and noise), mean [95% t interval]; Holm "
        f"per metric over these {len(pairs)} comparisons; N80 at the observed difference and level 0.05 / "
        f"{len(pairs)}:",
        "",
        "| difference | " + " | ".join(m[5:] for m in metrics) + " |",
        "|---" * (1 + len(metrics)) + "|",
    ]
    for a, b in pairs:
        d = diffs[(a, b)]
        lines.append(
            f"| {a} − {b} | "
            + " | ".join(
                fmt_ci(*d[m], p_holm=adjusted[m][(a, b)], family=len(pairs)) if m in d else UNEQUAL_N for m in metrics
            )
            + " |"
        )
    floor = [
        np.std([m["eval/weighted"] for m in rows if "eval/weighted" in m][-3:], ddof=1)
        for lbl in labels
        for rows in by_label[lbl].values()
    ]
    lines += [
        "",
        f"Noise floor of one evaluation: the sd of `eval/weighted` over each run's last three evaluations "
        f"(iterations 80, 90, 100; the weights move little there) is {np.mean(floor):.4f} on average over the "
        f"{len(floor)} runs.",
        "",
    ]
    if "recast" in labels:
        dev = [w_departure(rows[-1]["recast/W"]) for rows in by_label["recast"].values()]
        rho = [rows[-1]["recast/evidence"] for rows in by_label["recast"].values()]
        moved = [np.mean([max(m["recast/evidence"]) > 0 for m in rows]) for rows in by_label["recast"].values()]
        mean_dev = [np.mean([w_departure(m["recast/W"]) for m in rows]) for rows in by_label["recast"].values()]
        lines += [
            f"ReCAST's final W: max_kj |W / (lambda_k / T) - 1| = {', '.join(f'{d:.3f}' for d in dev)} (per seed); "
            f"evidence rho per reward: {'; '.join(str([round(v, 2) for v in r]) for r in rho)}. Over the run, W left "
            f"uniform (some rho > 0) in {', '.join(f'{v:.0%}' for v in moved)} of iterations; the mean over "
            "iterations of "
            f"that max deviation: {', '.join(f'{v:.3f}' for v in mean_dev)}.",
            "",
        ]
    curve_figure(res, out / "eval_vs_iteration.png", x="iteration")
    for judge in JUDGES:
        curve_figure(res, out / f"{judge.split('/')[-1]}_vs_iteration.png", metric=judge, x="iteration")
    return lines + ["![](eval_vs_iteration.png) ![](cnn_vs_iteration.png) ![](frechet_vs_iteration.png)", ""]


def report_nft_steps(res: Results, out: Path):
    """Held-out eval/weighted vs iteration for each number of optimizer steps per iteration."""
    lines = res.banner()
    base = res.exp.baseline
    for group, by_label in res.runs.items():
        labels = [label for label, runs in by_label.items() if runs]
        if not labels:
            continue
        curves = {
            label: {s: dict(zip(*eval_curve(rows)[::2])) for s, rows in by_label[label].items()} for label in labels
        }
        its = sorted({i for c in curves.values() for per_seed in c.values() for i in per_seed})
        others = [lbl for lbl in labels if lbl != base]
        lines += [
            "Held-out `eval/weighted` (mean ± sd over seeds) and the paired difference to " + base + " [95%]; "
            "no correction: read as a curve, not as tests; N80 at the observed difference:",
            "",
            "| iteration | " + " | ".join(labels) + " | " + " | ".join(f"{o} − {base}" for o in others) + " |",
            "|---" * (1 + len(labels) + len(others)) + "|",
        ]
        for i in its:
            at = {label: {s: c[i] for s, c in curves[label].items() if i in c} for label in labels}
            row = [mean_std(list(at[label].values())) for label in labels]
            row += [fmt_ci(*mean_ci(paired(at[o], at.get(base, {})))) for o in others]
            lines.append(f"| {int(i)} | " + " | ".join(row) + " |")
        lines.append("")
        judges = [j for j in JUDGES if any(j in rows[-1] for by in by_label.values() for rows in by.values())]
        lines += [
            "Held-out judges at the final evaluation (mean ± sd over seeds; `frechet`: lower is closer to the data):",
            "",
            "| method | " + " | ".join(j[11:] for j in judges) + " |",
            "|---" * (1 + len(judges)) + "|",
        ]
        lines += [
            f"| {label} (n={len(by_label[label])}) | "
            + " | ".join(mean_std(list(res.values(group, label, lambda r, j=j: final(r, j)).values())) for j in judges)
            + " |"
            for label in labels
        ]
        lines.append("")
    curve_figure(res, out / "eval_vs_iteration.png", x="iteration")
    curve_figure(res, out / "eval_vs_time.png")
    return lines + ["![](eval_vs_iteration.png) ![](eval_vs_time.png)", ""]


def power_lines(text: str, minutes) -> list[str]:
    """Markdown: how large a run would resolve the table's unresolved paired differences. Reads the `N80 N` that
    fmt_ci printed beside each unresolved difference (80% power, alpha 0.05, at the effect its table states); sizes
    this experiment at the smallest, median and largest N: `minutes(seeds)`, its wall-clock at that many seeds on 2
    cores with --jobs 2 (bench.estimate_minutes). No GPU rate is given: none has been measured here."""
    needs = [int(n) for n in re.findall(r"N80 (\d+)", text)]
    over = len(re.findall(r"N80 > ", text))
    if not needs and not over:
        return []
    lines = [
        "",
        "## Power",
        "",
        f"{len(needs) + over} paired difference(s) above are unresolved (`sd` is the sd of the paired differences, "
        "`N80` the seeds a paired t test needs for 80% power at the effect and level each table names"
        + (f"; {over} would need more than 10,000" if over else "")
        + "). This experiment at those sizes (all cells; `--seeds N`):",
        "",
        "| seeds | which | 2 cores, --jobs 2 |",
        "|---|---|---|",
    ]
    sizes = {}  # seeds -> which (the smallest, median and largest N80; one row when they coincide)
    for which, n in (
        ("largest", max(needs, default=0)),
        ("median", int(np.median(needs or [0]))),
        ("smallest", min(needs, default=0)),
    ):
        sizes[n] = which
    for n, which in sorted(sizes.items()):
        if n:
            lines.append(f"| {n} | {which} | ~{minutes(n) / 60:.1f} h |")
    return lines + [""]


# =============================================================================
# A report's section in Markdown (its results folder's README.md)
# =============================================================================


def results_block(text: str, records: list[dict], exp_dir: Path, md: Path, command: str) -> str:
    """table.md as a section of a Markdown file `md` (the results folder's README.md): its `# <experiment>` title
    dropped (md has its own), headings two levels down, figure links made relative to md; opened by the command and
    the runs' commits and dates (from the results themselves, so the block is the same bytes whenever it is
    rebuilt)."""
    shas = sorted({(r.get("git_sha") or "")[:7] for r in records} - {""})
    days = sorted({r["finished"] for r in records if r.get("finished")})
    when = f"{days[0]}{f' to {days[-1]}' if len(days) > 1 else ''}" if days else "date not recorded"
    made = f"commit {', '.join(shas)}" if shas else "commit not recorded"
    worlds = sorted({r.get("world") or "not recorded" for r in records})
    made += f", embedded world {', '.join(worlds)}"
    lines = [f"`{command}` ({len(records)} runs made at {made}, {when}):", ""]
    rel = Path(os.path.relpath(exp_dir, md.parent)).as_posix()
    rel = "" if rel == "." else rel + "/"  # md in the experiment's folder: the figures' own names
    body = text.splitlines()
    body = body[1:] if body and body[0].startswith("# ") else body
    for line in body[next((i for i, x in enumerate(body) if x.strip()), len(body)) :]:
        line = "##" + line if line.startswith("#") else line
        lines.append(re.sub(r"!\[([^\]]*)\]\(([^/():]+\.png)\)", lambda m: f"![{m[1] or m[2]}]({rel}{m[2]})", line))
    return "\n".join(lines).strip("\n")


def section_world(text: str):
    """The embedded world(s) a generated section names in its first line (`results_block`), or None."""
    found = re.search(r"embedded world ([^,]+), ", text.split("\n", 1)[0])
    return found[1] if found else None


def check_results_md(md: Path, name: str):
    """Refuse a --results-md that is a folder, lies in a missing folder, or whose markers of `name` are not one
    `<!-- BEGIN name -->` followed by one `<!-- END name -->`: a rebuild could then replace text that is not the
    section (a deleted END would take everything after BEGIN with it). Nothing is changed."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if md.is_dir():
        raise SystemExit(f"--results-md {md} is a folder: name a Markdown file (e.g. {md / 'RESULTS.md'})")
    if not md.parent.is_dir():
        raise SystemExit(f"--results-md {md}: its folder {md.parent} does not exist; create it or name another file")
    try:
        text = md.read_text() if md.exists() else ""
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"--results-md {md} cannot be read as text ({err}); name a Markdown file") from None
    if not os.access(md if md.exists() else md.parent, os.W_OK):
        raise SystemExit(f"--results-md {md} is not writable: make it writable, or name another file")
    lines = text.splitlines()
    at = {m: [i + 1 for i, line in enumerate(lines) if m in line] for m in (begin, end)}
    counts = text.count(begin), text.count(end)
    if counts == (0, 0) or counts == (1, 1) and text.find(begin) < text.find(end):
        return
    where = "; ".join(f"{m} on line(s) {', '.join(map(str, at[m])) or 'none'}" for m in (begin, end))
    raise SystemExit(
        f"{md}: the section's markers do not pair up ({where}), so its end is unknown and a rebuild could delete text "
        f"that is not the section. Leave exactly one {begin} before one {end} around the section (put a deleted END "
        "back where the section ends), then rerun; nothing was changed"
    )


def write_results_md(md: Path, name: str, block: str):
    """Replace what lies between md's markers of `name` with block (append the markers when absent); markers that do
    not pair up are refused (`check_results_md`)."""
    check_results_md(md, name)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    old = md.read_text() if md.is_file() else ""
    new = f"{begin}\n{block}\n{end}"
    i = old.find(begin)
    was = section_world(old[i + len(begin) :].lstrip("\n")) if i >= 0 else None
    if was is not None and was != section_world(block):
        raise SystemExit(
            f"{md}: its section {name} holds tables of embedded world {was}; these results are of world "
            f"{section_world(block)}, and one world's tables never replace another's. Keep the old section as a dated "
            f"record (rename its markers, e.g. <!-- BEGIN world-<name>/{name} -->, with its results moved to "
            f"experiments/results/world-<name>/{name}/) or delete it, then rerun; nothing was changed"
        )
    if i >= 0:
        text = old[:i] + new + old[old.index(end, i) + len(end) :]
    else:
        text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + new + "\n"
    if text != old:
        tmp = md.with_name(md.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, md)
