"""kit/, the run machinery both scripts import: budgets and flags parsed and checked before any work, --help in
sections, run folders, locks, resume after a kill or damage, atomic checkpoints that load in diffusers, trackers,
figures, prompt files, --dry-run; each case run through both scripts on the tiny pipeline of conftest.py.

`python tests/test_run_kit.py --same-metrics A B` compares two runs' metrics.jsonl apart from their wall-clock times
(`time/*`): the check that a change to the code left a seeded run's numbers byte-identical.
Run: python -m pytest -q test_run_kit.py
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import nft
import recast
import recast_controls
import rvge
import sd3
from conftest import (
    TINY_REWARDS,
    assert_loads_as_trained,
    brightness,
    copy_of,
    read_metrics,
    snapshot,
    tiny_argv,
    tiny_argv_for,
)
from kit import checkpoints, checks, figures, flags, folders, records, reward_models, session, worlds


def test_parse_budgets_reads_and_keeps_scale():
    assert checks.parse_budgets("0.4,0.3,0.2,0.1") == [0.4, 0.3, 0.2, 0.1]
    assert checks.parse_budgets(" 2, 0 ,1 ") == [2.0, 0.0, 1.0]  # not normalised


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("0.4,abc", "not a number"),
        ("0.4,,0.1", "not a number"),
        ("nan,1", "finite"),
        ("inf", "finite"),
        ("0.5,-0.1", "negative"),
        ("0,0,0", "all budgets are zero"),
    ],
)
def test_parse_budgets_errors_name_the_problem_and_the_fix(text, words):
    with pytest.raises(ValueError) as err:
        checks.parse_budgets(text)
    assert words in str(err.value) and "--budgets" in str(err.value)


def test_sample_grid_upscales_each_image_and_writes_its_prompt_under_it(tmp_path):
    colours = ["red", "blue", "green", "orange", "purple", "teal", "navy", "olive", "maroon", "gray"]
    images = [Image.new("RGB", (16, 16), c) for c in colours]
    prompts = ["a red circle on the left and a blue square", "two blue squares"] + [""] * 8
    grid = np.asarray(figures.save_grid(images, tmp_path / "grid.png", prompts=prompts, cols=8, cell=128))
    assert Image.open(tmp_path / "grid.png").size == (grid.shape[1], grid.shape[0])
    assert grid.shape[1] == 8 * 128 and 2 * 128 < grid.shape[0] < 2 * 128 + 2 * 100  # two rows, room for captions
    row_h = grid.shape[0] // 2
    for i, c in enumerate(colours):  # nearest upscaling: each 16 px image fills its 128 px cell with its colour
        x, y = (i % 8) * 128, (i // 8) * row_h
        assert (grid[y : y + 128, x : x + 128] == Image.new("RGB", (1, 1), c).getpixel((0, 0))).all()
    caption = lambda i: grid[128:row_h, i * 128 : (i + 1) * 128]  # noqa: E731
    lines = lambda i: (caption(i).min(axis=(1, 2)) < 128).astype(int)  # noqa: E731
    assert caption(0).min() < 100 and caption(1).min() < 100 and caption(2).min() == 255  # text only under prompts
    assert (np.diff(lines(0)) == 1).sum() > (np.diff(lines(1)) == 1).sum() >= 1  # the long prompt wraps


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_report_to_tensorboard_logs_the_metrics_keys_and_W(tiny, tmp_path, module):
    """--report-to tensorboard: event files in <run>/tensorboard hold every number of metrics.jsonl under the same key,
    one point per iteration, and W as an image where W is part of the update: credit.png's W panel, its rows named
    (figures.W_figure)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script, out = __import__(module), tmp_path / "run"
    argv = tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "1", "--report-to", "tensorboard")
    script.train(script.parse_args(argv), extra_rewards=TINY_REWARDS)
    rows = read_metrics(out)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    numbers = {k for m in rows for k, v in m.items() if isinstance(v, (int, float))}
    assert numbers <= set(events.Tags()["scalars"]) and "eval_before/brightness" in numbers
    for key in ("loss/policy", "reward/weighted", "eval/brightness", "grad_norm"):
        assert [e.step for e in events.Scalars(key)] == [0, 1]
        assert [e.value for e in events.Scalars(key)] == pytest.approx([m[key] for m in rows], rel=1e-6)
    if module == "rvge":  # --credit budgets: W is uniform and no part of the update (rvge.shows_W), so no W image
        assert "recast/W" not in events.Tags()["images"]
    else:
        images = events.Images("recast/W")
        fig = figures.W_figure(np.asarray(rows[0]["recast/W"]), ["brightness", "redness"])
        width, height = fig.canvas.get_width_height()
        assert [(i.step, i.height, i.width) for i in images] == [(0, height, width), (1, height, width)]
    # every evaluation's figures, live: the samples (before, then before/after), the run's figures
    shown = ["eval/samples", "figures/rewards", "figures/credit" if module == "recast" else "figures/directions"]
    for tag in shown:
        assert [i.step for i in events.Images(tag)] == [0, 1], tag
    assert [i.step for i in events.Images("eval_before/samples")] == [0]
    samples = events.Images("eval/samples")[-1]
    assert (samples.width, samples.height) == Image.open(out / "samples.png").size
    assert ("figures/credit" in events.Tags()["images"]) == (module == "recast")


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_evaluate_py_gives_the_runs_own_evaluations(tiny, tmp_path, module, capsys, monkeypatch):
    """evaluate.py on a run's final checkpoint gives the eval/* the run logged at its last iteration, and with --base
    the eval_before/* of its first line (the pretrained model); it writes them as JSON, with each image's rewards."""
    import evaluate

    script, out = __import__(module), tmp_path / "run"
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "2")), extra_rewards=TINY_REWARDS
    )
    rows = read_metrics(out)
    got = evaluate.main([str(out)], extra_rewards=TINY_REWARDS)
    assert got == {k: v for k, v in rows[-1].items() if k.startswith("eval/")} and len(got) == 3
    saved = json.loads((out / "eval-iter_000001.json").read_text())
    assert saved["metrics"] == got and saved["iteration"] == 1 and len(saved["images"]) == 4
    assert np.mean([im["brightness"] for im in saved["images"]]) == pytest.approx(got["eval/brightness"])
    assert "eval/weighted" in capsys.readouterr().out
    before = torch.load(out / "checkpoints" / "iter_000001" / "state.pt", weights_only=False)["samples_before"]
    assert before[0].shape == (4, 16, 16, 3) and before[1].shape == (4, 2)  # a resumed run still shows them
    base = evaluate.main([str(out), "--base"], extra_rewards=TINY_REWARDS)
    assert base == {k.replace("eval_before/", "eval/"): v for k, v in rows[0].items() if k.startswith("eval_before/")}
    assert base != got
    with pytest.raises(SystemExit, match="neither a run folder"):
        evaluate.main([str(tmp_path)])
    # other prompts (flags override the run's); only the first SHOWN samples are drawn, every image is scored
    many = tmp_path / "many.txt"
    many.write_text("a red circle\ntwo blue square\n" * 9)
    drawn = []
    monkeypatch.setattr(figures, "save_grid", lambda images, path, captions: drawn.append(len(images)))
    evaluate.main([str(out), "--eval-prompts", str(many), "--json", str(tmp_path / "many.json")], TINY_REWARDS)
    assert drawn == [session.SHOWN] and len(json.loads((tmp_path / "many.json").read_text())["images"]) == 18


def test_the_samples_figure_shows_before_above_after_with_each_images_reward(tmp_path, monkeypatch):
    """save_samples: per `cols` prompts a row of the first evaluation's images, then the same prompts now, each
    captioned with its label, its budget-weighted reward and its prompt; the last row padded with blanks."""
    seen = {}
    monkeypatch.setattr(
        figures, "save_grid", lambda images, path, captions, cols: seen.update(n=len(images), c=captions)
    )
    pixels, R = np.zeros((3, 16, 16, 3), np.uint8), np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    rows = [("before", (pixels, R)), ("iteration 4", (pixels + 255, 0 * R))]
    figures.save_samples(tmp_path / "samples.png", ["a", "b", "c"], rows, budgets=[3, 1], cols=2)
    assert seen["n"] == 8 and seen["c"] == [
        "before: 0.750. a",
        "before: 0.250. b",
        "iteration 4: 0.000. a",
        "iteration 4: 0.000. b",
        "before: 0.500. c",
        "",
        "iteration 4: 0.000. c",
        "",
    ]


def test_gradients_are_averaged_in_one_collective():
    """nft.average_grads (run.all_reduce_grads): one reduce of one flat buffer for every gradient (not one per
    tensor); each gradient gets its own part of the mean back, in place, shapes kept; a parameter without a gradient is
    left out."""
    calls = []

    class TwoProcesses:  # accelerate's reduce, as if the other process held twice these gradients
        num_processes = 2

        def reduce(self, tensor, reduction):
            calls.append((tensor.shape, reduction))
            return (tensor + 2 * tensor) / 2

    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((3, 4), (5,), (2, 2, 2), (7,))]
    for p in params[:3]:
        p.grad = torch.randn(p.shape)
    before = [p.grad.clone() for p in params[:3]]
    nft.average_grads(TwoProcesses(), params)
    assert calls == [((12 + 5 + 8,), "mean")]
    assert all(torch.allclose(p.grad, 1.5 * g) for p, g in zip(params, before)) and params[3].grad is None


def test_report_to_needs_its_package(tiny, tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    argv = tiny_argv(tiny, tmp_path / "run", "--report-to", "wandb")
    with pytest.raises(SystemExit, match="needs the wandb package: pip install wandb"):
        recast.validate(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert not (tmp_path / "run").exists()


KILL_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {repo!r})
import {module} as script, conftest
script.train(script.parse_args({argv!r}), extra_rewards=conftest.TINY_REWARDS)
"""


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_resume_after_sigkill_loses_nothing_and_same_seed_repeats(tiny, tmp_path, module):
    script = __import__(module)
    import signal
    import sys
    import time as _time

    ref, killed = tmp_path / "ref", tmp_path / "killed"
    common = ["--iterations", "5", "--save-every", "1", "--eval-every", "0"]
    script.train(script.parse_args(tiny_argv(tiny, ref, *common)), extra_rewards=TINY_REWARDS)
    code = KILL_SCRIPT.format(
        repo=str(Path(__file__).resolve().parents[1]), module=module, argv=tiny_argv(tiny, killed, *common)
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = _time.time() + 240
    while _time.time() < deadline and not (latest.exists() and latest.read_text() >= "iter_000001"):
        _time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest.exists(), "the killed run wrote no checkpoint"
    assert len(read_metrics(killed)) < 5, "the run finished before it could be killed"
    script.train(script.parse_args(["--resume", str(killed)]), extra_rewards=TINY_REWARDS)

    def strip(m):
        return {k: v for k, v in m.items() if not k.startswith("time/")}

    # exact, not approx: one code path run twice on the same inputs with the same threads and process layout (the
    # killed run's process inherits this one's environment), so resume must reproduce the uninterrupted run bit for bit
    assert [strip(m) for m in read_metrics(killed)] == [strip(m) for m in read_metrics(ref)]


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_nan_rewards_are_left_out_and_an_all_nan_reward_stops_with_a_checkpoint(tiny, tmp_path, module):
    script = __import__(module)

    def half_nan(images, prompts):
        v = brightness(images, prompts)
        v[::2] = np.nan
        return v

    out = tmp_path / "half"
    argv = tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0", "--rewards", "brightness,half")
    script.train(script.parse_args(argv), extra_rewards={**TINY_REWARDS, "half": half_nan})
    m, saved = read_metrics(out)[0], json.loads((out / "config.json").read_text())["args"]
    leaves = saved["prompts_per_iter"] * saved["n_roots"] * saved["n_branch"] ** len(saved["branch_steps"].split(","))
    assert m["reward_nonfinite/half"] == leaves // 2 and np.isfinite(m["reward/half"]) and np.isfinite(m["loss/policy"])
    out = tmp_path / "all"
    argv = tiny_argv(tiny, out, "--iterations", "3", "--eval-every", "0", "--rewards", "brightness,dead")
    with pytest.raises(SystemExit, match="NaN/inf for every image of iteration 0; nothing was trained"):
        script.train(
            script.parse_args(argv), extra_rewards={**TINY_REWARDS, "dead": lambda ims, ps: np.full(len(ims), np.nan)}
        )
    assert not (out / "checkpoints").exists(), "the untrained LoRA was saved as if iteration 0 had been trained"
    script.train(
        script.parse_args(["--resume", str(out), "--iterations", "1"]),
        extra_rewards={**TINY_REWARDS, "dead": brightness},
    )
    assert [m["iteration"] for m in read_metrics(out)] == [0]  # the reward fixed: iteration 0 is trained, not skipped
    out = tmp_path / "later"

    def dies_at_iteration_1(images, prompts):  # iteration 0's metrics line is written: iteration 1 has begun
        return brightness(images, prompts) * (np.nan if (out / "metrics.jsonl").exists() else 1.0)

    argv = tiny_argv(
        tiny, out, "--iterations", "3", "--save-every", "5", "--eval-every", "0", "--rewards", "dead", "--budgets", "1"
    )
    with pytest.raises(SystemExit, match="of iteration 1; the state after iteration 0 is saved"):
        script.train(script.parse_args(argv), extra_rewards={"dead": dies_at_iteration_1})
    assert (out / "checkpoints" / "latest").read_text() == "iter_000000"


def test_permute_within_groups_shuffles_the_named_rewards_inside_each_group_only():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(4), 6)
    R = rng.random((24, 3))
    out = session.permute_within_groups(R, groups, ["a", "b", "c"], "c,a", seed=3, it=5)
    assert np.array_equal(out[:, 1], R[:, 1])  # an unnamed reward is left as it is
    for g in range(4):  # each group keeps its values (mean, spread), the leaves they belong to change
        rows = groups == g
        for k in (0, 2):
            assert np.array_equal(np.sort(out[rows, k]), np.sort(R[rows, k]))
    assert not np.array_equal(out[:, [0, 2]], R[:, [0, 2]])
    assert np.array_equal(out, session.permute_within_groups(R, groups, ["a", "b", "c"], "c,a", seed=3, it=5))
    assert not np.array_equal(out, session.permute_within_groups(R, groups, ["a", "b", "c"], "c,a", seed=3, it=6))
    assert session.permute_within_groups(R, groups, ["a", "b", "c"], "", seed=3, it=5) is R


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_permuted_reward_control_keeps_the_logged_means_and_changes_the_update(tiny, tmp_path, module):
    """--permute-rewards redness: the same rollouts (same seed) and the same per-group values, so the logged
    training means are the true run's; the values no longer belong to the images, so the update differs."""
    script = __import__(module)
    rows = {}
    for label, more in (("true", []), ("permuted", ["--permute-rewards", "redness"])):
        argv = tiny_argv(tiny, tmp_path / label, "--iterations", "1", "--eval-every", "0", "--seed", "0", *more)
        script.train(script.parse_args(argv), extra_rewards=TINY_REWARDS)
        rows[label] = read_metrics(tmp_path / label)[0]
    for key in ("reward/redness", "reward/brightness"):
        assert rows["true"][key] == pytest.approx(rows["permuted"][key], rel=1e-12)
    assert rows["true"]["loss/policy"] != rows["permuted"]["loss/policy"]


@pytest.mark.parametrize(
    "change, words",
    [
        (["--budgets", "0.4,x"], "not a number"),
        (["--budgets", "1,2,3"], "3 budgets for 2 rewards"),
        (["--rewards", "brightness,nope"], "unknown or repeated reward"),
        (["--permute-rewards", "nope"], "--permute-rewards nope: name each permuted reward once, from --rewards"),
        (["--model", "/no/such/folder"], "no such folder"),
        (["--model", "stabilityai/stable-diffusion-3.5-medium", "--allow-embedded-defaults"], "needs a CUDA GPU"),
        (["--alpha", "3"], "--alpha 2"),
        (["--branch-steps", "9"], "strictly between"),
        (["--out", "/proc/forbidden/run"], "cannot write"),
        (["--out", "runs/" + "x" * 300], "--out runs/x.*has 300 bytes.*Choose a shorter --out"),
        (["--name", "y" * 300], "--name y.*has 300 bytes.*Choose a shorter --name"),
    ],
    ids=lambda v: str(v)[:40],
)
@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_bad_input_fails_before_any_work_with_a_clear_message(tiny, tmp_path, change, words, module):
    if "CUDA" in words and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if module == "rvge" and "--alpha" in change:
        change, words = ["--kl-beta", "0"], "--kl-beta 0.0: must be a finite number > 0"
    script = __import__(module)
    argv = tiny_argv(tiny, tmp_path / "run") + change
    with pytest.raises(SystemExit, match=words):
        script.validate(script.parse_args(argv), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize(
    "damage, words",
    [
        ("missing", "not a readable level-statistics file"),
        ("empty_list", "not a readable level-statistics file"),
        ("short_n", "field 'n' is not an array of shape"),
        ("ragged_s1", "field 's1' is not an array of shape"),
        ("null_in_s2", "field 's2' holds 1 null/NaN/inf entries"),
    ],
)
def test_a_bad_gain_init_file_is_refused_before_the_model_loads_or_the_run_folder_exists(
    tiny, tmp_path, damage, words, monkeypatch
):
    """--gain-init is checked in validate: a missing file, `[]`, a short n, ragged rows or null statistics (which
    would switch the credit off) are refused naming the file and the field; no model loads, no run folder is made."""
    out, path = tmp_path / "run", tmp_path / "levels.json"
    args = recast.parse_args(tiny_argv(tiny, out, "--gain-init", str(path)))
    T, s1 = args.steps, np.ones((2, args.steps + 1))
    saved = {"names": ["brightness", "redness"], "steps": T, "n": [4.0] * (T + 1), "s1": s1.tolist(), "s2": s1.tolist()}
    if damage == "short_n":
        saved["n"] = saved["n"][:-1]
    if damage == "ragged_s1":
        saved["s1"][1] = saved["s1"][1][:-1]
    if damage == "null_in_s2":
        saved["s2"][0][1] = None
    if damage != "missing":
        path.write_text("[]" if damage == "empty_list" else json.dumps(saved))
    monkeypatch.setattr(sd3, "load_pipeline", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match=re.escape(f"--gain-init {path}: ") + ".*" + re.escape(words)):
        recast.train(args, extra_rewards=TINY_REWARDS)
    assert not out.exists()
    if damage == "null_in_s2":  # the same file with the value: accepted, rows in the run's order
        saved["s2"][0][1] = 1.0
        path.write_text(json.dumps(saved))
        assert recast_controls.read_level_stats(path, ["redness", "brightness"], T)[2].shape == (2, T + 1)


def test_a_full_disk_before_config_json_leaves_no_tmp_and_the_same_command_runs_again(tiny, tmp_path, monkeypatch):
    """The disk fills after the lock, while config.json is written: a clear message, the program's own
    config.json.tmp removed, and the same --out is then free (with or without --overwrite)."""
    out = tmp_path / "run"
    write_text = Path.write_text

    def disk_full(self, text, *a, **k):
        if self.name == "config.json.tmp":
            write_text(self, text[:10])
            raise OSError(28, "No space left on device")
        return write_text(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(SystemExit, match="No space left on device.*is the disk full"):
        recast.train(recast.parse_args(tiny_argv(tiny, out, "--iterations", "1")), extra_rewards=TINY_REWARDS)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    monkeypatch.undo()
    (out / "config.json.tmp").write_text('{"args": {')  # a kill at that moment leaves it: still ours, still free
    for more in ([], ["--overwrite"]):
        recast.validate(recast.parse_args(tiny_argv(tiny, out, *more)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize("block", ["a_file", "read_only"])
def test_an_unwritable_tensorboard_folder_is_refused_before_the_model_loads(finished_run, tmp_path, block, monkeypatch):
    """<run>/tensorboard a user's file, or a folder nobody may write to: --resume --report-to tensorboard stops before
    the model loads, names the folder and the fix, and changes nothing."""
    out = copy_of(finished_run, tmp_path)
    tb = out / "tensorboard"
    if block == "a_file":
        tb.write_text("my notes")
    else:
        tb.mkdir()
        (tb / "events.old").write_text("x")
        tb.chmod(0o555)
        if subprocess.run(["chattr", "+i", str(tb)], capture_output=True).returncode and os.access(tb, os.W_OK):
            pytest.skip("this user can write to any folder (root without chattr): nothing read-only to test")
    before = snapshot(out)
    monkeypatch.setattr(sd3, "load_pipeline", lambda *a: pytest.fail("the model loaded"))
    try:
        with pytest.raises(SystemExit, match="is a file, not the run's TensorBoard" if block == "a_file" else "chmod"):
            finished_run.script.train(
                finished_run.script.parse_args(["--resume", str(out), "--report-to", "tensorboard"]),
                extra_rewards=TINY_REWARDS,
            )
        assert snapshot(out) == before
    finally:
        subprocess.run(["chattr", "-i", str(tb)], capture_output=True)
        tb.chmod(0o755)


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_a_full_disk_while_a_metrics_line_is_appended_stops_with_the_fix_and_resumes(
    tiny, tmp_path, module, monkeypatch
):
    """The disk fills in the middle of iteration 1's metrics line: a clear message, iteration 0's line and checkpoint
    kept; --resume drops the cut-short line and redoes iteration 1."""
    script, out = __import__(module), tmp_path / "run"

    def disk_full(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        if Path(path).name == "metrics.jsonl" and mode == "a" and Path(path).stat().st_size:
            f.write('{"iteration": 1, "rew')
            f.close()
            raise OSError(28, "No space left on device")
        return f

    monkeypatch.setattr(records, "open", disk_full, raising=False)
    argv = tiny_argv(tiny, out, "--iterations", "2", "--save-every", "1", "--eval-every", "0")
    with pytest.raises(SystemExit, match="iteration 1's metrics.*No space left on device.*--resume"):
        script.train(script.parse_args(argv), extra_rewards=TINY_REWARDS)
    monkeypatch.undo()
    assert (out / "checkpoints" / "latest").read_text() == "iter_000000"
    assert (out / "metrics.jsonl").read_text().splitlines()[-1] == '{"iteration": 1, "rew'
    script.train(script.parse_args(["--resume", str(out)]), extra_rewards=TINY_REWARDS)
    assert [m["iteration"] for m in read_metrics(out)] == [0, 1]


def test_figures_are_written_atomically_never_as_empty_files(finished_run, tmp_path, monkeypatch):
    """A kill (or a full disk) inside savefig, after the file is opened: the old rewards.png and credit.png (rvge:
    directions.png) stay as they were, no .tmp is left (a kill's own .tmp is one the next start removes), and a new
    plot replaces them."""
    from matplotlib.figure import Figure

    out = copy_of(finished_run, tmp_path)
    names = json.loads((out / "config.json").read_text())["rewards"]
    figure = "credit.png" if finished_run.script is recast else "directions.png"  # rvge: its own diagnostics
    before = snapshot(out)
    assert before[figure].startswith(b"\x89PNG") and before["rewards.png"].startswith(b"\x89PNG")

    def killed(self, fname, *a, **k):
        Path(fname).write_bytes(b"")  # opened, nothing written yet
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", killed)
    with pytest.raises(KeyboardInterrupt):
        figures.plot_run(out, names)
    monkeypatch.undo()
    assert snapshot(out) == before

    def disk_full(self, fname, *a, **k):
        Path(fname).write_bytes(b"\x89PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(SystemExit, match="rewards.png .No space left on device.: is the disk full.*--resume"):
        figures.plot_run(out, names)
    monkeypatch.undo()
    assert snapshot(out) == before
    (out / figure).unlink()
    assert out / figure in figures.plot_run(out, names)
    assert (out / figure).read_bytes().startswith(b"\x89PNG") and not list(out.glob("*.tmp"))
    (out / f"{figure}.tmp").write_bytes(b"")
    assert out / f"{figure}.tmp" in folders.leftovers(out)


def test_resume_after_the_project_folder_moved_goes_on_with_the_embedded_model(finished_run, tmp_path, capsys):
    """The saved --model is the embedded model's old absolute path (the project moved): the resume takes the same
    model at its new place and says so, with or without --model naming it; any other vanished model is refused
    with the fix, and nothing in the run folder changes."""
    script, out = finished_run.script, copy_of(finished_run, tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["args"]["model"] = "/old/place/of/the/project/assets/shapes-sd3"
    (out / "config.json").write_text(json.dumps(config))
    before = snapshot(out)
    for more in ([], ["--model", worlds.EMBEDDED_MODEL]):
        assert script.parse_args(["--resume", str(out), *more]).model == worlds.EMBEDDED_MODEL
        assert "resuming with the same embedded model" in "".join(capsys.readouterr())
    config["args"]["model"] = str(tmp_path / "moved-model")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=r"moved-model no longer exists\. If it moved, write its new place"):
        script.parse_args(["--resume", str(out), "--model", worlds.EMBEDDED_MODEL])
    assert snapshot(out) == {**before, "config.json": (out / "config.json").read_bytes()}


def test_resume_with_another_process_count_is_refused_before_the_model_loads(finished_run, tmp_path):
    """config.json records the process count; a resume under another count (which changes the global batch) is
    refused naming both counts and the launch that fits, with nothing changed."""
    script, out = finished_run.script, copy_of(finished_run, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["processes"] == 1
    config["processes"] = 2
    (out / "config.json").write_text(json.dumps(config))
    before = snapshot(out)
    with pytest.raises(SystemExit, match=r"trained with 2 process\(es\), this start has 1.*--num_processes 2"):
        script.validate(script.parse_args(["--resume", str(out)]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


def test_the_same_command_twice_makes_two_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in tiny_argv(tiny, "x", "--iterations", "1", "--eval-every", "0") if a not in ("--out", "x")]
    first = recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    before = snapshot(first)
    second = recast.train(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    assert first == Path("runs/recast-recast-0") and second == Path("runs/recast-recast-0-1")
    assert snapshot(first) == before and (second / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize(
    "more, words",
    [
        ([], "already holds a run"),
        (["--train-batch", "0"], "--train-batch 0: must be"),
        (["--lr", "nan"], "--lr nan: must be a finite"),
    ],
)
def test_an_existing_run_is_never_touched_by_a_new_command(finished_run, tmp_path, more, words):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words)):
        finished_run.script.validate(
            finished_run.script.parse_args(tiny_argv_for(finished_run, out, *more)), extra_rewards=TINY_REWARDS
        )
    assert snapshot(out) == before


def test_overwrite_replaces_a_run(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    script = finished_run.script
    script.train(
        script.parse_args(tiny_argv_for(finished_run, out, "--iterations", "1", "--eval-every", "0", "--overwrite")),
        extra_rewards=TINY_REWARDS,
    )
    assert [m["iteration"] for m in read_metrics(out)] == [0]
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_000000"]


def test_keep_checkpoints_keeps_the_newest_n_or_all(finished_run, tmp_path):
    """--keep-checkpoints N keeps the newest N checkpoints, 0 every one (DiffusionNFT's way); the default keeps two."""
    script, out = finished_run.script, copy_of(finished_run, tmp_path)

    def kept():
        return sorted(p.name for p in (out / "checkpoints").glob("iter_*"))

    assert kept() == ["iter_000000", "iter_000001"]  # the default, 2, after two saves
    more = ["--eval-every", "0", "--save-every", "1"]
    script.train(
        script.parse_args(["--resume", str(out), "--iterations", "4", "--keep-checkpoints", "0", *more]), TINY_REWARDS
    )
    assert kept() == ["iter_000000", "iter_000001", "iter_000002", "iter_000003"]
    script.train(
        script.parse_args(["--resume", str(out), "--iterations", "5", "--keep-checkpoints", "3", *more]), TINY_REWARDS
    )
    assert kept() == ["iter_000002", "iter_000003", "iter_000004"]
    assert (out / "checkpoints" / "latest").read_text() == "iter_000004"


def test_resume_trains_the_folder_given_wherever_it_lies(finished_run, tmp_path):
    script = finished_run.script
    original = snapshot(finished_run.out)
    moved = copy_of(finished_run, tmp_path, "moved")
    script.train(script.parse_args(["--resume", str(moved), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert [m["iteration"] for m in read_metrics(moved)] == [0, 1, 2]
    assert snapshot(finished_run.out) == original  # the folder it was copied from is untouched
    assert json.loads((moved / "config.json").read_text())["args"]["out"] == str(moved)
    with pytest.raises(SystemExit, match="continues that folder in place"):
        script.parse_args(["--resume", str(moved), "--out", str(tmp_path / "elsewhere")])


@pytest.mark.parametrize(
    "more, words",
    [
        (["--rewards", "brightness"], "--rewards: saved 'brightness,redness', given 'brightness'"),
        (["--steps", "12"], "--steps: saved 10, given 12"),
        (["--lora-rank", "8"], "--lora-rank: saved 4, given 8"),
    ],
)
def test_resume_refuses_settings_that_cannot_change(finished_run, tmp_path, more, words):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words)):
        finished_run.script.parse_args(["--resume", str(out), *more])
    assert snapshot(out) == before
    other = "rvge" if finished_run.script is recast else "recast"
    with pytest.raises(SystemExit, match=f"trained by {finished_run.script.__name__}.py"):
        __import__(other).parse_args(["--resume", str(out)])


def test_a_second_live_process_on_a_folder_is_refused(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    held = folders.lock_run(out)
    try:
        with pytest.raises(SystemExit, match="in use by another live process"):
            finished_run.script.train(
                finished_run.script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS
            )
    finally:
        held.close()


@pytest.mark.parametrize("damage", ["partial_metrics_line", "dangling_latest", "truncated_state"])
def test_resume_survives_damage_and_falls_back_to_an_intact_checkpoint(finished_run, tmp_path, damage, capsys):
    out = copy_of(finished_run, tmp_path)
    ckpts = out / "checkpoints"
    if damage == "partial_metrics_line":
        with open(out / "metrics.jsonl", "a") as f:
            f.write('{"iteration": 2, "reward/bri')
    elif damage == "dangling_latest":
        (ckpts / "latest").write_text("iter_000009")
    else:
        (ckpts / "iter_000001" / "state.pt").write_bytes((ckpts / "iter_000001" / "state.pt").read_bytes()[:1000])
    (ckpts / "iter_000005.tmp").mkdir()
    finished_run.script.train(
        finished_run.script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS
    )
    its = [m["iteration"] for m in read_metrics(out)]
    if damage == "truncated_state":  # iteration 1 is redone from the iteration-0 checkpoint
        captured = capsys.readouterr()
        assert its == [0, 1, 2] and "iter_000000, the newest intact checkpoint" in captured.out + captured.err
    else:
        assert its == [0, 1, 2]
    assert not list(ckpts.glob("*.tmp")) and (ckpts / (ckpts / "latest").read_text()).is_dir()


def test_a_runs_lora_loads_in_diffusers_as_the_trained_model(finished_run):
    """Both scripts (rank 4, alpha 8): checkpoints/iter_N is the folder to load, and it loads at full strength."""
    assert_loads_as_trained(finished_run.script, finished_run.out, finished_run.out / "checkpoints" / "iter_000001")


def test_resume_applies_a_new_lr_and_weight_decay_and_records_what_it_did(finished_run, tmp_path):
    """A changed flag applies from the resumed iteration on; config.json's args hold the new value and
    "changed_on_resume" what iterations 0-1 used and from which iteration the new one applies (issue 64: the old value
    was lost)."""
    out = copy_of(finished_run, tmp_path)
    script = finished_run.script
    before = json.loads((out / "config.json").read_text())["args"]
    script.train(
        script.parse_args(["--resume", str(out), "--iterations", "3", "--lr", "0.002", "--weight-decay", "0.25"]),
        extra_rewards=TINY_REWARDS,
    )
    groups = torch.load(out / "checkpoints" / "iter_000002" / "state.pt", weights_only=False)["optimizer"]
    assert [(g["lr"], g["weight_decay"]) for g in groups["param_groups"]] == [(0.002, 0.25)]
    config = json.loads((out / "config.json").read_text())
    assert (config["args"]["lr"], config["args"]["weight_decay"]) == (0.002, 0.25)
    changed = {c["flag"]: c for c in config["changed_on_resume"]}
    assert set(changed) == {"lr", "weight_decay", "iterations"}
    assert changed["lr"] == {"from_iteration": 2, "flag": "lr", "before": before["lr"], "after": 0.002}
    assert changed["iterations"]["before"] == before["iterations"] == 2


@pytest.mark.parametrize(
    "more, words",
    [
        (["--gain-estimator", "denoised"], "--gain-estimator: saved 'pairs', given 'denoised'"),
        (["--gain-init", "levels.json"], "--gain-init: saved 'world', given 'levels.json'"),
        (["--overwrite"], "--overwrite does not go with --resume"),
        (["--name", "other"], "--name does not go with --resume"),
    ],
)
def test_resume_refuses_flags_whose_saved_state_would_override_them(finished_run, tmp_path, more, words):
    """--gain-estimator / --alpha: the saved level statistics were measured with them; --gain-init seeds iteration 0
    only; --overwrite / --name choose another folder. Refused, nothing written."""
    script = finished_run.script
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    if script is rvge and more[0].startswith("--gain"):  # rvge.py has no such flag (its --credit recast: pairs, 2)
        with pytest.raises(SystemExit, match="2"):  # argparse: unrecognized arguments, exit status 2
            script.parse_args(["--resume", str(out), *more])
    else:
        with pytest.raises(SystemExit, match=re.escape(words)):
            script.train(script.parse_args(["--resume", str(out), *more]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


@pytest.mark.parametrize("loss", ["moved_away", "dangling_link", "a_file"])
def test_resume_of_a_run_whose_checkpoints_are_gone_is_refused_before_the_model_loads(
    finished_run, tmp_path, loss, monkeypatch
):
    """checkpoints/ moved away, or a link to nothing: starting again at iteration 0 would rewrite metrics.jsonl, so
    the resume stops, names the folder and the fix, and changes nothing (no model is loaded)."""
    out = copy_of(finished_run, tmp_path)
    if loss == "a_file":
        shutil.rmtree(out / "checkpoints")
        (out / "checkpoints").write_text("mine")
    else:
        shutil.move(out / "checkpoints", tmp_path / "elsewhere")
    if loss == "dangling_link":
        (out / "checkpoints").symlink_to(tmp_path / "unmounted")
    before = snapshot(out)
    monkeypatch.setattr(sd3, "load_pipeline", lambda *a: pytest.fail("the model loaded"))
    words = {"moved_away": "holds no checkpoint", "dangling_link": "does not exist", "a_file": "is not a folder"}
    with pytest.raises(SystemExit, match=words[loss]):
        finished_run.script.train(finished_run.script.parse_args(["--resume", str(out)]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    assert (out / "checkpoints").is_symlink() == (loss == "dangling_link")
    if loss == "moved_away":  # killed while its first checkpoint was written: no checkpoint yet, nothing to refuse
        lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
        (out / "metrics.jsonl").write_text(lines[0])
        checkpoints.check_checkpoints_are_there(out)


def test_resume_with_no_loadable_checkpoint_stops_and_changes_nothing(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    for state in (out / "checkpoints").glob("iter_*/state.pt"):
        state.write_bytes(state.read_bytes()[:500])
    before = snapshot(out)
    script = finished_run.script
    with pytest.raises(SystemExit, match="none of its checkpoints loads .*nothing was changed"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize(
    "files",
    [{"config.json": '{"_class_name": "SD3Transformer2DModel"}'}, {"notes.txt": "mine"}, {"config.json": "[1, 2]"}],
)
def test_out_at_a_folder_of_other_files_is_refused_even_with_overwrite(tiny, tmp_path, files, overwrite):
    out = tmp_path / "transformer"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    before = snapshot(out)
    with pytest.raises(SystemExit, match="holds files that are not a run of this project"):
        recast.validate(recast.parse_args(tiny_argv(tiny, out, *overwrite)), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    for system in ("/", "/etc", "/mnt", str(Path.home())):
        with pytest.raises(SystemExit, match="is a system folder|holds files that are not a run"):
            recast.validate(recast.parse_args(tiny_argv(tiny, system, "--overwrite")), extra_rewards=TINY_REWARDS)
    empty = tmp_path / "empty"
    (empty / ".lock").parent.mkdir()
    (empty / ".lock").write_text("")  # a start stopped before it wrote its config: the folder is free
    recast.validate(recast.parse_args(tiny_argv(tiny, empty)), extra_rewards=TINY_REWARDS)


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_only_the_first_process_judges_the_run_folder(tiny, tmp_path, module, monkeypatch):
    """Under accelerate launch, rank 0 creates the folder, probes it and may write config.json before rank 1 looks:
    rank 1 must not judge that folder (it would call it another run's) but wait for rank 0's choice (CI saw
    this race: test_two_processes_hold_the_same_W failed once with 'holds files that are not a run')."""
    script = __import__(module)
    out = tmp_path / "run"
    out.mkdir()
    (out / ".write_test.123").write_text("ok")  # rank 0's write probe, seen mid-check
    with pytest.raises(SystemExit, match="holds files that are not a run"):
        script.validate(script.parse_args(tiny_argv(tiny, out)), extra_rewards=TINY_REWARDS)
    for module in (folders, session):
        monkeypatch.setattr(module, "is_first_process", lambda args: False)  # what accelerate says in rank 1
    args = script.parse_args(tiny_argv(tiny, out))
    script.validate(args, extra_rewards=TINY_REWARDS)
    assert args.out == str(out) and sorted(p.name for p in out.iterdir()) == [".write_test.123"]
    argv = tiny_argv(tiny, out)
    del argv[argv.index("--out") : argv.index("--out") + 2]
    args = script.parse_args(argv)  # default runs/<name>: left to rank 0's broadcast
    monkeypatch.chdir(tmp_path)
    script.validate(args, extra_rewards=TINY_REWARDS)
    assert not args.out and not (tmp_path / "runs").exists()


def test_a_stray_rank_variable_leaves_a_single_process_run_checked_and_locked(finished_run, tmp_path, monkeypatch):
    """RANK=1 left over from a launcher in a plain shell: accelerate counts one process, so this is the first one and
    every check holds: an existing run is refused without --overwrite (nothing changed), a default run folder is
    chosen under runs/ (not the working folder), and the lock is taken."""
    script = finished_run.script
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    monkeypatch.setenv("RANK", "1")
    assert folders.is_first_process(script.parse_args(tiny_argv_for(finished_run, out)))
    with pytest.raises(SystemExit, match="already holds a run"):
        script.validate(script.parse_args(tiny_argv_for(finished_run, out)), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before
    argv = tiny_argv_for(finished_run, out)
    args = script.parse_args(argv[: argv.index("--out")])
    monkeypatch.chdir(tmp_path)
    script.validate(args, extra_rewards=TINY_REWARDS)
    assert Path(args.out).parent == Path("runs") and (tmp_path / args.out).is_dir()
    held = folders.lock_run(out)  # a live process on the run: the stray RANK does not skip the lock
    try:
        with pytest.raises(SystemExit, match="in use by another live process"):
            script.train(script.parse_args(["--resume", str(out)]), extra_rewards=TINY_REWARDS)
    finally:
        held.close()
    assert snapshot(out) == before


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_accelerate_cpu_launch_of_several_processes_is_refused_with_the_launch_that_works(
    tiny, tmp_path, monkeypatch, module
):
    """`accelerate launch --cpu --num_processes 2` starts one process with MASTER_ADDR and ACCELERATE_USE_CPU set and
    no WORLD_SIZE (accelerate's simple launcher): refused before the run folder exists, naming --multi_gpu. Under
    --multi_gpu (WORLD_SIZE set) or a single --cpu process (no MASTER_ADDR) the same check passes."""
    script, out = __import__(module), tmp_path / "run"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match=r"accelerate launch --multi_gpu --num_processes N .* --device cpu"):
        script.validate(script.parse_args(tiny_argv(tiny, out)), extra_rewards=TINY_REWARDS)
    assert not out.exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    checks.check_launch()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("MASTER_ADDR")
    checks.check_launch()


def test_out_inside_a_run_is_refused(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)
    script = finished_run.script
    for inner in (out / "checkpoints" / "iter_000001" / "new", out / "sub" / "run"):
        with pytest.raises(SystemExit, match="lies inside the run folder"):
            script.validate(script.parse_args(tiny_argv_for(finished_run, inner)), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


def test_only_the_programs_own_tmp_files_are_deleted(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    ckpts = out / "checkpoints"
    for mine in (out / "notes.tmp", ckpts / "mine.tmp"):
        mine.write_text("the user's")
    (out / "drafts.tmp").mkdir()
    (out / "config.json.tmp").write_text("{")
    (ckpts / "iter_000007.tmp").mkdir()
    (ckpts / "latest.tmp").write_text("iter_0000")
    script = finished_run.script
    script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert (out / "notes.tmp").read_text() == (ckpts / "mine.tmp").read_text() == "the user's"
    assert (out / "drafts.tmp").is_dir()
    assert not any(p.exists() for p in (out / "config.json.tmp", ckpts / "iter_000007.tmp", ckpts / "latest.tmp"))


def test_a_damaged_metrics_line_before_the_last_is_refused_not_dropped(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(["{broken", *lines[1:]]) + "\n")
    before = snapshot(out)
    script = finished_run.script
    with pytest.raises(SystemExit, match="line 1 of 2 is damaged"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: "{not json", "not readable JSON"),
        (lambda c: json.dumps({**c, "args": []}), 'does not hold an "args" object'),
        (lambda c: json.dumps({**c, "args": {**c["args"], "lr": "fast"}}), "args.lr is 'fast', not of type float"),
        (lambda c: json.dumps({**c, "args": {**c["args"], "steps": 2.5}}), "args.steps is 2.5, not of type int"),
        (lambda c: json.dumps({**c, "args": {**c["args"], "ema": "yes"}}), "args.ema is 'yes', not of type bool"),
        (lambda c: json.dumps({**c, "script": None}), 'its "script" is None'),
    ],
)
def test_a_hand_edited_config_is_a_clear_error_not_a_traceback(finished_run, tmp_path, edit, words):
    out = copy_of(finished_run, tmp_path)
    (out / "config.json").write_text(edit(json.loads((out / "config.json").read_text())))
    before = snapshot(out)
    with pytest.raises(SystemExit, match=re.escape(words) + ".*Repair the file"):
        finished_run.script.parse_args(["--resume", str(out)])
    assert snapshot(out) == before


def test_embedded_world_prompts_outside_its_grammar_are_refused_before_the_model_loads(tmp_path):
    path = tmp_path / "heldout.txt"
    path.write_text("two red circles\na purple hexagon\n")
    with pytest.raises(SystemExit, match="line 2, 'a purple hexagon', is outside the embedded world's captions"):
        recast.validate(recast.parse_args(["--eval-prompts", str(path), "--out", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists()
    path.write_text("two red circles\n" + "a purple hexagon " * 400 + "\n")  # a 6.8 kB line: its start is echoed
    with pytest.raises(
        SystemExit, match=r"line 2, 'a purple hexagon a purple.{40,80}\.\.\. \(6799 characters\)"
    ) as err:
        recast.validate(recast.parse_args(["--eval-prompts", str(path), "--out", str(tmp_path / "run")]))
    assert len(str(err.value)) < 400
    path.write_bytes("\ufefftwo red circles\na blue square\n".encode())  # a byte-order mark, as some editors save
    assert checks.read_prompts(path) == ["two red circles", "a blue square"]
    recast.validate(recast.parse_args(["--eval-prompts", str(path), "--out", str(tmp_path / "run")]))


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_a_non_finite_loss_stops_before_the_step_and_keeps_the_last_good_checkpoint(
    tiny, tmp_path, module, monkeypatch
):
    script = __import__(module)
    out = tmp_path / "run"
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "1", "--eval-every", "0")), extra_rewards=TINY_REWARDS
    )
    before = snapshot(out)
    holder, loss = (nft, "nft_loss") if module == "recast" else (script, "rvge_loss")
    monkeypatch.setattr(holder, loss, lambda *a, **k: torch.full((len(a[0]),), float("nan")))
    with pytest.raises(SystemExit, match="non-finite"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k != "config.json"} == {
        k: v for k, v in before.items() if k != "config.json"
    }


BAD_FLAGS = [
    ["--iterations", "0"],
    ["--iterations", "-1"],
    ["--train-batch", "0"],
    ["--prompts-per-iter", "0"],
    ["--n-branch", "0"],
    ["--n-roots", "0"],
    ["--resolution", "7"],
    ["--lora-rank", "0"],
    ["--updates-per-iter", "0"],
    ["--rollout-batch", "0"],
    ["--train-steps-per-leaf", "0"],
    ["--save-every", "0"],
    ["--seed", "-1"],
    ["--lr", "-1"],
    ["--lr", "nan"],
    ["--sde-a", "nan"],
    ["--grad-clip", "nan"],
    ["--gain-ema", "nan"],
    ["--gain-ema", "5"],
    ["--steps", "2"],
    ["--device", "bogus"],
    ["--weight-decay", "inf"],
]


@pytest.mark.parametrize("change", BAD_FLAGS, ids=lambda c: " ".join(c))
@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_every_numeric_flag_is_checked_before_anything_is_written(tiny, tmp_path, change, module):
    script = __import__(module)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=re.escape(change[0])):
        script.validate(script.parse_args(tiny_argv(tiny, out, *change)), extra_rewards=TINY_REWARDS)
    assert not out.exists()


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read it"),
        (b"\x00\x01\x02", "binary"),
        ("caf\xe9".encode("latin-1"), "not UTF-8"),
        (b"\n\n", "no prompts"),
    ],
)
def test_prompt_files_are_checked(tiny, tmp_path, content, words):
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit, match=words):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--train-prompts", str(path))),
            extra_rewards=TINY_REWARDS,
        )
    one = tmp_path / "one.txt"
    one.write_text("a red circle\n")
    with pytest.raises(SystemExit, match="at least 2 prompts"):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--eval-prompts", str(one))), extra_rewards=TINY_REWARDS
        )


def test_t5_prompt_length_is_diffusionnfts_128_off_the_embedded_model(tiny, tmp_path):
    """Without --max-sequence-length a model other than the embedded one encodes T5 at 128 tokens (DiffusionNFT's
    length): the text states are the CLIP tokens followed by 128 T5 tokens."""
    argv = tiny_argv(tiny, tmp_path / "run")
    i = argv.index("--max-sequence-length")
    argv = argv[:i] + argv[i + 2 :]
    run = recast.setup_run(recast.parse_args(argv), extra_rewards=TINY_REWARDS)
    emb, _ = sd3.encode(run.pipe, ["a red circle"], run.max_len, run.acc.device)
    assert run.max_len == 128 and emb.shape[1] == run.pipe.tokenizer.model_max_length + 128
    run.lock.close()


def test_file_prompts_are_drawn_as_diffusionnft_draws_them():
    """DiffusionNFT's sampler: per iteration one permutation of the lines, split over processes: no prompt twice in an
    iteration (all processes together), every line equally likely over iterations; a short file is cycled."""
    lines = [f"prompt {i}" for i in range(12)]
    counts = dict.fromkeys(lines, 0)
    for it in range(600):
        drawn = [p for rank in range(3) for p in checks.distinct_prompts(lines, 4, [0, it], rank, 3)]
        assert len(drawn) == len(set(drawn)) == 12
        for p in checks.distinct_prompts(lines, 4, [1, it], 0, 1):
            counts[p] += 1
    assert min(counts.values()) > 0.7 * 600 * 4 / 12 and max(counts.values()) < 1.3 * 600 * 4 / 12
    short = [p for rank in range(2) for p in checks.distinct_prompts(lines[:3], 4, [0, 0], rank, 2)]
    assert set(short[:3]) == set(lines[:3]) and short[3:6] == short[:3] and short[6:] == short[:2]


def test_unclear_cases_now_name_the_real_problem(tiny, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit, match=re.escape(f"--model {missing}: no such folder")):
        recast.validate(recast.parse_args(["--model", str(missing)]))
    with pytest.raises(SystemExit, match="--steps 2: must be"):
        recast.validate(
            recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--steps", "2")), extra_rewards=TINY_REWARDS
        )
    with pytest.raises(SystemExit, match="--train-prompts is not used with the embedded model"):
        recast.validate(recast.parse_args(["--train-prompts", str(tiny / "prompts.txt"), "--out", str(tmp_path / "e")]))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU is visible"):
            recast.validate(
                recast.parse_args(tiny_argv(tiny, tmp_path / "run", "--device", "cuda")), extra_rewards=TINY_REWARDS
            )


def test_checkpoint_write_failure_says_disk_and_keeps_the_last_good_one(finished_run, tmp_path, monkeypatch):
    script = finished_run.script
    out = copy_of(finished_run, tmp_path)
    before = snapshot(out)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit, match="is the disk full"):
        script.train(script.parse_args(["--resume", str(out), "--iterations", "3"]), extra_rewards=TINY_REWARDS)
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints")} == {
        k: v for k, v in before.items() if k.startswith("checkpoints")
    }


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_help_reads_as_sections_with_every_flag_in_its_own(module, capsys):
    """--help lists the flags in the sections of ARG_GROUPS, in that order, each flag under its Args group;
    the reward-model defaults are reward_models.DEFAULTS (one place for each default); every field has its help
    string written under it."""
    script = __import__(module)
    assert set(flags.field_docs(script.Args)) == {f.name for f in fields(script.Args)}
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    heads = [text.index(f"\n{title}:\n") for title in script.ARG_GROUPS]
    assert heads == sorted(heads) and set(f.metadata["group"] for f in fields(script.Args)) == set(script.ARG_GROUPS)
    ends = dict(zip(script.ARG_GROUPS, heads[1:] + [len(text)]))
    for f in fields(script.Args):
        at = re.search(rf"\n  --{f.name.replace('_', '-')}\b", text).start()
        assert text.index(f"\n{f.metadata['group']}:\n") < at < ends[f.metadata["group"]], f.name
        shown = " ".join(text[at : text.find("\n  --", at + 1)].split())
        assert re.search(r"\(default: \S", shown), f"--help shows no default of {f.name}"
    flat = " ".join(text.split())
    assert "(default: '')" not in flat and "(default: None)" not in flat  # words: none, off
    rewards, examples = text.split("\nrewards (--rewards")[1].split("\nexamples:\n")  # the epilog, after the flags
    world = worlds.load_world(worlds.EMBEDDED_MODEL)
    own = [k for k, f in world.REWARDS.items() if f.__module__.startswith("world.")]  # the world's own rewards
    for name in [*reward_models.REWARD_MODELS, *own]:  # (an experiment's world may register more: not the CLI's)
        assert re.search(rf"\b{name}\b", rewards), f"--help does not name the reward {name}"
    assert all(f" {flag}" in examples for flag in ("--config configs/", "--resume", "--dry-run", "--eval-every 0"))
    for name in ("pickscore_model", "pickscore_processor", "clip_model", "geneval_url", "geneval_key"):
        assert getattr(script.Args(), name) == reward_models.DEFAULTS[name]


@dataclass
class BaseFlags:
    out: str = nft.flag("", "I/O")
    """the base's help for --out"""
    name: str = nft.flag("", "I/O")
    """the base's help for --name"""


@dataclass
class ScriptFlags(BaseFlags):
    lr: float = nft.flag(1.0, "method", gt=0)
    """the script's help for --lr"""
    name: str = nft.flag("mine", "I/O")
    """the script's help for --name"""


def test_inherited_flags_keep_their_help_and_the_usage_line_follows_the_sections(capsys):
    """field_docs walks the base classes (RunArgs's fields sit in kit/flags.py, not in the script), a field the
    subclass redefines takes its own help and default, and --help's usage line lists the flags section by section
    (the base's fields come first in dataclass order)."""
    assert flags.field_docs(ScriptFlags) == {
        "out": "the base's help for --out",
        "name": "the script's help for --name",
        "lr": "the script's help for --lr",
    }
    parser = flags.make_parser(ScriptFlags, {"method": "m", "I/O": "io"}, "doc")
    assert [a.dest for a in parser._actions] == ["help", "lr", "out", "name", "config"]
    assert parser.parse_args([]).name == "mine"
    assert set(flags.field_docs(flags.RunArgs)) == {f.name for f in fields(flags.RunArgs)}


def test_the_dry_runs_activation_term_is_the_memory_fits_measurement():
    """--dry-run's activations (checks.activation_bytes): the coefficients are the fit of experiments/results/memory-fit
    (SD3.5-M's real blocks forward and backward on the CPU, bf16, 512 px), and for the whole 24-block model at one
    sample they give the peak measured there: 2.46 GiB without gradient checkpointing (within 2%), 0.27 with it (the
    fit 11% high, within 15%)."""
    fit = json.loads((Path(flags.__file__).parents[1] / "experiments/results/memory-fit/results.json").read_text())
    for ckpt, key in ((False, "bfloat16 dual ckpt=off"), (True, "bfloat16 dual ckpt=on")):
        measured = fit["fits"][key]["peak_delta"]["a_over_tokens_hidden_2"]
        assert checks.ACTIVATION_UNITS[ckpt][0] == pytest.approx(measured, abs=0.06)
    assert checks.ACTIVATION_UNITS[False][1] == pytest.approx(
        fit["fits"]["bfloat16 plain ckpt=off"]["peak_delta"]["a_over_tokens_hidden_2"], abs=0.06
    )
    config = json.loads((Path(flags.__file__).parents[1] / "world/assets/sd3.5-medium-transformer.json").read_text())
    whole = fit["reconciliation"]["check_whole_model"]
    for ckpt, tolerance in ((False, 0.02), (True, 0.15)):
        args = SimpleNamespace(train_batch=1, gradient_checkpointing=ckpt, dtype="", mixed_precision="no")
        got = checks.activation_bytes(args, config, (512 // 16) ** 2 + 77 + 128) / 2**30
        assert got == pytest.approx(whole["on" if ckpt else "off"]["measured_B1_GiB"], rel=tolerance)


@pytest.mark.parametrize("module, ema", [("recast", False), ("rvge", True)])
def test_dry_run_attaches_lora_to_sd35_medium_on_the_meta_device(capsys, recwarn, module, ema):
    """The plan's numbers, its GiB column aligned down to the total, and no peft warning about the second adapter
    (several adapters on one model are the design); with --ema (one script each way: a meta build takes ~20 s) the
    EMA is a third adapter."""
    info = __import__(module).main(["--dry-run"] + ["--ema"] * ema)
    assert 2.0e9 < info["total_params"] < 3.0e9  # SD3.5-Medium's transformer is ~2.5B parameters, adapters apart
    # r = 32 on every targeted (in, out) linear; 24 blocks, the last one has no to_add_out
    assert info["lora_layers"] == 24 * 7 + 23
    assert info["trainable_params"] > 1e7
    plan = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" GiB")]
    assert len(plan) == 7 and plan[-1].lstrip().startswith("total") and len({len(line) for line in plan}) == 1
    assert not [w for w in recwarn if "peft_config" in str(w.message)]
    lora_gib = 4 * info["trainable_params"] / 2**30  # one adapter's fp32 weights
    adapters = "3 LoRA adapters (default, old, ema; fp32)" if ema else "2 LoRA adapters (default, old; fp32)"
    assert info["memory_gib"][adapters] == pytest.approx((2 + ema) * lora_gib)


# -----------------------------------------------------------------------------
# Nothing of the kit is defined again in a script; a seeded run's numbers, compared
# -----------------------------------------------------------------------------


def imports_of(path):
    """The top-level names a file imports, lazy imports inside functions included (`import a.b` and `from a.b import
    c` give a)."""
    import ast

    tree = ast.parse(Path(path).read_text())
    return {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }


KIT = sorted(Path(flags.__file__).parent.glob("*.py"))


def test_the_layers_method_nft_model_and_the_kit_beside():
    """One iteration reads method -> DiffusionNFT -> model: nft.py imports only the model file (sd3.py) of the project,
    sd3.py nothing of it; the kit imports no world and no method script (nft.py and sd3.py it may: it loads the model
    and logs DiffusionNFT's metrics); recast.py and rvge.py import no world module (the model folder names its world,
    `worlds.load_world`); no definition of the kit is written again in a script."""
    import ast

    project = {p.stem for p in Path(nft.__file__).parent.glob("*.py")} | {"kit", "world", "experiments", "tests"}
    assert imports_of(nft.__file__) & project == {"sd3"}
    assert imports_of(sd3.__file__) & project == set()
    for module in KIT:
        assert not imports_of(module) & {"world", "recast", "rvge", "experiments", "evaluate"}, module.name
    for script in (recast, rvge):
        assert "world" not in imports_of(script.__file__), script.__name__

    def names(path):
        tree = ast.parse(Path(path).read_text())
        return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    kit = set().union(*(names(m) for m in KIT))
    for module in (recast, rvge, nft, sd3):
        assert not names(module.__file__) & kit, module.__name__
    assert {"global_stats", "frozen_velocities", "optimizer_step", "NFTArgs", "score"} <= names(nft.__file__)
    assert {"velocity", "copy_adapter", "encode", "decode", "load_pipeline"} <= names(sd3.__file__)


def test_no_kit_module_names_a_method():
    """The kit knows no method by name: a script passes what is its own (resume-fixed flags, whether W is drawn,
    whether W's departure is printed); no kit module compares a script name or a --credit value."""
    for module in KIT:
        text = module.read_text()
        assert not re.search(r"""["'](recast|rvge|nft|recast_reversed|uniform)["']""", text), module.name


def test_the_shared_flags_are_written_once_and_a_script_redefines_one_only_to_change_it():
    """nft.NFTArgs holds the rewards, rollout and optimisation flags both scripts take: each script's Args inherits
    them, and a field a script writes again changes its default or its help (never the same text twice)."""
    import ast
    import inspect

    shared = {f.name: f for f in fields(nft.NFTArgs)}
    base_docs = flags.field_docs(nft.NFTArgs)
    assert {"rewards", "budgets", "steps", "sde_a", "train_batch", "lr", "lora_rank"} <= set(shared)
    for script in (recast, rvge):
        assert issubclass(script.Args, nft.NFTArgs), script.__name__
        body = ast.parse(inspect.getsource(script.Args)).body[0].body
        written = {a.target.id for a in body if isinstance(a, ast.AnnAssign)}
        mine, docs = {f.name: f for f in fields(script.Args)}, flags.field_docs(script.Args)
        for name in written & set(shared):
            changed = mine[name].default != shared[name].default or docs[name] != base_docs[name]
            assert changed, f"{script.__name__}.Args writes --{name} again unchanged: leave it to nft.NFTArgs"


def metrics_without_times(path):
    """The lines of a metrics.jsonl with the wall-clock keys (time/*) left out, each re-serialised as it was written."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [json.dumps({k: v for k, v in row.items() if not k.startswith("time/")}) for row in rows]


def same_metrics(a, b):
    """(True, "") when two metrics.jsonl files hold the same lines apart from time/* keys, else (False, the first
    line that differs)."""
    left, right = metrics_without_times(a), metrics_without_times(b)
    for i, (x, y) in enumerate(zip(left, right)):
        if x != y:
            return False, f"line {i + 1} differs:\n{x[:300]}\n{y[:300]}"
    if len(left) != len(right):
        return False, f"{len(left)} lines against {len(right)}"
    return True, ""


def test_same_metrics_ignores_times_only(tmp_path):
    row = {"iteration": 0, "reward/a": 0.5, "time/update": 1.0, "recast/W": [[0.1, 0.2]]}
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text(json.dumps(row) + "\n")
    b.write_text(json.dumps({**row, "time/update": 2.5}) + "\n")
    c.write_text(json.dumps({**row, "recast/W": [[0.1, 0.2000000001]]}) + "\n")
    assert same_metrics(a, b) == (True, "")
    assert not same_metrics(a, c)[0] and "line 1 differs" in same_metrics(a, c)[1]
    d = tmp_path / "d.jsonl"
    d.write_text(a.read_text() * 2)
    assert same_metrics(a, d) == (False, "1 lines against 2")


if __name__ == "__main__" and sys.argv[1:2] == ["--same-metrics"]:
    for a, b in zip(sys.argv[2::2], sys.argv[3::2]):
        same, why = same_metrics(
            Path(a) / "metrics.jsonl" if Path(a).is_dir() else a, Path(b) / "metrics.jsonl" if Path(b).is_dir() else b
        )
        print(f"{a} vs {b}: {'same apart from time/*' if same else why}")


@pytest.mark.parametrize("script", [recast, rvge])
def test_resume_never_takes_overwrite_from_the_saved_run(tmp_path, script):
    """A run started with --overwrite saves overwrite = true in its config.json; resuming it must not replay the
    overwrite (start_or_resume would delete the run's checkpoints and metrics)."""
    run = tmp_path / "run"
    run.mkdir()
    saved = {**vars(script.Args()), "overwrite": True, "name": "first", "out": str(run)}
    (run / "config.json").write_text(json.dumps({"script": script.__name__, "args": saved}))
    args = script.parse_args(["--resume", str(run)])
    assert args.overwrite is False and args.name == "" and args.out == str(run)


# -----------------------------------------------------------------------------
# --config files: the recipes in configs/, a run's config.json, bad files
# -----------------------------------------------------------------------------

SD35M = "--model stabilityai/stable-diffusion-3.5-medium --resolution 512 --steps 10 --num-processes 8"
CADENCE = "--iterations 100000 --eval-every 10 --save-every 30 --keep-checkpoints 0"  # DiffusionNFT's
NFT = (
    f"--credit nft --budgets 1 {SD35M} --max-sequence-length 128 --sampler ode --n-roots 24 --prompts-per-iter 6 --ema "
    f"--eval-steps 40 --lr 3e-4 --rollout-batch 8 --train-batch 9 --mixed-precision fp16 {CADENCE} --base-reg 1e-4"
)
GENEVAL_SERVER = "--geneval-url http://127.0.0.1:18085 --geneval-metadata"
AESTHETIC = "--aesthetic-mlp reward_ckpts/sac+logos+ava1-l14-linearMSE.pth"
HPSV2 = "--hpsv2-checkpoint reward_ckpts/HPS_v2.1_compressed.pt"
TWIN = (  # the matched DiffusionNFT baselines of the methods' recipes
    f"--credit nft {SD35M} --sampler ode --n-roots 24 --prompts-per-iter 6 --updates-per-iter 1 "
    "--train-steps-per-leaf 9 --nft-b 0.1 --base-reg 1e-4 --ema --eval-steps 40 --lr 3e-4 --rollout-batch 8 "
    "--train-batch 9 --mixed-precision fp16 --iterations 1000 --eval-every 10 --save-every 30 --keep-checkpoints 0"
)
PROMPTS = "--train-prompts dataset/{0}/train.txt --eval-prompts dataset/{0}/test.txt"  # DiffusionNFT's layout
OWN = "--train-prompts train_prompts.txt --eval-prompts eval_prompts.txt"
RECIPES = {  # configs/<file>: the SD3.5-M commands as flags (DiffusionNFT's config/nft.py settings; see NOTES.md)
    "nft-geneval.yaml": f"{NFT} --rewards geneval --updates-per-iter 1 --train-steps-per-leaf 9 --nft-b 1 "
    f"--old-decay 1 {GENEVAL_SERVER} dataset/geneval/metadata.jsonl {PROMPTS.format('geneval')}",
    "nft-pickscore.yaml": f"{NFT} --rewards pickscore --updates-per-iter 1 --train-steps-per-leaf 9 --nft-b 1 "
    f"--old-decay 1 {PROMPTS.format('pickscore')}",
    "nft-ocr.yaml": f"{NFT} --rewards ocr --updates-per-iter 2 --train-steps-per-leaf 9 --nft-b 0.1 --old-decay 2 "
    f"{PROMPTS.format('ocr')}",
    "nft-hpsv2.yaml": f"{NFT} --rewards hpsv2 --updates-per-iter 1 --train-steps-per-leaf 9 --nft-b 1 "
    f"--old-decay 1 {HPSV2} {PROMPTS.format('pickscore')}",
    "nft-multi.yaml": f"{NFT} --rewards pickscore,hpsv2,clipscore --budgets 1,1,1 --updates-per-iter 1 "
    f"--nft-b 0.1 --old-decay 1 --steps 25 --train-steps-per-leaf 24 {HPSV2} {PROMPTS.format('pickscore')}",
    "recast-sd35m.yaml": f"--credit recast {SD35M} --rewards pickscore,clipscore,aesthetic,ocr --budgets "
    f"0.4,0.3,0.2,0.1 {AESTHETIC} {OWN} --n-roots 3 "
    "--n-branch 8 --branch-steps rotate --prompts-per-iter 6 --updates-per-iter 1 --train-steps-per-leaf 9 "
    "--nft-b 0.1 --ema --eval-steps 40 --lr 3e-4 --rollout-batch 8 --train-batch 9 --mixed-precision fp16 "
    "--iterations 1000 --base-reg 1e-4 "
    "--eval-every 10 --save-every 30 --keep-checkpoints 0",
    "rvge-sd35m.yaml": f"{SD35M} --rewards geneval,ocr,pickscore,clipscore,aesthetic --budgets 1,1,1,1,1 "
    f"{GENEVAL_SERVER} geneval_metadata.jsonl {AESTHETIC} {OWN} --n-roots 6 --n-branch 4 --branch-steps 7 "
    "--prompts-per-iter 6 --updates-per-iter 1 --train-steps-per-leaf 9 --ema --eval-steps 40 --lr 3e-4 "
    "--rollout-batch 8 --train-batch 9 --mixed-precision fp16 --iterations 1000 --eval-every 10 --save-every 30 "
    "--keep-checkpoints 0",
    "nft-recast-sd35m.yaml": f"{TWIN} --rewards pickscore,clipscore,aesthetic,ocr --budgets 0.4,0.3,0.02,0.1 "
    f"{AESTHETIC} {OWN}",
    "nft-rvge-sd35m.yaml": f"{TWIN} --rewards geneval,ocr,pickscore,clipscore,aesthetic --budgets 1,1,1,1,0.1 "
    f"{GENEVAL_SERVER} geneval_metadata.jsonl {AESTHETIC} {OWN}",
    "recast-embedded.yaml": "",  # the embedded default: `python recast.py`
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_file_parsed_equals_the_same_flags(recipe):
    """Each file in configs/ gives the Args its command gives (rvge-* for rvge.py, the rest recast.py), and the
    README or configs/README.md runs it by name."""
    script = rvge if recipe.startswith("rvge") else recast
    root = Path(__file__).resolve().parents[1]
    assert script.parse_args(["--config", str(root / "configs" / recipe)]) == script.parse_args(RECIPES[recipe].split())
    docs = (root / "README.md").read_text() + (root / "configs" / "README.md").read_text()
    assert f"--config configs/{recipe}" in docs
    assert sorted(p.name for p in (root / "configs").glob("*.yaml")) == sorted(RECIPES)  # reference/: not a recipe


def test_flags_on_the_command_line_override_the_config_file(tmp_path):
    """Keys take dashes or underscores; a flag given overrides the file's value, also a true switch (--no-ema);
    YAML 1.1's 3e-4 (text to PyYAML) reads as a number; JSON files too."""
    (tmp_path / "c.yaml").write_text("n_roots: 3\nn-branch: 5\nema: true\nlr: 3e-4\n")
    args = recast.parse_args(["--config", str(tmp_path / "c.yaml"), "--n-branch", "6", "--no-ema"])
    assert (args.n_roots, args.n_branch, args.ema, args.lr) == (3, 6, False, 3e-4)
    assert args == recast.parse_args(["--n-roots", "3", "--n-branch", "6", "--lr", "3e-4"])
    (tmp_path / "c.json").write_text(json.dumps({"seed": 5, "dry-run": True}))
    assert rvge.parse_args(["--config", str(tmp_path / "c.json")]) == rvge.parse_args(["--seed", "5", "--dry-run"])


def test_a_runs_config_json_is_a_config_file_for_a_new_run(finished_run):
    """A run's saved config.json given to --config repeats its settings in a new run folder: out, resume and
    overwrite are not taken from it."""
    script, saved = finished_run.script, json.loads((finished_run.out / "config.json").read_text())["args"]
    args = script.parse_args(["--config", str(finished_run.out / "config.json")])
    assert asdict(args) == {**saved, "out": "", "resume": "", "overwrite": False}
    other = rvge if script is recast else recast
    with pytest.raises(SystemExit, match=f"a run of {script.__name__}.py; give it to {script.__name__}.py"):
        other.parse_args(["--config", str(finished_run.out / "config.json")])


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("c.yaml", "n-root: 3\n", "unknown key 'n-root'; did you mean n-roots?"),
        ("c.yaml", "seed: 1.5\n", "seed is 1.5, not of type int. Fix it in the file"),
        ("c.yaml", "budgets: 1\n", "budgets is 1, not of type str. Fix it in the file (quote a text value"),
        ("c.yaml", "ema: yes please\n", "ema is 'yes please', not of type bool"),
        ("c.yaml", "lr: -1.0\n", "lr -1.0: must be a finite number > 0. Fix it in the file"),
        (
            "c.yaml",
            "credit: grpo\n",
            "credit 'grpo': choose one of ['recast', 'uniform', 'nft', 'recast_reversed', 'file']",
        ),
        ("c.yaml", "- lr\n", "must hold key: value lines (a mapping), not list"),
        ("c.yaml", "lr: [1\n", "cannot read it"),
        ("c.toml", "lr = 1\n", "give a .yaml, .yml or .json file"),
        ("c.json", "{lr: 1}", "cannot read it"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_the_key_and_the_fix(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as err:
        recast.parse_args(["--config", str(tmp_path / name)])
    assert str(err.value).startswith(f"--config {tmp_path / name}: ") and words in str(err.value)


def test_config_does_not_go_with_resume(finished_run, tmp_path):
    """--resume takes its settings from the run's config.json; a --config beside it is refused, not merged."""
    run = copy_of(finished_run, tmp_path)
    (tmp_path / "c.yaml").write_text("iterations: 3\n")
    with pytest.raises(SystemExit, match="does not go with --resume"):
        finished_run.script.parse_args(["--resume", str(run), "--config", str(tmp_path / "c.yaml")])


# -----------------------------------------------------------------------------
# The closing summary
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_the_run_ends_with_before_after_W_departure_and_the_checkpoint_to_load(tiny, tmp_path, module, capsys):
    """After the progress bar the first process prints the held-out before -> after of each reward, the weighted
    reward and each judge (eval_before/* and the last eval/* of metrics.jsonl), ReCAST's W departure from uniform
    (recast.py only), the run folder and the lines of Python that load the newest checkpoint: for a model other than
    the embedded one (SD3.5-M; here the tiny pipeline saved to disk) configs/README.md's, with torch imported, in
    bfloat16, moved to "cuda" (executed here on "cpu" where no GPU is)."""
    from diffusers import StableDiffusion3Pipeline

    script, out = __import__(module), tmp_path / "run"
    judges = {"bright": brightness}
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "1")),
        extra_rewards=TINY_REWARDS,
        judges=judges,
    )
    printed = capsys.readouterr().out.splitlines()
    rows = read_metrics(out)
    assert printed[0] == "held-out evaluation, pretrained -> after iteration 1 (2 trained):"
    for key in ("brightness", "redness", "weighted", "judge/bright"):
        was, now = rows[0][f"eval_before/{key}"], rows[-1][f"eval/{key}"]
        assert f"  {key:<24} {was:9.4f} -> {now:9.4f}   ({now - was:+.4f})" in printed
    departure = [line for line in printed if line.startswith("W's departure from uniform")]
    if module == "recast":
        W = np.asarray(rows[-1]["recast/W"])
        worst = np.abs(W / (W.sum(1, keepdims=True) / W.shape[1]) - 1).max(1)
        assert departure == [
            "W's departure from uniform, max_j |W_kj / (lambda_k / T) - 1| (0: uniform): "
            f"brightness {worst[0]:.3f}, redness {worst[1]:.3f}"
        ]
    else:
        assert departure == []
    assert f"run folder: {out}" in printed
    assert f"trained LoRA: {out / 'checkpoints' / 'iter_000001'}" in printed
    notices, handler = [], logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(handler)  # diffusers' loggers do not propagate to the root
    try:
        assert printed[-3] == "  import torch; from diffusers import StableDiffusion3Pipeline"
        load = printed[-2].strip()
        assert f'from_pretrained("{tiny / "pipe"}", dtype=torch.bfloat16); ' in load and load.endswith(
            'pipe.to("cuda")'
        )
        readme = (Path(__file__).resolve().parents[1] / "configs" / "README.md").read_text()
        assert 'from_pretrained("stabilityai/stable-diffusion-3.5-medium", dtype=torch.bfloat16)' in readme
        assert "import torch\n" in readme and '\npipe.to("cuda")\n' in readme  # the snippet the lines follow
        device = "cuda" if torch.cuda.is_available() else "cpu"
        namespace = {}
        exec(printed[-3].strip(), namespace)
        exec(load.replace('"cuda"', f'"{device}"'), namespace)  # the printed lines load the LoRA; diffusers is silent
        assert namespace["pipe"].transformer.dtype == torch.bfloat16 and namespace["pipe"].device.type == device
        assert not [n for n in notices if "No LoRA keys" in n]
        usual = StableDiffusion3Pipeline.from_pretrained(str(tiny / "pipe"))
        usual.load_lora_weights(out / "checkpoints" / "iter_000001")  # diffusers' usual loader: the same weights
        assert len([n for n in notices if "No LoRA keys associated to CLIPTextModelWithProjection" in n]) == 2
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    # the next line samples with the run's settings (no CFG, its evaluation steps, T5 tokens and size) and says so
    assert printed[-1] == (
        "  image = pipe('a red circle', height=16, width=16, num_inference_steps=10, guidance_scale=1.0, "
        "max_sequence_length=8).images[0]  # as trained and evaluated: no CFG, 10 steps, 8 T5 tokens, 16 px"
    )
    exec(printed[-1].strip(), namespace)
    assert namespace["image"].size == (16, 16)
    (loaded,) = namespace["pipe"].transformer.peft_config.values()
    assert (loaded.r, loaded.lora_alpha) == (4, 8)  # the run's --lora-rank 4 --lora-alpha 8, read from the folder
    lora = {k: v for k, v in usual.transformer.state_dict().items() if "lora" in k}
    trained = namespace["pipe"].transformer.state_dict()
    assert lora and all(torch.equal(v.to(torch.bfloat16), trained[k].cpu()) for k, v in lora.items())


def test_the_summary_of_a_run_without_evaluation_says_so(finished_run, capsys):
    lines = figures.print_summary(finished_run.out)
    assert lines[0].startswith("held-out evaluation: none in this run") and f"run folder: {finished_run.out}" in lines
    assert capsys.readouterr().out.splitlines() == lines


@pytest.mark.parametrize("module", ["recast", "rvge"])
def test_one_iteration_enters_the_kit_through_four_calls(tiny, tmp_path, module):
    """Between the top of train's loop and its end, one iteration reads method -> DiffusionNFT -> model and enters the
    kit (a frame of kit/ called from recast.py, rvge.py, nft.py or sd3.py) through four functions only: the prompts,
    the permuted-reward control, the stop when a reward failed and step 4 (the rollouts' diagnostics, metrics line,
    evaluation, checkpoint).
    Counted over iteration 1 of 3 (it evaluates and checkpoints too; the closing summary after the loop is not
    counted)."""
    script, kit = __import__(module), str(Path(flags.__file__).parent) + os.sep
    method = {str(Path(m.__file__)) for m in (recast, rvge, nft, sd3)}
    entered, on = set(), {"it": None}

    def profile(frame, event, arg):
        if event == "call" and on["it"] == 1 and frame.f_code.co_filename.startswith(kit):
            if frame.f_back is not None and frame.f_back.f_code.co_filename in method:
                entered.add(frame.f_code.co_name)

    generator = nft.iteration_generator

    def iteration_generator(seed, it):  # the top of each iteration of the loop
        on["it"] = it
        return generator(seed, it)

    argv = tiny_argv(tiny, tmp_path / "run", "--iterations", "3", "--eval-every", "2", "--save-every", "1")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(nft, "iteration_generator", iteration_generator)
        sys.setprofile(profile)
        try:
            script.train(script.parse_args(argv), extra_rewards=TINY_REWARDS)
        finally:
            sys.setprofile(None)
    assert entered == {"prompts_for", "permuted", "stop_if_a_reward_failed", "finish_iteration"}
