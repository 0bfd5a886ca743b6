"""What a run logs beside its metrics file: optimizer steps beside iterations, DiffusionNFT's diagnostics (the reward
spread within prompt groups, the share of groups without spread, the drift to the old policy, rollout images), the
W&B run that a resume continues, and the optional extras' install lines. (The printed lines that load a trained LoRA:
test_run_kit.py's closing-summary test.)
Run: python -m pytest -q tests/test_logging.py
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import nft
import recast
import rvge
from conftest import TINY_REWARDS, read_metrics, tiny_argv
from kit import figures, reward_models, session

REPO = Path(__file__).resolve().parents[1]


# -----------------------------------------------------------------------------
# DiffusionNFT's diagnostics
# -----------------------------------------------------------------------------


def test_group_spread_counts_ties_and_spread_per_group_and_column():
    """Hand-computed: per column, the numpy std of each group's finite rewards summed, the groups whose finite rewards
    all tie, the groups with any finite reward. A group of three equal 0.7s ties although its numpy std is not 0
    (DiffusionNFT's `std == 0` would miss it); a group with no finite reward is not counted."""
    R = np.array([[1, 0], [1, 1], [2, np.nan], [4, np.nan], [3, 3], [0.7, 2], [0.7, 2], [0.7, 2]])
    groups = np.array([5, 5, 1, 1, 2, 7, 7, 7])
    spread, tied, counted = session.group_spread(R, groups)
    assert np.std([0.7, 0.7, 0.7]) > 0  # the case max = min catches
    np.testing.assert_allclose(spread, [1.0 + np.std([0.7] * 3), 0.5])  # column 0: group 1's std 1; column 1: 0.5
    assert tied.tolist() == [3, 2]  # column 0: groups 5, 2 (one image), 7; column 1: groups 2 and 7
    assert counted.tolist() == [4, 3]  # column 1: group 1 has no finite reward


def test_a_run_logs_optimizer_steps_spread_drift_and_rollout_images(tiny, tmp_path, monkeypatch):
    """metrics.jsonl: train/optimizer_step, the optimizer steps so far (the cumulative train/opt_steps); per reward and
    for the weighted raw sum, reward_spread/* and reward_zero_spread/* as recomputed by hand from the iteration's
    rollouts; train/old_deviate, the mean |v_theta - v_old|^2, equal to loss/base_reg when the base term is off (v_base
    is then v_old). TensorBoard: the same numbers, and rollout/samples every --log-rollouts-every iterations: a grid
    of the first 15 rollouts."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rollouts = tmp_path / "run", []
    rollout_and_score = nft.rollout_and_score
    monkeypatch.setattr(
        nft, "rollout_and_score", lambda *a, **k: rollouts.append(rollout_and_score(*a, **k)) or rollouts[-1]
    )
    more = ["--iterations", "3", "--eval-every", "0", "--report-to", "tensorboard", "--log-rollouts-every", "2"]
    more += ["--base-reg", "0", "--updates-per-iter", "2", "--train-steps-per-leaf", "1"]
    recast.train(recast.parse_args(tiny_argv(tiny, out, *more)), extra_rewards=TINY_REWARDS)
    rows = read_metrics(out)
    assert [m["train/optimizer_step"] for m in rows] == np.cumsum([m["train/opt_steps"] for m in rows]).tolist()
    assert [m["train/optimizer_step"] for m in rows] == [2, 4, 6]
    budgets = [0.6, 0.4]
    for m, b in zip(rows, rollouts):
        columns = {"brightness": b.R[:, 0], "redness": b.R[:, 1], "weighted": b.R @ budgets}
        for name, values in columns.items():
            per_group = [values[b.groups == g] for g in np.unique(b.groups)]
            assert m[f"reward_spread/{name}"] == pytest.approx(np.mean([v.std() for v in per_group]), rel=1e-12)
            assert m[f"reward_zero_spread/{name}"] == np.mean([v.max() == v.min() for v in per_group])
        assert m["train/old_deviate"] == pytest.approx(m["loss/base_reg"], rel=1e-12) and m["train/old_deviate"] > 0
    assert any(m["reward_spread/brightness"] > 0 for m in rows)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert [e.value for e in events.Scalars("train/optimizer_step")] == [2, 4, 6]
    assert [e.value for e in events.Scalars("reward_zero_spread/weighted")] == [
        m["reward_zero_spread/weighted"] for m in rows
    ]
    shown = events.Images("rollout/samples")
    assert [i.step for i in shown] == [0, 2]  # iterations 0 and 2 of 0, 1, 2
    assert len(rollouts[0].leaves) >= 15 and shown[0].width == 5 * 128  # 15 of 16 rollouts, 5 a row, 128 px cells


def test_the_drift_to_the_old_policy_is_not_the_base_term_when_the_base_term_is_on(tiny, tmp_path):
    """With --base-reg > 0, loss/base_reg is |v_theta - v_base|^2 and train/old_deviate |v_theta - v_old|^2: two
    numbers once the old adapter has moved away from the base (--old-decay 0: old = the trained adapter after each
    iteration) and the trained one from the old (the second optimizer step of an iteration). rvge.py: the same update
    loop."""
    out, more = tmp_path / "run", ["--base-reg", "0.1", "--old-decay", "0", "--updates-per-iter", "2"]
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "0", "--train-steps-per-leaf", "1", *more)
    rvge.train(rvge.parse_args(argv), extra_rewards=TINY_REWARDS)
    last = read_metrics(out)[-1]
    assert last["train/old_deviate"] > 0 and last["train/old_deviate"] != pytest.approx(last["loss/base_reg"], rel=1e-3)


# -----------------------------------------------------------------------------
# W&B: the project and run names, a resume that continues its run
# -----------------------------------------------------------------------------


def test_the_wandb_run_id_continues_on_resume_and_after_a_move_and_is_new_for_a_copy(tmp_path):
    """wandb_run_id: a new run gets a new id, recorded in <run>/wandb/run.json; a resume gets it back, also after the
    folder moved; a resumed copy of the folder (the original still holds the same run) gets a new one; a damaged
    record gives a new one."""
    out = tmp_path / "a"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"run_id": "r1", "script": "recast", "args": {}}))
    first = figures.wandb_run_id(out, resume="")
    assert json.loads((out / "wandb" / "run.json").read_text()) == {"id": first, "folder": os.path.realpath(out)}
    assert figures.wandb_run_id(out, resume=str(out)) == first
    assert figures.wandb_run_id(out, resume="") != first  # a new run in the folder (--overwrite)
    again = figures.wandb_run_id(out, resume=str(out))
    shutil.copytree(out, tmp_path / "b")
    copy = figures.wandb_run_id(tmp_path / "b", resume=str(tmp_path / "b"))
    assert copy != again and figures.wandb_run_id(out, resume=str(out)) == again
    os.replace(out, tmp_path / "c")  # moved: the record's folder holds no run any more
    assert figures.wandb_run_id(tmp_path / "c", resume=str(tmp_path / "c")) == again
    (tmp_path / "c" / "wandb" / "run.json").write_text("{")
    assert figures.wandb_run_id(tmp_path / "c", resume=str(tmp_path / "c")) not in (again, copy)


def test_report_to_wandb_names_the_project_and_run_and_a_resume_continues_it(tiny, tmp_path, monkeypatch):
    """--report-to wandb (offline): wandb.init gets --tracker-project, --tracker-run-name, the run folder as its
    folder, the recorded id and resume="allow"; the metrics go to W&B at each iteration with train/optimizer_step,
    every chart's x-axis (define_metric); --resume starts W&B with the same id, so the same W&B run goes on (two
    offline segments of one run id)."""
    wandb = pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    inits, logged, defined = [], [], []
    init, log, define_metric = wandb.init, Run.log, Run.define_metric
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or init(**kw))
    monkeypatch.setattr(
        Run, "log", lambda self, data, step=None, **kw: logged.append((step, data)) or log(self, data, step=step, **kw)
    )
    monkeypatch.setattr(
        Run, "define_metric", lambda self, name, **kw: defined.append((name, kw)) or define_metric(self, name, **kw)
    )
    out = tmp_path / "run"
    names = ["--tracker-project", "p", "--tracker-run-name", "first try", "--updates-per-iter", "2"]
    argv = tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--report-to", "wandb", *names)
    recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    recast.train(recast.parse_args(["--resume", str(out), "--iterations", "2"]), extra_rewards=TINY_REWARDS)
    wandb_id = json.loads((out / "wandb" / "run.json").read_text())["id"]
    expected = {"project": "p", "name": "first try", "dir": str(out), "id": wandb_id, "resume": "allow"}
    assert [{k: kw[k] for k in expected} for kw in inits] == [expected, expected]
    assert ("*", {"step_metric": "train/optimizer_step"}) in defined
    lines = [(step, data) for step, data in logged if "reward/weighted" in data]
    assert [(step, data["train/optimizer_step"]) for step, data in lines] == [(0, 2), (1, 4)]
    rows = read_metrics(out)
    assert all(data["reward/weighted"] == m["reward/weighted"] for (_, data), m in zip(lines, rows))
    assert len(sorted((out / "wandb").glob(f"offline-run-*-{wandb_id}"))) == 2


# -----------------------------------------------------------------------------
# The optional extras
# -----------------------------------------------------------------------------


def test_ocr_without_its_package_is_named_with_the_install_line(monkeypatch):
    """The OCR engine is an optional extra: --rewards ocr without it is a problem the checks name (before any model
    loads) with the install line, and loading it says the same; requirements.txt no longer holds it, the extras file
    does, and requirements-dev.txt (CI) installs the extras."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "rapidocr_onnxruntime" else find_spec(n, *a)
    )
    problems = reward_models.missing_inputs(["ocr"], {})
    assert problems == [reward_models.OCR_PACKAGE_MISSING]
    assert "pip install -r configs/requirements-extras.txt" in problems[0]
    monkeypatch.setitem(__import__("sys").modules, "rapidocr_onnxruntime", None)  # import fails
    reward_models.load_ocr.cache_clear()
    with pytest.raises(SystemExit, match="pip install -r configs/requirements-extras.txt"):
        reward_models.load_ocr()
    reward_models.load_ocr.cache_clear()
    listed = lambda name: {line.split("==")[0] for line in (REPO / name).read_text().splitlines() if "==" in line}  # noqa: E731
    assert "rapidocr-onnxruntime" not in listed("requirements.txt")
    assert {"rapidocr-onnxruntime", "tensorboard", "wandb"} <= listed("configs/requirements-extras.txt")
    assert "-r configs/requirements-extras.txt" in (REPO / "requirements-dev.txt").read_text()
