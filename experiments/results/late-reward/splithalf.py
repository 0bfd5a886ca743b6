"""Split-half gradient cosine of DiffusionNFT's loss at the pretrained embedded model: is a reward learnable?

    OMP_NUM_THREADS=1 python experiments/results/late-reward/splithalf.py --rewards saturation,texture,grain \
        [--groups 64] [--splits 200] [--seed 0] [--out experiments/results/late-reward/splithalf.json]

For each reward k (and the same reward permuted within each prompt group, the control with no signal) and each
training timestep t_j (the sampler's grid, j = 0..T-1, as recast.py trains), the LoRA gradient of recast.py's
`nft_loss` is summed over two disjoint halves of the prompt groups, and the cosine between the two halves' gradients
is taken. A reward whose optimality tells the model something consistent gives the same direction from independent
groups (cosine > 0, rising with the number of groups); a reward whose spread within a group is noise the model
cannot act on gives the permuted reward's band around 0.

Everything is recast.py's own: `setup_run` (the pretrained embedded model, LoRA "default" = "old" = 0 at start),
`rollout_and_score` (branched tree rollouts of 8 prompt groups per iteration, the rewards), `global_stats` and
`optimality` (per-reward r in [0, 1], std over the iteration's groups), `noised_batch` (x_t = (1 - t) x0 + t eps,
fresh eps), `frozen_velocities` (v_old), `velocity` (v_theta) and `nft_loss` (b = --nft-b's default, 1). No update
is taken. The per-group gradients (LoRA parameters, 253,952 numbers) are kept as count sketches of --sketch
dimensions (random bucket and sign per parameter; inner products unbiased, cosine error ~ 1 / sqrt(sketch)), so that
any number of random splits can be drawn afterwards; one fixed split (the first half of the groups against the
second) is also accumulated exactly, and its exact cosines are compared with the sketch's (`sketch_error`).

Writes --out (JSON): per reward, per t_j and for the gradient summed over the late timesteps (t <= LATE_T) and over
all of them (what one update sums), the cosine's median and 5% / 95% quantiles over --splits random halvings,
for the reward and its permuted control, the exact split's cosines, and the per-group mean gradient norms; the
sketches themselves in experiments/results/late-reward/work/ (<out stem>.sketches.npz, not committed).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
import recast  # noqa: E402
from experiments import late_reward_world  # noqa: E402,F401  (registers the experiment's rewards and variant)

LATE_T = 0.5  # "late" training timesteps: t <= 0.5 (on the 10-step grid: 0.465, 0.278, 0.009)


def permute_within_groups(r, groups, rng):
    """r (N, K): each column's values shuffled among the leaves of each prompt group (independently per column)."""
    out = r.copy()
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        for k in range(r.shape[1]):
            out[idx, k] = r[rng.permutation(idx), k]
    return out


def split_cosines(G, splits, seed):
    """G (C, T, n_groups, m) sketched per-group gradients -> cosines (splits, C, T) of the two halves' sums over
    random halvings of the groups."""
    rng = np.random.default_rng(seed)
    n = G.shape[2]
    out = np.empty((splits, G.shape[0], G.shape[1]))
    for s in range(splits):
        perm = rng.permutation(n)
        a, b = G[:, :, perm[: n // 2]].sum(2), G[:, :, perm[n // 2 :]].sum(2)
        out[s] = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return out


def cos(a, b):
    return float((a * b).sum() / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rewards",
        required=True,
        help="comma-separated reward names (world.REWARDS, with experiments/late_reward_world.py's)",
    )
    ap.add_argument("--groups", type=int, default=64, help="prompt groups (8 per rollout iteration)")
    ap.add_argument("--splits", type=int, default=200, help="random halvings of the groups")
    ap.add_argument("--sketch", type=int, default=16384, help="count-sketch dimension of each per-group gradient")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "splithalf.json"))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    names = a.rewards.split(",")
    K, per_iter = len(names), 8
    iterations = -(-a.groups // per_iter)
    args = recast.parse_args(
        ["--rewards", a.rewards, "--budgets", ",".join(["1"] * K), "--seed", str(a.seed)]
        + ["--prompts-per-iter", str(per_iter), "--eval-every", "0", "--overwrite"]
        + ["--out", str(HERE / "work" / f"splithalf-{a.seed}")]
    )
    run = recast.setup_run(args)
    tr, sigmas, T = run.transformer, run.sigmas, args.steps
    params = recast.lora_params(tr, "default")
    sizes = [p.numel() for p in params]
    D = sum(sizes)
    hrng = np.random.default_rng(12345)  # the sketch's buckets and signs (fixed)
    bucket = torch.as_tensor(hrng.integers(a.sketch, size=D))
    sign = torch.as_tensor(hrng.choice([-1.0, 1.0], size=D), dtype=torch.float32)
    C = 2 * K  # columns: the rewards, then each permuted within groups
    n_groups = iterations * per_iter
    G = np.zeros((C, T, n_groups, a.sketch), np.float32)
    exact = torch.zeros((2, C, T, D))  # the fixed split: first half of the groups against the second
    norms = np.zeros((C, T, n_groups))
    prng = np.random.default_rng(a.seed + 1)
    gen = torch.Generator().manual_seed(a.seed + 2)  # training noise eps
    means = []
    t0 = time.time()
    for it in range(iterations):
        b = recast.rollout_and_score(run, args, it, recast.iteration_generator(a.seed, it))
        _, mean_R, std = recast.global_stats(b.R, run.reduce)
        means.append(mean_R.tolist())
        r = recast.optimality(b.R, b.groups, std=std)  # (N, K)
        r = np.concatenate([r, permute_within_groups(r, np.asarray(b.groups), prng)], 1)  # (N, 2K)
        r_t = torch.as_tensor(r, dtype=torch.float32)
        groups_t = torch.as_tensor(b.groups)
        for g in range(per_iter):
            gi = it * per_iter + g
            idx = torch.as_tensor(np.flatnonzero(np.asarray(b.groups) == g))
            for j in range(T):
                pairs = torch.stack([idx, torch.full_like(idx, j)], 1)
                nb = recast.noised_batch(pairs, b.leaves, groups_t, b.emb, b.pooled, sigmas, gen)
                v_old, _ = recast.frozen_velocities(tr, nb.x_t, nb.s, nb.cond, False)
                v_theta = recast.velocity(tr, nb.x_t, nb.s, *nb.cond)
                for c in range(C):
                    loss = recast.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, r_t[nb.i, c], b=args.nft_b).sum()
                    grads = torch.autograd.grad(loss, params, retain_graph=c < C - 1)
                    flat = torch.cat([gr.reshape(-1) for gr in grads])
                    norms[c, j, gi] = float(flat.norm())
                    G[c, j, gi] = torch.zeros(a.sketch).index_add_(0, bucket, sign * flat).numpy()
                    exact[int(gi >= n_groups // 2), c, j] += flat
        print(f"iteration {it + 1}/{iterations}: {time.time() - t0:.0f} s", flush=True)
    sketches = HERE / "work" / (Path(a.out).stem + ".sketches.npz")  # ~150 MB: kept out of git (work/)
    sketches.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(sketches, G=G, norms=norms)  # for other halvings or group counts later
    late = [j for j in range(T) if sigmas[j] <= LATE_T]
    G = np.concatenate([G, G[:, late].sum(1, keepdims=True), G.sum(1, keepdims=True)], 1)  # + late sum, all-t sum
    cosines = split_cosines(G, a.splits, a.seed)  # (splits, C, T + 2)
    half = n_groups // 2
    fixed_sketch = [[cos(G[c, j, :half].sum(0), G[c, j, half:].sum(0)) for j in range(T)] for c in range(C)]
    fixed_exact = [[cos(exact[0, c, j].numpy(), exact[1, c, j].numpy()) for j in range(T)] for c in range(C)]
    q = np.quantile(cosines, [0.05, 0.5, 0.95], axis=0)  # (3, C, T)
    res = {
        "command": " ".join(sys.argv),
        "rewards": names,
        "groups": n_groups,
        "leaves_per_group": int(len(b.groups) // per_iter),
        "splits": a.splits,
        "sketch": a.sketch,
        "seed": a.seed,
        "sigmas": sigmas[:T].tolist(),
        "columns": [f"t={float(x):.3f}" for x in sigmas[:T]] + [f"sum t<={LATE_T}", "sum all t"],
        "train_reward_mean": np.mean(means, 0).tolist(),
        "seconds": time.time() - t0,
        "sketch_error": float(np.abs(np.array(fixed_sketch) - np.array(fixed_exact)).max()),
        "cos": {},
    }
    for c in range(C):
        name = names[c % K] + ("" if c < K else " (permuted)")
        res["cos"][name] = {
            "q05": q[0, c].tolist(),
            "median": q[1, c].tolist(),
            "q95": q[2, c].tolist(),
            "mean": cosines[:, c].mean(0).tolist(),
            "fixed_split_exact": fixed_exact[c],
            "grad_norm_per_group": norms[c].mean(1).tolist(),
        }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(table(res))


def table(res):
    """Markdown: per reward, the median cosine [5%, 95%] over splits at each t, then its permuted control."""
    cols = res.get("columns") or [f"t={s:.3f}" for s in res["sigmas"]]
    lines = [
        f"split-half cosine of the LoRA gradient of nft_loss, {res['groups']} groups x {res['leaves_per_group']} "
        f"leaves, median [5%, 95%] over {res['splits']} random halvings (sketch error {res['sketch_error']:.3f})",
        "",
        "| reward | " + " | ".join(cols) + " |",
        "|---" * (1 + len(cols)) + "|",
    ]
    for name, c in res["cos"].items():
        cells = [f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}]" for lo, m, hi in zip(c["q05"], c["median"], c["q95"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
