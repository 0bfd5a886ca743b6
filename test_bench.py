"""bench.py: the experiment specs, the statistics, and each experiment's --quick on the embedded model.

pytest -q test_bench.py
"""

import json
import shutil

import numpy as np
import pytest

import bench
import recast
import rvge
import shapes_world


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
    assert all(bench.flag_value(c.flags, "--rewards").split(",") == list(bench.SETTINGS["A"]) for c in joint.cells)
    assert all(bench.flag_value(c.flags, "--budgets") == "0.25,0.25,0.25,0.25" for c in joint.cells)
    its = {c.label: bench.cell_iterations(joint, c) for c in joint.cells}
    assert its["rvge_fifth"] * 5 == its["nft"] == its["rvge"] == its["rvge_one_direction"] == its["rvge_recast"]
    flags = {c.label: (c.script, c.flags[4:]) for c in joint.cells}
    assert flags["rvge_one_direction"] == ("rvge", ("--combine", "reward"))
    assert flags["rvge_recast"] == ("rvge", ("--credit", "recast")) and flags["recast"] == (
        "recast",
        ("--credit", "recast"),
    )
    why = bench.EXPERIMENTS["rvge-joint-why"]
    assert why.reuse == "rvge-joint" and {c.label for c in why.cells} == {"nft", "rvge", "rvge_broad", "rvge_half_lr"}
    assert why.iterations == joint.iterations  # so its nft and rvge runs are rvge-joint's
    assert bench.flag_value(next(c for c in why.cells if c.label == "rvge_half_lr").flags, "--lr") == str(
        rvge.Args().lr / 2
    )
    eta = bench.EXPERIMENTS["rvge-joint-eta"]
    etas = [float(bench.flag_value(c.flags, "--eta")) for c in eta.cells if bench.flag_value(c.flags, "--eta")]
    assert eta.reuse == why.name and sorted(etas) == [rvge.Args().eta / 4, rvge.Args().eta / 2]
    assert set(bench.SETTINGS["A"]) != set(bench.SETTINGS["B"]) and all(
        set(v) <= set(bench.PROFILE_CANDIDATES) for v in bench.SETTINGS.values()
    )
    for name, setting in (("recast-protocol", "A"), ("recast-protocol-B", "B")):
        protocol = bench.EXPERIMENTS[name]
        assert {c.group for c in protocol.cells} == {f"{setting}-{b}" for b in bench.budget_vectors()}
        assert {c.label for c in protocol.cells} == {"nft", "uniform", "recast", "recast_prior"}
        assert all(  # only recast_prior starts from the measured profiles; recast learns W from its own rollouts
            (bench.flag_value(c.flags, "--gain-init") is not None) == (c.label == "recast_prior")
            for c in protocol.cells
        )
        for c in protocol.cells:
            assert bench.flag_value(c.flags, "--rewards").split(",") == list(bench.SETTINGS[setting])
            budgets = [float(b) for b in bench.flag_value(c.flags, "--budgets").split(",")]
            assert len(budgets) == 4 and abs(sum(budgets) - 1) < 1e-9
    steps = bench.EXPERIMENTS["nft-steps"]
    assert [bench.flag_value(c.flags, "--updates-per-iter") for c in steps.cells] == [
        "1",
        "8",
    ] and steps.eval_every == 10
    assert {c.label for c in bench.EXPERIMENTS["multi"].cells} == set(bench.MULTI_METHODS)


# -----------------------------------------------------------------------------
# Statistics (hand-computed values)
# -----------------------------------------------------------------------------


def test_statistics_by_hand():
    x, y = np.array([0.0, 10.0, 20.0]), np.array([0.1, 0.3, 0.5])
    assert bench.first_crossing(x, y, 0.4) == pytest.approx(15.0)
    assert bench.first_crossing(x, y, 0.05) == 0.0 and np.isnan(bench.first_crossing(x, y, 0.6))
    m, lo, hi, n = bench.mean_ci([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.3027
    assert (
        (m, n) == (2.0, 3)
        and hi - m == pytest.approx(4.302653 / np.sqrt(3), rel=1e-5)
        and lo == pytest.approx(2 * m - hi)
    )
    assert np.isnan(bench.mean_ci([1.0])[1])


def test_seeds_needed_resolves_the_observed_difference_at_its_sd():
    """mean 1, sd 1 over 3 seeds (unresolved): t(0.975, N - 1) / sqrt(N) < 1 first at N = 7 (2.447 < 2.646; at N = 6
    2.571 > 2.449); a resolved interval prints no n95, an unresolved one does."""
    m, lo, hi, n = bench.mean_ci([0.0, 1.0, 2.0])
    assert lo < 0 < hi and bench.seeds_needed(m, lo, hi, n) == 7
    assert bench.fmt_ci(m, lo, hi, n).endswith(" sd 1.0000 n95 7")
    exp = bench.EXPERIMENTS["rvge-single"]  # the power section sizes the experiment at the printed n95 values
    power = "\n".join(bench.power_lines(exp, "| a | +0.1 [-1, +1] sd 1 n95 7 | b n95 3 | c n95 > 10000 |"))
    assert "3 paired difference(s) above are unresolved" in power and "1 would need more than 10,000" in power
    from dataclasses import replace

    hours = bench.estimate_minutes(replace(exp, seeds=7), 2) / 60
    assert f"| 7 | largest | ~{hours:.1f} h |" in power and "| 3 | smallest |" in power
    assert bench.power_lines(exp, "all resolved") == []
    assert "n95" not in bench.fmt_ci(*bench.mean_ci([1.0, 1.1, 0.9]))
    assert bench.seeds_needed(0.0, -1.0, 1.0, 3) is None
    assert bench.verdict("eval/judge/frechet", -5.0, -1.0) == 1 and bench.verdict("eval/weighted", -5.0, -1.0) == -1
    assert bench.verdict("judge/frechet", -5.0, -1.0) == 1 and bench.verdict("judge/frechet", 1.0, 5.0) == -1
    assert bench.verdict("eval/weighted", -1.0, 1.0) == 0 and bench.verdict("eval/weighted", np.nan, np.nan) == 0
    assert bench.paired({0: 1.0, 1: 5.0, 2: 2.0}, {0: 0.5, 2: 1.0}) == [0.5, 1.0]
    assert bench.fmt_ratio({0: 4.0, 1: 9.0}, {0: 2.0, 1: 3.0}).startswith(
        f"{np.sqrt(6):.2f}x ["
    )  # geometric mean of 2 and 3
    e = np.e  # log ratios 0, 1, 2: mean 1, sd 1 over 3 seeds, as above: unresolved, n95 7
    assert bench.fmt_ratio({0: 1.0, 1: e, 2: e * e}, {0: 1.0, 1: 1.0, 2: 1.0}).endswith("(n=3) n95 7")
    rows = [
        {"iteration": 0, "eval_before/weighted": 0.4, "time/rollout": 1.0, "time/update": 1.0},
        {"iteration": 1, "time/rollout": 1.0, "time/update": 2.0, "eval/weighted": 0.6},
    ]
    its, secs, vals = bench.eval_curve(rows)
    assert its.tolist() == [0, 2] and secs.tolist() == [0.0, 5.0] and vals.tolist() == [0.4, 0.6]
    base = {"a": [0.0, 2.0, 0.0, 2.0], "b": [0.0, 0.5, 0.0, 0.5]}  # means 1, 0.25; sd 1, 0.25
    scores = {"a": [3.0, 3.0], "b": [0.5, 0.5], "judge/frechet": 7.0, "judge/pref": [1.0, 0.0, 2.0, 5.0]}
    assert bench.final_value(scores, "scale_free", ["a", "b"], [3.0, 1.0], base) == pytest.approx(
        (3 * 2.0 + 1 * 1.0) / 4
    )
    assert bench.final_value(scores, "weighted", ["a", "b"], [3.0, 1.0]) == pytest.approx((3 * 3.0 + 0.5) / 4)
    assert bench.final_value(scores, "judge/frechet") == 7.0 and bench.final_value(scores, "a") == 3.0
    assert bench.win_rate(scores, {"judge/pref": [0.0, 0.0, 3.0, 1.0]}) == pytest.approx((1 + 0.5 + 0 + 1) / 4)


def test_a_result_from_other_settings_is_redone(tmp_path):
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
    got = bench.final_evals([run], tmp_path, exp.final_noises)  # would load the model and fail if it evaluated
    assert got == {"pretrained": {"1": {"name": "pretrained"}}, run.run_id: {"1": {"name": run.run_id}}}
    records = [
        {"git_sha": "0123456789abcdef", "finished": "2026-12-01", "world": "abcdef012345"},
        {"git_sha": None, "finished": "2026-12-03"},
    ]
    block = bench.results_block(
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
    record = {"settings": list(runs[0].settings), "rows": [{"iteration": 0}], "world": "0123456789ab"}
    runs[0].result.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="another embedded world \\(0123456789ab; assets/ now hold world"):
        bench.check_world(runs, tmp_path / exp.name)
    runs[0].result.write_text(json.dumps({**record, "world": shapes_world.world_id()}))
    bench.check_world(runs, tmp_path / exp.name)
    runs[0].result.write_text(json.dumps({k: v for k, v in record.items() if k != "world"}))  # before world ids
    with pytest.raises(SystemExit, match="not recorded"):
        bench.check_world(runs, tmp_path / exp.name)


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


def test_bench_quick_runs_every_method_on_the_embedded_model(tmp_path):
    """multi --quick: both scripts' main loops on the embedded model with its default rewards."""
    res = bench.main(["multi", "--quick", "--out", str(tmp_path)])
    by_label = res.runs["0.4,0.3,0.2,0.1"]
    assert set(by_label) == set(bench.MULTI_METHODS) and not res.missing
    for label, runs in by_label.items():
        rows = runs[0]
        assert [m["iteration"] for m in rows] == [0, 1]
        W = np.array(rows[-1]["recast/W"])
        assert np.abs(W.sum(1) - [0.4, 0.3, 0.2, 0.1]).max() < 1e-9 and np.abs(W.sum(0) - 0.1).max() < 1e-9
        assert any(k.startswith("eval/judge/") for k in rows[-1]), "held-out judges were not evaluated"
    table = (tmp_path / "multi" / "table.md").read_text()
    assert (
        "speed-up vs nft" in table and all(f"| {m} |" in table for m in bench.MULTI_METHODS) and "PARTIAL" not in table
    )
    assert (tmp_path / "multi" / "reward_vs_time_0.4_0.3_0.2_0.1.png").exists()


def test_rvge_single_quick_reports_thresholds_and_speed_up(tmp_path):
    res = bench.main(["rvge-single", "--quick", "--out", str(tmp_path)])
    runs = res.runs[bench.DISCRETE_REWARD]
    assert set(runs) == {"nft", "rvge"} and all(set(by_seed) == {0, 1} for by_seed in runs.values())
    rows = runs["rvge"][0]
    assert "eval_before/weighted" in rows[0] and all("eval/weighted" in m for m in rows)  # eval every iteration here
    assert rows[-1]["eval/weighted"] == rows[-1][f"eval/{bench.DISCRETE_REWARD}"]  # budget 1: weighted is the reward
    table = (tmp_path / "rvge-single" / "table.md").read_text()
    assert f"## {bench.DISCRETE_REWARD}" in table and "final − nft [95%]" in table
    assert "speed-up in time" in table or "did not improve on the pretrained model" in table
    assert (tmp_path / "rvge-single" / "reward_vs_time.png").exists()


def test_rvge_joint_quick_in_parallel_processes_resumes_and_marks_partial(tmp_path, monkeypatch):
    out = tmp_path / "rvge-joint"
    res = bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])
    by_label = res.runs["joint"]
    assert {label: len(by_label[label][0]) for label in by_label} == {
        "nft": 2,
        "rvge": 2,
        "rvge_fifth": 1,
        "rvge_one_direction": 2,
        "rvge_recast": 2,
        "recast": 2,
    }
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
    assert "distance to base" in table and np.isfinite(bench.distance_to_base(by_label["rvge"][0]))
    assert "- rvge: direction rms per reward" in table and "- nft: direction rms" not in table

    def must_not_run(run):
        raise AssertionError(f"{run.run_id} has a result and must be skipped")

    monkeypatch.setattr(bench, "run_in_subprocess", must_not_run)
    bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])  # resume: nothing left to run
    (out / "runs" / "joint_rvge-seed0.json.gz").unlink()  # as if killed before this run finished
    partial = bench.main(["rvge-joint", "--quick", "--tables-only", "--out", str(tmp_path)])
    assert partial.missing == ["joint_rvge-seed0"] and "PARTIAL: 1 run(s) missing" in (out / "table.md").read_text()
    with pytest.raises(
        SystemExit, match="1 run\\(s\\) failed"
    ):  # a failing run is reported; the others' tables still come
        bench.main(["rvge-joint", "--quick", "--jobs", "2", "--out", str(tmp_path)])


def test_recast_protocol_quick_reports_paired_differences_and_judge_counts(tmp_path):
    res = bench.main(["recast-protocol", "--quick", "--out", str(tmp_path)])
    exp_dir = tmp_path / "recast-protocol"
    assert set(res.runs) == {"A-uniform"} and set(res.runs["A-uniform"]) == {"nft", "uniform", "recast", "recast_prior"}
    prof = json.loads((exp_dir / "profiles.json").read_text())
    assert prof["names"] == list(bench.PROFILE_CANDIDATES) and np.asarray(prof["s1"]).shape == (
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
        "| judge/frechet | pref win rate |" in table
    )
    for mine in ("recast", "recast_prior"):
        assert f"| {mine} − nft | 1 |" in table and f"| {mine} − uniform | 1 |" in table
    assert "| pretrained | |" in table and "## Noise floor of one evaluation" in table
    for other in ("nft", "uniform"):
        assert (
            f"ReCAST improves judge cnn over {other} in 0 of 1 cells" in table
            or f"ReCAST improves judge cnn over {other} in 1 of 1 cells" in table
        ) and f"ReCAST improves judge pref (win rate > 0.5) over {other} in " in table
    final = json.loads((exp_dir / "runs" / "A_uniform_recast-seed0.final.json").read_text())
    assert final["n"] == len(shapes_world.splits()["heldout"]) and set(final["scores"]) == {"1", "2"}
    assert all(len(final["scores"]["1"][k]) == final["n"] for k in ("geneval", "judge/cnn", "judge/pref"))
    assert (exp_dir / "profiles.png").exists() and (exp_dir / "W_final.png").exists()
    # once setting B has run too, each report adds the counts over both settings' cells (here B's file is A's copy)
    assert "Summary over both settings" not in table
    tally = json.loads((exp_dir / "summary.json").read_text())
    (tmp_path / "recast-protocol-B").mkdir()
    (tmp_path / "recast-protocol-B" / "summary.json").write_text(json.dumps(tally))
    bench.main(["recast-protocol", "--quick", "--tables-only", "--out", str(tmp_path)])
    both = (exp_dir / "table.md").read_text().split("Summary over both settings")[1]
    n, sig, cells, planned = tally["recast | nft | judge/cnn"]
    assert (
        planned == 1 and f"ReCAST improves judge cnn over nft in {2 * n} of 2 cells (significant in {2 * sig})" in both
    )


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
    assert once.startswith(head + "<!-- BEGIN nft-steps -->\n`python bench.py nft-steps --quick --tables-only` (2 runs")
    assert once.endswith("\n<!-- END nft-steps -->" + tail) and "old table" not in once
    assert "\n# nft-steps" not in once and "](results/nft-steps/eval_vs_iteration.png)" in once
    bench.main(argv)
    assert md.read_text() == once
    md.write_text("# Results\n")  # no block yet: appended at the end
    bench.main(argv)
    assert md.read_text() == "# Results\n\n" + once[len(head) : -len(tail)] + "\n"
