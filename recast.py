"""ReCAST: Reward Credit Assignment across Timesteps, on top of DiffusionNFT.

One self-contained file: the math (budgets, per-reward optimality, Renyi
discriminability curves and gains, the W solver, the mixed NFT loss) and the
SD3 training loop. Derivations: derivations.ipynb; design: DESIGN.md.

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
"""
from __future__ import annotations

import math

import numpy as np

# =============================================================================
# Math: budgets and optimality probabilities (DESIGN §2, §3.1)
# =============================================================================


def parse_budgets(text: str) -> list[float]:
    """Parse a budget vector such as "0.4,0.3,0.2,0.1" -> [0.4, 0.3, 0.2, 0.1].

    Budgets are NOT normalised: W's row sums equal them exactly as given. The
    loss divides by their sum (the mixture weights T W_kj / Lam sum to one per
    step), so scaling all budgets by a constant changes nothing in training.
    Raises ValueError naming the problem: empty, not a number, NaN/inf,
    negative, or all zero.
    """
    fix = 'give comma-separated non-negative numbers, one per reward, e.g. --budgets 0.4,0.3,0.2,0.1'
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
    return out


def optimality(rewards, groups, std=None, clip=5.0, eps=1e-4):
    """DiffusionNFT's reward -> optimality probability, per reward column.

    A = (R - mean_group R) / (std_global R + eps), A = clip(A, -clip, clip),
    r = 0.5 + 0.5 A / clip, so r in [0, 1].
    rewards (N,) or (N, K); groups (N,) prompt-group ids; std: the global std
    per reward if already reduced across processes (else computed here).
    Non-finite rewards are left out of the group means and the std and get
    r = 0.5 (no preference). A group whose rewards all tie gets r = 0.5.
    Returns r with the shape of rewards.
    """
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
    r = 0.5 + 0.5 * np.clip(A, -clip, clip) / clip
    return r[:, 0] if squeeze else r


def combine_raw(rewards, budgets):
    """DiffusionNFT's multi-reward baseline (--credit nft): R = sum_k lambda_k R_k, before normalising.
    rewards (N, K) -> (N,); a non-finite reward makes the sum non-finite (then r = 0.5)."""
    return np.asarray(rewards, dtype=np.float64) @ np.asarray(budgets, dtype=np.float64)


# =============================================================================
# Math: Renyi discriminability curves and gains (DESIGN §3.2-3.3)
# =============================================================================


def renyi_moment(h, Z, alpha):
    """Per-sample Renyi integrand: (h / Z)^alpha, or (h / Z) log(h / Z) for the KL limit alpha = 1.
    Averaging it over p_t and passing the mean to `renyi_from_moment` gives D_alpha(p+_t || p_t)."""
    q = np.asarray(h, dtype=np.float64) / Z
    if alpha == 1:
        return np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)
    return q ** alpha


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
    E[r_a r_b] = E[h_{t_l}^2] (they are independent given x_{t_l}); different
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


def denoised_moments(h, groups, alpha=2.0):
    """Sufficient statistics of the `denoised` (plug-in) estimator, any alpha > 0.

    h (L, N, K): plug-in optimality h_{k,t_l} ~ r_k(decode(x0_hat(x_{t_l}))) at probe
    level l. Z is the group mean at that level. Returns (sums (K, L), counts (L,))
    of the Renyi integrand; `renyi_from_moment(sums / counts, alpha)` gives D."""
    h = np.asarray(h, dtype=np.float64)
    groups = np.asarray(groups)
    sums = np.zeros((h.shape[2], h.shape[0]))
    for g in np.unique(groups):
        hg = h[:, groups == g]  # (L, n, K)
        Z = hg.mean(1, keepdims=True)
        sums += renyi_moment(hg, np.where(Z > 0, Z, 1.0), alpha).sum(1).T
    return sums, np.full(h.shape[0], float(h.shape[1]))


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
    """Renyi curves on the sampler grid and their per-step gains (DESIGN §3.3).

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


# =============================================================================
# Math: the W solver (DESIGN §3.4)
# =============================================================================


def solve_W(budgets, profile, tau=1.0, eps=1e-3, tol=1e-12, max_iter=20000):
    """Credit matrix W (K, T): the KL (I-)projection of K_kj = lambda_k P~_kj^tau onto
    {row sums = lambda, column sums = Lam / T}, with P~ = (1 - eps) P + eps / T.

    The solution has the form W = diag(a) K diag(b) and is found by Sinkhorn
    iterations in the log domain (derivations.ipynb §8). Rewards with budget 0
    get a zero row. eps > 0 keeps K positive so a unique solution exists; eps = 0
    is allowed when the profile is strictly positive. tau = 0 gives the uniform
    W_kj = lambda_k / T; identical profiles give it too.
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
# Math: the mixed NFT loss and the sampler steps (DESIGN §1-§3.1), on torch tensors
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


def nft_loss(v_theta, v_old, x_t, x0, t, r, b=1.0):
    """DiffusionNFT's per-sample policy loss (DESIGN §2), mean over latent dims.

    v+ = (1 - b) v_old + b v_theta,  v- = (1 + b) v_old - b v_theta,
    x0_hat± = x_t - t v±,  L± = mean((x0_hat± - x0)^2) / sg(mean|x0_hat± - x0|),
    L = (r L+ + (1 - r) L-) / b.
    Shapes: v_*, x_t, x0 (N, ...); t (N,) or (N, 1, 1, 1); r (N,). Returns (N,).
    Its unweighted optimum is v_theta* = v_old + (2 / b) h (v+ - v_old),
    h = E[r | x_t] (derivations.ipynb §3)."""
    t = t.reshape(-1, *([1] * (x_t.dim() - 1)))
    v_old = v_old.detach()
    dims = tuple(range(1, x_t.dim()))

    def adaptive(v):
        err = x_t - t * v - x0
        scale = err.detach().abs().mean(dims).clamp_min(1e-5)
        return (err ** 2).mean(dims) / scale

    loss_pos = adaptive((1 - b) * v_old + b * v_theta)
    loss_neg = adaptive((1 + b) * v_old - b * v_theta)
    return (r * loss_pos + (1 - r) * loss_neg) / b


def sde_step(x, v, s, s_next, a, s_first, noise):
    """One FlowGRPO-form SDE step from sigma s to s_next < s (DESIGN §1).

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


def shifted_sigmas(T, shift=3.0):
    """Grid 1 = s_0 > ... > s_T = 0 with SD3's time shift s -> shift s / (1 + (shift - 1) s) on a
    uniform grid. The training loop uses the scheduler's own sigmas; this is for the toy and tests."""
    u = np.linspace(1.0, 0.0, T + 1)
    return shift * u / (1 + (shift - 1) * u)
