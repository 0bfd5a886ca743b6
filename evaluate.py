"""Evaluate a checkpoint of a run, or the pretrained model, as the run's own evaluations do: the run's held-out
prompts, noise (run_kit.EVAL_SEED), sampler and weights (the EMA with --ema), its training rewards and held-out judges.
On the run's settings the numbers are the eval/* the run logged at that iteration (eval_before/* with --base).

    python evaluate.py runs/recast-recast-0                       # the run's newest checkpoint
    python evaluate.py runs/recast-recast-0/checkpoints/iter_000099 --eval-steps 40 --eval-prompts heldout.txt
    python evaluate.py runs/recast-recast-0 --base                # the pretrained model, with the run's settings
    accelerate launch --num_processes 8 evaluate.py runs/recast-recast-0   # the prompts split over processes

Writes <run>/eval-<checkpoint>.json (the metrics and every image's rewards), the first samples beside it as .png,
and prints a table beside what the run logged.
"""

import argparse
import importlib
import json
from dataclasses import fields
from pathlib import Path

import torch

import nft
from kit import run_kit


def parse_flags(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run folder (its newest checkpoint) or one of its checkpoints/iter_N")
    parser.add_argument("--base", action="store_true", help="the pretrained model (no LoRA), with the run's settings")
    parser.add_argument("--eval-prompts", help="file of held-out prompts, one per line (default: the run's)")
    parser.add_argument("--eval-steps", type=int, help="Euler steps of the sampler (default: the run's)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--json", help="where to write the results (default <run>/eval-<checkpoint>.json)")
    return parser.parse_args(argv)


def find_checkpoint(path):
    """(run folder, checkpoint folder) of a run folder (the checkpoint `latest` names) or of one of its checkpoints;
    SystemExit naming the path and what it should be."""
    path = Path(path)
    if run_kit.is_run(path):
        latest = path / "checkpoints" / "latest"
        if not latest.is_file():
            raise SystemExit(f"{path}: the run has no checkpoint yet; evaluate the pretrained model with --base")
        return path, path / "checkpoints" / latest.read_text().strip()
    if (path / "state.pt").is_file() and run_kit.is_run(path.parent.parent):
        return path.parent.parent, path
    raise SystemExit(f"{path}: neither a run folder (with config.json) nor one of its checkpoints/iter_N folders")


def main(argv=None, extra_rewards=None, judges=None):
    flags = parse_flags(argv)
    out, ckpt = find_checkpoint(flags.checkpoint)
    config = json.loads((out / "config.json").read_text())
    script = importlib.import_module(config["script"])
    _, saved = run_kit.read_run_config(out / "config.json", script.Args)
    known = {f.name for f in fields(script.Args)}
    given = {k: v for k, v in vars(flags).items() if k in known and v is not None}
    saved = run_kit.model_after_a_move(saved, given, out)  # the embedded model, moved with the project
    args = script.Args(
        **{
            **{k: v for k, v in saved.items() if k in known},
            **given,
            "out": str(out),
            "resume": "",
            "report_to": "none",
        }
    )
    names, budgets, branch = run_kit.check_common(args, extra_rewards)
    run_kit.check_files(args, names)
    run = run_kit.load_run(args, names, budgets, branch, config["script"], extra_rewards, judges, lock=False)
    label = "base" if flags.base else ckpt.name
    iteration = -1
    if not flags.base:
        from peft.utils import set_peft_model_state_dict

        state = torch.load(ckpt / "state.pt", weights_only=False)
        for adapter, weights in state["lora"].items():
            if adapter in run.transformer.peft_config:
                set_peft_model_state_dict(run.transformer, weights, adapter_name=adapter)
        run.transformer.set_adapter("default")
        iteration = state["iteration"]
    metrics, images, R = run_kit.evaluate(run, args, nft.ode_sample)
    if not run.acc.is_main_process:
        return metrics
    logged = next(
        (json.loads(line) for it, line in run_kit.metrics_lines(out / "metrics.jsonl") if it == max(iteration, 0)), {}
    )
    if flags.base:
        logged = {k.replace("eval_before/", "eval/"): v for k, v in logged.items()}
    steps, processes = len(run.eval_sigmas) - 1, run.acc.num_processes
    print(f"{label} of {out}: {len(run.eval_prompts)} prompts, {steps} steps, {processes} process(es)")
    print(f"{'metric':<28}{'evaluated':>12}{'run logged':>12}")
    for key, value in metrics.items():
        print(f"{key:<28}{value:>12.4f}{logged[key] if key in logged else float('nan'):>12.4f}")
    path = Path(flags.json or out / f"eval-{label}.json")
    result = {
        "run": str(out),
        "checkpoint": label,
        "iteration": iteration,
        "model": args.model,
        "eval_steps": steps,
        "processes": processes,
        "metrics": metrics,
        "images": [{"prompt": q, **{n: float(r) for n, r in zip(names, row)}} for q, row in zip(run.eval_prompts, R)],
    }
    run_kit.write_atomic(path, json.dumps(result, indent=2))
    run_kit.save_grid(
        images,
        path.with_suffix(".png"),
        [f"{run_kit.budget_mean(r, budgets):.3f}. {q}" for q, r in zip(run.eval_prompts, R)][: len(images)],
    )
    print(f"written: {path} and {path.with_suffix('.png')}")
    return metrics


if __name__ == "__main__":
    main()
