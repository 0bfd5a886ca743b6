"""What a run folder records, written atomically: its identity (config.json's run id and script), the metrics file
(one JSON line per iteration; a line cut short by a kill is dropped on resume), the git SHA, atomic file writes."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path


def write_atomic(path, text):
    """path holds `text`, or, when the write fails (OSError: a full disk), what it held before and no .tmp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def save_atomic(path, write):
    """write(tmp) to path + ".tmp", then rename it to path: a kill or a full disk mid-write leaves the old file (or
    none), never a truncated or empty one; the .tmp of a failed write is removed (a kill's by the next start)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise SystemExit(
                f"cannot write {path} ({err.strerror or err}): is the disk full? The run's metrics and checkpoints "
                f"are kept; free space, then --resume {path.parent} (it draws the figure again)"
            ) from None
        raise


def run_id(out):
    """The id a run folder's config.json records, written once when the run starts and kept by --resume (a copy of the
    folder shares it): save_checkpoint writes it into each state.pt, so that evaluate.py knows a checkpoint of another
    run. A run that predates it gets one at its next resume."""
    try:
        return json.loads((Path(out) / "config.json").read_text()).get("run_id") or uuid.uuid4().hex
    except (OSError, ValueError, AttributeError):
        return uuid.uuid4().hex


def run_identity(out):
    """{"run_id", "script"} of the run folder's config.json (None for what it lacks): what a checkpoint records of
    the run that wrote it."""
    try:
        config = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    return {"run_id": config.get("run_id"), "script": config.get("script")}


def git_sha():
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def append_metrics(out, metrics):
    """One line of out/metrics.jsonl. A failed write (a full disk) stops the run with the fix: the lines before are
    kept, a cut-short last line is dropped by the resume, which redoes the iterations after the last checkpoint."""
    try:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
    except OSError as err:
        raise SystemExit(
            f"cannot append iteration {metrics['iteration']}'s metrics to {out}/metrics.jsonl ({err.strerror}): is the "
            f"disk full? The earlier lines and the last checkpoint are kept; free space, then --resume {out}"
        ) from None


def metrics_lines(path):
    """(iteration, line) of each line of a metrics.jsonl. A last line that does not decode is a write a kill cut
    short and is left out; a damaged line before the last is not ours to drop: SystemExit naming it and the fix."""
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append((int(json.loads(line)["iteration"]), line))
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise SystemExit(
                    f"{path}: line {number} of {len(lines)} is damaged ({line[:40]!r}...); a resume would lose it. "
                    "Repair or delete that line, then --resume again"
                ) from None
    return rows


def keep_metrics_until(path, start):
    """On resume, keep the metric lines of iterations before `start` (later ones will be redone); a partial last
    line (a kill or a full disk mid-write) is dropped (metrics_lines)."""
    if path.exists():
        write_atomic(path, "".join(line + "\n" for it, line in metrics_lines(path) if it < start))
