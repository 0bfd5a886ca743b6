"""PLAN.md's power numbers, from committed pilot files and kit.stats' power tools (written before any dose-response
run; no result of this folder is read).

    python experiments/results/scale-law/power.py   # -> power.json

Toy: the paired sd of exact - uniform at equal KL (primary level) from experiments/results/toy-train/summary.json
(64 seeds at 2 and 8 groups per update, the same world, arms and analysis), effect 2% of uniform's gain there, two-sided
paired t at 0.05 / 5 (Holm's first step over the 5 sizes): seeds for 80% power (`seeds_for_power`), its range over the
sd's 95% interval (`seeds_for_power_range`), and the smallest effect 64 seeds detect with 80% power at that level.
Embedded: grain's paired sd and one evaluation's noise floor from experiments/results/recast-steps (summary tables
quoted in its README: early34 - early12 on grain, sd 0.0113 over 20 seeds; grain's noise sd of one evaluation 0.0083),
the effect that matters two noise floors (`kit.stats.effect_of_interest`), one comparison per reading (alpha 0.05).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from kit.stats import effect_of_interest, seeds_for_power, seeds_for_power_range  # noqa: E402

SIZES = (1, 4, 16, 64, 256)
SEEDS = 64


def smallest_effect(sd, n, alpha):
    """The smallest effect (in sd units scanned finely) that n seeds detect with 80% power."""
    e = sd / 100
    while (seeds_for_power(e, sd, alpha=alpha) or 10**9) > n:
        e *= 1.01
    return e


def main():
    alpha = 0.05 / len(SIZES)
    tt = json.loads((ROOT / "experiments/results/toy-train/summary.json").read_text())
    toy = []
    for r in tt["recast"]:
        if r["kl_fraction"] == 0.5 and (r["a"], r["b"]) in (("exact", "uniform"), ("exact", "reversed")):
            effect = 0.02 * abs(r["uniform_gain"])
            toy.append(
                dict(
                    pilot_groups=r["groups"],
                    comparison=f"{r['a']} - {r['b']}",
                    pilot_n=r["n"],
                    sd=r["sd"],
                    effect=effect,
                    alpha=alpha,
                    n80=seeds_for_power(effect, r["sd"], alpha=alpha),
                    n80_range=seeds_for_power_range(effect, r["sd"], r["n"], alpha=alpha),
                    smallest_effect_at_64=smallest_effect(r["sd"], SEEDS, alpha),
                    smallest_effect_at_64_share=smallest_effect(r["sd"], SEEDS, alpha) / abs(r["uniform_gain"]),
                    # the sd doubled (it grew 1.8x from 2 to 8 groups): what 64 seeds then detect
                    smallest_effect_at_64_sd_x2_share=smallest_effect(2 * r["sd"], SEEDS, alpha)
                    / abs(r["uniform_gain"]),
                )
            )
    floor, sd, n = 0.0083, 0.0113, 20
    eff = effect_of_interest(0.0, floor)
    emb = dict(
        source="experiments/results/recast-steps/README.md (early34 - early12 on grain: sd 0.0113, 20 seeds; noise floor 0.0083)",
        sd=sd,
        pilot_n=n,
        noise_floor=floor,
        effect=eff,
        alpha=0.05,
        n80=seeds_for_power(eff, sd, alpha=0.05),
        n80_range=seeds_for_power_range(eff, sd, n, alpha=0.05),
    )
    out = dict(command="python experiments/results/scale-law/power.py", sizes=SIZES, seeds=SEEDS, toy=toy, embedded=emb)
    (HERE / "power.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
