"""ReCAST: Reward Credit Assignment across Timesteps, on top of DiffusionNFT.

One self-contained file, read top to bottom: ReCAST's math in the paper's order (Renyi discriminability
curves of each reward, their gains per sampler step, the W solver, the mixed NFT loss), its glue (credit,
the update), the train loop, the flags; then the DiffusionNFT skeleton and run machinery, one block that is
the same text in rvge.py (so `diff recast.py rvge.py` shows the two methods). Derivations: derivations.ipynb;
the design each "§n" names: NOTES.md.

Notation map (code name -> symbol)
    lam      (K,)      reward budgets lambda_k (user preference), not normalised
    Lam                sum_k lambda_k
    sigmas   (T+1,)    sampler grid s_0 = 1 > s_1 > ... > s_T = 0 (t = 1 is pure noise)
    r        (N, K)    per-reward optimality probability r_k in [0, 1] (DiffusionNFT)
    D        (K, T+1)  Renyi discriminability curve D_k(s_j), D_k(1) = 0
    gains    (K, T)    g_kj = D_k(s_j) - D_k(s_{j-1}) >= 0, rows sum to D_k(0)
    P        (K, T)    profile P_kj = g_kj / sum_j g_kj
    W        (K, T)    credit matrix, rows sum to lambda_k, columns to Lam / T
    r_mix    (N,)      per-timestep mixture sum_k (T / Lam) W_kj r_k
    v_*      (B, C, H, W) velocities; x0_hat = x_t - t v (Tweedie, rectified flow)

Conventions: x_t = (1 - t) x0 + t eps; all losses are means over latent
dimensions, then over the batch; numpy math is float64.

Where to change what
    flags      Args (a field, its --help section in ARG_GROUPS, its checks), validate
    sampler    tree_rollout (trees; sde_step / sde_continue after a branch, ode_step or dpm2_step before),
               rollout_and_score (which adapter samples, what is decoded and scored)
    rewards    reward_models.py (REWARD_MODELS, build_rewards; README "Add a reward"), score, reward_extras
    credit     credit: level_observations -> level_curves -> credit_profiles -> solve_W; --credit nft: nft_baseline
    loss       nft_loss, mix_optimality (r~ per step), nft_update; the loop shared with rvge.py: update_loop
    old policy old_decay (the soft update of "old" each iteration), ema_decay (--ema)
    logging    reward_metrics + train's metrics line, finish_iteration (metrics.jsonl, log_to_trackers,
               checkpoints), progress bar in train, figures in plot_run and save_grid
    the loop   train (steps 1-4), setup_run, start_or_resume
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from reward_models import DEFAULTS, REWARD_MODELS, build_rewards, ocr_target

# =============================================================================
# ReCAST §3.2: Renyi discriminability of a reward's positive policy
# =============================================================================


def renyi_moment(h, Z, alpha):
    """Per-sample Renyi integrand: (h / Z)^alpha, or (h / Z) log(h / Z) for the KL limit alpha = 1.
    Averaging it over p_t and passing the mean to `renyi_from_moment` gives D_alpha(p+_t || p_t)."""
    q = np.asarray(h, dtype=np.float64) / Z
    if alpha == 1:
        return np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)
    return q**alpha


def renyi_from_moment(m, alpha):
    """D_alpha = 1 / (alpha - 1) log E[(h/Z)^alpha]; for alpha = 1 (KL) the moment is D itself."""
    if alpha <= 0:
        raise ValueError(f"Renyi order alpha must be > 0, got {alpha}")
    if alpha == 1:
        return np.asarray(m, dtype=np.float64)
    return np.log(np.maximum(m, 1e-300)) / (alpha - 1)


def renyi_from_h(h, alpha=2.0, weights=None):
    """D_alpha(p+ || p) for p+ = p h / Z from values h(x) >= 0 at samples (or quadrature nodes) of p.

    D = 1 / (alpha - 1) log E_p[(h / Z)^alpha], Z = E_p[h]  (derivations.ipynb §5).
    h (..., M); weights (M,) summing to one (default: uniform). Returns (...).
    D = 0 when h is constant (or identically zero)."""
    h = np.asarray(h, dtype=np.float64)
    w = np.full(h.shape[-1], 1.0 / h.shape[-1]) if weights is None else np.asarray(weights, dtype=np.float64)
    Z = (h * w).sum(-1, keepdims=True)
    safe_Z = np.where(Z > 0, Z, 1.0)
    D = renyi_from_moment((renyi_moment(h, safe_Z, alpha) * w).sum(-1), alpha)
    return np.where(Z[..., 0] > 0, D, 0.0)


def denoised_moments(h, alpha=2.0):
    """Sufficient statistics of the `denoised` (plug-in) estimator, any alpha > 0.

    h (L, N, K): plug-in optimality h_{k,t_l} ~ r_k(decode(x0_hat(x_{t_l}))) at probe level l.
    Z is the mean over all N samples of the level, not per prompt group: the leaves of one
    tree are correlated, and a per-group Z under-states D (toy_gaussian.py check 4 measured
    -34% at t = 0 against -1% pooled). Returns (sums (K, L), counts (L,)) of the Renyi
    integrand; `renyi_from_moment(sums / counts, alpha)` gives D. Z must be reduced across
    processes first when there are several (it is 0.5 by construction for group-centred r)."""
    h = np.asarray(h, dtype=np.float64)
    Z = h.mean(1, keepdims=True)
    return renyi_moment(h, np.where(Z > 0, Z, 1.0), alpha).sum(1).T, np.full(h.shape[0], float(h.shape[1]))


# =============================================================================
# ReCAST §3.3: D_k(t) measured during training, with standard errors
# =============================================================================


def split_levels(ancestry):
    """Level at which two leaves' trajectories split, from their ancestry codes.

    ancestry (N, L+1) ints: column 0 the root id, column l the branch index taken
    at branch time l (l = 1..L). Returns S (N, N): the number of leading columns
    two leaves share. S = 0: different roots (independent, t = 1); S = l: split at
    branch time l; S = L+1: the same leaf (t = 0)."""
    A = np.asarray(ancestry)
    same = A[:, None, :] == A[None, :, :]  # (N, N, L+1)
    return np.cumprod(same, axis=-1).sum(-1)


def pair_moments(r, groups, ancestry):
    """Sufficient statistics of the `pairs` estimator (alpha = 2), summable across processes.

    For leaves a, b of one prompt group whose trajectories split at level l,
    E[r_a r_b] = E[h_{t_l}^2] (they are independent given x_{t_l}, and sample x0 | x_{t_l} when the
    continuation reverses the noising: a = sqrt(2), exactly as the SDE steps shrink, closely with
    --sde-substeps; derivations.ipynb §7, toy_gaussian.py check 8a); different
    roots give Z^2 (level 0), a leaf with itself gives E[r^2] (t = 0).
    r (N, K); groups (N,); ancestry (N, L+1).
    Returns (sums (K, L+2), counts (L+2,)): sum of r_a r_b and number of ordered
    pairs a != b (a == b for the last level) per level, within groups only."""
    r = np.asarray(r, dtype=np.float64)
    r = r[:, None] if r.ndim == 1 else r
    S = split_levels(ancestry)
    n_levels = np.asarray(ancestry).shape[1] + 1
    same_group = np.asarray(groups)[:, None] == np.asarray(groups)[None, :]
    prods = np.einsum("ak,bk->kab", r, r)  # (K, N, N)
    sums = np.zeros((r.shape[1], n_levels))
    counts = np.zeros(n_levels)
    for level in range(n_levels):
        mask = same_group & (S == level)
        sums[:, level] = (prods * mask).sum((1, 2))
        counts[level] = mask.sum()
    return sums, counts


def pairs_curve(sums, counts):
    """D_2 at every level from pair statistics: D(t_l) = log(mean_l r_a r_b / mean_0 r_a r_b).
    Level 0 (different roots) is t = 1, so D = 0 there by construction. Levels with
    no pairs are NaN (dropped by `gains_on_grid`). Returns (K, L+2)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts
        return np.log(np.maximum(means, 1e-300) / np.maximum(means[:, :1], 1e-300))


def level_observations(r, groups, ancestry, layouts, T, probes=(), estimator="pairs", alpha=2.0):
    """Per-group observations of D's levels, summed into statistics that add across processes and
    iterations: n (T+1,) groups observed at grid level j (t = sigma_j; j = T is t = 0), s1 / s2 (K, T+1)
    sums of the observations and of their squares. One observation per group and level makes the
    standard error honest about within-group correlation (derivations.ipynb §7).

    pairs (alpha = 2): column 0 holds each group's mean cross-root product (the Z^2 baseline); column j
    the group's mean sibling product at its split level minus that baseline (a paired difference: the
    prompt's own scale cancels); column T the mean r^2 minus the baseline. D(s_j) = log(1 + m_j / m_0).
    denoised (any alpha): probes (step, h (n, K), group ids (n,)) give column j the group's mean of
    (h / Z_g)^alpha (`renyi_moment`, Z_g the group's mean h); column T uses the final r.
    r (N, K); groups (N,) group ids indexing layouts; ancestry (N, L+1) as in `split_levels`."""
    r = np.asarray(r, dtype=np.float64)
    K = r.shape[1]
    n, s1, s2 = np.zeros(T + 1), np.zeros((K, T + 1)), np.zeros((K, T + 1))

    def add(j, obs):
        if np.isfinite(obs).all():
            n[j] += 1
            s1[:, j] += obs
            s2[:, j] += obs * obs

    def moment(h):  # the group's mean of (h / Z_g)^alpha
        sums, counts = denoised_moments(h[None], alpha)
        return sums[:, 0] / counts[0]

    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        if estimator == "pairs":
            sums, counts = pair_moments(r[rows], groups[rows], ancestry[rows])
            with np.errstate(invalid="ignore", divide="ignore"):
                means = sums / counts  # (K, L+2): cross roots, each split level, self
            add(0, means[:, 0])
            for level, j in enumerate(list(layouts[g]) + [T], 1):
                add(j, means[:, level] - means[:, 0])
        else:
            add(T, moment(r[rows]))
    for j, h, probe_groups in probes:
        for g in np.unique(probe_groups):
            add(j, moment(np.asarray(h, dtype=np.float64)[probe_groups == g]))
    return n, s1, s2


def level_curves(n, s1, s2, estimator="pairs", alpha=2.0):
    """D (K, T+1) and its standard error at each grid level from `level_observations` statistics
    (summed over processes, discounted over iterations). Level 0 (t = 1) is D = 0 exactly; levels with
    fewer than 2 observations are NaN. se: the delta method on the level mean (sample variance over
    groups / n): pairs se_j = se(m_j) / m_0; denoised se(mean) / (mean (alpha - 1)), alpha = 1: se(mean)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s1 / n
        var = np.maximum(s2 / n - mean**2, 0.0) * n / (n - 1)
        se_mean = np.sqrt(var / n)
        if estimator == "pairs":
            D, se = np.log1p(mean / mean[:, :1]), se_mean / mean[:, :1]
        elif alpha == 1:
            D, se = mean, se_mean
        else:
            D, se = renyi_from_moment(mean, alpha), se_mean / (mean * (alpha - 1))
    bad = (n < 2)[None, :] | ~np.isfinite(D) | ~np.isfinite(se)
    D, se = np.where(bad, np.nan, D), np.where(bad, np.nan, se)
    D[:, 0], se[:, 0] = 0.0, 0.0
    return D, se


# =============================================================================
# ReCAST §3.3: gains and profiles, shrunk by their evidence
# =============================================================================


def monotone_curve(t_levels, D_levels, weights=None):
    """Project level estimates onto curves that are 0 at t = 1 and non-increasing in t.

    Isotonic (least-squares, weighted) regression of D on decreasing t, then
    clipped at 0 (D >= 0 for alpha > 0). NaN levels are dropped; t = 1 and t = 0
    must be among the levels. Returns (t ascending (M,), D (M,))."""
    t = np.asarray(t_levels, dtype=np.float64)
    D = np.asarray(D_levels, dtype=np.float64)
    w = np.ones_like(t) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = np.isfinite(D) & (w > 0)
    t, D, w = t[keep], D[keep], w[keep]
    if not (np.isclose(t, 0).any() and np.isclose(t, 1).any()):
        raise ValueError("Renyi levels must include t = 0 (final rewards) and t = 1 (independent roots)")
    order = np.argsort(-t, kind="stable")  # from t = 1 down to t = 0: D non-decreasing along this
    from scipy.optimize import isotonic_regression

    fit = np.maximum(isotonic_regression(D[order], weights=w[order], increasing=True).x, 0.0)
    t_sorted = t[order]
    fit[t_sorted == 1.0] = 0.0
    t_u, first = np.unique(t_sorted[::-1], return_index=True)  # ascending t, duplicates merged
    return t_u, fit[::-1][first]


def gains_on_grid(t_levels, D_levels, sigmas, weights=None):
    """Renyi curves on the sampler grid and their per-step gains (NOTES.md §3.3).

    t_levels (L,); D_levels (K, L) raw estimates; sigmas (T+1,) from 1 down to 0.
    Monotone projection, then monotone (PCHIP) interpolation to the grid, then
    g_kj = D_k(s_j) - D_k(s_{j-1}). PCHIP reproduces the end points, so each row
    of gains sums to D_k(0) (telescoping, derivations.ipynb §6).
    Returns (D_grid (K, T+1), gains (K, T))."""
    from scipy.interpolate import PchipInterpolator

    D_levels = np.atleast_2d(np.asarray(D_levels, dtype=np.float64))
    sigmas = np.asarray(sigmas, dtype=np.float64)
    D_grid = np.zeros((D_levels.shape[0], len(sigmas)))
    for k, row in enumerate(D_levels):
        t_u, D_u = monotone_curve(t_levels, row, weights)
        D_grid[k] = PchipInterpolator(t_u, D_u)(np.clip(sigmas, 0.0, 1.0))
    D_grid = np.maximum(D_grid, 0.0)  # PCHIP is monotone on monotone data: this only removes rounding
    return D_grid, np.maximum(np.diff(D_grid, axis=1), 0.0)


def profiles(gains):
    """P_kj = g_kj / sum_j g_kj, uniform 1/T for a reward whose total gain is 0. (K, T) -> (K, T)."""
    gains = np.asarray(gains, dtype=np.float64)
    total = gains.sum(1, keepdims=True)
    return np.where(total > 0, gains / np.where(total > 0, total, 1.0), 1.0 / gains.shape[1])


def evidence_weight(D, se, c=2.0, n=None, family=True):
    """rho_k in [0, 1]: how far reward k's measured curve departs from the rewards' common shape, in
    its own standard errors (derivations.ipynb §6b). W only moves credit *between* rewards, so the
    null is "every reward has the same profile": D_k(s_j) = D_k(0) c_j with c_j = sum_k D_kj / sum_k D_k(0).
    With z_kj = (D_kj - D_k(0) c_j) / sqrt(se_kj^2 + c_j^2 se_k(0)^2) over the p measured inner levels
    and Q_k = sum_j z_kj^2: rho_k = max(0, 1 - c p / Q_k), a positive-part James-Stein factor with a
    stricter constant (c = 2 keeps rho = 0 unless Q > 2p; a chi^2_8 exceeds 16 with probability 4%).
    n (T+1,): the levels' observation counts. The se are estimated from those observations, so with few of
    them z_kj has Student-t tails, not normal ones, and pure-noise rewards passed the chi^2 test far more often
    than 4% (results/evidence-null). Each z_kj is then replaced by the normal score of its t tail probability
    with nu = min(n_j, n_0) - 1 degrees of freedom (derivations.ipynb §6c), which leaves it unchanged as n grows.
    family: the K rewards are K tests, and W moves as soon as one of them passes, so with K = 4 pure-noise rewards
    W left uniform ~4x as often as one test's rate. The threshold c p is then raised to the chi^2_p quantile at
    1 - alpha / K, alpha = P(chi^2_p > c p) (Bonferroni: the chance that any reward passes under the null stays
    <= alpha; derivations.ipynb §6d). K = 1 keeps c p. family=False: each reward tested alone (the default until
    the second session of 2026-12-01).
    D, se (K, T+1) from `level_curves`. Returns (K,)."""
    j, z = evidence_departures(D, se, n)
    if not len(j):
        return np.zeros(D.shape[0])
    Q = (z**2).sum(1)
    threshold = evidence_threshold(c, len(j), D.shape[0], family)
    return np.where(Q > 0, np.maximum(0.0, 1.0 - threshold / np.where(Q > 0, Q, 1.0)), 0.0)


def evidence_departures(D, se, n=None):
    """The z_kj of `evidence_weight`: reward k's departure from the rewards' common shape at each measured inner level
    j, in its standard error; the normal scores of their t tails when the counts n are given (§6c). Returns
    (j (p,), z (K, p)), p = 0 when no inner level is measured or the D(0) sum to 0."""
    T = D.shape[1] - 1
    inner = np.arange(1, T)
    measured = np.isfinite(D[:, inner]).all(0) & np.isfinite(D[:, T]).all()
    if not measured.any() or not np.sum(D[:, T]) > 0:
        return inner[:0], np.zeros((D.shape[0], 0))
    j = inner[measured]
    shape = D[:, j].sum(0) / D[:, T].sum()  # (p,) the common curve, D(0) = 1
    sd = np.sqrt(se[:, j] ** 2 + (shape * se[:, T:]) ** 2)
    z = (D[:, j] - D[:, T:] * shape) / np.where(sd > 0, sd, np.inf)
    if n is not None:
        z = normal_score_of_t(z, np.minimum(np.asarray(n, dtype=np.float64)[j], float(n[T])) - 1.0)
    return j, z


def evidence_threshold(c, p, K, family=True):
    """The Q_k above which `evidence_weight` gives reward k credit: c p alone; with family (K > 1) the chi^2_p quantile
    at 1 - P(chi^2_p > c p) / K, so that any of K null rewards passes with at most one test's rate (§6d)."""
    if not family or K <= 1:
        return c * p
    from scipy.stats import chi2

    return chi2.isf(chi2.sf(c * p, p) / K, p)


def normal_score_of_t(z, nu):
    """sign(z) Phi^-1(1 - F_t(|z|; nu)): the standard normal value with the same tail probability as z under
    Student's t with nu degrees of freedom (nu may be fractional: discounted counts). nu < 1e-6 is taken as 1e-6
    (one observation: no spread measured, z carries no evidence). In log space, so that far tails keep their size;
    where even the log tail underflows (huge z at huge nu, where t is normal) z itself. Never larger than |z|."""
    from scipy import special, stats

    z = np.asarray(z, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        score = -special.ndtri_exp(stats.t.logsf(np.abs(z), np.maximum(nu, 1e-6)))
    return np.sign(z) * np.where(np.isfinite(score), np.minimum(score, np.abs(z)), np.abs(z))


def credit_profiles(D, se, sigmas, n, c=2.0):
    """From measured levels to the profiles W is built from (NOTES.md §3.3, derivations.ipynb §6b).
    Per reward the measured levels (NaN ones skipped) are monotone-projected and PCHIP-interpolated to
    the grid (`gains_on_grid`, weights = observation counts). Each gain gets its noise floor added,
    g~_kj = g_kj + delta_k (delta_k: the mean standard error of reward k's level differences), so a step
    where no reward's gain is measurable carries no ratio between rewards; the profile P_k of g~ is then
    shrunk towards the rewards' mean profile by its evidence: P~_k = rho_k P_k + (1 - rho_k) mean_k P_k.
    rho = 0 for every reward gives identical profiles and so the uniform W; with more samples delta -> 0
    and rho -> 1, and W tends to the exact one. Returns (D_grid (K, T+1), gains (K, T), P~ (K, T), rho (K,))."""
    sigmas = np.asarray(sigmas, dtype=np.float64)
    T = len(sigmas) - 1
    D_grid, gains = np.zeros_like(D), np.zeros((D.shape[0], T))
    for k in range(D.shape[0]):
        if np.isfinite(D[k, T]):
            D_grid[k], gains[k] = (
                a[0] for a in gains_on_grid(sigmas, D[k][None], sigmas, weights=np.maximum(n, 1e-12))
            )
    se_steps = np.sqrt(se[:, 1:] ** 2 + se[:, :-1] ** 2)  # (K, T) level differences; unmeasured levels excluded
    floor = np.array([np.nanmean(row) if np.isfinite(row).any() else 0.0 for row in se_steps])
    P = profiles(gains + floor[:, None])
    rho = evidence_weight(D, se, c, n) if c > 0 else np.ones(D.shape[0])
    return D_grid, gains, rho[:, None] * P + (1 - rho[:, None]) * P.mean(0), rho


# =============================================================================
# ReCAST §3.4: the W solver
# =============================================================================


def solve_W(budgets, profile, tau=1.0, eps=1e-3, tol=1e-12, max_iter=20000, col_sums=None):
    """Credit matrix W (K, T): the KL (I-)projection of K_kj = lambda_k P~_kj^tau onto
    {row sums = lambda, column sums = Lam / T}, with P~ = (1 - eps) P + eps / T.

    The solution has the form W = diag(a) K diag(b) and is found by Sinkhorn
    iterations in the log domain (derivations.ipynb §8). Rewards with budget 0
    get a zero row. eps > 0 keeps K positive so a unique solution exists; eps = 0
    is allowed when the profile is strictly positive. tau = 0 gives the uniform
    W_kj = lambda_k / T; identical profiles give it too.
    col_sums (T,): other column sums than the equal Lam / T (positive, summing to Lam), e.g. columns equal in
    gradient units (toy_gaussian.py --train, derivations.ipynb §11); None (the default) is the equal Lam / T.
    """
    lam = np.asarray(budgets, dtype=np.float64)
    P = np.asarray(profile, dtype=np.float64)
    if P.ndim != 2 or P.shape[0] != lam.shape[0]:
        raise ValueError(f"profile must have shape (K, T) with K = {lam.shape[0]} budgets, got {P.shape}")
    if (lam < 0).any() or not np.isfinite(lam).all() or lam.sum() <= 0:
        raise ValueError(f"budgets must be finite, non-negative and not all zero, got {lam}")
    if (P < 0).any() or not np.isfinite(P).all():
        raise ValueError("profile must be finite and non-negative")
    if not 0 <= eps <= 1 or tau < 0:
        raise ValueError(f"need 0 <= eps <= 1 and tau >= 0, got eps={eps}, tau={tau}")
    T = P.shape[1]
    P_tilde = (1 - eps) * P + eps / T
    active = lam > 0
    if (P_tilde[active] <= 0).any() and tau > 0:
        raise ValueError("profile has zeros: use eps > 0 so that a solution with these marginals exists")
    logK = np.log(lam[active])[:, None] + tau * np.log(np.where(P_tilde[active] > 0, P_tilde[active], 1.0))
    log_row, log_col = np.log(lam[active]), np.full(T, np.log(lam.sum() / T))
    if col_sums is not None:
        col = np.asarray(col_sums, dtype=np.float64)
        if col.shape != (T,) or not (col > 0).all() or not np.isclose(col.sum(), lam.sum(), rtol=1e-9, atol=0):
            raise ValueError(f"col_sums must be {T} positive numbers summing to sum(budgets) = {lam.sum()}, got {col}")
        log_col = np.log(col)
    f, g = np.zeros(active.sum()), np.zeros(T)
    from scipy.special import logsumexp

    for _ in range(max_iter):
        f = log_row - logsumexp(logK + g[None, :], axis=1)
        g = log_col - logsumexp(logK + f[:, None], axis=0)
        Wa = np.exp(logK + f[:, None] + g[None, :])
        if np.abs(Wa.sum(1) - lam[active]).max() < tol * lam.sum():
            break
    W = np.zeros((lam.shape[0], T))
    W[active] = Wa
    return W


def uniform_W(budgets, T):
    """W_kj = lambda_k / T: DiffusionNFT with per-reward normalisation (--credit uniform)."""
    return np.repeat(np.asarray(budgets, dtype=np.float64)[:, None] / T, T, axis=1)


# =============================================================================
# ReCAST §3.1: the mixed NFT loss
# =============================================================================


def mix_optimality(r, W, step):
    """Per-sample mixture r~ = sum_k (T / Lam) W[k, step] r_k for training samples at grid step `step`.

    r (N, K) tensor in [0, 1]; W (K, T) tensor; step (N,) long in [0, T). Columns of W
    sum to Lam / T, so the weights T W_kj / Lam are convex and r~ stays in [0, 1].
    Since the NFT loss is linear in r, this equals the W-weighted sum of
    per-reward NFT losses (derivations.ipynb §4)."""
    T = W.shape[1]
    weights = W[:, step].T * (T / W.sum())  # (N, K)
    return (weights * r).sum(-1)


def nft_loss(v_theta, v_old, x_t, x0, t, r, b=1.0, adv_clip=5.0):
    """DiffusionNFT's per-sample policy loss (NOTES.md §2), mean over latent dims.

    v+ = (1 - b) v_old + b v_theta,  v- = (1 + b) v_old - b v_theta,
    x0_hat± = x_t - t v±,  L± = mean((x0_hat± - x0)^2) / sg(mean|x0_hat± - x0|),
    L = adv_clip (r L+ + (1 - r) L-) / b.
    The factor adv_clip (5) is DiffusionNFT's: its batch policy loss is the per-sample loss times
    adv_clip_max before the mean (NVlabs/DiffusionNFT scripts/train_nft_sd3.py, `policy_loss = ...`,
    ~L960), so base_reg and the gradient clip act as theirs do.
    Shapes: v_*, x_t, x0 (N, ...); t (N,) or (N, 1, 1, 1); r (N,). Returns (N,).
    Optimum of the unweighted loss: v_theta* = v_old + (1 / b) E[(2r - 1)(u - v_old) | x_t]; it is
    v_old + (2 / b) h (v+ - v_old), h = E[r | x_t], only when v_old is the exact velocity of the law the
    rollouts come from (derivations.ipynb §3)."""
    t = t.reshape(-1, *([1] * (x_t.dim() - 1)))
    v_old = v_old.detach()
    dims = tuple(range(1, x_t.dim()))

    def adaptive(v):
        err = x_t - t * v - x0
        scale = err.detach().abs().mean(dims).clamp_min(1e-5)
        return (err**2).mean(dims) / scale

    loss_pos = adaptive((1 - b) * v_old + b * v_theta)
    loss_neg = adaptive((1 + b) * v_old - b * v_theta)
    return adv_clip * (r * loss_pos + (1 - r) * loss_neg) / b


# =============================================================================
# ReCAST's glue: credit (curves -> W), the update, DiffusionNFT's one-reward baseline
# =============================================================================


class CreditSettings(NamedTuple):
    """ReCAST's credit settings, the flags of the same names (credit_settings builds them from a script's Args)."""

    learn_W: bool  # --credit recast: W from the measured profiles; else uniform (D still measured and logged)
    gain_ema: float  # discount of the level statistics per iteration
    evidence: float  # c of evidence_weight (0: no shrinkage)
    tau: float  # temperature of solve_W
    eps: float  # floor mixing of solve_W
    estimator: str = "pairs"  # gain estimator: pairs (branched trees) or denoised
    alpha: float = 2.0  # Renyi order (pairs: 2 only)


def credit_settings(args):
    """recast.py's flags for credit."""
    return CreditSettings(
        args.credit == "recast", args.gain_ema, args.evidence, args.tau, args.eps, args.gain_estimator, args.alpha
    )


def credit(settings: CreditSettings, stats, r, std, b, budgets, sigmas, reduce):
    """ReCAST's credit for one iteration (NOTES.md §3.3-3.4): this iteration's level observations, summed
    over processes, are added to the discounted statistics (stats = gain_ema stats + new), then
    D, its standard error, the evidence-shrunk profiles and W. Returns (stats, info dict, W)."""
    T, c = len(sigmas) - 1, settings
    probes = [(j, optimality(Rp, gp, std=std), gp) for j, Rp, gp in b.probe_R]
    new = [reduce(a) for a in level_observations(r, b.groups, b.ancestry, b.layouts, T, probes, c.estimator, c.alpha)]
    stats = new if stats is None else [c.gain_ema * old + now for old, now in zip(stats, new)]
    D, se = level_curves(*stats, c.estimator, c.alpha)
    D_grid, gains, P, rho = credit_profiles(D, se, sigmas, stats[0], c.evidence)
    W = solve_W(budgets, P, c.tau, c.eps) if c.learn_W else uniform_W(budgets, T)
    info = {
        "recast/D": D_grid.tolist(),
        "recast/D_measured": np.where(np.isfinite(D), D, -1.0).tolist(),
        "recast/D_se": np.where(np.isfinite(se), se, -1.0).tolist(),
        "recast/level_n": stats[0].tolist(),
        "recast/evidence": rho.tolist(),
        "recast/gains": gains.tolist(),
        "recast/W": W.tolist(),
    }
    return stats, info, W


def nft_update(run, b, r_mix_table, W, args, gen, on_step):
    """ReCAST's update: `update_loop` with DiffusionNFT's loss (`nft_loss`) on the mixed optimality. The loss at
    t = sigmas[j] (the velocity that moves s_j -> s_{j+1}) uses r~ = sum_k (T / Lam) W_kj r_k (`mix_optimality`).
    b: the iteration's rollout (leaves, groups, emb, pooled); r_mix_table (N, K) optimality per reward; W (K, T)."""
    import torch

    r_t = torch.as_tensor(r_mix_table, dtype=torch.float32)
    W_t = torch.as_tensor(W / W.sum(), dtype=torch.float32)  # scale-free before float32 (budgets of 1e-40 or 1e300)

    def policy_loss(nb, v_theta, v_old):
        r = mix_optimality(r_t[nb.i], W_t, nb.j).to(nb.x0.device)
        return nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, r, b=args.nft_b)

    return update_loop(run, b, args, gen, on_step, policy_loss)


def combine_raw(rewards, budgets):
    """DiffusionNFT's multi-reward baseline (--credit nft): R = sum_k lambda_k R_k, before normalising.
    rewards (N, K) -> (N,); a non-finite reward makes the sum non-finite (then r = 0.5)."""
    return np.asarray(rewards, dtype=np.float64) @ np.asarray(budgets, dtype=np.float64)


def nft_baseline(R, groups, budgets, T, reduce):
    """--credit nft, DiffusionNFT's multi-reward baseline: one combined raw reward sum_k lambda_k R_k (`combine_raw`),
    normalised once over all processes. Returns its optimality (N, 1) and the one-row W (1, T) that leaves it as is."""
    Rc = combine_raw(R, budgets)[:, None]
    _, _, std = global_stats(Rc, reduce)
    return optimality(Rc, groups, std=std), uniform_W(budgets=[1.0], T=T)


def initial_level_stats(path, names, T):
    """[n (T+1,), s1 (K, T+1), s2 (K, T+1)]: the rows of `names` from a level-statistics file (bench.py
    `measure_profiles`), the gain statistics a run starts from with --gain-init. They are discounted by
    --gain-ema like the run's own, so the prior's weight halves every ~7 iterations at 0.9."""
    try:
        saved = json.loads(Path(path).read_text())
        rows = [saved["names"].index(k) for k in names]
        steps, estimator = saved["steps"], saved.get("estimator", "pairs")
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(
            f"--gain-init {path}: not a readable level-statistics file holding rewards {names} ({type(err).__name__}: "
            f"{err}). "
            "Make one with bench.py's measure_profiles, or omit --gain-init"
        ) from None
    if steps != T or estimator != "pairs":
        raise SystemExit(
            f"--gain-init {path}: measured with {steps} steps ({estimator}), this run has --steps {T} (pairs): "
            "measure again with these settings, or omit --gain-init"
        )
    return [
        np.asarray(saved["n"], dtype=np.float64),
        np.asarray(saved["s1"], dtype=np.float64)[rows],
        np.asarray(saved["s2"], dtype=np.float64)[rows],
    ]


# =============================================================================
# Train loop
# =============================================================================


def train(args: Args, extra_rewards=None, judges=None):
    """The whole run: per iteration rollout -> rewards -> credit (D, W) -> NFT update -> soft update
    of "old" -> log / evaluate / checkpoint. Returns the run folder."""
    run = setup_run(args, extra_rewards, judges)
    prior = initial_level_stats(args.gain_init, run.names, args.steps) if args.gain_init else None
    start, state = start_or_resume(run, args)
    T, budgets = args.steps, run.budgets
    if start == 0 and prior is not None:
        state["level_stats"] = prior

    def on_step():  # after every optimizer step: the EMA of the trained LoRA (DiffusionNFT's evaluation weights)
        state["opt_steps"] += 1
        if args.ema:
            copy_adapter(run.transformer, "default", "ema", keep=ema_decay(state["opt_steps"]))

    bar = tqdm(
        range(start, args.iterations),
        desc="recast",
        initial=start,
        total=args.iterations,
        disable=not run.acc.is_main_process,
    )
    for it in bar:
        gen, before = iteration_generator(args.seed, it), None
        if it == 0 and args.eval_every and run.eval_prompts and run.acc.is_main_process:
            before, images = evaluate(run, args)
            save_grid(images, run.out / "samples_before.png", prompts=run.eval_prompts)
        t0 = time.perf_counter()  # training time: the evaluation above is not part of it
        # 1. rollouts from the old policy, rewards
        b = rollout_and_score(run, args, it, gen, "layout" if args.gain_estimator == "denoised" else ())
        t2 = time.perf_counter()
        # 2. per-reward optimality (global std across processes), Renyi curves with errors, W
        n_valid, mean_R, std = global_stats(b.R, run.reduce)
        stop_if_a_reward_failed(run, it, n_valid, state)
        r = optimality(b.R, b.groups, std=std)
        sigmas = run.sigmas.double().numpy()
        state["level_stats"], credit_info, W = credit(
            credit_settings(args), state.get("level_stats"), r, std, b, budgets, sigmas, run.reduce
        )
        r_train, W_train = nft_baseline(b.R, b.groups, budgets, T, run.reduce) if args.credit == "nft" else (r, W)
        t3 = time.perf_counter()
        # 3. NFT update of "default", then the soft update of "old"
        losses = nft_update(run, b, r_train, W_train, args, gen, on_step)
        copy_adapter(run.transformer, "default", "old", keep=old_decay(state["opt_steps"], args.old_decay))
        t4 = time.perf_counter()
        # 4. log, evaluate, checkpoint
        metrics = {
            **reward_metrics(run, it, b, n_valid, mean_R, losses),
            **credit_info,
            "recast/sigmas": run.sigmas.tolist(),
            "time/rollout": b.t_rollout - t0,
            "time/reward": t2 - b.t_rollout,
            "time/gains_W": t3 - t2,
            "time/update": t4 - t3,
        }
        finish_iteration(run, args, it, metrics, state, before)
        bar.set_postfix({"reward": f"{metrics['reward/weighted']:.3f}", "loss": f"{metrics['loss/policy']:.4g}"})
    if run.acc.is_main_process:
        plot_run(run.out, run.names)
    run.acc.end_training()  # closes the --report-to tracker
    return run.out


# =============================================================================
# Arguments (flags in --help sections) and ReCAST's checks
# =============================================================================


EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "shapes-sd3")  # runs from any folder


ARG_GROUPS = {  # --help sections, in this order: title -> what the flags set
    "method": "ReCAST's credit: rewards, budgets, the Renyi gains and W",
    "rollout": "prompts per iteration, trees and the sampler",
    "optimisation": "the NFT loss, its timesteps, AdamW, the old policy and the LoRA",
    "evaluation": "held-out evaluation",
    "I/O": "model, prompts, run folder, device and logging",
    "reward models": "weights and servers of the real reward models (defaults in reward_models.DEFAULTS)",
}


def flag(default, group, **checks):
    """One Args field: its default, its --help section (a key of ARG_GROUPS) and the checks `check_ranges` applies:
    min / max (inclusive), gt / lt (strict), choices. Its help line is the string under it (`field_docs`)."""
    return field(default=default, metadata={"group": group, **checks})


@dataclass
class Args:
    # method
    rewards: str = flag("", "method")
    """comma-separated reward names, in budget order (default for the embedded model: its four default rewards)"""
    budgets: str = flag("0.4,0.3,0.2,0.1", "method")
    """reward budgets lambda_k, one per reward (W's row sums)"""
    credit: str = flag("recast", "method", choices=["recast", "uniform", "nft"])
    """recast: W from Renyi gains; uniform: W = lambda / T (per-reward normalisation); nft: DiffusionNFT's raw weighted
    sum"""
    gain_estimator: str = flag("pairs", "method", choices=["pairs", "denoised"])
    """pairs: sibling-leaf pair products (alpha = 2; levels exact as the SDE steps shrink, see --sde-substeps);
    denoised: rewards of decoded x0_hat at the layout's steps (any alpha, plug-in biased)"""
    alpha: float = flag(2.0, "method", gt=0)
    """Renyi order (pairs needs 2; 1 is the KL limit)"""
    tau: float = flag(1.0, "method", min=0)
    """temperature of the profile in W's kernel lambda_k P~^tau (0: uniform W)"""
    eps: float = flag(1e-3, "method", min=0, max=1)
    """profile smoothing P~ = (1 - eps) P + eps / T (> 0 keeps W unique)"""
    gain_ema: float = flag(0.999, "method", min=0, lt=1)
    """discount of the level statistics across iterations (horizon ~ 1 / (1 - gain_ema) iterations). 0.999: the default
    run keeps nearly every observation, (1 - 0.999^I) / 0.001 groups per level after I iterations (95 at the default
    100): W needs >= ~60 per level to resolve the embedded world's measured profiles (results/world-design/README.md;
    at 0.9 the levels held ~10)"""
    evidence: float = flag(2.0, "method", min=0)
    """shrink each reward's profile towards uniform by rho = max(0, 1 - c p / Q), Q the chi^2 of its curve against
    uniform gains (0: no shrinkage)"""
    gain_init: str = flag("", "method")
    """start the discounted level statistics from this JSON (bench.py's profiles.json: n, s1, s2 measured on the
    pretrained model with many groups) instead of from nothing; it must hold the run's rewards, with the same --steps"""
    # rollout
    prompts_per_iter: int = flag(8, "rollout", min=1)
    """prompt groups per iteration and process"""
    n_roots: int = flag(2, "rollout", min=1)
    """independent noises per prompt (tree roots)"""
    n_branch: int = flag(4, "rollout", min=1)
    """copies made of every state at each branch step"""
    branch_steps: str = flag("rotate", "rollout")
    """rotate: each prompt group branches once, at a step that rotates over 1..T-2 across groups and iterations (every
    level measured); or fixed sampler steps j (0 < j < T - 1) for every group; group size = n_roots *
    n_branch^(number of branch steps)"""
    sde_substeps: int = flag(2, "rollout", min=1)
    """Euler-Maruyama sub-steps per grid interval after a branch (1: the grid itself; more: siblings closer to exact x0
    | x_t samples, rollout cost grows)"""
    sampler: str = flag("tree", "rollout", choices=["tree", "ode"])
    """tree: branched trees (ReCAST's pairs estimator needs them); ode: DiffusionNFT's independent deterministic
    DPM-Solver-2 rollouts, n_roots per prompt"""
    steps: int = flag(10, "rollout", min=3)
    """sampler steps T (= columns of W = training timesteps)"""
    sde_a: float = flag(math.sqrt(2), "rollout", min=0)
    """SDE noise level a after the first branch, g = a sqrt(s / (1 - s)); sqrt(2) (default) is the exact reversal of the
    noising, so branches sample x0 | x_t (the pairs estimator and kappa transfer need it; FlowGRPO uses 0.7)"""
    resolution: int = flag(0, "rollout", min=0)
    """image size in pixels (0: the model's default, 512 for SD3.5-M)"""
    max_sequence_length: int = flag(0, "rollout", min=0)
    """T5 tokens (0: the model's default: 128 as DiffusionNFT encodes, 10 for the embedded model)"""
    rollout_batch: int = flag(64, "rollout", min=1)
    """chunk size for transformer calls during rollouts"""
    # optimisation
    iterations: int = flag(100, "optimisation", min=1)
    """training iterations (rollout + update); the default run takes <= 9 min on 2 CPU cores"""
    nft_b: float = flag(1.0, "optimisation", gt=0)
    """DiffusionNFT guidance strength b in v+- = v_old +- b (v_theta - v_old)"""
    base_reg: float = flag(1e-4, "optimisation", min=0)
    """weight of the velocity MSE to the frozen base model"""
    train_steps_per_leaf: int = flag(4, "optimisation", min=1)
    """training timesteps drawn (without replacement) from the T grid steps per leaf and iteration"""
    train_batch: int = flag(32, "optimisation", min=1)
    """micro-batch of (leaf, timestep) samples per forward/backward"""
    frozen_batch: int = flag(0, "optimisation", min=0)
    """compute the no-grad v_old / v_base forwards of each optimizer step ahead, in batches of this size (0: with each
    gradient micro-batch); same numbers, unmeasured on GPU"""
    gradient_checkpointing: bool = flag(False, "optimisation")
    """recompute the transformer's activations in backward (diffusers' gradient checkpointing): less memory for a larger
    --train-batch, same gradients"""
    updates_per_iter: int = flag(8, "optimisation", min=1)
    """optimizer steps per iteration, each on the mean loss over its share of the iteration's samples (1: DiffusionNFT's
    one step per epoch)"""
    old_decay: int = flag(1, "optimisation", choices=[0, 1, 2])
    """DiffusionNFT's old-policy schedule on optimizer steps: 0 none, 1 min(0.001 s, 0.5), 2 OCR's (0 for 75 steps, then
    +0.0075 up to 0.999)"""
    ema: bool = flag(False, "optimisation")
    """keep DiffusionNFT's EMA of the trained LoRA (decay min((1 + s) / (10 + s), 0.9)), evaluate it and save it beside
    the raw LoRA"""
    lr: float = flag(1e-4, "optimisation", gt=0)
    """AdamW learning rate (DiffusionNFT uses 3e-4 on SD3.5-M with ~1k images per step; 1e-4 suits the embedded model's
    256-sample steps)"""
    weight_decay: float = flag(1e-4, "optimisation", min=0)
    """AdamW weight decay"""
    grad_clip: float = flag(1.0, "optimisation", gt=0)
    """gradient norm clip"""
    lora_rank: int = flag(32, "optimisation", min=1)
    """LoRA rank"""
    lora_alpha: int = flag(64, "optimisation", min=1)
    """LoRA alpha"""
    # evaluation
    eval_every: int = flag(20, "evaluation", min=0)
    """evaluate every N iterations (and at start and end); 0: never"""
    eval_steps: int = flag(0, "evaluation", min=0)
    """Euler steps of the evaluation sampler (0: --steps; DiffusionNFT evaluates with 40)"""
    eval_prompts: str = flag("", "evaluation")
    """file with evaluation prompts, one per line (embedded model: its held-out prompts)"""
    # I/O
    model: str = flag(EMBEDDED_MODEL, "I/O")
    """diffusers folder or hub id (e.g. stabilityai/stable-diffusion-3.5-medium); default: the embedded tiny shapes
    model"""
    train_prompts: str = flag("", "I/O")
    """file with training prompts, one per line (embedded model: its train split)"""
    out: str = flag("", "I/O")
    """run folder (default runs/<name>)"""
    name: str = flag("", "I/O")
    """run name (default recast-<credit>-<seed>)"""
    seed: int = flag(0, "I/O", min=0, max=2**31 - 1)
    """seed for prompts, noise and LoRA init"""
    save_every: int = flag(10, "I/O", min=1)
    """checkpoint every N iterations (and at the end)"""
    resume: str = flag("", "I/O")
    """run folder to continue in place from its newest intact checkpoint (its config.json gives the settings; flags
    given now override those that may change)"""
    overwrite: bool = flag(False, "I/O")
    """let --out replace a run folder that already holds a run (its metrics, checkpoints and figures are deleted)"""
    device: str = flag("", "I/O")
    """cpu or cuda (default: cuda if available)"""
    dtype: str = flag("", "I/O", choices=["", "float32", "bfloat16", "float16"])
    """frozen weights' dtype (default: bfloat16 on cuda, float32 on cpu)"""
    dry_run: bool = flag(False, "I/O")
    """build SD3.5-Medium's transformer on the meta device, attach the LoRA, print trainable parameters and a memory
    plan, exit"""
    report_to: str = flag("none", "I/O", choices=["none", "tensorboard", "wandb"])
    """also log the metrics' numbers and strings, under the same keys, through accelerate's trackers: TensorBoard
    (event files in <run>/tensorboard, W as an image) or Weights & Biases (project <script>); needs that package"""
    # reward models
    pickscore_model: str = flag(DEFAULTS["pickscore_model"], "reward models")
    """PickScore weights"""
    pickscore_processor: str = flag(DEFAULTS["pickscore_processor"], "reward models")
    """PickScore processor"""
    clip_model: str = flag(DEFAULTS["clip_model"], "reward models")
    """CLIP for clipscore and the aesthetic predictor"""
    aesthetic_mlp: str = flag(DEFAULTS["aesthetic_mlp"] or "", "reward models")
    """aesthetic MLP weights file (LAION improved aesthetic predictor)"""
    geneval_url: str = flag(DEFAULTS["geneval_url"], "reward models")
    """GenEval reward server address (FlowGRPO's reward-server protocol)"""
    geneval_metadata: str = flag(DEFAULTS["geneval_metadata"] or "", "reward models")
    """JSONL of GenEval metadata per prompt (FlowGRPO's dataset/geneval format)"""
    geneval_key: str = flag(DEFAULTS["geneval_key"], "reward models")
    """GenEval reply field used as the reward: scores (partial credit), strict_rewards (0/1)"""


def validate(args: Args, extra_rewards=None):
    """Every check on the user's input, before any model is loaded or any file in a run folder changes: the shared
    ones (check_common, check_files) and this method's. Resolves the run folder (args.out). Returns (reward names,
    budgets, branch steps). Raises SystemExit with the problem and the fix."""
    names, budgets, branch = check_common(args, extra_rewards)
    if args.credit == "recast" and args.gain_estimator == "pairs" and args.sampler == "ode":
        raise SystemExit(
            "--credit recast with --gain-estimator pairs needs branched rollouts: use --sampler tree, "
            "or --gain-estimator denoised with --sampler ode"
        )
    if args.gain_estimator == "pairs":
        if args.alpha != 2:
            raise SystemExit(
                "--gain-estimator pairs estimates the order-2 Renyi divergence only: use --alpha 2, "
                "or --gain-estimator denoised for other orders"
            )
        if args.n_roots < 2 or not branch:
            raise SystemExit("--gain-estimator pairs needs --n-roots >= 2 and at least one --branch-steps entry")
    check_files(args, names)
    args.out = run_folder(args)
    return names, budgets, branch


def default_name(args):
    return f"recast-{args.credit}-{args.seed}"


# #####################################################################################################################
# DiffusionNFT skeleton and run machinery: identical in recast.py and rvge.py, in this order, to the end of the file.
# test_recast.py checks that the two blocks are the same text; change it in recast.py, then
# `python test_recast.py --fix-copies` rewrites rvge.py's block from it.
# #####################################################################################################################


# =============================================================================
# DiffusionNFT's rewards to optimality, and its schedules (NOTES.md §2)
# =============================================================================


def parse_budgets(text: str) -> list[float]:
    """Parse a budget vector such as "0.4,0.3,0.2,0.1" -> [0.4, 0.3, 0.2, 0.1].

    Budgets are NOT normalised: W's row sums equal them exactly as given. The
    loss divides by their sum (the mixture weights T W_kj / Lam sum to one per
    step), so scaling all budgets by a constant changes nothing in training.
    Raises ValueError naming the problem: empty, not a number, NaN/inf,
    negative, or all zero.
    """
    fix = "give comma-separated non-negative numbers, one per reward, e.g. --budgets 0.4,0.3,0.2,0.1"
    if text is None or not str(text).strip():
        raise ValueError(f"budgets are empty: {fix}")
    out = []
    for i, part in enumerate(str(text).split(",")):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"budget {i + 1} ({part.strip()!r}) is not a number: {fix}") from None
        if not math.isfinite(value):
            raise ValueError(f"budget {i + 1} is {value}: budgets must be finite; {fix}")
        if value < 0:
            raise ValueError(f"budget {i + 1} is negative ({value}): {fix}")
        out.append(value)
    if sum(out) <= 0:
        raise ValueError(f"all budgets are zero: at least one reward needs a positive budget; {fix}")
    if not math.isfinite(sum(out)):
        raise ValueError(f"budgets sum to {sum(out)}: only their ratios matter, so scale them down; {fix}")
    return out


def advantages(rewards, groups, std=None, clip=5.0, eps=1e-4):
    """DiffusionNFT's clipped advantage, per reward column:
    A = clip((R - mean_group R) / (std_global R + eps), -clip, clip).
    rewards (N,) or (N, K); groups (N,) prompt-group ids; std: the global std
    per reward if already reduced across processes (else computed here).
    Non-finite rewards are left out of the group means and the std and get
    A = 0 (no preference); so does a group whose rewards all tie.
    Returns A with the shape of rewards."""
    R = np.asarray(rewards, dtype=np.float64)
    squeeze = R.ndim == 1
    R = R[:, None] if squeeze else R
    groups = np.asarray(groups)
    valid = np.isfinite(R)
    if std is None:
        std = np.array([R[valid[:, k], k].std() if valid[:, k].any() else 0.0 for k in range(R.shape[1])])
    A = np.zeros_like(R)
    for g in np.unique(groups):
        rows = groups == g
        Rg, vg = R[rows], valid[rows]
        n = vg.sum(0)
        mean = np.where(vg, Rg, 0.0).sum(0) / np.maximum(n, 1)
        A[rows] = np.where(vg, (np.where(vg, Rg, 0.0) - mean) / (np.asarray(std) + eps), 0.0)
    A = np.clip(A, -clip, clip)
    return A[:, 0] if squeeze else A


def optimality(rewards, groups, std=None, clip=5.0, eps=1e-4):
    """DiffusionNFT's reward -> optimality probability: r = 0.5 + 0.5 A / clip in [0, 1], A the
    clipped advantage (`advantages`, same arguments). Non-finite rewards and tied groups get r = 0.5."""
    return 0.5 + 0.5 * advantages(rewards, groups, std, clip, eps) / clip


def budget_mean(values, budgets):
    """The budget-weighted mean sum_k lambda_k v_k / Lam of per-reward values (K,): the metrics `reward/weighted`
    and `eval/weighted`."""
    return np.asarray(budgets) @ values / sum(budgets)


def old_decay(step, decay_type):
    """DiffusionNFT's `return_decay`: the weight kept by the sampling ("old") adapter in
    old <- decay old + (1 - decay) default, after `step` optimizer steps in all.
    Type 0: always 0 (old = the trained policy); 1: min(0.001 step, 0.5) (GenEval, PickScore,
    multi-reward); 2: 0 for 75 steps, then 0.0075 per step up to 0.999 (OCR)."""
    flat, rate, cap = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def ema_decay(step):
    """Decay of DiffusionNFT's EMA of the trained LoRA after optimizer step `step` (1, 2, ...):
    min((1 + step) / (10 + step), 0.9) (flow_grpo/ema.py); the evaluation uses the EMA weights."""
    return min((1 + step) / (10 + step), 0.9)


# =============================================================================
# Sampler steps on torch tensors (NOTES.md §1)
# =============================================================================


def sde_step(x, v, s, s_next, a, s_first, noise):
    """One FlowGRPO-form SDE step from sigma s to s_next < s (NOTES.md §1).

    g = a sqrt(s / (1 - s)) (at s = 1 the denominator uses s_first = s_1),
    mean = x (1 + g^2 dt / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) dt,  dt = s_next - s < 0,
    x' = mean + g sqrt(-dt) noise.
    Euler-Maruyama for the reverse SDE with drift v - (g^2 / 2) score, so it keeps
    the model's marginals as steps shrink (derivations.ipynb §2; toy_gaussian.py).
    Works on floats, numpy arrays or tensors."""
    dt = s_next - s
    g = a * math.sqrt(s / (1 - (s_first if s >= 1 else s)))
    mean = x * (1 + g * g * dt / (2 * s)) + v * (1 + g * g * (1 - s) / (2 * s)) * dt
    return mean + g * math.sqrt(-dt) * noise


def ode_step(x, v, s, s_next):
    """Euler step of dx/dt = v from sigma s to s_next."""
    return x + (s_next - s) * v


def dpm2_step(x, x0_hat, x0_hat_prev, s_prev, s, s_next):
    """One step of DPM-Solver++(2M) (Lu et al. 2022, multistep, data prediction) for rectified flow,
    alpha_t = 1 - t, sigma_t = t, lambda = log(alpha / sigma): from sigma s to s_next < s,
      h = lambda(s_next) - lambda(s),  D = x0_hat + (x0_hat - x0_hat_prev) / (2 r),  r = h_prev / h,
      x' = (s_next / s) x - alpha(s_next) (exp(-h) - 1) D.
    First order (D = x0_hat, DDIM) at the first step (x0_hat_prev None) and at the last (s_next = 0,
    where x' = x0_hat), as diffusers' DPMSolverMultistepScheduler with lower_order_final and
    DiffusionNFT's deterministic "dpm2" rollouts do. x0_hat = x - s v. Works on floats, arrays, tensors."""
    if s_next <= 0:
        return x0_hat
    if s >= 1:  # lambda(1) = -inf: h = inf, the DDIM step from pure noise
        return s_next * x + (1 - s_next) * x0_hat
    lam = lambda u: math.log((1 - u) / u)  # noqa: E731
    h = lam(s_next) - lam(s)
    D = x0_hat
    if x0_hat_prev is not None and s_prev < 1:  # s_prev = 1: lambda = -inf, r = inf, no correction
        D = x0_hat + (x0_hat - x0_hat_prev) * h / (2 * (lam(s) - lam(s_prev)))
    return (s_next / s) * x - (1 - s_next) * math.expm1(-h) * D


def shifted_sigmas(T, shift=3.0):
    """Grid 1 = s_0 > ... > s_T = 0 with SD3's time shift s -> shift s / (1 + (shift - 1) s) on a
    uniform grid. The training loop uses the scheduler's own sigmas; this is for the toy and tests."""
    u = np.linspace(1.0, 0.0, T + 1)
    return shift * u / (1 + (shift - 1) * u)


# =============================================================================
# Rollout and rewards (NOTES.md §5)
# =============================================================================


def branch_layout(n_groups, T, branch_steps, offset=0):
    """Branch steps of each prompt group (NOTES.md §3.3, §5). branch_steps: a list of steps shared by
    every group, or "rotate": group p branches once, at step 1 + (offset + p) mod (T - 2), so that
    consecutive groups (and iterations, through `offset`) cover every step 1..T-2 in turn and each
    sampler level gets a measured D. Returns a list of n_groups sorted lists."""
    if branch_steps == "rotate":
        return [[1 + (offset + p) % (T - 2)] for p in range(n_groups)]
    return [list(branch_steps) for _ in range(n_groups)]


def encode(pipe, prompts, max_len, device):
    """CFG-free text conditioning: (prompt_embeds (P, L, D), pooled (P, D'))."""
    import torch

    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(
            prompts, prompts, prompts, device=device, do_classifier_free_guidance=False, max_sequence_length=max_len
        )
    return emb, pooled


def velocity(transformer, x, s, emb, pooled, chunk=64):
    """v(x_t, t, c) of the active adapter; x (N, C, h, w) float32, s (N,) sigmas in [0, 1],
    emb/pooled already indexed per sample. The transformer takes timestep = 1000 s (float32, as the
    SD3 pipeline passes it, whatever the weights' dtype). Returns float32."""
    import torch

    dtype = emb.dtype
    outs = []
    for i in range(0, len(x), chunk):
        sl = slice(i, i + chunk)
        outs.append(
            transformer(
                hidden_states=x[sl].to(dtype),
                timestep=s[sl] * 1000,
                encoder_hidden_states=emb[sl],
                pooled_projections=pooled[sl],
                return_dict=False,
            )[0].float()
        )
    return torch.cat(outs)


def tree_rollout(
    transformer,
    emb,
    pooled,
    sigmas,
    n_roots,
    n_branch,
    branch,
    sde_a,
    gen,
    shape,
    chunk=64,
    probe_steps=(),
    substeps=1,
    solver="euler",
):
    """One tree per prompt (NOTES.md §5): n_roots noises run with the ODE to the group's first branch
    step; at each of its branch steps every state is copied n_branch times; after the first branch the
    SDE continues (`substeps` Euler-Maruyama sub-steps per grid interval, so that siblings sample
    x0 | x_t closely: derivations.ipynb §7); the last step is an Euler step, so leaves are clean.
    branch / probe_steps: a list of steps shared by every prompt, or one list per prompt (`branch_layout`);
    every prompt must have the same number of branch steps. solver: the ODE before branching, "euler"
    or "dpm2" (`dpm2_step`, DiffusionNFT's deterministic sampler). sigmas (T+1,) float tensor, 1 -> 0.

    Returns leaves (N, C, h, w), groups (N,) prompt index, ancestry (N, 1 + L) codes for
    `split_levels`, and probes: a list of (step, x0_hat = x - s v, groups) for the denoised estimator."""
    import torch

    device = emb.device
    P, T = len(emb), len(sigmas) - 1

    def per_group(steps):
        return [list(x) for x in steps] if steps and isinstance(steps[0], (list, tuple)) else [list(steps)] * P

    branch, probe_steps = per_group(branch), per_group(probe_steps)
    L = len(branch[0])
    first = np.array([min(b) if b else T for b in branch])
    x = torch.randn((P * n_roots, *shape), generator=gen).to(device)
    groups = np.arange(P).repeat(n_roots)
    ancestry = np.zeros((len(x), 1 + L), dtype=np.int64)
    ancestry[:, 0] = np.arange(len(x))
    x0_prev, probes = None, []
    with torch.no_grad():
        for j in range(T):
            column = np.array([branch[g].index(j) + 1 if j in branch[g] else 0 for g in groups])
            if column.any():  # copy the branching states n_branch times, recording the branch index taken
                copies = np.where(column > 0, n_branch, 1)
                child = np.concatenate([np.arange(c) for c in copies])
                x, groups, column = (
                    x.repeat_interleave(torch.as_tensor(copies, device=device), 0),
                    groups.repeat(copies),
                    column.repeat(copies),
                )
                ancestry = ancestry.repeat(copies, 0)
                ancestry[column > 0, column[column > 0]] = child[column > 0]
                x0_prev = (
                    None if x0_prev is None else x0_prev.repeat_interleave(torch.as_tensor(copies, device=device), 0)
                )
            s, s_next = float(sigmas[j]), float(sigmas[j + 1])
            v = velocity(transformer, x, torch.full((len(x),), s, device=device), emb[groups], pooled[groups], chunk)
            x0_hat = x - s * v
            probing = np.array([j in probe_steps[g] for g in groups])
            if probing.any():
                probes.append((j, x0_hat[torch.as_tensor(probing)], groups[probing]))
            sde = torch.as_tensor((first[groups] <= j) & (j < T - 1), device=device)  # after the group's first branch
            if solver == "dpm2":
                x_ode = dpm2_step(x, x0_hat, x0_prev, float(sigmas[j - 1]) if j else 1.0, s, s_next)
            else:
                x_ode = ode_step(x, v, s, s_next)
            if sde.any():
                on = sde.cpu().numpy()
                x_ode = x_ode.clone()
                x_ode[sde] = sde_continue(
                    transformer,
                    x[sde],
                    v[sde],
                    s,
                    s_next,
                    emb[groups[on]],
                    pooled[groups[on]],
                    sde_a,
                    float(sigmas[1]),
                    substeps,
                    gen,
                    chunk,
                )
            x, x0_prev = x_ode, x0_hat
    return x, groups, ancestry, probes


def ode_sample(transformer, emb, pooled, sigmas, shape, seed, chunk=64):
    """One image latent per prompt by the Euler ODE from fixed noise (`seed`): the held-out samplers' rollout
    (a tree with one root and no branch)."""
    import torch

    return tree_rollout(
        transformer,
        emb,
        pooled,
        sigmas,
        n_roots=1,
        n_branch=1,
        branch=[],
        sde_a=0.0,
        gen=torch.Generator().manual_seed(seed),
        shape=shape,
        chunk=chunk,
    )[0]


def sde_continue(transformer, x, v, s, s_next, emb, pooled, sde_a, s_first, substeps, gen, chunk):
    """`substeps` SDE steps from s to s_next on an even sub-grid; v is the velocity already taken at s."""
    import torch

    grid = np.linspace(s, s_next, substeps + 1)
    for i, (u, u_next) in enumerate(zip(grid[:-1], grid[1:])):
        if i:
            v = velocity(transformer, x, torch.full((len(x),), float(u), device=x.device), emb, pooled, chunk)
        x = sde_step(x, v, float(u), float(u_next), sde_a, s_first, torch.randn(x.shape, generator=gen).to(x.device))
    return x


def decode(pipe, latents, chunk=8):
    """Latents (scaled as the transformer sees them) -> list of PIL images."""
    import torch

    cfg = pipe.vae.config
    images = []
    with torch.no_grad():
        for z in latents.split(chunk):
            x = pipe.vae.decode((z / cfg.scaling_factor + cfg.shift_factor).to(pipe.vae.dtype), return_dict=False)[0]
            images += pipe.image_processor.postprocess(x.float(), output_type="pil")
    return images


def reward_extras(model, extra=None):
    """Rewards that are plain callables: the embedded world's programs (for the embedded model;
    their names shadow the reward models', e.g. `geneval` is the shapes checker there) and `extra`."""
    world = __import__("shapes_world").REWARDS if is_embedded(model) else {}
    return {**world, **(extra or {})}


def score(rewards, images, prompts):
    """Rewards (N, K) float64; non-finite values are kept (NaN) and handled by `optimality`."""
    return np.stack([np.asarray(fn(images, prompts), dtype=np.float64).reshape(len(images)) for fn in rewards], 1)


# =============================================================================
# The update loop: (leaf, timestep) samples, frozen forwards, optimizer step (NOTES.md §2)
# =============================================================================


def training_pairs(N, T, per_leaf, gen):
    """(N * per_leaf, 2) (leaf, grid step) pairs in random order: each leaf trains on `per_leaf`
    distinct sampler steps, the first of a random permutation of the T (DiffusionNFT: 9 of 10)."""
    import torch

    steps = torch.stack([torch.randperm(T, generator=gen)[: min(per_leaf, T)] for _ in range(N)])
    pairs = torch.stack([torch.arange(N).repeat_interleave(steps.shape[1]), steps.reshape(-1)], 1)
    return pairs[torch.randperm(len(pairs), generator=gen)]


def update_loop(run, b, args, gen, on_step, policy_loss):
    """The update both methods share (NOTES.md §2, §4.3): the iteration's (leaf, timestep) samples in
    --updates-per-iter equal chunks, one AdamW step per chunk on the mean loss over its samples (all processes;
    1 chunk is DiffusionNFT's one step per epoch). Per micro-batch: fresh noise (`noised_batch`), the frozen
    v_old / v_base, v_theta, and loss = mean(policy_loss(nb, v_theta, v_old)) + base_reg mean(|v_theta - v_base|^2),
    policy_loss the method's per-sample loss (B,). `on_step()` runs after every optimizer step (the EMA).
    Returns mean losses, the last gradient norm and the counts."""
    import torch

    transformer, sigmas, leaves, groups = run.transformer, run.sigmas, b.leaves, torch.as_tensor(b.groups)
    pairs = training_pairs(len(leaves), len(sigmas) - 1, args.train_steps_per_leaf, gen)
    params = lora_params(transformer, "default")
    totals = {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": len(pairs)}
    for chunk in pairs.tensor_split(args.updates_per_iter):
        batches = [
            noised_batch(mb, leaves, groups, b.emb, b.pooled, sigmas, gen) for mb in chunk.split(args.train_batch)
        ]
        with_base = args.base_reg > 0
        frozen = (
            frozen_velocities_ahead(transformer, batches, args.frozen_batch, with_base) if args.frozen_batch else None
        )
        for k, nb in enumerate(batches):
            v_old, v_base = frozen[k] if frozen else frozen_velocities(transformer, nb.x_t, nb.s, nb.cond, with_base)
            v_theta = velocity(transformer, nb.x_t, nb.s, *nb.cond)
            policy = policy_loss(nb, v_theta, v_old).mean()
            base = ((v_theta - v_base) ** 2).mean()
            ((policy + args.base_reg * base) * (len(nb.pairs) / len(chunk))).backward()
            totals["loss/policy"] += policy.item() * len(nb.pairs) / len(pairs)
            totals["loss/base_reg"] += base.item() * len(nb.pairs) / len(pairs)
        optimizer_step(run.opt, params, totals, args.grad_clip, run.all_reduce_grads)
        on_step()
    return totals


class NoisedBatch(NamedTuple):
    """One micro-batch of training samples. pairs (B, 2) (leaf, grid step); i, j (B,) its columns; x0 (B, C, h, w)
    the leaves; s (B,) sigmas[j]; x_t (B, C, h, w) = (1 - s) x0 + s eps; cond (emb (B, L, D), pooled (B, D'))."""

    pairs: object
    i: object
    j: object
    x0: object
    s: object
    x_t: object
    cond: tuple


def noised_batch(pairs, leaves, groups, emb, pooled, sigmas, gen):
    """One micro-batch of (leaf, step) pairs -> NoisedBatch, with fresh noise eps from gen."""
    import torch

    i, j = pairs[:, 0], pairs[:, 1]
    x0, s = leaves[i], sigmas[j].to(leaves.device)
    eps = torch.randn(x0.shape, generator=gen).to(leaves.device)
    x_t = (1 - s.view(-1, *[1] * (x0.dim() - 1))) * x0 + s.view(-1, *[1] * (x0.dim() - 1)) * eps
    return NoisedBatch(pairs, i, j, x0, s, x_t, (emb[groups[i]], pooled[groups[i]]))


def frozen_velocities_ahead(transformer, batches, size, with_base):
    """--frozen-batch: the no-grad v_old / v_base of every micro-batch of an optimizer step, computed
    ahead in chunks of `size` (larger than the gradient micro-batch: no activations are kept), then
    split back per micro-batch. The same numbers as `frozen_velocities` per micro-batch."""
    import torch

    x_t, s = torch.cat([nb.x_t for nb in batches]), torch.cat([nb.s for nb in batches])
    cond = (torch.cat([nb.cond[0] for nb in batches]), torch.cat([nb.cond[1] for nb in batches]))
    v_old, v_base = zip(
        *(
            frozen_velocities(
                transformer,
                x_t[k : k + size],
                s[k : k + size],
                (cond[0][k : k + size], cond[1][k : k + size]),
                with_base,
            )
            for k in range(0, len(x_t), size)
        )
    )
    sizes = [len(nb.pairs) for nb in batches]
    return list(zip(torch.cat(v_old).split(sizes), torch.cat(v_base).split(sizes)))


def frozen_velocities(transformer, x_t, s, cond, with_base):
    """No-grad velocities of the "old" (sampling) adapter and of the frozen base (adapters off; v_old
    again when the base term is off); leaves the "default" adapter active."""
    import torch

    with torch.no_grad():
        transformer.set_adapter("old")
        v_old = velocity(transformer, x_t, s, *cond)
        transformer.disable_adapters()
        v_base = velocity(transformer, x_t, s, *cond) if with_base else v_old
        transformer.enable_adapters()
    transformer.set_adapter("default")
    return v_old, v_base


def optimizer_step(opt, params, totals, grad_clip, all_reduce_grads):
    """Average the gradients over processes, clip their norm, refuse a non-finite step, step AdamW."""
    import torch

    all_reduce_grads(params)
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    check_finite(totals)
    opt.step()
    opt.zero_grad(set_to_none=True)
    totals["train/opt_steps"] += 1


def check_finite(values):
    """Stop before an optimizer step that would write NaN/inf into the weights (exit code 1; the run
    folder keeps its last good checkpoint). values: the step's losses and gradient norm."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise SystemExit(
            f"non-finite {bad}: the optimizer step was not taken and nothing was saved; the last good "
            "checkpoint is kept. Lower --lr or check the flags and rewards, then --resume"
        )


# =============================================================================
# One iteration's shared steps (train's steps 1 and 4)
# =============================================================================


def setup_run(args: Args, extra_rewards=None, judges=None):
    """Validate, then load everything one run needs; returns a namespace shared by the loop's steps."""
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import broadcast_object_list

    names, budgets, branch = validate(args, extra_rewards)
    quiet_start_up()
    lock = lock_run(args.out) if is_first_process() else None
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if PartialState(cpu=device_name == "cpu").num_processes > 1:  # the first process chose the run folder
        args.out = broadcast_object_list([args.out], from_process=0)[0]
    trackers = {} if args.report_to == "none" else {"log_with": args.report_to, "project_dir": args.out}
    acc = Accelerator(cpu=device_name == "cpu", **trackers)
    dtype = getattr(torch, args.dtype or ("bfloat16" if acc.device.type == "cuda" else "float32"))
    seed_everything(args.seed)
    world = __import__("shapes_world") if is_embedded(args.model) else None
    gen_kwargs = world.GEN_KWARGS if world else {}
    res = args.resolution or gen_kwargs.get("height", 512)
    max_len = args.max_sequence_length or gen_kwargs.get("max_sequence_length", 128)  # 128: DiffusionNFT's T5 length
    pipe = load_pipeline(args, acc.device, dtype)
    pipe.scheduler.set_timesteps(args.steps)
    train_prompts = read_prompts(args.train_prompts, "--train-prompts") if args.train_prompts else None
    if world is None and train_prompts is None:
        raise SystemExit("--train-prompts FILE is required for this model (one prompt per line)")

    def reduce(a):  # sum numpy statistics over processes
        if acc.num_processes == 1:
            return np.asarray(a)
        return acc.reduce(torch.as_tensor(np.asarray(a), dtype=torch.float64, device=acc.device), "sum").cpu().numpy()

    def all_reduce_grads(params):
        if acc.num_processes > 1:
            for p in params:
                if p.grad is not None:
                    p.grad = acc.reduce(p.grad, "mean")

    def prompts_for(it):  # each process its own prompt groups
        if world:
            return world.sample_prompts(args.prompts_per_iter, "train", args.seed * 7919 + it * 97 + acc.process_index)
        return distinct_prompts(
            train_prompts, args.prompts_per_iter, [args.seed, it], acc.process_index, acc.num_processes
        )

    return SimpleNamespace(
        acc=acc,
        pipe=pipe,
        transformer=pipe.transformer,
        names=names,
        budgets=budgets,
        branch=branch,
        rewards=build_rewards(names, replace(args, device=str(acc.device)), reward_extras(args.model, extra_rewards)),
        judges=judges if judges is not None or world is None else world.JUDGES,
        frechet=world.frechet_distance if world else None,  # held-out drift judge (set level)
        sigmas=pipe.scheduler.sigmas.float().cpu(),  # (T+1,), 1 -> 0: the W columns and training timesteps
        eval_sigmas=scheduler_sigmas(pipe, args.eval_steps or args.steps),
        shape=(pipe.transformer.config.in_channels, res // pipe.vae_scale_factor, res // pipe.vae_scale_factor),
        opt=torch.optim.AdamW(lora_params(pipe.transformer, "default"), lr=args.lr, weight_decay=args.weight_decay),
        eval_prompts=read_prompts(args.eval_prompts, "--eval-prompts")
        if args.eval_prompts
        else (world.sample_prompts(16, "heldout", 0) if world else []),
        out=Path(args.out),
        lock=lock,
        reduce=reduce,
        all_reduce_grads=all_reduce_grads,
        prompts_for=prompts_for,
        encode=lambda prompts: encode(pipe, prompts, max_len, acc.device),
    )


def rollout_and_score(run, args, it, gen, probe_steps=()):
    """Step 1 of an iteration: prompts, rollouts from the "old" adapter (--sampler tree: branched trees
    with this iteration's branch layout; ode: independent deterministic DPM-Solver-2 samples, as
    DiffusionNFT), decoded leaves scored; x0_hat kept, decoded and scored at probe_steps (steps, or
    "layout": each group's layout steps, the denoised estimator). Returns a namespace with prompts, emb,
    pooled, leaves, groups, ancestry, layouts, probes [(step, x0_hat, groups)], probe_R [(step, R, groups)],
    R (N, K)."""
    prompts = run.prompts_for(it)
    emb, pooled = run.encode(prompts)
    P = len(prompts)
    layouts = branch_layout(P, args.steps, run.branch, offset=(it * run.acc.num_processes + run.acc.process_index) * P)
    tree = args.sampler == "tree"
    run.transformer.set_adapter("old")
    leaves, groups, ancestry, probes = tree_rollout(
        run.transformer,
        emb,
        pooled,
        run.sigmas,
        n_roots=args.n_roots,
        n_branch=args.n_branch,
        branch=layouts if tree else [],
        sde_a=args.sde_a,
        gen=gen,
        shape=run.shape,
        chunk=args.rollout_batch,
        probe_steps=layouts if probe_steps == "layout" else probe_steps,
        substeps=args.sde_substeps,
        solver="euler" if tree else "dpm2",
    )
    run.transformer.set_adapter("default")
    t_rollout = time.perf_counter()
    R = score(run.rewards, decode(run.pipe, leaves), [prompts[g] for g in groups])
    probe_R = [(j, score(run.rewards, decode(run.pipe, x0h), [prompts[g] for g in gp]), gp) for j, x0h, gp in probes]
    return SimpleNamespace(
        prompts=prompts,
        emb=emb,
        pooled=pooled,
        leaves=leaves,
        groups=groups,
        ancestry=ancestry,
        layouts=layouts if tree else [[]] * P,
        R=R,
        probes=probes,
        probe_R=probe_R,
        t_rollout=t_rollout,
    )


def global_stats(R, reduce):
    """Per-column (count, mean, std) of the finite rewards of all processes; R (N, K)."""
    finite = np.isfinite(R)
    Rz = np.where(finite, R, 0.0)
    n = reduce(finite.sum(0))
    mean = reduce(Rz.sum(0)) / np.maximum(n, 1)
    return n, mean, np.sqrt(np.maximum(reduce((Rz**2).sum(0)) / np.maximum(n, 1) - mean**2, 0.0))


def stop_if_a_reward_failed(run, it, n_valid, state):
    """Stop the run when a reward returned NaN/inf for every image of iteration `it` (all processes): the state
    before it is checkpointed, and the message names the reward(s) and how to continue. n_valid (K,)."""
    if (n_valid == 0).any():
        if run.acc.is_main_process:
            save_checkpoint(run.out, max(it - 1, 0), run.transformer, run.opt, state)
        bad = [n for n, c in zip(run.names, n_valid) if c == 0]
        raise SystemExit(
            f"reward(s) {bad} returned NaN/inf for every image of iteration {it}; checkpoint saved in {run.out}. "
            f"Fix the reward, then continue with --resume {run.out}"
        )


def reward_metrics(run, it, b, n_valid, mean_R, losses):
    """The first entries of an iteration's metrics line: training rewards per reward and budget-weighted, the
    count of non-finite ones (all processes), the update's losses and sample count."""
    nonfinite = (run.reduce(len(b.R)) - n_valid).astype(int).tolist()
    return {
        "iteration": it,
        **{f"reward/{n}": float(mean_R[k]) for k, n in enumerate(run.names)},
        "reward/weighted": float(budget_mean(mean_R, run.budgets)),
        **{f"reward_nonfinite/{n}": c for n, c in zip(run.names, nonfinite)},
        **losses,
        "train/samples": int(run.reduce(losses["train/samples"])),
    }


def finish_iteration(run, args, it, metrics, state, before=None):
    """Step 4: evaluate (every eval_every iterations and at the end), append the metrics line,
    checkpoint (every save_every iterations and at the end). Main process only."""
    last = it == args.iterations - 1
    if run.acc.is_main_process:
        if before:
            metrics.update({k.replace("eval/", "eval_before/"): v for k, v in before.items()})
        if args.eval_every and run.eval_prompts and ((it + 1) % args.eval_every == 0 or last):
            metrics_eval, images = evaluate(run, args)
            metrics.update(metrics_eval)
            if last:
                save_grid(images, run.out / "samples_after.png", prompts=run.eval_prompts)
        with open(run.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        log_to_trackers(run.acc, metrics, step=it)
        if (it + 1) % args.save_every == 0 or last:
            save_checkpoint(run.out, it, run.transformer, run.opt, state)
    run.acc.wait_for_everyone()


# =============================================================================
# Model loading
# =============================================================================


LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


def no_torchvision_notice(record):
    """A logging filter: drops transformers' notice that torchvision is absent (deliberately: the PIL image processors
    it falls back to serve every model here) and nothing else."""
    return "requires torchvision (not installed)" not in record.getMessage()


def quiet_start_up():
    """The console of a run holds one progress bar and no library notices: the filter above on the logger that
    prints the torchvision notice, and the loading bars of diffusers and transformers off in this process."""
    logging.getLogger("transformers.utils.import_utils").addFilter(no_torchvision_notice)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def load_pipeline(args, device, dtype):
    """StableDiffusion3Pipeline (the real SD3.5-M or the embedded tiny one, same classes) with
    frozen VAE and text encoders, and LoRA adapters on the transformer: "default" (trained), "old"
    (sampling policy, a copy) and with --ema "ema". Disabling adapters gives the frozen base."""
    import torch
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig

    local = Path(args.model).exists()
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype=dtype, local_files_only=local)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
        if module is not None:
            module.requires_grad_(False)
            module.eval()
    transformer = pipe.transformer
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights="gaussian", target_modules=LORA_TARGETS
    )
    torch.manual_seed(args.seed)
    transformer.add_adapter(config, adapter_name="default")
    adapters = ["default", "old"] + (["ema"] if args.ema else [])
    for name in adapters[1:]:  # "old" and "ema" start as copies of "default"
        with warnings.catch_warnings():  # several adapters on one model are the design here, not a slip
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            transformer.add_adapter(config, adapter_name=name)
        copy_adapter(transformer, "default", name)
    for p in [p for name in adapters for p in lora_params(transformer, name)]:
        p.data = p.data.float()  # LoRA weights and their optimizer state in float32
    transformer.set_adapter("default")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return pipe


def scheduler_sigmas(pipe, steps):
    """The pipeline scheduler's sigma grid (steps + 1,) for `steps` steps, from a copy (the pipeline's own stays
    as set)."""
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float().cpu()


def lora_params(transformer, adapter):
    return [p for n, p in transformer.named_parameters() if f".{adapter}." in n]


def copy_adapter(transformer, src, dst, keep=0.0):
    """dst <- keep * dst + (1 - keep) * src, parameter by parameter (DiffusionNFT's soft update)."""
    import torch

    with torch.no_grad():
        for p_src, p_dst in zip(lora_params(transformer, src), lora_params(transformer, dst)):
            p_dst.mul_(keep).add_(p_src.to(p_dst.dtype), alpha=1 - keep)


def dry_run(args):
    """SD3.5-Medium readiness without weights: its transformer (shipped config) on the meta device,
    the LoRA attached, trainable parameters and a memory plan for one micro-batch."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    config = json.loads((Path(__file__).parent / "assets/sd3.5-medium-transformer.json").read_text())
    with init_empty_weights():
        transformer = SD3Transformer2DModel.from_config(config)
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=LORA_TARGETS)
        transformer.add_adapter(lora, adapter_name="default")
        transformer.add_adapter(lora, adapter_name="old")
    total = sum(p.numel() for p in transformer.parameters())
    trainable = sum(p.numel() for p in lora_params(transformer, "default"))
    targets = sum(1 for n, _ in transformer.named_modules() if n.endswith(".lora_A.default"))
    res = args.resolution or 512
    tokens = (res // 8 // config["patch_size"]) ** 2 + 77 + (args.max_sequence_length or 128)
    gib = 2**30
    plan = {
        "frozen weights (bf16)": 2 * (total - 2 * trainable) / gib,
        "two LoRA adapters (fp32)": 4 * 2 * trainable / gib,
        "AdamW state + grads (fp32)": 3 * 4 * trainable / gib,
        # rough activation size kept for backward: per block ~ 12 tensors of (tokens, hidden) in bf16
        f"activations, micro-batch {args.train_batch} (estimate)": args.train_batch
        * config["num_layers"]
        * 12
        * tokens
        * config["num_attention_heads"]
        * config["attention_head_dim"]
        * 2
        / gib,
    }
    print(
        f"SD3.5-Medium transformer: {total / 1e6:.1f}M parameters, LoRA on {targets} linear layers "
        f"(r={args.lora_rank}, alpha={args.lora_alpha}): {trainable / 1e6:.2f}M trainable"
    )
    for key, value in plan.items():
        print(f"  {key:<45} {value:8.2f} GiB")
    print(f"  {'total (transformer training, excl. VAE/text encoders)':<45} {sum(plan.values()):8.2f} GiB")
    return {"total_params": total, "trainable_params": trainable, "lora_layers": targets, "memory_gib": plan}


# =============================================================================
# Arguments: parsing, resume, input checks
# =============================================================================


def field_docs(cls):
    """{field name: the string literal written under it} from cls's source: per-field docstrings (CleanRL's habit)
    that become the --help lines, whitespace collapsed."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        a.target.id: " ".join(b.value.value.split())
        for a, b in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
    }


def make_parser(suppress=False):
    """argparse from Args, in the sections of ARG_GROUPS; the string under each field is its --help line. With
    suppress=True only the flags actually given appear in the result (used by --resume)."""
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS if suppress else None
    )
    sections = {title: parser.add_argument_group(title, text) for title, text in ARG_GROUPS.items()}
    docs = field_docs(Args)
    for f in fields(Args):
        name, section = "--" + f.name.replace("_", "-"), sections[f.metadata["group"]]
        extra = {} if suppress else {"default": f.default}
        if f.type in (bool, "bool"):
            section.add_argument(name, action="store_true", help=docs[f.name], **extra)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            section.add_argument(name, type=kind, help=docs[f.name], choices=f.metadata.get("choices"), **extra)
    return parser


# Refused on --resume when they differ from the saved run (those of them a script has): a checkpoint is only valid with
# the first five; the level statistics it holds were measured with the gain estimator and order; --gain-init only
# seeds iteration 0. Every other flag applies from the resumed iteration on (the optimizer takes --lr, --weight-decay).
FIXED_ON_RESUME = ("model", "rewards", "steps", "lora_rank", "lora_alpha", "gain_estimator", "alpha", "gain_init")


NOT_ON_RESUME = ("name", "overwrite")  # they choose or replace a run folder; --resume continues its own


def parse_args(argv=None) -> Args:
    """Args from the command line. With --resume DIR the settings come from DIR/config.json and
    flags given now override them, except FIXED_ON_RESUME (refused with both values named); the
    run folder is DIR itself, wherever it lies now."""
    args = Args(**vars(make_parser().parse_args(argv)))
    if not args.resume:
        return args
    config = Path(args.resume) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--resume {args.resume}: no config.json there; give the run folder of an earlier run")
    saved_config, saved = read_run_config(config)
    script = Path(__file__).stem
    if saved_config["script"] != script:
        raise SystemExit(
            f"--resume {args.resume}: that run was trained by {saved_config['script']}.py; resume it with that script"
        )
    given = vars(make_parser(suppress=True).parse_args(argv))
    for k in NOT_ON_RESUME:
        if k in given:
            raise SystemExit(
                f"--{k} does not go with --resume {args.resume}, which continues that run in its own folder: "
                f"drop --{k}, or start a new run without --resume"
            )
    if "out" in given and Path(given["out"]).resolve() != Path(args.resume).resolve():
        raise SystemExit(
            f"--resume {args.resume} continues that folder in place; --out {given['out']} names another. "
            "To branch a run, copy its folder and resume the copy"
        )
    changed = [
        f"--{k.replace('_', '-')}: saved {saved.get(k)!r}, given {given[k]!r}"
        for k in FIXED_ON_RESUME
        if k in given and given[k] != saved.get(k)
    ]
    if changed:
        raise SystemExit(
            f"--resume {args.resume}: these settings cannot change on resume ({'; '.join(changed)}). "
            "Drop them, or start a new run"
        )
    known = {f.name for f in fields(Args)}
    args = Args(**{**{k: v for k, v in saved.items() if k in known}, **given})
    args.out, args.resume = str(args.resume), str(args.resume)
    return args


def read_run_config(path):
    """(config, its args) of a run's config.json, each saved flag of the type its Args field has (an int is
    also a float); SystemExit naming the file, the entry and the fix when it is unreadable or hand-edited wrong."""
    problem = None
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        config, problem = None, f"it is not readable JSON ({err})"
    if problem is None and not (isinstance(config, dict) and isinstance(config.get("args"), dict)):
        problem = 'it does not hold an "args" object'
    if problem is None and config.get("script") not in ("recast", "rvge"):
        problem = f'its "script" is {config.get("script")!r}, not recast or rvge'
    types = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    for f in fields(Args) if problem is None else ():
        value, kind = config["args"].get(f.name), f.type if isinstance(f.type, str) else f.type.__name__
        fits = isinstance(value, types[kind]) and (kind == "bool" or not isinstance(value, bool))
        if f.name in config["args"] and not fits and not (value is None and f.default is None):
            problem = f"args.{f.name} is {value!r}, not of type {kind}"
            break
    if problem:
        raise SystemExit(
            f"{path}: {problem}. Repair the file (the run's checkpoints are not affected), or start a new run"
        )
    return config, config["args"]


def seed_everything(seed):
    """Seeds Python's `random`, numpy's global RNG and torch's CPU and CUDA default generators.
    The loop itself draws every random number from per-iteration generators seeded by
    (seed, iteration), so a resumed run repeats the iterations an uninterrupted one would."""
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def iteration_generator(seed, iteration):
    """The CPU generator that draws every random number of one iteration (noise moves to the device)."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def check_ranges(args: Args):
    """Each numeric flag against the bounds in its Args metadata (min / max inclusive, gt / lt strict),
    NaN and inf refused; each flag with choices against them. Raises SystemExit naming flag, value and fix."""
    for f in fields(Args):
        value, meta, flag = getattr(args, f.name), f.metadata, "--" + f.name.replace("_", "-")
        if meta.get("choices") and value not in meta["choices"]:
            raise SystemExit(f"{flag} {value!r}: choose one of {[c for c in meta['choices'] if c]}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        bounds = [
            (meta.get("min"), ">=", value >= meta.get("min", -math.inf)),
            (meta.get("gt"), ">", value > meta.get("gt", -math.inf)),
            (meta.get("max"), "<=", value <= meta.get("max", math.inf)),
            (meta.get("lt"), "<", value < meta.get("lt", math.inf)),
        ]
        if not math.isfinite(value) or any(bound is not None and not ok for bound, _, ok in bounds):
            need = " and ".join(f"{op} {bound}" for bound, op, _ in bounds if bound is not None) or "finite"
            raise SystemExit(f"{flag} {value}: must be a finite number {need}. Fix {flag}")


def check_report_to(report_to):
    """--report-to's package is installed (no default run needs it); else SystemExit with the fix."""
    import importlib.util

    packages = {"tensorboard": ["tensorboard", "tensorboardX"], "wandb": ["wandb"]}.get(report_to, [])
    if packages and not any(importlib.util.find_spec(p) for p in packages):
        raise SystemExit(
            f"--report-to {report_to} needs the {packages[0]} package: pip install {packages[0]}, "
            "or leave --report-to at none"
        )


def check_common(args: Args, extra_rewards=None):
    """The checks both scripts make on the user's input, before any model is loaded or any file in a run folder
    changes: flag ranges, tracker, resolution, device, model, budgets and rewards, branch steps. Returns (reward
    names, budgets, branch steps). Raises SystemExit with the problem and the fix."""
    import torch

    check_ranges(args)
    check_report_to(args.report_to)
    if args.resolution % 16:
        raise SystemExit(
            f"--resolution {args.resolution}: SD3 needs a multiple of 16 (VAE 8 x patch 2), "
            "or 0 for the model's default"
        )
    device = args.device.split(":")[0]
    if device not in ("", "cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: give cpu, cuda or cuda:N (or omit it: cuda when available)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA GPU is visible here. Use --device cpu (or omit --device)")
    model_path = Path(args.model)
    if not args.dry_run:
        if not model_path.exists():
            if args.model.startswith((".", "/", "~")) or args.model.count("/") != 1:
                raise SystemExit(
                    f"--model {args.model}: no such folder. Give a diffusers folder or a hub id such as "
                    "stabilityai/stable-diffusion-3.5-medium"
                )
            if not torch.cuda.is_available() and args.device != "cpu":
                raise SystemExit(
                    f"--model {args.model} (SD3.5-Medium scale) needs a CUDA GPU and none is visible. "
                    "On a CPU, train the embedded model: omit --model"
                )
        elif not (model_path / "model_index.json").exists():
            raise SystemExit(f"--model {args.model}: not a diffusers pipeline folder (no model_index.json)")
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as err:
        raise SystemExit(f"--budgets: {err}") from None
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    if not names:
        if not is_embedded(args.model):
            raise SystemExit("--rewards is required for this model, e.g. --rewards pickscore,clipscore,aesthetic,ocr")
        import shapes_world

        names = list(shapes_world.DEFAULT_REWARDS)
    known = set(REWARD_MODELS) | set(reward_extras(args.model, extra_rewards))
    unknown = [n for n in names if n not in known]
    if unknown or len(set(names)) != len(names):
        raise SystemExit(f"unknown or repeated reward(s) in {names}; known rewards: {sorted(known)}. Fix --rewards.")
    if len(budgets) != len(names):
        raise SystemExit(
            f"{len(budgets)} budgets for {len(names)} rewards ({','.join(names)}): "
            "give one budget per reward with --budgets"
        )
    branch = parse_branch_steps(args.branch_steps, args.steps)
    if is_embedded(args.model) and args.train_prompts:
        raise SystemExit(
            "--train-prompts is not used with the embedded model (it samples prompts of its own world): "
            "omit it, or give --model"
        )
    return names, budgets, branch


def check_files(args, names):
    """The files a run reads, checked before any model loads: prompt files (readable, >= 2 held-out prompts, the
    embedded world's held-out prompts inside its grammar, quoted text for the ocr reward) and, on --resume, the
    metrics file (a damaged line is refused; metrics_lines). SystemExit naming the file, the problem and the fix."""
    if args.train_prompts:
        unquoted = [q for q in read_prompts(args.train_prompts, "--train-prompts") if ocr_target(q) is None]
        if "ocr" in names and unquoted:
            raise SystemExit(
                f"--train-prompts {args.train_prompts}: the ocr reward scores the text between double quotes, and "
                f"{len(unquoted)} prompt(s) quote nothing, the first: {unquoted[0]!r}. Quote the text to render"
            )
    if args.eval_prompts:
        prompts = read_prompts(args.eval_prompts, "--eval-prompts")
        if len(prompts) < 2:
            raise SystemExit(
                f"--eval-prompts {args.eval_prompts}: give at least 2 prompts (the held-out set is judged as a set)"
            )
        if is_embedded(args.model):
            import shapes_world

            for number, prompt in enumerate(prompts, 1):
                try:
                    shapes_world.parse_prompt(prompt)
                except ValueError:
                    raise SystemExit(
                        f"--eval-prompts {args.eval_prompts}: line {number}, {prompt!r}, is outside the embedded "
                        "world's captions (e.g. 'two red circles', 'a blue square on the left'); the world's "
                        "rewards cannot score it. Fix the line, or give --model"
                    ) from None
    if args.resume:
        metrics_lines(Path(args.resume) / "metrics.jsonl")


def parse_branch_steps(text, T):
    """--branch-steps: "rotate" or sorted distinct steps strictly between 0 and T - 1."""
    if text.strip() == "rotate":
        return "rotate"
    try:
        branch = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise SystemExit(f"--branch-steps {text!r}: give rotate, or step indices such as 3,6") from None
    if any(not 0 < b < T - 1 for b in branch):
        raise SystemExit(f"--branch-steps must lie strictly between 0 and T - 1 = {T - 1} (T = --steps), got {branch}")
    return branch


def is_embedded(model):
    return Path(model).resolve() == (Path(__file__).parent / EMBEDDED_MODEL).resolve()


def read_prompts(path, flag="prompts"):
    """Prompts of a UTF-8 text file, one per line; SystemExit naming the flag when the file is missing,
    binary, not UTF-8 or empty."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as err:
        raise SystemExit(
            f"{flag} {path}: cannot read it ({err.strerror}); give a text file with one prompt per line"
        ) from None
    except UnicodeDecodeError:
        raise SystemExit(f"{flag} {path}: not UTF-8 text; save it as UTF-8, one prompt per line") from None
    if "\x00" in text:
        raise SystemExit(f"{flag} {path}: a binary file, not prompts; give a text file with one prompt per line")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{flag} {path}: no prompts (one per line)")
    return prompts


def distinct_prompts(prompts, n, seed, rank, world_size):
    """Process `rank`'s n prompts of one iteration, as DiffusionNFT's sampler draws them: one permutation of the
    prompt file's lines per iteration (seed), shared by every process and cut into consecutive slices, so no prompt
    is drawn twice in an iteration while the file has n * world_size lines or more (a shorter file is cycled)."""
    need = n * world_size
    order = np.random.default_rng(seed).permutation(len(prompts))
    order = np.tile(order, -(-need // len(order)))[:need]
    return [prompts[i] for i in order[rank * n : (rank + 1) * n]]


# =============================================================================
# Run folders, resume and locks
# =============================================================================


def is_run(folder):
    """True when folder/config.json is a run's record (JSON with "args" and "script" recast or rvge)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict) and isinstance(config.get("args"), dict) and config.get("script") in ("recast", "rvge")
    )


def is_unused(folder):
    """True when nothing is at the path, or it is a folder holding nothing but a run's lock file (a start that
    stopped before it wrote its config)."""
    folder = Path(folder)
    return not folder.exists() or (folder.is_dir() and all(p.name == ".lock" for p in folder.iterdir()))


def run_folder(args):
    """The run folder, checked writable, never inside another run (whose checkpoint rotation would delete it).
    --resume: that folder. --out: a new or empty folder, or a run, which is refused unless --overwrite (a folder of
    other files is refused even then: a run writes only where nothing else lives). Default runs/<name>: a fresh
    -1, -2, ... suffix when the name is taken, so running a command twice gives two runs. Creates the folder;
    changes nothing inside it. Under a multi-process launch only the first process decides (the others would see
    its files as another run's); setup_run hands its choice to the rest. Returns the folder as a string, or, in
    the other processes, args.out as given."""
    if not is_first_process():
        return args.out
    if args.resume:
        out = Path(args.resume)
    elif args.out:
        out = Path(args.out)
        holds_a_run = is_run(out)
        if holds_a_run and not args.overwrite:
            raise SystemExit(
                f"--out {out} already holds a run. Continue it with --resume {out}, choose another --out, "
                "or replace it with --overwrite"
            )
        if not holds_a_run and not is_unused(out):
            raise SystemExit(
                f"--out {out} holds files that are not a run of this project (a run writes only to a new or empty "
                "folder, and --overwrite replaces only runs). Choose a new folder with --out"
            )
    else:
        base = Path("runs") / (args.name or default_name(args))
        out = next(p for p in (base.with_name(f"{base.name}-{i}") if i else base for i in range(10**6)) if is_unused(p))
    where = Path(os.path.abspath(out))
    if len(where.parts) <= 2 or where == Path.home().absolute():
        raise SystemExit(
            f"{out} is a system folder (the root, a folder directly under it, or your home folder): a run writes only "
            "to a folder of its own. Choose one such as runs/<name> with --out"
        )
    host = next((p for p in where.parents if is_run(p)), None)
    if host is not None:
        raise SystemExit(
            f"{out} lies inside the run folder {host}, whose checkpoint rotation and --overwrite would delete it: "
            "choose a folder outside any run"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise SystemExit(f"cannot write to the run folder {out} ({err.strerror}): choose another with --out") from None
    return str(out)


def is_first_process():
    """True in a single process and in rank 0 of an `accelerate launch` (which sets RANK before Python starts)."""
    return int(os.environ.get("RANK", 0)) == 0


def lock_run(out):
    """An exclusive lock on out/.lock for this process's lifetime: a second live process on the same
    folder (e.g. two --resume) is refused. Returns the open file (keep it referenced)."""
    import fcntl

    handle = open(Path(out) / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SystemExit(
            f"{out} is in use by another live process (it holds {out}/.lock); wait for it to finish or stop it"
        ) from None
    return handle


def start_or_resume(run, args):
    """Restore the newest intact checkpoint when resuming (metrics cut back to it), or clear the folder
    for --overwrite; remove this program's .tmp leftovers; write config.json; start the --report-to tracker.
    Returns (first iteration, state)."""
    state = load_checkpoint(run.out, run.transformer, run.opt, args.lr, args.weight_decay) if args.resume else None
    start = state.pop("iteration") + 1 if state else 0
    if args.resume and state is None:
        tqdm.write(f"{run.out} has no checkpoint yet: training starts at iteration 0")
    if run.acc.is_main_process:
        if args.overwrite:
            for name in (
                "config.json",
                "tensorboard",
                "metrics.jsonl",
                "checkpoints",
                "rewards.png",
                "credit.png",
                "samples_before.png",
                "samples_after.png",
            ):
                shutil.rmtree(run.out / name) if (run.out / name).is_dir() else (run.out / name).unlink(missing_ok=True)
        for leftover in leftovers(run.out):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        config = {"args": asdict(args), "script": Path(__file__).stem, "rewards": run.names, "git_sha": git_sha()}
        write_atomic(run.out / "config.json", json.dumps(config, indent=2))
        keep_metrics_until(run.out / "metrics.jsonl", start)
    start_trackers(run, args)
    return start, {"opt_steps": 0, "level_stats": None, **(state or {})}


def write_atomic(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def leftovers(out):
    """The half-written files a kill can leave in a run folder: write_atomic's and save_checkpoint's .tmp names
    (nothing else is ever deleted: a user's own *.tmp files stay)."""
    out, ckpts = Path(out), Path(out) / "checkpoints"
    ours = [out / "config.json.tmp", out / "metrics.jsonl.tmp", ckpts / "latest.tmp", *ckpts.glob("iter_??????.tmp")]
    return [p for p in ours if p.exists()]


def metrics_lines(path):
    """(iteration, line) of each line of a metrics.jsonl. A last line that does not decode is a write a kill cut
    short and is left out; a damaged line before the last is not ours to drop: SystemExit naming it and the fix."""
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((int(json.loads(line)["iteration"]), line))
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise SystemExit(
                    f"{path}: line {number} of {len(lines)} is damaged ({line[:40]!r}...); a resume would lose it. "
                    "Repair or delete that line, then --resume again"
                ) from None
    return rows


def keep_metrics_until(path, start):
    """On resume, keep the metric lines of iterations before `start` (later ones will be redone); a partial last
    line (a kill or a full disk mid-write) is dropped (metrics_lines)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for it, line in metrics_lines(path) if it < start))


def git_sha():
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


# =============================================================================
# Checkpoints (atomic)
# =============================================================================


def save_checkpoint(out, iteration, transformer, opt, state):
    """checkpoints/iter_N/: the "default" LoRA in diffusers' format with its LoraConfig as metadata, so that
    pipe.load_lora_weights("<run>/checkpoints/iter_N") gives the trained model exactly (without the metadata
    diffusers takes lora_alpha = r, a wrong scale unless alpha = r); iter_N/ema the EMA with --ema; and state.pt
    (every adapter, optimizer, level statistics, optimizer-step count, iteration). Written to a .tmp folder,
    renamed, then `latest` is replaced atomically: a kill at any moment leaves the last good one.
    Keeps this checkpoint and the newest earlier one. Refuses to write non-finite weights."""
    import torch
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    lora = {a: get_peft_model_state_dict(transformer, adapter_name=a) for a in transformer.peft_config}
    bad = [k for sd in lora.values() for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise SystemExit(
            f"non-finite LoRA weights ({bad[0]}, {len(bad)} tensors) at iteration {iteration}: not saved; "
            f"the last good checkpoint in {out}/checkpoints is kept"
        )
    root = out / "checkpoints"
    final, tmp = root / f"iter_{iteration:06d}", root / f"iter_{iteration:06d}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for adapter, folder in (("default", tmp), ("ema", tmp / "ema")):  # ema: DiffusionNFT's evaluation weights
            if adapter in lora:  # the adapter's config (rank, alpha, targets) in the file: loaders scale as trained
                StableDiffusion3Pipeline.save_lora_weights(
                    folder,
                    transformer_lora_layers=lora[adapter],
                    transformer_lora_adapter_metadata=transformer.peft_config[adapter].to_dict(),
                )
        torch.save({"iteration": iteration, "lora": lora, "optimizer": opt.state_dict(), **state}, tmp / "state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"writing the checkpoint of iteration {iteration} failed ({err}); is the disk full? "
            f"The last good checkpoint in {root} is kept; free space, then continue with --resume {out}"
        ) from None
    previous = max((p for p in root.glob("iter_??????") if p.name < final.name), default=None)
    for old in root.glob("iter_??????"):
        if old not in (final, previous):
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out, transformer, opt, lr, weight_decay):
    """Restore the newest intact checkpoint of a run folder (the one `latest` names, else the newest
    iter_N whose state.pt loads; says so when it falls back); the optimizer then takes this run's lr and
    weight decay (its saved moments are kept). Returns its state dict, None when the run has no checkpoint yet;
    SystemExit, with nothing changed, when it has checkpoints and none loads."""
    import torch
    from peft.utils import set_peft_model_state_dict

    root = out / "checkpoints"
    latest = root / "latest"
    named = root / latest.read_text().strip() if latest.is_file() else None
    candidates = ([named] if named else []) + sorted((p for p in root.glob("iter_??????") if p != named), reverse=True)
    for ckpt in candidates:
        try:
            state = torch.load(ckpt / "state.pt", weights_only=False)
        except Exception as err:  # missing, truncated or corrupt: try the next older one
            tqdm.write(f"checkpoint {ckpt} is not loadable ({type(err).__name__}); trying an older one")
            continue
        if ckpt != named:
            tqdm.write(f"resuming from {ckpt.name}, the newest intact checkpoint")
        lora = state.pop("lora")
        for adapter, sd in lora.items():
            if adapter in transformer.peft_config:
                set_peft_model_state_dict(transformer, sd, adapter_name=adapter)
        if "ema" in transformer.peft_config and "ema" not in lora:  # --ema switched on at resume: start it here
            copy_adapter(transformer, "default", "ema")
        opt.load_state_dict(state.pop("optimizer"))
        for group in opt.param_groups:  # the saved groups hold the old run's values: --lr / --weight-decay apply
            group.update(lr=lr, weight_decay=weight_decay)
        transformer.set_adapter("default")
        return state
    if candidates:
        raise SystemExit(
            f"--resume {out}: none of its checkpoints loads ({', '.join(p.name for p in candidates)}); nothing was "
            "changed. Their LoRA files (pytorch_lora_weights.safetensors) may still load in diffusers; to train "
            "again, start a new run"
        )
    return None


# =============================================================================
# Evaluation, trackers and figures
# =============================================================================


def evaluate(run, args):
    """Held-out evaluation of the trained adapter (its EMA with --ema, as DiffusionNFT evaluates):
    Euler ODE sampling with --eval-steps on fixed prompts and seeds, training rewards and held-out
    judges. Returns (metrics, images)."""

    emb, pooled = run.encode(run.eval_prompts)
    run.transformer.set_adapter("ema" if args.ema else "default")
    latents = ode_sample(run.transformer, emb, pooled, run.eval_sigmas, run.shape, seed=12345, chunk=args.rollout_batch)
    run.transformer.set_adapter("default")
    images = decode(run.pipe, latents)
    R = score(run.rewards, images, run.eval_prompts)
    metrics = {f"eval/{n}": float(np.nanmean(R[:, k])) for k, n in enumerate(run.names)}
    metrics["eval/weighted"] = float(budget_mean(np.nanmean(R, 0), run.budgets))
    for name, fn in (run.judges or {}).items():
        metrics[f"eval/judge/{name}"] = float(np.nanmean(fn(images, run.eval_prompts)))
    if run.frechet:
        metrics["eval/judge/frechet"] = float(run.frechet(images, run.eval_prompts))
    return metrics, images


def start_trackers(run, args):
    """--report-to tensorboard | wandb: accelerate's tracker, started with the run's flags (TensorBoard: event files
    in <run>/tensorboard; W&B: a run named after the run folder, in project <script>). Nothing for none."""
    if args.report_to == "none":
        return
    wandb = {"wandb": {"name": run.out.name, "dir": str(run.out)}}
    name, kwargs = ("tensorboard", {}) if args.report_to == "tensorboard" else (Path(__file__).stem, wandb)
    run.acc.init_trackers(name, config=asdict(args), init_kwargs=kwargs)


def log_to_trackers(acc, metrics, step):
    """The metrics line's numbers and strings to the --report-to tracker under the same keys (lists such as D stay in
    metrics.jsonl); W (K, T) also as an image on TensorBoard (viridis, 16 px a cell, scaled to its largest entry)."""
    if not acc.trackers:
        return
    acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}, step=step)
    if "recast/W" in metrics and any(tracker.name == "tensorboard" for tracker in acc.trackers):
        import matplotlib

        W = np.asarray(metrics["recast/W"])
        rgb = matplotlib.colormaps["viridis"](W / max(W.max(), 1e-300))[..., :3]  # (K, T, 3)
        image = np.kron(rgb, np.ones((16, 16, 1)))
        acc.get_tracker("tensorboard", unwrap=True).add_image("recast/W", image, step, dataformats="HWC")


def save_grid(images, path, prompts=(), cols=8, cell=128):
    """The images in rows of `cols`, each upscaled (nearest) to at least `cell` px wide, with its prompt written
    under it (wrapped to the image's width). Returns the grid (PIL)."""
    from PIL import Image, ImageDraw, ImageFont

    scale = max(1, -(-cell // images[0].size[0]))  # ceil: small images grow to at least `cell` px
    w, h = images[0].size[0] * scale, images[0].size[1] * scale
    font = ImageFont.load_default(size=max(10, w // 12))
    draw = ImageDraw.Draw(Image.new("RGB", (w, h)))
    captions = [wrap_text(draw, text, font, w - 4) for text in list(prompts) + [""] * (len(images) - len(prompts))]
    line = font.getbbox("Ag")[3] + 2
    text_h = line * max(len(c) for c in captions) + 4
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * (h + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, caption) in enumerate(zip(images, captions)):
        x, y = (i % cols) * w, (i // cols) * (h + text_h)
        grid.paste(im.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        for k, text in enumerate(caption):
            draw.text((x + 2, y + h + 2 + k * line), text, fill="black", font=font)
    grid.save(path)
    return grid


def wrap_text(draw, text, font, width):
    """Lines of `text` (words kept whole) that fit in `width` px with `font`."""
    lines = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def plot_run(out, names):
    """Figures from metrics.jsonl: reward curves, the last W heatmap, D_k(t) curves and gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if not rows:
        return
    its = [m["iteration"] for m in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names + ["weighted"]:
        ax.plot(its, [m[f"reward/{n}"] for m in rows], label=n)
    ax.set(xlabel="iteration", ylabel="mean training reward", title="rewards")
    ax.legend(fontsize=7)
    fig.savefig(out / "rewards.png", dpi=120, bbox_inches="tight")
    last, sig = rows[-1], np.array(rows[-1]["recast/sigmas"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 3.6), gridspec_kw={"wspace": 0.35})
    im = axes[0].imshow(np.array(last["recast/W"]), aspect="auto", cmap="viridis")
    axes[0].set(yticks=range(len(names)), yticklabels=names, xlabel="step j (t = sigma_j)", title="W (last iteration)")
    fig.colorbar(im, ax=axes[0])
    D_meas, D_se = np.array(last["recast/D_measured"]), np.array(last["recast/D_se"])  # -1: level not measured
    for k, n in enumerate(names):
        (line,) = axes[1].plot(
            sig, np.array(last["recast/D"])[k], label=f"{n} (evidence {last['recast/evidence'][k]:.2f})"
        )
        ok = D_se[k] >= 0
        axes[1].errorbar(sig[ok], D_meas[k, ok], yerr=2 * D_se[k, ok], fmt="o", ms=3, capsize=2, color=line.get_color())
        axes[2].plot(sig[:-1], np.array(last["recast/gains"])[k], marker=".", label=n)
    axes[1].set(xlabel="t", ylabel="D_k(t)", title="Renyi discriminability: levels +- 2 se, monotone fit")
    axes[2].set(xlabel="t at step start", ylabel="gain", title="gains per step")
    for a in axes[1:]:
        a.invert_xaxis()
        a.legend(fontsize=7)
    fig.savefig(out / "credit.png", dpi=120, bbox_inches="tight")
    plt.close("all")


# =============================================================================
# Main
# =============================================================================


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    out = train(args)
    print(f"run folder: {out}")
    return out


if __name__ == "__main__":
    main()
