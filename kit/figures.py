"""Trackers (TensorBoard, W&B through accelerate), the run's figures drawn from its metrics file, and the closing
summary of a run. What a figure shows follows the metric keys present (recast/*, rvge/*)."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict
from pathlib import Path

import numpy as np

import nft
from kit.checks import read_prompts
from kit.records import metrics_lines, run_identity, save_atomic, write_atomic
from kit.worlds import is_embedded, load_world


def start_trackers(run, args):
    """--report-to tensorboard | wandb: accelerate's tracker, started with the run's flags. TensorBoard: event files
    in <run>/tensorboard, plotted against iterations. W&B (files in <run>/wandb): project --tracker-project (default:
    the script), run name --tracker-run-name (default: the run folder's name), the run id of `wandb_run_id` with
    resume="allow", so that --resume continues the same W&B run; every chart's x-axis is train/optimizer_step
    (DiffusionNFT's global_step), iteration a second axis to choose. Nothing for none."""
    if args.report_to == "tensorboard":
        run.acc.init_trackers("tensorboard", config=asdict(args))
    if args.report_to != "wandb":
        return
    wandb_id = wandb_run_id(run.out, args.resume) if run.acc.is_main_process else None
    name = args.tracker_run_name or run.out.name
    kwargs = {"wandb": {"name": name, "dir": str(run.out), "id": wandb_id, "resume": "allow"}}
    run.acc.init_trackers(args.tracker_project or run.script, config=asdict(args), init_kwargs=kwargs)
    if run.acc.is_main_process:
        wandb = run.acc.get_tracker("wandb", unwrap=True)
        wandb.define_metric("train/optimizer_step")
        wandb.define_metric("*", step_metric="train/optimizer_step")


def wandb_run_id(out, resume):
    """The W&B run id of run folder `out`, kept in out/wandb/run.json with the folder it was recorded in: --resume
    continues that W&B run (also after the folder moved); a new run gets a new id, and so does a resumed copy of a
    run folder (the recorded folder still holds the same run: the copy branches it, and must not write into the
    original's W&B run). The id is recorded before W&B starts."""
    record, here = Path(out) / "wandb" / "run.json", os.path.realpath(out)
    try:
        saved = json.loads(record.read_text())
        wandb_id, origin = str(saved["id"]), str(saved["folder"])
    except (OSError, ValueError, KeyError, TypeError):
        wandb_id = origin = None
    copied = origin != here and origin is not None and run_identity(origin)["run_id"] == run_identity(out)["run_id"]
    if not (resume and wandb_id) or copied:
        wandb_id = uuid.uuid4().hex
    record.parent.mkdir(exist_ok=True)
    write_atomic(record, json.dumps({"id": wandb_id, "folder": here}))
    return wandb_id


def log_to_trackers(acc, metrics, step, names=None):
    """The metrics line's numbers and strings to the --report-to tracker under the same keys (lists such as D stay in
    metrics.jsonl); W (K, T) also as an image, credit.png's W panel (`W_figure`: relative to the uniform share, rows
    named by `names`), when W is in the line and names are given."""
    if not acc.trackers:
        return
    acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}, step=step)
    if "recast/W" in metrics and names:
        import matplotlib.pyplot as plt

        fig = W_figure(np.asarray(metrics["recast/W"]), names)
        fig.canvas.draw()
        log_images(acc, {"recast/W": np.asarray(fig.canvas.buffer_rgba())[..., :3]}, step)
        plt.close(fig)


def log_images(acc, images, step):
    """{tag: image} to the --report-to tracker (TensorBoard's image tab, W&B's media); an image is an (H, W, 3) array
    in [0, 1] or uint8, or the path of a PNG."""
    from PIL import Image

    for tag, image in images.items():
        image = np.asarray(Image.open(image).convert("RGB")) if isinstance(image, (str, Path)) else image
        for tracker in acc.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({tag: image[None]}, step, dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({tag: [image]}, step)


def show_evaluation(run, it, evaluated, state):
    """An evaluation's figures (main process), drawn while the run goes on: samples.png (the first SHOWN held-out
    samples of the first evaluation above this one's, each with its budget-weighted reward and prompt), the run's
    figures (`plot_run`), all logged as images to the --report-to tracker at step `it` (None: the first evaluation,
    before any update, logged as eval_before/samples)."""
    _, images, R = evaluated
    before = state.get("samples_before")  # a resume with other --eval-prompts: no before row
    rows = [("before", before)] if before is not None and len(before[1]) == len(images) else []
    if it is not None:
        rows.append((f"iteration {it}", (np.stack([np.asarray(im.convert("RGB")) for im in images]), R[: len(images)])))
    save_samples(run.out / "samples.png", run.eval_prompts[: len(images)], rows, run.budgets)
    if it is None:
        return log_images(run.acc, {"eval_before/samples": run.out / "samples.png"}, 0)
    figures = plot_run(run.out, run.names, run.shows_W)
    log_images(run.acc, {"eval/samples": run.out / "samples.png", **{f"figures/{p.stem}": p for p in figures}}, it)


def save_samples(path, prompts, rows, budgets, cols=8):
    """The held-out samples as a grid: for each `cols` prompts one row per entry of rows [(label, (images (P, H, W, 3)
    uint8, R (P, K)))], each image captioned with its label, its budget-weighted reward and its prompt."""
    from PIL import Image

    cols = min(cols, len(prompts))
    blank = Image.new("RGB", rows[0][1][0].shape[1::-1], "white")
    images, captions = [], []
    for first in range(0, len(prompts), cols):
        chunk = range(first, min(first + cols, len(prompts)))
        for label, (pixels, R) in rows:
            weighted = nft.budget_mean(np.asarray(R).T, budgets)  # (P,)
            images += [Image.fromarray(pixels[i]) for i in chunk] + [blank] * (cols - len(chunk))
            captions += [f"{label}: {weighted[i]:.3f}. {prompts[i]}" for i in chunk] + [""] * (cols - len(chunk))
    save_grid(images, path, captions, cols=cols)


def log_rollouts(acc, it, images, prompts, weighted, cols=5):
    """Rollout images of iteration `it` to the --report-to tracker as one grid, rollout/samples (DiffusionNFT logs its
    first 15 rollouts every 10 epochs): each captioned with its budget-weighted training reward and its prompt."""
    captions = [f"{w:.3f}. {p}" for w, p in zip(weighted, prompts)]
    log_images(acc, {"rollout/samples": np.asarray(grid_image(images, captions, cols=min(cols, len(images))))}, it)


def save_grid(images, path, prompts=(), cols=8, cell=128):
    """`grid_image` of the images saved as a PNG at path (atomically). Returns the grid (PIL)."""
    grid = grid_image(images, prompts, cols, cell)
    save_atomic(path, lambda tmp: grid.save(tmp, format="PNG"))
    return grid


def grid_image(images, prompts=(), cols=8, cell=128):
    """The images in rows of `cols`, each upscaled (nearest) to at least `cell` px wide, with its prompt written
    under it (wrapped to the image's width). Returns the grid (PIL)."""
    from PIL import Image, ImageDraw, ImageFont

    scale = max(1, -(-cell // images[0].size[0]))  # ceil: small images grow to at least `cell` px
    w, h = images[0].size[0] * scale, images[0].size[1] * scale
    font = ImageFont.load_default(size=max(10, w // 12))
    draw = ImageDraw.Draw(Image.new("RGB", (w, h)))
    captions = [wrap_text(draw, text, font, w - 4) for text in list(prompts) + [""] * (len(images) - len(prompts))]
    line = font.getbbox("Ag")[3] + 2
    text_h = line * max(len(c) for c in captions) + 4
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * (h + text_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, caption) in enumerate(zip(images, captions)):
        x, y = (i % cols) * w, (i // cols) * (h + text_h)
        grid.paste(im.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        for k, text in enumerate(caption):
            draw.text((x + 2, y + h + 2 + k * line), text, fill="black", font=font)
    return grid


def wrap_text(draw, text, font, width):
    """Lines of `text` (words kept whole) that fit in `width` px with `font`."""
    lines = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


FIGURES = ("rewards", "credit", "directions", "samples")  # the PNGs of a run folder


def plot_run(out, names, shows_W=True):
    """The run's figures from metrics.jsonl, drawn at every evaluation and at the end; returns their paths.
    rewards.png: the training rewards per iteration; the held-out rewards (eval/*) and each held-out judge on an axis
    of its own (their units differ: the CNN's 0-1, Fréchet's hundreds) per evaluation, at the number of iterations
    trained (0: eval_before/*, the pretrained model; the evaluation logged with iteration i: i + 1).
    credit.png (where the run logs recast/W and shows_W: W is part of its training signal, the script's `shows_W`):
    the last W relative to each
    reward's uniform share, W_kj / (lambda_k / T) (lambda_k c_j / Lam with unequal column sums c_j; 1 everywhere: the
    uniform W); D_k(t), measured levels +- 2 se and
    the monotone fit, with each reward's evidence factor; and the profiles W was solved from, after the evidence
    shrinkage (identical profiles give the uniform W).
    directions.png (rvge.py): per regressed reward, along the run, its bandwidth (local or broad), the direction's
    size (rms) and the split-half cosine of its direction (rvge/*)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for _, line in metrics_lines(out / "metrics.jsonl")]
    if not rows:
        return []
    its, drawn = [m["iteration"] for m in rows], []

    def save(fig, name):
        drawn.append(out / f"{name}.png")
        save_atomic(drawn[-1], lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))

    evals = (
        [(0, {k.replace("eval_before/", "eval/"): v for k, v in rows[0].items() if k.startswith("eval_before/")})]
        if "eval_before/weighted" in rows[0]  # not its eval/*: iteration 0's own evaluation, when it has one
        else []
    ) + [(m["iteration"] + 1, m) for m in rows if "eval/weighted" in m]
    judges = sorted({k for _, m in evals for k in m if k.startswith("eval/judge/")})  # each on its own axis: units
    panels = (2 if evals else 1) + len(judges)
    fig, axes = plt.subplots(1, panels, figsize=(16 / 3 * max(panels, 3), 3.6), squeeze=False)
    for n in names + ["weighted"]:
        axes[0, 0].plot(its, [m[f"reward/{n}"] for m in rows], label=n)
        if evals:
            axes[0, 1].plot([i for i, _ in evals], [m[f"eval/{n}"] for _, m in evals], marker=".", label=n)
    for a, key in zip(axes[0, 2:], judges):
        name = key.removeprefix("eval/judge/")
        a.plot([i for i, m in evals if key in m], [m[key] for _, m in evals if key in m], marker=".", label=name)
        a.set(title=f"held-out judge {name} ({key})")
    axes[0, 0].set(title="training rewards", xlabel="iteration (as in metrics.jsonl)")
    for a in axes[0, 1:]:
        a.set(xlabel="iterations trained (0: pretrained)")
    if evals:
        axes[0, 1].set(title="held-out rewards (eval/*)")
    for a in axes[0]:
        a.legend(fontsize=7)
    save(fig, "rewards")
    last, sig = rows[-1], np.array(rows[-1].get("recast/sigmas", []))
    if "recast/W" in last and shows_W:
        fig, axes = plt.subplots(1, 3, figsize=(16, 3.6), gridspec_kw={"wspace": 0.35})
        draw_W(fig, axes[0], np.array(last["recast/W"]), names)
        D_meas, D_se = np.array(last["recast/D_measured"]), np.array(last["recast/D_se"])  # -1: level not measured
        profile = np.array(last.get("recast/profile", last["recast/gains"]))
        for k, n in enumerate(names):
            (line,) = axes[1].plot(
                sig, np.array(last["recast/D"])[k], label=f"{n} (evidence {last['recast/evidence'][k]:.2f})"
            )
            ok = D_se[k] >= 0
            axes[1].errorbar(
                sig[ok], D_meas[k, ok], yerr=2 * D_se[k, ok], fmt="o", ms=3, capsize=2, color=line.get_color()
            )
            axes[2].plot(sig[:-1], profile[k], marker=".", label=n)
        axes[1].set(xlabel="t", ylabel="D_k(t)", title="Renyi discriminability: levels +- 2 se, monotone fit")
        axes[2].set(
            xlabel="t at step start",
            ylabel="share of the reward's gain",
            title="profiles W is solved from (after the evidence shrinkage)",
        )
        for a in axes[1:]:
            a.invert_xaxis()
            a.legend(fontsize=7)
        save(fig, "credit")
    regressed = [k.removeprefix("rvge/bandwidth/") for k in last if k.startswith("rvge/bandwidth/")]
    if regressed:
        fig, axes = plt.subplots(1, 3, figsize=(16, 3.6), gridspec_kw={"wspace": 0.3})
        for n in regressed:
            axes[0].plot(its, [m[f"rvge/bandwidth/{n}"] for m in rows], marker=".", label=n)
            axes[1].plot(its, [m[f"rvge/direction_rms/{n}"] for m in rows], label=n)
            axes[2].plot(its, [m[f"rvge/split_cos/{n}"] for m in rows], label=n)
        titles = ["bandwidth (regression groups)", "direction size (rms)", "split-half cosine of the direction"]
        for a, title in zip(axes, titles):
            a.set(xlabel="iteration", title=title)
            a.legend(fontsize=7)
        save(fig, "directions")
    plt.close("all")
    return drawn


def draw_W(fig, ax, W, names):
    """W (K, T) on ax as credit.png shows it: W_kj / uniform share (uniform_share; 1: uniform), blue below, red
    above, one row per reward (named), one column per step j, with its colour bar."""
    import matplotlib

    share = uniform_share(W)
    ratio = np.divide(W, share, out=np.ones_like(W), where=share > 0)
    norm = matplotlib.colors.TwoSlopeNorm(vcenter=1.0, vmin=min(ratio.min(), 0.5), vmax=max(ratio.max(), 2.0))
    im = ax.imshow(ratio, aspect="auto", cmap="RdBu_r", norm=norm)
    ax.set(
        yticks=range(len(names)),
        yticklabels=names,
        xlabel="step j (t = sigma_j)",
        title="W / uniform share (1: uniform)",
    )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.colorbar(im, ax=ax)


def W_figure(W, names):
    """The figure of W alone (`draw_W`), as the --report-to tracker shows it every iteration (recast/W)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 1.4 + 0.3 * len(names)), layout="constrained")
    draw_W(fig, ax, W, names)
    return fig


def uniform_share(W):
    """The uniform W with W's marginals, lambda_k c_j / Lam (K, T): lambda_k / T when the columns are equal, the
    reference W is read against in credit.png and the closing summary."""
    return np.outer(W.sum(1), W.sum(0)) / W.sum()


def sampling_line(args, embedded):
    """The line of Python, after the loading line, that samples the trained model with the settings it was trained
    and evaluated with, not the pipeline's defaults: no CFG (guidance_scale 1.0: DiffusionNFT trains and evaluates
    CFG-free), the evaluation's Euler steps (--eval-steps, else --steps; 40 in the SD3.5-M recipes), the T5 tokens
    of its text conditioning (128, DiffusionNFT's; the embedded model's 10) and its resolution, as load_run chooses
    them; on the first held-out prompt. On the embedded model's defaults these are its world's GEN_KWARGS."""
    world = load_world(args["model"]) if embedded else None
    gen = world.GEN_KWARGS if world else {}
    steps = args.get("eval_steps") or args["steps"]
    tokens = args.get("max_sequence_length") or gen.get("max_sequence_length", 128)
    res = args.get("resolution") or gen.get("height", 512)
    try:
        prompt = read_prompts(args["eval_prompts"])[0] if args.get("eval_prompts") else None
    except SystemExit:
        prompt = None
    prompt = prompt or (world.sample_prompts(1, "heldout", 0)[0] if world else "a photo of a cat")
    kwargs = dict(height=res, width=res, num_inference_steps=steps, guidance_scale=1.0, max_sequence_length=tokens)
    known = " (the world's GEN_KWARGS)" if world and kwargs == gen else ""
    return (
        f"  image = pipe({prompt!r}, {', '.join(f'{k}={v}' for k, v in kwargs.items())}).images[0]  # as trained and "
        f"evaluated{known}: no CFG, {steps} steps, {tokens} T5 tokens, {res} px"
    )


def python_str(text):
    """A Python string literal of str(text) in double quotes (JSON's escapes are Python's): a path of the closing lines
    stays valid Python whatever its name holds (a quote, a backslash), and reads as before where it holds none."""
    return json.dumps(str(text))


def print_summary(out, departure=False):
    """The closing lines of a run on the console (first process, after the progress bar), from its config.json and
    metrics.jsonl: the held-out evaluation before -> after per reward, weighted and judge (eval_before/*, logged
    with iteration 0, and the last eval/*, after iteration i: i + 1 trained); with `departure` (ReCAST's W), W's
    departure from uniform per reward, max_j |W_kj / (lambda_k / T) - 1| (0: W = lambda / T; with --column-units
    gradient the uniform share is lambda_k c_j / Lam); the run folder; the checkpoint to load, the lines of Python
    that load it (the embedded model's as kit/README.md, in float32 on the CPU; any other model's as
    configs/README.md, in bfloat16, moved to "cuda") and one that samples as the run did (`sampling_line`). Returns
    the lines printed."""
    config = json.loads((out / "config.json").read_text())
    args, rows = config["args"], [json.loads(line) for _, line in metrics_lines(out / "metrics.jsonl")]
    lines = []
    after = next((m for m in reversed(rows) if "eval/weighted" in m), None)
    before = next((m for m in rows if "eval_before/weighted" in m), {})
    if after:
        fix = "" if before else " (no evaluation of the pretrained model in this run: after only)"
        it = after["iteration"]  # 0-based, as metrics.jsonl, checkpoints/iter_N and the figures' captions count
        lines.append(f"held-out evaluation, pretrained -> after iteration {it} ({it + 1} trained){fix}:")
        for key, value in after.items():
            if key.startswith("eval/") and isinstance(value, (int, float)):
                was = before.get(key.replace("eval/", "eval_before/"))
                change = f"{was:9.4f} -> {value:9.4f}   ({value - was:+.4f})" if was is not None else f"{value:9.4f}"
                lines.append(f"  {key[5:]:<24} {change}")
    else:
        lines.append("held-out evaluation: none in this run (--eval-every 0, or no held-out prompts)")
    if departure and rows and "recast/W" in rows[-1]:
        W = np.asarray(rows[-1]["recast/W"])  # (K, T)
        departure = np.abs(W / uniform_share(W) - 1).max(1)
        each = ", ".join(f"{n} {d:.3f}" for n, d in zip(config["rewards"], departure))
        lines.append(f"W's departure from uniform, max_j |W_kj / (lambda_k / T) - 1| (0: uniform): {each}")
    lines.append(f"run folder: {out}")
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        folder = out / "checkpoints" / latest.read_text().strip() / ("ema" if args.get("ema") else "")
        embedded = is_embedded(args["model"])  # on the CPU in float32; any other model in bfloat16 on a GPU
        options, to_gpu = (
            (", local_files_only=True", "") if embedded else (", dtype=torch.bfloat16", '; pipe.to("cuda")')
        )
        lines.append(f"trained LoRA{' (its EMA, as evaluated)' if args.get('ema') else ''}: {folder}")
        lines.append(f"  {'' if embedded else 'import torch; '}from diffusers import StableDiffusion3Pipeline")
        lines.append(  # kit/README.md's, configs/README.md's: the transformer's LoRA only (no text-encoder notice)
            f"  pipe = StableDiffusion3Pipeline.from_pretrained({python_str(args['model'])}{options}); "
            f'pipe.transformer.load_lora_adapter({python_str(folder)}, prefix="transformer", '
            f'weight_name="pytorch_lora_weights.safetensors"){to_gpu}'
        )
        lines.append(sampling_line(args, embedded))
    print("\n".join(lines))
    return lines
