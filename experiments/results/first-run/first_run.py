"""The main command's candidate defaults, measured (README.md here holds the plan and the reading).

    OMP_NUM_THREADS=1 python experiments/results/first-run/first_run.py eval RUN [RUN ...]   # full held-out eval
    python experiments/results/first-run/first_run.py pulls RUN [RUN ...]  # keep item 6's pull checks' metrics
    python experiments/results/first-run/first_run.py table [--arms A,B,E]                  # table.md, summary.json

eval: each run's newest checkpoint and the pretrained model on every held-out caption x 8 noises at each of
protocol.EVAL_SEEDS (the same images for every model: paired), protocol.final_scores (every candidate reward, the CNN
and preference judges, the set's Fréchet distance); written per model, without images, to final/<run>.json
(committed; a model already there is not evaluated again), so that `table` needs no run folder.

table: per arm (the runs work/<phase>-<arm>-<seed>, their metrics.jsonl copied to runs/<phase>-<arm>-<seed>.jsonl.gz,
committed), over its seeds: each metric of the full evaluation as run - pretrained on the first evaluation seed, mean
[95% t over seeds], against the noise floor (the largest |first - second evaluation seed| over the models); the
budget-weighted reward of the arm's own rewards; Fréchet's ratio to the pretrained model's; from the in-run
evaluations, the best and last held-out weighted; W's largest departure from uniform per reward and its evidence rho;
the run's minutes.
"""

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from experiments import protocol, stats  # noqa: E402

NOISES = 8
IN_RUN_FLOOR = 0.021  # sd of one in-run held-out weighted (rvge-joint/eval_floor.json, 16 noise sets)


def evaluate(runs, seeds=protocol.EVAL_SEEDS, final=HERE / "final", kept=HERE / "runs"):
    """Each run's newest checkpoint and the pretrained model at each noise seed of `seeds`, one file per model in
    `final` (a model already there is not evaluated again); each run's metrics.jsonl copied into `kept`."""
    import torch

    import recast
    import sd3
    import world as shapes_world
    from evaluate import read_checkpoint  # the run's newest loadable checkpoint, as evaluate.py and --resume find it

    torch.set_num_threads(1)
    prompts = [c for c in shapes_world.splits()["heldout"] for _ in range(NOISES)]
    final.mkdir(exist_ok=True)
    pipe = sd3.load_pipeline(recast.parse_args([]), "cpu", torch.float32)
    models = {"pretrained": None} | {Path(r).name: Path(r) for r in runs}
    for label, run in models.items():
        path = final / f"{label}.json"
        if path.is_file():
            record_settings(path, run)  # an evaluation made before settings were recorded gains them, unchanged else
            continue
        ckpt, state = (None, None) if run is None else read_checkpoint(run)
        lora = None if state is None else state["lora"]["default"]
        out = {"checkpoint": str(ckpt), "images_per_seed": len(prompts), "world": shapes_world.world_id()}
        settings = {} if run is None else run_settings(run)
        out |= {"settings": settings} if settings else {}
        for seed in seeds:
            images = protocol.final_eval_images(pipe, lora, prompts, seed)
            scores = protocol.final_scores(images, prompts)
            out[str(seed)] = {k: (float(np.nanmean(v)) if isinstance(v, list) else v) for k, v in scores.items()}
        write_json(path, out)
        print(f"evaluated {label}", flush=True)
        if run is not None:  # the run's metrics beside it, for the in-run columns
            keep_metrics([run], kept)


def write_json(path, obj):
    """Atomically: a stopped evaluation leaves the old file or the new one, never half of one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


SETTINGS = ("credit", "rewards", "budgets", "base_reg", "lr", "iterations", "seed")  # what a reading needs to name


def run_settings(run) -> dict:
    """The run's own flags (its config.json, as recast.py wrote it) that a reading names; {} when the folder has none."""
    config = Path(run) / "config.json"
    if not config.is_file():
        return {}
    args = json.loads(config.read_text())["args"]
    return {k: args[k] for k in SETTINGS if k in args}


def record_settings(path, run):
    """Adds the run's settings to an evaluation written before they were recorded (its scores unchanged)."""
    result = json.loads(path.read_text())
    settings = {} if run is None or "settings" in result else run_settings(run)
    if not settings:
        return
    write_json(path, result | {"settings": settings})
    print(f"recorded the settings of {path.stem}", flush=True)


def run_log(label) -> list[dict]:
    """runs/<label>.jsonl.gz, the run's metrics.jsonl as kept by `keep_metrics`: one dict per iteration."""
    return [json.loads(x) for x in gzip.open(HERE / "runs" / f"{label}.jsonl.gz", "rt") if x.strip()]


def seed_runs(arm: str, labels) -> list[str]:
    """The labels that are training seeds of the arm (main-<arm>-<seed>, pilot-<arm>-<seed>), not its kernel runs."""
    return sorted(k for k in labels if k.split("-")[0] in ("main", "pilot") and k.split("-")[1:2] == [arm])


def run_summary(label):
    lines = run_log(label)
    evals = [(m["iteration"], m["eval/weighted"]) for m in lines if "eval/weighted" in m]
    before = lines[0].get("eval_before/weighted")
    W = np.asarray(lines[-1]["recast/W"])
    ratio = W / (W.sum(1, keepdims=True) / W.shape[1])
    return {
        "first": lines[0],  # iteration 0's line: eval_before/* (the pretrained model)
        "last_eval": next(m for m in reversed(lines) if "eval/weighted" in m),
        "iterations": len(lines),
        "evals": evals,
        "before": before,
        "best": max(v for _, v in evals),
        "best_at": max(evals, key=lambda e: e[1])[0],
        "last": evals[-1][1],
        "departure": np.abs(ratio - 1).max(1).tolist(),
        "rho": lines[-1]["recast/evidence"],
        "minutes": sum(v for m in lines for k, v in m.items() if k.startswith("time/")) / 60,
    }


def pilot_lines(arms, conf) -> list[str]:
    """The pilot (seed 0 of every arm) from its in-run evaluations: items 1-5 of the plan as the in-run evaluation
    reads them (item 1 against two in-run floors; item 2 against one). conf: arms.json."""
    lines = [
        "## The pilot: seed 0 of every arm, in-run held-out evaluation (49 captions x 1 noise)",
        "",
        f"In-run noise floor of the weighted reward: {IN_RUN_FLOOR} (one evaluation's sd over 16 noise sets, "
        "`rvge-joint/eval_floor.json`). Item 1: weighted up by two floors; 2: no reward of budget >= 0.2 down by more "
        "than one; 3: Fréchet <= 3x; 4: last within one floor of the best; 5: W >= 0.3 off uniform with rho >= 0.5 "
        "for >= 2 rewards.",
        "",
        "| arm | flags | weighted: pretrained -> last | best (iteration) | Fréchet: pretrained -> last | "
        "W departure (rho) per reward | items met | iterations run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        if not (HERE / "runs" / f"pilot-{arm}-0.jsonl.gz").is_file():
            continue
        c, s = conf[arm], run_summary(f"pilot-{arm}-0")
        first, last = s["first"], s["last_eval"]
        met = []
        if s["last"] - s["before"] >= 2 * IN_RUN_FLOOR:
            met.append(1)
        if all(
            last[f"eval/{k}"] - first[f"eval_before/{k}"] >= -IN_RUN_FLOOR
            for k, b in zip(c["rewards"], c["budgets"])
            if b >= 0.2
        ):
            met.append(2)
        fr0, fr1 = first["eval_before/judge/frechet"], last["eval/judge/frechet"]
        if fr1 <= 3 * fr0:
            met.append(3)
        if s["best"] - s["last"] <= IN_RUN_FLOOR:
            met.append(4)
        if sum(d >= 0.3 and r >= 0.5 for d, r in zip(s["departure"], s["rho"])) >= 2:
            met.append(5)
        w = ", ".join(f"{k} {d:.2f} ({r:.2f})" for k, d, r in zip(c["rewards"], s["departure"], s["rho"]))
        lines.append(
            f"| {arm} | {c['flags']} | {s['before']:.3f} -> {s['last']:.3f} | {s['best']:.3f} ({s['best_at']}) | "
            f"{fr0:.0f} -> {fr1:.0f} | {w} | {', '.join(map(str, met)) or 'none'} | {s['iterations']} |"
        )
    return lines + [""]


ALONE = ("geneval", "saturation", "shape")  # item 6: each trained alone by DiffusionNFT (work/alone-<reward>-<seed>)
# screened the same way as a reward to take saturation's place (README.md here)
CANDIDATES = ("sharpness", "jpeg", "detail")


def by_seed(labels, values, notes) -> str:
    """One value for every run, or each value with its seeds and their notes ("0.3: seeds 1, 2 (x21.0, x20.8)")."""
    if len(set(values)) == 1:
        return values[0]
    parts = []
    for v in dict.fromkeys(values):
        idx = [i for i, w in enumerate(values) if w == v]
        seeds = ", ".join(labels[i].rsplit("-", 1)[1] for i in idx)
        parts.append(f"{v}: seed{'s' * (len(idx) > 1)} {seeds} ({', '.join(notes[i] for i in idx)})")
    return "; ".join(parts)


def alone_lines(models, base, floor, checks) -> list[str]:
    """Item 6: each default reward trained alone by DiffusionNFT, read on the full held-out evaluation."""
    s1 = str(protocol.EVAL_SEEDS[0])
    lines = [
        "## Item 6: each default reward trained alone (DiffusionNFT, 40 iterations)",
        "",
        "The pull (`--base-reg`) as each run's config.json recorded it (`settings` in final/<run>.json), or, for runs "
        "evaluated after their folders were gone, as a rerun of their first iterations reproduced it (the next table); "
        '"not recorded": neither. Where the runs of one reward ran at more than one pull, each pull lists its seeds with '
        "their Fréchet ratios.",
        "",
        "| reward | pretrained | run − pretrained on it, mean [95% t over seeds] | noise floor | learnable alone | "
        "Fréchet: x the pretrained model's (seeds) | pull |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ALONE + CANDIDATES:
        labels = sorted(k for k in models if k.startswith(f"alone-{name}-"))
        if not labels:
            continue
        d = [models[lbl][s1][name] - base[s1][name] for lbl in labels]
        m, lo, hi, n = stats.mean_ci(d)
        verdict = "yes (resolved)" if lo > 0 else "not shown"
        fr = [models[lbl][s1]["judge/frechet"] / base[s1]["judge/frechet"] for lbl in labels]
        pulls = [
            str(models[lbl]["settings"]["base_reg"]) if "settings" in models[lbl] else reproduced_pull(lbl, checks)
            for lbl in labels
        ]
        lines.append(
            f"| {name}{' (a candidate, not a default)' if name in CANDIDATES else ''} | {base[s1][name]:.4f} | "
            f"{stats.fmt_ci(m, lo, hi, n)} | {floor[name]:.4f} | {verdict} | "
            f"x{min(fr):.1f}-x{max(fr):.1f} | {by_seed(labels, pulls, [f'x{x:.1f}' for x in fr])} |"
        )
    grain = []  # rvge-single's DiffusionNFT runs on grain alone: last in-run evaluation minus the pretrained model's
    for path in sorted((HERE.parent / "rvge-single" / "runs").glob("grain_nft-seed*.json.gz")):
        rows = json.loads(gzip.decompress(path.read_bytes()))["rows"]
        evals = [r for r in rows if "eval/grain" in r]
        grain.append(evals[-1]["eval/grain"] - rows[0]["eval_before/grain"])
    m, lo, hi, n = stats.mean_ci(grain)
    lines += [
        f"| grain | | {stats.fmt_ci(m, lo, hi, n)}: DiffusionNFT alone, 60 iterations x 4 groups, in-run evaluation "
        f"([rvge-single](../rvge-single/README.md) `runs/grain_nft-*`) | | {'yes (resolved)' if lo > 0 else 'not shown'} | | "
        "1e-4 (recast.py's default at the runs' commit, 1c047e8) |",
        "",
    ]
    return lines


def keep_metrics(runs, kept=HERE / "runs"):
    """Each run's metrics.jsonl copied to `kept`/<run>.jsonl.gz (runs/, committed): evaluated runs' for the in-run
    columns, `pulls`' check runs' for `pull_checks`."""
    kept.mkdir(exist_ok=True)
    for run in map(Path, runs):
        with open(run / "metrics.jsonl", "rb") as src, gzip.open(kept / f"{run.name}.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)


# a rerun at the run's own pull agrees to ~1e-5 (float paths of another CPU); another pull is off by >= 2e-2
MATCH = 1e-3


def pull_checks() -> dict:
    """Item 6's runs were evaluated after their folders (and config.json) were gone. Which pull each ran at is found by
    rerunning its first iterations at a given pull (runs/pullcheck-<reward>-<seed>-<pull>.jsonl.gz): the run's own
    pull reproduces the logged `loss/base_reg` of every iteration rerun, another does not. Returns {(run, pull):
    (iterations rerun, largest relative difference)}."""
    out = {}
    for path in sorted((HERE / "runs").glob("pullcheck-*.jsonl.gz")):
        _, reward, seed, pull = path.name.removesuffix(".jsonl.gz").split("-", 3)
        label = f"alone-{reward}-{seed}"
        rerun = [m["loss/base_reg"] for m in run_log(path.name.removesuffix(".jsonl.gz"))]
        logged = [m["loss/base_reg"] for m in run_log(label)]
        out[label, pull] = (len(rerun), max(abs(a - b) / abs(b) for a, b in zip(rerun, logged)))
    return out


def reproduced_pull(label, checks) -> str:
    """The pull whose rerun matched the run's log, or "not recorded"."""
    found = [pull for (lbl, pull), (_, diff) in checks.items() if lbl == label and diff < MATCH]
    return f"{found[0]} (reproduced)" if len(found) == 1 else "not recorded"


def pull_lines(checks) -> list[str]:
    if not checks:
        return []
    lines = [
        "## Item 6's pulls, reproduced",
        "",
        "Each check reruns an item-6 run's first iterations at one `--base-reg` and compares each iteration's "
        f"`loss/base_reg` with the logged one: the same pull when the largest relative difference is below {MATCH:g}.",
        "",
        "| run | pull tried | iterations rerun | largest relative difference | the run's pull |",
        "|---|---|---|---|---|",
    ]
    for (label, pull), (n, diff) in checks.items():
        lines.append(f"| {label} | {pull} | {n} | {diff:.1e} | {'yes' if diff < MATCH else 'no'} |")
    return lines + [""]


def floor_pool(models: dict) -> list[dict]:
    """The models whose two noise sets set the noise floors: every model evaluated but the screened candidates' runs
    (they drift up to x36 and are not compared here)."""
    return [r for k, r in models.items() if not any(k.startswith(f"alone-{c}-") for c in CANDIDATES)]


def table(arms):
    s1, s2 = (str(s) for s in protocol.EVAL_SEEDS)
    models = {p.stem: json.loads(p.read_text()) for p in sorted((HERE / "final").glob("*.json"))}
    base = models["pretrained"]
    pool = floor_pool(models)
    floor = {m: max(abs(r[s1][m] - r[s2][m]) for r in pool) for m in base[s1]}
    out, lines = {"noise_floor": floor, "arms": {}}, ["# first-run: tables (generated by `first_run.py table`)", ""]
    arms_conf = json.loads((HERE / "arms.json").read_text())
    lines += pilot_lines(arms, arms_conf)
    checks = pull_checks()
    lines += alone_lines(models, base, floor, checks)
    lines += pull_lines(checks)
    for arm in arms:
        labels = seed_runs(arm, models)
        if not labels:
            continue
        runs = {lbl: run_summary(lbl) for lbl in labels}
        conf = arms_conf[arm]
        names, budgets = conf["rewards"], conf["budgets"]
        for r in list(models.values()):
            for seed in (s1, s2):
                r[seed][f"weighted_{arm}"] = weighted_of(r, seed, conf)
        wf = max(abs(r[s1][f"weighted_{arm}"] - r[s2][f"weighted_{arm}"]) for r in pool)
        metrics = [f"weighted_{arm}", *names] + [m for m in ("judge/cnn", "judge/pref") if m not in names]
        lines += [
            f"## arm {arm}: {', '.join(f'{k} {b}' for k, b in zip(names, budgets))}; {conf['flags']} "
            f"({len(labels)} seeds: {', '.join(labels)})",
            "",
            f"Full held-out evaluation ({base['images_per_seed']} images per noise seed): run - pretrained on noise "
            f"seed {s1}, mean [95% t over training seeds]; noise floor = the largest |seed {s1} - seed {s2}| over "
            "every model evaluated.",
            "",
            "| metric | budget | pretrained | run − pretrained | noise floor | resolved up / down by > floor |",
            "|---|---|---|---|---|---|",
        ]
        arm_out = {"labels": labels, "paired": {}}
        for m in metrics:
            d = [models[lbl][s1][m] - base[s1][m] for lbl in labels]
            mm, lo, hi, n = stats.mean_ci(d)
            f = wf if m.startswith("weighted") else floor[m]
            b = budgets[names.index(m)] if m in names else ""
            verdict = "up" if lo > 0 else ("down" if hi < 0 else "no")
            verdict += " / yes" if mm < -f else " / no"
            arm_out["paired"][m] = {"per_seed": d, "mean": mm, "lo": lo, "hi": hi, "n": n, "floor": f}
            lines.append(f"| {m} | {b} | {base[s1][m]:.4f} | {stats.fmt_ci(mm, lo, hi, n)} | {f:.4f} | {verdict} |")
        fr = [models[lbl][s1]["judge/frechet"] / base[s1]["judge/frechet"] for lbl in labels]
        arm_out["frechet_ratio"] = fr
        lines += [
            "",
            f"Fréchet distance to the world's images: pretrained {base[s1]['judge/frechet']:.0f}; runs "
            + ", ".join(f"{models[lbl][s1]['judge/frechet']:.0f}" for lbl in labels)
            + f" (x{min(fr):.1f}-x{max(fr):.1f}).",
            "",
            "| run | in-run weighted: pretrained, best (iteration), last | last - best | W: max departure per reward "
            "| evidence rho | minutes |",
            "|---|---|---|---|---|---|",
        ]
        for lbl, s in runs.items():
            lines.append(
                f"| {lbl} | {s['before']:.4f}, {s['best']:.4f} ({s['best_at']}), {s['last']:.4f} | "
                f"{s['last'] - s['best']:+.4f} | {', '.join(f'{x:.2f}' for x in s['departure'])} | "
                f"{', '.join(f'{x:.2f}' for x in s['rho'])} | {s['minutes']:.1f} |"
            )
        arm_out["runs"] = {
            lbl: {k: v for k, v in r.items() if k not in ("first", "last_eval", "iterations")}
            for lbl, r in runs.items()
        }
        out["arms"][arm] = arm_out
        lines.append("")
    (HERE / "table.md").write_text("\n".join(lines))
    (HERE / "summary.json").write_text(json.dumps(stats.rounded(out), indent=1))  # the same bytes on another CPU
    print("\n".join(lines))


CHOSEN = "M"  # the arm the main command's defaults follow (README.md here: the choice, then arms L and M)
README = HERE.parents[2] / "README.md"
BEGIN, END = "<!-- BEGIN first-run (experiments/results/first-run/first_run.py table) -->", "<!-- END first-run -->"


FOLDER = "experiments/results/first-run"
TIMED = "E"  # main_command_time.txt: /usr/bin/time of arm E's command alone; main_command_time-<arm>.txt: another arm's


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def reward_share(arm: str) -> float:
    """The rewards' share of the training time (time/reward over every time/* key) over the arm's seeds' runs."""
    logs = [run_log(k) for k in seed_runs(arm, (p.name.removesuffix(".jsonl.gz") for p in (HERE / "runs").iterdir()))]
    total = sum(v for log in logs for m in log for k, v in m.items() if k.startswith("time/"))
    return sum(m["time/reward"] for log in logs for m in log) / total


def timed(name: str) -> tuple[float, str]:
    """A timing file's wall seconds and its machine's CPU ("Model name: ..." on its second line)."""
    text = (HERE / name).read_text()
    return float(text.split("wall ")[1].split(" s")[0]), text.splitlines()[1].split("Model name: ")[1].strip()


def confirmation_clause() -> str:
    """The README block's words on the out-of-sample confirmation (confirm.py's confirm.json), or that it has not been
    run."""
    path = HERE / "confirm.json"
    if not path.is_file():
        return "a confirmation on fresh seeds has not been run."
    c = json.loads(path.read_text())
    r = c["rows"]["weighted (noise mean)"]
    seeds, noises = c["seeds"], c["noise_seeds"]
    return (
        f"out of sample, the same command at fresh seeds ({seeds[0]}-{seeds[-1]}) on fresh noise sets "
        f"({noises[0]}-{noises[-1]}): weighted {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] (in sample "
        f"{c['in_sample']['mean']:+.3f}): {c['verdict']} ([the confirmation]({FOLDER}/README.md"
        "#confirmation-on-fresh-seeds-and-fresh-noise-plan-written-before-its-runs))."
    )


def uniform_control_line():
    """The README block's words on arm U, the uniform-W control at the defaults (`arm_u.py`'s arm_u.json), and on the
    confirmation (or that they have not been run)."""
    path = HERE / "arm_u.json"
    if not path.is_file():
        return f"a uniform-W control at these defaults has not been run; {confirmation_clause()}"
    u = json.loads(path.read_text())
    r = u["rows"]["weighted (noise mean)"]
    return (
        f"the uniform-W control at these defaults (arm U, `--credit uniform`, {len(u['seeds'])} paired seeds): M - U on "
        f"the weighted change {r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] (both noise sets averaged; "
        f"`{FOLDER}/arm_u.json`); {confirmation_clause()}"
    )


def timing_line(arm: str) -> str:
    """The main command's time alone on a 2-core machine, measured for the arm itself on each CPU kind it was timed
    on (main_command_time-<arm>[-<cpu>].txt; main_command_time.txt for arm TIMED): measured timings only, each with its
    CPU (issue 62: an estimate scaled from another arm's timing on another CPU is no measurement and is not quoted)."""
    names = ["main_command_time.txt"] if arm == TIMED else []
    names += sorted(p.name for p in HERE.glob(f"main_command_time-{arm}.txt"))
    names += sorted(p.name for p in HERE.glob(f"main_command_time-{arm}-*.txt"))
    if not names:
        return "The command alone: not timed for these defaults."
    said = []
    for name in names:
        wall, cpu = timed(name)
        said.append(f"{minutes(wall)} on a 2-core {cpu} (`{FOLDER}/{name}`)")
    return f"The command alone, measured: {'; '.join(said)}."


def weighted_of(result: dict, seed: str, conf: dict) -> float:
    return float(np.dot(conf["budgets"], [result[seed][k] for k in conf["rewards"]]) / sum(conf["budgets"]))


def readme_block(arm: str = CHOSEN, kernels=("avx2", "default")) -> str:
    """The README's first-run table, from summary.json and final/*.json: the chosen arm's full held-out evaluation
    over its seeds on both noise sets (each, and their average) with each reward's share of the weighted gain, the
    noise floor defined, how the defaults were chosen, the measured timing, and seed 0 of the same arm under other CPU
    kernels (ATEN_CPU_CAPABILITY; final/kernel-<arm>-<cap>.json) against the seeds' interval."""
    s1, s2 = (str(s) for s in protocol.EVAL_SEEDS)
    summary = json.loads((HERE / "summary.json").read_text())["arms"][arm]
    models = {p.stem: json.loads(p.read_text()) for p in sorted((HERE / "final").glob("*.json"))}
    base = models["pretrained"]
    conf = json.loads((HERE / "arms.json").read_text())[arm]
    rows = [(f"weighted_{arm}", "weighted", "")] + [(k, f"`{k}`", b) for k, b in zip(conf["rewards"], conf["budgets"])]
    rows += [("judge/cnn", "CNN judge", "")]
    labels = summary["labels"]
    n = len(labels)

    def value(result, seed, key):
        return weighted_of(result, seed, conf) if key.startswith("weighted") else result[seed][key]

    def change(key, seeds):
        return stats.mean_ci(
            [np.mean([value(models[lbl], s, key) - value(base, s, key) for s in seeds]) for lbl in labels]
        )

    def ci(m, lo, hi, _):
        return f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    total = summary["paired"][f"weighted_{arm}"]["mean"]
    lines = [
        f"| held-out | budget | pretrained | change on noise set {s1}, mean [95% t interval over {n} seeds] | noise set "
        f"{s2} | both sets averaged | share of the weighted gain | noise floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    shares = {}
    for key, name, budget in rows:
        p = summary["paired"][key]
        share = ""
        if budget != "":
            shares[key] = budget * p["mean"] / sum(conf["budgets"]) / total
            share = f"{shares[key]:.0%}"
        lines.append(
            f"| {name} | {budget} | {value(base, s1, key):.3f} | {ci(p['mean'], p['lo'], p['hi'], n)} | "
            f"{ci(*change(key, (s2,)))} | {ci(*change(key, (s1, s2)))} | {share} | {p['floor']:.3f} |"
        )
    pool = floor_pool(models)
    diff = [weighted_of(r, s1, conf) - weighted_of(r, s2, conf) for r in pool]
    sd_one = float(np.std(diff, ddof=1) / np.sqrt(2))  # one evaluation's noise: the two sets' difference / sqrt 2
    floor = summary["paired"][f"weighted_{arm}"]["floor"]
    top = sorted(shares, key=shares.get, reverse=True)
    lines += [
        "",
        f"Noise floor: the largest |noise set {s1} - noise set {s2}| of one model's evaluation over the {len(pool)} "
        f"models evaluated in this folder (for `weighted` {floor / sd_one:.1f} sd of one evaluation's noise). "
        f"Share of the weighted gain: budget x change / the weighted change (noise set {s1}): `{top[0]}` "
        f"{shares[top[0]]:.0%}, `geneval` {shares['geneval']:.0%}.",
        f"These defaults were chosen in sample: arm {arm} was picked after reading the earlier arms of "
        f"`{FOLDER}/arms.json` on the same seeds (0-{n - 1}) and noise set {s1}, and the interval is not corrected for "
        f"that search; {uniform_control_line()}",
    ]
    fr = summary["frechet_ratio"]
    lines += [f"Fréchet distance to the world's images: x{min(fr):.2f}-x{max(fr):.2f} the pretrained model's."]
    lines.append(timing_line(arm))
    p = summary["paired"][f"weighted_{arm}"]
    for cap in kernels:
        path = HERE / "final" / f"kernel-{arm}-{cap}.json"
        if path.is_file():
            d = weighted_of(json.loads(path.read_text()), s1, conf) - weighted_of(base, s1, conf)
            lines.append(
                f"Seed 0 with `ATEN_CPU_CAPABILITY={cap}` (other CPU kernels: the float path of another CPU): "
                f"weighted {d:+.3f}, {'inside' if p['lo'] <= d <= p['hi'] else 'outside'} the seeds' interval."
            )
        else:
            lines.append(f"Seed 0 with `ATEN_CPU_CAPABILITY={cap}`: not measured for these defaults.")
    return "\n".join(lines)


def write_readme_block():
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{README}: no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    README.write_text(head + BEGIN + "\n" + readme_block() + "\n" + END + rest.split(END, 1)[1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["eval", "pulls", "table"])
    ap.add_argument("runs", nargs="*")
    ap.add_argument("--arms", help="comma-separated arms.json keys (default: every arm; arms never run are skipped)")
    a = ap.parse_args(argv)
    if a.part == "eval":
        evaluate(a.runs)
    elif a.part == "pulls":
        keep_metrics(a.runs)
    else:
        table(a.arms.split(",") if a.arms else list(json.loads((HERE / "arms.json").read_text())))
        write_readme_block()


if __name__ == "__main__":
    main()
