"""(B8) Host overhead in one process: a cached call against a bare ``torch.cat`` + ``split``.

One process, a 1x1 ``SimMesh`` with ``hsdp`` (size-1 axes move nothing, so no collective
runs: the call is pure host work: flatten, plan lookup, packing, unpacking, state tags),
trees of K leaves of 16-22 fp32 elements (one bucket). Per call type the median of ``reps``
calls, each after a ``gc.collect()`` (so no call pays for an earlier call's garbage), over
the median of a bare ``torch.cat`` of the same leaves + ``torch.split`` back into K pieces
(the packing and unpacking any bucketed implementation must do). Calls:

- ``first``: ``reduce_grads(g, spec, last=False)`` (the first microbatch, cached plan);
- ``mid``: ``reduce_grads(g, spec, last=False, acc=acc)`` (a middle microbatch);
- ``last``: ``reduce_grads(g, spec, last=True, acc=acc)``;
- ``cold``: ``first`` right after ``fh.clear_caches()`` (plan built, checks run), reported
  as a ratio to ``first``.

Goal: cached calls (``last`` included) <= 1.5x cat + split. The gloo CPU-time measure of the
same overhead is (B3) ``overhead``.

``floor``: cat + split plus one read of every leaf's metadata (shape, dtype, device, layout):
the check by which a cached call refuses a tree whose leaves changed since its plan was built
(a changed leaf would otherwise come back silently wrong). No other work of a call is in it:
a lower bound for a call that makes that check, measured beside the others.
"""

from __future__ import annotations

import gc
import operator
import statistics
import time

import torch

from .. import common as C

SIZES = {
    "tiny": {"leaves": [100, 300], "reps": 3},
    "full": {"leaves": [1000, 10000], "reps": 7},
}
CALLS = ("first", "mid", "last")


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _case(k: int, reps: int) -> dict:
    import functional_hsdp as fh

    mesh = fh.SimMesh({"dp_outer": 1, "dp_inner": 1})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    g = {f"p{i:05d}": torch.randn(1, 1, 16 + i % 7) for i in range(k)}
    leaves = list(g.values())
    sizes = [x.shape[-1] for x in leaves]
    base = _median(lambda: torch.split(torch.cat(leaves, dim=-1), sizes, dim=-1), reps)
    meta = operator.attrgetter("shape", "dtype", "device", "layout")

    def floor():
        tuple(map(meta, leaves))
        torch.split(torch.cat(leaves, dim=-1), sizes, dim=-1)

    acc = fh.reduce_grads(g, spec, last=False)
    ops = {
        "first": lambda: fh.reduce_grads(g, spec, last=False),
        "mid": lambda: fh.reduce_grads(g, spec, last=False, acc=acc),
        "last": lambda: fh.reduce_grads(g, spec, last=True, acc=acc),
    }
    for fn in ops.values():  # warm: plans built, checks cached
        fn()
    medians = {name: _median(fn, reps) for name, fn in ops.items()}

    def cold():
        fh.clear_caches()
        fh.reduce_grads(g, spec, last=False)

    medians["cold"] = _median(cold, max(3, reps // 2))
    medians["floor"] = _median(floor, reps)
    return {"leaves": k, "base": base, "median": medians}


def run(size: str = "full", pool=None) -> dict:
    cfg = SIZES[size]
    torch.set_num_threads(1)
    return {"cfg": cfg, "cases": [_case(k, cfg["reps"]) for k in cfg["leaves"]]}


def report(res: dict, command: str, when: str) -> str:
    head = C.section_header("(B8) Host overhead in one process", command, when)
    desc = (
        "One process (this section only: no gloo workers), one thread, 1x1 `SimMesh`, `hsdp`: "
        "no collective runs (size-1 axes move nothing), so a call is pure host work. Trees of "
        "K fp32 leaves of 16-22 elements; median of "
        f"{res['cfg']['reps']} calls each after a `gc.collect()`, over the median of a bare "
        "`torch.cat` + `torch.split` of the same leaves. `first`: `reduce_grads(g, spec, "
        "last=False)`; `mid`: with `acc`; `last`: `last=True` with `acc`; `cold`: `first` "
        "after `fh.clear_caches()`, as a ratio to a cached `first`. `floor`: cat + split plus "
        "one read of every leaf's metadata (shape, dtype, device, layout): the check by which "
        "a cached call refuses a tree whose leaves changed since its plan was built, and "
        "nothing else.\n"
    )
    rows = []
    for c in res["cases"]:
        m = c["median"]
        rows.append(
            [
                c["leaves"],
                f"{c['base'] * 1e3:.2f}",
                f"{m['floor'] / c['base']:.2f}",
                *(f"{m[k] / c['base']:.2f}" for k in CALLS),
                f"{m['cold'] / m['first']:.1f}",
            ]
        )
    t = C.table(
        [
            "K leaves",
            "cat + split (ms)",
            "floor / base",
            "first / base",
            "mid / base",
            "last / base",
            "cold / first",
        ],
        rows,
    )
    worst = max(c["median"][k] / c["base"] for c in res["cases"] for k in CALLS)
    verdict = "met" if worst <= 1.5 else "not met"
    floor = max(c["median"]["floor"] / c["base"] for c in res["cases"])
    return (
        f"{head}\n{desc}\n{t}\n\nGoal (cached calls, `last` included, <= 1.5x cat + split): "
        f"**{verdict}** (worst {worst:.2f}; the metadata read alone brings cat + split to "
        f"{floor:.2f}x).\n"
    )
