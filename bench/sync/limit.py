"""(B2) ``reduce_grads`` and ``MainGrad.accumulate`` against bare collectives.

4 gloo processes, 2x2 mesh, ``hsdp``: one rank's fp32 gradient tree of N parameters (N = 1M,
10M, 50M). Library calls:

- ``rg_acc``: ``reduce_grads(g, spec, last=False, acc=acc)`` (a middle microbatch: pack,
  reduce-scatter over dp_inner per bucket, add the accumulation, unpack);
- ``rg_last``: ``reduce_grads(g, spec, last=True, acc=acc)`` (+ all-reduce over dp_outer on
  the shard);
- ``mg_acc`` / ``mg_last``: ``MainGrad.accumulate(g, last=False / True)``.

Bare collectives on pre-packed buffers with the library's bucket layout (same buckets, same
bytes, same process groups), every bucket's collective issued before any is waited on:

- ``fast_rs`` / ``fast_rs_ar``: the fastest bare gloo form measured (see "gloo reduce-scatter
  implementations"): in-place ``dist.all_reduce`` + slice, then in-place all-reduce of the
  slice over dp_outer: the physical limit;
- ``bare_rs`` / ``bare_rs_ar``: the functional collectives, ``funcol.reduce_scatter_single``
  per bucket, then ``funcol.all_reduce`` of each chunk over dp_outer (for reference).

Ratio: library call / fastest bare form (goal <= 1.15); also / funcol.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from .. import common as C

SIZES = {
    "tiny": {"sizes": [20_000, 80_000], "reps": 2, "warmup": 1, "cap": 0.05},
    "full": {"sizes": [1_000_000, 10_000_000, 50_000_000], "reps": 5, "warmup": 1, "cap": 25.0},
}
OPS = ("rg_acc", "rg_last", "mg_acc", "mg_last", "bare_rs", "bare_rs_ar", "fast_rs", "fast_rs_ar")
PAIRS = (
    ("rg_acc", "bare_rs", "fast_rs"),
    ("rg_last", "bare_rs_ar", "fast_rs_ar"),
    ("mg_acc", "bare_rs", "fast_rs"),
    ("mg_last", "bare_rs_ar", "fast_rs_ar"),
)


def _bare(dm, bufs):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from functional_hsdp.base.torch_releases import funcol_reduce_scatter_single

    inner, outer = (dm, 1), (dm, 0)
    g_in, g_out = dm.get_group(1), dm.get_group(0)
    n_in = dm.shape[1]
    r_in = dist.get_rank(g_in)
    AVG = dist.ReduceOp.AVG

    def bare_rs():
        outs = [funcol_reduce_scatter_single(b, "avg", 0, inner) for b in bufs]
        return [funcol.wait_tensor(o) for o in outs]

    def bare_rs_ar():
        outs = [funcol_reduce_scatter_single(b, "avg", 0, inner) for b in bufs]
        outs = [funcol.all_reduce(funcol.wait_tensor(o), "avg", outer) for o in outs]
        return [funcol.wait_tensor(o) for o in outs]

    def fast_rs():
        works = [dist.all_reduce(b, op=AVG, group=g_in, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        return [b.view(n_in, -1)[r_in] for b in bufs]

    def fast_rs_ar():
        chunks = fast_rs()
        works = [dist.all_reduce(c, op=AVG, group=g_out, async_op=True) for c in chunks]
        for w in works:
            w.wait()
        return chunks

    return {
        "bare_rs": bare_rs,
        "bare_rs_ar": bare_rs_ar,
        "fast_rs": fast_rs,
        "fast_rs_ar": fast_rs_ar,
    }


def task(cfg: dict) -> dict:
    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    mesh = fh.DistMesh(dm)
    spec = fh.hsdp(mesh, *C.AXES, bucket_cap_mb=cfg["cap"])
    out = {}
    for n in cfg["sizes"]:
        shapes = C.param_tree(n, leaf=min(1 << 20, max(64, n // 4)))
        g = C.make(shapes, fill=1.0)
        mg = fh.MainGrad(spec, like=g)
        acc = fh.reduce_grads(g, spec, last=False)
        bufs = [torch.ones(b.padded) for b in mg.plan.buckets]
        ops = {
            "rg_acc": partial(fh.reduce_grads, g, spec, last=False, acc=acc),
            "rg_last": partial(fh.reduce_grads, g, spec, last=True, acc=acc),
            "mg_acc": partial(mg.accumulate, g, last=False),
            "mg_last": partial(mg.accumulate, g, last=True),
            **_bare(dm, bufs),
        }
        times = C.interleaved(ops, cfg["warmup"], cfg["reps"], after={"mg_last": mg.zero_grad})
        out[n] = {
            "numel": C.numel(shapes),
            "leaves": len(shapes),
            "buckets": len(mg.plan.buckets),
            "times": times,
        }
        if n == max(cfg["sizes"]):
            out[n]["profile"] = {k: _profile(ops[k]) for k in ("rg_acc", "mg_acc", "bare_rs")}
        del g, mg, acc, bufs, ops
    return out


def _profile(fn, rows: int = 8) -> dict:
    """One call under torch.profiler: wall time and the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    C.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        res = fn()
        wall = time.perf_counter() - t0
    del res
    ka = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return {
        "wall": wall,
        "top": [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in ka],
    }


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["cases"] = []
    for n, case in per_rank[0].items():
        c = {k: case[k] for k in ("numel", "leaves", "buckets")}
        c["times"], c["median"] = C.slowest_rank_medians([r[n]["times"] for r in per_rank])
        c["ratio"] = {a: c["median"][a] / c["median"][b] for a, b, _ in PAIRS}
        c["ratio_fast"] = {a: c["median"][a] / c["median"][f] for a, _, f in PAIRS}
        if "profile" in case:
            c["profile"] = case["profile"]
        res["cases"].append(c)
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header(
        "(B2) reduce_grads / MainGrad.accumulate versus bare collectives", command, when
    )
    desc = (
        "hsdp on the 2x2 mesh; one rank's fp32 gradient tree of N elements (2-D leaves + "
        f"biases), {cfg['cap']:g} MiB buckets. Library calls versus bare collectives on "
        "pre-packed buffers with the library's bucket layout (same buckets, same bytes, same "
        "process groups, every bucket's collective issued before any is waited on). The "
        "physical limit is the fastest bare form: `fast` = in-place c10d `all_reduce` over "
        "dp_inner + this rank's slice (gloo has no native reduce-scatter: see the "
        "reduce-scatter section), then in-place all-reduce of the slice over dp_outer. For "
        "reference, `bare` = the functional collectives (`funcol.reduce_scatter_single`, then "
        "`funcol.all_reduce` on the chunk). "
        f"{C.timing_note(cfg, 'every operation')}\n"
    )
    rows = []
    for c in res["cases"]:
        for a, b, f in PAIRS:
            r = c["ratio_fast"][a]
            rows.append(
                [
                    f"{c['numel'] / 1e6:.1f}M ({c['leaves']} leaves, {c['buckets']} buckets)",
                    a,
                    f"{c['median'][a]:.4f}",
                    f,
                    f"{c['median'][f]:.4f}",
                    f"{r:.2f}",
                    "met" if r <= 1.15 else "not met",
                    b,
                    f"{c['median'][b]:.4f}",
                    f"{c['ratio'][a]:.2f}",
                ]
            )
    t = C.table(
        [
            "N",
            "library call",
            "median (s)",
            "fastest bare",
            "median (s)",
            "ratio",
            "<= 1.15",
            "bare funcol",
            "median (s)",
            "ratio vs funcol",
        ],
        rows,
    )
    met = all(c["ratio_fast"][a] <= 1.15 for c in res["cases"] for a, _, _ in PAIRS)
    worst = max(c["ratio_fast"][a] for c in res["cases"] for a, _, _ in PAIRS)
    met_f = all(c["ratio"][a] <= 1.15 for c in res["cases"] for a, _, _ in PAIRS)
    worst_f = max(c["ratio"][a] for c in res["cases"] for a, _, _ in PAIRS)
    prof = []
    for c in res["cases"]:
        if "profile" not in c:
            continue
        prof.append(
            f"\nWhere the time goes at {c['numel'] / 1e6:.1f}M: one more call of each under "
            "torch.profiler on rank 0 (self CPU time of the top ops; the gloo work itself runs "
            "on gloo's threads and shows up as waiting; with 4 processes on 2 cores, CPU "
            "work and communication compete for the same cores):\n"
        )
        for k, p in c["profile"].items():
            ops = "; ".join(f"`{name}` {sec * 1e3:.0f} ms ({n}x)" for name, sec, n in p["top"])
            prof.append(f"- `{k}` ({p['wall'] * 1e3:.0f} ms wall): {ops}")
    return (
        f"{head}\n{desc}\n{t}\n" + "\n".join(prof) + "\n\nGoal (every library call <= 1.15 x "
        f"the fastest bare collectives on the same bytes): **{'met' if met else 'not met'}** "
        f"(worst ratio {worst:.2f}). Against the functional collectives instead: "
        f"{'met' if met_f else 'not met'} (worst {worst_f:.2f}).\n"
    )
