"""Gaussian-mixture toy: exact checks of the ReCAST / DiffusionRVGE math before the full run.

Every quantity of NOTES.md §1-§4 has a closed form (or a quadrature that is exact
to rounding) when the data is a Gaussian mixture, so this script checks the
shipped functions of nft.py, recast.py and rvge.py against them (it imports them and
never re-implements them). `python toy_gaussian.py` runs all checks, prints a
table (check, measured, threshold, PASS/FAIL), writes PNG figures to --out and
exits non-zero if a check fails; --quick runs the same checks on smaller samples.

`python toy_gaussian.py --train` is the trainable toy instead: the exact mixture velocity is the pretrained model, a
correction of it is fine-tuned with the scripts' own losses and credit (ReCAST arms: nft, uniform, exact-profile,
time-reversed, online and gradient-unit W; RVGE vs NFT with permuted controls), every arm x seed at once, and the arms
are compared at equal KL to the pretrained model (results/toy-train; --train --quick in the tests).

Notation map (code name -> symbol)
    x0, xt   (n, d)    clean sample, noisy sample x_t = (1 - t) x0 + t eps (t = 1 is noise)
    resp     (n, C)    posterior component probabilities rho_c(x_t) = P(c | x_t)
    m, s2    (n, C, d) per-component posterior mean and (diagonal) variance of x0 | x_t, c
    h        (n,)      h_t(x_t) = E[r(x0) | x_t]
    D        (L,)      Renyi discriminability D_alpha(t) of p+ = p r / Z (NOTES.md §3.2)
    shift    (n, d)    tilted posterior-mean shift E*[x0 | x_t] - E[x0 | x_t] (NOTES.md §4.1)
Rewards are ridge functions r(x) = f(u . x); z = u . x0 is Gaussian under every
mixture component, so all reward expectations are 1-D (quadrature or closed form).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy.special import expit, iv, logsumexp
from scipy.stats import kstest, norm

import nft
import recast
import rvge
from kit import run_kit
from kit.stats import (  # the experiments' statistics: the same tests for the toy and the embedded model
    holm,
    interval_sd,
    mean_ci,
    p_value,
    seeds_for_power,
    time_to_reach,
)

# E[f(y)], y ~ N(0, 1)  ~=  sum_i Q_W_i f(Q_Y_i): trapezoid rule on [-8.5, 8.5], step 1/8. For f analytic
# in a strip |Im y| < a it converges like exp(-2 pi a / step) and, unlike Gauss-Hermite, it integrates
# cos(w y) to rounding for w up to ~40 (the fine rewards need that).
Q_Y = np.linspace(-8.5, 8.5, 137)
Q_W = np.exp(-(Q_Y**2) / 2) / np.exp(-(Q_Y**2) / 2).sum()

# =============================================================================
# Exact mixtures and rewards
# =============================================================================


class GaussianMixture:
    """p0(x) = sum_c w_c N(x; mu_c, diag(var_c)) in d dimensions, noised by x_t = (1 - t) x0 + t eps.

    Marginal:  p_t = sum_c w_c N((1 - t) mu_c, (1 - t)^2 var_c + t^2)   (per dimension, S_c = that variance).
    Posterior: x0 | x_t is the mixture with weights rho_c propto w_c N(x_t; (1 - t) mu_c, S_c) and
               components N(m_c, s2_c), m_c = mu_c + var_c (1 - t) / S_c (x_t - (1 - t) mu_c),
               s2_c = var_c t^2 / S_c  (valid at t = 0: m_c = x_t, s2_c = 0).
    Velocity:  v(x_t, t) = (x_t - E[x0 | x_t]) / t.
    """

    def __init__(self, weights, means, variances):
        self.w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.mu = np.atleast_2d(np.asarray(means, dtype=np.float64))  # (C, d)
        if self.mu.shape[0] != len(self.w):
            self.mu = self.mu.T
        var = np.asarray(variances, dtype=np.float64)
        self.var = np.broadcast_to(var.reshape(len(self.w), -1) if var.ndim else var, self.mu.shape).copy()
        self.C, self.d = self.mu.shape

    def marginal_params(self, t):
        """Component means (C, d) and variances (C, d) of p_t."""
        return (1 - t) * self.mu, (1 - t) ** 2 * self.var + t * t

    def _log_comp(self, x, t):
        mean, S = self.marginal_params(t)
        diff = x[:, None, :] - mean[None]
        return np.log(self.w) - 0.5 * (diff**2 / S + np.log(2 * np.pi * S)).sum(-1)  # (n, C)

    def log_prob(self, x, t=0.0):
        """log p_t(x), x (n, d) -> (n,)."""
        return logsumexp(self._log_comp(np.asarray(x, dtype=np.float64).reshape(-1, self.d), t), axis=1)

    def cdf(self, x, t=0.0):
        """CDF of p_t, d = 1 only (for KS tests)."""
        mean, S = self.marginal_params(t)
        return (self.w * norm.cdf((np.asarray(x)[..., None] - mean[:, 0]) / np.sqrt(S[:, 0]))).sum(-1)

    def sample(self, n, rng, t=0.0):
        """n samples of p_t (t = 0: the data)."""
        mean, S = self.marginal_params(t)
        c = rng.choice(self.C, size=n, p=self.w)
        return mean[c] + np.sqrt(S[c]) * rng.standard_normal((n, self.d))

    def posterior(self, x, t):
        """x0 | x_t: resp (n, C), m (n, C, d), s2 (C, d)."""
        _, S = self.marginal_params(t)
        lc = self._log_comp(x, t)
        resp = np.exp(lc - logsumexp(lc, axis=1, keepdims=True))
        m = self.mu + self.var * (1 - t) / S * (x[:, None, :] - (1 - t) * self.mu)
        return resp, m, self.var * t * t / S

    def posterior_mean(self, x, t):
        resp, m, _ = self.posterior(x, t)
        return (resp[..., None] * m).sum(1)

    def posterior_cov(self, x, t):
        """Cov(x0 | x_t) (n, d, d) = sum_c rho_c (diag s2_c + m_c m_c^T) - E E^T."""
        resp, m, s2 = self.posterior(x, t)
        E = (resp[..., None] * m).sum(1)
        second = np.einsum("nc,nci,ncj->nij", resp, m, m) + np.einsum("nc,ci->ni", resp, s2)[..., None] * np.eye(self.d)
        return second - E[:, :, None] * E[:, None, :]

    def velocity(self, x, t):
        return (x - self.posterior_mean(x, t)) / t

    def sample_posterior(self, x, t, rng):
        """One exact sample of x0 | x_t per row of x."""
        resp, m, s2 = self.posterior(x, t)
        c = (rng.random((len(x), 1)) > np.cumsum(resp, 1)[:, :-1]).sum(1)
        return m[np.arange(len(x)), c] + np.sqrt(s2[c]) * rng.standard_normal(x.shape)

    def tilted_linear(self, u, beta):
        """p*(x0) propto p0(x0) exp(u . x0 / beta), again a mixture: mu_c + var_c u / beta,
        weights propto w_c exp(u . mu_c / beta + sum_i var_ci u_i^2 / (2 beta^2))."""
        u = np.asarray(u, dtype=np.float64)
        logw = np.log(self.w) + self.mu @ u / beta + self.var @ (u * u) / (2 * beta * beta)
        return GaussianMixture(np.exp(logw - logw.max()), self.mu + self.var * u / beta, self.var)

    def _reward_moments(self, x, t, reward, g):
        """Per component E_c[g(r)] and E_c[x0 g(r)]: x0 = m + s2 u (z - u.m) / q + (independent part)."""
        resp, m, s2 = self.posterior(x, t)
        u = reward.u
        q = s2 @ (u * u)  # (C,)
        mz = m @ u  # (n, C)
        E0, E1 = reward.moments(mz, q, g)
        Ex0g = m * E0[..., None] + (s2 * u / np.where(q > 0, q, 1.0)[:, None]) * E1[..., None]
        return resp, m, E0, Ex0g

    def posterior_expect(self, x, t, reward, g=None):
        """E[g(r(x0)) | x_t] (g = identity gives h_t), x (n, d) -> (n,)."""
        resp, _, E0, _ = self._reward_moments(x, t, reward, g)
        return (resp * E0).sum(1)

    def tilted_shift(self, x, t, reward, beta=None, eta=1.0):
        """Exact E*[x0 | x_t] - E[x0 | x_t] under p* propto p0 exp(r / beta) (NOTES.md §4.1);
        beta None: first order eta Cov(x0, r | x_t). x (n, d) -> (n, d)."""
        g = None if beta is None else (lambda r: np.exp(r / beta))
        resp, m, E0, Ex0g = self._reward_moments(x, t, reward, g)
        mean = (resp[..., None] * m).sum(1)
        num, den = (resp[..., None] * Ex0g).sum(1), (resp * E0).sum(1)[:, None]
        return eta * (num - mean * den) if beta is None else num / den - mean


class RidgeReward:
    """r(x) = f(u . x). moments(mz, q, g) = (E[g(r(z))], E[(z - mz) g(r(z))]) for z ~ N(mz, q):
    the trapezoid rule Q_Y, Q_W, or closed form for the 0/1 step f(z) = 1[z > thr]:
    E[g] = g0 (1 - P) + g1 P, E[(z - mz) g] = (g1 - g0) sqrt(q) phi((thr - mz) / sqrt(q)),
    P = Phi((mz - thr) / sqrt(q))."""

    def __init__(self, name, u, f, step_at=None):
        self.name, self.u, self.f, self.step_at = name, np.asarray(u, dtype=np.float64), f, step_at

    def __call__(self, x):
        return self.f(np.asarray(x) @ self.u)

    def moments(self, mz, q, g=None):
        g = (lambda r: r) if g is None else g
        sd = np.sqrt(q)
        if self.step_at is not None:
            safe = np.where(sd > 0, sd, 1.0)
            a = (mz - self.step_at) / safe
            P = np.where(sd > 0, norm.cdf(a), (mz > self.step_at).astype(float))
            g0, g1 = g(np.float64(0.0)), g(np.float64(1.0))
            return g0 * (1 - P) + g1 * P, np.where(sd > 0, (g1 - g0) * sd * norm.pdf(a), 0.0)
        vals = g(self.f(mz[..., None] + sd[..., None] * Q_Y))  # (..., nodes)
        return vals @ Q_W, sd * (vals @ (Q_W * Q_Y))


def sigmoid_reward(u, center=0.0, scale=0.2):
    """Coarse reward: which side of the hyperplane u . x = center (which mode)."""
    return RidgeReward("coarse", u, lambda z: expit((z - center) / scale))


def vonmises_reward(u, w, a=0.7):
    """Fine reward r = exp(a (cos(w u . x) - 1)) in [exp(-2a), 1]: high-frequency detail. Entire in x, so
    (r / Z)^alpha is too and every quadrature here converges spectrally (0.5 + 0.5 cos would give kinks)."""
    return RidgeReward("fine", u, lambda z: np.exp(a * (np.cos(w * z) - 1)))


def vonmises_closed(mz, q, w, a=0.7):
    """E[exp(a (cos(w z) - 1))] for z ~ N(mz, q) = e^-a [I_0(a) + 2 sum_k I_k(a) cos(k w mz) exp(-k^2 w^2 q / 2)]
    (Jacobi-Anger expansion and E[cos(k w z)] = cos(k w mz) exp(-k^2 w^2 q / 2))."""
    k = np.arange(1, 40)
    terms = (
        iv(k, a) * np.cos(k * w * np.asarray(mz)[..., None]) * np.exp(-((k * w) ** 2) * np.asarray(q)[..., None] / 2)
    )
    return np.exp(-a) * (iv(0, a) + 2 * terms.sum(-1))


def step_reward(u, thr):
    return RidgeReward("step", u, lambda z: (z > thr).astype(np.float64), step_at=thr)


MIX1 = GaussianMixture([0.45, 0.55], [[-1.2], [1.0]], [0.3**2, 0.35**2])
MIX2 = GaussianMixture([0.3, 0.3, 0.4], [[-1.0, 0.6], [1.0, 0.8], [0.2, -1.0]], [[0.12, 0.08], [0.1, 0.15], [0.2, 0.1]])
COARSE1, FINE1 = sigmoid_reward([1.0], 0.0, 0.15), vonmises_reward([1.0], 12.0)
E1 = np.array([1.0, 0.0])
COARSE2, FINE2 = sigmoid_reward([0.6, 0.8], 0.0, 0.2), vonmises_reward(E1, 6.0)


def sample_bridge(x0, xt, t, s, rng):
    """x_s | x0, x_t for s < t under the Markov noising chain x_t | x_s = a x_s + c e, a = (1 - t) / (1 - s),
    c^2 = t^2 - a^2 s^2 (which keeps every marginal p_t). Gaussian: precision 1 / s^2 + a^2 / c^2,
    mean ((1 - s) x0 / s^2 + a x_t / c^2) / precision."""
    a = (1 - t) / (1 - s)
    c2 = t * t - a * a * s * s
    prec = 1 / (s * s) + a * a / c2
    return ((1 - s) * x0 / (s * s) + a * xt / c2) / prec + rng.standard_normal(x0.shape) / np.sqrt(prec)


def grid_quadrature(gm, t, n=1201, half=7.0):
    """Nodes (M, d) and weights (M,) of a uniform grid on [-half, half]^d with weights p_t dx
    (Riemann sum: spectrally accurate for smooth, decaying integrands). Also returns the raw mass.
    d = 1: 1201 nodes on [-7, 7]; d = 2: 161^2 on [-6, 6] (see check_telescoping)."""
    axis = np.linspace(-half, half, n)
    nodes = np.stack(np.meshgrid(*[axis] * gm.d, indexing="ij"), -1).reshape(-1, gm.d)
    w = np.exp(gm.log_prob(nodes, t)) * (axis[1] - axis[0]) ** gm.d
    keep = w > 1e-18 * w.max()  # nodes that cannot change any sum in double precision are dropped
    return nodes[keep], w[keep] / w.sum(), w.sum()


def exact_renyi(gm, reward, ts, alphas, n_grid, half=7.0):
    """D_alpha(t) = recast.renyi_from_h(h_t on the grid nodes of p_t, alpha, weights), (A, L);
    also the alpha = 2 closed form log(1 + Var h / Z^2) and E[h_t^2] (L,)."""
    D, D2, Eh2 = np.zeros((len(alphas), len(ts))), np.zeros(len(ts)), np.zeros(len(ts))
    for i, t in enumerate(ts):
        nodes, w, _ = grid_quadrature(gm, t, n_grid, half)
        h = gm.posterior_expect(nodes, t, reward)
        D[:, i] = [recast.renyi_from_h(h, a, w) for a in alphas]
        Z = (w * h).sum()
        D2[i], Eh2[i] = np.log(1 + (w * (h - Z) ** 2).sum() / Z**2), (w * h * h).sum()
    return D, D2, Eh2


def renyi_direct(gm, reward, alpha):
    """D_alpha(pi+ || pi) at t = 0 by 1-D quadrature over each data component (no grid, no noising)."""
    Z = gm.w @ reward.moments(gm.mu @ reward.u, gm.var @ reward.u**2)[0]
    m = gm.w @ reward.moments(gm.mu @ reward.u, gm.var @ reward.u**2, lambda r: recast.renyi_moment(r, Z, alpha))[0]
    return float(recast.renyi_from_moment(m, alpha))


def mean_step_time(weights, sigmas):
    """Weight-averaged mid-step sigma sum_j w_j (s_{j-1} + s_j) / 2 / sum_j w_j (per row)."""
    mid = 0.5 * (sigmas[:-1] + sigmas[1:])
    return (weights * mid).sum(-1) / weights.sum(-1)


# =============================================================================
# Checks 1-6: the math against closed forms
# =============================================================================


def check_exact_mixture(quick, out=None):
    """p_t integrates to one; E[x0 | x_t] and v(x_t, t) are the conditional means of x0 and eps - x0
    (residual z-test in bins of x_t: the residual has conditional mean 0); Cov(x0 | x_t) is the conditional
    mean of the residual outer product (same z-test);
    posterior sampling matches the closed form; quadrature h_t matches the Bessel closed form."""
    rng = np.random.default_rng(1)
    n = 60_000 if quick else 400_000
    mass_err, zmax, cov_err, samp_z = 0.0, 0.0, 0.0, 0.0
    for gm, n_grid, half in ((MIX1, 1201, 7.0), (MIX2, 161, 6.0)):
        for t in (0.0, 0.3, 0.7, 1.0):
            mass_err = max(mass_err, abs(grid_quadrature(gm, t, n_grid, half)[2] - 1))
        for t in (0.2, 0.5, 0.8):
            x0, eps = gm.sample(n, rng), rng.standard_normal((n, gm.d))
            xt = (1 - t) * x0 + t * eps
            res_x0 = x0 - gm.posterior_mean(xt, t)
            res_v = (eps - x0) - gm.velocity(xt, t)
            cov = gm.posterior_cov(xt, t)
            bins = np.floor(xt / 0.25).astype(int) @ (1000 ** np.arange(gm.d))
            for b in np.unique(bins):
                sel = bins == b
                if sel.sum() < 1000:
                    continue
                for res in (res_x0, res_v):
                    zmax = max(zmax, np.abs(res[sel].mean(0) / (res[sel].std(0) / np.sqrt(sel.sum()))).max())
                prod = (res_x0[sel][:, :, None] * res_x0[sel][:, None, :] - cov[sel]).reshape(sel.sum(), -1)
                cov_err = max(cov_err, np.abs(prod.mean(0) / (prod.std(0) / np.sqrt(sel.sum()) + 1e-300)).max())
            x = xt[:1].repeat(20_000, 0)
            ps = gm.sample_posterior(x, t, rng)
            mean, c = gm.posterior_mean(xt[:1], t)[0], gm.posterior_cov(xt[:1], t)[0]
            samp_z = max(samp_z, np.abs((ps.mean(0) - mean) / np.sqrt(np.diagonal(c) / len(x))).max())
    x = MIX1.sample(2000, rng)
    gh_err = 0.0
    for t in (0.0, 0.1, 0.5, 1.0):
        resp, m, s2 = MIX1.posterior(x, t)
        closed = (resp * vonmises_closed(m[..., 0], s2[:, 0], 12.0)).sum(1)
        gh_err = max(gh_err, np.abs(closed - MIX1.posterior_expect(x, t, FINE1)).max())
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        xs = np.linspace(-3, 3, 400)[:, None]
        for t in (0.0, 0.3, 0.6, 1.0):
            ax[0].plot(xs[:, 0], np.exp(MIX1.log_prob(xs, t)), label=f"t={t}")
            ax[1].plot(xs[:, 0], MIX1.posterior_mean(xs, max(t, 1e-3)), label=f"t={t}")
        ax[0].set_title("p_t (1-D mixture)"), ax[1].set_title("E[x0 | x_t]"), ax[0].legend(fontsize=7)
        fig.tight_layout(), fig.savefig(os.path.join(out, "1_exact_mixture.png"), dpi=110), plt.close(fig)
    return [
        ("1 marginal mass |int p_t - 1| (1-D, 2-D)", mass_err, "< 1e-8", mass_err < 1e-8),
        ("1 posterior mean & velocity: max bin |z|", zmax, "< 5", zmax < 5),
        ("1 posterior cov: max bin |z| of residual^2", cov_err, "< 5", cov_err < 5),
        ("1 posterior sampling: max |z| of mean", samp_z, "< 4.5", samp_z < 4.5),
        ("1 quadrature h_t vs Bessel closed form", gh_err, "< 1e-12", gh_err < 1e-12),
    ]


ALPHAS = (0.5, 1.0, 2.0, 3.0)


def check_telescoping(quick, out=None):
    """D_alpha(t) of the exact h_t, alpha in {0.5, 1, 2, 3}, coarse and fine rewards, 1-D and 2-D:
    D(1) = 0; D non-increasing in t; recast.gains_on_grid on the exact curve reproduces the exact
    step differences (so they are >= 0) and telescopes to D(0) computed directly (1-D quadrature per data component);
    alpha = 2: renyi_from_h equals log(1 + Var h / Z^2)."""
    worst = dict(D1=0.0, incr=0.0, neg=0.0, gain_vs_diff=0.0, tele=0.0, grid_vs_gh=0.0, d2=0.0)
    for gm, rewards, n_grid, half, n_lev, T in (
        (MIX1, (COARSE1, FINE1), 1201, 7.0, 21 if quick else 41, 10),
        (MIX2, (COARSE2, FINE2), 161, 6.0, 3 if quick else 9, 4 if quick else 10),
    ):
        sig = nft.shifted_sigmas(T, 3.0)
        ts = np.unique(np.concatenate([np.linspace(0, 1, n_lev), sig]))
        on_grid = np.searchsorted(ts, sig)
        for rew in rewards:
            D, D2, _ = exact_renyi(gm, rew, ts, ALPHAS, n_grid, half)
            for a, Da in zip(ALPHAS, D):
                direct = renyi_direct(gm, rew, a)
                Dl = Da.copy()
                Dl[0] = direct
                _, gains = recast.gains_on_grid(ts, Dl, sig)
                raw = np.diff(Dl[on_grid])  # D(s_j) - D(s_{j-1}); sig descends
                worst["D1"] = max(worst["D1"], abs(Da[-1]))
                worst["incr"] = max(worst["incr"], np.diff(Da).max())
                worst["neg"] = max(worst["neg"], -raw.min())
                worst["gain_vs_diff"] = max(worst["gain_vs_diff"], np.abs(gains[0] - raw).max())
                worst["tele"] = max(worst["tele"], abs(gains.sum() - direct))
                worst["grid_vs_gh"] = max(worst["grid_vs_gh"], abs(Da[0] - direct))
            worst["d2"] = max(worst["d2"], np.abs(D[ALPHAS.index(2.0)] - D2).max())
    w = worst
    return [
        ("2 D(1) = 0: max |D(1)|", w["D1"], "< 1e-12", w["D1"] < 1e-12),
        ("2 D non-increasing: max D(t+) - D(t)", w["incr"], "<= 1e-12", w["incr"] <= 1e-12),
        ("2 exact step gains >= 0: max(-gain)", w["neg"], "<= 1e-12", w["neg"] <= 1e-12),
        ("2 gains_on_grid = exact differences", w["gain_vs_diff"], "< 1e-10", w["gain_vs_diff"] < 1e-10),
        ("2 sum of gains - D(0) direct", w["tele"], "< 1e-10", w["tele"] < 1e-10),
        ("2 D(0) grid vs direct", w["grid_vs_gh"], "< 1e-8", w["grid_vs_gh"] < 1e-8),
        ("2 alpha=2: D = log(1 + Var h / Z^2)", w["d2"], "< 1e-12", w["d2"] < 1e-12),
    ]


def check_coarse_fine(quick, out=None):
    """Coarse (which mode) vs fine (cos(12 x)) reward on the 1-D mixture, SD3 grid shifted_sigmas(10, 3):
    the coarse reward's gains come earlier (larger gain-weighted mean t); solve_W with equal budgets gives
    the coarse reward most of the credit on the noisy steps where it gains and the fine reward the last step.
    (The very noisy first steps, where neither gains, go to the fine reward: its mass has to sit somewhere.)"""
    sig = nft.shifted_sigmas(10, 3.0)
    ts = np.unique(np.concatenate([np.linspace(0, 1, 21 if quick else 61), sig]))
    D = np.stack([exact_renyi(MIX1, rew, ts, (2.0,), 1201)[0][0] for rew in (COARSE1, FINE1)])
    D_grid, gains = recast.gains_on_grid(ts, D, sig)
    W = recast.solve_W([1.0, 1.0], recast.profiles(gains))
    tg = mean_step_time(gains, sig)
    share = W[0] / W.sum(0)  # coarse reward's share of each step's credit (columns sum to Lam / T)
    P = recast.profiles(gains)
    cs, fs = P[0] @ share, P[1] @ (1 - share)  # each reward's share of W where its own gains are
    peak_c, peak_f = sig[np.argmax(share)], sig[np.argmax(1 - share)]
    marg = max(np.abs(W.sum(1) - 1).max(), np.abs(W.sum(0) - 0.2).max())
    print("\n3 SD3 grid s_(j-1):  " + " ".join(f"{s:5.3f}" for s in sig[:-1]))
    for k, name in enumerate(("coarse", "fine  ")):
        print(f"  {name} gain share " + " ".join(f"{p:5.3f}" for p in recast.profiles(gains)[k]))
    print("  coarse share of W  " + " ".join(f"{s:5.3f}" for s in share))
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9.5, 3.4))
        for k, name in enumerate(("coarse (mode)", "fine (exp(.7 cos 12x))")):
            ax[0].plot(ts, D[k], label=f"{name}, D(0)={D[k, 0]:.3f}")
            ax[0].plot(sig, D_grid[k], "o", ms=3, color=f"C{k}")
        ax[0].set_xlabel("t"), ax[0].set_ylabel("D_2(t)"), ax[0].legend(fontsize=7)
        im = ax[1].imshow(W, aspect="auto", cmap="viridis")
        ax[1].set_yticks([0, 1], ["coarse", "fine"])
        ax[1].set_xticks(range(10), [f"{s:.2f}" for s in sig[:-1]], fontsize=6)
        ax[1].set_xlabel("step j (starts at sigma)"), ax[1].set_title("W (solve_W, equal budgets)")
        fig.colorbar(im, ax=ax[1]), fig.tight_layout()
        fig.savefig(os.path.join(out, "3_coarse_fine_W.png"), dpi=110), plt.close(fig)
    return [
        ("3 gain-weighted mean t: coarse", tg[0], f"> fine {tg[1]:.3f}", tg[0] > tg[1]),
        ("3 step of max coarse W-share starts at s", peak_c, f"> fine's {peak_f:.3f}", peak_c > peak_f),
        ("3 coarse's W-share, gain-weighted (unif .5)", cs, "> 0.65", cs > 0.65),
        ("3 fine's W-share, gain-weighted (unif .5)", fs, "> 0.9", fs > 0.9),
        ("3 W marginals error", marg, "< 1e-9", marg < 1e-9),
    ]


def sample_exact_trees(gm, n_trees, n_roots, n_branch, t_branch, rng):
    """Branched samples with exact conditionals (NOTES.md §5 with the exact sampler): per tree n_roots
    states x_{t_1} ~ p_{t_1}; at each branch time t_l every state is copied n_branch times; a copy
    moves to x_{t_{l+1}} ~ p(. | x_{t_l}) (sample x0' | x_{t_l}, then the bridge x_{t_{l+1}} | x0', x_{t_l})
    or, after the last branch time, to x0 ~ p(x0 | x_{t_L}). Leaves in C order (tree, root, b_1..b_L).
    Returns x0 (N, d), states [L] of (N, d) (each leaf's ancestor at t_l), groups (N,), ancestry (N, L+1)."""
    L = len(t_branch)
    x = gm.sample(n_trees * n_roots, rng, t=t_branch[0])
    levels = [x]
    for level in range(L):
        x = np.repeat(x, n_branch, 0)
        levels = [np.repeat(s, n_branch, 0) for s in levels]
        if level + 1 < L:
            x = sample_bridge(
                gm.sample_posterior(x, t_branch[level], rng), x, t_branch[level], t_branch[level + 1], rng
            )
            levels.append(x)
        else:
            x = gm.sample_posterior(x, t_branch[level], rng)
    idx = np.indices((n_trees, n_roots) + (n_branch,) * L).reshape(L + 2, -1).T
    return x, levels, idx[:, 0], idx[:, 1:]


def check_pairs(quick, out=None):
    """recast.pair_moments / pairs_curve on exact branched trees: the mean pair product at split level
    t estimates E[h_t^2] (Z^2 across roots, E[r^2] for a leaf with itself): within 3 standard errors
    (over independent batches of trees) of the exact value. The plug-in `denoised` estimator
    (h ~ r(E[x0 | x_t]), recast.denoised_moments) is reported against the exact D_2, with Z the mean over
    all leaves (plug-in bias alone) and with Z per tree (as in training: adds the bias of normalising
    by the mean of 12 correlated leaves)."""
    rng = np.random.default_rng(4)
    t_b = [0.6, 0.2]
    levels_t = np.array([1.0] + t_b + [0.0])
    n_batch, per = (25, 40) if quick else (60, 60)
    rewards = (COARSE1, FINE1)
    _, _, Eh2 = zip(*[exact_renyi(MIX1, rew, levels_t, (2.0,), 1201) for rew in rewards])
    exact = np.stack(Eh2)  # (K, 4); level 0 is t = 1 where E[h^2] = Z^2
    D_exact = np.log(exact / exact[:, :1])
    means, x_t2, den = [], [], {"tree": 0.0, "global": 0.0}
    for _ in range(n_batch):
        x0, states, groups, anc = sample_exact_trees(MIX1, per, 3, 2, t_b, rng)
        r = np.stack([rew(x0) for rew in rewards], 1)
        sums, counts = recast.pair_moments(r, groups, anc)
        means.append(sums / counts)
        x_t2.append(states[1][::2, 0])  # each x_{t_2} state appears once per branch below it
        probes = np.stack(
            [np.full_like(r, 0.5)]
            + [np.stack([rew(MIX1.posterior_mean(s, t)) for rew in rewards], 1) for s, t in zip(states, t_b)]
            + [r]
        )  # (4, N, K)
        s_, c_ = recast.denoised_moments(probes, 2.0)  # Z over all leaves (as shipped)
        den["global"] = den["global"] + s_ / c_ / n_batch
        per_tree = [recast.denoised_moments(probes[:, groups == g], 2.0) for g in np.unique(groups)]  # Z per tree
        den["tree"] = den["tree"] + sum(p[0] for p in per_tree) / sum(p[1] for p in per_tree) / n_batch
    ks = kstest(np.concatenate(x_t2), lambda v: MIX1.cdf(v, t_b[1]))
    means = np.stack(means)  # (B, K, 4)
    est, se = means.mean(0), means.std(0, ddof=1) / np.sqrt(n_batch)
    z = np.abs(est - exact) / se
    D_pairs = recast.pairs_curve(est, np.ones(4))
    D_den = recast.renyi_from_moment(den["global"], 2.0)
    bias = D_den - D_exact
    tree0 = np.abs(recast.renyi_from_moment(den["tree"], 2.0)[:, -1] / D_exact[:, -1] - 1)
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ts = np.linspace(0, 1, 41)
        for k, rew in enumerate(rewards):
            ax[k].plot(ts, exact_renyi(MIX1, rew, ts, (2.0,), 2001)[0][0], "k-", label="exact")
            ax[k].plot(levels_t, D_pairs[k], "o", label="pairs")
            ax[k].plot(levels_t, D_den[k], "s", label="denoised (plug-in)")
            ax[k].set_title(rew.name), ax[k].set_xlabel("t"), ax[k].legend(fontsize=7)
        fig.tight_layout(), fig.savefig(os.path.join(out, "4_pairs_vs_denoised.png"), dpi=110), plt.close(fig)
    rows = [
        ("4 bridge sampler: KS(x_t2, p_t2) p-value", ks.pvalue, "> 0.001", ks.pvalue > 0.001),
        ("4 pairs E[h_t^2] vs exact: max |z| (8 cells)", z.max(), "< 3", z.max() < 3),
        ("4 pairs D_2 max abs error (info)", np.abs(D_pairs - D_exact).max(), "(info)", True),
    ]
    for k, rew in enumerate(rewards):
        rows.append(
            (f"4 denoised D_2 bias {rew.name} at t=.6/.2", f"{bias[k, 1]:+.3f} / {bias[k, 2]:+.3f}", "(info)", True)
        )
    d0 = np.abs(bias[:, -1] / D_exact[:, -1]).max()
    rows += [
        ("4 denoised D_2(0) rel. error, global Z", d0, "< 0.05", d0 < 0.05),
        ("4 denoised D_2(0) rel. error, per-tree Z", tree0.max(), "(info)", True),
    ]
    return rows


def sde_sample(gm, T, n, rng, a=0.7, keep=()):
    """x_1 ~ N(0, I), then T nft.sde_step's with the exact velocity on shifted_sigmas(T, 3).
    Returns the final samples and {grid index: samples} for indices in keep."""
    sig = nft.shifted_sigmas(T, 3.0)
    x, kept = rng.standard_normal((n, gm.d)), {}
    for j in range(T):
        x = nft.sde_step(x, gm.velocity(x, sig[j]), sig[j], sig[j + 1], a, sig[1], rng.standard_normal(x.shape))
        if j + 1 in keep:
            kept[j + 1] = x
    return x, kept


def check_sde(quick, out=None):
    """nft.sde_step keeps the model's marginals as steps grow. 1-D Gaussian N(0, 0.7^2), exact
    velocity (linear, so the variance recursion var' = c_x^2 var + c_n^2 is exact with the coefficients
    read off sde_step): final std 0.61 / 0.68 / 0.70 for 10 / 40 / 160 steps (NOTES.md §1), error shrinking.
    Mixture: KS distance to the data falls with steps; intermediate marginals match p_t."""
    steps = (10, 20, 40, 80, 160)
    s2, stds = 0.49, []
    for T in steps:
        sig, var = nft.shifted_sigmas(T, 3.0), 1.0
        for j in range(T):
            s, sn = sig[j], sig[j + 1]
            k = (1 - s) * s2 / ((1 - s) ** 2 * s2 + s * s)  # E[x0 | x_s] = k x_s
            cx = nft.sde_step(1.0, (1 - k) / s, s, sn, 0.7, sig[1], 0.0)
            cn = nft.sde_step(0.0, 0.0, s, sn, 0.7, sig[1], 1.0)
            var = cx * cx * var + cn * cn
        stds.append(np.sqrt(var))
    err = np.abs(np.array(stds) - 0.7)
    rng = np.random.default_rng(5)
    n = 25_000 if quick else 150_000
    gauss = GaussianMixture([1.0], [[0.0]], [s2])
    mc_std = sde_sample(gauss, 40, n, rng)[0].std()
    ks = {T: kstest(sde_sample(MIX1, T, n, rng)[0][:, 0], MIX1.cdf).statistic for T in (10, 40)}
    x, kept = sde_sample(MIX1, 160, n, rng, keep=(40, 80, 120))
    ks[160] = kstest(x[:, 0], MIX1.cdf).statistic
    sig = nft.shifted_sigmas(160, 3.0)
    ks_mid = max(kstest(v[:, 0], lambda z, t=sig[j]: MIX1.cdf(z, t)).statistic for j, v in kept.items())
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ax[0].semilogx(steps, stds, "o-"), ax[0].axhline(0.7, color="k", ls="--")
        ax[0].set_xlabel("SDE steps"), ax[0].set_title("final std, N(0, 0.7^2), exact v, a=0.7")
        ax[1].hist(x[:, 0], 120, density=True, alpha=0.5, label="SDE 160 steps")
        xs = np.linspace(-2.5, 2.5, 300)
        ax[1].plot(xs, np.exp(MIX1.log_prob(xs[:, None])), "k", label="p0")
        ax[1].legend(fontsize=7), fig.tight_layout()
        fig.savefig(os.path.join(out, "5_sde_marginals.png"), dpi=110), plt.close(fig)
    std_str = " / ".join(f"{s:.3f}" for s in stds)
    return [
        (
            "5 Gaussian final std, 10/20/40/80/160 steps",
            std_str,
            "10:.61 40:.68 160:.70 (+-.01)",
            abs(stds[0] - 0.61) < 0.01 and abs(stds[2] - 0.68) < 0.01 and abs(stds[4] - 0.70) < 0.01,
        ),
        ("5 Gaussian |std - 0.7| strictly shrinking", err[-1], "monotone", bool((np.diff(err) < 0).all())),
        ("5 Gaussian MC std at 40 steps", mc_std, "0.678 +- 0.01", abs(mc_std - stds[2]) < 0.01),
        (
            "5 mixture KS to p0 at 10/40/160 steps",
            f"{ks[10]:.4f} / {ks[40]:.4f} / {ks[160]:.4f}",
            "10 > 40 > 160",
            ks[10] > ks[40] > ks[160],
        ),
        ("5 mixture KS to p_t at 3 mid-grid points", ks_mid, "< 0.02", ks_mid < 0.02),
    ]


class ExactVelocity:
    """Stand-in for the SD3 transformer inside run_kit.velocity: the exact velocity of a mixture, so the
    shipped nft.tree_rollout runs on the toy. Counts the states it evaluates (rollout cost)."""

    def __init__(self, gm):
        self.gm, self.evaluations = gm, 0

    def __call__(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict=False):
        import torch

        self.evaluations += len(hidden_states)
        x = hidden_states.reshape(len(hidden_states), -1).double().numpy()
        return (torch.as_tensor(self.gm.velocity(x, float(timestep[0]) / 1000)).reshape(hidden_states.shape),)


def training_regime(reward, gm, rng):
    """r = 1/2 + (R - E R) / (10 sd R): the magnitude of DiffusionNFT's r = 1/2 + A / 10 without the group
    centring and the clip (which scale e^D - 1 by a common factor: derivations.ipynb §7)."""
    R = reward(gm.sample(200_000, rng))
    m, sd = R.mean(), R.std()
    return RidgeReward(reward.name, reward.u, lambda z: 0.5 + (reward.f(z) - m) / (10 * sd))


def credit_iteration(gm, rewards, spec, n_prompts, offset, substeps, gen, estimator="pairs", T=10, noise_rng=None):
    """One training iteration's credit statistics on the toy, through the shipped code: nft.branch_layout,
    nft.tree_rollout (exact velocity, 2 roots x 4 children, a = sqrt 2), nft.optimality per group,
    recast.level_observations. noise_rng: pure-noise rewards instead (independent of x0).
    Returns ((n, s1, s2), rollout evaluations per leaf)."""
    import torch

    sig = torch.as_tensor(nft.shifted_sigmas(T))
    layouts = nft.branch_layout(n_prompts, T, spec, offset)
    model = ExactVelocity(gm)
    emb, pooled = torch.zeros(n_prompts, 1, 1, dtype=torch.float64), torch.zeros(n_prompts, 1, dtype=torch.float64)
    x, groups, anc, probes = nft.tree_rollout(
        model,
        emb,
        pooled,
        sig,
        2,
        4,
        layouts,
        np.sqrt(2),
        gen,
        (gm.d,),
        chunk=10**9,
        probe_steps=layouts if estimator == "denoised" else (),
        substeps=substeps,
    )

    def score(z):
        if noise_rng is not None:
            return noise_rng.standard_normal((len(z), len(rewards)))
        return np.stack([rew(z.double().numpy()) for rew in rewards], 1)

    R = score(x)
    std = R.std(0)
    r = nft.optimality(R, groups, std=std)
    probe_r = [(j, nft.optimality(score(x0h), gp, std=std), gp) for j, x0h, gp in probes]
    return recast.level_observations(r, groups, anc, layouts, T, probe_r, estimator), model.evaluations / len(x)


def accumulate(stats, new, gamma):
    return new if stats is None else [gamma * a + b for a, b in zip(stats, new)]


def credit_W(stats, sig, estimator="pairs", c=2.0, budgets=(1.0, 1.0)):
    D, se = recast.level_curves(*stats, estimator)
    _, _, P, rho = recast.credit_profiles(D, se, sig, stats[0], c)
    return recast.solve_W(list(budgets), P), D, se, rho


def noise_stats(n_rewards, prompts, iterations, gain_ema, seed):
    """Check 8c's null: n_rewards pure-noise rewards (standard normal draws, independent of the image) through the
    shipped credit code, `prompts` rotated trees per iteration, level statistics accumulated at gain_ema. Yields
    the statistics after every iteration; seed fixes both the rollouts' and the rewards' noise."""
    import torch

    stats, gen, nrng = None, torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for it in range(iterations):
        new = credit_iteration(MIX1, [None] * n_rewards, "rotate", prompts, it * prompts, 1, gen, noise_rng=nrng)
        stats = accumulate(stats, new[0], gain_ema)
        yield stats


def noise_departure(stats, sig, c=2.0):
    """max_kj |W / W_unif - 1| of the W built from pure-noise statistics (equal budgets, W_unif = 1 / T)."""
    n_rewards = stats[1].shape[0]
    return float(np.abs(credit_W(stats, sig, c=c, budgets=[1.0] * n_rewards)[0] * (len(sig) - 1) - 1).max())


def check_credit(quick, out=None):
    """ReCAST's measured credit against exact ground truth (issue: gains at every step, with error bars):
    (a) the pairs levels at the default sampler (T = 10, rotated branch steps, a = sqrt 2) against the
    exact D_2 of the training-regime r, for 1, 2 and 4 SDE sub-steps, with the rollout cost per leaf;
    (b) W from the estimators after 1 iteration and after the EMA horizon, against the exact W (coarse
    vs fine reward, equal budgets); (c) pure-noise rewards: how far W leaves uniform, with and without
    the evidence shrinkage; (d) with plenty of samples the shrunk W recovers the exact one."""
    import torch

    rng = np.random.default_rng(7)
    T, sig = 10, nft.shifted_sigmas(10)
    rewards = [training_regime(rew, MIX1, rng) for rew in (COARSE1, FINE1)]
    ts = np.unique(np.concatenate([np.linspace(0, 1, 41), sig]))
    exact = np.stack([np.interp(sig, ts, exact_renyi(MIX1, rew, ts, (2.0,), 1201)[0][0]) for rew in rewards])
    _, gains_x = recast.gains_on_grid(sig, exact, sig)
    W_exact = recast.solve_W([1.0, 1.0], recast.profiles(gains_x))
    rows, lines = [], []
    # (a) level bias and cost
    n_groups = 800 if quick else 4000
    bias = {}
    lines.append("\n8a pairs D_2 of the coarse reward (training regime) at each rotated branch level vs exact")
    lines.append("  t_j       " + " ".join(f"{sig[j]:6.3f}" for j in range(1, T - 1)) + "   evals/leaf")
    lines.append("  exact     " + " ".join(f"{exact[0, j]:6.3f}" for j in range(1, T - 1)))
    for m in (1, 2, 4):
        stats, cost = credit_iteration(MIX1, rewards, "rotate", n_groups, 0, m, torch.Generator().manual_seed(m))
        D, se = recast.level_curves(*stats)
        z = (D[0, 1 : T - 1] - exact[0, 1 : T - 1]) / se[0, 1 : T - 1]
        rel = np.abs(D[0, 1 : T - 1] - exact[0, 1 : T - 1]).sum() / exact[0, 1 : T - 1].sum()
        bias[m] = (rel, cost, np.abs(z).max())
        lines.append(
            f"  m = {m}     "
            + " ".join(f"{d:6.3f}" for d in D[0, 1 : T - 1])
            + f"   {cost:.1f}   (sum |err| / sum D = {rel:.2f})"
        )
        lines.append("    +- se   " + " ".join(f"{e:6.3f}" for e in se[0, 1 : T - 1]))
    rows += [
        (
            "8a pairs level error sum|D-D*|/sum D*, 1 / 2 / 4 sub-steps",
            " / ".join(f"{bias[m][0]:.2f}" for m in (1, 2, 4)),
            "shrinks with sub-steps",
            bias[4][0] < bias[1][0],
        ),
        (
            "8a rollout evaluations per leaf, 1 / 2 / 4 sub-steps",
            " / ".join(f"{bias[m][1]:.1f}" for m in (1, 2, 4)),
            "(info)",
            True,
        ),
    ]
    # (b) W error vs iterations, per estimator layout
    reps = 4 if quick else 12
    lines.append(
        "\n8b mean_kj |W - W*| / (lambda_k / T), coarse vs fine, equal budgets, 8 groups per iteration (mean over reps)"
    )
    errs = {}
    for name, spec, est in (
        ("pairs rotate", "rotate", "pairs"),
        ("pairs 3,6", [3, 6], "pairs"),
        ("denoised rotate", "rotate", "denoised"),
    ):
        for n_it in (1, 10, 50):
            e = []
            for rep in range(reps):
                stats = None
                gen = torch.Generator().manual_seed(1000 * rep + n_it)
                for it in range(n_it):
                    new, _ = credit_iteration(MIX1, rewards, spec, 8, it * 8, 2, gen, est)
                    stats = accumulate(stats, new, 0.9 if n_it <= 10 else 0.97)
                W = credit_W(stats, sig, est)[0]
                e.append(np.abs(W - W_exact).mean() / 0.1)
            errs[(name, n_it)] = np.mean(e)
        lines.append(
            f"  {name:<16} 1 it: {errs[(name, 1)]:.3f}   10 its (gamma .9): {errs[(name, 10)]:.3f}   "
            f"50 its (gamma .97): {errs[(name, 50)]:.3f}   (uniform W: {np.abs(0.1 - W_exact).mean() / 0.1:.3f})"
        )
    # (c) pure noise: W stays uniform
    noise_reps = 40 if quick else 200
    dev = {0.0: [], 2.0: []}
    for rep in range(noise_reps):
        *_, stats = noise_stats(2, 8, 10, 0.9, rep)
        for c in dev:
            dev[c].append(noise_departure(stats, sig, c))
    q95 = {c: float(np.quantile(v, 0.95)) for c, v in dev.items()}
    # the same at the main command's horizon: recast.py's default iterations and --gain-ema (many more observations)
    defaults = recast.Args()
    n_it, gamma, reps_h = defaults.iterations, defaults.gain_ema, 10 if quick else 40
    dev_h = []
    for rep in range(reps_h):
        *_, stats = noise_stats(2, 8, n_it, gamma, 10_000 + rep)
        dev_h.append(noise_departure(stats, sig))
    q95_h = float(np.quantile(dev_h, 0.95))
    # four pure-noise rewards at recast-protocol's size (3 groups x 24 iterations: few observations per level, where
    # estimated errors have t tails; derivations.ipynb §6c): the final W and how many iterations it was off uniform
    reps_p, dev_p, off_p = 10 if quick else 40, [], []
    for rep in range(reps_p):
        per_it = [noise_departure(stats, sig) for stats in noise_stats(4, 3, 24, gamma, 20_000 + rep)]
        dev_p.append(per_it[-1])
        off_p.append(np.mean(np.asarray(per_it) > 1e-3))
    q95_p = float(np.quantile(dev_p, 0.95))
    lines.append(
        f"\n8c four pure-noise rewards at recast-protocol's size (3 groups x 24 iterations, gain_ema {gamma}): final "
        f"max_kj |W / W_unif - 1| median / 95th percentile over {reps_p} runs: {np.median(dev_p):.3f} / {q95_p:.3f}; "
        f"iterations off uniform {np.mean(off_p):.0%}"
    )
    lines.append(
        f"\n8c pure-noise rewards at the main command's horizon ({n_it} iterations, gain_ema {gamma}): "
        f"max_kj |W / W_unif - 1| median / 95th percentile over {reps_h} runs: {np.median(dev_h):.3f} / {q95_h:.3f}"
    )
    lines.append(
        f"\n8c pure-noise rewards, 10 iterations: max_kj |W / W_unif - 1|, "
        f"median / 95th percentile over {noise_reps} runs: "
        f"no shrinkage {np.median(dev[0.0]):.3f} / {q95[0.0]:.3f}; "
        f"evidence c = 2: {np.median(dev[2.0]):.3f} / {q95[2.0]:.3f}"
    )
    rows += [
        (
            "8b W error after the horizon, pairs rotate",
            errs[("pairs rotate", 50)],
            f"< 1 it ({errs[('pairs rotate', 1)]:.3f})",
            errs[("pairs rotate", 50)] < errs[("pairs rotate", 1)],
        ),
        ("8c pure noise: 95th pct max|W/W_unif - 1|, c = 2", q95[2.0], "< 0.05", q95[2.0] < 0.05),
        (f"8c pure noise, {n_it} iterations at gain_ema {gamma}: 95th pct, c = 2", q95_h, "< 0.05", q95_h < 0.05),
        ("8c four pure-noise rewards, 3 groups x 24 iterations: 95th pct", q95_p, "< 0.05", q95_p < 0.05),
        (
            "8c pure noise: same without shrinkage (c = 0)",
            q95[0.0],
            "> 4x the shrunk",
            q95[0.0] > 4 * max(q95[2.0], 0.01),
        ),
    ]
    # (d) plenty of samples: the shrunk W recovers the exact W
    stats, _ = credit_iteration(MIX1, rewards, "rotate", 12000, 0, 4, torch.Generator().manual_seed(99))
    W_big, _, _, rho = credit_W(stats, sig)
    err_big, err_unif = np.abs(W_big - W_exact).mean() / 0.1, np.abs(0.1 - W_exact).mean() / 0.1
    n_exact = np.full(T + 1, 1e12)  # the exact levels with negligible errors: the rule must give the exact W back
    D_x, se_x = np.concatenate([np.zeros((2, 1)), exact[:, 1:]], 1), np.full((2, T + 1), 1e-9)
    W_lim = recast.solve_W([1.0, 1.0], recast.credit_profiles(D_x, se_x, sig, n_exact)[2])
    err_lim = np.abs(W_lim - W_exact).max() / 0.1
    rows += [
        (
            "8d many samples (4 sub-steps): mean|W - W*| / W_unif",
            err_big,
            f"< uniform's {err_unif:.3f} / 2 (rho {rho.round(2).tolist()})",
            err_big < err_unif / 2,
        ),
        ("8d exact levels, se -> 0: max|W - W*| / W_unif", err_lim, "< 1e-3", err_lim < 1e-3),
    ]
    print("\n".join(lines))
    print("  exact W / 0.1:\n" + "\n".join("    " + " ".join(f"{w / 0.1:5.2f}" for w in row) for row in W_exact))
    print("  many-sample W / 0.1:\n" + "\n".join("    " + " ".join(f"{w / 0.1:5.2f}" for w in row) for row in W_big))
    return rows


def cosine(a, b):
    """Cosine similarity along the last axis; 0 where either vector is exactly zero."""
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return np.where(na * nb > 0, (a * b).sum(-1) / np.where(na * nb > 0, na * nb, 1.0), 0.0)


def group_directions(gm, reward, t_b, n_groups, G, beta, rng):
    """n_groups states x_{t_b} ~ p_{t_b} (t_b = 1: broad groups of independent samples), G exact posterior
    samples each, rvge.value_direction per group. Returns states (n, d), members (n, G, d), d_B (n, d)."""
    xs = gm.sample(n_groups, rng, t=t_b)
    members = gm.sample_posterior(np.repeat(xs, G, 0), t_b, rng).reshape(n_groups, G, gm.d)
    d_B = np.stack([rvge.value_direction(x0, reward(x0), beta=beta) for x0 in members])
    return xs, members, d_B


def check_rvge(quick, out=None):
    """(a) Gaussian base N(mu, s2 I), linear reward R = w . x0: value_direction on exact posterior samples
    matches the tilted shift Cov(x0 | x_t) w / beta (and eta Cov w at first order); transfer_ratio /
    target_velocity match the exact velocity of the tilted Gaussian at other t. (b) Mixture base,
    smooth reward: error vs the exact tilted shift across t_b, group size G and query t. (c) 0/1 reward:
    local groups tie (zero direction), broad groups (t_b = 1) point along the population shift."""
    rng = np.random.default_rng(6)
    rows = []
    # (a) Gaussian base, linear reward
    s2, beta, t_b, eta = 0.5, 1.0, 0.5, 0.3
    w = np.array([1.0, 0.5, -0.5, 0.25])
    gm = GaussianMixture([1.0], [[0.5, -0.3, 0.2, 0.0]], [s2])
    lin = RidgeReward("linear", w, lambda z: z)
    G = 20_000 if quick else 80_000
    xb = gm.sample(1, rng, t=t_b)
    x0 = gm.sample_posterior(np.repeat(xb, G, 0), t_b, rng)
    kappa = rvge.posterior_var(t_b, s2)
    d_B = rvge.value_direction(x0, lin(x0), beta=beta)
    cos_a = float(cosine(d_B, kappa * w / beta))
    d_lin = rvge.value_direction(x0, lin(x0), eta=eta)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    kap_err = max(abs(rvge.posterior_var(t, s2) - gm.posterior_cov(xb, t)[0, 0, 0]) for t in (0.1, 0.5, 0.9))
    tilted, ts = gm.tilted_linear(w, beta), np.array([0.1, 0.3, 0.7, 0.9])
    xq = (1 - ts[:, None]) * x0[:4] + ts[:, None] * rng.standard_normal((4, 4))  # queries: noised members
    v_old = np.stack([gm.velocity(xq[i : i + 1], t)[0] for i, t in enumerate(ts)])
    v_star = np.stack([tilted.velocity(xq[i : i + 1], t)[0] for i, t in enumerate(ts)])
    v_tgt = rvge.target_velocity(v_old, np.repeat(d_B[None], 4, 0), ts, t_b, s2)
    tr_err = max(rel(v_tgt[i] - v_old[i], v_star[i] - v_old[i]) for i in range(4))
    rows += [
        ("6a kappa(t) vs exact Cov(x0|x_t)", kap_err, "< 1e-12", kap_err < 1e-12),
        ("6a KL direction: cosine to Cov w / beta", cos_a, "> 0.99", cos_a > 0.99),
        ("6a KL direction: rel. norm error", rel(d_B, kappa * w / beta), "< 0.05", rel(d_B, kappa * w / beta) < 0.05),
        (
            "6a first order: rel. error to eta Cov w",
            rel(d_lin, eta * kappa * w),
            "< 0.05",
            rel(d_lin, eta * kappa * w) < 0.05,
        ),
        ("6a transfer t_b=.5 -> t: rel. error of dv", tr_err, "< 0.05", tr_err < 0.05),
    ]
    # (b) Mixture base, smooth reward, KL beta
    beta, n_st = 0.5, 100 if quick else 300
    s2_pop = float(np.mean(MIX2.w @ (MIX2.var + MIX2.mu**2) - (MIX2.w @ MIX2.mu) ** 2))
    table, med = [], {}
    for t_b in (0.1, 0.3, 0.6, 1.0):
        for G in (8, 32, 128):
            xs, members, d_B = group_directions(MIX2, COARSE2, t_b, n_st, G, beta, rng)
            exact = MIX2.tilted_shift(xs, t_b, COARSE2, beta)
            med[t_b, G] = np.median(np.linalg.norm(d_B - exact, axis=1) / np.linalg.norm(exact, axis=1))
            cos = cosine(d_B, exact).mean()
        tq = np.array([0.05, 0.2, 0.5, 0.8])
        tr = []
        for t in tq:  # query: a member noised to t, direction transferred from t_b
            xq = (1 - t) * members[:, 0] + t * rng.standard_normal(members[:, 0].shape)
            est = rvge.transfer_ratio(t, t_b, s2_pop) * d_B
            tr.append(
                np.median(
                    np.linalg.norm(est - MIX2.tilted_shift(xq, t, COARSE2, beta), axis=1)
                    / np.linalg.norm(MIX2.tilted_shift(xq, t, COARSE2, beta), axis=1)
                )
            )
        table.append((t_b, med[t_b, 8], med[t_b, 32], med[t_b, 128], cos, *tr))
    print("\n6b mixture + smooth reward (beta=0.5): median rel. error of d_B vs exact shift")
    print("  t_b   G=8    G=32   G=128  cos(G=128) | transfer to t=" + " ".join(f"{t:<6}" for t in tq))
    for row in table:
        print(
            "  "
            + f"{row[0]:<4}  "
            + "  ".join(f"{v:.3f}" for v in row[1:5])
            + "      | "
            + " ".join(f"{v:.3f} " for v in row[5:])
        )
    shrink = all(med[t_b, 128] < med[t_b, 32] < med[t_b, 8] for t_b in (0.1, 0.3, 0.6, 1.0))
    rows += [
        (
            "6b rel. error shrinks with G at each t_b",
            max(med[t_b, 128] for t_b in (0.1, 0.3, 0.6, 1.0)),
            "G=8 > 32 > 128",
            shrink,
        ),
        ("6b min mean cosine at G=128", min(r[4] for r in table), "> 0.9", min(r[4] for r in table) > 0.9),
    ]
    # (c) smooth vs discrete reward across bandwidth t_b (G = 16)
    bands, res = (0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0), {}
    smooth, step = sigmoid_reward(E1, 0.0, 0.3), step_reward(E1, 0.0)
    for rew in (smooth, step):
        for t_b in bands:
            xs, _, d_B = group_directions(MIX2, rew, t_b, n_st, 16, beta, rng)
            exact = MIX2.tilted_shift(xs, t_b, rew, beta)
            res[rew.name, t_b] = (cosine(d_B, exact).mean(), (np.abs(d_B).max(1) == 0).mean())
    print("\n6c cosine to the exact shift vs bandwidth t_b (G=16): smooth | discrete (share of zero directions)")
    for t_b in bands:
        print(f"  t_b={t_b:<5} {res['coarse', t_b][0]:.3f} | {res['step', t_b][0]:.3f} ({res['step', t_b][1]:.2f})")
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.3))
        ax.semilogx(bands, [res["coarse", b][0] for b in bands], "o-", label="smooth (sigmoid)")
        ax.semilogx(bands, [res["step", b][0] for b in bands], "s-", label="discrete (0/1)")
        ax.semilogx(bands, [res["step", b][1] for b in bands], "s:", label="discrete: share tied")
        ax.set_xlabel("group bandwidth t_b"), ax.set_ylabel("mean cosine to exact shift"), ax.legend(fontsize=7)
        fig.tight_layout(), fig.savefig(os.path.join(out, "6_rvge_bandwidth.png"), dpi=110), plt.close(fig)
    rows += [
        ("6c discrete, local t_b=.05: share tied", res["step", 0.05][1], "> 0.5", res["step", 0.05][1] > 0.5),
        ("6c discrete, broad t_b=1: mean cosine", res["step", 1.0][0], "> 0.5", res["step", 1.0][0] > 0.5),
        ("6c smooth, local t_b=.05: mean cosine", res["coarse", 0.05][0], "> 0.8", res["coarse", 0.05][0] > 0.8),
    ]
    return rows


# =============================================================================
# Check 6d: diagnosis of each method's implied target on exact ground truth (issue 16, item 3)
# =============================================================================


def mixture_16d(seed=16):
    """d = 16 mixture with anisotropic components, as image latents are: 4 modes with means ~ N(0, 0.6^2 I),
    per-dimension variances log-spaced 0.02 ... 0.5 (shuffled per mode). With G << d a group's centred samples span
    at most G - 1 of the 16 directions (NOTES.md §4.2's subspace argument), so the estimator noise shows here and not
    in d = 2."""
    rng = np.random.default_rng(seed)
    var = np.geomspace(0.02, 0.5, 16)
    means = 0.6 * rng.standard_normal((4, 16))
    return GaussianMixture([0.2, 0.3, 0.25, 0.25], means, np.stack([rng.permutation(var) for _ in range(4)]))


def reward_moments0(gm, reward):
    """Mean and std of r(x0) under p0, exact (1-D moments per component)."""
    mz, q = gm.mu @ reward.u, gm.var @ reward.u**2
    m1, m2 = gm.w @ reward.moments(mz, q)[0], gm.w @ reward.moments(mz, q, lambda r: r * r)[0]
    return m1, np.sqrt(m2 - m1 * m1)


def nft_empirical_shift(x0, r, xq, t, x0_hat, b=1.0):
    """DiffusionNFT's implied target from G rollouts, in x0 units: the minimiser over v(x_q) of its (unweighted) loss on
    the rollouts' empirical distribution with fresh noise, -t (v* - v_old) = (1/b) sum_i w_i (2 r_i - 1)(x0_i - x0_hat),
    w_i propto N(x_q; (1 - t) x0_i, t^2 I) (the rollouts' noising likelihoods; derivations.ipynb §3, before E[u|x_t] =
    v_old is used). v_old is the exact old velocity (x0_hat = E[x0 | x_q]).
    x0 (n, G, d), r (n, G), xq (n, d) -> (n, d)."""
    logw = -((xq[:, None] - (1 - t) * x0) ** 2).sum(-1) / (2 * t * t)
    w = np.exp(logw - logw.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    return ((w * (2 * r - 1))[..., None] * (x0 - x0_hat[:, None])).sum(1) / b


def check_nft_closed_form(rng):
    """`nft_empirical_shift` is the argmin of the shipped nft.nft_loss (weighted by w_i): a Newton step from v_old
    at scale 1e-9, where nft_loss's adaptive scale sits at its 1e-5 floor (as in derivations.ipynb §3)."""
    import torch

    G, d, t, sc = 6, 5, 0.4, 1e-9
    x0, r, xq = rng.standard_normal((1, G, d)), rng.random((1, G)), rng.standard_normal((1, d))
    x0_hat = x0[0].mean(0, keepdims=True) + 0.1 * rng.standard_normal((1, d))
    logw = -((xq[:, None] - (1 - t) * x0) ** 2).sum(-1) / (2 * t * t)
    w = torch.as_tensor(np.exp(logw - logw.max()) / np.exp(logw - logw.max()).sum())[0]
    T = lambda a: torch.as_tensor(a * sc).expand(G, d)  # noqa: E731
    x_t, v_old = T(xq), T((xq - x0_hat) / t)

    def loss(v):
        return (
            w
            * nft.nft_loss(
                v.expand(G, d), v_old, x_t, torch.as_tensor(x0[0] * sc), torch.full((G,), t), torch.as_tensor(r[0])
            )
        ).sum()

    v0 = v_old[:1].clone()
    H = torch.autograd.functional.hessian(loss, v0).reshape(d, d)
    g = torch.autograd.grad(loss(v0.requires_grad_()), v0)[0].reshape(d)
    v_star = v0.detach().reshape(d) - torch.linalg.solve(H, g)
    shift = (-t * (v_star - v_old[0]) / sc).numpy()
    ref = nft_empirical_shift(x0, r, xq, t, x0_hat)[0]
    return float(np.linalg.norm(shift - ref) / np.linalg.norm(ref))


def diagnose(gm, reward, t_b, G, n, ts, rng, eta=0.2, b=1.0, cap=4.0):
    """One (mixture, reward, t_b, G) cell. n groups: a state x_{t_b} ~ p_{t_b} and G exact posterior samples of
    x0 | x_{t_b} (t_b = 1: G independent rollouts, a broad group; DiffusionNFT's prompt group). Rewards -> A with
    nft.advantages at the exact population std (r with nft.optimality). Queries: member 0 noised to each t in ts.
    Reference: the exact first-order tilted shift eta Cov(x0, A | x_q) (p* propto p exp(eta A), A = R / std R), in x0
    units (the velocity shift is -d / t: same cosine and relative error).
    Returns {variant: (len(ts), 4) array of
        mean cosine over the queries,
        relative error sqrt(sum |est - exact|^2 / sum |exact|^2) (1: no better than no update),
        gain sum <est, exact> / sum |exact|^2 (1: the right step on average),
        c* = sum <est, exact> / sum |est|^2 (the weight on the target that minimises the squared error)},
    the share of groups whose rewards all tie, and (len(ts),) the relative gap between the first-order shift and the
    exact tilt p propto p exp(eta A) (is eta small enough for first order)."""
    _, std = reward_moments0(gm, reward)
    var = gm.w @ (gm.var + gm.mu**2) - (gm.w @ gm.mu) ** 2  # (d,) population variance per dimension
    s2 = float(var.mean())  # pooled per-dimension variance (what rvge.py logs as rvge/s2)
    xs = gm.sample(n, rng, t=t_b)
    x0 = gm.sample_posterior(np.repeat(xs, G, 0), t_b, rng).reshape(n, G, gm.d)
    R = reward(x0)  # (n, G)
    groups = np.repeat(np.arange(n), G)
    A = nft.advantages(R.ravel(), groups, std=[std]).reshape(n, G)
    r = nft.optimality(R.ravel(), groups, std=[std]).reshape(n, G)
    tied = float((np.ptp(R, 1) == 0).mean())
    direction = lambda x, a: np.stack([rvge.value_direction(x[k], a[k], eta=eta) for k in range(n)])  # noqa: E731
    d_clean = direction(x0, A)
    t_n = max(t_b - 0.1, t_b / 2)  # "noisy" coordinates: each member's denoised state one 10-step grid step below t_b
    x_n = sample_bridge(x0, xs[:, None], t_b, t_n, rng)
    d_noisy = direction(gm.posterior_mean(x_n.reshape(-1, gm.d), t_n).reshape(n, G, gm.d), A)
    # The bias: value_direction is unbiased for eta Cov(x0, A | x_{t_b}), so a network that regresses on the targets
    # converges to E[ratio eta Cov(x0, A | x_{t_b}) | x_q]; x0 ~ x0 | x_q and x_{t_b} ~ N((1 - t_b) x0, t_b^2)
    # (K draws).
    K = 16

    def bias_at(xq, t):
        x_b = (1 - t_b) * gm.sample_posterior(np.repeat(xq, K, 0), t, rng) + t_b * rng.standard_normal((n * K, gm.d))
        return gm.tilted_shift(x_b, t_b, reward, eta=eta / std).reshape(n, K, gm.d).mean(1)

    if t_b < 1:  # the same leaf's broad group in an R x C tree: itself and G - 1 leaves of other (independent) roots
        xb = np.concatenate([x0[:, :1], gm.sample(n * (G - 1), rng).reshape(n, G - 1, gm.d)], 1)
        Rb = reward(xb)
        d_broad = direction(xb, nft.advantages(Rb.ravel(), groups, std=[std]).reshape(n, G))
    res, nonlin = {}, np.zeros(len(ts))
    for i, t in enumerate(ts):
        xq = (1 - t) * x0[:, 0] + t * rng.standard_normal((n, gm.d))
        exact = gm.tilted_shift(xq, t, reward, eta=eta / std)
        full = gm.tilted_shift(xq, t, reward, beta=std / eta)
        nonlin[i] = np.sqrt(((full - exact) ** 2).sum() / (full**2).sum())
        ratio, qw = rvge.transfer_ratio(t, t_b, s2, cap), rvge.query_weight(t, t_b, s2)
        d_inf = bias_at(xq, t)
        x0_hat = gm.posterior_mean(xq, t)
        est = {
            "clean, direct": ratio * d_clean,
            "clean, none": d_clean,
            "noisy, direct": ratio * d_noisy,
            "clean, direct, qw": qw * ratio * d_clean,
            "bias (G=inf), direct": ratio * d_inf,
            "bias (G=inf), none": d_inf,
            "fix: per-dim s2": rvge.transfer_ratio(t, t_b, var, cap) * d_clean,
        }
        if t_b < 1:  # proposal: the leaf's local direction at t <= t_b, its broad one (transferred from 1) above
            est["fix: local<=t_b<broad"] = (
                ratio * d_clean if t <= t_b else rvge.transfer_ratio(t, 1.0, s2, cap) * d_broad
            )
        else:  # DiffusionNFT regresses on independent rollouts: the broad group
            est["NFT empirical optimum"] = nft_empirical_shift(x0, r, xq, t, x0_hat, b)
            est["NFT 1 sample"] = (2 * r[:, 0:1] - 1) * (x0[:, 0] - x0_hat) / b
        ee = (exact**2).sum()
        for k, e in est.items():
            dot = (e * exact).sum()
            res.setdefault(k, np.zeros((len(ts), 4)))[i] = [
                cosine(e, exact).mean(),
                np.sqrt(((e - exact) ** 2).sum() / ee),
                dot / ee,
                dot / max((e * e).sum(), 1e-300),
            ]
    return res, tied, nonlin


def diagnosis_cases():
    """The four (mixture, reward) cases: MIX2 and `mixture_16d`, each with a sigmoid and a 0/1 step reward along one
    direction, centred on the population mean of u . x0."""
    gm16, u16 = mixture_16d(), np.full(16, 0.25)
    c16 = float(gm16.w @ gm16.mu @ u16)
    return {
        ("d=2", "sigmoid"): (MIX2, sigmoid_reward([0.6, 0.8], 0.0, 0.3)),
        ("d=2", "0/1"): (MIX2, step_reward([0.6, 0.8], 0.0)),
        ("d=16", "sigmoid"): (gm16, sigmoid_reward(u16, c16, 0.3)),
        ("d=16", "0/1"): (gm16, step_reward(u16, c16)),
    }


def print_diagnosis(Q, ties, cases, ts, Gs, G_show=8):
    """The tables: per case, every variant's cosine / rel. error (gain) vs t at G = G_show; the main variants vs G
    (means over t); c*(t); the share of tied groups."""
    cell = "{cos:5.2f}/{rel:5.2f}({gain:4.2f})"
    for case in cases:
        print(
            f"\n6d {case[0]}, {case[1]} reward, G = {G_show}: "
            "cosine / rel. error (gain) vs the exact tilted shift, per query t"
        )
        print(f"  {'t_b':<4} {'variant':<22} " + " ".join(f"t={t:<13}" for t in ts))
        for t_b in (0.3, 1.0):
            for k in dict.fromkeys(key[4] for key in Q if key[:3] == (*case, t_b)):
                print(f"  {t_b:<4} {k:<22} " + " ".join(cell.format(**Q[(*case, t_b, G_show, k, t)]) for t in ts))
        print("  vs G, mean over t:     " + "  ".join(f"G={G:<9}" for G in Gs))
        for t_b in (0.3, 1.0):
            extra = ("fix: local<=t_b<broad",) if t_b < 1 else ("NFT empirical optimum", "NFT 1 sample")
            for k in ("clean, direct", "fix: per-dim s2") + extra:
                mean = lambda f, G: np.mean([Q[(*case, t_b, G, k, t)][f] for t in ts])  # noqa: E731
                print(f"  {t_b:<4} {k:<22} " + "  ".join(f"{mean('cos', G):4.2f}/{mean('rel', G):5.2f}" for G in Gs))
        for t_b in (0.3, 1.0):
            print(
                f"  c*(t) of clean, direct at t_b = {t_b}, G = 2 | 8 | {Gs[-1]}: "
                + "  ".join(
                    "/".join(f"{Q[(*case, t_b, G, 'clean, direct', t)]['c_star']:.2f}" for G in (2, 8, Gs[-1]))
                    for t in ts
                )
            )
        print(
            "  groups that tie (t_b = 0.3 | 1): "
            + "  ".join(f"G={G}: {ties[(*case, 0.3, G)]:.2f} | {ties[(*case, 1.0, G)]:.2f}" for G in Gs)
        )


def check_rvge_diagnosis(quick, out=None):
    """Issue 16 item 3: the target each method implies at sampled (x_t, t), against the exact tilted shift, at equal
    reward evaluations (G per group), d = 2 and d = 16, smooth (sigmoid) and 0/1 reward. RVGE (rvge.value_direction /
    transfer_ratio / query_weight at the default eta = 0.2, cap 4) with each ablation: coords clean | noisy, transfer
    direct | none, local (t_b = 0.3) | broad (t_b = 1), query weights (qw: the first gradient step's shift, weight x
    target); bias rows (the targets' conditional mean at x_q, G -> infinity) isolate the transfer error; two candidate
    fixes ("fix:" rows). DiffusionNFT (b = 1): the minimiser of its loss on the same G rollouts (`nft_empirical_shift`,
    checked against nft.nft_loss), and the 1-sample target its loss regresses on. Tables printed; CSV in `out`."""
    rng = np.random.default_rng(8)
    ts = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
    Gs, n = ((2, 8, 24), 80) if quick else ((2, 4, 8, 24), 400)
    cases = diagnosis_cases()
    records, ties, nonlin = [], {}, []
    for case, (gm, rew) in cases.items():
        for t_b in (0.3, 1.0):
            for G in Gs:
                res, ties[(*case, t_b, G)], nl = diagnose(gm, rew, t_b, G, n, np.array(ts), rng)
                nonlin.append(nl.max())
                records += [
                    dict(
                        d=case[0],
                        reward=case[1],
                        t_b=t_b,
                        G=G,
                        method=k,
                        t=t,
                        cos=a[i, 0],
                        rel=a[i, 1],
                        gain=a[i, 2],
                        c_star=a[i, 3],
                    )
                    for k, a in res.items()
                    for i, t in enumerate(ts)
                ]
    Q = {(q["d"], q["reward"], q["t_b"], q["G"], q["method"], q["t"]): q for q in records}
    print_diagnosis(Q, ties, cases, ts, Gs)
    if out:
        import csv

        with open(os.path.join(out, "6d_rvge_diagnosis.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader(), writer.writerows(records)
    # what the numbers robustly show (margins from the quick and full runs)
    below, above = [t for t in ts if t <= 0.3], [t for t in ts if t > 0.3]
    m = lambda case, t_b, G, k, f="cos", tt=ts: np.mean([Q[(*case, t_b, G, k, t)][f] for t in tt])  # noqa: E731
    d2s, d16s = ("d=2", "sigmoid"), ("d=16", "sigmoid")
    nft_err = check_nft_closed_form(rng)
    noise = (m(d16s, 0.3, 2, "clean, direct", tt=below), m(d16s, 0.3, Gs[-1], "clean, direct", tt=below))
    sub = (m(d2s, 0.3, 2, "clean, direct", tt=below), m(d16s, 0.3, 2, "clean, direct", tt=below))
    conv = (m(d16s, 0.3, 8, "bias (G=inf), direct", tt=below), m(d16s, 0.3, 8, "clean, direct", tt=below))
    broad_bias = (
        m(d16s, 1.0, 8, "bias (G=inf), direct", tt=below),
        m(d16s, 1.0, 8, "bias (G=inf), direct", "rel", below),
    )
    pooled = lambda gm: float(np.mean(gm.w @ (gm.var + gm.mu**2) - (gm.w @ gm.mu) ** 2))  # noqa: E731
    qw_gap = max(
        abs(Q[(*c, 0.3, G, "clean, direct, qw", t)][f] - Q[(*c, 0.3, G, "clean, none", t)][f])
        for c in cases
        for G in Gs
        for t in above
        if rvge.transfer_ratio(t, 0.3, pooled(cases[c][0])) < 4.0
        for f in ("cos", "rel", "gain")
    )
    tie = (
        min(ties[(*c, 0.3, 2)] for c in cases if c[1] == "0/1"),
        max(ties[(*c, 1.0, 8)] for c in cases if c[1] == "0/1"),
    )
    coords = (
        np.mean([m(c, 0.3, 8, "clean, direct") - m(c, 0.3, 8, "noisy, direct") for c in cases]),
        min(m(c, 1.0, 8, "clean, direct") - m(c, 1.0, 8, "noisy, direct") for c in cases),
    )
    hybrid = min(m(c, 0.3, 8, "fix: local<=t_b<broad") - m(c, 0.3, 8, "clean, direct") for c in cases if c != d2s)
    vs_nft = min(m(c, 1.0, 8, "clean, direct") - m(c, 1.0, 8, "NFT empirical optimum") for c in cases)
    overshoot = min(Q[(*c, 1.0, 8, "clean, none", 0.1)]["gain"] for c in cases)
    steps = [Q[(*c, 1.0, 8, "bias (G=inf), direct", 0.9)]["gain"] for c in cases]
    f2 = lambda v: "/".join(f"{x:.2f}" for x in v)  # noqa: E731
    return [
        ("6d NFT closed form = argmin nft.nft_loss", nft_err, "< 1e-6", nft_err < 1e-6),
        ("6d first order vs exp tilt at eta=0.2 (max rel)", max(nonlin), "< 0.2", max(nonlin) < 0.2),
        ("6d noise: local cos t<=t_b, d=16, G=2/G=max", f2(noise), "G=max > G=2 + 0.3", noise[1] > noise[0] + 0.3),
        ("6d subspace: local G=2 cos t<=t_b, d=2/d=16", f2(sub), "d=2 > d=16 + 0.25", sub[0] > sub[1] + 0.25),
        ("6d local t<=t_b, d=16: cos G=inf/G=8", f2(conv), "> 0.9 / < 0.75", conv[0] > 0.9 and conv[1] < 0.75),
        (
            "6d broad->t<=.3, d=16, G=inf: cos/rel err",
            f2(broad_bias),
            "< 0.75 / > 1",
            broad_bias[0] < 0.75 and broad_bias[1] > 1,
        ),
        ("6d t>t_b, ratio<cap: weight x ratio = none", qw_gap, "< 1e-9", qw_gap < 1e-9),
        ("6d 0/1 tied: local G=2 (min) / broad G=8 (max)", f2(tie), "> 0.6 / < 0.1", tie[0] > 0.6 and tie[1] < 0.1),
        (
            "6d clean - noisy cos, G=8: local mean/broad min",
            f2(coords),
            "> 0.03 / > 0.3",
            coords[0] > 0.03 and coords[1] > 0.3,
        ),
        ("6d fix local<=t_b<broad - local cos (min, G=8)", hybrid, "> 0.1 (not d=2 smooth)", hybrid > 0.1),
        ("6d RVGE broad - NFT optimum cos, G=8 (min)", vs_nft, "> 0.15", vs_nft > 0.15),
        ("6d broad, no transfer: gain at t=0.1 (min)", overshoot, "> 3", overshoot > 3),
        (
            "6d broad step at t=0.9, G=inf: gain min/max",
            f2((min(steps), max(steps))),
            "0.9 .. 1.1",
            0.9 < min(steps) and max(steps) < 1.1,
        ),
    ]


# =============================================================================
# Check 7: end to end in 2-D (torch): flow-matching base, NFT credit modes, RVGE
# =============================================================================

MIX7 = GaussianMixture([0.25] * 4, [[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]], 0.3**2)
REWARDS7 = (sigmoid_reward(E1, 0.0, 0.3), vonmises_reward([0.0, 1.0], 8.0))  # coarse: right column; fine: x_2 detail
LAM7 = np.array([1.0, 1.0])


def velocity_mlp(width=128):
    """v(x, t): MLP on [x, t, cos(pi t), sin(pi t)] -> (N, 2)."""
    import torch

    class VelocityMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(5, width),
                torch.nn.SiLU(),
                torch.nn.Linear(width, width),
                torch.nn.SiLU(),
                torch.nn.Linear(width, width),
                torch.nn.SiLU(),
                torch.nn.Linear(width, 2),
            )

        def forward(self, x, t):
            t = t.reshape(-1, 1).expand(len(x), 1)
            return self.net(torch.cat([x, t, torch.cos(np.pi * t), torch.sin(np.pi * t)], 1))

    return VelocityMLP()


def train_base(gm, steps, seed=0):
    """Flow matching on exact samples: min E |v(x_t, t) - (eps - x0)|^2, t ~ U(0, 1)."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = velocity_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        x0 = torch.as_tensor(gm.sample(512, rng), dtype=torch.float32)
        eps, t = torch.randn_like(x0), torch.rand(512)
        loss = ((model((1 - t[:, None]) * x0 + t[:, None] * eps, t) - (eps - x0)) ** 2).mean()
        opt.zero_grad(), loss.backward(), opt.step(), sched.step()
    return model


def rollout(model, sig, n_groups, n_roots, n_branch, branch_steps, gen, a=0.7):
    """NOTES.md §5 trees: n_roots noises per group, ODE (nft.ode_step) to the first branch step, then at
    each branch step every state is copied n_branch times and continued with nft.sde_step. No branch
    steps: plain ODE samples. Returns x0 (N, 2) float32, groups (N,), ancestry (N, L+1)."""
    import torch

    x = torch.randn(n_groups * n_roots, 2, generator=gen)
    first = branch_steps[0] if branch_steps else len(sig)
    with torch.no_grad():
        for j in range(len(sig) - 1):
            s, sn = float(sig[j]), float(sig[j + 1])
            if j in branch_steps:
                x = x.repeat_interleave(n_branch, 0)
            v = model(x, torch.full((1,), s))
            x = (
                nft.ode_step(x, v, s, sn)
                if j < first
                else nft.sde_step(x, v, s, sn, a, float(sig[1]), torch.randn(x.shape, generator=gen))
            )
    L = len(branch_steps)
    idx = np.indices((n_groups, n_roots) + (n_branch,) * L).reshape(L + 2, -1).T
    return x, idx[:, 0], idx[:, 1:]


def rewards7(x):
    return np.stack([rew(np.asarray(x, dtype=np.float64)) for rew in REWARDS7], 1)  # (N, K)


def finetune(base, method, iters, n_groups=16, seed=0, beta=0.25, lr=1e-3, log_every=5):
    """DiffusionNFT recipe on the toy: old policy = EMA copy (eta_i = min(0.001 i, 0.5)), rollouts from old
    on shifted_sigmas(10, 3), training on the sampler's timesteps with fresh noise, + 1e-4 |v - v_ref|^2.
    method: 'nft' | 'uniform' | 'recast' (nft.nft_loss with r from combine_raw / uniform_W / solve_W of
    the pairs-estimated gains, EMA-smoothed) or 'rvge' (targets rvge.target_velocity from broad-group
    rvge.value_direction under KL beta on R = sum_k lambda_k R_k / Lam, NFT-style adaptive weighting).
    Returns (model, curve [(iteration, mean rewards (K,))], last W or None)."""
    import torch

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    sig = nft.shifted_sigmas(10, 3.0)
    T, branch = 10, [3, 6, 9]
    levels_t = np.array([1.0] + [sig[j] for j in branch] + [0.0])
    model, old, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    W, ema = recast.uniform_W(LAM7, T), None
    eval_gen_seed, curve = 1234, []
    for it in range(iters + 1):
        if it % log_every == 0 or it == iters:
            x_eval, _, _ = rollout(
                model, nft.shifted_sigmas(20, 3.0), 2000, 1, 1, [], torch.Generator().manual_seed(eval_gen_seed)
            )
            curve.append((it, rewards7(x_eval).mean(0)))
        if it == iters:
            break
        if method == "rvge":
            x0, groups, _ = rollout(old, sig, n_groups, 24, 1, [], gen)  # broad groups: 24 independent samples
            R = rewards7(x0) @ LAM7 / LAM7.sum()
            d = np.stack(
                [
                    rvge.value_direction(x0.numpy()[groups == g].astype(np.float64), R[groups == g], beta=beta)
                    for g in range(n_groups)
                ]
            )
            s2 = float(x0.var(0).mean())
            d_B = torch.as_tensor(d[groups], dtype=torch.float32)
        else:
            x0, groups, anc = rollout(old, sig, n_groups, 3, 2, branch, gen)
            R = rewards7(x0)
            if method == "nft":
                r = torch.as_tensor(nft.optimality(nft.combine_raw(R, LAM7), groups), dtype=torch.float32)
            else:
                rk = nft.optimality(R, groups)
                if method == "recast":
                    sums, counts = recast.pair_moments(rk, groups, anc)
                    ema = (sums, counts) if ema is None else (0.8 * ema[0] + 0.2 * sums, 0.8 * ema[1] + 0.2 * counts)
                    _, gains = recast.gains_on_grid(levels_t, recast.pairs_curve(*ema), sig)
                    W = recast.solve_W(LAM7, recast.profiles(gains))
                rk = torch.as_tensor(rk, dtype=torch.float32)
        n = len(x0)
        step = torch.arange(T).repeat(n)  # every leaf at every sampler timestep, fresh noise
        leaf = torch.arange(n).repeat_interleave(T)
        perm = torch.randperm(n * T, generator=gen)
        for chunk in perm.chunk(4):
            j, i = step[chunk], leaf[chunk]
            t = torch.as_tensor(sig[:-1], dtype=torch.float32)[j]
            x0b = x0[i]
            xt = (1 - t[:, None]) * x0b + t[:, None] * torch.randn(x0b.shape, generator=gen)
            with torch.no_grad():
                v_old, v_ref = old(xt, t), ref(xt, t)
            v = model(xt, t)
            if method == "rvge":
                v_tgt = rvge.target_velocity(v_old, d_B[i], t, torch.tensor(1.0), s2)
                err = t[:, None] * (v - v_tgt)  # x0-space error, NFT-style adaptive weight
                w_q = rvge.query_weight(t, torch.tensor(1.0), s2)
                loss = w_q * (err**2).mean(1) / err.detach().abs().mean(1).clamp_min(1e-5)
            else:
                r_j = (
                    r[i]
                    if method == "nft"
                    else recast.mix_optimality(rk[i], torch.as_tensor(W, dtype=torch.float32), j)
                )
                loss = nft.nft_loss(v, v_old, xt, x0b, t, r_j, b=1.0)
            loss = loss.mean() + 1e-4 * ((v - v_ref) ** 2).mean()
            opt.zero_grad(), loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        eta = min(0.001 * (it + 1), 0.5)
        with torch.no_grad():
            for p_old, p in zip(old.parameters(), model.parameters()):
                p_old.mul_(eta).add_((1 - eta) * p)
    return model, curve, (W if method == "recast" else None)


def weighted_mmd(x, y, wy, bandwidths=(0.2, 0.5)):
    """MMD^2 between samples x (uniform weights) and weighted samples (y, wy), Gaussian kernels averaged."""
    from scipy.spatial.distance import cdist

    wx, wy = np.full(len(x), 1.0 / len(x)), wy / wy.sum()
    dxx, dyy, dxy = cdist(x, x, "sqeuclidean"), cdist(y, y, "sqeuclidean"), cdist(x, y, "sqeuclidean")
    out = 0.0
    for h in bandwidths:
        k = lambda d: np.exp(-d / (2 * h * h))  # noqa: E731
        out += wx @ k(dxx) @ wx + wy @ k(dyy) @ wy - 2 * wx @ k(dxy) @ wy
    return out / len(bandwidths)


def tilt_matched_mmd(x, exact, R_exact, R_model_mean):
    """Distance to the KL-optimal tilt that reaches the model's reward: target p0 exp(R / beta) by importance
    weights on exact samples, 1 / beta chosen (bisection) so its mean R equals the model's mean R."""
    from scipy.optimize import brentq

    def mean_R(inv_beta):
        w = np.exp(inv_beta * (R_exact - R_exact.max()))
        return w @ R_exact / w.sum()

    inv = brentq(lambda b: mean_R(b) - R_model_mean, -200, 200) if mean_R(-200) < R_model_mean < mean_R(200) else np.nan
    w = np.exp(inv * (R_exact - R_exact.max())) if np.isfinite(inv) else np.full(len(R_exact), np.nan)
    return weighted_mmd(x, exact, w), inv


def check_end_to_end(quick, out=None):
    """Train a base v(x, t) by flow matching on MIX7; fine-tune copies with NFT credit nft / uniform / recast
    and with RVGE (two rewards: coarse = which column of modes, fine = exp(.7 (cos 8 x_2 - 1)); budgets 1, 1).
    Checks: each run improves the budget-weighted reward of ODE samples over the base and stays finite.
    Reported: per-reward gains, and the MMD to the tilt p0 exp(R / beta) matched to the same reward level."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = train_base(MIX7, 200 if quick else 1500)
        iters, n_groups = (5, 6) if quick else (40, 16)
        runs = {m: finetune(base, m, iters, n_groups, log_every=5) for m in ("nft", "uniform", "recast", "rvge")}
        x_base, _, _ = rollout(base, nft.shifted_sigmas(20, 3.0), 2000, 1, 1, [], torch.Generator().manual_seed(1234))
        finals = {
            m: rollout(mod, nft.shifted_sigmas(20, 3.0), 2000, 1, 1, [], torch.Generator().manual_seed(1234))[0].numpy()
            for m, (mod, _, _) in runs.items()
        }
    finally:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(7)
    exact = MIX7.sample(3000, rng)
    R_exact = rewards7(exact) @ LAM7 / LAM7.sum()
    base_R = rewards7(x_base.numpy())
    base_mmd = weighted_mmd(x_base.numpy(), exact, np.ones(len(exact)))
    rows = [("7 base model: MMD^2 to data (info)", base_mmd, "(info)", True)]
    print("\n7 end to end (budgets 1, 1; ODE samples, 20 steps):")
    print(f"  {'run':8} {'coarse':>7} {'fine':>7} {'weighted':>8}  {'MMD^2 to matched tilt':>21}  1/beta")
    print(f"  {'base':8} {base_R[:, 0].mean():7.3f} {base_R[:, 1].mean():7.3f} {base_R.mean(0) @ LAM7 / 2:8.3f}")
    for m, x in finals.items():
        Rm = rewards7(x)
        gain = (Rm.mean(0) - base_R.mean(0)) @ LAM7 / LAM7.sum()
        mmd, inv = tilt_matched_mmd(x, exact, R_exact, (Rm @ LAM7 / LAM7.sum()).mean())
        print(
            f"  {m:8} {Rm[:, 0].mean():7.3f} {Rm[:, 1].mean():7.3f} {Rm.mean(0) @ LAM7 / 2:8.3f}  "
            f"{mmd:21.4f}  {inv:6.2f}"
        )
        finite = bool(np.isfinite(x).all() and all(np.isfinite(c).all() for _, c in runs[m][1]))
        rows.append((f"7 {m}: weighted reward gain over base", gain, "> 0.01, finite", finite and gain > 0.01))
        rows.append(
            (
                f"7 {m}: coarse / fine gain; MMD^2 matched tilt",
                f"{Rm[:, 0].mean() - base_R[:, 0].mean():+.3f} / "
                f"{Rm[:, 1].mean() - base_R[:, 1].mean():+.3f}; {mmd:.4f}",
                "(info)",
                True,
            )
        )
    if runs["recast"][2] is not None:
        print(
            "  recast W (last iteration), coarse share per step: "
            + " ".join(f"{s:.2f}" for s in runs["recast"][2][0] / runs["recast"][2].sum(0))
        )
    if out:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        for m, (_, curve, _) in runs.items():
            its = [c[0] for c in curve]
            ax[0].plot(its, [c[1] @ LAM7 / LAM7.sum() for c in curve], "o-", ms=3, label=m)
        ax[0].set_xlabel("iteration"), ax[0].set_ylabel("budget-weighted reward"), ax[0].legend(fontsize=7)
        ax[1].scatter(*x_base.numpy().T, s=1, alpha=0.4, label="base")
        ax[1].set_title("base samples"), ax[1].set_aspect("equal")
        for m, c in (("recast", "C2"), ("rvge", "C3")):
            ax[2].scatter(*finals[m].T, s=1, alpha=0.4, color=c, label=m)
        ax[2].set_title("fine-tuned samples"), ax[2].legend(fontsize=7, markerscale=8), ax[2].set_aspect("equal")
        fig.tight_layout(), fig.savefig(os.path.join(out, "7_end_to_end.png"), dpi=110), plt.close(fig)
    return rows


# =============================================================================
# --train: a trainable toy (the exact velocity plus a fine-tuned correction), many seeds at once
# =============================================================================

TRAIN_MIX = MIX7  # 4 modes at (+-1, +-1), sd 0.3
TRAIN_REWARDS = (sigmoid_reward(E1, 0.0, 0.3), vonmises_reward([0.0, 1.0], 4.0))  # coarse: right column; fine: x_2
TRAIN_LAM = np.array([1.0, 1.0])
SINGLE_REWARDS = {"smooth": TRAIN_REWARDS[0], "discrete": step_reward(E1, 0.0)}
RECAST_ARMS = ("nft", "uniform", "exact", "reversed", "online", "grad_uniform", "grad_exact")
RVGE_ARMS = tuple(f"{m}:{r}{p}" for r in ("smooth", "discrete") for p in ("", "-perm") for m in ("nft", "rvge"))


@dataclass
class TrainConfig:
    """Sizes of `python toy_gaussian.py --train` (QUICK_TRAIN: --train --quick)."""

    seeds: int = 64  # paired seeds per arm
    iterations: int = 60  # rollout + one AdamW step each (DiffusionNFT: one optimizer step per epoch)
    groups: tuple = (2, 8)  # prompt groups per iteration: the batch sizes (8 leaves per group)
    eval_every: int = 5
    n_eval: int = 256  # evaluation samples per run (the same noise for every arm and evaluation of a seed)
    features: int = 192  # random Fourier features of x (times 3 polynomials of t)
    lr: float = 3e-3
    steps: int = 10  # sampler grid shifted_sigmas(steps, 3): the columns of W and the training timesteps
    sde_a: float = math.sqrt(2)  # recast.Args' default
    grad_clip: float = 1.0  # per run (DiffusionNFT's 1.0)
    base_reg: float = 1e-4  # DiffusionNFT's 1e-4 |v_theta - v_ref|^2
    eta: float = 0.2  # RVGE's first-order step (rvge.Args' default)
    seed0: int = 0


QUICK_TRAIN = TrainConfig(seeds=3, iterations=4, groups=(2, 3), eval_every=2, n_eval=64, features=48)


class FourierCorrection:
    """The trainable part: dv(x, t) = sum_m tau_m(t) psi(x) A_m, psi(x) = sqrt(2 / F) cos(Omega x + b) (F fixed random
    Fourier features, frequency scales 0.5 ... 8 so both the modes and the fine reward's period 2 pi / 4 are reachable),
    tau(t) = (1, t, t^2): the same parameters serve every timestep, as a network's do. A (S, M, F, d) holds one
    parameter set per run (leading axis S): each run's loss depends on its own A only, and Adam(W) acts elementwise, so
    the runs of one batch stay independent. A = 0 is the exact pretrained model."""

    def __init__(self, d, n_features, seed=0):
        import torch

        rng = np.random.default_rng(seed)
        scales = np.array([0.5, 1.0, 2.0, 4.0, 6.0, 8.0])[np.arange(n_features) % 6]
        self.omega = torch.as_tensor(rng.standard_normal((n_features, d)) * scales[:, None], dtype=torch.float32)
        self.b = torch.as_tensor(rng.uniform(0, 2 * np.pi, n_features), dtype=torch.float32)
        self.shape = (3, n_features, d)

    def psi(self, x):
        """x (S, n, d) -> (S, n, F)."""
        return math.sqrt(2 / len(self.b)) * torch_cos(x @ self.omega.T + self.b)

    def __call__(self, A, x, t, psi=None):
        """dv (S, n, d) at the scalar time t; A (S, 3, F, d)."""
        A_t = A[:, 0] + t * A[:, 1] + t * t * A[:, 2]  # (S, F, d)
        return (self.psi(x) if psi is None else psi) @ A_t


def torch_cos(z):
    return z.cos()


def exact_velocity(gm, x, t):
    """The pretrained model: gm's exact velocity (float64 numpy) at the scalar t for x (S, n, d) float32 tensors."""
    import torch

    v = gm.velocity(x.reshape(-1, x.shape[-1]).double().numpy(), t)
    return torch.as_tensor(v, dtype=torch.float32).reshape(x.shape)


def per_run_clip(grad, max_norm):
    """Gradient clipping run by run: grad (S, ...) scaled so that each run's norm is at most max_norm
    (torch.nn.utils.clip_grad_norm_ of each run's parameters alone). Returns the norms before clipping (S,)."""
    norms = grad.reshape(len(grad), -1).norm(dim=1)
    grad.mul_((max_norm / (norms + 1e-6)).clamp(max=1.0).reshape(-1, *[1] * (grad.dim() - 1)))
    return norms


def stack_columns(W):
    """Per-run credit matrices W (S, K, T) as one (K, S T) matrix for `recast.mix_optimality`, whose steps are then
    run * T + j. mix_optimality weighs by T / sum(W); every run's W sums to Lam, so (S T) / (S Lam) is each run's
    own T / Lam and the stacked call equals the per-run calls (test_toy_gaussian.py)."""
    S, K, T = W.shape
    return W.permute(1, 0, 2).reshape(K, S * T)


def reversed_W(budgets, P, **kw):
    """Time-reversed control: each reward's profile flipped in time, then solve_W. With equal column sums its
    marginals are those of solve_W(budgets, P) (rows lambda, columns Lam / T) and it is that W flipped."""
    return recast.solve_W(budgets, np.asarray(P)[:, ::-1], **kw)


def exact_profiles(gm, rewards, sigmas, n_grid=161, half=6.0, seed=7):
    """Each reward's exact profile on the grid: exact_renyi of its training-regime r (`training_regime`) at the grid
    points, recast.gains_on_grid, recast.profiles. Returns (D (K, T+1), gains (K, T), P (K, T))."""
    rng = np.random.default_rng(seed)
    D = np.stack(
        [exact_renyi(gm, training_regime(rew, gm, rng), sigmas, (2.0,), n_grid, half)[0][0] for rew in rewards]
    )
    _, gains = recast.gains_on_grid(sigmas, D, sigmas)
    return D, gains, recast.profiles(gains)


def seed_noise(seeds, it, purpose, shape):
    """Standard normal noise (len(seeds), *shape), float32, fixed by (seed, iteration, purpose): the same for every arm
    of a seed (paired runs)."""
    import torch

    return torch.as_tensor(
        np.stack([np.random.default_rng([s, it, purpose]).standard_normal(shape) for s in seeds]), dtype=torch.float32
    )


def tree_layout(P, R, C, T, it):
    """Leaves of P groups x R roots x C children in C order; group p branches at nft.branch_layout's rotated step
    (iteration offset it P); C = 1: independent samples (no branch). Returns groups (N,), ancestry (N, 2) (root id,
    child index; (N, 1) without branch), layouts, branch step per group (P,) (T: never)."""
    idx = np.indices((P, R, C)).reshape(3, -1).T
    if C == 1:
        return idx[:, 0], (idx[:, 0] * R + idx[:, 1])[:, None], [[] for _ in range(P)], np.full(P, T)
    layouts = nft.branch_layout(P, T, "rotate", it * P)
    return idx[:, 0], np.stack([idx[:, 0] * R + idx[:, 1], idx[:, 2]], 1), layouts, np.array([b[0] for b in layouts])


def sample_chain(gm, corr, A, sigmas, a, x, noise, branch=None, kl=False):
    """The toy's sampler, every run at once: nft.sde_step from s_0 = 1 on the model v = exact + corr(A), the last
    step nft.ode_step (clean leaves, as nft.tree_rollout). x (S, P, R, C, d) start noise (children equal);
    noise (T, S, P, R, C, d); branch (P,): a group's C children share their noise before its branch step.
    kl: also the exact path KL of the all-SDE chain (every step stochastic) between this model and the exact one,
    along these trajectories, KL = sum_j E |mu_theta - mu_exact|^2 / (2 c_j^2), mu = sde_step's mean,
    c_j = g_j sqrt(|dt_j|) its noise scale (derivations.ipynb §11). Returns x0 (S, N, d) and KL (S,) or None."""
    import torch

    S, d, T = x.shape[0], x.shape[-1], len(sigmas) - 1
    shape = x.shape
    total = torch.zeros(S)
    with torch.no_grad():
        for j in range(T):
            s, sn = float(sigmas[j]), float(sigmas[j + 1])
            flat = x.reshape(S, -1, d)
            v_ex = exact_velocity(gm, flat, s)
            dv = corr(A, flat, s)
            if kl:
                dmu = nft.sde_step(0.0, dv, s, sn, a, float(sigmas[1]), 0.0)
                c = nft.sde_step(0.0, 0.0, s, sn, a, float(sigmas[1]), 1.0)
                total += (dmu**2).sum(-1).mean(1) / (2 * c * c)
            v = (v_ex + dv).reshape(shape)
            if j == T - 1:
                x = nft.ode_step(x, v, s, sn)
                continue
            z = noise[j]
            if branch is not None:
                before = torch.as_tensor(j < branch).reshape(1, -1, 1, 1, 1)
                z = torch.where(before, z[:, :, :, :1].expand_as(z), z)
            x = nft.sde_step(x, v, s, sn, a, float(sigmas[1]), z)
    return x.reshape(S, -1, d), (total if kl else None)


def score_all(x):
    """Every reward of the experiments on x (S, N, d): coarse, fine, discrete. Returns (S, N, 3) float64."""
    flat = x.reshape(-1, x.shape[-1]).double().numpy()
    out = [TRAIN_REWARDS[0](flat), TRAIN_REWARDS[1](flat), SINGLE_REWARDS["discrete"](flat)]
    return np.stack(out, 1).reshape(*x.shape[:2], 3)


REWARD_COLUMN = {"coarse": 0, "fine": 1, "smooth": 0, "discrete": 2}


def permute_within_groups(R, groups, seed, it):
    """The control: each group's rewards shuffled among its leaves (a fixed permutation per seed and iteration).
    R (N,) -> (N,)."""
    return run_kit.shuffle_within_groups(R, groups, np.random.default_rng([seed, it, 7]))


@dataclass
class ArmPlan:
    """How each run of a batch is trained. family 'recast': credit per run (W (S, K, T) with equal columns, the
    step weights omega (S, T), which runs learn W online); 'rvge': loss ('nft' | 'rvge'), reward name, permuted."""

    family: str
    arms: tuple
    seeds: tuple
    W: np.ndarray = None
    omega: np.ndarray = None
    online: np.ndarray = None
    nft_raw: np.ndarray = None
    loss: tuple = ()
    reward: tuple = ()
    permuted: np.ndarray = None

    @property
    def runs(self):
        return [(arm, seed) for arm in self.arms for seed in self.seeds]


def recast_plan(arms, seeds, sigmas, P):
    """W per arm from the exact profiles P (K, T): uniform, exact (solve_W), reversed, gradient units (col_sums
    propto 1 / s_j) on uniform or exact profiles; nft: uniform W over copies of the raw-sum optimality; online
    starts uniform."""
    T, lam = len(sigmas) - 1, TRAIN_LAM
    cols = recast.gradient_unit_columns(sigmas, lam)
    Ws = {
        "nft": recast.uniform_W(lam, T),
        "uniform": recast.uniform_W(lam, T),
        "online": recast.uniform_W(lam, T),
        "exact": recast.solve_W(lam, P),
        "reversed": reversed_W(lam, P),
        "grad_uniform": recast.solve_W(lam, np.full_like(P, 1.0 / T), col_sums=cols),
        "grad_exact": recast.solve_W(lam, P, col_sums=cols),
    }
    W, omega = [], []
    for arm, _ in [(a, s) for a in arms for s in seeds]:
        om, Weq = recast.equal_columns(Ws[arm])
        W.append(Weq), omega.append(om)
    flags = np.array([a for a in arms for _ in seeds])
    plan = ArmPlan("recast", tuple(arms), tuple(seeds), np.stack(W), np.stack(omega), flags == "online", flags == "nft")
    return plan, Ws


def rvge_plan(arms, seeds):
    parts = [a.split(":") for a in arms for _ in seeds]
    return ArmPlan(
        "rvge",
        tuple(arms),
        tuple(seeds),
        loss=tuple(m for m, _ in parts),
        reward=tuple(r.removesuffix("-perm") for _, r in parts),
        permuted=np.array([r.endswith("-perm") for _, r in parts]),
    )


def train_batch(plan: ArmPlan, cfg: TrainConfig, P, corr, log=print):
    """Fine-tune every run of the plan (arms x seeds, one parameter set each) for cfg.iterations iterations of P
    groups. Per iteration: rollouts of the old policy (recast family: 2 roots x 4 children, rotated branch step;
    rvge family: 8 independent samples per group), rewards -> nft.optimality (ReCAST arms: per reward, mixed by
    recast.mix_optimality; nft: nft.combine_raw first) or nft.advantages -> rvge.group_directions (broad groups,
    t_b = 1) -> rvge.target_velocity; every leaf at every grid step with fresh noise; nft.nft_loss or
    rvge.rvge_loss (+ base_reg |dv|^2); one AdamW step with per-run clipping; old <- decay old + (1 - decay) new
    (nft.old_decay type 1). Online W: recast.level_observations accumulated at recast.Args' gain_ema ->
    level_curves -> credit_profiles -> solve_W, per run. Evaluations every cfg.eval_every iterations: rewards of
    n_eval samples and the path KL to the exact model (`sample_chain`). Returns (records, the online arm's final
    W, evidence weights and measured D_2 curves, summarised over seeds, or None)."""
    import torch

    gm, d, T = TRAIN_MIX, TRAIN_MIX.d, cfg.steps
    sig = nft.shifted_sigmas(T, 3.0)
    runs, seeds = plan.runs, list(plan.seeds)
    S, n_arms = len(runs), len(plan.arms)
    R_, C_ = (2, 4) if plan.family == "recast" else (8, 1)
    N = P * R_ * C_
    A = torch.zeros((S, *corr.shape), requires_grad=True)
    A_old = torch.zeros((S, *corr.shape))
    opt = torch.optim.AdamW([A], lr=cfg.lr, weight_decay=1e-4)
    defaults = recast.Args()
    stats, last = [None] * S, {}
    W = torch.as_tensor(plan.W, dtype=torch.float32) if plan.family == "recast" else None
    W_np = None if plan.family != "recast" else plan.W.copy()
    tile = lambda z: z.repeat(n_arms, *[1] * (z.dim() - 1))  # noqa: E731  (seeds,) -> (arms * seeds,): paired noise
    ev_x = tile(seed_noise(seeds, 0, 1, (cfg.n_eval, 1, 1, d)))  # (S, n, 1, 1, d)
    ev_z = tile(seed_noise(seeds, 0, 2, (cfg.n_eval, 1, 1, T, d))).permute(4, 0, 1, 2, 3, 5)
    records = []
    for it in range(cfg.iterations + 1):
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            x_ev, kl = sample_chain(gm, corr, A.detach(), sig, cfg.sde_a, ev_x, ev_z, kl=True)
            R_ev = score_all(x_ev).mean(1)  # (S, 3)
            for i, (arm, seed) in enumerate(runs):
                records.append(
                    dict(
                        family=plan.family,
                        groups=P,
                        arm=arm,
                        seed=seed,
                        iteration=it,
                        kl=float(kl[i]),
                        coarse=float(R_ev[i, 0]),
                        fine=float(R_ev[i, 1]),
                        discrete=float(R_ev[i, 2]),
                    )
                )
        if it == cfg.iterations:
            break
        groups, anc, layouts, branch = tree_layout(P, R_, C_, T, it)
        x1 = tile(seed_noise(seeds, it, 3, (P, R_, 1, d))).expand(S, P, R_, C_, d)
        z = tile(seed_noise(seeds, it, 4, (P, R_, C_, T, d))).permute(4, 0, 1, 2, 3, 5)
        x0, _ = sample_chain(gm, corr, A_old, sig, cfg.sde_a, x1, z, branch)  # (S, N, d)
        R_all = score_all(x0)
        if plan.family == "recast":
            r = np.zeros((S, N, 2))
            for i in range(S):
                R_i = R_all[i, :, :2]
                if plan.nft_raw[i]:
                    r[i] = nft.optimality(nft.combine_raw(R_i, TRAIN_LAM), groups)[:, None]
                    continue
                r[i] = nft.optimality(R_i, groups)
                if plan.online[i]:
                    new = recast.level_observations(r[i], groups, anc, layouts, T)
                    stats[i] = accumulate(stats[i], new, defaults.gain_ema)
                    D, se = recast.level_curves(*stats[i])
                    _, _, P_i, rho = recast.credit_profiles(D, se, sig, stats[i][0], defaults.evidence)
                    W_np[i] = recast.solve_W(TRAIN_LAM, P_i, defaults.tau, defaults.eps)
                    last[i] = (D, rho, stats[i][0])
            W = torch.as_tensor(W_np, dtype=torch.float32)
            W_big, r_t = stack_columns(W), torch.as_tensor(r, dtype=torch.float32).reshape(S * N, 2)
            omega = torch.as_tensor(plan.omega, dtype=torch.float32)
        else:
            cols = [REWARD_COLUMN[name] for name in plan.reward]
            R = np.stack([R_all[i, :, c] for i, c in enumerate(cols)])  # (S, N)
            for i in np.flatnonzero(plan.permuted):
                R[i] = permute_within_groups(R[i], groups, runs[i][1], it)
            is_rvge = np.array([m == "rvge" for m in plan.loss])
            r = np.stack([nft.optimality(R[i], groups) for i in range(S)])  # (S, N)
            A_adv = np.stack([nft.advantages(R[i], groups) for i in range(S)])
            ids = (np.arange(S)[:, None] * P + groups[None]).ravel()
            d_B = rvge.group_directions(
                x0.reshape(S * N, d), torch.as_tensor(A_adv.ravel(), dtype=torch.float32), ids, None, cfg.eta
            )
            s2 = np.array([np.divide(*rvge.group_variance(x0[i], groups)) for i in range(S)])
            r_t = torch.as_tensor(r.ravel(), dtype=torch.float32)
            s2_t = torch.as_tensor(np.repeat(s2, N), dtype=torch.float32)
            rv_t = torch.as_tensor(np.repeat(is_rvge, N))
        eps = tile(seed_noise(seeds, it, 5, (N, T, d)))  # fresh noise per (leaf, step)
        opt.zero_grad()
        run_of = torch.arange(S).repeat_interleave(N)
        for j in range(T):
            s = float(sig[j])
            x_t = (1 - s) * x0 + s * eps[:, :, j]
            v_ex = exact_velocity(gm, x_t, s)
            psi = corr.psi(x_t)
            dv = corr(A, x_t, s, psi)
            with torch.no_grad():
                dv_old = corr(A_old, x_t, s, psi)
            flat = lambda y: y.reshape(S * N, d)  # noqa: E731
            v, v_old, xt_f, x0_f = flat(v_ex + dv), flat(v_ex + dv_old), flat(x_t), flat(x0)
            t = torch.full((S * N,), s)
            if plan.family == "recast":
                r_j = recast.mix_optimality(r_t, W_big, run_of * T + j)
                loss = nft.nft_loss(v, v_old, xt_f, x0_f, t, r_j).reshape(S, N) * omega[:, j : j + 1]
            else:
                loss_nft = nft.nft_loss(v, v_old, xt_f, x0_f, t, r_t)
                v_tgt = rvge.target_velocity(v_old, d_B, t, 1.0, s2_t)
                loss_rvge = rvge.rvge_loss(v, v_tgt, v_old, xt_f, x0_f, t, rvge.query_weight(t, 1.0, s2_t))
                loss = torch.where(rv_t, loss_rvge, loss_nft).reshape(S, N)
            total = loss.mean(1) + cfg.base_reg * (dv**2).mean((1, 2))
            (total.sum() / T).backward()
        per_run_clip(A.grad, cfg.grad_clip)
        opt.step()
        decay = nft.old_decay(it + 1, 1)
        with torch.no_grad():
            A_old.mul_(decay).add_((1 - decay) * A.detach())
    online = None
    if plan.family == "recast" and last:
        D_on, rho_on, n_on = (np.stack([last[i][k] for i in sorted(last)]) for k in range(3))
        online = dict(
            W=W_np[plan.online].mean(0).tolist(),  # mean over seeds
            rho_mean=rho_on.mean(0).tolist(),  # evidence weight per reward (credit_profiles), mean / max over seeds
            rho_max=rho_on.max(0).tolist(),
            D=[
                [nan_mean(D_on[:, k, j]) for j in range(T + 1)] for k in range(D_on.shape[1])
            ],  # measured D_2, per level
            n=n_on.mean(0).tolist(),  # discounted observations per level
        )
    return records, online


# --- the analysis: equal-KL comparisons, paired by seed, Holm-corrected; thresholds with censoring -------------------


def nan_mean(values):
    """Mean of the finite values, NaN (without numpy's warning) when there are none."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else np.nan


def value_at_level(x, y, level):
    """y where the curve x first reaches `level` (linear between the evaluations around the crossing), NaN when it
    never does. x, y (E,) along training (x = KL or iteration)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    hit = np.flatnonzero(x >= level)
    if not len(hit):
        return np.nan
    i = hit[0]
    if i == 0:
        return float(y[0])
    w = (level - x[i - 1]) / (x[i] - x[i - 1])
    return float(y[i - 1] + w * (y[i] - y[i - 1]))


def paired_censored(time_a, event_a, time_b, event_b):
    """Gehan's pairwise scoring of paired, right-censored times: a seed counts as a win for a when a reached the
    threshold and b either reached it later or was still short of it at a later time; a loss symmetrically; otherwise
    (both censored, or censored before the other's event) a tie. Two-sided sign test on wins vs losses.
    Returns (wins, losses, ties, p)."""
    from scipy.stats import binomtest

    ta, ea, tb, eb = (np.asarray(v) for v in (time_a, event_a, time_b, event_b))
    win = ea & ((ta < tb) | (~eb & (ta <= tb)))
    loss = eb & ((tb < ta) | (~ea & (tb <= ta)))
    w, lo = int(win.sum()), int(loss.sum())
    p = binomtest(w, w + lo).pvalue if w + lo else 1.0
    return w, lo, len(ta) - w - lo, float(p)


def paired_stats(diff):
    """Mean, 95% t interval, two-sided paired t p, n and sd of paired differences (NaN pairs dropped): kit.stats'
    `mean_ci` and `p_value`, as a dict."""
    m, lo, hi, n = mean_ci(diff)
    return dict(mean=m, lo=lo, hi=hi, p=p_value(m, lo, hi, n), n=n, sd=interval_sd(lo, hi, n) if n > 1 else np.nan)


def run_curves(records, family, groups, arm, key):
    """{seed: (iterations (E,), kl (E,), value (E,))} of one arm; key a reward column or 'weighted'."""
    out = {}
    for rec in records:
        if rec["family"] == family and rec["groups"] == groups and rec["arm"] == arm:
            val = (rec["coarse"] + rec["fine"]) / 2 if key == "weighted" else rec[key]
            out.setdefault(rec["seed"], []).append((rec["iteration"], rec["kl"], val))
    return {s: tuple(np.array(c).T) for s, c in sorted(out.items())}


def gains(curves):
    """Each seed's curve minus its value at iteration 0 (the exact model; the same for every arm of a seed)."""
    return {s: (it, kl, y - y[0]) for s, (it, kl, y) in curves.items()}


RECAST_COMPARISONS = (
    ("exact", "uniform"),
    ("exact", "reversed"),
    ("online", "uniform"),
    ("uniform", "nft"),
    ("grad_uniform", "uniform"),
    ("grad_exact", "exact"),
)
EFFECT_OF_INTEREST = 0.02  # fixed before the full run: 2% of uniform W's weighted gain at the primary KL level
KL_FRACTIONS = (0.25, 0.5, 1.0)  # KL levels as fractions of the median final KL of uniform W (primary: 0.5)


def analyse_recast(records, groups_list):
    """Equal-KL paired comparisons of the ReCAST arms: per batch size the weighted-reward gain of each run read at
    KL levels KL_FRACTIONS x the median final KL of uniform W; paired differences by seed; Holm over every
    (batch size, comparison) at the primary level 0.5."""
    rows, per_arm = [], []
    for P in groups_list:
        cur = {a: gains(run_curves(records, "recast", P, a, "weighted")) for a in RECAST_ARMS}
        per_rew = {
            (a, k): gains(run_curves(records, "recast", P, a, k)) for a in RECAST_ARMS for k in ("coarse", "fine")
        }
        ref = float(np.median([kl[-1] for _, kl, _ in cur["uniform"].values()]))
        for frac in KL_FRACTIONS:
            level = frac * ref
            at = {a: {s: value_at_level(kl, y, level) for s, (_, kl, y) in c.items()} for a, c in cur.items()}
            for a in RECAST_ARMS:
                vals = np.array(list(at[a].values()))
                ck = {
                    k: nan_mean([value_at_level(kl, y, level) for _, kl, y in per_rew[(a, k)].values()])
                    for k in ("coarse", "fine")
                }
                per_arm.append(
                    dict(
                        groups=P,
                        kl_fraction=frac,
                        kl_level=level,
                        arm=a,
                        weighted_gain=float(nan_mean(vals)),
                        coarse_gain=float(ck["coarse"]),
                        fine_gain=float(ck["fine"]),
                        reached=int(np.isfinite(vals).sum()),
                        runs=len(vals),
                        final_kl=float(np.median([kl[-1] for _, kl, _ in cur[a].values()])),
                    )
                )
            for a, b in RECAST_COMPARISONS:
                seeds = sorted(set(at[a]) & set(at[b]))
                st = paired_stats([at[a][s] - at[b][s] for s in seeds])
                base = nan_mean(list(at["uniform"].values()))
                rows.append(dict(groups=P, kl_fraction=frac, kl_level=level, a=a, b=b, uniform_gain=float(base), **st))
    primary = [i for i, r in enumerate(rows) if r["kl_fraction"] == 0.5]
    adj = holm([rows[i]["p"] for i in primary])
    for i, p in zip(primary, adj):
        rows[i]["p_holm"] = float(p)
    return rows, per_arm


def analyse_rvge(records, groups_list, threshold_fraction=0.5):
    """RVGE vs NFT per batch size and reward: the KL (and the iteration) at which each run's gain first reaches
    threshold_fraction x the median final gain of NFT on that reward, censored runs counted (`paired_censored`);
    the gain at equal KL (0.5 x NFT's median final KL); the permuted controls' final gain and KL."""
    speed, controls = [], []
    for P in groups_list:
        for rew in ("smooth", "discrete"):
            key = "coarse" if rew == "smooth" else "discrete"
            cur = {m: gains(run_curves(records, "rvge", P, f"{m}:{rew}", key)) for m in ("nft", "rvge")}
            thr = threshold_fraction * float(np.median([y[-1] for _, _, y in cur["nft"].values()]))
            level = 0.5 * float(np.median([kl[-1] for _, kl, _ in cur["nft"].values()]))
            seeds = sorted(set(cur["nft"]) & set(cur["rvge"]))
            row = dict(groups=P, reward=rew, threshold=thr, kl_level=level, n=len(seeds))
            for axis, name in ((1, "kl"), (0, "iteration")):
                t = {m: [time_to_reach(cur[m][s][axis], cur[m][s][2], thr) for s in seeds] for m in cur}
                for m in cur:
                    times = np.array([x for x, _ in t[m]])
                    hit = np.array([e for _, e in t[m]])
                    row[f"{m}_reached"] = int(hit.sum())
                    row[f"{m}_median_{name}"] = float(np.median(times[hit])) if hit.any() else np.nan
                w, lo, ties, p = paired_censored(
                    *(np.array([x for x, _ in t["rvge"]]), np.array([e for _, e in t["rvge"]])),
                    *(np.array([x for x, _ in t["nft"]]), np.array([e for _, e in t["nft"]])),
                )
                row.update({f"{name}_wins": w, f"{name}_losses": lo, f"{name}_ties": ties, f"{name}_p": p})
            at = {m: {s: value_at_level(cur[m][s][1], cur[m][s][2], level) for s in seeds} for m in cur}
            st = paired_stats([at["rvge"][s] - at["nft"][s] for s in seeds])
            row.update({f"equal_kl_{k}": v for k, v in st.items()})
            row["nft_final_gain"] = float(np.mean([y[-1] for _, _, y in cur["nft"].values()]))
            row["rvge_final_gain"] = float(np.mean([y[-1] for _, _, y in cur["rvge"].values()]))
            speed.append(row)
            for m in ("nft", "rvge"):
                perm = gains(run_curves(records, "rvge", P, f"{m}:{rew}-perm", key))
                st = paired_stats([y[-1] for _, _, y in perm.values()])
                controls.append(
                    dict(
                        groups=P,
                        reward=rew,
                        method=m,
                        true_final_gain=row[f"{m}_final_gain"],
                        true_final_kl=float(np.median([kl[-1] for _, kl, _ in cur[m].values()])),
                        perm_final_kl=float(np.median([kl[-1] for _, kl, _ in perm.values()])),
                        **{f"perm_gain_{k}": v for k, v in st.items()},
                    )
                )
    adj = holm([r["kl_p"] for r in speed] + [r["equal_kl_p"] for r in speed])
    for r, p1, p2 in zip(speed, adj[: len(speed)], adj[len(speed) :]):
        r["kl_p_holm"], r["equal_kl_p_holm"] = float(p1), float(p2)
    return speed, controls


def fmt_ci(r, prefix="", digits=4):
    m, lo, hi = r[prefix + "mean"], r[prefix + "lo"], r[prefix + "hi"]
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def table_header(*columns):
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]


def write_tables(path, cfg, profiles_info, recast_rows, per_arm, speed, controls, power, elapsed):
    """results/toy-train/tables.md: the exact profiles and W, the equal-KL tables, RVGE's thresholds and controls,
    the seeds a resolution needs."""
    sig = profiles_info["sigmas"]
    L = [f"# toy --train: {cfg.seeds} paired seeds per arm, {cfg.iterations} iterations, groups {list(cfg.groups)}"]
    L.append(f"\nWritten by `python toy_gaussian.py --train` in {elapsed:.0f} s (one thread).")
    L.append("\n## Exact profiles (training-regime r, exact_renyi + recast.gains_on_grid on shifted_sigmas(10, 3))\n")
    L.append("| | " + " | ".join(f"{s:.3f}" for s in sig[:-1]) + " | D(0) |")
    L.append("|---" * (len(sig) + 1) + "|")
    for name, row, D0 in zip(("coarse", "fine"), profiles_info["P"], profiles_info["D0"]):
        L.append(f"| P {name} | " + " | ".join(f"{p:.3f}" for p in row) + f" | {D0:.4f} |")
    for arm in ("exact", "reversed", "grad_uniform", "grad_exact"):
        W = np.asarray(profiles_info["W"][arm])
        L.append(f"| W {arm}: coarse share | " + " | ".join(f"{c:.2f}" for c in W[0] / W.sum(0)) + " | |")
        L.append(
            f"| W {arm}: column sum x T / Lam | " + " | ".join(f"{c:.2f}" for c in W.sum(0) * W.shape[1] / 2) + " | |"
        )
    for P, on in (profiles_info.get("online") or {}).items():
        W = np.asarray(on["W"])
        L.append(
            f"| W online (mean of seeds, groups {P}): coarse share | "
            + " | ".join(f"{c:.2f}" for c in W[0] / W.sum(0))
            + " | |"
        )
    if profiles_info.get("online"):
        L.append(
            "\nOnline W's evidence: the exact D_2 of each reward at the grid levels s_1 ... s_T = 0 against the pairs"
        )
        L.append("estimate at the end of training (mean over seeds) and the evidence weight rho of `credit_profiles`")
        L.append("(0: the profile is shrunk to the rewards' common one, so W stays uniform).\n")
        L += table_header("curve", *[f"{s:.3f}" for s in sig[1:]], "rho mean / max")
        for k, name in enumerate(("coarse", "fine")):
            D_x = np.asarray(profiles_info["D"])[k]
            L.append(f"| exact D {name} | " + " | ".join(f"{d:.4f}" for d in D_x[1:]) + " | |")
            for P, on in profiles_info["online"].items():
                D_m = np.asarray(on["D"])[k]
                L.append(
                    f"| pairs D {name}, groups {P} | "
                    + " | ".join(f"{d:.4f}" for d in D_m[1:])
                    + f" | {on['rho_mean'][k]:.2f} / {on['rho_max'][k]:.2f} |"
                )
        for P, on in profiles_info["online"].items():
            L.append(f"| observations per level, groups {P} | " + " | ".join(f"{n:.0f}" for n in on["n"][1:]) + " | |")
    L.append("\n## ReCAST arms: gain of the weighted reward (coarse + fine) / 2 at equal KL\n")
    L.append(
        "Gain = the run's value minus its seed's value at iteration 0 (the exact model); each run is read where its"
    )
    L.append("own KL curve first reaches the level (KL level = fraction x the median final KL of uniform W).\n")
    L += table_header(
        "groups",
        "KL fraction",
        "KL level",
        "arm",
        "weighted gain",
        "coarse gain",
        "fine gain",
        "runs reaching",
        "median final KL",
    )
    for r in per_arm:
        L.append(
            f"| {r['groups']} | {r['kl_fraction']} | {r['kl_level']:.4f} | {r['arm']} | {r['weighted_gain']:+.4f} | "
            f"{r['coarse_gain']:+.4f} | {r['fine_gain']:+.4f} | {r['reached']}/{r['runs']} | {r['final_kl']:.4f} |"
        )
    L.append("\n### Paired differences at equal KL (a - b; mean [95% t interval], p; Holm over the 12 primary rows)\n")
    L.append("| groups | KL fraction | a - b | difference | relative to uniform's gain | n | p | p Holm |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in recast_rows:
        rel = r["mean"] / r["uniform_gain"] if r["uniform_gain"] else np.nan
        ph = f"{r['p_holm']:.3g}" if "p_holm" in r else "-"
        L.append(
            f"| {r['groups']} | {r['kl_fraction']} | {r['a']} - {r['b']} | {fmt_ci(r)} | {rel:+.1%} | {r['n']} | "
            f"{r['p']:.3g} | {ph} |"
        )
    L.append("\n## RVGE vs NFT, one reward each: thresholds at matched KL and iterations (censored runs counted)\n")
    L.append("Threshold = 0.5 x NFT's median final gain on that reward. Wins: seeds where RVGE reached it first")
    L.append(
        "(Gehan pairwise scoring: a censored run counts as slower than any run that reached it earlier); sign test;"
    )
    L.append("Holm over the 8 rows x {KL, equal-KL gain}.\n")
    L += table_header(
        "groups",
        "reward",
        "threshold",
        "reached rvge / nft",
        "median KL to thr. rvge / nft",
        "KL: wins / losses / ties, p Holm",
        "iterations: wins / losses / ties, p",
        "gain at equal KL rvge - nft, p Holm",
        "final gain rvge / nft",
    )
    for r in speed:
        L.append(
            f"| {r['groups']} | {r['reward']} | {r['threshold']:.4f} | "
            f"{r['rvge_reached']}/{r['nft_reached']} of {r['n']} | "
            f"{r['rvge_median_kl']:.4f} / {r['nft_median_kl']:.4f} | "
            f"{r['kl_wins']} / {r['kl_losses']} / {r['kl_ties']}, "
            f"{r['kl_p_holm']:.3g} | {r['iteration_wins']} / {r['iteration_losses']} / {r['iteration_ties']}, "
            f"{r['iteration_p']:.3g} | {fmt_ci(r, 'equal_kl_')}, {r['equal_kl_p_holm']:.3g} | "
            f"{r['rvge_final_gain']:+.4f} / {r['nft_final_gain']:+.4f} |"
        )
    L.append("\n### Control: the reward permuted within groups (final gain must stay within noise)\n")
    L += table_header(
        "groups",
        "reward",
        "method",
        "final gain, permuted [95% t interval]",
        "p (uncorrected)",
        "final gain, true reward",
        "median final KL permuted / true",
    )
    for r in controls:
        L.append(
            f"| {r['groups']} | {r['reward']} | {r['method']} | {fmt_ci(r, 'perm_gain_')} | {r['perm_gain_p']:.3g} | "
            f"{r['true_final_gain']:+.4f} | {r['perm_final_kl']:.4f} / {r['true_final_kl']:.4f} |"
        )
    L.append("\n## Seeds for 80% power (paired t at 0.05 / 12, Holm's first step) at this run's paired sd\n")
    L.append("Effect of interest: 2% of uniform W's weighted gain at the primary KL level (0.5).\n")
    L.append("| groups | a - b | paired sd | effect (2% of uniform's gain) | seeds needed | seeds run |")
    L.append("|---|---|---|---|---|---|")
    for r in power:
        L.append(
            f"| {r['groups']} | {r['a']} - {r['b']} | {r['sd']:.4f} | {r['delta']:.4f} | {r['needed']} | {r['n']} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def plot_reward_vs_kl(path, records, groups_list):
    """Reward against KL, the mean over seeds of each run's curve read at common KL levels up to the arm's median
    final KL (so at least half the runs are in every mean). Top: ReCAST arms' weighted gain per batch size, and each
    arm's paired difference to uniform W (dashed: the smaller batch). Bottom: RVGE vs NFT per reward (the permuted
    control dashed)."""
    import matplotlib.pyplot as plt

    def curve(cur, top, n=25):
        levels = np.linspace(0, top, n)
        return levels, [nan_mean([value_at_level(kl, y, lv) for _, kl, y in cur.values()]) for lv in levels]

    def median_final(cur):
        return float(np.median([kl[-1] for _, kl, _ in cur.values()]))

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    for col, P in enumerate(groups_list[:2]):
        cur = {m: gains(run_curves(records, "recast", P, m, "weighted")) for m in RECAST_ARMS}
        for k, m in enumerate(RECAST_ARMS):
            ax[0, col].plot(*curve(cur[m], median_final(cur[m])), color=f"C{k}", label=m, lw=2 if k in (1, 2, 3) else 1)
            if m == "uniform":
                continue
            top = min(median_final(cur[m]), median_final(cur["uniform"]))
            levels = np.linspace(0, top, 25)
            diff = [
                nan_mean(
                    [value_at_level(*cur[m][s][1:], lv) - value_at_level(*cur["uniform"][s][1:], lv) for s in cur[m]]
                )
                for lv in levels
            ]
            ax[0, 2].plot(levels, diff, "-" if col else "--", color=f"C{k}", label=f"{m}, {P} groups")
        ax[0, col].set_title(f"ReCAST arms, {P} groups x 8 leaves"), ax[0, col].set_xlabel("path KL to the exact model")
        ax[0, col].set_ylabel("weighted reward gain"), ax[0, col].legend(fontsize=7)
    ax[0, 2].axhline(0, color="k", lw=0.5), ax[0, 2].set_title("paired difference to uniform W at equal KL")
    ax[0, 2].set_xlabel("path KL to the exact model"), ax[0, 2].legend(fontsize=6, ncol=2)
    for col, rew in enumerate(("smooth", "discrete")):
        key = "coarse" if rew == "smooth" else "discrete"
        for k, P in enumerate(groups_list[:2]):
            for c, m in enumerate(("nft", "rvge")):
                for perm in ("", "-perm"):
                    cur = gains(run_curves(records, "rvge", P, f"{m}:{rew}{perm}", key))
                    ax[1, col].plot(
                        *curve(cur, median_final(cur)),
                        "--" if perm else "-",
                        color=f"C{2 * c + k}",
                        label=f"{m}{perm}, {P} groups",
                    )
        ax[1, col].set_title(f"RVGE vs NFT, {rew} reward"), ax[1, col].set_xlabel("path KL to the exact model")
        ax[1, col].set_ylabel(f"{key} gain"), ax[1, col].legend(fontsize=6)
    ax[1, 2].axis("off")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)


def power_rows(recast_rows, n_tests):
    """Seeds for 80% power at the primary level: EFFECT_OF_INTEREST x uniform W's gain, each comparison's paired sd."""
    out = []
    for r in recast_rows:
        if r["kl_fraction"] == 0.5:
            delta = EFFECT_OF_INTEREST * abs(r["uniform_gain"])
            out.append(
                dict(
                    groups=r["groups"],
                    a=r["a"],
                    b=r["b"],
                    sd=r["sd"],
                    delta=delta,
                    n=r["n"],
                    needed=seeds_for_power(delta, r["sd"], alpha=0.05 / n_tests) or np.inf,
                )
            )
    return out


def train_report(out, records, cfg, info, seconds):
    """The analysis of a --train run from its records: summary.json, tables.md and reward_vs_kl.png in `out`
    (`--train --tables-only` calls this on the committed runs.csv)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    recast_rows, per_arm = analyse_recast(records, cfg.groups)
    speed, controls = analyse_rvge(records, cfg.groups)
    power = power_rows(recast_rows, len(RECAST_COMPARISONS) * len(cfg.groups))
    summary = dict(
        config=asdict(cfg),
        profiles=info,
        recast=recast_rows,
        recast_arms=per_arm,
        rvge=speed,
        rvge_controls=controls,
        power=power,
        seconds=seconds,
    )
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_tables(os.path.join(out, "tables.md"), cfg, info, recast_rows, per_arm, speed, controls, power, seconds)
    plot_reward_vs_kl(os.path.join(out, "reward_vs_kl.png"), records, cfg.groups)
    print(open(os.path.join(out, "tables.md")).read())


def read_train_run(out):
    """runs.csv and summary.json of a --train run: (records, TrainConfig, profile info, seconds)."""
    import csv
    import json

    with open(os.path.join(out, "runs.csv")) as f:
        records = [
            {
                k: (v if k in ("family", "arm") else (int(v) if k in ("groups", "seed", "iteration") else float(v)))
                for k, v in row.items()
            }
            for row in csv.DictReader(f)
        ]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    cfg = TrainConfig(**{**summary["config"], "groups": tuple(summary["config"]["groups"])})
    online = {int(k): v for k, v in summary["profiles"]["online"].items()}
    return records, cfg, {**summary["profiles"], "online": online}, summary["seconds"]


def train_main(quick, out, cfg=None):
    """--train: the exact profiles, both experiment families at every batch size, the analysis; writes runs.csv,
    summary.json, tables.md and reward_vs_kl.png to `out`. Returns 0, or 1 if a reported quantity is not finite."""
    import csv

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.time()
    cfg = cfg or (QUICK_TRAIN if quick else TrainConfig())
    os.makedirs(out, exist_ok=True)
    sig = nft.shifted_sigmas(cfg.steps, 3.0)
    D, g, P = exact_profiles(TRAIN_MIX, TRAIN_REWARDS, sig, n_grid=81 if quick else 161)
    print("exact profiles (training-regime r) on shifted_sigmas(10, 3), step j starts at s_(j-1):")
    print("  s          " + " ".join(f"{s:5.3f}" for s in sig[:-1]))
    for name, row in zip(("coarse", "fine"), P):
        print(f"  {name:<10} " + " ".join(f"{p:5.3f}" for p in row))
    corr = FourierCorrection(TRAIN_MIX.d, cfg.features, seed=cfg.seed0)
    seeds = tuple(range(cfg.seed0, cfg.seed0 + cfg.seeds))
    records, online = [], {}
    try:
        for n_groups in cfg.groups:
            t0 = time.time()
            plan, Ws = recast_plan(RECAST_ARMS, seeds, sig, P)
            rec, online[n_groups] = train_batch(plan, cfg, n_groups, corr)
            records += rec
            t1 = time.time()
            rec, _ = train_batch(rvge_plan(RVGE_ARMS, seeds), cfg, n_groups, corr)
            records += rec
            print(f"[groups {n_groups}: recast arms {t1 - t0:.0f} s, rvge arms {time.time() - t1:.0f} s]")
    finally:
        torch.set_num_threads(threads)
    elapsed = time.time() - start
    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader(), writer.writerows(records)
    info = dict(
        sigmas=sig.tolist(),
        D=D.tolist(),
        D0=D[:, -1].tolist(),
        gains=g.tolist(),
        P=P.tolist(),
        W={k: np.asarray(v).tolist() for k, v in Ws.items()},
        online=online,
    )
    train_report(out, records, cfg, info, elapsed)
    finite = all(np.isfinite([r["kl"], r["coarse"], r["fine"], r["discrete"]]).all() for r in records)
    print(f"--train done in {elapsed:.0f} s; results in {out}/ ({'all finite' if finite else 'NON-FINITE values'})")
    return 0 if finite else 1


# =============================================================================
# Main
# =============================================================================

CHECKS = (
    "exact_mixture",
    "telescoping",
    "coarse_fine",
    "pairs",
    "sde",
    "credit",
    "rvge",
    "rvge_diagnosis",
    "end_to_end",
)


def main(argv=None):
    """Run the checks (all, or --only a,b), print the table, write figures to --out; exit code 1 on a FAIL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the PNG figures (toy_out; --train: results/toy-train)")
    parser.add_argument("--quick", action="store_true", help="smaller samples and fewer steps (for the tests)")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated subset of " + ", ".join(CHECKS))
    parser.add_argument(
        "--train",
        action="store_true",
        help="instead of the checks: fine-tune a correction of the exact model, every arm x seed (see TrainConfig)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="--train: paired seeds per arm (default TrainConfig's)")
    parser.add_argument(
        "--tables-only", action="store_true", help="--train: redo the analysis, tables and figure from --out's runs.csv"
    )
    parser.add_argument("--seed0", type=int, default=None, help="--train: first seed (the pilot used 1000)")
    args = parser.parse_args(argv)
    if args.train and args.tables_only:
        out = args.out or "results/toy-train"
        train_report(out, *read_train_run(out))
        return 0
    if args.train:
        cfg = QUICK_TRAIN if args.quick else TrainConfig()
        cfg = replace(cfg, seeds=args.seeds or cfg.seeds, seed0=cfg.seed0 if args.seed0 is None else args.seed0)
        return train_main(args.quick, args.out or "results/toy-train", cfg)
    args.out = args.out or "toy_out"
    unknown = [n for n in args.only.split(",") if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    rows, start = [], time.time()
    for name in args.only.split(","):
        t0 = time.time()
        rows += globals()[f"check_{name}"](args.quick, out=args.out)
        print(f"[{name}: {time.time() - t0:.1f} s]")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, (float, np.floating)) else str(v)  # noqa: E731
    print(f"\n{'check':<48} {'measured':>30}  {'threshold':<30} result")
    for check, measured, threshold, passed in rows:
        verdict = "info" if threshold == "(info)" else ("PASS" if passed else "FAIL")
        print(f"{check:<48} {fmt(measured):>30}  {threshold:<30} {verdict}")
    n_fail = sum(not bool(r[3]) for r in rows)
    print(f"\n{len(rows) - n_fail}/{len(rows)} passed in {time.time() - start:.1f} s; figures in {args.out}/")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
