"""Profile the configs/ recipes (DiffusionNFT, ReCAST, DiffusionRVGE on SD3.5-Medium): time, memory and MFU per phase.

    # one GPU: every SD3.5-M recipe in configs/ at its real size (per process), SD3.5-M-sized random pipeline
    python -m experiments.bench_gpu
    # some recipes, shrunk to 1 prompt group per process (time per iteration extrapolated to the recipe's 6)
    python -m experiments.bench_gpu --config configs/nft-geneval.yaml configs/rvge-sd35m.yaml --prompts-per-iter 1
    # does a bigger micro-batch fit, and is it faster?
    python -m experiments.bench_gpu --config configs/nft-geneval.yaml --train-batch 16 --rollout-batch 32
    # the same code on CPU at toy size: the three methods (what the test runs), or a recipe at toy size
    python -m experiments.bench_gpu --tiny
    python -m experiments.bench_gpu --tiny --config configs/nft-geneval.yaml

Run it on one GPU of the kind you mean to rent, before renting a cluster of them: it says whether a recipe's
micro-batches fit (peak memory per phase; on running out of memory it halves --train-batch and --rollout-batch until
they fit, and says so), where an iteration's time goes (rollout, reward, gains+W, update) and what share of the GPU's
matrix rate the loop achieves (MFU). The budget: GPU-hours ~ iterations x seconds per iteration x GPUs / 3600 (prompt
groups never straddle processes, so each of the recipe's 8 GPUs runs this loop on its share; the gradient all-reduce,
one flat buffer of the LoRA's 19M numbers per optimizer step, is not measured). A 15-minute slot on one H200-class
GPU fits about four recipes at --prompts-per-iter 1 (an estimate from the FLOP counts below at ~300 TFLOP/s, not a
measurement); `--config configs/nft-geneval.yaml configs/nft-multi.yaml configs/recast-sd35m.yaml
configs/rvge-sd35m.yaml --prompts-per-iter 1` covers the four kinds of run (nft-pickscore and nft-ocr time as
nft-geneval: the same sizes, other rewards).

What it runs: recast.train and rvge.train themselves, each recipe parsed as its command parses it (`--config`; rvge.py
for rvge-*.yaml, recast.py for the others) with what a bench must replace: the model (the random pipeline below),
STAND-IN rewards (as many as the recipe's, image statistics that cost ~nothing: real reward models add their own time
to the reward phase), the prompt files, no evaluation, --iterations 2 (the first is warm-up) and a checkpoint only at
the end; every other flag is the recipe's (precision mode, sampler, trees, steps, timesteps trained, micro-batches,
EMA), unless given here. Without --config and with --tiny: recast --credit recast, recast --credit nft and rvge at the
toy size TINY. Phase times are the loop's own metrics (time/rollout, time/reward, time/gains_W or rvge's
time/regression, time/update); bench_gpu only wraps the loop's rollout (`nft.tree_rollout`), decode (`nft.decode`,
which nft.rollout_and_score calls) and update (`recast.nft_update`, `rvge.rvge_update`) to synchronise CUDA at their
end (so kernels still queued are charged to the phase that launched them), record each phase's peak memory
(torch.cuda.max_memory_allocated) and count what passes through the models.

What it builds (nothing is downloaded): a StableDiffusion3Pipeline with random weights of SD3.5-Medium's transformer
config (world/assets/sd3.5-medium-transformer.json) and VAE shape (16 latent channels, 8x downsampling), and text
encoders with the real widths and sequence lengths (CLIP-L 768, CLIP-G 1280, T5-XXL 4096; 77 and 256 tokens) but 1-2
layers: they run once per prompt, and a shallow stack keeps the build and the disk small. Saved in bfloat16 on a GPU;
each recipe loads it in its own precision. Random weights cost the same FLOPs as trained ones.

FLOPs: torch.utils.flop_counter.FlopCounterMode counts one transformer forward (no grad), one forward + backward (the
trained LoRA adapter active, as in the update: the backward computes input gradients through every frozen layer but
weight gradients only for the LoRA) and one VAE decode, at batch 1 and the recipe's resolution, under the recipe's
autocast. SD3.5-M at 512 px (counted on the meta device): forward 2.47 TFLOP with the LoRA, forward + backward 5.26
(2.13x, not the 3x of full fine-tuning), VAE decode 2.51 TFLOP per image (decoding the leaves is not free). Hooks count
the samples the loop pushes through the transformer in each phase (with and without grad) and the images it decodes;
phase FLOPs = counts x FLOPs per sample. Text encoders and rewards are not counted (their time is). Achieved TFLOP/s
= FLOPs / seconds; MFU = that / the dense matmul rate measured here on the same device in the dtype the transformer
computes in (float16 under --mixed-precision fp16, else the frozen weights'; torch.matmul of two n x n matrices). The
first iteration (warm-up: kernel selection, allocator) is left out of the averages. Writes --out/bench_gpu.json and
--out/bench_gpu.md (also printed): a summary table per recipe (seconds per iteration at the recipe's size, GPU-hours
per 100 iterations on its 8 GPUs, MFU, peak memory) and the phases of each.
"""

import argparse
import gc
import json
import math
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

import nft
import recast
import rvge
import sd3

ROOT = Path(__file__).resolve().parents[1]

METHODS = {  # --tiny without --config: name -> (module, flags)
    "recast": (recast, ["--credit", "recast"]),
    "nft": (recast, ["--credit", "nft"]),
    "rvge": (rvge, []),
}
PHASES = {  # table phase -> the loop's time/* key(s)
    "rollout": ("time/rollout",),
    "reward": ("time/reward",),
    "gains+W": ("time/gains_W", "time/regression"),  # rvge: gains, W and the group directions
    "update": ("time/update",),
}
GPUS = 8  # every SD3.5-M recipe assumes 8 processes, one per GPU (configs/README.md)
# The toy size --tiny runs on CPU: the three methods at these values, or a recipe with these values over its own.
# Every entry is also a flag of this script, which overrides a recipe's value (--prompts-per-iter 1 shrinks a recipe).
TINY = dict(
    resolution=64,
    steps=4,
    max_sequence_length=64,
    prompts_per_iter=2,
    n_roots=2,
    n_branch=2,
    branch_steps="1,2",
    rollout_batch=8,
    train_batch=8,
    train_steps_per_leaf=2,
    lora_rank=4,
    lora_alpha=8,
    lr=1e-4,
    iterations=2,
)
BENCH_ITERATIONS = 2  # a recipe's run here: one warm-up iteration, one measured (--iterations for more)
PROMPTS = [  # at most 40 characters: the tokenizers are character-level, and --tiny keeps 64 T5 tokens
    "a photo of a red fox in the snow",
    "a bowl of ramen on a wooden table",
    "a lighthouse at dusk, oil painting",
    "two cats sleeping on a sofa",
    "a neon sign that reads open late",
    "a watercolor map of an island",
]
GIB = 2**30


# =============================================================================
# A random SD3.5-Medium-shaped pipeline, built from configs
# =============================================================================

SD35M_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=16,
    layers_per_block=2,
    norm_num_groups=32,
    mid_block_add_attention=True,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)
TINY_VAE = dict(
    SD35M_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8, mid_block_add_attention=False
)
TINY_TRANSFORMER = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=32,
    pos_embed_max_size=16,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
# (hidden, intermediate, heads, layers, positions); CLIP-L and CLIP-G widths, 2 layers
# (the pipeline reads hidden_states[-2])
SD35M_CLIPS = [(768, 3072, 12, 2, 77, "quick_gelu"), (1280, 5120, 20, 2, 77, "gelu")]
TINY_CLIPS = [(16, 32, 2, 2, 77, "quick_gelu"), (16, 32, 2, 2, 77, "gelu")]
SD35M_T5 = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, num_layers=1, feed_forward_proj="gated-gelu")
TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=1, feed_forward_proj="gated-gelu")
LETTERS = "abcdefghijklmnopqrstuvwxyz,"


def build_pipeline(path, tiny=False, device="cpu", dtype="float32", seed=0):
    """Save a random StableDiffusion3Pipeline to `path` (diffusers layout) and return its transformer's
    parameter count. Full size: SD3.5-Medium's transformer config and VAE shape, text encoders of the
    real widths with 1-2 layers; tiny: the same classes and block types at toy widths. Tokenizers are
    character-level, built from a vocabulary (no files): prompts pad to 77 CLIP / max_sequence_length
    T5 tokens as with the real ones. Modules are initialised on `device` (fast on a GPU)."""
    import torch
    from transformers import CLIPTokenizer, T5Tokenizer

    t_cfg = (
        TINY_TRANSFORMER
        if tiny
        else json.loads((Path(recast.__file__).parent / "world/assets/sd3.5-medium-transformer.json").read_text())
    )
    t_cfg = {k: v for k, v in t_cfg.items() if not k.startswith("_")}
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in LETTERS:
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    clips = TINY_CLIPS if tiny else SD35M_CLIPS
    t5_pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)] + [(c, -2.0) for c in LETTERS]
    pipe = sd3.pipeline_from_configs(
        transformer=t_cfg,
        vae=TINY_VAE if tiny else SD35M_VAE,
        clips=[
            dict(
                vocab_size=len(vocab),
                hidden_size=h,
                intermediate_size=i,
                num_attention_heads=a,
                num_hidden_layers=n,
                max_position_embeddings=p,
                projection_dim=h,
                hidden_act=act,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
            for h, i, a, n, p, act in clips
        ],
        t5=dict(vocab_size=len(t5_pieces), **(TINY_T5 if tiny else SD35M_T5)),
        tokenizers=(
            CLIPTokenizer(vocab=vocab, merges=[], model_max_length=clips[0][4]),
            CLIPTokenizer(vocab=vocab, merges=[], model_max_length=clips[1][4]),
            T5Tokenizer(vocab=t5_pieces, model_max_length=TINY["max_sequence_length"] if tiny else 256),
        ),
        seed=seed,
        device=device,
    )
    transformer = pipe.transformer
    for module in (transformer, pipe.vae, pipe.text_encoder_3, pipe.text_encoder, pipe.text_encoder_2):
        torch.nn.Module.to(
            module, getattr(torch, dtype)
        )  # diffusers' own .to() warns about keep-in-fp32 lists, empty here
    pipe.save_pretrained(path)
    return sum(p.numel() for p in transformer.parameters())


# =============================================================================
# Stand-in rewards: cheap image statistics, (images, prompts) -> (N,)
# =============================================================================


def _pixels(images):
    return [np.asarray(im, dtype=np.float32) / 255 for im in images]


def brightness(images, prompts):
    return np.array([x.mean() for x in _pixels(images)])


def redness(images, prompts):
    return np.array([(x[..., 0] - x[..., 2]).mean() for x in _pixels(images)])


def contrast(images, prompts):
    return np.array([x.std() for x in _pixels(images)])


def saturation(images, prompts):
    return np.array([(x.max(-1) - x.min(-1)).mean() for x in _pixels(images)])


def sharpness(images, prompts):
    return np.array([np.abs(np.diff(x, axis=1)).mean() for x in _pixels(images)])


STAND_INS = {  # a recipe's K rewards are the first K of these (rvge-sd35m has 5)
    "brightness": brightness,
    "redness": redness,
    "contrast": contrast,
    "saturation": saturation,
    "sharpness": sharpness,
}


# =============================================================================
# Measuring: the matmul rate, FLOPs per sample, and what the loop runs in each phase
# =============================================================================


def count_cpu_attention():
    """torch's FlopCounterMode has formulas for the CUDA attention kernels but not for the fused CPU
    one (aten._scaled_dot_product_flash_attention_for_cpu); register the same formulas for it."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    for op, formula in (
        (aten._scaled_dot_product_flash_attention_for_cpu, fc.sdpa_flop),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, fc.sdpa_backward_flop),
    ):
        if op not in fc.flop_registry:
            fc.register_flop_formula(op, get_raw=True)(formula)  # these formulas already take shapes


def matmul_rate(device, dtype, n=8192, reps=20):
    """Dense matmul rate in FLOP/s on `device` in `dtype`: the fastest of 3 timings of `reps`
    products of two n x n matrices (2 n^3 FLOPs each), after a warm-up. The MFU denominator."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best


def flops_per_sample(run, decode):
    """FLOPs of one transformer forward (no grad), one forward + backward with the trained "default" adapter (as in
    the update), and one VAE decode, at batch 1, the run's latent shape and under its autocast (`Run.autocast`)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    count_cpu_attention()
    emb, pooled = sd3.encode(run.pipe, PROMPTS[:1], run.max_len, run.acc.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((1, *run.shape), generator=gen).to(emb.device)
    s = torch.full((1,), 0.5, device=emb.device)
    run.transformer.set_adapter("default")
    with torch.no_grad(), FlopCounterMode(display=False) as forward, run.autocast():
        sd3.velocity(run.transformer, x, s, emb, pooled)
    with FlopCounterMode(display=False) as forward_backward:
        with run.autocast():
            v = sd3.velocity(run.transformer, x, s, emb, pooled)
        v.pow(2).mean().backward()
    for p in sd3.lora_params(run.transformer, "default"):
        p.grad = None  # the optimizer's first step must not see this gradient
    with FlopCounterMode(display=False) as vae, run.autocast():
        decode(run.pipe, x)
    return {
        "transformer_forward": forward.get_total_flops(),
        "transformer_forward_backward": forward_backward.get_total_flops(),
        "vae_decode": vae.get_total_flops(),
    }


class Profiler:
    """Instruments one script module (recast or rvge) while its `train` runs: patches the functions the loop calls,
    where the loop looks them up at call time (the script's setup_run and its update, recast.nft_update or
    rvge.rvge_update; nft.tree_rollout and nft.decode, which nft.rollout_and_score calls), with wrappers that set the
    current phase, synchronise CUDA at the end and record the phase's peak memory; hooks on the transformer and the
    VAE decoder count samples per phase. `iterations[i]` holds iteration i's counts and peaks; `precision` is the
    run's (sd3.Precision)."""

    PHASE_OF = {"tree_rollout": "rollout", "decode": "reward", "nft_update": "update", "rvge_update": "update"}

    def __init__(self, module):
        self.module, self.orig, self.hooks, self.phase, self.iterations = module, {}, [], None, []
        self.per_sample, self.params, self.cuda, self.precision = {}, 0, False, None

    def __enter__(self):
        update = "nft_update" if hasattr(self.module, "nft_update") else "rvge_update"
        for space, name in [(self.module, "setup_run"), (nft, "tree_rollout"), (sd3, "decode"), (self.module, update)]:
            self.orig[name] = (space, getattr(space, name))
            setattr(space, name, self._setup_run if name == "setup_run" else self._wrap(name))
        return self

    def __exit__(self, *exc):
        for name, (space, fn) in self.orig.items():
            setattr(space, name, fn)
        for h in self.hooks:
            h.remove()

    def _setup_run(self, *a, **k):
        run = self.orig["setup_run"][1](*a, **k)
        self.cuda, self.precision = run.acc.device.type == "cuda", run.precision
        self.params = sum(p.numel() for n, p in run.transformer.named_parameters() if "lora_" not in n)
        self.per_sample = flops_per_sample(run, self.orig["decode"][1])
        self.hooks = [
            run.transformer.register_forward_pre_hook(self._count_transformer, with_kwargs=True),
            run.pipe.vae.decoder.register_forward_pre_hook(self._count_decode),
        ]
        return run

    def _wrap(self, name):
        import torch

        phase, fn = self.PHASE_OF[name], self.orig[name][1]

        def wrapped(*a, **k):
            if phase == "rollout":  # every iteration starts with its rollout (evaluation is off)
                self.iterations.append(
                    {
                        "rollout": {"nograd": 0, "grad": 0},
                        "reward": {"decode": 0},
                        "update": {"nograd": 0, "grad": 0},
                        "peak_gib": {},
                    }
                )
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            self.phase = phase
            try:
                return fn(*a, **k)
            finally:
                self.phase = None
                if self.cuda:
                    torch.cuda.synchronize()
                    peaks = self.iterations[-1]["peak_gib"]
                    peaks[phase] = max(peaks.get(phase, 0.0), torch.cuda.max_memory_allocated() / GIB)

        return wrapped

    def _count_transformer(self, module, args, kwargs):
        import torch

        if self.phase in ("rollout", "update"):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.iterations[-1][self.phase]["grad" if torch.is_grad_enabled() else "nograd"] += len(x)

    def _count_decode(self, module, args):
        if self.phase == "reward":
            self.iterations[-1]["reward"]["decode"] += len(args[0])


# =============================================================================
# What to profile: the recipes (or, --tiny, the three methods), run as their scripts run them
# =============================================================================


@dataclass
class Case:
    """One run to profile: a recipe (--config) or, --tiny without one, a method at the toy size."""

    name: str  # the recipe's file stem, or the method
    module: object  # recast or rvge: the script that runs it
    flags: list[str]  # ["--config", recipe] or the method's own flags
    sizes: dict  # the TINY keys as this run sets them (the recipe's, --tiny's, then this command's)
    budgets: str  # one per reward: the run's stand-ins are the first K of STAND_INS
    recipe: dict  # the TINY keys at the recipe's own size (for a method: its sizes)

    def scale(self, sizes):
        """The factor from the measured seconds per iteration to the recipe's own: its prompt groups per process over
        those run, when only those (and the micro-batches, which split the same work) differ; else None."""
        same = ("prompts_per_iter", "iterations", "train_batch", "rollout_batch")
        if any(sizes[k] != self.recipe[k] for k in TINY if k not in same):
            return None
        return self.recipe["prompts_per_iter"] / sizes["prompts_per_iter"]


def recipe_script(path):
    """The script a recipe is run with, as its header's command and tests/test_recipes.py say: rvge.py for rvge-*."""
    return rvge if Path(path).name.startswith("rvge") else recast


def sd35m_recipes():
    """Every recipe in configs/ for SD3.5-Medium (its `model` is configs/reference/diffusionnft.yaml's)."""
    model = yaml.safe_load((ROOT / "configs/reference/diffusionnft.yaml").read_text())["all"]["model"]
    return [
        str(p) for p in sorted((ROOT / "configs").glob("*.yaml")) if yaml.safe_load(p.read_text()).get("model") == model
    ]


def cases(args):
    """The runs to profile, in order: each --config recipe (default: every SD3.5-M recipe) at its own size (its
    --iterations replaced by BENCH_ITERATIONS; with --tiny the TINY values over it), or with --tiny and no --config the
    methods at TINY; the size flags given here override either."""
    given = {k: getattr(args, k) for k in TINY if getattr(args, k) is not None}
    if args.tiny and not args.config:
        sizes = {**TINY, **given}
        return [Case(m, *METHODS[m], sizes, "0.4,0.3,0.2,0.1", sizes) for m in args.methods]
    out = []
    for path in args.config or sd35m_recipes():
        module = recipe_script(path)
        recipe = module.parse_args(["--config", str(path)])
        if len(recipe.budgets.split(",")) > len(STAND_INS):
            raise SystemExit(f"{path}: {len(recipe.budgets.split(','))} rewards, {len(STAND_INS)} stand-ins here")
        own = {k: getattr(recipe, k) for k in TINY}
        sizes = {**own, "iterations": BENCH_ITERATIONS, **(TINY if args.tiny else {}), **given}
        out.append(Case(Path(path).stem, module, ["--config", str(path)], sizes, recipe.budgets, own))
    return out


def case_argv(args, case, sizes, pipe_dir, prompts_file, out):
    """The command line of one case: its flags, then what a bench replaces (model, stand-in rewards, prompt files, no
    evaluation, a checkpoint at the end), the sizes, --dtype if given here, and --script-args."""
    names = list(STAND_INS)[: len(case.budgets.split(","))]
    flags = {
        "--model": pipe_dir,
        "--rewards": ",".join(names),
        "--budgets": case.budgets,
        "--train-prompts": prompts_file,
        "--eval-prompts": prompts_file,
        "--eval-every": 0,
        "--save-every": sizes["iterations"],
        "--keep-checkpoints": 1,
        "--out": out,
        "--device": args.device,
        "--seed": args.seed,
        **({"--dtype": args.dtype} if args.dtype else {}),
        **{"--" + k.replace("_", "-"): v for k, v in sizes.items()},
    }
    return case.flags + [str(x) for kv in flags.items() for x in kv] + shlex.split(args.script_args)


def profile_case(args, case, pipe_dir, prompts_file, out):
    """Train one case under the Profiler. Out of GPU memory, it halves --train-batch and --rollout-batch (the largest
    micro-batches that fit) and tries again in a fresh folder. Returns (metrics rows, profiler, sizes used)."""
    import torch

    sizes, attempt = dict(case.sizes), 0
    while True:
        run_dir = out / "runs" / (case.name if attempt == 0 else f"{case.name}-{attempt}")
        shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own run folder, from an earlier bench
        argv = case_argv(args, case, sizes, pipe_dir, prompts_file, run_dir)
        try:
            with Profiler(case.module) as prof:
                case.module.train(case.module.parse_args(argv), extra_rewards=STAND_INS)
            break
        except torch.OutOfMemoryError:
            if sizes["train_batch"] == sizes["rollout_batch"] == 1:
                raise
        attempt += 1
        sizes.update(train_batch=max(1, sizes["train_batch"] // 2), rollout_batch=max(1, sizes["rollout_batch"] // 2))
        print(
            f"{case.name}: out of GPU memory; again at --train-batch {sizes['train_batch']} "
            f"--rollout-batch {sizes['rollout_batch']}",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, prof, sizes


# =============================================================================
# The summary and the table
# =============================================================================


def summarize(rows, prof, rate):
    """Per phase: mean seconds, TFLOP, TFLOP/s, MFU and peak GiB over the iterations after the first
    (all of them if there is only one), plus the whole iteration."""
    keep = slice(1, None) if len(rows) > 1 else slice(None)
    rows, its = rows[keep], prof.iterations[keep]
    F = prof.per_sample
    flops = {
        "rollout": [
            c["rollout"]["nograd"] * F["transformer_forward"] + c["rollout"]["grad"] * F["transformer_forward_backward"]
            for c in its
        ],
        "reward": [c["reward"]["decode"] * F["vae_decode"] for c in its],
        "gains+W": [0.0 for _ in its],
        "update": [
            c["update"]["nograd"] * F["transformer_forward"] + c["update"]["grad"] * F["transformer_forward_backward"]
            for c in its
        ],
    }
    seconds = {p: [sum(m.get(k, 0.0) for k in keys) for m in rows] for p, keys in PHASES.items()}
    seconds["iteration"] = [sum(v) for v in zip(*seconds.values())]
    flops["iteration"] = [sum(v) for v in zip(*flops.values())]
    out = {}
    for p in seconds:
        s, f = float(np.mean(seconds[p])), float(np.mean(flops[p]))
        peaks = (
            [c["peak_gib"].get(p) for c in its]
            if p != "iteration"
            else [max(c["peak_gib"].values(), default=None) for c in its]
        )
        peaks = [x for x in peaks if x is not None]
        out[p] = {
            "seconds": s,
            "tflop": f / 1e12,
            "tflops": f / s / 1e12 if f else None,
            "mfu": f / s / rate if f else None,
            "peak_gib": max(peaks) if peaks else None,
        }
    out["samples"] = {
        k: {kk: float(np.mean([c[k][kk] for c in its])) for kk in its[0][k]} for k in ("rollout", "reward", "update")
    }
    return out


def compute_dtype(prec):
    """The dtype the transformer's matmuls run in: the autocast's (--mixed-precision fp16), else the weights'."""
    return str(prec.autocast or prec.transformer).removeprefix("torch.")


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table(result):
    """The markdown report: setup lines, one summary row per recipe (or method), then its phases."""
    rates = ", ".join(f"{d} {r:.4g}" for d, r in result["matmul_tflops"].items())
    first = next(iter(result["runs"].values()))
    F, res = first["flops_per_sample"], first["settings"]["resolution"]
    lines = [
        f"# bench_gpu: {result['device_name']}, {result['model']}",
        "",
        f"- transformer {first['transformer_params'] / 1e6:.4g}M parameters; one forward at {res} px: "
        f"{F['transformer_forward'] / 1e12:.4g} TFLOP, forward + backward (LoRA): "
        f"{F['transformer_forward_backward'] / 1e12:.4g} TFLOP "
        f"(x{F['transformer_forward_backward'] / F['transformer_forward']:.2f}); "
        f"VAE decode {F['vae_decode'] / 1e12:.4g} TFLOP per image",
        f"- measured matmul rate, TFLOP/s: {rates} (the MFU denominator, in the dtype each run computes in)",
        f"- rewards are STAND-INS ({', '.join(STAND_INS)}: image statistics); real reward models add their time to "
        "`reward`; no evaluation; `gains+W` is rvge's time/regression for rvge",
        f"- means over the iterations after the first (warm-up); {result['script_args'] or 'no extra script flags'}",
        f"- at the recipe's size: the measured seconds x (the recipe's prompt groups per process / those run), each "
        f"phase being linear in them (n/a where other sizes differ, as with --tiny); GPU-hours for 100 iterations on "
        f"the recipe's {GPUS} GPUs (one loop per GPU; the gradient all-reduce not measured)",
        "",
        "| recipe | script | computes in | prompts / process: run (recipe) | train / rollout batch | s / iteration at "
        f"the recipe's size | GPU-h / 100 iterations ({GPUS} GPUs) | TFLOP/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        it, s = r["phases"]["iteration"], r["settings"]
        at_size = it["seconds"] * r["scale"] if r["scale"] else None  # None: other sizes than the recipe's (--tiny)
        lines.append(
            f"| {name} | {r['script']}.py | {r['computes_in']} | {s['prompts_per_iter']} "
            f"({r['recipe']['prompts_per_iter']}) | {s['train_batch']} / {s['rollout_batch']} | "
            f"{fmt(at_size, '.3f')} | "
            f"{fmt(at_size and at_size * 100 * GPUS / 3600, '.4g')} | {fmt(it['tflops'], '.4g')} | "
            f"{fmt(it['mfu'] and 100 * it['mfu'], '.1f')}{'%' if it['mfu'] else ''} | {fmt(it['peak_gib'], '.2f')} |"
        )
    lines += [
        "",
        "| recipe | phase | s / iteration | TFLOP / iteration | TFLOP/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        for p in [*PHASES, "iteration"]:
            x = r["phases"][p]
            shown = f"**{p}**" if p == "iteration" else p
            lines.append(
                f"| {name} | {shown} | {x['seconds']:.3f} | {x['tflop']:.4g} | {fmt(x['tflops'], '.4g')} | "
                f"{fmt(x['mfu'] and 100 * x['mfu'], '.1f')}{'%' if x['mfu'] else ''} | {fmt(x['peak_gib'], '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--config",
        nargs="+",
        default=[],
        metavar="RECIPE",
        help="recipes to profile (default: every SD3.5-M recipe in configs/; with --tiny: none, the three methods)",
    )
    g.add_argument(
        "--tiny",
        action="store_true",
        help="toy-size pipeline on CPU (seconds): the methods at TINY, or each --config recipe with TINY's sizes",
    )
    g.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=list(METHODS),
        help="--tiny without --config: methods to profile",
    )
    g.add_argument("--device", default="", help="cuda or cpu (default: cuda if available; cpu with --tiny)")
    g.add_argument(
        "--dtype",
        default="",
        help="passed to every script as --dtype (default: the recipe's precision mode decides; with the recipes' "
        "--mixed-precision fp16 only float32 goes)",
    )
    g.add_argument(
        "--matmul-size",
        type=int,
        default=0,
        help="n of the n x n matmul timed for the rate (default 8192; 512 with --tiny)",
    )
    g.add_argument(
        "--script-args",
        default="",
        help='extra flags passed to every script, e.g. "--frozen-batch 32" or "--mixed-precision no" (bf16)',
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random pipeline and of the runs")
    r = parser.add_argument_group("sizes (default: each recipe's own, --iterations 2; --tiny: TINY's)")
    for key, value in TINY.items():
        r.add_argument("--" + key.replace("_", "-"), type=type(value), default=None, help=f"tiny: {value}")
    io = parser.add_argument_group("I/O")
    io.add_argument("--out", default="runs/bench_gpu", help="output folder: bench_gpu.json, bench_gpu.md, the runs")
    io.add_argument(
        "--pipeline-dir",
        default="",
        help="where to save the random pipeline (reused if it holds one); default: a temp folder",
    )
    return parser.parse_args(argv)


def profile_all(args, out):
    """Build (or reuse) the random pipeline, then per case: train it under the Profiler, measure the matmul rate in
    the dtype it computes in (once per dtype), summarise."""
    import torch

    todo = cases(args)
    with tempfile.TemporaryDirectory() as tmp:
        pipe_dir = Path(args.pipeline_dir or Path(tmp) / "pipeline")
        if not (pipe_dir / "model_index.json").exists():
            print(
                f"building a random {'tiny' if args.tiny else 'SD3.5-Medium-sized'} pipeline in {pipe_dir}", flush=True
            )
            build_dtype = "bfloat16" if args.device.startswith("cuda") else "float32"  # each run loads it in its own
            build_pipeline(pipe_dir, args.tiny, args.device, build_dtype, args.seed)
            gc.collect()
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        result = {
            "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "model": "random tiny SD3" if args.tiny else "random SD3.5-Medium-sized SD3",
            "matmul_tflops": {},
            "script_args": args.script_args,
            "rewards": "stand-ins: " + ", ".join(STAND_INS),
            "runs": {},
        }
        for case in todo:
            print(f"{case.name}: {case.module.__name__}.py {' '.join(case.flags)}", flush=True)
            rows, prof, sizes = profile_case(args, case, pipe_dir, prompts_file, out)
            dtype = compute_dtype(prof.precision)
            if dtype not in result["matmul_tflops"]:
                n = args.matmul_size or (512 if args.tiny else 8192)
                result["matmul_tflops"][dtype] = matmul_rate(args.device, getattr(torch, dtype), n) / 1e12
            result["runs"][case.name] = {
                "script": case.module.__name__,
                "flags": case.flags,
                "computes_in": dtype,
                "settings": sizes,
                "recipe": case.recipe,
                "scale": case.scale(sizes),
                "flops_per_sample": prof.per_sample,
                "transformer_params": prof.params,
                "phases": summarize(rows, prof, result["matmul_tflops"][dtype] * 1e12),
            }
            gc.collect()  # the run's pipeline, before the next one loads
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return result


def main(argv=None):
    import torch

    args = parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("SD3.5-Medium size needs a CUDA GPU and none is used here: run with --tiny on a CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # toy tensors: threads only add synchronisation (5x slower on 2 busy cores)
    try:
        result = profile_all(args, out)
    finally:
        torch.set_num_threads(threads)
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=2))
    report = table(result)
    (out / "bench_gpu.md").write_text(report)
    print(report)
    return result


if __name__ == "__main__":
    main()
