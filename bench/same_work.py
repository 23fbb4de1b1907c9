"""Do two checkouts of the library do the same work? B9, B13 and B14 (``layerwise``, ``module``,
``dpsgd``) run on both, alternating, in one job, and compared:

- the collectives each rank issues in one step of every library variant, **in order**
  (``fh.comm_log``: op, axis, dtype, element count, reduce op), and the step's loss;
- each benchmark's own figures, run in full on each side (step time, peak step memory per
  rank, bytes on the wire).

::

    git worktree add /tmp/before <commit>
    python -m bench.same_work /tmp/before          # this checkout is "after"
    python -m bench.same_work /tmp/before --size tiny --names module   # seconds

Each side runs in a process of its own whose working directory and ``PYTHONPATH`` are that
checkout (this file is copied into the other checkout's ``bench/`` when it lacks it), so each
side imports its own ``functional_hsdp`` and ``bench``. Not a registered benchmark: it compares
two libraries rather than measuring one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

NAMES = ("layerwise", "module", "dpsgd")
# the library's variants of each benchmark (the peers' variants do not change with it)
LIBRARY = {
    "layerwise": (
        "lw_sink",
        "lw_maingrad",
        "lw_pure",
        "lw_sink_raf0",
        "lw_sink_sync",
        "whole_tree",
    ),
    "module": tuple(
        f"{k}/{v}" for k in ("llama", "mlp") for v in ("fh", "fh_recompute", "fh_bf16", "fh_func")
    ),
    "dpsgd": ("fh", "fh_dpsgd", "whole_dpsgd"),
}


def _runner(name: str, variant: str, cfg: dict, dm: Any):
    """``(runner, data(step))`` of one library variant of benchmark ``name``."""
    import importlib

    mod = importlib.import_module(f"bench.{name}")
    if name == "layerwise":
        base = mod._base(cfg)
        return mod._build(variant, cfg, base, dm), lambda k: mod._data(cfg, k)
    if name == "module":
        kind, v = variant.split("/")
        return mod._build(kind, v, cfg, dm), lambda k: (mod._data(kind, cfg, k),)
    return mod._build(variant, cfg, dm), lambda k: mod._data(cfg, k)


def _trace_task(name: str, cfg: dict) -> dict:
    """On every rank: each library variant's second step (the first one warms it) under
    ``comm_log``; its events in issue order and its loss."""
    import functional_hsdp as fh
    from bench import common as C

    dm = C.device_mesh((2, 2))
    out = {}
    for variant in LIBRARY[name]:
        runner, data = _runner(name, variant, cfg, dm)
        runner.step(*data(0))
        with fh.comm_log() as log:
            loss = runner.step(*data(1))
        out[variant] = {
            "events": [[e.op, e.axis, str(e.dtype), e.numel, e.reduce] for e in log.events],
            "loss": float(loss),
        }
        del runner
    return out


def side(names: list[str], size: str, out: str) -> None:
    """In a checkout: the traces, then each benchmark's own run; written to ``out``."""
    import importlib

    from bench import common as C

    res: dict = {"trace": {}, "bench": {}}
    for name in names:
        mod = importlib.import_module(f"bench.{name}")
        cfg = mod.SIZES[size]
        res["trace"][name] = C.on_ranks(None, _trace_task, name, cfg)
        t0 = time.perf_counter()
        res["bench"][name] = mod.run(size)
        res["bench"][name]["wall_s"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(res, f, default=str)


def _run_side(checkout: str, names: list[str], size: str, out: str) -> None:
    mine = os.path.abspath(__file__)
    theirs = os.path.join(checkout, "bench", os.path.basename(mine))
    if not os.path.exists(theirs):
        shutil.copy(mine, theirs)
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [
        sys.executable,
        "-m",
        "bench.same_work",
        "--side",
        out,
        "--size",
        size,
        "--names",
        *names,
    ]
    subprocess.run(cmd, cwd=checkout, env=env, check=True)


def _fh_keys(bench: dict, name: str) -> list[str]:
    return [k for k in bench.get("median", {}) if k in LIBRARY[name]]


_TRACE_HEAD = (
    "| variant | collectives per step (rank 0) | same order on every rank "
    "| loss before | loss after |\n|---|---|---|---|---|"
)
_BENCH_HEAD = (
    "\n| variant | step time before (s) | after (s) | peak step memory before (MiB) "
    "| after (MiB) |\n|---|---|---|---|---|"
)


def _peak_mib(res: dict, variant: str) -> float:
    mem = res.get("mem", {})
    return mem[variant]["peak"] / 2**20 if variant in mem else float("nan")


def _compare_one(before: dict, after: dict, name: str) -> tuple[list[str], bool]:
    """One benchmark's rows, and whether its collectives, losses and wire bytes match."""
    tb, ta = before["trace"][name], after["trace"][name]
    lines, same = [f"### {name}\n", _TRACE_HEAD], True
    for v in LIBRARY[name]:
        eq = all(b[v]["events"] == a[v]["events"] for b, a in zip(tb, ta))
        same &= eq and tb[0][v]["loss"] == ta[0][v]["loss"]
        lines.append(
            f"| {v} | {len(ta[0][v]['events'])} | {'yes' if eq else '**no**'} | "
            f"{tb[0][v]['loss']:.9g} | {ta[0][v]['loss']:.9g} |"
        )
    bb, ba = before["bench"][name], after["bench"][name]
    lines.append(_BENCH_HEAD)
    for v in _fh_keys(ba, name):
        times = f"{bb['median'][v]:.3f} | {ba['median'][v]:.3f}"
        lines.append(f"| {v} | {times} | {_peak_mib(bb, v):.1f} | {_peak_mib(ba, v):.1f} |")
    if "wire" in ba:
        diff = [v for v in ba["wire"] if v in bb["wire"] and ba["wire"][v] != bb["wire"][v]]
        same &= not diff
        verdict = "identical" if not diff else f"differ in {diff}"
        lines.append(f"\nBytes on the wire (every variant): {verdict}.")
    return [*lines, ""], same


def compare(before: dict, after: dict, names: list[str]) -> tuple[str, bool]:
    """A markdown report of the two sides, and whether their collectives are identical."""
    lines, same = [], True
    for name in names:
        rows, ok = _compare_one(before, after, name)
        lines += rows
        same &= ok
    return "\n".join(lines), same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.same_work", description=__doc__)
    ap.add_argument("before", nargs="?", help="the other checkout (the baseline)")
    ap.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--size", default="full", choices=["tiny", "full"])
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        side(a.names, a.size, a.side)
        return 0
    if not a.before:
        ap.error("give the baseline checkout")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for label, checkout in (("before", os.path.abspath(a.before)), ("after", here)):
            res[label] = os.path.join(tmp, f"{label}.json")
            print(f"== {label}: {checkout}", flush=True)
            _run_side(checkout, a.names, a.size, res[label])
        before, after = (json.load(open(res[k])) for k in ("before", "after"))
    report, same = compare(before, after, a.names)
    print(report)
    print(
        "collectives, their order, losses and wire bytes identical" if same else "THE SIDES DIFFER"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
