"""Run folders: choosing and checking one, locks, the launcher's process variables, resume, atomic writes, the metrics
file."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import sys
import threading
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from kit.checkpoints import check_checkpoints_are_there, load_checkpoint
from kit.figures import FIGURES, start_trackers
from kit.flags import is_script
from kit.records import git_sha, keep_metrics_until, run_id, write_atomic


def is_run(folder):
    """True when folder/config.json is a run's record (JSON with "args" and the "script" that trained it)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("args"), dict) and is_script(config.get("script"))


def is_unused(folder):
    """True when nothing is at the path, or it is a folder holding nothing but a run's lock file and a half-written
    config.json.tmp (a start that stopped before it wrote its config; the start removes the .tmp)."""
    folder = Path(folder)
    return not folder.exists() or (
        folder.is_dir() and all(p.name in (".lock", "config.json.tmp") for p in folder.iterdir())
    )


def run_folder(args, default_name):
    """The run folder, checked writable, never inside another run (whose checkpoint rotation would delete it).
    --resume: that folder. --out: a new or empty folder, or a run, which is refused unless --overwrite (a folder of
    other files is refused even then: a run writes only where nothing else lives). Default runs/<--name, else the
    script's default_name>: a fresh -1, -2, ... suffix when the name is taken, so running a command twice gives two
    runs. Creates the folder; changes nothing inside it. Under a multi-process launch only the first process decides
    (the others would see its files as another run's); load_run hands its choice to the rest. Returns the folder as a
    string, or, in the other processes, args.out as given."""
    if not is_first_process(args):
        return args.out
    for flag, path in (("--resume", args.resume), ("--out", args.out), ("--name", args.name)):
        check_path_length(path, flag)
    if args.resume:
        out = Path(args.resume)
        check_checkpoints_are_there(out)
        check_process_count(out, args)
    elif args.out:
        out = Path(args.out)
        holds_a_run = is_run(out)
        if holds_a_run and not args.overwrite:
            raise SystemExit(
                f"--out {out} already holds a run. Continue it with --resume {out}, choose another --out, "
                "or replace it with --overwrite"
            )
        if holds_a_run and not_the_runs_own(out) and not os.access(out.resolve().parent, os.W_OK):
            raise SystemExit(
                f"--overwrite {out}: it holds files that are not the run's own ({not_the_runs_own(out)[0].name}, ...), "
                f"which --overwrite moves to {set_aside_folder(out)}, and {out.resolve().parent} is not writable. "
                "Move them away yourself, or choose another --out"
            )
        if not holds_a_run and not is_unused(out):
            raise SystemExit(
                f"--out {out} holds files that are not a run of this project (a run writes only to a new or empty "
                "folder, and --overwrite replaces only runs). Choose a new folder with --out"
            )
    else:
        base = Path("runs") / (args.name or default_name)
        out = next(p for p in (base.with_name(f"{base.name}-{i}") if i else base for i in range(10**6)) if is_unused(p))
    where = Path(os.path.abspath(out))
    if len(where.parts) <= 2 or where == Path.home().absolute():
        raise SystemExit(
            f"{out} is a system folder (the root, a folder directly under it, or your home folder): a run writes only "
            "to a folder of its own. Choose one such as runs/<name> with --out"
        )
    host = next((p for p in where.parents if is_run(p)), None)
    if host is not None:
        raise SystemExit(
            f"{out} lies inside the run folder {host}, whose checkpoint rotation and --overwrite would delete it: "
            "choose a folder outside any run"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise SystemExit(f"cannot write to the run folder {out} ({err.strerror}): choose another with --out") from None
    if args.report_to == "tensorboard" or args.overwrite:
        check_tensorboard_folder(out / "tensorboard", args.report_to)
    return str(out)


def check_process_count(out, args):
    """--resume with the process count the run was trained with (config.json's "processes"; runs that predate it
    are not checked): each process draws --prompts-per-iter prompt groups, so another count changes the global
    batch, and with it the prompts and the updates of every later iteration."""
    try:
        saved = json.loads((out / "config.json").read_text()).get("processes")
    except (OSError, ValueError, AttributeError):
        return  # parse_flags has named the problem
    now, groups = process_state(args).num_processes, args.prompts_per_iter
    if saved is not None and saved != now:
        raise SystemExit(
            f"--resume {out}: the run was trained with {saved} process(es), this start has {now}; each draws "
            f"--prompts-per-iter {groups} prompt groups, so the global batch would change from {saved * groups} to "
            f"{now * groups} groups. Launch with the same count (accelerate launch --num_processes {saved}, or a "
            "plain python for 1), or start a new run"
        )


def check_path_length(path, flag):
    """A run folder path the file system can hold: no name longer than its NAME_MAX bytes (255 on Linux file
    systems), the whole within PATH_MAX; else SystemExit naming the flag and the fix."""
    if not path:
        return
    name_max, path_max = 255, 4096
    try:
        name_max, path_max = os.pathconf(".", "PC_NAME_MAX"), os.pathconf(".", "PC_PATH_MAX")
    except (OSError, ValueError):
        pass
    long = next((part for part in Path(path).parts if len(os.fsencode(part)) > name_max), None)
    if long is not None or len(os.fsencode(os.path.abspath(path))) > path_max - 100:  # 100: the run's own names
        what = f"the name {long[:30]}... has {len(os.fsencode(long))} bytes" if long else "the path is too long"
        raise SystemExit(
            f"{flag} {str(path)[:60]}...: {what}; this file system allows {name_max} bytes a name and {path_max} a "
            f"path. Choose a shorter {flag}"
        )


def check_tensorboard_folder(folder, report_to):
    """<run>/tensorboard, where --report-to tensorboard writes its events and --overwrite clears: nothing yet, or a
    folder this process can write to. Checked before the model loads (a tracker fails only once it starts)."""
    if folder.is_symlink() and not folder.exists() or folder.exists() and not folder.is_dir():
        raise SystemExit(
            f"{folder} is a file, not the run's TensorBoard folder, and a run writes its events there (--overwrite "
            "would delete it): move that file away, then run the command again"
        )
    if folder.is_dir():
        probe = folder / f".write_test.{os.getpid()}"
        try:
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            fix = "or leave --report-to at none" if report_to == "tensorboard" else "or choose another --out"
            raise SystemExit(
                f"cannot write to {folder} ({err.strerror}): make it writable (chmod -R u+w {folder}), {fix}"
            ) from None


def process_state(args):
    """accelerate's PartialState of this process (started here if no one has yet: under `accelerate launch` this
    joins the process group), on the device --device names, else CUDA when there is one. The launcher's variables
    are checked first (`launch_variables`); a process of a launch that waits for the others says so after
    WAIT_NOTICE_S and gives up after LAUNCH_WAIT_S (passed to torch.distributed as its timeout, which then bounds
    every collective too, as NCCL's default of 10 minutes does)."""
    from accelerate import PartialState

    cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    launch = None if torch.distributed.is_available() and torch.distributed.is_initialized() else launch_variables()
    if launch is None:
        return PartialState(cpu=cpu)
    rank, world, where = launch
    given = " ".join(k for k in LAUNCH_VARIABLES if k in os.environ)  # accelerate adds some of them
    notice = threading.Timer(
        WAIT_NOTICE_S,
        lambda: print(
            f"process {rank} of {world}: waiting for the other processes at {where} (gives up after {LAUNCH_WAIT_S} s)",
            file=sys.stderr,
            flush=True,
        ),
    )
    notice.daemon = True
    notice.start()
    try:
        return PartialState(cpu=cpu, timeout=datetime.timedelta(seconds=LAUNCH_WAIT_S))
    except (RuntimeError, ValueError) as err:  # torch's DistNetworkError, DistStoreError; accelerate's ValueError
        raise SystemExit(
            f"process {rank} of {world}: the other processes did not join at {where} within {LAUNCH_WAIT_S} s "
            f"({type(err).__name__}). Start them all with `accelerate launch --num_processes {world} ...`, or unset "
            f"{given} MASTER_ADDR MASTER_PORT to run one process"
        ) from None
    finally:
        notice.cancel()


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # what a launcher (torchrun) sets


LAUNCH_WAIT_S = 600  # how long a process of a launch waits for the others before it gives up


WAIT_NOTICE_S = 10  # when a waiting process says that it waits


def launch_variables():
    """The launcher's variables (LAUNCH_VARIABLES, MASTER_ADDR, MASTER_PORT), checked before any distributed start:
    None when there are none, or when their values are one process's (WORLD_SIZE 1 or unset, RANK and LOCAL_RANK 0
    or unset; a RANK alone, which starts nothing) and no MASTER_ADDR/MASTER_PORT says a launcher set them: such
    leftovers in a plain shell are removed from this process's environment, with a line that says so, and the run
    is one process. (rank, world size, "addr:port") of a launch. Values that are not whole numbers, that contradict
    each other, or of several processes without MASTER_ADDR and MASTER_PORT: SystemExit in one line naming the
    variables and the fix."""
    given = {k: os.environ[k] for k in LAUNCH_VARIABLES if k in os.environ}
    if not given:
        return None
    shown = " ".join(f"{k}={v}" for k, v in given.items())
    fix = f"Start several processes with `accelerate launch --num_processes N ...`, or unset {' '.join(given)} for one"
    bad = next((k for k, v in given.items() if not v.strip().isdigit()), None)
    if bad:
        raise SystemExit(f"launcher variables {shown}: {bad} is not a whole number. {fix}")
    n = {k: int(v) for k, v in given.items()}
    world, rank, local = n.get("WORLD_SIZE", 1), n.get("RANK"), n.get("LOCAL_RANK", 0)
    launched = bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT"))
    if world == 1 and local == 0 and (rank in (None, 0) or "WORLD_SIZE" not in given) and not launched:
        for k in given:
            del os.environ[k]
        print(f"{shown} (a launcher's variables, without MASTER_ADDR/MASTER_PORT): one process", file=sys.stderr)
        return None
    local_world = n.get("LOCAL_WORLD_SIZE", world)
    if world < 1:
        problem = "WORLD_SIZE must be 1 or more"
    elif rank is None:
        problem = "RANK is not set"
    elif rank >= world:
        problem = f"RANK {rank} is not below WORLD_SIZE {world}"
    elif local > rank or local >= local_world:
        problem = f"LOCAL_RANK {local} does not fit RANK {rank} and LOCAL_WORLD_SIZE {local_world}"
    elif not launched:
        problem = "MASTER_ADDR and MASTER_PORT are not set (no launcher started the other processes)"
    else:
        return rank, world, f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    raise SystemExit(f"launcher variables {shown}: {problem}. {fix}")


def is_first_process(args):
    """True in a single process and in the first process of an `accelerate launch`, as accelerate itself counts
    them (process index 0). Never an environment variable alone: a RANK left over from a launcher in a plain shell
    must not switch off the run-folder checks and the lock of a single-process run."""
    return process_state(args).process_index == 0


def exclusive_lock(path, refusal):
    """An exclusive lock on the file `path` for this process's lifetime (the kernel releases it with a killed
    process); SystemExit(refusal) when another live process holds it. Returns the open file (keep it referenced)."""
    handle = open(path, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SystemExit(refusal) from None
    return handle


def lock_run(out):
    """An exclusive lock on out/.lock for this process's lifetime: a second live process on the same
    folder (e.g. two --resume) is refused. Returns the open file (keep it referenced)."""
    return exclusive_lock(
        Path(out) / ".lock",
        f"{out} is in use by another live process (it holds {out}/.lock); wait for it to finish or stop it",
    )


def start_or_resume(run, args):
    """Restore the newest intact checkpoint when resuming (metrics cut back to it), or clear the folder
    for --overwrite; remove this program's .tmp leftovers; write config.json; start the --report-to tracker. A resume
    whose --iterations is below the iterations its checkpoint has trained is refused before any file changes. On
    resume, config.json's "args" are the values from the resumed iteration on, and "changed_on_resume" keeps, for each
    flag given a new value, the iteration from which it applies and the value before (`resume_changes`).
    Returns (first iteration, state)."""
    state = (
        load_checkpoint(run.out, run.transformer, run.opt, args.lr, args.weight_decay, run.scaler)
        if args.resume
        else None
    )
    start = state.pop("iteration") + 1 if state else 0
    if args.resume and state is None:
        tqdm.write(f"{run.out} has no checkpoint yet: training starts at iteration 0")
    if start > args.iterations:  # before any file changes: config.json would record fewer than metrics.jsonl holds
        raise SystemExit(
            f"--resume {run.out}: the run has trained {start} iterations (its newest checkpoint is iteration "
            f"{start - 1}), and --iterations {args.iterations} asks for fewer: nothing to train, nothing was changed. "
            f"Give --iterations {start + 1} or more to train on"
        )
    if args.resume and start == args.iterations:
        tqdm.write(
            f"--resume {run.out}: the run has trained its {start} iterations, so nothing is left to train. Give "
            f"--iterations {start + 1} or more to train on"
        )
    if run.acc.is_main_process:
        if args.overwrite:
            set_aside(run.out)  # nothing that predates the new run stays: what is not the old run's own is moved
            for name in RUN_OWN:
                shutil.rmtree(run.out / name) if (run.out / name).is_dir() else (run.out / name).unlink(missing_ok=True)
        for leftover in leftovers(run.out):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        config = {
            "args": asdict(args),
            **({"changed_on_resume": resume_changes(run.out, asdict(args), start)} if args.resume else {}),
            "script": run.script,
            "run_id": run_id(run.out) if args.resume else uuid.uuid4().hex,  # in every checkpoint (save_checkpoint)
            "rewards": run.names,
            "processes": run.acc.num_processes,  # the global batch is processes x --prompts-per-iter groups
            "git_sha": git_sha(),
        }
        try:
            write_atomic(run.out / "config.json", json.dumps(config, indent=2))
            keep_metrics_until(run.out / "metrics.jsonl", start)
        except OSError as err:
            raise SystemExit(
                f"cannot write {run.out}/config.json or metrics.jsonl ({err.strerror}): is the disk full? No "
                "half-written file is left and no run data was lost; free space, then run the same command again"
            ) from None
    start_trackers(run, args)
    return start, {"opt_steps": 0, "level_stats": None, **(state or {})}


def resume_changes(out, now, start):
    """config.json's "changed_on_resume" for a resume at iteration `start`: the earlier records of iterations before
    `start` (those at or after it are trained again, with the values given now), then one entry {"from_iteration",
    "flag", "before", "after"} per flag whose value `now` differs from the saved config's (the folder flags aside)."""
    try:
        saved = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    kept = [c for c in saved.get("changed_on_resume", []) if c.get("from_iteration", 0) < start]
    before = saved.get("args", {})
    return kept + [
        {"from_iteration": start, "flag": k, "before": before.get(k), "after": v}
        for k, v in now.items()
        if k not in ("out", "resume", "name", "overwrite") and k in before and before[k] != v
    ]


RUN_OWN = (  # what a run writes in its folder (its figures: FIGURES), deleted by --overwrite
    "config.json",
    "tensorboard",
    "metrics.jsonl",
    "checkpoints",
    "rewards.png",
    "credit.png",
    "directions.png",
    "samples.png",
)


def not_the_runs_own(out):
    """What --overwrite moves out of a run folder rather than delete: every entry but the run's own files (RUN_OWN),
    its lock, run_folder's write probes and this program's half-written leftovers (evaluate.py's results, a user's
    notes)."""
    out, ours = Path(out), set(leftovers(out))
    return sorted(
        p
        for p in out.iterdir()
        if p.name not in RUN_OWN and p.name != ".lock" and not p.name.startswith(".write_test.") and p not in ours
    )


def set_aside_folder(out):
    """Where --overwrite moves what is not the replaced run's own: <out>.set-aside beside the run folder (-2, -3, ...
    when taken)."""
    names = (f"{Path(out).name}.set-aside" + (f"-{i}" if i > 1 else "") for i in range(1, 10**6))
    return next(p for p in map(Path(out).with_name, names) if not p.exists())


def set_aside(out):
    """--overwrite: move not_the_runs_own(out) into a new set_aside_folder (renames, nothing copied or deleted) and say
    so. Returns that folder, or None when there was nothing to move."""
    entries = not_the_runs_own(out)
    if not entries:
        return None
    aside = set_aside_folder(out)
    aside.mkdir()
    for p in entries:
        os.replace(p, aside / p.name)
    names = ", ".join(p.name for p in entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    tqdm.write(f"--overwrite: {names} (not the replaced run's own) moved to {aside}")
    return aside


def leftovers(out):
    """The half-written files a kill can leave in a run folder: write_atomic's, save_atomic's (figures) and
    save_checkpoint's .tmp names (nothing else is ever deleted: a user's own *.tmp files stay)."""
    out, ckpts = Path(out), Path(out) / "checkpoints"
    figures = [out / f"{name}.png.tmp" for name in FIGURES]
    ours = [out / "config.json.tmp", out / "metrics.jsonl.tmp", *figures, ckpts / "latest.tmp"]
    ours += ckpts.glob("iter_??????.tmp")
    return [p for p in ours if p.exists()]
