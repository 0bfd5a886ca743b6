"""The trainable Gaussian-mixture toy: the credit mechanism (ReCAST) and RVGE's step, trained, many seeds at once.

    python -m experiments.toy_train                   # 64 paired seeds per arm -> experiments/results/toy-train/
    python -m experiments.toy_train --tables-only     # the analysis, tables and figure again from runs.csv
    python -m experiments.toy_train --quick --out DIR # toy sizes (the tests)
    python -m experiments.toy_train --online          # online W vs grad_uniform -> .../toy-train/online/
    python -m experiments.toy_train --online --groups 128  # append a batch size to that run (others not rerun)

The exact velocity of a Gaussian mixture (MIX7, toy_checks.py's check 7) is the pretrained model; a correction of it is
fine-tuned with the scripts' own losses and credit (ReCAST arms: nft, uniform, exact-profile, time-reversed, online and
gradient-unit W; RVGE vs NFT with permuted controls), every arm x seed at once, and the arms are compared at equal KL
to the pretrained model. Design, analysis plan and reading: experiments/results/toy-train/README.md. The mixture
class, rewards and exact Renyi curves are toy_gaussian.py's (the math checks); this file only trains and analyses.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

if not __package__:  # run by path, as the committed tables say they were written: the root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nft  # noqa: E402
import recast  # noqa: E402
import recast_controls  # noqa: E402
import rvge  # noqa: E402
from experiments.stats import (  # noqa: E402  the experiments' statistics: the same tests as the embedded model's
    holm,
    interval_sd,
    mean_ci,
    p_value,
    rounded,
    seeds_for_power,
    time_to_reach,
)
from experiments.toy_checks import MIX7  # noqa: E402  check 7's mixture
from kit import session  # noqa: E402
from toy_gaussian import (  # noqa: E402
    E1,
    GaussianMixture,
    accumulate,
    exact_renyi,
    sigmoid_reward,
    step_reward,
    training_regime,
    vonmises_reward,
)

RESULTS = str(Path(__file__).resolve().parent / "results" / "toy-train")

# =============================================================================
# The trainable toy: the exact velocity plus a fine-tuned correction, many seeds at once
# =============================================================================

TRAIN_MIX = MIX7  # 4 modes at (+-1, +-1), sd 0.3
TRAIN_REWARDS = (sigmoid_reward(E1, 0.0, 0.3), vonmises_reward([0.0, 1.0], 4.0))  # coarse: right column; fine: x_2
TRAIN_LAM = np.array([1.0, 1.0])
SINGLE_REWARDS = {"smooth": TRAIN_REWARDS[0], "discrete": step_reward(E1, 0.0)}
RECAST_ARMS = ("nft", "uniform", "exact", "reversed", "online", "grad_uniform", "grad_exact")


@dataclass(frozen=True)
class World:
    """A pretrained toy and what is measured on it: gm's exact velocity is the pretrained model, `rewards` the K = 2
    trained rewards (budgets TRAIN_LAM), `extra` rewards only evaluated; `names` the record column of each, in order."""

    gm: object
    rewards: tuple
    names: tuple
    extra: tuple = ()

    def score(self, x):
        """Every reward on x (S, N, d): (S, N, len(names)) float64, the trained rewards first."""
        flat = x.reshape(-1, x.shape[-1]).double().numpy()
        return np.stack([f(flat) for f in self.rewards + self.extra], 1).reshape(*x.shape[:2], len(self.names))


RVGE_ARMS = tuple(f"{m}:{r}{p}" for r in ("smooth", "discrete") for p in ("", "-perm") for m in ("nft", "rvge"))


@dataclass
class TrainConfig:
    """Sizes of `python -m experiments.toy_train` (QUICK_TRAIN: --quick)."""

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


TRAIN_WORLD = World(TRAIN_MIX, TRAIN_REWARDS, ("coarse", "fine", "discrete"), (SINGLE_REWARDS["discrete"],))


def sample_tree(gm, corr, A, sigmas, a, x, noise, branch, substeps):
    """The shipped sampler (nft.tree_rollout), every run at once: a group runs nft.ode_step until its branch step, then
    `substeps` nft.sde_step sub-steps per grid interval on an even sub-grid (nft.sde_continue), the last step
    nft.ode_step. x (S, P, R, C, d) start noise (children equal, so they stay equal until the branch);
    noise (T, substeps, S, P, R, C, d); branch (P,) each group's branch step; A None: the exact model.
    Returns x0 (S, N, d)."""
    import torch

    S, d, T = x.shape[0], x.shape[-1], len(sigmas) - 1
    shape = x.shape

    def velocity(y, u):
        flat = y.reshape(S, -1, d)
        v = exact_velocity(gm, flat, u) + (0.0 if A is None else corr(A, flat, u))
        return v.reshape(shape)

    with torch.no_grad():
        for j in range(T):
            s, sn = float(sigmas[j]), float(sigmas[j + 1])
            v = velocity(x, s)
            x_ode = nft.ode_step(x, v, s, sn)
            if j == T - 1:
                x = x_ode
                continue
            grid = np.linspace(s, sn, substeps + 1)
            y = x
            for i, (u, u_next) in enumerate(zip(grid[:-1], grid[1:])):
                w = v if i == 0 else velocity(y, float(u))
                y = nft.sde_step(y, w, float(u), float(u_next), a, float(sigmas[1]), noise[j, i])
            sde = torch.as_tensor(j >= np.asarray(branch)).reshape(1, -1, 1, 1, 1)
            x = torch.where(sde, y, x_ode)
    return x.reshape(S, -1, d)


def score_all(x):
    """Every reward of the experiments on x (S, N, d): coarse, fine, discrete. Returns (S, N, 3) float64."""
    return TRAIN_WORLD.score(x)


REWARD_COLUMN = {"coarse": 0, "fine": 1, "smooth": 0, "discrete": 2}


def permute_within_groups(R, groups, seed, it):
    """The control: each group's rewards shuffled among its leaves (a fixed permutation per seed and iteration).
    R (N,) -> (N,)."""
    return session.shuffle_within_groups(R, groups, np.random.default_rng([seed, it, 7]))


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
    evidence: np.ndarray = None  # c of each online run (None: recast.Args' default)
    W_exact: np.ndarray = None  # W of the exact profiles, for each online run's distance to it
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
    cols = recast_controls.gradient_unit_columns(sigmas, lam)
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
        om, Weq = recast_controls.equal_columns(Ws[arm])
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


def train_batch(plan: ArmPlan, cfg: TrainConfig, P, corr, log=print, world=TRAIN_WORLD, substeps=0):
    """Fine-tune every run of the plan (arms x seeds, one parameter set each) for cfg.iterations iterations of P
    groups. Per iteration: rollouts of the old policy (recast family: 2 roots x 4 children, rotated branch step;
    rvge family: 8 independent samples per group), rewards -> nft.optimality (ReCAST arms: per reward, mixed by
    recast.mix_optimality; nft: nft.combine_raw first) or nft.advantages -> rvge.group_directions (broad groups,
    t_b = 1) -> rvge.target_velocity; every leaf at every grid step with fresh noise; nft.nft_loss or
    rvge.rvge_loss (+ base_reg |dv|^2); one AdamW step with per-run clipping; old <- decay old + (1 - decay) new
    (nft.old_decay type 1). Online W: recast.level_observations accumulated at recast.Args' gain_ema ->
    level_curves -> credit_profiles -> solve_W, per run. Evaluations every cfg.eval_every iterations: rewards of
    n_eval samples and the path KL to the exact model (`sample_chain`). world: the pretrained toy and its rewards;
    substeps > 0: rollouts with the shipped sampler (`sample_tree`) instead of the all-SDE chain. plan.evidence: each
    online run's c (default recast.Args'). Returns (records, the online arm's final W, evidence weights and measured
    D_2 curves, summarised over seeds, or None; with plan.W_exact also each online run's final W, rho, counts)."""
    import torch

    gm, d, T = world.gm, world.gm.d, cfg.steps
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
            R_ev = world.score(x_ev).mean(1)  # (S, columns)
            for i, (arm, seed) in enumerate(runs):
                records.append(
                    dict(
                        family=plan.family,
                        groups=P,
                        arm=arm,
                        seed=seed,
                        iteration=it,
                        kl=float(kl[i]),
                        **{name: float(R_ev[i, c]) for c, name in enumerate(world.names)},
                    )
                )
        if it == cfg.iterations:
            break
        groups, anc, layouts, branch = tree_layout(P, R_, C_, T, it)
        x1 = tile(seed_noise(seeds, it, 3, (P, R_, 1, d))).expand(S, P, R_, C_, d)
        z = tile(seed_noise(seeds, it, 4, (P, R_, C_, T, d))).permute(4, 0, 1, 2, 3, 5)
        if substeps:
            z = tile(seed_noise(seeds, it, 6, (P, R_, C_, T, substeps, d))).permute(4, 5, 0, 1, 2, 3, 6)
            x0 = sample_tree(gm, corr, A_old, sig, cfg.sde_a, x1, z, branch, substeps)
        else:
            x0, _ = sample_chain(gm, corr, A_old, sig, cfg.sde_a, x1, z, branch)  # (S, N, d)
        R_all = world.score(x0)
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
                    c = defaults.evidence if plan.evidence is None else plan.evidence[i]
                    _, _, P_i, rho = recast.credit_profiles(D, se, sig, stats[i][0], c)
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
        if plan.W_exact is not None:
            online["runs"] = [
                dict(
                    arm=runs[i][0],
                    seed=runs[i][1],
                    W_distance=float(np.linalg.norm(W_np[i] - plan.W_exact)),
                    rho=last[i][1].tolist(),
                    n=last[i][2].tolist(),
                )
                for i in sorted(last)
            ]
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
    """Mean, 95% t interval, two-sided paired t p, n and sd of paired differences (NaN pairs dropped): stats.py's
    `mean_ci` and `p_value`, as a dict."""
    m, lo, hi, n = mean_ci(diff)
    return dict(mean=m, lo=lo, hi=hi, p=p_value(m, lo, hi, n), n=n, sd=interval_sd(lo, hi, n) if n > 1 else np.nan)


def run_curves(records, family, groups, arm, key, pair=("coarse", "fine")):
    """{seed: (iterations (E,), kl (E,), value (E,))} of one arm; key a reward column or 'weighted' (the mean of
    the two trained rewards' columns, `pair`)."""
    out = {}
    for rec in records:
        if rec["family"] == family and rec["groups"] == groups and rec["arm"] == arm:
            val = (rec[pair[0]] + rec[pair[1]]) / 2 if key == "weighted" else rec[key]
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


def analyse_recast(
    records, groups_list, arms=RECAST_ARMS, comparisons=RECAST_COMPARISONS, pair=("coarse", "fine"), ref="uniform"
):
    """Equal-KL paired comparisons of the ReCAST arms: per batch size the weighted-reward gain of each run read at
    KL levels KL_FRACTIONS x the median final KL of the `ref` arm; paired differences by seed; Holm over every
    (batch size, comparison) at the primary level 0.5. Arms without runs at a batch size (and their comparisons) are
    skipped there. `uniform_gain` in the rows: the ref arm's mean gain at the level."""
    rows, per_arm = [], []
    for P in groups_list:
        cur = {a: gains(run_curves(records, "recast", P, a, "weighted", pair)) for a in arms}
        cur = {a: c for a, c in cur.items() if c}
        per_rew = {(a, k): gains(run_curves(records, "recast", P, a, k, pair)) for a in cur for k in pair}
        top = float(np.median([kl[-1] for _, kl, _ in cur[ref].values()]))
        for frac in KL_FRACTIONS:
            level = frac * top
            at = {a: {s: value_at_level(kl, y, level) for s, (_, kl, y) in c.items()} for a, c in cur.items()}
            for a in cur:
                vals = np.array(list(at[a].values()))
                ck = [nan_mean([value_at_level(kl, y, level) for _, kl, y in per_rew[(a, k)].values()]) for k in pair]
                per_arm.append(
                    dict(
                        groups=P,
                        kl_fraction=frac,
                        kl_level=level,
                        arm=a,
                        weighted_gain=float(nan_mean(vals)),
                        coarse_gain=float(ck[0]),
                        fine_gain=float(ck[1]),
                        reached=int(np.isfinite(vals).sum()),
                        runs=len(vals),
                        final_kl=float(np.median([kl[-1] for _, kl, _ in cur[a].values()])),
                    )
                )
            for a, b in comparisons:
                if a not in cur or b not in cur:
                    continue
                seeds = sorted(set(at[a]) & set(at[b]))
                st = paired_stats([at[a][s] - at[b][s] for s in seeds])
                base = nan_mean(list(at[ref].values()))
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


def profile_lines(sig, names, info, arms):
    """The table of exact profiles (P per reward with its D(0)) and, per arm, W's coarse share and column sums."""
    L = ["| | " + " | ".join(f"{s:.3f}" for s in sig[:-1]) + " | D(0) |", "|---" * (len(sig) + 1) + "|"]
    for name, row, D0 in zip(names, info["P"], info["D0"]):
        L.append(f"| P {name} | " + " | ".join(f"{p:.3f}" for p in row) + f" | {D0:.4f} |")
    for arm in arms:
        W = np.asarray(info["W"][arm])
        L.append(f"| W {arm}: coarse share | " + " | ".join(f"{c:.2f}" for c in W[0] / W.sum(0)) + " | |")
        L.append(
            f"| W {arm}: column sum x T / Lam | " + " | ".join(f"{c:.2f}" for c in W.sum(0) * W.shape[1] / 2) + " | |"
        )
    return L


def arm_gain_lines(per_arm, second):
    """The equal-KL gain table: a row per batch size, KL fraction and arm; `second` names the reward beside coarse."""
    L = table_header(
        "groups",
        "KL fraction",
        "KL level",
        "arm",
        "weighted gain",
        "coarse gain",
        f"{second} gain",
        "runs reaching",
        "median final KL",
    )
    for r in per_arm:
        L.append(
            f"| {r['groups']} | {r['kl_fraction']} | {r['kl_level']:.4f} | {r['arm']} | {r['weighted_gain']:+.4f} | "
            f"{r['coarse_gain']:+.4f} | {r['fine_gain']:+.4f} | {r['reached']}/{r['runs']} | {r['final_kl']:.4f} |"
        )
    return L


def paired_lines(rows, baseline):
    """The paired differences at equal KL, relative to `baseline`'s gain, with Holm's p on the primary rows."""
    L = table_header(
        "groups", "KL fraction", "a - b", "difference", f"relative to {baseline}'s gain", "n", "p", "p Holm"
    )
    for r in rows:
        rel = r["mean"] / r["uniform_gain"] if r["uniform_gain"] else np.nan
        ph = f"{r['p_holm']:.3g}" if "p_holm" in r else "-"
        L.append(
            f"| {r['groups']} | {r['kl_fraction']} | {r['a']} - {r['b']} | {fmt_ci(r)} | {rel:+.1%} | {r['n']} | "
            f"{r['p']:.3g} | {ph} |"
        )
    return L


def power_lines(power, effect):
    """The seeds each primary comparison needs for 80% power (power_rows), `effect` naming the effect's column."""
    L = table_header("groups", "a - b", "paired sd", effect, "seeds needed", "seeds run")
    for r in power:
        L.append(
            f"| {r['groups']} | {r['a']} - {r['b']} | {r['sd']:.4f} | {r['delta']:.4f} | {fmt_needed(r)} | {r['n']} |"
        )
    return L


def write_tables(path, cfg, profiles_info, recast_rows, per_arm, speed, controls, power, elapsed):
    """results/toy-train/tables.md: the exact profiles and W, the equal-KL tables, RVGE's thresholds and controls,
    the seeds a resolution needs."""
    sig = profiles_info["sigmas"]
    L = [f"# toy --train: {cfg.seeds} paired seeds per arm, {cfg.iterations} iterations, groups {list(cfg.groups)}"]
    L.append(f"\nWritten by `python experiments/toy_train.py` in {elapsed:.0f} s (one thread).")
    L.append("\n## Exact profiles (training-regime r, exact_renyi + recast.gains_on_grid on shifted_sigmas(10, 3))\n")
    L += profile_lines(sig, ("coarse", "fine"), profiles_info, ("exact", "reversed", "grad_uniform", "grad_exact"))
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
    L += arm_gain_lines(per_arm, "fine")
    L.append("\n### Paired differences at equal KL (a - b; mean [95% t interval], p; Holm over the 12 primary rows)\n")
    L += paired_lines(recast_rows, "uniform")
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
    L += power_lines(power, "effect (2% of uniform's gain)")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def fmt_needed(r) -> str:
    """The seeds a power row needs; none when the two arms give (nearly) the same result on every seed (paired sd
    under 1% of the effect): a power calculation would print its floor of 3 for arms that cannot differ."""
    if r["sd"] < 0.01 * r["delta"]:
        return f"— (paired sd {r['sd']:.1e}: the arms coincide)"
    return str(r["needed"])


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


def power_rows(recast_rows, n_tests, effect=EFFECT_OF_INTEREST):
    """Seeds for 80% power at the primary level (KL fraction 0.5): `effect` x the baseline's gain, each comparison's
    paired sd, at alpha 0.05 / n_tests (inf where no seed count suffices or the sd is not finite)."""
    out = []
    for r in recast_rows:
        if r["kl_fraction"] == 0.5:
            delta = effect * abs(r["uniform_gain"])
            needed = seeds_for_power(delta, r["sd"], alpha=0.05 / n_tests) if np.isfinite(r["sd"]) else None
            out.append(
                dict(groups=r["groups"], a=r["a"], b=r["b"], sd=r["sd"], delta=delta, n=r["n"], needed=needed or np.inf)
            )
    return out


def train_report(out, records, cfg, info, seconds):
    """The analysis of a run from its records: summary.json, tables.md and reward_vs_kl.png in `out`
    (`--tables-only` calls this on the committed runs.csv)."""
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
        exact = {k: summary[k] for k in ("config", "profiles")}  # read back to continue runs: kept as they are
        json.dump({**rounded(summary), **exact}, f, indent=1)  # the rest: the same bytes on another CPU
    write_tables(os.path.join(out, "tables.md"), cfg, info, recast_rows, per_arm, speed, controls, power, seconds)
    plot_reward_vs_kl(os.path.join(out, "reward_vs_kl.png"), records, cfg.groups)
    print(open(os.path.join(out, "tables.md")).read())


def write_records(out, records):
    """runs.csv: one row per evaluation of a run (read_records reads it back)."""
    import csv

    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader(), writer.writerows(records)


def profile_info(sig, D, g, P, Ws, **more):
    """summary.json's "profiles": the grid, the exact D curves, gains and profiles, each arm's W (as lists), `more`."""
    return dict(
        sigmas=sig.tolist(),
        D=D.tolist(),
        D0=D[:, -1].tolist(),
        gains=g.tolist(),
        P=P.tolist(),
        W={k: np.asarray(v).tolist() for k, v in Ws.items()},
        **more,
    )


def read_records(out):
    """The evaluations of runs.csv, typed: family and arm as text, groups, seed and iteration as int, the rest float."""
    import csv

    with open(os.path.join(out, "runs.csv")) as f:
        return [
            {
                k: (v if k in ("family", "arm") else (int(v) if k in ("groups", "seed", "iteration") else float(v)))
                for k, v in row.items()
            }
            for row in csv.DictReader(f)
        ]


def read_train_run(out):
    """runs.csv and summary.json of a run: (records, TrainConfig, profile info, seconds)."""
    import json

    records = read_records(out)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    cfg = TrainConfig(**{**summary["config"], "groups": tuple(summary["config"]["groups"])})
    online = {int(k): v for k, v in summary["profiles"]["online"].items()}
    return records, cfg, {**summary["profiles"], "online": online}, summary["seconds"]


def train_main(quick, out, cfg=None):
    """The exact profiles, both experiment families at every batch size, the analysis; writes runs.csv,
    summary.json, tables.md and reward_vs_kl.png to `out`. Returns 0, or 1 if a reported quantity is not finite."""
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
    write_records(out, records)
    train_report(out, records, cfg, profile_info(sig, D, g, P, Ws, online=online), elapsed)
    finite = all(np.isfinite([r["kl"], r["coarse"], r["fine"], r["discrete"]]).all() for r in records)
    print(f"toy_train done in {elapsed:.0f} s; results in {out}/ ({'all finite' if finite else 'NON-FINITE values'})")
    return 0 if finite else 1


# =============================================================================
# --online: ReCAST's online W against a fixed late-step reweighting (README "Online W, decided"), pre-registered
# =============================================================================

# modes at (+-2, +-0.6), sd 0.2: which column (x_1) is decided early (t ~ 0.9-0.55), which row (x_2) mid-trajectory
# (t ~ 0.56-0.25), so the mid reward's credit and the gradient-unit reweighting (largest at the last step) part ways
ONLINE_MIX = GaussianMixture([0.25] * 4, [[-2.0, -0.6], [-2.0, 0.6], [2.0, -0.6], [2.0, 0.6]], 0.2**2)
ONLINE_WORLD = World(
    ONLINE_MIX, (sigmoid_reward(E1, 0.0, 0.3), sigmoid_reward(np.array([0.0, 1.0]), 0.0, 0.2)), ("coarse", "mid")
)
ONLINE_EFFECT = 0.02  # fixed before the run: 2% of grad_uniform's weighted gain at the primary KL level


@dataclass
class OnlineConfig(TrainConfig):
    """Sizes of `python -m experiments.toy_train --online` (QUICK_ONLINE: --online --quick)."""

    iterations: int = 40
    groups: tuple = (8, 32, 128)  # prompt groups per iteration: the estimator's sample size (groups / 8 per level)
    substeps: int = 2  # the shipped sampler: ODE to the branch step, then 2 SDE sub-steps per interval
    prior_groups: tuple = (192, 1000)  # groups per level of the estimated-prior arms (measured once on the base)
    # the arms above the smallest batch size (the prior arms' W does not depend on the batch): see arms_at
    largest_arms: tuple = ("uniform", "grad_uniform", "exact", "online", "online_noshrink")


QUICK_ONLINE = OnlineConfig(
    seeds=3, iterations=4, groups=(2, 3), eval_every=2, n_eval=64, features=48, prior_groups=(4, 8)
)


def online_arms(cfg):
    return ("uniform", "grad_uniform", "exact", "online", "online_noshrink") + tuple(
        f"prior{n}" for n in cfg.prior_groups
    )


def arms_at(cfg, n_groups):
    """The arms run at a batch size: every arm at the smallest, cfg.largest_arms at each larger one."""
    return online_arms(cfg) if n_groups == min(cfg.groups) else cfg.largest_arms


def online_comparisons(cfg):
    """The family (Holm over all of them at every batch size, primary KL level): each estimated W and the exact one
    against the bar grad_uniform; the controls exact - uniform (credit helps here at all), grad_uniform - uniform (the
    bar is above uniform), online - uniform (online W moves at all)."""
    est = ("online", "online_noshrink") + tuple(f"prior{n}" for n in cfg.prior_groups)
    return tuple((a, "grad_uniform") for a in est + ("exact",)) + (
        ("exact", "uniform"),
        ("grad_uniform", "uniform"),
        ("online", "uniform"),
    )


def measured_prior(world, sig, n_per_level, seed, cfg):
    """The toy twin of recast_prior: D_2 measured once on the pretrained model (A = 0) with the shipped sampler and the
    pairs estimator, n_per_level groups of 2 x 4 leaves at each branch level 1..T-2 (`tree_layout`, rotated), then
    recast.level_curves -> credit_profiles (evidence c of recast.Args) -> solve_W, held fixed during training.
    Returns (W (K, T), rho (K,), n (T+1,))."""
    import torch

    T, d = cfg.steps, world.gm.d
    n_groups = n_per_level * (T - 2)
    rng = np.random.default_rng([seed, 99, n_per_level])
    groups, anc, layouts, branch = tree_layout(n_groups, 2, 4, T, 0)
    x1 = torch.as_tensor(rng.standard_normal((1, n_groups, 2, 1, d)), dtype=torch.float32).expand(1, n_groups, 2, 4, d)
    z = torch.as_tensor(rng.standard_normal((T, cfg.substeps, 1, n_groups, 2, 4, d)), dtype=torch.float32)
    x0 = sample_tree(world.gm, None, None, sig, cfg.sde_a, x1, z, branch, cfg.substeps)
    r = nft.optimality(world.score(x0)[0, :, :2], groups)
    stats = recast.level_observations(r, groups, anc, layouts, T)
    D, se = recast.level_curves(*stats)
    defaults = recast.Args()
    _, _, P, rho = recast.credit_profiles(D, se, sig, stats[0], defaults.evidence)
    return recast.solve_W(TRAIN_LAM, P, defaults.tau, defaults.eps), rho, stats[0]


def online_plan(arms, seeds, sig, P_exact, priors):
    """W per run: uniform, grad_uniform (solve_W of uniform profiles with gradient-unit columns), exact (solve_W of the
    exact profiles), online and online_noshrink (start uniform, learnt; evidence c = recast.Args' or 0), prior<n>
    (each seed's measured_prior W). Returns (ArmPlan, W_exact)."""
    T, lam = len(sig) - 1, TRAIN_LAM
    W_exact = recast.solve_W(lam, P_exact)
    fixed = {
        "uniform": recast.uniform_W(lam, T),
        "online": recast.uniform_W(lam, T),
        "online_noshrink": recast.uniform_W(lam, T),
        "exact": W_exact,
        "grad_uniform": recast.solve_W(
            lam, np.full_like(P_exact, 1.0 / T), col_sums=recast_controls.gradient_unit_columns(sig, lam)
        ),
    }
    W, omega = [], []
    for arm, seed in [(a, s) for a in arms for s in seeds]:
        om, Weq = recast_controls.equal_columns(fixed[arm] if arm in fixed else priors[int(arm[5:])][seed][0])
        W.append(Weq), omega.append(om)
    flags = np.array([a for a in arms for _ in seeds])
    online = np.isin(flags, ("online", "online_noshrink"))
    evidence = np.where(flags == "online_noshrink", 0.0, recast.Args().evidence)
    plan = ArmPlan(
        "recast",
        tuple(arms),
        tuple(seeds),
        np.stack(W),
        np.stack(omega),
        online,
        np.zeros(len(flags), bool),
        evidence,
        W_exact,
    )
    return plan, fixed


def estimator_rows(credit, W_uniform_distance):
    """Per (arm, groups): observations per branch level (mean over the measured levels 1..T-2), evidence weight rho
    per reward (mean, max over seeds), ||W - W_exact||_F (mean, 95% t interval over seeds)."""
    rows = []
    for key in dict.fromkeys((c["arm"], c["groups"]) for c in credit):
        cs = [c for c in credit if (c["arm"], c["groups"]) == key]
        rho = np.array([c["rho"] for c in cs])
        n = np.array([c["n"] for c in cs])
        m, lo, hi, k = mean_ci([c["W_distance"] for c in cs])
        rows.append(
            dict(
                arm=key[0],
                groups=key[1],
                n_level=float(n[:, 1:-2].mean()),
                rho_mean=rho.mean(0).tolist(),
                rho_max=rho.max(0).tolist(),
                dist_mean=m,
                dist_lo=lo,
                dist_hi=hi,
                runs=k,
                uniform_distance=W_uniform_distance,
            )
        )
    return rows


def write_online_tables(path, cfg, info, rows, per_arm, est, power, elapsed):
    sig = info["sigmas"]
    L = [f"# toy --online: {cfg.seeds} paired seeds per arm, {cfg.iterations} iterations, groups {list(cfg.groups)}"]
    L.append(f"\nWritten by `python experiments/toy_train.py --online` in {elapsed:.0f} s (one thread).")
    L.append("\n## Exact profiles of the online world (training-regime r, exact_renyi + gains_on_grid)\n")
    L += profile_lines(sig, ("coarse", "mid"), info, ("exact", "grad_uniform"))
    L.append("\n## The estimator: observations per level, evidence weight, distance of W to the exact W\n")
    L.append("Online arms: at the end of training (counts discounted at gain_ema 0.999); prior arms: the one")
    L.append(
        f"measurement on the pretrained model. ||W_uniform - W_exact||_F = {est[0]['uniform_distance']:.4f}.\n"
        if est
        else "measurement on the pretrained model.\n"
    )
    L += table_header(
        "arm",
        "groups / iteration",
        "observations per level",
        "rho coarse mean / max",
        "rho mid mean / max",
        "||W - W_exact|| [95% t interval]",
        "runs",
    )
    for r in est:
        L.append(
            f"| {r['arm']} | {r['groups']} | {r['n_level']:.0f} | {r['rho_mean'][0]:.2f} / {r['rho_max'][0]:.2f} | "
            f"{r['rho_mean'][1]:.2f} / {r['rho_max'][1]:.2f} | {fmt_ci(r, 'dist_')} | {r['runs']} |"
        )
    L.append(
        "\n## Weighted gain (coarse + mid) / 2 at equal KL (KL level = fraction x grad_uniform's median final KL)\n"
    )
    L += arm_gain_lines(per_arm, "mid")
    n_primary = sum("p_holm" in r for r in rows)
    L.append(
        f"\n### Paired differences at equal KL (a - b; mean [95% t interval]; Holm over the {n_primary} primary rows)\n"
    )
    L += paired_lines(rows, "grad_uniform")
    L.append(f"\n## Seeds for 80% power (paired t at 0.05 / {n_primary}, Holm's first step) at this run's paired sd\n")
    L.append(
        f"Effect that matters: {ONLINE_EFFECT:.0%} of grad_uniform's weighted gain at the primary KL level (0.5).\n"
    )
    L += power_lines(power, "effect")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def online_report(out, records, credit, cfg, info, seconds):
    """summary.json and tables.md of an --online run from runs.csv's records and credit.json's per-run estimator."""
    import json

    groups = sorted({r["groups"] for r in records})
    comps = online_comparisons(cfg)
    rows, per_arm = analyse_recast(records, groups, online_arms(cfg), comps, ("coarse", "mid"), "grad_uniform")
    n_primary = sum("p_holm" in r for r in rows)
    power = power_rows(rows, n_primary, ONLINE_EFFECT)
    W_ex, W_un = np.asarray(info["W"]["exact"]), np.asarray(info["W"]["uniform"])
    est = estimator_rows(credit, float(np.linalg.norm(W_un - W_ex)))
    summary = dict(
        config=asdict(cfg), profiles=info, recast=rows, recast_arms=per_arm, estimator=est, power=power, seconds=seconds
    )
    with open(os.path.join(out, "summary.json"), "w") as f:
        exact = {k: summary[k] for k in ("config", "profiles")}  # read back to continue runs: kept as they are
        json.dump({**rounded(summary), **exact}, f, indent=1)  # the rest: the same bytes on another CPU
    write_online_tables(os.path.join(out, "tables.md"), cfg, info, rows, per_arm, est, power, seconds)
    print(open(os.path.join(out, "tables.md")).read())


def write_online_files(out, records, credit):
    import json

    write_records(out, records)
    with open(os.path.join(out, "credit.json"), "w") as f:
        json.dump(credit, f)


def read_online_run(out):
    """runs.csv, credit.json and summary.json of an --online run: (records, credit, OnlineConfig, info, seconds)."""
    import json

    records = read_records(out)
    with open(os.path.join(out, "credit.json")) as f:
        credit = json.load(f)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    c = summary["config"]
    cfg = OnlineConfig(**{**c, **{k: tuple(c[k]) for k in ("groups", "prior_groups", "largest_arms")}})
    return records, credit, cfg, summary["profiles"], summary["seconds"]


def online_main(quick, out, cfg=None, add=None):
    """--online: the exact profiles of ONLINE_WORLD, the prior arms' measurements, every batch size's arms (arms_at)
    with the shipped sampler, the analysis. Writes runs.csv and credit.json after each batch size (partial results
    survive), summary.json and tables.md with each. add: one batch size appended to the run already in `out` (its
    config, seeds and profiles from summary.json; the sizes there are not rerun; seconds add up)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.time()
    os.makedirs(out, exist_ok=True)
    if add:
        records, credit, cfg, info, seconds = read_online_run(out)
        if add in cfg.groups or add < min(cfg.groups):
            raise SystemExit(f"--groups {add}: {out} has groups {list(cfg.groups)}; add a new size above the smallest")
        cfg, todo = replace(cfg, groups=tuple(sorted(cfg.groups + (add,)))), (add,)
        D, g, P = (np.asarray(info[k]) for k in ("D", "gains", "P"))
    else:
        cfg = cfg or (QUICK_ONLINE if quick else OnlineConfig())
        records, credit, seconds, todo = [], [], 0.0, cfg.groups
    sig = nft.shifted_sigmas(cfg.steps, 3.0)
    if not add:
        D, g, P = exact_profiles(ONLINE_MIX, ONLINE_WORLD.rewards, sig, n_grid=81 if quick else 161)
    corr = FourierCorrection(ONLINE_MIX.d, cfg.features, seed=cfg.seed0)
    seeds = tuple(range(cfg.seed0, cfg.seed0 + cfg.seeds))
    needed = {a for n_groups in todo for a in arms_at(cfg, n_groups)}
    try:
        priors = {
            n: {s: measured_prior(ONLINE_WORLD, sig, n, s, cfg) for s in seeds}
            for n in cfg.prior_groups
            if f"prior{n}" in needed
        }
        print(f"[prior measurements: {time.time() - start:.0f} s]", flush=True)
        for n, per_seed in priors.items():
            W_ex = recast.solve_W(TRAIN_LAM, P)
            credit += [
                dict(
                    arm=f"prior{n}",
                    groups=0,
                    seed=s,
                    W_distance=float(np.linalg.norm(W - W_ex)),
                    rho=rho.tolist(),
                    n=cnt.tolist(),
                )
                for s, (W, rho, cnt) in per_seed.items()
            ]
        for n_groups in todo:
            t0 = time.time()
            plan, Ws = online_plan(arms_at(cfg, n_groups), seeds, sig, P, priors)
            rec, on = train_batch(plan, cfg, n_groups, corr, world=ONLINE_WORLD, substeps=cfg.substeps)
            records += rec
            credit += [dict(r, groups=n_groups) for r in on["runs"]]
            info = profile_info(sig, D, g, P, Ws)
            write_online_files(out, records, credit)
            online_report(out, records, credit, cfg, info, seconds + time.time() - start)
            print(f"[groups {n_groups}: {time.time() - t0:.0f} s]", flush=True)
    finally:
        torch.set_num_threads(threads)
    finite = all(np.isfinite([r["kl"], r["coarse"], r["mid"]]).all() for r in records)
    print(
        f"--online done in {time.time() - start:.0f} s; results in {out}/ ({'all finite' if finite else 'NON-FINITE'})"
    )
    return 0 if finite else 1


# =============================================================================
# Main
# =============================================================================


def main(argv=None):
    """Train every arm x seed and write the results to --out, or (--tables-only) redo the analysis from --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS, help="results folder (default experiments/results/toy-train)")
    parser.add_argument("--quick", action="store_true", help="toy sizes (QUICK_TRAIN, for the tests)")
    parser.add_argument("--seeds", type=int, default=None, help="paired seeds per arm (default TrainConfig's)")
    parser.add_argument(
        "--tables-only", action="store_true", help="redo the analysis, tables and figure from --out's runs.csv"
    )
    parser.add_argument("--seed0", type=int, default=None, help="first seed (the pilot used 1000)")
    parser.add_argument(
        "--online",
        action="store_true",
        help="the online-W experiment (OnlineConfig; default --out .../toy-train/online)",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=None,
        help="with --online: append this batch size to the run in --out (its seeds and sizes), not rerunning others",
    )
    args = parser.parse_args(argv)
    if args.groups and not (args.online and not args.tables_only):
        parser.error("--groups appends a batch size to an --online run (without --tables-only)")
    if args.online:
        out = args.out if args.out != RESULTS else os.path.join(RESULTS, "online")
        if args.tables_only:
            records, credit, cfg, info, seconds = read_online_run(out)
            online_report(out, records, credit, cfg, info, seconds)
            return 0
        if args.groups:
            return online_main(args.quick, out, add=args.groups)
        cfg = QUICK_ONLINE if args.quick else OnlineConfig()
        cfg = replace(cfg, seeds=args.seeds or cfg.seeds, seed0=cfg.seed0 if args.seed0 is None else args.seed0)
        return online_main(args.quick, out, cfg)
    if args.tables_only:
        train_report(args.out, *read_train_run(args.out))
        return 0
    cfg = QUICK_TRAIN if args.quick else TrainConfig()
    cfg = replace(cfg, seeds=args.seeds or cfg.seeds, seed0=cfg.seed0 if args.seed0 is None else args.seed0)
    return train_main(args.quick, args.out, cfg)


if __name__ == "__main__":
    sys.exit(main())
