"""Tables and figure of the toy dose-response (PLAN.md), from the result files only.

    python experiments/results/scale-law/summarize.py   # -> tables.md, advantage_vs_M.png, summary.json

Reads toy/runs.csv, toy/credit.jsonl (run_toy.py) and measure.json (measure.py predict: the predicted crossing).
The analysis is PLAN.md's, fixed before the runs: per batch size M, each run's weighted-reward gain read at equal KL
(toy_train's rule: the level 0.5 x uniform's median final KL at that M, linear between evaluations), paired by seed;
primary: exact - uniform, as a share of uniform's gain, Holm over the sizes; secondary (each its own Holm family over
the sizes): exact - reversed, grad_uniform - uniform, online - uniform. The law's curve A(M) = A_max M / (M + M*) is
fitted to the primary means, with a bootstrap over seeds (the same seeds at every size) for M*. Only seeds finished
at a size enter that size's rows; the fit uses the seeds finished at every size.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from kit.stats import holm, mean_ci, p_value, seeds_for_power, sign_flip_p  # noqa: E402

from experiments import toy_train as tt  # noqa: E402

ARMS = ("uniform", "exact", "online", "grad_uniform", "reversed")
PRIMARY = ("exact", "uniform")
SECONDARY = (("exact", "reversed"), ("grad_uniform", "uniform"), ("online", "uniform"))
EFFECT = 0.02  # PLAN.md: 2% of uniform's gain at the primary level, at each M
LEVEL = 0.5  # the primary KL fraction
PLANNED_SIZES = (1, 4, 16, 64, 256)
PLANNED_SEEDS = 64


def read_runs(path):
    with open(path) as f:
        return [
            {
                k: (v if k in ("family", "arm") else (int(v) if k in ("groups", "seed", "iteration") else float(v)))
                for k, v in row.items()
            }
            for row in csv.DictReader(f)
        ]


def at_level(records, M, frac=LEVEL):
    """{arm: {seed: weighted gain at the level}}, the level, and uniform's mean gain there."""
    cur = {a: tt.gains(tt.run_curves(records, "recast", M, a, "weighted")) for a in ARMS}
    cur = {a: c for a, c in cur.items() if c}
    level = frac * float(np.median([kl[-1] for _, kl, _ in cur["uniform"].values()]))
    at = {a: {s: tt.value_at_level(kl, y, level) for s, (_, kl, y) in c.items()} for a, c in cur.items()}
    return at, level, tt.nan_mean(list(at["uniform"].values()))


def fit_law(M, y):
    """Least squares of y = A M / (M + Ms) over A and log Ms (grid over Ms, A closed form). Returns (A, Ms)."""
    M, y = np.asarray(M, float), np.asarray(y, float)
    best = (np.inf, np.nan, np.nan)
    for Ms in np.exp(np.linspace(np.log(0.01), np.log(1e5), 2001)):
        f = M / (M + Ms)
        A = float(f @ y / (f @ f))
        sse = float(((y - A * f) ** 2).sum())
        if sse < best[0]:
            best = (sse, A, Ms)
    return best[1], best[2]


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=str(HERE / "toy" / "runs.csv"))
    p.add_argument("--out", default=str(HERE), help="where tables.md, summary.json, advantage_vs_M.png go")
    a = p.parse_args(argv)
    out, runs_path = Path(a.out), Path(a.runs)
    records = read_runs(a.runs)
    measure = json.loads((HERE / "measure.json").read_text())
    pred = measure["predicted_crossing"]["toy_fine"]
    sizes = sorted({r["groups"] for r in records})
    comps = (PRIMARY,) + SECONDARY
    rows, per_seed = [], {}
    for M in sizes:
        at, level, ug = at_level(records, M)
        seeds = sorted(set.intersection(*(set(at[a]) for a in ARMS if a in at)))
        for a, b in comps:
            if a not in at or b not in at:
                continue
            d = np.array([at[a][s] - at[b][s] for s in seeds])
            m, lo, hi, n = mean_ci(d)
            sd = float(np.nanstd(d, ddof=1)) if n > 1 else np.nan
            rows.append(
                dict(
                    groups=M,
                    a=a,
                    b=b,
                    n=n,
                    kl_level=level,
                    uniform_gain=ug,
                    mean=m,
                    lo=lo,
                    hi=hi,
                    rel=m / ug,
                    rel_lo=lo / ug,
                    rel_hi=hi / ug,
                    sd=sd,
                    p=p_value(m, lo, hi, n) if n > 1 else np.nan,
                    exact_p=sign_flip_p(d[np.isfinite(d)]) if n > 1 else np.nan,
                    reached={x: int(np.isfinite(list(at[x].values())).sum()) for x in (a, b)},
                    runs=len(seeds),
                )
            )
            if (a, b) == PRIMARY:
                per_seed[M] = {s: at[a][s] - at[b][s] for s in seeds}
                per_seed[M] = {s: v / ug for s, v in per_seed[M].items()}
    for a, b in comps:
        fam = [r for r in rows if (r["a"], r["b"]) == (a, b) and np.isfinite(r["p"])]
        for r, ph in zip(fam, holm([r["p"] for r in fam])):
            r["p_holm"] = float(ph)
        for r, ph in zip(fam, holm([r["exact_p"] for r in fam])):
            r["exact_p_holm"] = float(ph)
        for r in fam:
            r["n80"] = seeds_for_power(EFFECT * abs(r["uniform_gain"]), r["sd"], alpha=0.05 / len(fam))
    # the law's curve on the primary advantage (share of uniform's gain), seeds finished at every size
    common = sorted(set.intersection(*(set(v) for v in per_seed.values()))) if per_seed else []
    fit = None
    if len(sizes) >= 3 and len(common) >= 4:
        Y = np.array([[per_seed[M][s] for M in sizes] for s in common])  # (seeds, sizes)
        ok = np.isfinite(Y).all(1)
        Y = Y[ok]
        A, Ms = fit_law(sizes, Y.mean(0))
        rng = np.random.default_rng(0)
        boot = np.array([fit_law(sizes, Y[rng.integers(0, len(Y), len(Y))].mean(0)) for _ in range(400)])
        hi_lo = Y[:, -1] - Y[:, 0]
        m, lo, hi, n = mean_ci(hi_lo)
        fit = dict(
            seeds=int(len(Y)),
            A_max=A,
            A_max_ci=np.quantile(boot[:, 0], [0.025, 0.975]).tolist(),
            M_star=Ms,
            M_star_ci=np.quantile(boot[:, 1], [0.025, 0.975]).tolist(),
            largest_minus_smallest=dict(mean=m, lo=lo, hi=hi, n=n, p=p_value(m, lo, hi, n)),
        )
    # descriptive (not in the plan's family): where exact - uniform comes from, per reward at the same KL level
    parts = []
    for M in sizes:
        at, level, ug = at_level(records, M)
        for key in ("coarse", "fine"):
            cur = {a: tt.gains(tt.run_curves(records, "recast", M, a, key)) for a in PRIMARY}
            v = {a: {sd: tt.value_at_level(kl, y, level) for sd, (_, kl, y) in c.items()} for a, c in cur.items()}
            seeds = sorted(set(v[PRIMARY[0]]) & set(v[PRIMARY[1]]))
            m, lo, hi, n = mean_ci([v[PRIMARY[0]][sd] - v[PRIMARY[1]][sd] for sd in seeds])
            base = tt.nan_mean(list(v["uniform"].values()))
            parts.append(dict(groups=M, reward=key, mean=m, lo=lo, hi=hi, n=n, uniform_gain=base))
    online = []
    cpath = runs_path.parent / "credit.jsonl"
    if cpath.exists():
        cred = [json.loads(x) for x in cpath.read_text().splitlines() if x.strip()]
        for M in sizes:
            cs = [c for c in cred if c["groups"] == M]
            if cs:
                online.append(
                    dict(
                        groups=M,
                        runs=len(cs),
                        W_distance=float(np.mean([c["W_distance"] for c in cs])),
                        rho=np.mean([c["rho"] for c in cs], 0).tolist(),
                        n_level=float(np.mean([np.mean(c["n"][1:-2]) for c in cs])),
                    )
                )
    counts = {M: len({r["seed"] for r in records if r["groups"] == M}) for M in sizes}
    summary = dict(
        sizes=sizes, seeds_finished=counts, rows=rows, fit=fit, predicted=pred, by_reward=parts, online=online
    )
    summary["verdict"] = verdict(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    write_tables(summary, out, measure)
    plot(summary, out)
    print((out / "tables.md").read_text())


def verdict(S):
    """PLAN.md's rules on the primary (exact - uniform, share of uniform's gain): (a) the rise, per-seed D(largest) -
    D(smallest) resolved above 0; (b) the low end, D(smallest)'s upper 95% bound below half of D(largest); (c) the
    fitted M*'s interval overlapping [5, 100]; (d) D(largest) resolved above 0 after Holm. Reproduced: all four;
    partly: (a) without (b) and (c) both; not reproduced (a flat line): D(smallest) resolved above 0 after Holm and
    D(largest) - D(smallest) below +2% (its upper bound); otherwise not shown at this size. PARTIAL when a planned size
    or seed is missing."""
    prim = {r["groups"]: r for r in S["rows"] if (r["a"], r["b"]) == PRIMARY}
    f = S["fit"]
    if not f or not prim:
        return dict(verdict="not readable yet", partial=True)
    lo_M, hi_M = min(prim), max(prim)
    lm = f["largest_minus_smallest"]
    a = lm["lo"] > 0
    b = prim[lo_M]["rel_hi"] < 0.5 * prim[hi_M]["rel"]
    c = f["M_star_ci"][0] <= 100 and f["M_star_ci"][1] >= 5
    d = prim[hi_M]["rel_lo"] > 0 and prim[hi_M].get("p_holm", 1) < 0.05
    flat = prim[lo_M]["rel_lo"] > 0 and prim[lo_M].get("p_holm", 1) < 0.05 and lm["hi"] < EFFECT
    if a and b and c and d:
        v = "reproduced"
    elif flat:
        v = "not reproduced (a flat line)"
    elif a:
        v = "partly"
    else:
        v = "not shown at this size"
    partial = tuple(S["sizes"]) != PLANNED_SIZES or any(n < PLANNED_SEEDS for n in S["seeds_finished"].values())
    return dict(verdict=v, rise=a, low_end=b, crossing=c, largest_resolved=d, flat=flat, partial=partial)


def fmt_p(p):
    """A sign-flip p past 25 seeds is a Monte Carlo share of kit.stats' 200,000 patterns: 0 means below 1 / 200,000."""
    return "< 5e-06" if p == 0 else f"{p:.3g}"


def fmt(m, lo, hi, d=4, pct=False):
    if pct:
        return f"{100 * m:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"
    return f"{m:+.{d}f} [{lo:+.{d}f}, {hi:+.{d}f}]"


def measure_lines(measure):
    """The inputs' tables from measure.json: s(t) per model, reward, level and estimate; the x0-error spectra and the
    bound; the predicted crossings."""
    rows = measure["rows"]
    L = ["## s(t): per-group signal-to-noise at the pretrained model (measure.json `rows`)", ""]
    L.append(
        "Groups of 8 leaves. toy: 4,096 groups, exact model, bootstrap over groups (`measure_toy.json`); embedded: the "
        "committed files named (LoRA space: phase_gate_splithalf.json, 256 groups, bootstrap; the split-half rounds' "
        "median cosine inverted, s = c / ((1 - c) M/2), their band the halvings' 5-95%, not a sampling interval; x0 "
        "space: signed_errors.json, 128 groups, bootstrap)."
    )
    L.append("")
    keys = list(dict.fromkeys((r["model"], r["reward"], r["space"], r.get("estimate", "")) for r in rows))
    ts = sorted({round(r["t"], 3) for r in rows if r["model"] == "embedded"}, reverse=True)
    tt_ = sorted({round(r["t"], 3) for r in rows if r["model"] == "toy"}, reverse=True)
    for model, tgrid in (("toy", tt_), ("embedded", ts)):
        L += tt.table_header("reward", "space / estimate", *[f"t={t:.3f}" for t in tgrid])
        for k in keys:
            if k[0] != model:
                continue
            cells = []
            for t in tgrid:
                r = next(
                    (
                        r
                        for r in rows
                        if (r["model"], r["reward"], r["space"], r.get("estimate", "")) == k and round(r["t"], 3) == t
                    ),
                    None,
                )
                cells.append(f"{r['s']:.4f} [{r['ci'][0]:.4f}, {r['ci'][1]:.4f}]" if r else "")
            L.append(f"| {k[1]} | {k[2]} {k[3]} | " + " | ".join(cells) + " |")
        L.append("")
    L += ["## The bound: within-group x0-error spectrum, (n - 1) lambda_max / tr Sigma_e(t)", ""]
    L.append(
        "lambda_max / tr: in-sample (biased up when the leaves are few against the dimension), its bias-corrected "
        "value and basic-bootstrap 95% interval, and cross-fitted (top direction from half the groups, variance along "
        "it on the other half; biased down); participation ratio tr^2 / tr Sigma^2 (bias-corrected, still biased "
        "down); the bound with n = 8 from the bias-corrected value."
    )
    L.append("")
    for name, sp, G in (
        ("toy", measure["toy_spectrum"], 4096),
        ("embedded", measure.get("embedded_spectrum"), measure.get("embedded_spectrum_groups")),
    ):
        if not sp:
            L.append(f"{name}: not measured (measure_embedded.json absent).")
            L.append("")
            continue
        L.append(f"{name} ({G} groups):")
        L.append("")
        L += tt.table_header(
            "t", "lambda_max / tr", "bias-corrected [95%]", "cross-fitted [95%]", "participation", "7 x lambda/tr"
        )
        for x in sp:
            L.append(
                f"| {x['t']:.3f} | {x['lam_ratio']:.4f} | {x['lam_ratio_bc']:.4f} [{x['lam_ratio_ci'][0]:.4f}, "
                f"{x['lam_ratio_ci'][1]:.4f}] | {x['lam_ratio_crossfit_bc']:.4f} [{x['lam_ratio_crossfit_ci'][0]:.4f}, "
                f"{x['lam_ratio_crossfit_ci'][1]:.4f}] | {x['participation_bc']:.0f} | {7 * x['lam_ratio_bc']:.3f} |"
            )
        L.append("")
    L.append(
        "embedded, the committed estimate (late-reward README section 8, from signed_errors.json's E|e|^2): "
        "N(t) = E|e|^2 (1 - t)^2 / t^2 latent numbers as unknown as the noise; spread evenly, lambda_max / tr = 1 / N "
        "and the bound (n - 1) / N (N above 1,024, the latent's size, is not a count of directions: t = 0.009):"
    )
    L.append("")
    L += tt.table_header("t", "E sum e^2", "N(t)", "bound, 8 leaves", "bound, 24 leaves")
    for x in measure["embedded_isotropic_bound"]["by_t"]:
        b8, b24 = (f"{x[k]:.4f}" if x[k] is not None else "-" for k in ("bound_8_leaves", "bound_24_leaves"))
        L.append(f"| {x['t']:.3f} | {x['x0_error_sq']:.1f} | {x['N']:.0f} | {b8} | {b24} |")
    L.append("")
    pc = measure["predicted_crossing"]
    L += ["## Predicted crossings M* = 1 / s(t) (measure.json `predicted_crossing`)", ""]
    L += tt.table_header("model, reward", "t", "M* [from s's 95% interval]")
    for name, key in (("toy, fine", "toy_fine"), ("embedded, grain", "embedded_grain")):
        for t, v in pc[key].items():
            L.append(f"| {name} | {t} | {v['M_star']:.0f} [{v['M_star_ci'][0]:.0f}, {v['M_star_ci'][1]:.0f}] |")
    sd = pc["sd35m"]
    L.append("")
    L.append(
        f"configs/recast-sd35m.yaml: {sd['groups_per_update']} groups per update, {sd['leaves_per_group']} leaves per "
        f"group; {sd['note']}: "
        + "; ".join(
            f"{t}: M s = {v['M_s']:.2f} [{v['M_s_ci'][0]:.2f}, {v['M_s_ci'][1]:.2f}]" for t, v in sd["by_t"].items()
        )
        + "."
    )
    if sd.get("bound_from_embedded_spectrum"):
        L.append("")
        L.append(
            "The bound's ceiling there, with the embedded model's spectrum standing in for SD3.5-M's: M (n - 1) "
            "lambda_max / tr = "
            + "; ".join(
                f"t={x['t']:.3f}: {x['M_s_ceiling']:.2f} [{x['M_s_ceiling_ci'][0]:.2f}, {x['M_s_ceiling_ci'][1]:.2f}]"
                for x in sd["bound_from_embedded_spectrum"]
            )
            + "."
        )
    L.append("")
    return L


def write_tables(S, out, measure):
    pred = S["predicted"]
    L = [
        "# scale-law: inputs and the toy dose-response (generated by `summarize.py` from measure.json and toy/runs.csv)"
    ]
    L.append("")
    L += measure_lines(measure)
    L += ["## The toy dose-response (PLAN.md, part 1)", ""]
    L.append(
        "Seeds finished per size (planned: "
        f"{PLANNED_SEEDS} at each of {list(PLANNED_SIZES)}): "
        + ", ".join(f"M = {M}: {n}" for M, n in S["seeds_finished"].items())
        + ". Only finished seeds are read; a size with fewer than the planned seeds is PARTIAL."
    )
    L.append("")
    L.append(
        "Predicted crossing (measure.json, the toy's fine reward, M* = 1 / s(t), params space): "
        + "; ".join(
            f"{k}: {v['M_star']:.0f} [{v['M_star_ci'][0]:.0f}, {v['M_star_ci'][1]:.0f}]" for k, v in pred.items()
        )
    )
    L.append("")
    L.append(
        "Paired differences of the weighted-reward gain at equal KL (0.5 x uniform's median final KL at that M), "
        "mean [95% t]; `share`: of uniform's gain at the level; Holm over the sizes within each comparison (the "
        "primary family is exact - uniform); exact: the sign-flip test; N80: seeds for 80% power at 2% of uniform's "
        "gain, alpha 0.05 / sizes, at the observed sd."
    )
    L.append("")
    L += tt.table_header(
        "M", "a - b", "n", "difference", "share of uniform's gain", "p", "p Holm", "exact p Holm", "N80", "reached"
    )
    for r in S["rows"]:
        n80 = r.get("n80")
        L.append(
            f"| {r['groups']} | {r['a']} - {r['b']} | {r['n']} | {fmt(r['mean'], r['lo'], r['hi'])} | "
            f"{fmt(r['rel'], r['rel_lo'], r['rel_hi'], pct=True)} | {r['p']:.3g} | {r.get('p_holm', np.nan):.3g} | "
            f"{fmt_p(r.get('exact_p_holm', np.nan))} | {n80 if n80 else '> 10000'} | "
            + ", ".join(f"{k} {v}/{r['runs']}" for k, v in r["reached"].items())
            + " |"
        )
    f = S["fit"]
    L.append("")
    if f:
        lm = f["largest_minus_smallest"]
        L.append(
            f"The law's curve fitted to exact - uniform (share of uniform's gain; {f['seeds']} seeds finished at every "
            f"size, bootstrap over seeds): A_max {100 * f['A_max']:+.2f}% [{100 * f['A_max_ci'][0]:+.2f}, "
            f"{100 * f['A_max_ci'][1]:+.2f}], M* {f['M_star']:.3g} [{f['M_star_ci'][0]:.3g}, {f['M_star_ci'][1]:.3g}]; "
            f"largest minus smallest M, per seed: {fmt(lm['mean'], lm['lo'], lm['hi'], pct=True)} (p {lm['p']:.3g})."
        )
    else:
        L.append("The law's curve is not fitted yet (needs >= 3 sizes and >= 4 seeds finished at every size).")
    L.append("")
    L.append(
        "Descriptive (not in the plan's family): exact - uniform on each trained reward's own gain at the same KL "
        "level, mean [95% t], and uniform's gain on it."
    )
    L.append("")
    L += tt.table_header("M", "reward", "n", "exact - uniform", "uniform's gain")
    for r in S.get("by_reward", []):
        L.append(
            f"| {r['groups']} | {r['reward']} | {r['n']} | {fmt(r['mean'], r['lo'], r['hi'])} | "
            f"{r['uniform_gain']:+.4f} |"
        )
    if S.get("online"):
        L.append("")
        L.append(
            "The online arm's estimator at the end of training (toy/credit.jsonl, mean over seeds): discounted "
            "observations per measured level, evidence weight rho (coarse, fine), ||W - W_exact||_F (uniform W: "
            "0.2666)."
        )
        L.append("")
        L += tt.table_header("M", "runs", "observations per level", "rho coarse", "rho fine", "W distance")
        for r in S["online"]:
            L.append(
                f"| {r['groups']} | {r['runs']} | {r['n_level']:.0f} | {r['rho'][0]:.2f} | {r['rho'][1]:.2f} | "
                f"{r['W_distance']:.4f} |"
            )
    v = S["verdict"]
    L.append("")
    L.append(
        f"PLAN.md's rules on these seeds: **{v['verdict']}**"
        + (" (PARTIAL: fewer seeds or sizes than planned)" if v.get("partial") else "")
        + (
            f"; (a) rise {v['rise']}, (b) low end below half {v['low_end']}, (c) crossing in [5, 100] {v['crossing']}, "
            f"(d) largest size resolved {v['largest_resolved']}, flat line {v['flat']}."
            if "rise" in v
            else "."
        )
    )
    (out / "tables.md").write_text("\n".join(L) + "\n")


def plot(S, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        PRIMARY: ("k", "o", "exact - uniform (primary)"),
        ("exact", "reversed"): ("tab:red", "s", "exact - reversed"),
        ("grad_uniform", "uniform"): ("tab:blue", "^", "grad_uniform - uniform"),
        ("online", "uniform"): ("tab:green", "v", "online - uniform"),
    }
    for k, (c, mk, lab) in styles.items():
        rs = [r for r in S["rows"] if (r["a"], r["b"]) == k]
        if not rs:
            continue
        x = np.array([r["groups"] for r in rs], float) * (1 + 0.04 * list(styles).index(k))
        y = np.array([r["rel"] for r in rs]) * 100
        e = np.array([[r["rel"] - r["rel_lo"], r["rel_hi"] - r["rel"]] for r in rs]).T * 100
        ax.errorbar(x, y, yerr=e, color=c, marker=mk, capsize=3, ls="-" if k == PRIMARY else ":", label=lab)
    f = S["fit"]
    if f:
        xs = np.exp(np.linspace(np.log(1), np.log(max(S["sizes"]) * 1.5), 200))
        ax.plot(xs, 100 * f["A_max"] * xs / (xs + f["M_star"]), "k--", lw=0.8, label=f"fit, M* = {f['M_star']:.3g}")
        ms = S["predicted"].get("t=0.250", {}).get("M_star")
        if ms:
            ax.plot(
                xs, 100 * f["A_max"] * xs / (xs + ms), color="tab:purple", ls=":", lw=1.2, label=f"law, M* = {ms:.0f}"
            )
    for key, v in S["predicted"].items():
        if key.startswith("t=0.25"):
            ax.axvline(v["M_star"], color="tab:purple", lw=1.2, label=f"predicted M* ({key}) = {v['M_star']:.0f}")
            lo, hi = v["M_star_ci"]
            ax.axvspan(lo, min(hi, 1e4), color="tab:purple", alpha=0.12)
    ax.axvspan(5, 100, color="tab:purple", alpha=0.05, label="crossing read as in [5, 100] (PLAN.md)")
    ax.axhline(0, color="grey", lw=0.6)
    ax.axhline(100 * EFFECT, color="grey", lw=0.6, ls="--", label="effect that matters (2%)")
    ax.set_xscale("log")
    ax.set_xlabel("groups per update M")
    ax.set_ylabel("advantage at equal KL, % of uniform's gain")
    n = ", ".join(f"{M}: {k}" for M, k in S["seeds_finished"].items())
    ax.set_title(f"toy: late credit vs batch size (seeds finished {n})", fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "advantage_vs_M.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
