"""SD3 with LoRA adapters: the model file under DiffusionNFT (nft.py), for SD3.5-Medium and the embedded tiny SD3.

Loading (the diffusers pipeline, frozen VAE and text encoders, LoRA adapters "default" (trained), "old" (sampling) and
"ema" on the transformer), precision (--mixed-precision, --dtype) and the gradient scaler, the sampler's sigmas, the
transformer call (`velocity`: timestep = 1000 t, dtype, chunks) and its autocast, text encoding, decoding, the LoRA
parameters and the adapter copy (DiffusionNFT's soft update), and `pipeline_from_configs`, the one builder of a random
SD3 pipeline from configs (the tests' tiny one, the embedded world's before its training, the GPU profiler's
SD3.5-M-shaped one). diffusers, transformers and peft load where first used.

Shapes: latents x (N, C, h, w) float32 (C = 16 for SD3.5-M, 4 for the embedded model); sigmas s (N,) in [0, 1] (t = 1
is pure noise; the transformer takes timestep 1000 s); text conditioning emb (N, L, D), pooled (N, D').
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

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


def autocast(prec: Precision, device_type):
    """The context of the transformer's forwards and the decodes (a run's `run.autocast()`): `torch.autocast` with
    --mixed-precision fp16, else none (the weights' own dtype)."""
    return torch.autocast(device_type, dtype=prec.autocast) if prec.autocast else contextlib.nullcontext()


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


def pipeline_from_configs(transformer, vae, clips, t5, tokenizers, seed=0, device="cpu"):
    """A random StableDiffusion3Pipeline of the real diffusers classes from configs (diffusers' get_dummy_components
    pattern; nothing downloaded): the tests' tiny pipeline (conftest.py), the GPU profiler's SD3.5-M-shaped one
    (experiments/bench_gpu.py). transformer, vae: SD3Transformer2DModel and AutoencoderKL config dicts; clips: two
    CLIPTextConfig dicts (CLIP-L, CLIP-G), t5: a T5Config dict; tokenizers: (CLIP-L's, CLIP-G's, T5's), built by the
    caller from a vocabulary. seed: an int (torch.manual_seed once, then the modules created on `device` in the order
    transformer, VAE, CLIP-L, CLIP-G, T5), or one seed per module {"transformer": .., "vae": .., "text_encoder": ..,
    "text_encoder_2": .., "text_encoder_3": ..} (the embedded world's build); the scheduler is SD3's (shift 3)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    make = dict(
        transformer=lambda: SD3Transformer2DModel(**transformer),
        vae=lambda: AutoencoderKL(**vae),
        text_encoder=lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clips[0])),
        text_encoder_2=lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clips[1])),
        text_encoder_3=lambda: T5EncoderModel(T5Config(**t5)),
    )
    seeds = seed if isinstance(seed, dict) else None
    if seeds is None:
        torch.manual_seed(seed)
    modules = {}
    with torch.device(device):
        for name in make:
            if seeds is not None:
                torch.manual_seed(seeds[name])
            modules[name] = make[name]()
    names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    return StableDiffusion3Pipeline(
        **modules, **dict(zip(names, tokenizers)), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0)
    )
