"""Profile ReCAST, DiffusionNFT and DiffusionRVGE on SD3.5-Medium: time, memory and MFU per phase.

    # one GPU: SD3.5-M-sized random pipeline, README's recipe
    python experiments/bench_gpu.py
    # does a bigger micro-batch fit, and is it faster?
    python experiments/bench_gpu.py --train-batch 16 --rollout-batch 32
    # the same code on CPU at toy size (what the test runs)
    python experiments/bench_gpu.py --tiny

Run it on one GPU of the kind you mean to rent, before renting a cluster of them: it says whether
a micro-batch fits (peak memory per phase), where an iteration's time goes (rollout, reward,
gains+W, update) and what share of the GPU's matrix rate the loop achieves (MFU). Size
--train-batch / --rollout-batch from it, and the budget: GPU-hours ~ iterations x seconds per
iteration / 3600 per GPU (prompt groups never straddle processes, so each GPU runs this loop).

What it builds (nothing is downloaded): a StableDiffusion3Pipeline with random weights of
SD3.5-Medium's transformer config (assets/sd3.5-medium-transformer.json) and VAE shape (16 latent
channels, 8x downsampling), and text encoders with the real widths and sequence lengths (CLIP-L
768, CLIP-G 1280, T5-XXL 4096; 77 and 256 tokens) but 1-2 layers: they run once per prompt, and a
shallow stack keeps the build and the disk small. Random weights cost the same FLOPs as trained ones.

What it runs: recast.train and rvge.train themselves (recast --credit recast, recast --credit nft,
rvge), a few iterations each at the recipe's settings, with STAND-IN rewards (image statistics
that cost ~nothing: real reward models add their own time to the reward phase). Phase times are
the loop's own metrics (time/rollout, time/reward, time/gains_W or rvge's time/regression,
time/update); bench_gpu only wraps the loop's rollout, decode and update functions to synchronise
CUDA at their end (so kernels still queued are charged to the phase that launched them), record
each phase's peak memory (torch.cuda.max_memory_allocated) and count what passes through the models.

FLOPs: torch.utils.flop_counter.FlopCounterMode counts one transformer forward (no grad), one
forward + backward (the trained LoRA adapter active, as in the update: the backward computes
input gradients through every frozen layer but weight gradients only for the LoRA) and one VAE
decode, at batch 1 and the run's resolution. SD3.5-M at 512 px (counted on the meta device):
forward 2.47 TFLOP with the LoRA, forward + backward 5.26 (2.13x, not the 3x of full
fine-tuning), VAE decode 2.51 TFLOP per image (decoding 48 leaves is not free). Hooks count the
samples the loop pushes through the transformer in each phase (with and without grad) and the
images it decodes; phase FLOPs = counts x FLOPs per sample. Text encoders and rewards are not
counted (their time is). Achieved TFLOP/s = FLOPs / seconds; MFU = that / the dense matmul rate
measured here on the same device and dtype (torch.matmul of two n x n matrices). The first
iteration (warm-up: kernel selection, allocator) is left out of the averages. Writes
--out/bench_gpu.json and --out/bench_gpu.md (also printed).
"""

import argparse
import gc
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python experiments/bench_gpu.py`: the scripts
import recast  # noqa: E402
import rvge  # noqa: E402

METHODS = {  # name -> (module, flags)
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
# The README's SD3.5-M recipe (groups of 24 = 3 roots x 2^3 branches, 2 prompts per process),
# and the toy size --tiny runs on CPU. Every entry is a flag of this script.
RECIPE = dict(
    resolution=512,
    steps=10,
    max_sequence_length=256,
    prompts_per_iter=2,
    n_roots=3,
    n_branch=2,
    branch_steps="2,4,6",
    rollout_batch=8,
    train_batch=8,
    train_steps_per_leaf=4,
    lora_rank=32,
    lora_alpha=64,
    lr=3e-4,
    iterations=3,
)
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
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5Tokenizer,
    )

    torch.manual_seed(seed)
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
    with torch.device(device):
        text_encoders = [
            CLIPTextModelWithProjection(
                CLIPTextConfig(
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
            )
            for h, i, a, n, p, act in clips
        ]
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_pieces), **(TINY_T5 if tiny else SD35M_T5)))
        transformer = SD3Transformer2DModel.from_config(t_cfg)
        vae = AutoencoderKL(**(TINY_VAE if tiny else SD35M_VAE))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=text_encoders[0],
        tokenizer=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=clips[0][4]),
        text_encoder_2=text_encoders[1],
        tokenizer_2=CLIPTokenizer(vocab=vocab, merges=[], model_max_length=clips[1][4]),
        text_encoder_3=t5,
        tokenizer_3=T5Tokenizer(vocab=t5_pieces, model_max_length=TINY["max_sequence_length"] if tiny else 256),
    )
    for module in (transformer, vae, t5, *text_encoders):
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


STAND_INS = {"brightness": brightness, "redness": redness, "contrast": contrast, "saturation": saturation}


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


def flops_per_sample(run, module, decode):
    """FLOPs of one transformer forward (no grad), one forward + backward with the trained "default"
    adapter (as in the update), and one VAE decode, at batch 1 and the run's latent shape."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    count_cpu_attention()
    emb, pooled = module.encode(run.pipe, PROMPTS[:1], run.max_len, run.acc.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((1, *run.shape), generator=gen).to(emb.device)
    s = torch.full((1,), 0.5, device=emb.device)
    run.transformer.set_adapter("default")
    with torch.no_grad(), FlopCounterMode(display=False) as forward:
        module.velocity(run.transformer, x, s, emb, pooled)
    with FlopCounterMode(display=False) as forward_backward:
        module.velocity(run.transformer, x, s, emb, pooled).pow(2).mean().backward()
    for p in module.lora_params(run.transformer, "default"):
        p.grad = None  # the optimizer's first step must not see this gradient
    with FlopCounterMode(display=False) as vae:
        decode(run.pipe, x)
    return {
        "transformer_forward": forward.get_total_flops(),
        "transformer_forward_backward": forward_backward.get_total_flops(),
        "vae_decode": vae.get_total_flops(),
    }


class Profiler:
    """Instruments one script module (recast or rvge) while its `train` runs: patches the module-level
    functions the loop calls (it looks them up at call time) with wrappers that set the current phase,
    synchronise CUDA at the end and record the phase's peak memory; hooks on the transformer and the
    VAE decoder count samples per phase. `iterations[i]` holds iteration i's counts and peaks."""

    PHASE_OF = {"tree_rollout": "rollout", "decode": "reward", "nft_update": "update", "rvge_update": "update"}

    def __init__(self, module):
        self.module, self.orig, self.hooks, self.phase, self.iterations = module, {}, [], None, []
        self.per_sample, self.params, self.cuda = {}, 0, False

    def __enter__(self):
        for name in ["setup_run", *self.PHASE_OF]:
            if hasattr(self.module, name):
                self.orig[name] = getattr(self.module, name)
                setattr(self.module, name, self._setup_run if name == "setup_run" else self._wrap(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self.orig.items():
            setattr(self.module, name, fn)
        for h in self.hooks:
            h.remove()

    def _setup_run(self, *a, **k):
        run = self.orig["setup_run"](*a, **k)
        self.cuda = run.acc.device.type == "cuda"
        self.params = sum(p.numel() for n, p in run.transformer.named_parameters() if "lora_" not in n)
        self.per_sample = flops_per_sample(run, self.module, self.orig["decode"])
        self.hooks = [
            run.transformer.register_forward_pre_hook(self._count_transformer, with_kwargs=True),
            run.pipe.vae.decoder.register_forward_pre_hook(self._count_decode),
        ]
        return run

    def _wrap(self, name):
        import torch

        phase, fn = self.PHASE_OF[name], self.orig[name]

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
# Runs and the summary
# =============================================================================


def method_argv(args, recipe, pipe_dir, prompts_file, out):
    flags = {
        "--model": pipe_dir,
        "--rewards": ",".join(STAND_INS),
        "--budgets": "0.4,0.3,0.2,0.1",
        "--train-prompts": prompts_file,
        "--eval-every": 0,
        "--save-every": recipe["iterations"],
        "--out": out,
        "--device": args.device,
        "--seed": args.seed,
    }
    flags.update({"--" + k.replace("_", "-"): v for k, v in recipe.items()})
    return [str(x) for kv in flags.items() for x in kv] + shlex.split(args.script_args)


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


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table(result):
    """The markdown report: setup lines, then one row per (method, phase)."""
    F, s = result["flops_per_sample"], result["settings"]
    lines = [
        f"# bench_gpu: {result['device_name']} ({result['dtype']}), {result['model']}",
        "",
        f"- transformer {result['transformer_params'] / 1e6:.4g}M parameters; one forward at {s['resolution']} px: "
        f"{F['transformer_forward'] / 1e12:.4g} TFLOP, forward + backward (LoRA): "
        f"{F['transformer_forward_backward'] / 1e12:.4g} TFLOP "
        f"(x{F['transformer_forward_backward'] / F['transformer_forward']:.2f}); "
        f"VAE decode {F['vae_decode'] / 1e12:.4g} TFLOP per image",
        f"- measured matmul rate ({result['dtype']}): {result['matmul_tflops']:.4g} TFLOP/s (the MFU denominator)",
        f"- recipe: {', '.join(f'{k}={v}' for k, v in s.items())}; {result['script_args'] or 'no extra script flags'}",
        f"- rewards are STAND-INS ({', '.join(STAND_INS)}: image statistics); "
        "real reward models add their time to `reward`",
        f"- means over iterations 2..{s['iterations']} (iteration 1 is warm-up); "
        "`gains+W` is rvge's time/regression for rvge",
        "",
        "| method | phase | s / iteration | TFLOP / iteration | TFLOP/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, phases in result["methods"].items():
        for p in [*PHASES, "iteration"]:
            r = phases[p]
            name = f"**{p}**" if p == "iteration" else p
            lines.append(
                f"| {method} | {name} | {r['seconds']:.3f} | {r['tflop']:.4g} | {fmt(r['tflops'], '.4g')} | "
                f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | {fmt(r['peak_gib'], '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = parser.add_argument_group("what to run")
    g.add_argument(
        "--tiny",
        action="store_true",
        help="toy-size pipeline and recipe on CPU (seconds); the flags below still override",
    )
    g.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to profile")
    g.add_argument("--device", default="", help="cuda or cpu (default: cuda if available; cpu with --tiny)")
    g.add_argument(
        "--dtype",
        default="",
        help="frozen weights' dtype (default: bfloat16 on cuda, float32 on cpu); also the matmul rate's",
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
        help='extra flags passed to every script, e.g. "--frozen-batch 32" (before/after a change)',
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random pipeline and of the runs")
    r = parser.add_argument_group("recipe (default: the README's SD3.5-M recipe; --tiny: toy values)")
    for key, value in RECIPE.items():
        r.add_argument(
            "--" + key.replace("_", "-"), type=type(value), default=None, help=f"recipe {value}, tiny {TINY[key]}"
        )
    io = parser.add_argument_group("I/O")
    io.add_argument("--out", default="runs/bench_gpu", help="output folder: bench_gpu.json, bench_gpu.md, the runs")
    io.add_argument(
        "--pipeline-dir",
        default="",
        help="where to save the random pipeline (reused if it holds one); default: a temp folder",
    )
    return parser.parse_args(argv)


def profile_all(args, recipe, out):
    """Build (or reuse) the random pipeline, measure the matmul rate, train each method under the Profiler."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        pipe_dir = Path(args.pipeline_dir or Path(tmp) / "pipeline")
        if not (pipe_dir / "model_index.json").exists():
            print(
                f"building a random {'tiny' if args.tiny else 'SD3.5-Medium-sized'} pipeline in {pipe_dir}", flush=True
            )
            build_pipeline(pipe_dir, args.tiny, args.device, args.dtype, args.seed)
            gc.collect()
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        rate = matmul_rate(args.device, getattr(torch, args.dtype), args.matmul_size or (512 if args.tiny else 8192))
        result = {
            "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
            "dtype": args.dtype,
            "model": "random tiny SD3" if args.tiny else "random SD3.5-Medium-sized SD3",
            "matmul_tflops": rate / 1e12,
            "settings": recipe,
            "script_args": args.script_args,
            "rewards": "stand-ins: " + ", ".join(STAND_INS),
            "methods": {},
        }
        for method in args.methods:
            module, flags = METHODS[method]
            run_dir = out / "runs" / method
            argv_m = method_argv(args, recipe, pipe_dir, prompts_file, run_dir) + ["--dtype", args.dtype] + flags
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            with Profiler(module) as prof:
                module.train(module.parse_args(argv_m), extra_rewards=STAND_INS)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            result["methods"][method] = summarize(rows, prof, rate)
            result.update(flops_per_sample=prof.per_sample, transformer_params=prof.params)
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
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    recipe = {
        k: v if getattr(args, k) is None else getattr(args, k) for k, v in (TINY if args.tiny else RECIPE).items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # toy tensors: threads only add synchronisation (5x slower on 2 busy cores)
    try:
        result = profile_all(args, recipe, out)
    finally:
        torch.set_num_threads(threads)
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=2))
    report = table(result)
    (out / "bench_gpu.md").write_text(report)
    print(report)
    return result


if __name__ == "__main__":
    main()
