"""The notebooks in notebooks/ are part of the product: each one runs top to bottom here.

Every ``notebooks/*.ipynb`` is executed with nbclient on the ``python3`` kernel (cwd =
notebooks/), and any cell error fails the test; the notebooks' own asserts check the library
against dense torch references. Each notebook is authored as a jupytext percent-format ``.py``
beside it; the pair must hold the same cells (regenerate with
``jupytext --to ipynb notebooks/NN_name.py``).

In CI (``.ci/run``) the docs lane executes every notebook too (the site's build fails on any
cell error, ``nb_execution_raise_on_error``), in the same run; ``.ci/run`` sets
``FH_NOTEBOOKS_RUN_BY_DOCS_LANE=1`` for the test command, and the execution here is skipped
then (the pairs are still checked), so that CI executes each notebook once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository root
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SOURCES = sorted(NOTEBOOK_DIR.glob("*.py"))
CELL_TIMEOUT_S = 120
MAX_COMMITTED_BYTES = 200_000  # outputs are committed stripped, or small


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 3, f"expected at least 3 notebooks in {NOTEBOOK_DIR}"
    assert {p.stem for p in NOTEBOOKS} == {p.stem for p in SOURCES}, (
        "every notebook needs its jupytext percent-format .py pair and vice versa"
    )


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_notebook_in_sync_with_py(source: Path):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: jupytext --to ipynb {source}"
    committed = nbformat.read(ipynb, as_version=4)
    assert _cells(jupytext.read(source)) == _cells(committed), (
        f"{ipynb.name} differs from {source.name}: regenerate with "
        f"jupytext --to ipynb notebooks/{source.name}"
    )
    size = ipynb.stat().st_size
    assert size < MAX_COMMITTED_BYTES, f"{ipynb.name} is {size} bytes: strip its outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    if os.environ.get("FH_NOTEBOOKS_RUN_BY_DOCS_LANE") == "1":
        pytest.skip("CI's docs lane executes the notebooks in this run (.ci/run)")
    # The kernel imports this checkout of functional_hsdp, installed or not.
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), pythonpath])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    try:
        client.execute()
    finally:
        # Keep the executed copy for inspection when a cell fails.
        nbformat.write(nb, tmp_path / path.name)
