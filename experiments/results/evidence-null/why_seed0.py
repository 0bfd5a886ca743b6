"""Why pure noise still moves W in one seed at recast-protocol's size, after the family threshold (notebook §6d).

    OMP_NUM_THREADS=1 python experiments/results/evidence-null/noise_W.py \
        --iterations 24 --prompts-per-iter 3 --seeds 1 \
        --out /tmp/nw_seed0.json --run runs/noise-W-seed0
    python experiments/results/evidence-null/why_seed0.py runs/noise-W-seed0 > experiments/results/evidence-null/why_seed0.txt

Reads the run's last metrics line (the measured levels D, their se and counts) and prints, per reward and measured
inner level, the standardised departure z from the rewards' common shape, its t-scored value, Q_k and the family
threshold (`recast.evidence_departures`, `evidence_threshold`: what `recast.evidence_weight` uses).
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import recast  # noqa: E402

run = Path(sys.argv[1])
last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]
D, se = (np.array(last[k], dtype=float) for k in ("recast/D_measured", "recast/D_se"))
n = np.array(last["recast/level_n"], dtype=float)
D[D == -1], se[se == -1] = np.nan, np.nan  # unmeasured levels are written as -1
j, z = recast.evidence_departures(D, se)
zt = recast.evidence_departures(D, se, n)[1]
T = D.shape[1] - 1
np.set_printoptions(precision=2, suppress=True, linewidth=160)
print(f"run {run}: measured inner levels {j.tolist()}, groups per level {np.round(n[j], 1).tolist()}, n_0 {n[T]:.1f}")
print("se per reward and level (x 1000):")
print(se[:, j] * 1000)
print("z (departure from the common shape, in its se):")
print(z)
print("t-scored z:")
print(zt)
p = len(j)
print(
    f"Q_k {np.round((zt**2).sum(1), 2).tolist()}; family threshold (K = {D.shape[0]}, p = {p}): "
    f"{recast.evidence_threshold(2.0, p, D.shape[0]):.2f}; "
    f"rho {np.round(recast.evidence_weight(D, se, 2.0, n), 3).tolist()}"
)
print(
    f"|t-scored z| > 3 in {(np.abs(zt) > 3).sum()} of {zt.size} cells; "
    f"under N(0, 1) expected {zt.size * 2 * 0.00135:.2f}"
)
