"""What the pretrained model draws inside its shapes: line amplitudes and fine energies of held-out samples.

    OMP_NUM_THREADS=1 python experiments/results/late-reward/generated_lines.py \
        > experiments/results/late-reward/generated_lines.txt

160 held-out prompts (world.sample_prompts(160, "heldout", 3)), one sample each (world.generate,
seed 5); per reward its mean and sd over named-texture and plain captions; the 10/50/90% quantiles of the pooled
line amplitudes (check()'s line_x, line_y) and fine energies (fine_x, fine_y), all in units of ground truth's.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import world as sw  # noqa: E402
from experiments import late_reward_world  # noqa: E402,F401  (registers the experiment's rewards and variant)

prompts = sw.sample_prompts(160, "heldout", 3)
images = sw.generate(sw.load_pipeline(), prompts, seed=5)
named = np.array([sw.parse_prompt(p).get("texture") is not None for p in prompts])
print(f"{len(prompts)} held-out samples of the pretrained model ({named.sum()} name a texture)")
for name in ("texture", "grain", "texture_soft", "texture_lines", "lines_along"):
    r = sw.REWARDS[name](images, prompts)
    print(
        f"{name:14s} named {r[named].mean():.3f} sd {r[named].std():.3f} | plain {r[~named].mean():.3f} "
        f"sd {r[~named].std():.3f}"
    )
checks = [sw.check(i, p) for i, p in zip(images, prompts)]
for k in ("line_x", "line_y", "fine_x", "fine_y"):
    print(
        f"{k} quantiles 10/50/90%: "
        + " ".join(f"{q:.2f}" for q in np.quantile([c[k] for c in checks], [0.1, 0.5, 0.9]))
    )
