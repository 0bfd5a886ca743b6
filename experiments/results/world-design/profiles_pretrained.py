"""Profiles of the rebuilt pretrained model (issue 24, step 4): every candidate reward's D_k(t) / D_k(0).

    OMP_NUM_THREADS=1 python experiments/results/world-design/profiles_pretrained.py [ITERATIONS [SUBFOLDER]]

protocol.measure_profiles (recast.py's own rotated-tree rollouts, no update) with ITERATIONS (default 96) x 8 prompt
groups, i.e. ITERATIONS groups per inner level; writes experiments/results/world-design/profiles.json (the statistics; also a
--gain-init file) and profiles.md: protocol.profile_table and, per reward, the share of D(0) decided at each level
with its standard error (both / D(0)).
"""

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import bench, protocol  # noqa: E402

iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 96
out = HERE / sys.argv[2] if len(sys.argv) > 2 else HERE  # a sub-folder for a second measurement
t0 = time.time()
prof = protocol.measure_profiles(out, iterations=iterations)
sig, D, se, n = (np.asarray(prof[k]) for k in ("sigmas", "D", "se", "n"))
levels = [j for j in range(1, len(sig)) if n[j] >= 2]
lines = protocol.profile_table(prof, bench.SETTINGS)
lines += [
    f"## Share of D(0) decided at each level, the default rewards first ({int(n[1])} groups per inner level; "
    f"measured in {(time.time() - t0) / 60:.1f} min)",
    "",
    "| reward | default | D(0) ± se | " + " | ".join(f"t={sig[j]:.3f}" for j in levels) + " |",
    "|---" * (3 + len(levels)) + "|",
]
DEFAULTS = bench.SETTINGS["A"]  # the default rewards when this table was made (setting A)
order = list(DEFAULTS) + [k for k in prof["names"] if k not in DEFAULTS]
for name in order:
    k = prof["names"].index(name)
    top = D[k, -1]
    cells = [f"{D[k, j] / top:.2f} ± {se[k, j] / top:.2f}" for j in levels]
    default = "yes" if name in DEFAULTS else ""
    lines.append(f"| {name} | {default} | {top:.4f} ± {se[k, -1]:.4f} | " + " | ".join(cells) + " |")
(out / "profiles.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
