"""recast.py and the skeleton both scripts share, from fast to slow: hand-computed values, vectorised vs naive
loops, properties of the W solver, the shared block's identity check, then end-to-end runs of both scripts on a
tiny random SD3 pipeline (run folders, resume, locks, several processes) and on the embedded model.
RVGE's math: test_rvge.py; reward models: test_reward_models.py; the toy: test_toy_gaussian.py.
Run: python -m pytest -q
"""

import itertools
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import recast
import reward_models
import rvge

# -----------------------------------------------------------------------------
# Budgets
# -----------------------------------------------------------------------------


def test_parse_budgets_reads_and_keeps_scale():
    assert recast.parse_budgets("0.4,0.3,0.2,0.1") == [0.4, 0.3, 0.2, 0.1]
    assert recast.parse_budgets(" 2, 0 ,1 ") == [2.0, 0.0, 1.0]  # not normalised


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("0.4,abc", "not a number"),
        ("0.4,,0.1", "not a number"),
        ("nan,1", "finite"),
        ("inf", "finite"),
        ("0.5,-0.1", "negative"),
        ("0,0,0", "all budgets are zero"),
    ],
)
def test_parse_budgets_errors_name_the_problem_and_the_fix(text, words):
    with pytest.raises(ValueError) as err:
        recast.parse_budgets(text)
    assert words in str(err.value) and "--budgets" in str(err.value)


# -----------------------------------------------------------------------------
# Optimality probabilities (NOTES.md §2)
# -----------------------------------------------------------------------------


def test_optimality_hand_computed():
    R = np.array([1.0, 3.0, 10.0, 10.0])
    groups = np.array([0, 0, 1, 1])
    std = R.std()  # global std over the batch
    r = recast.optimality(R, groups)
    A = np.array([-1.0, 1.0, 0.0, 0.0]) / (std + 1e-4)
    assert np.allclose(r, 0.5 + 0.5 * np.clip(A, -5, 5) / 5)
    assert np.allclose(r[2:], 0.5)  # a tied group: r = 0.5, never NaN


def test_optimality_clips_and_handles_nan_and_all_ties():
    R = np.array([[0.0, 1.0], [0.0, np.nan], [0.0, 100.0], [0.0, 1.0]])
    r = recast.optimality(R, [0, 0, 0, 0], std=np.array([1.0, 1e-3]))
    assert np.all(np.isfinite(r)) and np.all((r >= 0) & (r <= 1))
    assert np.allclose(r[:, 0], 0.5)  # every reward tied
    assert r[1, 1] == 0.5  # NaN left out: no preference
    assert r[2, 1] == 1.0 and r[0, 1] == 0.0  # clipped at +-5 -> {0, 1}
    # the NaN is excluded from the group mean: mean of (1, 100, 1) = 34
    assert np.isclose(recast.optimality(R[:, 1], [0] * 4, std=1e3)[0], 0.5 + 0.5 * (1 - 34) / (1e3 + 1e-4) / 5)


def test_combine_raw_is_the_budget_weighted_sum():
    R = np.array([[1.0, 2.0], [3.0, np.nan]])
    out = recast.combine_raw(R, [0.25, 0.75])
    assert out[0] == 0.25 + 1.5 and np.isnan(out[1])


# -----------------------------------------------------------------------------
# Renyi curves (NOTES.md §3.2-3.3)
# -----------------------------------------------------------------------------


def test_renyi_alpha2_is_log_one_plus_relative_variance():
    h = np.random.default_rng(0).uniform(0.1, 0.9, size=1000)
    assert np.isclose(recast.renyi_from_h(h, 2.0), np.log(1 + h.var() / h.mean() ** 2))


def test_renyi_orders_are_ordered_and_kl_is_the_limit():
    h = np.random.default_rng(1).uniform(0.05, 0.95, size=500)
    D = [recast.renyi_from_h(h, a) for a in (0.5, 0.999, 1.0, 1.001, 2.0, 3.0)]
    assert np.all(np.diff(D) >= -1e-12)  # D_alpha non-decreasing in alpha
    assert abs(D[1] - D[2]) < 1e-3 and abs(D[3] - D[2]) < 1e-3
    assert abs(recast.renyi_from_h(np.full(10, 0.3), 2.0)) < 1e-12 and recast.renyi_from_h(np.zeros(5), 1.0) == 0.0


def test_split_levels_by_hand():
    anc = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]])
    S = recast.split_levels(anc)
    assert S[0, 1] == 2 and S[0, 2] == 1 and S[0, 3] == 0 and S[0, 0] == 3 and (S == S.T).all()


def test_pair_moments_match_a_naive_loop():
    rng = np.random.default_rng(2)
    anc = np.array(list(itertools.product(range(3), range(2), range(2))))  # 3 roots x 2 x 2
    anc = np.concatenate([anc, anc + [3, 0, 0]])  # two prompt groups
    groups = np.repeat([0, 1], 12)
    r = rng.random((24, 2))
    sums, counts = recast.pair_moments(r, groups, anc)
    naive_s, naive_c = np.zeros((2, 4)), np.zeros(4)
    for a in range(24):
        for b in range(24):
            if groups[a] != groups[b]:
                continue
            level = 0
            while level < 3 and anc[a, level] == anc[b, level]:
                level += 1
            naive_s[:, level] += r[a] * r[b]
            naive_c[level] += 1
    assert np.allclose(sums, naive_s) and np.array_equal(counts, naive_c)
    assert counts[-1] == 24  # each leaf with itself
    D = recast.pairs_curve(sums, counts)
    assert np.allclose(D[:, 0], 0.0)


def test_pairs_estimator_sees_a_coarse_reward_early():
    """Leaves of one root share a reward decided at the root (coarse): pairs split after the root
    are perfectly correlated, so D is already at its t = 0 value at the first branch level."""
    anc = np.array(list(itertools.product(range(8), range(2), range(2))))
    root_value = np.random.default_rng(3).integers(0, 2, 8).astype(float)
    r = root_value[anc[:, 0]][:, None] * 0.8 + 0.1
    D = recast.pairs_curve(*recast.pair_moments(r, np.zeros(len(r)), anc))[0]
    assert D[1] > 0.1 and np.allclose(D[1:], D[-1])


def test_denoised_moments_reduce_to_renyi_from_h():
    rng = np.random.default_rng(4)
    h = rng.uniform(0.1, 0.9, size=(3, 16, 2))
    for alpha in (0.5, 1.0, 2.0):
        sums, counts = recast.denoised_moments(h, alpha)
        D = recast.renyi_from_moment(sums / counts, alpha)
        assert np.allclose(D, recast.renyi_from_h(np.moveaxis(h, 1, -1), alpha).T)


def test_branch_layout_rotates_over_every_inner_step():
    T = 10
    seen = [recast.branch_layout(8, T, "rotate", offset=it * 8) for it in range(3)]
    assert all(len(b) == 1 and 1 <= b[0] <= T - 2 for layout in seen for b in layout)
    assert sorted(b[0] for b in seen[0]) == list(range(1, T - 1))  # 8 groups cover the 8 inner steps
    assert seen[1] == seen[0] and recast.branch_layout(3, T, [3, 6]) == [[3, 6]] * 3
    assert [b[0] for b in recast.branch_layout(3, T, "rotate", offset=7)] == [8, 1, 2]


def test_level_observations_match_a_naive_loop():
    """Two prompt groups branching at different steps (2 roots x 3 children): each group adds one
    paired difference (sibling mean product - cross-root mean product) at its own level and one at t = 0."""
    rng = np.random.default_rng(5)
    T, layouts = 10, [[2], [7]]
    anc = np.array(list(itertools.product(range(2), range(3))))
    anc = np.concatenate([anc, anc + [2, 0]])
    groups = np.repeat([0, 1], 6)
    r = rng.random((12, 2))
    n, s1, s2 = recast.level_observations(r, groups, anc, layouts, T)
    for g, j in ((0, 2), (1, 7)):
        rows = np.flatnonzero(groups == g)
        sib = [r[a] * r[b] for a in rows for b in rows if a != b and anc[a, 0] == anc[b, 0]]
        cross = [r[a] * r[b] for a in rows for b in rows if anc[a, 0] != anc[b, 0]]
        assert np.allclose(s1[:, j], np.mean(sib, 0) - np.mean(cross, 0))
        assert np.allclose(s2[:, j], (np.mean(sib, 0) - np.mean(cross, 0)) ** 2)
    assert n.tolist() == [2, 0, 1, 0, 0, 0, 0, 1, 0, 0, 2]
    D, se = recast.level_curves(n, s1, s2)
    assert (
        np.isnan(D[:, 2]).all() and np.isfinite(D[:, 10]).all() and (D[:, 0] == 0).all()
    )  # one observation: no error bar
    base = s1[:, 0] / 2
    assert np.allclose(D[:, 10], np.log1p(s1[:, 10] / 2 / base))
    assert np.allclose(se[:, 10], np.sqrt((s2[:, 10] / 2 - (s1[:, 10] / 2) ** 2) * 2 / 1 / 2) / base)


def test_evidence_keeps_W_uniform_for_identical_profiles_and_follows_clear_differences():
    T, sig = 10, recast.shifted_sigmas(10)
    frac = np.arange(T + 1) / T
    early, late = np.sqrt(frac) * 0.04, frac**3 * 0.04  # a coarse and a fine reward's curves, D(0) = 0.04
    n = np.full(T + 1, 50.0)
    rng = np.random.default_rng(0)
    se = np.full((2, T + 1), 0.002)
    se[:, 0] = 0
    same = np.stack([early, early]) + rng.normal(0, 0.002, (2, T + 1)) * (frac > 0)
    W_same = recast.solve_W([1, 1], recast.credit_profiles(same, se, sig, n)[2])
    assert np.allclose(W_same, 0.1, atol=1e-6)  # no evidence that the profiles differ: uniform W
    differ = np.stack([early, late])
    _, _, P, rho = recast.credit_profiles(differ, se, sig, n)
    W = recast.solve_W([1, 1], P)
    assert (rho > 0.8).all() and W[0, :5].sum() > W[1, :5].sum() * 1.5  # the coarse reward gets the early steps
    assert recast.evidence_weight(differ, se * 100, c=2.0).max() == 0.0  # the same curves, buried in noise


def test_evidence_reads_estimated_errors_with_their_t_tails():
    """derivations.ipynb §6c: z from errors estimated on n observations is scored by its t tail (nu = n - 1).
    Two rewards departing from their common shape by z = +2 / -2 at all 9 inner levels: raw, Q = 9 * 4 = 36 = 4p,
    rho = 1 - 2p / Q = 0.5; at n = 3 (nu = 2, where F_t(z) = 1/2 + z / (2 sqrt(2 + z^2))) the normal score of z = 2
    is Phi^-1(1 - (1/2 - 1/sqrt 6)) = 1.330, Q = 9 * 1.77 < 2p, so rho = 0; at large n the raw rule is back."""
    from scipy.stats import norm

    T, s = 10, 0.01
    shape = np.arange(T + 1) / T
    se = np.full((2, T + 1), s)
    se[:, 0] = 0.0
    a = 2.0 * np.sqrt(s**2 + (shape * s) ** 2)  # z = a / sd = 2 at every level
    D = np.stack([shape + a, shape - a])
    D[:, 0], D[:, T] = 0.0, 1.0
    n = lambda k: np.full(T + 1, k)  # noqa: E731 (k observations at every level)
    one = dict(family=False)  # each reward tested alone (the family threshold: the next test)
    assert np.allclose(recast.evidence_weight(D, se, 2.0, **one), 0.5)
    z_t2 = norm.isf(0.5 - 1 / np.sqrt(6))  # the normal score of z = 2 under t with 2 degrees of freedom
    assert np.isclose(recast.normal_score_of_t(np.array([2.0, -2.0]), 2.0), [z_t2, -z_t2]).all() and z_t2 < 1.34
    assert np.allclose(recast.evidence_weight(D, se, 2.0, n(3.0), **one), 0.0)
    assert np.allclose(recast.evidence_weight(D, se, 2.0, n(1e8), **one), 0.5, atol=1e-6)
    Dk, sek, nk = (np.ones((2, T + 1)) * shape, se, n(3.0))  # no departure at all: rho = 0 with either rule
    assert recast.evidence_weight(Dk, sek, 2.0, nk).max() == 0.0 == recast.evidence_weight(Dk, sek, 2.0).max()


def test_evidence_threshold_holds_the_family_rate_over_the_rewards():
    """derivations.ipynb §6d: with K rewards, W moves when any of K tests passes, so the threshold c p becomes the
    chi^2_p quantile at 1 - alpha / K, alpha = P(chi^2_p > c p). The same departure (z = +-2 at p = 9 levels, Q = 36)
    as above: alone rho = 1 - 18/36 = 0.5; in a family of K = 2, alpha = P(chi^2_9 > 18) = 0.0352 and the threshold
    is the chi^2_9 quantile at 1 - 0.0176 (19.9, computed here from scipy's chi^2, not from the code); K = 1 keeps
    c p; with K = 4 rewards (two of them flat) the threshold is higher still."""
    from scipy.stats import chi2

    T, s = 10, 0.01
    shape = np.arange(T + 1) / T
    a = 2.0 * np.sqrt(s**2 + (shape * s) ** 2)
    se = np.full((2, T + 1), s)
    se[:, 0] = 0.0
    D = np.stack([shape + a, shape - a])
    D[:, 0], D[:, T] = 0.0, 1.0
    q2 = chi2.ppf(1 - chi2.sf(18.0, 9) / 2, 9)
    assert 19.5 < q2 < 20.5 and np.allclose(recast.evidence_weight(D, se, 2.0), 1 - q2 / 36)
    single = recast.evidence_weight(D[:1], se[:1], 2.0)  # K = 1: c p, unchanged (its own shape: z = 0 here)
    assert np.array_equal(single, recast.evidence_weight(D[:1], se[:1], 2.0, family=False))
    D4, se4 = np.concatenate([D, np.stack([shape, shape])]), np.concatenate([se, se])  # two more rewards, on shape
    rho4 = recast.evidence_weight(D4, se4, 2.0)
    assert rho4[0] < recast.evidence_weight(D4, se4, 2.0, family=False)[0] and rho4[0] < 1 - q2 / 36


def test_gains_are_monotone_projected_and_telescope():
    sig = recast.shifted_sigmas(10, 3.0)
    t_levels = [1.0, 0.8, 0.6, 0.3, 0.0]
    D_raw = np.array(
        [
            [0.0, 0.2, 0.1, 0.4, 0.5],  # violates monotonicity at 0.6
            [0.0, -0.05, 0.0, 0.0, 0.3],  # negative noise
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )  # uninformative reward
    D_grid, gains = recast.gains_on_grid(t_levels, D_raw, sig)
    assert (gains >= 0).all() and np.allclose(D_grid[:, 0], 0.0)
    assert np.allclose(gains.sum(1), D_grid[:, -1], atol=1e-12)
    assert np.allclose(D_grid[:, -1], [0.5, 0.3, 0.0])
    assert np.allclose(recast.profiles(gains)[2], 0.1)  # no gain: uniform profile
    with pytest.raises(ValueError, match="t = 0"):
        recast.gains_on_grid([1.0, 0.5], D_raw[:, :2], sig)


# -----------------------------------------------------------------------------
# The W solver (NOTES.md §3.4)
# -----------------------------------------------------------------------------


def random_instance(seed, K=4, T=10):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.05, 1.0, K), rng.dirichlet(np.full(T, 0.5), size=K)


@pytest.mark.parametrize("seed", range(5))
def test_W_marginals(seed):
    lam, P = random_instance(seed)
    W = recast.solve_W(lam, P, tau=1.5, eps=1e-3)
    assert np.abs(W.sum(1) - lam).max() < 1e-9
    assert np.abs(W.sum(0) - lam.sum() / P.shape[1]).max() < 1e-9
    assert (W > 0).all()


def test_W_tau_zero_and_identical_profiles_are_uniform():
    lam, P = random_instance(7)
    U = recast.uniform_W(lam, P.shape[1])
    assert np.allclose(recast.solve_W(lam, P, tau=0.0), U, rtol=0, atol=1e-15)
    assert np.allclose(recast.solve_W(lam, np.repeat(P[:1], len(lam), 0), tau=2.0), U, rtol=0, atol=1e-12)


def test_W_permuting_rewards_permutes_rows():
    lam, P = random_instance(8)
    perm = np.array([2, 0, 3, 1])
    W = recast.solve_W(lam, P)
    assert np.allclose(recast.solve_W(lam[perm], P[perm]), W[perm], atol=1e-13)


def test_W_moves_credit_towards_informative_steps():
    lam = np.array([1.0, 1.0])
    early, late = np.linspace(1, 0.1, 10), np.linspace(0.1, 1, 10)
    P = np.stack([early / early.sum(), late / late.sum()])
    W = recast.solve_W(lam, P)
    assert W[0, 0] > W[1, 0] and W[0, -1] < W[1, -1]


@pytest.mark.parametrize("seed", range(3))
def test_W_agrees_with_pot_sinkhorn(seed):
    ot = pytest.importorskip("ot")
    lam, P = random_instance(seed + 20, K=3, T=7)
    tau, eps = 1.3, 1e-2
    W = recast.solve_W(lam, P, tau=tau, eps=eps)
    Kmat = lam[:, None] * ((1 - eps) * P + eps / 7) ** tau
    # entropic OT with cost -log K and reg 1 has the Gibbs kernel K itself
    W_pot = ot.sinkhorn(
        lam, np.full(7, lam.sum() / 7), -np.log(Kmat), reg=1.0, method="sinkhorn_log", stopThr=1e-15, numItermax=100000
    )
    assert np.allclose(W, W_pot, atol=1e-10)


def test_W_zero_budget_and_eps_zero():
    lam, P = random_instance(9)
    lam[1] = 0.0
    W = recast.solve_W(lam, P)
    assert (W[1] == 0).all() and np.abs(W.sum(0) - lam.sum() / 10).max() < 1e-9
    Wexact = recast.solve_W(lam, P, eps=0.0)  # strictly positive profile: allowed
    assert np.abs(Wexact.sum(1) - lam).max() < 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_W_col_sums_other_marginals_default_unchanged(seed):
    lam, P = random_instance(seed + 30)
    T = P.shape[1]
    # default and the explicit equal columns give the same W, bit for bit
    assert np.array_equal(recast.solve_W(lam, P), recast.solve_W(lam, P, col_sums=None))
    assert np.allclose(recast.solve_W(lam, P, col_sums=np.full(T, lam.sum() / T)), recast.solve_W(lam, P), atol=1e-12)
    cols = lam.sum() * np.geomspace(1, 4, T) / np.geomspace(1, 4, T).sum()
    W = recast.solve_W(lam, P, tau=1.5, col_sums=cols)
    assert np.abs(W.sum(1) - lam).max() < 1e-9 and np.abs(W.sum(0) - cols).max() < 1e-9 and (W > 0).all()
    # uniform profiles: the rank-one lambda_k c_j / Lam
    assert np.allclose(recast.solve_W(lam, np.full_like(P, 1 / T), col_sums=cols), np.outer(lam, cols) / lam.sum())
    # still the KL projection: W / K has the product form a_k b_j
    Kmat = lam[:, None] * ((1 - 1e-3) * P + 1e-3 / T) ** 1.5
    logratio = np.log(W / Kmat)
    assert np.abs(logratio - logratio[:, :1] - logratio[:1, :] + logratio[0, 0]).max() < 1e-9
    with pytest.raises(ValueError, match="col_sums"):
        recast.solve_W(lam, P, col_sums=cols[:-1])
    with pytest.raises(ValueError, match="col_sums"):
        recast.solve_W(lam, P, col_sums=2 * cols)


def test_W_input_errors():
    lam, P = random_instance(10)
    with pytest.raises(ValueError, match="shape"):
        recast.solve_W(lam[:3], P)
    with pytest.raises(ValueError, match="non-negative"):
        recast.solve_W(lam, -P)
    with pytest.raises(ValueError, match="non-negative"):
        recast.solve_W(-lam, P)
    P0 = P.copy()
    P0[0, 0] = 0.0
    with pytest.raises(ValueError, match="eps > 0"):
        recast.solve_W(lam, P0, eps=0.0)


# -----------------------------------------------------------------------------
# The mixed NFT loss (NOTES.md §2, §3.1)
# -----------------------------------------------------------------------------


def nft_batch(seed=0, N=6):
    g = torch.Generator().manual_seed(seed)
    shape = (N, 2, 3, 3)
    x0, eps, v_old, v_theta = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.rand(N, generator=g, dtype=torch.float64) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    return x0, x_t, v_old, v_theta, t


def test_nft_loss_matches_the_formula_by_hand():
    x0, x_t, v_old, v_theta, t = nft_batch()
    r, b = torch.rand(6, dtype=torch.float64), 0.7
    got = recast.nft_loss(v_theta, v_old, x_t, x0, t, r, b)
    for i in range(6):
        terms = []
        for v in ((1 - b) * v_old[i] + b * v_theta[i], (1 + b) * v_old[i] - b * v_theta[i]):
            err = x_t[i] - t[i] * v - x0[i]
            terms.append(float((err**2).mean() / err.abs().mean()))
        assert math.isclose(got[i].item(), 5 * (r[i] * terms[0] + (1 - r[i]) * terms[1]).item() / b, rel_tol=1e-12)


def diffusionnft_policy_loss(forward, old, xt, x0, t, advantages, beta, adv_clip_max=5.0):
    """Our own line-by-line transcription of DiffusionNFT's training-step policy loss
    (NVlabs/DiffusionNFT scripts/train_nft_sd3.py, ~L905-L960, read with `fetch`): clip the advantage,
    map it to r in [0, 1], positive / implicit-negative predictions, x0-space errors divided by a
    float64 no-grad mean-absolute weight (floored at 1e-5), mixed by r, divided by beta, times
    adv_clip_max, then the mean over the batch."""
    a = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    r = torch.clamp((a / adv_clip_max) / 2.0 + 0.5, 0, 1)
    te = t.view(-1, *([1] * (x0.ndim - 1)))
    dims = tuple(range(1, x0.ndim))
    pos = beta * forward + (1 - beta) * old.detach()
    neg = (1.0 + beta) * old.detach() - beta * forward
    out = []
    for pred in (pos, neg):
        x0_pred = xt - te * pred
        with torch.no_grad():
            w = torch.abs(x0_pred.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
        out.append(((x0_pred - x0) ** 2 / w).mean(dim=dims))
    return ((r * out[0] / beta + (1.0 - r) * out[1] / beta) * adv_clip_max).mean()


@pytest.mark.parametrize("b", [1.0, 0.1])
def test_nft_loss_is_diffusionnft_policy_loss_value_and_gradient(b):
    x0, x_t, v_old, v_theta, t = nft_batch(3, N=8)
    A = torch.randn(8, dtype=torch.float64) * 4  # some beyond the clip
    ours_v, theirs_v = v_theta.clone().requires_grad_(True), v_theta.clone().requires_grad_(True)
    r = torch.as_tensor(recast.optimality(A.numpy() * 1.0, np.zeros(8), std=1.0 - 1e-4))  # A / (std + 1e-4) = A
    ours = recast.nft_loss(ours_v, v_old, x_t, x0, t, r, b).mean()
    theirs = diffusionnft_policy_loss(theirs_v, v_old, x_t, x0, t, A - A.mean(), b)
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-6 * abs(theirs.item())
    assert torch.allclose(ours_v.grad, theirs_v.grad, rtol=1e-6, atol=1e-12)


def test_old_decay_and_ema_decay_are_diffusionnft_schedules():
    def return_decay(step, decay_type):  # transcription of train_nft_sd3.py's return_decay
        flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
        return 0.0 if step < flat else min((step - flat) * uprate, uphold)

    for decay_type in (0, 1, 2):
        for step in (0, 1, 74, 75, 76, 200, 499, 500, 501, 10_000):
            assert recast.old_decay(step, decay_type) == return_decay(step, decay_type)
    assert recast.old_decay(76, 2) == pytest.approx(0.0075) and recast.old_decay(600, 1) == 0.5
    assert [recast.ema_decay(s) for s in (0, 1, 80, 81, 1000)] == [0.1, 2 / 11, 81 / 90, 0.9, 0.9]


def test_dpm2_step_is_diffusers_dpm_solver_2m_on_flow_sigmas():
    """DiffusionNFT's deterministic rollouts (DPM-Solver-2, multistep): our dpm2_step against diffusers'
    DPMSolverMultistepScheduler (flow sigmas, order 2, lower_order_final) with the exact velocity of
    N(0, 0.5) data; and its error on the exact ODE endpoint is about half of Euler's at 10 steps."""
    from diffusers import DPMSolverMultistepScheduler

    sch = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction", solver_order=2, lower_order_final=True
    )
    sch.set_timesteps(10)
    sig = sch.sigmas.double().numpy()
    s2 = 0.5
    vel = lambda x, t: x * (1 - (1 - t) * s2 / ((1 - t) ** 2 * s2 + t * t)) / t  # (x - E[x0 | x_t]) / t  # noqa: E731
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ours, theirs, euler, prev = x.clone(), x.clone(), x.clone(), None
    for i in range(10):
        t, t_next = float(sig[i]), float(sig[i + 1])
        theirs = sch.step(vel(theirs, t), sch.timesteps[i], theirs, return_dict=False)[0]
        x0_hat = ours - t * vel(ours, t)
        ours, prev = recast.dpm2_step(ours, x0_hat, prev, float(sig[i - 1]) if i else 1.0, t, t_next), x0_hat
        euler = recast.ode_step(euler, vel(euler, t), t, t_next)
    assert (ours - theirs).abs().max() < 1e-5
    exact = x * math.sqrt(
        s2 / ((1 - sig[0]) ** 2 * s2 + sig[0] ** 2)
    )  # the exact flow map: x_t scaled by std(x0) / std(x_t)
    assert (ours - exact).abs().max() < 0.6 * (euler - exact).abs().max()  # measured: 0.23 against 0.46


def test_mixture_with_one_reward_is_diffusionnft_and_uniform_is_per_reward_normalisation():
    x0, x_t, v_old, v_theta, t = nft_batch(1)
    T = 10
    step = torch.arange(6) % T
    r1 = torch.rand(6, 1, dtype=torch.float64)
    W1 = torch.tensor(recast.uniform_W([0.7], T))
    assert torch.allclose(recast.mix_optimality(r1, W1, step), r1[:, 0])
    lam = [0.4, 0.3, 0.2, 0.1]
    r = torch.rand(6, 4, dtype=torch.float64)
    mixed = recast.mix_optimality(r, torch.tensor(recast.uniform_W(lam, T)), step)
    assert torch.allclose(mixed, r @ torch.tensor(lam, dtype=torch.float64) / sum(lam))
    # linear in r: the mixed loss is the W-weighted sum of per-reward losses
    W = torch.tensor(recast.solve_W(lam, np.random.default_rng(0).dirichlet(np.ones(T), 4)))
    mixed_loss = recast.nft_loss(v_theta, v_old, x_t, x0, t, recast.mix_optimality(r, W, step))
    per_reward = torch.stack([recast.nft_loss(v_theta, v_old, x_t, x0, t, r[:, k]) for k in range(4)], 1)
    weights = W[:, step].T * T / W.sum()
    assert torch.allclose(mixed_loss, (weights * per_reward).sum(1))


# -----------------------------------------------------------------------------
# The SDE step (NOTES.md §1)
# -----------------------------------------------------------------------------


def test_sde_step_is_the_reverse_sde_euler_maruyama_step():
    x, v, s, s_next, a, s1 = 0.3, -1.2, 0.6, 0.5, 0.7, 0.9
    g2 = a * a * s / (1 - s)
    score = -(x + (1 - s) * v) / s  # from v = -(x + t score) / (1 - t)
    drift = v - g2 / 2 * score
    assert math.isclose(recast.sde_step(x, v, s, s_next, a, s1, 0.0), x + drift * (s_next - s))
    assert math.isclose(
        recast.sde_step(x, v, s, s_next, a, s1, 1.0) - recast.sde_step(x, v, s, s_next, a, s1, 0.0),
        math.sqrt(g2 * (s - s_next)),
    )
    # at s = 1 the denominator uses s_1
    assert math.isfinite(recast.sde_step(x, v, 1.0, 0.9, a, 0.9, 1.0))


# -----------------------------------------------------------------------------
# The shared skeleton: one block, the same text at the end of recast.py and rvge.py (diffusers' check_copies idea)
# -----------------------------------------------------------------------------
# After editing recast.py's block, `python test_recast.py --fix-copies` rewrites rvge.py's.

SHARED_BANNER = "# DiffusionNFT skeleton and run machinery: identical in recast.py and rvge.py"


def shared_block(source):
    """The text of a script from the line holding SHARED_BANNER to the end of the file (with its banner)."""
    start = source.index(SHARED_BANNER)
    return source[source.rindex("\n", 0, start) + 1 :]


def fix_copies(original=Path(__file__).parent / "recast.py", copy=Path(__file__).parent / "rvge.py"):
    """Rewrite copy's shared block with original's (the method part above it stays)."""
    src, dst = original.read_text(), copy.read_text()
    copy.write_text(dst[: len(dst) - len(shared_block(dst))] + shared_block(src))


def test_the_shared_skeleton_is_one_identical_block_in_both_scripts():
    """recast.py and rvge.py: method first, then one shared block, the same text in both; no definition of the shared
    block is defined again above it, so `diff recast.py rvge.py` shows the two methods and nothing else."""
    here = Path(__file__).parent
    src, dst = (here / "recast.py").read_text(), (here / "rvge.py").read_text()
    assert shared_block(src) == shared_block(dst), (
        "rvge.py's shared block differs from recast.py's: change recast.py, then python test_recast.py --fix-copies"
    )
    import ast

    def names(text):
        tree = ast.parse(text)
        return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    shared = names(shared_block(src))
    for text in (src, dst):
        method = text[: len(text) - len(shared_block(text))]
        assert not names(method) & shared, "a shared definition is defined again in a method part"
        assert "# Copied from" not in text


def test_gain_init_reads_the_runs_rewards_rows_and_refuses_a_mismatch(tmp_path):
    """--gain-init: the rows of the run's rewards, in the run's order; other steps, a missing reward or a broken file
    are refused."""
    T, names = 4, ["a", "b", "c"]
    s1 = np.arange(3 * (T + 1), dtype=float).reshape(3, T + 1)
    saved = {
        "names": names,
        "steps": T,
        "estimator": "pairs",
        "n": [5.0] * (T + 1),
        "s1": s1.tolist(),
        "s2": (s1**2).tolist(),
    }
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(saved))
    n, got1, got2 = recast.initial_level_stats(path, ["c", "a"], T)
    assert (
        n.tolist() == [5.0] * (T + 1)
        and got1.tolist() == [s1[2].tolist(), s1[0].tolist()]
        and got2.tolist() == (got1**2).tolist()
    )
    with pytest.raises(SystemExit, match="--steps 10"):
        recast.initial_level_stats(path, ["a"], 10)
    with pytest.raises(SystemExit, match="holding rewards \\['a', 'zzz'\\]"):
        recast.initial_level_stats(path, ["a", "zzz"], T)
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="--gain-init"):
        recast.initial_level_stats(path, ["a"], T)


# -----------------------------------------------------------------------------
# recast.py end to end on a tiny random SD3 pipeline built from configs
# -----------------------------------------------------------------------------

TINY_WORDS = ["a", "red", "blue", "circle", "square", "two"]


def make_tiny_pipeline(path, seed=0):
    """A tiny random SD3 pipeline of the real diffusers classes (diffusers' get_dummy_components
    pattern), tokenizers built from a vocabulary: nothing is downloaded."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5Tokenizer,
    )

    torch.manual_seed(seed)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    merges = []
    for ch in sorted(set("".join(TINY_WORDS))):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    for w in TINY_WORDS:  # merge from the word's end so that every word is a single token
        parts = list(w[:-1]) + [w[-1] + "</w>"]
        while len(parts) > 1:
            merges.append((parts[-2], parts[-1]))
            vocab.setdefault(parts[-2] + parts[-1], len(vocab))
            parts = parts[:-2] + [parts[-2] + parts[-1]]
    clip_tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)
    clip_cfg = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    t5_tok = T5Tokenizer(
        vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in TINY_WORDS],
        model_max_length=16,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=8,
        ),
        vae=AutoencoderKL(
            block_out_channels=(8, 16),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            norm_num_groups=8,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            mid_block_add_attention=False,
            shift_factor=0.0,
            scaling_factor=1.0,
        ),
        text_encoder=CLIPTextModelWithProjection(clip_cfg),
        tokenizer=clip_tok,
        text_encoder_2=CLIPTextModelWithProjection(clip_cfg),
        tokenizer_2=clip_tok,
        text_encoder_3=T5EncoderModel(
            T5Config(vocab_size=len(t5_tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        ),
        tokenizer_3=t5_tok,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(path)
    return path


def brightness(images, prompts):
    return np.array([np.asarray(im, dtype=np.float64).mean() / 255 for im in images])


def redness(images, prompts):
    return np.array(
        [
            (np.asarray(im, dtype=np.float64)[..., 0] - np.asarray(im, dtype=np.float64)[..., 2]).mean() / 255
            for im in images
        ]
    )


TINY_REWARDS = {"brightness": brightness, "redness": redness}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    make_tiny_pipeline(root / "pipe")
    (root / "prompts.txt").write_text("a red circle\ntwo blue square\na blue circle\ntwo red square\n")
    return root


def tiny_argv(tiny, out, *more):
    return [
        "--model",
        str(tiny / "pipe"),
        "--rewards",
        "brightness,redness",
        "--budgets",
        "0.6,0.4",
        "--resolution",
        "16",
        "--max-sequence-length",
        "8",
        "--train-prompts",
        str(tiny / "prompts.txt"),
        "--eval-prompts",
        str(tiny / "prompts.txt"),
        "--prompts-per-iter",
        "2",
        "--out",
        str(out),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        *more,
    ]


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("credit, estimator", [("recast", "pairs"), ("recast", "denoised"), ("nft", "pairs")])
def test_recast_two_iterations_write_metrics_W_figures_and_a_loadable_lora(tiny, tmp_path, credit, estimator):
    out = tmp_path / "run"
    argv = tiny_argv(
        tiny, out, "--iterations", "2", "--eval-every", "1", "--credit", credit, "--gain-estimator", estimator
    )
    if estimator == "denoised":
        argv += ["--alpha", "1.0"]
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    rows = read_metrics(out)
    assert [m["iteration"] for m in rows] == [0, 1]
    for m in rows:
        W = np.array(m["recast/W"])
        assert np.abs(W.sum(1) - [0.6, 0.4]).max() < 1e-9 and np.abs(W.sum(0) - 1.0 / 10).max() < 1e-9
        D = np.array(m["recast/D"])
        assert D.shape == (2, 11) and np.allclose(D[:, 0], 0) and (np.diff(D, axis=1) >= -1e-12).all()
        assert np.isfinite([m["loss/policy"], m["reward/weighted"], m["eval/brightness"]]).all()
    assert "eval_before/brightness" in rows[0]
    for fig in ("rewards.png", "credit.png", "samples_before.png", "samples_after.png"):
        assert (out / fig).stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["args"]["credit"] == credit
    assert not (out / "tensorboard").exists()  # --report-to none: metrics.jsonl only
    assert_loads_as_trained(recast, out, out / "checkpoints" / (out / "checkpoints" / "latest").read_text())


def assert_loads_as_trained(script, out, folder, adapter="default"):
    """diffusers' own loader on a checkpoint folder gives the model the run trained: the transformer's output with
    pipe.load_lora_weights(folder) equals the training model's (the script's load_pipeline + load_checkpoint, the
    adapter active) to float tolerance, and the change from the base model is far above that tolerance (a LoRA
    loaded at the wrong scale, as with alpha != r and no alpha recorded, moves it by the wrong amount)."""
    from diffusers import StableDiffusion3Pipeline

    args = script.parse_args(["--resume", str(out)])
    assert args.lora_alpha != args.lora_rank, "the check needs alpha != r to see a wrong scale"
    trained = script.load_pipeline(args, "cpu", torch.float32).transformer
    script.load_checkpoint(Path(out), trained, torch.optim.AdamW(script.lora_params(trained, "default")), 1e-3, 0.0)
    trained.set_adapter(adapter)
    loaded = StableDiffusion3Pipeline.from_pretrained(args.model, local_files_only=True)
    base = loaded.transformer(**transformer_inputs(loaded.transformer)).sample
    loaded.load_lora_weights(folder)  # the README's instruction, as a user runs it
    with torch.no_grad():
        y_loaded = loaded.transformer(**transformer_inputs(loaded.transformer)).sample
        y_trained = trained(**transformer_inputs(trained)).sample
    change = (y_trained - base).abs().max().item()
    assert change > 1e-5, "training did not move the model: the comparison would show nothing"
    assert (y_loaded - y_trained).abs().max().item() < 1e-3 * change
    assert loaded.transformer.peft_config["default_0"].lora_alpha == args.lora_alpha


def transformer_inputs(transformer, seed=0):
    """One fixed random input of an SD3 transformer (latents, a timestep, text states and pooled states)."""
    g, c = torch.Generator().manual_seed(seed), transformer.config
    side = c.sample_size
    return dict(
        hidden_states=torch.randn(2, c.in_channels, side, side, generator=g),
        timestep=torch.tensor([500.0, 700.0]),
        encoder_hidden_states=torch.randn(2, 5, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=g),
        return_dict=True,
    )


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_where_to_change_what_names_functions_that_exist(module):
    script = __import__(module)
    block = script.__doc__.split("Where to change what")[1]
    words = {"reward_models", "w_kj", "README"}  # a file, a symbol and a file named in the map
    names = set(re.findall(r"\b(?:[a-z0-9]+_[a-z0-9_]+|Args|[A-Z_]{4,})\b", block)) - words
    assert len(names) > 20
    missing = [n for n in names if not hasattr(script, n) and not hasattr(reward_models, n)]
    assert not missing, f"the map in {module}.py's docstring names {missing}, which {module}.py does not define"


def test_sample_grid_upscales_each_image_and_writes_its_prompt_under_it(tmp_path):
    colours = ["red", "blue", "green", "orange", "purple", "teal", "navy", "olive", "maroon", "gray"]
    images = [Image.new("RGB", (16, 16), c) for c in colours]
    prompts = ["a red circle on the left and a blue square", "two blue squares"] + [""] * 8
    grid = np.asarray(recast.save_grid(images, tmp_path / "grid.png", prompts=prompts, cols=8, cell=128))
    assert Image.open(tmp_path / "grid.png").size == (grid.shape[1], grid.shape[0])
    assert grid.shape[1] == 8 * 128 and 2 * 128 < grid.shape[0] < 2 * 128 + 2 * 100  # two rows, room for captions
    row_h = grid.shape[0] // 2
    for i, c in enumerate(colours):  # nearest upscaling: each 16 px image fills its 128 px cell with its colour
        x, y = (i % 8) * 128, (i // 8) * row_h
        assert (grid[y : y + 128, x : x + 128] == Image.new("RGB", (1, 1), c).getpixel((0, 0))).all()
    caption = lambda i: grid[128:row_h, i * 128 : (i + 1) * 128]  # noqa: E731
    lines = lambda i: (caption(i).min(axis=(1, 2)) < 128).astype(int)  # noqa: E731
    assert caption(0).min() < 100 and caption(1).min() < 100 and caption(2).min() == 255  # text only under prompts
    assert (np.diff(lines(0)) == 1).sum() > (np.diff(lines(1)) == 1).sum() >= 1  # the long prompt wraps


def test_the_main_command_prints_one_progress_bar_with_reward_and_loss_and_no_warnings(tmp_path):
    """The README's first command (embedded model) for one small iteration, in a fresh process: stderr holds the
    progress bar with its live reward and loss and nothing else (no library notice, no loading bar)."""
    cmd = [sys.executable, str(Path(recast.__file__)), "--iterations", "1", "--prompts-per-iter", "2"]
    cmd += ["--eval-every", "0", "--updates-per-iter", "1", "--out", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [line for line in re.split(r"[\r\n]+", done.stderr) if line.strip()]
    assert lines and all(line.startswith("recast: ") for line in lines), lines
    assert re.search(r"1/1 .*reward=[-0-9.]+, loss=[-0-9.e]+", lines[-1]), lines[-1]
    assert done.stdout.strip() == f"run folder: {tmp_path / 'run'}"


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_report_to_tensorboard_logs_the_metrics_keys_and_W(tiny, tmp_path, module):
    """--report-to tensorboard: event files in <run>/tensorboard hold every number of metrics.jsonl under the same key,
    one point per iteration, and W as an image of 16 px a cell."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script, out = __import__(module), tmp_path / "run"
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "1", "--report-to", "tensorboard")
    script.train(script.parse_args(argv), extra_rewards=TINY_REWARDS)
    rows = read_metrics(out)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    numbers = {k for m in rows for k, v in m.items() if isinstance(v, (int, float))}
    assert numbers <= set(events.Tags()["scalars"]) and "eval_before/brightness" in numbers
    for key in ("loss/policy", "reward/weighted", "eval/brightness", "grad_norm"):
        assert [e.step for e in events.Scalars(key)] == [0, 1]
        assert [e.value for e in events.Scalars(key)] == pytest.approx([m[key] for m in rows], rel=1e-6)
    images = events.Images("recast/W")
    assert [(i.step, i.height, i.width) for i in images] == [(0, 2 * 16, 10 * 16), (1, 2 * 16, 10 * 16)]


def test_report_to_needs_its_package(tiny, tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    argv = tiny_argv(tiny, tmp_path / "run", "--report-to", "wandb")
    with pytest.raises(SystemExit, match="needs the wandb package: pip install wandb"):
        recast.validate(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("credit, beta", [("budgets", None), ("recast", "0.5")])
def test_rvge_two_iterations_log_bandwidths_directions_and_W(tiny, tmp_path, credit, beta):
    out = tmp_path / "run"
    argv = tiny_argv(
        tiny, out, "--iterations", "2", "--eval-every", "1", "--credit", credit, "--rewards", "brightness,dark"
    )
    argv += ["--kl-beta", beta] if beta else []

    def dark(ims, ps):  # 0/1: ties among near-copies
        return (brightness(ims, ps) < 0.45).astype(float)

    rvge.train(rvge.parse_args(argv), extra_rewards={**TINY_REWARDS, "dark": dark})
    rows = read_metrics(out)
    assert [m["iteration"] for m in rows] == [0, 1]
    for m in rows:
        W = np.array(m["recast/W"])
        assert np.abs(W.sum(1) - [0.6, 0.4]).max() < 1e-9 and np.abs(W.sum(0) - 0.1).max() < 1e-9
        assert m["rvge/bandwidth/dark"] == "broad" and m["rvge/tie_share/dark"] > 0.2  # auto: a 0/1 reward goes broad
        assert m["rvge/bandwidth/brightness"] == "split" and m["rvge/tie_share/brightness"] == 0  # a smooth one splits
        assert m["rvge/t_b/dark"] == 1.0 and 0 < m["rvge/t_b/brightness"] < 1.0
        assert m["rvge/group_size/brightness"] == m["rvge/group_size/dark"] == 4.0  # R = C = 4: like for like
        assert m["rvge/direction_rms/brightness"] > 0 and np.isfinite(m["loss/policy"]) and m["rvge/s2"] > 0
    if credit == "budgets":
        assert np.allclose(np.array(rows[0]["recast/W"]), recast.uniform_W([0.6, 0.4], 10))
    assert (out / "samples_after.png").exists() and (out / "credit.png").exists()


def test_rvge_one_direction_on_the_weighted_reward(tiny, tmp_path):
    """--combine reward regresses one direction on sum_k lambda_k R_k normalised once. With one reward it is the
    per-reward run exactly (same advantages, mixture weight 1 at every step); with two it logs one direction,
    "weighted", whose advantage is DiffusionNFT's combined one; per-reward settings are refused with it."""
    one = ["--iterations", "2", "--eval-every", "1", "--save-every", "1", "--rewards", "brightness", "--budgets", "1"]
    for combine in ("directions", "reward"):
        rvge.train(rvge.parse_args(tiny_argv(tiny, tmp_path / combine, *one, "--combine", combine)), TINY_REWARDS)
    per, joint = read_metrics(tmp_path / "directions"), read_metrics(tmp_path / "reward")
    for a, b in zip(per, joint):
        assert a["loss/policy"] == b["loss/policy"] and a["eval/brightness"] == b["eval/brightness"]
        assert a["rvge/direction_rms/brightness"] == b["rvge/direction_rms/weighted"]
    states = [
        torch.load(tmp_path / c / "checkpoints/iter_000001/state.pt", weights_only=False)["lora"]["default"]
        for c in ("directions", "reward")
    ]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    out = tmp_path / "two"
    rvge.train(
        rvge.parse_args(tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--combine", "reward")),
        TINY_REWARDS,
    )
    m = read_metrics(out)[0]
    assert "rvge/bandwidth/weighted" in m and not any(k.startswith("rvge/bandwidth/bright") for k in m)
    for bad in (["--credit", "recast"], ["--bandwidth", "split,broad"]):
        with pytest.raises(SystemExit, match="--combine reward regresses one direction"):
            rvge.validate(rvge.parse_args(tiny_argv(tiny, tmp_path / "x", "--combine", "reward", *bad)), TINY_REWARDS)


def test_diffusionnft_step_counts_ema_and_ode_sampler(tiny, tmp_path):
    """--updates-per-iter 1 is one AdamW step per iteration over all its samples; --ema keeps
    DiffusionNFT's EMA (ema_s = d_s ema_{s-1} + (1 - d_s) default_s, d_s = min((1 + s) / (10 + s), 0.9)),
    saved beside the raw LoRA and loadable with load_lora_weights; --sampler ode gives independent samples."""

    out = tmp_path / "run"
    argv = tiny_argv(
        tiny,
        out,
        "--iterations",
        "2",
        "--eval-every",
        "1",
        "--save-every",
        "1",
        "--updates-per-iter",
        "1",
        "--train-steps-per-leaf",
        "9",
        "--ema",
        "--eval-steps",
        "6",
        "--sampler",
        "ode",
        "--n-roots",
        "4",
        "--credit",
        "nft",
        "--gain-estimator",
        "denoised",
    )
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    rows = read_metrics(out)
    assert [m["train/opt_steps"] for m in rows] == [1, 1] and [m["train/samples"] for m in rows] == [2 * 4 * 9] * 2
    states = [torch.load(out / "checkpoints" / f"iter_00000{i}" / "state.pt", weights_only=False) for i in (0, 1)]
    assert states[1]["opt_steps"] == 2
    d2 = recast.ema_decay(2)
    for key, ema in states[1]["lora"]["ema"].items():
        expect = d2 * states[0]["lora"]["ema"][key] + (1 - d2) * states[1]["lora"]["default"][key]
        assert torch.allclose(ema, expect, atol=1e-7)
    assert_loads_as_trained(recast, out, out / "checkpoints" / "iter_000001" / "ema", adapter="ema")


@pytest.mark.parametrize("flags", [["--frozen-batch", "48"], ["--gradient-checkpointing"]])
def test_speed_flags_leave_the_numbers_unchanged(tiny, tmp_path, flags):
    """GPU throughput options (unmeasured on a GPU, so off by default) must not change the numerics:
    the same losses and the same trained LoRA weights as the plain path after 2 iterations."""
    from safetensors.torch import load_file

    outs = []
    for name, more in (("plain", []), ("flag", flags)):
        out = tmp_path / name
        argv = tiny_argv(
            tiny, out, "--iterations", "2", "--eval-every", "0", "--train-batch", "8", "--updates-per-iter", "2", *more
        )
        recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
        outs.append(out)
    for a, b in zip(read_metrics(outs[0]), read_metrics(outs[1])):
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4
        )
    wa, wb = (load_file(o / "checkpoints" / "iter_000001" / "pytorch_lora_weights.safetensors") for o in outs)
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_rvge_ablation_flags_train_end_to_end(tiny, tmp_path, monkeypatch):
    """--coords noisy --transfer none --query-weights on, local and broad: one iteration trains, regressing on
    the x0_hat probes the shared rollout returns at step 1 (broad) and the branch step + 1 (local)."""
    real_score = rvge.rollout_and_score

    def rollout_and_score(*a, **k):
        b = real_score(*a, **k)
        assert [j for j, _, _ in b.probes] == [1, 8]
        return b

    monkeypatch.setattr(rvge, "rollout_and_score", rollout_and_score)
    out = tmp_path / "run"
    argv = tiny_argv(
        tiny,
        out,
        "--iterations",
        "1",
        "--eval-every",
        "0",
        "--coords",
        "noisy",
        "--transfer",
        "none",
        "--query-weights",
        "on",
        "--bandwidth",
        "local,broad",
        "--branch-steps",
        "7",
    )
    rvge.train(rvge.parse_args(argv), extra_rewards=TINY_REWARDS)
    m = read_metrics(out)[0]
    assert m["rvge/bandwidth/brightness"] == "local" and m["rvge/bandwidth/redness"] == "broad"
    assert (
        m["rvge/direction_rms/brightness"] > 0 and m["rvge/direction_rms/redness"] > 0 and np.isfinite(m["loss/policy"])
    )


KILL_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
import {module} as script, test_recast
script.train(script.parse_args({argv!r}), extra_rewards=test_recast.TINY_REWARDS)
"""


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_resume_after_sigkill_loses_nothing_and_same_seed_repeats(tiny, tmp_path, module):
    script = __import__(module)
    import signal
    import subprocess
    import sys
    import time as _time

    ref, killed = tmp_path / "ref", tmp_path / "killed"
    common = ["--iterations", "5", "--save-every", "1", "--eval-every", "0"]
    script.train(script.parse_args(tiny_argv(tiny, ref, *common)), extra_rewards=TINY_REWARDS)
    code = KILL_SCRIPT.format(repo=str(Path(__file__).parent), module=module, argv=tiny_argv(tiny, killed, *common))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = _time.time() + 240
    while _time.time() < deadline and not (latest.exists() and latest.read_text() >= "iter_000001"):
        _time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest.exists(), "the killed run wrote no checkpoint"
    assert len(read_metrics(killed)) < 5, "the run finished before it could be killed"
    script.train(script.parse_args(["--resume", str(killed)]), extra_rewards=TINY_REWARDS)

    def strip(m):
        return {k: v for k, v in m.items() if not k.startswith("time/")}

    assert [strip(m) for m in read_metrics(killed)] == [strip(m) for m in read_metrics(ref)]


TWO_PROC_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
import {module} as script, recast, test_recast
from accelerate import PartialState
solve = recast.solve_W  # both scripts build W in recast.credit
def recorded(*a, **k):
    W = solve(*a, **k)
    with open({out!r} + f"/W_rank{{PartialState().process_index}}.txt", "a") as f:
        f.write(repr(W.tolist()) + "\\n")
    return W
recast.solve_W = recorded
script.train(script.parse_args({argv!r}), extra_rewards=test_recast.TINY_REWARDS)
"""


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_two_processes_hold_the_same_W(tiny, tmp_path, module):
    import subprocess
    import sys

    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "two.py"
    here = str(Path(__file__).parent)
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "0", "--device", "cpu", "--credit", "recast")
    script.write_text(TWO_PROC_SCRIPT.format(repo=here, module=module, out=str(out), argv=argv))
    # accelerate's --cpu flag alone starts one process (several need MPI); --multi_gpu starts
    # torchrun's processes, and --device cpu makes each one a CPU (gloo) rank
    res = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=here,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    W0 = (out / "W_rank0.txt").read_text().splitlines()
    W1 = (out / "W_rank1.txt").read_text().splitlines()
    assert len(W0) == 2 and W0 == W1
    # each rank saw its own prompts, yet the statistics are global
    assert len(read_metrics(out)) == 2


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_nan_rewards_are_left_out_and_an_all_nan_reward_stops_with_a_checkpoint(tiny, tmp_path, module):
    script = __import__(module)

    def half_nan(images, prompts):
        v = brightness(images, prompts)
        v[::2] = np.nan
        return v

    out = tmp_path / "half"
    argv = tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--rewards", "brightness,half")
    script.train(script.parse_args(argv), extra_rewards={**TINY_REWARDS, "half": half_nan})
    m, saved = read_metrics(out)[0], json.loads((out / "config.json").read_text())["args"]
    leaves = saved["prompts_per_iter"] * saved["n_roots"] * saved["n_branch"] ** len(saved["branch_steps"].split(","))
    assert m["reward_nonfinite/half"] == leaves // 2 and np.isfinite(m["reward/half"]) and np.isfinite(m["loss/policy"])
    out = tmp_path / "all"
    argv = tiny_argv(tiny, out, "--iterations", "3", "--eval-every", "0", "--rewards", "brightness,dead")
    with pytest.raises(SystemExit, match="NaN/inf for every image"):
        script.train(
            script.parse_args(argv), extra_rewards={**TINY_REWARDS, "dead": lambda ims, ps: np.full(len(ims), np.nan)}
        )
    assert (out / "checkpoints" / "latest").exists()


@pytest.mark.parametrize(
    "change, words",
    [
        (["--budgets", "0.4,x"], "not a number"),
        (["--budgets", "1,2,3"], "3 budgets for 2 rewards"),
        (["--rewards", "brightness,nope"], "unknown or repeated reward"),
        (["--model", "/no/such/folder"], "no such folder"),
        (["--model", "stabilityai/stable-diffusion-3.5-medium"], "needs a CUDA GPU"),
        (["--alpha", "3"], "--alpha 2"),
        (["--branch-steps", "9"], "strictly between"),
        (["--out", "/proc/forbidden/run"], "cannot write"),
    ],
)
@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_bad_input_fails_before_any_work_with_a_clear_message(tiny, tmp_path, change, words, module):
    if "CUDA" in words and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if module == "rvge" and "--alpha" in change:
        change, words = ["--kl-beta", "0"], "--kl-beta 0.0: must be a finite number > 0"
    script = __import__(module)
    argv = tiny_argv(tiny, tmp_path / "run") + change
    with pytest.raises(SystemExit, match=words):
        script.validate(script.parse_args(argv), extra_rewards=TINY_REWARDS)


# -----------------------------------------------------------------------------
# Runs never lose or corrupt work (issue 14): every case leaves an earlier run byte-identical
# -----------------------------------------------------------------------------


def snapshot(folder):
    """{relative path: bytes} of every file under a run folder (the lock file excluded)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module", params=["recast", "rvge"])
def finished_run(request, tiny, tmp_path_factory):
    """A finished 2-iteration run (checkpoints at both iterations) of each script; tests copy it."""
    script = __import__(request.param)
    out = tmp_path_factory.mktemp(request.param) / "run"
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "2", "--save-every", "1", "--eval-every", "0")),
        extra_rewards=TINY_REWARDS,
    )
    return SimpleNamespace(script=script, out=out)


def copy_of(run, tmp_path, name="run"):
    import shutil

    dst = tmp_path / name
    shutil.copytree(run.out, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def test_the_same_command_twice_makes_two_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in tiny_argv(tiny, "x", "--iterations", "1", "--eval-every", "0") if a not in ("--out", "x")]
    first = recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    before = snapshot(first)
    second = recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert first == Path("runs/recast-recast-0") and second == Path("runs/recast-recast-0-1")
    assert snapshot(first) == before and (second / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize(
    "more, words",
    [
        ([], "already holds a run"),
        (["--train-batch", "0"], "--train-batch 0: must be"),
        (["--lr", "nan"], "--lr nan: must be a finite"),
    ],
)
def test_an_existing_run_is_never_touched_by_a_new_command(finished_run, tmp_path, more, words):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words)):
        finished_run.script.validate(
            finished_run.script.parse_args(tiny_argv_for(finished_run, out, *more)), extra_rewards=TINY_REWARDS
        )
    assert snapshot(out) == before


def tiny_argv_for(run, out, *more):
    return json_args_to_argv(json.loads((run.out / "config.json").read_text())["args"], out, *more)


def json_args_to_argv(saved, out, *more):
    keep = [
        "model",
        "rewards",
        "budgets",
        "resolution",
        "max_sequence_length",
        "train_prompts",
        "eval_prompts",
        "prompts_per_iter",
        "lora_rank",
        "lora_alpha",
    ]
    return [x for k in keep for x in (f"--{k.replace('_', '-')}", str(saved[k]))] + ["--out", str(out), *more]


def test_overwrite_replaces_a_run(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    script = finished_run.script
    script.train(
        script.parse_args(tiny_argv_for(finished_run, out, "--iterations", "1", "--eval-every", "0", "--overwrite")),
        extra_rewards=TINY_REWARDS,
    )
    assert [m["iteration"] for m in read_metrics(out)] == [0]
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_000000"]


def test_resume_trains_the_folder_given_wherever_it_lies(finished_run, tmp_path):
    script = finished_run.script
    original = snapshot(finished_run.out)
    moved = copy_of(finished_run, tmp_path, "moved")
    script.train(script.parse_args(["--resume", str(moved), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert [m["iteration"] for m in read_metrics(moved)] == [0, 1, 2]
    assert snapshot(finished_run.out) == original  # the folder it was copied from is untouched
    assert json.loads((moved / "config.json").read_text())["args"]["out"] == str(moved)
    with pytest.raises(SystemExit, match="continues that folder in place"):
        script.parse_args(["--resume", str(moved), "--out", str(tmp_path / "elsewhere")])


@pytest.mark.parametrize(
    "more, words",
    [
        (["--rewards", "brightness"], "--rewards: saved 'brightness,redness', given 'brightness'"),
        (["--steps", "12"], "--steps: saved 10, given 12"),
        (["--lora-rank", "8"], "--lora-rank: saved 4, given 8"),
    ],
)
def test_resume_refuses_settings_that_cannot_change(finished_run, tmp_path, more, words):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words)):
        finished_run.script.parse_args(["--resume", str(out), *more])
    assert snapshot(out) == before
    other = "rvge" if finished_run.script is recast else "recast"
    with pytest.raises(SystemExit, match=f"trained by {finished_run.script.__name__}.py"):
        __import__(other).parse_args(["--resume", str(out)])


def test_a_second_live_process_on_a_folder_is_refused(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    held = finished_run.script.lock_run(out)
    try:
        with pytest.raises(SystemExit, match="in use by another live process"):
            finished_run.script.train(
                finished_run.script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS
            )
    finally:
        held.close()


@pytest.mark.parametrize("damage", ["partial_metrics_line", "dangling_latest", "truncated_state"])
def test_resume_survives_damage_and_falls_back_to_an_intact_checkpoint(finished_run, tmp_path, damage, capsys):
    out = copy_of(finished_run, tmp_path)
    ckpts = out / "checkpoints"
    if damage == "partial_metrics_line":
        with open(out / "metrics.jsonl", "a") as f:
            f.write('{"iteration": 2, "reward/bri')
    elif damage == "dangling_latest":
        (ckpts / "latest").write_text("iter_000009")
    else:
        (ckpts / "iter_000001" / "state.pt").write_bytes((ckpts / "iter_000001" / "state.pt").read_bytes()[:1000])
    (ckpts / "iter_000005.tmp").mkdir()
    finished_run.script.train(
        finished_run.script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS
    )
    its = [m["iteration"] for m in read_metrics(out)]
    if damage == "truncated_state":  # iteration 1 is redone from the iteration-0 checkpoint
        captured = capsys.readouterr()
        assert its == [0, 1, 2] and "iter_000000, the newest intact checkpoint" in captured.out + captured.err
    else:
        assert its == [0, 1, 2]
    assert not list(ckpts.glob("*.tmp")) and (ckpts / (ckpts / "latest").read_text()).is_dir()


def test_a_runs_lora_loads_in_diffusers_as_the_trained_model(finished_run):
    """Both scripts (rank 4, alpha 8): checkpoints/iter_N is the folder to load, and it loads at full strength."""
    assert_loads_as_trained(finished_run.script, finished_run.out, finished_run.out / "checkpoints" / "iter_000001")


def test_resume_applies_a_new_lr_and_weight_decay_and_records_what_it_did(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    script = finished_run.script
    script.train(
        script.parse_args(["--resume", str(out), "--iterations", "3", "--lr", "0.002", "--weight-decay", "0.25"]),
        extra_rewards=TINY_REWARDS,
    )
    groups = torch.load(out / "checkpoints" / "iter_000002" / "state.pt", weights_only=False)["optimizer"]
    assert [(g["lr"], g["weight_decay"]) for g in groups["param_groups"]] == [(0.002, 0.25)]
    saved = json.loads((out / "config.json").read_text())["args"]
    assert (saved["lr"], saved["weight_decay"]) == (0.002, 0.25)


@pytest.mark.parametrize(
    "more, words",
    [
        (["--gain-estimator", "denoised"], "--gain-estimator: saved 'pairs', given 'denoised'"),
        (["--gain-init", "levels.json"], "--gain-init: saved '', given 'levels.json'"),
        (["--overwrite"], "--overwrite does not go with --resume"),
        (["--name", "other"], "--name does not go with --resume"),
    ],
)
def test_resume_refuses_flags_whose_saved_state_would_override_them(finished_run, tmp_path, more, words):
    """--gain-estimator / --alpha: the saved level statistics were measured with them; --gain-init seeds iteration 0
    only; --overwrite / --name choose another folder. Refused, nothing written."""
    script = finished_run.script
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    if script is rvge and more[0].startswith("--gain"):  # rvge.py has no such flag (its --credit recast: pairs, 2)
        with pytest.raises(SystemExit, match="2"):  # argparse: unrecognized arguments, exit status 2
            script.parse_args(["--resume", str(out), *more])
    else:
        with pytest.raises(SystemExit, match=re.escape(words)):
            script.train(script.parse_args(["--resume", str(out), *more]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


def test_resume_with_no_loadable_checkpoint_stops_and_changes_nothing(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    for state in (out / "checkpoints").glob("iter_*/state.pt"):
        state.write_bytes(state.read_bytes()[:500])
    before = snapshot(out)
    script = finished_run.script
    with pytest.raises(SystemExit, match="none of its checkpoints loads .*nothing was changed"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize(
    "files",
    [{"config.json": '{"_class_name": "SD3Transformer2DModel"}'}, {"notes.txt": "mine"}, {"config.json": "[1, 2]"}],
)
def test_out_at_a_folder_of_other_files_is_refused_even_with_overwrite(tiny, tmp_path, files, overwrite):
    out = tmp_path / "transformer"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    before = snapshot(out)
    with pytest.raises(SystemExit, match="holds files that are not a run of this project"):
        recast.validate(recast.parse_args(tiny_argv(tiny, out, *overwrite)), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    for system in ("/", "/etc", "/mnt", str(Path.home())):
        with pytest.raises(SystemExit, match="is a system folder|holds files that are not a run"):
            recast.validate(recast.parse_args(tiny_argv(tiny, system, "--overwrite")), extra_rewards=TINY_REWARDS)
    empty = tmp_path / "empty"
    (empty / ".lock").parent.mkdir()
    (empty / ".lock").write_text("")  # a start stopped before it wrote its config: the folder is free
    recast.validate(recast.parse_args(tiny_argv(tiny, empty)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_only_the_first_process_judges_the_run_folder(tiny, tmp_path, module, monkeypatch):
    """Under accelerate launch, rank 0 creates the folder, probes it and may write config.json before rank 1 looks:
    rank 1 must not judge that folder (it would call it another run's) but wait for rank 0's choice (CI saw
    this race: test_two_processes_hold_the_same_W failed once with 'holds files that are not a run')."""
    script = __import__(module)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".write_test.123").write_text("ok")  # rank 0's write probe, seen mid-check
    with pytest.raises(SystemExit, match="holds files that are not a run"):
        script.validate(script.parse_args(tiny_argv(tiny, out)), extra_rewards=TINY_REWARDS)
    monkeypatch.setenv("RANK", "1")
    args = script.parse_args(tiny_argv(tiny, out))
    script.validate(args, extra_rewards=TINY_REWARDS)
    assert args.out == str(out) and sorted(p.name for p in out.iterdir()) == [".write_test.123"]
    argv = tiny_argv(tiny, out)
    del argv[argv.index("--out") : argv.index("--out") + 2]
    args = script.parse_args(argv)  # default runs/<name>: left to rank 0's broadcast
    monkeypatch.chdir(tmp_path)
    script.validate(args, extra_rewards=TINY_REWARDS)
    assert not args.out and not (tmp_path / "runs").exists()


def test_out_inside_a_run_is_refused(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    script = finished_run.script
    for inner in (out / "checkpoints" / "iter_000001" / "new", out / "sub" / "run"):
        with pytest.raises(SystemExit, match="lies inside the run folder"):
            script.validate(script.parse_args(tiny_argv_for(finished_run, inner)), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


def test_only_the_programs_own_tmp_files_are_deleted(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    ckpts = out / "checkpoints"
    for mine in (out / "notes.tmp", ckpts / "mine.tmp"):
        mine.write_text("the user's")
    (out / "drafts.tmp").mkdir()
    (out / "config.json.tmp").write_text("{")
    (ckpts / "iter_000007.tmp").mkdir()
    (ckpts / "latest.tmp").write_text("iter_0000")
    script = finished_run.script
    script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert (out / "notes.tmp").read_text() == (ckpts / "mine.tmp").read_text() == "the user's"
    assert (out / "drafts.tmp").is_dir()
    assert not any(p.exists() for p in (out / "config.json.tmp", ckpts / "iter_000007.tmp", ckpts / "latest.tmp"))


def test_a_damaged_metrics_line_before_the_last_is_refused_not_dropped(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(["{broken", *lines[1:]]) + "\n")
    before = snapshot(out)
    script = finished_run.script
    with pytest.raises(SystemExit, match="line 1 of 2 is damaged"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: "{not json", "not readable JSON"),
        (lambda c: json.dumps({**c, "args": []}), 'does not hold an "args" object'),
        (lambda c: json.dumps({**c, "args": {**c["args"], "lr": "fast"}}), "args.lr is 'fast', not of type float"),
        (lambda c: json.dumps({**c, "args": {**c["args"], "steps": 2.5}}), "args.steps is 2.5, not of type int"),
        (lambda c: json.dumps({**c, "args": {**c["args"], "ema": "yes"}}), "args.ema is 'yes', not of type bool"),
        (lambda c: json.dumps({**c, "script": None}), 'its "script" is None'),
    ],
)
def test_a_hand_edited_config_is_a_clear_error_not_a_traceback(finished_run, tmp_path, edit, words):
    out = copy_of(finished_run, tmp_path)
    (out / "config.json").write_text(edit(json.loads((out / "config.json").read_text())))
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words) + ".*Repair the file"):
        finished_run.script.parse_args(["--resume", str(out)])
    assert snapshot(out) == before


def test_embedded_world_prompts_outside_its_grammar_are_refused_before_the_model_loads(tmp_path):
    path = tmp_path / "heldout.txt"
    path.write_text("two red circles\na purple hexagon\n")
    with pytest.raises(SystemExit, match="line 2, 'a purple hexagon', is outside the embedded world's captions"):
        recast.validate(recast.parse_args(["--eval-prompts", str(path), "--out", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_a_non_finite_loss_stops_before_the_step_and_keeps_the_last_good_checkpoint(
    tiny, tmp_path, module, monkeypatch
):
    script = __import__(module)
    out = tmp_path / "run"
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0")), extra_rewards=TINY_REWARDS
    )
    before = snapshot(out)
    loss = "nft_loss" if module == "recast" else "rvge_loss"
    monkeypatch.setattr(script, loss, lambda *a, **k: torch.full((len(a[0]),), float("nan")))
    with pytest.raises(SystemExit, match="non-finite"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != "config.json"} == {
        k: v for k, v in before.items() if k != "config.json"
    }


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_budgets_are_scale_free(tiny, tmp_path, module):
    script = __import__(module)
    losses = []
    for budgets in ("1,1", "1e-40,1e-40", "1e300,1e300"):
        out = tmp_path / budgets
        script.train(
            script.parse_args(tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--budgets", budgets)),
            extra_rewards=TINY_REWARDS,
        )
        losses.append(read_metrics(out)[0]["loss/policy"])
    assert np.isfinite(losses).all() and np.allclose(losses, losses[0], rtol=1e-5)
    with pytest.raises(SystemExit, match="scale them down"):
        script.validate(
            script.parse_args(tiny_argv(tiny, tmp_path / "big", "--budgets", "1e308,1e308")), extra_rewards=TINY_REWARDS
        )


BAD_FLAGS = [
    ["--iterations", "0"],
    ["--iterations", "-1"],
    ["--train-batch", "0"],
    ["--prompts-per-iter", "0"],
    ["--n-branch", "0"],
    ["--n-roots", "0"],
    ["--resolution", "7"],
    ["--lora-rank", "0"],
    ["--updates-per-iter", "0"],
    ["--rollout-batch", "0"],
    ["--train-steps-per-leaf", "0"],
    ["--save-every", "0"],
    ["--seed", "-1"],
    ["--lr", "-1"],
    ["--lr", "nan"],
    ["--sde-a", "nan"],
    ["--grad-clip", "nan"],
    ["--gain-ema", "nan"],
    ["--gain-ema", "5"],
    ["--steps", "2"],
    ["--device", "bogus"],
    ["--weight-decay", "inf"],
]


@pytest.mark.parametrize("change", BAD_FLAGS, ids=lambda c: " ".join(c))
@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_every_numeric_flag_is_checked_before_anything_is_written(tiny, tmp_path, change, module):
    script = __import__(module)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=re.escape(change[0])):
        script.validate(script.parse_args(tiny_argv(tiny, out, *change)), extra_rewards=TINY_REWARDS)
    assert not out.exists()


@pytest.mark.parametrize("change", [["--nft-b", "nan"], ["--alpha", "0"]])
def test_recast_only_flags_are_checked(tiny, tmp_path, change):
    with pytest.raises(SystemExit, match=re.escape(change[0])):
        recast.validate(recast.parse_args(tiny_argv(tiny, tmp_path / "run", *change)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize(
    "change",
    [
        ["--eta", "nan"],
        ["--eta", "-1"],
        ["--transfer-cap", "nan"],
        ["--tie-threshold", "nan"],
        ["--n-roots", "1"],
        ["--n-branch", "1"],
    ],
)
def test_rvge_only_flags_are_checked(tiny, tmp_path, change):
    with pytest.raises(SystemExit, match=re.escape(change[0])):
        rvge.validate(rvge.parse_args(tiny_argv(tiny, tmp_path / "run", *change)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize(
    "field, value", [("coords", "dirty"), ("transfer", "kappa"), ("query_weights", "maybe"), ("bandwidth", "wide")]
)
def test_rvge_ablation_flags_refuse_unknown_values(tiny, tmp_path, field, value):
    """argparse refuses these at the command line; validate() refuses them too (Args built in code, --resume
    configs)."""
    args = replace(rvge.parse_args(tiny_argv(tiny, tmp_path / "run")), **{field: value})
    with pytest.raises(SystemExit, match=re.escape(f"--{field.replace('_', '-')} {value!r}")):
        rvge.validate(args, extra_rewards=TINY_REWARDS)


def test_rvge_tiny_kl_beta_gives_finite_directions():
    x0 = torch.randn(4, 3, 2, 2)
    d = rvge.value_direction(x0, torch.tensor([0.1, -0.2, 0.3, 0.0]), beta=1e-300)
    assert torch.isfinite(d).all() and torch.allclose(d, x0[2] - x0.mean(0))  # the softmax becomes the arg max


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read it"),
        (b"\x00\x01\x02", "binary"),
        ("caf\xe9".encode("latin-1"), "not UTF-8"),
        (b"\n\n", "no prompts"),
    ],
)
def test_prompt_files_are_checked(tiny, tmp_path, content, words):
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit, match=words):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--train-prompts", str(path))),
            extra_rewards=TINY_REWARDS,
        )
    one = tmp_path / "one.txt"
    one.write_text("a red circle\n")
    with pytest.raises(SystemExit, match="at least 2 prompts"):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--eval-prompts", str(one))), extra_rewards=TINY_REWARDS
        )


def test_t5_prompt_length_is_diffusionnfts_128_off_the_embedded_model(tiny, tmp_path):
    """Without --max-sequence-length a model other than the embedded one encodes T5 at 128 tokens (DiffusionNFT's
    length): the text states are the CLIP tokens followed by 128 T5 tokens."""
    argv = tiny_argv(tiny, tmp_path / "run")
    i = argv.index("--max-sequence-length")
    argv = argv[:i] + argv[i + 2 :]
    run = recast.setup_run(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    emb, _ = run.encode(["a red circle"])
    assert emb.shape[1] == run.pipe.tokenizer.model_max_length + 128
    run.lock.close()


def test_file_prompts_are_drawn_as_diffusionnft_draws_them():
    """DiffusionNFT's sampler: per iteration one permutation of the lines, split over processes: no prompt twice in an
    iteration (all processes together), every line equally likely over iterations; a short file is cycled."""
    lines = [f"prompt {i}" for i in range(12)]
    counts = dict.fromkeys(lines, 0)
    for it in range(600):
        drawn = [p for rank in range(3) for p in recast.distinct_prompts(lines, 4, [0, it], rank, 3)]
        assert len(drawn) == len(set(drawn)) == 12
        for p in recast.distinct_prompts(lines, 4, [1, it], 0, 1):
            counts[p] += 1
    assert min(counts.values()) > 0.7 * 600 * 4 / 12 and max(counts.values()) < 1.3 * 600 * 4 / 12
    short = [p for rank in range(2) for p in recast.distinct_prompts(lines[:3], 4, [0, 0], rank, 2)]
    assert set(short[:3]) == set(lines[:3]) and short[3:6] == short[:3] and short[6:] == short[:2]


def test_unclear_cases_now_name_the_real_problem(tiny, tmp_path):
    with pytest.raises(SystemExit, match="--model /nonexistent: no such folder"):
        recast.validate(recast.parse_args(["--model", "/nonexistent"]))
    with pytest.raises(SystemExit, match="--steps 2: must be"):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--steps", "2")), extra_rewards=TINY_REWARDS
        )
    with pytest.raises(SystemExit, match="--train-prompts is not used with the embedded model"):
        recast.validate(recast.parse_args(["--train-prompts", str(tiny / "prompts.txt"), "--out", str(tmp_path / "e")]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU is visible"):
            recast.validate(
                recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--device", "cuda")), extra_rewards=TINY_REWARDS
            )


def test_checkpoint_write_failure_says_disk_and_keeps_the_last_good_one(finished_run, tmp_path, monkeypatch):
    script = finished_run.script
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit, match="is the disk full"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints")
    }


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_help_reads_as_sections_with_every_flag_in_its_own(module, capsys):
    """--help lists the flags in the sections of ARG_GROUPS, in that order, each flag under its Args group;
    the reward-model defaults are reward_models.DEFAULTS (one place for each default); every field has its help
    string written under it."""
    script = __import__(module)
    assert set(script.field_docs(script.Args)) == {f.name for f in fields(script.Args)}
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    heads = [text.index(f"\n{title}:\n") for title in script.ARG_GROUPS]
    assert heads == sorted(heads) and set(f.metadata["group"] for f in fields(script.Args)) == set(script.ARG_GROUPS)
    ends = dict(zip(script.ARG_GROUPS, heads[1:] + [len(text)]))
    for f in fields(script.Args):
        at = re.search(rf"\n  --{f.name.replace('_', '-')}\b", text).start()
        assert text.index(f"\n{f.metadata['group']}:\n") < at < ends[f.metadata["group"]], f.name
    for name in ("pickscore_model", "pickscore_processor", "clip_model", "geneval_url", "geneval_key"):
        assert getattr(script.Args(), name) == reward_models.DEFAULTS[name]


def test_helper_scripts_refuse_bad_flags(tmp_path, capsys):
    import toy_gaussian

    with pytest.raises(SystemExit):
        toy_gaussian.main(["--only", "bogus", "--out", str(tmp_path)])
    assert "unknown check(s) ['bogus']" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, words",
    [
        (["--bandwidth", "wide"], "local, broad, split or auto"),
        (["--bandwidth", "local,broad,auto"], "once per reward"),
        (["--branch-steps", "", "--bandwidth", "local"], "need branched rollouts"),
        (["--branch-steps", "rotate"], "split at one fixed step"),
    ],
)
def test_rvge_bad_bandwidth_input(tiny, tmp_path, change, words):
    with pytest.raises(SystemExit, match=words):
        rvge.validate(rvge.parse_args(tiny_argv(tiny, tmp_path / "run") + change), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_dry_run_attaches_lora_to_sd35_medium_on_the_meta_device(capsys, module):
    info = __import__(module).main(["--dry-run"])
    assert 2.0e9 < info["total_params"] < 3.0e9  # SD3.5-Medium's transformer is ~2.5B parameters
    # r = 32 on every targeted (in, out) linear; 24 blocks, the last one has no to_add_out
    assert info["lora_layers"] == 24 * 7 + 23
    assert info["trainable_params"] > 1e7
    assert "GiB" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# The embedded model (assets/shapes-sd3) with both scripts
# -----------------------------------------------------------------------------


def linear_latent_cosines(pipe_path, prompts, max_len, seed=0):
    """Directions of rvge from one batch of tree rollouts, for a reward linear in the clean latents
    R = w . x0: the cosine of each group's direction with the reward's gradient w, per bandwidth."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(pipe_path, local_files_only=True)
    pipe.scheduler.set_timesteps(10)
    emb, pooled = rvge.encode(pipe, prompts, max_len, "cpu")
    tr = pipe.transformer
    shape = (tr.config.in_channels, tr.config.sample_size, tr.config.sample_size)
    gen = torch.Generator().manual_seed(seed)
    leaves, groups, ancestry, _ = rvge.tree_rollout(
        tr, emb, pooled, pipe.scheduler.sigmas.float(), 4, 4, [7], 0.7, gen, shape
    )
    w = torch.randn(leaves[0].numel(), generator=gen)
    R = leaves.flatten(1) @ w
    out = {}
    for bandwidth, local in (("broad", False), ("local", True)):
        ids = rvge.regression_groups(groups, ancestry, local)
        d = rvge.group_directions(leaves, R, ids).flatten(1)
        first = [np.flatnonzero(ids == g)[0] for g in np.unique(ids)]
        out[bandwidth] = torch.nn.functional.cosine_similarity(d[first], w[None], dim=1).numpy()
    return out


def test_rvge_direction_follows_a_linear_latent_reward_on_the_embedded_model():
    import shapes_world

    cos = linear_latent_cosines(
        recast.EMBEDDED_MODEL,
        shapes_world.sample_prompts(6, "train", 0),
        shapes_world.GEN_KWARGS["max_sequence_length"],
    )
    for bandwidth, c in cos.items():
        print(f"{bandwidth}: mean cosine {c.mean():.3f} ± {c.std() / np.sqrt(len(c)):.3f} over {len(c)} groups")
        assert c.mean() > 3 * c.std() / np.sqrt(len(c)) and c.mean() > 0.02


if __name__ == "__main__" and "--fix-copies" in sys.argv:
    fix_copies()
