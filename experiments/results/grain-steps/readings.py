"""grain-steps' planned readings (README.md, "Plan"), computed from the committed result files alone: the primary test
(the moved reward at equal iterations, each run's final evaluation averaged over its two noise sets) and the secondary
family (the same at equal velocity-space distance and at equal image-space distance, the held-out judges), Holm over
the secondary family. Written before any grain-steps run; checked on recast-steps' files (the same design on
saturation), which is where the plan's sd comes from:

    python experiments/results/grain-steps/readings.py                      # grain-steps: decided - consistent, grain
                                                                            # (and its permuted control, once run)
    python experiments/results/grain-steps/readings.py --exp recast-steps --mine early34 --other early12
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from experiments import stats  # noqa: E402
from experiments.protocol import EVAL_SEEDS  # noqa: E402
from experiments.reports import distance_to_base  # noqa: E402

EFFECT = 0.005  # the effect that matters on grain (README)
NOISES = tuple(str(s) for s in EVAL_SEEDS)  # the final evaluation's two noise sets


def final(folder: Path, arm: str, seed: int) -> dict:
    """{noise set: {metric: per-image list or scalar}} of one run's final evaluation."""
    return json.loads((folder / f"A_uniform_{arm}-seed{seed}.final.json").read_text())["scores"]


def distance(folder: Path, arm: str, seed: int) -> float:
    """The run's velocity-space distance to the base model: `loss/base_reg` over its last 10 iterations."""
    return distance_to_base(json.loads(gzip.open(folder / f"A_uniform_{arm}-seed{seed}.json.gz").read())["rows"])


def mean_over(scores: dict, metric: str, noises=NOISES) -> float:
    """The metric's mean over the images of each noise set, averaged over `noises`."""
    return float(np.mean([np.nanmean(np.asarray(scores[n][metric], dtype=float)) for n in noises]))


def fmt(m, lo, hi, p, digits=4):
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] p {p:.2g}"


def readings(folder: Path, mine: str, other: str, reward: str, seeds: int) -> list[str]:
    per = [(final(folder, mine, s), final(folder, other, s)) for s in range(seeds)]
    diff = lambda metric, noises=NOISES: [mean_over(a, metric, noises) - mean_over(b, metric, noises) for a, b in per]  # noqa: E731
    y = diff(reward)
    m, lo, hi, n = stats.mean_ci(y)
    p = stats.p_value(m, lo, hi, n)
    tost = max(stats.non_inferiority((m, lo, hi, n), EFFECT, 1), stats.non_inferiority((m, lo, hi, n), EFFECT, -1))
    lines = [
        f"{mine} − {other}, {n} paired seeds, final evaluation (every held-out caption x 4 noises), each run's value the",
        f"mean over its two noise sets ({', '.join(NOISES)}).",
        "",
        f"Primary, {reward} at equal iterations: {fmt(m, lo, hi, p)}, exact p {stats.sign_flip_p(y):.2g}, sd "
        f"{np.std(y, ddof=1):.4f}; equivalence within ±{EFFECT} (two one-sided tests) p {tost:.2g}; N80 at {EFFECT} "
        f"{stats.seeds_for_power(EFFECT, np.std(y, ddof=1))}",
    ]
    for noise in NOISES:  # the bench table reads the first set alone
        yn = diff(reward, (noise,))
        mn, lon, hin, nn = stats.mean_ci(yn)
        lines.append(f"  noise set {noise} alone: {fmt(mn, lon, hin, stats.p_value(mn, lon, hin, nn))}")
    d_v = [np.log(distance(folder, mine, s) / distance(folder, other, s)) for s in range(seeds)]
    d_i = [
        np.mean([np.log(float(a[k]["judge/frechet"]) / float(b[k]["judge/frechet"])) for k in NOISES]) for a, b in per
    ]
    secondary = {}
    for name, x in (("velocity-space distance (base_reg)", d_v), ("image-space distance (Fréchet)", d_i)):
        a, alo, ahi, ap, xlo, xhi = stats.adjusted_difference(y, x, ["A"] * seeds)[0]["A"]
        secondary[f"{reward} at equal {name}"] = (fmt(a, alo, ahi, ap) + f" (log ratios [{xlo:+.2f}, {xhi:+.2f}])", ap)
    for metric in ("judge/cnn", "judge/frechet"):
        mm, mlo, mhi, mn = stats.mean_ci(diff(metric))
        pm = stats.p_value(mm, mlo, mhi, mn)
        secondary[f"{metric} at equal iterations"] = (fmt(mm, mlo, mhi, pm, 4 if metric == "judge/cnn" else 1), pm)
    shares = [np.mean([stats.pref_share(a[k]["judge/pref"], b[k]["judge/pref"]) for k in NOISES]) for a, b in per]
    lm, llo, lhi, ln = stats.share_logits(shares)
    pp = stats.p_value(lm, llo, lhi, ln)
    expit = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    secondary[f"pref share for {mine}"] = (f"{expit(lm):.3f} [{expit(llo):.3f}, {expit(lhi):.3f}] p {pp:.2g}", pp)
    adjusted = stats.holm([p for _, p in secondary.values()])
    lines += ["", f"Secondary (Holm over these {len(secondary)}):"]
    lines += [f"- {k}: {v} Holm {h:.2g}" for (k, (v, _)), h in zip(secondary.items(), adjusted)]
    lines += [
        "",
        "Reported, not tested: distance ratio mine / other, velocity space "
        f"{np.exp(np.mean(d_v)):.3f}, image space {np.exp(np.mean(d_i)):.3f} (geometric means over seeds).",
    ]
    return lines


def control_lines(folder: Path, control: Path, reward: str, seeds: int) -> list[str]:
    """The control the plan names for a positive primary: the same two W with the reward permuted within each prompt
    group (grain-steps-permuted). Per seed (decided - consistent) - (decided_permuted - consistent_permuted) on the
    reward, each run's value the mean over both noise sets; D needs it resolved above 0 (paired t and exact test)."""

    def arm_diff(where, mine, other, noises=NOISES):
        return np.array(
            [
                mean_over(final(where, mine, s), reward, noises) - mean_over(final(where, other, s), reward, noises)
                for s in range(seeds)
            ]
        )

    lines = [f"Control (grain-steps-permuted, {reward} permuted within each prompt group), {seeds} paired seeds:"]
    for noises, label in ((NOISES, "both noise sets"), *(((n,), f"noise set {n} alone") for n in NOISES)):
        y = arm_diff(folder, "decided", "consistent", noises)
        yc = arm_diff(control, "decided_permuted", "consistent_permuted", noises)
        cm, clo, chi, cn = stats.mean_ci(yc)
        dm, dlo, dhi, dn = stats.mean_ci(y - yc)
        lines.append(
            f"  {label}: decided_permuted − consistent_permuted {fmt(cm, clo, chi, stats.p_value(cm, clo, chi, cn))};"
            f" difference of differences {fmt(dm, dlo, dhi, stats.p_value(dm, dlo, dhi, dn))}, exact p "
            f"{stats.sign_flip_p(y - yc):.2g}"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", default="grain-steps", help="the experiment's folder under experiments/results/")
    parser.add_argument("--mine", default="decided")
    parser.add_argument("--other", default="consistent")
    parser.add_argument("--reward", default="grain")
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args(argv)
    folder = ROOT / "experiments" / "results" / args.exp / "runs"
    print("\n".join(readings(folder, args.mine, args.other, args.reward, args.seeds)))
    control = ROOT / "experiments" / "results" / f"{args.exp}-permuted" / "runs"
    if args.exp == "grain-steps" and control.is_dir():
        print("\n" + "\n".join(control_lines(folder, control, args.reward, args.seeds)))


if __name__ == "__main__":
    main()
