"""The held-out judges of rvge-single's runs, which its table (rewards and thresholds only) leaves out.

    python experiments/results/rvge-single/judges.py > experiments/results/rvge-single/judges.txt

Per reward and method: each seed's last held-out evaluation of the reward, the CNN judge and the Fréchet distance
(lower is better), and the paired RVGE − NFT differences with experiments/stats.py's t interval over seeds.
"""

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import bench, reports, stats  # noqa: E402

METRICS = ("eval/weighted", "eval/judge/cnn", "eval/judge/frechet")


def last_eval(path):
    rows = json.loads(gzip.open(path).read())["rows"]
    return {m: reports.final(rows, m) for m in METRICS}


for reward in (bench.SMOOTH_REWARD, bench.DISCRETE_REWARD):
    finals = {}
    for method in ("nft", "rvge"):
        finals[method] = {
            int(p.name.split("-seed")[1].split(".")[0]): last_eval(p)
            for p in sorted((HERE / "runs").glob(f"{reward}_{method}-seed*.json.gz"))
        }
    print(f"## {reward}\n")
    print("| method | seed | " + " | ".join(METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for method, by_seed in finals.items():
        for seed, v in sorted(by_seed.items()):
            print(f"| {method} | {seed} | " + " | ".join(f"{v[m]:.4f}" for m in METRICS) + " |")
    print("\n| rvge − nft | " + " | ".join(METRICS) + " |")
    print("|---|" + "---|" * len(METRICS))
    diffs = [
        stats.fmt_ci(
            *stats.mean_ci(
                stats.paired({s: v[m] for s, v in finals["rvge"].items()}, {s: v[m] for s, v in finals["nft"].items()})
            )
        )
        for m in METRICS
    ]
    print("| paired | " + " | ".join(diffs) + " |\n")
