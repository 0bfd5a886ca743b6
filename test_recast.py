"""recast.py and DiffusionNFT's nft.py, which both scripts import, from fast to slow: hand-computed values,
vectorised vs naive loops, properties of the W solver, DiffusionNFT written once, then end-to-end runs of both
scripts on a tiny random SD3 pipeline (conftest.py; several processes among them) and on the embedded model.
RVGE's math: test_rvge.py; the run machinery (kit/: flags, run folders, resume, locks, checkpoints): test_run_kit.py;
reward models: test_reward_models.py; the toy: test_toy_gaussian.py.
Run: python -m pytest -q
"""

import importlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import nft
import recast
import recast_controls
import rvge
import sd3
from conftest import TINY_REWARDS, assert_loads_as_trained, brightness, read_metrics, tiny_argv
from kit import figures, reward_models, worlds

# -----------------------------------------------------------------------------
# Optimality probabilities (NOTES.md §2)
# -----------------------------------------------------------------------------


def test_optimality_hand_computed():
    R = np.array([1.0, 3.0, 10.0, 10.0])
    groups = np.array([0, 0, 1, 1])
    std = R.std()  # global std over the batch
    r = nft.optimality(R, groups)
    A = np.array([-1.0, 1.0, 0.0, 0.0]) / (std + 1e-4)
    assert np.allclose(r, 0.5 + 0.5 * np.clip(A, -5, 5) / 5)
    assert np.allclose(r[2:], 0.5)  # a tied group: r = 0.5, never NaN


def test_optimality_clips_and_handles_nan_and_all_ties():
    R = np.array([[0.0, 1.0], [0.0, np.nan], [0.0, 100.0], [0.0, 1.0]])
    r = nft.optimality(R, [0, 0, 0, 0], std=np.array([1.0, 1e-3]))
    assert np.all(np.isfinite(r)) and np.all((r >= 0) & (r <= 1))
    assert np.allclose(r[:, 0], 0.5)  # every reward tied
    assert r[1, 1] == 0.5  # NaN left out: no preference
    assert r[2, 1] == 1.0 and r[0, 1] == 0.0  # clipped at +-5 -> {0, 1}
    # the NaN is excluded from the group mean: mean of (1, 100, 1) = 34
    assert np.isclose(nft.optimality(R[:, 1], [0] * 4, std=1e3)[0], 0.5 + 0.5 * (1 - 34) / (1e3 + 1e-4) / 5)


def test_advantages_match_a_loop_over_groups():
    """nft.advantages' group means (one pass, np.add.at) against each group's own mean, rows of the groups interleaved,
    groups of 1 to 9 rows, non-finite rewards left out of their group's mean and getting A = 0."""
    rng = np.random.default_rng(5)
    groups = rng.permutation(np.repeat([7, 1, 4, 9], [1, 3, 9, 6]))
    R = rng.normal(size=(len(groups), 2))
    R[rng.random(R.shape) < 0.15] = np.nan
    std = np.array([0.7, 1.3])
    loop = np.zeros_like(R)
    for g in np.unique(groups):
        for k in range(2):
            rows = (groups == g) & np.isfinite(R[:, k])
            loop[rows, k] = np.clip((R[rows, k] - R[rows, k].mean()) / (std[k] + 1e-4), -5, 5)
    assert np.allclose(nft.advantages(R, groups, std=std), loop, rtol=1e-13, atol=1e-15)


def test_combine_raw_is_the_budget_weighted_sum():
    R = np.array([[1.0, 2.0], [3.0, np.nan]])
    out = nft.combine_raw(R, [0.25, 0.75])
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
    """Over every ordered pair of leaves, whatever the order of the rows and the sizes of the groups (pair_moments
    takes the groups of one size at a time)."""
    rng = np.random.default_rng(2)
    anc = np.array(list(itertools.product(range(3), range(2), range(2))))  # 3 roots x 2 x 2
    anc = np.concatenate([anc, anc + [3, 0, 0], anc[:8] + [6, 0, 0]])  # three prompt groups: 12, 12 and 8 leaves
    groups = np.repeat([0, 5, 2], [12, 12, 8])
    shuffle = rng.permutation(len(groups))
    anc, groups, r = anc[shuffle], groups[shuffle], rng.random((len(groups), 2))
    sums, counts = recast.pair_moments(r, groups, anc)
    naive_s, naive_c = np.zeros((2, 4)), np.zeros(4)
    for a in range(len(groups)):
        for b in range(len(groups)):
            if groups[a] != groups[b]:
                continue
            level = 0
            while level < 3 and anc[a, level] == anc[b, level]:
                level += 1
            naive_s[:, level] += r[a] * r[b]
            naive_c[level] += 1
    assert np.allclose(sums, naive_s, rtol=1e-13, atol=0) and np.array_equal(counts, naive_c)
    assert counts[-1] == 32  # each leaf with itself
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
    seen = [nft.branch_layout(8, T, "rotate", offset=it * 8) for it in range(3)]
    assert all(len(b) == 1 and 1 <= b[0] <= T - 2 for layout in seen for b in layout)
    assert sorted(b[0] for b in seen[0]) == list(range(1, T - 1))  # 8 groups cover the 8 inner steps
    assert seen[1] == seen[0] and nft.branch_layout(3, T, [3, 6]) == [[3, 6]] * 3
    assert [b[0] for b in nft.branch_layout(3, T, "rotate", offset=7)] == [8, 1, 2]


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
    T, sig = 10, nft.shifted_sigmas(10)
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
    sig = nft.shifted_sigmas(10, 3.0)
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


def test_gradient_unit_W_columns_are_proportional_to_one_over_g_and_equal_columns_split_the_loss():
    rng = np.random.default_rng(3)
    sig, lam = nft.shifted_sigmas(10, 3.0), np.array([1.0, 2.0])
    cols = recast_controls.gradient_unit_columns(sig, lam)
    W = recast.solve_W(lam, recast.profiles(rng.random((2, 10)) ** 3), col_sums=cols)
    g = sig[:-1]  # velocity-space gradient size per unit weight, derivations.ipynb §11
    assert np.allclose(W.sum(1), lam, atol=1e-9)
    assert np.allclose(W.sum(0) * g / (W.sum(0) * g).mean(), 1.0, atol=1e-9)  # column sums propto 1 / g_j
    # omega_j L(r~_j) with the equal-column W' is the W-weighted sum of per-reward NFT losses
    omega, W_eq = recast_controls.equal_columns(W)
    assert np.allclose(W_eq.sum(0), lam.sum() / 10, atol=1e-12) and np.allclose(omega.mean(), 1.0)
    N, d = 40, 3
    step = torch.as_tensor(rng.integers(0, 10, N))
    s = torch.as_tensor(sig[:-1])[step]
    r = torch.as_tensor(rng.random((N, 2)))
    v, v_old, x0, xt = (torch.as_tensor(rng.standard_normal((N, d))) for _ in range(4))
    lhs = torch.as_tensor(omega)[step] * nft.nft_loss(
        v, v_old, xt, x0, s, recast.mix_optimality(r, torch.as_tensor(W_eq), step)
    )
    rhs = sum(
        10 / lam.sum() * torch.as_tensor(W)[k, step] * nft.nft_loss(v, v_old, xt, x0, s, r[:, k]) for k in range(2)
    )
    assert torch.allclose(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_nft_update_weighs_each_step_by_omega_with_gradient_column_units(monkeypatch):
    """For any W (columns unequal: --column-units gradient, --credit file; or equal) the per-sample loss nft_update
    hands to update_loop at step j is sum_k (T / Lam) W_kj nft_loss(r_k) (omega_j times the equal-column mixture's
    loss where the columns differ)."""
    rng = np.random.default_rng(4)
    sig, lam, T, N = nft.shifted_sigmas(10, 3.0), np.array([0.7, 0.3]), 10, 12
    cols = recast_controls.gradient_unit_columns(sig, lam)
    W = recast.solve_W(lam, recast.profiles(rng.random((2, T)) ** 3), col_sums=cols)
    r = rng.random((N, 2))
    monkeypatch.setattr(nft, "update_loop", lambda run, b, args, gen, on_step, policy_loss: policy_loss)
    j = torch.as_tensor(rng.integers(0, T, N))
    nb = SimpleNamespace(i=torch.arange(N), j=j, s=torch.as_tensor(sig[:-1], dtype=torch.float32)[j])
    nb.x0, nb.x_t = torch.randn(N, 3, 2, 2), torch.randn(N, 3, 2, 2)
    v_theta, v_old = torch.randn(N, 3, 2, 2), torch.randn(N, 3, 2, 2)
    per_reward = [
        nft.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, torch.as_tensor(r[:, k], dtype=torch.float32))
        for k in range(2)
    ]
    for M in (W, recast.solve_W(lam, recast.profiles(rng.random((2, T)) ** 3))):  # unequal columns, then equal
        got = recast.nft_update(None, None, r, M, SimpleNamespace(nft_b=1.0), None, None)(nb, v_theta, v_old)
        Mt = torch.as_tensor(M, dtype=torch.float32)
        want = sum(T / lam.sum() * Mt[k, j] * per_reward[k] for k in range(2))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # the same W read with equal columns (its mixture's loss, no step weight) would differ: the check has power
    r_mix = recast.mix_optimality(torch.as_tensor(r, dtype=torch.float32), torch.as_tensor(W / W.sum()).float(), j)
    unweighted = nft.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, r_mix)
    assert not torch.allclose(
        unweighted,
        sum(T / lam.sum() * torch.as_tensor(W).float()[k, j] * per_reward[k] for k in range(2)),
        rtol=1e-3,
        atol=1e-4,
    )


@pytest.mark.parametrize("credit", ["recast", "recast_reversed", "uniform", "nft"])
def test_column_units_gradient_in_a_run(tiny, tmp_path, monkeypatch, credit):
    """A tiny run with --column-units gradient logs W with column sums propto 1 / s_j (rows: the budgets), and the
    update gets it (--credit nft: combine_raw's one row of sum 1 with those columns)."""
    got = []

    def record(run, b, r_train, W_train, args, gen, on_step):
        got.append(W_train)
        return {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": 0}

    monkeypatch.setattr(recast, "nft_update", record)
    out = tmp_path / "run"
    argv = tiny_argv(
        tiny, out, "--iterations", "1", "--eval-every", "0", "--credit", credit, "--column-units", "gradient"
    )
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    m = read_metrics(out)[0]
    cols = recast_controls.gradient_unit_columns(np.array(m["recast/sigmas"]), [0.6, 0.4])
    W = np.array(m["recast/W"])
    assert np.abs(W.sum(1) - [0.6, 0.4]).max() < 1e-9 and np.abs(W.sum(0) - cols).max() < 1e-9
    assert cols[-1] / cols[0] > 50  # the last training step's small t: a real reweighting
    want = cols[None] / 1.0 if credit == "nft" else W
    assert np.abs(np.asarray(got[0]) - want).max() < 1e-9


def test_credit_file_trains_with_the_files_W_held_fixed(tiny, tmp_path, monkeypatch):
    """--credit file: the run logs and trains with the file's W (unequal columns and rows other than the budgets) at
    every iteration; the file's W equal to uniform W gives --credit uniform's run, metric for metric."""
    T = recast.parse_args(tiny_argv(tiny, tmp_path / "x")).steps
    W = np.random.default_rng(0).random((2, T)) ** 2
    W /= W.sum()  # the budgets' sum, 0.6 + 0.4
    path = tmp_path / "W.json"
    path.write_text(json.dumps({"rewards": ["brightness", "redness"], "W": W.tolist()}))
    got = []

    def record(run, b, r_train, W_train, args, gen, on_step):
        got.append(np.asarray(W_train))
        return {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": 0}

    with monkeypatch.context() as m:
        m.setattr(recast, "nft_update", record)
        out = tmp_path / "fixed"
        argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "0", "--credit", "file")
        recast.train(recast.parse_args([*argv, "--credit-file", str(path)]), extra_rewards=TINY_REWARDS)
    assert len(got) == 2 and all(np.array_equal(g, W) for g in got)
    assert all(np.array_equal(np.array(row["recast/W"]), W) for row in read_metrics(out))
    rows = {}
    path.write_text(json.dumps({"rewards": ["brightness", "redness"], "W": recast.uniform_W([0.6, 0.4], T).tolist()}))
    for credit, more in (("uniform", []), ("file", ["--credit-file", str(path)])):
        argv = tiny_argv(tiny, tmp_path / credit, "--iterations", "1", "--eval-every", "0", "--credit", credit, *more)
        recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
        rows[credit] = {k: v for k, v in read_metrics(tmp_path / credit)[0].items() if not k.startswith("time/")}
    assert rows["file"] == rows["uniform"]


@pytest.mark.parametrize(
    "content, more, words",
    [
        (None, [], "needs --credit-file, a JSON file"),
        ("{", [], "not .* JSON"),
        ({"rewards": ["redness", "brightness"]}, [], "rewards .* are not --rewards"),
        ({"W": [[0.1] * 3]}, [], r"shape \(1, 3\), not \(2, "),
        ({"neg": True}, [], "negative or non-finite"),
        ({"W_scale": 2.0}, [], "sums to 2, not the budgets' sum 1"),
        ({}, ["--credit", "uniform"], "is read with --credit file only"),
    ],
    ids=["missing", "not-json", "rewards", "shape", "negative", "total", "without-file-credit"],
)
def test_a_bad_credit_file_is_refused_before_the_model_loads(tiny, tmp_path, monkeypatch, content, more, words):
    """--credit-file is checked in validate: each problem named with the file, nothing loaded, no run folder."""
    out, path = tmp_path / "run", tmp_path / "W.json"
    T = recast.parse_args(tiny_argv(tiny, out)).steps
    spec = {"rewards": ["brightness", "redness"], "W": recast.uniform_W([0.6, 0.4], T).tolist()}
    if isinstance(content, dict):
        spec.update({k: v for k, v in content.items() if k in spec})
        if content.get("neg"):
            spec["W"][0][0] = -0.01
        spec["W"] = (np.asarray(spec["W"]) * content.get("W_scale", 1.0)).tolist()
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(spec))
    monkeypatch.setattr(sd3, "load_pipeline", lambda *a: pytest.fail("the model loaded"))
    argv = tiny_argv(tiny, out, "--credit", "file", "--credit-file", str(path), *more)
    with pytest.raises(SystemExit, match=words):
        recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert not out.exists()


def test_time_reversed_W_is_W_flipped_with_the_same_marginals():
    """--credit recast_reversed, the control for credit in time: W from each profile flipped in time. With equal
    columns (loss units) it is recast's W flipped (solve_W treats the steps alike), so rows (budgets) and columns are
    unchanged; with gradient-unit columns, whose sums differ per step, it keeps those marginals instead."""
    lam, P = random_instance(10)
    W, Wr = recast.solve_W(lam, P), recast.solve_W(lam, P[:, ::-1])
    assert np.abs(Wr - W[:, ::-1]).max() < 1e-9 and np.abs(Wr - W).max() > 1e-3
    sigmas = np.linspace(1, 0, P.shape[1] + 1)
    sigmas[-2] = 0.01
    cols = recast_controls.gradient_unit_columns(sigmas, lam)
    Wg = recast.solve_W(lam, P[:, ::-1], col_sums=cols)
    assert np.abs(Wg.sum(1) - lam).max() < 1e-9 and np.abs(Wg.sum(0) - cols).max() < 1e-9


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
    got = nft.nft_loss(v_theta, v_old, x_t, x0, t, r, b)
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
    r = torch.as_tensor(nft.optimality(A.numpy() * 1.0, np.zeros(8), std=1.0 - 1e-4))  # A / (std + 1e-4) = A
    ours = nft.nft_loss(ours_v, v_old, x_t, x0, t, r, b).mean()
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
            assert nft.old_decay(step, decay_type) == return_decay(step, decay_type)
    assert nft.old_decay(76, 2) == pytest.approx(0.0075) and nft.old_decay(600, 1) == 0.5
    assert [nft.ema_decay(s) for s in (0, 1, 80, 81, 1000)] == [0.1, 2 / 11, 81 / 90, 0.9, 0.9]


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
        ours, prev = nft.dpm2_step(ours, x0_hat, prev, float(sig[i - 1]) if i else 1.0, t, t_next), x0_hat
        euler = nft.ode_step(euler, vel(euler, t), t, t_next)
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
    mixed_loss = nft.nft_loss(v_theta, v_old, x_t, x0, t, recast.mix_optimality(r, W, step))
    per_reward = torch.stack([nft.nft_loss(v_theta, v_old, x_t, x0, t, r[:, k]) for k in range(4)], 1)
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
    assert math.isclose(nft.sde_step(x, v, s, s_next, a, s1, 0.0), x + drift * (s_next - s))
    assert math.isclose(
        nft.sde_step(x, v, s, s_next, a, s1, 1.0) - nft.sde_step(x, v, s, s_next, a, s1, 0.0),
        math.sqrt(g2 * (s - s_next)),
    )
    # at s = 1 the denominator uses s_1
    assert math.isfinite(nft.sde_step(x, v, 1.0, 0.9, a, 0.9, 1.0))


# -----------------------------------------------------------------------------
# DiffusionNFT written once (nft.py); both scripts on one skeleton
# -----------------------------------------------------------------------------


def top_level_names(path):
    """The functions and classes a module's file defines at its top level."""
    import ast

    tree = ast.parse(Path(path).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def banners(path):
    """The section titles of a file, in order: the line under each `# ===...` rule that opens a section."""
    lines = Path(path).read_text().splitlines()
    return [
        lines[i + 1][2:] for i in range(len(lines) - 2) if re.fullmatch(r"# =+", lines[i]) and lines[i + 2] == lines[i]
    ]


def test_diffusionnft_is_written_once_in_nft_py_and_each_function_has_one_name():
    """Neither script defines a function of nft.py again, and none hands one on under its own name (recast.optimality
    does not exist: the toy, the tests and the notebook all call nft.optimality); the two scripts' shared sections
    (after each method's own, the NOTES.md sections) come in the same order and are all there is (ReCAST's controls
    are recast_controls.py's), so a reader moving from one script to the other finds each part where the other had
    it."""
    defined = top_level_names(nft.__file__)
    assert {"optimality", "nft_loss", "tree_rollout", "update_loop", "global_stats", "optimizer_step"} <= defined
    for script in (recast, rvge):
        assert not top_level_names(script.__file__) & defined, script.__name__
        declared = {"flag", "NFTArgs"}  # what a script's Args is declared with, imported from nft.py by that name
        assert not [n for n in defined - declared if hasattr(script, n)], script.__name__
    skeleton = [
        [re.sub("ReCAST|RVGE", "<method>", b.split(":")[0]) for b in banners(script.__file__) if not b.startswith(own)]
        for script, own in ((recast, "NOTES.md"), (rvge, "NOTES.md"))
    ]
    assert (
        skeleton[0]
        == skeleton[1]
        == [
            "<method>'s glue",
            "Train loop",
            "Arguments (flags in --help sections) and <method>'s checks",
            "The script's entry points",
        ]
    )


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
    n, got1, got2 = recast_controls.read_level_stats(path, ["c", "a"], T)
    assert (
        n.tolist() == [5.0] * (T + 1)
        and got1.tolist() == [s1[2].tolist(), s1[0].tolist()]
        and got2.tolist() == (got1**2).tolist()
    )
    with pytest.raises(SystemExit, match="--steps 10"):
        recast_controls.read_level_stats(path, ["a"], 10)
    with pytest.raises(SystemExit, match="holding rewards \\['a', 'zzz'\\]"):
        recast_controls.read_level_stats(path, ["a", "zzz"], T)
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="--gain-init"):
        recast_controls.read_level_stats(path, ["a"], T)


def test_gain_init_refuses_negative_counts_and_another_grid_or_world(tmp_path):
    """--gain-init: a negative count n or sum of squares s2 (which would switch the credit off, as NaN does) is
    refused; where the file records its sampler grid and world, another grid or world than the run's is refused, and
    the same ones are accepted (a file that records neither is read as before)."""
    T, names = 4, ["a", "b"]
    grid = [1.0, 0.8, 0.5, 0.2, 0.0]
    saved = {"names": names, "steps": T, "n": [5.0] * 5, "s1": [[0.1] * 5] * 2, "s2": [[0.2] * 5] * 2}
    path = tmp_path / "profiles.json"
    for key, bad in (("n", [5.0, -1.0, 5.0, 5.0, 5.0]), ("s2", [[0.2] * 5, [0.2, 0.2, -0.1, 0.2, 0.2]])):
        path.write_text(json.dumps({**saved, key: bad}))
        with pytest.raises(SystemExit, match=f"field '{key}' holds 1 negative entries"):
            recast_controls.read_level_stats(path, names, T)
    path.write_text(json.dumps({**saved, "sigmas": grid, "world": "abc"}))
    grid32 = np.array(grid, dtype=np.float32)
    assert recast_controls.read_level_stats(path, names, T, sigmas=grid32, world="abc")[0].shape == (5,)
    with pytest.raises(SystemExit, match="measured on the sampler grid"):
        recast_controls.read_level_stats(path, names, T, sigmas=np.array([1.0, 0.9, 0.5, 0.2, 0.0]))
    with pytest.raises(SystemExit, match="measured on world abc, this run's model is world xyz"):
        recast_controls.read_level_stats(path, names, T, world="xyz")
    path.write_text(json.dumps(saved))
    assert recast_controls.read_level_stats(path, names, T, sigmas=np.array(grid), world="xyz")[0].shape == (5,)


def test_gain_init_world_starts_the_embedded_defaults_from_the_worlds_profiles_and_nothing_else():
    """--gain-init world (the default): the embedded world's pretrained profiles, this world's (its id), where they fit
    the run (the embedded model, pairs, tree sampler, 10 steps, rewards the file holds); nothing where they do not, and
    nothing with none."""
    import world as shapes_world

    saved = json.loads(shapes_world.PROFILES_PATH.read_text())
    assert saved["world"] == shapes_world.world_id() and set(shapes_world.DEFAULT_REWARDS) <= set(saved["names"])
    names = list(shapes_world.DEFAULT_REWARDS)
    n, s1, s2 = recast_controls.gain_prior(recast.parse_args([]), names)
    rows = [saved["names"].index(k) for k in names]
    assert n.tolist() == saved["n"] and s1.tolist() == [saved["s1"][i] for i in rows]
    assert s2.tolist() == [saved["s2"][i] for i in rows]
    for flags in (["--gain-init", "none"], ["--steps", "12"], ["--gain-estimator", "denoised"], ["--sampler", "ode"]):
        assert recast_controls.gain_prior(recast.parse_args(flags), names) is None, flags
    # a reward the file does not hold; another model or world
    assert recast_controls.gain_prior(recast.parse_args([]), ["texture_lines"]) is None
    assert recast_controls.gain_prior(recast.parse_args(["--model", "elsewhere"]), names) is None


# -----------------------------------------------------------------------------
# recast.py end to end on a tiny random SD3 pipeline built from configs
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "credit, estimator", [("recast", "pairs"), ("recast", "denoised"), ("nft", "pairs"), ("recast_reversed", "pairs")]
)
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
        P = np.array(m["recast/profile"])
        if credit == "recast":  # the logged profiles (credit.png's) are those W is solved from, after the shrinkage
            assert np.allclose(recast.solve_W([0.6, 0.4], P), W, atol=1e-12)
        if credit == "recast_reversed":  # the control: W from the same profiles flipped in time
            assert np.allclose(recast.solve_W([0.6, 0.4], P[:, ::-1]), W, atol=1e-12)
        assert np.isfinite([m["loss/policy"], m["reward/weighted"], m["eval/brightness"]]).all()
    assert "eval_before/brightness" in rows[0]
    for fig in ("rewards.png", "samples.png"):
        assert (out / fig).stat().st_size > 0
    # credit.png draws W's timing: there is none under --credit nft (one W row, uniform), so it is not drawn there
    assert (out / "credit.png").exists() == (credit != "nft")
    assert credit == "nft" or (out / "credit.png").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["args"]["credit"] == credit
    assert not (out / "tensorboard").exists()  # --report-to none: metrics.jsonl only
    assert_loads_as_trained(recast, out, out / "checkpoints" / (out / "checkpoints" / "latest").read_text())


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_where_to_change_what_names_functions_that_exist(module):
    script = __import__(module)
    block = script.__doc__.split("Where to change what")[1]
    words = {"reward_models", "w_kj", "README", "recast_reversed"}  # files, a symbol, a flag value
    names = set(re.findall(r"\b(?:[a-z0-9]+_[a-z0-9_]+|Args|Run|[A-Z_]{4,})\b", block)) - words
    assert len(names) > 20
    kit = [importlib.import_module(f"kit.{p.stem}") for p in Path(reward_models.__file__).parent.glob("*.py")]
    homes = (script, nft, sd3, recast_controls, *kit)
    missing = [n for n in names if not any(hasattr(home, n) for home in homes)]
    assert not missing, (
        f"the map in {module}.py's docstring names {missing}, which neither {module}.py, nft.py nor the kit defines"
    )
    for home in (nft, sd3, recast_controls, *kit):  # a qualified name lives where it says
        named = set(re.findall(rf"\b{home.__name__.split('.')[-1]}\.([A-Za-z0-9_]+)\b", block)) - {"x", "py"}
        assert (named or home is not nft) and not [n for n in named if not hasattr(home, n)], (home.__name__, named)


def test_the_main_command_prints_one_progress_bar_with_reward_and_loss_and_no_warnings(tmp_path):
    """The README's first command (embedded model) for one small iteration, in a fresh process: stderr holds the
    progress bar with its live reward and loss and nothing else (no library notice, no loading bar); stdout the
    closing summary."""
    cmd = [sys.executable, str(Path(recast.__file__)), "--iterations", "1", "--prompts-per-iter", "2"]
    cmd += ["--eval-every", "0", "--updates-per-iter", "1", "--out", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [line for line in re.split(r"[\r\n]+", done.stderr) if line.strip()]
    assert lines and all(line.startswith("recast: ") for line in lines), lines
    assert re.search(r"1/1 .*reward=[-0-9.]+, loss=[-0-9.e]+", lines[-1]), lines[-1]
    assert done.stdout.splitlines() == figures.print_summary(tmp_path / "run", departure=True)  # the closing summary


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
    assert (out / "samples.png").exists() and (out / "directions.png").exists()
    assert (out / "credit.png").exists() == (credit == "recast")  # rvge draws ReCAST's W only where it learns it


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
    d2 = nft.ema_decay(2)
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
    real_score = nft.rollout_and_score

    def rollout_and_score(*a, **k):
        b = real_score(*a, **k)
        assert [j for j, _, _ in b.probes] == [1, 8]
        return b

    monkeypatch.setattr(nft, "rollout_and_score", rollout_and_score)
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


TWO_PROC_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
import {module} as script, nft, recast, test_recast
from accelerate import PartialState
solve = recast.solve_W  # both scripts build W in recast.credit
def recorded(*a, **k):
    W = solve(*a, **k)
    with open({out!r} + f"/W_rank{{PartialState().process_index}}.txt", "a") as f:
        f.write(repr(W.tolist()) + "\\n")
    return W
recast.solve_W = recorded
average_grads = nft.average_grads
def averaged(acc, params):  # the gradients each rank steps with, after the one all-reduce
    average_grads(acc, params)
    with open({out!r} + f"/grads_rank{{PartialState().process_index}}.txt", "a") as f:
        f.write(repr([float(p.grad.double().sum()) for p in params]) + "\\n")
nft.average_grads = averaged
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
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "2", "--device", "cpu", "--credit", "recast")
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
    # each rank saw its own prompts, yet the statistics are global, and both step with the same mean gradients
    grads = [(out / f"grads_rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    assert len(grads[0]) == 2 * 8 and grads[0] == grads[1]  # 8 optimizer steps an iteration
    rows = read_metrics(out)
    assert len(rows) == 2
    # the evaluation split over the two processes and gathered gives one process's numbers (evaluate.py)
    import evaluate

    alone = evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    assert alone == pytest.approx({k: v for k, v in rows[-1].items() if k.startswith("eval/")}, rel=1e-5)


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


@pytest.mark.parametrize("change", [["--nft-b", "nan"], ["--alpha", "0"]])
def test_recast_only_flags_are_checked(tiny, tmp_path, change):
    with pytest.raises(SystemExit, match=re.escape(change[0])):
        recast.validate(recast.parse_args(tiny_argv(tiny, tmp_path / "run", *change)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize("credit", ["recast", "recast_reversed"])
def test_learned_W_with_pairs_needs_branched_rollouts(tiny, tmp_path, credit):
    """W learned from the pairs estimator (--credit recast, and its time-reversed control) needs sibling leaves: an
    ODE sampler is refused naming the credit and both fixes; --credit uniform (W not learned) is not refused."""
    argv = tiny_argv(tiny, tmp_path / "run", "--credit", credit, "--sampler", "ode")
    with pytest.raises(SystemExit, match=f"--credit {credit} with --gain-estimator pairs needs branched rollouts"):
        recast.validate(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    argv = tiny_argv(tiny, tmp_path / "ok", "--credit", "uniform", "--sampler", "ode")
    recast.validate(recast.parse_args(argv), extra_rewards=TINY_REWARDS)


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


# -----------------------------------------------------------------------------
# The embedded model (assets/shapes-sd3) with both scripts
# -----------------------------------------------------------------------------


def linear_latent_cosines(pipe_path, prompts, max_len, seed=0):
    """Directions of rvge from one batch of tree rollouts, for a reward linear in the clean latents
    R = w . x0: the cosine of each group's direction with the reward's gradient w, per bandwidth."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(pipe_path, local_files_only=True)
    pipe.scheduler.set_timesteps(10)
    emb, pooled = sd3.encode(pipe, prompts, max_len, "cpu")
    tr = pipe.transformer
    shape = (tr.config.in_channels, tr.config.sample_size, tr.config.sample_size)
    gen = torch.Generator().manual_seed(seed)
    leaves, groups, ancestry, _ = nft.tree_rollout(
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
    import world as shapes_world

    cos = linear_latent_cosines(
        worlds.EMBEDDED_MODEL,
        shapes_world.sample_prompts(6, "train", 0),
        shapes_world.GEN_KWARGS["max_sequence_length"],
    )
    for bandwidth, c in cos.items():
        print(f"{bandwidth}: mean cosine {c.mean():.3f} ± {c.std() / np.sqrt(len(c)):.3f} over {len(c)} groups")
        assert c.mean() > 3 * c.std() / np.sqrt(len(c)) and c.mean() > 0.02
