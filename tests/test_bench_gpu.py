"""bench_gpu.py --tiny: the GPU profiler runs the real training loops on CPU at toy size (the three methods, and the
configs/ recipes with toy sizes over their own flags) and reports every phase with finite, positive times and FLOP
counts that match the loop's structure; out of memory it retries with halved micro-batches."""

import json
import math

import pytest
import torch

import nft
import recast
import rvge
import sd3
from experiments import bench_gpu


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    threads = torch.get_num_threads()
    result = bench_gpu.main(["--tiny", "--out", str(out)])
    assert torch.get_num_threads() == threads  # --tiny runs on one thread and gives the others back
    return result, json.loads((out / "bench_gpu.json").read_text()), (out / "bench_gpu.md").read_text()


def test_tiny_run_reports_every_method_and_phase_with_positive_times_and_flops(tiny_report):
    result, saved, table = tiny_report
    assert saved == json.loads(json.dumps(result))
    assert "STAND-INS" in table and saved["matmul_tflops"]["float32"] > 0
    assert set(saved["runs"]) == {"recast", "nft", "rvge"}
    for method, run in saved["runs"].items():
        F = run["flops_per_sample"]
        # one forward, forward + backward (the backward is counted, not assumed) and one VAE decode
        assert 0 < F["transformer_forward"] < F["transformer_forward_backward"] < 4 * F["transformer_forward"]
        assert F["vae_decode"] > 0 and run["transformer_params"] > 0 and run["computes_in"] == "float32"
        assert run["scale"] == 1.0 and f"| {method} | {run['script']}.py | float32 | 2 (2) | 8 / 8 |" in table
        phases = run["phases"]
        for phase in ["rollout", "reward", "gains+W", "update", "iteration"]:
            row = phases[phase]
            assert math.isfinite(row["seconds"]) and row["seconds"] > 0, (method, phase)
            assert f"| {method} | {phase} |" in table or f"| {method} | **{phase}** |" in table
            if phase != "gains+W":
                assert row["tflop"] > 0 and math.isfinite(row["tflops"]) and 0 < row["mfu"], (method, phase)
        assert phases["iteration"]["seconds"] == pytest.approx(sum(phases[p]["seconds"] for p in bench_gpu.PHASES))
        assert phases["iteration"]["tflop"] == pytest.approx(sum(phases[p]["tflop"] for p in bench_gpu.PHASES))


def test_counted_samples_match_the_tree_and_the_update(tiny_report):
    """TINY: 2 prompts x 2 roots, branching x2 at steps 1 and 2 of T = 4, 2 SDE sub-steps per interval after
    a branch (the scripts' default): the rollout runs 4 + (8 + 8) + (16 + 16) + 16 = 68 transformer samples
    without grad (the last step is Euler) and decodes 16 leaves; the update
    draws 2 timesteps per leaf: 32 samples with grad, 2 x 32 without (v_old and v_base)."""
    _, saved, _ = tiny_report
    for method, run in saved["runs"].items():
        F, phases = run["flops_per_sample"], run["phases"]
        assert phases["samples"] == {
            "rollout": {"nograd": 68, "grad": 0},
            "reward": {"decode": 16},
            "update": {"nograd": 64, "grad": 32},
        }, method
        assert phases["rollout"]["tflop"] * 1e12 == pytest.approx(68 * F["transformer_forward"])
        assert phases["update"]["tflop"] * 1e12 == pytest.approx(
            64 * F["transformer_forward"] + 32 * F["transformer_forward_backward"]
        )


def test_the_loop_functions_are_restored_after_profiling(tiny_report):
    """The profiler patches what the loop looks up at call time, where it looks it up, and puts it back."""
    for module, name in [(nft, "tree_rollout"), (sd3, "decode"), (recast, "setup_run"), (rvge, "setup_run")]:
        assert getattr(module, name).__qualname__ == name, (module.__name__, name)
    assert recast.nft_update.__qualname__ == "nft_update" and rvge.rvge_update.__qualname__ == "rvge_update"


def test_a_recipe_runs_with_its_own_flags_at_toy_size(tmp_path):
    """--tiny --config: each recipe through its own script (rvge.py for rvge-*), its flags kept but for the sizes,
    the model, the rewards (stand-ins, as many as the recipe's) and the prompts: nft-geneval's independent
    DPM-Solver-2 rollouts (2 prompts x 2 roots x T = 4: 16 samples, 4 leaves) under fp16 autocast, so the MFU is
    against the float16 matmul rate; rvge-sd35m's five rewards. No extrapolation to the recipe's size at toy sizes."""
    saved = bench_gpu.main(
        [
            "--tiny",
            "--config",
            str(bench_gpu.ROOT / "configs/nft-geneval.yaml"),
            str(bench_gpu.ROOT / "configs/rvge-sd35m.yaml"),
            "--out",
            str(tmp_path),
        ]
    )
    geneval, rvge_run = saved["runs"]["nft-geneval"], saved["runs"]["rvge-sd35m"]
    assert (geneval["script"], rvge_run["script"]) == ("recast", "rvge")
    assert geneval["computes_in"] == rvge_run["computes_in"] == "float16" and saved["matmul_tflops"]["float16"] > 0
    assert geneval["phases"]["samples"] == {
        "rollout": {"nograd": 16, "grad": 0},
        "reward": {"decode": 4},
        "update": {"nograd": 16, "grad": 8},
    }
    assert geneval["scale"] is None and geneval["recipe"]["prompts_per_iter"] == 6
    args = json.loads((tmp_path / "runs" / "nft-geneval" / "config.json").read_text())["args"]
    assert (args["sampler"], args["mixed_precision"], args["credit"], args["ema"], args["steps"]) == (
        "ode",
        "fp16",
        "nft",
        True,
        4,
    )
    assert (args["rewards"], args["eval_every"], args["iterations"]) == ("brightness", 0, 2)
    args = json.loads((tmp_path / "runs" / "rvge-sd35m" / "config.json").read_text())["args"]
    assert args["rewards"] == ",".join(bench_gpu.STAND_INS) and args["budgets"] == "1,1,1,1,1"


def test_out_of_memory_halves_the_micro_batches_and_tries_again(tmp_path, monkeypatch, capsys):
    """The largest micro-batches that fit: a run that runs out of memory is tried again at half --train-batch and
    --rollout-batch, in a fresh folder, and the table gives the sizes that ran."""
    train, calls = recast.train, []

    def once_out_of_memory(args, **kwargs):
        calls.append((args.train_batch, args.rollout_batch))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return train(args, **kwargs)

    monkeypatch.setattr(recast, "train", once_out_of_memory)
    saved = bench_gpu.main(["--tiny", "--methods", "nft", "--out", str(tmp_path)])
    assert calls == [(8, 8), (4, 4)] and "nft: out of GPU memory; again at --train-batch 4" in capsys.readouterr().out
    run = saved["runs"]["nft"]
    assert (run["settings"]["train_batch"], run["settings"]["rollout_batch"]) == (4, 4)
    assert (tmp_path / "runs" / "nft-1" / "metrics.jsonl").exists()
    assert "| nft | recast.py | float32 | 2 (2) | 4 / 4 |" in (tmp_path / "bench_gpu.md").read_text()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: checks that peak memory is reported per phase and that a recipe's fp16 autocast runs "
    "and is measured against the float16 matmul rate",
)
def test_cuda_run_reports_peak_memory_and_mfu_against_the_float16_rate(tmp_path):
    result = bench_gpu.main(
        [
            "--tiny",
            "--device",
            "cuda",
            "--config",
            str(bench_gpu.ROOT / "configs/nft-geneval.yaml"),
            "--out",
            str(tmp_path),
        ]
    )
    run = result["runs"]["nft-geneval"]
    assert run["computes_in"] == "float16" and result["matmul_tflops"]["float16"] > 0
    assert all(run["phases"][p]["peak_gib"] > 0 for p in ["rollout", "reward", "update", "iteration"])
    assert 0 < run["phases"]["iteration"]["mfu"] < 1
