"""DiffusionRVGE: regression-based value-gradient estimation, on top of DiffusionNFT.

Read top to bottom: RVGE's math (centred reward / clean-image cross-covariance directions, the Gaussian
posterior-variance transfer, target velocities, regression groups and bandwidth by reward continuity), its glue
(directions per reward, the regression loss and update), the train loop, the flags and RVGE's checks, the entry points.
DiffusionNFT itself (optimality, schedules, sampler steps, tree rollouts, the update loop) is nft.py, written once for
both methods (recast.py has the same skeleton: its sections in the same order); the model (SD3 with LoRA: loading, the
transformer call, encode, decode) is sd3.py; the run machinery (flags, checks, run folders, resume, checkpoints,
trackers, figures) is kit/'s; --credit recast takes ReCAST's W from recast.py (`recast.credit`). The paper's full text
was not available: each "NOTES.md §n" names a section of our reconstruction of the method, and derivations.ipynb derives
each formula.

Notation map (code name -> symbol)
    lam      (K,)      reward budgets lambda_k, not normalised; Lam = sum_k lambda_k
    sigmas   (T+1,)    sampler grid s_0 = 1 > s_1 > ... > s_T = 0 (t = 1 is pure noise)
    A        (N, K)    normalised rewards: clipped advantages (R - group mean) / global std (`nft.advantages`)
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

Where to change what (nft.x: in nft.py; sd3.x: in sd3.py; flags.x, session.x, ...: in kit/)
    flags       Args (a field, its --help section in ARG_GROUPS, its checks), validate; checks.check_common;
                the flags both scripts share: nft.NFTArgs (rewards, budgets, rollout, optimisation),
                flags.RunArgs (evaluation, I/O, reward models, controls)
    sampler     nft.tree_rollout (trees; nft.sde_step / nft.sde_continue after a branch, nft.ode_step or
                nft.dpm2_step before), nft.rollout_and_score (which adapter samples, what is decoded and scored;
                probes for --coords noisy)
    rewards     kit/reward_models.py (REWARD_MODELS, build_rewards; README "Add a reward"), nft.score,
                worlds.reward_extras; reward -> advantage: nft.advantages (nft.global_stats's std)
    directions  value_directions: regression_groups, pick_bandwidth, group_directions -> value_direction
                (--combine reward: one direction on the budget-weighted reward, weighted_advantage)
    transfer    reward_target: uses_local, target_velocity (transfer_ratio, posterior_var), query_weight
    credit      mixture_weights (w_kj from W); W itself is recast.credit (--credit recast)
    loss        rvge_loss, mix_targets, rvge_update; the loop shared with recast.py: nft.update_loop
                (with nft.frozen_velocities, nft.optimizer_step)
    old policy  nft.old_decay (the soft update of "old" each iteration, sd3.copy_adapter), nft.ema_decay (--ema)
    logging     nft.reward_metrics + train's metrics line, session.finish_iteration (metrics.jsonl,
                figures.log_to_trackers, checkpoints), progress bar in train, figures in figures.plot_run,
                show_evaluation; the held-out evaluation session.evaluate (with nft.ode_sample); the closing lines
                (before -> after, the checkpoint to load) in figures.print_summary
    the loop    train (steps 1-4), setup_run (session.Run), folders.start_or_resume
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
import sd3
from kit.checks import check_common, check_files
from kit.figures import plot_run, print_summary
from kit.flags import RUN_ARG_GROUPS, RunArgs, parse_flags
from kit.folders import run_folder, start_or_resume
from kit.preflight import dry_run
from kit.session import Run, evaluate_before, finish_iteration, load_run, stop_if_a_reward_failed
from nft import NFTArgs, flag
from recast import CreditSettings, credit

# =============================================================================
# NOTES.md §4.1-§4.3, our reconstruction: value directions and their transfer across t
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
    (experiments/toy_checks.py 6d), so it is off by default (--query-weights)."""
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
# NOTES.md §4.4, our reconstruction: regression groups and bandwidth by reward continuity
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
    On broad groups (independent roots) this is unbiased; siblings would bias it low."""
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
    (experiments/toy_checks.py 6d). t (B,) tensor; t_b float or (B,)."""
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
    """--combine reward: the advantage (N, 1) of the one reward sum_k lambda_k R_k (`nft.combine_raw`), normalised
    once with its global std over all processes, as DiffusionNFT's multi-reward baseline forms it
    (`recast.nft_baseline`)."""
    Rc = nft.combine_raw(b.R, budgets)[:, None]
    _, _, std = nft.global_stats(Rc, run.reduce)
    return nft.advantages(Rc, b.groups, std=std)


def credit_settings(args):
    """rvge.py's flags for recast.credit: W learned with --credit recast (else uniform, the budgets' lambda / T), by
    ReCAST's pairs estimator at order 2 on RVGE's trees (CreditSettings' defaults)."""
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
    """RVGE's update: `nft.update_loop` with the regression loss (`rvge_loss`) to the mixed target of each query at
    t = sigmas[j]: v_target = sum_k w_kj v_k, query weight q = sum_k w_kj q_k (`mix_targets`; w_kj = mix[k, j],
    sum_k w_kj = 1; v_k, q_k from `reward_target`). b: the iteration's rollout (leaves, groups, emb, pooled);
    directions: K RewardDirections (`value_directions`); mix (K, T); s2 the latent variance."""
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

    return nft.update_loop(run, b, args, gen, on_step, policy_loss)


# =============================================================================
# Train loop
# =============================================================================


def train(args: Args, extra_rewards=None, judges=None):
    """The whole run: per iteration rollout -> rewards -> per-reward group directions (bandwidth
    per reward) -> regression update to the transferred targets -> soft update of "old" ->
    log / evaluate / checkpoint. ReCAST's credit (W for --credit recast, its D curves logged either way) is
    recast.py's `credit`: the pairs estimator at alpha = 2; with --credit budgets W is uniform. Returns the run
    folder."""
    run = setup_run(args, extra_rewards, judges)
    start, state = start_or_resume(run, args)
    budgets, regressed = run.budgets, run.names if args.combine == "directions" else ["weighted"]  # one direction each
    bandwidths = parse_bandwidths(args.bandwidth, len(regressed))

    def on_step():  # after every optimizer step: the EMA of the trained LoRA (DiffusionNFT's evaluation weights)
        state["opt_steps"] += 1
        if args.ema:
            sd3.copy_adapter(run.transformer, "default", "ema", keep=nft.ema_decay(state["opt_steps"]))

    bar = tqdm(
        range(start, args.iterations),
        desc="rvge",
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
        b = nft.rollout_and_score(run, args, it, gen, coordinate_steps(args.coords, run.branch))
        t2 = time.perf_counter()
        # 2. normalised rewards (global std across processes); bandwidth, t_b and directions per reward
        n_valid, mean_R, std = nft.global_stats(b.R, run.reduce)
        stop_if_a_reward_failed(run, it, n_valid, state)
        if args.combine == "directions":
            A = nft.advantages(b.R, b.groups, std=std)
        else:
            A = weighted_advantage(b, budgets, run)
        r = nft.optimality(b.R, b.groups, std=std)  # for the pairs estimator of --credit recast
        sigmas = run.sigmas.double().numpy()
        # ReCAST's estimator runs whatever --credit is: its D curves are logged either way (W uniform but for recast)
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
        sd3.copy_adapter(run.transformer, "default", "old", keep=nft.old_decay(state["opt_steps"], args.old_decay))
        t4 = time.perf_counter()
        # 4. log, evaluate, checkpoint
        metrics = {
            **nft.reward_metrics(run, it, b, n_valid, mean_R, losses),
            **rvge_metrics,
            **credit_info,
            "recast/sigmas": run.sigmas.tolist(),
            "time/rollout": b.t_rollout - t0,
            "time/reward": t2 - b.t_rollout,
            "time/regression": t3 - t2,
            "time/update": t4 - t3,
        }
        drawn = finish_iteration(run, args, it, metrics, state, before, nft.ode_sample, b)
        before = None
        bar.set_postfix({"reward": f"{metrics['reward/weighted']:.3f}", "loss": f"{metrics['loss/policy']:.4g}"})
    if run.acc.is_main_process:
        if not drawn:  # else the last evaluation drew them from the same metrics
            plot_run(run.out, run.names, shows_W(args))
        print_summary(run.out)  # before -> after, the checkpoint to load
    run.acc.end_training()  # closes the --report-to tracker
    return run.out


# =============================================================================
# Arguments (flags in --help sections) and RVGE's checks
# =============================================================================


ARG_GROUPS = {  # --help sections, in this order: title -> what the flags set
    "method": "DiffusionRVGE: rewards, budgets, regression groups, directions and their transfer",
    "recast credit": "ReCAST's W, with --credit recast (the math is recast.py's)",
    "rollout": "prompts per iteration, trees and the sampler",
    "optimisation": "the regression loss, its timesteps, AdamW, the old policy and the LoRA",
    **RUN_ARG_GROUPS,  # evaluation, I/O, reward models, controls: kit.flags.RunArgs's
}


@dataclass
class Args(NFTArgs, RunArgs):
    """RVGE's flags, and the rollout and optimisation defaults it changes; --rewards, --budgets, the rollout and
    optimisation flags both scripts share are nft.NFTArgs's, the evaluation, I/O, reward-model and control
    flags kit.flags.RunArgs's."""

    # method
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
    """auto picks broad for a reward when the share of tied local groups exceeds this (smooth rewards tie rarely, 0/1
    rewards often: experiments/toy_checks.py 6d)"""
    coords: str = flag("clean", "method", choices=["clean", "noisy"])
    """regression coordinates: clean (final latents) or noisy (x0_hat on each trajectory one grid step after the group's
    branch time)"""
    transfer: str = flag("direct", "method", choices=["direct", "none"])
    """direct: d(t) = kappa(t) / kappa(t_b) d_B at query time t; none: d(t) = d_B (ablation)"""
    query_weights: str = flag("off", "method", choices=["on", "off"])
    """on: weight queries at t > t_b by kappa(t_b) / kappa(t) (it cancels the transfer there:
    experiments/toy_checks.py 6d); off: weight 1"""
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
    """discount of the level statistics across iterations (horizon ~ 1 / (1 - gain_ema) iterations); the default as
    recast.py's (NOTES.md §3.3: how many groups per level W needs)"""
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
    # optimisation
    iterations: int = flag(120, "optimisation", min=1)
    """training iterations (rollout + update); an iteration costs about as much as recast.py's (64 images)"""
    base_reg: float = flag(1e-4, "optimisation", min=0)
    """weight of the velocity MSE to the frozen base model (DiffusionNFT's 1e-4)"""


def validate(args: Args, extra_rewards=None):
    """Every check on the user's input, before any model is loaded or any file in a run folder changes: the shared
    ones (check_common, check_files) and this method's. Resolves the run folder (args.out). Returns (reward names,
    budgets, branch steps). Raises SystemExit with the problem and the fix. --dry-run: those that need no model, GPU,
    prompt file or run folder."""
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
    if args.dry_run:  # no prompt file, run folder or model: the plan needs none of them
        return names, budgets, branch
    check_files(args, names)
    args.out = run_folder(args, default_name(args))
    return names, budgets, branch


BANDWIDTHS = ("local", "broad", "split", "auto")


def parse_bandwidths(text, K):
    """--bandwidth: one of BANDWIDTHS for every reward, or one per reward."""
    values = [b.strip() for b in text.split(",")]
    return values * K if len(values) == 1 else values


def default_name(args):
    """--name's default."""
    return f"rvge-{args.credit}-{args.seed}"


def shows_W(args):
    """Whether W is part of the run's training signal (credit.png draws it): with --credit recast only."""
    return args.credit == "recast"


# =============================================================================
# The script's entry points: its flags, its run, main
# =============================================================================


def parse_args(argv=None) -> Args:
    """This script's Args from the command line (`flags.parse_flags`; --resume DIR reads DIR/config.json)."""
    return parse_flags(argv, Args, ARG_GROUPS, __doc__, Path(__file__).stem, fixed=("credit",))


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
