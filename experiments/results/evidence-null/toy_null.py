"""How far ReCAST's W leaves uniform when every reward is pure noise, in the Gaussian toy, through the shipped
credit code (toy_gaussian.credit_iteration: recast.tree_rollout, optimality, level_observations, level_curves,
credit_profiles, solve_W), at a chosen size, for each evidence rule the project has had:

    python experiments/results/evidence-null/toy_null.py K PROMPTS ITERATIONS GAIN_EMA REPS [--out FILE.json]
    python experiments/results/evidence-null/toy_null.py 2 PROMPTS ITERATIONS GAIN_EMA REPS --signal [--out FILE.json]

--signal: the power side instead. The toy's coarse and fine rewards (check 8: decided early and late, equal
budgets), whose exact W is known: per rule the final error mean_kj |W - W*| / (lambda_k / T) against the exact W and
against the uniform W's error (1 - error / uniform's error: the share of the way from uniform to exact).

Rules compared (evidence_weight's Q_k = sum_j z_kj^2 over the p measured inner levels, rho_k = max(0, 1 - c p / Q_k)):
- `normal, c=2`: the first rule (z taken as standard normal);
- `t, c=2` / `t, c=3`: each z_kj first mapped to the normal score of its t tail with nu = min(n_j, n_0) - 1 degrees of
  freedom (its standard error is estimated from n_j observations), then the same rule with c = 2 or 3
  (derivations.ipynb §6c), each reward tested alone;
- `t-fw, c=2`: the shipped rule: t-scored, and the threshold c p raised to the chi^2_p quantile at 1 - alpha / K,
  alpha = P(chi^2_p > c p), so that the chance that any of the K rewards passes under the null is <= alpha
  (Bonferroni, derivations.ipynb §6d).
Per rule: the final departure max_kj |W / W_unif - 1| over REPS runs (median, 95th percentile, max), the 95th
percentile over every iteration of every run, and the mean number of iterations off uniform.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import recast  # noqa: E402
import toy_gaussian as tg  # noqa: E402

ap = argparse.ArgumentParser()
for name, kind in (("K", int), ("prompts", int), ("iterations", int), ("gain_ema", float), ("reps", int)):
    ap.add_argument(name, type=kind)
ap.add_argument("--out", default="")
ap.add_argument("--signal", action="store_true")
a = ap.parse_args()
torch.set_num_threads(1)
sig = recast.shifted_sigmas(10)
shipped = recast.evidence_weight


def raw_z(D, se, c, n=None):  # the first rule: z taken as standard normal (the counts unused), each reward alone
    return shipped(D, se, c, family=False)


def per_reward(D, se, c, n=None):  # the second: t-scored z, each reward tested alone
    return shipped(D, se, c, n, family=False)


RULES = {"normal": raw_z, "t": per_reward, "t-fw": shipped}  # t-fw: the shipped rule


def departure(stats, rule):
    kind, c = rule
    recast.evidence_weight = RULES[kind]
    try:
        return tg.noise_departure(stats, sig, c)
    finally:
        recast.evidence_weight = shipped


rules = [("normal", 2.0), ("t", 2.0), ("t", 3.0), ("t-fw", 2.0)]
if a.signal:
    assert a.K == 2, "--signal uses the toy's two rewards (coarse, fine)"
    rng = np.random.default_rng(7)
    rewards = [tg.training_regime(rew, tg.MIX1, rng) for rew in (tg.COARSE1, tg.FINE1)]
    ts = np.unique(np.concatenate([np.linspace(0, 1, 41), sig]))
    exact = np.stack([np.interp(sig, ts, tg.exact_renyi(tg.MIX1, rew, ts, (2.0,), 1201)[0][0]) for rew in rewards])
    W_exact = recast.solve_W([1.0, 1.0], recast.profiles(recast.gains_on_grid(sig, exact, sig)[1]))
    err_uniform = float(np.abs(0.1 - W_exact).mean() / 0.1)
    errors = {r: [] for r in rules}
    for rep in range(a.reps):
        stats, gen = None, torch.Generator().manual_seed(1000 * rep + 7)
        for it in range(a.iterations):
            stats = tg.accumulate(
                stats, tg.credit_iteration(tg.MIX1, rewards, "rotate", a.prompts, it * a.prompts, 2, gen)[0], a.gain_ema
            )
        for kind, c in rules:
            recast.evidence_weight = RULES[kind]
            try:
                W = tg.credit_W(stats, sig, c=c)[0]
            finally:
                recast.evidence_weight = shipped
            errors[(kind, c)].append(float(np.abs(W - W_exact).mean() / 0.1))
    out = {"command": " ".join(["python", *sys.argv]), **{k: v for k, v in vars(a).items() if k != "out"}}
    out["uniform_W_error"] = err_uniform
    out["rules"] = {
        f"{kind}, c={c:g}": {"error_mean": float(np.mean(e)), "share_of_the_way": 1 - float(np.mean(e)) / err_uniform}
        for (kind, c), e in errors.items()
    }
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    sys.exit()
devs = {r: [] for r in rules}
for rep in range(a.reps):
    per = {r: [] for r in rules}
    for stats in tg.noise_stats(a.K, a.prompts, a.iterations, a.gain_ema, rep):
        for r in rules:
            per[r].append(departure(stats, r))
    for r in rules:
        devs[r].append(per[r])
out = {"command": " ".join(["python", *sys.argv]), **{k: v for k, v in vars(a).items() if k != "out"}, "rules": {}}
for (kind, c), d in devs.items():
    d = np.asarray(d)
    out["rules"][f"{kind}, c={c:g}"] = {
        "final_median": float(np.median(d[:, -1])),
        "final_p95": float(np.quantile(d[:, -1], 0.95)),
        "final_max": float(d[:, -1].max()),
        "all_iterations_p95": float(np.quantile(d, 0.95)),
        "iterations_off_uniform_mean": float((d > 1e-3).sum(1).mean()),
    }
print(json.dumps(out, indent=1))
if a.out:
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
