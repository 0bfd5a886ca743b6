"""Gaussian-mixture toy: exact checks of the ReCAST / DiffusionRVGE math before the full run.

Every quantity of NOTES.md §1-§4 has a closed form (or a quadrature that is exact
to rounding) when the data is a Gaussian mixture, so this script checks the
shipped functions of nft.py, recast.py and rvge.py against them (it imports them and
never re-implements them). `python toy_gaussian.py` runs all checks, prints a
table (check, measured, threshold, PASS/FAIL), writes PNG figures to --out and
exits non-zero if a check fails; --quick runs the same checks on smaller samples.

The checks: 1 the exact mixture (marginals, posteriors, velocity, reward quadrature); 2 the telescoping identity of
ReCAST's Renyi gains (D_alpha(t) of the exact h_t is 0 at t = 1 and non-increasing, recast.gains_on_grid's step
gains are its exact differences, >= 0, and sum to D(pi+ || pi)); 3 solve_W gives each reward the steps where it
gains; 4 the pairs estimator of E[h_t^2] on exact trees; 5 the SDE sampler keeps the marginals; 6a-6c RVGE's
population regression geometry (value_direction = the tilted posterior-mean shift, Cov(x0 | x_t) w / beta for a
linear reward; the kappa(t) / kappa(t_b) transfer; local vs broad groups for smooth and 0/1 rewards); 8 ReCAST's
measured credit (the shipped tree rollout, levels and evidence shrinkage) against the exact D_2 and W.

Checks 6d (each method's implied target diagnosed, issue 16) and 7 (end-to-end training in 2-D) are experiments on
this toy, not checks of the math: `python -m experiments.toy_checks` (same numbering, same table; it imports this file,
never the reverse). The trainable toy (the exact mixture velocity as the pretrained model, a correction of it
fine-tuned with the scripts' own losses and credit) is one too: `python -m experiments.toy_train`.

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
import os
import sys
import time

import numpy as np
from scipy.special import expit, iv, logsumexp
from scipy.stats import kstest, norm

import nft
import recast
import rvge

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
    """Stand-in for the SD3 transformer inside sd3.velocity: the exact velocity of a mixture, so the
    shipped nft.tree_rollout runs on the toy. Counts the states it evaluates (rollout cost). gm None: zero velocity."""

    def __init__(self, gm):
        self.gm, self.evaluations = gm, 0

    def __call__(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict=False):
        import torch

        self.evaluations += len(hidden_states)
        if self.gm is None:  # pure-noise rewards (credit_iteration): only the tree's layout matters, not its states
            return (torch.zeros_like(hidden_states),)
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
    model = ExactVelocity(gm if noise_rng is None else None)  # pure noise: the same tree and draws, no velocity
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
# Main
# =============================================================================

CHECKS = ("exact_mixture", "telescoping", "coarse_fine", "pairs", "sde", "credit", "rvge")


def run_checks(argv, checks, doc):
    """Run `checks` ({name: check(quick, out) -> rows}, in order; all, or --only a,b), print the table, write figures to
    --out; exit code 1 on a FAIL. doc: the --help line's source. Also experiments/toy_checks.py's runner (6d, 7)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default="toy_out", help="folder for the PNG figures")
    parser.add_argument("--quick", action="store_true", help="smaller samples and fewer steps (for the tests)")
    parser.add_argument("--only", default=",".join(checks), help="comma-separated subset of " + ", ".join(checks))
    args = parser.parse_args(argv)
    unknown = [n for n in args.only.split(",") if n not in checks]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(checks)}")
    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    rows, start = [], time.time()
    for name in args.only.split(","):
        t0 = time.time()
        rows += checks[name](args.quick, out=args.out)
        print(f"[{name}: {time.time() - t0:.1f} s]")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, (float, np.floating)) else str(v)  # noqa: E731
    print(f"\n{'check':<48} {'measured':>30}  {'threshold':<30} result")
    for check, measured, threshold, passed in rows:
        verdict = "info" if threshold == "(info)" else ("PASS" if passed else "FAIL")
        print(f"{check:<48} {fmt(measured):>30}  {threshold:<30} {verdict}")
    n_fail = sum(not bool(r[3]) for r in rows)
    print(f"\n{len(rows) - n_fail}/{len(rows)} passed in {time.time() - start:.1f} s; figures in {args.out}/")
    return 1 if n_fail else 0


def main(argv=None):
    """Run this file's checks (all, or --only a,b), print the table, write figures to --out; exit code 1 on a FAIL."""
    return run_checks(argv, {name: globals()[f"check_{name}"] for name in CHECKS}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
