"""bench_gpu.py --tiny: the GPU profiler runs the real training loops on CPU at toy size and reports
every phase with finite, positive times and FLOP counts that match the loop's structure."""

import json
import math

import pytest
import torch

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
    F = saved["flops_per_sample"]
    # one forward, forward + backward (the backward is counted, not assumed) and one VAE decode
    assert 0 < F["transformer_forward"] < F["transformer_forward_backward"] < 4 * F["transformer_forward"]
    assert F["vae_decode"] > 0 and saved["matmul_tflops"] > 0 and saved["transformer_params"] > 0
    assert "STAND-INS" in table
    assert set(saved["methods"]) == {"recast", "nft", "rvge"}
    for method, phases in saved["methods"].items():
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
    F = saved["flops_per_sample"]
    for method, phases in saved["methods"].items():
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
    import recast
    import rvge

    for module in (recast, rvge):
        for name in ["setup_run", "tree_rollout", "decode"]:
            assert getattr(module, name).__qualname__ == name, (module.__name__, name)
    assert recast.nft_update.__qualname__ == "nft_update" and rvge.rvge_update.__qualname__ == "rvge_update"


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: checks that peak memory is reported per phase"
)
def test_cuda_run_reports_peak_memory(tmp_path):
    result = bench_gpu.main(["--tiny", "--device", "cuda", "--methods", "nft", "--out", str(tmp_path)])
    phases = result["methods"]["nft"]
    assert all(phases[p]["peak_gib"] > 0 for p in ["rollout", "reward", "update", "iteration"])
