"""DiffusionNFT: the online reinforcement step on the forward process that ReCAST and DiffusionRVGE build on.

Written once, to be read next to the DiffusionNFT paper (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement
with Forward Process", arXiv:2509.16117) and its public code (NVlabs/DiffusionNFT, `scripts/train_nft_sd3.py`); NOTES.md
§2 writes the step down and tables how this code matches theirs ("DiffusionNFT fidelity"). recast.py and rvge.py
import it (`import nft`) and change one thing each: the optimality the loss is fed per timestep (ReCAST's W) or the
loss itself (RVGE's regression to target velocities); `recast.py --config configs/nft-geneval.yaml` runs DiffusionNFT.
Read top to bottom, one section each:
    hyperparameters         NFTArgs (the flags both methods share: rewards, rollout, optimisation), declared by `flag`
    rewards -> optimality   global_stats (the std over all processes), advantages, optimality; several rewards:
                            combine_raw (added with their weights, then normalised once)
    schedules               old_decay (the soft update of the sampling adapter "old"), ema_decay (the evaluation's EMA)
    sampler steps           sde_step (FlowGRPO's SDE), ode_step (Euler), dpm2_step (DiffusionNFT's DPM-Solver-2),
                            shifted_sigmas (SD3's grid, for the toy and the tests)
    rollouts                rollout_and_score -> tree_rollout (the ODE to a branch, the SDE after it: sde_continue;
                            --sampler ode: independent DPM-Solver-2 samples, DiffusionNFT's), ode_sample (held out)
    the update              update_loop: training_pairs, noised_batch, frozen_velocities (v_old, v_base), nft_loss
                            (ReCAST's loss; RVGE passes its own), optimizer_step (all-reduce, [unscale], clip, AdamW),
                            reward_metrics (the first entries of an iteration's metrics line)
It stands on the model file alone, sd3.py: loading, the transformer call (`sd3.velocity`: timestep = 1000 t, dtype,
chunks), text encoding, decoding, the LoRA parameters and the adapter copy (`sd3.copy_adapter`, which old_decay's
weight drives). `run` is the kit's Run (kit/session.py), read for what it holds (the pipeline, the adapters, the
optimizer, the sigmas, the rewards) and for four services of the run machinery: the prompts of an iteration
(`run.prompts_for`), the sums across processes (`run.reduce`, `run.all_reduce_grads`) and the permuted-reward control
(`run.permuted`, R itself unless the run is that control).

Notation map (code name -> symbol)
    R         (N, K)        raw rewards of the N leaves (images), K rewards; NaN where a reward failed
    groups    (N,)          prompt group of each leaf: advantages are centred within a group
    A         (N, K)        clipped advantage clip((R - mean_group R) / (std_global R + eps), -5, 5)
    r         (N, K)        optimality probability r = 0.5 + 0.5 A / 5 in [0, 1]
    lam       (K,)          reward weights lambda_k (budgets) of the multi-reward sum sum_k lambda_k R_k
    sigmas    (T+1,)        sampler grid s_0 = 1 > s_1 > ... > s_T = 0 (t = 1 is pure noise); step j: s_j -> s_{j+1}
    x0, eps                 a leaf's clean latent and fresh noise; x_t = (1 - t) x0 + t eps, target u = eps - x0
    v_theta                 velocity of the trained adapter "default"
    v_old                   velocity of the sampling adapter "old" (no grad); v_base: the base model (adapters off)
    b                       guidance strength (--nft-b): v+ = (1 - b) v_old + b v_theta, v- = (1 + b) v_old - b v_theta
    x0_hat                  x_t - t v (Tweedie, rectified flow)
    a, g                    SDE noise level: g = a sqrt(s / (1 - s))

Conventions: x_t = (1 - t) x0 + t eps (t = sigma, SD3's rectified flow); the loss is a mean over latent dimensions, then
over the batch; numpy statistics in float64, the transformer's outputs float32; every random number of an iteration
comes from its CPU generator `gen` (`iteration_generator`). Precision (`sd3.precision`): the transformer's forwards and
the decodes run inside `run.autocast()` (--mixed-precision fp16: float16 autocast, DiffusionNFT's; else nothing), the
loss outside it in float32, its backward through `run.scaler` when there is one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

import sd3

# =============================================================================
# DiffusionNFT's hyperparameters (NOTES.md §2): the flags both methods share
# =============================================================================


def flag(default, group, **checks):
    """One Args field: its default, its --help section (a key of the script's ARG_GROUPS) and the checks
    `check_ranges` applies: min / max (inclusive), gt / lt (strict), choices. Its help line is the string under it
    (`field_docs`)."""
    return field(default=default, metadata={"group": group, **checks})


@dataclass
class NFTArgs:
    """DiffusionNFT's hyperparameters, the flags both methods take with the same meaning: the rewards and budgets,
    the rollout, the optimisation (each script's method, rollout and optimisation --help sections). The defaults are
    the embedded model's (recast.py's); rvge.py redefines those it changes (a redefined field keeps its place in
    --help); the SD3.5-M recipes in configs/ set DiffusionNFT's own. A script's Args inherits this class and the kit's
    RunArgs (evaluation, I/O, reward models, controls)."""

    # method
    rewards: str = flag("", "method")
    """comma-separated reward names, in budget order (default: the embedded model's four; required for another
    model)"""
    budgets: str = flag("0.4,0.3,0.2,0.1", "method")
    """reward budgets lambda_k, one per reward (W's row sums)"""
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
    """training iterations (rollout + update)"""
    base_reg: float = flag(0.1, "optimisation", min=0)
    """weight of the velocity MSE to the frozen base model (a pull towards the pretrained model); DiffusionNFT uses
    1e-4, as every SD3.5-M recipe and rvge.py do"""
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


# =============================================================================
# Rewards to optimality, across processes; several rewards (NOTES.md §2)
# =============================================================================


def process_sum(acc, a):
    """A numpy statistic summed over the processes of accelerate's `acc` (`run.reduce`): float64, itself with one
    process."""
    if acc.num_processes == 1:
        return np.asarray(a)
    return acc.reduce(torch.as_tensor(np.asarray(a), dtype=torch.float64, device=acc.device), "sum").cpu().numpy()


def average_grads(acc, params):
    """The gradients of `params` averaged over processes in one collective (`run.all_reduce_grads`): every gradient
    copied into one flat buffer, all-reduced, copied back (DDP's bucketing with a single bucket; the LoRA's gradients
    are small)."""
    grads = [p.grad for p in params if p.grad is not None]
    if acc.num_processes > 1 and grads:
        flat = acc.reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def global_stats(R, reduce):
    """Per-column (count, mean, std) of the finite rewards of all processes: the global std DiffusionNFT divides
    the advantages by. R (N, K); reduce sums a numpy array over processes (`run.reduce`)."""
    finite = np.isfinite(R)
    Rz = np.where(finite, R, 0.0)
    n = reduce(finite.sum(0))
    mean = reduce(Rz.sum(0)) / np.maximum(n, 1)
    return n, mean, np.sqrt(np.maximum(reduce((Rz**2).sum(0)) / np.maximum(n, 1) - mean**2, 0.0))


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
    group = np.unique(groups, return_inverse=True)[1].reshape(-1)  # each row's group, 0 .. G - 1
    R0 = np.where(valid, R, 0.0)
    n, total = np.zeros((2, group.max(initial=-1) + 1, R.shape[1]))  # per group and reward: finite rewards, their sum
    np.add.at(n, group, valid)
    np.add.at(total, group, R0)
    mean = total / np.maximum(n, 1)
    A = np.where(valid, (R0 - mean[group]) / (np.asarray(std) + eps), 0.0)
    A = np.clip(A, -clip, clip)
    return A[:, 0] if squeeze else A


def optimality(rewards, groups, std=None, clip=5.0, eps=1e-4):
    """DiffusionNFT's reward -> optimality probability: r = 0.5 + 0.5 A / clip in [0, 1], A the
    clipped advantage (`advantages`, same arguments). Non-finite rewards and tied groups get r = 0.5."""
    return 0.5 + 0.5 * advantages(rewards, groups, std, clip, eps) / clip


def combine_raw(rewards, budgets):
    """DiffusionNFT's multi-reward baseline: R = sum_k lambda_k R_k, before normalising (recast.py --credit nft,
    rvge.py --combine reward). rewards (N, K) -> (N,); a non-finite reward makes the sum non-finite (then r = 0.5)."""
    return np.asarray(rewards, dtype=np.float64) @ np.asarray(budgets, dtype=np.float64)


def budget_mean(values, budgets):
    """The budget-weighted mean sum_k lambda_k v_k / Lam of per-reward values (K,): the metrics `reward/weighted`
    and `eval/weighted`."""
    return np.asarray(budgets) @ values / sum(budgets)


def score(rewards, images, prompts):
    """Rewards (N, K) float64; non-finite values are kept (NaN) and handled by `optimality`."""
    return np.stack([np.asarray(fn(images, prompts), dtype=np.float64).reshape(len(images)) for fn in rewards], 1)


# =============================================================================
# The old policy and the EMA: DiffusionNFT's schedules (NOTES.md §2)
# =============================================================================


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
# Tree rollouts (NOTES.md §5), rewards, the held-out sampler
# =============================================================================


def iteration_generator(seed, iteration):
    """The CPU generator that draws every random number of one iteration (noise moves to the device)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def branch_layout(n_groups, T, branch_steps, offset=0):
    """Branch steps of each prompt group (NOTES.md §3.3, §5). branch_steps: a list of steps shared by
    every group, or "rotate": group p branches once, at step 1 + (offset + p) mod (T - 2), so that
    consecutive groups (and iterations, through `offset`) cover every step 1..T-2 in turn and each
    sampler level gets a measured D. Returns a list of n_groups sorted lists."""
    if branch_steps == "rotate":
        return [[1 + (offset + p) % (T - 2)] for p in range(n_groups)]
    return [list(branch_steps) for _ in range(n_groups)]


def sde_continue(transformer, x, v, s, s_next, emb, pooled, sde_a, s_first, substeps, gen, chunk):
    """`substeps` SDE steps from s to s_next on an even sub-grid; v is the velocity already taken at s."""
    grid = np.linspace(s, s_next, substeps + 1)
    for i, (u, u_next) in enumerate(zip(grid[:-1], grid[1:])):
        if i:
            v = sd3.velocity(transformer, x, torch.full((len(x),), float(u), device=x.device), emb, pooled, chunk)
        x = sde_step(x, v, float(u), float(u_next), sde_a, s_first, torch.randn(x.shape, generator=gen).to(x.device))
    return x


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
    noise=None,
):
    """One tree per prompt (NOTES.md §5): n_roots noises run with the ODE to the group's first branch
    step; at each of its branch steps every state is copied n_branch times; after the first branch the
    SDE continues (`substeps` Euler-Maruyama sub-steps per grid interval, so that siblings sample
    x0 | x_t closely: derivations.ipynb §7); the last step is an Euler step, so leaves are clean.
    branch / probe_steps: a list of steps shared by every prompt, or one list per prompt (`branch_layout`);
    every prompt must have the same number of branch steps. solver: the ODE before branching, "euler"
    or "dpm2" (`dpm2_step`, DiffusionNFT's deterministic sampler). sigmas (T+1,) float tensor, 1 -> 0.
    noise (P n_roots, C, h, w): the roots' starting noise (default: drawn from gen).

    Returns leaves (N, C, h, w), groups (N,) prompt index, ancestry (N, 1 + L) codes for
    `recast.split_levels`, and probes: a list of (step, x0_hat = x - s v, groups) for the denoised estimator."""
    device = emb.device
    P, T = len(emb), len(sigmas) - 1

    def per_group(steps):
        return [list(x) for x in steps] if steps and isinstance(steps[0], (list, tuple)) else [list(steps)] * P

    branch, probe_steps = per_group(branch), per_group(probe_steps)
    L = len(branch[0])
    first = np.array([min(b) if b else T for b in branch])
    x = (torch.randn((P * n_roots, *shape), generator=gen) if noise is None else noise).to(device)
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
            v = sd3.velocity(
                transformer, x, torch.full((len(x),), s, device=device), emb[groups], pooled[groups], chunk
            )
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


def ode_sample(transformer, emb, pooled, sigmas, shape, seed, chunk=64, noise=None):
    """One image latent per prompt by the Euler ODE from fixed noise (`seed`, or `noise` (P, C, h, w): one process's
    share of the evaluation's noise, `kit.session.evaluate`): the held-out samplers' rollout (a tree with one root
    and no branch)."""
    gen = torch.Generator().manual_seed(seed)  # draws the noise when none is given (no branch: no SDE noise)
    kwargs = dict(n_roots=1, n_branch=1, branch=[], sde_a=0.0, gen=gen, shape=shape, chunk=chunk, noise=noise)
    return tree_rollout(transformer, emb, pooled, sigmas, **kwargs)[0]


@dataclass
class Rollout:
    """One iteration's rollouts and rewards (`rollout_and_score`): what the method's step 2 and the update read."""

    prompts: list[str]  # (P,) this process's prompts, one per tree
    emb: torch.Tensor  # (P, L, D) CFG-free text embeddings
    pooled: torch.Tensor  # (P, D') pooled text embeddings
    leaves: torch.Tensor  # (N, C, h, w) clean latents of the leaves
    groups: np.ndarray  # (N,) prompt index of each leaf
    ancestry: np.ndarray  # (N, 1 + L) each leaf's root and branch indices (`recast.split_levels`)
    layouts: list[list[int]]  # each prompt's branch steps (`branch_layout`; [] each with --sampler ode)
    R: np.ndarray  # (N, K) rewards; NaN where a reward failed
    probes: list  # [(step, x0_hat (M, C, h, w), groups (M,))] at the probe steps
    probe_R: list  # [(step, rewards (M, K), groups (M,))]: the decoded probes, scored
    t_rollout: float  # time.perf_counter() when the rollouts ended (the rewards' clock starts there)


def rollout_and_score(run, args: NFTArgs, it, gen, probe_steps=()) -> Rollout:
    """Step 1 of an iteration: prompts, rollouts from the "old" adapter (--sampler tree: branched trees
    with this iteration's branch layout; ode: independent deterministic DPM-Solver-2 samples, as
    DiffusionNFT), decoded leaves scored; x0_hat kept, decoded and scored at probe_steps (steps, or
    "layout": each group's layout steps, the denoised estimator). Returns the Rollout."""
    prompts = run.prompts_for(it)
    emb, pooled = sd3.encode(run.pipe, prompts, run.max_len, run.acc.device)
    P = len(prompts)
    layouts = branch_layout(P, args.steps, run.branch, offset=(it * run.acc.num_processes + run.acc.process_index) * P)
    tree = args.sampler == "tree"
    run.transformer.set_adapter("old")
    with run.autocast():  # --mixed-precision fp16: DiffusionNFT samples under float16 autocast
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
    with run.autocast():  # ... and decodes there (its pipeline's VAE call), scoring outside (its reward thread)
        images, probe_images = sd3.decode(run.pipe, leaves), [sd3.decode(run.pipe, x0h) for _, x0h, _ in probes]
    R = run.permuted(score(run.rewards, images, [prompts[g] for g in groups]), groups, it)  # R itself but in a control
    probe_R = [
        (j, score(run.rewards, im, [prompts[g] for g in gp]), gp) for (j, _, gp), im in zip(probes, probe_images)
    ]
    return Rollout(
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


# =============================================================================
# The update: (leaf, timestep) samples, noised batches, the loss, the frozen forwards, the step (NOTES.md §2)
# =============================================================================


def training_pairs(N, T, per_leaf, gen):
    """(N * per_leaf, 2) (leaf, grid step) pairs in random order: each leaf trains on `per_leaf`
    distinct sampler steps, the first of a random permutation of the T (DiffusionNFT: 9 of 10)."""
    steps = torch.stack([torch.randperm(T, generator=gen)[: min(per_leaf, T)] for _ in range(N)])
    pairs = torch.stack([torch.arange(N).repeat_interleave(steps.shape[1]), steps.reshape(-1)], 1)
    return pairs[torch.randperm(len(pairs), generator=gen)]


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
    i, j = pairs[:, 0], pairs[:, 1]
    x0, s = leaves[i], sigmas[j].to(leaves.device)
    eps = torch.randn(x0.shape, generator=gen).to(leaves.device)
    x_t = (1 - s.view(-1, *[1] * (x0.dim() - 1))) * x0 + s.view(-1, *[1] * (x0.dim() - 1)) * eps
    return NoisedBatch(pairs, i, j, x0, s, x_t, (emb[groups[i]], pooled[groups[i]]))


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


def frozen_velocities(transformer, x_t, s, cond, with_base):
    """No-grad velocities of the "old" (sampling) adapter and of the frozen base (adapters off; v_old
    again when the base term is off); leaves the "default" adapter active."""
    with torch.no_grad():
        transformer.set_adapter("old")
        v_old = sd3.velocity(transformer, x_t, s, *cond)
        transformer.disable_adapters()
        v_base = sd3.velocity(transformer, x_t, s, *cond) if with_base else v_old
        transformer.enable_adapters()
    transformer.set_adapter("default")
    return v_old, v_base


def frozen_velocities_ahead(transformer, batches, size, with_base):
    """--frozen-batch: the no-grad v_old / v_base of every micro-batch of an optimizer step, computed
    ahead in chunks of `size` (larger than the gradient micro-batch: no activations are kept), then
    split back per micro-batch. The same numbers as `frozen_velocities` per micro-batch."""
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


def check_finite(values):
    """Stop before an optimizer step that would write NaN/inf into the weights (exit code 1; the run
    folder keeps its last good checkpoint). values: the step's losses and gradient norm."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise SystemExit(
            f"non-finite {bad}: the optimizer step was not taken and nothing was saved; the last good "
            "checkpoint is kept. Lower --lr or check the flags and rewards, then --resume"
        )


def optimizer_step(opt, params, totals, grad_clip, all_reduce_grads, scaler=None):
    """Average the gradients over processes, clip their norm, refuse a non-finite step, step AdamW.

    With a gradient scaler (--mixed-precision fp16), in DiffusionNFT's order: the scaled gradients are averaged over
    processes (DDP's all-reduce in backward there), unscaled, clipped (grad_norm: the unscaled norm), then
    scaler.step takes the AdamW step unless a gradient is non-finite, and scaler.update halves the scale after a
    skipped step (doubles it after 2,000 taken). Every process reduces the same sum before unscaling, so all skip
    together. A skipped step is counted in train/skipped_steps (its grad_norm is inf or NaN) and still counts as an
    optimizer step for the old-policy decay and the EMA, as DiffusionNFT's global_step does; train/loss_scale is the
    scale after it. A non-finite loss is no scale's doing (the forward overflowed): refused in both cases."""
    all_reduce_grads(params)
    if scaler is not None:
        scaler.unscale_(opt)
    totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    if scaler is None:
        check_finite(totals)
        opt.step()
    else:
        check_finite({k: v for k, v in totals.items() if k != "grad_norm"})
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        totals["train/skipped_steps"] += int(scaler.get_scale() < scale)  # the scale drops only after a skip
        totals["train/loss_scale"] = scaler.get_scale()
    opt.zero_grad(set_to_none=True)
    totals["train/opt_steps"] += 1


def update_loop(run, b: Rollout, args: NFTArgs, gen, on_step, policy_loss):
    """The update both methods share (NOTES.md §2, §4.3): the iteration's (leaf, timestep) samples in
    --updates-per-iter equal chunks, one AdamW step per chunk on the mean loss over its samples (all processes;
    1 chunk is DiffusionNFT's one step per epoch). Per micro-batch: fresh noise (`noised_batch`), the frozen
    v_old / v_base, v_theta, and loss = mean(policy_loss(nb, v_theta, v_old)) + base_reg mean(|v_theta - v_base|^2),
    policy_loss the method's per-sample loss (B,); the forwards inside `run.autocast()`, the backward scaled by
    `run.scaler` (--mixed-precision fp16). `on_step()` runs after every optimizer step (the EMA).
    Returns mean losses, the last gradient norm, the counts and the drift to the old policy (train/old_deviate:
    mean |v_theta - v_old|^2, DiffusionNFT's old_deviate)."""
    transformer, sigmas, leaves, groups = run.transformer, run.sigmas, b.leaves, torch.as_tensor(b.groups)
    pairs = training_pairs(len(leaves), len(sigmas) - 1, args.train_steps_per_leaf, gen)
    params = sd3.lora_params(transformer, "default")
    totals = {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": len(pairs)}
    totals["train/old_deviate"] = 0.0  # this process's, as loss/*
    if run.scaler is not None:  # --mixed-precision fp16
        totals.update({"train/skipped_steps": 0, "train/loss_scale": run.scaler.get_scale()})
    scale = run.scaler.scale if run.scaler is not None else (lambda loss: loss)
    for chunk in pairs.tensor_split(args.updates_per_iter):
        batches = [
            noised_batch(mb, leaves, groups, b.emb, b.pooled, sigmas, gen) for mb in chunk.split(args.train_batch)
        ]
        with_base = args.base_reg > 0
        with run.autocast():  # the forwards under --mixed-precision fp16's autocast; the loss in float32 (`velocity`)
            frozen = (
                frozen_velocities_ahead(transformer, batches, args.frozen_batch, with_base)
                if args.frozen_batch
                else None
            )
        for k, nb in enumerate(batches):
            with run.autocast():
                v_old, v_base = (
                    frozen[k] if frozen else frozen_velocities(transformer, nb.x_t, nb.s, nb.cond, with_base)
                )
                v_theta = sd3.velocity(transformer, nb.x_t, nb.s, *nb.cond)
            policy = policy_loss(nb, v_theta, v_old).mean()
            base, drift = ((v_theta - v_base) ** 2).mean(), ((v_theta.detach() - v_old) ** 2).mean()
            scale((policy + args.base_reg * base) * (len(nb.pairs) / len(chunk))).backward()
            for key, value in (("loss/policy", policy), ("loss/base_reg", base), ("train/old_deviate", drift)):
                totals[key] += value.item() * len(nb.pairs) / len(pairs)
        optimizer_step(run.opt, params, totals, args.grad_clip, run.all_reduce_grads, run.scaler)
        on_step()
    return totals


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
