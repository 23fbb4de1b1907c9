"""What it costs to get 4 gloo ranks to run a task (not a registered benchmark)::

    python -m bench.mesh.startup

times each way, each part in a fresh process (so that the first start also starts the
forkserver): the one-shot :func:`functional_hsdp.mesh.launch.run` (torch's ``elastic_launch``,
workers forked from a forkserver), ``elastic_launch`` as torch configures it (workers
spawned), and the test pool, :class:`functional_hsdp.tools.testing.GlooPool`. The "mesh task" builds
a 2x2 ``DeviceMesh`` (cached in a pool's workers) and runs one functional all-reduce, like a
typical test.

Measured 2026-12-03 on a 2-core CPU, torch 2.13 (CPU), load average about 6 (other jobs were
running), by this code when it was ``python -m functional_hsdp.launch``:

=================================================  ==========
what (4 ranks)                                      seconds
=================================================  ==========
``run(rank)``, first call (starts the forkserver)     3.75
``run(rank)``, later calls (median of 5)              0.80
``run(mesh task)``, later calls (median of 5)         0.92
``elastic_launch``, its default ``spawn`` start      25.9
``GlooPool.start``, first (starts the forkserver)     3.61
``GlooPool.start``, later                             0.58
``pool.run(mesh task)``, first (builds the mesh)      0.21
``pool.run(rank)`` (median of 21)                     0.0001
``pool.run(mesh task)``, later (median of 21)         0.0028
=================================================  ==========

Rerun 2026-12-05, same machine and torch, load average 5-6, in one job: before the move
(``python -m functional_hsdp.launch`` at ed35a9b) and after (this module). The two agree
within the load's noise, except the pool's first mesh task: its workers now import this module
(and with it the ``bench`` package) for it, about 0.07 s each, where the task used to live in
the module they had imported already:

=================================================  ==========  ==========
what (4 ranks), seconds                               before      after
=================================================  ==========  ==========
``run(rank)``, first call (starts the forkserver)     2.43        2.42
``run(rank)``, later calls (median of 5)              0.76        0.62
``run(mesh task)``, later calls (median of 5)         0.80        0.86
``elastic_launch``, its default ``spawn`` start       9.27        7.34
``GlooPool.start``, first (starts the forkserver)     3.70        2.15
``GlooPool.start``, later                             0.66        0.46
``pool.run(mesh task)``, first (builds the mesh)      0.008       0.26
``pool.run(rank)`` (median of 21)                     0.0002      0.0002
``pool.run(mesh task)``, later (median of 21)         0.0018      0.0014
=================================================  ==========  ==========

So a one-shot task costs about 0.9 s of start-up and teardown even with the forkserver running
(spawning each worker instead, torch's default, costs 7 to 26 s), and a pool task about 3 ms
after a 0.6 s start. The test suite ran 96 tests on gloo ranks then, at least one task each:
about 90 s one-shot against about 4 s with a pool per test module. That is why the test
modules that run on gloo ranks keep a pool, and the demo and the benchmarks run on their own
(one to a few tasks of seconds to minutes per run) use :func:`~functional_hsdp.mesh.launch.run`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from functional_hsdp.mesh import launch
from functional_hsdp.tools.testing import GlooPool

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the forkserver imports: the launcher's default, as the test suite's (which adds only
# pytest). Not this module, whose import would bring the library into the forkserver and
# spare every worker the import that a test's worker pays.
PRELOAD = launch.DEFAULT_PRELOAD


def _measure(part: str) -> None:
    """Print the docstring's table rows for ``part`` ("run" or "pool"); call in a fresh
    process, so that the first start also starts the forkserver."""
    rows = _measure_run() if part == "run" else _measure_pool()
    for what, seconds in rows:
        print(f"{what:<48} {seconds:8.4f} s", flush=True)


def _timed(fn: Callable[[], Any], n: int = 1) -> float:
    """The median of ``n`` calls' wall times, in seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def _run(task: Callable[[], Any]) -> list[Any]:
    return launch.run(task, preload=PRELOAD)


def _measure_run() -> list[tuple[str, float]]:
    # Set up before the first run(), which would otherwise also pay for importing the launcher.
    with _spawned_launch() as spawned:
        rows = [
            ("run(rank), first call (starts the forkserver)", _timed(lambda: _run(launch.rank))),
            ("run(rank), later calls (median of 5)", _timed(lambda: _run(launch.rank), 5)),
            ("run(mesh task), later calls (median of 5)", _timed(lambda: _run(_mesh_task), 5)),
            ("elastic_launch, its default spawn start", _timed(spawned)),
        ]
    return rows


@contextlib.contextmanager
def _spawned_launch() -> Iterator[Callable[[], Any]]:
    """What ``run`` would cost without the forkserver: elastic_launch as torch configures it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory() as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=4,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            run_id=f"functional_hsdp_{uuid.uuid4().hex[:8]}",
            max_restarts=0,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )  # start_method "spawn": LaunchConfig's default
        yield lambda: elastic_launch(config, _spawned)()


def _measure_pool() -> list[tuple[str, float]]:
    pool = GlooPool(4, preload=PRELOAD)
    rows = [("GlooPool.start, first (starts the forkserver)", _timed(pool.start))]
    pool.close()
    rows.append(("GlooPool.start, later (forkserver running)", _timed(pool.start)))
    rows.append(
        ("pool.run(mesh task), first (builds the mesh)", _timed(lambda: pool.run(_mesh_task)))
    )
    rows.append(("pool.run(rank) (median of 21)", _timed(lambda: pool.run(launch.rank), 21)))
    rows.append(
        ("pool.run(mesh task), later (median of 21)", _timed(lambda: pool.run(_mesh_task), 21))
    )
    pool.close()
    return rows


def _mesh_task() -> float:
    """A typical test task: a 2x2 DeviceMesh (cached in a pool) and one functional all-reduce."""
    import torch.distributed._functional_collectives as funcol

    mesh = launch.device_mesh((2, 2), ("outer", "inner"))
    return funcol.all_reduce(torch.ones(4), "sum", (mesh, 1)).sum().item()


def _spawned() -> int:
    """A spawned worker's task: join the group as :func:`~functional_hsdp.mesh.launch.run`'s
    workers do (the launcher's own set-up, so that only the start method differs)."""
    import torch.distributed as dist

    launch.join_group(60.0)
    r = launch.rank()
    dist.barrier()
    dist.destroy_process_group()
    return r


def main() -> int:
    print(
        f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; torch {torch.__version__}"
    )
    for part in ("run", "pool"):  # each in a fresh process; tasks pickled by module name
        code = f"from bench.mesh import startup; startup._measure({part!r})"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
