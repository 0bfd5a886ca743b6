"""Runs and evaluations never lose work (issue 47) and the first run reads right (issue 44 §3): each fault injected
on the tiny pipeline of conftest.py, the files of the run folder compared before and after (their bytes: `snapshot`).
Run: python -m pytest -q tests/test_robustness.py
"""

import json
import re
import time
from types import SimpleNamespace

import matplotlib.figure
import pytest

import evaluate
import recast
from conftest import TINY_REWARDS, copy_of, read_metrics, snapshot, tiny_argv
from kit import run_kit


@pytest.fixture(scope="module")
def evaluated_run(tiny, tmp_path_factory):
    """A finished 1-iteration recast run whose only iteration also evaluates (eval_before/* and eval/* on one line),
    with its checkpoint; tests copy it."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    recast.train(recast.parse_args(tiny_argv(tiny, out, "--iterations", "1")), extra_rewards=TINY_REWARDS)
    return SimpleNamespace(out=out)


def drawn_lines(monkeypatch):
    """{figure file stem: [(panel title, line label, xs, ys)]} of every figure plot_run saves from now on."""
    drawn = {}
    savefig = matplotlib.figure.Figure.savefig

    def record(fig, path, **kwargs):
        stem = re.sub(r"\.png(\.tmp)?$", "", str(path)).rsplit("/", 1)[-1]
        drawn[stem] = [
            (ax.get_title(), line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
            for ax in fig.axes
            for line in ax.lines
        ]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return drawn


# -----------------------------------------------------------------------------
# issue 44 §3: the first iteration's evaluation is not the pretrained model's
# -----------------------------------------------------------------------------


def test_rewards_figure_plots_the_pretrained_point_from_eval_before_only(tmp_path, monkeypatch):
    """Iteration 0's line holds eval_before/* (the pretrained model) and, when it also evaluates, eval/* (after its
    update): the pretrained point is eval_before/*, iteration 0's evaluation the next point."""
    row = {"iteration": 0, "reward/a": 0.5, "reward/weighted": 0.5}
    row |= {"eval_before/a": 0.1, "eval_before/weighted": 0.1, "eval/a": 0.9, "eval/weighted": 0.9}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    drawn = drawn_lines(monkeypatch)
    run_kit.plot_run(tmp_path, ["a"])
    held_out = {label: ys for title, label, _, ys in drawn["rewards"] if title.startswith("held-out rewards")}
    assert held_out == {"a": [0.1, 0.9], "weighted": [0.1, 0.9]}


def test_evaluate_base_compares_with_eval_before_when_iteration_0_also_evaluated(evaluated_run, tmp_path, capsys):
    """evaluate.py --base's "run logged" column is the pretrained model's eval_before/*, not iteration 0's eval/*
    (which share its metrics line when the first iteration evaluates; set apart here so they cannot round alike)."""
    out = copy_of(evaluated_run, tmp_path)
    (row,) = read_metrics(out)
    assert "eval/weighted" in row and "eval_before/weighted" in row
    row |= {k: 9.0 for k in row if k.startswith("eval/")}  # iteration 0's evaluation, far from the pretrained one
    (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    before = snapshot(out)
    base = evaluate.main([str(out), "--base", "--json", str(tmp_path / "base.json")], extra_rewards=TINY_REWARDS)
    printed = capsys.readouterr().out
    for key, value in base.items():
        logged = row[key.replace("eval/", "eval_before/")]
        assert re.search(rf"^{re.escape(key)} +{value:.4f} +{logged:.4f}$", printed, re.M), (key, printed)
    assert base == pytest.approx({k.replace("eval_before/", "eval/"): v for k, v in row.items() if "eval_before/" in k})
    assert snapshot(out) == before


# -----------------------------------------------------------------------------
# issue 47: --overwrite leaves nothing of the replaced run, and sets aside what was not its own
# -----------------------------------------------------------------------------


def test_overwrite_leaves_nothing_that_predates_the_new_run_and_sets_the_rest_aside(tiny, evaluated_run, tmp_path):
    """evaluate.py's results of the replaced run, a user's notes, folders and *.tmp files: moved, bytes intact, to
    <out>.set-aside (a second --overwrite: .set-aside-2); the run's own files are deleted; every file left in the
    folder was written by the new run."""
    out = copy_of(evaluated_run, tmp_path)
    evaluate.main([str(out)], extra_rewards=TINY_REWARDS)  # eval-iter_000000.json and .png of the replaced run
    (out / "notes.txt").write_text("mine")
    (out / "drafts" / "deep").mkdir(parents=True)
    (out / "drafts" / "deep" / "x.tmp").write_text("mine too")
    (out / "config.json.tmp").write_text("{")  # a kill's half-written config: the program's own, deleted
    before = snapshot(out)
    foreign = {k: v for k, v in before.items() if k.startswith(("eval-", "notes", "drafts"))}
    assert len(foreign) == 4
    argv = tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--overwrite")
    started = time.time_ns()
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert snapshot(tmp_path / "run.set-aside") == foreign
    assert {name.split("/")[0] for name in snapshot(out)} <= set(run_kit.RUN_OWN)
    assert all(p.stat().st_mtime_ns >= started for p in out.rglob("*") if p.is_file() and p.name != ".lock")
    (out / "eval-base.json").write_text("{}")
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert snapshot(tmp_path / "run.set-aside-2") == {"eval-base.json": b"{}"}
    assert snapshot(tmp_path / "run.set-aside") == foreign
