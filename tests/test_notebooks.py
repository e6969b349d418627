"""Every `notebooks/*.ipynb` runs top to bottom in a fresh kernel without a cell error (the
notebooks assert what their text claims, so a notebook is a test), and is stored without
outputs. New notebooks are picked up by the glob."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory):
    """A `python3` kernelspec running this very interpreter (the test venv), first on
    JUPYTER_PATH so that no user- or system-wide `python3` kernel (another Python, without
    this package) shadows it. Kernels inherit the environment: CPU JAX, the repo importable."""
    d = tmp_path_factory.mktemp("jupyter")
    spec = d / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (inkling-jax tests)", "language": "python"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(d), os.environ.get("JUPYTER_PATH")])))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        mp.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
        mp.setenv("MPLBACKEND", "Agg")
        from jupyter_client.kernelspec import KernelSpecManager

        found = KernelSpecManager().get_kernel_spec("python3")
        assert found.argv[0] == sys.executable, found.argv
        yield "python3"


def _ids(paths):
    return [p.name for p in paths]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=180, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # drop the traceback's terminal colours
        pytest.fail(f"{path.name}: a cell failed\n{plain}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_stored_without_outputs(path):
    """Keep the repository small and diffs readable: commit notebooks with outputs cleared."""
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"
