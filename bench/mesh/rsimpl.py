"""gloo reduce-scatter implementations, for the library's per-backend choice.

On 4 gloo processes, 2x2 mesh, a reduce-scatter (AVG) of one fp32 buffer over ``dp_inner``
(2 ranks per group, both groups at once) and over the whole world (4 ranks), four ways:

- ``funcol``: ``funcol.reduce_scatter_single`` + ``wait_tensor`` (the functional collective);
- ``list``: c10d list form, ``dist.reduce_scatter(out, list(buf.chunk(n)))``;
- ``tensor``: c10d tensor form, ``dist.reduce_scatter_tensor(out, buf)``;
- ``ar_slice``: ``dist.all_reduce(buf)`` in place, then the rank's slice (no copy);
- ``funcol_ar_slice``: ``funcol.all_reduce`` (out of place) + wait, then the slice.

Median of the timed repetitions after warm-up (the slowest rank's time per repetition), the
bytes that crossed the loopback interface per call (all 4 processes together, from
``/proc/net/dev``), and the peak RSS a call needs beyond its input (max over ranks).
"""

from __future__ import annotations

from functools import partial

import torch

from .. import common as C

SIZES = {
    "tiny": {"sizes": [100_000], "reps": 1, "warmup": 1, "groups": ["dp_inner"]},
    "full": {"sizes": [10_000_000, 50_000_000], "reps": 5, "warmup": 1, "groups": ["dp_inner"]},
    "full+world": {
        "sizes": [10_000_000, 50_000_000],
        "reps": 5,
        "warmup": 1,
        "groups": ["dp_inner", "world"],
    },
}
IMPLS = ("funcol", "list", "tensor", "ar_slice", "funcol_ar_slice")


def _impls(group, pg_ref, n: int):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from functional_hsdp.base.torch_releases import funcol_reduce_scatter_single

    AVG = dist.ReduceOp.AVG
    r = dist.get_rank(group)
    rs_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def funcol_rs(buf):
        return funcol.wait_tensor(funcol_reduce_scatter_single(buf, "avg", 0, pg_ref))

    def list_rs(buf):
        out = torch.empty(buf.numel() // n)
        dist.reduce_scatter(out, list(buf.chunk(n)), op=AVG, group=group)
        return out

    def tensor_rs(buf):
        out = torch.empty(buf.numel() // n)
        rs_tensor(out, buf, op=AVG, group=group)
        return out

    def ar_slice(buf):
        dist.all_reduce(buf, op=AVG, group=group)
        return buf.view(n, -1)[r]

    def funcol_ar_slice(buf):
        return funcol.wait_tensor(funcol.all_reduce(buf, "avg", pg_ref)).view(n, -1)[r]

    return {
        "funcol": funcol_rs,
        "list": list_rs,
        "tensor": tensor_rs,
        "ar_slice": ar_slice,
        "funcol_ar_slice": funcol_ar_slice,
    }


def task(cfg: dict) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    dm = C.device_mesh((2, 2))
    out, cases = {}, {}
    for gname in cfg["groups"]:
        if gname == "world":
            group, n = dist.group.WORLD, dist.get_world_size()
            pg_ref = group
        else:
            d = C.AXES.index(gname)
            group, n = dm.get_group(d), dm.shape[d]
            pg_ref = (dm, d)
        impls = _impls(group, pg_ref, n)
        for numel in cfg["sizes"]:
            numel = numel // n * n
            buf = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
            ref = impls["list"](buf.clone())
            times = {k: [] for k in impls}
            wire = {k: [] for k in impls}
            peak = {k: 0 for k in impls}  # filled at the end
            for fn in impls.values():  # each agrees with the list form
                got = fn(buf.clone())
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            for rep in range(cfg["warmup"] + cfg["reps"]):
                for k, fn in impls.items():
                    work = buf.clone()
                    C.barrier()
                    lo0 = C.lo_bytes()
                    dt, res = C.timed(partial(fn, work), sync=False)
                    del res
                    C.barrier()
                    lo1 = C.lo_bytes()
                    if rep >= cfg["warmup"]:
                        times[k].append(dt)
                        wire[k].append(lo1 - lo0)
            cases[(gname, numel)] = (impls, buf)
            out[f"{gname}/{numel}"] = {
                "group": gname,
                "n": n,
                "numel": numel,
                "times": times,
                "wire": wire,
                "peak": peak,
            }
    # memory last: mallopt (mmap >= 64 KiB) would change the timings above
    C.set_malloc()
    for (gname, numel), (impls, buf) in cases.items():
        for k, fn in impls.items():
            work = buf.clone()
            C.barrier()
            with C.Peak() as pk:
                res = fn(work)
            del res, work
            out[f"{gname}/{numel}"]["peak"][k] = pk.extra
    return out


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["cases"] = {}
    for key, case in per_rank[0].items():
        c = {"group": case["group"], "n": case["n"], "numel": case["numel"]}
        c["times"], c["median"] = C.slowest_rank_medians([r[key]["times"] for r in per_rank])
        c["wire"] = {k: C.median(v) for k, v in case["wire"].items()}  # machine-wide counter
        c["peak"] = {k: max(r[key]["peak"][k] for r in per_rank) for k in IMPLS}
        res["cases"][key] = c
    return res


def report(res: dict, command: str, when: str) -> str:
    head = C.section_header("gloo reduce-scatter implementations", command, when)
    desc = (
        "A reduce-scatter (AVG) of one fp32 buffer of N elements per rank. `dp_inner`: the two "
        "2-rank groups of the 2x2 mesh run at once; `world`: one 4-rank group. Implementations: "
        "`funcol` = `funcol.reduce_scatter_single` + wait (the functional collective); `list` = "
        "`dist.reduce_scatter(out, list(buf.chunk(n)))`; `tensor` = "
        "`dist.reduce_scatter_tensor(out, buf)`; `ar_slice` = in-place `dist.all_reduce` + "
        "slice; `funcol_ar_slice` = `funcol.all_reduce` (out of place) + slice. "
        f"{res['cfg']['warmup']} warm-up, {res['cfg']['reps']} timed repetitions, interleaved; "
        "median of the slowest rank's time. *Loopback bytes*: bytes through `lo` per call, all "
        "4 processes together (`/proc/net/dev`), as a multiple of the ring reduce-scatter "
        "minimum (each of the G groups' n ranks sends (n-1)/n of its buffer: G·(n-1)·S "
        "bytes in all, S = bytes of one rank's buffer). *Peak extra*: RSS high-water mark of "
        "the call beyond its input (max over ranks).\n"
    )
    rows = []
    for c in res["cases"].values():
        S = c["numel"] * 4
        groups = 4 // c["n"]
        minimum = groups * (c["n"] - 1) * S
        best = min(c["median"].values())
        for k in IMPLS:
            rows.append(
                [
                    c["group"],
                    f"{c['numel'] / 1e6:g}M",
                    k,
                    f"{c['median'][k]:.3f}",
                    f"{c['median'][k] / c['median']['funcol']:.2f}",
                    f"{c['median'][k] / best:.2f}",
                    f"{c['wire'][k] / minimum:.2f}",
                    C.mib(c["peak"][k]),
                ]
            )
    t = C.table(
        [
            "group",
            "N",
            "impl",
            "median (s)",
            "vs funcol",
            "vs fastest",
            "loopback bytes / min",
            "peak extra (MiB)",
        ],
        rows,
    )
    lines = [head, desc, t, ""]
    for c in res["cases"].values():
        best = min(c["median"], key=c["median"].get)
        lines.append(
            f"- {c['group']}, {c['numel'] / 1e6:g}M: fastest `{best}` "
            f"({c['median'][best]:.3f} s; funcol {c['median']['funcol']:.3f} s, "
            f"list {c['median']['list']:.3f} s, ar_slice {c['median']['ar_slice']:.3f} s)."
        )
    return "\n".join(lines) + "\n"
