"""(B5) Scaling: gradient-sync cost versus M, model size and mesh shape.

4 gloo processes. The cost of one step's data-parallel communication with the library: ``gather``
of the parameters for the forward + M ``MainGrad.accumulate`` calls (synthetic per-rank
gradients, no model compute), ``hsdp``. Swept:

- M = 1, 2, 4, 8 at N = 10M on the 2x2 mesh; next to it the same step without deferral
  (gradient placement ``[Replicate, Flat]``: every microbatch also all-reduces over dp_outer),
  which is what deferral saves;
- N = 1M, 10M, 50M at M = 4 on 2x2;
- mesh 2x2, 4x1, 1x4 (dp_outer x dp_inner) at N = 10M, M = 4.

Median of the timed repetitions (slowest rank), a table and a PNG plot.
"""

from __future__ import annotations

import os

from .. import common as C

SIZES = {
    "tiny": {
        "Ms": [1, 2],
        "n": 40_000,
        "ns": [10_000, 40_000],
        "meshes": [(2, 2), (4, 1)],
        "M": 2,
        "reps": 2,
        "warmup": 1,
        "cap": 0.05,
    },
    "full": {
        "Ms": [1, 2, 4, 8],
        "n": 10_000_000,
        "ns": [1_000_000, 10_000_000, 50_000_000],
        "meshes": [(2, 2), (4, 1), (1, 4)],
        "M": 4,
        "reps": 3,
        "warmup": 1,
        "cap": 25.0,
    },
}
PNG = os.path.join(C.BENCH_DIR, "scaling.png")


def _spec(fh, mesh, deferred: bool, cap: float):
    if deferred:
        return fh.hsdp(mesh, *C.AXES, bucket_cap_mb=cap)
    return fh.Spec(
        mesh,
        parameter=[fh.Replicate(), fh.Flat()],
        gradient=[fh.Replicate(), fh.Flat()],
        optimizer=[fh.Replicate(), fh.Flat()],
        bucket_cap_mb=cap,
    )


def _case(fh, shape, n, M, deferred, cfg) -> dict:
    mesh = fh.DistMesh(C.device_mesh(shape))
    spec = _spec(fh, mesh, deferred, cfg["cap"])
    shapes = C.param_tree(n, leaf=min(1 << 20, max(64, n // 8)))
    g = C.make(shapes, fill=1.0)
    params = fh.shard(g, spec)
    mg = fh.MainGrad(spec, like=g)

    def step():
        full = fh.gather(params, spec)
        for _, last in fh.microbatches(M):
            mg.accumulate(g, last=last)
        mg.zero_grad()
        return full

    times = []
    for rep in range(cfg["warmup"] + cfg["reps"]):
        with fh.comm_log() as log:
            dt, _ = C.timed(step)
        if rep >= cfg["warmup"]:
            times.append(dt)
    sent = 0.0
    factor = {
        "reduce_scatter": lambda k: (k - 1) / k,
        "all_reduce": lambda k: 2 * (k - 1) / k,
        "all_gather": lambda k: k - 1,
    }
    for e in log.events:
        sent += factor[e.op](mesh.size(e.axis)) * e.nbytes
    return {
        "shape": list(shape),
        "n": C.numel(shapes),
        "M": M,
        "deferred": deferred,
        "times": times,
        "collectives": len(log.events),
        "wire": sent,
    }


def task(cfg: dict) -> list[dict]:
    import functional_hsdp as fh

    out = []
    for M in cfg["Ms"]:
        for deferred in (True, False):
            out.append({"sweep": "M", **_case(fh, (2, 2), cfg["n"], M, deferred, cfg)})
    for n in cfg["ns"]:
        out.append({"sweep": "size", **_case(fh, (2, 2), n, cfg["M"], True, cfg)})
    for shape in cfg["meshes"]:
        out.append({"sweep": "mesh", **_case(fh, shape, cfg["n"], cfg["M"], True, cfg)})
    return out


def run(size: str = "full", pool=None, png: str | None = PNG) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    cases = []
    for i, c in enumerate(per_rank[0]):
        c = dict(c)
        c["times"] = C.across_ranks_max([r[i]["times"] for r in per_rank])
        c["median"] = C.median(c["times"])
        cases.append(c)
    res.update(cases=cases, png=png)
    if png:
        plot(res, png)
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = res["cases"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    for deferred, label in (
        (True, "hsdp (deferred outer all-reduce)"),
        (False, "no deferral (all-reduce every microbatch)"),
    ):
        xs = [c for c in cases if c["sweep"] == "M" and c["deferred"] == deferred]
        ax.plot([c["M"] for c in xs], [c["median"] for c in xs], "o-", label=label)
    n = next(c["n"] for c in cases if c["sweep"] == "M")
    ax.set(
        xlabel="microbatches M",
        ylabel="sync time per step (s)",
        title=f"vs M ({n / 1e6:.0f}M params, 2x2)",
    )
    ax.legend(fontsize=8)
    ax = axes[1]
    xs = [c for c in cases if c["sweep"] == "size"]
    ax.loglog([c["n"] for c in xs], [c["median"] for c in xs], "o-")
    ax.set(
        xlabel="parameters",
        ylabel="sync time per step (s)",
        title=f"vs model size (M={xs[0]['M']}, 2x2)",
    )
    ax = axes[2]
    xs = [c for c in cases if c["sweep"] == "mesh"]
    ax.bar([f"{c['shape'][0]}x{c['shape'][1]}" for c in xs], [c["median"] for c in xs])
    ax.set(
        xlabel="mesh (dp_outer x dp_inner)",
        ylabel="sync time per step (s)",
        title=f"vs mesh shape ({xs[0]['n'] / 1e6:.0f}M params, M={xs[0]['M']})",
    )
    fig.suptitle(
        "functional_hsdp gradient sync per step (gather + M x MainGrad.accumulate), "
        "4 gloo processes on a 2-core CPU",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header("(B5) Scaling: cost versus M, model size and mesh shape", command, when)
    desc = (
        "Cost = wall time of one step's communication with the library: `gather` of the "
        "parameters + M x `MainGrad.accumulate` (synthetic gradients, no model compute), "
        f"hsdp, fp32, {cfg['cap']:g} MiB buckets. {cfg['warmup']} warm-up and {cfg['reps']} "
        "timed repetitions per point, median of the slowest rank's time. *Wire* = bytes one "
        "rank sends for the logged collectives with the bandwidth-optimal algorithm (see B4). "
        '"no deferral": gradient placement [Replicate, Flat], i.e. an outer all-reduce on '
        "every microbatch.\n"
    )
    if res.get("png"):
        desc += f"\n![scaling]({os.path.basename(res['png'])})\n"
    rows = []
    for c in res["cases"]:
        rows.append(
            [
                c["sweep"],
                f"{c['shape'][0]}x{c['shape'][1]}",
                f"{c['n'] / 1e6:.1f}M",
                c["M"],
                "yes" if c["deferred"] else "no",
                c["collectives"],
                C.mib(c["wire"]),
                f"{c['median']:.3f}",
                f"{c['median'] / c['M']:.3f}",
            ]
        )
    t = C.table(
        [
            "sweep",
            "mesh",
            "params",
            "M",
            "deferred",
            "collectives per step",
            "wire per rank (MiB)",
            "median (s)",
            "per microbatch (s)",
        ],
        rows,
    )
    ms = {(c["M"], c["deferred"]): c["median"] for c in res["cases"] if c["sweep"] == "M"}
    lines = []
    for M in cfg["Ms"]:
        if (M, True) in ms and (M, False) in ms:
            lines.append(f"M={M}: {ms[(M, True)] / ms[(M, False)]:.2f}")
    note = ("\nDeferred / non-deferred time: " + ", ".join(lines) + ".\n") if lines else ""
    return f"{head}\n{desc}\n{t}\n{note}"
