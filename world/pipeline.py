"""The shipped pipeline: where the world's assets are, the settings it was trained for (GEN_KWARGS), its id
(world_id), and loading, prompting, sampling and the VAE's round trip. torch and diffusers are imported inside the
functions that need them.

Latents follow SD3: the pipeline's scaled latent is ``x = (z - shift_factor) * scaling_factor`` with z the VAE
posterior mean; the VAE config's factors are set so that x has about zero mean and unit variance over the world.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image

from world.checker import _as_array
from world.grammar import RES

ROOT = Path(__file__).resolve().parent
ASSETS = ROOT / "assets"
PIPELINE_DIR = ASSETS / "shapes-sd3"
JUDGE_PATH = ASSETS / "judge.safetensors"
PREF_PATH = ASSETS / "pref_judge.safetensors"
PROFILES_PATH = ASSETS / "profiles.json"
"""The pretrained model's level statistics (experiments/protocol.py's measure_profiles: 192 groups per inner level, the
default tree sampler, 10 steps; a copy of experiments/results/world-design/profiles192/profiles.json): recast.py's
--gain-init world starts W from them."""
WORLD_FILE = "world.json"
"""The plugin contract: a pipeline folder that is a world's model holds this file, {"module": NAME} (and a "note"),
NAME the importable module that is its world (the interface of world/__init__.py: rewards, judges, prompts,
GEN_KWARGS, ...): "world" for the shipped folder, the variant's experiment module for a world variant. world_id
leaves it out, so that naming the module changes no world's id."""

GEN_KWARGS = dict(height=RES, width=RES, num_inference_steps=10, guidance_scale=1.0, max_sequence_length=10)
"""Pipeline-call arguments the model was trained for: ``pipe(prompts, **GEN_KWARGS)``.
``max_sequence_length=10`` matters: the transformer saw 10 T5 tokens; the pipeline's
default 256 lets the random T5 turn padding into features (accuracy falls to ~6%)."""
TEXT_LEN = 10  # CLIP and T5 tokens per prompt (incl. special tokens)


def write_world_file(folder: str | Path, module: str, note: str | None = None) -> Path:
    """The plugin contract's WORLD_FILE in a pipeline folder: {"module": module, "note": note}. Returns its path."""
    path = Path(folder) / WORLD_FILE
    path.write_text(json.dumps({"module": module, **({"note": note} if note else {})}, indent=1) + "\n")
    return path


def world_id(path: str | Path = PIPELINE_DIR) -> str:
    """Which embedded world a result was measured on: the first 12 hex digits of the SHA-256 of every file of the
    pipeline folder (names and bytes; hidden files such as locks and the folder's WORLD_FILE skipped). A rebuild
    gives a new id; bench.py refuses to mix results of two worlds."""
    path, h = Path(path), hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if f.relative_to(path).as_posix() == WORLD_FILE:
            continue
        h.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def load_pipeline(path: str | Path = PIPELINE_DIR, device: str = "cpu"):
    """The shipped pipeline, loaded exactly as the real one (offline), progress bar off."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_prompts(pipe, prompts: list[str]):
    """(prompt_embeds (N, 20, 64), pooled (N, 64)) exactly as the pipeline computes them
    under GEN_KWARGS (``pipe.encode_prompt`` with max_sequence_length=10, no CFG)."""
    import torch

    with torch.no_grad():
        pe, _, pooled, _ = pipe.encode_prompt(
            prompts,
            None,
            None,
            do_classifier_free_guidance=False,
            max_sequence_length=GEN_KWARGS["max_sequence_length"],
            device=pipe._execution_device,
        )
    return pe, pooled


def generate(pipe, prompts: list[str], seed: int = 0, batch: int = 64, **overrides) -> list:
    """Images for prompts with GEN_KWARGS (overridable); one CPU generator seeded once."""
    import torch

    g = torch.Generator().manual_seed(seed)
    kw = {**GEN_KWARGS, **overrides}
    out = []
    for i in range(0, len(prompts), batch):
        out += list(pipe(prompts[i : i + batch], generator=g, **kw).images)
    return out


def _images_to_tensor(images: list):
    import torch

    a = np.stack([_as_array(i) for i in images]) / 127.5 - 1.0
    return torch.from_numpy(a).permute(0, 3, 1, 2).float()


def vae_encode(vae, images: list):
    """Raw VAE posterior means z (N, 4, 16, 16) (unscaled)."""
    import torch

    with torch.no_grad():
        return torch.cat(
            [vae.encode(_images_to_tensor(images[i : i + 256])).latent_dist.mode() for i in range(0, len(images), 256)]
        )


def vae_decode(vae, z) -> list:
    """PIL images from raw (unscaled) latents z (N, 4, 16, 16)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(z), 256):
            out += _tensor_to_images(vae.decode(z[i : i + 256]).sample)
    return out


def _tensor_to_images(x) -> list:
    a = ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(v) for v in a]
