"""ReCAST's controls and the files a run starts from: recast.py's flags beyond the method, each called there in a line.

recast.py holds the method (W and its solver, the gains, D measured with errors, credit, the update, train); what W's
inputs and W itself can be besides ReCAST's own sits here, off the method's page:

    W's columns     --column-units gradient (columns equal in gradient units) and any W whose columns differ, split into
                    step weights and an equal-column W: `column_sums`, `gradient_unit_columns`, `step_weights`,
                    `equal_columns` (NOTES.md §3.4; derivations.ipynb §4 and §11)
    credit in time  --credit recast_reversed, the control: W from each profile flipped in time (`controlled_W_inputs`)
    W from a file   --credit file --credit-file W.json, held fixed (the control of recast-steps): `fixed_W_of`,
                    `read_credit_file`
    the prior       --gain-init: the level statistics iteration 0 starts from (the world's pretrained profiles by
                    default, or a file of experiments/protocol.py's `measure_profiles`): `gain_prior`,
                    `read_level_stats`
    the start       both files are read once, when a run starts, and kept by its checkpoints: `record_absolute_paths`,
                    `resumes_a_checkpoint`, `started_with`

The controls answer a reviewer's questions about ReCAST (experiments/bench.py: recast-reversed, recast-units,
recast-steps; the protocol's recast_prior arm); off by default, they leave ReCAST as it is. This module imports nothing
of recast.py, which imports it; its functions' tests are in test_recast.py and tests/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kit.worlds import EMBEDDED_MODEL, load_world

# =============================================================================
# W's columns: in loss or gradient units; a W whose columns differ as step weights
# =============================================================================


def column_sums(column_units, sigmas, budgets):
    """W's column sums: None (loss units, ReCAST's: Lam / T each) or, with --column-units gradient,
    `gradient_unit_columns`."""
    return gradient_unit_columns(sigmas, budgets) if column_units == "gradient" else None


def gradient_unit_columns(sigmas, budgets):
    """Column sums equal in gradient units (--column-units gradient): c_j propto 1 / s_j, scaled to sum to Lam.
    nft.nft_loss's velocity gradient per unit weight at t = s_j is proportional to s_j (derivations.ipynb §11), so
    c_j s_j, each step's share of the update, is the same for every step. sigmas (T+1,) -> (T,)."""
    inv = 1.0 / np.asarray(sigmas[:-1], dtype=np.float64)
    return float(np.sum(budgets)) * inv / inv.sum()


def step_weights(W):
    """The loss's weight per step and the W that mix_optimality reads: ReCAST's (None, W) where W's columns are equal
    (loss units); where they differ (--column-units gradient, a --credit file W), `equal_columns` splits them into
    omega (T,) float32 and the equal-column W'. Either way the loss at step j is sum_k (T / Lam) W_kj L(r_k)."""
    cols = np.asarray(W, dtype=np.float64).sum(0)
    if np.allclose(cols, cols.mean(), rtol=1e-6, atol=0):
        return None, W
    omega, W = equal_columns(W)
    return torch.as_tensor(omega, dtype=torch.float32), W


def equal_columns(W):
    """Split a W with unequal column sums c_j into the step weight omega_j = T c_j / Lam and the equal-column
    W' = W Lam / (T c_j). The NFT loss is linear in r (derivations.ipynb §4), so
    sum_k (T / Lam) W_kj L(r_k) = omega_j L(r~'_j) with r~'_j = mix_optimality(r, W', j) in [0, 1].
    A column of zeros (a --credit file's "no weight at these steps") gets omega_j = 0 and the uniform column
    Lam / (K T) in W' (any column would do: the step's loss is multiplied by 0, so its samples carry no policy
    gradient). W (K, T) -> (omega (T,), W')."""
    W = np.asarray(W, dtype=np.float64)
    Lam, (K, T), c = W.sum(), W.shape, W.sum(0)
    used = c > 0
    return T * c / Lam, np.where(used, W * (Lam / T) / np.where(used, c, 1.0), Lam / (K * T))


# =============================================================================
# W's inputs under the controls: --credit recast_reversed, --column-units gradient
# =============================================================================


def controlled_W_inputs(settings, P, sigmas, budgets):
    """The profile and the column sums W is solved with: ReCAST's own (P, None: columns Lam / T each) unless a
    control changes them. --credit recast_reversed, the control for credit in time: each reward's profile flipped in
    time (the same marginals as recast's W; with equal columns it is recast's W flipped). --column-units gradient:
    the column sums of `column_sums`. settings: recast.CreditSettings; P (K, T) -> (P_W (K, T), cols (T,) or None)."""
    P_W = P[:, ::-1] if settings.reverse_time else P
    return P_W, column_sums(settings.column_units, sigmas, budgets)


# =============================================================================
# --credit file: a W given in a file, held fixed
# =============================================================================


def fixed_W_of(args, names, budgets):
    """--credit file, W held fixed (recast-steps: one reward's weight moved between steps at equal measured share):
    the (K, T) array of --credit-file (`read_credit_file` refuses a file that does not fit the run), None for
    every other --credit. Its rows may differ from the budgets and its columns from each other (`step_weights` weights
    each step by its column sum)."""
    if args.credit != "file":
        if args.credit_file:
            raise SystemExit(f"--credit-file {args.credit_file} is read with --credit file only: add --credit file")
        return None
    return read_credit_file(args.credit_file, names, args.steps, budgets)


def read_credit_file(path_name, names, T, budgets):
    """The (K, T) W of a --credit file: JSON {"rewards": [names in --rewards order], "W": K x T entries}. Refused,
    naming the file and the fix: missing or not that JSON, its rewards other than `names` (in order), its shape other
    than (K, T), a negative or non-finite entry, or a total other than the budgets' sum (the loss is normalised by W's
    total, so the total fixes nothing but this check)."""
    path = Path(path_name)
    if not path_name or not path.is_file():
        what = f"{path} is not one" if path_name else "none was given"
        raise SystemExit(f"--credit file needs --credit-file, a JSON file with the W to train with; {what}")
    try:
        spec = json.loads(path.read_text())
        W = np.asarray(spec["W"], dtype=np.float64)
        rewards = spec["rewards"]
    except (ValueError, KeyError, TypeError) as err:
        raise SystemExit(f'--credit-file {path}: not {{"rewards": [...], "W": [[...]]}} JSON ({err}); fix the file')
    problem = (
        f"its rewards is {rewards!r}, not a list of names ({list(names)})"
        if not isinstance(rewards, list) or not all(isinstance(n, str) for n in rewards)
        else f"its rewards {rewards} are not --rewards {list(names)} (in that order)"
        if rewards != list(names)
        else f"W has shape {W.shape}, not ({len(names)}, {T}) (rewards x --steps)"
        if W.shape != (len(names), T)
        else "W has a negative or non-finite entry"
        if not np.all(np.isfinite(W)) or np.any(W < 0)
        else f"W sums to {W.sum():.6g}, not the budgets' sum {sum(budgets):.6g}"
        if not np.isclose(W.sum(), sum(budgets), rtol=1e-6, atol=0)
        else None
    )
    if problem:
        raise SystemExit(f"--credit-file {path}: {problem}; fix the file or the flags")
    return W


# =============================================================================
# --gain-init: the level statistics a run starts from
# =============================================================================


def gain_prior(args, names, sigmas=None, world=None):
    """--gain-init: the discounted level statistics the run starts from (`read_level_stats` refuses a file that
    does not fit), else None. `world` is the embedded world's pretrained profiles (its PROFILES_PATH) where
    they fit the run, else None; `none` (or empty) is None. sigmas, world: the run's grid and world id, compared with
    the file's where known (`read_level_stats`)."""
    if args.gain_init in ("", "none"):
        return None
    if args.gain_init != "world":
        fix = (
            f"The run {args.resume} has no checkpoint yet, so it starts at iteration 0 and reads the file: put it "
            "back, or start a new run"
            if args.resume
            else None
        )
        return read_level_stats(args.gain_init, names, args.steps, fix, sigmas, world)
    profiles = load_world(EMBEDDED_MODEL).PROFILES_PATH
    saved = json.loads(profiles.read_text())
    fits = (
        Path(args.model).resolve() == Path(EMBEDDED_MODEL).resolve()  # a world variant is another world
        and (args.gain_estimator, args.sampler, args.steps) == ("pairs", "tree", saved["steps"])
        and set(names) <= set(saved["names"])
    )
    return read_level_stats(profiles, names, args.steps, None, sigmas, world) if fits else None


def read_level_stats(path, names, T, fix=None, sigmas=None, world=None):
    """[n (T+1,), s1 (K, T+1), s2 (K, T+1)]: the rows of `names` from a level-statistics file (experiments/protocol.py
    `measure_profiles`), the gain statistics recast.py starts from with --gain-init. They are discounted by
    --gain-ema like the run's own, so the prior's weight halves every ~7 iterations at 0.9. A file that is missing,
    not JSON, without the run's rewards, of other steps, of the wrong shapes, with null/NaN/inf statistics or negative
    counts or sums of squares (either would switch the credit off: W uniform, evidence 0), or, where the file records
    them, measured on another sampler grid (`sigmas`, the run's (T+1,)) or another world (`world`, the run's world id)
    is refused naming the file and the field, and `fix` (by default: make the file, or omit --gain-init)."""
    fix = fix or "Make one with experiments/protocol.py's measure_profiles, or omit --gain-init"
    try:
        saved = json.loads(Path(path).read_text())
        rows = [saved["names"].index(k) for k in names]
        steps, estimator = saved["steps"], saved.get("estimator", "pairs")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(
            f"--gain-init {path}: not a readable level-statistics file holding rewards {names} ({type(err).__name__}: "
            f"{str(err)[:200]}). {fix}"
        ) from None
    if steps != T or estimator != "pairs":
        raise SystemExit(
            f"--gain-init {path}: measured with {steps} steps ({estimator}), this run has --steps {T} (pairs). {fix}"
        )
    grid = np.asarray(saved.get("sigmas", []), dtype=np.float64)
    if sigmas is not None and grid.size and (grid.shape != (T + 1,) or not np.allclose(grid, sigmas, atol=1e-5)):
        raise SystemExit(
            f"--gain-init {path}: measured on the sampler grid {np.round(grid, 3).tolist()}, this run samples on "
            f"{np.round(np.asarray(sigmas, dtype=np.float64), 3).tolist()}. {fix}"
        )
    if world is not None and saved.get("world") not in (None, world):
        raise SystemExit(
            f"--gain-init {path}: measured on world {saved['world']}, this run's model is world {world}. {fix}"
        )
    stats = []
    for key, shape in (("n", (T + 1,)), ("s1", (len(saved["names"]), T + 1)), ("s2", (len(saved["names"]), T + 1))):
        try:
            value = np.asarray(saved.get(key), dtype=np.float64)  # null -> NaN, refused below
        except (ValueError, TypeError):
            value = np.asarray(None)
        if value.shape != shape:
            raise SystemExit(
                f"--gain-init {path}: field {key!r} is not an array of shape {shape} (steps + 1 levels"
                f"{'' if key == 'n' else ', one row per reward in names'}). {fix}"
            )
        if not np.isfinite(value).all():
            raise SystemExit(
                f"--gain-init {path}: field {key!r} holds {int((~np.isfinite(value)).sum())} null/NaN/inf entries; "
                f"they would switch ReCAST's credit off (W uniform). {fix}"
            )
        if key in ("n", "s2") and (value < 0).any():
            raise SystemExit(
                f"--gain-init {path}: field {key!r} holds {int((value < 0).sum())} negative entries (a count, a sum "
                f"of squares); they would switch ReCAST's credit off (W uniform). {fix}"
            )
        stats.append(value if key == "n" else value[rows])
    return stats


# =============================================================================
# Read once, when a run starts: the files of --gain-init and --credit-file, kept by the checkpoints
# =============================================================================


def record_absolute_paths(args):
    """A new run's --gain-init and --credit-file as absolute paths (config.json records them so): a --resume from
    another folder names the same files. --gain-init's world and none stay as they are."""
    if args.gain_init not in ("", "none", "world"):
        args.gain_init = os.path.abspath(args.gain_init)
    if args.credit_file:
        args.credit_file = os.path.abspath(args.credit_file)


def resumes_a_checkpoint(args):
    """Whether this start continues a run from a checkpoint (--resume of a folder that holds one): --gain-init and
    --credit-file were read when the run started, and the checkpoint holds what they gave."""
    return bool(args.resume) and any((Path(args.resume) / "checkpoints").glob("iter_??????"))


def started_with(run, args, start, state):
    """What --gain-init and --credit-file give a run, read once, when it starts (iteration 0), so that a resumed run
    trains on exactly what it started with, whatever became of the files since. --gain-init: the level statistics
    iteration 0 starts from (state["level_stats"]; a checkpoint holds the run's own since). --credit file: its W
    (`fixed_W_of`), recorded in state["credit_W"] and so in every checkpoint; a resume trains the recorded W and says
    so when the file now differs or is gone (a checkpoint that predates the record reads the file). Returns the W of
    --credit file, else None."""
    if start == 0:
        world = run.world.world_id(args.model) if run.world is not None else None
        prior = gain_prior(args, run.names, run.sigmas.numpy(), world)  # the world's pretrained profiles by default
        if prior is not None:
            state["level_stats"] = prior
    if args.credit != "file":
        return None
    W = state.get("credit_W") if start > 0 else None
    if W is None:
        W = fixed_W_of(args, run.names, run.budgets)
    elif run.acc.is_main_process:
        try:
            now = read_credit_file(args.credit_file, run.names, args.steps, run.budgets)
            by = np.abs(now - W).max()
            change = f"differs from the W the run started with (entries by up to {by:.3g})" if by > 0 else None
        except SystemExit as err:
            change = f"no longer gives a W for this run ({err})"
        if change:
            tqdm.write(
                f"--credit-file {args.credit_file} {change}: the run goes on with the W it started with, recorded "
                "in its checkpoints. To train the file's W, start a new run with it"
            )
    state["credit_W"] = np.asarray(W, dtype=np.float64)
    return state["credit_W"]
