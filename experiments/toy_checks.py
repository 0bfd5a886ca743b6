"""Checks 6d and 7 of the Gaussian-mixture toy: experiments on its exact mixtures, not checks of the math.

    python -m experiments.toy_checks                        # both; the table, figures and 6d's CSV in --out
    python -m experiments.toy_checks --only rvge_diagnosis  # check 6d alone (experiments/results/rvge-defaults/)
    python -m experiments.toy_checks --quick                # smaller samples and fewer steps (the tests)

6d (issue 16, item 3): the target each method implies at sampled (x_t, t), RVGE with each ablation and DiffusionNFT,
against the exact tilted shift, at equal reward evaluations (d = 2 and d = 16, smooth and 0/1 rewards): the diagnosis
behind rvge.py's defaults. 7: a base velocity trained by flow matching on MIX7, fine-tuned with NFT credit nft / uniform
/ recast and with RVGE: each run improves the budget-weighted reward and stays finite. They lived in toy_gaussian.py
(checks 1-6c and 8, the card's math checks, stay there); the mixture class, MIX2, the rewards and the check runner are
its (`toy_gaussian.run_checks`: the same table, flags and exit code); MIX7, defined here, is also the trainable toy's
pretrained model (`toy_train.py`).
"""

from __future__ import annotations

import copy
import os
import sys

import numpy as np

import nft
import recast
import rvge
from toy_gaussian import (
    E1,
    MIX2,
    GaussianMixture,
    cosine,
    run_checks,
    sample_bridge,
    sigmoid_reward,
    step_reward,
    vonmises_reward,
)

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
# Main
# =============================================================================

CHECKS = ("rvge_diagnosis", "end_to_end")


def main(argv=None):
    """Run checks 6d and 7 (both, or --only one) with toy_gaussian's runner; exit code 1 on a FAIL."""
    return run_checks(argv, {name: globals()[f"check_{name}"] for name in CHECKS}, __doc__)


if __name__ == "__main__":
    sys.exit(main())
