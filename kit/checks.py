"""The input checks every script makes before any model loads (ranges, device, model, budgets, rewards, prompt files,
the process count against the plan), the prompt files' readers, and the activation term of --dry-run's memory plan
(kit/preflight.py). Each refusal names the problem and the fix."""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kit.flags import check_ranges
from kit.records import metrics_lines
from kit.reward_models import REWARD_MODELS, missing_inputs, ocr_target
from kit.worlds import is_embedded, load_world, reward_extras


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


def warn_process_count(args):
    """A launch (WORLD_SIZE) of another process count than --num-processes (the recipe's plan) says, once, which
    global batch it keeps and which it loses (`process_count_note`): each process draws --prompts-per-iter
    prompt groups, so the count sets the batch of every iteration and optimizer step. --dry-run prints it with its
    arithmetic."""
    world = os.environ.get("WORLD_SIZE", "")
    if args.dry_run or not args.num_processes or not world.isdigit() or int(world) == args.num_processes:
        return
    if os.environ.get("RANK", "0") == "0":
        tqdm.write(process_count_note(args, int(world)))


def process_count_note(args, launched):
    """The global batch a launch of `launched` processes keeps and loses against --num-processes (the recipe's
    plan: each process draws --prompts-per-iter groups), and the flags that keep the planned one."""
    P, planned = args.prompts_per_iter, args.num_processes
    want, got = P * planned, P * launched
    change = f"loses {want - got} of them" if got < want else f"gains {got - want}"
    keep = (
        f"--prompts-per-iter {want // launched} --num-processes {launched}"
        if want % launched == 0
        else f"no whole --prompts-per-iter on {launched} processes ({want} / {launched}); launch a divisor of {want}"
    )
    return (
        f"the run is planned for --num-processes {planned} x --prompts-per-iter {P} = {want} prompt groups per "
        f"iteration; {launched} process(es) draw {got}: every iteration and optimizer step {change}. To keep {want}: "
        f"{keep}"
    )


def check_common(args, extra_rewards=None):
    """The checks both scripts make on the user's input, before any model is loaded or any file in a run folder
    changes: flag ranges, tracker, resolution, device, model, budgets and rewards (the reward models' weights, files
    and server there: reward_models.missing_inputs), branch steps. With --dry-run only those that need no GPU, no
    model and no reward model (the plan is made without them). Returns (reward names, budgets, branch steps). Raises
    SystemExit with the problem and the fix."""
    check_ranges(args)
    check_precision(args)
    check_report_to(args.report_to)
    check_launch()
    warn_process_count(args)
    if args.resolution % 16:
        raise SystemExit(
            f"--resolution {args.resolution}: SD3 needs a multiple of 16 (VAE 8 x patch 2), "
            "or 0 for the model's default"
        )
    device = args.device.split(":")[0]
    if device not in ("", "cpu", "cuda"):
        raise SystemExit(f"--device {args.device!r}: give cpu, cuda or cuda:N (or omit it: cuda when available)")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
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
    if args.rewards.strip() and not names:
        raise SystemExit(
            f"--rewards {args.rewards!r} names no reward: give comma-separated reward names, or omit --rewards for "
            "the model's defaults"
        )
    if not names:
        if not is_embedded(args.model):
            raise SystemExit("--rewards is required for this model, e.g. --rewards pickscore,clipscore,aesthetic,ocr")
        names = list(load_world(args.model).DEFAULT_REWARDS)
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
    if args.dry_run:  # the reward models' weights and servers are the run's to check
        return names, budgets, branch
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
    """The files a run reads, checked before any model loads (`file_problems`): SystemExit naming each file, its
    problem and the fix."""
    problems = file_problems(args, names)
    if problems:
        raise SystemExit("\n".join(problems))


def file_problems(args, names):
    """The problems of the files a run reads, one line each: prompt files (readable, >= 2 held-out prompts, the
    embedded world's held-out prompts inside its grammar, quoted text for the ocr reward) and, on --resume, the
    metrics file (a damaged line is refused; metrics_lines)."""
    problems = []
    for check in (train_prompts_problem, eval_prompts_problem):
        try:
            check(args, names)
        except SystemExit as err:
            problems.append(str(err))
    if args.resume:
        try:
            metrics_lines(Path(args.resume) / "metrics.jsonl")
        except SystemExit as err:
            problems.append(str(err))
    return problems


def train_prompts_problem(args, names):
    """--train-prompts: readable, and with the ocr reward each prompt quotes its text; SystemExit naming the fix."""
    if args.train_prompts:
        unquoted = [q for q in read_prompts(args.train_prompts, "--train-prompts") if ocr_target(q) is None]
        if "ocr" in names and unquoted:
            raise SystemExit(
                f"--train-prompts {args.train_prompts}: the ocr reward scores the text between double quotes, and "
                f"{len(unquoted)} prompt(s) quote nothing, the first: {clip(unquoted[0])}. Quote the text to render"
            )


def eval_prompts_problem(args, names):
    """--eval-prompts: readable, >= 2 prompts, the embedded world's inside its grammar; SystemExit naming the fix."""
    if args.eval_prompts:
        prompts = read_prompts(args.eval_prompts, "--eval-prompts")
        if len(prompts) < 2:
            raise SystemExit(
                f"--eval-prompts {args.eval_prompts}: give at least 2 prompts (the held-out set is judged as a set)"
            )
        if is_embedded(args.model):
            for number, prompt in enumerate(prompts, 1):
                try:
                    load_world(args.model).parse_prompt(prompt)
                except ValueError:
                    raise SystemExit(
                        f"--eval-prompts {args.eval_prompts}: line {number}, {clip(prompt)}, is outside the embedded "
                        "world's captions (e.g. 'two red circles', 'a blue square on the left'); the world's "
                        "rewards cannot score it. Fix the line, or give --model"
                    ) from None


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


# Activations kept for backward per block and sample, in units of tokens x hidden x 2 bytes, fitted from forward and
# backward passes of SD3.5-Medium's real blocks at 512 px in bfloat16 on the CPU (experiments/results/memory-fit: 30
# runs, residuals under 1 MiB): blocks with the second attention (dual_attention_layers) and plain ones, a constant
# per sample, and a constant (MiB); with gradient checkpointing mostly one block recomputed in backward.
ACTIVATION_UNITS = {False: (32.7, 24.4, -1.9, 26), True: (1.8, 1.2, 37.6, 39)}
FLOAT32_ACTIVATIONS = 38.4 / 32.7  # float32 weights without autocast keep more (measured on the dual blocks)


def activation_bytes(args, config, tokens):
    """Bytes a micro-batch's forward keeps for its backward (`ACTIVATION_UNITS`): train_batch x tokens x hidden x 2 x
    (a n_dual + b n_plain + c) + d MiB. The CPU ran PyTorch's flash attention, which keeps what CUDA's flash and
    memory-efficient kernels keep; fp16 autocast is taken as bfloat16 (not measured), float32 weights scaled by
    FLOAT32_ACTIVATIONS."""
    a, b, c, d = ACTIVATION_UNITS[bool(args.gradient_checkpointing)]
    dual = len(config.get("dual_attention_layers") or ())
    units = a * dual + b * (config["num_layers"] - dual) + c
    unit = tokens * config["num_attention_heads"] * config["attention_head_dim"] * 2
    scale = FLOAT32_ACTIVATIONS if args.dtype == "float32" and args.mixed_precision != "fp16" else 1.0
    return args.train_batch * unit * units * scale + d * 2**20
