"""The full held-out evaluation of single-reward DiffusionNFT runs against the pretrained model (the gate's third
part): every held-out caption x --noises noises, at each of protocol.EVAL_SEEDS (the same images for every model),
with protocol.py's own `final_eval_images` (Euler ODE, 10 steps, the LoRA "default" of the run's last checkpoint).

    OMP_NUM_THREADS=1 python experiments/results/late-reward/final_eval.py --reward texture_soft \
        --runs experiments/results/late-reward/work/runs/texture_soft-nft-{0,1,2} [--noises 8] [--out FILE.json]

Per model and evaluation seed: the mean of every reward in --scores and of the CNN judge (world.judge_cnn)
over the images. Per run (training seed): its mean minus the pretrained model's on the same images (paired), then
stats.mean_ci over the training seeds (a 95% t interval). The evaluation's noise floor: each model's mean on the
first evaluation seed minus its mean on the second (same weights, other noise), the largest |difference| over the
models. Images are cached per model in --cache (keyed by the checkpoint) so that a second reward reuses them.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
import world as shapes_world  # noqa: E402
from experiments import late_reward_world, protocol, stats  # noqa: E402,F401  (late_reward_world: registers its rewards)
from kit.checkpoints import checkpoint_dir  # noqa: E402

SCORES = ("texture", "grain", "texture_soft", "texture_along", "texture_lines", "lines_along", "saturation", "geneval")


def checkpoint(run, iteration=None):
    """The run's checkpoint folder at `iteration` (recast.py keeps the last two), else its latest."""
    ckpts = Path(run) / "checkpoints"
    if iteration is not None:
        path = checkpoint_dir(run, iteration)
        if not (path / "state.pt").is_file():
            raise SystemExit(f"{run}: no checkpoint at iteration {iteration} (kept: {sorted(ckpts.glob('iter_*'))})")
        return path
    return ckpts / (ckpts / "latest").read_text().strip()


def scores_of(images, prompts, names):
    out = {k: shapes_world.REWARDS[k](images, prompts).tolist() for k in names}
    out["judge/cnn"] = shapes_world.judge_cnn(images, prompts).tolist()
    return out


def gate_table(out: dict) -> str:
    """The gate's table from a result of `main` (its means, paired differences and noise floors): each metric, the
    pretrained model, each run, run − pretrained over seeds (stats.fmt_ci: t interval, p; N80 when unresolved, no
    correction: each metric is read on its own) and the largest same-weights difference between the two noise sets."""
    s1, s2 = (str(s) for s in out["eval_seeds"])
    mean = out["means"]
    runs = [lbl for lbl in mean if lbl != "pretrained"]
    lines = [
        f"## {out['reward']}: single-reward NFT runs against the pretrained model, every held-out caption x "
        f"{out['noises']} noises ({out['images_per_seed']} images, evaluation seed {s1}; the noise floor from seed "
        f"{s2})",
        "",
        "| metric | pretrained | runs (per seed) | run - pretrained, mean [95% t] over seeds | noise floor |",
        "|---|---|---|---|---|",
    ]
    for m, p in out["paired"].items():
        per = ", ".join(f"{mean[lbl][s1][m]:.4f}" for lbl in runs)
        lines.append(
            f"| {m} | {mean['pretrained'][s1][m]:.4f} | {per} | {stats.fmt_ci(p['mean'], p['lo'], p['hi'], p['n'])} | "
            f"{out['noise_floor'][m]:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward", required=True, help="the reward the runs trained on (the gate's metric)")
    ap.add_argument("--runs", nargs="+", required=True, help="run folders (recast.py --out), one per training seed")
    ap.add_argument("--noises", type=int, default=8)
    ap.add_argument("--iteration", type=int, default=None, help="evaluate each run's checkpoint at this iteration")
    ap.add_argument("--scores", default=",".join(SCORES))
    ap.add_argument("--cache", default=str(HERE / "work" / "final"))
    ap.add_argument("--out", default="")
    ap.add_argument("--model", default=None, help="pipeline folder of the runs (default: the shipped embedded model)")
    a = ap.parse_args(argv)
    import torch

    import recast
    import sd3

    torch.set_num_threads(1)
    names = list(dict.fromkeys(a.scores.split(",") + [a.reward]))
    prompts = [c for c in shapes_world.splits()["heldout"] for _ in range(a.noises)]
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    pipe = sd3.load_pipeline(recast.parse_args(["--model", a.model] if a.model else []), "cpu", torch.float32)
    base = "pretrained" if a.model is None else f"pretrained-{shapes_world.world_id(a.model)}"
    models = {"pretrained": None} | {Path(r).name: checkpoint(r, a.iteration) for r in a.runs}
    results = {}
    for label, ckpt in models.items():
        key = base if ckpt is None else f"{Path(ckpt).parents[1].name}-{ckpt.name}"
        path = cache / f"{key}-n{a.noises}.json"
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if all(k in cached.get(str(s), {}) for s in protocol.EVAL_SEEDS for k in names + ["judge/cnn"]):
            results[label] = cached
            continue
        state = None if ckpt is None else torch.load(ckpt / "state.pt", weights_only=False)["lora"]["default"]
        for seed in protocol.EVAL_SEEDS:
            images = protocol.final_eval_images(pipe, state, prompts, seed)
            cached[str(seed)] = scores_of(images, prompts, names)
        path.write_text(json.dumps(cached))
        results[label] = cached
        print(f"evaluated {label}", flush=True)
    s1, s2 = (str(s) for s in protocol.EVAL_SEEDS)
    metrics = names + ["judge/cnn"]
    mean = {lbl: {s: {m: float(np.nanmean(r[s][m])) for m in metrics} for s in (s1, s2)} for lbl, r in results.items()}
    runs = [lbl for lbl in results if lbl != "pretrained"]
    out = {
        "reward": a.reward,
        "model": a.model,
        "runs": [str(r) for r in a.runs],
        "command": " ".join(sys.argv),
        "checkpoints": {lbl: str(c) for lbl, c in models.items() if c is not None},
        "images_per_seed": len(prompts),
        "noises": a.noises,
        "eval_seeds": list(protocol.EVAL_SEEDS),
        "means": mean,
        "paired": {},
        "noise_floor": {},
    }
    for m in metrics:
        d = [mean[lbl][s1][m] - mean["pretrained"][s1][m] for lbl in runs]
        d2 = [mean[lbl][s2][m] - mean["pretrained"][s2][m] for lbl in runs]
        mm, lo, hi, n = stats.mean_ci(d)
        out["paired"][m] = {"per_seed": d, "per_seed_eval2": d2, "mean": mm, "lo": lo, "hi": hi, "n": n}
        out["noise_floor"][m] = max(abs(mean[lbl][s1][m] - mean[lbl][s2][m]) for lbl in results)
    out["table"] = gate_table(out)
    print(out["table"])
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
