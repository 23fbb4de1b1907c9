"""Every Python block of README.md runs, so the README cannot drift from the library.

Blocks that build a ``DistMesh`` run on the 4 gloo ranks of the module's pool (as under
``torchrun --nproc-per-node 4``); the others run here. A block that starts with
``# continuing the quickstart`` (or ``the layer-wise example``) runs after that example's
block, in one namespace. A block
whose last lines are ``print(...)`` followed by a ``# <output>`` comment must print that output.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


BLOCKS = _blocks()
BASES = {
    "# continuing the quickstart": next(b for b in BLOCKS if "init_device_mesh" in b),
    "# continuing the layer-wise example": next(b for b in BLOCKS if "into=mg)" in b),
}


def _program(block: str) -> str:
    for marker, base in BASES.items():
        if block.startswith(marker):
            return base + "\n" + block
    return block


def _distributed(block: str) -> bool:
    return "DistMesh(" in _program(block)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    return out.getvalue()


def _expected_output(block: str) -> str | None:
    lines = block.rstrip().splitlines()
    if len(lines) >= 2 and lines[-2].startswith("print(") and lines[-1].startswith("# "):
        return lines[-1][2:]
    return None


def test_the_readme_has_python_blocks_of_both_kinds():
    assert len(BLOCKS) >= 6
    assert any(map(_distributed, BLOCKS)) and not all(map(_distributed, BLOCKS))


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if not _distributed(b)], ids=lambda b: b.splitlines()[0][:40]
)
def test_block_runs_in_one_process(block):
    printed = _run(_program(block))
    expected = _expected_output(block)
    if expected is not None:
        assert printed.strip() == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if _distributed(b)], ids=lambda b: b.splitlines()[0][:40]
)
def test_block_runs_on_four_gloo_ranks(pool, block):
    assert pool.run(_run, _program(block), timeout=240) == [""] * 4
