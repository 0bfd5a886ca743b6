"""What one training run holds (`Run`, loaded by `load_run`), and the kit's part of each iteration: the prompts, the
permuted-reward control, the rollouts' diagnostics (DiffusionNFT's reward spread, rollout images to the tracker), the
stop when a reward failed, and step 4 (`finish_iteration`: metrics line, held-out evaluation, figures, checkpoint)."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

import nft
import sd3
from kit.checkpoints import save_checkpoint
from kit.checks import distinct_prompts, read_prompts
from kit.figures import log_rollouts, log_to_trackers, show_evaluation
from kit.folders import is_first_process, lock_run, process_state
from kit.records import append_metrics
from kit.reward_models import build_rewards
from kit.worlds import load_world, reward_extras

if TYPE_CHECKING:  # the types Run's fields name; diffusers and accelerate load when a run starts (`load_run`)
    from accelerate import Accelerator
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline


@dataclass
class Run:
    """What one training run holds once it is set up (`load_run`); each step of a script's train reads it."""

    acc: Accelerator  # accelerate: the processes, this one's device, the --report-to tracker
    pipe: StableDiffusion3Pipeline  # the real SD3.5-M or the embedded tiny one: frozen VAE and text encoders
    transformer: SD3Transformer2DModel  # pipe.transformer, LoRA adapters "default" (trained), "old" (sampling), "ema"
    names: list[str]  # reward names, in budget order
    budgets: list[float]  # lambda_k, one per reward, as given (not normalised)
    branch: str | list[int]  # --branch-steps: "rotate", or the branch steps every prompt group takes
    rewards: list  # reward callables (images, prompts) -> (N,), in names' order
    judges: dict | None  # held-out judges {name: (images, prompts) -> (N,)}, read by the evaluation only
    frechet: object  # held-out drift judge (set level) (images, prompts) -> float, or None
    sigmas: torch.Tensor  # (T+1,) float32, 1 -> 0: the sampler grid, W's columns and the training timesteps
    eval_sigmas: torch.Tensor  # (eval steps + 1,): the evaluation sampler's grid
    shape: tuple[int, int, int]  # (C, h, w) of one image's latent
    opt: torch.optim.Optimizer  # AdamW on the "default" adapter's parameters
    eval_prompts: list[str]  # the held-out prompts of every evaluation
    out: Path  # the run folder
    lock: object  # the open out/.lock of the first process (held while the run lives), None in the others
    script: str  # the script training it (recast, rvge): config.json's "script", the W&B project
    world: object  # the world module --model names (`worlds.load_world`: the embedded model's), else None
    train_prompts: list[str] | None  # --train-prompts' lines (None: the embedded world samples its own)
    max_len: int  # T5 tokens of the text conditioning
    prompts_per_iter: int  # prompt groups per iteration and process
    seed: int  # --seed, which draws the prompts
    autocast: Callable  # () -> the context of the transformer's forwards and the decodes (`sd3.autocast`)
    reduce: Callable  # numpy statistics summed over processes (`nft.process_sum`)
    all_reduce_grads: Callable  # params -> their gradients averaged over processes in place (`nft.average_grads`)
    keep_checkpoints: int = 2  # --keep-checkpoints: the newest N kept (0: all)
    precision: sd3.Precision | None = None  # --mixed-precision, --dtype: the weights' dtypes and the autocast
    scaler: torch.amp.GradScaler | None = None  # the gradient scaler of a float16 autocast (`nft.optimizer_step`)
    permute_rewards: str = ""  # --permute-rewards: the rewards the permuted-reward control shuffles (`permuted`)
    shows_W: bool = True  # whether W is part of the method's training signal: its image in credit.png and the tracker
    rollouts_every: int = 0  # --log-rollouts-every: the iterations whose rollout images go to the tracker (0: none)

    def permuted(self, R, groups, it):
        """--permute-rewards, a control of the experiments: R (N, K) with the named rewards shuffled within each prompt
        group (`permute_within_groups`); R itself when the run is no control."""
        return permute_within_groups(R, groups, self.names, self.permute_rewards, self.seed, it, self.acc.process_index)

    def rollout_diagnostics(self, it, b):
        """DiffusionNFT's diagnostics of iteration `it`'s rollouts b (nft.Rollout), for its metrics line (every process
        calls it): per reward and for the budget-weighted raw sum (`nft.combine_raw`, DiffusionNFT's "avg"), the mean
        over prompt groups of the rewards' std within the group (reward_spread/*) and the share of groups whose
        rewards all tie (reward_zero_spread/*: groups that teach that reward nothing), over all processes
        (`group_spread`). Every --log-rollouts-every iterations the main process also logs the images of its first
        ROLLOUTS_SHOWN rollouts to the --report-to tracker (`figures.log_rollouts`)."""
        R = np.column_stack([b.R, nft.combine_raw(b.R, self.budgets)])
        spread, tied, counted = self.reduce(np.stack(group_spread(R, b.groups)))
        counted = np.where(counted > 0, counted, np.nan)  # no finite reward in any group: NaN
        names = [*self.names, "weighted"]
        out = {f"reward_spread/{n}": float(v) for n, v in zip(names, spread / counted)}
        out.update({f"reward_zero_spread/{n}": float(v) for n, v in zip(names, tied / counted)})
        if self.rollouts_every and it % self.rollouts_every == 0 and self.acc.is_main_process and self.acc.trackers:
            shown = min(ROLLOUTS_SHOWN, len(b.leaves))
            with self.autocast():
                images = sd3.decode(self.pipe, b.leaves[:shown])
            weighted = nft.budget_mean(b.R[:shown].T, self.budgets)
            log_rollouts(self.acc, it, images, [b.prompts[g] for g in b.groups[:shown]], weighted)
        return out

    def prompts_for(self, it):
        """This process's prompt groups of iteration `it`."""
        acc = self.acc
        if self.world:
            return self.world.sample_prompts(
                self.prompts_per_iter, "train", self.seed * 7919 + it * 97 + acc.process_index
            )
        return distinct_prompts(
            self.train_prompts, self.prompts_per_iter, [self.seed, it], acc.process_index, acc.num_processes
        )


def load_run(args, names, budgets, branch, script, extra_rewards=None, judges=None, lock=True, shows_W=True):
    """Everything one run needs, loaded, after the script's checks (its `validate` gave names, budgets and branch):
    the run folder locked (lock=False: evaluate.py, which only reads a run, perhaps one still training), processes
    and device, seeds, the pipeline with its LoRA adapters, rewards, judges, the optimizer, prompts. Returns the Run."""
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list

    sd3.quiet_start_up()
    lock = lock_run(args.out) if lock and is_first_process(args) else None
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if process_state(args).num_processes > 1:  # the first process chose the run folder
        args.out = broadcast_object_list([args.out], from_process=0)[0]
    trackers = {} if args.report_to == "none" else {"log_with": args.report_to, "project_dir": args.out}
    acc = Accelerator(cpu=device_name == "cpu", **trackers)
    prec = sd3.precision(args, acc.device.type)
    if prec.tf32 and acc.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(args.seed)
    world = load_world(args.model)
    gen_kwargs = world.GEN_KWARGS if world else {}
    res = args.resolution or gen_kwargs.get("height", 512)
    max_len = args.max_sequence_length or gen_kwargs.get("max_sequence_length", 128)  # 128: DiffusionNFT's T5 length
    text_dtype = prec.text_encoders if prec.text_encoders != prec.transformer else None
    pipe = sd3.load_pipeline(args, acc.device, prec.transformer, text_dtype)
    pipe.scheduler.set_timesteps(args.steps)
    train_prompts = read_prompts(args.train_prompts, "--train-prompts") if args.train_prompts else None
    if world is None and train_prompts is None:
        raise SystemExit("--train-prompts FILE is required for this model (one prompt per line)")
    return Run(
        acc=acc,
        pipe=pipe,
        transformer=pipe.transformer,
        names=names,
        budgets=budgets,
        branch=branch,
        rewards=build_rewards(names, replace(args, device=str(acc.device)), reward_extras(args.model, extra_rewards)),
        judges=judges if judges is not None or world is None else world.JUDGES,
        frechet=world.frechet_distance if world else None,
        sigmas=pipe.scheduler.sigmas.float().cpu(),
        eval_sigmas=sd3.scheduler_sigmas(pipe, args.eval_steps or args.steps),
        shape=(pipe.transformer.config.in_channels, res // pipe.vae_scale_factor, res // pipe.vae_scale_factor),
        opt=torch.optim.AdamW(sd3.lora_params(pipe.transformer, "default"), lr=args.lr, weight_decay=args.weight_decay),
        eval_prompts=read_prompts(args.eval_prompts, "--eval-prompts")
        if args.eval_prompts
        else (world.sample_prompts(16, "heldout", 0) if world else []),
        out=Path(args.out),
        lock=lock,
        script=script,
        world=world,
        train_prompts=train_prompts,
        max_len=max_len,
        prompts_per_iter=args.prompts_per_iter,
        seed=args.seed,
        keep_checkpoints=args.keep_checkpoints,
        precision=prec,
        scaler=sd3.gradient_scaler(acc.device.type, prec),
        autocast=functools.partial(sd3.autocast, prec, acc.device.type),
        reduce=functools.partial(nft.process_sum, acc),
        all_reduce_grads=functools.partial(nft.average_grads, acc),
        permute_rewards=args.permute_rewards,
        shows_W=shows_W,
        rollouts_every=args.log_rollouts_every,
    )


def seed_everything(seed):
    """Seeds Python's `random`, numpy's global RNG and torch's CPU and CUDA default generators.
    The loop itself draws every random number from per-iteration generators seeded by
    (seed, iteration), so a resumed run repeats the iterations an uninterrupted one would."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def stop_if_a_reward_failed(run: Run, it, n_valid, state):
    """Stop the run when a reward returned NaN/inf for every image of iteration `it` (all processes): the state
    after iteration it - 1 is checkpointed (at iteration 0 nothing was trained and nothing is saved, so that a
    resume trains iteration 0), and the message names the reward(s) and how to continue. n_valid (K,)."""
    if (n_valid == 0).any():
        if run.acc.is_main_process and it > 0:
            save_checkpoint(run.out, it - 1, run.transformer, run.opt, state, run.keep_checkpoints, run.scaler)
        bad = [n for n, c in zip(run.names, n_valid) if c == 0]
        done = f"the state after iteration {it - 1} is saved in {run.out}" if it else "nothing was trained"
        raise SystemExit(
            f"reward(s) {bad} returned NaN/inf for every image of iteration {it}; {done}. "
            f"Fix the reward, then continue with --resume {run.out}"
        )


def finish_iteration(run: Run, args, it, metrics, state, before, sample, rollout):
    """Step 4: DiffusionNFT's diagnostics of the iteration's rollouts (`Run.rollout_diagnostics` of `rollout`),
    evaluate (`evaluate` with the held-out sampler `sample`, nft.ode_sample, every eval_every iterations and at the
    end; every process takes its share), append the metrics line, draw the figures and log them (at each evaluation),
    checkpoint (every save_every iterations and at the end). `before` the first evaluation's metrics (or None).
    Returns whether it drew the figures (it evaluated)."""
    last = it == args.iterations - 1
    metrics.update(run.rollout_diagnostics(it, rollout))  # every process: its sums are over all of them
    evaluated = None
    if args.eval_every and run.eval_prompts and ((it + 1) % args.eval_every == 0 or last):
        evaluated = evaluate(run, args, sample)
    if run.acc.is_main_process:
        if before:
            metrics.update({k.replace("eval/", "eval_before/"): v for k, v in before.items()})
        if evaluated:
            metrics.update(evaluated[0])
        metrics["train/optimizer_step"] = state["opt_steps"]  # all optimizer steps so far: DiffusionNFT's global_step
        append_metrics(run.out, metrics)
        names = run.names if run.shows_W else None  # no W image where W plays no part
        log_to_trackers(run.acc, metrics, step=it, names=names)
        if evaluated:
            show_evaluation(run, it, evaluated, state)
        if (it + 1) % args.save_every == 0 or last:
            save_checkpoint(run.out, it, run.transformer, run.opt, state, run.keep_checkpoints, run.scaler)
    run.acc.wait_for_everyone()
    return evaluated is not None


EVAL_SEED = 12345  # the held-out noise of every evaluation of every run and method, and of evaluate.py


SHOWN = 16  # the held-out prompts whose samples an evaluation returns, draws (samples.png) and keeps


def evaluate(run: Run, args, sample):
    """Held-out evaluation of the trained adapter (its EMA with --ema, as DiffusionNFT evaluates): the Euler ODE
    (`sample`: nft.ode_sample, passed in, as the kit imports no algorithm) with --eval-steps from fixed noise
    (EVAL_SEED) on the held-out prompts, training rewards and held-out judges. Every process samples, decodes and
    scores its consecutive share of the prompts, from the noise that prompt has when one process samples them all;
    the shares are gathered, so every process returns what one process would: (metrics, the images of the first
    SHOWN prompts, R (P, K) the rewards per image). Only those images travel between processes, unless a set-level
    judge (frechet) needs them all."""
    from accelerate.utils import gather_object

    acc, prompts = run.acc, run.eval_prompts
    share = np.array_split(np.arange(len(prompts)), acc.num_processes)[acc.process_index]
    noise = torch.randn((len(prompts), *run.shape), generator=torch.Generator().manual_seed(EVAL_SEED))
    mine, images, R, judged = [prompts[i] for i in share], [], np.zeros((0, len(run.names))), {}
    if len(mine):
        emb, pooled = sd3.encode(run.pipe, mine, run.max_len, acc.device)
        run.transformer.set_adapter("ema" if args.ema else "default")
        with run.autocast():  # DiffusionNFT's evaluation samples and decodes under its autocast too
            latents = sample(
                run.transformer, emb, pooled, run.eval_sigmas, run.shape, EVAL_SEED, args.rollout_batch, noise[share]
            )
            images = sd3.decode(run.pipe, latents)
        run.transformer.set_adapter("default")
        R = nft.score(run.rewards, images, mine)
        judged = {name: np.asarray(fn(images, mine), dtype=np.float64) for name, fn in (run.judges or {}).items()}
    first = share[0] if len(share) else len(prompts)
    images = images if run.frechet else images[: max(0, SHOWN - first)]
    shares = gather_object([(images, R, judged)])  # [(images, R, judged)] of every process, in process order
    images, R = [im for part in shares for im in part[0]], np.concatenate([part[1] for part in shares])
    metrics = {f"eval/{n}": float(np.nanmean(R[:, k])) for k, n in enumerate(run.names)}
    metrics["eval/weighted"] = float(nft.budget_mean(np.nanmean(R, 0), run.budgets))
    for name in run.judges or {}:
        values = np.concatenate([part[2][name] for part in shares if name in part[2]])
        metrics[f"eval/judge/{name}"] = float(np.nanmean(values))
    if run.frechet:
        metrics["eval/judge/frechet"] = float(run.frechet(images, prompts))
    return metrics, images[:SHOWN], R


def evaluate_before(run: Run, args, sample, state):
    """The first evaluation, before any update (the pretrained model's samples): its metrics (logged as
    eval_before/* with iteration 0), its images and per-image rewards kept in `state` (and so in every checkpoint)
    for the before/after figure `samples.png`."""
    metrics, images, R = evaluate(run, args, sample)
    if run.acc.is_main_process:
        state["samples_before"] = (np.stack([np.asarray(im.convert("RGB")) for im in images]), R[: len(images)])
        show_evaluation(run, None, (metrics, images, R), state)
    return metrics


ROLLOUTS_SHOWN = 15  # the rollouts whose images an iteration logs to the tracker (DiffusionNFT's 15)


def group_spread(R, groups):
    """DiffusionNFT's `calculate_zero_std_ratio` per column of R (N, K) over the prompt groups (N,) of one process,
    as three (K,) sums that add over processes (groups never straddle them): the std (numpy's, ddof 0) of each group's
    finite rewards, the number of groups whose finite rewards all tie (max = min: their advantages are 0), and the
    number of groups with a finite reward. reward_std_mean and zero_std_ratio are the first two over the third."""
    R, groups = np.asarray(R, dtype=np.float64), np.asarray(groups)
    spread, tied, counted = np.zeros((3, R.shape[1]))
    for g in np.unique(groups):
        for k, column in enumerate(R[groups == g].T):
            finite = column[np.isfinite(column)]
            if len(finite):
                spread[k] += finite.std()
                tied[k] += finite.max() == finite.min()
                counted[k] += 1
    return spread, tied, counted


# =============================================================================
# The experiments' control (--permute-rewards), applied through `Run.permuted`
# =============================================================================


def permute_within_groups(R, groups, names, permute, seed, it, rank=0):
    """--permute-rewards, the control that could prove a method wrong: the columns of R (N, K) named in `permute`
    (comma-separated, from `names`) shuffled among the leaves of each prompt group by a permutation fixed by
    (seed, iteration, process). Each group keeps its values (its mean and spread, so the optimality's scale), which
    no longer belong to its images. Returns R itself when nothing is permuted, else a copy."""
    cols = [names.index(n.strip()) for n in permute.split(",") if n.strip()]
    if not cols:
        return R
    out = R.copy()
    out[:, cols] = shuffle_within_groups(R[:, cols], groups, np.random.default_rng([seed, it, rank, 7]))
    return out


def shuffle_within_groups(R, groups, rng):
    """R (N, ...) with each group's rows shuffled among themselves: one rng.permutation per group, in the order of
    np.unique(groups). Returns a copy. (--permute-rewards; the trainable toy's permuted control.)"""
    out, groups = R.copy(), np.asarray(groups)
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        out[rows] = R[rng.permutation(rows)]
    return out
