"""Evaluate a checkpoint of a run, or the pretrained model, as the run's own evaluations do: the run's held-out
prompts, noise (session.EVAL_SEED), sampler and weights (the EMA with --ema), its training rewards and held-out judges.
On the run's settings the numbers are the eval/* the run logged at that iteration (eval_before/* with --base).

    python evaluate.py runs/recast-recast-0                       # the run's newest checkpoint
    python evaluate.py runs/recast-recast-0/checkpoints/iter_000099 --eval-steps 40 --eval-prompts heldout.txt
    python evaluate.py runs/recast-recast-0 --base                # the pretrained model, with the run's settings
    accelerate launch --num_processes 8 evaluate.py runs/recast-recast-0   # the prompts split over processes
    python evaluate.py my_lora --config configs/nft-pickscore.yaml          # a diffusers or PEFT LoRA folder
    python evaluate.py logs/nft/sd3/geneval/checkpoints/checkpoint-300 --config configs/nft-geneval.yaml
    python evaluate.py runs/recast-recast-0 --guidance-scale 4.5            # with CFG (FlowGRPO's reported setting)

A LoRA folder that is no run's (diffusers', PEFT's, DiffusionNFT's checkpoint-N: `find_lora`) is evaluated with the
settings of --config (a recipe, or a run's config.json: model, held-out prompts, rewards, steps, resolution); its
result goes beside the folder (checkpoint-N's: eval-checkpoint-N.json in its checkpoints/). With a GenEval reward the
result adds DiffusionNFT's accuracies as judges (eval/judge/geneval_*; `reward_models.geneval_judges`).

Writes <run>/eval-<checkpoint>.json (the metrics and every image's rewards), the first samples beside it as .png,
and prints a table beside what the run logged. Everything is checked before any model loads: the checkpoint (a run
folder gives its newest loadable one, as --resume finds it, and says which; a run still training may rotate
checkpoints meanwhile), and the result path (never one of the run's own files; an earlier result only with --replace;
two evaluations of one checkpoint at once never write over each other: the second is refused).
"""

import argparse
import functools
import importlib
import json
import os
import re
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import yaml

import nft
import sd3
from kit import checks, figures, flags, folders, records, reward_models, session, worlds

OWN_FLAGS = (
    "--base",
    "--config",
    "--eval-prompts",
    "--eval-steps",
    "--guidance-scale",
    "--device",
    "--json",
    "--replace",
)


def parse_flags(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint",
        help="a run folder (its newest checkpoint), one of its checkpoints/iter_N, or a LoRA folder (diffusers', "
        "PEFT's, DiffusionNFT's checkpoint-N) with --config",
    )
    parser.add_argument("--base", action="store_true", help="the pretrained model (no LoRA), with the run's settings")
    parser.add_argument("--config", help="for a LoRA folder: the recipe or run config.json whose settings evaluate it")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=1.0,
        help='classifier-free guidance g, v = v("") + g (v(c) - v("")) (default 1: CFG-free, as the runs sample)',
    )
    parser.add_argument("--eval-prompts", help="file of held-out prompts, one per line (default: the run's)")
    parser.add_argument("--eval-steps", type=int, help="Euler steps of the sampler (default: the run's)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--json",
        help="where to write the results, a .json path (default <run>/eval-<checkpoint>.json; the samples beside it "
        "as .png); inside the run folder only <run>/eval-*.json",
    )
    parser.add_argument("--replace", action="store_true", help="write over an earlier result file (default: refuse)")
    return parser.parse_args(argv)


def is_run_path(path):
    """Whether `path` is a run folder (config.json) or one of its checkpoints/iter_N (state.pt)."""
    return (Path(path) / "config.json").exists() or (Path(path) / "state.pt").is_file()


def find_checkpoint(path, base=False):
    """(run folder, checkpoint folder) of one of a run's checkpoints/iter_N, or (run folder, None) of a run folder
    (its newest loadable checkpoint: `read_checkpoint`; with base=True, --base, none is needed: the pretrained model is
    evaluated on the run's settings); SystemExit naming the path and what it should be, or the damaged config.json."""
    path = Path(path)
    run = path if (path / "config.json").exists() else path.parent.parent if (path / "state.pt").is_file() else None
    if run is None:
        raise SystemExit(
            f"{path}: neither a run folder (with config.json), one of its checkpoints/iter_N folders, nor a LoRA "
            "folder (diffusers' pytorch_lora_weights.safetensors, PEFT's adapter_config.json, DiffusionNFT's "
            "checkpoint-N/lora)"
        )
    if not folders.is_run(run):
        raise SystemExit(
            f"{run / 'config.json'} is damaged (not a run's record: JSON with its args and script); repair it, or "
            "copy it from a backup (the checkpoints are not affected)"
        )
    if run == path and not base:
        root = path / "checkpoints"
        if not (root / "latest").is_file() and not any(root.glob("iter_??????")):
            raise SystemExit(f"{path}: the run has no checkpoint yet; evaluate the pretrained model with --base")
        return path, None
    return run, path


@dataclass
class Lora:
    """A LoRA folder that is no run's checkpoint (`find_lora`)."""

    folder: Path  # what holds the weights
    layout: str  # "diffusers" (pytorch_lora_weights.safetensors) or "peft" (adapter_config.json + adapter_model.*)
    weights: Path  # the weights file
    label: str  # the result's name: the folder's, or DiffusionNFT's checkpoint-N
    results: Path  # where the result goes by default: beside the folder (DiffusionNFT's: in its checkpoints/)


def find_lora(path):
    """The LoRA folder at `path` (a `Lora`), or None: diffusers' layout (pytorch_lora_weights.safetensors, what
    pipe.load_lora_weights reads), PEFT's (adapter_config.json with adapter_model.safetensors or .bin, what
    save_pretrained writes), or DiffusionNFT's checkpoint-N (its lora/, PEFT's layout; lora/old/ is not read)."""
    path = Path(path)
    nft_layout = re.fullmatch(r"checkpoint-\d+", path.name) and (path / "lora").is_dir()
    folder = path / "lora" if nft_layout else path
    label = path.name if nft_layout else path.parent.name if path.name == "lora" else path.name
    results = folder.parent.parent if re.fullmatch(r"checkpoint-\d+", folder.parent.name) else folder.parent
    if (folder / "pytorch_lora_weights.safetensors").is_file():
        return Lora(folder, "diffusers", folder / "pytorch_lora_weights.safetensors", label, results)
    if (folder / "adapter_config.json").is_file():
        weights = [folder / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()]
        if not weights:
            raise SystemExit(f"{folder}: adapter_config.json but no adapter_model.safetensors or .bin beside it")
        return Lora(folder, "peft", weights[0], label, results)
    return None


def load_lora(transformer, lora):
    """The LoRA of `lora` as the transformer's adapter "default" (the run's fresh one removed first), its weights in
    float32 as a run keeps them: diffusers' loader (load_lora_adapter) for both layouts; PEFT's keys
    (base_model.model.<module>...) as the transformer's own (<module>...) and its adapter_config.json passed as the
    LoraConfig (rank, alpha, targets)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    if lora.layout == "diffusers":
        source, how = str(lora.folder), dict(prefix="transformer", weight_name=lora.weights.name)
    else:  # PEFT's keys base_model.model.<module>... are the transformer's own <module>...
        weights = str(lora.weights)
        state = (
            load_file(weights) if weights.endswith(".safetensors") else torch.load(weights, "cpu", weights_only=True)
        )
        source = {k.removeprefix("base_model.model."): v for k, v in state.items()}
        how = dict(prefix=None, metadata=LoraConfig.from_pretrained(str(lora.folder)).to_dict())
    with warnings.catch_warnings():  # the run's adapters make way for the evaluated one: by design, not a slip
        warnings.filterwarnings("ignore", message="Adapter default was active|Already found a `peft_config`")
        transformer.delete_adapters(["default"])
        transformer.load_lora_adapter(source, adapter_name="default", **how)
    for p in sd3.lora_params(transformer, "default"):
        p.data = p.data.float()
    transformer.set_adapter("default")


def given_flags(cli, Args):
    """evaluate.py's flags that are also the script's (--eval-prompts, --eval-steps, --device), where given."""
    return {f.name: getattr(cli, f.name) for f in fields(Args) if getattr(cli, f.name, None) is not None}


def lora_args(cli, lora):
    """The settings a LoRA folder is evaluated with: --config's (a recipe or a run's config.json, parsed by the script
    its `script:` names), then evaluate.py's own flags; CFG-free and no EMA (the folder's weights are the ones
    evaluated). Returns (script name, Args). SystemExit without --config, naming what to give."""
    if not cli.config:
        raise SystemExit(
            f"{lora.folder} is a LoRA folder ({lora.layout}'s layout), not a run's: give --config FILE, a recipe (e.g. "
            "configs/nft-pickscore.yaml) or a run's config.json, for the model, held-out prompts and rewards"
        )
    if not Path(cli.config).is_file():
        raise SystemExit(f"--config {cli.config}: no such file; give a recipe from configs/ or a run's config.json")
    text = yaml.safe_load(Path(cli.config).read_text())
    name = text.get("script", "recast") if isinstance(text, dict) else "recast"
    if name not in ("recast", "rvge"):
        raise SystemExit(f"--config {cli.config}: script {name!r} is neither recast nor rvge")
    args = importlib.import_module(name).parse_args(["--config", cli.config])
    args = replace(args, **given_flags(cli, args), out=str(lora.results), resume="", report_to="none", ema=False)
    if not args.eval_prompts and not worlds.is_embedded(args.model):
        raise SystemExit(f"--config {cli.config} names no held-out prompts: give --eval-prompts FILE")
    return name, replace(args, train_prompts=args.eval_prompts)  # not trained: the run's loader reads a prompt file


def read_checkpoint(out, ckpt=None, attempts=3):
    """(checkpoint folder, its state.pt) read into memory before any model loads: `ckpt`, or the newest loadable
    checkpoint of the run folder `out` as --resume finds it (the one `latest` names, else the newest iter_N whose
    state.pt loads; says which it used). A training run rotates its checkpoints while this reads: a checkpoint
    deleted under it is passed over and the folder looked at again (up to `attempts` times). A checkpoint that another
    run or script wrote (its state.pt's "run" against config.json; older checkpoints record none) is refused."""
    root, tried = out / "checkpoints", []
    for _ in range(attempts):
        latest = root / "latest"
        try:
            named = [root / latest.read_text().strip()] if ckpt is None and latest.is_file() else []
        except OSError:
            named = []
        older = sorted((p for p in root.glob("iter_??????") if p not in named), reverse=True) if ckpt is None else []
        candidates, gone = [ckpt] if ckpt else named + older, False
        for candidate in candidates:
            try:
                state = torch.load(candidate / "state.pt", weights_only=False, map_location="cpu")
            except Exception as err:  # truncated, corrupt, or rotated away under us: try the next older one
                gone |= isinstance(err, FileNotFoundError)
                tried.append(f"{candidate.name} ({type(err).__name__})")
                print(f"checkpoint {candidate} is not loadable ({type(err).__name__}); trying an older one")
                continue
            check_identity(out, candidate, state.get("run"))
            if candidates[0] != candidate:
                print(f"evaluating {candidate.name}, the newest loadable checkpoint of {out}")
            return candidate, state
        if not gone:
            break
    raise SystemExit(
        f"{ckpt or out}: no loadable checkpoint ({', '.join(tried) or 'none found'}). Give another checkpoints/iter_N "
        "folder, or evaluate the pretrained model with --base"
    )


def check_identity(out, ckpt, written_by):
    """SystemExit when state.pt's "run" (records.run_identity of the run that wrote it) is another run's or another
    script's than the run folder's config.json."""
    here = records.run_identity(out)
    if written_by is None or written_by == here:
        return
    raise SystemExit(
        f"{ckpt} was written by another run ({written_by['script']}.py, run {written_by['run_id']}), not by {out} "
        f"({here['script']}.py, run {here['run_id']}): its weights do not fit this run's settings. Evaluate it from "
        "the run folder it was written in"
    )


def result_path(out, cli, label, lora=None):
    """The result file (`--json`, default <run>/eval-<label>.json; the samples go beside it as .png), checked before
    any model loads: a .json path; inside the run folder (a LoRA's own folder) only evaluate.py's own eval-*.json
    there (never the run's record: metrics.jsonl, config.json, checkpoints); no existing file unless --replace; its
    folder there and writable. SystemExit naming the path and the fix."""
    path = Path(cli.json) if cli.json else out / f"eval-{label}.json"
    if path.suffix != ".json":
        raise SystemExit(f"--json {path}: give a path ending in .json (the samples are written beside it, as .png)")
    guard, what = (lora.folder, "LoRA folder") if lora else (out, "run folder")
    where, run = path.resolve(), guard.resolve()
    if run in where.parents and not (where.parent == run and where.name.startswith("eval-")):
        raise SystemExit(
            f"--json {path} lies inside the {what} {guard} and is not one of evaluate.py's results "
            f"({guard}/eval-*.json): it could replace the {what}'s own files. Choose a path outside it, or "
            f"{guard}/eval-<name>.json"
        )
    existing = [p for p in (path, path.with_suffix(".png")) if p.exists() or p.is_symlink()]
    if existing and (not cli.replace or not all(p.is_file() for p in existing)):
        raise SystemExit(
            f"{existing[0]} exists (an earlier evaluation?). Give --replace to write over it, or --json another path"
            if all(p.is_file() for p in existing)
            else f"{existing[0]} is not a file; choose another --json path"
        )
    if not path.parent.is_dir():
        raise SystemExit(f"--json {path}: the folder {path.parent} does not exist; create it, or choose another path")
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(f"--json {path}: the folder {path.parent} is not writable; choose another path")
    return path


def claim_result(path):
    """An exclusive lock on <path>.lock for this process's lifetime (released by `release`, which removes the file; a
    killed process's lock is released with it): two evaluate.py of one checkpoint would both pass result_path's
    check, then write over each other. Returns (the open lock file, its path). SystemExit when another holds it."""
    lock = path.with_name(path.name + ".lock")
    refusal = (
        f"another evaluate.py is writing {path} (it holds {lock}): wait for it to finish, or give --json another path"
    )
    return folders.exclusive_lock(lock, refusal), lock


def release(claim):
    """The end of `claim_result`'s lock: its file removed, then the lock released."""
    handle, lock = claim
    lock.unlink(missing_ok=True)
    handle.close()


def write_result(path, text, replace):
    """The result file: with --replace written over (atomically); else created only where no file is (a link of a
    complete .tmp, exclusive), so that a result another evaluation wrote meanwhile is never replaced (SystemExit)."""
    if replace:
        records.write_atomic(path, text)
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.link(tmp, path)
    except FileExistsError:
        raise SystemExit(
            f"{path} was written meanwhile (another evaluation?); this evaluation's result is not written. Give "
            "--replace to write over it, or --json another path"
        ) from None
    except OSError:  # a file system without hard links: the check under the claim, then the atomic write
        if path.exists():
            raise SystemExit(
                f"{path} was written meanwhile (another evaluation?); give --replace, or --json another path"
            )
        records.write_atomic(path, text)
    finally:
        tmp.unlink(missing_ok=True)


def in_own_terms(err, out):
    """A check's SystemExit whose fix names flags evaluate.py does not take (they are the run's settings, from its
    config.json), with a line that says so."""
    text = str(err.code)
    foreign = sorted({f for f in re.findall(r"--[a-z][a-z0-9-]*", text) if f not in OWN_FLAGS})
    if not foreign:
        return err
    return SystemExit(
        f"{text}\n(evaluate.py: {', '.join(foreign)} {'is the run' if len(foreign) == 1 else 'are the run'}'s "
        f"setting{'' if len(foreign) == 1 else 's'}, from {out}/config.json; evaluate.py takes only "
        f"{', '.join(OWN_FLAGS)})"
    )


def run_args(cli, out):
    """The settings a run's checkpoint is evaluated with: its config.json's, then evaluate.py's own flags. Returns
    (script name, Args)."""
    config = json.loads((out / "config.json").read_text())
    script = importlib.import_module(config["script"])
    _, saved = flags.read_run_config(out / "config.json", script.Args)
    known, given = {f.name for f in fields(script.Args)}, given_flags(cli, script.Args)
    try:
        saved = flags.model_after_a_move(saved, given, out)  # the embedded model, moved with the project
    except SystemExit as err:
        raise in_own_terms(err, out) from None
    saved = {k: v for k, v in saved.items() if k in known}
    return config["script"], script.Args(**{**saved, **given, "out": str(out), "resume": "", "report_to": "none"})


def main(argv=None, extra_rewards=None, judges=None):
    cli = parse_flags(argv)
    lora = None if is_run_path(cli.checkpoint) else find_lora(cli.checkpoint)
    if lora is None:
        out, ckpt = find_checkpoint(cli.checkpoint, cli.base)
        script, args = run_args(cli, out)
    else:
        (script, args), out, ckpt = lora_args(cli, lora), lora.results, None
    try:
        names, budgets, branch = checks.check_common(args, extra_rewards)
        checks.check_files(args, names)
    except SystemExit as err:
        raise in_own_terms(err, out) from None
    ckpt, state = (None, None) if cli.base or lora else read_checkpoint(out, ckpt)
    label = "base" if cli.base else lora.label if lora else ckpt.name
    path = result_path(out, cli, label, lora)  # before the model loads
    first = folders.is_first_process(args)  # the one that writes the result (every process evaluates its share)
    claim = claim_result(path) if first else None  # a second evaluate.py of the same result is refused here
    if "geneval" in names and not worlds.is_embedded(args.model) and "geneval" not in (extra_rewards or {}):
        prompts = checks.read_prompts(args.eval_prompts, "--eval-prompts")
        judges = {**(judges or {}), **reward_models.geneval_judges(args, prompts)}  # DiffusionNFT's accuracies
    try:
        if first:
            result_path(
                out, cli, label, lora
            )  # again, under the claim: another evaluate.py may have finished meanwhile
        setting = (names, budgets, branch, state, label, lora)
        return evaluate_into(path, cli, out, script, args, setting, extra_rewards, judges)
    finally:
        if claim:
            release(claim)


def guided(sample, scale, uncond):
    """`sample` (nft.ode_sample) with classifier-free guidance, as diffusers' StableDiffusion3Pipeline guides:
    v = v_u + g (v_c - v_u), v_u the velocity for the empty prompt (`uncond`: its (1, L, D) and (1, D') embeddings,
    the pipeline's default negative prompt), both in one transformer call of twice the batch. g = 1: `sample` itself
    (CFG-free, as the runs sample and evaluate)."""
    if scale == 1.0:
        return sample

    def guided_transformer(transformer, hidden_states, timestep, encoder_hidden_states, pooled_projections, **kw):
        n = len(hidden_states)
        v_u, v_c = transformer(
            hidden_states=torch.cat([hidden_states, hidden_states]),
            timestep=torch.cat([timestep, timestep]),
            encoder_hidden_states=torch.cat([uncond[0].expand(n, -1, -1), encoder_hidden_states]),
            pooled_projections=torch.cat([uncond[1].expand(n, -1), pooled_projections]),
            **kw,
        )[0].chunk(2)
        return (v_u + scale * (v_c - v_u),)

    return lambda transformer, *a, **kw: sample(functools.partial(guided_transformer, transformer), *a, **kw)


def evaluate_into(path, cli, out, script, args, setting, extra_rewards, judges):
    """Evaluate the checkpoint (`state`; the LoRA folder `lora`; the pretrained model with --base) and write the
    result to `path` and its PNG (`write_result`). Returns the metrics."""
    names, budgets, branch, state, label, lora = setting
    existed = path.exists() or path.with_suffix(".png").exists()
    run = session.load_run(args, names, budgets, branch, script, extra_rewards, judges, lock=False)
    iteration = -1
    if lora and not cli.base:
        load_lora(run.transformer, lora)
    elif not cli.base:
        from peft.utils import set_peft_model_state_dict

        for adapter, weights in state["lora"].items():
            if adapter in run.transformer.peft_config:
                set_peft_model_state_dict(run.transformer, weights, adapter_name=adapter)
        run.transformer.set_adapter("default")
        iteration = state["iteration"]
    uncond = sd3.encode(run.pipe, [""], run.max_len, run.acc.device) if cli.guidance_scale != 1.0 else None
    metrics, images, R = session.evaluate(run, args, guided(nft.ode_sample, cli.guidance_scale, uncond))
    if not run.acc.is_main_process:
        return metrics
    logged = next(
        (json.loads(line) for it, line in records.metrics_lines(out / "metrics.jsonl") if it == max(iteration, 0)), {}
    )
    if cli.base:
        logged = {k.replace("eval_before/", "eval/"): v for k, v in logged.items() if k.startswith("eval_before/")}
    steps, processes = len(run.eval_sigmas) - 1, run.acc.num_processes
    print(f"{label} of {out}: {len(run.eval_prompts)} prompts, {steps} steps, {processes} process(es)")
    width = max(28, 2 + max(map(len, metrics)))
    print(f"{'metric':<{width}}{'evaluated':>12}{'run logged':>12}")
    for key, value in metrics.items():
        print(f"{key:<{width}}{value:>12.4f}{logged[key] if key in logged else float('nan'):>12.4f}")
    result = {
        "run": str(out),
        "checkpoint": label,
        "iteration": iteration,
        **({"lora": str(lora.folder), "layout": lora.layout, "config": cli.config} if lora else {}),
        "model": args.model,
        "eval_steps": steps,
        "guidance_scale": cli.guidance_scale,
        "processes": processes,
        "metrics": metrics,
        "images": [{"prompt": q, **{n: float(r) for n, r in zip(names, row)}} for q, row in zip(run.eval_prompts, R)],
    }
    write_result(path, json.dumps(result, indent=2), cli.replace)
    figures.save_grid(
        images,
        path.with_suffix(".png"),
        [f"{nft.budget_mean(r, budgets):.3f}. {q}" for q, r in zip(run.eval_prompts, R)][: len(images)],
    )
    replaced = " (replacing the earlier result: --replace)" if existed else ""
    print(f"written: {path} and {path.with_suffix('.png')}{replaced}")
    return metrics


if __name__ == "__main__":
    main()
