"""Shared machinery of the benchmarks: running a task on 4 gloo ranks, memory and timing
probes, trees, and writing sections of ``bench/RESULTS.md``.

Gloo runs use :mod:`functional_hsdp.mesh.launch`: a benchmark run on its own starts 4 fresh ranks
with the one-shot :func:`~functional_hsdp.mesh.launch.run` (torch's ``elastic_launch``); the smoke
test passes one :class:`functional_hsdp.tools.testing.GlooPool` to all benchmarks instead, since
starting ranks once per benchmark would dominate its run time there. Tasks are module-level
functions of ``bench.*`` modules, run on every rank.

Memory: torch has no CPU allocator statistics, so a probe reads the process's resident set
(``/proc/self/statm``) and its high-water mark (``getrusage(RUSAGE_SELF).ru_maxrss``). glibc is
told (``mallopt``, and ``MALLOC_MMAP_THRESHOLD_`` for the processes we start) to mmap every
allocation of 64 KiB or more, so a freed tensor goes back to the OS and the high-water mark
follows tensor lifetimes. Between measured regions the high-water mark is reset to the current
RSS by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), so one process can measure
several regions.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from functional_hsdp.mesh import launch

if TYPE_CHECKING:
    from functional_hsdp.tools.testing import GlooPool

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS = os.path.join(BENCH_DIR, "RESULTS.md")

MMAP_THRESHOLD = 65536
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
WORLD = 4
AXES = ("dp_outer", "dp_inner")

# -- gloo ranks -------------------------------------------------------------------------------

PRELOAD = (
    *launch.DEFAULT_PRELOAD,
    "torch.distributed.fsdp",
    "torch.profiler",
    "functional_hsdp",
)

# The library version the gloo workers run: the checkout when this process started the
# forkserver (which preloads functional_hsdp). None: not known (another caller started it).
WORKER_LIBRARY: str | None = None


def _forkserver_pid():
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _note_worker_library() -> None:
    """Before starting workers: if this starts the forkserver, which imports functional_hsdp
    now, every worker forked from it later in this process runs this checkout's code as of now,
    whatever happens to the checkout meanwhile."""
    global WORKER_LIBRARY
    if WORKER_LIBRARY is None and _forkserver_pid() is None:
        WORKER_LIBRARY = library_version()


def new_pool(world_size: int = WORLD, timeout: float = 900.0) -> GlooPool:
    """A started pool of ``world_size`` gloo processes, for running many benchmarks (the
    smoke test). The workers keep glibc's default malloc settings (timings are what users
    get); a memory measurement calls :func:`set_malloc` in the worker, after any timing in
    that process."""
    # Imported here: agreement_scaling loads this file beside a baseline checkout of the
    # library, which may predate functional_hsdp.tools.testing, and never makes a pool.
    from functional_hsdp.tools.testing import GlooPool

    pool = GlooPool(world_size, timeout=timeout, start_timeout=180.0, preload=PRELOAD)
    _note_worker_library()
    pool.start()
    return pool


def on_ranks(pool: GlooPool | None, task: Callable[..., Any], *args: Any) -> list[Any]:
    """``task(*args)`` on every rank: on ``pool`` if given, else on 4 fresh ranks."""
    if pool is not None:
        return pool.run(task, *args)
    _note_worker_library()
    return launch.run(task, *args, world_size=WORLD, timeout=900.0, preload=PRELOAD)


def run_task(task: Callable[[dict], Any], sizes: dict, size: str, pool=None) -> tuple[list, dict]:
    """A benchmark's ``task(cfg)`` (``cfg = sizes[size]``) on every rank: its per-rank results,
    and the start of the benchmark's result dict (size, cfg, wall time of the run)."""
    cfg = sizes[size]
    t0 = time.perf_counter()
    per_rank = on_ranks(pool, task, cfg)
    return per_rank, {"size": size, "cfg": cfg, "wall_s": time.perf_counter() - t0}


def time_then_memory(
    time_task: Callable[[dict], Any], sizes: dict, size: str, pool: Any, memory: Callable
) -> tuple[list, dict, dict]:
    """A side-by-side benchmark's two phases: ``time_task(cfg)`` on every rank (every variant
    in one group), then ``memory(pool, per_rank)`` -> ``{variant: per-rank results}`` (each
    variant in a fresh group, or in ``pool``). A size without fresh groups gets a pool made
    and closed here when none is given. Returns ``(per_rank, res, mem)``, ``res["load"]``
    the load average around each phase."""
    own = None
    if pool is None and not sizes[size]["fresh"]:
        pool = own = new_pool()
    try:
        start = loadavg()
        per_rank, res = run_task(time_task, sizes, size, pool)
        middle = loadavg()
        mem = memory(pool, per_rank)
        res["load"] = {"time": [start, middle], "memory": [middle, loadavg()]}
    finally:
        if own is not None:
            own.close()
    return per_rank, res, mem


def device_mesh(shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = AXES):
    """A cached CPU DeviceMesh in a worker (collective: call on every rank)."""
    return launch.device_mesh(tuple(shape), tuple(names))


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# -- memory -----------------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    """Give glibc's free memory back to the OS (``malloc_trim``), so that reusing it later
    faults the pages in again and shows in the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def set_malloc() -> None:
    """mmap allocations >= 64 KiB and trim freed memory (as MALLOC_MMAP_THRESHOLD_ would)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops dynamic adjustment)
        libc.mallopt(-1, MMAP_THRESHOLD)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except OSError:
        pass


def rss() -> int:
    """Current resident set size in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def maxrss() -> int:
    """High-water mark of the resident set in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Peak:
    """``with Peak() as p: ...`` -> ``p.extra``: peak RSS in the block minus RSS before it."""

    def __enter__(self) -> Peak:
        import gc

        gc.collect()
        trim()
        self.reset = reset_peak()
        self.before = rss()
        return self

    def __exit__(self, *exc) -> None:
        self.after = rss()
        self.peak = maxrss()
        self.extra = self.peak - self.before
        self.kept = self.after - self.before


# -- a variant's step memory (fresh groups) ----------------------------------------------------


def status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM, VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def settle() -> int:
    """Collect garbage, give freed memory back, return the RSS."""
    gc.collect()
    trim()
    return status("VmRSS")


@contextlib.contextmanager
def frozen():
    """Every object alive now moved out of the collector's sight (``gc.freeze``) for the
    block: later ``gc.collect()`` calls then take milliseconds instead of a quarter second
    (torch's import leaves a large heap of objects). A heap frozen before the block (by
    :func:`freeze_heap`) stays frozen after it."""
    outer = gc.get_freeze_count() > 0
    freeze_heap()
    try:
        yield
    finally:
        if not outer:
            gc.unfreeze()


def freeze_heap() -> None:
    """Collect garbage, then move every object alive out of the collector's sight for the
    rest of the process (``gc.freeze``): every later ``gc.collect()`` walks only what was made
    since. For the smoke test's long-lived processes, whose heaps (torch, transformers, the
    benchmarks run before) make each full collection cost 0.1-0.4 s; a benchmark's own runs,
    in fresh processes, never call it."""
    gc.collect()
    gc.freeze()


def loadavg() -> float:
    """The 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def warm_group(dm) -> None:
    import torch.distributed as dist

    for group in (None, dm.get_group("dp_outer"), dm.get_group("dp_inner")):
        dist.all_reduce(torch.ones(1), group=group)


def step_memory(build: Callable[[Any], Any], data: Callable[[int], tuple]) -> dict:
    """One variant's step memory on this rank (every rank calls it): idle RSS once the group
    is warm, ``runner = build(device_mesh)``, a warm-up ``runner.step(*data(0))``, then the
    high-water mark of ``runner.step(*data(1))`` above idle (glibc mmapping every allocation
    of 64 KiB or more, so freed tensors leave the RSS). ``before``: what the runner holds
    above idle just before the measured step."""
    set_malloc()
    with frozen():
        dm = device_mesh((2, 2))
        warm_group(dm)
        idle = settle()
        runner = build(dm)
        runner.step(*data(0))
        batch = data(1)
        barrier()
        before = settle() - idle
        reset = reset_peak()
        runner.step(*batch)
        peak = status("VmHWM") - idle
        barrier()
        del runner
        settle()
        return {"before": before, "peak": peak, "reset_ok": reset}


# -- timing -----------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], sync: bool = True) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``, starting after a barrier so ranks start together."""
    if sync:
        barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def interleaved(
    ops: dict[Any, Callable[[], Any]],
    warmup: int,
    reps: int,
    after: dict[Any, Callable[[], Any]] | None = None,
) -> dict[Any, list[float]]:
    """Times of every op in ``ops`` over ``reps`` repetitions after ``warmup`` untimed ones:
    each repetition calls every op once, in turn (interleaved, so that drift on a noisy machine
    hits all of them alike), each call after a barrier. ``after[key]()`` runs untimed after
    each call of op ``key`` (a reset, say)."""
    after = after or {}
    times: dict[Any, list[float]] = {k: [] for k in ops}
    for rep in range(warmup + reps):
        for k, fn in ops.items():
            dt, res = timed(fn)
            del res
            if k in after:
                after[k]()
            if rep >= warmup:
                times[k].append(dt)
    return times


def timing_note(cfg: dict, what: str) -> str:
    """The report's sentence on how :func:`interleaved` timed ``what`` and what is shown."""
    return (
        f"{cfg['warmup']} warm-up and {cfg['reps']} timed repetitions, {what} interleaved, "
        "each after a barrier; median of the slowest rank's time."
    )


def across_ranks_max(per_rank: list[list[float]]) -> list[float]:
    """Per repetition, the slowest rank's time (a step is as slow as its slowest rank)."""
    return [max(col) for col in zip(*per_rank)]


def slowest_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per timed variant (the keys of every rank's ``{variant: times}``), each repetition's
    time on the slowest rank."""
    return {k: across_ranks_max([r[k] for r in per_rank]) for k in per_rank[0]}


def slowest_rank_medians(
    per_rank: list[dict[str, list[float]]],
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """:func:`slowest_rank`'s times, and their median per variant."""
    times = slowest_rank(per_rank)
    return times, {k: median(v) for k, v in times.items()}


def mean_losses(per_rank: list[dict], *, keys=None) -> dict[str, list[float]]:
    """Per variant (``keys``, default: the first rank's), each step's loss averaged over the
    ranks' ``losses``."""
    keys = per_rank[0]["losses"] if keys is None else keys
    steps = lambda k: zip(*(r["losses"][k] for r in per_rank))  # noqa: E731
    return {k: [sum(col) / len(col) for col in steps(k)] for k in keys}


def lo_bytes() -> int:
    """Bytes sent on the loopback interface so far (all processes of this machine)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


# -- trees ------------------------------------------------------------------------------------


def param_tree(n_params: int, leaf: int = 1 << 20, odd: bool = False) -> dict[str, tuple]:
    """Shapes of a tree of about ``n_params`` elements: 2-D leaves of ~``leaf`` elements plus
    a bias per weight. ``odd`` picks sizes that do not divide evenly (padding is exercised)."""
    shapes: dict[str, tuple] = {}
    cols = int(math.isqrt(leaf))
    rows = cols - 1 if odd else cols
    per = rows * cols + rows
    k = max(1, round(n_params / per))
    for i in range(k):
        shapes[f"layer{i:03d}.weight"] = (rows, cols)
        shapes[f"layer{i:03d}.bias"] = (rows + (1 if odd and i % 2 else 0),)
    return shapes


def numel(shapes: dict[str, tuple]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def make(
    shapes: dict[str, tuple],
    batch: tuple[int, ...] = (),
    fill: float | None = None,
    seed: int = 0,
    dtype=torch.float32,
) -> dict[str, torch.Tensor]:
    """A tree of new (touched) tensors of ``shapes`` with ``batch`` dims in front."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, s in shapes.items():
        if fill is None:
            out[k] = torch.randn((*batch, *s), generator=g, dtype=dtype)
        else:
            out[k] = torch.full((*batch, *s), fill, dtype=dtype)
    return out


# -- reporting --------------------------------------------------------------------------------


def date() -> str:
    """The output of ``date``."""
    try:
        return subprocess.run(["date"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return time.strftime("%a %b %d %H:%M:%S %Z %Y")


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()}-core CPU ({cpu}), {mem:.0f} GiB RAM, Python "
        f"{platform.python_version()}, torch {torch.__version__}, gloo over loopback"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            if x != x:
                return "n/a"
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def library_version() -> str:
    """The commit of the checkout, and whether functional_hsdp/ has uncommitted changes."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "functional_hsdp")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (" + uncommitted changes in functional_hsdp/" if dirty else "")


def section_header(title: str, command: str, when: str) -> str:
    now = library_version()
    lib = now
    if WORKER_LIBRARY is not None and WORKER_LIBRARY != now:
        lib = (
            f"gloo workers: {WORKER_LIBRARY} (imported when this run started its forkserver); "
            f"checkout when this section was written: {now}"
        )
    return (
        f"## {title}\n\n"
        f"Command: `{command}`  \nDate: {when}  \nLibrary: {lib}  \n"
        f"Machine: {machine()}; 4 gloo processes (one thread each) unless stated.\n"
    )


_MARK = "<!-- bench:{name}:{edge} -->"


def write_section(name: str, markdown: str, path: str = RESULTS) -> None:
    """Replace the section ``name`` of ``path`` (between its markers) or append it; every other
    part of the file (other sections, other people's text) is kept as it is."""
    start, end = _MARK.format(name=name, edge="start"), _MARK.format(name=name, edge="end")
    block = f"{start}\n{markdown.strip()}\n{end}\n"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if not text:
        text = (
            "# functional_hsdp benchmarks\n\n"
            "Every figure here was measured by the command given in its section (`python -m "
            "bench <name>`, or `python -m bench all` for all of them). Sections are rewritten "
            "in place when their benchmark is rerun.\n\n"
        )
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block + ("\n" + tail.lstrip("\n") if tail.strip() else "")
    else:  # a new section goes at the end; nothing else in the file moves
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(text)
