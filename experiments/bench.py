"""Experiments on the embedded model, one command each: DiffusionNFT vs ReCAST vs DiffusionRVGE.

    python experiments/bench.py multi            # today's side-by-side benchmark: 6 methods x 2 budget vectors
    # single reward (one smooth, one discrete): RVGE vs DiffusionNFT, speed-up
    python experiments/bench.py rvge-single
    python experiments/bench.py rvge-joint       # all five world rewards: RVGE vs NFT at equal compute and at 1/5 of it
    # why RVGE trails jointly: broad groups for every reward, or half the lr
    python experiments/bench.py rvge-joint-why
    python experiments/bench.py rvge-joint-eta   # and whether a smaller step (--eta 0.1, 0.05) stops its drift
    # RVGE's drift on one reward: a noisy direction or a longer step? (permuted, --eta)
    python experiments/bench.py rvge-drift
    python experiments/bench.py recast-protocol  # setting A x 5 budget vectors x {nft, uniform, recast, recast_prior}
    python experiments/bench.py recast-protocol-B  # the same for setting B
    # the control for credit in time: W from the profiles vs the same W reversed
    python experiments/bench.py recast-reversed
    # and uniform W at the budgets those two W give in effect: timing or budgets?
    python experiments/bench.py recast-matched
    python experiments/bench.py recast-units     # the same two W with columns equal in gradient units
    # the embedded default for 100 iterations: DiffusionNFT vs uniform W vs ReCAST
    python experiments/bench.py recast-100
    python experiments/bench.py nft-steps        # DiffusionNFT with 1 vs 8 optimizer steps per iteration
    options: [--quick] [--jobs N] [--seeds N] [--out DIR] [--tables-only] [--iterations N] [--prompts-per-iter N]
             [--results-md FILE] [--replace-results]

An experiment is data (`EXPERIMENTS`): a list of cells, each (script, extra flags, label, group),
plus iterations, prompt groups per iteration, held-out evaluation cadence and seeds. Every cell
runs once per seed; the seed alone fixes the prompts and the noise, so runs with the same seed
are paired across cells, and every interval below is over seeds of paired differences (t, 95%) with its paired-t p.
Each table says its multiple-comparison correction: Holm's (`holm`) over the comparisons read together (e.g. every
cell x comparison of one metric), or none where a table is read as a curve. An unresolved difference also prints
`N80 N`: the seeds a paired t test at alpha 0.05 needs for 80% power (`seeds_for_power`, noncentral t) at the larger
of the observed difference and two noise floors of one evaluation where that floor is measured (`effect_of_interest`),
at the measured sd. The preference judge is summarised per seed as the mean of sigmoid(score difference), with an
interval on the logit scale (inside (0, 1)); times to reach a level count the runs that never reach it as censored
(Kaplan-Meier medians, log-rank p); a Fréchet distance is compared only between evaluations of the same N images.
"Matches" is a test, never an unresolved difference: non-inferiority at a margin of two noise floors of one in-run
evaluation (`measure_eval_floor`, `non_inferiority`), with the untrained model as the control that shows where the
margin is too wide to read.

Runs and results. Each (cell, seed) is one run of `recast.py` or `rvge.py` (with --overwrite) in
its run folder --out/<experiment>/work/<run>/ (checkpoints: large, git-ignored); once it finishes,
its result is written to --out/<experiment>/runs/<run>.json.gz (the command, every metrics line,
wall seconds, the git SHA and date; gzip-compressed). --out defaults to `results/`,
where everything but work/ is small and committed: the results, the final evaluations
(<run>.final.json), profiles.json, table.md and the figures. So `--tables-only` rebuilds every table
on a fresh clone, with no run folder. A stopped experiment keeps every finished run (Ctrl-C or SIGTERM: nothing
more starts, the runs in flight are ended with their process groups, exit 128 + the signal); running the
command again skips runs whose result exists, and --tables-only rebuilds --out/<experiment>/table.md and the
figures from whatever results exist (marked partial when runs are missing). Runs are ordered seed by seed, so a
partial experiment holds complete pairs. Each report also goes into RESULTS.md (--results-md), between the markers
`<!-- BEGIN <experiment> -->` and `<!-- END <experiment> -->` (replaced; appended when absent).
The default `results/` writes RESULTS.md; another --out, or --quick (whose default is runs/bench-quick/), writes
it only when --results-md names the file; markers that do not pair up are refused. Every result names the embedded
world it was measured on (`shapes_world.world_id`). Results are data and never lost: a command is refused, before
anything runs, where runs/ holds results made with other settings or on another world (each named with what
differs; the earlier world's are kept under results/world-amp0.3/, their tables rebuilt with
`--out results/world-amp0.3 --tables-only`), unless --replace-results, which moves them to set-aside/<time>/; a
damaged result is named, moved to set-aside/ and its run redone (--tables-only leaves it out with a warning).
--jobs N runs N runs at once, each in its own process (`python recast.py ...`, one thread each:
OMP/MKL threads = 1); --jobs 1 runs them one after the other in this process, also on one thread.

Sizing (each full experiment <= ~60 min on 2 cores with --jobs 2). Measured on the embedded
model, one thread per process (`recast.py --iterations 3 --prompts-per-iter 4 --eval-every 0`, tree
4 x 2 at step 7), recast.py at 7e7c243: 2.5 s per iteration at 4 prompt groups (rollout 0.66 s,
rewards 0.16 s, credit 0.01 s, update 1.7 s; rvge.py within 3%), i.e. 0.62 s per prompt group
(8 leaves) and iteration; one held-out evaluation (16 prompts, ODE, rewards, CNN judge, Fréchet)
~0.8 s; start-up ~7 s plus ~5 s of imports in a fresh process. recast.py at c650ea9 (DiffusionNFT's
step, gains at every step), side by side with 7e7c243 on the same loaded machine: 1.1x that with
the 4 x 2 tree and 1.35x with its own default tree (SDE sub-steps after each branch). So
`estimate_minutes` uses 0.75 s per prompt group-iteration (0.85 s for the experiments on recast.py's
own tree), 1 s per evaluation and 12 s per start, and packs the runs in their order on --jobs
workers (printed at start; `test_bench.py` checks each full size stays under 60 min). The R = C = 4
tree of rvge-single / rvge-joint (16 leaves per prompt group, SDE sub-steps) measured 1.25-1.3 s per
prompt group-iteration with two runs side by side (their results' time/* sums, 8 runs of 40
iterations), so those use 1.3 s. The textured world (issue 24) left these rates unchanged (rvge-single's results:
wall seconds per run). The two recast-protocol settings first measure the pretrained model's profiles once
(`measure_profiles`, 192 iterations x 8 groups: ~9 min on one core), shared by both.
Sizes (`estimate_minutes`; `test_bench.py` checks each stays under the hour):

    experiment        cells  seeds  iterations x prompts     eval every  runs  estimate (2 cores, --jobs 2)
    multi                12      3       30 x 4                 30         36   ~31 min
    rvge-single           4      5       60 x 4                  5         20   ~56 min
    rvge-joint            6      4       60 x 4 (RVGE 1/5: 12)  10         24   ~59 min
    rvge-joint-why        4      3       60 x 4                 10         12   ~17 min (6 taken from rvge-joint)
    rvge-joint-eta        4      3       60 x 4                 10         12   ~17 min (6 taken from -why)
    rvge-drift            6      5       60 x 4                  5         30   ~56 min (10 taken from rvge-single)
    recast-protocol      20      3       24 x 3                  8         60   ~39 min (+ final evaluation, profiles)
    recast-protocol-B    20      3       24 x 3                  8         60   ~39 min (+ final evaluation)
    recast-reversed      12      8       24 x 3                  8         96   ~45 min (+ final evaluation; 27 taken)
    recast-matched       12      8       24 x 3                  8         96   ~31 min (+ final evaluation; 48 taken)
    recast-units         12      8       24 x 3                  8         96   ~31 min (+ final evaluation; 48 taken)
    recast-100            3      3      100 x 8                 10          9   ~59 min
    nft-steps             2      3      100 x 8                 10          6   ~35 min

On a GPU machine the same command runs many processes at once (`--jobs 16`); no GPU rate is measured here, so the
Power sections size runs on 2 cores only. Start-up (~12 s per run) does not shrink on a GPU: prefer more iterations
per run over many short runs there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python experiments/bench.py`: the project's modules
from world import shapes_world  # noqa: E402

HERE = Path(__file__).resolve().parent  # experiments/
ROOT = HERE.parent  # the project: the scripts, and where the runs' processes start
PHASES = [
    "time/rollout",
    "time/reward",
    "time/gains_W",
    "time/regression",
    "time/update",
]  # training time; eval excluded

# =============================================================================
# Experiments as data
# =============================================================================


@dataclass(frozen=True)
class Cell:
    script: str  # "recast" or "rvge": the module whose train() runs
    flags: tuple[str, ...]  # extra CLI flags of this cell (rewards, budgets, method)
    label: str  # the method's name in tables and figures
    group: str = ""  # cells of one group are compared with each other (a budget vector, a reward)
    compute: float = 1.0  # share of the experiment's iterations this cell trains for


@dataclass(frozen=True)
class Experiment:
    name: str
    cells: tuple[Cell, ...]
    iterations: int
    prompts_per_iter: int
    eval_every: int
    seeds: int
    report: str  # name of the function that writes table.md
    common: tuple[str, ...] = ()  # flags every cell gets (the rollout tree)
    baseline: str = "nft"  # the label others are compared to
    quick_keep: tuple[str, ...] = ()  # groups (or methods) --quick keeps (empty: all)
    seconds_per_prompt_iter: float = 0.75  # sizing: measured cost of one prompt group-iteration, one thread (docstring)
    save_every: int = 0  # checkpoint cadence (0: only at the end)
    final_noises: int = 0  # final evaluation of each run on held-out captions x this many noises (0: none)
    reuse: str = ""  # an experiment whose results of identical runs (same id, same settings) are taken, not rerun
    pairs: tuple[tuple[str, str], ...] = ()  # (label, other) comparisons reported besides each method - baseline
    quick: dict = field(default_factory=lambda: {"iterations": 2, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2})


TREE = (
    "--n-roots",
    "4",
    "--n-branch",
    "4",
    "--branch-steps",
    "7",
)  # rvge.py's default R = C = 4 tree: 16 leaves per prompt
SAME_IMAGES = (
    "--prompts-per-iter",
    "8",
)  # recast.py's own tree (2 roots x 4, rotated) at 8 prompts: the 64 images of 4 x 16
MULTI_METHODS = {  # label -> (script, flags): each script's own default tree, 64 images per iteration
    "nft": ("recast", ("--credit", "nft", *SAME_IMAGES)),
    "uniform": ("recast", ("--credit", "uniform", *SAME_IMAGES)),
    "recast": ("recast", ("--credit", "recast", *SAME_IMAGES)),
    "rvge": ("rvge", ()),
    "rvge_kl": ("rvge", ("--kl-beta", "5")),
    "rvge_recast": ("rvge", ("--credit", "recast")),
}
MULTI_BUDGETS = ("0.4,0.3,0.2,0.1", "0.1,0.2,0.3,0.4")
SMOOTH_REWARD = "grain"  # the textured world's late smooth reward (issue 25.2)
DISCRETE_REWARD = "texture"  # the textured world's late 0/1 reward: the caption's texture (issue 25.2)
SETTINGS = {  # setting -> its four training rewards, in budget order
    "A": tuple(shapes_world.DEFAULT_REWARDS),  # geneval (mid), saturation (early), texture (late), grain (mid-late)
    # Chosen on the textured world from the pretrained model's measured D_k(t) (results/world-design/profiles192,
    # 192 groups per inner level): of the 4-subsets of the candidates sharing at most one reward with A, one whose
    # W at uniform budgets departs far from uniform (max |K T W / Lam - 1| 0.65 then; 0.57 in the protocol's own
    # 192-group prior under the family threshold) with evidence on three of its four rewards, and whose profiles
    # differ from A's: two image statistics decided early (sharpness 0.65, jpeg 0.70 of D(0) by t = 0.79) against
    # the caption's shape (0.21) and its texture (0.17), decided late.
    "B": ("sharpness", "jpeg", "shape", "texture"),
}
JOINT_REWARDS = SETTINGS["A"]  # RVGE's joint runs: setting A (the main command's rewards) at uniform budgets
JOINT_BUDGETS = ",".join(["0.25"] * len(JOINT_REWARDS))


def _joint_cells(methods):
    """rvge-joint's cells: setting A's rewards at uniform budgets, one cell per (script, flags, label[, compute])."""
    return tuple(
        Cell(script, ("--rewards", ",".join(JOINT_REWARDS), "--budgets", JOINT_BUDGETS, *flags), label, "joint", *more)
        for script, flags, label, *more in methods
    )


NFT_RVGE = (("recast", ("--credit", "nft"), "nft"), ("rvge", (), "rvge"))  # the two methods each RVGE experiment has
TREE_RUNS = dict(iterations=60, prompts_per_iter=4, common=TREE, seconds_per_prompt_iter=1.3)  # RVGE's experiments


def budget_vectors(k=4, high=0.55):
    """Five budget vectors for k = 4 rewards: uniform, and one emphasising each reward in turn
    (high on it, the rest shared equally). Returns {name: "l1,l2,l3,l4"}."""
    low = (1 - high) / (k - 1)
    out = {"uniform": ",".join(["0.25"] * k)}
    for i in range(k):
        out[f"emph{i + 1}"] = ",".join(f"{high if j == i else low:.4g}" for j in range(k))
    return out


PROTOCOL_SETTINGS = ("recast-protocol", "recast-protocol-B")  # the two settings' experiments, summarised together
REVERSED_CELLS = ("A-uniform", "A-emph3", "A-emph4")  # uniform budgets, and 0.55 on each late reward (texture, grain)
PROFILES_DIR = "recast-protocol"  # both settings' ReCAST-from-prior cells start from the one profile measurement there
PROFILE_ITERATIONS = 192  # x 8 prompt groups over 8 rotated inner levels: 192 per level (at 48, W is uniform)


def _protocol_cells(setting, reversed_arm=False):
    """Per setting and budget vector: DiffusionNFT's faithful step, uniform W (NFT with per-reward normalisation),
    ReCAST learning W online from its own rollouts (no prior), and ReCAST started from the pretrained model's
    measured profiles (--gain-init; at the default --gain-ema 0.999 the prior keeps 0.98 of its weight over 24
    iterations). With `reversed_arm`, the control for credit in time as well: the same prior with W solved from each
    profile flipped in time (`--credit recast_reversed`: the same marginals), labelled `reversed` so that the report
    compares both ReCAST arms with it."""
    prior = ("--gain-init", f"{{exp_dir}}/../{PROFILES_DIR}/profiles.json")
    methods = {
        "nft": ("--credit", "nft"),
        "uniform": ("--credit", "uniform"),
        "recast": ("--credit", "recast"),
        "recast_prior": ("--credit", "recast", *prior),
        **({"reversed": ("--credit", "recast_reversed", *prior)} if reversed_arm else {}),
    }
    rewards = SETTINGS[setting]
    return tuple(
        Cell("recast", ("--rewards", ",".join(rewards), "--budgets", budgets, *flags), label, f"{setting}-{bname}")
        for bname, budgets in budget_vectors(len(rewards)).items()
        for label, flags in methods.items()
    )


# recast-matched: uniform W at the budgets each ReCAST arm of recast-reversed hands its rewards in effect, the
# gradient-weighted shares sum_j W_kj s_j / sum_kj W_kj s_j (`effective_budgets`: the NFT loss's velocity gradient per
# unit weight is proportional to s_j), means over its 8 seeds x 24 iterations (sd over them <= 0.0007); test_bench
# recomputes them from results/recast-reversed.
MATCHED_BUDGETS = {
    "A-uniform": {"matched": "0.256,0.284,0.225,0.235", "matched_reversed": "0.245,0.216,0.270,0.268"},
    "A-emph3": {"matched": "0.159,0.175,0.520,0.146", "matched_reversed": "0.143,0.127,0.574,0.157"},
    "A-emph4": {"matched": "0.158,0.174,0.138,0.530", "matched_reversed": "0.143,0.126,0.158,0.573"},
}


def effective_budgets(W, sigmas):
    """Each reward's share of the update under W (K, T) on the grid sigmas (T+1,): sum_j W_kj s_j, normalised. The
    NFT loss is linear in the mixed reward, and its velocity gradient per unit weight at step j is proportional to
    s_j, so a W with these shares moves each reward as uniform W at these budgets would, save for the timing."""
    share = np.asarray(W, dtype=float) @ np.asarray(sigmas, dtype=float)[:-1]
    return share / share.sum()


def _matched_cells():
    """recast-matched: recast-reversed's recast_prior and reversed arms (taken from it), and uniform W at each one's
    effective budgets (`matched`, `matched_reversed`: no timing, the same share of the update per reward)."""
    out = []
    for c in _protocol_cells("A", reversed_arm=True):
        if c.group in MATCHED_BUDGETS and c.label in ("recast_prior", "reversed"):
            label = "matched" if c.label == "recast_prior" else "matched_reversed"
            rewards = c.flags[c.flags.index("--rewards") + 1]
            flags = ("--rewards", rewards, "--budgets", MATCHED_BUDGETS[c.group][label], "--credit", "uniform")
            out.append(c)
            out.append(Cell("recast", flags, label, c.group))
    order = ("recast_prior", "reversed", "matched", "matched_reversed")  # recast_prior first: its budgets score
    return tuple(sorted(out, key=lambda c: (list(MATCHED_BUDGETS).index(c.group), order.index(c.label))))


def _units_cells():
    """recast-units: recast-reversed's two ReCAST arms (loss units, taken from it) and the same two with W's columns
    equal in gradient units (`--column-units gradient`: c_j propto 1 / s_j), per cell of REVERSED_CELLS."""
    out = []
    for c in _protocol_cells("A", reversed_arm=True):
        if c.group in REVERSED_CELLS and c.label in ("recast_prior", "reversed"):
            out += [c, replace(c, flags=(*c.flags, "--column-units", "gradient"), label=c.label + "_grad")]
    return tuple(out)


CONTROL_RUNS = dict(  # recast-reversed, -matched and -units: recast-protocol's runs at 8 seeds, paired across all three
    iterations=24,
    prompts_per_iter=3,
    eval_every=8,
    seeds=8,
    report="report_protocol",
    quick_keep=("A-uniform",),
    seconds_per_prompt_iter=0.85,
    final_noises=4,
    quick={"iterations": 2, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2, "final_noises": 1},
)

EXPERIMENTS = {
    e.name: e
    for e in [
        Experiment(
            "multi",
            tuple(
                Cell(script, ("--budgets", b, *flags), label, b)
                for b in MULTI_BUDGETS
                for label, (script, flags) in MULTI_METHODS.items()
            ),
            iterations=30,
            prompts_per_iter=4,
            eval_every=30,
            seeds=3,
            report="report_multi",
            quick_keep=MULTI_BUDGETS[:1],
        ),
        Experiment(
            "rvge-single",
            tuple(
                c
                for reward in (SMOOTH_REWARD, DISCRETE_REWARD)
                for c in (
                    Cell("recast", ("--credit", "nft", "--rewards", reward, "--budgets", "1"), "nft", reward),
                    Cell("rvge", ("--rewards", reward, "--budgets", "1"), "rvge", reward),
                )
            ),
            eval_every=5,
            seeds=5,
            report="report_rvge_single",
            quick_keep=(DISCRETE_REWARD,),
            **TREE_RUNS,
            quick={"iterations": 2, "prompts_per_iter": 1, "seeds": 2, "eval_every": 1},
        ),
        Experiment(
            "rvge-joint",
            _joint_cells(
                [
                    *NFT_RVGE,
                    ("rvge", (), "rvge_fifth", 0.2),
                    ("rvge", ("--combine", "reward"), "rvge_one_direction", 1.0),  # one regression, weighted reward
                    ("rvge", ("--credit", "recast"), "rvge_recast", 1.0),  # the combination (issue 25.4)
                    ("recast", ("--credit", "recast"), "recast", 1.0),  # its other parent, on the same tree
                ]
            ),
            eval_every=10,
            seeds=4,
            report="report_rvge_joint",
            pairs=(("rvge_one_direction", "rvge"), ("rvge_recast", "rvge"), ("rvge_recast", "recast")),
            **TREE_RUNS,
        ),
        Experiment(  # why RVGE trails in rvge-joint: is it the step (lr) or the bandwidth (broad for every reward)?
            "rvge-joint-why",
            _joint_cells(
                [
                    *NFT_RVGE,
                    ("rvge", ("--bandwidth", "broad"), "rvge_broad"),
                    ("rvge", ("--lr", "5e-05"), "rvge_half_lr"),
                ]
            ),
            eval_every=10,
            seeds=3,
            report="report_rvge_joint",
            reuse="rvge-joint",
            **TREE_RUNS,
        ),
        Experiment(  # RVGE's drift on one reward: a noisy direction (it drifts on a permuted reward too) or a
            # longer step (reward against distance to the base model overlays NFT's, smaller --eta moves less)?
            "rvge-drift",
            tuple(
                Cell(script, (*flags, "--rewards", SMOOTH_REWARD, "--budgets", "1"), label, SMOOTH_REWARD)
                for script, flags, label in [
                    *NFT_RVGE,  # rvge-single's two cells, taken from its results
                    ("recast", ("--credit", "nft", "--permute-rewards", SMOOTH_REWARD), "nft_permuted"),
                    ("rvge", ("--permute-rewards", SMOOTH_REWARD), "rvge_permuted"),
                    ("rvge", ("--eta", "0.1"), "rvge_eta_0.1"),
                    ("rvge", ("--eta", "0.05"), "rvge_eta_0.05"),
                ]
            ),
            eval_every=5,
            seeds=5,
            report="report_rvge_drift",
            reuse="rvge-single",
            **TREE_RUNS,
            quick_keep=("nft", "rvge", "rvge_permuted", "rvge_eta_0.05"),
            quick={"iterations": 2, "prompts_per_iter": 1, "seeds": 2, "eval_every": 1},
        ),
        Experiment(  # rvge-joint-why's reading: is the drift set by the size of the targets (--eta)?
            "rvge-joint-eta",
            _joint_cells(
                [
                    *NFT_RVGE,
                    ("rvge", ("--eta", "0.1"), "rvge_eta_0.1"),
                    ("rvge", ("--eta", "0.05"), "rvge_eta_0.05"),
                ]
            ),
            eval_every=10,
            seeds=3,
            report="report_rvge_joint",
            reuse="rvge-joint-why",  # which holds rvge-joint's nft and rvge runs of seeds 0-2
            **TREE_RUNS,
        ),
        *(  # one experiment per setting, so that each fits the hour
            Experiment(
                name,
                _protocol_cells(setting),
                iterations=24,
                prompts_per_iter=3,
                eval_every=8,
                seeds=3,
                report="report_protocol",
                quick_keep=(f"{setting}-uniform",),
                seconds_per_prompt_iter=0.85,
                final_noises=4,  # recast.py's own tree
                quick={"iterations": 2, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2, "final_noises": 1},
            )
            for setting, name in (("A", "recast-protocol"), ("B", "recast-protocol-B"))
        ),
        Experiment(  # the control for credit in time (issue 36.1): W from the profiles against the same W reversed
            "recast-reversed",
            tuple(
                c
                for c in _protocol_cells("A", reversed_arm=True)
                if c.group in REVERSED_CELLS and c.label in ("nft", "uniform", "recast_prior", "reversed")
            ),
            **CONTROL_RUNS,
            reuse="recast-protocol",  # its nft, uniform and recast_prior runs of seeds 0-2, final evaluations too
        ),
        Experiment(
            "recast-matched",
            _matched_cells(),
            **CONTROL_RUNS,
            reuse="recast-reversed",  # its recast_prior and reversed runs, final evaluations too
            pairs=(("recast_prior", "matched"), ("reversed", "matched_reversed")),  # the family, per cell
        ),
        Experiment(
            "recast-units",
            _units_cells(),
            **CONTROL_RUNS,
            reuse="recast-reversed",  # its recast_prior and reversed runs (loss units), final evaluations too
            pairs=(("recast_prior_grad", "recast_prior"), ("recast_prior_grad", "reversed_grad")),
        ),
        Experiment(
            "recast-100",
            tuple(
                Cell("recast", flags, label, "A")
                for label, flags in (
                    ("nft", ("--credit", "nft", "--updates-per-iter", "8")),
                    ("uniform", ("--credit", "uniform")),
                    ("recast", ("--credit", "recast")),
                )
            ),
            iterations=100,
            prompts_per_iter=8,
            eval_every=10,
            seeds=3,
            report="report_recast_100",
            save_every=50,
            seconds_per_prompt_iter=0.85,
        ),
        Experiment(
            "nft-steps",
            tuple(
                Cell("recast", ("--credit", "nft", "--updates-per-iter", str(n)), f"updates_{n}", "nft") for n in (1, 8)
            ),
            iterations=100,
            prompts_per_iter=8,
            eval_every=10,
            seeds=3,
            report="report_nft_steps",
            baseline="updates_1",
            save_every=50,
            seconds_per_prompt_iter=0.85,
        ),
    ]
}


def quick_version(exp: Experiment) -> Experiment:
    """Seconds instead of an hour: the quick overrides, and only the groups (or methods) in quick_keep."""
    cells = tuple(c for c in exp.cells if not exp.quick_keep or c.group in exp.quick_keep or c.label in exp.quick_keep)
    return replace(exp, cells=cells, **exp.quick)


# =============================================================================
# Runs: one per (cell, seed); results written as they finish
# =============================================================================


@dataclass(frozen=True)
class Run:
    run_id: str
    cell: Cell
    seed: int
    settings: tuple[str, ...]  # the script's flags without --out / --overwrite (what a result must match)
    work: Path  # the script's run folder
    result: Path  # runs/<run_id>.json.gz


def slug(text):
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def cell_iterations(exp, cell):
    return max(1, round(exp.iterations * cell.compute))


def plan_runs(exp: Experiment, exp_dir: Path) -> list[Run]:
    """Every run of the experiment, seed by seed (a stopped experiment holds complete pairs)."""
    runs = []
    for seed in range(exp.seeds):
        for cell in exp.cells:
            its = cell_iterations(exp, cell)
            run_id = slug(f"{cell.group}-{cell.label}") + f"-seed{seed}"
            settings = (
                *exp.common,
                "--seed",
                str(seed),
                "--iterations",
                str(its),
                "--prompts-per-iter",
                str(exp.prompts_per_iter),
                "--eval-every",
                str(exp.eval_every),
                "--save-every",
                str(exp.save_every or its),
                *(f.replace("{exp_dir}", str(exp_dir)) for f in cell.flags),
            )
            runs.append(
                Run(run_id, cell, seed, settings, exp_dir / "work" / run_id, exp_dir / "runs" / f"{run_id}.json.gz")
            )
    return runs


def reuse_results(runs, exp: Experiment, exp_dir: Path) -> int:
    """Copy into exp_dir the results of `exp.reuse` that are the same runs (same id, same settings: e.g. the
    nft and rvge cells of rvge-joint-why are rvge-joint's); returns how many were taken. A result file already
    there is never overwritten."""
    taken, world = 0, shapes_world.world_id()
    for run in runs:
        if not exp.reuse or run.result.exists():
            continue
        source = exp_dir.parent / exp.reuse / "runs" / run.result.name
        if (record := load_result(replace(run, result=source))) is not None and record.get("world") == world:
            run.result.parent.mkdir(parents=True, exist_ok=True)
            copy_atomic(source, run.result)
            taken += 1
            evaluated = source.with_name(run.run_id + ".final.json")  # its final evaluation (report_protocol's)
            if evaluated.is_file() and not (mine := run.result.with_name(evaluated.name)).exists():
                copy_atomic(evaluated, mine)
    return taken


def copy_atomic(source: Path, target: Path):
    """target holds a whole copy of source, or (killed meanwhile) what it held before."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def survey_results(runs, exp: Experiment, exp_dir: Path) -> tuple[dict, dict]:
    """Every result file in exp_dir/runs/ read against this command's runs: ({file: what is wrong} of the damaged
    ones, {file: how it differs} of those made with other settings, on another embedded world, or of a run this
    experiment does not plan). A result of a higher seed than asked (e.g. --seeds 1 where 5 exist) is this
    experiment's when it matches the run that seed would be."""
    folder, world = exp_dir / "runs", shapes_world.world_id()
    files = sorted(folder.glob("*.json.gz")) if folder.is_dir() else []
    read = {path: read_result(path) for path in files}
    seeds = [re.search(r"-seed(\d+)\.json\.gz$", p.name) for p in files]
    top = min(max([int(m[1]) + 1 for m in seeds if m] + [exp.seeds]), exp.seeds + 10_000)
    plan = {r.result.name: r for r in (plan_runs(replace(exp, seeds=top), exp_dir) if top > exp.seeds else runs)}
    damaged, differ = {}, {}
    for path, (record, problem) in read.items():
        run = plan.get(path.name)
        if problem:
            damaged[path] = problem
        elif run is None:
            differ[path] = "not a run of this experiment's cells"
        else:
            why = [] if same_settings(record, run) else [f"other settings ({settings_difference(record, run)})"]
            if record.get("world") != world:
                why.append(
                    f"another embedded world ({record.get('world') or 'not recorded'}; assets/ now hold world {world})"
                )
            if why:
                differ[path] = " and ".join(why)
    return damaged, differ


def check_results(runs, exp: Experiment, exp_dir: Path, replace_results=False):
    """Committed results are data: before anything runs, refuse to replace or add to results of other settings or of
    another embedded world (the tables would mix them, or a rerun would overwrite them), naming each and the fix;
    with replace_results they are moved to exp_dir/set-aside/<time>/ instead. A damaged result of a planned run is
    moved aside and the run redone (said); a damaged file of no planned run is left where it is (said)."""
    damaged, differ = survey_results(runs, exp, exp_dir)
    if differ and not replace_results:
        lines = [f"  {p.name}: {why}" for p, why in list(differ.items())[:8]]
        lines += [f"  ... and {len(differ) - 8} more"] if len(differ) > 8 else []
        raise SystemExit(
            f"{exp_dir / 'runs'} holds {len(differ)} result(s) that this command would replace or add to, made "
            f"differently:\n" + "\n".join(lines) + "\nNothing was run or changed. To keep them and run this command: "
            "pass --out DIR (a new folder). To run it here anyway: pass --replace-results (they are moved to "
            f"{exp_dir / 'set-aside'}/<time>/, not deleted). Their own tables: `--tables-only` with the flags they "
            "were made with."
        )
    planned = {r.result.name for r in runs}
    for path, why in damaged.items():
        if path.name not in planned:
            print(f"warning: {path}: {why}; not a run of this command, left where it is", flush=True)
    broken = {p: why for p, why in damaged.items() if p.name in planned}
    if broken:
        where = set_aside(broken, exp_dir, "damaged")
        for path, why in broken.items():
            print(f"{path}: {why}; moved to {where / path.name} and the run will be redone", flush=True)
    if differ:
        where = set_aside(differ, exp_dir, "replaced")
        print(f"--replace-results: moved {len(differ)} result(s) made differently to {where} (see WHY.txt there)")


def set_aside(files: dict, exp_dir: Path, why: str) -> Path:
    """Move files ({path: reason}) and their final evaluations (<run>.final.json) to exp_dir/set-aside/<UTC time>-why/,
    with WHY.txt naming each file's reason; nothing is deleted. Returns the folder."""
    where = exp_dir / "set-aside" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{why}"
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "WHY.txt", "a") as f:
        for path, reason in files.items():
            f.write(f"{path.name}: {reason}\n")
            final_eval = path.with_name(path.name.removesuffix(".json.gz") + ".final.json")
            for p in (path, final_eval):
                if p.exists():
                    os.replace(p, where / p.name)
    return where


def check_writable(folder: Path):
    """Refuse, before anything runs, a results folder (or its nearest existing parent) that cannot be written."""
    here = next(p for p in (folder, *folder.parents) if p.exists())
    for p in (here, here / "runs", here / "work"):
        if p.exists() and not (p.is_dir() and os.access(p, os.W_OK | os.X_OK)):
            raise SystemExit(
                f"{p} is {'not a folder' if not p.is_dir() else 'not writable'}: the results, tables and figures are "
                f"written under {folder}; make it writable (chmod -R u+w {p}) or pass --out DIR (another folder)"
            )


def check_flags(runs):
    """Parse every cell's flags with its script's own parser before anything runs."""
    import importlib

    from kit import run_kit

    for run in {r.cell: r for r in runs}.values():
        module = importlib.import_module(run.cell.script)
        try:
            run_kit.check_ranges(module.parse_args(list(run.settings)))
        except SystemExit as err:
            raise SystemExit(
                f"cell {run.cell.label} ({run.cell.group}): {run.cell.script}.py refuses {' '.join(run.settings)}"
                f"{f' ({err.code})' if isinstance(err.code, str) else ''}"
            ) from None


RESULT_FIELDS = {"settings": list, "rows": list}  # what a result needs; its run is its file name and settings


def read_result(path: Path) -> tuple[dict | None, str | None]:
    """(record, None) for an intact result file (gzip or plain JSON with RESULT_FIELDS and metrics rows); (None, what
    is wrong) for a damaged or older-format one; (None, None) when there is no file."""
    import zlib

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    try:
        record = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    except (OSError, EOFError, zlib.error) as err:
        return None, f"not an intact gzip file ({type(err).__name__}: {err}; a write cut short?)"
    except ValueError as err:
        return None, f"not JSON ({type(err).__name__}: {str(err)[:80]})"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not a result record"
    lacking = [k for k, kind in RESULT_FIELDS.items() if not isinstance(record.get(k), kind)]
    if lacking:
        return None, f"lacks {', '.join(lacking)} (an older format, or not a result of bench.py)"
    if not record["rows"] or not all(isinstance(m, dict) and "iteration" in m for m in record["rows"]):
        return None, "its metrics rows are empty or lack `iteration` (an older format?)"
    return record, None


def read_json(path: Path):
    """(the parsed JSON, None), or (None, what is wrong) for a damaged or unreadable file."""
    try:
        return json.loads(path.read_text()), None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    except ValueError as err:
        return None, f"not JSON ({type(err).__name__}: {str(err)[:80]}; a write cut short?)"


def load_result(run: Run):
    """The run's result if it exists, is intact and was made with the same settings; else None. Gzip or plain JSON."""
    record, _ = read_result(run.result)
    return record if record is not None and same_settings(record, run) else None


def same_settings(record: dict, run: Run) -> bool:
    """Whether a result was made with the run's settings, wherever its results folder was then (`portable`)."""
    return record_settings(record) == portable(run.settings, run.work.parent.parent)


def record_settings(record: dict) -> list[str]:
    made_in = re.search(r"--out (\S+)/work/", record.get("command") or "")  # where the results folder was then
    return portable(record["settings"], made_in[1]) if made_in else [str(x) for x in record["settings"]]


def settings_difference(record: dict, run: Run) -> str:
    """The flags in which a result differs from the run, e.g. "--iterations 60 there, 1 now; --lr 5e-05 there,
    (absent) now"."""

    def flags(settings):
        out, key = {}, None
        for x in settings:
            if x.startswith("--"):
                key = x
                out.setdefault(key, "")
            elif key:
                out[key] = (out[key] + " " + x).strip()
        return out

    a, b = flags(record_settings(record)), flags(portable(run.settings, run.work.parent.parent))
    diffs = [
        f"{k} {a.get(k, '(absent)')} there, {b.get(k, '(absent)')} now"
        for k in dict.fromkeys([*a, *b])
        if a.get(k) != b.get(k)
    ]
    return "; ".join(diffs) or "the same flags in another order"


def portable(settings, exp_dir) -> list[str]:
    """Settings with the experiment's folder written {exp_dir} (as in the cells' flags): a result keeps its identity
    when its results folder moves (e.g. an earlier world's results to results/world-amp0.3/)."""
    return [str(x).replace(str(exp_dir), "{exp_dir}") for x in settings]


def shown(text) -> str:
    """A path or command as a result records it: relative to the project folder when under it (the committed results
    then read the same on every machine), else absolute."""
    return str(text).replace(str(ROOT) + os.sep, "")


def write_result(run: Run, wall_s: float):
    rows = [json.loads(line) for line in (run.work / "metrics.jsonl").read_text().splitlines() if line.strip()]
    try:
        sha = json.loads((run.work / "config.json").read_text()).get("git_sha")
    except (OSError, ValueError):
        sha = None
    record = {
        "run_id": run.run_id,
        "script": run.cell.script,
        "label": run.cell.label,
        "group": run.cell.group,
        "seed": run.seed,
        "settings": [shown(x) for x in run.settings],
        "command": shown(f"python {run.cell.script}.py {' '.join(run.settings)} --out {run.work} --overwrite"),
        "wall_s": wall_s,
        "git_sha": sha,  # the code the run trained with (its config.json)
        "world": shapes_world.world_id(),  # the embedded model it trained (a rebuild changes it)
        "finished": time.strftime("%Y-%m-%d", time.gmtime()),
        "rows": rows,
    }
    run.result.parent.mkdir(parents=True, exist_ok=True)
    if run.result.exists() and load_result(run) is None:  # appeared meanwhile (check_results ran before): kept
        set_aside({run.result: "another result found where this run's was written"}, run.work.parent.parent, "replaced")
    tmp = run.result.with_name(run.result.name + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(record).encode(), mtime=0))  # mtime 0: same record, same bytes
    os.replace(tmp, run.result)  # atomic: a kill leaves the old state or the whole result
    run.result.with_name(run.run_id + ".final.json").unlink(missing_ok=True)  # an earlier run's final evaluation
    return record


def argv_of(run: Run):
    return [*run.settings, "--out", str(run.work), "--overwrite"]


def run_in_process(run: Run):
    """module.train in this process, on one thread like every worker (restored after): the time/*
    numbers then compare across --jobs, and a shared machine is not oversubscribed (OpenMP threads
    spin-waiting on a busy core made a 2-thread run ~8x slower here)."""
    import importlib

    import torch

    module = importlib.import_module(run.cell.script)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        module.train(module.parse_args(argv_of(run)))
        return write_result(run, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def worker_command(run: Run) -> list[str]:
    """The process of one run under --jobs N: `python <script>.py <settings> --out <work> --overwrite`."""
    return [sys.executable, str(ROOT / f"{run.cell.script}.py"), *argv_of(run)]


def start_worker(run: Run):
    """Start the run's process with one thread (set before torch is imported), in its own process group (so that a
    stop ends it and whatever it started), told to end if bench.py dies; log in work/<run>.log. Returns (process,
    log, start time)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
    }
    run.work.mkdir(parents=True, exist_ok=True)
    log = run.work.with_name(run.run_id + ".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            worker_command(run),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=end_with_parent,
        )
    return proc, log, time.perf_counter()


def end_with_parent():
    """In the child, before exec (Linux): SIGTERM when bench.py dies, even by SIGKILL, so no run is left orphaned."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def finish_worker(run: Run, proc, log: Path, t0: float):
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)} (log: {log})")
    return write_result(run, time.perf_counter() - t0)


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
GRACE_S = 10.0  # after a stop, seconds a run's process group has to end on SIGTERM before SIGKILL


class Stop:
    """While active: SIGINT, SIGTERM and SIGHUP record the signal instead of killing bench.py (with `interrupt`, also
    raise KeyboardInterrupt, to leave a run trained in this process); a second signal asks to hurry (SIGKILL to the
    runs), a third gets the signal's usual behaviour."""

    def __init__(self, interrupt=False):
        self.signum, self.count, self.interrupt, self.saved = 0, 0, interrupt, {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for name in STOP_SIGNALS:
                sig = getattr(signal, name)
                self.saved[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.signum, self.count = self.signum or signum, self.count + 1
        if self.count >= 3:  # a third signal: the usual behaviour again (the runs end with bench.py: end_with_parent)
            self.__exit__()
            os.kill(os.getpid(), signum)
        elif self.interrupt and self.count == 1:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.saved = {}


def end_groups(live: dict, sig):
    import signal

    for proc, _, _ in live.values():
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL:
            proc.kill()


def stopped(stop: Stop, kept: int, ended: list, queued: int, runs_dir: Path):
    """The line and exit code of a stopped experiment (128 + the signal, as a shell reports it)."""
    import signal

    name, which = signal.Signals(stop.signum).name, f" ({', '.join(ended)})" if ended else ""
    print(
        f"\nbench.py: stopped by {name}: {kept} finished result(s) kept in {runs_dir}; {len(ended)} run(s) in flight "
        f"ended{which}, {queued} not started. Run the same command again to complete the experiment.",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + stop.signum)


def execute(runs, jobs):
    """Run what has no result yet; returns {run_id: error} of the runs that failed. A SIGINT, SIGTERM or SIGHUP stops
    it: nothing more starts, the runs in flight are ended (their whole process groups), every finished result is
    kept, and it exits with 128 + the signal and one line saying so."""
    import signal

    from tqdm import tqdm

    todo = [r for r in runs if load_result(r) is None]
    failed, ended = {}, []
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="runs", unit="run")
    with Stop(interrupt=jobs == 1) as stop:
        queue, live = list(todo), {}
        if jobs == 1:
            current = None
            try:
                while queue and not stop.signum:
                    current = queue.pop(0)
                    try:
                        run_in_process(current)
                    except (Exception, SystemExit) as err:
                        failed[current.run_id] = f"{type(err).__name__}: {err}"
                    bar.update()
                    current = None
            except KeyboardInterrupt:  # raised by Stop in the run's training: nothing more starts
                stop.signum = stop.signum or signal.SIGINT
                ended += [current.run_id] if current and not current.result.exists() else []
        else:
            stop_at = None
            while live or queue and not stop.signum:
                while queue and len(live) < jobs and not stop.signum:
                    run = queue.pop(0)
                    try:
                        live[run] = start_worker(run)
                    except OSError as err:
                        failed[run.run_id] = f"could not start: {err}"
                for run, (proc, log, t0) in list(live.items()):
                    if proc.poll() is None:
                        continue
                    del live[run]
                    if stop.signum and proc.returncode:
                        ended.append(run.run_id)
                        continue
                    try:
                        finish_worker(run, proc, log, t0)
                    except Exception as err:
                        failed[run.run_id] = str(err)
                    bar.set_postfix_str(run.run_id)
                    bar.update()
                if stop.signum and live:
                    if stop_at is None:
                        stop_at = time.monotonic()
                        end_groups(live, signal.SIGTERM)
                    elif stop.count > 1 or time.monotonic() - stop_at > GRACE_S:
                        end_groups(live, signal.SIGKILL)
                time.sleep(0.05)
    bar.close()
    if stop.signum:
        kept = sum(r.result.exists() for r in runs)
        stopped(stop, kept, ended, len(queue), runs[0].result.parent)
    return failed


# Measured on 2 cores (module docstring): seconds per evaluation and per start of a run.
SECONDS_PER_EVAL, SECONDS_PER_START = 1.0, 12.0


def planned_not_reused(exp: Experiment) -> list[Run]:
    """The runs the experiment makes itself: all, less those `exp.reuse` plans identically (same id and settings),
    whose results are taken from it."""
    runs = plan_runs(exp, Path("."))
    if not exp.reuse or exp.reuse not in EXPERIMENTS:
        return runs
    other = {(r.run_id, r.settings) for r in plan_runs(EXPERIMENTS[exp.reuse], Path("."))}  # at its own seeds
    return [r for r in runs if (r.run_id, r.settings) not in other]


def estimate_minutes(exp: Experiment, jobs=2):
    """Wall-clock estimate on a 2-core machine: each run's time from the measured rates, runs handed
    in their order to whichever of the `jobs` workers frees first; runs taken from `exp.reuse` cost nothing."""
    workers = np.zeros(jobs)
    for run in planned_not_reused(exp):
        its = cell_iterations(exp, run.cell)
        evals = 1 + (its // exp.eval_every + (its % exp.eval_every > 0) if exp.eval_every else 0)
        workers[workers.argmin()] += (
            its * exp.prompts_per_iter * exp.seconds_per_prompt_iter + evals * SECONDS_PER_EVAL + SECONDS_PER_START
        )
    return workers.max() / 60


# =============================================================================
# Statistics on runs
# =============================================================================


def elapsed(rows):
    """Cumulative training seconds at the end of each iteration (rollout + reward + credit + update; eval excluded)."""
    return np.cumsum([sum(m.get(p, 0.0) for p in PHASES) for m in rows])


def smooth(y, k=3):
    y = np.asarray(y, dtype=float)
    return np.array([y[max(0, i - k + 1) : i + 1].mean() for i in range(len(y))])


def eval_curve(rows, metric="eval/weighted"):
    """Held-out curve of one run: (iterations, training seconds, values); the pretrained value
    (eval_before/..., logged with iteration 0) at iteration 0 and 0 s when present."""
    name = metric.split("/", 1)[1]
    t = elapsed(rows)
    pts = [(0, 0.0, rows[0][f"eval_before/{name}"])] if rows and f"eval_before/{name}" in rows[0] else []
    pts += [(m["iteration"] + 1, t[i], m[metric]) for i, m in enumerate(rows) if metric in m]
    return tuple(np.array(col, dtype=float) for col in zip(*pts)) if pts else (np.zeros(0),) * 3


def final(rows, metric):
    """The metric at the last evaluation of the run (NaN if never evaluated)."""
    return next((m[metric] for m in reversed(rows) if metric in m), np.nan)


def first_crossing(x, y, level):
    """First x at which y reaches level, linearly interpolated between evaluations; NaN if never."""
    hit = np.flatnonzero(y >= level)
    if not len(hit):
        return np.nan
    i = hit[0]
    if i == 0 or y[i] == y[i - 1]:
        return x[i]
    return x[i - 1] + (level - y[i - 1]) / (y[i] - y[i - 1]) * (x[i] - x[i - 1])


def mean_ci(values):
    """(mean, low, high, n) of the finite values; a t interval at 95% (NaN bounds below 2 values)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return np.nan, np.nan, np.nan, 0
    if len(v) < 2:
        return v.mean(), np.nan, np.nan, 1
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return v.mean(), v.mean() - half, v.mean() + half, len(v)


def paired(a: dict, b: dict):
    """Per-seed values a[s] - b[s] over the seeds both have."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def interval_sd(lo, hi, n):
    """The sd of the n paired differences behind a 95% t interval [lo, hi]: (hi - lo) / 2 = t(0.975, n - 1) sd /
    sqrt(n)."""
    return (hi - lo) / 2 * np.sqrt(n) / t_975(n - 1)


def t_975(dof):
    from scipy import stats

    return stats.t.ppf(0.975, dof)


def p_value(m, lo, hi, n):
    """Two-sided p of the paired t test behind `mean_ci`'s (m, lo, hi, n): t = m / (sd / sqrt(n)), n - 1 dof; NaN
    below 2 values; 0 or 1 when the differences do not vary."""
    from scipy import stats

    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if se == 0:
        return 1.0 if m == 0 else 0.0
    return float(2 * stats.t.sf(abs(m) / se, n - 1))


def holm(pvalues):
    """Holm's step-down adjusted p-values (family-wise error over the family given): the i-th smallest of m p-values
    becomes max over j <= i of min(1, (m - j + 1) p_(j)); NaN stays NaN and does not count in m."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (len(ok) - rank) * p[i]))
        out[i] = running
    return out


POWER, ALPHA = 0.8, 0.05  # the power and two-sided level at which `seeds_for_power` sizes a comparison


def seeds_for_power(effect, sd, alpha=ALPHA, power=POWER, most=10_000):
    """The fewest seeds N >= 2 at which a two-sided paired t test at level alpha detects a true mean difference
    `effect` (paired differences of sd `sd`) with the given power: P(|T| > t(1 - alpha/2, N - 1)) >= power, T
    noncentral t with N - 1 dof and noncentrality effect sqrt(N) / sd. None past `most` (or effect = 0); 2 when sd
    = 0. Cohen's d = 0.5 at alpha 0.05 and power 0.8 gives the textbook 34."""
    from scipy import stats

    if not (np.isfinite(effect) and np.isfinite(sd)) or effect == 0:
        return None
    if sd == 0:
        return 2
    for n in range(2, most + 1):
        crit, nc = stats.t.ppf(1 - alpha / 2, n - 1), abs(effect) * np.sqrt(n) / sd
        # the far tail: scipy's nct.cdf returns NaN there on some CPUs at large noncentrality (seen at nc ~ 27, 4
        # seeds), where it is below 1e-16; read as 0, else a NaN power would skip N and move N80 up by several seeds
        far = np.nan_to_num(stats.nct.cdf(-crit, n - 1, nc), nan=0.0)
        if stats.nct.sf(crit, n - 1, nc) + far >= power:
            return n
    return None


def effect_of_interest(m, floor=None):
    """The difference a power statement is made at: the larger of |the observed mean| and two noise floors of one
    evaluation (`floor`: its sd), or |m| alone where no floor was measured."""
    return max(abs(m), 2 * floor) if floor is not None and np.isfinite(floor) else abs(m)


def resolved(lo, hi, p_holm=None):
    """Whether a difference is resolved: its 95% interval excludes 0 and, under a correction, its Holm-adjusted p is
    below ALPHA."""
    return bool(np.isfinite(lo) and not lo <= 0 <= hi and (p_holm is None or p_holm < ALPHA))


def fmt_ci(m, lo, hi, n, digits=4, floor=None, p_holm=None, family=1):
    """mean [95% t interval] sd (of the paired differences), p (paired t; with `p_holm`, the Holm-adjusted p of its
    family of `family` tests as well). An unresolved difference (`resolved`) adds "N80 k": the seeds a paired t test
    needs for 80% power at `effect_of_interest` (observed |mean|, or two noise floors when larger) and the measured sd,
    at level alpha / family (Holm's first step, so enough for every step; alpha 0.05 uncorrected) (`seeds_for_power`;
    "N80 > 10000" past the search)."""
    if not np.isfinite(m):
        return "n/a"
    if not np.isfinite(lo):
        return f"{m:+.{digits}f} (n={n})"
    sd, p = interval_sd(lo, hi, n), p_value(m, lo, hi, n)
    text = f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] sd {sd:.{digits}f} p {p:.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    if resolved(lo, hi, p_holm):
        return text
    need = seeds_for_power(effect_of_interest(m, floor), sd, alpha=ALPHA / family)
    return text + (f" N80 {need}" if need else " N80 > 10000")


def pref_share(a_scores, b_scores):
    """The preference judge's summary of one pair of image sets (same prompt and noise per position): the mean over
    images of sigmoid(s_a - s_b), the Bradley-Terry probability that it prefers a's image; 0.5 = no preference. Near
    0.5 when the images barely differ, where a win rate (the share with s_a > s_b) swings from 0 to 1."""
    from scipy.special import expit

    return float(np.mean(expit(np.asarray(a_scores, dtype=float) - np.asarray(b_scores, dtype=float))))


def share_logit(share):
    """log(share / (1 - share)), the share clipped to [1e-6, 1 - 1e-6]."""
    from scipy.special import logit

    return float(logit(np.clip(share, 1e-6, 1 - 1e-6)))


def share_logits(shares):
    """(mean, low, high, n) of `mean_ci` over the logits of per-seed shares in (0, 1) (`share_logit`): the scale on
    which a preference share is tested and its interval drawn."""
    return mean_ci([share_logit(s) for s in shares if np.isfinite(s)])


def fmt_share(m, lo, hi, n, floor=None, p_holm=None, family=1):
    """A preference share from `share_logits`: the mean logit and its 95% t interval mapped back through the sigmoid
    (so inside (0, 1)), the p of logit = 0 (share 0.5), and N80 on the logit scale when unresolved (`fmt_ci`)."""
    from scipy.special import expit

    if not n:
        return "n/a"
    if n < 2:
        return f"{expit(m):.3f} (n={n})"
    text = f"{expit(m):.3f} [{expit(lo):.3f}, {expit(hi):.3f}] p {p_value(m, lo, hi, n):.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    if resolved(lo, hi, p_holm):
        return text
    need = seeds_for_power(effect_of_interest(m, floor), interval_sd(lo, hi, n), alpha=ALPHA / family)
    return text + (f" N80 {need}" if need else " N80 > 10000")


def km_median(times, reached):
    """Kaplan-Meier median time to reach a level: runs that never reach it are censored at their last evaluation
    (they count as "not yet" up to then, never dropped). The first time the KM survival falls to 0.5 or below; inf
    when it never does (too many runs never reach the level)."""
    t, e = np.asarray(times, dtype=float), np.asarray(reached, dtype=bool)
    surv = 1.0
    for x in np.unique(t[e]):
        surv *= 1 - np.sum(e & (t == x)) / np.sum(t >= x)
        if surv <= 0.5:
            return float(x)
    return np.inf


def median_ratio(base, other):
    """base / other of two median times, where inf means "never reached": inf when only `other` reaches it (or
    reaches it at 0), 0 when only `base` does, NaN when neither does (or both at 0)."""
    if np.isinf(base) and np.isinf(other) or base == other == 0:
        return np.nan
    return np.inf if np.isinf(base) or other == 0 else base / other


def censored_speedup(base: dict, other: dict, resamples=2000, seed=0):
    """Speed-up of `other` over `base` at a level both try to reach, from {seed: (time, reached)}: the ratio of their
    Kaplan-Meier median times (base / other; runs that never reach the level censored, `km_median`), a 95% percentile
    interval from resampling seeds in pairs (fixed generator: the same table every rebuild), and the log-rank p
    (scipy.stats.logrank) of the two time-to-reach curves. (ratio, low, high, n, p)."""
    from scipy import stats

    seeds = sorted(set(base) & set(other))
    if not seeds:
        return np.nan, np.nan, np.nan, 0, np.nan
    b, o = (np.array([d[s] for s in seeds], dtype=float) for d in (base, other))

    def ratio(idx):
        return median_ratio(km_median(b[idx, 0], b[idx, 1] > 0), km_median(o[idx, 0], o[idx, 1] > 0))

    rng = np.random.default_rng(seed)
    boot = np.array([ratio(rng.integers(0, len(seeds), len(seeds))) for _ in range(resamples)])
    boot = boot[~np.isnan(boot)]  # resamples where neither median is reached say nothing about the ratio
    lo, hi = np.quantile(boot, [0.025, 0.975], method="inverted_cdf") if len(boot) else (np.nan, np.nan)
    p = np.nan
    if b[:, 1].any() or o[:, 1].any():
        data = [stats.CensoredData(uncensored=x[x[:, 1] > 0, 0], right=x[x[:, 1] == 0, 0]) for x in (b, o)]
        p = float(stats.logrank(*data).pvalue)
    return ratio(np.arange(len(seeds))), float(lo), float(hi), len(seeds), p


def fmt_speedup(r, lo, hi, n, p, p_holm=None):
    """ "1.40x [0.80, inf] log-rank p 0.3": a speed-up from `censored_speedup` (inf: the baseline's median is never
    reached; 0.00x: the method's is not)."""
    if not n:
        return "n/a"

    def fmt(x):
        return "inf" if np.isinf(x) else "n/a" if np.isnan(x) else f"{x:.2f}"

    text = f"{fmt(r)}{'x' if np.isfinite(r) else ''} [{fmt(lo)}, {fmt(hi)}] (n={n})"
    text += f" log-rank p {p:.2g}" if np.isfinite(p) else ""
    return text + (f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else "")


def mean_std(values, digits=4):
    v = np.asarray(values, dtype=float)
    return f"{np.nanmean(v):.{digits}f} ± {np.nanstd(v):.{digits}f}" if np.isfinite(v).any() else "n/a"


def flag_value(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


class Results:
    """The finished runs of one experiment: runs[group][label] = {seed: metrics rows}."""

    def __init__(self, exp: Experiment, records: list[dict], planned: list[Run]):
        self.exp, self.records = exp, records
        self.runs: dict[str, dict[str, dict[int, list]]] = {}
        for cell in exp.cells:  # spec order, whatever has finished
            self.runs.setdefault(cell.group, {}).setdefault(cell.label, {})
        for r in records:
            self.runs[r["group"]][r["label"]][r["seed"]] = r["rows"]
        self.missing = [run.run_id for run in planned if not any(r["run_id"] == run.run_id for r in records)]
        self.cells = {(c.group, c.label): c for c in exp.cells}

    def values(self, group, label, fn):
        return {s: fn(rows) for s, rows in self.runs[group][label].items()}

    def banner(self):
        n = len(self.records) + len(self.missing)
        head = [
            f"# {self.exp.name}",
            "",
            f"{len(self.records)} of {n} runs; seeds paired across methods (same prompts and noise); "
            f"{self.exp.iterations} iterations x {self.exp.prompts_per_iter} prompt groups, held-out eval every "
            f"{self.exp.eval_every}; "
            "intervals: t, 95%, over seeds of paired differences; each table of differences states its "
            "multiple-comparison correction.",
            "",
        ]
        if self.missing:
            head += [
                f"**PARTIAL: {len(self.missing)} run(s) missing** ({', '.join(self.missing[:8])}"
                f"{', ...' if len(self.missing) > 8 else ''}); rerun the command to complete them.",
                "",
            ]
        return head


# =============================================================================
# Reports: table.md and figures, regenerated from the results alone
# =============================================================================


def curve_figure(res: Results, path: Path, metric="eval/weighted", x="seconds"):
    """Held-out metric vs training seconds (or iterations), one panel per group (and per metric when `metric` is a
    tuple): mean over seeds, band +- 1 sd."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (metric,) if isinstance(metric, str) else metric
    panels = [(g, m) for g, by in res.runs.items() if any(by.values()) for m in metrics]
    if not panels:
        return
    cols = min(len(panels), 5)
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3 * rows_n), squeeze=False)
    for ax, (group, metric) in zip(axes.flat, panels):
        for label, by_seed in res.runs[group].items():
            curves = [eval_curve(rows, metric) for rows in by_seed.values()]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            if x == "seconds":
                grid = np.linspace(0, min(c[1][-1] for c in curves), 40)
                ys = np.array([np.interp(grid, c[1], c[2]) for c in curves])
            else:
                n = min(len(c[0]) for c in curves)
                grid, ys = curves[0][0][:n], np.array([c[2][:n] for c in curves])
            mean, sd = ys.mean(0), ys.std(0)
            ax.plot(grid, mean, marker="." if x != "seconds" else None, label=f"{label} (n={len(ys)})")
            ax.fill_between(grid, mean - sd, mean + sd, alpha=0.2)
        ax.set(
            title=group, xlabel="training seconds" if x == "seconds" else "iteration", ylabel=f"held-out {metric[5:]}"
        )
        if ax.get_legend_handles_labels()[0]:  # a metric no run logged leaves the panel empty
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_multi(res: Results, out: Path):
    """Today's tables per budget vector: final rewards and judges at equal iterations and at equal
    wall-clock, the time to reach DiffusionNFT's final training reward, the share of each phase."""
    lines = res.banner()
    for budgets, by_label in res.runs.items():
        by_label = {k: v for k, v in by_label.items() if v}
        if not by_label:
            continue
        first = next(iter(next(iter(by_label.values())).values()))[-1]
        names = [k[len("reward/") :] for k in first if k.startswith("reward/")]
        evals = sorted(k for k in first if k.startswith("eval/"))
        lines += [
            f"## budgets {budgets}",
            "",
            "Equal iterations (final iteration; training rewards of the rollouts smoothed over 3 "
            "iterations, then held-out evaluation: ODE sampler, fixed prompts and seeds), mean ± sd over seeds:",
            "",
            "| method | n | " + " | ".join(names + evals) + " |",
            "|---" * (2 + len(names) + len(evals)) + "|",
        ]
        for label, runs in by_label.items():
            cells = [mean_std([smooth([m[f"reward/{n}"] for m in rows])[-1] for rows in runs.values()]) for n in names]
            cells += [mean_std([final(rows, e) for rows in runs.values()]) for e in evals]
            lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
        budget_s = min(elapsed(rows)[-1] for runs in by_label.values() for rows in runs.values())
        lines += [
            "",
            f"Equal wall-clock ({budget_s:.1f} s of training, the shortest run): smoothed training rewards",
            "",
            "| method | " + " | ".join(names) + " |",
            "|---" * (1 + len(names)) + "|",
        ]
        for label, runs in by_label.items():
            cells = [
                mean_std(
                    [
                        np.interp(budget_s, elapsed(rows), smooth([m[f"reward/{n}"] for m in rows]))
                        for rows in runs.values()
                    ]
                )
                for n in names
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if "nft" in by_label:
            target = np.mean([smooth([m["reward/weighted"] for m in rows])[-1] for rows in by_label["nft"].values()])

            def reach(rows):
                return time_to_reach(elapsed(rows), smooth([m["reward/weighted"] for m in rows]), target)

            nft_t = {s: reach(rows) for s, rows in by_label["nft"].items()}
            times = {label: {s: reach(rows) for s, rows in runs.items()} for label, runs in by_label.items()}
            speed = {label: censored_speedup(nft_t, t) for label, t in times.items() if label != "nft"}
            adjusted = dict(zip(speed, holm([v[4] for v in speed.values()])))
            lines += [
                "",
                f"Time to reach DiffusionNFT's final budget-weighted training reward ({target:.4f}, smoothed over 3 "
                "iterations): Kaplan-Meier median seconds (runs that never reach it censored at their end; inf: the "
                "median is not reached); speed-up = NFT's median / the method's [95% paired bootstrap over seeds], "
                f"log-rank p, Holm over the {len(speed)} methods:",
                "",
                "| method | median seconds | speed-up vs nft | runs that reached it |",
                "|---|---|---|---|",
            ]
            for label, t in times.items():
                cell = fmt_speedup(*speed[label], adjusted[label]) if label in speed else "1"
                lines.append(f"| {label} | {km_median(*zip(*t.values())):.1f} | {cell} | {reach_counts(t)} |")
        lines += [
            "",
            "Share of an iteration's time per phase:",
            "",
            "| method | " + " | ".join(p[5:] for p in PHASES) + " |",
            "|---" * (1 + len(PHASES)) + "|",
        ]
        for label, runs in by_label.items():
            totals = np.array([[sum(m.get(p, 0.0) for m in rows) for p in PHASES] for rows in runs.values()]).sum(0)
            lines.append(f"| {label} | " + " | ".join(f"{100 * x / totals.sum():.1f}%" for x in totals) + " |")
        lines.append("")
        multi_figures(budgets, by_label, out)
    return lines


def multi_figures(budgets, by_label, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = slug(budgets)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, runs in by_label.items():
        grid = np.linspace(0, min(elapsed(rows)[-1] for rows in runs.values()), 50)
        curves = np.array(
            [np.interp(grid, elapsed(rows), smooth([m["reward/weighted"] for m in rows])) for rows in runs.values()]
        )
        ax.plot(grid, curves.mean(0), label=label)
        ax.fill_between(grid, curves.mean(0) - curves.std(0), curves.mean(0) + curves.std(0), alpha=0.15)
    ax.set(xlabel="training seconds", ylabel="budget-weighted training reward (smoothed)", title=f"budgets {budgets}")
    ax.legend(fontsize=7)
    fig.savefig(out / f"reward_vs_time_{tag}.png", dpi=120, bbox_inches="tight")
    fig, axes = plt.subplots(1, len(by_label), figsize=(3.2 * len(by_label), 2.6), squeeze=False)
    for ax, (label, runs) in zip(axes[0], by_label.items()):
        ax.imshow(np.array(next(iter(runs.values()))[-1]["recast/W"]), aspect="auto", cmap="viridis")
        ax.set(title=label, xlabel="step j", ylabel="reward k")
    fig.savefig(out / f"W_final_{tag}.png", dpi=120, bbox_inches="tight")
    plt.close("all")


def time_to_reach(x, y, level):
    """(x at which y first reaches level, True), or (the last x, False): a run that never reaches the level is
    censored at its last evaluation, not dropped."""
    t = first_crossing(x, y, level)
    return (t, True) if np.isfinite(t) else ((x[-1] if len(x) else np.nan), False)


def reach_counts(reach: dict) -> str:
    return f"{sum(r for _, r in reach.values())}/{len(reach)}"


THRESHOLD_SHARES = (1 / 3, 2 / 3, 1.0)  # matched levels: pretrained + share x (NFT's final - pretrained)


def speedup_table(by_label, labels, base, pre, top, clocks) -> tuple[int, list[str]]:
    """The matched-level rows of rvge-single and rvge-drift: per level pre + share (top - pre) (THRESHOLD_SHARES) and
    method, the Kaplan-Meier median of each of two clocks (name, rows -> the clock at each evaluation, format) at
    which the held-out reward first reaches the level (runs that never reach it censored, `time_to_reach`), how many
    reach it, and the speed-up base / method on each clock (`censored_speedup`), Holm over all of them. Returns
    (how many speed-ups, the table's rows)."""
    reach = {  # (share, label, clock) -> {seed: (x, reached)}
        (share, label, i): {
            s: time_to_reach(clock(rows), eval_curve(rows)[2], pre + share * (top - pre))
            for s, rows in by_label[label].items()
        }
        for share in THRESHOLD_SHARES
        for label in labels
        for i, (_, clock, _) in enumerate(clocks)
    }
    speed = {k: censored_speedup(reach[(k[0], base, k[2])], r) for k, r in reach.items() if k[1] != base}
    adjusted = dict(zip(speed, holm([v[4] for v in speed.values()])))
    rows = []
    for share in THRESHOLD_SHARES:
        for label in labels:
            medians = [km_median(*zip(*reach[(share, label, i)].values())) for i in range(len(clocks))]
            cells = [
                fmt_speedup(*speed[(share, label, i)], adjusted[(share, label, i)]) if label != base else "1"
                for i in range(len(clocks))
            ]
            rows.append(
                f"| {share:.0%} ({pre + share * (top - pre):.4f}) | {label} | "
                + " | ".join(f"{m:{fmt}}" for m, (_, _, fmt) in zip(medians, clocks))
                + f" | {reach_counts(reach[(share, label, 0)])} | {cells[0]} | {cells[1]} |"
            )
    return len(speed), rows


def report_rvge_single(res: Results, out: Path):
    """Per reward: final held-out reward, then the time and iterations each method needs to reach
    matched thresholds (NFT's final value and two intermediate levels) and the speed-up, runs that never reach a
    level counted as censored (Kaplan-Meier medians, log-rank p, Holm over the reward's thresholds x measures)."""
    lines = res.banner() + [
        "Single-reward training (budget 1, so `eval/weighted` is the reward itself); thresholds on the held-out "
        "curve (evaluations linearly interpolated; training seconds exclude evaluation). `final − nft`: one "
        "comparison per reward, no correction; N80 at the observed difference (no noise floor is measured here).",
        "",
    ]
    base = res.exp.baseline
    for reward, by_label in res.runs.items():
        if not by_label.get(base):
            lines += [f"## {reward}", "", f"no {base} run finished yet", ""]
            continue
        pre = np.nanmean([eval_curve(rows)[2][0] for rows in by_label[base].values()])
        top = np.nanmean([final(rows, "eval/weighted") for rows in by_label[base].values()])
        lines += [
            f"## {reward}",
            "",
            f"Pretrained {pre:.4f}; {base}'s final {top:.4f}.",
            "",
            "| method | n | final held-out | training seconds | final − " + base + " [95%] |",
            "|---|---|---|---|---|",
        ]
        for label, runs in by_label.items():
            fin = res.values(reward, label, lambda r: final(r, "eval/weighted"))
            secs = [elapsed(rows)[-1] for rows in runs.values()]
            diff = (
                fmt_ci(*mean_ci(paired(fin, res.values(reward, base, lambda r: final(r, "eval/weighted")))))
                if label != base
                else "—"
            )
            lines.append(f"| {label} | {len(runs)} | {mean_std(list(fin.values()))} | {mean_std(secs, 1)} | {diff} |")
        if top <= pre:
            lines += ["", f"{base} did not improve on the pretrained model here, so no threshold is meaningful.", ""]
            continue
        clocks = (
            ("seconds", lambda rows: eval_curve(rows)[1], ".1f"),
            ("iterations", lambda rows: eval_curve(rows)[0], ".1f"),
        )
        n_speed, table = speedup_table(by_label, list(by_label), base, pre, top, clocks)
        lines += [
            "",
            f"Kaplan-Meier median time to each level (runs that never reach it censored at their last evaluation; "
            f"inf: the median is not reached); speed-up = {base}'s median / the method's [95% paired bootstrap over "
            f"seeds], log-rank p, Holm over this reward's {n_speed} speed-ups:",
            "",
            "| threshold | method | median seconds | median iterations | reached | speed-up in time | in iterations |",
            "|---|---|---|---|---|---|---|",
            *table,
            "",
        ]
    curve_figure(res, out / "reward_vs_time.png")
    return lines + ["![](reward_vs_time.png)", ""]


LOWER_IS_BETTER = ("judge/frechet",)  # with or without the "eval/" of metrics.jsonl


def better_sign(metric):
    """-1 for a metric where lower is better (the Fréchet distance, named "eval/judge/frechet" in a run's metrics and
    "judge/frechet" in the final evaluation), else +1. Until 2026-12-02 only the first name was known, so the
    protocol's summaries counted a higher Fréchet distance as an improvement."""
    return -1.0 if metric.removeprefix("eval/") in LOWER_IS_BETTER else 1.0


def is_frechet(metric):
    return metric.removeprefix("eval/") == "judge/frechet"


UNEQUAL_N = "n/a (unequal N)"  # a Fréchet distance depends on the number of images: never compared across N


def eval_set(record: dict):
    """The held-out prompts a run's in-run evaluations used: its --eval-prompts, or None for the embedded held-out
    split (the same N images in every run of an experiment)."""
    return flag_value(record_settings(record), "--eval-prompts")


def equal_n(res, group: str, labels) -> bool:
    """Whether every run of these labels in the group was evaluated on the same prompts (so the same N images):
    the condition for comparing their Fréchet distances."""
    return len({eval_set(r) for r in res.records if r["group"] == group and r["label"] in labels}) <= 1


def verdict(metric, lo, hi):
    """+1: the interval lies wholly on the better side of 0; -1: wholly on the worse side; 0: it
    holds 0, or there is no interval (fewer than 2 paired seeds)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return 0
    lo, hi = sorted((better_sign(metric) * lo, better_sign(metric) * hi))
    return 1 if lo > 0 else -1 if hi < 0 else 0


def report_rvge_joint(res: Results, out: Path):
    """Every held-out metric at the end of each run; RVGE (full and 1/5 compute) minus NFT, paired."""
    lines = res.banner()
    base, floor = res.exp.baseline, eval_floor(res)
    for group, by_label in res.runs.items():
        any_rows = next((rows for runs in by_label.values() for rows in runs.values()), None)
        if any_rows is None:
            continue
        metrics = sorted(k for k in any_rows[-1] if k.startswith("eval/"))
        lines += [
            f"## {group}: final held-out metrics (mean ± sd over seeds; frechet: lower is better)",
            "",
            "| method | n | iterations | training seconds | distance to base | "
            + " | ".join(m[5:] for m in metrics)
            + " |",
            "|---" * (5 + len(metrics)) + "|",
        ]
        before = {m: any_rows[0].get(m.replace("eval/", "eval_before/")) for m in metrics}
        lines.append(
            "| pretrained | | 0 | 0 | 0 | "
            + " | ".join(f"{v:.4f}" if v is not None else "" for v in before.values())
            + " |"
        )
        for label, runs in by_label.items():
            cell = res.cells[(group, label)]
            lines.append(
                f"| {label} | {len(runs)} | {cell_iterations(res.exp, cell)} | "
                f"{mean_std([elapsed(r)[-1] for r in runs.values()], 1)} | "
                f"{mean_std([distance_to_base(r) for r in runs.values()], 5)} | "
                + " | ".join(mean_std([final(r, m) for r in runs.values()]) for m in metrics)
                + " |"
            )
        rows = [(label, base) for label in by_label if label != base]
        rows += [(a, b) for a, b in res.exp.pairs if a in by_label and b in by_label]
        diffs = {
            (label, other): {
                m: mean_ci(
                    paired(
                        res.values(group, label, lambda r, m=m: final(r, m)),
                        res.values(group, other, lambda r, m=m: final(r, m)),
                    )
                )
                for m in metrics
                if not is_frechet(m) or equal_n(res, group, (label, other))
            }
            for label, other in rows
        }
        floors = floor.get("sd", {})
        adjusted = {  # Holm per metric over every comparison of this table
            m: dict(zip(rows, holm([p_value(*diffs[r][m]) if m in diffs[r] else np.nan for r in rows])))
            for m in metrics
        }
        lines += [
            "",
            f"Paired differences method − {base}, then between methods (the variants against their parents) [95%]; "
            f"Holm per metric over these {len(rows)} comparisons; N80 at "
            + (
                "the larger of the observed difference and two noise floors of one in-run evaluation "
                "(`eval_floor.json`)"
                if floors
                else "the observed difference (no noise floor is measured for the in-run evaluation)"
            )
            + f" and level 0.05 / {len(rows)}:",
            "",
            "| method | " + " | ".join(m[5:] for m in metrics) + " |",
            "|---" * (1 + len(metrics)) + "|",
        ]
        summary = []
        for label, other in rows:
            d, name = diffs[(label, other)], label if other == base else f"{label} − {other}"
            cells = [
                fmt_ci(*d[m], floor=floors.get(m), p_holm=adjusted[m][(label, other)], family=len(rows))
                if m in d
                else UNEQUAL_N
                for m in metrics
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
            better = sum(better_sign(m) * v[0] > 0 for m, v in d.items() if np.isfinite(v[0]))
            sig = [verdict(m, v[1], v[2]) if adjusted[m][(label, other)] < ALPHA else 0 for m, v in d.items()]
            summary.append(
                f"- {label} vs {other}: better on average on {better} of {len(d)} held-out metrics; "
                + (
                    f"resolved better on {sig.count(1)}, resolved worse on {sig.count(-1)}, unresolved on "
                    f"{sig.count(0)} (after Holm; unresolved is not a match)."
                    if any(np.isfinite(v[1]) for v in d.values())
                    else "no intervals (fewer than 2 paired seeds)."
                )
            )
        lines += [""] + summary + [""] + non_inferiority_lines(res, group, floor, metrics, diffs, rows)
        lines += along_the_run(res, group, by_label, base)
        lines += [
            "Distance to base: `loss/base_reg`, mean |v_theta - v_base|^2 of the trained velocity against the frozen",
            "pretrained one on the training queries, averaged over the run's last 10 iterations (how far it moved).",
            "",
        ] + direction_sizes(by_label)
    curve_figure(res, out / "reward_vs_time.png", metric=ALONG)
    return lines + ["![](reward_vs_time.png)", ""]


EVAL_FLOOR_NOISES = 16  # noise sets of the in-run evaluation's noise floor (`measure_eval_floor`)


def measure_eval_floor(exp: Experiment, exp_dir: Path, noises=EVAL_FLOOR_NOISES) -> dict:
    """The noise floor of one in-run held-out evaluation: the pretrained model evaluated as every run evaluates
    (`run_kit.evaluate`: the held-out prompts, the ODE sampler, the first cell's rewards and judges) from `noises`
    noise sets (run_kit.EVAL_SEED, the runs' own, and the next noises - 1 seeds); per metric the sd over them.
    report_rvge_joint's non-inferiority margin is two of these. Cached in exp_dir/eval_floor.json (measured again
    when the settings, the world or `noises` differ). The model is imported only when something is measured."""
    path, cell = exp_dir / "eval_floor.json", exp.cells[0]
    settings, world = [*exp.common, *cell.flags], shapes_world.world_id()
    cached, problem = read_json(path) if path.is_file() else (None, None)
    if isinstance(cached, dict) and [cached.get(k) for k in ("settings", "world", "noises")] == [
        settings,
        world,
        noises,
    ]:
        return cached
    import importlib
    import tempfile

    from kit import run_kit

    script = importlib.import_module(cell.script)
    seeds = [run_kit.EVAL_SEED + k for k in range(noises)]
    values, default = {}, run_kit.EVAL_SEED
    with tempfile.TemporaryDirectory() as tmp:
        args = script.parse_args([*settings, "--out", str(Path(tmp) / "run")])
        names, budgets, branch = run_kit.check_common(args)
        run = run_kit.load_run(args, names, budgets, branch, cell.script, lock=False)
        try:
            for seed in seeds:
                run_kit.EVAL_SEED = seed
                for m, v in run_kit.evaluate(run, args, script.ode_sample)[0].items():
                    values.setdefault(m, []).append(float(v))
        finally:
            run_kit.EVAL_SEED = default
    record = {
        "what": "the pretrained model's in-run held-out evaluation from several noise sets (bench.measure_eval_floor)",
        "settings": settings,
        "world": world,
        "noises": noises,
        "seeds": seeds,
        "values": values,
        "sd": {m: float(np.std(v, ddof=1)) for m, v in values.items()},
    }
    exp_dir.mkdir(parents=True, exist_ok=True)
    run_kit.write_atomic(path, json.dumps(record, indent=1) + "\n")
    return record


def non_inferiority(diff, margin, better=1):
    """One-sided paired t test that a method is not worse than the baseline by more than `margin`: H0 better * (mean
    difference) <= -margin. From `mean_ci`'s (m, lo, hi, n); returns its p (NaN below 2 seeds)."""
    from scipy import stats

    m, lo, hi, n = diff
    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if se == 0:
        return 0.0 if better * m > -margin else 1.0
    return float(stats.t.sf((better * m + margin) / se, n - 1))


def eval_floor(res: Results) -> dict:
    """The experiment's eval_floor.json (`measure_eval_floor`: its "sd" per metric is the sd of one in-run
    evaluation); {} when it was not measured (an earlier world's results) or cannot be read (with a warning)."""
    path = getattr(res, "exp_dir", Path(".")) / "eval_floor.json"
    record, problem = read_json(path) if path.is_file() else (None, None)
    if problem or record is not None and not (isinstance(record, dict) and isinstance(record.get("sd"), dict)):
        print(f"warning: {path}: {problem or 'no sd field'}; no noise floor or non-inferiority margin is used")
        return {}
    return record or {}


def non_inferiority_lines(res: Results, group, floor, metrics, diffs, rows) -> list[str]:
    """Markdown: "matches" as a test. Each method − baseline against a non-inferiority margin of two noise floors of
    one in-run evaluation (`floor`: exp_dir/eval_floor.json, `eval_floor`); one-sided paired t, Holm per metric over
    the methods. Nothing when the floor was not measured (an earlier world's results)."""
    if not floor:
        return []
    base = res.exp.baseline
    mine = [r for r in rows if r[1] == base]
    margins = {m: 2 * floor["sd"][m] for m in metrics if m in floor["sd"]}
    p = {
        m: dict(
            zip(
                mine,
                holm(
                    [
                        non_inferiority(diffs[r][m], margins[m], better_sign(m)) if m in diffs[r] else np.nan
                        for r in mine
                    ]
                ),
            )
        )
        for m in margins
    }
    lines = [
        f'Non-inferiority to {base} ("matches or beats"): margin = two noise floors of one in-run evaluation (the '
        f"pretrained model's sd over {floor['noises']} noise sets, `eval_floor.json`; the rule the claims table "
        'names, fixed before this table was read but after the runs); one-sided paired t of H0 "worse by the margin '
        f'or more", Holm per metric over these {len(mine)} methods; ✓ non-inferior (Holm p < 0.05).',
        "",
        "| method | " + " | ".join(f"{m[5:]} (margin {margins[m]:.4g})" for m in margins) + " | non-inferior on |",
        "|---" * (2 + len(margins)) + "|",
    ]
    for r in mine:
        ok = [m for m in margins if p[m][r] < ALPHA]
        cells = [f"{'✓ ' if m in ok else ''}Holm {p[m][r]:.2g}" if np.isfinite(p[m][r]) else "n/a" for m in margins]
        lines.append(f"| {r[0]} | " + " | ".join(cells) + f" | {len(ok)} of {len(margins)} |")
    # the control that could prove the margin useless: the pretrained model itself against the baseline's final
    before = {
        m: mean_ci(
            paired(
                res.values(group, base, lambda r, m=m: r[0].get(m.replace("eval/", "eval_before/"), np.nan)),
                res.values(group, base, lambda r, m=m: final(r, m)),
            )
        )
        for m in margins
    }
    control = {m: non_inferiority(before[m], margins[m], better_sign(m)) for m in margins}
    ok = [m for m in margins if control[m] < ALPHA]
    lines.append(
        "| pretrained (control: no training) | "
        + " | ".join(
            f"{'✓ ' if m in ok else ''}p {control[m]:.2g}" if np.isfinite(control[m]) else "n/a" for m in margins
        )
        + f" | {len(ok)} of {len(margins)} |"
    )
    return lines + [
        "",
        "The control row tests the pretrained model (iteration 0, no correction) against the same margin: where it "
        "is non-inferior too, the margin is wider than the baseline's own gain and a ✓ there says nothing.",
        "",
    ]


def distance_to_base(rows, last=10):
    """Mean `loss/base_reg` (|v_theta - v_base|^2 on the training queries) over the run's last `last` iterations."""
    return float(np.mean([m["loss/base_reg"] for m in rows[-last:] if "loss/base_reg" in m] or [np.nan]))


def distance_curve(rows, k=5):
    """The distance to the base model along a run, at each held-out evaluation (`eval_curve`'s points): `loss/base_reg`
    averaged over the `k` iterations up to the evaluation, as a running maximum (the farthest the run has been by
    then, so that "distance needed to reach a level" is well defined); 0 at the pretrained model."""
    base = [m.get("loss/base_reg", np.nan) for m in rows]
    pts = [0.0] if rows and "eval_before/weighted" in rows[0] else []
    pts += [float(np.mean(base[max(0, i - k + 1) : i + 1])) for i, m in enumerate(rows) if "eval/weighted" in m]
    return np.maximum.accumulate(np.array(pts, dtype=float)) if pts else np.zeros(0)


DRIFT_CONTRASTS = (  # (method, against): distance to base, compared as a ratio; one Holm family
    ("rvge_permuted", "rvge"),  # a noisy direction drifts as far with the reward shuffled within groups
    ("rvge_permuted", "nft_permuted"),  # RVGE's noise against NFT's
    ("nft_permuted", "nft"),
    ("rvge_eta_0.1", "rvge"),  # a longer step: a smaller eta moves less
    ("rvge_eta_0.05", "rvge"),
)


def report_rvge_drift(res: Results, out: Path):
    """RVGE's drift on one reward, decided: distance to the base model of RVGE and NFT with the reward and with it
    shuffled within groups, and of RVGE at smaller --eta (ratios over paired seeds, Holm over `DRIFT_CONTRASTS`);
    the held-out reward against that distance; speed-ups at matched iterations and at matched distance (censored)."""
    lines = res.banner()
    base = res.exp.baseline
    for reward, by_label in res.runs.items():
        if not by_label.get(base):
            lines += [f"## {reward}", "", f"no {base} run finished yet", ""]
            continue
        metric = "eval/weighted"

        def value(label, fn):
            return res.values(reward, label, fn)

        dist = {label: value(label, distance_to_base) for label in by_label}
        fin = {label: value(label, lambda r: final(r, metric)) for label in by_label}
        pre = np.nanmean([eval_curve(rows)[2][0] for rows in by_label[base].values()])
        top = np.nanmean(list(fin[base].values()))
        lines += [
            f"## {reward}",
            "",
            f"Pretrained {pre:.4f}; {base}'s final {top:.4f}. Distance to base: `loss/base_reg` (mean |v_theta - "
            "v_base|^2 on the training queries) over the run's last 10 iterations. Held-out reward: the true reward "
            "for every arm (the permuted arms shuffle only their training scores). Final − " + base + ": paired t, "
            "no correction.",
            "",
            "| method | n | final held-out | distance to base | final Fréchet | final CNN judge | final − "
            + base
            + " [95%] |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, runs in by_label.items():
            if not runs:
                continue
            diff = fmt_ci(*mean_ci(paired(fin[label], fin[base]))) if label != base else "—"
            frechet = [final(r, "eval/judge/frechet") for r in runs.values()]
            cnn = [final(r, "eval/judge/cnn") for r in runs.values()]
            lines.append(
                f"| {label} | {len(runs)} | {mean_std(list(fin[label].values()))} | "
                f"{mean_std(list(dist[label].values()), 5)} | {mean_std(frechet, 0)} | {mean_std(cnn)} | {diff} |"
            )
        contrasts = [(a, b) for a, b in DRIFT_CONTRASTS if by_label.get(a) and by_label.get(b)]
        logs = {
            (a, b): mean_ci(
                paired({s: np.log(v) for s, v in dist[a].items()}, {s: np.log(v) for s, v in dist[b].items()})
            )
            for a, b in contrasts
        }
        adjusted = holm([p_value(*logs[c]) for c in contrasts])
        lines += [
            "",
            f"Distance to base as a ratio (paired over seeds on the log scale: exp of the mean log ratio [95% t "
            f"interval]); Holm over these {len(contrasts)} comparisons. A noisy direction predicts rvge_permuted / "
            "rvge near 1; a longer step predicts it well below 1 and smaller ratios at smaller --eta.",
            "",
            "| distance ratio | n | ratio [95%] | log ratio, its sd, p, Holm |",
            "|---|---|---|---|",
        ]
        for (a, b), p_holm in zip(contrasts, adjusted):
            m, lo, hi, n = logs[(a, b)]
            lines.append(
                f"| {a} / {b} | {n} | {np.exp(m):.3g} [{np.exp(lo):.3g}, {np.exp(hi):.3g}] | "
                f"{fmt_ci(m, lo, hi, n, digits=3, p_holm=p_holm, family=len(contrasts))} |"
            )
        if top <= pre:
            lines += ["", f"{base} did not improve on the pretrained model here, so no threshold is meaningful.", ""]
            continue
        movers = [label for label in by_label if label != base and "permuted" not in label and by_label[label]]
        clocks = (("iterations", lambda rows: eval_curve(rows)[0], ".1f"), ("distance", distance_curve, ".5f"))
        n_speed, table = speedup_table(by_label, [base, *movers], base, pre, top, clocks)
        lines += [
            "",
            f"Matched iterations and matched distance: the Kaplan-Meier median iterations, and distance to base "
            f"(`distance_curve`: its running maximum), at which the held-out reward first reaches each level (runs "
            f"that never reach it censored, never dropped); speed-up = {base}'s median / the method's (> 1: the "
            f"method needs fewer iterations, or moves less far from the base model) [95% paired bootstrap], log-rank "
            f"p, Holm over these {n_speed} speed-ups:",
            "",
            "| threshold | method | median iterations | median distance | reached | speed-up in iterations | "
            "in distance |",
            "|---|---|---|---|---|---|---|",
            *table,
            "",
        ]
        drift_figure(reward, by_label, out / f"reward_vs_distance_{slug(reward)}.png")
        lines += [f"![](reward_vs_distance_{slug(reward)}.png)", ""]
    return lines


def drift_figure(reward, by_label, path):
    """Held-out reward against distance to the base model (`distance_curve`, log scale), one line per run, and its
    Fréchet distance against the same."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, (label, runs) in enumerate(by_label.items()):
        for j, rows in enumerate(runs.values()):
            x = distance_curve(rows)
            for ax, metric in zip(axes, ("eval/weighted", "eval/judge/frechet")):
                y = eval_curve(rows, metric)[2]
                n = min(len(x), len(y))
                ax.plot(
                    x[1:n], y[1:n], color=f"C{k}", alpha=0.7, lw=1, label=f"{label} (n={len(runs)})" if j == 0 else None
                )
    for ax, name in zip(axes, (f"held-out {reward}", "held-out Fréchet distance")):
        ax.set(xscale="log", xlabel="distance to base (running max of loss/base_reg)", ylabel=name)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def direction_sizes(by_label: dict) -> list[str]:
    """Markdown: per RVGE method, each reward's `rvge/direction_rms` (mean over iterations and seeds), its bandwidth."""
    lines = []
    for label, runs in by_label.items():
        rows = [m for r in runs.values() for m in r]
        names = [k.split("/", 2)[2] for k in (rows[0] if rows else {}) if k.startswith("rvge/direction_rms/")]
        if names:
            rms = {n: np.nanmean([m[f"rvge/direction_rms/{n}"] for m in rows]) for n in names}
            sizes = [f"{n} {rms[n]:.4f} ({rows[-1][f'rvge/bandwidth/{n}']})" for n in names]
            lines.append(
                f"- {label}: direction rms per reward (mean over iterations and seeds; bandwidth) " + ", ".join(sizes)
            )
    return lines + [""] if lines else []


ALONG = ("eval/weighted", "eval/judge/cnn", "eval/judge/frechet")


def along_the_run(res: Results, group: str, by_label: dict, base: str) -> list[str]:
    """Markdown: at each held-out evaluation, each full-length method minus the baseline at the same iteration
    (paired over seeds, 95% t) for `ALONG`'s metrics: where along the run one overtakes the other."""
    full = [lbl for lbl in by_label if lbl != base and res.cells[(group, lbl)].compute == 1.0]
    if not full or not by_label.get(base):
        return []
    iters = eval_curve(next(iter(by_label[base].values())), ALONG[0])[0]
    lines = [
        f"Along the run: method − {base} at the same iteration [95%] (iteration 0: the pretrained model, identical); "
        "no correction: read as a curve, not as tests; N80 at the observed difference.",
        "",
        "| iteration | " + " | ".join(f"{lbl}: {m[5:]}" for lbl in full for m in ALONG) + " |",
        "|---" * (1 + len(full) * len(ALONG)) + "|",
    ]
    for i, it in enumerate(iters[1:], start=1):

        def at(label, m, i=i):
            return res.values(
                group, label, lambda r: eval_curve(r, m)[2][i] if len(eval_curve(r, m)[2]) > i else np.nan
            )

        cells = [
            fmt_ci(*mean_ci(paired(at(lbl, m), at(base, m))), digits=4 if not is_frechet(m) else 0)
            if not is_frechet(m) or equal_n(res, group, (lbl, base))
            else UNEQUAL_N
            for lbl in full
            for m in ALONG
        ]
        lines.append(f"| {int(it)} | " + " | ".join(cells) + " |")
    return lines + [""]


PROFILE_CANDIDATES = (
    "geneval",
    "saturation",
    "sharpness",
    "jpeg",
    "geneval_strict",
    "count",
    "colour",
    "shape",
    "position",
    "detail",
    "texture",
    "grain",
)


def measure_profiles(exp_dir: Path, names=PROFILE_CANDIDATES, iterations=48, prompts=8, seed=0, replace_results=False):
    """D_k(t) of every candidate reward under the pretrained model: recast.py's own rollouts (rotated
    branch layout, so each of the 8 inner levels is measured by prompts * iterations / 8 groups) and its
    level statistics, with no update. Cached in exp_dir/profiles.json (reused for the same rewards, sizes and
    embedded world): names, sigmas, the statistics (n, s1, s2: the file `recast.py --gain-init` starts from), D, se
    and the evidence rho of each reward. A cached file of other rewards, sizes or world is refused unless
    replace_results (then moved to exp_dir/set-aside/); a damaged one is moved there and measured anew."""
    path = exp_dir / "profiles.json"
    if path.exists():
        cached, problem = read_json(path)
        if problem is None and not isinstance(cached, dict):
            problem = f"a JSON {type(cached).__name__}, not profiles"
        if problem:
            where = set_aside({path: problem}, exp_dir, "damaged")
            print(f"{path}: {problem}; moved to {where / path.name} and measured anew", flush=True)
        else:
            mine = {
                "names": list(names),
                "iterations": iterations,
                "prompts": prompts,
                "world": shapes_world.world_id(),
            }
            differ = "; ".join(f"{k} {cached.get(k)} there, {v} now" for k, v in mine.items() if cached.get(k) != v)
            if not differ:
                return cached
            if not replace_results:
                raise SystemExit(
                    f"{path} holds profiles measured differently ({differ}); this command would measure and replace "
                    "them. Pass --out DIR (another folder) to keep them, or --replace-results to move the file to "
                    f"{exp_dir / 'set-aside'}/<time>/ and measure anew; nothing was run or changed"
                )
            where = set_aside({path: f"profiles measured differently ({differ})"}, exp_dir, "replaced")
            print(f"--replace-results: moved {path} ({differ}) to {where}", flush=True)
    import torch

    import recast

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = recast.parse_args(
            [
                "--rewards",
                ",".join(names),
                "--budgets",
                ",".join(["1"] * len(names)),
                "--seed",
                str(seed),
                "--prompts-per-iter",
                str(prompts),
                "--eval-every",
                "0",
                "--out",
                str(exp_dir / "work" / "profiles"),
                "--overwrite",
            ]
        )
        run = recast.setup_run(args)
        sigmas, stats = run.sigmas.double().numpy(), None
        for it in range(iterations):
            b = recast.rollout_and_score(run, args, it, recast.iteration_generator(seed, it))
            r = recast.optimality(b.R, b.groups, std=recast.global_stats(b.R, run.reduce)[2])
            new = recast.level_observations(r, b.groups, b.ancestry, b.layouts, args.steps)
            stats = list(new) if stats is None else [a + c for a, c in zip(stats, new)]
    finally:
        torch.set_num_threads(threads)
    D, se = recast.level_curves(*stats)
    rho = recast.credit_profiles(D, se, sigmas, stats[0])[3]
    out = {
        "names": list(names),
        "iterations": iterations,
        "prompts": prompts,
        "steps": args.steps,
        "estimator": "pairs",
        "world": shapes_world.world_id(),
        "sigmas": sigmas.tolist(),
        "n": stats[0].tolist(),
        "s1": stats[1].tolist(),
        "s2": stats[2].tolist(),
        "D": np.where(np.isfinite(D), D, -1.0).tolist(),
        "se": np.where(np.isfinite(se), se, -1.0).tolist(),
        "rho": rho.tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)  # atomic: a kill leaves no torn file
    return out


def setting_W(prof: dict, rewards, budgets):
    """W that ReCAST builds from the measured profiles of `rewards` (recast.credit_profiles + solve_W
    at the defaults): what the credit looks like with ~prompts * iterations groups of evidence."""
    import recast

    rows = [prof["names"].index(k) for k in rewards]
    n, s1, s2 = np.asarray(prof["n"]), np.asarray(prof["s1"])[rows], np.asarray(prof["s2"])[rows]
    D, se = recast.level_curves(n, s1, s2)
    P, rho = recast.credit_profiles(D, se, np.asarray(prof["sigmas"]), n)[2:]
    return recast.solve_W([float(b) for b in budgets], P), rho


def settings_W(prof: dict) -> dict:
    """setting -> (W at uniform budgets, evidence rho) from the measured profiles: what the profile table and
    figure show."""
    return {setting: setting_W(prof, rewards, ["0.25"] * len(rewards)) for setting, rewards in SETTINGS.items()}


def profile_table(prof: dict) -> list[str]:
    """Markdown: each candidate's D_k(0) with its standard error, D_k(t) / D_k(0) at every measured level,
    and per setting the evidence rho and how far W departs from uniform (uniform budgets)."""
    sig, D, se = np.asarray(prof["sigmas"]), np.asarray(prof["D"]), np.asarray(prof["se"])
    n = np.asarray(prof["n"])
    levels = [j for j in range(1, len(sig)) if n[j] >= 2]
    lines = [
        f"## The settings, from measured gains (`measure_profiles`: {prof['iterations']} iterations x "
        f"{prof['prompts']} prompt groups of the pretrained model, {int(prof['n'][1])} groups per inner level)",
        "",
        "| reward | D(0) nats ± se | " + " | ".join(f"t={sig[j]:.2f}" for j in levels) + " |",
        "|---" * (2 + len(levels)) + "|",
    ]
    for k, name in enumerate(prof["names"]):
        top = D[k, -1]
        cells = [f"{D[k, j] / top:.2f} ± {se[k, j] / top:.2f}" if se[k, j] >= 0 else "" for j in levels]
        lines.append(f"| {name} | {top:.4f} ± {se[k, -1]:.4f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "D(t) / D(0) ± se / D(0): the share of the reward's final discriminability already decided at noise level t.",
        "",
    ]
    for setting, (W, rho) in settings_W(prof).items():
        rewards, dev = SETTINGS[setting], np.abs(w_ratio(W) - 1)
        lines.append(
            f"- setting {setting} ({', '.join(rewards)}): evidence rho {', '.join(f'{r:.2f}' for r in rho)}; "
            f"W at uniform budgets departs from uniform by max {dev.max():.3f}, mean {dev.mean():.3f} "
            "(|K T W / Lam - 1|)"
        )
    return lines + [""]


def profile_figure(prof: dict, path: Path):
    """Left: each candidate's D_k(t) / D_k(0) against t with +- 1 se (the settings' rewards marked);
    right: ReCAST's W for each setting at uniform budgets, from these measurements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sig, names = np.asarray(prof["sigmas"]), prof["names"]
    D, se = np.asarray(prof["D"]), np.asarray(prof["se"])
    fig, axes = plt.subplots(
        1,
        1 + len(SETTINGS),
        figsize=(5.5 + 3.6 * len(SETTINGS), 3.6),
        gridspec_kw={"width_ratios": [1.6] + [1] * len(SETTINGS)},
    )
    for k, name in enumerate(names):
        ok = D[k] >= 0
        where = [s for s, rw in SETTINGS.items() if name in rw]
        style = "-" if where else ":"
        top = D[k, -1] if D[k, -1] > 0 else 1.0
        axes[0].errorbar(
            sig[ok],
            D[k, ok] / top,
            yerr=se[k, ok] / top,
            ls=style,
            marker="o",
            ms=3,
            capsize=2,
            label=f"{name}" + (f" ({'+'.join(where)})" if where else ""),
        )
    axes[0].set(
        xlabel="t (1 = noise, 0 = image)",
        ylabel="D_k(t) / D_k(0)",
        title="Rényi gain measured on the pretrained model",
        xlim=(1.02, -0.02),
    )
    axes[0].legend(fontsize=7, ncol=2)
    for ax, (setting, (W, rho)) in zip(axes[1:], settings_W(prof).items()):
        rewards = SETTINGS[setting]
        im = ax.imshow(w_ratio(W), aspect="auto", cmap="coolwarm", vmin=0.5, vmax=1.5)
        ax.set(
            title=f"setting {setting}: K T W / Lam",
            xlabel="step j (t from 1 to 0)",
            yticks=range(len(rewards)),
            yticklabels=[f"{r} (rho {p:.2f})" for r, p in zip(rewards, rho)],
        )
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


EVAL_SEEDS = (1, 2)  # the final evaluation's noise seeds: the first for the tables, the second for the noise floor


def final_eval_images(pipe, transformer_state, prompts, seed, steps=10):
    """Held-out images of one LoRA state (None: the pretrained model): Euler ODE, fixed noise per seed."""
    import torch
    from peft.utils import set_peft_model_state_dict

    import recast
    from kit import run_kit

    tr = pipe.transformer
    if transformer_state is None:
        tr.disable_adapters()
    else:
        tr.enable_adapters()
        set_peft_model_state_dict(tr, transformer_state, adapter_name="default")
        tr.set_adapter("default")
    emb, pooled = recast.encode(pipe, prompts, shapes_world.GEN_KWARGS["max_sequence_length"], "cpu")
    shape = (
        tr.config.in_channels,
        shapes_world.RES // pipe.vae_scale_factor,
        shapes_world.RES // pipe.vae_scale_factor,
    )
    with torch.no_grad():
        latents = recast.ode_sample(tr, emb, pooled, run_kit.scheduler_sigmas(pipe, steps), shape, seed)
    tr.enable_adapters()
    return recast.decode(pipe, latents)


def final_scores(images, prompts):
    """Per-image scores of every candidate reward, the CNN judge and the preference judge; the set's Fréchet
    distance."""
    return {
        **{k: shapes_world.REWARDS[k](images, prompts).tolist() for k in PROFILE_CANDIDATES},
        "judge/cnn": shapes_world.judge_cnn(images, prompts).tolist(),
        "judge/pref": shapes_world.judge_preference(images, prompts).tolist(),
        "judge/frechet": shapes_world.frechet_distance(images, prompts),
    }


def final_evals(runs: list[Run], exp_dir: Path, noises: int):
    """The final evaluation of every finished run (and of the pretrained model), on a held-out set
    larger than the runs' own: every held-out caption x `noises` noises, at each of EVAL_SEEDS
    (same images for every method: paired). Cached next to each result as <run>.final.json (keyed by the
    checkpoint's name); returns {run_id or "pretrained": {seed: scores}}. The model (torch, recast, run_kit) is
    imported only when something is evaluated: a rebuild from cached evaluations needs none of it."""
    prompts = [c for c in shapes_world.splits()["heldout"] for _ in range(noises)]
    out, pipe = {}, None
    todo = [("pretrained", None, exp_dir / "runs" / "pretrained.final.json")]
    todo += [
        (r.run_id, r.work / "checkpoints", r.result.with_name(r.run_id + ".final.json"))
        for r in runs
        if load_result(r) is not None
    ]
    for run_id, ckpts, path in todo:
        cached, problem = read_json(path) if path.exists() else ({}, None)
        if problem is None and not isinstance(cached, dict):
            problem = f"a JSON {type(cached).__name__}, not a final evaluation"
        if problem:
            print(f"warning: {path}: {problem}; not used (evaluated anew where the run's checkpoint exists)")
            cached = {}
        if ckpts and not (ckpts / "latest").is_file():  # no run folder (a fresh clone): the committed evaluation
            if cached.get("n") == len(prompts) and "scores" in cached:
                out[run_id] = cached["scores"]
            continue
        latest = (ckpts / (ckpts / "latest").read_text().strip()) if ckpts else None
        key = latest.name if latest else "pretrained"  # the checkpoint's name: the cache survives moving --out
        if (
            Path(str(cached.get("checkpoint", ""))).name == key
            and cached.get("n") == len(prompts)
            and "scores" in cached
        ):
            out[run_id] = cached["scores"]
            continue
        if ckpts and not (latest / "state.pt").is_file():
            continue  # result without its checkpoint (work folder removed): no final evaluation
        if pipe is None:
            import torch

            import recast
            from kit import run_kit

            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            pipe = run_kit.load_pipeline(recast.parse_args([]), "cpu", torch.float32)
        state = torch.load(latest / "state.pt", weights_only=False)["lora"]["default"] if latest else None
        scores = {
            str(seed): final_scores(final_eval_images(pipe, state, prompts, seed), prompts) for seed in EVAL_SEEDS
        }
        if problem:  # the damaged file is kept, never overwritten
            where = set_aside({path: problem}, exp_dir, "damaged")
            print(f"{path}: moved to {where / path.name}; evaluated anew", flush=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"checkpoint": key, "n": len(prompts), "prompts": prompts, "scores": scores}))
        os.replace(tmp, path)
        out[run_id] = scores
    if pipe is not None:
        torch.set_num_threads(threads)
    return out


def final_value(scores: dict, metric: str, names=(), budgets=(), base: dict | None = None):
    """One number of a final evaluation (`final_evals` scores at one seed): a reward's or judge's mean,
    the frechet distance, `weighted` (budget-weighted raw mean) or `scale_free`: each reward's change
    from the pretrained model (`base`, same images) in units of the pretrained per-image spread,
    budget-weighted: sum_k lambda_k (mean_k - mean0_k) / sd0_k / sum_k lambda_k."""
    if metric == "judge/frechet":
        return float(scores[metric])
    lam = np.asarray(budgets, dtype=float)
    if metric == "weighted":
        return float(lam @ [np.nanmean(scores[k]) for k in names] / lam.sum())
    if metric == "scale_free":
        z = [(np.nanmean(scores[k]) - np.nanmean(base[k])) / max(float(np.nanstd(base[k])), 1e-12) for k in names]
        return float(lam @ z / lam.sum())
    return float(np.nanmean(scores[metric]))


def report_protocol(res: Results, out: Path):
    """Issue 11: per (setting, budget) cell, recast minus each other method, paired by seed, on every
    training reward and judge of the large final evaluation, raw and scale-free, plus the preference
    judge's share (mean sigmoid of the score difference); Holm per metric over cells x comparisons; the noise floor
    of one evaluation; then how often ReCAST improves each judge."""
    lines = res.banner()
    finals = final_evals(plan_runs(res.exp, res.exp_dir), res.exp_dir, res.exp.final_noises)
    seed_a, seed_b = (str(s) for s in EVAL_SEEDS)
    base = finals.get("pretrained", {})
    n_img = len(next(iter(base.values()))["judge/cnn"]) if base else 0
    cells, floors = {}, {}  # group -> what its tables need; metric -> same weights' differences between noise sets
    for group, by_label in res.runs.items():
        cell = next(c for c in res.exp.cells if c.group == group)
        names, budgets = (
            flag_value(cell.flags, "--rewards").split(","),
            [float(b) for b in flag_value(cell.flags, "--budgets").split(",")],
        )
        metrics = names + ["weighted", "scale_free", "judge/cnn", "judge/frechet"]
        ids = {
            label: {seed: slug(f"{group}-{label}") + f"-seed{seed}" for seed in by_seed}
            for label, by_seed in by_label.items()
        }

        def value(label, m, seed_key=seed_a, ids=ids, names=names, budgets=budgets):
            return {
                s: final_value(finals[i][seed_key], m, names, budgets, base[seed_key])
                for s, i in ids[label].items()
                if i in finals
            }

        def pref(mine, other, seed_key=seed_a, ids=ids):
            return {
                s: pref_share(
                    finals[ids[mine][s]][seed_key]["judge/pref"], finals[ids[other][s]][seed_key]["judge/pref"]
                )
                for s in ids[mine]
                if s in ids[other] and ids[mine][s] in finals and ids[other][s] in finals
            }

        for label in ids:  # noise floor: the same weights, evaluated on the second noise set
            for m in metrics:
                a, b = value(label, m), value(label, m, seed_b)
                floors.setdefault(m, []).extend(a[s] - b[s] for s in a if s in b)
        comparisons = (  # the experiment's own pairs, else every ReCAST arm against every other arm
            [(r, o) for r, o in res.exp.pairs if r in ids and o in ids]
            if res.exp.pairs
            else [(r, o) for r in ids if r.startswith("recast") for o in ids if not o.startswith("recast")]
        )
        diffs = {}
        for mine, other in comparisons:
            diffs[(mine, other)] = {m: mean_ci(paired(value(mine, m), value(other, m))) for m in metrics}
            shares = (pref(mine, other), pref(mine, other, seed_b))
            diffs[(mine, other)]["pref"] = share_logits(shares[0].values())
            floors.setdefault("pref", []).extend(  # on the logit scale, where the share is tested
                share_logit(shares[0][s]) - share_logit(shares[1][s]) for s in shares[0] if s in shares[1]
            )
        cells[group] = (names, budgets, metrics, ids, value, diffs)
    floor_sd = {m: np.std(v, ddof=1) / np.sqrt(2) for m, v in floors.items() if len(v) > 1}
    family = [(g, c, m) for g, (*_, diffs) in cells.items() for c in diffs for m in diffs[c]]
    adjusted = {}
    for m in dict.fromkeys(k[2] for k in family):  # Holm per metric over every cell x comparison of the experiment
        keys = [k for k in family if k[2] == m]
        adjusted.update(zip(keys, holm([p_value(*cells[g][5][c][m]) for g, c, _ in keys])))
    n_tests = max((sum(k[2] == m for k in family) for m in {k[2] for k in family}), default=0)
    lines += [
        f"Final evaluation: every held-out caption x {res.exp.final_noises} noises ({n_img} images, Euler ODE, 10 "
        "steps), the same images (prompt and noise) for every method and the pretrained model, so every Fréchet "
        "distance here is over the same N. Judges are never trained on: `cnn` (learned attribute judge), `frechet` "
        "(distance of the judge's features to the data; lower is better: its difference counts as an improvement "
        "when negative) and `pref` (pairwise preference judge, a Bradley-Terry CNN trained on its own "
        "render-vs-corruption pairs: per seed, the mean over images of sigmoid(score of ReCAST's image − score of "
        "the other's), 0.5 = no preference; across seeds the mean logit with a 95% t interval, mapped back). "
        "`scale_free`: each training reward's change from the pretrained model in units of its pretrained per-image "
        "spread, budget-weighted; `weighted`: the budget-weighted raw mean.",
        "",
        f"Correction: Holm per metric over every cell x comparison of this experiment ({n_tests} tests per metric); "
        f"`Holm` is the adjusted p. N80: seeds for 80% power (paired t) at level 0.05 / {n_tests} (Holm's first step) "
        "and the larger of the observed difference and two noise floors of one evaluation (the table at the end).",
        "",
    ]
    counts = {}
    for group, (names, budgets, metrics, ids, value, diffs) in cells.items():
        lines += [
            f"## setting {group.split('-')[0]} ({', '.join(names)}), budgets {','.join(f'{b:g}' for b in budgets)}",
            "",
            "| method | n | " + " | ".join(metrics) + " |",
            "|---" * (2 + len(metrics)) + "|",
        ]
        if base:
            lines.append(
                "| pretrained | | "
                + " | ".join(f"{final_value(base[seed_a], m, names, budgets, base[seed_a]):.4f}" for m in metrics)
                + " |"
            )
        for label in ids:
            lines.append(
                f"| {label} | {len(value(label, metrics[0]))} | "
                + " | ".join(mean_std(list(value(label, m).values())) for m in metrics)
                + " |"
            )
        lines += [
            "",
            "| difference | n | " + " | ".join(metrics) + " | pref share |",
            "|---" * (3 + len(metrics)) + "|",
        ]
        for (mine, other), d in diffs.items():
            adj = {m: adjusted[(group, (mine, other), m)] for m in d}
            lines.append(
                f"| {mine} − {other} | {max(v[3] for v in d.values())} | "
                + " | ".join(fmt_ci(*d[m], floor=floor_sd.get(m), p_holm=adj[m], family=n_tests) for m in metrics)
                + f" | {fmt_share(*d['pref'], floor=floor_sd.get('pref'), p_holm=adj['pref'], family=n_tests)} |"
            )
            for m, (mean, lo, hi, n) in d.items():
                if n == 0:
                    continue
                c = counts.setdefault((mine, other, m), [0, 0, 0])
                c[2] += 1
                c[0] += better_sign(m) * mean > 0
                c[1] += verdict(m, lo, hi) == 1 and adj[m] < ALPHA
        lines.append("")
    lines += [
        "## How far ReCAST's W moved",
        "",
        "| setting | method | runs | iterations with W off uniform | mean max_kj abs(W / W_unif - 1) |",
    ]
    lines += ["|---|---|---|---|---|"]
    for setting in sorted({g.split("-")[0] for g in res.runs}):
        for label in sorted(
            {
                lbl
                for g, by in res.runs.items()
                if g.startswith(setting + "-")
                for lbl in by
                if lbl.startswith(("recast", "reversed"))
            }
        ):
            devs = [
                [w_departure(row["recast/W"]) for row in rows]
                for g, by in res.runs.items()
                if g.startswith(setting + "-")
                for rows in by.get(label, {}).values()
            ]
            if devs:
                off = np.mean([np.mean(np.asarray(d) > 1e-3) for d in devs])
                lines.append(
                    f"| {setting} | {label} | {len(devs)} | {off:.0%} | {np.mean([np.mean(d) for d in devs]):.3f} |"
                )
    lines += [
        "",
        "## Noise floor of one evaluation",
        "",
        f"The same weights evaluated on two noise sets (seeds {seed_a} and {seed_b}, same prompts): the standard "
        "deviation of one "
        "evaluation is sd(difference) / sqrt(2) over all finished runs; a method difference below ~2x this is not "
        "resolved by "
        "one evaluation (the paired intervals above include it, since each seed's difference is a separate "
        "evaluation). `pref`: on the logit scale of its share, the same pair of methods on the two noise sets.",
        "",
        "| metric | noise sd of one evaluation | runs |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {sd:.4f} | {len(floors[m])} |" for m, sd in floor_sd.items()]
    tally = {  # (mine, other, metric) -> [improves, significant after Holm, cells with results, cells planned]
        key: [int(n), int(sig), int(done), sum(key[0] in by and key[1] in by for by in res.runs.values())]
        for key, (n, sig, done) in counts.items()
    }
    (res.exp_dir / "summary.json").write_text(json.dumps({" | ".join(k): v for k, v in sorted(tally.items())}) + "\n")
    lines += ["", "## Summary", ""] + summary_lines(tally)
    settings = [EXPERIMENTS[name] for name in PROTOCOL_SETTINGS]
    files = [res.exp_dir.parent / e.name / "summary.json" for e in settings]
    tallies = [read_json(f) for f in files if f.is_file()] if res.exp.name in PROTOCOL_SETTINGS else []
    for f, (_, problem) in zip(files, tallies):
        if problem:
            print(
                f"warning: {f}: {problem}; the summary over both settings is left out (rebuild that setting's "
                "table with --tables-only to rewrite it)"
            )
    if tallies and len(tallies) == len(files) and all(t is not None for t, _ in tallies):  # every setting has run
        both = {}
        for tally_of_setting, _ in tallies:
            for text, v in tally_of_setting.items():
                key = tuple(text.split(" | "))
                both[key] = [a + b for a, b in zip(both.get(key, [0] * 4), v)]
        lines += ["", f"## Summary over both settings ({', '.join(e.name for e in settings)}; Holm within each)", ""]
        lines += summary_lines(both)
    prof_path = res.exp_dir.parent / PROFILES_DIR / "profiles.json"
    prof, problem = read_json(prof_path) if prof_path.is_file() else (None, None)
    if problem or prof is not None and not isinstance(prof, dict):
        print(f"warning: {prof_path}: {problem or 'not a JSON object'}; the profile table and figure are left out")
    elif prof is not None:
        profile_figure(prof, out / "profiles.png")
        lines = lines[:3] + profile_table(prof) + lines[3:]
    curve_figure(res, out / "reward_vs_time.png", x="iterations")
    drawn = w_figure(res, out / "W_final.png", labels=W_LABELS)
    return lines + [
        "",
        "Measured D_k(t) of the candidate rewards and the W ReCAST builds from them: ![](profiles.png)",
        "",
        "Held-out `eval/weighted` of the runs' own small evaluation (16 prompts) along training: "
        "![](reward_vs_time.png)",
        "",
        *([w_caption(drawn), ""] if drawn else []),
    ]


def summary_lines(tally: dict) -> list[str]:
    """Markdown bullets: per (method, other, judge or summary metric) "improves ... in n of N cells (significant
    after Holm in m)", from tally[(mine, other, metric)] = [improves, significant, cells with results, cells
    planned]."""
    lines = []
    for (mine, other, m), (n, sig, cells, planned) in sorted(tally.items()):
        if m.startswith("judge/") or m in ("scale_free", "weighted", "pref"):
            what = (
                f"judge {m[len('judge/') :]}"
                if m.startswith("judge/")
                else ("judge pref (share > 0.5)" if m == "pref" else m)
            )
            lines.append(
                f"- {'ReCAST' if mine == 'recast' else mine} improves {what} over {other} in {n} of {planned} cells "
                f"(significant after Holm in {sig})"
                + (f"; {planned - cells} cell(s) without results" if cells < planned else "")
            )
    return lines


def w_ratio(W) -> np.ndarray:
    """W_kj / (lambda_k / T): W against the uniform W of its own budgets (its row sums), 1 where uniform."""
    W = np.asarray(W, dtype=float)
    return W / (W.sum(1, keepdims=True) / W.shape[1])


def w_departure(W) -> float:
    """max_kj |W_kj / (lambda_k / T) - 1|: how far a logged W is from the uniform W of its own budgets."""
    return float(np.abs(w_ratio(W) - 1).max())


W_LABELS = ("recast", "recast_prior_grad", "reversed_grad")  # recast-protocol's W; recast-units' new arms
W_LABELS_ELSE = ("recast_prior", "reversed")  # where none of those ran (recast-reversed, recast-matched)


def w_caption(drawn):
    if drawn == ["recast"]:
        return "ReCAST's final W per cell (first seed): ![](W_final.png)"
    return f"The final W per cell (first seed), a row of panels per arm ({', '.join(drawn)}): ![](W_final.png)"


def w_figure(res: Results, path: Path, labels=("recast",), fallback=W_LABELS_ELSE) -> list[str]:
    """The credit matrix W at the last iteration of each group's run (first seed), one row of panels per label of
    `labels` that ran (else of `fallback`), five groups a row at most; returns the labels drawn (none: no figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = lambda which: [lbl for lbl in which if any(by.get(lbl) for by in res.runs.values())]  # noqa: E731
    drawn = ran(labels) or ran(fallback)
    per_label = {lbl: [(g, by[lbl][min(by[lbl])]) for g, by in res.runs.items() if by.get(lbl)] for lbl in drawn}
    if not drawn:
        return []
    cols = min(max(len(v) for v in per_label.values()), 5)
    n_rows = {lbl: -(-len(v) // cols) for lbl, v in per_label.items()}  # each label starts a row of panels
    height = sum(n_rows.values())
    fig, axes = plt.subplots(height, cols, figsize=(3.4 * cols, 2.6 * height), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    start = 0
    for lbl, found in per_label.items():
        for ax, (group, rows) in zip(axes[start : start + n_rows[lbl]].flat, found):
            names = flag_value(res.cells[(group, lbl)].flags, "--rewards").split(",")
            ax.axis("on")
            im = ax.imshow(np.array(rows[-1]["recast/W"]), aspect="auto", cmap="viridis")
            title = f"{group} {lbl}" if len(drawn) > 1 else group
            ax.set(title=title, xlabel="step j (t from 1 to 0)", yticks=range(len(names)), yticklabels=names)
            fig.colorbar(im, ax=ax)
        start += n_rows[lbl]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


JUDGES = ("eval/judge/cnn", "eval/judge/frechet")


def report_recast_100(res: Results, out: Path):
    """The embedded default, 100 iterations: final held-out metrics per method, paired differences with
    95% intervals, the noise floor of one evaluation, and how far ReCAST's W left uniform."""
    lines = res.banner()
    by_label = res.runs["A"]
    labels = [lbl for lbl, runs in by_label.items() if runs]
    rows0 = next(iter(by_label[labels[0]].values()))
    metrics = (
        ["eval/weighted"]
        + sorted(k for k in rows0[-1] if k.startswith("eval/") and k != "eval/weighted" and k not in JUDGES)
        + list(JUDGES)
    )
    before = {m: rows0[0].get(m.replace("eval/", "eval_before/")) for m in metrics}
    lines += [
        "Final held-out evaluation (iteration 100; 16 held-out prompts, fixed seeds; mean ± sd over seeds). "
        "`frechet` is lower-is-better (drift from the data).",
        "",
        "| method | " + " | ".join(m[5:] for m in metrics) + " |",
        "|---" * (1 + len(metrics)) + "|",
        "| pretrained | " + " | ".join(f"{before[m]:.4f}" if before[m] is not None else "" for m in metrics) + " |",
    ]
    for label in labels:
        lines.append(
            f"| {label} (n={len(by_label[label])}) | "
            + " | ".join(mean_std(list(res.values("A", label, lambda r, m=m: final(r, m)).values())) for m in metrics)
            + " |"
        )
    pairs = [
        (a, b) for a, b in (("recast", "nft"), ("recast", "uniform"), ("uniform", "nft")) if a in labels and b in labels
    ]
    diffs = {
        (a, b): {
            m: mean_ci(
                paired(res.values("A", a, lambda r, m=m: final(r, m)), res.values("A", b, lambda r, m=m: final(r, m)))
            )
            for m in metrics
            if not is_frechet(m) or equal_n(res, "A", (a, b))
        }
        for a, b in pairs
    }
    adjusted = {
        m: dict(zip(pairs, holm([p_value(*diffs[k][m]) if m in diffs[k] else np.nan for k in pairs]))) for m in metrics
    }
    lines += [
        "",
        "Paired differences at the final evaluation (same seeds: same prompts and noise), mean [95% t interval]; Holm "
        f"per metric over these {len(pairs)} comparisons; N80 at the observed difference and level 0.05 / "
        f"{len(pairs)}:",
        "",
        "| difference | " + " | ".join(m[5:] for m in metrics) + " |",
        "|---" * (1 + len(metrics)) + "|",
    ]
    for a, b in pairs:
        d = diffs[(a, b)]
        lines.append(
            f"| {a} − {b} | "
            + " | ".join(
                fmt_ci(*d[m], p_holm=adjusted[m][(a, b)], family=len(pairs)) if m in d else UNEQUAL_N for m in metrics
            )
            + " |"
        )
    floor = [
        np.std([m["eval/weighted"] for m in rows if "eval/weighted" in m][-3:], ddof=1)
        for lbl in labels
        for rows in by_label[lbl].values()
    ]
    lines += [
        "",
        f"Noise floor of one evaluation: the sd of `eval/weighted` over each run's last three evaluations "
        f"(iterations 80, 90, 100; the weights move little there) is {np.mean(floor):.4f} on average over the "
        f"{len(floor)} runs.",
        "",
    ]
    if "recast" in labels:
        dev = [w_departure(rows[-1]["recast/W"]) for rows in by_label["recast"].values()]
        rho = [rows[-1]["recast/evidence"] for rows in by_label["recast"].values()]
        moved = [np.mean([max(m["recast/evidence"]) > 0 for m in rows]) for rows in by_label["recast"].values()]
        mean_dev = [np.mean([w_departure(m["recast/W"]) for m in rows]) for rows in by_label["recast"].values()]
        lines += [
            f"ReCAST's final W: max_kj |W / (lambda_k / T) - 1| = {', '.join(f'{d:.3f}' for d in dev)} (per seed); "
            f"evidence rho per reward: {'; '.join(str([round(v, 2) for v in r]) for r in rho)}. Over the run, W left "
            f"uniform (some rho > 0) in {', '.join(f'{v:.0%}' for v in moved)} of iterations; the mean over "
            "iterations of "
            f"that max deviation: {', '.join(f'{v:.3f}' for v in mean_dev)}.",
            "",
        ]
    curve_figure(res, out / "eval_vs_iteration.png", x="iteration")
    for judge in JUDGES:
        curve_figure(res, out / f"{judge.split('/')[-1]}_vs_iteration.png", metric=judge, x="iteration")
    return lines + ["![](eval_vs_iteration.png) ![](cnn_vs_iteration.png) ![](frechet_vs_iteration.png)", ""]


def report_nft_steps(res: Results, out: Path):
    """Held-out eval/weighted vs iteration for each number of optimizer steps per iteration."""
    lines = res.banner()
    base = res.exp.baseline
    for group, by_label in res.runs.items():
        labels = [label for label, runs in by_label.items() if runs]
        if not labels:
            continue
        curves = {
            label: {s: dict(zip(*eval_curve(rows)[::2])) for s, rows in by_label[label].items()} for label in labels
        }
        its = sorted({i for c in curves.values() for per_seed in c.values() for i in per_seed})
        others = [lbl for lbl in labels if lbl != base]
        lines += [
            "Held-out `eval/weighted` (mean ± sd over seeds) and the paired difference to " + base + " [95%]; "
            "no correction: read as a curve, not as tests; N80 at the observed difference:",
            "",
            "| iteration | " + " | ".join(labels) + " | " + " | ".join(f"{o} − {base}" for o in others) + " |",
            "|---" * (1 + len(labels) + len(others)) + "|",
        ]
        for i in its:
            at = {label: {s: c[i] for s, c in curves[label].items() if i in c} for label in labels}
            row = [mean_std(list(at[label].values())) for label in labels]
            row += [fmt_ci(*mean_ci(paired(at[o], at.get(base, {})))) for o in others]
            lines.append(f"| {int(i)} | " + " | ".join(row) + " |")
        lines.append("")
        judges = [j for j in JUDGES if any(j in rows[-1] for by in by_label.values() for rows in by.values())]
        lines += [
            "Held-out judges at the final evaluation (mean ± sd over seeds; `frechet`: lower is closer to the data):",
            "",
            "| method | " + " | ".join(j[11:] for j in judges) + " |",
            "|---" * (1 + len(judges)) + "|",
        ]
        lines += [
            f"| {label} (n={len(by_label[label])}) | "
            + " | ".join(mean_std(list(res.values(group, label, lambda r, j=j: final(r, j)).values())) for j in judges)
            + " |"
            for label in labels
        ]
        lines.append("")
    curve_figure(res, out / "eval_vs_iteration.png", x="iteration")
    curve_figure(res, out / "eval_vs_time.png")
    return lines + ["![](eval_vs_iteration.png) ![](eval_vs_time.png)", ""]


# =============================================================================
# Main
# =============================================================================


def build_report(exp: Experiment, exp_dir: Path, planned: list[Run]) -> tuple[str, Results]:
    """table.md from the results of the planned runs. A result the report cannot read (rows without a metric the
    others have: an older format) is left out with a warning naming it, and the report made from the rest."""
    pairs = [(run, rec) for run in planned if (rec := load_result(run)) is not None]
    while True:
        records = [  # a result's place in the tables is its run's (file name and settings), not what it says
            {**rec, "run_id": run.run_id, "group": run.cell.group, "label": run.cell.label, "seed": run.seed}
            for run, rec in pairs
        ]
        res = Results(exp, records, planned)
        res.exp_dir = exp_dir
        try:
            text = (
                "\n".join(globals()[exp.report](res, exp_dir))
                if records
                else "\n".join(res.banner() + ["No finished runs yet.", ""])
            )
            break
        except KeyError as err:
            key = err.args[0] if err.args else None
            lacking = {run.run_id: run.result for run, rec in pairs if not any(key in m for m in rec["rows"])}
            if not lacking:
                raise  # not a result's fault
            if len(lacking) == len(pairs):
                raise SystemExit(
                    f"{exp.name}: the report needs {key!r}, which no result under {exp_dir / 'runs'} has (e.g. "
                    f"{next(iter(lacking.values())).name}: results of an older format?); rebuild them with the "
                    "bench.py they were made with, or move them away and rerun the experiment"
                ) from None
            for path in lacking.values():
                print(f"warning: {path}: its rows lack {key!r} (an older format?); left out of the tables")
            pairs = [(run, rec) for run, rec in pairs if run.run_id not in lacking]
    text += "\n".join(power_lines(exp, text))
    (exp_dir / "table.md").write_text(text)
    return text, res


def power_lines(exp: Experiment, text: str) -> list[str]:
    """Markdown: how large a run would resolve the table's unresolved paired differences. Reads the `N80 N` that
    fmt_ci printed beside each unresolved difference (80% power, alpha 0.05, at the effect its table states); sizes
    this experiment at the smallest, median and largest N (estimate_minutes on 2 cores with --jobs 2). No GPU rate is
    given: none has been measured here."""
    needs = [int(n) for n in re.findall(r"N80 (\d+)", text)]
    over = len(re.findall(r"N80 > ", text))
    if not needs and not over:
        return []
    lines = [
        "",
        "## Power",
        "",
        f"{len(needs) + over} paired difference(s) above are unresolved (`sd` is the sd of the paired differences, "
        "`N80` the seeds a paired t test needs for 80% power at the effect and level each table names"
        + (f"; {over} would need more than 10,000" if over else "")
        + "). This experiment at those sizes (all cells; `--seeds N`):",
        "",
        "| seeds | which | 2 cores, --jobs 2 |",
        "|---|---|---|",
    ]
    sizes = {}  # seeds -> which (the smallest, median and largest N80; one row when they coincide)
    for which, n in (
        ("largest", max(needs, default=0)),
        ("median", int(np.median(needs or [0]))),
        ("smallest", min(needs, default=0)),
    ):
        sizes[n] = which
    for n, which in sorted(sizes.items()):
        if n:
            lines.append(f"| {n} | {which} | ~{estimate_minutes(replace(exp, seeds=n), 2) / 60:.1f} h |")
    return lines + [""]


def results_block(text: str, records: list[dict], exp_dir: Path, md: Path, command: str) -> str:
    """table.md as a section of RESULTS.md: its `# <experiment>` title dropped (RESULTS.md has its own), headings
    two levels down, figure links made relative to RESULTS.md; opened by the command and the runs' commits and
    dates (from the results themselves, so the block is the same bytes whenever it is rebuilt)."""
    shas = sorted({(r.get("git_sha") or "")[:7] for r in records} - {""})
    days = sorted({r["finished"] for r in records if r.get("finished")})
    when = f"{days[0]}{f' to {days[-1]}' if len(days) > 1 else ''}" if days else "date not recorded"
    made = f"commit {', '.join(shas)}" if shas else "commit not recorded"
    worlds = sorted({r.get("world") or "not recorded" for r in records})
    made += f", embedded world {', '.join(worlds)}"
    lines = [f"`{command}` ({len(records)} runs made at {made}, {when}):", ""]
    rel = Path(os.path.relpath(exp_dir, md.parent)).as_posix()
    body = text.splitlines()
    body = body[1:] if body and body[0].startswith("# ") else body
    for line in body[next((i for i, x in enumerate(body) if x.strip()), len(body)) :]:
        line = "##" + line if line.startswith("#") else line
        lines.append(re.sub(r"!\[([^\]]*)\]\(([^/():]+\.png)\)", lambda m: f"![{m[1] or m[2]}]({rel}/{m[2]})", line))
    return "\n".join(lines).strip("\n")


def check_one_world(planned: list[Run], exp_dir: Path):
    """Refuse tables of results from two embedded worlds (one table, one world): name each world's files and the fix.
    A run refuses such a folder before anything runs (`check_results`); this guards --tables-only."""
    worlds = {}
    for run in planned:
        if (record := load_result(run)) is not None:
            worlds.setdefault(record.get("world") or "not recorded", []).append(run.result.name)
    if len(worlds) > 1:
        raise SystemExit(
            f"{exp_dir / 'runs'} holds results of {len(worlds)} embedded worlds ("
            + "; ".join(f"{w}: {len(f)} result(s), e.g. {f[0]}" for w, f in worlds.items())
            + "); one table never mixes worlds. Move one world's results (with their .final.json) to their own folder, "
            "e.g. results/world-<name>/<experiment>/runs/, and rebuild each with --tables-only --out; nothing was "
            "changed"
        )


def section_world(text: str):
    """The embedded world(s) a generated RESULTS.md section names in its first line (`results_block`), or None."""
    found = re.search(r"embedded world ([^,]+), ", text.split("\n", 1)[0])
    return found[1] if found else None


def check_results_md(md: Path, name: str):
    """Refuse a --results-md that is a folder, lies in a missing folder, or whose markers of `name` are not one
    `<!-- BEGIN name -->` followed by one `<!-- END name -->`: a rebuild could then replace text that is not the
    section (a deleted END would take everything after BEGIN with it). Nothing is changed."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if md.is_dir():
        raise SystemExit(f"--results-md {md} is a folder: name a Markdown file (e.g. {md / 'RESULTS.md'})")
    if not md.parent.is_dir():
        raise SystemExit(f"--results-md {md}: its folder {md.parent} does not exist; create it or name another file")
    try:
        text = md.read_text() if md.exists() else ""
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"--results-md {md} cannot be read as text ({err}); name a Markdown file") from None
    if not os.access(md if md.exists() else md.parent, os.W_OK):
        raise SystemExit(f"--results-md {md} is not writable: make it writable, or name another file")
    lines = text.splitlines()
    at = {m: [i + 1 for i, line in enumerate(lines) if m in line] for m in (begin, end)}
    counts = text.count(begin), text.count(end)
    if counts == (0, 0) or counts == (1, 1) and text.find(begin) < text.find(end):
        return
    where = "; ".join(f"{m} on line(s) {', '.join(map(str, at[m])) or 'none'}" for m in (begin, end))
    raise SystemExit(
        f"{md}: the section's markers do not pair up ({where}), so its end is unknown and a rebuild could delete text "
        f"that is not the section. Leave exactly one {begin} before one {end} around the section (put a deleted END "
        "back where the section ends), then rerun; nothing was changed"
    )


def write_results_md(md: Path, name: str, block: str):
    """Replace what lies between RESULTS.md's markers of `name` with block (append the markers when absent); markers
    that do not pair up are refused (`check_results_md`)."""
    check_results_md(md, name)
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    old = md.read_text() if md.is_file() else ""
    new = f"{begin}\n{block}\n{end}"
    i = old.find(begin)
    was = section_world(old[i + len(begin) :].lstrip("\n")) if i >= 0 else None
    if was is not None and was != section_world(block):
        raise SystemExit(
            f"{md}: its section {name} holds tables of embedded world {was}; these results are of world "
            f"{section_world(block)}, and one world's tables never replace another's. Keep the old section as a dated "
            f"record (rename its markers, e.g. <!-- BEGIN world-<name>/{name} -->, with its results moved to "
            f"results/world-<name>/{name}/) or delete it, then rerun; nothing was changed"
        )
    if i >= 0:
        text = old[:i] + new + old[old.index(end, i) + len(end) :]
    else:
        text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + new + "\n"
    if text != old:
        tmp = md.with_name(md.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, md)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:3]),
    )
    parser.add_argument("experiment", choices=list(EXPERIMENTS), help="which experiment")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds, not an hour: 1-2 iterations, 1 prompt, 1-2 seeds, fewer cells (what the tests run)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, one process (one thread) each; 1: one after the other in this process (one thread)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default: the experiment's)")
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="iterations per run (default: the experiment's; a GPU affords ~30x)",
    )
    parser.add_argument(
        "--prompts-per-iter", type=int, default=None, help="prompt groups per iteration (default: the experiment's)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results go to OUT/<experiment>/, run folders to OUT/<experiment>/work/ "
        "(default: results, committed; with --quick runs/bench-quick)",
    )
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="rebuild table.md, the figures and the RESULTS.md section from the results that exist; run nothing",
    )
    parser.add_argument(
        "--results-md",
        default=None,
        help="the file whose <!-- BEGIN/END <experiment> --> section the report replaces (the marker: OUT/<experiment> "
        "under results/, e.g. world-amp0.3/recast-protocol) (default: RESULTS.md when OUT is results/ or a folder in "
        "it, e.g. results/world-amp0.3; else none)",
    )
    parser.add_argument(
        "--replace-results",
        action="store_true",
        help="run even where OUT/<experiment>/runs/ holds results made with other settings or on another embedded "
        "world (refused without it): they are moved to OUT/<experiment>/set-aside/<time>/, never deleted",
    )
    args = parser.parse_args(argv)
    # every path absolute, once: the runs' processes start in the project folder, wherever bench.py was started
    args.out = Path(args.out).resolve() if args.out else (ROOT / "runs/bench-quick") if args.quick else HERE / "results"
    root = HERE / "results"
    # the committed results (results/, or an earlier world's under it): their report goes into RESULTS.md
    committed = not args.quick and (args.out == root or root in args.out.parents)
    args.results_md = (
        Path(args.results_md).resolve() if args.results_md else (HERE / "RESULTS.md" if committed else None)
    )
    for flag in ("jobs", "seeds", "iterations", "prompts_per_iter"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    exp = quick_version(EXPERIMENTS[args.experiment]) if args.quick else EXPERIMENTS[args.experiment]
    exp = replace(
        exp,
        **{k: getattr(args, k) for k in ("seeds", "iterations", "prompts_per_iter") if getattr(args, k) is not None},
    )
    exp_dir = args.out / exp.name
    planned = plan_runs(exp, exp_dir)
    sizes = [
        f"--{k.replace('_', '-')} {v}" for k in ("seeds", "iterations", "prompts_per_iter") if (v := getattr(args, k))
    ]
    marker = exp.name
    if root in args.out.parents:  # e.g. results/world-amp0.3: an earlier world's results
        sizes.append(f"--out {Path(os.path.relpath(args.out, ROOT)).as_posix()}")
        marker = Path(os.path.relpath(exp_dir, root)).as_posix()  # world-amp0.3/<experiment>
    if args.results_md is not None:
        check_results_md(args.results_md, marker)
    check_writable(exp_dir)
    if args.tables_only:
        for path, why in survey_results(planned, exp, exp_dir)[0].items():
            print(f"warning: {path}: {why}; left where it is and not in the tables", flush=True)
    else:
        check_results(planned, exp, exp_dir, args.replace_results)
    failed, reused = (
        {},
        (0 if args.tables_only else reuse_results(planned, exp, exp_dir)),
    )  # tables-only writes no result
    if reused:
        print(f"{exp.name}: {reused} identical run(s) taken from {exp_dir.parent / exp.reuse / 'runs'}", flush=True)
    if args.tables_only:
        if not any(load_result(run) for run in planned):
            parser.error(
                f"--tables-only: no results of these settings under {exp_dir / 'runs'} yet; run the experiment first "
                f"(without --tables-only{', with --quick' if args.quick else ''})"
            )
        check_one_world(planned, exp_dir)
    else:
        check_flags(planned)
        print(
            f"{exp.name}: {len(planned)} runs ({len(exp.cells)} cells x {exp.seeds} seeds), "
            f"~{estimate_minutes(exp, args.jobs):.0f} min "
            f"with --jobs {args.jobs} at 2-core CPU speed; results in {exp_dir / 'runs'}",
            flush=True,
        )
        exp_dir.mkdir(parents=True, exist_ok=True)
        if exp.report == "report_rvge_joint":  # the margin of "matches": two noise floors of one evaluation
            measure_eval_floor(exp, exp_dir, noises=2 if args.quick else EVAL_FLOOR_NOISES)
        if exp.report == "report_protocol":  # the gains ReCAST starts from (--gain-init), measured before any run
            profile_sizes = (
                dict(iterations=2, prompts=1) if args.quick else dict(iterations=PROFILE_ITERATIONS, prompts=8)
            )
            measure_profiles(exp_dir.parent / PROFILES_DIR, replace_results=args.replace_results, **profile_sizes)
        failed = execute(planned, args.jobs)
    try:
        text, res = build_report(exp, exp_dir, planned)
        if args.results_md is not None:
            command = " ".join(["python experiments/bench.py", exp.name, *(["--quick"] if args.quick else []), *sizes])
            block = results_block(text, res.records, exp_dir, args.results_md, command + " --tables-only")
            write_results_md(args.results_md, marker, block)
    except OSError as err:  # a full disk, a folder made read-only meanwhile: the results themselves are kept
        raise SystemExit(
            f"could not write {err.filename or 'the tables'}: {err.strerror or err}; every result is kept in "
            f"{exp_dir / 'runs'}: fix that, then `--tables-only` rebuilds the tables"
        ) from None
    print(text)
    if failed:
        raise SystemExit(
            f"{len(failed)} run(s) failed (the tables hold the others; rerun to retry):\n"
            + "\n".join(f"  {k}: {v}" for k, v in failed.items())
        )
    return res


if __name__ == "__main__":
    main()
