"""Fixtures shared by the test modules.

Gloo worker processes import task functions by module name, so what a task needs lives in
importable modules: the test modules themselves and ``reference.py`` (this file is pytest's,
not imported by tests).

The tests sit in folders that mirror the package's layers (``tests/<layer>/test_*.py``;
``tests/project/``: checks of the whole project), none of them a package: pytest's default
``prepend`` import mode puts each test module's folder on ``sys.path`` and imports it by its
own name (``test_launch``, never ``mesh.test_launch``), so test module names are unique across
the folders. ``tests/`` itself is on ``sys.path`` too (pyproject's ``pythonpath``), for the
helper modules here (``reference``, ``lw_problem``, ...). Workers get the caller's ``sys.path``,
so they import both by the same names.
"""

from __future__ import annotations

import gc

import pytest

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD
from functional_hsdp.tools.testing import GlooPool


def pytest_collection_finish(session):
    """Every object alive once the test modules are imported (torch's, transformers', the
    modules' own) moved out of the collector's sight (``gc.freeze``): the suite's many
    ``gc.collect()`` calls (release and leak checks, the benchmarks' memory readings) then walk
    what the tests made, not the imports' heap (0.1-0.4 s a walk otherwise)."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """The frozen heap back in the collector's sight before the interpreter's shutdown, which
    otherwise leaves those objects alive (triton's bindings then report them as leaks)."""
    gc.unfreeze()


@pytest.fixture(scope="module")
def pool():
    """4 gloo ranks (``functional_hsdp.tools.testing.GlooPool``) shared by one module's tests."""
    with GlooPool(4, preload=(*DEFAULT_PRELOAD, "pytest")) as p:  # workers import test modules
        yield p


@pytest.fixture
def mesh() -> fh.SimMesh:
    """A 2x2 SimMesh over (dp_outer, dp_inner)."""
    return fh.SimMesh({"dp_outer": 2, "dp_inner": 2})


@pytest.fixture
def spec(mesh) -> fh.Spec:
    """hsdp on :func:`mesh`."""
    return fh.hsdp(mesh, "dp_outer", "dp_inner")
