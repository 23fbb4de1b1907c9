"""(B6) What asynchronous buckets gain: ``DistMesh(overlap=True)`` versus ``overlap=False``.

4 gloo processes, 2x2 mesh, ``hsdp``: one rank's fp32 gradient tree of N parameters, with a
bucket cap that makes B >= 4 buckets. The same library calls on two ``DistMesh`` views of one
``DeviceMesh`` (same process groups):

- ``overlap=True`` (the default): each bucket is packed just before its first collective, and
  every bucket's collective is issued before any is waited on (``reduce_grads``), or two
  buckets are in flight at once (``MainGrad``); the dp_outer all-reduce of one bucket runs
  while later buckets' dp_inner reduce-scatters are still in flight;
- ``overlap=False``: each collective is waited for as soon as it is issued (no overlap between
  buckets, nor between packing and communication).

Calls: ``rg_acc`` = ``reduce_grads(g, last=False, acc=acc)``, ``rg_last`` = ``reduce_grads(g,
last=True, acc=acc)``, ``mg_acc`` / ``mg_last`` = ``MainGrad.accumulate(g, last=False/True)``.
Ratio: overlap / no overlap (below 1: overlap gains).
"""

from __future__ import annotations

from functools import partial

from .. import common as C

SIZES = {
    "tiny": {"n": 40_000, "caps": [0.04, 0.01], "reps": 2, "warmup": 1},
    "full": {"n": 20_000_000, "caps": [20.0, 5.0], "reps": 7, "warmup": 1},
}
CALLS = ("rg_acc", "rg_last", "mg_acc", "mg_last")


def task(cfg: dict) -> dict:
    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    meshes = {True: fh.DistMesh(dm), False: fh.DistMesh(dm, overlap=False)}
    shapes = C.param_tree(cfg["n"], leaf=min(1 << 20, max(64, cfg["n"] // 16)))
    g = C.make(shapes, fill=1.0)
    out = {}
    for cap in cfg["caps"]:
        ops, mgs = {}, {}
        for on, mesh in meshes.items():
            spec = fh.hsdp(mesh, *C.AXES, bucket_cap_mb=cap)
            mg = mgs[on] = fh.MainGrad(spec, like=g)
            acc = fh.reduce_grads(g, spec, last=False)
            ops[("rg_acc", on)] = partial(fh.reduce_grads, g, spec, last=False, acc=acc)
            ops[("rg_last", on)] = partial(fh.reduce_grads, g, spec, last=True, acc=acc)
            ops[("mg_acc", on)] = partial(mg.accumulate, g, last=False)
            ops[("mg_last", on)] = partial(mg.accumulate, g, last=True)
        resets = {("mg_last", on): mg.zero_grad for on, mg in mgs.items()}
        times = C.interleaved(ops, cfg["warmup"], cfg["reps"], after=resets)
        out[cap] = {
            "buckets": len(mgs[True].plan.buckets),
            "times": {f"{k[0]}/{'on' if k[1] else 'off'}": v for k, v in times.items()},
        }
        del ops, mgs
    return {"numel": C.numel(shapes), "leaves": len(shapes), "cases": out}


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    first = per_rank[0]
    res.update(numel=first["numel"], leaves=first["leaves"], cases=[])
    for cap, case in first["cases"].items():
        _, median = C.slowest_rank_medians([r["cases"][cap]["times"] for r in per_rank])
        ratio = {c: median[f"{c}/on"] / median[f"{c}/off"] for c in CALLS}
        res["cases"].append(
            {"cap": cap, "buckets": case["buckets"], "median": median, "ratio": ratio}
        )
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header("(B6) Asynchronous buckets: overlap on versus off", command, when)
    desc = (
        f"hsdp on the 2x2 mesh; one rank's fp32 gradient tree of {res['numel'] / 1e6:.1f}M "
        f"elements ({res['leaves']} leaves), bucket caps giving B buckets. The same calls on "
        "`DistMesh(dm)` (overlap: every bucket packed just before its first collective and "
        "every bucket's collective issued before any is waited on; MainGrad two buckets in "
        "flight) and `DistMesh(dm, overlap=False)` (each collective waited for as soon as it "
        f"is issued), same process groups. {C.timing_note(cfg, 'all calls')} Ratio = overlap / "
        "no overlap: below 1, overlap gains.\n"
    )
    rows = []
    for c in res["cases"]:
        for call in CALLS:
            rows.append(
                [
                    f"{c['buckets']} ({c['cap']:g} MiB)",
                    call,
                    f"{c['median'][f'{call}/off']:.4f}",
                    f"{c['median'][f'{call}/on']:.4f}",
                    f"{c['ratio'][call]:.2f}",
                ]
            )
    t = C.table(["buckets (cap)", "call", "no overlap (s)", "overlap (s)", "ratio"], rows)
    gains = [c["ratio"][call] for c in res["cases"] for call in CALLS]
    summary = (
        f"Overlap / no overlap ranges from {min(gains):.2f} to {max(gains):.2f} "
        f"(geometric mean {C.geomean(gains):.2f}).\n"
    )
    return f"{head}\n{desc}\n{t}\n\n{summary}"
