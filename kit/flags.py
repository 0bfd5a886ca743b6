"""Flags: an Args dataclass -> argparse with --help sections; --config files; --resume's saved config.

RunArgs holds the flags every script takes (evaluation, I/O, reward models, the experiments' controls); nft.NFTArgs
DiffusionNFT's; each script's Args inherits both and adds its method's. `flag` (nft.py) declares a field: its default,
its --help section, its range checks; the string under a field is its --help line (`field_docs`)."""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from tqdm import tqdm

from kit.reward_models import DEFAULTS, REWARD_MODELS
from kit.worlds import EMBEDDED_MODEL, is_embedded, load_world
from nft import flag


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
    "trackers": "what --report-to logs beside metrics.jsonl: the W&B project and run, rollout images",
    "reward models": "weights and servers of the real reward models (defaults in reward_models.DEFAULTS)",
    "controls": "the experiments' controls: runs that could prove a method wrong, not for training a model",
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
    """the preflight, no GPU, nothing downloaded: every check the launch makes before the model loads (model access,
    prompt files, reward weights, GenEval's server), the run's arithmetic, SD3.5-Medium's memory per GPU (on the meta
    device) and its time at a stated MFU; exits non-zero naming every failure"""
    num_processes: int = flag(0, "I/O", min=0)
    """processes (GPUs) the run is planned for, each drawing --prompts-per-iter prompt groups (every SD3.5-M recipe: 8,
    so 48 groups per iteration); a launch of another count says which global batch it keeps and which it loses, and
    --dry-run plans for this count (0: the launch's own, WORLD_SIZE, else 1)"""
    allow_embedded_defaults: bool = flag(False, "I/O")
    """let a model other than the embedded one train with the defaults of --lr, --base-reg, --updates-per-iter,
    --train-steps-per-leaf, --ema and --mixed-precision, which are the embedded model's; without it such a run takes
    them from a recipe (configs/*.yaml) or the command line"""
    report_to: str = flag("none", "I/O", choices=["none", "tensorboard", "wandb"])
    """also log the metrics' numbers and strings, under the same keys, through accelerate's trackers: TensorBoard
    (event files in <run>/tensorboard, W as an image) or Weights & Biases (files in <run>/wandb); needs that package:
    pip install -r configs/requirements-extras.txt"""
    # trackers
    tracker_project: str = flag("", "trackers")
    """W&B project (default: the script's name, recast or rvge)"""
    tracker_run_name: str = flag("", "trackers")
    """W&B run name (default: the run folder's name); --resume continues the same W&B run (its id is kept in
    <run>/wandb/run.json)"""
    log_rollouts_every: int = flag(10, "trackers", min=0)
    """log the images of the first 15 rollouts of every Nth iteration to the --report-to tracker, each with its
    weighted reward and prompt (rollout/samples; DiffusionNFT: every 10 epochs); 0: never"""
    # reward models
    pickscore_model: str = flag(DEFAULTS["pickscore_model"], "reward models")
    """PickScore weights"""
    pickscore_processor: str = flag(DEFAULTS["pickscore_processor"], "reward models")
    """PickScore processor"""
    clip_model: str = flag(DEFAULTS["clip_model"], "reward models")
    """CLIP for clipscore and the aesthetic predictor"""
    aesthetic_mlp: str = flag(DEFAULTS["aesthetic_mlp"] or "", "reward models")
    """aesthetic MLP weights file (LAION improved aesthetic predictor)"""
    hpsv2_checkpoint: str = flag(DEFAULTS["hpsv2_checkpoint"] or "", "reward models")
    """HPSv2 weights file (HPS_v2.1_compressed.pt, an open_clip state dict; loaded into transformers' CLIP)"""
    hpsv2_config: str = flag(DEFAULTS["hpsv2_config"], "reward models")
    """HPSv2's architecture and tokenizer: a transformers CLIP ViT-H-14 (its config and tokenizer only)"""
    geneval_url: str = flag(DEFAULTS["geneval_url"], "reward models")
    """GenEval reward server address (FlowGRPO's reward-server protocol)"""
    geneval_metadata: str = flag(DEFAULTS["geneval_metadata"] or "", "reward models")
    """JSONL of GenEval metadata per prompt (FlowGRPO's dataset/geneval format)"""
    geneval_key: str = flag(DEFAULTS["geneval_key"], "reward models")
    """GenEval reply field used as the reward: scores (partial credit), strict_rewards (0/1)"""
    # controls
    permute_rewards: str = flag("", "controls")
    """the permuted-reward control: these rewards' training scores (comma-separated names from --rewards) are shuffled
    among the leaves of each prompt group, so they keep their values but no longer belong to the images; held-out
    evaluation scores the true rewards"""


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
        epilog=help_epilog(),
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


def help_epilog():
    """--help's last lines: the reward names (the real models', the embedded model's world's), then examples
    (%(prog)s: the script)."""
    world = load_world(EMBEDDED_MODEL)
    return "\n".join(
        [
            "rewards (--rewards, comma-separated, one budget each):",
            textwrap.fill(
                f"real models: {', '.join(sorted(REWARD_MODELS))} (kit/reward_models.py)",
                79,
                initial_indent="  ",
                subsequent_indent="    ",
            ),
            textwrap.fill(
                f"embedded model: {', '.join(world.DEFAULT_REWARDS)} (its defaults); also "
                f"{', '.join(sorted(set(world.REWARDS) - set(world.DEFAULT_REWARDS)))} "
                f"({world.__name__})",
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
            "  python %(prog)s --config configs/FILE.yaml --dry-run  # preflight: checks, batch, memory, time",
            "  accelerate launch --multi_gpu --num_processes 8 %(prog)s --config configs/FILE.yaml",
        ]
    )


# Refused on --resume when they differ from the saved run, with those a script adds (`parse_flags`'s fixed: its
# method's, such as --credit): a checkpoint is only valid with the first five; --permute-rewards says what the run is (a
# control), and config.json records one value for the whole run. Every other flag applies from the resumed iteration
# on (the optimizer takes --lr, --weight-decay). A run's config.json that predates a flag ran with its default.
FIXED_ON_RESUME = ("model", "rewards", "steps", "lora_rank", "lora_alpha", "permute_rewards")


def resume_value(name, value, paths=()):
    """A setting as --resume compares it: --permute-rewards as its set of names (order and spaces aside); a flag of
    `paths` (a file a script records absolute when its run starts) as an absolute path, so that the same file given
    relative to this folder is the same setting."""
    if name == "permute_rewards" and isinstance(value, str):
        return sorted({n.strip() for n in value.split(",") if n.strip()})
    if name in paths and isinstance(value, str) and value:
        return os.path.abspath(value)
    return value


def shown_setting(name, value, model):
    """A setting as a --resume refusal names it: its repr, and for an empty --rewards the rewards it stands for (the
    embedded world's defaults)."""
    if name == "rewards" and isinstance(value, str) and not value.strip() and is_embedded(model):
        return f"{value!r} (the default: {','.join(load_world(model).DEFAULT_REWARDS)})"
    return repr(value)


NOT_ON_RESUME = ("name", "overwrite")  # they choose or replace a run folder; --resume continues its own


def parse_flags(argv, Args, groups, doc, script, fixed=(), paths=()):
    """A script's Args (the class; `groups` and `doc` as make_parser's) from the command line. With --resume DIR the
    settings come from DIR/config.json and flags given now override them, except FIXED_ON_RESUME and the script's
    `fixed` (refused with both values named; those of `paths`, files, compared as absolute paths); the run must be
    one of `script`'s; the run folder is DIR itself, wherever it lies now. With
    --config FILE the file's values replace the defaults and flags given on the command line override them."""
    argv = dash_values(argv, Args)
    parser = make_parser(Args, groups, doc)
    config = vars(parser.parse_args(argv)).get("config")
    from_file = read_config_file(config, Args, script) if config is not None else {}
    parser.set_defaults(**from_file)
    args = Args(**{k: v for k, v in vars(parser.parse_args(argv)).items() if k != "config"})
    if not args.resume:
        given = set(vars(make_parser(Args, groups, doc, suppress=True).parse_args(argv)))
        check_recipe(args, given | set(from_file))
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
    model = saved.get("model", defaults["model"])
    changed = [
        f"--{k.replace('_', '-')}: saved {shown_setting(k, saved.get(k, defaults.get(k)), model)}, "
        f"given {shown_setting(k, given[k], model)}"
        for k in (*FIXED_ON_RESUME, *fixed)
        if k in given and resume_value(k, given[k], paths) != resume_value(k, saved.get(k, defaults.get(k)), paths)
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


DIFFUSIONNFT = Path(__file__).parents[1] / "configs" / "reference" / "diffusionnft.yaml"  # its SD3.5-M values


def diffusionnft_values(steps):
    """DiffusionNFT's values (DIFFUSIONNFT's `all`, one optimizer step per epoch, int(steps x 0.99) timesteps per
    image) of the flags whose defaults are the embedded model's: {flag name: value}."""
    ref = yaml.safe_load(DIFFUSIONNFT.read_text())["all"]
    return {
        "lr": ref["lr"],
        "base_reg": ref["base-reg"],
        "updates_per_iter": 1,
        "train_steps_per_leaf": int(steps * ref["timestep-fraction"]),
        "ema": ref["ema"],
        "mixed_precision": ref["mixed-precision"],
    }


def needs_a_recipe(model):
    """Whether `model` is SD3.5-Medium-scale, whose runs take DiffusionNFT's values rather than the embedded model's
    defaults: a hub id, or a diffusers folder whose transformer has SD3.5-Medium's depth and width (the tests' tiny
    pipelines do not)."""
    if is_embedded(model):
        return False
    if not Path(model).exists():
        return not model.startswith((".", "/", "~")) and model.count("/") == 1  # a hub id; a bad path: check_common
    sd35m = json.loads((Path(__file__).parents[1] / "world/assets/sd3.5-medium-transformer.json").read_text())
    try:
        config = json.loads((Path(model) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    keys = ("num_layers", "num_attention_heads", "attention_head_dim")
    return all(config.get(k) == sd35m[k] for k in keys)


def check_recipe(args, given):
    """A new run of an SD3.5-Medium-scale model (`needs_a_recipe`) whose optimisation flags the user left at the
    embedded model's defaults (lr 1e-4, --base-reg 0.1, 8 updates, 4 timesteps, no EMA, no fp16: not DiffusionNFT's)
    is refused, naming each flag with DiffusionNFT's value, the recipes and --allow-embedded-defaults. `given`: the
    flags given on the command line or by --config. A refusal rather than DiffusionNFT's values silently: those
    depend on the reward (b, the decay, 25 steps for the multi-reward run, 2 steps for OCR), which a recipe names."""
    if args.allow_embedded_defaults or not needs_a_recipe(args.model):
        return
    left = [
        f"--{k.replace('_', '-')} {getattr(args, k)} (DiffusionNFT: {v})"
        for k, v in diffusionnft_values(args.steps).items()
        if k not in given and getattr(args, k) != v
    ]
    if left:
        raise SystemExit(
            f"--model {args.model} would train with the embedded model's defaults: {', '.join(left)}. Start from a "
            "recipe, --config configs/nft-pickscore.yaml (or another configs/nft-*.yaml, recast-sd35m.yaml, "
            "rvge-sd35m.yaml; flags given override it), give these flags, or add --allow-embedded-defaults"
        )


def dash_values(argv, Args):
    """The command line (sys.argv's when argv is None) with `--flag -0.1,1.1` written `--flag=-0.1,1.1` where a flag
    that takes a value is followed by one that starts with a dash and a digit or a dot: argparse takes such a value
    for an option ("expected one argument"), so the flag's own check (a negative budget) never saw it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    valued = {"--" + f.name.replace("_", "-") for f in fields(Args) if f.type not in (bool, "bool")}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in valued and i + 1 < len(argv) and re.match(r"-[0-9.]", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def is_script(name):
    """Whether `name` is a training script of this project: <name>.py beside the kit, at the repository root
    (config.json's "script"; recast, rvge)."""
    return isinstance(name, str) and name.isidentifier() and (Path(__file__).parents[1] / f"{name}.py").is_file()


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
    if problem is None and not is_script(config.get("script")):
        problem = f'its "script" is {config.get("script")!r}, not a training script here (<script>.py at the root)'
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
    folder of its own); a byte-order mark is dropped. A `script` key (every recipe in configs/ has one) names the
    script the file is for: another script refuses it. Unknown keys, a key given twice (also one flag spelled with
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
    if "script" in data:  # a recipe names the script it is for (configs/*.yaml); a file without the key is not checked
        data = dict(data)
        named = data.pop("script")
        if not is_script(named):
            raise SystemExit(
                f"--config {path}: script {named!r} is not a training script here (recast, rvge). Fix the file"
            )
        if named != script:
            raise SystemExit(
                f"--config {path}: a recipe for {named}.py (its `script: {named}`); give it to {named}.py, or give "
                f"{script}.py a recipe of its own"
            )
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
