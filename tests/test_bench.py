"""experiments/bench.py, reports.py and protocol.py: the experiment specs, the reports, the result files, and each
experiment's --quick on the embedded model (the statistics: test_stats.py).

OMP_NUM_THREADS=1 python -m pytest -q tests/test_bench.py
"""

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import recast
import rvge
import world as shapes_world
from experiments import bench, protocol, reports, stats


def has_updates_per_iter():
    try:
        recast.parse_args(["--updates-per-iter", "1"])
        return True
    except SystemExit:
        return False


# -----------------------------------------------------------------------------
# Specs and sizing (no training)
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(bench.EXPERIMENTS))
def test_each_full_experiment_fits_an_hour_on_two_cores(name):
    exp = bench.EXPERIMENTS[name]
    minutes = bench.estimate_minutes(exp, jobs=2)
    # "<= ~60 min": the rates behind the estimate vary by ~10% between runs, so a minute over is within it
    assert 5 < minutes < 61, f"{name}: ~{minutes:.0f} min with --jobs 2 at the measured 2-core rate"
    assert bench.estimate_minutes(bench.quick_version(exp), jobs=1) < 3


@pytest.mark.parametrize("name", list(bench.EXPERIMENTS))
def test_runs_are_paired_by_seed_and_every_cell_parses(name, tmp_path):
    exp = bench.EXPERIMENTS[name]
    runs = bench.plan_runs(exp, tmp_path)
    assert len(runs) == len(exp.cells) * exp.seeds and len({r.run_id for r in runs}) == len(runs)
    assert [r.seed for r in runs] == sorted(r.seed for r in runs), (
        "seed by seed, so a stopped experiment holds whole pairs"
    )
    for seed in range(exp.seeds):
        settings = [r.settings for r in runs if r.seed == seed]
        assert all(s[s.index("--seed") + 1] == str(seed) for s in settings)
        assert len({s[s.index("--prompts-per-iter") + 1] for s in settings}) == 1
    if any("--updates-per-iter" in c.flags for c in exp.cells) and not has_updates_per_iter():
        with pytest.raises(SystemExit, match="refuses"):
            bench.check_flags(runs)
    else:
        bench.check_flags(runs)


def test_experiment_contents():
    single = bench.EXPERIMENTS["rvge-single"]
    assert {c.group for c in single.cells} == {bench.SMOOTH_REWARD, bench.DISCRETE_REWARD} and single.seeds >= 5
    assert {bench.SMOOTH_REWARD, bench.DISCRETE_REWARD} <= set(shapes_world.REWARDS)
    joint = bench.EXPERIMENTS["rvge-joint"]
    assert all(reports.flag_value(c.flags, "--rewards").split(",") == list(bench.SETTINGS["A"]) for c in joint.cells)
    assert all(reports.flag_value(c.flags, "--budgets") == "0.25,0.25,0.25,0.25" for c in joint.cells)
    its = {c.label: reports.cell_iterations(joint, c) for c in joint.cells}
    assert its["rvge_fifth"] * 5 == its["nft"] == its["rvge"] == its["rvge_one_direction"] == its["rvge_recast"]
    flags = {c.label: (c.script, c.flags[4:]) for c in joint.cells}
    assert flags["rvge_one_direction"] == ("rvge", ("--combine", "reward"))
    assert flags["rvge_recast"] == ("rvge", ("--credit", "recast")) and flags["recast"] == (
        "recast",
        ("--credit", "recast"),
    )
    fifth = bench.EXPERIMENTS["rvge-joint-fifth"]  # issue 45: rvge-joint's nft and rvge_fifth, the same runs per seed
    assert [c for c in joint.cells if c.label in ("nft", "rvge_fifth")] == list(fifth.cells)
    assert fifth.seeds == 13 and fifth.final_noises == 4 and not fifth.reuse  # rvge-joint keeps no checkpoint
    theirs = {r.run_id: r.settings for r in bench.plan_runs(joint, Path("x"))}
    assert all(theirs[r.run_id] == r.settings for r in bench.plan_runs(fifth, Path("x")) if r.seed < joint.seeds)
    why = bench.EXPERIMENTS["rvge-joint-why"]
    assert why.reuse == "rvge-joint" and {c.label for c in why.cells} == {"nft", "rvge", "rvge_broad", "rvge_half_lr"}
    assert why.iterations == joint.iterations  # so its nft and rvge runs are rvge-joint's
    assert reports.flag_value(next(c for c in why.cells if c.label == "rvge_half_lr").flags, "--lr") == str(
        rvge.Args().lr / 2
    )
    eta = bench.EXPERIMENTS["rvge-joint-eta"]
    etas = [float(reports.flag_value(c.flags, "--eta")) for c in eta.cells if reports.flag_value(c.flags, "--eta")]
    assert eta.reuse == why.name and sorted(etas) == [rvge.Args().eta / 4, rvge.Args().eta / 2]
    assert set(bench.SETTINGS["A"]) != set(bench.SETTINGS["B"]) and all(
        set(v) <= set(protocol.PROFILE_CANDIDATES) for v in bench.SETTINGS.values()
    )
    for name, setting in (("recast-protocol", "A"), ("recast-protocol-B", "B")):
        spec = bench.EXPERIMENTS[name]
        assert {c.group for c in spec.cells} == {f"{setting}-{b}" for b in bench.budget_vectors()}
        assert {c.label for c in spec.cells} == {"nft", "uniform", "recast", "recast_prior"}
        assert all(  # only recast_prior starts from the measured profiles; recast learns W from its own rollouts
            (reports.flag_value(c.flags, "--gain-init") is not None) == (c.label == "recast_prior") for c in spec.cells
        )
        for c in spec.cells:
            assert reports.flag_value(c.flags, "--rewards").split(",") == list(bench.SETTINGS[setting])
            budgets = [float(b) for b in reports.flag_value(c.flags, "--budgets").split(",")]
            assert len(budgets) == 4 and abs(sum(budgets) - 1) < 1e-9
    steps = bench.EXPERIMENTS["nft-steps"]
    assert [reports.flag_value(c.flags, "--updates-per-iter") for c in steps.cells] == [
        "1",
        "8",
    ] and steps.eval_every == 10
    assert {c.label for c in bench.EXPERIMENTS["multi"].cells} == set(bench.MULTI_METHODS)


def test_the_power_section_sizes_the_experiment_at_the_N80_values():
    """The Power section reads the N80 values fmt_ci printed and sizes the experiment at them, on 2 cores only (no
    GPU rate is measured)."""
    exp = bench.EXPERIMENTS["rvge-single"]
    minutes = lambda seeds: bench.estimate_minutes(bench.replace(exp, seeds=seeds), 2)  # noqa: E731
    power = "\n".join(reports.power_lines("| a | +0.1 [-1, +1] sd 1 N80 7 | b N80 3 | c N80 > 10000 |", minutes))
    assert "3 paired difference(s) above are unresolved" in power and "1 would need more than 10,000" in power
    hours = bench.estimate_minutes(bench.replace(exp, seeds=7), 2) / 60
    assert f"| 7 | largest | ~{hours:.1f} h |" in power and "| 3 | smallest |" in power and "GPU" not in power
    assert reports.power_lines("all resolved", minutes) == []


def test_frechet_is_compared_only_at_equal_n(tmp_path):
    """Runs evaluated on other prompts (another N of images) are never compared on the Fréchet distance."""
    from types import SimpleNamespace

    same = ["--seed", "0"]
    other = [*same, "--eval-prompts", "mine.txt"]
    res = SimpleNamespace(
        records=[
            {"group": "g", "label": "a", "settings": same},
            {"group": "g", "label": "b", "settings": same},
            {"group": "g", "label": "c", "settings": other},
        ]
    )
    assert reports.equal_n(res, "g", ("a", "b")) and not reports.equal_n(res, "g", ("a", "c"))
    assert reports.is_frechet("eval/judge/frechet") and reports.is_frechet("judge/frechet")
    assert not reports.is_frechet("eval/weighted")
    exp = bench.EXPERIMENTS["rvge-joint"]  # the report marks the Fréchet cell and compares the rest
    records = [
        {
            "group": "joint",
            "label": label,
            "seed": seed,
            "settings": same if label == "nft" else other,
            "rows": [
                {
                    "iteration": 0,
                    "eval_before/weighted": 0.5,
                    "eval_before/judge/frechet": 100.0,
                    "loss/base_reg": 0.01,
                    "eval/weighted": 0.5 + 0.1 * seed + (label == "rvge") * 0.01 * (1 + seed),
                    "eval/judge/frechet": 100.0 + seed,
                }
            ],
        }
        for label in ("nft", "rvge")
        for seed in range(3)
    ]
    report = reports.Results(exp, records, [], tmp_path)
    row = next(x for x in reports.report_rvge_joint(report, tmp_path) if x.startswith("| rvge | ") and " [" in x)
    assert row.split(" | ")[1] == reports.UNEQUAL_N and row.split(" | ")[2].startswith("+0.0200 [")


def test_statistics_helpers():
    """verdict's sign per metric, paired seeds, the held-out curve, the final evaluation's summaries."""
    assert reports.verdict("eval/judge/frechet", -5.0, -1.0) == 1 and reports.verdict("eval/weighted", -5.0, -1.0) == -1
    assert reports.verdict("judge/frechet", -5.0, -1.0) == 1 and reports.verdict("judge/frechet", 1.0, 5.0) == -1
    assert reports.verdict("eval/weighted", -1.0, 1.0) == 0 and reports.verdict("eval/weighted", np.nan, np.nan) == 0
    assert stats.paired({0: 1.0, 1: 5.0, 2: 2.0}, {0: 0.5, 2: 1.0}) == [0.5, 1.0]
    rows = [
        {"iteration": 0, "eval_before/weighted": 0.4, "time/rollout": 1.0, "time/update": 1.0},
        {"iteration": 1, "time/rollout": 1.0, "time/update": 2.0, "eval/weighted": 0.6},
    ]
    its, secs, vals = reports.eval_curve(rows)
    assert its.tolist() == [0, 2] and secs.tolist() == [0.0, 5.0] and vals.tolist() == [0.4, 0.6]
    base = {"a": [0.0, 2.0, 0.0, 2.0], "b": [0.0, 0.5, 0.0, 0.5]}  # means 1, 0.25; sd 1, 0.25
    scores = {"a": [3.0, 3.0], "b": [0.5, 0.5], "judge/frechet": 7.0, "judge/pref": [1.0, 0.0, 2.0, 5.0]}
    assert protocol.final_value(scores, "scale_free", ["a", "b"], [3.0, 1.0], base) == pytest.approx(
        (3 * 2.0 + 1 * 1.0) / 4
    )
    assert protocol.final_value(scores, "weighted", ["a", "b"], [3.0, 1.0]) == pytest.approx((3 * 3.0 + 0.5) / 4)
    assert protocol.final_value(scores, "judge/frechet") == 7.0 and protocol.final_value(scores, "a") == 3.0


def test_a_result_from_other_settings_is_not_the_runs(tmp_path):
    """load_result takes only a result of the run's own settings (check_results refuses to replace the others)."""
    exp = bench.quick_version(bench.EXPERIMENTS["nft-steps"])
    run = bench.plan_runs(exp, tmp_path)[0]
    run.result.parent.mkdir(parents=True)
    run.result.write_text(json.dumps({"settings": list(run.settings), "rows": [{"iteration": 0}]}))
    assert bench.load_result(run) is not None
    other = bench.plan_runs(bench.replace(exp, iterations=3), tmp_path)[0]
    assert other.result == run.result and bench.load_result(other) is None
    run.result.write_text('{"settings": [')  # a torn write is no result
    assert bench.load_result(run) is None


def test_a_result_keeps_its_identity_when_its_results_folder_moves(tmp_path):
    """A run whose flags name its experiment's folder ({exp_dir}: recast_prior's --gain-init) is still found after the
    folder moves; the same flags pointing elsewhere are another run."""
    exp = bench.quick_version(bench.EXPERIMENTS["recast-protocol"])
    old = next(r for r in bench.plan_runs(exp, tmp_path / "results" / exp.name) if "--gain-init" in r.settings)
    assert any(str(tmp_path / "results" / exp.name) in x for x in old.settings)
    record = {
        "settings": list(old.settings),
        "rows": [{"iteration": 0}],
        "command": f"python recast.py --out {old.work}",
    }
    moved = next(r for r in bench.plan_runs(exp, tmp_path / "kept" / exp.name) if r.run_id == old.run_id)
    moved.result.parent.mkdir(parents=True)
    moved.result.write_text(json.dumps(record))
    assert bench.load_result(moved) == record
    elsewhere = [x.replace(str(tmp_path / "results"), str(tmp_path / "other")) for x in old.settings]
    moved.result.write_text(json.dumps({**record, "settings": elsewhere}))
    assert bench.load_result(moved) is None


def test_identical_runs_are_taken_from_the_reused_experiment(tmp_path):
    why = bench.EXPERIMENTS["rvge-joint-why"]
    source = {r.run_id: r for r in bench.plan_runs(bench.EXPERIMENTS[why.reuse], tmp_path / why.reuse)}
    planned = bench.plan_runs(why, tmp_path / why.name)
    shared = [r for r in planned if r.run_id in source]
    assert {r.cell.label for r in shared} == {"nft", "rvge"} and all(
        r.settings == source[r.run_id].settings for r in shared
    )
    for r in shared:
        r.result.parent.mkdir(parents=True, exist_ok=True)
    world = shapes_world.world_id()
    for run in source.values():  # every source result, one with other settings (as if made by other code's flags)
        run.result.parent.mkdir(parents=True, exist_ok=True)  # and one made on another embedded world
        settings = list(run.settings) + (["--eta", "0.1"] if run.run_id == "joint_nft-seed1" else [])
        made_on = "0123456789ab" if run.run_id == "joint_rvge-seed1" else world
        record = {"settings": settings, "rows": [{"iteration": 0, "seed": run.seed}], "world": made_on}
        run.result.write_text(json.dumps(record))
    assert bench.reuse_results(planned, why, tmp_path / why.name) == len(shared) - 2
    taken = {r.run_id for r in planned if bench.load_result(r) is not None}
    assert taken == {r.run_id for r in shared} - {"joint_nft-seed1", "joint_rvge-seed1"}
    assert bench.reuse_results(planned, why, tmp_path / why.name) == 0  # nothing twice


def test_results_are_committable_and_final_evaluations_need_no_run_folder(tmp_path):
    """A result is gzip JSON, the same bytes when written again, with the run's commit; a new result drops the old
    final evaluation; on a fresh clone (no work/ folder) the committed final evaluations are the ones used."""
    exp = bench.quick_version(bench.EXPERIMENTS["recast-protocol"])
    run = bench.plan_runs(exp, tmp_path)[0]
    run.work.mkdir(parents=True)
    (run.work / "metrics.jsonl").write_text('{"iteration": 0, "eval/weighted": 0.5}\n')
    (run.work / "config.json").write_text(json.dumps({"git_sha": "0123456789abcdef"}))
    final = run.result.with_name(run.run_id + ".final.json")
    final.parent.mkdir(parents=True)
    final.write_text("{}")
    bench.write_result(run, 1.5)
    data = run.result.read_bytes()
    assert run.result.name.endswith(".json.gz") and data[:2] == b"\x1f\x8b" and not final.exists()
    assert (
        bench.load_result(run)["git_sha"] == "0123456789abcdef" and bench.load_result(run)["rows"][0]["iteration"] == 0
    )
    bench.write_result(run, 1.5)
    assert run.result.read_bytes() == data
    shutil.rmtree(run.work)  # a fresh clone: results, no run folders
    n = len(shapes_world.splits()["heldout"]) * exp.final_noises
    for name in ("pretrained", run.run_id):
        scores = {"1": {"name": name}}
        run.result.with_name(f"{name}.final.json").write_text(
            json.dumps({"checkpoint": "pretrained", "n": n, "scores": scores})
        )
    got = protocol.final_evals([run], tmp_path, exp.final_noises)  # would load the model and fail if it evaluated
    assert got == {"pretrained": {"1": {"name": "pretrained"}}, run.run_id: {"1": {"name": run.run_id}}}
    records = [
        {"git_sha": "0123456789abcdef", "finished": "2026-12-01", "world": "abcdef012345"},
        {"git_sha": None, "finished": "2026-12-03"},
    ]
    block = reports.results_block(
        "# x\n\n## a\n![](f.png) ![g](g.png)", records, tmp_path / "r" / "x", tmp_path / "R.md", "cmd"
    )
    assert (
        block == "`cmd` (2 runs made at commit 0123456, embedded world abcdef012345, not recorded, "
        "2026-12-01 to 2026-12-03):\n\n"
        "#### a\n![f.png](r/x/f.png) ![g](r/x/g.png)"
    )


def test_bench_refuses_to_mix_results_of_two_worlds(tmp_path, capsys):
    """A result made on another embedded world (an earlier assets/ build) stops a new run of its experiment with
    the fix named; the same result made on today's world does not stop it, and --tables-only reads either."""
    exp = bench.quick_version(bench.EXPERIMENTS["nft-steps"])
    runs = bench.plan_runs(exp, tmp_path / exp.name)
    runs[0].result.parent.mkdir(parents=True)
    record = {
        "run_id": runs[0].run_id,
        "label": runs[0].cell.label,
        "group": runs[0].cell.group,
        "seed": 0,
        "settings": list(runs[0].settings),
        "rows": [{"iteration": 0}],
        "world": "0123456789ab",
    }
    runs[0].result.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="another embedded world \\(0123456789ab; assets/ now hold world"):
        bench.check_results(runs, exp, tmp_path / exp.name)
    runs[0].result.write_text(json.dumps({**record, "world": shapes_world.world_id()}))
    bench.check_results(runs, exp, tmp_path / exp.name)
    runs[0].result.write_text(json.dumps({k: v for k, v in record.items() if k != "world"}))  # before world ids
    with pytest.raises(SystemExit, match="not recorded"):
        bench.check_results(runs, exp, tmp_path / exp.name)


def test_world_id_names_the_pipeline_bytes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"weights")
    first = shapes_world.world_id(tmp_path)
    assert len(first) == 12 and shapes_world.world_id(tmp_path) == first
    (tmp_path / "a" / "w.bin").write_bytes(b"weightz")
    assert shapes_world.world_id(tmp_path) != first


def test_bench_refuses_bad_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["multi", "--seeds", "0", "--out", str(tmp_path)])
    assert "--seeds 0: give at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["rvge-joint", "--tables-only", "--out", str(tmp_path / "empty")])
    assert "no results of these settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["nonsense", "--out", str(tmp_path)])
    assert "invalid choice" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Each experiment's --quick on the embedded model
# -----------------------------------------------------------------------------


@pytest.mark.long(150)  # seconds on a 2-core machine, for the order only
def test_bench_quick_runs_every_method_on_the_embedded_model(tmp_path):
    """multi --quick: both scripts' main loops on the embedded model with its default rewards."""
    res = bench.main(["multi", "--quick", "--out", str(tmp_path)])
    by_label = res.runs["0.4,0.3,0.2,0.1"]
    assert set(by_label) == set(bench.MULTI_METHODS) and not res.missing
    for label, runs in by_label.items():
        rows = runs[0]
        assert [m["iteration"] for m in rows] == [0]  # --quick: one iteration
        W = np.array(rows[-1]["recast/W"])
        assert np.abs(W.sum(1) - [0.4, 0.3, 0.2, 0.1]).max() < 1e-9 and np.abs(W.sum(0) - 0.1).max() < 1e-9
        assert any(k.startswith("eval/judge/") for k in rows[-1]), "held-out judges were not evaluated"
    table = (tmp_path / "multi" / "table.md").read_text()
    assert (
        "speed-up vs nft" in table and all(f"| {m} |" in table for m in bench.MULTI_METHODS) and "PARTIAL" not in table
    )
    assert (tmp_path / "multi" / "reward_vs_time_0.4_0.3_0.2_0.1.png").exists()


def check_recast_reversed_quick(tmp_path):
    """recast-reversed --quick after recast-protocol --quick: the control for credit in time. recast-protocol's nft,
    uniform and recast_prior runs (and their final evaluations) are taken, not rerun; the reversed arm starts from the
    same prior and solves W from each logged profile flipped in time; the report compares both ReCAST arms'
    differences with it and sums no settings."""
    res = bench.main(["recast-reversed", "--quick", "--out", str(tmp_path)])
    runs = res.runs["A-uniform"]
    assert set(runs) == {"nft", "uniform", "recast_prior", "reversed"}
    mine, theirs = tmp_path / "recast-reversed" / "runs", tmp_path / "recast-protocol" / "runs"
    for label in ("nft", "uniform", "recast_prior"):
        for ext in (".json.gz", ".final.json"):
            name = f"A_uniform_{label}-seed0{ext}"
            assert (mine / name).read_bytes() == (theirs / name).read_bytes()
    assert not (tmp_path / "recast-reversed" / "work" / "A_uniform_nft-seed0").exists()  # taken, not rerun
    budgets = [float(b) for b in bench.budget_vectors()["uniform"].split(",")]
    for row, prior in zip(runs["reversed"][0], runs["recast_prior"][0]):
        P = np.asarray(row["recast/profile"])
        assert np.allclose(np.asarray(row["recast/W"]), recast.solve_W(budgets, P[:, ::-1]), atol=1e-12)
    assert np.allclose(runs["reversed"][0][0]["recast/level_n"], runs["recast_prior"][0][0]["recast/level_n"])
    table = (tmp_path / "recast-reversed" / "table.md").read_text()
    assert "| recast_prior − reversed | 1 |" in table and "| recast_prior − nft | 1 |" in table
    assert "| A | reversed | 1 |" in table and "Summary over both settings" not in table


@pytest.mark.long(200)  # seconds on a 2-core machine, for the order only
def test_rvge_single_quick_reports_thresholds_and_speed_up(tmp_path):
    res = bench.main(["rvge-single", "--quick", "--out", str(tmp_path)])
    runs = res.runs[bench.SMOOTH_REWARD]
    assert set(runs) == {"nft", "rvge"} and all(set(by_seed) == {0, 1} for by_seed in runs.values())
    rows = runs["rvge"][0]
    assert "eval_before/weighted" in rows[0] and all("eval/weighted" in m for m in rows)  # eval every iteration here
    assert rows[-1]["eval/weighted"] == rows[-1][f"eval/{bench.SMOOTH_REWARD}"]  # budget 1: weighted is the reward
    table = (tmp_path / "rvge-single" / "table.md").read_text()
    assert f"## {bench.SMOOTH_REWARD}" in table and "final − nft [95%]" in table
    assert "speed-up in time" in table or "did not improve on the pretrained model" in table
    assert (tmp_path / "rvge-single" / "reward_vs_time.png").exists()
    check_rvge_drift_quick(tmp_path)


def check_rvge_drift_quick(tmp_path):
    """rvge-drift --quick after rvge-single --quick: its nft and rvge runs are taken, not rerun; every arm runs; the
    distance ratios are the paired geometric means of the runs' own distances to base (`loss/base_reg`), Holm over the
    five; the matched-distance table and the figure are written."""
    res = bench.main(["rvge-drift", "--quick", "--out", str(tmp_path)])
    runs = {label: by_seed for label, by_seed in res.runs[bench.SMOOTH_REWARD].items() if by_seed}
    assert set(runs) == set(bench.EXPERIMENTS["rvge-drift"].quick_keep)  # quick keeps four of the six arms
    assert all(set(by_seed) == {0, 1} for by_seed in runs.values())
    for label in ("nft", "rvge"):
        for seed in (0, 1):
            name = f"{bench.SMOOTH_REWARD}_{label}-seed{seed}"
            assert not (tmp_path / "rvge-drift" / "work" / name).exists()  # taken, not rerun
            mine, theirs = (tmp_path / exp / "runs" / f"{name}.json.gz" for exp in ("rvge-drift", "rvge-single"))
            assert mine.read_bytes() == theirs.read_bytes()
    table = (tmp_path / "rvge-drift" / "table.md").read_text()
    dist = {label: [reports.distance_to_base(runs[label][s]) for s in (0, 1)] for label in runs}
    contrasts = [(a, b) for a, b in reports.DRIFT_CONTRASTS if a in runs and b in runs]
    assert len(contrasts) == 2
    for a, b in contrasts:
        ratio = np.exp(np.mean(np.log(dist[a]) - np.log(dist[b])))
        assert f"| {a} / {b} | 2 | {ratio:.3g} [" in table
    assert "Holm over these 2 comparisons" in table
    assert "speed-up in iterations" in table or "did not improve on the pretrained model" in table
    curve = reports.distance_curve(runs["rvge"][0])
    assert curve[0] == 0 and (np.diff(curve) >= 0).all() and len(curve) == len(reports.eval_curve(runs["rvge"][0])[0])


@pytest.mark.long(190)  # seconds on a 2-core machine, for the order only
def test_rvge_joint_quick_in_parallel_processes_resumes_and_marks_partial(tmp_path, monkeypatch):
    out = tmp_path / "rvge-joint"
    res = bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])
    by_label = res.runs["joint"]
    assert set(by_label) == {"nft", "rvge", "rvge_fifth", "rvge_one_direction", "rvge_recast", "recast"}
    assert all(len(by_label[label][0]) == 1 for label in by_label)  # --quick: one iteration each
    names = [k[len("eval/") :] for k in by_label["nft"][0][-1] if k.startswith("eval/") and "/" not in k[5:]]
    assert set(bench.JOINT_REWARDS) <= set(names)
    assert all(
        (out / "work" / f"joint_{label}-seed0.log").exists() for label in by_label
    )  # one process per run, logged
    table = (out / "table.md").read_text()
    assert "rvge_fifth vs nft" in table and "judge/cnn" in table and "| pretrained |" in table
    for a, b in bench.EXPERIMENTS["rvge-joint"].pairs:  # the variants against their parents, paired
        assert f"| {a} − {b} | " in table and f"- {a} vs {b}: " in table
    assert "Along the run" in table and "rvge: weighted" in table and "rvge_fifth: weighted" not in table
    assert "distance to base" in table and np.isfinite(reports.distance_to_base(by_label["rvge"][0]))
    assert "- rvge: direction rms per reward" in table and "- nft: direction rms" not in table
    # the noise floor of the pretrained model's in-run evaluation (N80's effect floor), whose first noise set is the
    # runs' own (so it reproduces their eval_before/*)
    floor = json.loads((out / "eval_floor.json").read_text())
    first = by_label["nft"][0][0]
    # approx, not ==: the floor evaluates in another batch split than the run (another order of the same float sums),
    # so the two agree to ~1e-9 and round alike only on some CPUs
    assert floor["noises"] == 2 and floor["values"]["eval/weighted"][0] == pytest.approx(
        first["eval_before/weighted"], rel=1e-6
    )
    assert floor["sd"]["eval/weighted"] == pytest.approx(np.std(floor["values"]["eval/weighted"], ddof=1))
    # "matches" as a test needs NFT's gain with an interval, so 2 paired seeds: at --quick's one it says so
    assert "not testable here, fewer than 2 paired seeds" in table.split("Non-inferiority to nft")[1]

    def must_not_run(run):
        raise AssertionError(f"{run.run_id} has a result and must be skipped")

    monkeypatch.setattr(bench, "worker_command", must_not_run)
    bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])  # resume: nothing left to run
    (out / "runs" / "joint_rvge-seed0.json.gz").unlink()  # as if killed before this run finished
    partial = bench.main(["rvge-joint", "--quick", "--tables-only", "--out", str(tmp_path)])
    assert partial.missing == ["joint_rvge-seed0"] and "PARTIAL: 1 run(s) missing" in (out / "table.md").read_text()
    monkeypatch.setattr(bench, "worker_command", lambda run: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(
        SystemExit, match="1 run\\(s\\) failed"
    ):  # a failing run is reported; the others' tables still come
        bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])


def test_non_inferiority_holm_over_the_metrics_of_one_method():
    """rvge-joint-fifth's family: one method, Holm over the metrics on which the baseline's gain is resolved (a metric
    without one has no margin and no test); lower-is-better metrics count a negative difference as better; the
    untrained model fails the margin its baseline's gain sets."""
    gains = {"a": [0.10, 0.12, 0.11, 0.09, 0.10], "b": [0.05, -0.04, 0.01, -0.02, 0.0], "judge/frechet": [-5, -6, -4]}
    diffs = {"m": {"a": [0.0, 0.002, -0.001, 0.001, 0.0], "b": [0.1, 0.2, 0.0, 0.1, 0.0], "judge/frechet": [1, 0, 2]}}
    lines = reports.non_inferiority_table("nft", list(gains), diffs, gains, family="metrics")
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| ")}
    assert "none (gain not resolved)" in rows["b"] and "Holm" not in rows["b"]
    p = {}
    for m, sign in (("a", 1), ("judge/frechet", -1)):
        margin = reports.NI_FRACTION * stats.mean_ci([sign * v for v in gains[m]])[1]
        assert f"| {margin:.4g} |" in rows[m]
        p[m] = stats.non_inferiority(stats.mean_ci(diffs["m"][m]), margin, sign)
    holm = dict(zip(p, stats.holm(list(p.values()))))
    assert holm["a"] < 0.05 < holm["judge/frechet"]
    assert f"| ✓ Holm {holm['a']:.2g}" in rows["a"] and f"| Holm {holm['judge/frechet']:.2g}" in rows["judge/frechet"]
    assert all(" | p " in rows[m] and "✓ p" not in rows[m] for m in p)  # the control fails
    text = "\n".join(lines)
    assert (
        "Holm per method over the 2 metrics on which nft's gain is resolved" in text and "m 1 of 2 testable (a)" in text
    )


@pytest.mark.long(110)  # seconds on a 2-core machine, for the order only
def test_rvge_joint_fifth_quick_decides_on_the_final_evaluation(tmp_path):
    """rvge-joint-fifth --quick: both cells, each run's last checkpoint and the pretrained model on the final
    evaluation (cached as <run>.final.json), the non-inferiority table over the metrics, and the same table rebuilt
    from the results alone (no run folder)."""
    res = bench.main(["rvge-joint-fifth", "--quick", "--out", str(tmp_path)])
    out = tmp_path / "rvge-joint-fifth"
    assert {label: sorted(runs) for label, runs in res.runs["joint"].items()} == {"nft": [0, 1], "rvge_fifth": [0, 1]}
    assert not res.incomplete and (out / "runs" / "pretrained.final.json").is_file()
    final = json.loads((out / "runs" / "joint_rvge_fifth-seed1.final.json").read_text())
    n = bench.QUICK_FINAL["final_captions"] * bench.QUICK_FINAL["final_noises"]
    assert final["n"] == n and set(final["scores"]) == {"1", "2"}
    table = (out / "table.md").read_text()
    assert "| pretrained | | 0 | 0 |" in table and "| rvge_fifth | 2 | 1 |" in table
    assert "Holm per method over the" in table and "| judge/frechet |" in table.split("Non-inferiority to nft")[1]
    assert "Noise floor of one final evaluation" in table
    shutil.rmtree(out / "work")
    bench.main(["rvge-joint-fifth", "--quick", "--tables-only", "--out", str(tmp_path)])
    assert (out / "table.md").read_text() == table


@pytest.mark.long(250)  # seconds on a 2-core machine, for the order only
def test_recast_protocol_quick_reports_paired_differences_and_judge_counts(tmp_path):
    res = bench.main(["recast-protocol", "--quick", "--out", str(tmp_path)])
    exp_dir = tmp_path / "recast-protocol"
    assert set(res.runs) == {"A-uniform"} and set(res.runs["A-uniform"]) == {"nft", "uniform", "recast", "recast_prior"}
    prof = json.loads((exp_dir / "profiles.json").read_text())
    assert prof["names"] == list(protocol.PROFILE_CANDIDATES) and np.asarray(prof["s1"]).shape == (
        len(prof["names"]),
        prof["steps"] + 1,
    )
    # recast_prior starts from the measured statistics, discounted once: level_n = gain_ema * prior + this
    # iteration's (= uniform's, same rollouts); recast (online) from its own rollouts alone
    first = {label: res.runs["A-uniform"][label][0][0]["recast/level_n"] for label in res.runs["A-uniform"]}
    gamma = recast.Args().gain_ema
    assert np.allclose(first["recast_prior"], gamma * np.asarray(prof["n"]) + np.asarray(first["uniform"]))
    assert np.allclose(first["recast"], first["uniform"])
    table = (exp_dir / "table.md").read_text()
    assert (
        "| difference | n | " + " | ".join(bench.SETTINGS["A"]) + " | weighted | scale_free | judge/cnn "
        "| judge/frechet | pref share |" in table
    )
    for mine in ("recast", "recast_prior"):
        assert f"| {mine} − nft | 1 |" in table and f"| {mine} − uniform | 1 |" in table
    assert "| pretrained | |" in table and "## Noise floor of one evaluation" in table
    for other in ("nft", "uniform"):
        assert (
            f"ReCAST improves judge cnn over {other} in 0 of 1 cells" in table
            or f"ReCAST improves judge cnn over {other} in 1 of 1 cells" in table
        ) and f"ReCAST improves judge pref (share > 0.5) over {other} in " in table
    final = json.loads((exp_dir / "runs" / "A_uniform_recast-seed0.final.json").read_text())
    n = bench.QUICK_FINAL["final_captions"] * bench.QUICK_FINAL["final_noises"]
    assert final["n"] == n and set(final["scores"]) == {"1", "2"}
    assert all(len(final["scores"]["1"][k]) == final["n"] for k in ("geneval", "judge/cnn", "judge/pref"))
    assert (exp_dir / "profiles.png").exists() and (exp_dir / "W_final.png").exists()
    # once setting B has run too, each report adds the counts over both settings' cells (here B's file is A's copy)
    assert "Summary over both settings" not in table
    tally = json.loads((exp_dir / "summary.json").read_text())
    (tmp_path / "recast-protocol-B").mkdir()
    (tmp_path / "recast-protocol-B" / "summary.json").write_text(json.dumps(tally))
    bench.main(["recast-protocol", "--quick", "--tables-only", "--out", str(tmp_path)])
    both = (exp_dir / "table.md").read_text().split("Summary over both settings")[1]
    n, sig, cells, planned, *_ = tally["recast | nft | judge/cnn"]  # then: exact-test count, worse count
    assert (
        planned == 1
        and f"ReCAST improves judge cnn over nft in {2 * n} of 2 cells (significant after Holm in {2 * sig};" in both
    )
    check_recast_reversed_quick(tmp_path)
    check_recast_matched_quick(tmp_path)
    check_recast_steps_quick(tmp_path)


def check_recast_matched_quick(tmp_path):
    """recast-matched --quick after recast-reversed --quick: its recast_prior and reversed runs are taken, not rerun;
    the matched arms train uniform W at their budgets (every column the budgets / T); the report tests only the
    experiment's own pairs and draws the two ReCAST arms' W."""
    res = bench.main(["recast-matched", "--quick", "--out", str(tmp_path)])
    runs = res.runs["A-uniform"]
    assert set(runs) == {"recast_prior", "reversed", "matched", "matched_reversed"}
    mine, theirs = tmp_path / "recast-matched" / "runs", tmp_path / "recast-reversed" / "runs"
    for label in ("recast_prior", "reversed"):
        name = f"A_uniform_{label}-seed0.final.json"
        assert (mine / name).read_bytes() == (theirs / name).read_bytes()
    assert not (tmp_path / "recast-matched" / "work" / "A_uniform_reversed-seed0").exists()  # taken, not rerun
    for label in ("matched", "matched_reversed"):
        lam = np.array([float(b) for b in bench.MATCHED_BUDGETS["A-uniform"][label].split(",")])
        for row in runs[label][0]:
            W = np.asarray(row["recast/W"])
            assert np.allclose(W, np.outer(lam, np.ones(W.shape[1]) / W.shape[1]), atol=1e-9)
            assert np.allclose(bench.effective_budgets(W, row["recast/sigmas"]), lam / lam.sum())
    table = (tmp_path / "recast-matched" / "table.md").read_text()
    assert "| recast_prior − matched | 1 |" in table and "| reversed − matched_reversed | 1 |" in table
    assert "| recast_prior − reversed" not in table and "(2 tests per metric)" in table
    assert "a row of panels per arm (recast_prior, reversed)" in table


def check_recast_steps_quick(tmp_path):
    """recast-steps --quick after recast-protocol --quick: its two W files are written from the profiles there before
    the runs, each run trains with its file's W held fixed, and the report tests the one pair."""
    res = bench.main(["recast-steps", "--quick", "--out", str(tmp_path)])
    runs, exp_dir = res.runs["A-uniform"], tmp_path / "recast-steps"
    want = bench.steps_W(tmp_path / "recast-protocol" / "profiles.json")
    for label in ("early12", "early34"):
        assert json.loads((exp_dir / f"W_{label}.json").read_text())["W"] == want[label].tolist()
        assert all(np.array_equal(row["recast/W"], want[label]) for row in runs[label][0])
    table = (exp_dir / "table.md").read_text()
    assert "| early34 − early12 | 1 |" in table and "(1 tests per metric)" in table


def test_recast_steps_W_moves_saturations_weight_between_steps_at_equal_measured_shares():
    """The two W of recast-steps, from the committed profiles: saturation's weight on steps 1-4 all on steps 1-2
    (early12) or all on 3-4 (early34), every other weight that of the profiles' W (up to the common scale that makes
    the total the budgets' sum), and each reward's share of the update under the measured g_j the same in both arms
    and in the profiles' W."""
    profiles = Path(bench.__file__).resolve().parent / "results" / bench.PROFILES_DIR / "profiles.json"
    Ws = bench.steps_W(profiles)
    W0 = protocol.setting_W(json.loads(profiles.read_text()), bench.SETTINGS["A"], [0.25] * 4)[0]
    g, k = bench.measured_step_sizes()[1], bench.SETTINGS["A"].index("saturation")
    for label, W in Ws.items():
        assert W.sum() == pytest.approx(1.0, abs=1e-12) and (W >= 0).all()
        steps = list(bench.STEPS_ARMS[label])
        others = [j for j in range(4) if j not in steps]
        assert (W[k, others] == 0).all() and W[k, steps[0]] == W[k, steps[1]] > 0
        scale = W[0, 0] / W0[0, 0]
        keep = np.ones_like(W, dtype=bool)
        keep[k, :4] = False
        assert np.allclose(W[keep], scale * W0[keep], rtol=1e-12, atol=0)
        assert np.allclose(W @ g / (W @ g).sum(), W0 @ g / (W0 @ g).sum(), rtol=1e-12, atol=0)
        assert (W[k, steps] > W0[k, steps]).all()  # moved in: more than the profiles' W there


def test_grain_steps_W_moves_grains_weight_between_consistent_and_decided_steps_at_equal_measured_shares():
    """grain-steps (issue 62 item 1), recast-steps' design on grain: its weight on steps 5-8 all on steps 5-6 (t =
    0.790, 0.707: consistent) or 7-8 (t = 0.602, 0.465: decided), every other weight the profiles' W's up to the common
    scale, every reward's share under the measured g_j that of the profiles' W in both arms; the committed W files
    (written before any run) are these W, and the experiment is recast-steps' but for its two cells."""
    results = Path(bench.__file__).resolve().parent / "results"
    profiles = results / bench.PROFILES_DIR / "profiles.json"
    reward, arms = bench.STEPS_DESIGNS["grain-steps"]
    Ws = bench.steps_W(profiles, reward, arms)
    W0 = protocol.setting_W(json.loads(profiles.read_text()), bench.SETTINGS["A"], [0.25] * 4)[0]
    sigmas, g = bench.measured_step_sizes()
    k = bench.SETTINGS["A"].index("grain")
    assert reward == bench.SMOOTH_REWARD == "grain" and list(Ws) == ["consistent", "decided"]
    assert [round(float(sigmas[j]), 3) for j in (4, 5, 6, 7)] == [0.79, 0.707, 0.602, 0.465]
    for label, W in Ws.items():
        assert W.sum() == pytest.approx(1.0, abs=1e-12) and (W >= 0).all()
        steps = list(arms[label])
        others = [j for j in range(4, 8) if j not in steps]
        assert (W[k, others] == 0).all() and W[k, steps[0]] == W[k, steps[1]] > 0
        keep = np.ones_like(W, dtype=bool)
        keep[k, 4:8] = False
        assert np.allclose(W[keep], W[0, 0] / W0[0, 0] * W0[keep], rtol=1e-12, atol=0)
        assert np.allclose(W @ g / (W @ g).sum(), W0 @ g / (W0 @ g).sum(), rtol=1e-12, atol=0)
        assert (W[k, steps] > W0[k, steps]).all()  # moved in: more than the profiles' W there
        committed = json.loads((results / "grain-steps" / f"W_{label}.json").read_text())
        assert committed == {"rewards": list(bench.SETTINGS["A"]), "W": W.tolist()}
    exp, steps_exp = bench.EXPERIMENTS["grain-steps"], bench.EXPERIMENTS["recast-steps"]
    assert exp.pairs == (("decided", "consistent"),) and exp.seeds == steps_exp.seeds == 20
    assert bench.replace(exp, name="x", cells=(), pairs=()) == bench.replace(steps_exp, name="x", cells=(), pairs=())
    assert [c.flags[:4] for c in exp.cells] == [c.flags[:4] for c in steps_exp.cells]
    assert bench.STEPS_DESIGNS["recast-steps"] == (bench.STEPS_REWARD, bench.STEPS_ARMS)
    for label, W in bench.steps_W(profiles, *bench.STEPS_DESIGNS["recast-steps"]).items():  # its files as committed
        assert json.loads((results / "recast-steps" / f"W_{label}.json").read_text())["W"] == W.tolist()


def test_dry_run_prints_the_plan_and_runs_or_writes_nothing(tmp_path, capsys):
    """--dry-run: the runs, sizes and cost, a steps experiment's W (grain's share equal in both arms) and seed 0's
    commands; no folder, W file, lock or result is made."""
    assert bench.main(["grain-steps", "--dry-run", "--out", str(tmp_path)]) is None
    out = capsys.readouterr().out
    assert "grain-steps (dry run: nothing is run or written): 40 runs (2 cells x 20 seeds" in out
    assert f"~{bench.estimate_minutes(bench.EXPERIMENTS['grain-steps'], 2):.0f} min with --jobs 2" in out
    assert "grain's weight on steps 5 (t = 0.790), 6 (t = 0.707), 7 (t = 0.602), 8 (t = 0.465) moved" in out
    shares = re.findall(r"every reward's share under g_j (.*)", out)
    assert len(shares) == 2 and shares[0] == shares[1]
    assert out.count("python recast.py ") == 2 and f"--credit-file {tmp_path / 'grain-steps' / 'W_decided.json'}" in out
    assert not any(tmp_path.iterdir())


def test_matched_budgets_are_the_effective_budgets_of_recast_reversed_runs():
    """bench.MATCHED_BUDGETS, typed into the experiment, are the gradient-weighted shares of the committed
    recast-reversed runs' W (means over seeds and iterations), to the 3 decimals written; the two arms of a cell
    differ where the timing moved them (saturation: recast_prior above its budget, reversed below)."""
    runs = Path(bench.__file__).resolve().parent / "results" / "recast-reversed" / "runs"
    exp = bench.EXPERIMENTS["recast-matched"]
    for group, arms in bench.MATCHED_BUDGETS.items():
        for label, source in (("matched", "recast_prior"), ("matched_reversed", "reversed")):
            shares = [
                bench.effective_budgets(row["recast/W"], row["recast/sigmas"])
                for seed in range(exp.seeds)
                for row in json.loads(
                    gzip.open(runs / f"{reports.slug(group + '-' + source)}-seed{seed}.json.gz").read()
                )["rows"]
            ]
            typed = np.array([float(b) for b in arms[label].split(",")])
            assert np.abs(np.mean(shares, axis=0) - typed).max() < 0.0011, (group, label)
        assert float(arms["matched"].split(",")[1]) > float(arms["matched_reversed"].split(",")[1])


def test_nft_steps_quick(tmp_path):
    if not has_updates_per_iter():
        pytest.skip("recast.py has no --updates-per-iter yet (the lead is adding it); nft-steps cannot run")
    res = bench.main(["nft-steps", "--quick", "--out", str(tmp_path)])
    assert set(res.runs["nft"]) == {"updates_1", "updates_8"}
    table = (tmp_path / "nft-steps" / "table.md").read_text()
    assert "updates_8 − updates_1" in table and (tmp_path / "nft-steps" / "eval_vs_iteration.png").exists()

    # RESULTS.md from the results alone (a fresh clone: no work/): exactly the marker block, the same bytes twice
    clone = tmp_path / "clone"
    shutil.copytree(tmp_path / "nft-steps", clone / "results" / "nft-steps", ignore=shutil.ignore_patterns("work"))
    md = clone / "RESULTS.md"
    head, tail = "# Results\n\nbefore\n<!-- BEGIN nft-steps-x -->\n", "\nafter <!-- END nft-steps-x -->\n"
    md.write_text(head + "<!-- BEGIN nft-steps -->\nold table\n<!-- END nft-steps -->" + tail)
    argv = ["nft-steps", "--quick", "--tables-only", "--out", str(clone / "results"), "--results-md", str(md)]
    bench.main(argv)
    once = md.read_text()
    assert (clone / "results" / "nft-steps" / "table.md").read_text() == table  # the same table without run folders
    assert once.startswith(
        head + "<!-- BEGIN nft-steps -->\n`python experiments/bench.py nft-steps --quick --tables-only` (2 runs"
    )
    assert once.endswith("\n<!-- END nft-steps -->" + tail) and "old table" not in once
    assert "\n# nft-steps" not in once and "](results/nft-steps/eval_vs_iteration.png)" in once
    bench.main(argv)
    assert md.read_text() == once
    md.write_text("# Results\n")  # no block yet: appended at the end
    bench.main(argv)
    assert md.read_text() == "# Results\n\n" + once[len(head) : -len(tail)] + "\n"


# -----------------------------------------------------------------------------
# Results are data: faults injected, the files compared before and after (no training: a fake worker process)
# -----------------------------------------------------------------------------

FAKE_WORKER = """
import json, os, subprocess, sys, time
work, wait = sys.argv[sys.argv.index("--out") + 1], float(sys.argv[1])
os.makedirs(work, exist_ok=True)
with open(os.path.join(work, "seen.json"), "w") as f:
    json.dump({"cwd": os.getcwd(), "argv": sys.argv[2:]}, f)
if wait:  # a run still training: a child of its own (its process group's) and its pids on disk
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(work, "pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(wait)
rows = [{"iteration": i, "eval/weighted": 0.1 * i, "time/rollout": 1.0} for i in range(2)]
with open(os.path.join(work, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(m) + "\\n" for m in rows))
"""


def fake_worker(slow=()):
    """worker_command for bench.execute: a process that writes a run's metrics at once (or, for run ids in `slow`,
    sleeps 60 s with a child process), and records the folder it ran in and its flags."""
    return lambda run: [sys.executable, "-c", FAKE_WORKER, "60" if run.run_id in slow else "0", *bench.argv_of(run)]


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def write_record(run, world=None, **changes):
    record = {
        "run_id": run.run_id,
        "label": run.cell.label,
        "group": run.cell.group,
        "seed": run.seed,
        "settings": list(run.settings),
        "command": f"python {run.cell.script}.py --out {run.work} --overwrite",
        "world": world or shapes_world.world_id(),
        "rows": [{"iteration": 0, "eval/weighted": 0.5}],
        **changes,
    }
    run.result.parent.mkdir(parents=True, exist_ok=True)
    run.result.write_bytes(gzip.compress(json.dumps(record).encode(), mtime=0))
    return record


def test_a_rerun_with_other_settings_or_of_another_world_is_refused_and_replace_moves_them_aside(
    tmp_path, monkeypatch, capsys
):
    """The probe's case: `rvge-single --seeds 1 --iterations 1` on committed results replaced them. Now it is refused
    before anything runs, naming each result and what differs, and nothing changes; a result of another world at
    matching settings is refused too; --replace-results moves them (byte for byte) to set-aside/ and runs."""
    exp = bench.EXPERIMENTS["rvge-single"]
    exp_dir = tmp_path / "results" / exp.name
    committed = bench.plan_runs(exp, exp_dir)
    for run in committed[:4]:  # seed 0 of every cell, at the experiment's settings
        write_record(run)
    write_record(committed[5], world="0123456789ab")  # seed 1 of one cell: made on another embedded world
    before = snapshot(tmp_path)
    monkeypatch.setattr(bench, "worker_command", fake_worker())
    monkeypatch.setattr(reports, "report_rvge_single", lambda res, out: res.banner())
    argv = ["rvge-single", "--out", str(tmp_path / "results"), "--seeds", "1", "--iterations", "1", "--jobs", "2"]
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    msg = str(err.value.code)
    assert "holds 5 result(s) that this command would replace or add to" in msg
    assert f"{committed[0].result.name}: other settings (--iterations 60 there, 1 now; --save-every 60 there" in msg
    assert "another embedded world (0123456789ab" in msg and "--replace-results" in msg and "--out DIR" in msg
    assert snapshot(tmp_path) == before
    with pytest.raises(SystemExit, match=f"{committed[5].result.name}: another embedded world \\(0123456789ab"):
        bench.main(argv[:3] + ["--jobs", "2"])  # the experiment's own settings: seed 1's other world still refused
    assert snapshot(tmp_path) == before

    res = bench.main(argv + ["--replace-results"])
    assert not res.missing and len(res.records) == 4
    aside = next((exp_dir / "set-aside").iterdir())
    assert aside.name.endswith("-replaced") and "0123456789ab" in (aside / "WHY.txt").read_text()
    moved = {f"results/{exp.name}/set-aside/{aside.name}/{k.rsplit('/', 1)[1]}": v for k, v in before.items()}
    assert {k: v for k, v in snapshot(tmp_path).items() if k in moved} == moved  # every old result kept, unchanged
    now = bench.plan_runs(bench.replace(exp, seeds=1, iterations=1), exp_dir)
    assert all(reports.flag_value(bench.load_result(r)["settings"], "--iterations") == "1" for r in now)
    assert "moved 5 result(s) made differently" in capsys.readouterr().out


def test_a_higher_seed_of_the_same_settings_is_not_a_conflict(tmp_path):
    exp = bench.EXPERIMENTS["rvge-single"]
    for run in bench.plan_runs(exp, tmp_path / exp.name):
        write_record(run)
    fewer = bench.replace(exp, seeds=1)
    assert bench.survey_results(bench.plan_runs(fewer, tmp_path / exp.name), fewer, tmp_path / exp.name) == ({}, {})


def test_jobs_from_another_folder_keeps_every_result(tmp_path, monkeypatch):
    """--jobs N started elsewhere with a relative --out: the workers (run in the project folder) get absolute paths,
    and every result lands in the --out the caller meant; nothing is written in the project folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(bench, "worker_command", fake_worker())
    monkeypatch.setattr(reports, "report_rvge_joint", lambda res, out: res.banner())
    res = bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", "res"])
    exp_dir = elsewhere / "res" / "rvge-joint"
    assert not res.missing and len(res.records) == 6 and len(list((exp_dir / "runs").glob("*.json.gz"))) == 6
    seen = json.loads((exp_dir / "work" / "joint_nft-seed0" / "seen.json").read_text())
    assert seen["cwd"] == str(bench.ROOT) and seen["argv"][seen["argv"].index("--out") + 1] == str(
        exp_dir / "work" / "joint_nft-seed0"
    )
    assert not (bench.HERE / "res").exists() and not (bench.ROOT / "res").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_launches_nothing_more_ends_the_runs_in_flight_and_keeps_every_result(
    sig, tmp_path, monkeypatch, capsys
):
    """Ctrl-C (or SIGTERM) while --jobs 2 has two runs in flight and seven queued: nothing more starts, both runs and
    their children end, the two finished results and the one from before are kept unchanged, one line and exit
    128 + signal, no traceback."""
    exp = bench.quick_version(bench.EXPERIMENTS["rvge-joint"])
    exp_dir = tmp_path / exp.name
    runs = bench.plan_runs(bench.replace(exp, seeds=2), exp_dir)  # 12 runs, seed by seed
    write_record(runs[6])  # finished before: kept, not rerun
    before = snapshot(tmp_path)
    slow = {r.run_id for r in runs[2:]}
    monkeypatch.setattr(bench, "worker_command", fake_worker(slow))
    in_flight = [runs[2].work / "pids", runs[3].work / "pids"]
    handler = signal.getsignal(sig)

    def stop_when_both_run():
        deadline = time.monotonic() + 60
        while not all(p.is_file() and len(p.read_text().split()) == 2 for p in in_flight):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    threading.Thread(target=stop_when_both_run, daemon=True).start()
    with pytest.raises(SystemExit) as err:
        bench.main(["rvge-joint", "--quick", "--seeds", "2", "--jobs", "2", "--out", str(tmp_path)])
    assert err.value.code == 128 + sig
    line = capsys.readouterr().err
    assert f"stopped by {signal.Signals(sig).name}: 3 finished result(s) kept" in line and "7 not started" in line
    assert "Traceback" not in line and runs[2].run_id in line and runs[3].run_id in line
    pids = [int(x) for p in in_flight for x in p.read_text().split()]
    time.sleep(0.3)
    assert not any(alive(pid) for pid in pids), "a run or its child outlived the stop"
    assert all(not r.work.exists() for r in runs[4:] if r is not runs[6]), "a queued run was launched after the stop"
    after = snapshot(tmp_path)
    assert {k: after[k] for k in before} == before  # the result from before, unchanged
    assert [r.run_id for r in runs if r.result.exists()] == [runs[0].run_id, runs[1].run_id, runs[6].run_id]
    assert signal.getsignal(sig) is handler  # bench.py's handler is gone again


def test_a_stop_in_the_single_process_mode(tmp_path, monkeypatch, capsys):
    """--jobs 1 trains in this process: Ctrl-C there ends that run, starts no other and keeps the finished ones."""
    exp = bench.quick_version(bench.EXPERIMENTS["rvge-joint"])
    runs = bench.plan_runs(exp, tmp_path / exp.name)
    started = []

    def fake_run_in_process(run):
        started.append(run.run_id)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # interrupted
        write_record(run)

    monkeypatch.setattr(bench, "run_in_process", fake_run_in_process)
    with pytest.raises(SystemExit) as err:
        bench.execute(runs, 1)
    assert err.value.code == 130 and started == [runs[0].run_id, runs[1].run_id]
    assert "stopped by SIGINT: 1 finished result(s) kept" in capsys.readouterr().err
    assert runs[0].result.exists() and not runs[1].result.exists()


def test_tables_only_never_mixes_worlds_nor_takes_runs_from_the_reused_experiment(tmp_path):
    """--tables-only runs nothing and writes no result: an experiment whose results are gone (rvge-joint-why) is
    refused, not filled with rvge-joint's runs; a folder holding two worlds' results makes no table."""
    why = bench.EXPERIMENTS["rvge-joint-why"]
    world = shapes_world.world_id()
    for run in bench.plan_runs(bench.EXPERIMENTS[why.reuse], tmp_path / why.reuse):
        run.result.parent.mkdir(parents=True, exist_ok=True)
        run.result.write_text(json.dumps({"settings": list(run.settings), "rows": [{"iteration": 0}], "world": world}))
    with pytest.raises(SystemExit):
        bench.main(["rvge-joint-why", "--tables-only", "--out", str(tmp_path)])
    assert not (tmp_path / why.name / "runs").exists()
    exp = bench.quick_version(bench.EXPERIMENTS["nft-steps"])
    runs = bench.plan_runs(exp, tmp_path / exp.name)
    runs[0].result.parent.mkdir(parents=True)
    for run, made_on in zip(runs, (world, "0123456789ab")):
        run.result.write_text(
            json.dumps({"settings": list(run.settings), "rows": [{"iteration": 0}], "world": made_on})
        )
    with pytest.raises(SystemExit, match="holds results of 2 embedded worlds .*one table never mixes worlds"):
        bench.check_one_world(runs, tmp_path / exp.name)
    runs[1].result.write_text(
        json.dumps({"settings": list(runs[1].settings), "rows": [{"iteration": 0}], "world": world})
    )
    bench.check_one_world(runs, tmp_path / exp.name)


def test_one_worlds_section_of_results_md_is_never_replaced_by_anothers(tmp_path):
    md = tmp_path / "RESULTS.md"
    text = "# R\n\n<!-- BEGIN x -->\n`c` (3 runs made at commit abc, embedded world aaa, 2026-12-01):\n\nold\n"
    text += "<!-- END x -->\n"
    md.write_text(text)
    with pytest.raises(SystemExit, match="holds tables of embedded world aaa; these results are of world bbb"):
        reports.write_results_md(md, "x", "`c` (3 runs made at commit abd, embedded world bbb, 2026-12-02):\n\nnew")
    assert md.read_text() == text
    reports.write_results_md(md, "x", "`c` (4 runs made at commit abd, embedded world aaa, 2026-12-02):\n\nnew")
    assert "\n\nnew\n<!-- END x -->" in md.read_text() and "old" not in md.read_text()


def generated_sections(here: Path) -> dict:
    """{Markdown file: its generated sections' markers} for every Markdown file under `here` (experiments/) that has
    any: the results folders' README.md."""
    found = {}
    for md in sorted(here.rglob("*.md")):
        if not {"work", "set-aside"} & set(md.relative_to(here).parts):
            if markers := re.findall(r"^<!-- BEGIN (\S+) -->$", md.read_text(), flags=re.M):
                found[md] = markers
    return found


@pytest.mark.long(120)  # seconds on a 2-core machine, for the order only
def test_every_generated_file_regenerates_unchanged(tmp_path, monkeypatch):
    """Each generated section (<!-- BEGIN ... --> in any Markdown file under experiments/: each results folder's
    README.md), rebuilt by the --tables-only command it names from a copy of the committed results alone (the files
    here are not touched), is the same text, and so is each table.md: no generated number is stale. Every committed
    experiment (a results folder of an experiment with result files) has a section, so none goes unchecked, and an
    earlier world's sections (world-amp0.3/...) regenerate too. ~80 s on one core."""
    here = Path(bench.__file__).resolve().parent  # experiments/
    files = generated_sections(here)
    markers = [(md, m) for md, found in files.items() for m in found]
    assert markers and len({m for _, m in markers}) == len(markers), "no generated section, or one named twice"
    committed = {
        p.parent.parent.relative_to(here / "results").as_posix()
        for p in (here / "results").rglob("runs/*.json.gz")
        if p.parent.parent.name in bench.EXPERIMENTS and "set-aside" not in p.parts
    }
    assert committed and committed <= {m for _, m in markers}, f"committed results without a section: {committed}"
    copy = tmp_path / "experiments"  # the project's layout: commands name --out relative to the project folder
    for _, marker in markers:  # each experiment folder of a marker, and its root's profiles (read by recast-protocol)
        root = marker.rpartition("/")[0]
        for name in (marker.rpartition("/")[2], bench.PROFILES_DIR):
            source = here / "results" / root / name
            if source.is_dir() and not (copy / "results" / root / name).exists():
                shutil.copytree(source, copy / "results" / root / name, ignore=shutil.ignore_patterns("work"))
    for md in files:
        shutil.copyfile(md, copy / md.relative_to(here))
    monkeypatch.setattr(bench, "HERE", copy)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    for md, marker in sorted(markers, key=lambda x: "-B" not in x[1]):  # setting B's summary first: A's report reads it
        root, _, name = marker.rpartition("/")
        command = re.search(r"`python experiments/bench\.py (.+?) --tables-only`", section(md.read_text(), marker))
        assert command and command[1].split()[0] == name, f"section {marker} names no --tables-only command"
        argv = command[1].split() + ["--tables-only"]
        if "--out" in argv:
            argv[argv.index("--out") + 1] = str(tmp_path / argv[argv.index("--out") + 1])
        bench.main(argv)
        table = Path("results", root, name, "table.md")
        assert (copy / table).read_text() == (here / table).read_text(), f"{table} is stale: rebuild it"
    for md, found in files.items():
        old, new = md.read_text(), (copy / md.relative_to(here)).read_text()
        stale = [m for m in found if section(new, m) != section(old, m)]
        assert not stale, f"{md}: sections not what their commands make: {stale}; rerun them with --tables-only"
        assert new == old, f"{md}: the text around its sections changed in a rebuild"


def section(text, marker):
    return text.split(f"<!-- BEGIN {marker} -->")[1].split(f"<!-- END {marker} -->")[0]


@pytest.mark.parametrize(
    "text",
    [
        "# Results\n\n<!-- BEGIN nft-steps -->\nold table\n\n## My notes\n\nkeep me\n",  # END deleted
        "<!-- BEGIN nft-steps -->\na\n<!-- END nft-steps -->\nmine\n<!-- BEGIN nft-steps -->\nb\n",  # two BEGINs
        "<!-- END nft-steps -->\nmine\n<!-- BEGIN nft-steps -->\nb\n",  # END before BEGIN
    ],
)
def test_results_md_markers_that_do_not_pair_up_are_refused(text, tmp_path):
    """A BEGIN whose END was deleted: the first rebuild appended a block, the second deleted the user's text after
    the orphan BEGIN. Now both refuse, naming the file and the marker, and the file is unchanged."""
    md = tmp_path / "RESULTS.md"
    md.write_text(text)
    for _ in range(2):
        with pytest.raises(SystemExit, match=f"{md}: the section's markers do not pair up \\(<!-- BEGIN nft-steps -->"):
            reports.write_results_md(md, "nft-steps", "new table")
        assert md.read_text() == text
    with pytest.raises(SystemExit, match="do not pair up"):  # and before any run
        bench.main(["nft-steps", "--tables-only", "--out", str(tmp_path / "res"), "--results-md", str(md)])
    assert md.read_text() == text


def test_a_results_md_that_is_a_folder_or_a_read_only_results_folder_is_refused_clearly(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="--results-md .* is a folder: name a Markdown file"):
        bench.main(["nft-steps", "--tables-only", "--out", str(tmp_path / "res"), "--results-md", str(tmp_path)])
    with pytest.raises(SystemExit, match="its folder .*missing does not exist"):
        bench.main(
            ["nft-steps", "--tables-only", "--out", str(tmp_path), "--results-md", str(tmp_path / "missing/R.md")]
        )
    exp_dir = tmp_path / "ro" / "nft-steps"
    write_record(bench.plan_runs(bench.EXPERIMENTS["nft-steps"], exp_dir)[0])
    before = snapshot(tmp_path / "ro")
    exp_dir.chmod(0o555)
    real_access = os.access  # root writes anyway: answer as the user would be answered
    monkeypatch.setattr(bench.os, "access", lambda p, mode: real_access(p, mode) and Path(p) != exp_dir)
    try:
        for extra in ([], ["--tables-only"]):
            with pytest.raises(SystemExit, match=f"{exp_dir} is not writable: .*chmod -R u\\+w .*or pass --out DIR"):
                bench.main(["nft-steps", "--out", str(tmp_path / "ro"), *extra])
    finally:
        exp_dir.chmod(0o755)
    assert snapshot(tmp_path / "ro") == before
    (tmp_path / "file" / "nft-steps").mkdir(parents=True)
    (tmp_path / "file" / "nft-steps" / "runs").write_text("not a folder")
    with pytest.raises(SystemExit, match="runs is not a folder"):
        bench.main(["nft-steps", "--out", str(tmp_path / "file")])


def test_a_damaged_or_older_result_is_named_and_the_rest_carry_on(tmp_path, monkeypatch, capsys):
    """One damaged or older-format result used to stop both --tables-only and the experiment with a traceback naming
    no file. Now --tables-only names each file and what is wrong, leaves it where it is and builds the tables from
    the rest; a run moves the damaged ones, byte for byte, to set-aside/ and redoes only those runs."""
    exp_dir = tmp_path / "rvge-single"
    shutil.copytree(bench.HERE / "results" / "rvge-single" / "runs", exp_dir / "runs")  # the committed results
    folder = exp_dir / "runs"

    def older(data):  # a record from before `settings` was kept
        record = json.loads(gzip.decompress(data))
        return gzip.compress(json.dumps({k: v for k, v in record.items() if k != "settings"}).encode())

    faults = {
        "grain_nft-seed0.json.gz": (lambda b: b[: len(b) // 2], "not an intact gzip file"),  # a write cut short
        "grain_rvge-seed1.json.gz": (lambda b: b[:12] + bytes(len(b) - 12), "not an intact gzip file"),  # zeroed
        "texture_nft-seed2.json.gz": (lambda b: b"[1, 2, 3]", "a JSON list, not a result record"),
        "texture_rvge-seed3.json.gz": (older, "lacks settings (an older format"),
    }
    for name, (fault, _) in faults.items():
        (folder / name).write_bytes(fault((folder / name).read_bytes()))
    before = snapshot(tmp_path)
    res = bench.main(["rvge-single", "--tables-only", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for name, (_, why) in faults.items():
        assert f"warning: {folder / name}: {why}" in out
    assert len(res.records) == 16 and sorted(res.missing) == sorted(n.removesuffix(".json.gz") for n in faults)
    assert "PARTIAL: 4 run(s) missing" in (exp_dir / "table.md").read_text()
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before  # tables-only moved nothing

    # rows without a metric the report needs (an older format): that result is left out, named, the rest reported
    def report_needing_eval(res, out):
        return res.banner() + [str(sum(rows[-1]["eval/weighted"] for rows in res.runs["grain"]["nft"].values()))]

    monkeypatch.setattr(reports, "report_rvge_single", report_needing_eval)
    path = folder / "grain_nft-seed1.json.gz"
    record = json.loads(gzip.decompress(path.read_bytes()))
    record["rows"] = [{k: v for k, v in m.items() if k != "eval/weighted"} for m in record["rows"]]
    path.write_bytes(gzip.compress(json.dumps(record).encode()))
    res = bench.main(["rvge-single", "--tables-only", "--out", str(tmp_path)])
    assert f"warning: {path}: its rows lack 'eval/weighted'" in capsys.readouterr().out and len(res.records) == 15

    # the experiment itself: the four damaged results set aside unchanged, only their runs redone
    before = snapshot(tmp_path)
    monkeypatch.setattr(bench, "worker_command", fake_worker())
    monkeypatch.setattr(reports, "report_rvge_single", lambda res, out: res.banner())
    res = bench.main(["rvge-single", "--out", str(tmp_path), "--jobs", "2"])
    out = capsys.readouterr().out
    aside = next((exp_dir / "set-aside").iterdir())
    assert aside.name.endswith("-damaged") and not res.missing
    for name, (_, why) in faults.items():
        assert (aside / name).read_bytes() == before[f"rvge-single/runs/{name}"] and why in (
            aside / "WHY.txt"
        ).read_text()
        assert f"{folder / name}: {why}" in out and "the run will be redone" in out
        assert bench.load_result(next(r for r in bench.plan_runs(res.exp, exp_dir) if r.result.name == name))
    after = snapshot(tmp_path)
    kept = [k for k in before if k.startswith("rvge-single/runs/") and k.rsplit("/", 1)[1] not in faults]
    assert len(kept) == 16 and all(after[k] == before[k] for k in kept)


def test_profiles_and_final_evaluations_are_never_replaced_silently(tmp_path, capsys):
    """profiles.json measured with other sizes (or on another world) is refused, not re-measured over; a damaged
    final evaluation is named and, with no checkpoint to evaluate again, left as it is and out of the tables (with
    one, it is moved to set-aside/ and evaluated anew)."""
    path = tmp_path / "profiles.json"
    path.write_text(
        json.dumps({"names": list(protocol.PROFILE_CANDIDATES), "iterations": 192, "prompts": 8, "world": "x"})
    )
    before = snapshot(tmp_path)
    with pytest.raises(
        SystemExit, match="profiles.json holds profiles measured differently \\(iterations 192 there, 2"
    ):
        protocol.measure_profiles(tmp_path, iterations=2, prompts=1)
    assert snapshot(tmp_path) == before
    exp = bench.quick_version(bench.EXPERIMENTS["recast-protocol"])
    run = bench.plan_runs(exp, tmp_path)[0]
    write_record(run)
    final_eval = run.result.with_name(run.run_id + ".final.json")
    final_eval.write_text('{"checkpoint": "iter_000001", "n": 1')  # a write cut short
    n = len(shapes_world.splits()["heldout"]) * exp.final_noises
    pretrained = {"checkpoint": "pretrained", "n": n, "scores": {"1": {}}}
    (tmp_path / "runs" / "pretrained.final.json").write_text(json.dumps(pretrained))
    before = snapshot(tmp_path)
    assert protocol.final_evals([run], tmp_path, exp.final_noises) == {"pretrained": {"1": {}}}
    assert f"warning: {final_eval}: not JSON" in capsys.readouterr().out
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the runs are told to end with bench.py on Linux")
def test_killing_bench_outright_leaves_no_run_behind(tmp_path):
    """SIGKILL cannot be caught: the runs of --jobs N are told to end when bench.py dies, so none is orphaned."""
    script = tmp_path / "bench_with_fake_runs.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\nfrom experiments import bench\n"
        f"fake = {FAKE_WORKER!r}\n"
        "bench.worker_command = lambda run: [sys.executable, '-c', fake, '60', *bench.argv_of(run)]\n"
        "exp = bench.quick_version(bench.EXPERIMENTS['rvge-joint'])\n"
        "bench.execute(bench.plan_runs(exp, Path(sys.argv[1])), 2)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(bench.ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "exp")], cwd=bench.ROOT, env=env)
    pid_files = [tmp_path / "exp" / "work" / name / "pids" for name in ("joint_nft-seed0", "joint_rvge-seed0")]
    deadline = time.monotonic() + 120
    while not all(p.is_file() and len(p.read_text().split()) == 2 for p in pid_files):
        assert time.monotonic() < deadline and proc.poll() is None, "the fake runs did not start"
        time.sleep(0.05)
    pids = [int(x) for p in pid_files for x in p.read_text().split()]
    assert all(alive(pid) for pid in pids)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    runs_alive = [pid for pid in pids[::2] if alive(pid)]
    for pid in pids:  # what is left (the fake runs' own children: the README's limit) is this test's to end
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not runs_alive, "a run outlived bench.py"


# -----------------------------------------------------------------------------
# Rebuilds never lose results (issue 47: each fault injected, the files compared before and after)
# -----------------------------------------------------------------------------


def must_not_run(run):
    raise AssertionError(f"{run.run_id}: nothing may run here")


def test_a_rebuild_reads_every_committed_seed_or_refuses(tmp_path, monkeypatch, capsys):
    """47.1: rvge-drift holds 8 seeds where the experiment plans 5. `--tables-only` read 5 and rewrote table.md, the
    figure and the section from 30 of its 48 results without a word, and so did the full command, which had nothing
    to run. Now --tables-only reads every committed seed (the committed files, byte for byte), and a run, or --seeds
    below the committed seeds, is refused before anything runs or changes, naming the seeds and the flag."""
    copy = tmp_path / "experiments"  # a copy of the committed folder, where the default --out writes its section
    shutil.copytree(bench.HERE / "results" / "rvge-drift", copy / "results" / "rvge-drift")
    monkeypatch.setattr(bench, "HERE", copy)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "worker_command", must_not_run)
    monkeypatch.setattr(bench, "run_in_process", must_not_run)
    exp_dir = copy / "results" / "rvge-drift"
    before = snapshot(exp_dir)
    for argv in (["rvge-drift"], ["rvge-drift", "--jobs", "2"], ["rvge-drift", "--tables-only", "--seeds", "2"]):
        with pytest.raises(SystemExit, match="holds results of these settings at seeds 0-7; .*Pass --seeds 8 to read"):
            bench.main(argv)
        assert snapshot(exp_dir) == before
    res = bench.main(["rvge-drift", "--tables-only"])
    assert "rvge-drift: reading every committed seed, 0-7 (--seeds 8)" in capsys.readouterr().out
    assert len(res.records) == 48 and not res.missing and snapshot(exp_dir) == before
    res = bench.main(["rvge-drift", "--seeds", "8", "--jobs", "2"])  # every run there: nothing runs, nothing changes
    assert len(res.records) == 48 and snapshot(exp_dir) == before


def test_a_second_bench_on_the_same_experiment_is_refused_naming_the_first(tmp_path, monkeypatch):
    """47.2: two bench.py on one experiment both ran its runs and both exited 1, reporting failed runs that existed.
    Now the second is refused before it reads or writes anything, naming the process that holds the experiment (runs
    and --tables-only alike); a holder killed outright (SIGKILL) leaves its file but no lock."""
    exp_dir = tmp_path / "nft-steps"
    holder_code = (
        "import sys, time\nfrom pathlib import Path\nfrom experiments import bench\n"
        "with bench.experiment_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(bench.ROOT)}
    command = [sys.executable, "-c", holder_code, str(exp_dir)]
    holder = subprocess.Popen(command, cwd=bench.ROOT, env=env, stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(bench, "worker_command", fake_worker())
    monkeypatch.setattr(reports, "report_nft_steps", lambda res, out: res.banner())
    argv = ["nft-steps", "--quick", "--jobs", "2", "--out", str(tmp_path)]
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        for extra in ([], ["--tables-only"]):
            with pytest.raises(
                SystemExit, match=f"nft-steps is in use by another bench.py \\(pid {holder.pid}, since "
            ):
                bench.main(argv + extra)
            assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    assert (exp_dir / bench.LOCK).exists()  # the killed holder's file stays; its lock went with it
    res = bench.main(argv)
    assert len(res.records) == 2 and not res.missing and not (exp_dir / bench.LOCK).exists()


def test_an_incomplete_result_is_named_and_marked_partial(tmp_path, capsys):
    """47.3: a result with a metric removed (from every row, or from its last evaluation only) dropped out of that
    metric's cells and curves, and a run whose final evaluation was deleted (no checkpoint to redo it) out of every
    final table, with no warning and no partial mark. Now each is named with what it lacks, on the console and in
    the table (PARTIAL); the result files are not touched."""
    exp_dir = tmp_path / "rvge-single"
    shutil.copytree(bench.HERE / "results" / "rvge-single" / "runs", exp_dir / "runs")

    def drop(name, key, last_only=False):
        path = exp_dir / "runs" / name
        record = json.loads(gzip.decompress(path.read_bytes()))
        rows = record["rows"]
        record["rows"] = [
            {k: v for k, v in m.items() if k != key} if not last_only or i == len(rows) - 1 else m
            for i, m in enumerate(rows)
        ]
        path.write_bytes(gzip.compress(json.dumps(record).encode()))
        return sum(key in m for m in (rows[-1:] if last_only else rows)), len(rows)

    lost, n = drop("grain_rvge-seed2.json.gz", "eval/judge/frechet")
    drop("texture_nft-seed1.json.gz", "eval/weighted", last_only=True)
    before = snapshot(exp_dir / "runs")
    res = bench.main(["rvge-single", "--tables-only", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    first = f"grain_rvge-seed2: lacks eval/judge/frechet at {lost} of its {n} rows"
    second = f"texture_nft-seed1: lacks eval/weighted at 1 of its {n} rows"
    assert f"warning: {exp_dir / 'runs' / 'grain_rvge-seed2.json.gz'}: {first.split(': ')[1]}" in out
    assert f"warning: {exp_dir / 'runs' / 'texture_nft-seed1.json.gz'}: {second.split(': ')[1]}" in out
    table = (exp_dir / "table.md").read_text()
    assert f"**PARTIAL: 2 result(s) incomplete** ({first}; {second})" in table
    assert len(res.records) == 20 and snapshot(exp_dir / "runs") == before

    exp_dir = tmp_path / "recast-reversed"  # the final evaluation of one run deleted, and no run folder to redo it
    shutil.copytree(bench.HERE / "results" / "recast-reversed" / "runs", exp_dir / "runs")
    (exp_dir / "runs" / "A_uniform_reversed-seed3.final.json").unlink()
    before = snapshot(exp_dir / "runs")
    bench.main(["recast-reversed", "--tables-only", "--out", str(tmp_path)])
    gone = "no final evaluation (A_uniform_reversed-seed3.final.json missing, no checkpoint to redo it)"
    assert f"warning: {exp_dir / 'runs' / 'A_uniform_reversed-seed3.json.gz'}: {gone}" in capsys.readouterr().out
    table = (exp_dir / "table.md").read_text()
    assert f"**PARTIAL: 1 result(s) incomplete** (A_uniform_reversed-seed3: {gone})" in table
    assert "| reversed | 7 |" in table and snapshot(exp_dir / "runs") == before
