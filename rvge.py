"""DiffusionRVGE: regression-based value-gradient estimation, on top of DiffusionNFT.

One self-contained file: the math (centred reward/clean-image cross-covariance
directions, the Gaussian posterior-variance transfer, target velocities) and the
SD3 training loop. Derivations: derivations.ipynb; design: DESIGN.md.

Notation map (code name -> symbol)
    x0       (G, ...)   clean latents of one group B (posterior samples of x0 | x_{t_b})
    R        (G,)       rewards of the group (normalised per reward, DESIGN §2)
    d_B      (...)      direction at the branch time: E*[x0 | x_{t_b}] - E[x0 | x_{t_b}]
    beta               trajectory-KL weight (None: first order, step size eta = 1 / beta)
    s2                 per-dimension variance of the clean latents (population model)
    kappa(t)           Cov(x0 | x_t) / I = s2 t^2 / (t^2 + (1 - t)^2 s2)
    t_b                branch time of the group (1 for broad groups)
    v_target           v_old(x_t) - d(t) / t

Conventions: x_t = (1 - t) x0 + t eps, t = 1 is noise; dv = -dx0_hat / t.
"""
from __future__ import annotations

import numpy as np

# =============================================================================
# Math: value directions and their transfer across t (DESIGN §4)
# =============================================================================


def value_direction(x0, rewards, beta=None, eta=1.0):
    """Tilted posterior-mean shift d_B from one group of posterior samples (DESIGN §4.2).

    First order (beta None): d_B = eta (1/G) sum_i (R_i - R_bar)(x0_i - x0_bar),
    the centred cross-covariance Cov(x0, R | x_t), i.e. the first variation of
    E[x0 | x_t] under the tilt exp(eta R).
    With a trajectory-KL penalty beta > 0: d_B = sum_i softmax(R / beta)_i x0_i - x0_bar,
    the self-normalised estimate of E*[x0 | x_t] - E[x0 | x_t] under p* ∝ p exp(R / beta)
    (derivations.ipynb §9). A group whose rewards all tie gives exactly zero.
    x0 (G, ...) numpy array or tensor; rewards (G,). Returns (...) like x0[0].
    """
    if beta is not None and not beta > 0:
        raise ValueError(f"--kl-beta must be > 0 (got {beta}); leave it unset for the first-order direction")
    R = rewards - rewards.mean()
    centred = x0 - x0.mean(0)
    if beta is None:
        weights = eta * R / len(R)
    else:
        z = R / beta
        weights = np.exp(z - z.max()) if isinstance(z, np.ndarray) else (z - z.max()).exp()
        weights = weights / weights.sum()
    if (rewards == rewards[0]).all():  # ties: no contrast, no direction (and no rounding noise in the mean)
        return centred[0] * 0
    return (weights.reshape(-1, *[1] * (x0.ndim - 1)) * centred).sum(0)


def posterior_var(t, s2):
    """kappa(t) = Cov(x0 | x_t) per dimension for x0 ~ N(mu, s2 I), x_t = (1-t) x0 + t eps.

    kappa = s2 t^2 / (t^2 + (1 - t)^2 s2): 0 at t = 0, s2 at t = 1, increasing
    (derivations.ipynb §10). t: float, array or tensor."""
    return s2 * t * t / (t * t + (1 - t) * (1 - t) * s2)


def transfer_ratio(t, t_b, s2, cap=4.0):
    """kappa(t) / kappa(t_b), capped at `cap`: under the Gaussian population model the
    shift at query time t is d(t) = kappa(t) / kappa(t_b) d_B (exact for linear rewards)."""
    ratio = posterior_var(t, s2) / posterior_var(t_b, s2)
    return ratio.clip(max=cap) if hasattr(ratio, "clip") else min(ratio, cap)


def query_weight(t, t_b, s2):
    """Weight of a training query at t: 1 inside the group's neighbourhood (t <= t_b),
    kappa(t_b) / kappa(t) < 1 beyond it, where the transferred direction is an extrapolation."""
    w = posterior_var(t_b, s2) / posterior_var(t, s2)
    return w.clip(max=1.0) if hasattr(w, "clip") else min(w, 1.0)


def target_velocity(v_old, d_B, t, t_b, s2, cap=4.0):
    """v_target = v_old(x_t) - d(t) / t with d(t) = (kappa(t) / kappa(t_b)) d_B (DESIGN §4.3).
    v_old (N, ...); d_B (N, ...) (each query's group direction); t (N,) tensor or array."""
    shape = (-1, *[1] * (v_old.ndim - 1))
    return v_old - transfer_ratio(t, t_b, s2, cap).reshape(shape) * d_B / t.reshape(shape)
