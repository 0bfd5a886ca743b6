"""The activation memory of one SD3.5-Medium block per sample, measured on the CPU (issue 63).

    nice -n 5 python -m experiments.memory_fit                    # every configuration, then the fit
    python -m experiments.memory_fit --fit-only                   # refit the results JSON already written
    python -m experiments.memory_fit --one '{"L": 1, "B": 1, ...}'  # one configuration (what each subprocess runs)

SD3.5-Medium's transformer (world/assets/sd3.5-medium-transformer.json: hidden 24 x 64 = 1536, joint attention dim 4096)
cut to `num_layers` L = 2 or 3, random weights (`SD3Transformer2DModel.from_config`, no download), in --dtype weights,
LoRA r=32 alpha=64 on `sd3.LORA_TARGETS` (peft, Gaussian init, the adapter weights in float32 as `sd3.load_pipeline`
keeps them), only the LoRA parameters requiring grad. 512 px: latents (B, 16, 64, 64), 1024 image tokens; text
(B, 77 + 128, 4096), pooled (B, 2048). One forward and backward of the output's mean square. `kind`: "dual" keeps
the shipped dual_attention_layers (blocks 0-12 of SD3.5-M are MMDiT-X blocks with a second, image-only attention),
"plain" empties it (blocks 13-23); "real" is the shipped config unchanged (L = 24: the check of the fits). With L
blocks the last one is SD3's `context_pre_only` block (no text output).

Each configuration runs in a fresh subprocess (one at a time). Memory, two readings:
  * peak RSS (the fit's reading): the process's peak resident set is reset after the model and inputs are built
    (writing 5 to /proc/self/clear_refs resets VmHWM to the current VmRSS), then VmHWM after the backward minus VmRSS
    before the forward: everything the forward and backward allocated at their peak (saved activations, transients,
    the LoRA grads), through glibc's allocator run with MALLOC_MMAP_THRESHOLD_=65536 (below, MALLOC);
  * saved bytes: a torch.autograd.graph.saved_tensors_hooks pack hook over the forward counts each distinct storage
    autograd saves for backward (parameters excluded): the activations kept, independent of the allocator. Not read
    with gradient checkpointing (its own hooks hold the saved tensors there).
The attention backend that ran is read from the grad_fn of F.scaled_dot_product_attention's output.

Fit (least squares over L in {2, 3}, B in {1, 2, 4}): delta(L, B) = L B a + B b + c: a is one middle block's bytes
per sample (L = 3 adds block 1, a block between the first and the last: block 0 keeps less, since nothing before its
first LoRA layer requires grad, and the last is context_pre_only); b the per-sample rest; c a constant.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "experiments/results/memory-fit"
CONFIG = ROOT / "world/assets/sd3.5-medium-transformer.json"
RES, TEXT = 512, 77 + 128
GIB = 2**30
# glibc's malloc with a fixed mmap threshold: every block of 64 KiB or more is its own mapping, returned to the system
# when freed, so the resident set follows the live bytes (glibc's default raises the threshold as blocks are freed and
# then serves large tensors from its heap, where freed memory stays resident: results-glibc-default.json)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def status_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(spec):
    """One configuration: build, reset the peak RSS, forward + backward; the readings as a dict."""
    import torch
    import torch.nn.functional as F
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import sd3

    torch.set_num_threads(spec.get("threads", 2))
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    config = json.loads(CONFIG.read_text())
    config["num_layers"] = spec["L"]
    if spec["kind"] == "plain":
        config["dual_attention_layers"] = []
    if spec["kind"] == "real":  # the whole shipped model: built in --dtype directly (no float32 copy in RAM)
        torch.set_default_dtype(dtype)
    model = SD3Transformer2DModel.from_config(config).to(dtype)
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    lora = LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=sd3.LORA_TARGETS)
    model.add_adapter(lora, adapter_name="default")
    for p in sd3.lora_params(model, "default"):
        p.data = p.data.float()
        p.requires_grad_(True)
    if spec["ckpt"]:
        model.enable_gradient_checkpointing()
    model.train()
    B, h = spec["B"], RES // 8
    x = torch.randn(B, 16, h, h, dtype=dtype)
    emb = torch.randn(B, TEXT, config["joint_attention_dim"], dtype=dtype)
    pooled = torch.randn(B, config["pooled_projection_dim"], dtype=dtype)
    t = torch.full((B,), 500.0)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}

    backends = set()
    sdpa = F.scaled_dot_product_attention

    def traced_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        backends.add(type(out.grad_fn).__name__ if out.grad_fn is not None else "no grad_fn")
        return out

    F.scaled_dot_product_attention = traced_sdpa
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            saved[storage.data_ptr()] = (storage.nbytes(), str(tensor.dtype).replace("torch.", ""))
        return tensor

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base_rss = status_kb("VmRSS")
    start = time.time()
    with contextlib.ExitStack() as stack:
        if spec.get("attn") == "math":  # the math path forced: SDPA's upper bound
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        out = model(hidden_states=x, encoder_hidden_states=emb, pooled_projections=pooled, timestep=t)
    loss = out.sample.float().pow(2).mean()
    fwd_hwm = status_kb("VmHWM")
    loss.backward()
    peak = status_kb("VmHWM")
    grads = sum(p.grad is not None for p in sd3.lora_params(model, "default"))
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    tokens = (RES // 8 // config["patch_size"]) ** 2 + TEXT
    return {
        **spec,
        "tokens": tokens,
        "hidden": hidden,
        "base_rss": base_rss,
        "forward_peak_delta": fwd_hwm - base_rss,
        "peak_delta": peak - base_rss,
        "saved_bytes": None if spec["ckpt"] else sum(n for n, _ in saved.values()),
        "saved_bytes_by_dtype": None
        if spec["ckpt"]
        else {d: sum(n for n, e in saved.values() if e == d) for d in sorted({e for _, e in saved.values()})},
        "attention_backend": sorted(backends),
        "lora_grads": grads,
        "seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
        "malloc_env": {k: os.environ.get(k) for k in MALLOC},
    }


def runs():
    """The configurations, in order of priority."""
    out = []
    for ckpt in (False, True):
        for L in (2, 3):
            for B in (1, 2, 4):
                out.append({"dtype": "bfloat16", "kind": "dual", "ckpt": ckpt, "L": L, "B": B})
    # the check: the shipped 24 blocks at B = 1 against the fits' extrapolation
    out.append({"dtype": "bfloat16", "kind": "real", "ckpt": False, "L": 24, "B": 1})
    for L in (2, 3):
        for B in (1, 2):
            out.append({"dtype": "bfloat16", "kind": "plain", "ckpt": False, "L": L, "B": B})
    for L in (2, 3):
        for B in (1, 2):
            out.append({"dtype": "bfloat16", "kind": "dual", "ckpt": False, "L": L, "B": B, "attn": "math"})
    out.append({"dtype": "bfloat16", "kind": "real", "ckpt": True, "L": 24, "B": 1})
    for L in (2, 3):
        for B in (1, 2):
            out.append({"dtype": "float32", "kind": "dual", "ckpt": False, "L": L, "B": B})
    for L in (2, 3):
        for B in (1, 2):
            out.append({"dtype": "bfloat16", "kind": "plain", "ckpt": True, "L": L, "B": B})
    return out


def key(spec):
    return json.dumps({k: spec.get(k) for k in ("dtype", "kind", "ckpt", "L", "B", "attn")}, sort_keys=True)


def fit(rows, column):
    """Least squares delta = L B a + B b + c, with residuals (rows in the order of `rows`); and the brief's
    delta = L B a + c."""
    L = np.array([r["L"] for r in rows], float)
    B = np.array([r["B"] for r in rows], float)
    y = np.array([r[column] for r in rows], float)
    X = np.stack([L * B, B, np.ones_like(B)], 1)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    res = y - X @ coef
    unit = rows[0]["tokens"] * rows[0]["hidden"] * 2
    X2 = np.stack([L * B, np.ones_like(B)], 1)  # the brief's form, delta = L B a + c: a then averages in the
    coef2, *_ = np.linalg.lstsq(X2, y, rcond=None)  # first and last blocks' differences
    res2 = y - X2 @ coef2
    brief = {
        "a_bytes": coef2[0],
        "a_over_tokens_hidden_2": coef2[0] / unit,
        "c_MiB": coef2[1] / 2**20,
        "residuals_MiB": [round(v / 2**20, 1) for v in res2],
    }
    return {
        "n": len(rows),
        "a_bytes": coef[0],
        "a_MiB": coef[0] / 2**20,
        "a_over_tokens_hidden_2": coef[0] / unit,
        "b_bytes": coef[1],
        "b_over_tokens_hidden_2": coef[1] / unit,
        "c_MiB": coef[2] / 2**20,
        "residuals_MiB": [round(v / 2**20, 1) for v in res],
        "max_abs_residual_MiB": float(np.abs(res).max() / 2**20),
        "brief_form": brief,
    }


def fits(results):
    groups = {}
    for r in results:
        name = f"{r['dtype']} {r['kind']} ckpt={'on' if r['ckpt'] else 'off'}" + (
            f" attn={r['attn']}" if r.get("attn") else ""
        )
        groups.setdefault(name, []).append(r)
    out = {}
    for name, rows in groups.items():
        if len({r["L"] for r in rows}) < 2 or len({r["B"] for r in rows}) < 2:
            continue
        out[name] = {"peak_delta": fit(rows, "peak_delta")}
        if rows[0]["saved_bytes"] is not None:
            out[name]["saved_bytes"] = fit(rows, "saved_bytes")
    return out


# the record (issue 63): bench_gpu.py on one H200, --mixed-precision no (bfloat16 weights), --train-batch 8, no EMA,
# random SD3.5-M transformer (24 blocks), bench_gpu's shallow text encoders and full-size VAE, stand-in rewards
H200 = {"measured_gib": 26.97, "printed_gib": 12.63, "train_batch": 8}
# parameters of the frozen parts dry_run omits; "counted": on the meta device here, from the configs named
REAL_TEXT = {"T5-XXL encoder": 4.76e9, "CLIP-G (text, projection)": 0.69e9, "CLIP-L (text, projection)": 0.12e9}


def counts():
    """Parameter counts on the meta device: the transformer (shipped config), bench_gpu's text encoders (the real
    widths, 2 CLIP layers, 1 T5 layer, a character vocabulary) and VAE (SD3.5-M's shape)."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from experiments import bench_gpu

    def n(m):
        return sum(p.numel() for p in m.parameters())

    out = {}
    with torch.device("meta"):
        out["transformer"] = n(SD3Transformer2DModel.from_config(json.loads(CONFIG.read_text())))
        out["vae"] = n(AutoencoderKL(**bench_gpu.SD35M_VAE))
        for name, (h, i, a, layers, pos, act) in zip(("bench CLIP-L", "bench CLIP-G"), bench_gpu.SD35M_CLIPS):
            cfg = dict(hidden_size=h, intermediate_size=i, num_attention_heads=a, num_hidden_layers=layers)
            cfg |= dict(max_position_embeddings=pos, projection_dim=h, hidden_act=act, vocab_size=56)
            cfg |= dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
            out[name] = n(CLIPTextModelWithProjection(CLIPTextConfig(**cfg)))
        out["bench T5"] = n(T5EncoderModel(T5Config(vocab_size=31, **bench_gpu.SD35M_T5)))
    return out


def activation_model(fits_, column="peak_delta"):
    """Per-sample bytes of the shipped 24 blocks (13 dual, 11 plain) from the fits: B (13 a_dual + 11 a_plain +
    b_dual) + c_dual without checkpointing (the measured dual L = 3 model is blocks first, middle, last; the real one
    adds 10 dual and 11 plain middle blocks and its last block is plain: 13 a_dual + 11 a_plain in all, to a block's
    first/last difference); with it B (13 a_dual + 11 a_plain + b_dual) + c_dual of the checkpointed fits (b: one
    dual block recomputed in the backward). a_plain = a_dual where plain was not measured."""
    dual = fits_.get("bfloat16 dual ckpt=off", {}).get(column)
    plain = fits_.get("bfloat16 plain ckpt=off", {}).get(column, dual)
    ck = fits_.get("bfloat16 dual ckpt=on", {}).get(column)
    ck_plain = fits_.get("bfloat16 plain ckpt=on", {}).get(column, ck)
    out = {}
    if dual:
        out["off"] = {
            "per_sample": 13 * dual["a_bytes"] + 11 * plain["a_bytes"] + dual["b_bytes"],
            "const": dual["c_MiB"] * 2**20,
            "plain_measured": "bfloat16 plain ckpt=off" in fits_,
        }
    if ck:
        out["on"] = {
            "per_sample": 13 * ck["a_bytes"] + 11 * ck_plain["a_bytes"] + ck["b_bytes"],
            "const": ck["c_MiB"] * 2**20,
        }
    return out


def reconcile(data):
    """The fits against the whole model at B = 1 (measured here) and the H200 record at train batch 8."""
    c = counts()
    model = activation_model(data["fits"])
    real = {r["ckpt"]: r for r in data["runs"] if r["kind"] == "real"}
    check = {}
    for ckpt, m in model.items():
        r = real.get(ckpt == "on")
        pred = m["per_sample"] + m["const"]
        check[ckpt] = {"predicted_B1_GiB": pred / GIB, "measured_B1_GiB": r and r["peak_delta"] / GIB}
        if r and r.get("saved_bytes") is not None:
            check[ckpt]["measured_B1_saved_GiB"] = r["saved_bytes"] / GIB
    trainable = 18_780_000  # dry_run: 18.78M LoRA parameters (r=32 on 191 linear layers)
    B = H200["train_batch"]
    parts = {
        "frozen transformer weights (bf16) [counted]": 2 * c["transformer"] / GIB,
        "2 LoRA adapters (default, old; fp32) [dry_run]": 2 * 4 * trainable / GIB,
        "AdamW state + grads (fp32) [dry_run]": 3 * 4 * trainable / GIB,
    }
    if "off" in model:
        parts["activations, fitted, train batch 8 [measured on CPU]"] = (
            B * model["off"]["per_sample"] + model["off"]["const"]
        ) / GIB
    parts["bench text encoders (bf16) [counted]"] = 2 * (c["bench CLIP-L"] + c["bench CLIP-G"] + c["bench T5"]) / GIB
    parts["VAE (bf16) [counted]"] = 2 * c["vae"] / GIB
    total = sum(parts.values())
    return {
        "counts": c,
        "activation_model": model,
        "check_whole_model": check,
        "h200": {
            **H200,
            "parts_gib": parts,
            "total_gib": total,
            "unexplained_gib": H200["measured_gib"] - total,
            "dry_run_activation_gib": B * 24 * 12 * 1229 * 1536 * 2 / GIB,
        },
        "real_resident_gib": {
            **{f"{k} (fp16/bf16) [estimated size]": 2 * v / GIB for k, v in REAL_TEXT.items()},
            "VAE (fp32, fp16 mode) [counted]": 4 * c["vae"] / GIB,
            "VAE (bf16) [counted]": 2 * c["vae"] / GIB,
            "PickScore CLIP-H (fp32) [estimated]": 3.7,
            "CLIP-L reward (fp32) [estimated]": 1.6,
        },
    }


def table(data):
    """The measurements as a markdown table (the README's)."""
    unit = 1229 * 1536 * 2
    lines = [
        "| weights | blocks | ckpt | attention | L | B | peak delta GiB | saved GiB | saved fp32 share | "
        "saved / (L B tokens hidden 2) | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        saved = r["saved_bytes"]
        fp32 = (r["saved_bytes_by_dtype"] or {}).get("float32", 0) / saved if saved else None
        per = saved / (r["L"] * r["B"] * unit) if saved else None
        lines.append(
            f"| {r['dtype']} | {r['kind']} | {'on' if r['ckpt'] else 'off'} | {r.get('attn') or 'default'} | "
            f"{r['L']} | {r['B']} | {r['peak_delta'] / GIB:.3f} | "
            f"{'' if saved is None else f'{saved / GIB:.3f}'} | {'' if fp32 is None else f'{fp32:.2f}'} | "
            f"{'' if per is None else f'{per:.1f}'} | {r['seconds']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="one configuration (JSON); prints its readings")
    parser.add_argument("--fit-only", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the measurements as a markdown table")
    parser.add_argument("--budget-min", type=float, default=22.0, help="stop starting runs after this many minutes")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(json.loads(args.one))), flush=True)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    if args.table:
        print(table(data))
        return
    if not args.fit_only:
        done = {key(r) for r in data["runs"]}
        start = time.time()
        for spec in runs():
            if key(spec) in done:
                continue
            if time.time() - start > 60 * args.budget_min:
                print("budget spent; stopping", flush=True)
                break
            cmd = ["nice", "-n", "5", sys.executable, "-m", "experiments.memory_fit", "--one", json.dumps(spec)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **MALLOC})
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(f"failed: {spec}\n{proc.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(lines[-1][7:])
            data["runs"].append(r)
            print(
                f"{key(spec)}: peak {r['peak_delta'] / GIB:.3f} GiB, saved {r['saved_bytes']}, "
                f"{r['attention_backend']}, {r['seconds']} s",
                flush=True,
            )
            data["machine"] = {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            }
            path.write_text(json.dumps(data, indent=1) + "\n")
    data["fits"] = fits(data["runs"])
    data["reconciliation"] = reconcile(data)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: data[k] for k in ("fits", "reconciliation")}, indent=1))


if __name__ == "__main__":
    main()
