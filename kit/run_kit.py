"""run_kit: the run machinery recast.py and rvge.py share, in one module, named for what it holds: the kit a run is
set up, kept and logged with (as diffusers' training examples import `diffusers.training_utils`).

Flags (RunArgs: the evaluation, I/O and reward-model flags; NFTArgs: the rewards, rollout and optimisation flags both
scripts share; each script's Args inherits them; Args -> argparse with --help sections and defaults; --config files;
--resume's saved config), the input checks both scripts make, model loading, text encoding, the transformer's
velocity, decoding and scoring, the adapter copy, what a run holds (`Run`), the held-out evaluation (split over
processes; evaluate.py runs it on any checkpoint), run folders, locks, resume, atomic checkpoints, trackers, figures,
the end-of-run summary and --dry-run. The algorithms are not here: DiffusionNFT (optimality and the global reward
statistics, schedules, sampler steps, tree rollouts, the loss, the frozen forwards, the optimizer step, the update
loop) is nft.py, each method its script, which passes in what is its own: its Args class and --help sections, its
checks, its default run name; the held-out sampler is nft.ode_sample.
diffusers, transformers, peft, accelerate and matplotlib are imported where first used, so that importing a script
for its math (the toy, the notebook, the tests) does not load them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import difflib
import fcntl
import functools
import importlib.util
import inspect
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import yaml
from tqdm import tqdm

import world as shapes_world
from kit.reward_models import DEFAULTS, REWARD_MODELS, build_rewards, missing_inputs, ocr_target

if TYPE_CHECKING:  # the types Run's fields name; diffusers and accelerate load when a run starts (`load_run`)
    from accelerate import Accelerator
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline


# =============================================================================
# Flags: Args fields, parsing, --resume's saved config
# =============================================================================


EMBEDDED_MODEL = str(Path(__file__).resolve().parents[1] / "world" / "assets" / "shapes-sd3")  # runs from any folder


def flag(default, group, **checks):
    """One Args field: its default, its --help section (a key of the script's ARG_GROUPS) and the checks
    `check_ranges` applies: min / max (inclusive), gt / lt (strict), choices. Its help line is the string under it
    (`field_docs`)."""
    return field(default=default, metadata={"group": group, **checks})


@functools.cache  # the source is read once per process, not at every parse_args
def field_docs(cls):
    """{field name: the string literal written under it} from the source of cls and of the dataclasses it inherits
    from (base first, so a field a subclass redefines takes its own): per-field docstrings (CleanRL's habit) that
    become the --help lines, whitespace collapsed."""
    docs = {}
    for c in reversed(cls.__mro__):
        if "__dataclass_fields__" not in vars(c):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(c))).body[0].body
        docs.update(
            (a.target.id, " ".join(b.value.value.split()))
            for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
        )
    return docs


RUN_ARG_GROUPS = {  # the --help sections of RunArgs's flags, after each script's own (method, rollout, optimisation)
    "evaluation": "held-out evaluation",
    "I/O": "model, prompts, run folder, device and logging",
    "reward models": "weights and servers of the real reward models (defaults in reward_models.DEFAULTS)",
}


@dataclass
class RunArgs:
    """The flags both scripts take, in RUN_ARG_GROUPS's sections; NFTArgs adds the shared method, rollout and
    optimisation flags, each script's Args its own."""

    # evaluation
    eval_every: int = flag(20, "evaluation", min=0)
    """evaluate every N iterations (and at start and end); 0: never"""
    eval_steps: int = flag(0, "evaluation", min=0)
    """Euler steps of the evaluation sampler (0: --steps; DiffusionNFT evaluates with 40)"""
    eval_prompts: str = flag("", "evaluation")
    """file with evaluation prompts, one per line (embedded model: its held-out prompts)"""
    # I/O
    model: str = flag(EMBEDDED_MODEL, "I/O")
    """diffusers folder or hub id (e.g. stabilityai/stable-diffusion-3.5-medium); default: the embedded tiny shapes
    model"""
    train_prompts: str = flag("", "I/O")
    """file with training prompts, one per line (embedded model: its train split)"""
    out: str = flag("", "I/O")
    """run folder (default: runs/<name>)"""
    name: str = flag("", "I/O")
    """run name (default: <script>-<credit>-<seed>: recast-recast-0, rvge-budgets-0, ...)"""
    seed: int = flag(0, "I/O", min=0, max=2**31 - 1)
    """seed for prompts, noise and LoRA init"""
    save_every: int = flag(10, "I/O", min=1)
    """checkpoint every N iterations (and at the end)"""
    keep_checkpoints: int = flag(2, "I/O", min=0)
    """checkpoints kept in <run>/checkpoints: the newest N (0: every one, as DiffusionNFT keeps them)"""
    resume: str = flag("", "I/O")
    """run folder to continue in place from its newest intact checkpoint (its config.json gives the settings; flags
    given now override those that may change)"""
    overwrite: bool = flag(False, "I/O")
    """let --out replace a run folder that already holds a run (its metrics, checkpoints and figures are deleted; any
    other file there, such as evaluate.py's results, is moved to <out>.set-aside)"""
    device: str = flag("", "I/O")
    """cpu or cuda (default: cuda if available)"""
    dtype: str = flag("", "I/O", choices=["", "float32", "bfloat16", "float16"])
    """frozen weights' dtype with --mixed-precision no (default: bfloat16 on cuda, float32 on cpu); float16 is refused
    there (its gradients need a scaler: --mixed-precision fp16)"""
    mixed_precision: str = flag("no", "I/O", choices=["no", "fp16"])
    """fp16: DiffusionNFT's mode: the transformer's weights in float32, its forwards (rollouts, training, evaluation)
    and the decodes under float16 autocast, a gradient scaler (a step with non-finite gradients is skipped, counted in
    train/skipped_steps), the VAE in float32, the text encoders in float16, TF32 allowed; set by every SD3.5-M recipe.
    no: no autocast and no scaler, every frozen weight in --dtype (bfloat16 on a GPU, float32 on the CPU). no is the
    default: bfloat16's exponent range is float32's, so no loss scale and no skipped step, at a third of fp16 mode's
    memory for the frozen transformer (2 bytes a parameter against 4, plus the 2 of autocast's copies kept for
    backward)"""
    dry_run: bool = flag(False, "I/O")
    """build SD3.5-Medium's transformer on the meta device, attach the LoRA, print trainable parameters and a memory
    plan, exit"""
    report_to: str = flag("none", "I/O", choices=["none", "tensorboard", "wandb"])
    """also log the metrics' numbers and strings, under the same keys, through accelerate's trackers: TensorBoard
    (event files in <run>/tensorboard, W as an image) or Weights & Biases (project <script>); needs that package"""
    # reward models
    pickscore_model: str = flag(DEFAULTS["pickscore_model"], "reward models")
    """PickScore weights"""
    pickscore_processor: str = flag(DEFAULTS["pickscore_processor"], "reward models")
    """PickScore processor"""
    clip_model: str = flag(DEFAULTS["clip_model"], "reward models")
    """CLIP for clipscore and the aesthetic predictor"""
    aesthetic_mlp: str = flag(DEFAULTS["aesthetic_mlp"] or "", "reward models")
    """aesthetic MLP weights file (LAION improved aesthetic predictor)"""
    geneval_url: str = flag(DEFAULTS["geneval_url"], "reward models")
    """GenEval reward server address (FlowGRPO's reward-server protocol)"""
    geneval_metadata: str = flag(DEFAULTS["geneval_metadata"] or "", "reward models")
    """JSONL of GenEval metadata per prompt (FlowGRPO's dataset/geneval format)"""
    geneval_key: str = flag(DEFAULTS["geneval_key"], "reward models")
    """GenEval reply field used as the reward: scores (partial credit), strict_rewards (0/1)"""


@dataclass
class NFTArgs(RunArgs):
    """The flags both scripts take with the same meaning: the rewards and budgets, DiffusionNFT's rollout and its
    optimisation, in each script's method, rollout and optimisation sections. The defaults are recast.py's; rvge.py
    redefines those it changes (a redefined field keeps its place in --help)."""

    # method
    rewards: str = flag("", "method")
    """comma-separated reward names, in budget order (default: the embedded model's four; required for another
    model)"""
    budgets: str = flag("0.4,0.3,0.2,0.1", "method")
    """reward budgets lambda_k, one per reward (W's row sums)"""
    permute_rewards: str = flag("", "method")
    """the permuted-reward control: these rewards' training scores (comma-separated names from --rewards) are shuffled
    among the leaves of each prompt group, so they keep their values but no longer belong to the images; held-out
    evaluation scores the true rewards"""
    # rollout
    prompts_per_iter: int = flag(8, "rollout", min=1)
    """prompt groups per iteration and process"""
    n_roots: int = flag(2, "rollout", min=1)
    """independent noises per prompt (tree roots)"""
    n_branch: int = flag(4, "rollout", min=1)
    """copies made of every state at each branch step"""
    branch_steps: str = flag("rotate", "rollout")
    """rotate: each prompt group branches once, at a step that rotates over 1..T-2 across groups and iterations (every
    level measured); or fixed sampler steps j (0 < j < T - 1) for every group; group size = n_roots *
    n_branch^(number of branch steps)"""
    sde_substeps: int = flag(2, "rollout", min=1)
    """Euler-Maruyama sub-steps per grid interval after a branch (1: the grid itself; more: siblings closer to exact x0
    | x_t samples, rollout cost grows)"""
    sampler: str = flag("tree", "rollout", choices=["tree", "ode"])
    """tree: branched trees (ReCAST's pairs estimator needs them); ode: DiffusionNFT's independent deterministic
    DPM-Solver-2 rollouts, n_roots per prompt"""
    steps: int = flag(10, "rollout", min=3)
    """sampler steps T (= columns of W = training timesteps)"""
    sde_a: float = flag(math.sqrt(2), "rollout", min=0)
    """SDE noise level a after the first branch, g = a sqrt(s / (1 - s)); sqrt(2) (default) is the exact reversal of the
    noising, so branches sample x0 | x_t (the pairs estimator and kappa transfer need it; FlowGRPO uses 0.7)"""
    resolution: int = flag(0, "rollout", min=0)
    """image size in pixels (0: the model's default, 512 for SD3.5-M)"""
    max_sequence_length: int = flag(0, "rollout", min=0)
    """T5 tokens (0: the model's default: 128 as DiffusionNFT encodes, 10 for the embedded model)"""
    rollout_batch: int = flag(64, "rollout", min=1)
    """chunk size for transformer calls during rollouts"""
    # optimisation
    iterations: int = flag(100, "optimisation", min=1)
    """training iterations (rollout + update)"""
    base_reg: float = flag(0.1, "optimisation", min=0)
    """weight of the velocity MSE to the frozen base model (a pull towards the pretrained model): 0.1 keeps the
    embedded model's ReCAST runs near their data with a steady gain (results/first-run); DiffusionNFT uses 1e-4, as
    every SD3.5-M recipe and rvge.py do"""
    train_steps_per_leaf: int = flag(4, "optimisation", min=1)
    """training timesteps drawn (without replacement) from the T grid steps per leaf and iteration"""
    train_batch: int = flag(32, "optimisation", min=1)
    """micro-batch of (leaf, timestep) samples per forward/backward"""
    frozen_batch: int = flag(0, "optimisation", min=0)
    """compute the no-grad v_old / v_base forwards of each optimizer step ahead, in batches of this size (0: with each
    gradient micro-batch); same numbers, unmeasured on GPU"""
    gradient_checkpointing: bool = flag(False, "optimisation")
    """recompute the transformer's activations in backward (diffusers' gradient checkpointing): less memory for a larger
    --train-batch, same gradients"""
    updates_per_iter: int = flag(8, "optimisation", min=1)
    """optimizer steps per iteration, each on the mean loss over its share of the iteration's samples (1: DiffusionNFT's
    one step per epoch)"""
    old_decay: int = flag(1, "optimisation", choices=[0, 1, 2])
    """DiffusionNFT's old-policy schedule on optimizer steps: 0 none, 1 min(0.001 s, 0.5), 2 OCR's (0 for 75 steps, then
    +0.0075 up to 0.999)"""
    ema: bool = flag(False, "optimisation")
    """keep DiffusionNFT's EMA of the trained LoRA (decay min((1 + s) / (10 + s), 0.9)), evaluate it and save it beside
    the raw LoRA"""
    lr: float = flag(1e-4, "optimisation", gt=0)
    """AdamW learning rate (DiffusionNFT uses 3e-4 on SD3.5-M with ~1k images per step; 1e-4 suits the embedded model's
    256-sample steps)"""
    weight_decay: float = flag(1e-4, "optimisation", min=0)
    """AdamW weight decay"""
    grad_clip: float = flag(1.0, "optimisation", gt=0)
    """gradient norm clip"""
    lora_rank: int = flag(32, "optimisation", min=1)
    """LoRA rank"""
    lora_alpha: int = flag(64, "optimisation", min=1)
    """LoRA alpha"""


def make_parser(Args, groups, doc, suppress=False):
    """argparse from a script's Args class, in the sections of `groups` (its ARG_GROUPS: title -> text), described by
    the first paragraph of `doc` (its docstring); the string under each field is its --help line, followed by its
    default. --config FILE (not a field: it names where the others come from) sits in the I/O section. With
    suppress=True only the flags actually given appear in the result (used by --resume). argparse rather than tyro:
    tyro puts a flat dataclass's flags in one section, in base-class order, and cannot tell which flags were given,
    which the sections and --resume's rules need."""
    parser = argparse.ArgumentParser(
        description=" ".join(doc.split("\n\n")[0].split()),
        argument_default=argparse.SUPPRESS if suppress else None,
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's lines as written
    )
    sections = {title: parser.add_argument_group(title, text) for title, text in groups.items()}
    docs = field_docs(Args)
    for f in sorted(fields(Args), key=lambda f: list(groups).index(f.metadata["group"])):  # the usage line, by section
        name, section = "--" + f.name.replace("_", "-"), sections[f.metadata["group"]]
        extra = {} if suppress else {"default": f.default}
        shown = "off" if f.default is False or f.default is None else "none" if f.default == "" else f.default
        said = "(default: " in docs[f.name]  # a default the help line words itself (device, dtype, ...)
        text = (docs[f.name] if said else f"{docs[f.name]} (default: {shown})").replace("%", "%%")  # argparse: %
        if f.type in (bool, "bool"):
            section.add_argument(name, action=argparse.BooleanOptionalAction, help=text, **extra)  # --no-x: off
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            section.add_argument(name, type=kind, help=text, choices=f.metadata.get("choices"), **extra)
    sections.get("I/O", parser).add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="YAML or JSON file of flags (keys: the flag names, dashes or underscores; e.g. configs/*.yaml, or a "
        "run's config.json); flags given on the command line override it",
    )
    return parser


HELP_EPILOG = "\n".join(  # --help's last lines: the reward names, then examples (%(prog)s: the script)
    [
        "rewards (--rewards, comma-separated, one budget each):",
        textwrap.fill(
            f"real models: {', '.join(sorted(REWARD_MODELS))} (kit/reward_models.py)",
            79,
            initial_indent="  ",
            subsequent_indent="    ",
        ),
        textwrap.fill(
            f"embedded model: {', '.join(shapes_world.DEFAULT_REWARDS)} (its defaults); also "
            f"{', '.join(sorted(set(shapes_world.REWARDS) - set(shapes_world.DEFAULT_REWARDS)))} "
            "(world/rewards.py)",
            79,
            initial_indent="  ",
            subsequent_indent="    ",
        ),
        "",
        "examples:",
        "  python %(prog)s  # the embedded model on the CPU, its default rewards",
        "  python %(prog)s --iterations 2 --prompts-per-iter 1 --n-branch 2 \\",
        "      --train-steps-per-leaf 2 --updates-per-iter 1 --eval-every 0  # smoke run",
        "  python %(prog)s --config configs/FILE.yaml --seed 1  # a recipe, flags override it",
        "  python %(prog)s --resume runs/RUN --iterations 200  # continue a run in place",
        "  python %(prog)s --dry-run  # SD3.5-Medium's LoRA and memory plan, no weights",
        "  accelerate launch --multi_gpu --num_processes 8 %(prog)s --config configs/FILE.yaml",
    ]
)


# Refused on --resume when they differ from the saved run (those of them a script has): a checkpoint is only valid with
# the first five; the level statistics it holds were measured with the gain estimator and order; --gain-init only
# seeds iteration 0; --credit, --credit-file, --column-units and --permute-rewards say what the run is (its method, or
# a control), and config.json records one value for the whole run. Every other flag applies from the resumed iteration
# on (the optimizer takes --lr, --weight-decay). A run's config.json that predates a flag ran with its default.
FIXED_ON_RESUME = (
    *("model", "rewards", "steps", "lora_rank", "lora_alpha", "gain_estimator", "alpha", "gain_init"),
    *("credit", "credit_file", "column_units", "permute_rewards"),
)


def resume_value(name, value):
    """A setting as --resume compares it: --permute-rewards as its set of names (order and spaces aside)."""
    if name == "permute_rewards" and isinstance(value, str):
        return sorted({n.strip() for n in value.split(",") if n.strip()})
    return value


NOT_ON_RESUME = ("name", "overwrite")  # they choose or replace a run folder; --resume continues its own


def parse_flags(argv, Args, groups, doc, script):
    """A script's Args (the class; `groups` and `doc` as make_parser's) from the command line. With --resume DIR the
    settings come from DIR/config.json and flags given now override them, except FIXED_ON_RESUME (refused with both
    values named); the run must be one of `script`'s; the run folder is DIR itself, wherever it lies now. With
    --config FILE the file's values replace the defaults and flags given on the command line override them."""
    parser = make_parser(Args, groups, doc)
    config = vars(parser.parse_args(argv)).get("config")
    if config is not None:
        parser.set_defaults(**read_config_file(config, Args, script))
    args = Args(**{k: v for k, v in vars(parser.parse_args(argv)).items() if k != "config"})
    if not args.resume:
        return args
    if config is not None:
        raise SystemExit(
            f"--config {config} does not go with --resume {args.resume}, whose config.json gives the settings: "
            "drop --config and give the flags to change on the command line"
        )
    config = Path(args.resume) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--resume {args.resume}: no config.json there; give the run folder of an earlier run")
    saved_config, saved = read_run_config(config, Args)
    if saved_config["script"] != script:
        raise SystemExit(
            f"--resume {args.resume}: that run was trained by {saved_config['script']}.py; resume it with that script"
        )
    given = vars(make_parser(Args, groups, doc, suppress=True).parse_args(argv))
    saved = model_after_a_move(saved, given, args.resume)
    for k in NOT_ON_RESUME:
        if k in given:
            raise SystemExit(
                f"--{k} does not go with --resume {args.resume}, which continues that run in its own folder: "
                f"drop --{k}, or start a new run without --resume"
            )
    if "out" in given and Path(given["out"]).resolve() != Path(args.resume).resolve():
        raise SystemExit(
            f"--resume {args.resume} continues that folder in place; --out {given['out']} names another. "
            "To branch a run, copy its folder and resume the copy"
        )
    defaults = {f.name: f.default for f in fields(Args)}
    changed = [
        f"--{k.replace('_', '-')}: saved {saved.get(k, defaults.get(k))!r}, given {given[k]!r}"
        for k in FIXED_ON_RESUME
        if k in given and resume_value(k, given[k]) != resume_value(k, saved.get(k, defaults.get(k)))
    ]
    if changed:
        raise SystemExit(
            f"--resume {args.resume}: these settings cannot change on resume ({'; '.join(changed)}). "
            "Drop them, or start a new run"
        )
    known = {f.name for f in fields(Args)}
    args = Args(**{**{k: v for k, v in saved.items() if k in known and k not in NOT_ON_RESUME}, **given})
    args.out, args.resume = str(args.resume), str(args.resume)
    return args


def read_run_config(path, Args):
    """(config, its args) of a run's config.json, each saved flag of the type its Args field has (an int is
    also a float); SystemExit naming the file, the entry and the fix when it is unreadable or hand-edited wrong."""
    problem = None
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        config, problem = None, f"it is not readable JSON ({err})"
    if problem is None and not (isinstance(config, dict) and isinstance(config.get("args"), dict)):
        problem = 'it does not hold an "args" object'
    if problem is None and config.get("script") not in ("recast", "rvge"):
        problem = f'its "script" is {config.get("script")!r}, not recast or rvge'
    for f in fields(Args) if problem is None else ():
        if f.name in config["args"] and type_problem(f, config["args"][f.name]):
            problem = f"args.{f.name} {type_problem(f, config['args'][f.name])}"
            break
    if problem:
        raise SystemExit(
            f"{path}: {problem}. Repair the file (the run's checkpoints are not affected), or start a new run"
        )
    return config, config["args"]


def type_problem(f, value):
    """What is wrong with `value` for the Args field f ("is 'x', not of type int"), or None (an int is also a
    float; a bool is never a number)."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    types = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}[kind]
    if isinstance(value, types) and (kind == "bool" or not isinstance(value, bool)) or value is f.default is None:
        return None
    return f"is {value!r}, not of type {kind}"


NEW_RUN_ONLY = ("out", "resume", "overwrite")  # from a run's config.json given to --config: they chose its folder


def unique_keys(pairs):
    """json.loads's object_pairs_hook for --config files: a dict, or ValueError naming a key given twice (JSON
    itself keeps the last)."""
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise ValueError(f"the key {twice!r} is given twice; keep one")
    return dict(pairs)


class UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {twice!r} is given twice; keep one", node.start_mark
            )
        return super().construct_mapping(node, deep)


def read_config_file(path, Args, script):
    """{field: value} of a --config file: YAML (.yaml, .yml) or JSON (.json) holding flag names (dashes or
    underscores) and values, or a run's config.json (its "args", less NEW_RUN_ONLY, so that the new run gets a
    folder of its own); a byte-order mark is dropped. Unknown keys, a key given twice (also one flag spelled with
    dashes and with underscores), `overwrite` (it is given on the command line), values of the wrong type and values
    outside a flag's range are refused naming the file, the key and the fix."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise SystemExit(f"--config {path}: give a .yaml, .yml or .json file (its suffix says how to read it)")
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")  # -sig: a byte-order mark some editors write is dropped
        data = json.loads(text, object_pairs_hook=unique_keys) if suffix == ".json" else yaml.load(text, UniqueKeys)
    except (OSError, ValueError, yaml.YAMLError) as err:  # a missing file; a syntax error, with its line; a key twice
        raise SystemExit(f"--config {path}: cannot read it ({err}). Fix the file or the path") from None
    if isinstance(data, dict) and isinstance(data.get("args"), dict) and "script" in data:  # a run's config.json
        if data["script"] != script:
            raise SystemExit(
                f"--config {path}: a run of {data['script']}.py; give it to {data['script']}.py, or a {script} file"
            )
        data = {k: v for k, v in data["args"].items() if k not in NEW_RUN_ONLY}
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: the file must hold key: value lines (a mapping), not {type(data).__name__}")
    known = {f.name: f for f in fields(Args)}
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in values:
            twice = next(k for k in data if str(k).replace("-", "_") == name)
            raise SystemExit(f"--config {path}: {twice!r} and {key!r} name the same flag; keep one of them")
        if name == "overwrite":  # a run's config.json has lost it already (NEW_RUN_ONLY)
            raise SystemExit(
                f"--config {path}: overwrite is not taken from a file (a recipe would replace the run in its folder "
                "without a word); give --overwrite on the command line"
            )
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0].replace('_', '-')}? " if close else ""
            raise SystemExit(
                f"--config {path}: unknown key {key!r}; {hint}(the keys are the flags of `python {script}.py --help`). "
                "Fix or remove it"
            )
        if known[name].type in (float, "float") and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as text
            try:
                value = float(value)
            except ValueError:
                pass
        problem = type_problem(known[name], value)
        quote = ' (quote a text value: budgets: "1")' if problem and known[name].type in (str, "str") else ""
        problem = problem or range_problem(known[name], value)
        if problem:
            raise SystemExit(f"--config {path}: {key} {problem}. Fix it in the file{quote}")
        values[name] = value
    return values


# =============================================================================
# Input checks (both scripts), before any model loads
# =============================================================================


def check_ranges(args):
    """Each numeric flag against the bounds in its Args metadata (min / max inclusive, gt / lt strict),
    NaN and inf refused; each flag with choices against them. Raises SystemExit naming flag, value and fix."""
    for f in fields(args):
        problem, flag = range_problem(f, getattr(args, f.name)), "--" + f.name.replace("_", "-")
        if problem:
            raise SystemExit(f"{flag} {problem}. Fix {flag}")


def range_problem(f, value):
    """What is wrong with `value` against the Args field f's choices or bounds ("-1: must be a finite number >= 0"),
    or None."""
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        return f"{value!r}: choose one of {[c for c in meta['choices'] if c]}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    bounds = [
        (meta.get("min"), ">=", value >= meta.get("min", -math.inf)),
        (meta.get("gt"), ">", value > meta.get("gt", -math.inf)),
        (meta.get("max"), "<=", value <= meta.get("max", math.inf)),
        (meta.get("lt"), "<", value < meta.get("lt", math.inf)),
    ]
    if not math.isfinite(value) or any(bound is not None and not ok for bound, _, ok in bounds):
        need = " and ".join(f"{op} {bound}" for bound, op, _ in bounds if bound is not None) or "finite"
        return f"{value}: must be a finite number {need}"
    return None


def check_report_to(report_to):
    """--report-to's package is installed (no default run needs it); else SystemExit with the fix."""
    packages = {"tensorboard": ["tensorboard", "tensorboardX"], "wandb": ["wandb"]}.get(report_to, [])
    if packages and not any(importlib.util.find_spec(p) for p in packages):
        raise SystemExit(
            f"--report-to {report_to} needs the {packages[0]} package: pip install {packages[0]}, "
            "or leave --report-to at none"
        )


def parse_budgets(text: str) -> list[float]:
    """Parse a budget vector such as "0.4,0.3,0.2,0.1" -> [0.4, 0.3, 0.2, 0.1].

    Budgets are NOT normalised: W's row sums equal them exactly as given. The
    loss divides by their sum (the mixture weights T W_kj / Lam sum to one per
    step), so scaling all budgets by a constant changes nothing in training.
    Raises ValueError naming the problem: empty, not a number, NaN/inf,
    negative, or all zero.
    """
    fix = "give comma-separated non-negative numbers, one per reward, e.g. --budgets 0.4,0.3,0.2,0.1"
    if text is None or not str(text).strip():
        raise ValueError(f"budgets are empty: {fix}")
    out = []
    for i, part in enumerate(str(text).split(",")):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"budget {i + 1} ({part.strip()!r}) is not a number: {fix}") from None
        if not math.isfinite(value):
            raise ValueError(f"budget {i + 1} is {value}: budgets must be finite; {fix}")
        if value < 0:
            raise ValueError(f"budget {i + 1} is negative ({value}): {fix}")
        out.append(value)
    if sum(out) <= 0:
        raise ValueError(f"all budgets are zero: at least one reward needs a positive budget; {fix}")
    if not math.isfinite(sum(out)):
        raise ValueError(f"budgets sum to {sum(out)}: only their ratios matter, so scale them down; {fix}")
    return out


def check_launch():
    """`accelerate launch --cpu --num_processes N` with N > 1 starts one process (accelerate's --cpu launcher runs
    several only through MPI), which would train on 1/N of the batch asked for: refused, with the launch that works.
    That launcher leaves MASTER_ADDR and ACCELERATE_USE_CPU set and no process count (WORLD_SIZE, or MPI's)."""
    env = os.environ
    counts = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_ADDR" in env and not any(map(env.get, counts)):
        raise SystemExit(
            "accelerate launch --cpu --num_processes N starts only one process (its --cpu launcher needs MPI for "
            "more). For N CPU processes: accelerate launch --multi_gpu --num_processes N <script>.py --device cpu ...; "
            "for one, drop --num_processes"
        )


def check_common(args, extra_rewards=None):
    """The checks both scripts make on the user's input, before any model is loaded or any file in a run folder
    changes: flag ranges, tracker, resolution, device, model, budgets and rewards (the reward models' weights, files
    and server there: reward_models.missing_inputs), branch steps. Returns (reward
    names, budgets, branch steps). Raises SystemExit with the problem and the fix."""
    check_ranges(args)
    check_precision(args)
    check_report_to(args.report_to)
    check_launch()
    if args.resolution % 16:
        raise SystemExit(
            f"--resolution {args.resolution}: SD3 needs a multiple of 16 (VAE 8 x patch 2), "
            "or 0 for the model's default"
        )
    device = args.device.split(":")[0]
    if device not in ("", "cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: give cpu, cuda or cuda:N (or omit it: cuda when available)")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA GPU is visible here. Use --device cpu (or omit --device)")
    model_path = Path(args.model)
    if not args.dry_run:
        if not model_path.exists():
            if args.model.startswith((".", "/", "~")) or args.model.count("/") != 1:
                raise SystemExit(
                    f"--model {args.model}: no such folder. Give a diffusers folder or a hub id such as "
                    "stabilityai/stable-diffusion-3.5-medium"
                )
            if not torch.cuda.is_available() and args.device != "cpu":
                raise SystemExit(
                    f"--model {args.model} (SD3.5-Medium scale) needs a CUDA GPU and none is visible. "
                    "On a CPU, train the embedded model: omit --model"
                )
        elif not (model_path / "model_index.json").exists():
            raise SystemExit(f"--model {args.model}: not a diffusers pipeline folder (no model_index.json)")
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as err:
        raise SystemExit(f"--budgets: {err}") from None
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    if not names:
        if not is_embedded(args.model):
            raise SystemExit("--rewards is required for this model, e.g. --rewards pickscore,clipscore,aesthetic,ocr")
        names = list(shapes_world.DEFAULT_REWARDS)
    known = set(REWARD_MODELS) | set(reward_extras(args.model, extra_rewards))
    unknown = [n for n in names if n not in known]
    if unknown or len(set(names)) != len(names):
        raise SystemExit(f"unknown or repeated reward(s) in {names}; known rewards: {sorted(known)}. Fix --rewards.")
    if len(budgets) != len(names):
        raise SystemExit(
            f"{len(budgets)} budgets for {len(names)} rewards ({','.join(names)}): "
            "give one budget per reward with --budgets"
        )
    permuted = [n.strip() for n in args.permute_rewards.split(",") if n.strip()]
    if args.permute_rewards.strip() and not permuted:
        tqdm.write(
            f"--permute-rewards {args.permute_rewards!r} names no reward: nothing is permuted (the run is no control)"
        )
    if any(n not in names for n in permuted) or len(set(permuted)) != len(permuted):
        raise SystemExit(
            f"--permute-rewards {args.permute_rewards}: name each permuted reward once, from --rewards "
            f"({','.join(names)})"
        )
    branch = parse_branch_steps(args.branch_steps, args.steps)
    if is_embedded(args.model) and args.train_prompts:
        raise SystemExit(
            "--train-prompts is not used with the embedded model (it samples prompts of its own world): "
            "omit it, or give --model"
        )
    problems = missing_inputs([n for n in names if n not in reward_extras(args.model, extra_rewards)], args)
    if problems:  # last: it may ask the hub or the GenEval server
        raise SystemExit(f"--rewards {','.join(names)}: a reward model cannot start:\n  " + "\n  ".join(problems))
    return names, budgets, branch


def check_precision(args):
    """--mixed-precision with --dtype: float16 weights without a gradient scaler are refused (a float16 gradient
    underflows to 0 or overflows to inf where a bfloat16 or float32 one does not), and fp16 mode keeps the transformer's
    weights in float32 as DiffusionNFT does, so another --dtype contradicts it."""
    if args.mixed_precision == "fp16" and args.dtype not in ("", "float32"):
        raise SystemExit(
            f"--mixed-precision fp16 keeps the transformer's weights in float32 under float16 autocast (DiffusionNFT's "
            f"mode); --dtype {args.dtype} contradicts it: drop --dtype, or --mixed-precision for {args.dtype} weights"
        )
    if args.mixed_precision == "no" and args.dtype == "float16":
        raise SystemExit(
            "--dtype float16 trains without a gradient scaler, and float16 gradients underflow or overflow where "
            "bfloat16's do not: use --mixed-precision fp16 (DiffusionNFT's mode: float32 weights, float16 autocast, a "
            "gradient scaler) or --dtype bfloat16"
        )


def check_files(args, names):
    """The files a run reads, checked before any model loads: prompt files (readable, >= 2 held-out prompts, the
    embedded world's held-out prompts inside its grammar, quoted text for the ocr reward) and, on --resume, the
    metrics file (a damaged line is refused; metrics_lines). SystemExit naming the file, the problem and the fix."""
    if args.train_prompts:
        unquoted = [q for q in read_prompts(args.train_prompts, "--train-prompts") if ocr_target(q) is None]
        if "ocr" in names and unquoted:
            raise SystemExit(
                f"--train-prompts {args.train_prompts}: the ocr reward scores the text between double quotes, and "
                f"{len(unquoted)} prompt(s) quote nothing, the first: {clip(unquoted[0])}. Quote the text to render"
            )
    if args.eval_prompts:
        prompts = read_prompts(args.eval_prompts, "--eval-prompts")
        if len(prompts) < 2:
            raise SystemExit(
                f"--eval-prompts {args.eval_prompts}: give at least 2 prompts (the held-out set is judged as a set)"
            )
        if is_embedded(args.model):
            for number, prompt in enumerate(prompts, 1):
                try:
                    shapes_world.parse_prompt(prompt)
                except ValueError:
                    raise SystemExit(
                        f"--eval-prompts {args.eval_prompts}: line {number}, {clip(prompt)}, is outside the embedded "
                        "world's captions (e.g. 'two red circles', 'a blue square on the left'); the world's "
                        "rewards cannot score it. Fix the line, or give --model"
                    ) from None
    if args.resume:
        metrics_lines(Path(args.resume) / "metrics.jsonl")


def read_credit_file(path_name, names, T, budgets):
    """The (K, T) W of a --credit file: JSON {"rewards": [names in --rewards order], "W": K x T entries}. Refused,
    naming the file and the fix: missing or not that JSON, its rewards other than `names` (in order), its shape other
    than (K, T), a negative or non-finite entry, or a total other than the budgets' sum (the loss is normalised by W's
    total, so the total fixes nothing but this check)."""
    path = Path(path_name)
    if not path_name or not path.is_file():
        raise SystemExit(f"--credit file needs --credit-file, a JSON file with the W to train with; {path} is not one")
    try:
        spec = json.loads(path.read_text())
        W = np.asarray(spec["W"], dtype=np.float64)
        rewards = list(spec["rewards"])
    except (ValueError, KeyError, TypeError) as err:
        raise SystemExit(f'--credit-file {path}: not {{"rewards": [...], "W": [[...]]}} JSON ({err}); fix the file')
    problem = (
        f"its rewards {rewards} are not --rewards {list(names)} (in that order)"
        if rewards != list(names)
        else f"W has shape {W.shape}, not ({len(names)}, {T}) (rewards x --steps)"
        if W.shape != (len(names), T)
        else "W has a negative or non-finite entry"
        if not np.all(np.isfinite(W)) or np.any(W < 0)
        else f"W sums to {W.sum():.6g}, not the budgets' sum {sum(budgets):.6g}"
        if not np.isclose(W.sum(), sum(budgets), rtol=1e-6, atol=0)
        else None
    )
    if problem:
        raise SystemExit(f"--credit-file {path}: {problem}; fix the file or the flags")
    return W


def read_level_stats(path, names, T):
    """[n (T+1,), s1 (K, T+1), s2 (K, T+1)]: the rows of `names` from a level-statistics file (experiments/protocol.py
    `measure_profiles`), the gain statistics recast.py starts from with --gain-init. They are discounted by
    --gain-ema like the run's own, so the prior's weight halves every ~7 iterations at 0.9. A file that is missing,
    not JSON, without the run's rewards, of other steps, of the wrong shapes, or with null/NaN/inf statistics (which
    would switch the credit off: W uniform, evidence 0) is refused naming the file and the field."""
    fix = "Make one with experiments/protocol.py's measure_profiles, or omit --gain-init"
    try:
        saved = json.loads(Path(path).read_text())
        rows = [saved["names"].index(k) for k in names]
        steps, estimator = saved["steps"], saved.get("estimator", "pairs")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(
            f"--gain-init {path}: not a readable level-statistics file holding rewards {names} ({type(err).__name__}: "
            f"{str(err)[:200]}). {fix}"
        ) from None
    if steps != T or estimator != "pairs":
        raise SystemExit(
            f"--gain-init {path}: measured with {steps} steps ({estimator}), this run has --steps {T} (pairs): "
            "measure again with these settings, or omit --gain-init"
        )
    stats = []
    for key, shape in (("n", (T + 1,)), ("s1", (len(saved["names"]), T + 1)), ("s2", (len(saved["names"]), T + 1))):
        try:
            value = np.asarray(saved.get(key), dtype=np.float64)  # null -> NaN, refused below
        except (ValueError, TypeError):
            value = np.asarray(None)
        if value.shape != shape:
            raise SystemExit(
                f"--gain-init {path}: field {key!r} is not an array of shape {shape} (steps + 1 levels"
                f"{'' if key == 'n' else ', one row per reward in names'}). {fix}"
            )
        if not np.isfinite(value).all():
            raise SystemExit(
                f"--gain-init {path}: field {key!r} holds {int((~np.isfinite(value)).sum())} null/NaN/inf entries; "
                f"they would switch ReCAST's credit off (W uniform). {fix}"
            )
        stats.append(value if key == "n" else value[rows])
    return stats


def clip(text, n=80):
    """repr of text for a message, cut to its first n characters (a 6 kB line is not echoed in full)."""
    return repr(text) if len(text) <= n else f"{text[:n]!r}... ({len(text)} characters)"


def parse_branch_steps(text, T):
    """--branch-steps: "rotate" or sorted distinct steps strictly between 0 and T - 1."""
    if text.strip() == "rotate":
        return "rotate"
    try:
        branch = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise SystemExit(f"--branch-steps {text!r}: give rotate, or step indices such as 3,6") from None
    if any(not 0 < b < T - 1 for b in branch):
        raise SystemExit(f"--branch-steps must lie strictly between 0 and T - 1 = {T - 1} (T = --steps), got {branch}")
    return branch


def is_embedded(model):
    """The embedded model, or a world variant built from it (`experiments/late_reward_world.py build --variant NAME`:
    its pipeline folder holds shapes_world.WORLD_FILE, world.json), which is run the same way: its world's rewards,
    text length, size."""
    path = Path(model).resolve()
    return path == (Path(__file__).parent / EMBEDDED_MODEL).resolve() or (path / shapes_world.WORLD_FILE).is_file()


def read_prompts(path, flag="prompts"):
    """Prompts of a UTF-8 text file, one per line; SystemExit naming the flag when the file is missing,
    binary, not UTF-8 or empty."""
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")  # -sig: a byte-order mark some editors write is dropped
    except OSError as err:
        raise SystemExit(
            f"{flag} {path}: cannot read it ({err.strerror}); give a text file with one prompt per line"
        ) from None
    except UnicodeDecodeError:
        raise SystemExit(f"{flag} {path}: not UTF-8 text; save it as UTF-8, one prompt per line") from None
    if "\x00" in text:
        raise SystemExit(f"{flag} {path}: a binary file, not prompts; give a text file with one prompt per line")
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{flag} {path}: no prompts (one per line)")
    return prompts


def distinct_prompts(prompts, n, seed, rank, world_size):
    """Process `rank`'s n prompts of one iteration, as DiffusionNFT's sampler draws them: one permutation of the
    prompt file's lines per iteration (seed), shared by every process and cut into consecutive slices, so no prompt
    is drawn twice in an iteration while the file has n * world_size lines or more (a shorter file is cycled)."""
    need = n * world_size
    order = np.random.default_rng(seed).permutation(len(prompts))
    order = np.tile(order, -(-need // len(order)))[:need]
    return [prompts[i] for i in order[rank * n : (rank + 1) * n]]


# =============================================================================
# Model loading, text encoding, the transformer's velocity, decoding and scoring
# =============================================================================


LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]


def no_torchvision_notice(record):
    """A logging filter: drops transformers' notice that torchvision is absent (deliberately: the PIL image processors
    it falls back to serve every model here) and nothing else."""
    return "requires torchvision (not installed)" not in record.getMessage()


def quiet_start_up():
    """The console of a run holds one progress bar and no library notices: the filter above on the logger that
    prints the torchvision notice, and the loading bars of diffusers and transformers off in this process."""
    logging.getLogger("transformers.utils.import_utils").addFilter(no_torchvision_notice)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


@dataclass(frozen=True)
class Precision:
    """What --mixed-precision and --dtype give a run on its device (`precision`): each frozen module's weight dtype
    (the LoRA adapters and AdamW's state are float32 in every mode) and the autocast of the transformer's forwards and
    the decodes (None: none). A float16 autocast comes with a gradient scaler (`gradient_scaler`)."""

    transformer: torch.dtype  # the frozen transformer's weights
    text_encoders: torch.dtype  # CLIP-L, CLIP-G, T5 (their embeddings' dtype is the transformer input's, `velocity`)
    vae: torch.dtype
    autocast: torch.dtype | None  # rollouts, the update's forwards, evaluation, decoding; None: no autocast
    tf32: bool  # TF32 matmuls and convolutions allowed on cuda (DiffusionNFT's allow_tf32)


def precision(args, device_type):
    """--mixed-precision fp16: DiffusionNFT's mode (`scripts/train_nft_sd3.py`: the pipeline loaded in float32, the VAE
    kept there, the text encoders in float16, `torch_autocast(dtype=float16)` around the transformer's forwards and the
    sampler's decode, a `GradScaler`, `allow_tf32`). no: every frozen weight in --dtype (bfloat16 on cuda, float32 on
    cpu), no autocast, TF32 left as torch sets it."""
    if args.mixed_precision == "fp16":
        return Precision(torch.float32, torch.float16, torch.float32, torch.float16, tf32=True)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device_type == "cuda" else "float32"))
    return Precision(dtype, dtype, dtype, None, tf32=False)


def gradient_scaler(device_type, prec: Precision):
    """torch.amp.GradScaler for a float16 autocast (its default scale 2^16, halved after a step with non-finite
    gradients, doubled after 2,000 good ones), else None (bfloat16 and float32 need none)."""
    return torch.amp.GradScaler(device_type) if prec.autocast == torch.float16 else None


def load_pipeline(args, device, dtype, text_dtype=None):
    """StableDiffusion3Pipeline (the real SD3.5-M or the embedded tiny one, same classes) with
    frozen VAE and text encoders, and LoRA adapters on the transformer: "default" (trained), "old"
    (sampling policy, a copy) and with --ema "ema". Disabling adapters gives the frozen base.
    dtype: the frozen weights' (the VAE's too); text_dtype: the text encoders' when it differs (fp16 mode)."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig

    local = Path(args.model).exists()
    pipe = StableDiffusion3Pipeline.from_pretrained(args.model, dtype=dtype, local_files_only=local)
    if text_dtype is not None:  # before moving to the device: T5-XXL in float32 would take 19 GB there
        for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            if module is not None:
                module.to(dtype=text_dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device, silence_dtype_warnings=text_dtype is not None)  # float16 text encoders run on a CPU too (autocast)
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
        if module is not None:
            module.requires_grad_(False)
            module.eval()
    transformer = pipe.transformer
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, init_lora_weights="gaussian", target_modules=LORA_TARGETS
    )
    torch.manual_seed(args.seed)
    transformer.add_adapter(config, adapter_name="default")
    adapters = ["default", "old"] + (["ema"] if args.ema else [])
    for name in adapters[1:]:  # "old" and "ema" start as copies of "default"
        with warnings.catch_warnings():  # several adapters on one model are the design here, not a slip
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            transformer.add_adapter(config, adapter_name=name)
        copy_adapter(transformer, "default", name)
    for p in [p for name in adapters for p in lora_params(transformer, name)]:
        p.data = p.data.float()  # LoRA weights and their optimizer state in float32
    transformer.set_adapter("default")
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return pipe


def scheduler_sigmas(pipe, steps):
    """The pipeline scheduler's sigma grid (steps + 1,) for `steps` steps, from a copy (the pipeline's own stays
    as set)."""
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.float().cpu()


def lora_params(transformer, adapter):
    return [p for n, p in transformer.named_parameters() if f".{adapter}." in n]


def copy_adapter(transformer, src, dst, keep=0.0):
    """dst <- keep * dst + (1 - keep) * src, parameter by parameter (DiffusionNFT's soft update)."""
    with torch.no_grad():
        for p_src, p_dst in zip(lora_params(transformer, src), lora_params(transformer, dst)):
            p_dst.mul_(keep).add_(p_src.to(p_dst.dtype), alpha=1 - keep)


def encode(pipe, prompts, max_len, device):
    """CFG-free text conditioning: (prompt_embeds (P, L, D), pooled (P, D'))."""
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(
            prompts, prompts, prompts, device=device, do_classifier_free_guidance=False, max_sequence_length=max_len
        )
    return emb, pooled


def velocity(transformer, x, s, emb, pooled, chunk=64):
    """v(x_t, t, c) of the active adapter; x (N, C, h, w) float32, s (N,) sigmas in [0, 1],
    emb/pooled already indexed per sample. The transformer takes timestep = 1000 s (float32, as the
    SD3 pipeline passes it, whatever the weights' dtype). Returns float32."""
    dtype = emb.dtype
    outs = []
    for i in range(0, len(x), chunk):
        sl = slice(i, i + chunk)
        outs.append(
            transformer(
                hidden_states=x[sl].to(dtype),
                timestep=s[sl] * 1000,
                encoder_hidden_states=emb[sl],
                pooled_projections=pooled[sl],
                return_dict=False,
            )[0].float()
        )
    return torch.cat(outs)


def decode(pipe, latents, chunk=8):
    """Latents (scaled as the transformer sees them) -> list of PIL images."""
    cfg = pipe.vae.config
    images = []
    with torch.no_grad():
        for z in latents.split(chunk):
            x = pipe.vae.decode((z / cfg.scaling_factor + cfg.shift_factor).to(pipe.vae.dtype), return_dict=False)[0]
            images += pipe.image_processor.postprocess(x.float(), output_type="pil")
    return images


def reward_extras(model, extra=None):
    """Rewards that are plain callables: the embedded world's programs (for the embedded model;
    their names shadow the reward models', e.g. `geneval` is the shapes checker there) and `extra`."""
    world = shapes_world.REWARDS if is_embedded(model) else {}
    return {**world, **(extra or {})}


def score(rewards, images, prompts):
    """Rewards (N, K) float64; non-finite values are kept (NaN) and handled by `optimality`."""
    return np.stack([np.asarray(fn(images, prompts), dtype=np.float64).reshape(len(images)) for fn in rewards], 1)


def permute_within_groups(R, groups, names, permute, seed, it, rank=0):
    """--permute-rewards, the control that could prove a method wrong: the columns of R (N, K) named in `permute`
    (comma-separated, from `names`) shuffled among the leaves of each prompt group by a permutation fixed by
    (seed, iteration, process). Each group keeps its values (its mean and spread, so the optimality's scale), which
    no longer belong to its images. Returns R itself when nothing is permuted, else a copy."""
    cols = [names.index(n.strip()) for n in permute.split(",") if n.strip()]
    if not cols:
        return R
    out = R.copy()
    out[:, cols] = shuffle_within_groups(R[:, cols], groups, np.random.default_rng([seed, it, rank, 7]))
    return out


def shuffle_within_groups(R, groups, rng):
    """R (N, ...) with each group's rows shuffled among themselves: one rng.permutation per group, in the order of
    np.unique(groups). Returns a copy. (--permute-rewards; the trainable toy's permuted control.)"""
    out, groups = R.copy(), np.asarray(groups)
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        out[rows] = R[rng.permutation(rows)]
    return out


def dry_run(args):
    """SD3.5-Medium readiness without weights: its transformer (shipped config) on the meta device,
    the LoRA adapters attached ("default", "old", with --ema "ema"), trainable parameters and a memory plan for one
    micro-batch in the run's precision (--mixed-precision fp16: float32 frozen weights and the float16 copies autocast
    makes of them, kept for backward: of one block at a time with --gradient-checkpointing, which recomputes them)."""
    check_precision(args)
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    config = json.loads((Path(__file__).parents[1] / "world/assets/sd3.5-medium-transformer.json").read_text())
    with init_empty_weights(include_buffers=True):  # buffers too: SD3's 384 x 384 position table is not computed
        transformer = SD3Transformer2DModel.from_config(config)
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=LORA_TARGETS)
        transformer.add_adapter(lora, adapter_name="default")
        adapters = ["default", "old"] + (["ema"] if args.ema else [])
        with warnings.catch_warnings():  # several adapters on one model are the design here (as in load_pipeline)
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            for name in adapters[1:]:
                transformer.add_adapter(lora, adapter_name=name)
    trainable = sum(p.numel() for p in lora_params(transformer, "default"))
    total = sum(p.numel() for p in transformer.parameters()) - len(adapters) * trainable  # the transformer alone
    targets = sum(1 for n, _ in transformer.named_modules() if n.endswith(".lora_A.default"))
    res = args.resolution or 512
    tokens = (res // 8 // config["patch_size"]) ** 2 + 77 + (args.max_sequence_length or 128)
    gib = 2**30
    fp16 = args.mixed_precision == "fp16"
    weights = "fp32" if fp16 or args.dtype == "float32" else "bf16"  # float16 without a scaler: check_precision
    copies = total / (config["num_layers"] if args.gradient_checkpointing else 1)
    plan = {
        f"frozen weights ({weights})": {"fp32": 4, "bf16": 2}[weights] * total / gib,
        **({"their fp16 copies kept for backward (autocast)": 2 * copies / gib} if fp16 else {}),
        f"{len(adapters)} LoRA adapters ({', '.join(adapters)}; fp32)": 4 * len(adapters) * trainable / gib,
        "AdamW state + grads (fp32)": 3 * 4 * trainable / gib,
        # rough activation size kept for backward: per block ~ 12 tensors of (tokens, hidden) in bf16 (fp16)
        f"activations, micro-batch {args.train_batch} (estimate)": args.train_batch
        * config["num_layers"]
        * 12
        * tokens
        * config["num_attention_heads"]
        * config["attention_head_dim"]
        * 2
        / gib,
    }
    print(
        f"SD3.5-Medium transformer: {total / 1e6:.1f}M parameters, LoRA on {targets} linear layers "
        f"(r={args.lora_rank}, alpha={args.lora_alpha}): {trainable / 1e6:.2f}M trainable"
    )
    rows = {**plan, "total (transformer training, excl. VAE/text encoders)": sum(plan.values())}
    width = max(len(key) for key in rows)
    for key, value in rows.items():
        print(f"  {key:<{width}} {value:8.2f} GiB")
    return {"total_params": total, "trainable_params": trainable, "lora_layers": targets, "memory_gib": plan}


# =============================================================================
# The run: what one training run holds, seeding, and each iteration's bookkeeping
# =============================================================================


@dataclass
class Run:
    """What one training run holds once it is set up (`load_run`); each step of a script's train reads it."""

    acc: Accelerator  # accelerate: the processes, this one's device, the --report-to tracker
    pipe: StableDiffusion3Pipeline  # the real SD3.5-M or the embedded tiny one: frozen VAE and text encoders
    transformer: SD3Transformer2DModel  # pipe.transformer, LoRA adapters "default" (trained), "old" (sampling), "ema"
    names: list[str]  # reward names, in budget order
    budgets: list[float]  # lambda_k, one per reward, as given (not normalised)
    branch: str | list[int]  # --branch-steps: "rotate", or the branch steps every prompt group takes
    rewards: list  # reward callables (images, prompts) -> (N,), in names' order
    judges: dict | None  # held-out judges {name: (images, prompts) -> (N,)}, read by the evaluation only
    frechet: object  # held-out drift judge (set level) (images, prompts) -> float, or None
    sigmas: torch.Tensor  # (T+1,) float32, 1 -> 0: the sampler grid, W's columns and the training timesteps
    eval_sigmas: torch.Tensor  # (eval steps + 1,): the evaluation sampler's grid
    shape: tuple[int, int, int]  # (C, h, w) of one image's latent
    opt: torch.optim.Optimizer  # AdamW on the "default" adapter's parameters
    eval_prompts: list[str]  # the held-out prompts of every evaluation
    out: Path  # the run folder
    lock: object  # the open out/.lock of the first process (held while the run lives), None in the others
    script: str  # "recast" or "rvge": config.json's "script", the W&B project
    world: object  # the shapes_world module for the embedded model, else None
    train_prompts: list[str] | None  # --train-prompts' lines (None: the embedded world samples its own)
    max_len: int  # T5 tokens of the text conditioning
    prompts_per_iter: int  # prompt groups per iteration and process
    seed: int  # --seed, which draws the prompts
    keep_checkpoints: int = 2  # --keep-checkpoints: the newest N kept (0: all)
    precision: Precision | None = None  # --mixed-precision, --dtype: the weights' dtypes and the autocast
    scaler: torch.amp.GradScaler | None = None  # the gradient scaler of a float16 autocast (`nft.optimizer_step`)

    def autocast(self):
        """The context of the transformer's forwards and the decodes: `torch.autocast` with --mixed-precision fp16,
        else none (the weights' own dtype)."""
        dtype = self.precision.autocast if self.precision else None
        return torch.autocast(self.acc.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def reduce(self, a):
        """Sum numpy statistics over processes."""
        if self.acc.num_processes == 1:
            return np.asarray(a)
        tensor = torch.as_tensor(np.asarray(a), dtype=torch.float64, device=self.acc.device)
        return self.acc.reduce(tensor, "sum").cpu().numpy()

    def all_reduce_grads(self, params):
        """Average the gradients of `params` over processes in one collective: every gradient copied into one flat
        buffer, all-reduced, copied back (DDP's bucketing with a single bucket; the LoRA's gradients are small)."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.acc.num_processes > 1 and grads:
            flat = self.acc.reduce(torch.cat([g.reshape(-1) for g in grads]), "mean")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def prompts_for(self, it):
        """This process's prompt groups of iteration `it`."""
        acc = self.acc
        if self.world:
            return self.world.sample_prompts(
                self.prompts_per_iter, "train", self.seed * 7919 + it * 97 + acc.process_index
            )
        return distinct_prompts(
            self.train_prompts, self.prompts_per_iter, [self.seed, it], acc.process_index, acc.num_processes
        )


def load_run(args, names, budgets, branch, script, extra_rewards=None, judges=None, lock=True):
    """Everything one run needs, loaded, after the script's checks (its `validate` gave names, budgets and branch):
    the run folder locked (lock=False: evaluate.py, which only reads a run, perhaps one still training), processes
    and device, seeds, the pipeline with its LoRA adapters, rewards, judges, the optimizer, prompts. Returns the Run."""
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list

    quiet_start_up()
    lock = lock_run(args.out) if lock and is_first_process(args) else None
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if process_state(args).num_processes > 1:  # the first process chose the run folder
        args.out = broadcast_object_list([args.out], from_process=0)[0]
    trackers = {} if args.report_to == "none" else {"log_with": args.report_to, "project_dir": args.out}
    acc = Accelerator(cpu=device_name == "cpu", **trackers)
    prec = precision(args, acc.device.type)
    if prec.tf32 and acc.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(args.seed)
    world = shapes_world if is_embedded(args.model) else None
    gen_kwargs = world.GEN_KWARGS if world else {}
    res = args.resolution or gen_kwargs.get("height", 512)
    max_len = args.max_sequence_length or gen_kwargs.get("max_sequence_length", 128)  # 128: DiffusionNFT's T5 length
    text_dtype = prec.text_encoders if prec.text_encoders != prec.transformer else None
    pipe = load_pipeline(args, acc.device, prec.transformer, text_dtype)
    pipe.scheduler.set_timesteps(args.steps)
    train_prompts = read_prompts(args.train_prompts, "--train-prompts") if args.train_prompts else None
    if world is None and train_prompts is None:
        raise SystemExit("--train-prompts FILE is required for this model (one prompt per line)")
    return Run(
        acc=acc,
        pipe=pipe,
        transformer=pipe.transformer,
        names=names,
        budgets=budgets,
        branch=branch,
        rewards=build_rewards(names, replace(args, device=str(acc.device)), reward_extras(args.model, extra_rewards)),
        judges=judges if judges is not None or world is None else world.JUDGES,
        frechet=world.frechet_distance if world else None,
        sigmas=pipe.scheduler.sigmas.float().cpu(),
        eval_sigmas=scheduler_sigmas(pipe, args.eval_steps or args.steps),
        shape=(pipe.transformer.config.in_channels, res // pipe.vae_scale_factor, res // pipe.vae_scale_factor),
        opt=torch.optim.AdamW(lora_params(pipe.transformer, "default"), lr=args.lr, weight_decay=args.weight_decay),
        eval_prompts=read_prompts(args.eval_prompts, "--eval-prompts")
        if args.eval_prompts
        else (world.sample_prompts(16, "heldout", 0) if world else []),
        out=Path(args.out),
        lock=lock,
        script=script,
        world=world,
        train_prompts=train_prompts,
        max_len=max_len,
        prompts_per_iter=args.prompts_per_iter,
        seed=args.seed,
        keep_checkpoints=args.keep_checkpoints,
        precision=prec,
        scaler=gradient_scaler(acc.device.type, prec),
    )


def seed_everything(seed):
    """Seeds Python's `random`, numpy's global RNG and torch's CPU and CUDA default generators.
    The loop itself draws every random number from per-iteration generators seeded by
    (seed, iteration), so a resumed run repeats the iterations an uninterrupted one would."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def iteration_generator(seed, iteration):
    """The CPU generator that draws every random number of one iteration (noise moves to the device)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration)


def stop_if_a_reward_failed(run: Run, it, n_valid, state):
    """Stop the run when a reward returned NaN/inf for every image of iteration `it` (all processes): the state
    after iteration it - 1 is checkpointed (at iteration 0 nothing was trained and nothing is saved, so that a
    resume trains iteration 0), and the message names the reward(s) and how to continue. n_valid (K,)."""
    if (n_valid == 0).any():
        if run.acc.is_main_process and it > 0:
            save_checkpoint(run.out, it - 1, run.transformer, run.opt, state, run.keep_checkpoints, run.scaler)
        bad = [n for n, c in zip(run.names, n_valid) if c == 0]
        done = f"the state after iteration {it - 1} is saved in {run.out}" if it else "nothing was trained"
        raise SystemExit(
            f"reward(s) {bad} returned NaN/inf for every image of iteration {it}; {done}. "
            f"Fix the reward, then continue with --resume {run.out}"
        )


def reward_metrics(run: Run, it, b, n_valid, mean_R, losses):
    """The first entries of an iteration's metrics line: training rewards per reward and budget-weighted, the
    count of non-finite ones (all processes), the update's losses and sample count."""
    nonfinite = (run.reduce(len(b.R)) - n_valid).astype(int).tolist()
    return {
        "iteration": it,
        **{f"reward/{n}": float(mean_R[k]) for k, n in enumerate(run.names)},
        "reward/weighted": float(budget_mean(mean_R, run.budgets)),
        **{f"reward_nonfinite/{n}": c for n, c in zip(run.names, nonfinite)},
        **losses,
        "train/samples": int(run.reduce(losses["train/samples"])),
    }


def budget_mean(values, budgets):
    """The budget-weighted mean sum_k lambda_k v_k / Lam of per-reward values (K,): the metrics `reward/weighted`
    and `eval/weighted`."""
    return np.asarray(budgets) @ values / sum(budgets)


def finish_iteration(run: Run, args, it, metrics, state, before, sample):
    """Step 4: evaluate (`evaluate` with the held-out sampler `sample`, nft.ode_sample, every eval_every iterations
    and at the end; every process takes its share), append the metrics line, draw the figures and log them (at each
    evaluation), checkpoint (every save_every iterations and at the end). `before` the first evaluation's metrics (or
    None). Returns whether it drew the figures (it evaluated)."""
    last = it == args.iterations - 1
    evaluated = None
    if args.eval_every and run.eval_prompts and ((it + 1) % args.eval_every == 0 or last):
        evaluated = evaluate(run, args, sample)
    if run.acc.is_main_process:
        if before:
            metrics.update({k.replace("eval/", "eval_before/"): v for k, v in before.items()})
        if evaluated:
            metrics.update(evaluated[0])
        append_metrics(run.out, metrics)
        names = run.names if getattr(args, "credit", "") != "nft" else None  # nft: no W image, W plays no part
        log_to_trackers(run.acc, metrics, step=it, names=names)
        if evaluated:
            show_evaluation(run, it, evaluated, state)
        if (it + 1) % args.save_every == 0 or last:
            save_checkpoint(run.out, it, run.transformer, run.opt, state, run.keep_checkpoints, run.scaler)
    run.acc.wait_for_everyone()
    return evaluated is not None


EVAL_SEED = 12345  # the held-out noise of every evaluation of every run and method, and of evaluate.py
SHOWN = 16  # the held-out prompts whose samples an evaluation returns, draws (samples.png) and keeps


def evaluate(run: Run, args, sample):
    """Held-out evaluation of the trained adapter (its EMA with --ema, as DiffusionNFT evaluates): the Euler ODE
    (`sample`: nft.ode_sample, passed in, as the kit imports no algorithm) with --eval-steps from fixed noise
    (EVAL_SEED) on the held-out prompts, training rewards and held-out judges. Every process samples, decodes and
    scores its consecutive share of the prompts, from the noise that prompt has when one process samples them all;
    the shares are gathered, so every process returns what one process would: (metrics, the images of the first
    SHOWN prompts, R (P, K) the rewards per image). Only those images travel between processes, unless a set-level
    judge (frechet) needs them all."""
    from accelerate.utils import gather_object

    acc, prompts = run.acc, run.eval_prompts
    share = np.array_split(np.arange(len(prompts)), acc.num_processes)[acc.process_index]
    noise = torch.randn((len(prompts), *run.shape), generator=torch.Generator().manual_seed(EVAL_SEED))
    mine, images, R, judged = [prompts[i] for i in share], [], np.zeros((0, len(run.names))), {}
    if len(mine):
        emb, pooled = encode(run.pipe, mine, run.max_len, acc.device)
        run.transformer.set_adapter("ema" if args.ema else "default")
        with run.autocast():  # DiffusionNFT's evaluation samples and decodes under its autocast too
            latents = sample(
                run.transformer, emb, pooled, run.eval_sigmas, run.shape, EVAL_SEED, args.rollout_batch, noise[share]
            )
            images = decode(run.pipe, latents)
        run.transformer.set_adapter("default")
        R = score(run.rewards, images, mine)
        judged = {name: np.asarray(fn(images, mine), dtype=np.float64) for name, fn in (run.judges or {}).items()}
    first = share[0] if len(share) else len(prompts)
    images = images if run.frechet else images[: max(0, SHOWN - first)]
    shares = gather_object([(images, R, judged)])  # [(images, R, judged)] of every process, in process order
    images, R = [im for part in shares for im in part[0]], np.concatenate([part[1] for part in shares])
    metrics = {f"eval/{n}": float(np.nanmean(R[:, k])) for k, n in enumerate(run.names)}
    metrics["eval/weighted"] = float(budget_mean(np.nanmean(R, 0), run.budgets))
    for name in run.judges or {}:
        values = np.concatenate([part[2][name] for part in shares if name in part[2]])
        metrics[f"eval/judge/{name}"] = float(np.nanmean(values))
    if run.frechet:
        metrics["eval/judge/frechet"] = float(run.frechet(images, prompts))
    return metrics, images[:SHOWN], R


def evaluate_before(run: Run, args, sample, state):
    """The first evaluation, before any update (the pretrained model's samples): its metrics (logged as
    eval_before/* with iteration 0), its images and per-image rewards kept in `state` (and so in every checkpoint)
    for the before/after figure `samples.png`."""
    metrics, images, R = evaluate(run, args, sample)
    if run.acc.is_main_process:
        state["samples_before"] = (np.stack([np.asarray(im.convert("RGB")) for im in images]), R[: len(images)])
        show_evaluation(run, None, (metrics, images, R), state)
    return metrics


def append_metrics(out, metrics):
    """One line of out/metrics.jsonl. A failed write (a full disk) stops the run with the fix: the lines before are
    kept, a cut-short last line is dropped by the resume, which redoes the iterations after the last checkpoint."""
    try:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
    except OSError as err:
        raise SystemExit(
            f"cannot append iteration {metrics['iteration']}'s metrics to {out}/metrics.jsonl ({err.strerror}): is the "
            f"disk full? The earlier lines and the last checkpoint are kept; free space, then --resume {out}"
        ) from None


def check_finite(values):
    """Stop before an optimizer step that would write NaN/inf into the weights (exit code 1; the run
    folder keeps its last good checkpoint). values: the step's losses and gradient norm."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise SystemExit(
            f"non-finite {bad}: the optimizer step was not taken and nothing was saved; the last good "
            "checkpoint is kept. Lower --lr or check the flags and rewards, then --resume"
        )


# =============================================================================
# Run folders, resume and locks
# =============================================================================


def is_run(folder):
    """True when folder/config.json is a run's record (JSON with "args" and "script" recast or rvge)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict) and isinstance(config.get("args"), dict) and config.get("script") in ("recast", "rvge")
    )


def is_unused(folder):
    """True when nothing is at the path, or it is a folder holding nothing but a run's lock file and a half-written
    config.json.tmp (a start that stopped before it wrote its config; the start removes the .tmp)."""
    folder = Path(folder)
    return not folder.exists() or (
        folder.is_dir() and all(p.name in (".lock", "config.json.tmp") for p in folder.iterdir())
    )


def run_folder(args, default_name):
    """The run folder, checked writable, never inside another run (whose checkpoint rotation would delete it).
    --resume: that folder. --out: a new or empty folder, or a run, which is refused unless --overwrite (a folder of
    other files is refused even then: a run writes only where nothing else lives). Default runs/<--name, else the
    script's default_name>: a fresh -1, -2, ... suffix when the name is taken, so running a command twice gives two
    runs. Creates the folder; changes nothing inside it. Under a multi-process launch only the first process decides
    (the others would see its files as another run's); load_run hands its choice to the rest. Returns the folder as a
    string, or, in the other processes, args.out as given."""
    if not is_first_process(args):
        return args.out
    for flag, path in (("--resume", args.resume), ("--out", args.out), ("--name", args.name)):
        check_path_length(path, flag)
    if args.resume:
        out = Path(args.resume)
        check_checkpoints_are_there(out)
        check_process_count(out, args)
    elif args.out:
        out = Path(args.out)
        holds_a_run = is_run(out)
        if holds_a_run and not args.overwrite:
            raise SystemExit(
                f"--out {out} already holds a run. Continue it with --resume {out}, choose another --out, "
                "or replace it with --overwrite"
            )
        if holds_a_run and not_the_runs_own(out) and not os.access(out.resolve().parent, os.W_OK):
            raise SystemExit(
                f"--overwrite {out}: it holds files that are not the run's own ({not_the_runs_own(out)[0].name}, ...), "
                f"which --overwrite moves to {set_aside_folder(out)}, and {out.resolve().parent} is not writable. "
                "Move them away yourself, or choose another --out"
            )
        if not holds_a_run and not is_unused(out):
            raise SystemExit(
                f"--out {out} holds files that are not a run of this project (a run writes only to a new or empty "
                "folder, and --overwrite replaces only runs). Choose a new folder with --out"
            )
    else:
        base = Path("runs") / (args.name or default_name)
        out = next(p for p in (base.with_name(f"{base.name}-{i}") if i else base for i in range(10**6)) if is_unused(p))
    where = Path(os.path.abspath(out))
    if len(where.parts) <= 2 or where == Path.home().absolute():
        raise SystemExit(
            f"{out} is a system folder (the root, a folder directly under it, or your home folder): a run writes only "
            "to a folder of its own. Choose one such as runs/<name> with --out"
        )
    host = next((p for p in where.parents if is_run(p)), None)
    if host is not None:
        raise SystemExit(
            f"{out} lies inside the run folder {host}, whose checkpoint rotation and --overwrite would delete it: "
            "choose a folder outside any run"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise SystemExit(f"cannot write to the run folder {out} ({err.strerror}): choose another with --out") from None
    if args.report_to == "tensorboard" or args.overwrite:
        check_tensorboard_folder(out / "tensorboard", args.report_to)
    return str(out)


def check_process_count(out, args):
    """--resume with the process count the run was trained with (config.json's "processes"; runs that predate it
    are not checked): each process draws --prompts-per-iter prompt groups, so another count changes the global
    batch, and with it the prompts and the updates of every later iteration."""
    try:
        saved = json.loads((out / "config.json").read_text()).get("processes")
    except (OSError, ValueError, AttributeError):
        return  # parse_flags has named the problem
    now, groups = process_state(args).num_processes, args.prompts_per_iter
    if saved is not None and saved != now:
        raise SystemExit(
            f"--resume {out}: the run was trained with {saved} process(es), this start has {now}; each draws "
            f"--prompts-per-iter {groups} prompt groups, so the global batch would change from {saved * groups} to "
            f"{now * groups} groups. Launch with the same count (accelerate launch --num_processes {saved}, or a "
            "plain python for 1), or start a new run"
        )


def check_path_length(path, flag):
    """A run folder path the file system can hold: no name longer than its NAME_MAX bytes (255 on Linux file
    systems), the whole within PATH_MAX; else SystemExit naming the flag and the fix."""
    if not path:
        return
    name_max, path_max = 255, 4096
    try:
        name_max, path_max = os.pathconf(".", "PC_NAME_MAX"), os.pathconf(".", "PC_PATH_MAX")
    except (OSError, ValueError):
        pass
    long = next((part for part in Path(path).parts if len(os.fsencode(part)) > name_max), None)
    if long is not None or len(os.fsencode(os.path.abspath(path))) > path_max - 100:  # 100: the run's own names
        what = f"the name {long[:30]}... has {len(os.fsencode(long))} bytes" if long else "the path is too long"
        raise SystemExit(
            f"{flag} {str(path)[:60]}...: {what}; this file system allows {name_max} bytes a name and {path_max} a "
            f"path. Choose a shorter {flag}"
        )


def check_tensorboard_folder(folder, report_to):
    """<run>/tensorboard, where --report-to tensorboard writes its events and --overwrite clears: nothing yet, or a
    folder this process can write to. Checked before the model loads (a tracker fails only once it starts)."""
    if folder.is_symlink() and not folder.exists() or folder.exists() and not folder.is_dir():
        raise SystemExit(
            f"{folder} is a file, not the run's TensorBoard folder, and a run writes its events there (--overwrite "
            "would delete it): move that file away, then run the command again"
        )
    if folder.is_dir():
        probe = folder / f".write_test.{os.getpid()}"
        try:
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            fix = "or leave --report-to at none" if report_to == "tensorboard" else "or choose another --out"
            raise SystemExit(
                f"cannot write to {folder} ({err.strerror}): make it writable (chmod -R u+w {folder}), {fix}"
            ) from None


def process_state(args):
    """accelerate's PartialState of this process (started here if no one has yet: under `accelerate launch` this
    joins the process group), on the device --device names, else CUDA when there is one. The launcher's variables
    are checked first (`launch_variables`); a process of a launch that waits for the others says so after
    WAIT_NOTICE_S and gives up after LAUNCH_WAIT_S (passed to torch.distributed as its timeout, which then bounds
    every collective too, as NCCL's default of 10 minutes does)."""
    from accelerate import PartialState

    cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    launch = None if torch.distributed.is_available() and torch.distributed.is_initialized() else launch_variables()
    if launch is None:
        return PartialState(cpu=cpu)
    rank, world, where = launch
    given = " ".join(k for k in LAUNCH_VARIABLES if k in os.environ)  # accelerate adds some of them
    notice = threading.Timer(
        WAIT_NOTICE_S,
        lambda: print(
            f"process {rank} of {world}: waiting for the other processes at {where} (gives up after {LAUNCH_WAIT_S} s)",
            file=sys.stderr,
            flush=True,
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        return PartialState(cpu=cpu, timeout=datetime.timedelta(seconds=LAUNCH_WAIT_S))
    except (RuntimeError, ValueError) as err:  # torch's DistNetworkError, DistStoreError; accelerate's ValueError
        raise SystemExit(
            f"process {rank} of {world}: the other processes did not join at {where} within {LAUNCH_WAIT_S} s "
            f"({type(err).__name__}). Start them all with `accelerate launch --num_processes {world} ...`, or unset "
            f"{given} MASTER_ADDR MASTER_PORT to run one process"
        ) from None
    finally:
        notice.cancel()


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # what a launcher (torchrun) sets
LAUNCH_WAIT_S = 600  # how long a process of a launch waits for the others before it gives up
WAIT_NOTICE_S = 10  # when a waiting process says that it waits


def launch_variables():
    """The launcher's variables (LAUNCH_VARIABLES, MASTER_ADDR, MASTER_PORT), checked before any distributed start:
    None when there are none, or when their values are one process's (WORLD_SIZE 1 or unset, RANK and LOCAL_RANK 0
    or unset; a RANK alone, which starts nothing) and no MASTER_ADDR/MASTER_PORT says a launcher set them: such
    leftovers in a plain shell are removed from this process's environment, with a line that says so, and the run
    is one process. (rank, world size, "addr:port") of a launch. Values that are not whole numbers, that contradict
    each other, or of several processes without MASTER_ADDR and MASTER_PORT: SystemExit in one line naming the
    variables and the fix."""
    given = {k: os.environ[k] for k in LAUNCH_VARIABLES if k in os.environ}
    if not given:
        return None
    shown = " ".join(f"{k}={v}" for k, v in given.items())
    fix = f"Start several processes with `accelerate launch --num_processes N ...`, or unset {' '.join(given)} for one"
    bad = next((k for k, v in given.items() if not v.strip().isdigit()), None)
    if bad:
        raise SystemExit(f"launcher variables {shown}: {bad} is not a whole number. {fix}")
    n = {k: int(v) for k, v in given.items()}
    world, rank, local = n.get("WORLD_SIZE", 1), n.get("RANK"), n.get("LOCAL_RANK", 0)
    launched = bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT"))
    if world == 1 and local == 0 and (rank in (None, 0) or "WORLD_SIZE" not in given) and not launched:
        for k in given:
            del os.environ[k]
        print(f"{shown} (a launcher's variables, without MASTER_ADDR/MASTER_PORT): one process", file=sys.stderr)
        return None
    local_world = n.get("LOCAL_WORLD_SIZE", world)
    if world < 1:
        problem = "WORLD_SIZE must be 1 or more"
    elif rank is None:
        problem = "RANK is not set"
    elif rank >= world:
        problem = f"RANK {rank} is not below WORLD_SIZE {world}"
    elif local > rank or local >= local_world:
        problem = f"LOCAL_RANK {local} does not fit RANK {rank} and LOCAL_WORLD_SIZE {local_world}"
    elif not launched:
        problem = "MASTER_ADDR and MASTER_PORT are not set (no launcher started the other processes)"
    else:
        return rank, world, f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    raise SystemExit(f"launcher variables {shown}: {problem}. {fix}")


def is_first_process(args):
    """True in a single process and in the first process of an `accelerate launch`, as accelerate itself counts
    them (process index 0). Never an environment variable alone: a RANK left over from a launcher in a plain shell
    must not switch off the run-folder checks and the lock of a single-process run."""
    return process_state(args).process_index == 0


def lock_run(out):
    """An exclusive lock on out/.lock for this process's lifetime: a second live process on the same
    folder (e.g. two --resume) is refused. Returns the open file (keep it referenced)."""
    handle = open(Path(out) / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SystemExit(
            f"{out} is in use by another live process (it holds {out}/.lock); wait for it to finish or stop it"
        ) from None
    return handle


def start_or_resume(run: Run, args):
    """Restore the newest intact checkpoint when resuming (metrics cut back to it), or clear the folder
    for --overwrite; remove this program's .tmp leftovers; write config.json; start the --report-to tracker.
    Returns (first iteration, state)."""
    state = (
        load_checkpoint(run.out, run.transformer, run.opt, args.lr, args.weight_decay, run.scaler)
        if args.resume
        else None
    )
    start = state.pop("iteration") + 1 if state else 0
    if args.resume and state is None:
        tqdm.write(f"{run.out} has no checkpoint yet: training starts at iteration 0")
    if run.acc.is_main_process:
        if args.overwrite:
            set_aside(run.out)  # nothing that predates the new run stays: what is not the old run's own is moved
            for name in RUN_OWN:
                shutil.rmtree(run.out / name) if (run.out / name).is_dir() else (run.out / name).unlink(missing_ok=True)
        for leftover in leftovers(run.out):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        config = {
            "args": asdict(args),
            "script": run.script,
            "run_id": run_id(run.out) if args.resume else uuid.uuid4().hex,  # in every checkpoint (save_checkpoint)
            "rewards": run.names,
            "processes": run.acc.num_processes,  # the global batch is processes x --prompts-per-iter groups
            "git_sha": git_sha(),
        }
        try:
            write_atomic(run.out / "config.json", json.dumps(config, indent=2))
            keep_metrics_until(run.out / "metrics.jsonl", start)
        except OSError as err:
            raise SystemExit(
                f"cannot write {run.out}/config.json or metrics.jsonl ({err.strerror}): is the disk full? No "
                "half-written file is left and no run data was lost; free space, then run the same command again"
            ) from None
    start_trackers(run, args)
    return start, {"opt_steps": 0, "level_stats": None, **(state or {})}


def run_id(out):
    """The id a run folder's config.json records, written once when the run starts and kept by --resume (a copy of the
    folder shares it): save_checkpoint writes it into each state.pt, so that evaluate.py knows a checkpoint of another
    run. A run that predates it gets one at its next resume."""
    try:
        return json.loads((Path(out) / "config.json").read_text()).get("run_id") or uuid.uuid4().hex
    except (OSError, ValueError, AttributeError):
        return uuid.uuid4().hex


def run_identity(out):
    """{"run_id", "script"} of the run folder's config.json (None for what it lacks): what a checkpoint records of
    the run that wrote it."""
    try:
        config = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    return {"run_id": config.get("run_id"), "script": config.get("script")}


RUN_OWN = (  # what a run writes in its folder (its figures: FIGURES), deleted by --overwrite
    "config.json",
    "tensorboard",
    "metrics.jsonl",
    "checkpoints",
    "rewards.png",
    "credit.png",
    "directions.png",
    "samples.png",
)


def not_the_runs_own(out):
    """What --overwrite moves out of a run folder rather than delete: every entry but the run's own files (RUN_OWN),
    its lock, run_folder's write probes and this program's half-written leftovers (evaluate.py's results, a user's
    notes)."""
    out, ours = Path(out), set(leftovers(out))
    return sorted(
        p
        for p in out.iterdir()
        if p.name not in RUN_OWN and p.name != ".lock" and not p.name.startswith(".write_test.") and p not in ours
    )


def set_aside_folder(out):
    """Where --overwrite moves what is not the replaced run's own: <out>.set-aside beside the run folder (-2, -3, ...
    when taken)."""
    names = (f"{Path(out).name}.set-aside" + (f"-{i}" if i > 1 else "") for i in range(1, 10**6))
    return next(p for p in map(Path(out).with_name, names) if not p.exists())


def set_aside(out):
    """--overwrite: move not_the_runs_own(out) into a new set_aside_folder (renames, nothing copied or deleted) and say
    so. Returns that folder, or None when there was nothing to move."""
    entries = not_the_runs_own(out)
    if not entries:
        return None
    aside = set_aside_folder(out)
    aside.mkdir()
    for p in entries:
        os.replace(p, aside / p.name)
    names = ", ".join(p.name for p in entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    tqdm.write(f"--overwrite: {names} (not the replaced run's own) moved to {aside}")
    return aside


def write_atomic(path, text):
    """path holds `text`, or, when the write fails (OSError: a full disk), what it held before and no .tmp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def leftovers(out):
    """The half-written files a kill can leave in a run folder: write_atomic's, save_atomic's (figures) and
    save_checkpoint's .tmp names (nothing else is ever deleted: a user's own *.tmp files stay)."""
    out, ckpts = Path(out), Path(out) / "checkpoints"
    figures = [out / f"{name}.png.tmp" for name in FIGURES]
    ours = [out / "config.json.tmp", out / "metrics.jsonl.tmp", *figures, ckpts / "latest.tmp"]
    ours += ckpts.glob("iter_??????.tmp")
    return [p for p in ours if p.exists()]


def metrics_lines(path):
    """(iteration, line) of each line of a metrics.jsonl. A last line that does not decode is a write a kill cut
    short and is left out; a damaged line before the last is not ours to drop: SystemExit naming it and the fix."""
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((int(json.loads(line)["iteration"]), line))
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise SystemExit(
                    f"{path}: line {number} of {len(lines)} is damaged ({line[:40]!r}...); a resume would lose it. "
                    "Repair or delete that line, then --resume again"
                ) from None
    return rows


def keep_metrics_until(path, start):
    """On resume, keep the metric lines of iterations before `start` (later ones will be redone); a partial last
    line (a kill or a full disk mid-write) is dropped (metrics_lines)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for it, line in metrics_lines(path) if it < start))


def git_sha():
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


# =============================================================================
# Checkpoints (atomic)
# =============================================================================


def save_checkpoint(out, iteration, transformer, opt, state, keep=2, scaler=None):
    """checkpoints/iter_N/: the "default" LoRA in diffusers' format with its LoraConfig as metadata, so that
    pipe.load_lora_weights("<run>/checkpoints/iter_N") gives the trained model exactly (without the metadata
    diffusers takes lora_alpha = r, a wrong scale unless alpha = r); iter_N/ema the EMA with --ema; and state.pt
    (every adapter, optimizer, the gradient scaler's state with --mixed-precision fp16, level statistics,
    optimizer-step count, iteration, and the run that wrote it: run_identity). Written to a .tmp folder,
    renamed, then `latest` is replaced atomically: a kill at any moment leaves the last good one.
    Keeps this checkpoint and the newest keep - 1 earlier ones (keep=0: every earlier one); a later one (left by a run
    resumed from an earlier checkpoint) goes. Refuses to write non-finite weights."""
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict

    lora = {a: get_peft_model_state_dict(transformer, adapter_name=a) for a in transformer.peft_config}
    bad = [k for sd in lora.values() for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise SystemExit(
            f"non-finite LoRA weights ({bad[0]}, {len(bad)} tensors) at iteration {iteration}: not saved; "
            f"the last good checkpoint in {out}/checkpoints is kept"
        )
    root = out / "checkpoints"
    final, tmp = root / f"iter_{iteration:06d}", root / f"iter_{iteration:06d}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for adapter, folder in (("default", tmp), ("ema", tmp / "ema")):  # ema: DiffusionNFT's evaluation weights
            if adapter in lora:  # the adapter's config (rank, alpha, targets) in the file: loaders scale as trained
                StableDiffusion3Pipeline.save_lora_weights(
                    folder,
                    transformer_lora_layers=lora[adapter],
                    transformer_lora_adapter_metadata=transformer.peft_config[adapter].to_dict(),
                )
        scaled = {"scaler": scaler.state_dict()} if scaler is not None else {}  # DiffusionNFT's scaler.pt
        torch.save(
            {
                "iteration": iteration,
                "lora": lora,
                "optimizer": opt.state_dict(),
                **scaled,
                **state,
                "run": run_identity(out),
            },
            tmp / "state.pt",
        )
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"writing the checkpoint of iteration {iteration} failed ({err}); is the disk full? "
            f"The last good checkpoint in {root} is kept; free space, then continue with --resume {out}"
        ) from None
    earlier = sorted(p for p in root.glob("iter_??????") if p.name < final.name)
    later = [p for p in root.glob("iter_??????") if p.name > final.name]
    for old in later + (earlier[: max(0, len(earlier) - keep + 1)] if keep else []):
        shutil.rmtree(old, ignore_errors=True)


def model_after_a_move(saved, given, folder):
    """--resume: a run's saved --model that is an absolute path no longer there. The embedded model (its folder
    moved with the project) is the same model at its new place: the run goes on with it, says so, and accepts
    --model naming it; any other is refused with the fix. Returns the saved args, model updated."""
    model = saved.get("model") or ""
    if not Path(model).is_absolute() or Path(model).exists():
        return saved  # still there, or a hub id
    if Path(model).parts[-2:] == Path(EMBEDDED_MODEL).parts[-2:] and is_embedded(given.get("model", EMBEDDED_MODEL)):
        tqdm.write(
            f"the run's model {model} is gone (the project folder moved?): resuming with the same embedded model at "
            f"{EMBEDDED_MODEL}"
        )
        given["model"] = EMBEDDED_MODEL
        return {**saved, "model": EMBEDDED_MODEL}
    raise SystemExit(
        f"--resume {folder}: the run's model {model} no longer exists. If it moved, write its new place as "
        f'"model" under "args" in {folder}/config.json (the LoRA fits only the model it was trained on), then '
        "--resume again"
    )


def check_checkpoints_are_there(out):
    """--resume, before anything loads: refuse (nothing changed) when out/checkpoints is a link to nothing or not a
    folder, or holds no checkpoint although metrics.jsonl shows one was written (a line of an iteration that saved,
    by config.json's --save-every, followed by a later line): starting over at iteration 0 would replace those
    metrics. A run stopped before its first checkpoint still starts at iteration 0."""
    root = out / "checkpoints"
    if root.is_symlink() and not root.exists():
        raise SystemExit(
            f"--resume {out}: {root} is a link to {os.readlink(root)}, which does not exist (moved or unmounted?). "
            "Make the link point at the run's checkpoints, then --resume again; nothing was changed"
        )
    if root.exists() and not root.is_dir():
        raise SystemExit(f"--resume {out}: {root} is not a folder; move that file away, then --resume again")
    if root.is_dir() and any(root.glob("iter_??????")):
        return
    try:
        save_every = int(json.loads((out / "config.json").read_text())["args"]["save_every"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no readable record: parse_flags has already named the problem
    its = [it for it, _ in metrics_lines(out / "metrics.jsonl")]
    saved = [it for it in its if (it + 1) % max(save_every, 1) == 0 and it < max(its)]
    if saved:
        raise SystemExit(
            f"--resume {out}: metrics.jsonl records iterations up to {max(its)} and a checkpoint written at iteration "
            f"{saved[-1]}, but {root} holds no checkpoint (moved or deleted?). Put the run's checkpoints back in "
            f"{root}, then --resume again; nothing was changed. To train from the start instead, start a new run "
            "with --out"
        )


def load_checkpoint(out, transformer, opt, lr, weight_decay, scaler=None):
    """Restore the newest intact checkpoint of a run folder (the one `latest` names, else the newest
    iter_N whose state.pt loads; says so when it falls back); the optimizer then takes this run's lr and
    weight decay (its saved moments are kept); `scaler` (--mixed-precision fp16) its saved scale and growth count,
    or its initial ones when the checkpoint has none (said). Returns its state dict, None when the run has no
    checkpoint yet; SystemExit, with nothing changed, when it has checkpoints and none loads."""
    from peft.utils import set_peft_model_state_dict

    root = out / "checkpoints"
    latest = root / "latest"
    named = root / latest.read_text().strip() if latest.is_file() else None
    candidates = ([named] if named else []) + sorted((p for p in root.glob("iter_??????") if p != named), reverse=True)
    for ckpt in candidates:
        try:
            state = torch.load(ckpt / "state.pt", weights_only=False)
        except Exception as err:  # missing, truncated or corrupt: try the next older one
            tqdm.write(f"checkpoint {ckpt} is not loadable ({type(err).__name__}); trying an older one")
            continue
        if ckpt != named:
            tqdm.write(f"resuming from {ckpt.name}, the newest intact checkpoint")
        lora = state.pop("lora")
        for adapter, sd in lora.items():
            if adapter in transformer.peft_config:
                set_peft_model_state_dict(transformer, sd, adapter_name=adapter)
        if "ema" in transformer.peft_config and "ema" not in lora:  # --ema switched on at resume: start it here
            copy_adapter(transformer, "default", "ema")
        opt.load_state_dict(state.pop("optimizer"))
        scaled = state.pop("scaler", None)
        if scaler is not None and scaled:
            scaler.load_state_dict(scaled)
        elif scaler is not None:
            tqdm.write(f"{ckpt.name} holds no gradient scaler state: the loss scale starts at {scaler.get_scale():g}")
        for group in opt.param_groups:  # the saved groups hold the old run's values: --lr / --weight-decay apply
            group.update(lr=lr, weight_decay=weight_decay)
        transformer.set_adapter("default")
        return state
    if candidates:
        raise SystemExit(
            f"--resume {out}: none of its checkpoints loads ({', '.join(p.name for p in candidates)}); nothing was "
            "changed. Their LoRA files (pytorch_lora_weights.safetensors) may still load in diffusers; to train "
            "again, start a new run"
        )
    return None


# =============================================================================
# Trackers and figures
# =============================================================================


def start_trackers(run: Run, args):
    """--report-to tensorboard | wandb: accelerate's tracker, started with the run's flags (TensorBoard: event files
    in <run>/tensorboard; W&B: a run named after the run folder, in project <script>). Nothing for none."""
    if args.report_to == "none":
        return
    wandb = {"wandb": {"name": run.out.name, "dir": str(run.out)}}
    name, kwargs = ("tensorboard", {}) if args.report_to == "tensorboard" else (run.script, wandb)
    run.acc.init_trackers(name, config=asdict(args), init_kwargs=kwargs)


def log_to_trackers(acc, metrics, step, names=None):
    """The metrics line's numbers and strings to the --report-to tracker under the same keys (lists such as D stay in
    metrics.jsonl); W (K, T) also as an image, credit.png's W panel (`W_figure`: relative to the uniform share, rows
    named by `names`), when W is in the line and names are given."""
    if not acc.trackers:
        return
    acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}, step=step)
    if "recast/W" in metrics and names:
        import matplotlib.pyplot as plt

        fig = W_figure(np.asarray(metrics["recast/W"]), names)
        fig.canvas.draw()
        log_images(acc, {"recast/W": np.asarray(fig.canvas.buffer_rgba())[..., :3]}, step)
        plt.close(fig)


def log_images(acc, images, step):
    """{tag: image} to the --report-to tracker (TensorBoard's image tab, W&B's media); an image is an (H, W, 3) array
    in [0, 1] or uint8, or the path of a PNG."""
    from PIL import Image

    for tag, image in images.items():
        image = np.asarray(Image.open(image).convert("RGB")) if isinstance(image, (str, Path)) else image
        for tracker in acc.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({tag: image[None]}, step, dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({tag: [image]}, step)


def show_evaluation(run: Run, it, evaluated, state):
    """An evaluation's figures (main process), drawn while the run goes on: samples.png (the first SHOWN held-out
    samples of the first evaluation above this one's, each with its budget-weighted reward and prompt), the run's
    figures (`plot_run`), all logged as images to the --report-to tracker at step `it` (None: the first evaluation,
    before any update, logged as eval_before/samples)."""
    _, images, R = evaluated
    before = state.get("samples_before")  # a resume with other --eval-prompts: no before row
    rows = [("before", before)] if before is not None and len(before[1]) == len(images) else []
    if it is not None:
        rows.append((f"iteration {it}", (np.stack([np.asarray(im.convert("RGB")) for im in images]), R[: len(images)])))
    save_samples(run.out / "samples.png", run.eval_prompts[: len(images)], rows, run.budgets)
    if it is None:
        return log_images(run.acc, {"eval_before/samples": run.out / "samples.png"}, 0)
    figures = plot_run(run.out, run.names)
    log_images(run.acc, {"eval/samples": run.out / "samples.png", **{f"figures/{p.stem}": p for p in figures}}, it)


def save_samples(path, prompts, rows, budgets, cols=8):
    """The held-out samples as a grid: for each `cols` prompts one row per entry of rows [(label, (images (P, H, W, 3)
    uint8, R (P, K)))], each image captioned with its label, its budget-weighted reward and its prompt."""
    from PIL import Image

    cols = min(cols, len(prompts))
    blank = Image.new("RGB", rows[0][1][0].shape[1::-1], "white")
    images, captions = [], []
    for first in range(0, len(prompts), cols):
        chunk = range(first, min(first + cols, len(prompts)))
        for label, (pixels, R) in rows:
            weighted = budget_mean(np.asarray(R).T, budgets)  # (P,)
            images += [Image.fromarray(pixels[i]) for i in chunk] + [blank] * (cols - len(chunk))
            captions += [f"{label}: {weighted[i]:.3f}. {prompts[i]}" for i in chunk] + [""] * (cols - len(chunk))
    save_grid(images, path, captions, cols=cols)


def save_grid(images, path, prompts=(), cols=8, cell=128):
    """The images in rows of `cols`, each upscaled (nearest) to at least `cell` px wide, with its prompt written
    under it (wrapped to the image's width). Returns the grid (PIL)."""
    from PIL import Image, ImageDraw, ImageFont

    scale = max(1, -(-cell // images[0].size[0]))  # ceil: small images grow to at least `cell` px
    w, h = images[0].size[0] * scale, images[0].size[1] * scale
    font = ImageFont.load_default(size=max(10, w // 12))
    draw = ImageDraw.Draw(Image.new("RGB", (w, h)))
    captions = [wrap_text(draw, text, font, w - 4) for text in list(prompts) + [""] * (len(images) - len(prompts))]
    line = font.getbbox("Ag")[3] + 2
    text_h = line * max(len(c) for c in captions) + 4
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * (h + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, caption) in enumerate(zip(images, captions)):
        x, y = (i % cols) * w, (i // cols) * (h + text_h)
        grid.paste(im.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        for k, text in enumerate(caption):
            draw.text((x + 2, y + h + 2 + k * line), text, fill="black", font=font)
    save_atomic(path, lambda tmp: grid.save(tmp, format="PNG"))
    return grid


def save_atomic(path, write):
    """write(tmp) to path + ".tmp", then rename it to path: a kill or a full disk mid-write leaves the old file (or
    none), never a truncated or empty one; the .tmp of a failed write is removed (a kill's by the next start)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise SystemExit(
                f"cannot write {path} ({err.strerror or err}): is the disk full? The run's metrics and checkpoints "
                f"are kept; free space, then --resume {path.parent} (it draws the figure again)"
            ) from None
        raise


def wrap_text(draw, text, font, width):
    """Lines of `text` (words kept whole) that fit in `width` px with `font`."""
    lines = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


FIGURES = ("rewards", "credit", "directions", "samples")  # the PNGs of a run folder


def plot_run(out, names):
    """The run's figures from metrics.jsonl, drawn at every evaluation and at the end; returns their paths.
    rewards.png: the training rewards per iteration; the held-out rewards (eval/*) and each held-out judge on an axis
    of its own (their units differ: the CNN's 0-1, Fréchet's hundreds) per evaluation, at the number of iterations
    trained (0: eval_before/*, the pretrained model; the evaluation logged with iteration i: i + 1).
    credit.png (recast.py but for --credit nft, whose one combined reward W plays no part in, and rvge.py with --credit
    recast: wherever W is ReCAST's or its control's): the last W relative to each
    reward's uniform share, W_kj / (lambda_k / T) (lambda_k c_j / Lam with unequal column sums c_j; 1 everywhere: the
    uniform W); D_k(t), measured levels +- 2 se and
    the monotone fit, with each reward's evidence factor; and the profiles W was solved from, after the evidence
    shrinkage (identical profiles give the uniform W).
    directions.png (rvge.py): per regressed reward, along the run, its bandwidth (local or broad), the direction's
    size (rms) and the split-half cosine of its direction (rvge/*)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for _, line in metrics_lines(out / "metrics.jsonl")]
    if not rows:
        return []
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    its, drawn = [m["iteration"] for m in rows], []

    def save(fig, name):
        drawn.append(out / f"{name}.png")
        save_atomic(drawn[-1], lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))

    evals = (
        [(0, {k.replace("eval_before/", "eval/"): v for k, v in rows[0].items() if k.startswith("eval_before/")})]
        if "eval_before/weighted" in rows[0]  # not its eval/*: iteration 0's own evaluation, when it has one
        else []
    ) + [(m["iteration"] + 1, m) for m in rows if "eval/weighted" in m]
    judges = sorted({k for _, m in evals for k in m if k.startswith("eval/judge/")})  # each on its own axis: units
    panels = (2 if evals else 1) + len(judges)
    fig, axes = plt.subplots(1, panels, figsize=(16 / 3 * max(panels, 3), 3.6), squeeze=False)
    for n in names + ["weighted"]:
        axes[0, 0].plot(its, [m[f"reward/{n}"] for m in rows], label=n)
        if evals:
            axes[0, 1].plot([i for i, _ in evals], [m[f"eval/{n}"] for _, m in evals], marker=".", label=n)
    for a, key in zip(axes[0, 2:], judges):
        name = key.removeprefix("eval/judge/")
        a.plot([i for i, m in evals if key in m], [m[key] for _, m in evals if key in m], marker=".", label=name)
        a.set(title=f"held-out judge {name} ({key})")
    axes[0, 0].set(title="training rewards", xlabel="iteration (as in metrics.jsonl)")
    for a in axes[0, 1:]:
        a.set(xlabel="iterations trained (0: pretrained)")
    if evals:
        axes[0, 1].set(title="held-out rewards (eval/*)")
    for a in axes[0]:
        a.legend(fontsize=7)
    save(fig, "rewards")
    last, sig = rows[-1], np.array(rows[-1].get("recast/sigmas", []))
    script, credit = config.get("script", "recast"), config.get("args", {}).get("credit", "recast")
    if "recast/W" in last and (credit != "nft" if script == "recast" else credit == "recast"):  # nft: W plays no part
        fig, axes = plt.subplots(1, 3, figsize=(16, 3.6), gridspec_kw={"wspace": 0.35})
        draw_W(fig, axes[0], np.array(last["recast/W"]), names)
        D_meas, D_se = np.array(last["recast/D_measured"]), np.array(last["recast/D_se"])  # -1: level not measured
        profile = np.array(last.get("recast/profile", last["recast/gains"]))
        for k, n in enumerate(names):
            (line,) = axes[1].plot(
                sig, np.array(last["recast/D"])[k], label=f"{n} (evidence {last['recast/evidence'][k]:.2f})"
            )
            ok = D_se[k] >= 0
            axes[1].errorbar(
                sig[ok], D_meas[k, ok], yerr=2 * D_se[k, ok], fmt="o", ms=3, capsize=2, color=line.get_color()
            )
            axes[2].plot(sig[:-1], profile[k], marker=".", label=n)
        axes[1].set(xlabel="t", ylabel="D_k(t)", title="Renyi discriminability: levels +- 2 se, monotone fit")
        axes[2].set(
            xlabel="t at step start",
            ylabel="share of the reward's gain",
            title="profiles W is solved from (after the evidence shrinkage)",
        )
        for a in axes[1:]:
            a.invert_xaxis()
            a.legend(fontsize=7)
        save(fig, "credit")
    regressed = [k.removeprefix("rvge/bandwidth/") for k in last if k.startswith("rvge/bandwidth/")]
    if regressed:
        fig, axes = plt.subplots(1, 3, figsize=(16, 3.6), gridspec_kw={"wspace": 0.3})
        for n in regressed:
            axes[0].plot(its, [m[f"rvge/bandwidth/{n}"] for m in rows], marker=".", label=n)
            axes[1].plot(its, [m[f"rvge/direction_rms/{n}"] for m in rows], label=n)
            axes[2].plot(its, [m[f"rvge/split_cos/{n}"] for m in rows], label=n)
        titles = ["bandwidth (regression groups)", "direction size (rms)", "split-half cosine of the direction"]
        for a, title in zip(axes, titles):
            a.set(xlabel="iteration", title=title)
            a.legend(fontsize=7)
        save(fig, "directions")
    plt.close("all")
    return drawn


def draw_W(fig, ax, W, names):
    """W (K, T) on ax as credit.png shows it: W_kj / uniform share (uniform_share; 1: uniform), blue below, red
    above, one row per reward (named), one column per step j, with its colour bar."""
    import matplotlib

    share = uniform_share(W)
    ratio = np.divide(W, share, out=np.ones_like(W), where=share > 0)
    norm = matplotlib.colors.TwoSlopeNorm(vcenter=1.0, vmin=min(ratio.min(), 0.5), vmax=max(ratio.max(), 2.0))
    im = ax.imshow(ratio, aspect="auto", cmap="RdBu_r", norm=norm)
    ax.set(
        yticks=range(len(names)),
        yticklabels=names,
        xlabel="step j (t = sigma_j)",
        title="W / uniform share (1: uniform)",
    )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.colorbar(im, ax=ax)


def W_figure(W, names):
    """The figure of W alone (`draw_W`), as the --report-to tracker shows it every iteration (recast/W)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 1.4 + 0.3 * len(names)), layout="constrained")
    draw_W(fig, ax, W, names)
    return fig


def uniform_share(W):
    """The uniform W with W's marginals, lambda_k c_j / Lam (K, T): lambda_k / T when the columns are equal, the
    reference W is read against in credit.png and the closing summary."""
    return np.outer(W.sum(1), W.sum(0)) / W.sum()


def sampling_line(args, embedded):
    """The line of Python, after the loading line, that samples the trained model with the settings it was trained
    and evaluated with, not the pipeline's defaults: no CFG (guidance_scale 1.0: DiffusionNFT trains and evaluates
    CFG-free), the evaluation's Euler steps (--eval-steps, else --steps; 40 in the SD3.5-M recipes), the T5 tokens
    of its text conditioning (128, DiffusionNFT's; the embedded model's 10) and its resolution, as load_run chooses
    them; on the first held-out prompt. On the embedded model's defaults these are shapes_world.GEN_KWARGS."""
    gen = shapes_world.GEN_KWARGS if embedded else {}
    steps = args.get("eval_steps") or args["steps"]
    tokens = args.get("max_sequence_length") or gen.get("max_sequence_length", 128)
    res = args.get("resolution") or gen.get("height", 512)
    try:
        prompt = read_prompts(args["eval_prompts"])[0] if args.get("eval_prompts") else None
    except SystemExit:
        prompt = None
    prompt = prompt or (shapes_world.sample_prompts(1, "heldout", 0)[0] if embedded else "a photo of a cat")
    kwargs = dict(height=res, width=res, num_inference_steps=steps, guidance_scale=1.0, max_sequence_length=tokens)
    known = " (shapes_world.GEN_KWARGS)" if embedded and kwargs == gen else ""
    return (
        f"  image = pipe({prompt!r}, {', '.join(f'{k}={v}' for k, v in kwargs.items())}).images[0]  # as trained and "
        f"evaluated{known}: no CFG, {steps} steps, {tokens} T5 tokens, {res} px"
    )


def print_summary(out):
    """The closing lines of a run on the console (first process, after the progress bar), from its config.json and
    metrics.jsonl: the held-out evaluation before -> after per reward, weighted and judge (eval_before/*, logged
    with iteration 0, and the last eval/*, after iteration i: i + 1 trained); for ReCAST's credit, W's departure from
    uniform per reward, max_j |W_kj / (lambda_k / T) - 1| (0: W = lambda / T; with --column-units gradient the
    uniform share is lambda_k c_j / Lam); the run folder; the checkpoint to load, the line of Python that loads it
    (kit/README.md's) and one that samples as the run did (`sampling_line`). Returns the lines printed."""
    config = json.loads((out / "config.json").read_text())
    args, rows = config["args"], [json.loads(line) for _, line in metrics_lines(out / "metrics.jsonl")]
    lines = []
    after = next((m for m in reversed(rows) if "eval/weighted" in m), None)
    before = next((m for m in rows if "eval_before/weighted" in m), {})
    if after:
        fix = "" if before else " (no evaluation of the pretrained model in this run: after only)"
        it = after["iteration"]  # 0-based, as metrics.jsonl, checkpoints/iter_N and the figures' captions count
        lines.append(f"held-out evaluation, pretrained -> after iteration {it} ({it + 1} trained){fix}:")
        for key, value in after.items():
            if key.startswith("eval/") and isinstance(value, (int, float)):
                was = before.get(key.replace("eval/", "eval_before/"))
                change = f"{was:9.4f} -> {value:9.4f}   ({value - was:+.4f})" if was is not None else f"{value:9.4f}"
                lines.append(f"  {key[5:]:<24} {change}")
    else:
        lines.append("held-out evaluation: none in this run (--eval-every 0, or no held-out prompts)")
    if config["script"] == "recast" and args.get("credit", "").startswith("recast") and rows and "recast/W" in rows[-1]:
        W = np.asarray(rows[-1]["recast/W"])  # (K, T)
        departure = np.abs(W / uniform_share(W) - 1).max(1)
        each = ", ".join(f"{n} {d:.3f}" for n, d in zip(config["rewards"], departure))
        lines.append(f"W's departure from uniform, max_j |W_kj / (lambda_k / T) - 1| (0: uniform): {each}")
    lines.append(f"run folder: {out}")
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        folder = out / "checkpoints" / latest.read_text().strip() / ("ema" if args.get("ema") else "")
        embedded = is_embedded(args["model"])
        local = ", local_files_only=True" if embedded else ""
        lines.append(f"trained LoRA{' (its EMA, as evaluated)' if args.get('ema') else ''}: {folder}")
        lines.append(  # kit/README.md's lines: the transformer's LoRA only, so diffusers logs no text-encoder notice
            f'  pipe = StableDiffusion3Pipeline.from_pretrained("{args["model"]}"{local}); '
            f'pipe.transformer.load_lora_adapter("{folder}", prefix="transformer", '
            'weight_name="pytorch_lora_weights.safetensors")'
        )
        lines.append(sampling_line(args, embedded))
    print("\n".join(lines))
    return lines
