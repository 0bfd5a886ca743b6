"""The checker's texture thresholds at amplitude 0.1, chosen on the rebuilt world (issue 24).

    OMP_NUM_THREADS=1 python experiments/results/world-design/thresholds.py > experiments/results/world-design/thresholds.txt

400 held-out prompts: ground truth, its VAE reconstructions and the pretrained model's samples (seed 0). For each
(TEX_PLAIN, TEX_FULL, TEX_ANISO), as fractions of world.texture_contrast() for the first two, the share of
images whose texture verdict is right, named and plain captions apart; rows where the VAE's reconstructions read
back right on >= 97% of both. First the generated images' fine energy per caption texture (ex, ey / contrast).
"""

import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import world as sw  # noqa: E402
from world import checker  # noqa: E402

pipe = sw.load_pipeline(sw.PIPELINE_DIR)
prompts = sw.sample_prompts(400, "heldout", 8)
tex = np.array([sw.parse_prompt(p).get("texture", "plain") for p in prompts])
gt = [sw.render(p, 7_000_000 + i) for i, p in enumerate(prompts)]
rec = sw.vae_decode(pipe.vae, sw.vae_encode(pipe.vae, gt))
gen = sw.generate(pipe, prompts, seed=0)
c = sw.texture_contrast()


def feats(ims):
    """(ex, ey, n, any object detected) per image, as sw.check pools them."""
    return [(*sw.pooled_texture(objs), bool(objs)) for objs in map(sw.detect, ims)]


F = {k: feats(v) for k, v in (("gt", gt), ("vae", rec), ("gen", gen))}
g = np.array([(ex / c, ey / c) for ex, ey, _, _ in F["gen"]])
print(f"contrast {c:.4f}; generated images, fine energy / contrast (quantiles 0.1, 0.5, 0.9):")
for t in ("plain",) + sw.TEXTURES:
    s = tex == t
    along, across = (g[s, 1], g[s, 0]) if t == "striped" else (g[s, 0], g[s, 1])
    q = lambda x: " ".join(f"{v:.2f}" for v in np.quantile(x, [0.1, 0.5, 0.9]))  # noqa: E731
    print(f"  {t} ({s.sum()}): along the lines {q(along)}; across {q(across)}; ex + ey {q(along + across)}")
plain = tex == "plain"
print("TEX_PLAIN TEX_FULL TEX_ANISO | VAE named / plain | generated named / plain / all | ground truth")
for p, f, a in itertools.product((0.45, 0.6, 0.75), (0.4, 0.5, 0.6, 0.8), (1.3, 1.6, 2.0, 2.5)):
    r = {}
    for k, fs in F.items():
        ok = np.array([o and checker._texture_of(ex, ey, n, p, f, a) == t for (ex, ey, n, o), t in zip(fs, tex)])
        r[k] = (ok[~plain].mean(), ok[plain].mean(), ok.mean())
    if r["vae"][0] >= 0.97 and r["vae"][1] >= 0.97:
        print(
            f"{p} {f} {a} | {r['vae'][0]:.3f} / {r['vae'][1]:.3f} | {r['gen'][0]:.3f} / {r['gen'][1]:.3f} / "
            f"{r['gen'][2]:.3f} | {r['gt'][2]:.3f}"
        )
