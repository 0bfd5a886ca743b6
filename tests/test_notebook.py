"""derivations.ipynb runs top to bottom: every cell, and so every numerical check (assert) in it, must pass.

Executes the notebook with nbclient in a fresh `python3` kernel whose working directory is the
repository root (so `import recast`, `import rvge`, `import toy_gaussian` work), 120 s per cell.
ipykernel's wheel installs the `python3` kernel spec into sys.prefix, so a plain
`pip install -r requirements-dev.txt` is enough; if no spec is found (unusual installs) one is written
into a temporary folder for this run only, pointing at the interpreter running the tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "derivations.ipynb"


def _ensure_python3_kernelspec(tmp_path, monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    prefix = tmp_path / "jupyter-prefix"
    install(kernel_name="python3", prefix=str(prefix))
    monkeypatch.setenv(
        "JUPYTER_PATH", str(prefix / "share" / "jupyter") + os.pathsep + os.environ.get("JUPYTER_PATH", "")
    )


@pytest.mark.long(150)  # seconds on a 2-core machine, for the order only
def test_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _ensure_python3_kernelspec(tmp_path, monkeypatch)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError (with the traceback) if any cell, or any assert in it, fails
    out_dir = os.environ.get("NOTEBOOK_OUT")
    if out_dir:  # keep the executed copy for reading (never written into the repository by default)
        nbformat.write(nb, Path(out_dir) / "derivations.executed.ipynb")
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors
    assert sys.version_info >= (3, 9)
