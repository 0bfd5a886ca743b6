"""The toy dose-response of PLAN.md: late credit against the groups per update M, on experiments/toy_train.py's
TRAIN_WORLD (MIX7; coarse and fine rewards; the fine one decided at the last two steps), 60 iterations.

    nohup nice -n 19 python experiments/results/scale-law/run_toy.py > experiments/results/scale-law/run_toy.log 2>&1 &
    python experiments/results/scale-law/run_toy.py --sizes 2 --seeds 2 --chunk 2 --out /tmp/x   # timing

Arms (toy_train.recast_plan, its own W): uniform (the reference), exact (solve_W of the exact profiles), online (the
pairs estimator, as recast.py), grad_uniform (the fixed late-step reweighting: uniform profiles, columns equal in
gradient units), reversed (the exact profiles flipped in time). Every arm and size uses the same seeds (the same
rollout, training and evaluation noise per seed: toy_train.seed_noise), so the runs are paired across arms and sizes.

Seeds run in chunks in a balanced order: chunk 0 (seeds 0..c-1) at every size, then chunk 1, ... A chunk's runs are
independent of the others' (per-run parameters, AdamW elementwise, per-run clipping, noise fixed by seed), so a
chunk gives exactly what those seeds would give in one batch. After each (chunk, size) its evaluations are appended
to runs.csv and its online runs' W distance / evidence to credit.jsonl, so a partial table can be read at any time
(summarize.py); a (chunk, size) already in runs.csv is skipped, so the command can be restarted.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

ARMS = ("uniform", "exact", "online", "grad_uniform", "reversed")
SIZES = (2, 8, 32, 128)
FIELDS = ("family", "groups", "arm", "seed", "iteration", "kl", "coarse", "fine", "discrete")


def done_chunks(path):
    """{(groups, seed)} already in runs.csv (a chunk is written whole, every arm and evaluation)."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {(int(r["groups"]), int(r["seed"])) for r in csv.DictReader(f)}


def main(argv=None):
    import numpy as np
    import torch

    import nft
    from experiments import toy_train as tt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--seeds", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8, help="seeds per chunk (balanced order over sizes)")
    p.add_argument("--iterations", type=int, default=None, help="default TrainConfig's (60)")
    p.add_argument("--out", default=str(HERE / "toy"))
    a = p.parse_args(argv)
    sizes = tuple(int(x) for x in a.sizes.split(","))
    torch.set_num_threads(1)
    cfg = tt.TrainConfig(seeds=a.seeds, groups=sizes)
    if a.iterations:
        cfg = replace(cfg, iterations=a.iterations)
    os.makedirs(a.out, exist_ok=True)
    runs_csv, credit_jsonl = os.path.join(a.out, "runs.csv"), os.path.join(a.out, "credit.jsonl")
    sig = nft.shifted_sigmas(cfg.steps, 3.0)
    D, g, P = tt.exact_profiles(tt.TRAIN_MIX, tt.TRAIN_REWARDS, sig)
    corr = tt.FourierCorrection(tt.TRAIN_MIX.d, cfg.features, seed=cfg.seed0)
    _, Ws = tt.recast_plan(ARMS, (0,), sig, P)
    info = tt.profile_info(sig, D, g, P, Ws, arms=list(ARMS), sizes=list(sizes), config=str(cfg))
    with open(os.path.join(a.out, "profiles.json"), "w") as f:
        json.dump(info, f, indent=1)
    done = done_chunks(runs_csv)
    t_start = time.time()
    for c0 in range(cfg.seed0, cfg.seed0 + a.seeds, a.chunk):
        seeds = tuple(range(c0, min(c0 + a.chunk, cfg.seed0 + a.seeds)))
        for M in sizes:
            if all((M, s) in done for s in seeds):
                continue
            t0 = time.time()
            plan, _ = tt.recast_plan(ARMS, seeds, sig, P)
            plan = replace(plan, W_exact=np.asarray(Ws["exact"]))
            records, online = tt.train_batch(plan, cfg, M, corr, log=lambda *x: None)
            new = not os.path.exists(runs_csv)
            with open(runs_csv, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                if new:
                    w.writeheader()
                w.writerows({k: r[k] for k in FIELDS} for r in records)
            with open(credit_jsonl, "a") as f:
                for r in (online or {}).get("runs", []):
                    f.write(json.dumps(dict(r, groups=M)) + "\n")
            with open(os.path.join(a.out, "timing.jsonl"), "a") as f:
                f.write(json.dumps(dict(groups=M, seeds=list(seeds), seconds=time.time() - t0)) + "\n")
            print(
                f"[seeds {seeds[0]}-{seeds[-1]} at {M} groups: {time.time() - t0:.0f} s; "
                f"{time.time() - t_start:.0f} s in all]",
                flush=True,
            )
    print(f"run_toy done in {time.time() - t_start:.0f} s; results in {a.out}/", flush=True)


if __name__ == "__main__":
    sys.exit(main())
