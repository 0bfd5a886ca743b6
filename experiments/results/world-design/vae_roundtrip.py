"""A VAE alone on a texture design: PSNR and the checker's texture verdict on ground truth and reconstructions.

    OMP_NUM_THREADS=1 python experiments/results/world-design/vae_roundtrip.py KIND AMP STEPS N [HF]

(N ground-truth training images, STEPS VAE steps at batch 32, HF = world.build.VAE_HF_WEIGHT; 300 held-out prompts.)
Writes experiments/results/world-design/vae_<KIND><AMP>_<STEPS>_hf<HF>.json.
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
import world as sw  # noqa: E402
from world import build as wb  # noqa: E402
from world import checker, metrics  # noqa: E402

torch.set_num_threads(1)
kind, amp, steps, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
wb.VAE_HF_WEIGHT = float(sys.argv[5]) if len(sys.argv) > 5 else wb.VAE_HF_WEIGHT
sw.TEXTURE.update(kind=kind, amp=amp)
t0 = time.time()
prompts, images = wb._world_dataset(n, "train", seed=1)
vae = wb.build_components(seed=0)["vae"]
wb.train_vae(vae, images, steps, batch=32)
ps = sw.sample_prompts(300, "heldout", 8)
gt = [sw.render(p, 7_000_000 + i) for i, p in enumerate(ps)]
recs = sw.vae_decode(vae, sw.vae_encode(vae, gt))
tex = np.array([sw.parse_prompt(p).get("texture", "plain") for p in ps])
out = {
    "kind": kind,
    "amp": amp,
    "steps": steps,
    "psnr": float(np.mean([metrics._psnr(checker._as_array(a), checker._as_array(b)) for a, b in zip(gt, recs)])),
}
for what, ims in (("gt", gt), ("vae", recs)):
    r, g = sw.REWARDS["texture"](ims, ps), sw.REWARDS["grain"](ims, ps)
    for t in ("plain",) + sw.TEXTURES:
        out[f"{what}_tex_{t}"] = round(float(r[tex == t].mean()), 3)
        out[f"{what}_grain_{t}"] = round(float(g[tex == t].mean()), 3)
    out[f"{what}_strict"] = float(sw.REWARDS["geneval_strict"](ims, ps).mean())
out["seconds"] = time.time() - t0
print(out)
import json  # noqa: E402

(HERE / f"vae_{kind}{amp:g}_{steps}_hf{wb.VAE_HF_WEIGHT:g}.json").write_text(json.dumps(out, indent=1))
