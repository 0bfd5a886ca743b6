"""Experiments on the embedded model, one command each: DiffusionNFT vs ReCAST vs DiffusionRVGE.

    python -m experiments.bench multi            # side by side: 6 methods x 2 budget vectors (not run on this world)
    # single reward (one smooth, one discrete): RVGE vs DiffusionNFT, speed-up
    python -m experiments.bench rvge-single
    python -m experiments.bench rvge-joint       # all five world rewards: RVGE vs NFT at equal compute and at 1/5 of it
    # does RVGE at 1/5 of the compute match NFT? 13 seeds, the large final evaluation, non-inferiority
    python -m experiments.bench rvge-joint-fifth
    # why RVGE trails jointly: broad groups for every reward, or half the lr
    python -m experiments.bench rvge-joint-why
    python -m experiments.bench rvge-joint-eta   # and whether a smaller step (--eta 0.1, 0.05) stops its drift
    # RVGE's drift on one reward: a noisy direction or a longer step? (permuted, --eta)
    python -m experiments.bench rvge-drift --seeds 8  # 5 seeds by default; the committed results hold 8
    python -m experiments.bench recast-protocol  # setting A x 5 budget vectors x {nft, uniform, recast, recast_prior}
    python -m experiments.bench recast-protocol-B  # the same for setting B
    # the control for credit in time: W from the profiles vs the same W reversed
    python -m experiments.bench recast-reversed
    # and uniform W at the budgets those two W give in effect: timing or budgets?
    python -m experiments.bench recast-matched
    python -m experiments.bench recast-units     # the same two W with columns equal in gradient units
    # credit where a reward is decided, or where it is learnable? saturation's weight at steps 1-2 vs 3-4
    python -m experiments.bench recast-steps
    # the same on the late reward grain: its weight where decided (steps 7-8) or where consistent (5-6)
    python -m experiments.bench grain-steps
    python -m experiments.bench grain-steps-permuted  # its control, grain permuted within groups (if decided wins)
    # the embedded default for 100 iterations: DiffusionNFT vs uniform W vs ReCAST
    python -m experiments.bench recast-100
    python -m experiments.bench nft-steps        # DiffusionNFT with 1 vs 8 optimizer steps per iteration
    options: [--quick] [--jobs N] [--seeds N] [--out DIR] [--tables-only] [--iterations N] [--prompts-per-iter N]
             [--results-md FILE] [--replace-results] [--dry-run]

An experiment is data (`EXPERIMENTS`): a list of cells, each (script, extra flags, label, group),
plus iterations, prompt groups per iteration, held-out evaluation cadence and seeds. Every cell
runs once per seed; the seed alone fixes the prompts and the noise, so runs with the same seed
are paired across cells, and every interval below is over seeds of paired differences (t, 95%) with its paired-t p,
and beside it the exact sign-flip test's p (`sign_flip_p`: no normal model; at 3 / 5 / 8 seeds it cannot go below
0.25 / 0.0625 / 0.0078, so it tells where a decision rests on the normal model). Each table says its
multiple-comparison correction: Holm's (`holm`) over the comparisons read together (e.g. every cell x comparison of
one metric), or none where a table is read as a curve. An unresolved difference also prints `N80 N [low, high]`: the
seeds a paired t test at alpha 0.05 needs for 80% power (`seeds_for_power`, noncentral t) at the larger of the
observed difference and two noise floors of one evaluation where that floor is measured (`effect_of_interest`), at
the measured sd, and over the sd's 95% interval (`seeds_for_power_range`). The preference judge is summarised per
seed as the mean of sigmoid(score difference), with an interval on the logit scale (inside (0, 1)); times to reach a
level count the runs that never reach it as censored (Kaplan-Meier medians with a paired bootstrap; the test is the
paired one of `paired_speedup`, per-seed log ratios); a Fréchet distance is compared only between evaluations of the
same N images. "Matches" is a test, never an unresolved difference: non-inferiority at a margin of half the lower 95%
bound of the baseline's own gain over the pretrained model (`gain_margin`, `non_inferiority`; no margin where that
gain is not resolved), with the untrained model as the control. This file holds the experiments and their runs; the
statistics are `stats.py`'s, the tables and figures `reports.py`'s (ReCAST's protocol, with its profiles and final
evaluation: `protocol.py`).

Runs and results. Each (cell, seed) is one run of `recast.py` or `rvge.py` (with --overwrite) in its run folder
--out/<experiment>/work/<run>/ (checkpoints: large, git-ignored); once it finishes, its result is written to
--out/<experiment>/runs/<run>.json.gz (the command, every metrics line, wall seconds, the git SHA and date;
gzip-compressed). --out defaults to `experiments/results/`, where everything but work/ is small and committed: the
results, the final evaluations (<run>.final.json), profiles.json, table.md and the figures. So `--tables-only` rebuilds
every table on a fresh clone, with no run folder. A stopped experiment keeps every finished run (Ctrl-C or SIGTERM:
nothing more starts, the runs in flight are ended with their process groups, exit 128 + the signal); running the
command again skips runs whose result exists, and --tables-only rebuilds --out/<experiment>/table.md and the figures
from whatever results exist (marked partial when runs are missing). Runs are ordered seed by seed, so a partial
experiment holds complete pairs. Each report also goes into its results folder's README.md (--results-md), between the
markers `<!-- BEGIN <experiment> -->` and `<!-- END <experiment> -->` (replaced; appended when absent), next to the
hand-written design and reading; RESULTS.md holds the claims and links them. The default `experiments/results/` writes
<experiment>/README.md; another --out, or --quick (whose default is runs/bench-quick/), writes a section only when
--results-md names the file; markers that do not pair up are refused. Every result names the embedded world it was
measured on (`shapes_world.world_id`). Results are data and never lost: a command is refused, before anything runs,
where runs/ holds results made with other settings or on another world (each named with what differs; the earlier
world's are kept under experiments/results/world-amp0.3/, their tables rebuilt with `--out
experiments/results/world-amp0.3 --tables-only`), unless --replace-results, which moves them to set-aside/<time>/; a
damaged result is named, moved to set-aside/ and its run redone (--tables-only leaves it out with a warning). A rebuild
uses every committed result: --tables-only reads every seed the folder holds, and a run or --seeds below them is
refused; a result lacking a metric its cell's other seeds have, or its final evaluation, is named and marked PARTIAL;
one bench.py works on an experiment at a time (<experiment>/.bench.lock; a second is refused, naming the first). --jobs
N runs N runs at once, each in its own process (`python recast.py ...`, one thread each: OMP/MKL threads = 1); --jobs 1
runs them one after the other in this process, also on one thread.

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
    rvge-joint-fifth      2     13       60 x 4 (RVGE 1/5: 12)  10         26   ~46 min (+ final evaluation)
    rvge-joint-why        4      3       60 x 4                 10         12   ~17 min (6 taken from rvge-joint)
    rvge-joint-eta        4      3       60 x 4                 10         12   ~17 min (6 taken from -why)
    rvge-drift            6      5       60 x 4                  5         30   ~56 min (10 taken from rvge-single)
    recast-protocol      20      3       24 x 3                  8         60   ~39 min (+ final evaluation, profiles)
    recast-protocol-B    20      3       24 x 3                  8         60   ~39 min (+ final evaluation)
    recast-reversed      12      8       24 x 3                  8         96   ~45 min (+ final evaluation; 27 taken)
    recast-matched       12      8       24 x 3                  8         96   ~31 min (+ final evaluation; 48 taken)
    recast-units         12      8       24 x 3                  8         96   ~31 min (+ final evaluation; 48 taken)
    recast-steps          2     20       24 x 3                  8         40   ~26 min (+ final evaluation)
    grain-steps           2     20       24 x 3                  8         40   ~26 min (+ final evaluation)
    grain-steps-permuted  2     20       24 x 3                  8         40   ~26 min (+ final evaluation)
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
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

if not __package__:  # run by path, as the results' tables quote the rebuild (COMMAND): the root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import world as shapes_world  # noqa: E402
from experiments import protocol, reports  # noqa: E402  (the reports import nothing of this file)
from experiments.reports import (  # noqa: E402
    Results,
    cell_iterations,
    check_results_md,
    portable,
    power_lines,
    record_settings,
    results_block,
    set_aside,
    slug,
    write_results_md,
)

HERE = Path(__file__).resolve().parent  # experiments/
# the rebuild command a results folder's README quotes above its tables (`results_block`): by path, as the committed
# tables were written with it; `python -m experiments.bench` is the same command
COMMAND = "python experiments/bench.py"
ROOT = HERE.parent  # the project: the scripts, and where the runs' processes start


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
    final_captions: int = 0  # of the held-out captions, the first this many (0: every one; --quick: a few)
    reuse: str = ""  # an experiment whose results of identical runs (same id, same settings) are taken, not rerun
    pairs: tuple[tuple[str, str], ...] = ()  # (label, other) comparisons reported besides each method - baseline
    quick: dict = field(default_factory=lambda: {"iterations": 1, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2})


QUICK_FINAL = {"final_noises": 1, "final_captions": 4}  # --quick's final evaluation: the first 4 captions, one noise
QUICK_FLAGS = ("--eval-steps", "4")  # --quick's in-run evaluations: 4 Euler steps (the runs' own: --steps, 10)
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
    # the main command's rewards until first-run chose others (results/first-run): every experiment's setting A
    "A": ("geneval", "saturation", "texture", "grain"),  # geneval (mid), saturation (early), texture (late), grain
    # Chosen on the textured world from the pretrained model's measured D_k(t) (results/world-design/profiles192,
    # 192 groups per inner level): of the 4-subsets of the candidates sharing at most one reward with A, one whose
    # W at uniform budgets departs far from uniform (max |K T W / Lam - 1| 0.65 then; 0.57 in the protocol's own
    # 192-group prior under the family threshold) with evidence on three of its four rewards, and whose profiles
    # differ from A's: two image statistics decided early (sharpness 0.65, jpeg 0.70 of D(0) by t = 0.79) against
    # the caption's shape (0.21) and its texture (0.17), decided late.
    "B": ("sharpness", "jpeg", "shape", "texture"),
}
JOINT_REWARDS = SETTINGS["A"]  # RVGE's joint runs: setting A at uniform budgets
JOINT_BUDGETS = ",".join(["0.25"] * len(JOINT_REWARDS))


def _joint_cells(methods):
    """rvge-joint's cells: setting A's rewards at uniform budgets, one cell per (script, flags, label[, compute])."""
    return tuple(
        Cell(script, ("--rewards", ",".join(JOINT_REWARDS), "--budgets", JOINT_BUDGETS, *flags), label, "joint", *more)
        for script, flags, label, *more in methods
    )


NFT_RVGE = (("recast", ("--credit", "nft"), "nft"), ("rvge", (), "rvge"))  # the two methods each RVGE experiment has
TREE_RUNS = dict(iterations=60, prompts_per_iter=4, common=TREE, seconds_per_prompt_iter=1.3)  # RVGE's experiments
RVGE_FIFTH = ("rvge", (), "rvge_fifth", 0.2)  # RVGE at 1/5 of the compute: 12 of the 60 iterations


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


# recast-steps (issue 45): credit where a reward is decided, or where it is learnable? recast_prior's W of setting A's
# uniform cell (the W of the committed pretrained profiles, held fixed: --credit file) with saturation's weight on steps
# 1-4 all moved to steps 1-2 (t = 1.0, 0.96, before it is decided: early12) or to steps 3-4 (t = 0.913, 0.858, where it
# is decided: early34), at the same share of the update under the measured gradient size per unit weight g_j
# (sum_j W_sj g_j over steps 1-4 kept); every other reward's weights as in that W. The loss is normalised by W's
# total (`recast.mix_optimality`, `equal_columns`), so each file's W is scaled to the budgets' sum: every reward's
# share of the update is then the same in both arms, and only where saturation's share acts differs.
# grain-steps (issue 62 item 1): the same design on the late reward the model learns, grain. Its weight on steps 5-8
# all moved to steps 5-6 (t = 0.790, 0.707: where its split-half gradient is consistent, 0.14 of its D(0) decided
# there: consistent) or to steps 7-8 (t = 0.602, 0.465: 0.44 of D(0) decided there, its gradient not consistent:
# decided); steps 4 (t = 0.858: neither) and 9 (t = 0.278: both) keep the profiles' W (results/grain-steps/README.md).
STEPS_CELL, STEPS_REWARD = "A-uniform", "saturation"
STEPS_ARMS = {"early12": (0, 1), "early34": (2, 3)}  # label -> the W columns (steps) saturation's weight goes to
STEPS_DESIGNS = {  # experiment -> (the reward whose weight moves, {label: the W columns it goes to}), in setting A
    "recast-steps": (STEPS_REWARD, STEPS_ARMS),
    "grain-steps": (SMOOTH_REWARD, {"consistent": (4, 5), "decided": (6, 7)}),
    # its control (run only if `decided` wins, results/grain-steps/README.md): the same two W, grain's scores permuted
    # within each prompt group (--permute-rewards grain: the same step weights, no relation to the images)
    "grain-steps-permuted": (SMOOTH_REWARD, {"consistent_permuted": (4, 5), "decided_permuted": (6, 7)}),
}
SPLIT_HALF = ROOT / "experiments/results/late-reward/splithalf_round1.json"  # the measured gradient sizes


def measured_step_sizes(path=SPLIT_HALF):
    """(sigmas (T+1,), g (T,)): each training step's gradient size per unit weight, the mean over the rewards measured
    by the split-half runs (not their permuted controls) of `grad_norm_per_group` (the norm of one prompt group's LoRA
    gradient of NFT's loss at that step, at the pretrained model), each normalised to mean 1."""
    res = json.loads(Path(path).read_text())
    norms = [np.asarray(v["grad_norm_per_group"]) for k, v in res["cos"].items() if "permuted" not in k]
    return np.asarray(res["sigmas"]), np.mean([n / n.mean() for n in norms], 0)


def steps_W(profiles: Path, reward=STEPS_REWARD, arms=STEPS_ARMS) -> dict:
    """A steps experiment's W (label -> (K, T)), from the pretrained profiles (`protocol.setting_W`, setting A at
    uniform budgets) and measured g_j: `reward`'s weight on every step some arm names is all moved to each arm's
    steps, equal on them, at the same share sum_j W_kj g_j over those steps; then each W is scaled to the budgets'
    sum (recast-steps' defaults; grain-steps: `STEPS_DESIGNS`)."""
    rewards, budgets = SETTINGS["A"], [0.25] * len(SETTINGS["A"])
    W0, _ = protocol.setting_W(json.loads(Path(profiles).read_text()), rewards, budgets)
    g, k = measured_step_sizes()[1], rewards.index(reward)
    moved = sorted(j for steps in arms.values() for j in steps)
    share = W0[k, moved] @ g[moved]
    out = {}
    for label, steps in arms.items():
        W = W0.copy()
        W[k, moved] = 0.0
        W[k, list(steps)] = share / g[list(steps)].sum()
        out[label] = W * (sum(budgets) / W.sum())
    return out


def write_steps_W(exp_dir: Path, profiles: Path, reward=STEPS_REWARD, arms=STEPS_ARMS):
    """A steps experiment's --credit-file files, exp_dir/W_<label>.json, written before its runs (atomically)."""
    from kit.records import write_atomic

    exp_dir.mkdir(parents=True, exist_ok=True)
    for label, W in steps_W(profiles, reward, arms).items():
        write_atomic(exp_dir / f"W_{label}.json", json.dumps({"rewards": list(SETTINGS["A"]), "W": W.tolist()}) + "\n")


def _steps_cells(arms=STEPS_ARMS, extra=()):
    """A steps experiment: setting A's uniform cell, --credit file with each of `steps_W`'s W (one per arm), and the
    `extra` flags of a control."""
    rewards = ("--rewards", ",".join(SETTINGS["A"]), "--budgets", budget_vectors()["uniform"])
    return tuple(
        Cell(
            "recast",
            (*rewards, "--credit", "file", "--credit-file", f"{{exp_dir}}/W_{label}.json", *extra),
            label,
            STEPS_CELL,
        )
        for label in arms
    )


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
    quick={"iterations": 1, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2, **QUICK_FINAL},
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
            quick_keep=(SMOOTH_REWARD,),  # rvge-drift --quick then takes its runs
            **TREE_RUNS,
            quick={"iterations": 1, "prompts_per_iter": 1, "seeds": 2, "eval_every": 1},
        ),
        Experiment(
            "rvge-joint",
            _joint_cells(
                [
                    *NFT_RVGE,
                    RVGE_FIFTH,
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
        Experiment(  # issue 45: "RVGE at 1/5 of the compute matches DiffusionNFT", decided: rvge-joint's two cells
            # at 13 seeds on recast-protocol's large final evaluation, non-inferiority at half the lower bound of NFT's
            # gain
            "rvge-joint-fifth",
            _joint_cells([NFT_RVGE[0], RVGE_FIFTH]),
            eval_every=10,
            seeds=13,
            report="report_final_non_inferiority",
            final_noises=4,  # every held-out caption x 4 noises, at two noise seeds (recast-protocol's)
            # no reuse: rvge-joint's committed results keep no checkpoint (work/ is not committed), and the final
            # evaluation needs each run's last one, so its seeds 0-3 are run again here
            **TREE_RUNS,
            quick={"iterations": 1, "prompts_per_iter": 1, "seeds": 2, "eval_every": 2, **QUICK_FINAL},
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
            quick={"iterations": 1, "prompts_per_iter": 1, "seeds": 2, "eval_every": 1},
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
                quick={"iterations": 1, "prompts_per_iter": 1, "seeds": 1, "eval_every": 2, **QUICK_FINAL},
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
        Experiment(  # credit where decided, or where learnable? (issue 45; results/recast-reversed's plan)
            "recast-steps",
            _steps_cells(),
            **{**CONTROL_RUNS, "seeds": 20},
            pairs=(("early34", "early12"),),
        ),
        Experiment(  # the same on the late reward grain: where decided (steps 7-8) or consistent (5-6)? (issue 62)
            "grain-steps",
            _steps_cells(STEPS_DESIGNS["grain-steps"][1]),
            **{**CONTROL_RUNS, "seeds": 20},
            pairs=(("decided", "consistent"),),
        ),
        Experiment(  # its control: the same two W with grain's scores permuted within each prompt group
            "grain-steps-permuted",
            _steps_cells(STEPS_DESIGNS["grain-steps-permuted"][1], ("--permute-rewards", SMOOTH_REWARD)),
            **{**CONTROL_RUNS, "seeds": 20},
            pairs=(("decided_permuted", "consistent_permuted"),),
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
    """Seconds instead of an hour: the quick overrides, QUICK_FLAGS, and only the groups (or methods) in quick_keep. A
    cell that sets its own --prompts-per-iter (multi's recast cells: the images of rvge's tree) keeps its ratio to the
    experiment's."""

    def scaled(flags):
        if "--prompts-per-iter" not in flags:
            return flags
        i = flags.index("--prompts-per-iter") + 1
        n = max(1, int(flags[i]) * exp.quick.get("prompts_per_iter", exp.prompts_per_iter) // exp.prompts_per_iter)
        return (*flags[:i], str(n), *flags[i + 1 :])

    cells = tuple(
        replace(c, flags=(*scaled(c.flags), *QUICK_FLAGS))
        for c in exp.cells
        if not exp.quick_keep or c.group in exp.quick_keep or c.label in exp.quick_keep
    )
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


def plan_runs(exp: Experiment, exp_dir: Path) -> list[Run]:
    """Every run of the experiment, seed by seed (a stopped experiment holds complete pairs)."""
    runs = []
    for seed in range(exp.seeds):
        for cell in exp.cells:
            its = cell_iterations(exp, cell)
            run_id = slug(f"{cell.group}-{cell.label}") + f"-seed{seed}"
            sizes = {"--seed": seed, "--iterations": its, "--prompts-per-iter": exp.prompts_per_iter}
            sizes.update({"--eval-every": exp.eval_every, "--save-every": exp.save_every or its})
            settings = (
                *exp.common,
                *(x for flag, value in sizes.items() for x in (flag, str(value))),
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


def check_writable(folder: Path):
    """Refuse, before anything runs, a results folder (or its nearest existing parent) that cannot be written."""
    here = next(p for p in (folder, *folder.parents) if p.exists())
    for p in (here, here / "runs", here / "work"):
        if p.exists() and not (p.is_dir() and os.access(p, os.W_OK | os.X_OK)):
            raise SystemExit(
                f"{p} is {'not a folder' if not p.is_dir() else 'not writable'}: the results, tables and figures are "
                f"written under {folder}; make it writable (chmod -R u+w {p}) or pass --out DIR (another folder)"
            )


def seeds_committed(exp: Experiment, exp_dir: Path) -> tuple[int, int]:
    """(N, k): exp_dir/runs holds results of this command's settings up to seed N - 1, k of them at seeds this command
    does not read (seed >= exp.seeds); (exp.seeds, 0) when there are none beyond. A table rebuilt from fewer seeds
    than are committed would leave those k out without a word (issue 47.1)."""
    folder = exp_dir / "runs"
    found = [re.search(r"-seed(\d+)\.json\.gz$", p.name) for p in (folder.glob("*.json.gz") if folder.is_dir() else [])]
    top = min(max([int(m[1]) + 1 for m in found if m], default=0), exp.seeds + 10_000)
    if top <= exp.seeds:
        return exp.seeds, 0
    beyond = [r for r in plan_runs(replace(exp, seeds=top), exp_dir) if r.seed >= exp.seeds and load_result(r)]
    return max([r.seed + 1 for r in beyond], default=exp.seeds), len(beyond)


def check_seeds(exp: Experiment, exp_dir: Path, seeds_given: bool, tables_only: bool) -> int:
    """The seeds this command reads: every committed one. Results at seeds beyond the command's (e.g. rvge-drift's 8
    where it plans 5) are read by --tables-only without --seeds (said); a run, or --seeds N below them, is refused
    before anything runs or changes, naming the seeds committed and the flag that reads them."""
    committed, beyond = seeds_committed(exp, exp_dir)
    if not beyond:
        return exp.seeds
    if tables_only and not seeds_given:
        print(f"{exp.name}: reading every committed seed, 0-{committed - 1} (--seeds {committed})", flush=True)
        return committed
    raise SystemExit(
        f"{exp.name}: {exp_dir / 'runs'} holds results of these settings at seeds 0-{committed - 1}; this command "
        f"reads seeds 0-{exp.seeds - 1} and would rebuild table.md, the figures and the section from them, leaving "
        f"{beyond} result(s) out. Pass --seeds {committed} to read every one"
        + ("" if tables_only else " (a run then makes only what those seeds lack)")
        + ", or --out DIR for a new folder; nothing was run or changed"
    )


LOCK = ".bench.lock"  # in the experiment's folder while a bench.py works on it


@contextmanager
def experiment_lock(exp_dir: Path):
    """An exclusive lock on exp_dir/.bench.lock while this command works on the experiment (runs, tables, sections):
    a second bench.py on the same experiment is refused before it reads or writes anything, naming the process that
    holds the lock. The kernel drops the lock when its holder dies, even by SIGKILL; the file names the holder (pid,
    start, command) and is removed on release (one left by a killed holder is taken over)."""
    import fcntl

    exp_dir.mkdir(parents=True, exist_ok=True)
    path = exp_dir / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "a process that has not written its name yet"
            os.close(fd)
            raise SystemExit(
                f"{exp_dir} is in use by another bench.py ({holder}; it holds {path}): wait for it to finish, or stop "
                "it (Ctrl-C, or kill the pid named); nothing was run or changed"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino  # not a file its last holder removed meanwhile
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.write(fd, f"pid {os.getpid()}, since {started}: {' '.join(sys.argv)}\n".encode())
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def check_flags(runs):
    """Parse every cell's flags with its script's own parser before anything runs."""
    import importlib

    from kit import flags

    for run in {r.cell: r for r in runs}.values():
        module = importlib.import_module(run.cell.script)
        try:
            flags.check_ranges(module.parse_args(list(run.settings)))
        except SystemExit as err:
            raise SystemExit(
                f"cell {run.cell.label} ({run.cell.group}): {run.cell.script}.py refuses {' '.join(run.settings)}"
                f"{f' ({err.code})' if isinstance(err.code, str) else ''}"
            ) from None


RESULT_FIELDS = {"settings": list, "rows": list}  # what a result needs; its run is its file name and settings


# (path, inode, mtime, ctime, size) -> read_result's answer: each main reads a result file once (main clears it)
RESULTS_READ = {}


def read_result(path: Path) -> tuple[dict | None, str | None]:
    """(record, None) for an intact result file (gzip or plain JSON with RESULT_FIELDS and metrics rows); (None, what
    is wrong) for a damaged or older-format one; (None, None) when there is no file. A file read before in this main,
    unchanged since (its stat the same), is not read again: the record is shared, never changed by its readers."""
    try:
        stat = path.stat()
        key = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
        if key not in RESULTS_READ:
            RESULTS_READ[key] = parse_result(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, f"cannot be read ({err.strerror or err})"
    return RESULTS_READ[key]


def parse_result(data: bytes) -> tuple[dict | None, str | None]:
    """`read_result` of a file's bytes not read before."""
    import zlib

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


def load_result(run: Run):
    """The run's result if it exists, is intact and was made with the same settings; else None. Gzip or plain JSON."""
    record, _ = read_result(run.result)
    return record if record is not None and same_settings(record, run) else None


def same_settings(record: dict, run: Run) -> bool:
    """Whether a result was made with the run's settings, wherever its results folder was then (`portable`)."""
    return record_settings(record) == portable(run.settings, run.work.parent.parent)


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
        "command": shown(f"python {run.cell.script}.py {' '.join(argv_of(run))}"),
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


PINNED = {"recast": ("--base-reg", "0.0001", "--gain-init", "none"), "rvge": ("--base-reg", "0.0001")}
"""Flags every run of a script gets before its settings (a cell's own flags override them), outside a result's
identity: the experiments ran at DiffusionNFT's --base-reg 1e-4, the scripts' default until first-run chose a stronger
pull for recast.py's main command, and with ReCAST's level statistics starting empty, recast.py's default until
first-run's arm M started them from the world's pretrained profiles (results/first-run; recast_prior passes its own
--gain-init); pinned so that a rerun repeats them."""


def argv_of(run: Run):
    return [*PINNED[run.cell.script], *run.settings, "--out", str(run.work), "--overwrite"]


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
    one = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TQDM_DISABLE")
    env = {**os.environ, **dict.fromkeys(one, "1")}
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


def planned_not_reused(exp: Experiment) -> list[Cell]:
    """The cells of the runs the experiment makes itself, run by run (seed by seed, as `plan_runs`): all, less those
    `exp.reuse` plans identically (same id and settings), whose results are taken from it. Only its seeds can be
    taken, so only they are planned (a power line asks for thousands of seeds)."""
    other = EXPERIMENTS.get(exp.reuse)  # none: no reuse ("") or an unknown name
    if other is None:
        return [cell for _ in range(exp.seeds) for cell in exp.cells]
    taken = {(r.run_id, r.settings) for r in plan_runs(other, Path("."))}  # at its own seeds
    shared = min(exp.seeds, other.seeds)
    first = plan_runs(replace(exp, seeds=shared), Path("."))
    return [r.cell for r in first if (r.run_id, r.settings) not in taken] + [
        cell for _ in range(shared, exp.seeds) for cell in exp.cells
    ]


def estimate_minutes(exp: Experiment, jobs=2):
    """Wall-clock estimate on a 2-core machine: each run's time from the measured rates, runs handed
    in their order to whichever of the `jobs` workers frees first; runs taken from `exp.reuse` cost nothing."""
    workers = np.zeros(jobs)
    for cell in planned_not_reused(exp):
        its = cell_iterations(exp, cell)
        evals = 1 + (its // exp.eval_every + (its % exp.eval_every > 0) if exp.eval_every else 0)
        workers[workers.argmin()] += (
            its * exp.prompts_per_iter * exp.seconds_per_prompt_iter + evals * SECONDS_PER_EVAL + SECONDS_PER_START
        )
    return workers.max() / 60


# =============================================================================
# Main
# =============================================================================


def dry_run_lines(exp: Experiment, exp_dir: Path, planned: list[Run], jobs: int) -> list[str]:
    """--dry-run: the experiment's plan and cost, and for a steps experiment (`STEPS_DESIGNS`) its W files' content
    from the committed profiles, without running, measuring or writing anything."""
    lines = [
        f"{exp.name} (dry run: nothing is run or written): {len(planned)} runs ({len(exp.cells)} cells x {exp.seeds} "
        f"seeds, paired by seed), {exp.iterations} iterations x {exp.prompts_per_iter} prompt groups, held-out "
        f"evaluation every {exp.eval_every}"
        + (f", final evaluation every held-out caption x {exp.final_noises} noises" if exp.final_noises else "")
        + (f"; identical runs taken from {exp.reuse} where it holds them" if exp.reuse else ""),
        f"cost: ~{estimate_minutes(exp, jobs):.0f} min with --jobs {jobs}, ~{estimate_minutes(exp, 2):.0f} min with "
        "--jobs 2 at the measured 2-core CPU rate" + (" (+ the final evaluation)" if exp.final_noises else ""),
    ]
    if exp.name in STEPS_DESIGNS:
        reward, arms = STEPS_DESIGNS[exp.name]
        profiles = exp_dir.parent / PROFILES_DIR / "profiles.json"
        profiles = profiles if profiles.is_file() else HERE / "results" / PROFILES_DIR / "profiles.json"
        sigmas, g = measured_step_sizes()
        k, Ws = SETTINGS["A"].index(reward), steps_W(profiles, reward, arms)
        moved = sorted(j for steps in arms.values() for j in steps)
        lines.append(
            f"W ({profiles}; written to {exp_dir}/W_<arm>.json before the runs): {reward}'s weight on steps "
            + ", ".join(f"{j + 1} (t = {sigmas[j]:.3f})" for j in moved)
            + f" moved, at an equal share under the measured g_j ({', '.join(f'{g[j]:.2f}' for j in moved)})"
        )
        for label, W in Ws.items():
            shares = W @ g / (W @ g).sum()
            lines.append(
                f"  {label}: {reward} at steps {', '.join(str(j + 1) for j in arms[label])}, W "
                + ", ".join(f"{W[k, j]:.4f}" for j in moved)
                + "; every reward's share under g_j "
                + ", ".join(f"{r} {x:.3f}" for r, x in zip(SETTINGS["A"], shares))
            )
    first = [run for run in planned if run.seed == 0]
    lines += ["the runs of seed 0 (every other seed: the same with its --seed):"]
    lines += [f"  python {run.cell.script}.py " + " ".join(argv_of(run)) for run in first]
    return lines


def report_of(exp: Experiment):
    """The function that writes the experiment's table.md (`exp.report`): in protocol.py, else in reports.py."""
    return getattr(protocol if hasattr(protocol, exp.report) else reports, exp.report)


def build_report(exp: Experiment, exp_dir: Path, planned: list[Run]) -> tuple[str, Results]:
    """table.md from the results of the planned runs. A result the report cannot read (rows without a metric the
    others have: an older format) is left out with a warning naming it, and the report made from the rest."""
    pairs = [(run, rec) for run in planned if (rec := load_result(run)) is not None]
    finished = [run for run, _ in pairs]  # each with its final evaluation, where the experiment has one
    while True:
        records = [  # a result's place in the tables is its run's (file name and settings), not what it says
            {**rec, "run_id": run.run_id, "group": run.cell.group, "label": run.cell.label, "seed": run.seed}
            for run, rec in pairs
        ]
        res = Results(
            exp,
            records,
            planned,
            exp_dir,
            finished,
            settings=SETTINGS,
            profiles=exp_dir.parent / PROFILES_DIR / "profiles.json",
            together=PROTOCOL_SETTINGS if exp.name in PROTOCOL_SETTINGS else (),
        )
        try:
            text = (
                "\n".join(report_of(exp)(res, exp_dir))
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
    where = {run.run_id: run.result for run in planned}
    for run_id, why in res.incomplete.items():
        print(f"warning: {where.get(run_id, run_id)}: {why}; missing from the tables and figures (marked PARTIAL)")
    text += "\n".join(power_lines(text, lambda seeds: estimate_minutes(replace(exp, seeds=seeds), 2)))
    (exp_dir / "table.md").write_text(text)
    return text, res


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
            "e.g. experiments/results/world-<name>/<experiment>/runs/, and rebuild each with --tables-only --out; "
            "nothing was "
            "changed"
        )


def main(argv=None):
    RESULTS_READ.clear()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:3]),
    )
    parser.add_argument("experiment", choices=list(EXPERIMENTS), help="which experiment")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds, not an hour: 1 iteration, 1 prompt, 1-2 seeds, fewer cells, evaluations at 4 steps, the final "
        "one on 4 captions (what the tests run)",
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
        help="rebuild table.md, the figures and the README.md section from the results that exist; run nothing",
    )
    parser.add_argument(
        "--results-md",
        default=None,
        help="the Markdown file whose <!-- BEGIN/END <experiment> --> section the report replaces (the marker: "
        "OUT/<experiment> under experiments/results/, e.g. world-amp0.3/recast-protocol) (default: "
        "OUT/<experiment>/README.md when OUT is experiments/results/ or a folder in it, e.g. "
        "experiments/results/world-amp0.3; else none)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (runs, sizes, cost, a steps experiment's W) and the runs' commands; run or write nothing",
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
    # the committed results (results/, or an earlier world's under it): their report goes into the folder's README.md
    committed = not args.quick and (args.out == root or root in args.out.parents)
    args.results_md = (
        Path(args.results_md).resolve()
        if args.results_md
        else (args.out / args.experiment / "README.md" if committed else None)
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
    if args.dry_run:
        print("\n".join(dry_run_lines(exp, exp_dir, planned, args.jobs)))
        return None
    marker = exp.name
    if root in args.out.parents:  # e.g. results/world-amp0.3: an earlier world's results
        sizes.append(f"--out {Path(os.path.relpath(args.out, ROOT)).as_posix()}")
        marker = Path(os.path.relpath(exp_dir, root)).as_posix()  # world-amp0.3/<experiment>
    if args.results_md is not None and (args.results_md.parent != exp_dir or exp_dir.is_dir()):  # else made below
        check_results_md(args.results_md, marker)
    check_writable(exp_dir)
    with experiment_lock(exp_dir):  # one bench.py per experiment at a time
        seeds = check_seeds(exp, exp_dir, args.seeds is not None, args.tables_only)  # every committed seed, or none
        if seeds != exp.seeds:
            exp = replace(exp, seeds=seeds)
            planned = plan_runs(exp, exp_dir)
            sizes.insert(0, f"--seeds {seeds}")
        if args.tables_only:
            for path, why in survey_results(planned, exp, exp_dir)[0].items():
                print(f"warning: {path}: {why}; left where it is and not in the tables", flush=True)
        else:
            check_results(planned, exp, exp_dir, args.replace_results)
        failed, reused = {}, (0 if args.tables_only else reuse_results(planned, exp, exp_dir))  # tables-only: none
        if reused:
            print(f"{exp.name}: {reused} identical run(s) taken from {exp_dir.parent / exp.reuse / 'runs'}", flush=True)
        if args.tables_only:
            if not any(load_result(run) for run in planned):
                parser.error(
                    f"--tables-only: no results of these settings under {exp_dir / 'runs'} yet; run the experiment "
                    f"first (without --tables-only{', with --quick' if args.quick else ''})"
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
                reports.measure_eval_floor(exp, exp_dir, noises=2 if args.quick else reports.EVAL_FLOOR_NOISES)
            if exp.report == "report_protocol":  # the gains ReCAST starts from (--gain-init), measured before any run
                profile_sizes = (
                    dict(iterations=1, prompts=1) if args.quick else dict(iterations=PROFILE_ITERATIONS, prompts=8)
                )
                protocol.measure_profiles(
                    exp_dir.parent / PROFILES_DIR, replace_results=args.replace_results, **profile_sizes
                )
            if exp.name in STEPS_DESIGNS:  # its two W, from the profiles just measured or committed
                write_steps_W(exp_dir, exp_dir.parent / PROFILES_DIR / "profiles.json", *STEPS_DESIGNS[exp.name])
            failed = execute(planned, args.jobs)
        try:
            text, res = build_report(exp, exp_dir, planned)
            if args.results_md is not None:
                command = " ".join([COMMAND, exp.name, *(["--quick"] if args.quick else []), *sizes])
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
