"""CI's second lane (``.ci/torch-lane``: the oldest and newest torch supported) runs a subset
of the suite; these checks keep that subset honest and the supported range stated alike
everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import functional_hsdp as fh
from functional_hsdp.base import torch_releases

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository root
LANE = ROOT / ".ci" / "torch-lane"


def _lane_paths() -> list[Path]:
    block = re.search(r"LANE_TESTS=\((.*?)\)", LANE.read_text(), re.S).group(1)
    return [ROOT / p for p in block.split()]


def _lane_text() -> str:
    files = []
    for path in _lane_paths():
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    helpers = {
        ROOT / "tests" / n
        for n in ("reference.py", "transform_problem.py", "hf_problem.py", "lw_problem.py")
    }
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
    return "\n".join(p.read_text() for p in [*files, *helpers, *pages])  # test_readme runs pages


def test_the_lane_runs_every_public_name():
    """Every name of ``fh.__all__`` is used (``fh.NAME``) by a test, helper, doctest or README
    or guide block that the lane runs."""
    text = _lane_text()
    missing = [n for n in fh.__all__ if not re.search(rf"\bfh\.{n}\b|\bimport .*\b{n}\b", text)]
    assert missing == []


def test_the_lane_runs_both_carriages_and_the_readme():
    names = {p.name for p in _lane_paths()}
    assert {"test_readme.py", "test_field_gloo.py", "test_dist_gloo.py"} <= names
    assert all(p.exists() for p in _lane_paths())


def test_the_supported_range_is_stated_alike():
    """pyproject's lower bound, the README and CI's lanes name the range torch_releases
    names."""
    (lo_major, lo_minor), (hi_major, hi_minor) = torch_releases.TORCH_RANGE
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={lo_major}.{lo_minor}' in pyproject
    lanes = re.search(r"for version in ([\d. ]+); do", (ROOT / ".ci" / "run").read_text())
    releases = [tuple(map(int, v.split(".")[:2])) for v in lanes.group(1).split()]
    assert releases == [(lo_major, lo_minor), (hi_major, hi_minor)]
    readme = (ROOT / "README.md").read_text()
    assert f"torch {lo_major}.{lo_minor} through {hi_major}.{hi_minor}" in readme


def test_a_compiled_step_equals_eager_on_this_release():
    """Inside a compiled function reduce_grads is traced where dynamo can
    (``TRACES_LIBRARY``: torch >= 2.13), else run eagerly at a graph break: the same results
    on every release."""
    import optree
    import torch

    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    gen = torch.Generator().manual_seed(0)
    g = {"w": torch.randn(2, 2, 8, 4, generator=gen), "b": torch.randn(2, 2, 3, generator=gen)}

    def step(g, acc):
        return fh.reduce_grads(optree.tree_map(lambda t: 2 * t, g), spec, last=True, acc=acc)

    want = step(g, None)
    got = torch.compile(step, backend="aot_eager")(g, None)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch_releases.TRACES_LIBRARY == (torch_releases.torch_release() >= (2, 13))
