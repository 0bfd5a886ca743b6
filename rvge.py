"""DiffusionRVGE: regression-based value-gradient estimation, on top of DiffusionNFT.

One self-contained file, read top to bottom: RVGE's math (centred reward / clean-image cross-covariance
directions, the Gaussian posterior-variance transfer, target velocities, bandwidth by reward continuity), its
glue (directions per reward, the regression loss and update), the train loop, the flags; then the DiffusionNFT
skeleton and run machinery, one block that is the same text in recast.py (so `diff recast.py rvge.py` shows the
two methods). --credit recast takes ReCAST's W from recast.py (`recast.credit`, imported where used).
Derivations: derivations.ipynb; the design each "§n" names: NOTES.md.

Notation map (code name -> symbol)
    lam      (K,)      reward budgets lambda_k, not normalised; Lam = sum_k lambda_k
    sigmas   (T+1,)    sampler grid s_0 = 1 > s_1 > ... > s_T = 0 (t = 1 is pure noise)
    A        (N, K)    normalised rewards: clipped advantages (R - group mean) / global std (`advantages`)
    x0       (G, ...)  clean latents of one regression group B (posterior samples of x0 | x_{t_b})
    d_B      (...)     direction at the branch time: E*[x0 | x_{t_b}] - E[x0 | x_{t_b}]
    beta               trajectory-KL weight (None: first order with step size eta, = 1 / beta)
    s2                 per-dimension variance of the clean latents (population model)
    kappa(t)           Cov(x0 | x_t) / I = s2 t^2 / (t^2 + (1 - t)^2 s2)
    t_b                branch time of a group: local groups (the C siblings of a root) sigma at the branch step,
                       broad groups (the R leaves of one child index, one per root) 1; split: local for t <= t_b
    v_target (N, ...)  v_old(x_t) - sum_k w_kj d_k(t) / t, d_k(t) = kappa(t) / kappa(t_b) d_B,k
    W        (K, T)    reward-by-step weights (budgets: lambda / T; --credit recast: ReCAST's W)

Conventions: x_t = (1 - t) x0 + t eps; dv = -dx0_hat / t; all losses are means over latent
dimensions, then over the batch; numpy math is float64.

Where to change what
    flags       Args (a field, its --help section in ARG_GROUPS, its checks), validate
    sampler     tree_rollout (trees; sde_step / sde_continue after a branch, ode_step or dpm2_step before),
                rollout_and_score (which adapter samples, what is decoded and scored; probes for --coords noisy)
    rewards     reward_models.py (REWARD_MODELS, build_rewards; README "Add a reward"), score, reward_extras
    directions  value_directions: regression_groups, pick_bandwidth, group_directions -> value_direction
                (--combine reward: one direction on the budget-weighted reward, weighted_advantage)
    transfer    reward_target: uses_local, target_velocity (transfer_ratio, posterior_var), query_weight
    credit      mixture_weights (w_kj from W); W itself is recast.credit (--credit recast), imported in train
    loss        rvge_loss, mix_targets, rvge_update; the loop shared with recast.py: update_loop
    old policy  old_decay (the soft update of "old" each iteration), ema_decay (--ema)
    logging     reward_metrics + train's metrics line, finish_iteration (metrics.jsonl, log_to_trackers,
                checkpoints), progress bar in train, figures in plot_run and save_grid
    the loop    train (steps 1-4), setup_run, start_or_resume
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
# RVGE §4.1-§4.3: value directions and their transfer across t
# =============================================================================


def value_direction(x0, rewards, beta=None, eta=1.0):
    """Tilted posterior-mean shift d_B from one group of posterior samples (NOTES.md §4.2).

    First order (beta None): d_B = eta 1/(G-1) sum_i (R_i - R_bar)(x0_i - x0_bar), the unbiased
    centred cross-covariance Cov(x0, R | x_t) (1/G would shrink it by (G-1)/G: by half for the
    2-leaf local groups; derivations.ipynb §10), i.e. the first variation of E[x0 | x_t] under
    the tilt exp(eta R). A single sample (G = 1) gives zero.
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
        weights = eta * R / max(len(R) - 1, 1)
    else:
        z = (R if isinstance(R, np.ndarray) else R.double()) / beta  # float64: A / beta overflows float32 for tiny beta
        weights = np.exp(z - z.max()) if isinstance(z, np.ndarray) else (z - z.max()).exp().to(x0.dtype)
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
    kappa(t_b) / kappa(t) < 1 beyond it, where the transferred direction is an extrapolation.
    Derived nowhere, and below the cap weight x transfer_ratio = 1: it undoes the transfer above t_b
    (toy_gaussian.py 6d), so it is off by default (--query-weights)."""
    w = posterior_var(t_b, s2) / posterior_var(t, s2)
    return w.clip(max=1.0) if hasattr(w, "clip") else min(w, 1.0)


def target_velocity(v_old, d_B, t, t_b, s2, cap=4.0, transfer="direct"):
    """v_target = v_old(x_t) - d(t) / t with d(t) = (kappa(t) / kappa(t_b)) d_B (NOTES.md §4.3); --transfer none
    uses d(t) = d_B at every t (the ablation). v_old (N, ...); d_B (N, ...) (each query's group direction);
    t (N,) tensor or array; t_b a float or (N,) like t."""
    shape = (-1, *[1] * (v_old.ndim - 1))
    ratio = transfer_ratio(t, t_b, s2, cap) if transfer == "direct" else t * 0 + 1
    return v_old - ratio.reshape(shape) * d_B / t.reshape(shape)


# =============================================================================
# RVGE §4.4: regression groups and bandwidth by reward continuity
# =============================================================================


def regression_groups(groups, ancestry, local):
    """Ids (N,) of the groups the directions regress over (NOTES.md §4.4), from an R roots x C children tree.
    Local: the C siblings that share their state at the last branch step (near-copies, t_b = sigma there).
    Broad: the R leaves of one prompt that took the same branch indices, one per root (independent, t_b = 1).
    With R = C both hold C leaves of the same rollout, so bandwidth is the only difference. Without a branch
    step the broad group is the prompt group. groups (N,) prompt ids; ancestry (N, L+1) as in `split_levels`
    (column 0 the root id, unique across prompts)."""
    A = np.asarray(ancestry)
    keys = A[:, :-1] if local else np.column_stack([np.asarray(groups), A[:, 1:]])
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)


def tie_counts(A, ids):
    """(groups whose rewards all tie, groups) per reward column; A (N, K). The tie share decides
    --bandwidth auto: discrete rewards tie among near-copies and give no contrast there."""
    tied = np.array([[np.ptp(A[ids == g, k]) == 0 for k in range(A.shape[1])] for g in np.unique(ids)])
    return tied.sum(0), np.full(A.shape[1], float(len(tied)))


def group_directions(x0, A, ids, beta=None, eta=1.0):
    """Every leaf's direction: `value_direction` of its regression group. x0 (N, ...) tensor,
    A (N,) tensor, ids (N,) numpy. Returns (N, ...)."""
    d = x0.new_zeros(x0.shape)
    for g in np.unique(ids):
        rows = np.flatnonzero(ids == g)
        d[rows] = value_direction(x0[rows], A[rows], beta, eta)
    return d


def group_variance(x0, ids):
    """Sufficient statistics of s2, the per-dimension variance of the clean latents around their group means:
    (sum of squared deviations, degrees of freedom (sum_g (n_g - 1)) x dims), summable across processes.
    On broad groups (independent roots) this is unbiased; siblings would bias it low (issue 16)."""
    total, dof = 0.0, 0
    for g in np.unique(ids):
        xg = x0[np.flatnonzero(ids == g)]
        total += float((xg - xg.mean(0)).pow(2).sum())
        dof += (len(xg) - 1) * xg[0].numel()
    return total, dof


def pick_bandwidth(setting, tie_share, threshold):
    """--bandwidth per reward: local | broad | split as given; auto: broad when more than `threshold` of the
    local groups tie (a discrete reward: near-copies give no contrast), else split (NOTES.md §4.4)."""
    if setting != "auto":
        return setting
    return "broad" if tie_share > threshold else "split"


def uses_local(t, t_b, bandwidth):
    """Which group a training query at t regresses on: True for the local group (its direction transferred
    from t_b), False for the broad one (from t = 1). local: every query; broad: none; split: t <= t_b,
    where the local group is a posterior sample of x0 | x_t's neighbourhood and the broad one is biased
    (toy_gaussian.py 6d). t (B,) tensor; t_b float or (B,)."""
    if bandwidth == "local":
        return t >= 0
    if bandwidth == "broad":
        return t < 0
    return t <= t_b


def reward_target(v_old, t, direction, s2, cap=4.0, transfer="direct", query_weights="off"):
    """One reward's target velocity and query weight at queries (x_t, t) of leaves whose directions are given:
    direction = (bandwidth, d_local (B, ...) or None, d_broad (B, ...) or None, t_b (B,) local branch times).
    Each query uses the group `uses_local` picks, transferred from that group's branch time (t_b or 1).
    Query weight kappa(t_b) / kappa(t) capped at 1 (`query_weight`) with --query-weights on, else 1.
    Returns (v_target (B, ...), q (B,))."""
    bandwidth, d_local, d_broad, t_b = direction
    local = uses_local(t, t_b, bandwidth)
    t_used = local * t_b + ~local * 1.0  # (B,) branch time of each query's group
    if d_local is None or d_broad is None:
        d = d_local if d_broad is None else d_broad
    else:
        d = d_local.where(local.reshape(-1, *[1] * (d_local.ndim - 1)), d_broad)
    q = query_weight(t, t_used, s2) if query_weights == "on" else t * 0 + 1
    return target_velocity(v_old, d, t, t_used, s2, cap, transfer), q


def mixture_weights(W, budgets):
    """w_kj = T W_kj / Lam: each step's weights over the rewards, (K, T), every column summing to one (W's columns
    sum to Lam / T). --credit budgets (W uniform): w_kj = lambda_k / Lam at every step."""
    return W * W.shape[1] / sum(budgets)


def mix_targets(targets, w):
    """The target of a training query at step j over the K rewards: v_target = sum_k w_kj v_k and its weight
    q = sum_k w_kj q_k. targets: K pairs (v_k (B, ...), q_k (B,)) from `reward_target`; w (K, B) each query's
    column of the mixture weights (sum_k w_kj = 1). Returns (v_target (B, ...), q (B,))."""
    v_target = sum(w[k].view(-1, *[1] * (v_k.dim() - 1)) * v_k for k, (v_k, _) in enumerate(targets))
    q = sum(w[k] * q_k for k, (_, q_k) in enumerate(targets))
    return v_target, q


def split_half_cosine(x0, A, ids, beta=None):
    """Noise gauge: mean over groups of the cosine between the directions of the two halves of
    each group (alternate members); groups under 4 members or with a zero half are skipped (NaN if all)."""
    cosines = []
    for g in np.unique(ids):
        rows = np.flatnonzero(ids == g)
        if len(rows) < 4:
            continue
        d1, d2 = (value_direction(x0[rows[h::2]], A[rows[h::2]], beta) for h in (0, 1))
        norm = float((d1 * d1).sum() * (d2 * d2).sum()) ** 0.5
        if norm > 0:
            cosines.append(float((d1 * d2).sum()) / norm)
    return float(np.mean(cosines)) if cosines else float("nan")


class RewardDirections(NamedTuple):
    """One reward's directions for the update. bandwidth: local | broad | split (auto resolved);
    local / broad: (N, ...) each leaf's direction from its local / broad group (None when unused);
    t_b: (N,) tensor, the branch time of each leaf's local group (its broad group's is 1)."""

    bandwidth: str
    local: object
    broad: object
    t_b: object

    def rows(self, i):
        """The same directions for the leaves i of a micro-batch."""
        pick = lambda d: None if d is None else d[i]  # noqa: E731
        return RewardDirections(self.bandwidth, pick(self.local), pick(self.broad), self.t_b[i])


def coordinate_steps(coords, branch):
    """Sampler steps whose x0_hat --coords noisy regresses on: the first state after each group's branch
    time, where its members differ (at the branch step itself siblings share one state): step 1 for broad
    groups (t_b = 1; at step 0 every root's x0_hat is near E[x0]) and the last branch step + 1 for local ones."""
    return tuple(sorted({1} | ({branch[-1] + 1} if branch else set()))) if coords == "noisy" else ()


def denoised_coordinates(probes, step, n_leaves):
    """Each leaf's x0_hat at sampler step `step` of its own trajectory, from the rollout's probes
    [(step, x0_hat (n_j, ...), groups)]. Tree states are copied in place (repeat_interleave), so leaf i
    descends from state i // (N / n_j) of that step. Returns (N, ...)."""
    import torch

    x0_hat = next(x for j, x, _ in probes if j == step)
    return x0_hat[torch.arange(n_leaves, device=x0_hat.device) // (n_leaves // len(x0_hat))]


# =============================================================================
# RVGE's glue: directions per reward, the regression loss and update
# =============================================================================


def value_directions(b, A, sigmas, branch, bandwidths, names, args, reduce):
    """Step 2 of an iteration (NOTES.md §4.2-4.4), the leaves of an R x C tree b (leaves, groups, ancestry;
    probes with --coords noisy). Per reward: its bandwidth (auto: by the share of tied local groups, summed
    over processes), then every leaf's local and/or broad direction on the clean latents (or on x0_hat just
    after the group's branch time, --coords noisy); s2 from the broad groups (independent roots).
    A (N, K) normalised rewards. Returns (list of K RewardDirections, s2, metrics)."""
    import torch

    x0 = b.leaves.float()
    N, K = len(x0), A.shape[1]
    broad_ids = regression_groups(b.groups, b.ancestry, local=False)
    local_ids = regression_groups(b.groups, b.ancestry, local=True) if branch else None
    ties, n_groups = reduce(tie_counts(A, local_ids)) if branch else (np.zeros(K), np.ones(K))
    tie_share = ties / np.maximum(n_groups, 1)
    total, dof = group_variance(x0, broad_ids)
    s2 = float(reduce(total) / max(reduce(dof), 1))  # per-dimension latent variance within a prompt
    t_local = float(sigmas[branch[-1]]) if branch else 1.0
    coords = {"local": x0, "broad": x0}
    if args.coords == "noisy":
        coords = {
            "local": denoised_coordinates(b.probes, step=branch[-1] + 1, n_leaves=N).float() if branch else None,
            "broad": denoised_coordinates(b.probes, step=1, n_leaves=N).float(),
        }
    A_t = torch.as_tensor(A, dtype=torch.float32, device=x0.device)
    t_b = torch.full((N,), t_local, device=x0.device)
    directions, metrics = [], {"rvge/s2": s2}
    for k, name in enumerate(names):
        bandwidth = pick_bandwidth(bandwidths[k], tie_share[k], args.tie_threshold)
        d = {
            kind: group_directions(coords[kind], A_t[:, k], ids, args.kl_beta, args.eta)
            for kind, ids in (("local", local_ids), ("broad", broad_ids))
            if bandwidth in (kind, "split")
        }
        directions.append(RewardDirections(bandwidth, d.get("local"), d.get("broad"), t_b))
        main, ids = ("broad", broad_ids) if bandwidth == "broad" else ("local", local_ids)  # the groups at t <= t_b
        metrics.update(
            {
                f"rvge/bandwidth/{name}": bandwidth,
                f"rvge/t_b/{name}": 1.0 if main == "broad" else t_local,
                f"rvge/group_size/{name}": float(np.bincount(ids).mean()),
                f"rvge/tie_share/{name}": float(tie_share[k]),
                f"rvge/direction_rms/{name}": float(d[main].pow(2).mean().sqrt()),
                f"rvge/split_cos/{name}": split_half_cosine(x0, A_t[:, k], b.groups, args.kl_beta),
            }
        )
    return directions, s2, metrics


def weighted_advantage(b, budgets, run):
    """--combine reward: the advantage (N, 1) of the one reward sum_k lambda_k R_k (`recast.combine_raw`), normalised
    once with its global std over all processes, as DiffusionNFT's multi-reward baseline forms it
    (`recast.nft_baseline`)."""
    from recast import combine_raw

    Rc = combine_raw(b.R, budgets)[:, None]
    _, _, std = global_stats(Rc, run.reduce)
    return advantages(Rc, b.groups, std=std)


def credit_settings(args):
    """rvge.py's flags for recast.credit: W learned with --credit recast (else uniform, the budgets' lambda / T), by
    ReCAST's pairs estimator at order 2 on RVGE's trees (CreditSettings' defaults)."""
    from recast import CreditSettings

    return CreditSettings(args.credit == "recast", args.gain_ema, args.evidence, args.tau, args.eps)


def rvge_loss(v_theta, v_target, v_old, x_t, x0, t, weight):
    """Per-sample regression loss in x0 coordinates with NFT's adaptive weight at the old policy:
    q(t) mean((t (v_theta - sg(v_target)))^2) / sg(mean|x_t - t v_old - x0|), mean over latent dims.
    t (v_theta - v_target) is the x0_hat difference (x0_hat = x_t - t v). Returns (N,)."""
    t = t.reshape(-1, *([1] * (x_t.dim() - 1)))
    dims = tuple(range(1, x_t.dim()))
    scale = (x_t - t * v_old - x0).abs().mean(dims).clamp_min(1e-5).detach()
    return weight * ((t * (v_theta - v_target.detach())) ** 2).mean(dims) / scale


def rvge_update(run, b, directions, mix, s2, args, gen, on_step):
    """RVGE's update: `update_loop` with the regression loss (`rvge_loss`) to the mixed target of each query at
    t = sigmas[j]: v_target = sum_k w_kj v_k, query weight q = sum_k w_kj q_k (`mix_targets`; w_kj = mix[k, j],
    sum_k w_kj = 1; v_k, q_k from `reward_target`). b: the iteration's rollout (leaves, groups, emb, pooled);
    directions: K RewardDirections (`value_directions`); mix (K, T); s2 the latent variance."""
    import torch

    mix_t = torch.as_tensor(mix, dtype=torch.float32)

    def policy_loss(nb, v_theta, v_old):
        with torch.no_grad():
            w = mix_t[:, nb.j].to(nb.x0.device)  # (K, B)
            targets = [
                reward_target(v_old, nb.s, d.rows(nb.i), s2, args.transfer_cap, args.transfer, args.query_weights)
                for d in directions
            ]
            v_target, q = mix_targets(targets, w)
        return rvge_loss(v_theta, v_target, v_old, nb.x_t, nb.x0, nb.s, weight=q)

    return update_loop(run, b, args, gen, on_step, policy_loss)


# =============================================================================
# Train loop
# =============================================================================


def train(args: Args, extra_rewards=None, judges=None):
    """The whole run: per iteration rollout -> rewards -> per-reward group directions (bandwidth
    per reward) -> regression update to the transferred targets -> soft update of "old" ->
    log / evaluate / checkpoint. ReCAST's credit (W for --credit recast, its D curves logged either way) is
    recast.py's, imported here. Returns the run folder."""
    from recast import credit  # the pairs estimator, alpha = 2; with --credit budgets W is uniform

    run = setup_run(args, extra_rewards, judges)
    start, state = start_or_resume(run, args)
    budgets, regressed = run.budgets, run.names if args.combine == "directions" else ["weighted"]  # one direction each
    bandwidths = parse_bandwidths(args.bandwidth, len(regressed))

    def on_step():  # after every optimizer step: the EMA of the trained LoRA (DiffusionNFT's evaluation weights)
        state["opt_steps"] += 1
        if args.ema:
            copy_adapter(run.transformer, "default", "ema", keep=ema_decay(state["opt_steps"]))

    bar = tqdm(
        range(start, args.iterations),
        desc="rvge",
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
        b = rollout_and_score(run, args, it, gen, coordinate_steps(args.coords, run.branch))
        t2 = time.perf_counter()
        # 2. normalised rewards (global std across processes); bandwidth, t_b and directions per reward
        n_valid, mean_R, std = global_stats(b.R, run.reduce)
        stop_if_a_reward_failed(run, it, n_valid, state)
        A = advantages(b.R, b.groups, std=std) if args.combine == "directions" else weighted_advantage(b, budgets, run)
        r = optimality(b.R, b.groups, std=std)  # for the pairs estimator of --credit recast
        sigmas = run.sigmas.double().numpy()
        state["level_stats"], credit_info, W = credit(
            credit_settings(args), state.get("level_stats"), r, std, b, budgets, sigmas, run.reduce
        )
        directions, s2, rvge_metrics = value_directions(
            b, A, run.sigmas, run.branch, bandwidths, regressed, args, run.reduce
        )
        mix = mixture_weights(W, budgets) if args.combine == "directions" else np.ones((1, len(sigmas) - 1))
        t3 = time.perf_counter()
        # 3. regression update of "default", then the soft update of "old"
        losses = rvge_update(run, b, directions, mix, s2, args, gen, on_step)
        copy_adapter(run.transformer, "default", "old", keep=old_decay(state["opt_steps"], args.old_decay))
        t4 = time.perf_counter()
        # 4. log, evaluate, checkpoint
        metrics = {
            **reward_metrics(run, it, b, n_valid, mean_R, losses),
            **rvge_metrics,
            **credit_info,
            "recast/sigmas": run.sigmas.tolist(),
            "time/rollout": b.t_rollout - t0,
            "time/reward": t2 - b.t_rollout,
            "time/regression": t3 - t2,
            "time/update": t4 - t3,
        }
        finish_iteration(run, args, it, metrics, state, before)
        bar.set_postfix({"reward": f"{metrics['reward/weighted']:.3f}", "loss": f"{metrics['loss/policy']:.4g}"})
    if run.acc.is_main_process:
        plot_run(run.out, run.names)
    run.acc.end_training()  # closes the --report-to tracker
    return run.out


# =============================================================================
# Arguments (flags in --help sections) and RVGE's checks
# =============================================================================


EMBEDDED_MODEL = str(Path(__file__).resolve().parent / "assets" / "shapes-sd3")  # runs from any folder


ARG_GROUPS = {  # --help sections, in this order: title -> what the flags set
    "method": "DiffusionRVGE: rewards, budgets, regression groups, directions and their transfer",
    "recast credit": "ReCAST's W, with --credit recast (the math is recast.py's)",
    "rollout": "prompts per iteration, trees and the sampler",
    "optimisation": "the regression loss, its timesteps, AdamW, the old policy and the LoRA",
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
    credit: str = flag("budgets", "method", choices=["budgets", "recast"])
    """budgets: reward k's direction weighted lambda_k / Lam at every step; recast: T W_kj / Lam with ReCAST's W (Renyi
    gains from the pairs estimator)"""
    combine: str = flag("directions", "method", choices=["directions", "reward"])
    """directions: one direction per reward (each normalised apart), mixed per step by w_kj; reward: one direction for
    the budget-weighted reward sum_k lambda_k R_k, normalised once, as DiffusionNFT forms one advantage (with
    --credit budgets only; --bandwidth one value)"""
    bandwidth: str = flag("auto", "method")
    """local (regress among the C siblings of a root, t_b = sigma at the last branch step), broad (among the R leaves
    with the same child index, one per root, t_b = 1), split (local for training queries t <= t_b, broad above) or
    auto (broad when more than --tie-threshold of the local groups tie, else split); one value or one per reward"""
    tie_threshold: float = flag(0.2, "method", min=0, max=1)
    """auto picks broad for a reward when the share of tied local groups exceeds this (smooth rewards: ~0; 0/1 rewards:
    0.45-0.85 in toy_gaussian.py 6d)"""
    coords: str = flag("clean", "method", choices=["clean", "noisy"])
    """regression coordinates: clean (final latents) or noisy (x0_hat on each trajectory one grid step after the group's
    branch time)"""
    transfer: str = flag("direct", "method", choices=["direct", "none"])
    """direct: d(t) = kappa(t) / kappa(t_b) d_B at query time t; none: d(t) = d_B (ablation)"""
    query_weights: str = flag("off", "method", choices=["on", "off"])
    """on: weight queries at t > t_b by kappa(t_b) / kappa(t) (it cancels the transfer there: toy_gaussian.py 6d); off:
    weight 1"""
    eta: float = flag(0.2, "method", gt=0)
    """first-order step size: d = eta Cov(x0, A) (0.2 matches DiffusionNFT's implied step at b = 1)"""
    kl_beta: float = flag(None, "method", gt=0)
    """trajectory-KL weight beta > 0: softmax(A / beta) tilt instead of the first-order direction"""
    transfer_cap: float = flag(4.0, "method", min=1)
    """cap on kappa(t) / kappa(t_b) in the direction transfer"""
    # recast credit
    tau: float = flag(1.0, "recast credit", min=0)
    """temperature of the profile in W's kernel lambda_k P~^tau (0: uniform W)"""
    eps: float = flag(1e-3, "recast credit", min=0, max=1)
    """profile smoothing P~ = (1 - eps) P + eps / T (> 0 keeps W unique)"""
    gain_ema: float = flag(0.999, "recast credit", min=0, lt=1)
    """discount of the level statistics across iterations (horizon ~ 1 / (1 - gain_ema) iterations); 0.999 as recast.py:
    W needs ~60 groups per level to resolve the embedded world's profiles (results/world-design/horizon.json)"""
    evidence: float = flag(2.0, "recast credit", min=0)
    """shrink each reward's profile towards uniform by rho = max(0, 1 - c p / Q), Q the chi^2 of its curve against
    uniform gains (0: no shrinkage)"""
    # rollout
    prompts_per_iter: int = flag(4, "rollout", min=1)
    """prompt groups per iteration and process (4 x 16 leaves: the 64 images of recast.py's default)"""
    n_roots: int = flag(4, "rollout", min=1)
    """independent noises per prompt (tree roots)"""
    n_branch: int = flag(4, "rollout", min=1)
    """copies C made of every state at each branch step; local groups hold C leaves, broad ones R = --n-roots (keep R =
    C for like-for-like bandwidths)"""
    branch_steps: str = flag("7", "rollout")
    """sampler steps j (0 < j < T - 1) at which states branch; leaves per prompt = n_roots * n_branch^len; local groups
    split at the last one (step 7 of 10: t_b = 0.46 on SD3's shift-3 grid)"""
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
    iterations: int = flag(120, "optimisation", min=1)
    """training iterations (rollout + update); an iteration costs about as much as recast.py's (64 images)"""
    base_reg: float = flag(1e-4, "optimisation", min=0)
    """weight of the velocity MSE to the frozen base model"""
    train_steps_per_leaf: int = flag(4, "optimisation", min=1)
    """training timesteps drawn (without replacement) from the T grid steps per leaf and iteration"""
    train_batch: int = flag(32, "optimisation", min=1)
    """micro-batch of (leaf, timestep) samples per optimizer step"""
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
    """run name (default rvge-<credit>-<seed>)"""
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
    if branch == "rotate":
        raise SystemExit(
            "--branch-steps rotate: RVGE's local groups split at one fixed step; give it, e.g. --branch-steps 7"
        )
    if args.sampler == "ode":
        branch = []  # independent samples: the broad groups are the prompt groups
    bandwidths = parse_bandwidths(args.bandwidth, len(names))
    if len(bandwidths) != len(names) or any(b not in BANDWIDTHS for b in bandwidths):
        raise SystemExit(
            f"--bandwidth {args.bandwidth!r}: give {', '.join(BANDWIDTHS[:-1])} or {BANDWIDTHS[-1]}, "
            f"once or once per reward ({len(names)})"
        )
    if not branch and any(b != "broad" for b in bandwidths):
        raise SystemExit(
            "local, split and auto bandwidths need branched rollouts (--sampler tree and a --branch-steps entry); "
            "or use --bandwidth broad"
        )
    if args.n_roots < 2:
        raise SystemExit(
            f"--n-roots {args.n_roots}: RVGE needs >= 2 independent roots per prompt "
            "(broad groups and the latent variance s2)"
        )
    if branch and args.n_branch < 2 and any(b != "broad" for b in bandwidths):
        raise SystemExit(
            f"--n-branch {args.n_branch}: local groups need >= 2 siblings; raise --n-branch or use --bandwidth broad"
        )
    if args.combine == "reward" and (args.credit == "recast" or "," in args.bandwidth):
        raise SystemExit(
            "--combine reward regresses one direction on the budget-weighted reward: it takes --credit budgets and "
            "one --bandwidth value (ReCAST's W and per-reward bandwidths are per-reward settings)"
        )
    if args.credit == "recast" and (args.n_roots < 2 or not branch):
        raise SystemExit(
            "--credit recast estimates gains from branched pairs: it needs --n-roots >= 2 and a --branch-steps entry"
        )
    check_files(args, names)
    args.out = run_folder(args)
    return names, budgets, branch


BANDWIDTHS = ("local", "broad", "split", "auto")


def parse_bandwidths(text, K):
    """--bandwidth: one of BANDWIDTHS for every reward, or one per reward."""
    values = [b.strip() for b in text.split(",")]
    return values * K if len(values) == 1 else values


def default_name(args):
    return f"rvge-{args.credit}-{args.seed}"


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
