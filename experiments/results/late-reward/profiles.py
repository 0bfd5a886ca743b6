"""Profiles of candidate late rewards on the pretrained embedded model: D_k(t) / D_k(0) with standard errors.

    OMP_NUM_THREADS=1 python experiments/results/late-reward/profiles.py REWARDS [ITERATIONS [SUBFOLDER]]

protocol.measure_profiles (recast.py's own rotated-tree rollouts, no update; the code path of
results/world-design/profiles192) with ITERATIONS (default 192) x 8 prompt groups, i.e. ITERATIONS groups per inner
level, for the comma-separated REWARDS; writes SUBFOLDER/profiles.json (the statistics; also a --gain-init file) and
SUBFOLDER/profiles.md: per reward the share of D(0) decided at each level with its standard error (both / D(0)), and
the gate's cell: the share at t ~ 0.46 (<= 0.35 with se <= 0.1 passes).
"""

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import late_reward_world, protocol  # noqa: E402,F401  (late_reward_world: registers its rewards)

names = tuple(sys.argv[1].split(","))
iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 192
out = HERE / (sys.argv[3] if len(sys.argv) > 3 else "profiles")
t0 = time.time()
prof = protocol.measure_profiles(out, names=names, iterations=iterations)
sig, D, se, n = (np.asarray(prof[k]) for k in ("sigmas", "D", "se", "n"))
levels = [j for j in range(1, len(sig)) if n[j] >= 2]
gate = min(levels, key=lambda j: abs(sig[j] - 0.46))
lines = [
    f"## Share of D(0) decided at each level ({int(n[1])} groups per inner level; {(time.time() - t0) / 60:.1f} min; "
    f"world {prof['world']})",
    "",
    "| reward | D(0) ± se | " + " | ".join(f"t={sig[j]:.3f}" for j in levels) + f" | gate at t={sig[gate]:.3f} |",
    "|---" * (3 + len(levels)) + "|",
]
for k, name in enumerate(prof["names"]):
    top = D[k, -1]
    cells = [f"{D[k, j] / top:.2f} ± {se[k, j] / top:.2f}" for j in levels]
    share, err = D[k, gate] / top, se[k, gate] / top
    verdict = "pass" if share <= 0.35 and err <= 0.1 else "fail"
    lines.append(f"| {name} | {top:.4f} ± {se[k, -1]:.4f} | " + " | ".join(cells) + f" | {verdict} |")
(out / "profiles.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
