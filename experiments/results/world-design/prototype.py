"""Prototype one texture design of the shapes world and measure its reward profiles (issue 24, step 2).

    OMP_NUM_THREADS=1 python experiments/results/world-design/prototype.py KIND AMP [--n-images N --vae-steps V
        --judge-steps J --transformer-steps S --iterations I]

Builds a reduced world (world.build.build into /tmp/proto_<KIND><AMP>, its evaluation cut to 64
held-out prompts), copies its pipeline into assets/shapes-sd3 (restore with `git checkout assets/`),
measures protocol.measure_profiles on it (I iterations x 8 prompt groups) and writes
results/world-design/proto_<KIND><AMP>.json: the build metrics, the VAE's texture round trip and the
profiles' share of D(0) decided at each level.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import world as sw  # noqa: E402
from world import build as wb  # noqa: E402

NAMES = ("geneval", "saturation", "count", "colour", "shape", "sharpness", "jpeg", "texture", "grain")

ap = argparse.ArgumentParser()
ap.add_argument("kind")
ap.add_argument("amp", type=float)
ap.add_argument("--n-images", type=int, default=8000)
ap.add_argument("--vae-steps", type=int, default=400)
ap.add_argument("--judge-steps", type=int, default=200)
ap.add_argument("--transformer-steps", type=int, default=800)
ap.add_argument("--iterations", type=int, default=16)
a = ap.parse_args()
sw.TEXTURE.update(kind=a.kind, amp=a.amp)
tag = f"{a.kind}{a.amp:g}"
out = Path(f"/tmp/proto_{tag}")
res_path = ROOT / "results" / "world-design" / f"proto_{tag}.json"
_evaluate = wb.evaluate
wb.evaluate = lambda pipe, **kw: _evaluate(pipe, **{**kw, "n": 64})
t0 = time.time()
if not (out / "build_metrics.json").is_file():
    wb.build(
        out_dir=out,
        n_images=a.n_images,
        vae_steps=a.vae_steps,
        judge_steps=a.judge_steps,
        transformer_steps=a.transformer_steps,
    )
m = json.loads((out / "build_metrics.json").read_text())
pipe = sw.load_pipeline(out / "shapes-sd3")
# texture through the VAE round trip, and in generated images
prompts = sw.sample_prompts(400, "heldout", 8)
gt = [sw.render(p, 7_000_000 + i) for i, p in enumerate(prompts)]
recs = sw.vae_decode(pipe.vae, sw.vae_encode(pipe.vae, gt))
gen = sw.generate(pipe, prompts[:192], seed=0)
tex = np.array([sw.parse_prompt(p).get("texture", "plain") for p in prompts])
rt = {}
for what, ims in (("gt", gt), ("vae", recs), ("gen", gen)):
    pp = prompts[: len(ims)]
    r, g = sw.REWARDS["texture"](ims, pp), sw.REWARDS["grain"](ims, pp)
    for t in ("plain",) + sw.TEXTURES:
        sel = tex[: len(ims)] == t
        rt[f"{what}_texture_{t}"] = float(r[sel].mean())
        rt[f"{what}_grain_{t}"] = float(g[sel].mean())
    rt[f"{what}_texture"] = float(r.mean())
    rt[f"{what}_strict"] = float(sw.REWARDS["geneval_strict"](ims, pp).mean())
shutil.rmtree(sw.PIPELINE_DIR)
shutil.copytree(out / "shapes-sd3", sw.PIPELINE_DIR)
from experiments import protocol  # noqa: E402

exp = out / "profiles"
prof = protocol.measure_profiles(exp, names=NAMES, iterations=a.iterations)
sig, D, se, n = (np.asarray(prof[k]) for k in ("sigmas", "D", "se", "n"))
levels = [j for j in range(1, len(sig)) if n[j] >= 2]
share = {
    name: {
        "D0": float(D[k, -1]),
        "se0": float(se[k, -1]),
        "share": {f"{sig[j]:.2f}": [float(D[k, j] / D[k, -1]), float(se[k, j] / D[k, -1])] for j in levels},
    }
    for k, name in enumerate(prof["names"])
}
result = dict(
    design=dict(sw.TEXTURE),
    build=m,
    roundtrip=rt,
    profiles_iterations=a.iterations,
    profiles_prompts=prof["prompts"],
    groups_per_inner_level=int(n[1]),
    profiles=share,
    seconds=time.time() - t0,
    command=" ".join(["python", "experiments/results/world-design/prototype.py"] + sys.argv[1:]),
)
res_path.write_text(json.dumps(result, indent=1))
shutil.copy(exp / "profiles.json", res_path.with_name(f"proto_{tag}_profiles.json"))
print(json.dumps({k: v for k, v in result.items() if k != "build"}, indent=1))
