"""--mixed-precision fp16, DiffusionNFT's precision mode (float32 weights under float16 autocast, a gradient scaler, the
VAE float32, the text encoders float16, TF32), against the default (every frozen weight in --dtype, no autocast): the
refusal of float16 weights without a scaler, the dtypes each mode loads, nft.optimizer_step's scaler (all-reduce,
unscale, clip, skip) on a CPU GradScaler, the scaler's state through checkpoints and --resume, the dry run's memory
plan, and a tiny run of each mode on the CPU (CPU autocast supports float16). What only a GPU shows is one test, skipped
here, which says what it checks.

Run: python -m pytest -q tests/test_precision.py
"""

import json

import pytest
import torch

import nft
import recast
import sd3
from conftest import TINY_REWARDS, read_metrics, tiny_argv
from kit import checkpoints

# -----------------------------------------------------------------------------
# The flags: a float16 run without a scaler is refused; each mode's dtypes
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dtype", "float16"], "--dtype float16 trains without a gradient scaler"),
        (["--mixed-precision", "fp16", "--dtype", "bfloat16"], "--dtype bfloat16 contradicts it"),
        (["--mixed-precision", "fp16", "--dtype", "float16"], "--dtype float16 contradicts it"),
    ],
)
def test_float16_weights_without_a_scaler_are_refused_before_anything_loads(tiny, tmp_path, monkeypatch, flags, words):
    monkeypatch.setattr(sd3, "load_pipeline", lambda *a, **k: pytest.fail("the model loaded"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=words):
        recast.main(tiny_argv(tiny, out, *flags))
    assert not out.exists()
    with pytest.raises(SystemExit, match=words):  # the dry run too
        recast.main(["--dry-run", *flags])


def test_each_mode_gives_its_dtypes_and_only_fp16_a_scaler():
    """fp16: DiffusionNFT's dtypes on any device; no: --dtype, else bfloat16 on cuda and float32 on the CPU."""
    args = recast.parse_args(["--mixed-precision", "fp16"])
    for device in ("cuda", "cpu"):
        prec = sd3.precision(args, device)
        assert (prec.transformer, prec.text_encoders, prec.vae, prec.autocast, prec.tf32) == (
            torch.float32,
            torch.float16,
            torch.float32,
            torch.float16,
            True,
        )
    assert isinstance(sd3.gradient_scaler("cpu", prec), torch.amp.GradScaler)  # "cuda": the same, on its device
    for flags, device, dtype in [([], "cuda", torch.bfloat16), ([], "cpu", torch.float32)] + [
        (["--dtype", name], "cuda", getattr(torch, name)) for name in ("float32", "bfloat16")
    ]:
        prec = sd3.precision(recast.parse_args(flags), device)
        assert (prec.transformer, prec.text_encoders, prec.vae, prec.autocast, prec.tf32) == (dtype,) * 3 + (
            None,
            False,
        )
        assert sd3.gradient_scaler("cpu", prec) is None


# -----------------------------------------------------------------------------
# nft.optimizer_step with a gradient scaler (a CPU GradScaler: the same class as on cuda)
# -----------------------------------------------------------------------------


def two_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]


def backward_scaled(params, grads, scaler):
    """Gradients `grads` (scaled by the scaler's scale), as the update loop's scaler.scale(loss).backward() makes."""
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()


def test_a_scaled_step_all_reduces_then_unscales_clips_and_steps_as_the_unscaled_one():
    """The all-reduce sees the scaled gradients (DiffusionNFT's DDP reduces in backward, before scaler.unscale_),
    the clip acts on the unscaled ones, and the step equals the step without a scaler (the scale is a power of 2, so
    the numbers are exact); the scale stays and no step is skipped."""
    p0, grads = two_tensors(0), [10 * g for g in two_tensors(1)]  # norm > clip 1: the clip acts
    plain = [p.clone().requires_grad_() for p in p0]
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    plain_totals = {"train/opt_steps": 0}
    nft.optimizer_step(torch.optim.AdamW(plain, lr=0.1), plain, plain_totals, 1.0, lambda ps: None)

    params = [p.clone().requires_grad_() for p in p0]
    scaler, seen = torch.amp.GradScaler("cpu", init_scale=2.0**10), []
    backward_scaled(params, grads, scaler)
    totals = {"train/opt_steps": 0, "train/skipped_steps": 0}
    nft.optimizer_step(
        torch.optim.AdamW(params, lr=0.1),
        params,
        totals,
        1.0,
        lambda ps: seen.append([p.grad.clone() for p in ps]),
        scaler,
    )
    assert all(torch.equal(s, 2.0**10 * g) for s, g in zip(seen[0], grads))  # reduced while still scaled
    assert totals["grad_norm"] == plain_totals["grad_norm"] > 1.0  # the unscaled norm, before the clip
    assert all(torch.equal(p, q) for p, q in zip(params, plain))  # the same AdamW step
    assert (totals["train/skipped_steps"], totals["train/loss_scale"], totals["train/opt_steps"]) == (0, 2.0**10, 1)
    assert all(p.grad is None for p in params)


def test_a_non_finite_gradient_skips_the_step_halves_the_scale_and_is_counted():
    """scaler.step takes no AdamW step (weights and moments untouched), the scale halves, the step is counted as
    skipped and still as an optimizer step (DiffusionNFT's global_step counts it for the old decay and the EMA)."""
    p0 = two_tensors(0)
    params = [p.clone().requires_grad_() for p in p0]
    opt, scaler = torch.optim.AdamW(params, lr=0.1), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backward_scaled(params, [two_tensors(1)[0], torch.full((5,), float("inf"))], scaler)
    totals = {"train/opt_steps": 0, "train/skipped_steps": 0, "loss/policy": 1.0}
    nft.optimizer_step(opt, params, totals, 1.0, lambda ps: None, scaler)
    assert all(torch.equal(p, q) for p, q in zip(params, p0)) and not opt.state
    assert (totals["train/skipped_steps"], totals["train/loss_scale"], totals["train/opt_steps"]) == (1, 2.0**9, 1)
    assert not torch.isfinite(torch.tensor(totals["grad_norm"]))


def test_two_processes_skip_together_because_the_scaled_gradients_are_reduced_first():
    """One process's gradients finite, the other's not: the all-reduce (a mean over both, as nft.average_grads)
    spreads the inf before unscale_ looks for one, so both skip and their weights stay equal; unscaling before the
    reduce would let the finite process step on NaN gradients."""
    p0 = two_tensors(0)
    procs = [[p.clone().requires_grad_() for p in p0] for _ in range(2)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    backward_scaled(procs[0], two_tensors(1), scalers[0])
    backward_scaled(procs[1], [two_tensors(2)[0], torch.full((5,), float("inf"))], scalers[1])
    mean = [(a.grad + b.grad) / 2 for a, b in zip(*procs)]

    def all_reduce(params):
        for p, m in zip(params, mean):
            p.grad.copy_(m)

    for params, scaler in zip(procs, scalers):
        totals = {"train/opt_steps": 0, "train/skipped_steps": 0}
        nft.optimizer_step(torch.optim.AdamW(params, lr=0.1), params, totals, 1.0, all_reduce, scaler)
        assert totals["train/skipped_steps"] == 1
    assert all(torch.equal(a, b) and torch.equal(a, p) for a, b, p in zip(*procs, p0))


def test_a_non_finite_loss_is_refused_with_a_scaler_too():
    """The scale cannot mend a forward that overflowed: a non-finite loss stops the run before the step, with the
    scaler as without it."""
    params = [p.clone().requires_grad_() for p in two_tensors(0)]
    scaler = torch.amp.GradScaler("cpu")
    backward_scaled(params, two_tensors(1), scaler)
    totals = {"train/opt_steps": 0, "train/skipped_steps": 0, "loss/policy": float("nan")}
    with pytest.raises(SystemExit, match="non-finite"):
        nft.optimizer_step(torch.optim.AdamW(params), params, totals, 1.0, lambda ps: None, scaler)


# -----------------------------------------------------------------------------
# The scaler's state in checkpoints; the dry run's plan
# -----------------------------------------------------------------------------


def test_the_scalers_state_goes_into_a_checkpoint_and_comes_back(tiny, tmp_path, capsys):
    """save_checkpoint writes the scale and its growth count into state.pt (DiffusionNFT's scaler.pt); load_checkpoint
    restores them, and says so when a checkpoint has none (a run resumed in fp16 mode starts at the initial scale)."""
    args = recast.parse_args(tiny_argv(tiny, tmp_path / "run"))
    transformer = sd3.load_pipeline(args, "cpu", torch.float32).transformer
    params = sd3.lora_params(transformer, "default")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    scaler.update(new_scale=2.0**7)
    out = tmp_path / "run"
    checkpoints.save_checkpoint(out, 0, transformer, torch.optim.AdamW(params), {"opt_steps": 3}, scaler=scaler)
    fresh = torch.amp.GradScaler("cpu")
    state = checkpoints.load_checkpoint(out, transformer, torch.optim.AdamW(params), 1e-3, 0.0, fresh)
    assert fresh.state_dict() == scaler.state_dict() and fresh.get_scale() == 2.0**7
    assert "scaler" not in state and state["opt_steps"] == 3

    checkpoints.save_checkpoint(out, 1, transformer, torch.optim.AdamW(params), {"opt_steps": 4})  # a run without one
    fresh = torch.amp.GradScaler("cpu")
    state = checkpoints.load_checkpoint(out, transformer, torch.optim.AdamW(params), 1e-3, 0.0, fresh)
    assert "holds no gradient scaler state: the loss scale starts at 65536" in capsys.readouterr().out
    assert fresh.get_scale() == 2.0**16 and "scaler" not in state


def test_the_dry_run_plans_fp16_modes_float32_weights_and_their_autocast_copies(capsys):
    """fp16 mode: the frozen transformer at 4 bytes a parameter and autocast's float16 copies of it, kept for backward
    (of one block of 24 with --gradient-checkpointing), beside the default's bf16 weights; the rest as in bf16."""
    bf16 = recast.main(["--dry-run"])["memory_gib"]
    fp16 = recast.main(["--dry-run", "--mixed-precision", "fp16"])["memory_gib"]
    ckpt = recast.main(["--dry-run", "--mixed-precision", "fp16", "--gradient-checkpointing"])["memory_gib"]
    copies = "their fp16 copies kept for backward (autocast)"
    assert fp16["frozen weights (fp32)"] == pytest.approx(2 * bf16["frozen weights (bf16)"])
    assert fp16[copies] == pytest.approx(bf16["frozen weights (bf16)"]) and copies not in bf16
    assert ckpt[copies] == pytest.approx(fp16[copies] / 24)
    resident = ("weights", "text encoders", "VAE")  # each in the mode's own dtype
    assert {k: v for k, v in fp16.items() if not k.startswith(resident) and "weights" not in k and k != copies} == {
        k: v for k, v in bf16.items() if not k.startswith(resident) and "weights" not in k
    }
    assert fp16["VAE (fp32)"] == pytest.approx(2 * bf16["VAE (bf16)"])  # DiffusionNFT keeps its VAE in float32
    text = "text encoders (T5-XXL, CLIP-G, CLIP-L; "
    assert fp16[text + "fp16)"] == pytest.approx(bf16[text + "bf16)"])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" GiB")]
    assert any(line.lstrip().startswith(copies) for line in plan)


# -----------------------------------------------------------------------------
# Tiny runs of each mode on the CPU
# -----------------------------------------------------------------------------


def test_fp16_mode_loads_diffusionnfts_dtypes_and_the_default_one_dtype(tiny, tmp_path):
    """fp16: the transformer's frozen weights, the LoRA and the VAE float32, the text encoders float16, a float16
    autocast around the forwards and a GradScaler. The default on the CPU: float32 everywhere, no autocast, no
    scaler (the embedded path as before)."""

    def frozen(transformer):
        return {p.dtype for n, p in transformer.named_parameters() if "lora_" not in n}

    run = recast.setup_run(
        recast.parse_args(tiny_argv(tiny, tmp_path / "fp16", "--mixed-precision", "fp16")), TINY_REWARDS
    )
    pipe = run.pipe
    assert frozen(run.transformer) == {torch.float32} and pipe.vae.dtype == torch.float32
    assert {pipe.text_encoder.dtype, pipe.text_encoder_2.dtype, pipe.text_encoder_3.dtype} == {torch.float16}
    assert {p.dtype for p in sd3.lora_params(run.transformer, "default")} == {torch.float32}
    assert isinstance(run.scaler, torch.amp.GradScaler)
    with run.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        emb, pooled = sd3.encode(pipe, ["a red circle"], run.max_len, "cpu")
        x = torch.randn(1, *run.shape)
        assert emb.dtype == torch.float16
        assert sd3.velocity(run.transformer, x, torch.tensor([0.5]), emb, pooled).dtype == torch.float32
    run.lock.close()

    run = recast.setup_run(recast.parse_args(tiny_argv(tiny, tmp_path / "default")), TINY_REWARDS)
    assert frozen(run.transformer) == {torch.float32} and run.scaler is None
    assert {run.pipe.vae.dtype, run.pipe.text_encoder_3.dtype} == {torch.float32}
    with run.autocast():
        assert not torch.is_autocast_enabled("cpu")
    run.lock.close()


def scaler_at(scale):
    """sd3.gradient_scaler, its initial scale replaced: 2^100 makes every float16 gradient overflow."""
    return lambda device, prec: torch.amp.GradScaler(device, init_scale=scale) if prec.autocast else None


def state_of(out):
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    return torch.load(ckpt / "state.pt", weights_only=False)


def test_an_fp16_run_trains_on_the_cpu_and_logs_its_scale(tiny, tmp_path):
    """Two iterations with evaluation: every step taken at the initial scale 2^16, the LoRA moved, the scaler's state
    in state.pt; the metrics carry train/skipped_steps and train/loss_scale (a default run's do not)."""
    out = tmp_path / "run"
    recast.train(
        recast.parse_args(tiny_argv(tiny, out, "--iterations", "2", "--eval-every", "1", "--mixed-precision", "fp16")),
        extra_rewards=TINY_REWARDS,
    )
    rows = read_metrics(out)
    assert [(r["train/skipped_steps"], r["train/loss_scale"], r["train/opt_steps"]) for r in rows] == [
        (0, 2.0**16, 8)
    ] * 2
    assert all(0 < r["grad_norm"] < float("inf") and "eval/brightness" in r for r in rows)
    state = state_of(out)
    assert state["scaler"]["scale"] == 2.0**16 and state["opt_steps"] == 16
    lora = state["lora"]
    assert any(not torch.equal(lora["default"][k], lora["old"][k.replace("default", "old")]) for k in lora["default"])


def test_skipped_steps_leave_the_lora_and_resume_restores_the_scale(tiny, tmp_path, monkeypatch):
    """A scale of 2^100 overflows every float16 gradient: each of the 8 steps an iteration takes is skipped (the
    LoRA stays at its start, "old" equal to it) and halves the scale, 2^92 after iteration 0 and 2^84 after 1; the
    steps still count for the old decay. A run stopped after iteration 0 and resumed logs the same lines: its scale
    came back from the checkpoint (a fresh scaler would log 2^92 again)."""
    monkeypatch.setattr(sd3, "gradient_scaler", scaler_at(2.0**100))
    flags = ("--save-every", "1", "--eval-every", "0", "--mixed-precision", "fp16")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    recast.train(recast.parse_args(tiny_argv(tiny, straight, "--iterations", "2", *flags)), extra_rewards=TINY_REWARDS)
    recast.train(recast.parse_args(tiny_argv(tiny, resumed, "--iterations", "1", *flags)), extra_rewards=TINY_REWARDS)
    recast.train(recast.parse_args(["--resume", str(resumed), "--iterations", "2"]), extra_rewards=TINY_REWARDS)
    rows = read_metrics(straight)
    assert [(r["train/skipped_steps"], r["train/loss_scale"]) for r in rows] == [(8, 2.0**92), (8, 2.0**84)]
    untimed = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
    assert untimed == [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(resumed)]
    state = state_of(resumed)
    assert state["scaler"]["scale"] == 2.0**84 and state["opt_steps"] == 16
    lora = state["lora"]
    # "old" after 16 soft updates keep x + (1 - keep) x of an unchanged x: x up to a rounding per update (kernels with
    # fused multiply-add, avx2 / avx512, return x bit for bit; ATEN_CPU_CAPABILITY=default's do not); one real AdamW
    # step would move the LoRA by ~lr = 1e-4, >= 1e-3 of its entries, far outside rtol 1e-5 (~80 float32 ulps)
    assert all(
        torch.allclose(v, lora["old"][k.replace("default", "old")], rtol=1e-5, atol=0)
        for k, v in lora["default"].items()
    )
    assert json.loads((resumed / "config.json").read_text())["args"]["mixed_precision"] == "fp16"


# -----------------------------------------------------------------------------
# On a GPU
# -----------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_mode_on_a_gpu_allows_tf32_runs_float16_matmuls_and_trains(tiny, tmp_path):
    """On cuda: loading the run allows TF32 (DiffusionNFT's allow_tf32); inside run.autocast() the transformer's
    matmuls run in float16 (a velocity within 1e-2 of the float32 one, not equal to it); a two-iteration tiny run takes
    every step at the initial scale and ends with finite weights. Skipped on the CPU, where the rest of this file
    tests the same code with CPU autocast and a CPU GradScaler."""
    flags = ("--device", "cuda", "--mixed-precision", "fp16")
    run = recast.setup_run(recast.parse_args(tiny_argv(tiny, tmp_path / "probe", *flags)), TINY_REWARDS)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    emb, pooled = sd3.encode(run.pipe, ["a red circle"], run.max_len, "cuda")
    x, s = torch.randn(1, *run.shape, device="cuda"), torch.tensor([0.5], device="cuda")
    with run.autocast():
        v16 = sd3.velocity(run.transformer, x, s, emb, pooled)
    v32 = sd3.velocity(run.transformer, x, s, emb.float(), pooled.float())
    assert 0 < (v16 - v32).abs().max() < 1e-2 * v32.abs().max()
    run.lock.close()
    out = tmp_path / "run"
    recast.train(recast.parse_args(tiny_argv(tiny, out, "--iterations", "2", *flags)), extra_rewards=TINY_REWARDS)
    assert [r["train/skipped_steps"] for r in read_metrics(out)] == [0, 0]
    assert all(torch.isfinite(v).all() for sd in state_of(out)["lora"].values() for v in sd.values())
