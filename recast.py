"""ReCAST: Reward Credit Assignment across Timesteps, on top of DiffusionNFT.

Read top to bottom: ReCAST's objects first, in the order one derives the next (the credit matrix W and its solver, W in
DiffusionNFT's loss as the mixed optimality, the per-step gains and profiles W is solved from, the Renyi
discriminability D whose gains they are, D measured during training with standard errors), then its glue (credit, the
update, DiffusionNFT's multi-reward baseline), the train loop, the flags and ReCAST's checks, the entry points. The
controls the experiments use and the files a run starts from are recast_controls.py's. DiffusionNFT itself (optimality,
schedules, sampler steps, tree rollouts, the loss, the update loop) is nft.py, written once for both methods (rvge.py
has the same skeleton: its sections in the same order); the model (SD3 with LoRA: loading, the transformer call, encode,
decode) is sd3.py; the run machinery (flags, checks, run folders, resume, checkpoints, trackers, figures) is kit/'s. The
paper's full text was not available: each "NOTES.md §n" names a section of our reconstruction of the method, and
derivations.ipynb derives each formula.

Notation map (code name -> symbol)
    lam      (K,)      reward budgets lambda_k (user preference), not normalised
    Lam                sum_k lambda_k
    sigmas   (T+1,)    sampler grid s_0 = 1 > s_1 > ... > s_T = 0 (t = 1 is pure noise)
    r        (N, K)    per-reward optimality probability r_k in [0, 1] (DiffusionNFT: nft.optimality)
    W        (K, T)    credit matrix, rows sum to lambda_k, columns to Lam / T
    r_mix    (N,)      per-timestep mixture sum_k (T / Lam) W_kj r_k
    gains    (K, T)    g_kj = D_k(s_j) - D_k(s_{j-1}) >= 0, rows sum to D_k(0)
    P        (K, T)    profile P_kj = g_kj / sum_j g_kj
    D        (K, T+1)  Renyi discriminability curve D_k(s_j), D_k(1) = 0
    v_*      (B, C, H, W) velocities; x0_hat = x_t - t v (Tweedie, rectified flow)

Conventions: x_t = (1 - t) x0 + t eps; all losses are means over latent
dimensions, then over the batch; numpy math is float64.

Where to change what (nft.x: in nft.py; sd3.x: in sd3.py; flags.x, session.x, ...: in kit/)
    flags      Args (a field, its --help section in ARG_GROUPS, its checks), validate; checks.check_common;
               the flags both scripts share: nft.NFTArgs (rewards, budgets, rollout, optimisation),
               flags.RunArgs (evaluation, I/O, reward models, controls)
    sampler    nft.tree_rollout (trees; nft.sde_step / nft.sde_continue after a branch, nft.ode_step or
               nft.dpm2_step before), nft.rollout_and_score (which adapter samples, what is decoded and scored)
    rewards    kit/reward_models.py (REWARD_MODELS, build_rewards; README "Add a reward"), nft.score,
               worlds.reward_extras; reward -> optimality: nft.optimality (nft.global_stats's std)
    credit     credit: level_observations -> level_curves -> credit_profiles -> solve_W; --credit nft: nft_baseline
    loss       nft_update: nft.nft_loss on mix_optimality (r~ per step); the loop shared with rvge.py:
               nft.update_loop (with nft.frozen_velocities, nft.optimizer_step)
    old policy nft.old_decay (the soft update of "old" each iteration, sd3.copy_adapter), nft.ema_decay (--ema)
    controls   the experiments' --credit recast_reversed and file, --column-units gradient, and --gain-init (in
               recast_controls.py): recast_controls.controlled_W_inputs, recast_controls.step_weights,
               recast_controls.fixed_W_of, recast_controls.gain_prior; both files read once:
               recast_controls.started_with
    logging    nft.reward_metrics + train's metrics line, session.finish_iteration (metrics.jsonl,
               figures.log_to_trackers, checkpoints), progress bar in train, figures in figures.plot_run,
               show_evaluation; the held-out evaluation session.evaluate (with nft.ode_sample); the closing lines
               (before -> after, the checkpoint to load) in figures.print_summary
    the loop   train (steps 1-4), setup_run (session.Run), folders.start_or_resume
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

import nft
import recast_controls
import sd3
from kit.checks import check_common, check_files
from kit.figures import plot_run, print_summary
from kit.flags import RUN_ARG_GROUPS, RunArgs, parse_flags
from kit.folders import run_folder, start_or_resume
from kit.preflight import dry_run
from kit.session import Run, evaluate_before, finish_iteration, load_run, stop_if_a_reward_failed
from nft import NFTArgs, flag

# =============================================================================
# NOTES.md §3.4 and §3.1, our reconstruction: the W solver, and W in DiffusionNFT's loss
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
    gradient units (experiments/toy_train.py, derivations.ipynb §11); None (the default) is the equal Lam / T.
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


def uniform_W(budgets, T, col_sums=None):
    """W_kj = lambda_k / T: DiffusionNFT with per-reward normalisation (--credit uniform); with col_sums c (T,),
    W_kj = lambda_k c_j / Lam."""
    lam = np.asarray(budgets, dtype=np.float64)
    if col_sums is None:
        return np.repeat(lam[:, None] / T, T, axis=1)
    return np.outer(lam, col_sums) / lam.sum()


def mix_optimality(r, W, step):
    """Per-sample mixture r~ = sum_k (T / Lam) W[k, step] r_k for training samples at grid step `step`.

    r (N, K) tensor in [0, 1]; W (K, T) tensor; step (N,) long in [0, T). Columns of W
    sum to Lam / T, so the weights T W_kj / Lam are convex and r~ stays in [0, 1].
    Since the NFT loss is linear in r, this equals the W-weighted sum of
    per-reward NFT losses (derivations.ipynb §4)."""
    T = W.shape[1]
    weights = W[:, step].T * (T / W.sum())  # (N, K)
    return (weights * r).sum(-1)


# =============================================================================
# NOTES.md §3.3, our reconstruction: gains and profiles, shrunk by their evidence
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
    than 4% (NOTES.md §3.3). Each z_kj is then replaced by the normal score of its t tail probability
    with nu = min(n_j, n_0) - 1 degrees of freedom (derivations.ipynb §6c), which leaves it unchanged as n grows.
    family: the K rewards are K tests, and W moves as soon as one of them passes, so with K = 4 pure-noise rewards
    W left uniform ~4x as often as one test's rate. The threshold c p is then raised to the chi^2_p quantile at
    1 - alpha / K, alpha = P(chi^2_p > c p) (Bonferroni: the chance that any reward passes under the null stays
    <= alpha; derivations.ipynb §6d). K = 1 keeps c p. family=False: each reward tested alone.
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
# NOTES.md §3.2, our reconstruction: Renyi discriminability of a reward's positive policy
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
# NOTES.md §3.3, our reconstruction: D_k(t) measured during training, with standard errors
# =============================================================================


def split_levels(ancestry):
    """Level at which two leaves' trajectories split, from their ancestry codes.

    ancestry (N, L+1) ints: column 0 the root id, column l the branch index taken
    at branch time l (l = 1..L). Returns S (N, N): the number of leading columns
    two leaves share. S = 0: different roots (independent, t = 1); S = l: split at
    branch time l; S = L+1: the same leaf (t = 0). Leading axes are batch axes:
    (G, N, L+1) -> (G, N, N)."""
    A = np.asarray(ancestry)
    same = A[..., :, None, :] == A[..., None, :, :]  # (..., N, N, L+1)
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
    A, groups = np.asarray(ancestry), np.asarray(groups)
    n_levels = A.shape[1] + 1
    sums, counts = np.zeros((r.shape[1], n_levels)), np.zeros(n_levels)
    order = np.argsort(groups, kind="stable")  # the pairs of one group only: O(N m) for groups of m leaves, not O(N^2)
    _, starts, sizes = np.unique(groups[order], return_index=True, return_counts=True)
    for m in np.unique(sizes):  # the groups of m leaves at once: rows (G, m)
        rows = order[starts[sizes == m][:, None] + np.arange(m)]
        S = split_levels(A[rows])  # (G, m, m)
        prods = np.einsum("gak,gbk->kgab", r[rows], r[rows])  # (K, G, m, m)
        counts += np.bincount(S.ravel(), minlength=n_levels)
        for k in range(r.shape[1]):
            sums[k] += np.bincount(S.ravel(), weights=prods[k].ravel(), minlength=n_levels)
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
# ReCAST's glue: credit (curves -> W), the update, DiffusionNFT's multi-reward baseline
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
    column_units: str = "loss"  # W's columns equal in loss units, or in gradient units (c_j propto 1 / s_j)
    reverse_time: bool = False  # --credit recast_reversed: W solved from each profile flipped in time (the control)
    fixed_W: np.ndarray | None = None  # --credit file: W as given (K, T), held fixed (the control of recast-steps)


def credit_settings(args):
    """recast.py's flags for credit."""
    return CreditSettings(
        args.credit in ("recast", "recast_reversed"),
        args.gain_ema,
        args.evidence,
        args.tau,
        args.eps,
        args.gain_estimator,
        args.alpha,
        args.column_units,
        args.credit == "recast_reversed",
    )


def credit(settings: CreditSettings, stats, r, std, b, budgets, sigmas, reduce):
    """ReCAST's credit for one iteration (NOTES.md §3.3-3.4): this iteration's level observations, summed
    over processes, are added to the discounted statistics (stats = gain_ema stats + new), then
    D, its standard error, the evidence-shrunk profiles and W. Returns (stats, info dict, W)."""
    T, c = len(sigmas) - 1, settings
    probes = [(j, nft.optimality(Rp, gp, std=std), gp) for j, Rp, gp in b.probe_R]
    new = [reduce(a) for a in level_observations(r, b.groups, b.ancestry, b.layouts, T, probes, c.estimator, c.alpha)]
    stats = new if stats is None else [c.gain_ema * old + now for old, now in zip(stats, new)]
    D, se = level_curves(*stats, c.estimator, c.alpha)
    D_grid, gains, P, rho = credit_profiles(D, se, sigmas, stats[0], c.evidence)
    P_W, cols = recast_controls.controlled_W_inputs(c, P, sigmas, budgets)  # (P, None) unless a control is on
    W = solve_W(budgets, P_W, c.tau, c.eps, col_sums=cols) if c.learn_W else uniform_W(budgets, T, cols)
    W = W if c.fixed_W is None else c.fixed_W  # --credit file: a control of the experiments
    info = {
        "recast/D": D_grid.tolist(),
        "recast/D_measured": np.where(np.isfinite(D), D, -1.0).tolist(),
        "recast/D_se": np.where(np.isfinite(se), se, -1.0).tolist(),
        "recast/level_n": stats[0].tolist(),
        "recast/evidence": rho.tolist(),
        "recast/profile": P.tolist(),
        "recast/gains": gains.tolist(),
        "recast/W": W.tolist(),
    }
    return stats, info, W


def nft_update(run, b, r_mix_table, W, args, gen, on_step):
    """ReCAST's update: `nft.update_loop` with DiffusionNFT's loss (`nft.nft_loss`) on the mixed optimality. The loss at
    t = sigmas[j] (the velocity that moves s_j -> s_{j+1}) uses r~ = sum_k (T / Lam) W_kj r_k (`mix_optimality`).
    Where W's columns differ (--column-units gradient, --credit file) the loss at step j is omega_j L(r~'_j)
    (`step_weights`).
    b: the iteration's rollout (leaves, groups, emb, pooled); r_mix_table (N, K) optimality per reward; W (K, T)."""
    r_t = torch.as_tensor(r_mix_table, dtype=torch.float32)
    omega, W = recast_controls.step_weights(W)  # (None, W) unless W's columns differ (the controls)
    W_t = torch.as_tensor(W / W.sum(), dtype=torch.float32)  # scale-free before float32 (budgets of 1e-40 or 1e300)

    def policy_loss(nb, v_theta, v_old):
        r = mix_optimality(r_t[nb.i], W_t, nb.j).to(nb.x0.device)
        loss = nft.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, r, b=args.nft_b)
        return loss if omega is None else loss * omega[nb.j].to(loss.device)

    return nft.update_loop(run, b, args, gen, on_step, policy_loss)


def nft_baseline(R, groups, budgets, sigmas, reduce, column_units="loss"):
    """--credit nft, DiffusionNFT's multi-reward baseline in ReCAST's update: one combined raw reward
    sum_k lambda_k R_k (`nft.combine_raw`), normalised once over all processes. Returns its optimality (N, 1) and the
    one-row W (1, T) that leaves it as is (with --column-units gradient, its columns in gradient units: the step
    weights omega_j)."""
    # None (equal columns) unless --column-units gradient
    cols = recast_controls.column_sums(column_units, sigmas, [1.0])
    Rc = nft.combine_raw(R, budgets)[:, None]
    _, _, std = nft.global_stats(Rc, reduce)
    return nft.optimality(Rc, groups, std=std), uniform_W([1.0], len(sigmas) - 1, cols)


# =============================================================================
# Train loop
# =============================================================================


def train(args: Args, extra_rewards=None, judges=None):
    """The whole run: per iteration rollout -> rewards -> credit (D, W) -> NFT update -> soft update
    of "old" -> log / evaluate / checkpoint. Returns the run folder."""
    run = setup_run(args, extra_rewards, judges)
    start, state = start_or_resume(run, args)
    budgets = run.budgets
    fixed_W = recast_controls.started_with(run, args, start, state)  # --credit file's W (None for the others)
    settings = credit_settings(args)._replace(fixed_W=fixed_W)

    def on_step():  # after every optimizer step: the EMA of the trained LoRA (DiffusionNFT's evaluation weights)
        state["opt_steps"] += 1
        if args.ema:
            sd3.copy_adapter(run.transformer, "default", "ema", keep=nft.ema_decay(state["opt_steps"]))

    bar = tqdm(
        range(start, args.iterations),
        desc="recast",
        initial=start,
        total=args.iterations,
        disable=not run.acc.is_main_process,
    )
    drawn = False  # whether the last iteration run drew the figures (it evaluated)
    before = None  # the pretrained model's evaluation (every process its share), logged with iteration 0
    if start == 0 and args.eval_every and run.eval_prompts:
        before = evaluate_before(run, args, nft.ode_sample, state)
    for it in bar:
        gen = nft.iteration_generator(args.seed, it)
        t0 = time.perf_counter()  # training time: the evaluation above is not part of it
        # 1. rollouts from the old policy, rewards
        b = nft.rollout_and_score(run, args, it, gen, "layout" if args.gain_estimator == "denoised" else ())
        t2 = time.perf_counter()
        # 2. per-reward optimality (global std across processes), Renyi curves with errors, W
        n_valid, mean_R, std = nft.global_stats(b.R, run.reduce)
        stop_if_a_reward_failed(run, it, n_valid, state)
        r = nft.optimality(b.R, b.groups, std=std)
        sigmas = run.sigmas.double().numpy()
        state["level_stats"], credit_info, W = credit(
            settings, state.get("level_stats"), r, std, b, budgets, sigmas, run.reduce
        )
        if args.credit == "nft":
            r_train, W_train = nft_baseline(b.R, b.groups, budgets, sigmas, run.reduce, args.column_units)
        else:
            r_train, W_train = r, W
        t3 = time.perf_counter()
        # 3. NFT update of "default", then the soft update of "old"
        losses = nft_update(run, b, r_train, W_train, args, gen, on_step)
        sd3.copy_adapter(run.transformer, "default", "old", keep=nft.old_decay(state["opt_steps"], args.old_decay))
        t4 = time.perf_counter()
        # 4. log, evaluate, checkpoint
        metrics = {
            **nft.reward_metrics(run, it, b, n_valid, mean_R, losses),
            **credit_info,
            "recast/sigmas": run.sigmas.tolist(),
            "time/rollout": b.t_rollout - t0,
            "time/reward": t2 - b.t_rollout,
            "time/gains_W": t3 - t2,
            "time/update": t4 - t3,
        }
        drawn = finish_iteration(run, args, it, metrics, state, before, nft.ode_sample, b)
        before = None
        bar.set_postfix({"reward": f"{metrics['reward/weighted']:.3f}", "loss": f"{metrics['loss/policy']:.4g}"})
    if run.acc.is_main_process:
        if not drawn:  # else the last evaluation drew them from the same metrics
            plot_run(run.out, run.names, shows_W(args))
        print_summary(run.out, departure=args.credit.startswith("recast"))  # before -> after, W, the checkpoint
    run.acc.end_training()  # closes the --report-to tracker
    return run.out


# =============================================================================
# Arguments (flags in --help sections) and ReCAST's checks
# =============================================================================


ARG_GROUPS = {  # --help sections, in this order: title -> what the flags set
    "method": "ReCAST's credit: rewards, budgets, the Renyi gains and W",
    "rollout": "prompts per iteration, trees and the sampler",
    "optimisation": "the NFT loss, its timesteps, AdamW, the old policy and the LoRA",
    **RUN_ARG_GROUPS,  # evaluation, I/O, reward models, controls: kit.flags.RunArgs's
}


@dataclass
class Args(NFTArgs, RunArgs):
    """ReCAST's flags; --rewards, --budgets, the rollout and optimisation flags both scripts share are
    nft.NFTArgs's, the evaluation, I/O, reward-model and control flags kit.flags.RunArgs's."""

    # method
    credit: str = flag("recast", "method", choices=["recast", "uniform", "nft", "recast_reversed", "file"])
    """recast: W from Renyi gains; uniform: W = lambda / T (per-reward normalisation); nft: DiffusionNFT's raw weighted
    sum; recast_reversed: the control for credit in time, W from each reward's profile flipped in time (the same
    marginals as recast's W; with equal columns it is recast's W flipped); file: the W of --credit-file, held fixed
    (a control of the experiments)"""
    credit_file: str = flag("", "controls")
    """--credit file's W: a JSON {"rewards": [names in --rewards order], "W": K x T entries >= 0 summing to the
    budgets' sum}; its rows need not sum to each budget nor its columns be equal (a column's sum weights its step; a
    column of zeros: no weight at that step). Read when the run starts: a --resume trains the W it started with"""
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
    """discount of the level statistics across iterations (horizon ~ 1 / (1 - gain_ema) iterations); the default keeps
    nearly every observation, (1 - gain_ema^I) / (1 - gain_ema) groups per level after I iterations (NOTES.md §3.3:
    how many W needs)"""
    evidence: float = flag(2.0, "method", min=0)
    """shrink each reward's profile towards uniform by rho = max(0, 1 - c p / Q), Q the chi^2 of its curve against
    uniform gains (0: no shrinkage)"""
    column_units: str = flag("loss", "controls", choices=["loss", "gradient"])
    """what W's equal columns ("the same total weight to each denoising step") are equal in: loss (DiffusionNFT's loss
    as it is: column sums Lam / T) or gradient (column sums propto 1 / t_j, since the loss's velocity gradient per
    unit weight is propto t: each step gets the same share of the update; derivations.ipynb §11). Also applies to
    --credit uniform and nft"""
    gain_init: str = flag("world", "method")
    """the discounted level statistics the run starts from, so that W starts from measured profiles instead of
    uniform: a JSON file (n, s1, s2 per reward and level, measured on the pretrained model, e.g.
    experiments/protocol.py's profiles.json; it must hold the run's rewards, with the same --steps); world: the
    embedded world's pretrained profiles where they fit the run (the embedded model, --gain-estimator pairs, --sampler
    tree, 10 steps), from nothing elsewhere; none: from nothing (W from the run's own rollouts alone)"""
    # optimisation
    nft_b: float = flag(1.0, "optimisation", gt=0)
    """DiffusionNFT guidance strength b in v+- = v_old +- b (v_theta - v_old)"""


def validate(args: Args, extra_rewards=None):
    """Every check on the user's input, before any model is loaded or any file in a run folder changes: the shared
    ones (check_common, check_files) and this method's. Resolves the run folder (args.out). Returns (reward names,
    budgets, branch steps). Raises SystemExit with the problem and the fix. --dry-run: those that need no model, GPU,
    prompt file or run folder."""
    names, budgets, branch = check_common(args, extra_rewards)
    if credit_settings(args).learn_W and args.gain_estimator == "pairs" and args.sampler == "ode":
        raise SystemExit(
            f"--credit {args.credit} with --gain-estimator pairs needs branched rollouts: use --sampler tree, "
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
    if not args.resume:  # a new run records where its files are, wherever it is resumed from
        recast_controls.record_absolute_paths(args)
    # its checkpoint holds what --gain-init and --credit-file gave (`recast_controls.started_with`)
    if recast_controls.resumes_a_checkpoint(args):
        if args.credit != "file" and args.credit_file:
            recast_controls.fixed_W_of(args, names, budgets)  # refused: --credit-file without --credit file
    else:
        recast_controls.gain_prior(args, names)  # --gain-init: refused here when it does not fit the run
        recast_controls.fixed_W_of(args, names, budgets)  # --credit file: refused here when its W does not fit the run
    if args.dry_run:  # no prompt file, run folder or model: the plan needs none of them
        return names, budgets, branch
    check_files(args, names)
    args.out = run_folder(args, default_name(args))
    return names, budgets, branch


def default_name(args):
    """--name's default."""
    return f"recast-{args.credit}-{args.seed}"


def shows_W(args):
    """Whether W is part of the run's training signal (credit.png draws it): every --credit but nft, whose one
    combined reward W plays no part in."""
    return args.credit != "nft"


# Refused on --resume when they differ from the saved run, beside the kit's (kit.flags.FIXED_ON_RESUME): the level
# statistics a checkpoint holds were measured with the gain estimator and order; --gain-init only seeds iteration 0;
# --credit, --credit-file and --column-units say what the run is (its method, or a control). The files of --gain-init
# and --credit-file are read when the run starts only (`recast_controls.started_with`): a resume from a checkpoint
# needs neither.
FIXED_ON_RESUME = ("gain_estimator", "alpha", "gain_init", "credit", "credit_file", "column_units")
# recorded as absolute paths when a run starts (`recast_controls.record_absolute_paths`)
FILE_FLAGS = ("gain_init", "credit_file")


# =============================================================================
# The script's entry points: its flags, its run, main
# =============================================================================


def parse_args(argv=None) -> Args:
    """This script's Args from the command line (`flags.parse_flags`; --resume DIR reads DIR/config.json)."""
    return parse_flags(argv, Args, ARG_GROUPS, __doc__, Path(__file__).stem, FIXED_ON_RESUME, FILE_FLAGS)


def setup_run(args: Args, extra_rewards=None, judges=None) -> Run:
    """This script's checks (`validate`), then everything the run needs, loaded (`session.load_run`)."""
    names, budgets, branch = validate(args, extra_rewards)
    return load_run(args, names, budgets, branch, Path(__file__).stem, extra_rewards, judges, shows_W=shows_W(args))


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the input checks that need no model first (`validate`), then the preflight
        return dry_run(args, validate(args)[0])
    return train(args)  # the console: one progress bar, then print_summary's lines


if __name__ == "__main__":
    main()
