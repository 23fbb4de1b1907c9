"""The cost of cross-rank validation: a first call (fingerprint exchange) vs a cached call.

Standalone: ``python bench/validation_cost.py`` starts 4 gloo ranks (2x2 mesh, one thread
each; ``functional_hsdp.launch.run``), times ``reduce_grads`` (hsdp, last=True) on trees of
several sizes, and writes its section of ``bench/RESULTS.md`` (between its own markers; the rest
of the file is kept).

Per tree, each figure is the median over repeats of the slowest rank, ranks started together
by a barrier:

* first call, validated: a new plan (a new mesh object) and the fingerprint exchange;
* first call, validation off: a new plan, ``validation("off")``;
* exchange alone: ``validate.check`` for a new (plan, call) on an existing plan;
* cached call: the same plan again (nothing exchanged);
* cached call with ``check_finite=True``: one tiny all-gather and a NaN scan per call.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

from functional_hsdp import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "RESULTS.md")
TREES = [(10, 4096), (100, 4096), (1000, 256)]  # (leaves, elements per leaf)
REPEATS = 9


def _worker() -> list:
    """On every rank (``launch.run`` has joined the process group): the timings of each tree."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import functional_hsdp as fh
    from functional_hsdp import validate
    from functional_hsdp.lookup import plan_for
    from functional_hsdp.tree import flatten

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_inner"))

    def timed(fn, *args, **kwargs) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn(*args, **kwargs)
        return time.perf_counter() - start

    rows = []
    for leaves, size in TREES:
        grads = {f"p{i:04d}": torch.randn(size) for i in range(leaves)}
        runs: dict[str, list[float]] = {k: [] for k in ("first", "off", "check", "cached", "fin")}
        for _ in range(REPEATS):
            spec = fh.hsdp(fh.DistMesh(dm), "dp_outer", "dp_inner")  # a new mesh: new plans
            runs["first"].append(timed(fh.reduce_grads, grads, spec, last=True))
            runs["cached"].append(timed(fh.reduce_grads, grads, spec, last=True))
            fh.reduce_grads(grads, spec, last=True, check_finite=True)  # its first call
            runs["fin"].append(timed(fh.reduce_grads, grads, spec, last=True, check_finite=True))
            leaves_, treedef, paths = flatten(grads, "grads")
            shapes = [tuple(x.shape) for x in leaves_]
            n = len(leaves_)
            plan = plan_for(leaves_, treedef, paths, (spec,) * n, (0,) * n, shapes)
            key = f"bench {len(runs['check'])}"  # a call this plan has not been checked for
            runs["check"].append(timed(validate.check, plan, key, paths, last=True))
            other = fh.hsdp(fh.DistMesh(dm), "dp_outer", "dp_inner")
            with validate.validation("off"):
                runs["off"].append(timed(fh.reduce_grads, grads, other, last=True))
        rows.append((leaves, size, {k: statistics.median(v) for k, v in runs.items()}))
    return rows


def _date() -> str:
    try:
        return subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return time.ctime()


def _write_section(markdown: str) -> None:
    """Replace this script's section of RESULTS.md (between its markers) or append it."""
    start, end = "<!-- bench:validation_cost:start -->", "<!-- bench:validation_cost:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}\n"
    text = open(RESULTS).read() if os.path.exists(RESULTS) else ""
    if not text:
        text = "# functional_hsdp benchmarks\n\n"
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block + ("\n" + tail.lstrip("\n") if tail.strip() else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(RESULTS, "w") as f:
        f.write(text)


def main() -> None:
    load = os.getloadavg()[0]
    per_rank = dict(enumerate(launch.run(_worker, world_size=4, timeout=120)))
    import torch

    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    lines = [
        "| leaves x elements | first call, validated (ms) | first call, validation off (ms) "
        "| exchange alone (ms) | cached call (ms) | cached, check_finite=True (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for i, (leaves, size, _) in enumerate(per_rank[0]):
        worst = {k: max(per_rank[r][i][2][k] for r in per_rank) for k in per_rank[0][i][2]}
        lines.append(
            f"| {leaves} x {size} | {ms(worst['first'])} | {ms(worst['off'])} | "
            f"{ms(worst['check'])} | {ms(worst['cached'])} | {ms(worst['fin'])} |"
        )
    cpu = platform.processor() or platform.machine()
    section = "\n".join(
        [
            "## Cross-rank validation cost (first call only)",
            "",
            "Command: `python bench/validation_cost.py`  ",
            f"Date: {_date()}  ",
            f"Machine: {os.cpu_count()}-core CPU ({cpu}), Python {platform.python_version()}, "
            f"torch {torch.__version__}; 4 gloo processes (one thread each), 2x2 mesh, "
            f"hsdp, `reduce_grads(last=True)`, float32. Median over {REPEATS} repeats of the "
            "slowest rank; ranks start each timing together (barrier). Load average at "
            f"start: {load:.1f} (other work on the machine makes these figures noisy; compare "
            "columns within a row).",
            "",
            *lines,
            "",
            "The fingerprint exchange runs once per (plan, call, last): the first call pays it "
            "(two tiny `all_gather`s over the 2x2 mesh plus hashing the tree's description), "
            "every later call pays nothing. `check_finite=True` pays one tiny exchange and a "
            "NaN/Inf scan on every call.",
        ]
    )
    _write_section(section)
    print(section)


if __name__ == "__main__":
    main()
