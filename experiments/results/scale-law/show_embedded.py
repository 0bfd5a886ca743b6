"""Exploratory, written after reading the embedded dose-response's first seeds (not in PLAN.md): what the arms' held-out
images look like at 32 groups per update, beside the pretrained model's, on the first 8 held-out captions at the
first evaluation seed (the images final_eval.py scores). The rows are chosen by the caller, so they illustrate, and
test nothing.

    python experiments/results/scale-law/show_embedded.py --seeds 0,1   # -> embedded/images_M32.png
"""

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from run_embedded import last_checkpoint  # noqa: E402  (this folder: the script's own directory is on the path)

import world as shapes_world  # noqa: E402
from experiments import protocol  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--groups", type=int, default=32)
    a = p.parse_args(argv)
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import recast
    import sd3

    torch.set_num_threads(1)
    pipe = sd3.load_pipeline(recast.parse_args([]), "cpu", torch.float32)
    prompts = shapes_world.splits()["heldout"][:8]
    rows = [("pretrained", None)]
    for seed in a.seeds.split(","):
        for arm in ("late", "early"):
            run, state = last_checkpoint(arm, a.groups, seed)
            rows.append((run.name, torch.load(state, weights_only=False)["lora"]["default"]))
    fig, ax = plt.subplots(len(rows), len(prompts), figsize=(1.5 * len(prompts), 1.6 * len(rows)))
    for i, (label, state) in enumerate(rows):
        images = protocol.final_eval_images(pipe, state, prompts, protocol.EVAL_SEEDS[0])
        grain = float(np.mean(shapes_world.REWARDS["grain"](images, prompts)))
        for j, image in enumerate(images):
            ax[i, j].imshow(image)
            ax[i, j].axis("off")
        ax[i, 0].set_title(f"{label}: grain {grain:.3f} (these 8)", fontsize=7, loc="left")
    fig.tight_layout()
    fig.savefig(HERE / "embedded" / f"images_M{a.groups}.png", dpi=90)


if __name__ == "__main__":
    main()
