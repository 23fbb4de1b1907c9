"""The hostile matrix (tests/units/hostile.py, B17): the layer-wise units and the module path
under valid use, misuse, the user's exceptions and ranks that disagree, each case's outcome
against what the README's contract allows.

The default run is its tiny size: three cases in seconds, two on a SimMesh and one on the
module's pool of gloo ranks, each with the outcome its case expects and no leak. The whole
matrix (156 cases, each on 4 fresh gloo ranks and, where it applies, on a SimMesh, in the
default and the strict validation mode; about 15 minutes on 2 cores) is an opt-in long run,
chosen by ``FH_HOSTILE``::

    FH_HOSTILE=all python -m pytest -q -s tests/units/test_hostile.py
    FH_HOSTILE='units/diverge/*,module/*' python -m pytest -q -s tests/units/test_hostile.py

(``all``: every case; else comma-separated case names or globs.) It fails on what the matrix's
targets forbid (``hostile.violations``: a silent wrong result, a hang or a leak in either mode,
a crash in strict mode) and prints its report; the whole matrix also writes that report into
``bench/RESULTS.md`` (its ``hostile`` section, shown on the docs site's benchmark results page)
and the raw results into ``bench/raw/hostile.json``.
"""

from __future__ import annotations

import json
import os

import hostile
import pytest

from bench import common

SELECTED = os.environ.get("FH_HOSTILE", "")


def test_the_tiny_cases_end_as_their_contract_says(pool):
    res = hostile.run("tiny", pool=pool)
    assert res["cases"], res
    for case, entry in res["cases"].items():
        for key, run in entry["runs"].items():
            assert run["expected"] and not run["leak"], (case, key, run)
            assert run["checked_leak"], (case, key, run)
    md = hostile.report(res, "the tiny size", common.date())
    assert "## (B17) The hostile matrix" in md and "None." in md  # no violation


@pytest.mark.skipif(not SELECTED, reason="the whole matrix is an opt-in long run: FH_HOSTILE=all")
@pytest.mark.timeout(3600)
def test_the_matrix_meets_its_targets():
    cases = None if SELECTED == "all" else SELECTED.split(",")
    command = f"FH_HOSTILE='{SELECTED}' python -m pytest -s tests/units/test_hostile.py"
    when = common.date()
    res = hostile.run("full", cases=cases)
    md = hostile.report(res, command, when) + f"\nRun time {res['wall_s']:.0f} s.\n"
    print(md, flush=True)
    if cases is None:  # every case: the record, as the benchmarks keep theirs
        common.write_section("hostile", md, common.RESULTS)
        with open(os.path.join(common.BENCH_DIR, "raw", "hostile.json"), "w") as f:
            raw = {"command": command, "date": when, "size": "full", "result": res}
            json.dump(raw, f, indent=1, default=str)
    bad = {
        f"{name} {key}": hostile.violations(key.split("/")[1], run)
        for name, entry in res["cases"].items()
        for key, run in entry["runs"].items()
    }
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}
