"""Runs and evaluations never lose work (issue 47) and the first run reads right (issue 44 §3): each fault injected
on the tiny pipeline of conftest.py, the files of the run folder compared before and after (their bytes: `snapshot`).
Run: python -m pytest -q tests/test_robustness.py
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import matplotlib.figure
import numpy as np
import pytest
import torch
import yaml

import evaluate
import recast
import recast_controls
import rvge
from conftest import TINY_REWARDS, copy_of, read_metrics, snapshot, tiny_argv
from kit import figures, folders


@pytest.fixture(scope="module")
def evaluated_run(tiny, tmp_path_factory):
    """A finished 2-iteration recast run that evaluates at every iteration (iteration 0's line holds eval_before/*
    and eval/*) and checkpoints both; tests copy it."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "1", "--save-every", "1")
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
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
    figures.plot_run(tmp_path, ["a"])
    held_out = {label: (xs, ys) for title, label, xs, ys in drawn["rewards"] if title.startswith("held-out rewards")}
    assert held_out == {"a": ([0, 1], [0.1, 0.9]), "weighted": ([0, 1], [0.1, 0.9])}  # x: iterations trained


def test_evaluate_base_compares_with_eval_before_when_iteration_0_also_evaluated(evaluated_run, tmp_path, capsys):
    """evaluate.py --base's "run logged" column is the pretrained model's eval_before/*, not iteration 0's eval/*
    (which share its metrics line when the first iteration evaluates; set apart here so they cannot round alike)."""
    out = copy_of(evaluated_run, tmp_path)
    row, *rest = read_metrics(out)
    assert "eval/weighted" in row and "eval_before/weighted" in row
    row |= {k: 9.0 for k in row if k.startswith("eval/")}  # iteration 0's evaluation, far from the pretrained one
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [row, *rest]))
    before = snapshot(out)
    base = evaluate.main([str(out), "--base", "--json", str(tmp_path / "base.json")], extra_rewards=TINY_REWARDS)
    printed = capsys.readouterr().out
    for key, value in base.items():
        logged = row[key.replace("eval/", "eval_before/")]
        assert re.search(rf"^{re.escape(key)} +{value:.4f} +{logged:.4f}$", printed, re.M), (key, printed)
    assert base == pytest.approx({k.replace("eval_before/", "eval/"): v for k, v in row.items() if "eval_before/" in k})
    assert snapshot(out) == before


def test_evaluate_base_needs_no_checkpoint_and_without_base_says_to_use_it(evaluated_run, tmp_path):
    """evaluate.py RUN --base on a run that has no checkpoint yet evaluates the pretrained model on the run's settings
    (it was refused with a message telling the user to give --base, which they had given); without --base the refusal
    names --base."""
    out = copy_of(evaluated_run, tmp_path)
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(SystemExit, match="no checkpoint yet; evaluate the pretrained model with --base"):
        evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    base = evaluate.main([str(out), "--base", "--json", str(tmp_path / "base.json")], extra_rewards=TINY_REWARDS)
    assert base and all(np.isfinite(v) for v in base.values())


# -----------------------------------------------------------------------------
# issue 47: --overwrite leaves nothing of the replaced run, and sets aside what was not its own
# -----------------------------------------------------------------------------


def test_overwrite_leaves_nothing_that_predates_the_new_run_and_sets_the_rest_aside(tiny, evaluated_run, tmp_path):
    """evaluate.py's results of the replaced run, a user's notes, folders and *.tmp files: moved, bytes intact, to
    <out>.set-aside (a second --overwrite: .set-aside-2); the run's own files are deleted; every file left in the
    folder was written by the new run."""
    out = copy_of(evaluated_run, tmp_path)
    evaluate.main([str(out)], extra_rewards=TINY_REWARDS)  # eval-iter_000001.json and .png of the replaced run
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
    assert {name.split("/")[0] for name in snapshot(out)} <= set(folders.RUN_OWN)
    assert all(p.stat().st_mtime_ns >= started for p in out.rglob("*") if p.is_file() and p.name != ".lock")
    (out / "eval-base.json").write_text("{}")
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert snapshot(tmp_path / "run.set-aside-2") == {"eval-base.json": b"{}"}
    assert snapshot(tmp_path / "run.set-aside") == foreign


# -----------------------------------------------------------------------------
# issue 47: evaluate.py's result path, checked before any model loads
# -----------------------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """load_run fails the test: what is refused must be refused before any model loads."""

    def load_run(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    for module in (recast, rvge):  # each script calls the kit's load_run by the name it imported
        monkeypatch.setattr(module, "load_run", load_run)


@pytest.mark.parametrize(
    "where, words",
    [
        ("metrics.jsonl", "give a path ending in .json"),
        ("config.json", "is not one of evaluate.py's results"),
        ("checkpoints/eval-x.json", "is not one of evaluate.py's results"),
        ("samples.png", "give a path ending in .json"),
        ("../x.png", "give a path ending in .json"),  # the PNG would be written over the JSON
        ("../missing/x.json", "the folder"),
        ("../taken.json", "exists (an earlier evaluation?). Give --replace"),
        ("../taken.png", "give a path ending in .json"),
        ("../samples.json", "samples.png exists"),  # the .png beside it is taken
    ],
)
def test_evaluate_refuses_a_result_path_that_would_replace_a_file(evaluated_run, tmp_path, no_model, where, words):
    out = copy_of(evaluated_run, tmp_path)
    (tmp_path / "taken.json").write_text("mine")
    (tmp_path / "taken.png").write_text("mine")
    (tmp_path / "samples.png").write_text("mine")
    before, around = snapshot(out), snapshot(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(words)):
        evaluate.main([str(out), "--json", str(out / where)], extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before and snapshot(tmp_path) == around
    assert not (tmp_path / "missing").exists()


def test_evaluate_writes_over_an_earlier_result_only_with_replace(evaluated_run, tmp_path, capsys):
    """The default result file, there from an earlier evaluation (perhaps with other settings), is refused before the
    model loads; --replace writes it again and says so."""
    out = copy_of(evaluated_run, tmp_path)
    (out / "eval-iter_000001.json").write_text("earlier")
    before = snapshot(out)
    with pytest.raises(SystemExit, match=r"eval-iter_000001.json exists .*Give --replace"):
        evaluate.main([str(out), "--eval-steps", "3"], extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    evaluate.main([str(out), "--replace"], extra_rewards=TINY_REWARDS)
    assert "(replacing the earlier result: --replace)" in capsys.readouterr().out
    assert json.loads((out / "eval-iter_000001.json").read_text())["checkpoint"] == "iter_000001"
    assert {k for k in snapshot(out) if snapshot(out)[k] != before.get(k)} == {
        "eval-iter_000001.json",
        "eval-iter_000001.png",
    }


# -----------------------------------------------------------------------------
# issue 47: evaluate.py's checkpoint: the newest loadable one, a training run's rotation, another run's
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_evaluate_falls_back_to_the_newest_loadable_checkpoint_and_says_so(evaluated_run, tmp_path, capsys, damage):
    """The newest checkpoint truncated, or `latest` naming one that is gone: evaluate.py evaluates the newest one that
    loads, as --resume would, says which, and its numbers are what the run logged at that iteration."""
    out = copy_of(evaluated_run, tmp_path)
    newest = out / "checkpoints" / "iter_000001"
    if damage == "truncated":
        (newest / "state.pt").write_bytes((newest / "state.pt").read_bytes()[:1000])
    else:
        shutil.rmtree(newest)
    before = snapshot(out)
    got = evaluate.main([str(out), "--json", str(tmp_path / "e.json")], extra_rewards=TINY_REWARDS)
    printed = capsys.readouterr().out
    assert f"evaluating iter_000000, the newest loadable checkpoint of {out}" in printed
    assert got == {k: v for k, v in read_metrics(out)[0].items() if k.startswith("eval/")}
    assert json.loads((tmp_path / "e.json").read_text())["checkpoint"] == "iter_000000"
    assert snapshot(out) == before


def test_evaluate_reads_a_training_runs_checkpoint_while_rotation_deletes_it(evaluated_run, tmp_path, monkeypatch):
    """A run still training saves iter_2 and iter_3 between evaluate.py reading `latest` (iter_1) and loading it, and
    its rotation deletes iter_0 and iter_1: evaluate.py looks again and takes iter_3."""
    out = copy_of(evaluated_run, tmp_path)
    root, load = out / "checkpoints", torch.load

    def rotated_meanwhile(path, **kwargs):
        if not (root / "iter_000003").exists():
            shutil.copytree(root / "iter_000001", root / "iter_000003")
            (root / "latest").write_text("iter_000003")
            shutil.rmtree(root / "iter_000000")
            shutil.rmtree(root / "iter_000001")
        return load(path, **kwargs)

    monkeypatch.setattr(torch, "load", rotated_meanwhile)
    ckpt, state = evaluate.read_checkpoint(out)
    assert ckpt == root / "iter_000003" and state["iteration"] == 1


def test_checkpoints_record_their_run_and_evaluate_refuses_another_runs(evaluated_run, tmp_path, no_model):
    """state.pt records the run id and script of config.json (a resume keeps the id); evaluate.py refuses a
    checkpoint whose record is another run's, before the model loads; a checkpoint older than the record loads."""
    out = copy_of(evaluated_run, tmp_path)
    config = json.loads((out / "config.json").read_text())
    state = torch.load(out / "checkpoints" / "iter_000001" / "state.pt", weights_only=False)
    assert len(config["run_id"]) == 32 and state["run"] == {"run_id": config["run_id"], "script": "recast"}
    (out / "config.json").write_text(json.dumps({**config, "run_id": "another"}))  # iter_N came from another run
    before = snapshot(out)
    with pytest.raises(SystemExit, match=r"was written by another run \(recast.py, run [0-9a-f]{32}\), not by"):
        evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    state.pop("run")  # a checkpoint that predates the record: evaluated as the run's
    torch.save(state, out / "checkpoints" / "iter_000001" / "state.pt")
    assert evaluate.read_checkpoint(out)[0].name == "iter_000001"


def test_resume_keeps_the_run_id_in_config_and_new_checkpoints(evaluated_run, tmp_path):
    out = copy_of(evaluated_run, tmp_path)
    run_id = json.loads((out / "config.json").read_text())["run_id"]
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert json.loads((out / "config.json").read_text())["run_id"] == run_id
    state = torch.load(out / "checkpoints" / "iter_000002" / "state.pt", weights_only=False)
    assert state["run"] == {"run_id": run_id, "script": "recast"}


def test_evaluate_names_a_damaged_config_and_the_flags_it_does_not_take(evaluated_run, tmp_path, no_model):
    out = copy_of(evaluated_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit) as err:  # the tiny run's rewards are not known without extra_rewards
        evaluate.main([str(out)])
    assert "Fix --rewards" in str(err.value)
    assert f"(evaluate.py: --rewards is the run's setting, from {out}/config.json; evaluate.py takes only" in str(
        err.value
    )
    (out / "config.json").write_text('{"args": {')
    for given in (out, out / "checkpoints" / "iter_000001"):
        with pytest.raises(SystemExit, match=re.escape(f"{out / 'config.json'} is damaged")):
            evaluate.main([str(given)], extra_rewards=TINY_REWARDS)
    assert snapshot(out) == {**before, "config.json": b'{"args": {'}


# -----------------------------------------------------------------------------
# issue 47: a launcher's variables left in a plain shell
# -----------------------------------------------------------------------------

LAUNCH = """
import sys
from dataclasses import asdict
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from kit import figures, folders
folders.LAUNCH_WAIT_S, folders.WAIT_NOTICE_S = 4, 1
print("processes", folders.process_state(SimpleNamespace(device="cpu")).num_processes)
"""


def start_processes(env):
    """process_state in a fresh python with the launcher's variables `env` (and no others): (exit code, stdout,
    stderr)."""
    clean = {k: v for k, v in os.environ.items() if k not in (*folders.LAUNCH_VARIABLES, "MASTER_ADDR", "MASTER_PORT")}
    code = LAUNCH.format(root=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout, done.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_launchers_single_process_values_run_as_one_process():
    rc, out, err = start_processes({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert rc == 0 and out.strip() == "processes 1", err[-2000:]
    assert (
        "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 (a launcher's variables, without MASTER_ADDR/MASTER_PORT): one process" in err
    )


def test_a_process_waiting_for_its_peers_says_so_and_gives_up_after_the_stated_time():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    started = time.monotonic()
    rc, out, err = start_processes(env)
    assert rc == 1 and time.monotonic() - started < 60
    assert "process 1 of 2: waiting for the other processes at 127.0.0.1:" in err and "(gives up after 4 s)" in err
    assert err.strip().splitlines()[-1].startswith("process 1 of 2: the other processes did not join at 127.0.0.1:")
    assert "within 4 s" in err and "accelerate launch --num_processes 2" in err


@pytest.mark.parametrize(
    "env, words",
    [
        ({"LOCAL_RANK": "abc"}, "launcher variables LOCAL_RANK=abc: LOCAL_RANK is not a whole number"),
        ({"WORLD_SIZE": "2"}, "launcher variables WORLD_SIZE=2: RANK is not set"),
        ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK 1 is not below WORLD_SIZE 1"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "MASTER_ADDR and MASTER_PORT are not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "LOCAL_RANK 3"),
    ],
)
def test_a_launchers_inconsistent_values_are_refused_in_one_line_before_anything_is_written(
    tiny, tmp_path, monkeypatch, env, words
):
    for k in (*folders.LAUNCH_VARIABLES, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as err:
        recast.validate(recast.parse_args(tiny_argv(tiny, tmp_path / "run")), extra_rewards=TINY_REWARDS)
    message = str(err.value)
    assert words in message and "\n" not in message and not (tmp_path / "run").exists()
    assert "accelerate launch --num_processes N" in message and "or unset " in message


# -----------------------------------------------------------------------------
# issue 47: --config files
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("c.yaml", "lr: 1.0\nseed: 2\nlr: 2.0\n", "the key 'lr' is given twice; keep one"),
        ("c.json", '{"lr": 1.0, "lr": 2.0}', "the key 'lr' is given twice; keep one"),
        ("c.yaml", "n-roots: 3\nn_roots: 4\n", "'n-roots' and 'n_roots' name the same flag; keep one of them"),
        ("c.json", '{"n_roots": 3, "n-roots": 4}', "'n_roots' and 'n-roots' name the same flag"),
        ("c.yaml", "out: runs/x\noverwrite: true\n", "overwrite is not taken from a file"),
    ],
)
def test_a_config_file_that_says_a_flag_twice_or_overwrites_is_refused(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as err:
        recast.parse_args(["--config", str(tmp_path / name)])
    assert str(err.value).startswith(f"--config {tmp_path / name}: ") and words in str(err.value)


@pytest.mark.parametrize("name, text", [("c.json", '{"seed": 5, "n-roots": 3}'), ("c.yaml", "seed: 5\nn-roots: 3\n")])
def test_a_config_file_with_a_byte_order_mark_reads_as_without(tmp_path, name, text):
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert recast.parse_args(["--config", str(tmp_path / name)]) == recast.parse_args(["--seed", "5", "--n-roots", "3"])


# -----------------------------------------------------------------------------
# issue 47: what a run is does not change on --resume
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "more, words",
    [
        (["--credit", "nft"], "--credit: saved 'recast', given 'nft'"),
        (["--column-units", "gradient"], "--column-units: saved 'loss', given 'gradient'"),
        (["--permute-rewards", "redness"], "--permute-rewards: saved '', given 'redness'"),
    ],
)
def test_resume_refuses_a_change_of_method_or_control(evaluated_run, tmp_path, more, words):
    """config.json records one --credit, --column-units and --permute-rewards for the whole run: a resume that
    changes one is refused before anything is written."""
    out = copy_of(evaluated_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(
        SystemExit, match=re.escape(words) + r".*cannot change on resume|cannot change.*" + re.escape(words)
    ):
        recast.parse_args(["--resume", str(out), "--iterations", "3", *more])
    assert snapshot(out) == before


def test_resume_takes_the_same_permuted_rewards_in_another_order_and_flags_a_config_predates(evaluated_run, tmp_path):
    out = copy_of(evaluated_run, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["args"]["permute_rewards"] = "brightness,redness"
    del config["args"]["column_units"]  # a run from before the flag: it ran with the default
    (out / "config.json").write_text(json.dumps(config))
    args = recast.parse_args(
        ["--resume", str(out), "--permute-rewards", " redness , brightness", "--column-units", "loss"]
    )
    assert args.permute_rewards == " redness , brightness" and args.column_units == "loss"


def test_permute_rewards_that_names_no_reward_is_warned(tiny, tmp_path, capsys):
    args = recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--permute-rewards", " , "))
    recast.validate(args, extra_rewards=TINY_REWARDS)
    assert "--permute-rewards ' , ' names no reward: nothing is permuted" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# issue 44 §3: figures and the closing lines
# -----------------------------------------------------------------------------


def test_each_judge_has_an_axis_of_its_own(tmp_path, monkeypatch):
    """The CNN judge (0-1) and Fréchet (hundreds) are drawn on separate axes, neither on a log scale."""
    rows = [
        {"iteration": i, "reward/a": 0.5, "reward/weighted": 0.5, "eval/a": 0.5, "eval/weighted": 0.5}
        | {"eval/judge/cnn": 0.7 - 0.01 * i, "eval/judge/frechet": 120.0 + 500 * i}
        for i in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    drawn = drawn_lines(monkeypatch)
    figures.plot_run(tmp_path, ["a"])
    judged = {title: (label, ys) for title, label, _, ys in drawn["rewards"] if title.startswith("held-out judge")}
    assert judged == {
        "held-out judge cnn (eval/judge/cnn)": ("cnn", pytest.approx([0.7, 0.69, 0.68])),
        "held-out judge frechet (eval/judge/frechet)": ("frechet", [120.0, 620.0, 1120.0]),
    }


@pytest.mark.parametrize("credit, drawn", [("nft", False), ("uniform", True), ("recast_reversed", True)])
def test_credit_figure_is_drawn_only_where_W_weighs_the_loss(evaluated_run, tmp_path, credit, drawn):
    out = copy_of(evaluated_run, tmp_path)
    (out / "credit.png").unlink()
    config = json.loads((out / "config.json").read_text())
    config["args"]["credit"] = credit
    (out / "config.json").write_text(json.dumps(config))
    args = recast.parse_args(["--credit", credit])
    assert ((out / "credit.png") in figures.plot_run(out, ["brightness", "redness"], recast.shows_W(args))) == drawn
    assert (out / "credit.png").exists() == drawn


@pytest.mark.parametrize("credit", ["recast", "nft"])
def test_the_trackers_W_image_is_the_credit_figures_named_panel_and_none_for_nft(tiny, tmp_path, credit):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = tiny_argv(tiny, out, "--iterations", "1", "--credit", credit, "--report-to", "tensorboard")
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    images = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload().Tags()["images"]
    assert ("recast/W" in images) == ("figures/credit" in images) == (credit == "recast")
    fig = figures.W_figure(np.asarray(read_metrics(out)[0]["recast/W"]), ["brightness", "redness"])
    (ax, _) = fig.axes  # the heatmap and its colour bar
    assert [t.get_text() for t in ax.get_yticklabels()] == ["brightness", "redness"]
    assert ax.get_title() == "W / uniform share (1: uniform)" and ax.get_xlabel() == "step j (t = sigma_j)"


def test_the_sampling_line_uses_the_runs_settings_not_the_pipelines_defaults():
    """SD3.5-M's recipe: no CFG, its 40 evaluation steps, DiffusionNFT's 128 T5 tokens, 512 px; the embedded model's
    defaults: shapes_world.GEN_KWARGS, said."""
    import world as shapes_world

    sd35m = asdict(
        recast.parse_args(["--config", str(Path(__file__).resolve().parents[1] / "configs/recast-sd35m.yaml")])
    )
    line = figures.sampling_line(sd35m, embedded=False)
    assert "num_inference_steps=40, guidance_scale=1.0, max_sequence_length=128" in line and "height=512" in line
    assert line.endswith("# as trained and evaluated: no CFG, 40 steps, 128 T5 tokens, 512 px")
    line = figures.sampling_line(asdict(recast.Args()), embedded=True)
    kwargs = ", ".join(f"{k}={v}" for k, v in shapes_world.GEN_KWARGS.items())
    assert f"{kwargs}).images[0]  # as trained and evaluated (the world's GEN_KWARGS): no CFG, 10 steps" in line


# -----------------------------------------------------------------------------
# issue 64: runs never train on settings they did not start with (round 5)
# -----------------------------------------------------------------------------


def write_credit_file(path, W):
    path.write_text(json.dumps({"rewards": ["brightness", "redness"], "W": np.asarray(W).tolist()}))


def recorded_W(monkeypatch):
    """[W (K, T)] of each iteration's update from now on; the update itself is skipped (its losses zero)."""
    got = []

    def record(run, b, r_train, W_train, args, gen, on_step):
        got.append(np.asarray(W_train))
        return {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": 0}

    monkeypatch.setattr(recast, "nft_update", record)
    return got


def test_resume_trains_the_credit_files_W_the_run_started_with(tiny, tmp_path, monkeypatch, capsys):
    """A --credit-file edited (still valid), moved or deleted between a run and its --resume: the resumed iterations
    train the W the run started with (recorded in its checkpoints), and a changed file is named; a relative path
    is recorded absolute, so that a resume from another folder finds the same run."""
    T = recast.parse_args(tiny_argv(tiny, tmp_path / "x")).steps
    W0 = np.random.default_rng(0).random((2, T)) + 0.1
    W0 /= W0.sum()  # the budgets' sum, 0.6 + 0.4
    write_credit_file(tmp_path / "W.json", W0)
    got = recorded_W(monkeypatch)
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    argv = tiny_argv(tiny, out, "--iterations", "2", "--save-every", "1", "--eval-every", "0", "--credit", "file")
    recast.train(recast.parse_args([*argv, "--credit-file", "W.json"]), extra_rewards=TINY_REWARDS)
    assert json.loads((out / "config.json").read_text())["args"]["credit_file"] == str(tmp_path / "W.json")
    W1 = np.zeros((2, T))
    W1[0] = 1.0 / T  # rows 1/0: another valid W
    write_credit_file(tmp_path / "W.json", W1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    said = capsys.readouterr()
    assert len(got) == 3 and all(np.array_equal(g, W0) for g in got)
    assert [np.array(m["recast/W"]).tolist() for m in read_metrics(out)] == [W0.tolist()] * 3
    assert "differs from the W the run started with" in said.out + said.err
    (tmp_path / "W.json").unlink()  # gone: the recorded W still trains
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "4"]), extra_rewards=TINY_REWARDS)
    assert len(got) == 4 and np.array_equal(got[3], W0)


def test_a_credit_file_W_with_a_zero_column_trains_and_that_steps_samples_carry_no_policy_gradient(
    tiny, tmp_path, monkeypatch
):
    """A W with an all-zero column ("no weight at these steps"): equal_columns gives those steps the weight 0 and a
    finite equal-column W; the policy loss's gradient of their samples is exactly 0, the others' is not; a run of it
    trains with finite losses."""
    T = recast.parse_args(tiny_argv(tiny, tmp_path / "x")).steps
    W = np.random.default_rng(1).random((2, T)) + 0.1
    W[:, 3] = 0.0
    W /= W.sum()
    omega, W_eq = recast_controls.equal_columns(W)
    assert (
        np.isfinite(omega).all() and np.isfinite(W_eq).all() and omega[3] == 0 and (omega[np.arange(T) != 3] > 0).all()
    )
    assert np.allclose(W_eq.sum(0), W.sum() / T)
    losses = []

    def capture(run, b, args, gen, on_step, policy_loss):  # the policy loss nft_update hands the shared loop
        g = torch.Generator().manual_seed(0)
        N = 2 * T
        nb = SimpleNamespace(i=torch.arange(N) % 2, j=torch.arange(N) % T, s=torch.rand(N, generator=g))
        nb.x0, nb.x_t = torch.randn(N, 4, 2, 2, generator=g), torch.randn(N, 4, 2, 2, generator=g)
        v_theta = torch.randn(N, 4, 2, 2, generator=g, requires_grad=True)
        loss = policy_loss(nb, v_theta, torch.randn(N, 4, 2, 2, generator=g))
        loss.sum().backward()
        losses.append((nb.j, loss.detach(), v_theta.grad.flatten(1).abs().sum(1)))
        return {"loss/policy": 0.0, "loss/base_reg": 0.0, "train/opt_steps": 0, "train/samples": 0}

    r = np.random.default_rng(2).random((2, 2))
    with monkeypatch.context() as m:
        m.setattr(recast.nft, "update_loop", capture)
        recast.nft_update(None, None, r, W, recast.parse_args([]), None, None)
    j, loss, grad = losses[0]
    assert torch.isfinite(loss).all() and (grad[j == 3] == 0).all() and (grad[j != 3] > 0).all()
    write_credit_file(tmp_path / "W.json", W)
    out = tmp_path / "run"
    argv = tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--credit", "file")
    recast.train(recast.parse_args([*argv, "--credit-file", str(tmp_path / "W.json")]), extra_rewards=TINY_REWARDS)
    assert np.isfinite(read_metrics(out)[0]["loss/policy"])


def test_resume_needs_no_gain_init_file_and_a_relative_one_is_recorded_absolute(tiny, tmp_path, monkeypatch):
    """--gain-init seeds iteration 0 only: a resume from a checkpoint trains on without the file (moved, deleted or
    re-measured: its statistics are in the checkpoint), from another folder too; the run records its absolute path."""
    T = recast.parse_args(tiny_argv(tiny, tmp_path / "x")).steps
    s1 = np.ones((2, T + 1))
    saved = {"names": ["brightness", "redness"], "steps": T, "n": [4.0] * (T + 1), "s1": s1.tolist(), "s2": s1.tolist()}
    (tmp_path / "levels.json").write_text(json.dumps(saved))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = tiny_argv(tiny, out, "--iterations", "1", "--save-every", "1", "--eval-every", "0", "--gain-init")
    recast.train(recast.parse_args([*argv, "levels.json"]), extra_rewards=TINY_REWARDS)
    assert json.loads((out / "config.json").read_text())["args"]["gain_init"] == str(tmp_path / "levels.json")
    (tmp_path / "levels.json").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "2"]), extra_rewards=TINY_REWARDS)
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1]
    shutil.rmtree(out / "checkpoints")  # no checkpoint: the resume starts at iteration 0 and reads the file
    (out / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match="has no checkpoint yet, so it starts at iteration 0 .* put it back"):
        recast.train(recast.parse_args(["--resume", str(out), "--iterations", "2"]), extra_rewards=TINY_REWARDS)


CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.mark.parametrize(
    "script, more, words",
    [
        ("recast", ["--budgets", "1,2"], "2 budgets for 4 rewards"),
        ("recast", ["--credit", "file", "--credit-file", "missing.json"], "needs --credit-file, a JSON file"),
        ("recast", ["--gain-init", "missing.json"], "--gain-init .*missing.json: not a readable level-statistics"),
        ("recast", ["--branch-steps", "0,12"], "--branch-steps must lie strictly between"),
        ("rvge", ["--budgets", "1,-1,1,1,1"], "budget 2 is negative"),
    ],
)
def test_dry_run_makes_the_input_checks_that_need_no_model_first(tmp_path, monkeypatch, capsys, script, more, words):
    """--dry-run refuses what the run would refuse before any model loads (budgets, rewards, the method's flags, the
    --credit-file and --gain-init files) before its plan; the recipe's own dry run in a folder without the user's files
    prints its plan, then names the missing prompt files (tests/test_preflight.py: every preflight failure)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing reaches the hub
    monkeypatch.chdir(tmp_path)
    config = str(CONFIGS / f"{script}-sd35m.yaml")
    with pytest.raises(SystemExit, match=words):
        __import__(script).main(["--config", config, "--dry-run", *more])
    assert "memory" not in capsys.readouterr().out.lower()
    with pytest.raises(SystemExit, match=r"(?s)preflight: \d+ problem.*--train-prompts train_prompts.txt: cannot read"):
        __import__(script).main(["--config", config, "--dry-run"])
    assert "memory per GPU" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_a_recipe_names_its_script_and_the_other_script_refuses_it(tmp_path):
    """Every shipped recipe says which script it is for (`script:`); the other script refuses it, naming both; a
    file of flags without the key (the user's own) is read as before."""
    for recipe in sorted(CONFIGS.glob("*.yaml")):
        own = recipe.name.split("-")[0] if recipe.name.startswith("rvge") else "recast"
        other = "recast" if own == "rvge" else "rvge"
        assert yaml.safe_load(recipe.read_text()).get("script") == own, recipe.name
        with pytest.raises(SystemExit, match=f"a recipe for {own}.py .*give it to {own}.py"):
            __import__(other).parse_args(["--config", str(recipe)])
    (tmp_path / "c.yaml").write_text("script: nowhere\nseed: 3\n")
    with pytest.raises(SystemExit, match="script 'nowhere' is not a training script here"):
        recast.parse_args(["--config", str(tmp_path / "c.yaml")])
    (tmp_path / "c.yaml").write_text("seed: 3\n")
    assert recast.parse_args(["--config", str(tmp_path / "c.yaml")]).seed == 3


def test_resume_with_fewer_iterations_than_trained_is_refused_and_changes_nothing(evaluated_run, tmp_path, capsys):
    """--resume RUN --iterations 1 of a run that trained 2: refused before any file changes (config.json would say 1
    while metrics.jsonl holds 2 lines), naming what was trained and the fix; --iterations 2 (as many as trained) says
    that nothing is left to train."""
    out = copy_of(evaluated_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit, match="trained 2 iterations .* --iterations 1 .* Give --iterations 3 or more"):
        recast.train(recast.parse_args(["--resume", str(out), "--iterations", "1"]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    capsys.readouterr()
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "2"]), extra_rewards=TINY_REWARDS)
    said = capsys.readouterr()
    assert "nothing is left to train" in said.out + said.err
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1]


def test_resume_names_the_rewards_an_empty_saved_rewards_stands_for(tmp_path):
    """--resume with --rewards of a run saved with --rewards '' (the embedded world's defaults): the refusal says which
    rewards '' stands for."""
    (tmp_path / "run").mkdir()
    saved = {"args": {**asdict(recast.parse_args([])), "rewards": ""}, "script": "recast"}
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match=re.escape("saved '' (the default: geneval,grain,detail,shape), given 'g")):
        recast.parse_args(["--resume", str(tmp_path / "run"), "--rewards", "geneval,grain"])


def test_a_negative_budget_after_a_space_and_rewards_that_name_none_are_named(capsys):
    """--budgets -0.1,1.1,0,0 (a value that starts with a dash) reads as --budgets=-0.1,... does: the budgets' own
    message, not argparse's "expected one argument"; --rewards ',' names no reward and is refused, not trained as
    the defaults."""
    for script in (recast, rvge):
        args = script.parse_args(["--budgets", "-0.1,1.1,0,0"])
        assert args.budgets == "-0.1,1.1,0,0"
        with pytest.raises(SystemExit, match="budget 1 is negative"):
            script.main(["--budgets", "-0.1,1.1,0,0", "--dry-run"])
        with pytest.raises(SystemExit, match="--rewards ',' names no reward"):
            script.main(["--rewards", ",", "--budgets", "1", "--dry-run"])
    with pytest.raises(SystemExit):  # a flag where a value belongs is still argparse's error
        recast.parse_args(["--out", "--seed", "1"])
    assert "expected one argument" in capsys.readouterr().err


def test_the_closing_lines_are_valid_python_for_a_folder_with_a_quote(evaluated_run, tmp_path, capsys):
    """The closing line that loads the trained LoRA is Python that names the folder exactly, whatever its name holds
    (a double quote, a backslash); an ordinary folder reads as before, in double quotes."""
    import ast

    out = copy_of(evaluated_run, tmp_path, 'l4 "q" \\run')
    line = next(x for x in figures.print_summary(out) if "load_lora_adapter" in x)
    calls = [n for n in ast.walk(ast.parse(line.strip())) if isinstance(n, ast.Call)]
    named = {n.func.attr: n.args[0].value for n in calls if isinstance(n.func, ast.Attribute) and n.args}
    assert named["load_lora_adapter"] == str(out / "checkpoints" / "iter_000001")
    plain = next(x for x in figures.print_summary(evaluated_run.out) if "load_lora_adapter" in x)
    assert f'load_lora_adapter("{evaluated_run.out / "checkpoints" / "iter_000001"}"' in plain


def test_a_credit_file_whose_rewards_is_a_string_and_credit_file_without_a_file_are_named(tmp_path):
    """--credit-file with "rewards": "brightness,redness" (a string): named as such, not as a list of characters;
    --credit file without --credit-file says that none was given, not that `.` is not one."""
    path = tmp_path / "W.json"
    path.write_text(json.dumps({"rewards": "brightness,redness", "W": (np.ones((2, 10)) / 20).tolist()}))
    with pytest.raises(SystemExit) as err:
        recast_controls.read_credit_file(str(path), ["brightness", "redness"], 10, [0.6, 0.4])
    assert "rewards is 'brightness,redness', not a list of names" in str(err.value) and "['b'" not in str(err.value)
    with pytest.raises(SystemExit) as err:
        recast_controls.read_credit_file("", ["brightness", "redness"], 10, [0.6, 0.4])
    assert "none was given" in str(err.value) and " . " not in str(err.value) and ". is not" not in str(err.value)


def test_two_evaluations_of_one_checkpoint_never_write_over_each_other(evaluated_run, tmp_path, monkeypatch):
    """Two evaluate.py of one checkpoint at once, both past the check that the result is new: the second to start is
    refused before its model loads (the first holds <result>.lock); one whose result another wrote meanwhile is
    refused at the write, the other's result kept (exclusive create), and neither leaves a .tmp or .lock behind."""
    import fcntl

    from kit import session

    out = copy_of(evaluated_run, tmp_path)
    result = out / "eval-iter_000001.json"
    with open(out / "eval-iter_000001.json.lock", "w") as held:  # another evaluate.py at work on the same result
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="another evaluate.py is writing .*eval-iter_000001.json"):
            evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    (out / "eval-iter_000001.json.lock").unlink()
    real = session.evaluate

    def the_other_finishes_first(*args, **kwargs):
        done = real(*args, **kwargs)
        result.write_text("the other's")
        return done

    monkeypatch.setattr(session, "evaluate", the_other_finishes_first)
    with pytest.raises(SystemExit, match="written meanwhile"):
        evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    assert result.read_text() == "the other's"
    assert not [p.name for p in out.iterdir() if p.name.endswith((".tmp", ".json.lock"))]
