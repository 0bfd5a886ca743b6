"""--dry-run as a preflight for SD3.5-Medium, with no GPU and nothing downloaded: every check the launch makes that
needs no GPU, each failure collected (`preflight_problems`); the run's arithmetic from the code that runs
(`run_arithmetic`: the rollout itself counts its transformer passes); the memory per GPU of every resident part
(`memory_plan`, the transformer on the meta device); its time and GPU-hours at a stated MFU (`time_estimate`, FLOPs
counted on the meta device). `dry_run` prints the four and exits non-zero naming each failure."""

from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

import nft
import sd3
from kit.checks import (
    activation_bytes,
    check_precision,
    file_problems,
    parse_branch_steps,
    process_count_note,
    read_prompts,
)
from kit.reward_models import DEFAULTS, aesthetic_mlp, missing_inputs
from kit.worlds import is_embedded, reward_extras

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# SD3.5-Medium's resident parts beside the transformer (parameters): its text encoders at their real sizes (counted
# from their published configs, not shipped here) and its VAE (counted from its config).
TEXT_ENCODER_PARAMS = {"t5-xxl encoder": 4.76e9, "clip-g": 0.69e9, "clip-l": 0.12e9}
VAE_PARAMS = 83.8e6

# The reward models' architectures (the published configs of the default weights, kit.reward_models.DEFAULTS), whose
# parameters are counted on the meta device: PickScore and HPSv2 are CLIP ViT-H/14 (two copies), CLIPScore and the
# aesthetic predictor share CLIP ViT-L/14 (one copy: reward_models.load_clip is cached per model). A hub cache holding
# the model's own config.json is read instead.
CLIP_H = dict(
    text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24),
    vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32,
                       patch_size=14),
    projection_dim=1024,
)  # fmt: skip
CLIP_L = dict(
    text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12),
    vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                       patch_size=14),
    projection_dim=768,
)  # fmt: skip
REWARD_CLIPS = {"pickscore": ("pickscore_model", CLIP_H), "clipscore": ("clip_model", CLIP_L)}
REWARD_CLIPS["aesthetic"] = REWARD_CLIPS["clipscore"]  # aesthetic_clip defaults to --clip-model
REWARD_CLIPS["hpsv2"] = ("hpsv2_config", CLIP_H)  # HPSv2.1: OpenCLIP ViT-H-14, its own fine-tuned copy

# FlowGRPO's GenEval server (yifan123/reward-server) runs one worker per GPU (its gunicorn.conf.py), each holding
# GenEval's detector (Mask2Former Swin-S, ~69M parameters, mmdetection's model zoo) and its colour classifier (CLIP
# ViT-L/14, ~428M) in float32, beside a CUDA context: an ASSUMPTION, not measured here.
GENEVAL_WORKER = {"params": 69e6 + 428e6, "context_gib": 0.5}

# The time estimate's device: an H100 SXM's dense bfloat16 / float16 matmul rate (NVIDIA's datasheet, without
# sparsity) at an assumed model FLOPs utilisation; experiments/bench_gpu.py measures the real MFU on a lent GPU.
PEAK_TFLOPS, ASSUMED_MFU = 989.0, 0.35


def sd35m_transformer(args):
    """SD3.5-Medium's transformer (shipped config) on the meta device with the run's LoRA adapters ("default", "old",
    with --ema "ema"), frozen but for "default", as sd3.load_pipeline makes it. Returns (transformer, config,
    adapters)."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    config = json.loads((ROOT / "world/assets/sd3.5-medium-transformer.json").read_text())
    with init_empty_weights(include_buffers=True):  # buffers too: SD3's 384 x 384 position table is not computed
        transformer = SD3Transformer2DModel.from_config(config)
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=sd3.LORA_TARGETS)
        transformer.add_adapter(lora, adapter_name="default")
        adapters = ["default", "old"] + (["ema"] if args.ema else [])
        with warnings.catch_warnings():  # several adapters on one model are the design here (as in sd3.load_pipeline)
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            for name in adapters[1:]:
                transformer.add_adapter(lora, adapter_name=name)
    transformer.requires_grad_(False)
    for p in sd3.lora_params(transformer, "default"):
        p.requires_grad_(True)
    transformer.set_adapter("default")
    return transformer, config, adapters


@functools.cache  # one build per LoRA shape in a process
def transformer_counts(lora_rank, lora_alpha, ema):
    """(the transformer's own parameters, one adapter's trainable parameters, the linear layers LoRA targets, the
    adapters' names) of `sd35m_transformer`."""
    transformer, _, adapters = sd35m_transformer(SimpleNamespace(lora_rank=lora_rank, lora_alpha=lora_alpha, ema=ema))
    trainable = sum(p.numel() for p in sd3.lora_params(transformer, "default"))
    total = sum(p.numel() for p in transformer.parameters()) - len(adapters) * trainable  # the transformer alone
    targets = sum(1 for n, _ in transformer.named_modules() if n.endswith(".lora_A.default"))
    return total, trainable, targets, tuple(adapters)


# -----------------------------------------------------------------------------
# The checks: every one the launch makes that needs no GPU, each failure collected
# -----------------------------------------------------------------------------


DEFAULT_HUB_MODEL = "stabilityai/stable-diffusion-3.5-medium"


def model_problem(model):
    """None when the run can load `model` (the embedded one, a diffusers folder, or a hub id in the local cache or
    that the saved token may read: huggingface_hub's auth_check, no download); else one line naming the fix. A gated
    model without access (SD3.5-Medium) says: accept its licence on the hub and `hf auth login`."""
    if is_embedded(model):
        return None
    if Path(model).exists():
        ok = (Path(model) / "model_index.json").exists()
        return None if ok else f"--model {model}: not a diffusers pipeline folder (no model_index.json)"
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        return f"--model {model}: no such folder. Give a diffusers folder or a hub id such as {DEFAULT_HUB_MODEL}"
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(model, "transformer/config.json"), str):
        return None
    licence = f"accept its licence at https://huggingface.co/{model} and log in with `hf auth login`"
    if constants.HF_HUB_OFFLINE:
        return f"--model {model}: not in the local hub cache and HF_HUB_OFFLINE is set; unset it, {licence}"
    try:
        HfApi().auth_check(model)
    except GatedRepoError:
        return f"--model {model}: gated, and this token has no access: {licence}"
    except RepositoryNotFoundError:
        return f"--model {model}: not found on the hub, or gated and no token is saved: {licence}"
    except Exception as err:  # no network: the HTTP client's connection error
        return f"--model {model}: the hub cannot be reached ({type(err).__name__}) to check access; {licence}"
    return None


def preflight_problems(args, names):
    """Every failure the launch would meet before its first iteration that needs no GPU to see, one line each: the
    model (`model_problem`), the prompt files and --resume's metrics (`checks.file_problems`), each reward model's
    weights, the aesthetic MLP, the GenEval metadata and server (`reward_models.missing_inputs`, a 5 s TCP
    connection)."""
    real = real_rewards(args, names)
    return [p for p in [model_problem(args.model), *file_problems(args, names), *missing_inputs(real, args)] if p]


def real_rewards(args, names):
    """The rewards among `names` that are real reward models (kit.reward_models), not the embedded world's."""
    return [n for n in names if n not in reward_extras(args.model)]


# -----------------------------------------------------------------------------
# The arithmetic: processes, groups, images, samples per optimizer step
# -----------------------------------------------------------------------------


def planned_processes(args):
    """(processes, where the count comes from): the launch's (WORLD_SIZE) when launched, else --num-processes (the
    recipe's plan), else 1."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 0:
        return int(world), "WORLD_SIZE of this launch"
    if args.num_processes:
        return args.num_processes, "--num-processes, the recipe's"
    return 1, "one process: no launcher and no --num-processes"


class PassCounter(torch.nn.Module):
    """Stands in for the transformer in nft.tree_rollout: counts the samples passed through it (velocity 0)."""

    def __init__(self):
        super().__init__()
        self.samples = 0

    def forward(self, hidden_states, **_):
        self.samples += len(hidden_states)
        return (torch.zeros_like(hidden_states),)


def rollout_counts(args, processes):
    """One iteration's rollouts per process, counted by running nft.tree_rollout itself (the flags' sampler, trees,
    branch layout and SDE sub-steps) on 1-pixel latents with `PassCounter`, averaged over the processes of iteration
    0: (transformer samples, leaves, images decoded (leaves, and probes of --gain-estimator denoised))."""
    P, T = args.prompts_per_iter, args.steps
    branch = parse_branch_steps(args.branch_steps, T)
    sigmas = torch.as_tensor(nft.shifted_sigmas(T), dtype=torch.float32)
    tree, denoised = args.sampler == "tree", getattr(args, "gain_estimator", "pairs") == "denoised"
    counts = []
    for rank in range(processes):
        layouts = nft.branch_layout(P, T, branch, offset=rank * P)
        counter = PassCounter()
        leaves, _, _, probes = nft.tree_rollout(
            counter,
            torch.zeros(P, 1, 1),
            torch.zeros(P, 1),
            sigmas,
            n_roots=args.n_roots,
            n_branch=args.n_branch,
            branch=layouts if tree else [],
            sde_a=args.sde_a,
            gen=torch.Generator().manual_seed(0),
            shape=(1, 1, 1),
            probe_steps=layouts if tree and denoised else (),
            substeps=args.sde_substeps,
            solver="euler" if tree else "dpm2",
        )
        counts.append((counter.samples, len(leaves), len(leaves) + sum(len(x) for _, x, _ in probes)))
    return tuple(float(np.mean(c)) for c in zip(*counts))


def run_arithmetic(args, processes):
    """The run's sizes per process and in all, from the flags as the loop reads them (nft.update_loop: each leaf
    trains on min(--train-steps-per-leaf, T) steps, cut into --updates-per-iter optimizer steps; the frozen v_old and,
    with --base-reg > 0, v_base per sample)."""
    passes, leaves, decodes = rollout_counts(args, processes)
    P = args.prompts_per_iter
    per_leaf = min(args.train_steps_per_leaf, args.steps)
    samples = leaves * per_leaf  # (leaf, timestep) samples per process
    return {
        "processes": processes,
        "groups": P,
        "images_per_group": leaves / P,
        "images": leaves,
        "timesteps_per_image": per_leaf,
        "samples": samples,
        "samples_per_step": samples * processes / args.updates_per_iter,
        "optimizer_steps": args.updates_per_iter,
        "micro_batches_per_step": int(np.ceil(samples / args.updates_per_iter / args.train_batch)),
        "rollout_passes": passes,
        "frozen_passes": samples * (2 if args.base_reg > 0 else 1),
        "decodes": decodes,
    }


# -----------------------------------------------------------------------------
# Memory per GPU
# -----------------------------------------------------------------------------


def clip_params(ref, architecture):
    """Parameters of a CLIP model: its own config.json where the hub cache or a folder holds it, else `architecture`
    (the default weights' published config), built on the meta device. Returns (parameters, whether the model's own
    config was read)."""
    from accelerate import init_empty_weights
    from huggingface_hub import try_to_load_from_cache
    from transformers import CLIPConfig, CLIPModel

    local = Path(ref) / "config.json" if Path(ref).is_dir() else try_to_load_from_cache(ref, "config.json")
    if isinstance(local, (str, Path)) and Path(local).is_file():
        config, own = CLIPConfig.from_pretrained(str(Path(local).parent)), True
    else:
        config, own = CLIPConfig(**architecture), False
    with init_empty_weights():
        return sum(p.numel() for p in CLIPModel(config).parameters()), own


def reward_memory(args, names):
    """{row: GiB} of the reward models each GPU holds, estimated from their parameter counts (`clip_params`) in the
    dtype reward_models loads them in (--dtype, else float32); a CLIP two rewards share counted once; the GenEval
    server's worker on a local address (`GENEVAL_WORKER`, assumed); ocr runs on the CPU (onnxruntime)."""
    dtype = args.dtype or DEFAULTS["dtype"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    rows, held = {}, {}
    for name in names:
        if name in REWARD_CLIPS:
            flag, architecture = REWARD_CLIPS[name]
            ref = getattr(args, flag) or DEFAULTS[flag]
            if ref in held:
                held[ref].append(name)
                continue
            held[ref] = [name]
            params, source = clip_params(ref, architecture)
            rows[ref] = (params, source)
    plan = {
        f"reward model {ref.rstrip('/').split('/')[-1]} ({'+'.join(held[ref])}; {dtype}, {params / 1e6:.0f}M, "
        f"estimate{'' if source else ' from the default architecture'})": size * params / GIB
        for ref, (params, source) in rows.items()
    }
    if "aesthetic" in names:
        mlp = sum(p.numel() for p in aesthetic_mlp().parameters())
        plan["aesthetic MLP (float32)"] = 4 * mlp / GIB
    url = getattr(args, "geneval_url", "") or ""
    if "geneval" in names and any(h in url for h in ("127.0.0.1", "localhost", "[::1]")):
        plan["GenEval server worker (Mask2Former + CLIP-L, fp32; assumed)"] = (
            4 * GENEVAL_WORKER["params"] / GIB + GENEVAL_WORKER["context_gib"]
        )
    return plan


def memory_plan(args, names, config, adapters, trainable, total):
    """{row: GiB} of one GPU: the frozen transformer in the run's precision (--mixed-precision fp16: float32 and the
    float16 copies autocast makes of it, kept for backward, of one block at a time with --gradient-checkpointing),
    the LoRA adapters, AdamW's state, one micro-batch's activations as measured (`checks.activation_bytes`), the text
    encoders and VAE, the reward models and a local GenEval worker (`reward_memory`)."""
    res = args.resolution or 512
    tokens = (res // 8 // config["patch_size"]) ** 2 + 77 + (args.max_sequence_length or 128)
    fp16 = args.mixed_precision == "fp16"
    weights = "fp32" if fp16 or args.dtype == "float32" else "bf16"  # float16 without a scaler: check_precision
    copies = total / (config["num_layers"] if args.gradient_checkpointing else 1)
    text, vae = ("fp16", "fp32") if fp16 else (weights, weights)  # sd3.precision: fp16 mode's VAE float32
    ckpt = "on" if args.gradient_checkpointing else "off"
    return {
        f"frozen weights ({weights})": {"fp32": 4, "bf16": 2}[weights] * total / GIB,
        **({"their fp16 copies kept for backward (autocast)": 2 * copies / GIB} if fp16 else {}),
        f"{len(adapters)} LoRA adapters ({', '.join(adapters)}; fp32)": 4 * len(adapters) * trainable / GIB,
        "AdamW state + grads (fp32)": 3 * 4 * trainable / GIB,
        f"activations, micro-batch {args.train_batch}, checkpointing {ckpt} (fitted on the CPU)": activation_bytes(
            args, config, tokens
        )
        / GIB,
        f"text encoders (T5-XXL, CLIP-G, CLIP-L; {text})": {"fp32": 4, "bf16": 2, "fp16": 2}[text]
        * sum(TEXT_ENCODER_PARAMS.values())
        / GIB,
        f"VAE ({vae})": {"fp32": 4, "bf16": 2}[vae] * VAE_PARAMS / GIB,
        **reward_memory(args, real_rewards(args, names)),
    }


# -----------------------------------------------------------------------------
# Time at a stated MFU
# -----------------------------------------------------------------------------


@functools.cache  # one count per size in a process (the tests' dry runs share it)
def flops_per_sample(resolution, text_tokens, lora_rank, lora_alpha):
    """FLOPs of one transformer forward (no grad) and one forward + backward through the trained "default" adapter
    (input gradients through every frozen layer, weight gradients for the LoRA only), batch 1 at `resolution` px and
    77 CLIP + `text_tokens` T5 tokens, counted by torch's FlopCounterMode on SD3.5-Medium's transformer on the meta
    device (`sd35m_transformer`)."""
    from torch.utils.flop_counter import FlopCounterMode

    transformer, config, _ = sd35m_transformer(SimpleNamespace(lora_rank=lora_rank, lora_alpha=lora_alpha, ema=False))
    x = torch.empty(1, config["in_channels"], resolution // 8, resolution // 8, device="meta")
    s = torch.full((1,), 0.5, device="meta")
    emb = torch.empty(1, 77 + text_tokens, config["joint_attention_dim"], device="meta")
    pooled = torch.empty(1, config["pooled_projection_dim"], device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as forward:
        sd3.velocity(transformer, x, s, emb, pooled)
    with FlopCounterMode(display=False) as both:
        sd3.velocity(transformer, x, s, emb, pooled).sum().backward()
    return forward.get_total_flops(), both.get_total_flops()


def time_estimate(args, plan, flops, eval_prompts):
    """Seconds per iteration on one GPU (each process runs its share: prompt groups never straddle processes) at
    ASSUMED_MFU of PEAK_TFLOPS: rollout passes and the update's frozen passes x the forward's FLOPs, gradient
    samples x the forward + backward's (plus one forward each recomputed under --gradient-checkpointing), and the
    held-out evaluation (eval prompts x --eval-steps forwards, split over the processes, every --eval-every
    iterations) spread over the iterations. Decoding, text encoders and reward models are not counted."""
    forward, both = flops
    grad = both + (forward if args.gradient_checkpointing else 0)
    train = (plan["rollout_passes"] + plan["frozen_passes"]) * forward + plan["samples"] * grad
    evaluation = 0.0
    if args.eval_every and eval_prompts:
        passes = eval_prompts * (args.eval_steps or args.steps) / plan["processes"]
        evaluation = passes * forward / args.eval_every
    seconds = (train + evaluation) / (PEAK_TFLOPS * 1e12 * ASSUMED_MFU)
    gpu_hours = seconds * plan["processes"] / 3600
    return {"tflop": (train + evaluation) / 1e12, "seconds": seconds, "gpu_hours": gpu_hours}


# -----------------------------------------------------------------------------
# The dry run
# -----------------------------------------------------------------------------


def plan_run(args, names):
    """The numbers the dry run prints for the run the flags describe on SD3.5-Medium: parameters, the arithmetic
    (`run_arithmetic`, for `planned_processes`), the memory per GPU (`memory_plan`), FLOPs per sample and the time
    (`time_estimate`, with the held-out evaluation when its prompt file is readable)."""
    total, trainable, targets, adapters = transformer_counts(args.lora_rank, args.lora_alpha, args.ema)
    config = json.loads((ROOT / "world/assets/sd3.5-medium-transformer.json").read_text())
    plan = run_arithmetic(args, planned_processes(args)[0])
    try:
        eval_prompts = len(read_prompts(args.eval_prompts)) if args.eval_prompts else 0
    except SystemExit:
        eval_prompts = 0  # named among the problems
    flops = flops_per_sample(args.resolution or 512, args.max_sequence_length or 128, args.lora_rank, args.lora_alpha)
    return {
        "total_params": total,
        "trainable_params": trainable,
        "lora_layers": targets,
        "memory_gib": memory_plan(args, names, config, adapters, trainable, total),
        "plan": plan,
        "flops_per_sample": flops,
        "eval_prompts": eval_prompts,
        "time": time_estimate(args, plan, flops, eval_prompts),
        "config": config,
    }


def dry_run(args, names):
    """--dry-run: the preflight (`preflight_problems`), then the arithmetic, the memory table and the time of
    `plan_run`, printed; SystemExit naming every failure, else plan_run's numbers."""
    check_precision(args)
    problems = preflight_problems(args, names)
    numbers = plan_run(args, names)
    print(
        f"SD3.5-Medium transformer: {numbers['total_params'] / 1e6:.1f}M parameters, LoRA on {numbers['lora_layers']} "
        f"linear layers (r={args.lora_rank}, alpha={args.lora_alpha}): {numbers['trainable_params'] / 1e6:.2f}M "
        "trainable"
    )
    print_arithmetic(args, numbers["plan"], planned_processes(args)[1])
    print_memory(args, numbers["config"], numbers["memory_gib"], names)
    print_time(args, numbers["plan"], numbers["flops_per_sample"], numbers["time"], numbers["eval_prompts"])
    if problems:
        listed = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        raise SystemExit(f"preflight: {len(problems)} problem(s) the launch would stop at:\n{listed}")
    print("preflight: every check that needs no GPU passed")
    return numbers


def print_arithmetic(args, plan, source):
    """The arithmetic's lines, per process and in all."""
    n, P = plan["processes"], plan["groups"]
    sampler = "DPM-Solver-2 ODE" if args.sampler == "ode" else f"trees {args.n_roots} x {args.n_branch}"
    print(f"run arithmetic ({n} process(es) = GPUs: {source}):")
    print(f"  prompt groups per iteration   {P} per GPU, {P * n} in all")
    print(f"  images per group              {plan['images_per_group']:g} ({sampler}, {args.steps} steps)")
    print(f"  images per iteration          {plan['images']:g} per GPU, {plan['images'] * n:g} in all")
    print(f"  timesteps trained per image   {plan['timesteps_per_image']} of {args.steps}")
    print(
        f"  samples per optimizer step    {plan['samples_per_step']:,.0f} (images x timesteps, all GPUs); "
        f"{plan['optimizer_steps']} step(s) per iteration, {plan['micro_batches_per_step']} micro-batches of "
        f"{args.train_batch} per GPU each"
    )
    print(
        f"  transformer passes per GPU    {plan['rollout_passes']:g} rollout, {plan['frozen_passes']:g} frozen "
        f"(v_old{', v_base' if args.base_reg > 0 else ''}), {plan['samples']:g} with gradients; "
        f"{plan['decodes']:g} decodes"
    )
    epoch = ""
    if args.train_prompts and Path(args.train_prompts).is_file():
        lines = len(read_prompts(args.train_prompts))
        epoch = f"; {lines} training prompts: one pass over them every {lines / (P * n):.1f} iterations"
    print(f"  iterations                    {args.iterations} (DiffusionNFT's epoch = one iteration){epoch}")
    if args.num_processes and n != args.num_processes:
        print("  " + process_count_note(args, n))


def print_memory(args, config, memory, names):
    """The memory table, its total, and the activations with and without gradient checkpointing."""
    rows = {**memory, "total per GPU": sum(memory.values())}
    width = max(len(key) for key in rows)
    print("memory per GPU (GiB; parts from parameter counts, activations from a fit to CPU measurements):")
    for key, value in rows.items():
        print(f"  {key:<{width}} {value:8.2f} GiB")
    notes = ["parameters x bytes, the text encoders' and reward models' counted from their architectures"]
    if any(k.startswith("GenEval") for k in memory):
        notes.append(
            "GenEval's server assumed on these GPUs, one worker each (its gunicorn.conf.py), "
            f"{GENEVAL_WORKER['params'] / 1e6:.0f}M float32 parameters and a {GENEVAL_WORKER['context_gib']} GiB "
            "CUDA context: not measured"
        )
    if "ocr" in names:
        notes.append("ocr runs on the CPU (onnxruntime): nothing on the GPU")
    print("  counted: " + "; ".join(notes))
    tokens = ((args.resolution or 512) // 8 // config["patch_size"]) ** 2 + 77 + (args.max_sequence_length or 128)
    act = {c: activation_bytes(replace(args, gradient_checkpointing=c), config, tokens) / GIB for c in (False, True)}
    print(
        f"  activations of micro-batch {args.train_batch}: {act[False]:.2f} without gradient checkpointing, "
        f"{act[True]:.2f} with it (--gradient-checkpointing; one forward more per sample)"
    )


def print_time(args, plan, flops, cost, eval_prompts):
    """Time and GPU-hours per iteration, per 100 and per run, with what they assume."""
    n = plan["processes"]
    evaluation = (
        f"the evaluation's {eval_prompts} prompts x {args.eval_steps or args.steps} steps every {args.eval_every}"
        if eval_prompts and args.eval_every
        else "no evaluation (no readable --eval-prompts, or --eval-every 0)"
    )
    print(
        f"time (ESTIMATE: {ASSUMED_MFU:.0%} MFU of an H100's {PEAK_TFLOPS:g} TFLOP/s dense bf16/fp16, assumed; "
        "python -m experiments.bench_gpu measures the real MFU on a GPU):"
    )
    print(
        f"  FLOPs per sample (meta device, {args.resolution or 512} px): forward {flops[0] / 1e12:.2f} TFLOP, "
        f"forward + backward {flops[1] / 1e12:.2f}; per GPU and iteration {cost['tflop']:,.0f} TFLOP with {evaluation}"
    )
    run = args.iterations * cost["gpu_hours"]
    print(
        f"  {cost['seconds']:.0f} s per iteration; {cost['gpu_hours']:.3f} GPU-hours per iteration on {n} GPU(s), "
        f"{100 * cost['gpu_hours']:.1f} per 100 iterations, {run:,.{0 if run >= 10 else 2}f} for --iterations "
        f"{args.iterations} "
        f"({args.iterations * cost['seconds'] / 3600:,.1f} h wall); not counted: decoding, text encoders, rewards, "
        "the gradient all-reduce"
    )
