"""``python -m bench <name> [<name> ...] [--size tiny|full]``; ``python -m bench all``.

Runs the benchmarks, prints each section and writes it into ``bench/RESULTS.md`` (replacing
that section only; everything else in the file is kept), with the raw figures in
``bench/raw/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import BENCHMARKS, common


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def run_one(
    name: str,
    size: str,
    command: str,
    results: str | None,
    raw_dir: str | None,
    pool=None,
    png: str | None = None,
) -> tuple[dict, str]:
    """Run benchmark ``name``; returns (raw result, markdown section)."""
    mod = BENCHMARKS[name]
    when = common.date()
    load0 = _loadavg()
    t0 = time.perf_counter()
    if name == "scaling":
        res = mod.run(size, pool=pool, png=png if png is not None else mod.PNG)
    else:
        res = mod.run(size, pool=pool)
    wall = time.perf_counter() - t0
    md = mod.report(res, command, when)
    n = getattr(mod, "PROCESSES", common.WORLD)  # busy processes of its own
    md += (
        f"\nRun time {wall:.0f} s; 1-minute load average {load0} at the start, {_loadavg()} at "
        f"the end (this benchmark's own busy processes count: {n} busy "
        f"process{'es make' if n > 1 else ' makes'} about {n}; anything above that is other "
        "work on the machine, which adds noise).\n"
    )
    if size != "full":
        md = md.replace("## ", f"## [size={size}, not a measurement to quote] ", 1)
    if results:
        common.write_section(name, md, results)
    if raw_dir:
        os.makedirs(raw_dir, exist_ok=True)
        with open(os.path.join(raw_dir, f"{name}.json"), "w") as f:
            json.dump(
                {"command": command, "date": when, "size": size, "result": res},
                f,
                indent=1,
                default=str,
            )
    return res, md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "names",
        nargs="+",
        choices=[*BENCHMARKS, "all"],
        metavar="name",
        help=f"one or more of: {', '.join(BENCHMARKS)}, all",
    )
    ap.add_argument(
        "--size",
        choices=["tiny", "full"],
        default="full",
        help="tiny: seconds, for the smoke test; full (default): the figures",
    )
    ap.add_argument(
        "--results",
        default=None,
        help="markdown file to update (default: bench/RESULTS.md for --size full, none for tiny)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args(argv)
    names = list(BENCHMARKS) if "all" in a.names else a.names
    command = "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv)
    default = common.RESULTS if a.size == "full" else None
    results = None if a.no_write else (a.results or default)
    raw_dir = os.path.join(common.BENCH_DIR, "raw") if results == common.RESULTS else None
    png = None if results == common.RESULTS or a.size == "full" else ""
    t0 = time.perf_counter()
    for name in names:
        print(f"== {name} ({a.size})", flush=True)
        _, md = run_one(name, a.size, command, results, raw_dir, png=png)
        print(md, flush=True)
    print(f"== done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
