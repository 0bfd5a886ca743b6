"""Atomic checkpoints of a run (the LoRA as diffusers loads it, the optimizer, the run's state) and loading the newest
intact one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

import sd3
from kit.records import metrics_lines, run_identity


def checkpoint_dir(out, iteration):
    """A run's checkpoint folder for `iteration`: <out>/checkpoints/iter_N (N zero-padded to 6 digits)."""
    return Path(out) / "checkpoints" / f"iter_{iteration:06d}"


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
    final = checkpoint_dir(out, iteration)
    root, tmp = final.parent, final.with_name(final.name + ".tmp")
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
            sd3.copy_adapter(transformer, "default", "ema")
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
