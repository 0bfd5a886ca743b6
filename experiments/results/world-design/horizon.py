"""How many observations per level ReCAST's W needs (issue 24, step 4), from measured profiles.

    python experiments/results/world-design/horizon.py PROFILES.json REWARDS BUDGETS [--late NAME] [--out FILE.json]

The measured level statistics (n, s1, s2 of protocol.measure_profiles, n groups per level) are rescaled to n'
observations per level (same means and per-group variances, standard errors sqrt(n / n') larger), then W is built
as recast.py builds it (level_curves -> credit_profiles (evidence c = 2) -> solve_W at the default tau, eps). For
each n' it reports the evidence rho of every reward, max |K T W / Lam - 1| and the late reward's W over the last
three steps against its uniform share. A run's discounted level count after I iterations at gain_ema g and one
group per level per iteration (8 prompt groups, rotated layout) is (1 - g^I) / (1 - g), listed for the defaults.

"layouts": the same at the main command's compute (its 95 groups per level x 8 levels), spread over fewer branch
levels instead (a branch layout that skips the levels where no reward gains), and at twice that compute.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import recast  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("profiles")
ap.add_argument("rewards")
ap.add_argument("budgets")
ap.add_argument("--late", default="")
ap.add_argument("--out", default="")
a = ap.parse_args()
prof = json.loads(Path(a.profiles).read_text())
names = a.rewards.split(",")
budgets = [float(b) for b in a.budgets.split(",")]
rows = [prof["names"].index(k) for k in names]
n0, s1, s2 = np.asarray(prof["n"]), np.asarray(prof["s1"])[rows], np.asarray(prof["s2"])[rows]
sig = np.asarray(prof["sigmas"])
late = names.index(a.late) if a.late else None
T = len(sig) - 1
out = {"profiles": a.profiles, "rewards": names, "budgets": budgets, "n_measured": float(n0[1]), "by_n": []}
# the derivation: Q_k (the chi^2 of reward k's curve against the rewards' common shape, recast.evidence_weight) grows
# as p + n q_k with n groups per level; rho_k = max(0, 1 - c p / Q_k) >= 1/2 needs Q_k >= 2 c p, i.e.
# n >= (2 c p - p) / q_k with q_k = (Q_k(n_measured) - p) / n_measured.
D, se = recast.level_curves(n0, s1, s2)
inner = np.arange(1, T)
ok = np.isfinite(D[:, inner]).all(0)
j = inner[ok]
p = len(j)
shape = D[:, j].sum(0) / D[:, T].sum()
sd = np.sqrt(se[:, j] ** 2 + (shape * se[:, T:]) ** 2)
Q = (((D[:, j] - D[:, T:] * shape) / sd) ** 2).sum(1)
q = np.maximum(Q - p, 1e-9) / n0[1]
out["derivation"] = {
    "p_levels": int(p),
    "Q_measured": dict(zip(names, Q.round(2).tolist())),
    "q_per_group": dict(zip(names, q.round(4).tolist())),
    "n_for_rho_half (c = 2)": dict(zip(names, ((2 * 2 * p - p) / q).round(1).tolist())),
}
print(out["derivation"])


def credit_at(scale):
    """W from the measured statistics rescaled per level by `scale` (T+1,): rho, W / uniform, and the row's numbers."""
    D, se = recast.level_curves(n0 * scale, s1 * scale, s2 * scale)
    _, _, P, rho = recast.credit_profiles(D, se, sig, n0 * scale)
    W = recast.solve_W(budgets, P)
    ratio = W / (W.sum(1, keepdims=True) / T)
    row = {"rho": rho.round(3).tolist(), "max_departure": float(np.abs(ratio - 1).max())}
    if late is not None:
        row["late_last3_vs_uniform"] = float(W[late, -3:].sum() / (budgets[late] * 3 / T))
    return ratio, row


for n in (5, 10, 20, 30, 40, 50, 60, 80, 100, 150, 1000, 100000):
    _, row = credit_at(np.full(T + 1, n / n0[1]))
    out["by_n"].append({"n": n, **row})
    print(out["by_n"][-1])
# the main command's group observations over its 8 rotated levels, from its run (experiments/results/world-design/main_command.json)
main_total = float(np.sum(json.loads((Path(__file__).parent / "main_command.json").read_text())["level_n"][1:9]))
out["layouts"] = []
for levels in (range(1, 9), range(2, 9), range(3, 9), range(4, 9), range(5, 9)):
    for total in (main_total, 2 * main_total):
        scale = np.zeros(T + 1)
        scale[list(levels)] = total / len(levels) / n0[list(levels)]
        scale[0] = scale[T] = total / n0[T]  # every group measures D(0) and the roots
        ratio, row = credit_at(scale)
        row = {"branch_levels": list(levels), "groups_per_level": round(total / len(levels), 1), **row}
        if late is not None:
            row["late_per_step_last3"] = ratio[late, -3:].round(3).tolist()
        out["layouts"].append(row)
        print(row)
out["n_eff"] = {
    f"gain_ema {g} x {it} iterations": (1 - g**it) / (1 - g)
    for g in (0.9, 0.95, 0.97, 0.98, 0.99, 0.999)
    for it in (80, 90, 100, 120)
}
if a.out:
    Path(a.out).write_text(json.dumps(out, indent=1))
