"""The gate for candidate (a), `lines_phase` (the texture lines' signed amplitude at one fixed phase of the image
grid, textured captions only), parts 1 and 2 as written in README.md "Candidate (a)" before the runs.

    OMP_NUM_THREADS=1 python experiments/results/late-reward/phase_gate.py profile [--iterations 192]
    OMP_NUM_THREADS=1 python experiments/results/late-reward/phase_gate.py splithalf [--groups 128]
    python experiments/results/late-reward/phase_gate.py tables      # gate.md from the two result files

Another candidate on another world (candidate (b), README.md section 8): --model PIPELINE_FOLDER (a world variant,
`python experiments/late_reward_world.py build --variant signed`), --candidate REWARD (row 0 of both parts, in place of
lines_phase), --prefix NAME (the result files NAME_profile.json, NAME_splithalf.json, NAME.md) and --n-roots N
(N x 4 leaves per prompt group; the per-group signal to noise grows with leaves - 1: NOTES.md, "A late reward by
design").

profile (part 1): recast.py's own rotated-tree rollouts of the pretrained model, no update (the code path of
protocol.measure_profiles), ITERATIONS x 8 prompt groups; every group's `level_observations` is kept on its own,
so that groups can be resampled: a paired bootstrap (the same resampled groups for every reward) of each reward's
area under its share-of-D(0) curve (the mean of D(t) / D(0) over the 8 inner levels: larger = decided earlier) and of
its t_half (the first level, from t = 1 down, at which the share reaches 1/2, interpolated in t), against saturation's
and geneval's; the evidence weight rho of `recast.credit_profiles` on all groups; and the pretrained model's choice
(the share of textured samples with lines_phase > 0, < 0, and the groups whose lines_phase ties).

splithalf (part 2): at the pretrained model, for each of 128 prompt groups and each training timestep t_j, the LoRA
gradient of nft.nft_loss is linear in the optimality r: the group's gradient for any reward is
A + sum_i r_i D_i with A = grad sum_i L_i(r = 0) and D_i = grad (L_i(r = 1) - L_i(r = 0)), i over the group's leaves.
So A and the D_i are computed once (9 backward passes a group and timestep) and kept as count sketches (16,384
buckets), and every reward and every within-group permutation of it (the null, --permutations of them) costs no
backward pass. From the sketches' Gram matrix per timestep: the split-half cosine (median over --halvings random
halvings; the same halvings for every column) of each reward against the band of its permutations (5% / 95% over
permutations of the same median; p = (1 + #permutations >= observed) / (1 + permutations)); the per-group signal to
noise s(t) = (mean pairwise inner product of two groups' gradients) / (mean squared distance of a group's gradient from
the groups' mean), with a 95% bootstrap interval over groups; the absolute signal |mu(t)| (the square root of the
mean pairwise inner product) and the share of it at t <= 0.47. One fixed split's cosine is also accumulated exactly
for the true rewards (`sketch_error`: the largest difference to the sketch's).
Writes phase_gate_profile.json and phase_gate_splithalf.json here; the sketches go to work/ (not committed).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import late_reward_world  # noqa: E402,F401  (registers the experiment's rewards and variant)

PROFILE_REWARDS = ("lines_phase", "saturation", "geneval", "grain", "texture_lines")
SPLIT_REWARDS = ("lines_phase", "saturation", "grain", "texture_lines")
LATE_T = 0.47  # the gate's "late": t <= 0.47 (the 10-step grid's 0.465, 0.278, 0.009)
EARLY_T = 0.7  # part 3's "early": t >= 0.7 (the grid's 1.0 to 0.707)


MODEL = None  # --model: the pipeline folder (None: the shipped embedded model)
PREFIX = "phase_gate"  # --prefix: the result files' names
N_ROOTS = None  # --n-roots: roots per prompt (recast.py's; None: its default, 2, i.e. 8 leaves per group)


def use_candidate(candidate, model=None, prefix="phase_gate", n_roots=None):
    """Row 0 of both parts (the candidate the gate reads), the pipeline folder, the result files' prefix and the
    roots per prompt group (leaves per group = n_roots x 4)."""
    global PROFILE_REWARDS, SPLIT_REWARDS, MODEL, PREFIX, N_ROOTS
    PROFILE_REWARDS = (candidate,) + tuple(r for r in PROFILE_REWARDS[1:] if r != candidate)
    SPLIT_REWARDS = (candidate,) + tuple(r for r in SPLIT_REWARDS[1:] if r != candidate)
    MODEL, PREFIX, N_ROOTS = model, prefix, n_roots


def world_of_run():
    import world as shapes_world

    return shapes_world.world_id(MODEL) if MODEL else shapes_world.world_id()


def setup(rewards, seed, prompts, out):
    import nft  # noqa: F401  (the scripts' own modules)
    import recast

    args = recast.parse_args(
        ["--rewards", ",".join(rewards), "--budgets", ",".join(["1"] * len(rewards)), "--seed", str(seed)]
        + ["--prompts-per-iter", str(prompts), "--eval-every", "0", "--overwrite", "--out", str(out)]
        + (["--model", str(MODEL)] if MODEL else [])
        + (["--n-roots", str(N_ROOTS)] if N_ROOTS else [])
    )
    return args, recast.setup_run(args)


def gate_draws(run, args, iterations, seed, gen, t0):
    """The split-half's draws, in its order (signed_design.py repeats them): per iteration of 8 prompt groups the
    rollout (`iteration_generator(seed, it)`) and each reward's optimality r; per group and training timestep j the
    noised batch of the group's leaves at t_j (`gen`) and the old policy's velocity there. Yields (group index, the
    group's leaf indices, rollout, r, j, noised batch, v_old); prints each iteration's time since t0."""
    import torch

    import nft

    for it in range(iterations):
        b = nft.rollout_and_score(run, args, it, nft.iteration_generator(seed, it))
        r = nft.optimality(b.R, b.groups, std=nft.global_stats(b.R, run.reduce)[2])
        groups_t = torch.as_tensor(b.groups)
        for g in range(8):
            idx = torch.as_tensor(np.flatnonzero(np.asarray(b.groups) == g))
            for j in range(args.steps):
                pairs = torch.stack([idx, torch.full_like(idx, j)], 1)
                nb = nft.noised_batch(pairs, b.leaves, groups_t, b.emb, b.pooled, run.sigmas, gen)
                v_old, _ = nft.frozen_velocities(run.transformer, nb.x_t, nb.s, nb.cond, False)
                yield it * 8 + g, idx, b, r, j, nb, v_old
        print(f"iteration {it + 1}/{iterations}: {time.time() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------ part 1: profiles
def profile(a):
    import torch

    import nft
    import recast

    torch.set_num_threads(1)
    args, run = setup(PROFILE_REWARDS, a.seed, 8, HERE / "work" / f"{PREFIX}-profile")
    T = args.steps
    obs_n, obs_s1, choice, t0 = [], [], [], time.time()
    for it in range(a.iterations):
        b = nft.rollout_and_score(run, args, it, nft.iteration_generator(a.seed, it))
        r = nft.optimality(b.R, b.groups, std=nft.global_stats(b.R, run.reduce)[2])
        groups = np.asarray(b.groups)
        for g in np.unique(groups):
            rows = groups == g
            n, s1, _ = recast.level_observations(r[rows], groups[rows], b.ancestry[rows], b.layouts, T)
            obs_n.append(n)
            obs_s1.append(s1)
            choice.append([b.prompts[g], b.R[rows, 0].tolist()])
        if (it + 1) % 16 == 0:
            print(f"iteration {it + 1}/{a.iterations}: {time.time() - t0:.0f} s", flush=True)
    (HERE / "work").mkdir(exist_ok=True)
    np.savez_compressed(HERE / "work" / f"{PREFIX}_profile_groups.npz", n=np.array(obs_n), s1=np.array(obs_s1))
    res = profile_stats(np.array(obs_n), np.array(obs_s1), run.sigmas.double().numpy(), a.resamples, a.seed)
    values = np.array([v for _, vals in choice for v in vals])
    ties = sum(np.ptp(vals) == 0 for _, vals in choice)
    named = values[values != 0]
    res.update(
        command=" ".join(["python", *sys.argv]),
        rewards=list(PROFILE_REWARDS),
        iterations=a.iterations,
        seconds=time.time() - t0,
        world=world_of_run(),
        choice={
            "samples": int(len(values)),
            "nonzero": int(len(named)),
            "positive_share_of_nonzero": float((named > 0).mean()) if len(named) else None,
            "mean": float(values.mean()),
            "groups": len(choice),
            "tied_groups": int(ties),
        },
    )
    (HERE / f"{PREFIX}_profile.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("boot",)}, indent=1)[:4000])


def shares(D, sigmas):
    """(share (K, T+1) = D(t) / D(0), area (K,), t_half (K,)) from D (`recast.level_curves`)."""
    share = D / D[:, -1:]
    inner = list(range(1, len(sigmas) - 1))
    area = np.nanmean(share[:, inner], 1)
    t_half = np.full(D.shape[0], np.nan)
    for k in range(D.shape[0]):
        for j in range(1, len(sigmas)):
            if share[k, j] >= 0.5:  # sigmas fall with j: the first level from t = 1 down
                lo = share[k, j - 1] if j > 1 else 0.0
                f = (0.5 - lo) / max(share[k, j] - lo, 1e-12)
                t_half[k] = sigmas[j - 1] + f * (sigmas[j] - sigmas[j - 1])
                break
    return share, area, t_half


def profile_stats(n, s1, sigmas, resamples, seed):
    """Point values on all groups and a paired bootstrap over groups (the same draws for every reward)."""
    import recast

    K = s1.shape[1]
    tot = (n.sum(0), s1.sum(0), (s1**2).sum(0))
    D, se = recast.level_curves(*tot)
    share, area, t_half = shares(D, sigmas)
    rho = recast.credit_profiles(D, se, sigmas, tot[0])[3]
    rng = np.random.default_rng(seed)
    boot_area, boot_half = np.empty((resamples, K)), np.empty((resamples, K))
    for b in range(resamples):
        idx = rng.integers(len(n), size=len(n))
        D_b = recast.level_curves(n[idx].sum(0), s1[idx].sum(0), (s1[idx] ** 2).sum(0))[0]
        _, boot_area[b], boot_half[b] = shares(D_b, sigmas)
    out = {
        "sigmas": sigmas.tolist(),
        "groups_per_level": n.sum(0).tolist(),
        "share": np.where(np.isfinite(share), share, None).tolist(),
        "share_se": np.where(np.isfinite(se / D[:, -1:]), se / D[:, -1:], None).tolist(),
        "D0": D[:, -1].tolist(),
        "rho": rho.tolist(),
        "area": area.tolist(),
        "t_half": np.where(np.isfinite(t_half), t_half, None).tolist(),
        "resamples": resamples,
        "diff": {},
    }
    for k in range(1, K):  # the candidate (row 0) minus each other reward, paired
        da, dh = boot_area[:, 0] - boot_area[:, k], boot_half[:, 0] - boot_half[:, k]
        dh = dh[np.isfinite(dh)]
        out["diff"][PROFILE_REWARDS[k]] = {
            "area": [float(area[0] - area[k]), *np.quantile(da, [0.025, 0.975]).tolist()],
            "t_half": [float(t_half[0] - t_half[k]), *(np.quantile(dh, [0.025, 0.975]).tolist() if len(dh) else [])],
            "t_half_resamples": int(len(dh)),
        }
    return out


# ------------------------------------------------------------------ part 2: split-half
def splithalf(a):
    import torch

    import nft

    torch.set_num_threads(1)
    args, run = setup(SPLIT_REWARDS, a.seed, 8, HERE / "work" / f"{PREFIX}-splithalf")
    tr, sigmas, T, K = run.transformer, run.sigmas, args.steps, len(SPLIT_REWARDS)
    params = nft.lora_params(tr, "default")
    D = sum(p.numel() for p in params)
    hrng = np.random.default_rng(12345)  # the sketch's buckets and signs (fixed)
    bucket = torch.as_tensor(hrng.integers(a.sketch, size=D))
    sign = torch.as_tensor(hrng.choice([-1.0, 1.0], size=D), dtype=torch.float32)
    iterations = -(-a.groups // 8)
    n_groups = iterations * 8
    leaves = args.n_roots * args.n_branch
    basis = np.zeros((n_groups, T, 1 + leaves, a.sketch), np.float32)  # A, then D_1..D_leaves
    R_all = np.zeros((n_groups, leaves, K))
    r_all = np.zeros((n_groups, leaves, K))
    exact = torch.zeros((2, K, T, D))
    gen, t0 = torch.Generator().manual_seed(a.seed + 2), time.time()

    def sketch(flat):  # (m, D) -> (m, sketch)
        return torch.zeros(flat.shape[0], a.sketch).index_add_(1, bucket, sign * flat).numpy()

    for gi, idx, b, r, j, nb, v_old in gate_draws(run, args, iterations, a.seed, gen, t0):
        if j == 0:
            R_all[gi], r_all[gi] = b.R[idx.numpy()], r[idx.numpy()]
        v_theta = nft.velocity(tr, nb.x_t, nb.s, *nb.cond)
        ones = torch.ones(len(idx))
        l1 = nft.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, ones, b=args.nft_b)
        l0 = nft.nft_loss(v_theta, v_old, nb.x_t, nb.x0, nb.s, 0 * ones, b=args.nft_b)
        rows = [torch.cat([x.reshape(-1) for x in torch.autograd.grad(l0.sum(), params, retain_graph=True)])]
        for i in range(len(idx)):
            grads = torch.autograd.grad(l1[i] - l0[i], params, retain_graph=i < len(idx) - 1)
            rows.append(torch.cat([x.reshape(-1) for x in grads]))
        flat = torch.stack(rows)
        basis[gi, j] = sketch(flat)
        rr = torch.as_tensor(r_all[gi], dtype=torch.float32)  # (leaves, K)
        exact[int(gi >= n_groups // 2), :, j] += flat[0] + rr.T @ flat[1:]
    work = HERE / "work"
    work.mkdir(exist_ok=True)
    np.savez(work / f"{PREFIX}_splithalf_basis.npz", basis=basis, R=R_all, r=r_all)
    fixed_exact = [
        [float(torch.nn.functional.cosine_similarity(exact[0, k, j], exact[1, k, j], 0)) for j in range(T)]
        for k in range(K)
    ]
    res = splithalf_stats(basis, r_all, sigmas[:T].double().numpy(), a)
    sk = np.array([[res["cos"][name]["fixed_split"][j] for j in range(T)] for name in SPLIT_REWARDS])
    res.update(
        command=" ".join(["python", *sys.argv]),
        rewards=list(SPLIT_REWARDS),
        groups=n_groups,
        leaves_per_group=leaves,
        seconds=time.time() - t0,
        fixed_split_exact=fixed_exact,
        sketch_error=float(np.abs(sk - np.array(fixed_exact)).max()),
        train_reward_mean=R_all.reshape(-1, K).mean(0).tolist(),
        world=world_of_run(),
    )
    (HERE / f"{PREFIX}_splithalf.json").write_text(json.dumps(res, indent=1))
    print(split_table(res))


def grams(basis, sigmas):
    """Per column of the analysis (each timestep, then the sum over t <= LATE_T and over all t): the Gram matrix of
    every group's basis vectors, (C, n_groups, 1 + leaves, n_groups, 1 + leaves)."""
    late = [j for j in range(basis.shape[1]) if sigmas[j] <= LATE_T]
    cols = [basis[:, j] for j in range(basis.shape[1])] + [basis[:, late].sum(1), basis.sum(1)]
    out = []
    for B in cols:
        flat = B.reshape(-1, B.shape[-1]).astype(np.float64)
        out.append((flat @ flat.T).reshape(B.shape[0], B.shape[1], B.shape[0], B.shape[1]))
    return np.array(out)


def group_gram(gram, r):
    """Gram (n, n) of the groups' gradients A_g + sum_i r_gi D_gi for optimalities r (n, leaves)."""
    w = np.concatenate([np.ones((r.shape[0], 1)), r], 1)  # (n, 1 + leaves)
    return np.einsum("ga,gahb,hb->gh", w, gram, w)


def halving_cosines(G, halves):
    """Cosine of the two halves' summed gradients for each halving (H, n) 0/1 indicator of the first half."""
    a, b = halves, 1.0 - halves
    ab, aa, bb = (np.einsum("hg,gk,hk->h", x, G, y) for x, y in ((a, b), (a, a), (b, b)))
    return ab / np.sqrt(np.maximum(aa * bb, 1e-300))


def signal(G, w=None):
    """(s, mu2, noise2) with group weights w (bootstrap counts; default 1): mu2 the mean inner product of two
    different groups' gradients (unbiased for |mu|^2), noise2 the mean squared distance from the groups' mean."""
    w = np.ones(len(G)) if w is None else w
    n = w.sum()
    total, diag = w @ G @ w, (w * np.diag(G)).sum()
    pairs = n * n - (w * w).sum()
    mu2 = (total - (w * w * np.diag(G)).sum()) / max(pairs, 1)
    noise2 = (diag - total / n) / max(n - 1, 1)
    return mu2 / max(noise2, 1e-300), mu2, noise2


def splithalf_stats(basis, r_all, sigmas, a):
    rng = np.random.default_rng(a.seed)
    n, T = basis.shape[0], basis.shape[1]
    gram = grams(basis, sigmas)
    halves = np.zeros((a.halvings, n))
    for h in range(a.halvings):
        halves[h, rng.permutation(n)[: n // 2]] = 1.0
    fixed = np.zeros((1, n))
    fixed[0, : n // 2] = 1.0
    perms = [np.array([rng.permutation(r_all.shape[1]) for _ in range(n)]) for _ in range(a.permutations)]
    columns = [f"t={s:.3f}" for s in sigmas] + [f"sum t<={LATE_T}", "sum all t"]
    res = {"columns": columns, "halvings": a.halvings, "permutations": a.permutations, "cos": {}}
    boot = [rng.multinomial(n, np.ones(n) / n) for _ in range(a.resamples)]
    for k, name in enumerate(SPLIT_REWARDS):
        r = r_all[:, :, k]
        entry = {"median": [], "null_q05": [], "null_q95": [], "p": [], "fixed_split": [], "s": [], "s_ci": []}
        entry.update(mu=[])
        Gs = [group_gram(gram[c], r) for c in range(len(columns))]  # the groups' Gram per column, for every draw
        for c, G in enumerate(Gs):
            obs = float(np.median(halving_cosines(G, halves)))
            null = [
                float(np.median(halving_cosines(group_gram(gram[c], np.take_along_axis(r, p, 1)), halves)))
                for p in perms
            ]
            s, mu2, _ = signal(G)
            sb = [signal(G, w.astype(float))[0] for w in boot]
            entry["median"].append(obs)
            entry["null_q05"].append(float(np.quantile(null, 0.05)))
            entry["null_q95"].append(float(np.quantile(null, 0.95)))
            entry["p"].append((1 + sum(x >= obs for x in null)) / (1 + len(null)))
            entry["fixed_split"].append(float(halving_cosines(G, fixed)[0]))
            entry["s"].append(float(s))
            entry["s_ci"].append(np.quantile(sb, [0.025, 0.975]).tolist())
            entry["mu"].append(float(np.sqrt(max(mu2, 0.0))))
        mus = np.array(entry["mu"][:T])
        late = sigmas <= LATE_T
        entry["late_share"] = float(mus[late].sum() / max(mus.sum(), 1e-300))
        share_b = []
        for w in boot:
            m = np.array([np.sqrt(max(signal(Gs[c], w.astype(float))[1], 0.0)) for c in range(T)])
            share_b.append(m[late].sum() / max(m.sum(), 1e-300))
        entry["late_share_ci"] = np.quantile(share_b, [0.025, 0.975]).tolist()
        res["cos"][name] = entry
        print(f"{name}: done", flush=True)
    return res


def split_table(res):
    cols = res["columns"]
    lines = [
        f"Split-half cosine of the LoRA gradient of nft_loss, {res['groups']} groups x {res['leaves_per_group']} "
        f"leaves: median over {res['halvings']} halvings [the band of {res['permutations']} within-group "
        f"permutations: 5%, 95%] (p); sketch error {res['sketch_error']:.3f}",
        "",
        "| reward | " + " | ".join(cols) + " |",
        "|---" * (1 + len(cols)) + "|",
    ]
    for name, e in res["cos"].items():
        cells = [
            f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}] ({p:.3f})"
            for m, lo, hi, p in zip(e["median"], e["null_q05"], e["null_q95"], e["p"])
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per-group signal to noise s(t) [95% bootstrap over groups]:",
        "",
        "| reward | " + " | ".join(cols) + " | share of |mu| at t <= 0.47 |",
        "|---" * (2 + len(cols)) + "|",
    ]
    for name, e in res["cos"].items():
        cells = [f"{s:.3f} [{lo:.3f}, {hi:.3f}]" for s, (lo, hi) in zip(e["s"], e["s_ci"])]
        lo, hi = e["late_share_ci"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {e['late_share']:.2f} [{lo:.2f}, {hi:.2f}] |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["profile", "splithalf", "weights", "tables"])
    ap.add_argument("--iterations", type=int, default=192, help="profile: iterations of 8 prompt groups")
    ap.add_argument("--groups", type=int, default=128, help="splithalf: prompt groups")
    ap.add_argument("--permutations", type=int, default=100, help="splithalf: within-group permutations (null)")
    ap.add_argument("--halvings", type=int, default=100, help="splithalf: random halvings of the groups")
    ap.add_argument("--sketch", type=int, default=16384, help="splithalf: count-sketch buckets")
    ap.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples over groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="pipeline folder (default: the shipped embedded model)")
    ap.add_argument("--candidate", default="lines_phase", help="the reward the gate reads (row 0)")
    ap.add_argument("--prefix", default="phase_gate", help="result files: PREFIX_profile.json, _splithalf.json, .md")
    ap.add_argument("--n-roots", type=int, default=None, help="roots per prompt group (recast.py's; default 2)")
    a = ap.parse_args(argv)
    use_candidate(a.candidate, a.model, a.prefix, a.n_roots)
    {"profile": profile, "splithalf": splithalf, "weights": weights, "tables": tables}[a.part](a)


def step_arms(t):
    """Part 3's two step-weight rows (label -> (T,)): weight only at t >= EARLY_T or only at t <= LATE_T, equal in
    loss units over the arm's steps, summing to 1 (one reward at budget 1). With one reward there is no share between
    rewards to equalise: recast.py's loss is sum_j T W_j L_j over a total that is always T, and AdamW divides each
    parameter's step by its own gradient scale, so the two arms take updates of the same size whatever the loss's
    scale at their steps (`weights` prints the arms' measured gradient sizes sum_j W_j g_j for the record)."""
    t = np.asarray(t)  # each training step's t_j (bench.measured_step_sizes' grid)
    rows = {"early": (t >= EARLY_T).astype(float), "late": (t <= LATE_T).astype(float)}
    return {k: v / v.sum() for k, v in rows.items()}


def weights(a):
    """Part 3's --credit-file files, PREFIX_W_early.json and PREFIX_W_late.json (one reward: the candidate)."""
    from experiments import bench
    from kit.records import write_atomic

    t, g = bench.measured_step_sizes()
    for label, w in step_arms(t).items():
        path = HERE / f"{PREFIX}_W_{label}.json"
        write_atomic(path, json.dumps({"rewards": [SPLIT_REWARDS[0]], "W": [w.tolist()]}) + "\n")
        print(
            f"{path.name}: steps {np.flatnonzero(w).tolist()}, sum_j W_j g_j = {w @ g:.3f} (uniform W: {g.mean():.3f})"
        )


def profile_table(res) -> str:
    """Part 1's table: per reward its share of D(0) at each level, area and t_half, rho; the paired differences."""
    sig = res["sigmas"]
    inner = [j for j in range(1, len(sig)) if res["groups_per_level"][j] >= 2]
    ch = res["choice"]
    lines = [
        f"Part 1: {res['iterations']} iterations x 8 groups of rotated trees ({int(res['groups_per_level'][1])} groups "
        f"per inner level), seed 0, {res['seconds'] / 60:.0f} min; paired bootstrap over groups, {res['resamples']} "
        "resamples.",
        "",
        "| reward | D(0) | " + " | ".join(f"t={sig[j]:.3f}" for j in inner) + " | area | t_half | rho |",
        "|---" * (5 + len(inner)) + "|",
    ]
    for k, name in enumerate(res["rewards"]):
        cells = [f"{res['share'][k][j]:.2f} ± {res['share_se'][k][j]:.2f}" for j in inner]
        th = res["t_half"][k]
        lines.append(
            f"| {name} | {res['D0'][k]:.4f} | " + " | ".join(cells) + f" | {res['area'][k]:.3f} | "
            f"{'—' if th is None else f'{th:.3f}'} | {res['rho'][k]:.2f} |"
        )
    lines += ["", f"| {res['rewards'][0]} minus | area [95%] | t_half [95%] |", "|---|---|---|"]
    for name, d in res["diff"].items():
        area, th = d["area"], d["t_half"]
        t_cell = f"{th[0]:+.3f} [{th[1]:+.3f}, {th[2]:+.3f}]" if len(th) == 3 else "—"
        lines.append(f"| {name} | {area[0]:+.3f} [{area[1]:+.3f}, {area[2]:+.3f}] | {t_cell} |")
    lines += [
        "",
        f"The pretrained model's choice: {ch['nonzero']} of {ch['samples']} samples with {res['rewards'][0]} != 0, "
        f"{ch['positive_share_of_nonzero']:.3f} of them positive; {ch['tied_groups']} of {ch['groups']} groups tie "
        "(plain captions score 0).",
    ]
    return "\n".join(lines)


def tables(a):
    """phase_gate.md from the result files that exist."""
    parts = []
    for name, fn in ((f"{PREFIX}_profile.json", profile_table), (f"{PREFIX}_splithalf.json", split_table)):
        if (HERE / name).is_file():
            parts.append(fn(json.loads((HERE / name).read_text())))
    title = "Candidate (a), lines_phase" if PREFIX == "phase_gate" else f"{PREFIX}: {SPLIT_REWARDS[0]}"
    (HERE / f"{PREFIX}.md").write_text(f"# {title}: the gate's parts 1 and 2\n\n" + "\n\n".join(parts) + "\n")
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
