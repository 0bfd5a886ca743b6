"""ReCAST's protocol (recast-protocol, -B, -reversed, -matched, -units): the gains it starts from, its large final
evaluation, and its report.

1. `measure_profiles`: D_k(t) of every candidate reward under the pretrained model (recast.py's own rollouts, no
   update), cached in profiles.json; `recast.py --gain-init` starts ReCAST's W from it, and `profile_table` /
   `profile_figure` show it with the W each setting gets.
2. `final_evals`: every finished run's last checkpoint (and the pretrained model) on a held-out set larger than the
   runs' own, the same images for every method, at two noise seeds (the second for the noise floor); cached next to
   each result as <run>.final.json, so a fresh clone rebuilds the tables without a run folder.
3. `report_protocol`: per cell, the paired differences of the experiment's comparisons on every training reward and
   judge, Holm per metric; the preference judge's share; the noise floor; how far W moved; the summaries.

`bench.py` calls these; what the report needs of the experiment comes in `reports.Results`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import world as shapes_world
from experiments.reports import (
    ALONG,
    Results,
    better_sign,
    cell_iterations,
    curve_figure,
    distance_curve,
    distance_to_base,
    elapsed,
    eval_curve,
    flag_value,
    non_inferiority_table,
    read_json,
    set_aside,
    verdict,
    w_departure,
    w_ratio,
)
from experiments.stats import (
    ALPHA,
    adjusted_difference,
    fmt_ci,
    fmt_exact,
    fmt_share,
    holm,
    mean_ci,
    mean_std,
    p_value,
    paired,
    pref_share,
    share_logit,
    share_logits,
    sign_flip_p,
)

# =============================================================================
# The gains ReCAST starts from: profiles of the pretrained model
# =============================================================================


PROFILE_CANDIDATES = (
    "geneval",
    "saturation",
    "sharpness",
    "jpeg",
    "geneval_strict",
    "count",
    "colour",
    "shape",
    "position",
    "detail",
    "texture",
    "grain",
)


def measure_profiles(exp_dir: Path, names=PROFILE_CANDIDATES, iterations=48, prompts=8, seed=0, replace_results=False):
    """D_k(t) of every candidate reward under the pretrained model: recast.py's own rollouts (rotated
    branch layout, so each of the 8 inner levels is measured by prompts * iterations / 8 groups) and its
    level statistics, with no update. Cached in exp_dir/profiles.json (reused for the same rewards, sizes and
    embedded world): names, sigmas, the statistics (n, s1, s2: the file `recast.py --gain-init` starts from), D, se
    and the evidence rho of each reward. A cached file of other rewards, sizes or world is refused unless
    replace_results (then moved to exp_dir/set-aside/); a damaged one is moved there and measured anew."""
    path = exp_dir / "profiles.json"
    if path.exists():
        cached, problem = read_json(path)
        if problem is None and not isinstance(cached, dict):
            problem = f"a JSON {type(cached).__name__}, not profiles"
        if problem:
            where = set_aside({path: problem}, exp_dir, "damaged")
            print(f"{path}: {problem}; moved to {where / path.name} and measured anew", flush=True)
        else:
            mine = {
                "names": list(names),
                "iterations": iterations,
                "prompts": prompts,
                "world": shapes_world.world_id(),
            }
            differ = "; ".join(f"{k} {cached.get(k)} there, {v} now" for k, v in mine.items() if cached.get(k) != v)
            if not differ:
                return cached
            if not replace_results:
                raise SystemExit(
                    f"{path} holds profiles measured differently ({differ}); this command would measure and replace "
                    "them. Pass --out DIR (another folder) to keep them, or --replace-results to move the file to "
                    f"{exp_dir / 'set-aside'}/<time>/ and measure anew; nothing was run or changed"
                )
            where = set_aside({path: f"profiles measured differently ({differ})"}, exp_dir, "replaced")
            print(f"--replace-results: moved {path} ({differ}) to {where}", flush=True)
    import torch

    import nft
    import recast
    from kit import records

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = recast.parse_args(
            [
                "--rewards",
                ",".join(names),
                "--budgets",
                ",".join(["1"] * len(names)),
                "--seed",
                str(seed),
                "--prompts-per-iter",
                str(prompts),
                "--eval-every",
                "0",
                "--out",
                str(exp_dir / "work" / "profiles"),
                "--overwrite",
            ]
        )
        run = recast.setup_run(args)
        sigmas, stats = run.sigmas.double().numpy(), None
        for it in range(iterations):
            b = nft.rollout_and_score(run, args, it, nft.iteration_generator(seed, it))
            r = nft.optimality(b.R, b.groups, std=nft.global_stats(b.R, run.reduce)[2])
            new = recast.level_observations(r, b.groups, b.ancestry, b.layouts, args.steps)
            stats = list(new) if stats is None else [a + c for a, c in zip(stats, new)]
    finally:
        torch.set_num_threads(threads)
    D, se = recast.level_curves(*stats)
    rho = recast.credit_profiles(D, se, sigmas, stats[0])[3]
    out = {
        "names": list(names),
        "iterations": iterations,
        "prompts": prompts,
        "steps": args.steps,
        "estimator": "pairs",
        "world": shapes_world.world_id(),
        "sigmas": sigmas.tolist(),
        "n": stats[0].tolist(),
        "s1": stats[1].tolist(),
        "s2": stats[2].tolist(),
        "D": np.where(np.isfinite(D), D, -1.0).tolist(),
        "se": np.where(np.isfinite(se), se, -1.0).tolist(),
        "rho": rho.tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    records.write_atomic(path, json.dumps(out))  # a kill leaves no torn file
    return out


def setting_W(prof: dict, rewards, budgets):
    """W that ReCAST builds from the measured profiles of `rewards` (recast.credit_profiles + solve_W
    at the defaults): what the credit looks like with ~prompts * iterations groups of evidence."""
    import recast

    rows = [prof["names"].index(k) for k in rewards]
    n, s1, s2 = np.asarray(prof["n"]), np.asarray(prof["s1"])[rows], np.asarray(prof["s2"])[rows]
    D, se = recast.level_curves(n, s1, s2)
    P, rho = recast.credit_profiles(D, se, np.asarray(prof["sigmas"]), n)[2:]
    return recast.solve_W([float(b) for b in budgets], P), rho


def settings_W(prof: dict, settings: dict) -> dict:
    """setting -> (W at uniform budgets, evidence rho) from the measured profiles, for each of `settings` (setting ->
    its rewards: bench.SETTINGS): what the profile table and figure show."""
    return {setting: setting_W(prof, rewards, ["0.25"] * len(rewards)) for setting, rewards in settings.items()}


def profile_table(prof: dict, settings: dict) -> list[str]:
    """Markdown: each candidate's D_k(0) with its standard error, D_k(t) / D_k(0) at every measured level,
    and per setting of `settings` (setting -> its rewards) the evidence rho and how far W departs from uniform
    (uniform budgets)."""
    sig, D, se = np.asarray(prof["sigmas"]), np.asarray(prof["D"]), np.asarray(prof["se"])
    n = np.asarray(prof["n"])
    levels = [j for j in range(1, len(sig)) if n[j] >= 2]
    lines = [
        f"## The settings, from measured gains (`measure_profiles`: {prof['iterations']} iterations x "
        f"{prof['prompts']} prompt groups of the pretrained model, {int(prof['n'][1])} groups per inner level)",
        "",
        "| reward | D(0) nats ± se | " + " | ".join(f"t={sig[j]:.2f}" for j in levels) + " |",
        "|---" * (2 + len(levels)) + "|",
    ]
    for k, name in enumerate(prof["names"]):
        top = D[k, -1]
        cells = [f"{D[k, j] / top:.2f} ± {se[k, j] / top:.2f}" if se[k, j] >= 0 else "" for j in levels]
        lines.append(f"| {name} | {top:.4f} ± {se[k, -1]:.4f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "D(t) / D(0) ± se / D(0): the share of the reward's final discriminability already decided at noise level t.",
        "",
    ]
    for setting, (W, rho) in settings_W(prof, settings).items():
        rewards, dev = settings[setting], np.abs(w_ratio(W) - 1)
        lines.append(
            f"- setting {setting} ({', '.join(rewards)}): evidence rho {', '.join(f'{r:.2f}' for r in rho)}; "
            f"W at uniform budgets departs from uniform by max {dev.max():.3f}, mean {dev.mean():.3f} "
            "(|K T W / Lam - 1|)"
        )
    return lines + [""]


def profile_figure(prof: dict, path: Path, settings: dict):
    """Left: each candidate's D_k(t) / D_k(0) against t with +- 1 se (the settings' rewards marked);
    right: ReCAST's W for each setting at uniform budgets, from these measurements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sig, names = np.asarray(prof["sigmas"]), prof["names"]
    D, se = np.asarray(prof["D"]), np.asarray(prof["se"])
    fig, axes = plt.subplots(
        1,
        1 + len(settings),
        figsize=(5.5 + 3.6 * len(settings), 3.6),
        gridspec_kw={"width_ratios": [1.6] + [1] * len(settings)},
    )
    for k, name in enumerate(names):
        ok = D[k] >= 0
        where = [s for s, rw in settings.items() if name in rw]
        style = "-" if where else ":"
        top = D[k, -1] if D[k, -1] > 0 else 1.0
        axes[0].errorbar(
            sig[ok],
            D[k, ok] / top,
            yerr=se[k, ok] / top,
            ls=style,
            marker="o",
            ms=3,
            capsize=2,
            label=f"{name}" + (f" ({'+'.join(where)})" if where else ""),
        )
    axes[0].set(
        xlabel="t (1 = noise, 0 = image)",
        ylabel="D_k(t) / D_k(0)",
        title="Rényi gain measured on the pretrained model",
        xlim=(1.02, -0.02),
    )
    axes[0].legend(fontsize=7, ncol=2)
    for ax, (setting, (W, rho)) in zip(axes[1:], settings_W(prof, settings).items()):
        rewards = settings[setting]
        im = ax.imshow(w_ratio(W), aspect="auto", cmap="coolwarm", vmin=0.5, vmax=1.5)
        ax.set(
            title=f"setting {setting}: K T W / Lam",
            xlabel="step j (t from 1 to 0)",
            yticks=range(len(rewards)),
            yticklabels=[f"{r} (rho {p:.2f})" for r, p in zip(rewards, rho)],
        )
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =============================================================================
# The final evaluation: every run's last checkpoint on a larger held-out set
# =============================================================================


EVAL_SEEDS = (1, 2)  # the final evaluation's noise seeds: the first for the tables, the second for the noise floor


def final_eval_images(pipe, transformer_state, prompts, seed, steps=10):
    """Held-out images of one LoRA state (None: the pretrained model): Euler ODE, fixed noise per seed."""
    import torch
    from peft.utils import set_peft_model_state_dict

    import nft
    import sd3

    tr = pipe.transformer
    if transformer_state is None:
        tr.disable_adapters()
    else:
        tr.enable_adapters()
        set_peft_model_state_dict(tr, transformer_state, adapter_name="default")
        tr.set_adapter("default")
    emb, pooled = sd3.encode(pipe, prompts, shapes_world.GEN_KWARGS["max_sequence_length"], "cpu")
    shape = (
        tr.config.in_channels,
        shapes_world.RES // pipe.vae_scale_factor,
        shapes_world.RES // pipe.vae_scale_factor,
    )
    with torch.no_grad():
        latents = nft.ode_sample(tr, emb, pooled, sd3.scheduler_sigmas(pipe, steps), shape, seed)
    tr.enable_adapters()
    return sd3.decode(pipe, latents)


def final_scores(images, prompts):
    """Per-image scores of every candidate reward, the CNN judge and the preference judge; the set's Fréchet
    distance."""
    return {
        **{k: shapes_world.REWARDS[k](images, prompts).tolist() for k in PROFILE_CANDIDATES},
        "judge/cnn": shapes_world.judge_cnn(images, prompts).tolist(),
        "judge/pref": shapes_world.judge_preference(images, prompts).tolist(),
        "judge/frechet": shapes_world.frechet_distance(images, prompts),
    }


def final_set(exp) -> str:
    """The final evaluation's set, in words: every held-out caption (or, at --quick, the first few) x the noises."""
    captions = f"the first {exp.final_captions} held-out captions" if exp.final_captions else "every held-out caption"
    return f"{captions} x {exp.final_noises} noises"


def final_evals(runs: list, exp_dir: Path, noises: int, captions: int = 0):
    """The final evaluation of every run of `runs` (bench.Run: those whose results were read) and of the pretrained
    model, on a held-out set
    larger than the runs' own: every held-out caption (the first `captions` of them, where given: --quick) x `noises`
    noises, at each of EVAL_SEEDS
    (same images for every method: paired). Cached next to each result as <run>.final.json (keyed by the
    checkpoint's name); returns {run_id or "pretrained": {seed: scores}}. The model (torch, recast, the kit) is
    imported only when something is evaluated: a rebuild from cached evaluations needs none of it."""
    prompts = [c for c in shapes_world.splits()["heldout"][: captions or None] for _ in range(noises)]
    out, pipe = {}, None
    todo = [("pretrained", None, exp_dir / "runs" / "pretrained.final.json")]
    todo += [(r.run_id, r.work / "checkpoints", r.result.with_name(r.run_id + ".final.json")) for r in runs]
    for run_id, ckpts, path in todo:
        cached, problem = read_json(path) if path.exists() else ({}, None)
        if problem is None and not isinstance(cached, dict):
            problem = f"a JSON {type(cached).__name__}, not a final evaluation"
        if problem:
            print(f"warning: {path}: {problem}; not used (evaluated anew where the run's checkpoint exists)")
            cached = {}
        if ckpts and not (ckpts / "latest").is_file():  # no run folder (a fresh clone): the committed evaluation
            if cached.get("n") == len(prompts) and "scores" in cached:
                out[run_id] = cached["scores"]
            continue
        latest = (ckpts / (ckpts / "latest").read_text().strip()) if ckpts else None
        key = latest.name if latest else "pretrained"  # the checkpoint's name: the cache survives moving --out
        if (
            Path(str(cached.get("checkpoint", ""))).name == key
            and cached.get("n") == len(prompts)
            and "scores" in cached
        ):
            out[run_id] = cached["scores"]
            continue
        if ckpts and not (latest / "state.pt").is_file():
            continue  # result without its checkpoint (work folder removed): no final evaluation
        if pipe is None:
            import torch

            import recast
            import sd3
            from kit import records

            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            pipe = sd3.load_pipeline(recast.parse_args([]), "cpu", torch.float32)
        state = torch.load(latest / "state.pt", weights_only=False)["lora"]["default"] if latest else None
        scores = {
            str(seed): final_scores(final_eval_images(pipe, state, prompts, seed), prompts) for seed in EVAL_SEEDS
        }
        if problem:  # the damaged file is kept, never overwritten
            where = set_aside({path: problem}, exp_dir, "damaged")
            print(f"{path}: moved to {where / path.name}; evaluated anew", flush=True)
        records.write_atomic(
            path, json.dumps({"checkpoint": key, "n": len(prompts), "prompts": prompts, "scores": scores})
        )
        out[run_id] = scores
    if pipe is not None:
        torch.set_num_threads(threads)
    return out


def final_value(scores: dict, metric: str, names=(), budgets=(), base: dict | None = None):
    """One number of a final evaluation (`final_evals` scores at one seed): a reward's or judge's mean,
    the frechet distance, `weighted` (budget-weighted raw mean) or `scale_free`: each reward's change
    from the pretrained model (`base`, same images) in units of the pretrained per-image spread,
    budget-weighted: sum_k lambda_k (mean_k - mean0_k) / sd0_k / sum_k lambda_k."""
    if metric == "judge/frechet":
        return float(scores[metric])
    lam = np.asarray(budgets, dtype=float)
    if metric == "weighted":
        return float(lam @ [np.nanmean(scores[k]) for k in names] / lam.sum())
    if metric == "scale_free":
        z = [(np.nanmean(scores[k]) - np.nanmean(base[k])) / max(float(np.nanstd(base[k])), 1e-12) for k in names]
        return float(lam @ z / lam.sum())
    return float(np.nanmean(scores[metric]))


# =============================================================================
# The report
# =============================================================================


@dataclass
class CellTables:
    """What `report_protocol` reads of one group (setting x budgets) of an experiment: its rewards and budgets, the
    metrics tabled, run ids per label and seed, the final evaluation's `value(label, metric)` and
    `pref(mine, other)` ({seed: number}), and per comparison (mine, other) the paired differences: `diffs` (mean_ci's
    tuple per metric, "pref" on the logit scale) and `raw` (the per-seed differences behind them)."""

    names: list
    budgets: list
    metrics: list
    ids: dict
    value: Callable
    pref: Callable
    diffs: dict
    raw: dict


def finished_final_evals(res: Results) -> dict:
    """`final_evals` of every finished run of `res` and the pretrained model; a result whose final evaluation is gone
    (and its checkpoint too) is named in `res.incomplete` (marked PARTIAL), not dropped silently."""
    finals = final_evals(res.finished, res.exp_dir, res.exp.final_noises, res.exp.final_captions)
    read = {r["run_id"] for r in res.records}
    for run in res.finished:
        if run.run_id in read and run.run_id not in finals:
            res.incomplete[run.run_id] = (
                f"no final evaluation ({run.run_id}.final.json missing, no checkpoint to redo it)"
            )
    return finals


def cell_rewards(cell) -> tuple[list, list]:
    """A cell's training rewards (--rewards) and their budgets (--budgets, floats)."""
    return (
        flag_value(cell.flags, "--rewards").split(","),
        [float(b) for b in flag_value(cell.flags, "--budgets").split(",")],
    )


def noise_set_differences(value, labels, metrics, seed_b) -> dict:
    """{metric: per run, the same weights' final value on the first noise set minus on the second (seed_b)}, over the
    runs of `labels`: the noise floor's data. value(label, metric[, noise seed]) -> {training seed: value}."""
    out = {m: [] for m in metrics}
    for label in labels:
        for m in metrics:
            a, b = value(label, m), value(label, m, seed_b)
            out[m].extend(a[s] - b[s] for s in a if s in b)
    return out


def report_protocol(res: Results, out: Path):
    """Issue 11: per (setting, budget) cell, recast minus each other method, paired by seed, on every
    training reward and judge of the large final evaluation, raw and scale-free, plus the preference
    judge's share (mean sigmoid of the score difference); Holm per metric over cells x comparisons; the noise floor
    of one evaluation; then how often ReCAST improves each judge."""
    finals = finished_final_evals(res)
    lines = res.banner()
    seed_a, seed_b = (str(s) for s in EVAL_SEEDS)
    base = finals.get("pretrained", {})
    n_img = len(next(iter(base.values()))["judge/cnn"]) if base else 0
    cells, floors = {}, {}  # group -> what its tables need; metric -> same weights' differences between noise sets
    for group, by_label in res.runs.items():
        cell = next(c for c in res.exp.cells if c.group == group)
        names, budgets = cell_rewards(cell)
        metrics = names + ["weighted", "scale_free", "judge/cnn", "judge/frechet"]
        ids = {label: dict(res.ids.get(group, {}).get(label, {})) for label in by_label}

        def value(label, m, seed_key=seed_a, ids=ids, names=names, budgets=budgets):
            return {
                s: final_value(finals[i][seed_key], m, names, budgets, base[seed_key])
                for s, i in ids[label].items()
                if i in finals
            }

        def pref(mine, other, seed_key=seed_a, ids=ids):
            return {
                s: pref_share(
                    finals[ids[mine][s]][seed_key]["judge/pref"], finals[ids[other][s]][seed_key]["judge/pref"]
                )
                for s in ids[mine]
                if s in ids[other] and ids[mine][s] in finals and ids[other][s] in finals
            }

        for m, d in noise_set_differences(value, ids, metrics, seed_b).items():  # noise floor
            floors.setdefault(m, []).extend(d)
        comparisons = (  # the experiment's own pairs, else every ReCAST arm against every other arm
            [(r, o) for r, o in res.exp.pairs if r in ids and o in ids]
            if res.exp.pairs
            else [(r, o) for r in ids if r.startswith("recast") for o in ids if not o.startswith("recast")]
        )
        diffs, raw = {}, {}
        for mine, other in comparisons:
            raw[(mine, other)] = {m: paired(value(mine, m), value(other, m)) for m in metrics}
            diffs[(mine, other)] = {m: mean_ci(v) for m, v in raw[(mine, other)].items()}
            shares = (pref(mine, other), pref(mine, other, seed_b))
            raw[(mine, other)]["pref"] = [share_logit(x) for x in shares[0].values() if np.isfinite(x)]
            diffs[(mine, other)]["pref"] = share_logits(shares[0].values())
            floors.setdefault("pref", []).extend(  # on the logit scale, where the share is tested
                share_logit(shares[0][s]) - share_logit(shares[1][s]) for s in shares[0] if s in shares[1]
            )
        cells[group] = CellTables(names, budgets, metrics, ids, value, pref, diffs, raw)
    floor_sd = {m: np.std(v, ddof=1) / np.sqrt(2) for m, v in floors.items() if len(v) > 1}
    family = [(g, c, m) for g, t in cells.items() for c in t.diffs for m in t.diffs[c]]
    adjusted, exact, exact_holm = {}, {}, {}
    for m in dict.fromkeys(k[2] for k in family):  # Holm per metric over every cell x comparison of the experiment
        keys = [k for k in family if k[2] == m]
        adjusted.update(zip(keys, holm([p_value(*cells[g].diffs[c][m]) for g, c, _ in keys])))
        exact.update({(g, c, m): sign_flip_p(cells[g].raw[c][m]) for g, c, _ in keys})
        exact_holm.update(zip(keys, holm([exact[k] for k in keys])))
    n_tests = max((sum(k[2] == m for k in family) for m in {k[2] for k in family}), default=0)
    lines += [
        f"Final evaluation: {final_set(res.exp)} ({n_img} images, Euler ODE, 10 "
        "steps), the same images (prompt and noise) for every method and the pretrained model, so every Fréchet "
        "distance here is over the same N. Judges are never trained on: `cnn` (learned attribute judge), `frechet` "
        "(distance of the judge's features to the data; lower is better: its difference counts as an improvement "
        "when negative) and `pref` (pairwise preference judge, a Bradley-Terry CNN trained on its own "
        "render-vs-corruption pairs: per seed, the mean over images of sigmoid(score of ReCAST's image − score of "
        "the other's), 0.5 = no preference; across seeds the mean logit with a 95% t interval, mapped back). "
        "`scale_free`: each training reward's change from the pretrained model in units of its pretrained per-image "
        "spread, budget-weighted; `weighted`: the budget-weighted raw mean.",
        "",
        f"Correction: Holm per metric over every cell x comparison of this experiment ({n_tests} tests per metric); "
        "`Holm` is the adjusted p. `exact`: the sign-flip test of the same paired differences (no normal model) and "
        f"its Holm p over the same family; its smallest p at n seeds is 2 / 2^n ({exact_floor(cells)}), so where the "
        "t test resolves a difference and the exact test cannot, the decision rests on the normal model. N80: seeds "
        f"for 80% power (paired t) at level 0.05 / {n_tests} (Holm's first step) and the larger of the observed "
        "difference and two noise floors of one evaluation (the table at the end), with its range over the sd's 95% "
        "interval.",
        "",
    ]
    counts = {}
    for group, t in cells.items():
        names, budgets, metrics, ids, value, diffs = t.names, t.budgets, t.metrics, t.ids, t.value, t.diffs
        lines += [
            f"## setting {group.split('-')[0]} ({', '.join(names)}), budgets {','.join(f'{b:g}' for b in budgets)}",
            "",
            "| method | n | " + " | ".join(metrics) + " |",
            "|---" * (2 + len(metrics)) + "|",
        ]
        if base:
            lines.append(
                "| pretrained | | "
                + " | ".join(f"{final_value(base[seed_a], m, names, budgets, base[seed_a]):.4f}" for m in metrics)
                + " |"
            )
        for label in ids:
            lines.append(
                f"| {label} | {len(value(label, metrics[0]))} | "
                + " | ".join(mean_std(list(value(label, m).values())) for m in metrics)
                + " |"
            )
        lines += [
            "",
            "| difference | n | " + " | ".join(metrics) + " | pref share |",
            "|---" * (3 + len(metrics)) + "|",
        ]
        for (mine, other), d in diffs.items():
            key = {m: (group, (mine, other), m) for m in d}
            kw = {
                m: dict(
                    floor=floor_sd.get(m),
                    p_holm=adjusted[key[m]],
                    family=n_tests,
                    exact=exact[key[m]],
                    exact_holm=exact_holm[key[m]],
                )
                for m in d
            }
            lines.append(
                f"| {mine} − {other} | {max(v[3] for v in d.values())} | "
                + " | ".join(fmt_ci(*d[m], **kw[m]) for m in metrics)
                + f" | {fmt_share(*d['pref'], **kw['pref'])} |"
            )
            for m, (mean, lo, hi, n) in d.items():
                if n == 0:
                    continue
                c = counts.setdefault((mine, other, m), [0, 0, 0, 0, 0])
                c[2] += 1
                c[0] += better_sign(m) * mean > 0
                c[1] += verdict(m, lo, hi) == 1 and adjusted[key[m]] < ALPHA
                c[3] += verdict(m, lo, hi) == 1 and exact_holm[key[m]] < ALPHA
                c[4] += verdict(m, lo, hi) == -1 and adjusted[key[m]] < ALPHA
        lines.append("")
    lines += distance_lines(res, cells)
    lines += [
        "## How far ReCAST's W moved",
        "",
        "| setting | method | runs | iterations with W off uniform | mean max_kj abs(W / W_unif - 1) |",
    ]
    lines += ["|---|---|---|---|---|"]
    for setting in sorted({g.split("-")[0] for g in res.runs}):
        for label in sorted(
            {
                lbl
                for g, by in res.runs.items()
                if g.startswith(setting + "-")
                for lbl in by
                if lbl.startswith(("recast", "reversed"))
            }
        ):
            devs = [
                [w_departure(row["recast/W"]) for row in rows]
                for g, by in res.runs.items()
                if g.startswith(setting + "-")
                for rows in by.get(label, {}).values()
            ]
            if devs:
                off = np.mean([np.mean(np.asarray(d) > 1e-3) for d in devs])
                lines.append(
                    f"| {setting} | {label} | {len(devs)} | {off:.0%} | {np.mean([np.mean(d) for d in devs]):.3f} |"
                )
    lines += [
        "",
        "## Noise floor of one evaluation",
        "",
        f"The same weights evaluated on two noise sets (seeds {seed_a} and {seed_b}, same prompts): the standard "
        "deviation of one "
        "evaluation is sd(difference) / sqrt(2) over all finished runs; a method difference below ~2x this is not "
        "resolved by "
        "one evaluation (the paired intervals above include it, since each seed's difference is a separate "
        "evaluation). `pref`: on the logit scale of its share, the same pair of methods on the two noise sets.",
        "",
        "| metric | noise sd of one evaluation | runs |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {sd:.4f} | {len(floors[m])} |" for m, sd in floor_sd.items()]
    tally = {  # (mine, other, metric) -> [improves, significant after Holm, cells with results, cells planned,
        # significant after Holm of the exact test, significantly worse after Holm]
        key: [
            int(n),
            int(sig),
            int(done),
            sum(key[0] in by and key[1] in by for by in res.runs.values()),
            int(ex),
            int(w),
        ]
        for key, (n, sig, done, ex, w) in counts.items()
    }
    (res.exp_dir / "summary.json").write_text(json.dumps({" | ".join(k): v for k, v in sorted(tally.items())}) + "\n")
    lines += ["", "## Summary", ""] + summary_lines(tally)
    files = [res.exp_dir.parent / name / "summary.json" for name in res.together]
    tallies = [read_json(f) for f in files if f.is_file()]
    for f, (_, problem) in zip(files, tallies):
        if problem:
            print(
                f"warning: {f}: {problem}; the summary over both settings is left out (rebuild that setting's "
                "table with --tables-only to rewrite it)"
            )
    if tallies and len(tallies) == len(files) and all(t is not None for t, _ in tallies):  # every setting has run
        both = {}
        for tally_of_setting, _ in tallies:
            for text, v in tally_of_setting.items():
                key = tuple(text.split(" | "))
                both[key] = [a + b for a, b in zip(both.get(key, [0] * 6), v + [0] * (6 - len(v)))]
        lines += ["", f"## Summary over both settings ({', '.join(res.together)}; Holm within each)", ""]
        lines += summary_lines(both)
    prof_path = res.profiles
    prof, problem = read_json(prof_path) if prof_path and prof_path.is_file() else (None, None)
    if problem or prof is not None and not isinstance(prof, dict):
        print(f"warning: {prof_path}: {problem or 'not a JSON object'}; the profile table and figure are left out")
    elif prof is not None:
        profile_figure(prof, out / "profiles.png", res.settings)
        lines = lines[:3] + profile_table(prof, res.settings) + lines[3:]
    curve_figure(res, out / "reward_vs_time.png", x="iterations")
    drawn = w_figure(res, out / "W_final.png", labels=W_LABELS)
    return lines + [
        "",
        "Measured D_k(t) of the candidate rewards and the W ReCAST builds from them: ![](profiles.png)",
        "",
        "Held-out `eval/weighted` of the runs' own small evaluation (16 prompts) along training: "
        "![](reward_vs_time.png)",
        "",
        *([w_caption(drawn), ""] if drawn else []),
    ]


def report_final_non_inferiority(res: Results, out: Path):
    """rvge-joint-fifth (issue 45): "matches the baseline" decided on the large final evaluation (`final_evals`: every
    held-out caption x final_noises noises, the same images for every model). Per group: each method's and the
    pretrained model's final metrics (the training rewards, `weighted`, the CNN judge, the Fréchet distance); each
    method − baseline, paired by seed; the non-inferiority test (`reports.non_inferiority_table`) at half the lower
    95% bound of the baseline's own gain over the pretrained model, Holm per method over the metrics on which that
    gain is resolved, with the pretrained model as the control; the noise floor of one final evaluation."""
    finals = finished_final_evals(res)
    lines = res.banner()
    seed_a, seed_b = (str(s) for s in EVAL_SEEDS)
    pre = finals.get("pretrained", {})
    base = res.exp.baseline
    for group, by_label in res.runs.items():
        names, budgets = cell_rewards(next(c for c in res.exp.cells if c.group == group))
        metrics = names + ["weighted", "judge/cnn", "judge/frechet"]
        ids = {label: dict(res.ids.get(group, {}).get(label, {})) for label in by_label}

        def value(label, m, key=seed_a, ids=ids, names=names, budgets=budgets):
            return {s: final_value(finals[i][key], m, names, budgets) for s, i in ids[label].items() if i in finals}

        if not pre or not any(value(label, metrics[0]) for label in ids):
            lines += [f"## {group}: no final evaluation yet", ""]
            continue
        n_img = len(pre[seed_a]["judge/cnn"])
        before = {m: final_value(pre[seed_a], m, names, budgets) for m in metrics}
        lines += [
            f"## {group}: the final evaluation (mean ± sd over seeds; frechet: lower is better)",
            "",
            f"{final_set(res.exp).capitalize()} ({n_img} images, Euler ODE, 10 steps) from each "
            f"run's last checkpoint and from the pretrained model, the same images (prompt and noise) for every model, "
            f"noise seed {seed_a} (seed {seed_b}: the noise floor below); `weighted`: the budget-weighted mean of the "
            "training rewards; Fréchet distances over the same N images.",
            "",
            "| method | n | iterations | training seconds | " + " | ".join(metrics) + " |",
            "|---" * (4 + len(metrics)) + "|",
            "| pretrained | | 0 | 0 | " + " | ".join(f"{before[m]:.4f}" for m in metrics) + " |",
        ]
        for label, runs in by_label.items():
            lines.append(
                f"| {label} | {len(value(label, metrics[0]))} | {cell_iterations(res.exp, res.cells[(group, label)])} "
                f"| {mean_std([elapsed(r)[-1] for r in runs.values()], 1)} | "
                + " | ".join(mean_std(list(value(label, m).values())) for m in metrics)
                + " |"
            )
        diffs = {
            label: {m: paired(value(label, m), value(base, m)) for m in metrics} for label in by_label if label != base
        }
        lines += [
            "",
            f"Paired differences method − {base} [95% t], two-sided paired t p and exact sign-flip p, no correction "
            "(the decision is the non-inferiority table below):",
            "",
            "| method | " + " | ".join(metrics) + " |",
            "|---" * (1 + len(metrics)) + "|",
        ]
        for label, d in diffs.items():
            cells = [fmt_ci(*mean_ci(d[m]), exact=sign_flip_p(d[m]), power=False) for m in metrics]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        gains = {m: [v - before[m] for v in value(base, m).values()] for m in metrics}
        lines += [""] + non_inferiority_table(base, metrics, diffs, gains, family="metrics")
        floors = noise_set_differences(value, ids, metrics, seed_b)
        lines += [
            f"Noise floor of one final evaluation: the same weights on noise seeds {seed_a} and {seed_b}, sd of the "
            "difference / sqrt(2) over every run: "
            + ", ".join(f"{m} {np.std(v, ddof=1) / np.sqrt(2):.4g}" for m, v in floors.items() if len(v) > 1)
            + ".",
            "",
        ]
    curve_figure(res, out / "reward_vs_time.png", metric=ALONG)
    return lines + ["![](reward_vs_time.png)", ""]


def at_distance(rows, metric, d):
    """A run's in-run held-out `metric` at distance d from the base model: its evaluations placed on
    `reports.distance_curve` (the running maximum of `loss/base_reg`, 0 at the pretrained model) and interpolated
    linearly; NaN past the farthest the run went."""
    x, y = distance_curve(rows), eval_curve(rows, metric)[2]
    n = min(len(x), len(y))
    if n == 0 or not d <= x[n - 1] + 1e-15:
        return np.nan
    xu, first = np.unique(x[:n], return_index=True)  # a plateau of the running maximum: its first evaluation
    return float(np.interp(d, xu, y[:n][first]))


def distance_lines(res: Results, cells: dict) -> list[str]:
    """Markdown: how far each arm moved from the base model, and every comparison read at matched distance (issue 45:
    the drift confound rvge-drift controls for RVGE). (1) `reports.distance_to_base` per arm; (2) per comparison the
    distance ratio mine / other (paired log ratio, Holm over the comparisons, t and exact), and the in-run held-out
    metrics of both runs at the distance both reached (the smaller of their final `distance_curve`s, `at_distance`:
    the farther run interpolated between its evaluations), `weighted` at the cell's budgets, Holm per metric; (3) the
    final evaluation's differences with the log distance ratio as a covariate (`adjusted_difference`: an intercept
    per cell, one slope per comparison), Holm per metric."""
    dist = {(g, lbl): res.values(g, lbl, distance_to_base) for g, t in cells.items() for lbl in t.ids}
    comps = [(g, c) for g, t in cells.items() for c in t.diffs]
    if not comps or not all(np.isfinite(v).all() for d in dist.values() for v in [list(d.values())] if v):
        return []
    labels = list(dict.fromkeys(lbl for _, lbl in dist))
    lines = [
        "## Distance to the base model, and the comparisons at matched distance",
        "",
        "Distance to base: `loss/base_reg` (mean |v_theta - v_base|^2 on the training queries) over each run's last 10 "
        "iterations, mean ± sd over seeds. A method that moves farther can raise a reward further at the same "
        "iterations; these tables read each comparison where the two runs have moved equally far.",
        "",
        "| cell | " + " | ".join(labels) + " |",
        "|---" * (1 + len(labels)) + "|",
    ]
    for g in cells:
        lines.append(
            f"| {g} | "
            + " | ".join(mean_std(list(dist[(g, lbl)].values()), 5) if (g, lbl) in dist else "" for lbl in labels)
            + " |"
        )
    # (2) distance ratios and in-run metrics at matched distance
    inrun = {g: [*t.names, "weighted", "judge/cnn", "judge/frechet"] for g, t in cells.items()}

    def matched(g, mine, other, m):
        t, runs = cells[g], res.runs[g]
        out = {}
        for s in sorted(set(runs.get(mine, {})) & set(runs.get(other, {}))):
            a, b = runs[mine][s], runs[other][s]
            d = min(distance_curve(a)[-1], distance_curve(b)[-1])
            if m == "weighted":
                lam = np.asarray(t.budgets)
                va = lam @ [at_distance(a, f"eval/{k}", d) for k in t.names] / lam.sum()
                vb = lam @ [at_distance(b, f"eval/{k}", d) for k in t.names] / lam.sum()
            else:
                va, vb = at_distance(a, f"eval/{m}", d), at_distance(b, f"eval/{m}", d)
            out[s] = va - vb
        return [v for v in out.values() if np.isfinite(v)]

    ratio = {(g, c): paired(*({s: np.log(v) for s, v in dist[(g, x)].items()} for x in c)) for g, c in comps}
    r_ci = {k: mean_ci(v) for k, v in ratio.items()}
    r_holm = dict(zip(comps, holm([p_value(*r_ci[k]) for k in comps])))
    r_exact = {k: sign_flip_p(v) for k, v in ratio.items()}
    r_exact_holm = dict(zip(comps, holm([r_exact[k] for k in comps])))
    cols = list(dict.fromkeys(m for g in cells for m in inrun[g]))
    at = {(g, c, m): matched(g, *c, m) for g, c in comps for m in inrun[g]}
    holms = {}
    for m in cols:
        keys = [(g, c, m) for g, c in comps if (g, c, m) in at]
        cis = {k: mean_ci(at[k]) for k in keys}
        holms.update(
            {
                k: (cis[k], h, sign_flip_p(at[k]), e)
                for k, h, e in zip(
                    keys, holm([p_value(*cis[k]) for k in keys]), holm([sign_flip_p(at[k]) for k in keys])
                )
            }
        )
    n_tests = len(comps)
    lines += [
        "",
        f"Distance ratio mine / other: exp of the mean paired log ratio [95% t], Holm over these {n_tests} comparisons "
        "(t, and the exact sign-flip test). At matched distance: per seed, both runs' in-run held-out evaluation (16 "
        "prompts, the runs' own) at the distance both reached, the smaller of their final running-maximum distances "
        "(the farther run interpolated linearly between its evaluations, the nearer one at its end); `weighted` at the "
        f"cell's budgets; paired over seeds, Holm per metric over these {n_tests} comparisons (t and exact); "
        "frechet over the in-run set's images (lower is better). Compare with the same in-run metrics at the final "
        "iteration (the figure's curves), not with the final evaluation's larger tables above. A secondary reading: "
        "no N80, and the Power section sizes the comparisons above only.",
        "",
        "| difference | distance ratio [95%] | " + " | ".join(f"{m} at matched distance" for m in cols) + " |",
        "|---" * (2 + len(cols)) + "|",
    ]
    for g, c in comps:
        m, lo, hi, n = r_ci[(g, c)]
        cells_ = [
            f"{np.exp(m):.3g} [{np.exp(lo):.3g}, {np.exp(hi):.3g}] (n={n}) Holm {r_holm[(g, c)]:.2g}"
            f"{fmt_exact(r_exact[(g, c)], r_exact_holm[(g, c)])}"
        ]
        for col in cols:
            if (g, c, col) not in holms:
                cells_.append("")
                continue
            ci, h, e, eh = holms[(g, c, col)]
            digits = 1 if col == "judge/frechet" else 4
            cells_.append(fmt_ci(*ci, digits=digits, p_holm=h, family=n_tests, exact=e, exact_holm=eh, power=False))
        lines.append(f"| {g}: {c[0]} − {c[1]} | " + " | ".join(cells_) + " |")
    # (3) the final evaluation with the log distance ratio as a covariate
    final_metrics = list(dict.fromkeys(m for t in cells.values() for m in [*t.metrics, "pref"]))
    fits = {}
    for c in dict.fromkeys(c for _, c in comps):
        groups = [g for g, cc in comps if cc == c]
        for m in final_metrics:
            y, x, cell = [], [], []
            for g in groups:
                t = cells[g]
                if m != "pref" and m not in t.metrics:
                    continue
                ys = (
                    t.pref(*c)
                    if m == "pref"
                    else {s: v - w for s, v in t.value(c[0], m).items() if (w := t.value(c[1], m).get(s)) is not None}
                )
                for s, v in ys.items():
                    if s in dist[(g, c[0])] and s in dist[(g, c[1])]:
                        y.append(share_logit(v) if m == "pref" else v)
                        x.append(np.log(dist[(g, c[0])][s] / dist[(g, c[1])][s]))
                        cell.append(g)
            if len(set(cell)) and len(y) > len(set(cell)) + 1:
                fits[(c, m)] = adjusted_difference(y, x, cell)
    adj_holm = {}
    for m in final_metrics:
        keys = [(g, c, m) for g, c in comps if (c, m) in fits and g in fits[(c, m)][0]]
        adj_holm.update(zip(keys, holm([fits[(c, m)][0][g][3] for g, c, _ in keys])))

    from scipy.special import expit

    def fmt_a(a, m):
        v, lo, hi, p = a[:4]
        if not np.isfinite(v):
            return "n/a"
        if m == "pref":
            return f"{expit(v):.3f} [{expit(lo):.3f}, {expit(hi):.3f}] p {p:.2g}"
        digits = 1 if m == "judge/frechet" else 4
        return f"{v:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] p {p:.2g}"

    lines += [
        "",
        "The final evaluation with distance as a covariate: per comparison, the per-seed differences of the tables "
        "above regressed on the per-seed log distance ratio log(mine / other), an intercept per cell and one slope "
        "(`adjusted_difference`); the intercept is the difference at equal distance [95% t] (pref: the share at "
        "equal distance, from its logit), Holm per metric over the cells x comparisons. x: the range of the log "
        "ratios (an intercept outside it is an extrapolation along the slope); slope rows: the change per unit log "
        "ratio. Normal-model estimates: no exact test is given for a regression here.",
        "",
        "| difference at equal distance | x | " + " | ".join(final_metrics) + " |",
        "|---" * (2 + len(final_metrics)) + "|",
    ]
    for c in dict.fromkeys(c for _, c in comps):
        for g in [g for g, cc in comps if cc == c]:
            first = next((fits[(c, m)][0][g] for m in final_metrics if (c, m) in fits and g in fits[(c, m)][0]), None)
            xr = f"[{first[4]:+.2f}, {first[5]:+.2f}]" if first else ""
            row = [
                fmt_a(fits[(c, m)][0][g], m) + f" Holm {adj_holm[(g, c, m)]:.2g}"
                if (c, m) in fits and g in fits[(c, m)][0]
                else ""
                for m in final_metrics
            ]
            lines.append(f"| {g}: {c[0]} − {c[1]} | {xr} | " + " | ".join(row) + " |")
        slopes = [fits[(c, m)][1] if (c, m) in fits else None for m in final_metrics]
        lines.append(
            f"| slope, {c[0]} − {c[1]} | | "
            + " | ".join(
                f"{b[0]:+.4g} [{b[1]:+.4g}, {b[2]:+.4g}] p {b[3]:.2g}" if b and np.isfinite(b[0]) else ""
                for b in slopes
            )
            + " |"
        )
    return lines + [""]


def exact_floor(cells) -> str:
    """ "3 seeds: 0.25" / "8 seeds: 0.0078": the smallest two-sided p the sign-flip test can give at each seed count
    of the experiment's comparisons."""
    ns = sorted({v[3] for t in cells.values() for d in t.diffs.values() for v in d.values() if v[3] > 1})
    return "; ".join(f"{n} seeds: {2 / 2**n:.2g}" for n in ns) or "no comparison"


def summary_lines(tally: dict) -> list[str]:
    """Markdown bullets: per (method, other, judge or summary metric) "improves ... in n of N cells (significant
    after Holm in m; by the exact test in e; significantly worse in w)", from tally[(mine, other, metric)] =
    [improves, significant, cells with results, cells planned, significant by the exact test, significantly worse]
    (a tally written before 2026-12-04 has neither of the last two)."""
    lines = []
    for (mine, other, m), (n, sig, cells, planned, *ex) in sorted(tally.items()):  # ex: [exact, worse] or []
        if m.startswith("judge/") or m in ("scale_free", "weighted", "pref"):
            what = (
                f"judge {m[len('judge/') :]}"
                if m.startswith("judge/")
                else ("judge pref (share > 0.5)" if m == "pref" else m)
            )
            lines.append(
                f"- {'ReCAST' if mine == 'recast' else mine} improves {what} over {other} in {n} of {planned} cells "
                f"(significant after Holm in {sig}"
                + (f"; by the exact test in {ex[0]}; significantly worse in {ex[1]})" if len(ex) > 1 else ")")
                + (f"; {planned - cells} cell(s) without results" if cells < planned else "")
            )
    return lines


W_LABELS = ("recast", "recast_prior_grad", "reversed_grad")  # recast-protocol's W; recast-units' new arms


# where none of those ran (recast-reversed, recast-matched, recast-steps)
W_LABELS_ELSE = ("recast_prior", "reversed", "early12", "early34")


def w_caption(drawn):
    if drawn == ["recast"]:
        return "ReCAST's final W per cell (first seed): ![](W_final.png)"
    return f"The final W per cell (first seed), a row of panels per arm ({', '.join(drawn)}): ![](W_final.png)"


def w_figure(res: Results, path: Path, labels=("recast",), fallback=W_LABELS_ELSE) -> list[str]:
    """The credit matrix W at the last iteration of each group's run (first seed), one row of panels per label of
    `labels` that ran (else of `fallback`), five groups a row at most; returns the labels drawn (none: no figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = lambda which: [lbl for lbl in which if any(by.get(lbl) for by in res.runs.values())]  # noqa: E731
    drawn = ran(labels) or ran(fallback)
    per_label = {lbl: [(g, by[lbl][min(by[lbl])]) for g, by in res.runs.items() if by.get(lbl)] for lbl in drawn}
    if not drawn:
        return []
    cols = min(max(len(v) for v in per_label.values()), 5)
    n_rows = {lbl: -(-len(v) // cols) for lbl, v in per_label.items()}  # each label starts a row of panels
    height = sum(n_rows.values())
    fig, axes = plt.subplots(height, cols, figsize=(3.4 * cols, 2.6 * height), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    start = 0
    for lbl, found in per_label.items():
        for ax, (group, rows) in zip(axes[start : start + n_rows[lbl]].flat, found):
            names = flag_value(res.cells[(group, lbl)].flags, "--rewards").split(",")
            ax.axis("on")
            im = ax.imshow(np.array(rows[-1]["recast/W"]), aspect="auto", cmap="viridis")
            title = f"{group} {lbl}" if len(drawn) > 1 else group
            ax.set(title=title, xlabel="step j (t from 1 to 0)", yticks=range(len(names)), yticklabels=names)
            fig.colorbar(im, ax=ax)
        start += n_rows[lbl]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
