"""(B7) ``reduce_grads`` compiled with ``torch.compile(fullgraph=True)`` versus eager.

4 gloo processes, 2x2 mesh, ``hsdp``: one rank's fp32 gradient tree of N parameters. The same
calls eager and through ``torch.compile(fn, fullgraph=True)`` (inductor; one function per value
of ``last``): ``rg_acc`` = ``reduce_grads(g, last=False, acc=acc)``, ``rg_last`` =
``reduce_grads(g, last=True, acc=acc)``. Traced, the DistMesh runs the functional collectives
(gloo: all-reduce + slice inside ``reduce_scatter_tensor``); eager, its asynchronous in-place
c10d all-reduces. Compile time (the first call) is reported apart; the timed calls reuse the
compiled graphs. Results are checked equal to eager before timing.
"""

from __future__ import annotations

from functools import partial

from . import common as C

SIZES = {
    "tiny": {"sizes": [20_000], "reps": 2, "warmup": 1, "backend": "aot_eager", "cap": 0.05},
    "full": {
        "sizes": [1_000_000, 10_000_000],
        "reps": 7,
        "warmup": 2,
        "backend": "inductor",
        "cap": 25.0,
    },
}
CALLS = ("rg_acc", "rg_last")


def task(cfg: dict) -> dict:
    import optree
    import torch

    import functional_hsdp as fh

    torch._dynamo.reset()
    spec = fh.hsdp(fh.DistMesh(C.device_mesh((2, 2))), *C.AXES, bucket_cap_mb=cfg["cap"])
    eager = {
        "rg_acc": lambda g, acc: fh.reduce_grads(g, spec, last=False, acc=acc),
        "rg_last": lambda g, acc: fh.reduce_grads(g, spec, last=True, acc=acc),
    }
    compiled = {
        k: torch.compile(f, fullgraph=True, backend=cfg["backend"]) for k, f in eager.items()
    }
    out = {}
    for n in cfg["sizes"]:
        shapes = C.param_tree(n, leaf=min(1 << 20, max(64, n // 8)))
        g = C.make(shapes, seed=C.rank())
        acc = fh.reduce_grads(g, spec, last=False)
        compile_s, equal = {}, {}
        for k in CALLS:
            dt, got = C.timed(partial(compiled[k], g, acc))
            compile_s[k] = dt
            want = eager[k](g, acc)
            equal[k] = all(map(torch.equal, optree.tree_leaves(got), optree.tree_leaves(want)))
        ops = {
            (k, mode): partial(fns[k], g, acc)
            for mode, fns in (("eager", eager), ("compiled", compiled))
            for k in CALLS
        }
        times = C.interleaved(ops, cfg["warmup"], cfg["reps"])
        out[n] = {
            "numel": C.numel(shapes),
            "leaves": len(shapes),
            "times": {f"{k}/{mode}": v for (k, mode), v in times.items()},
            "compile_s": compile_s,
            "equal": equal,
        }
    return out


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["cases"] = []
    for n, case in per_rank[0].items():
        _, median = C.slowest_rank_medians([r[n]["times"] for r in per_rank])
        res["cases"].append(
            {
                "numel": case["numel"],
                "leaves": case["leaves"],
                "median": median,
                "ratio": {k: median[f"{k}/compiled"] / median[f"{k}/eager"] for k in CALLS},
                "compile_s": {k: max(r[n]["compile_s"][k] for r in per_rank) for k in CALLS},
                "equal": all(all(r[n]["equal"].values()) for r in per_rank),
            }
        )
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header(
        "(B7) torch.compile(fullgraph=True) of reduce_grads versus eager", command, when
    )
    desc = (
        f"hsdp on the 2x2 mesh, 4 gloo processes; one rank's fp32 gradient tree of N elements "
        f"(rank-dependent values). `torch.compile(fn, fullgraph=True, backend="
        f'"{cfg["backend"]}")`, one function per value of `last`. Traced, the DistMesh runs '
        "the functional collectives; eager, its asynchronous in-place c10d all-reduces (the "
        "faster form on gloo). Compile time = the first compiled call (max over ranks). "
        f"{C.timing_note(cfg, 'eager and compiled')} Ratio = compiled / eager.\n"
    )
    rows = []
    for c in res["cases"]:
        for k in CALLS:
            rows.append(
                [
                    f"{c['numel'] / 1e6:.1f}M ({c['leaves']} leaves)",
                    k,
                    f"{c['median'][f'{k}/eager']:.4f}",
                    f"{c['median'][f'{k}/compiled']:.4f}",
                    f"{c['ratio'][k]:.2f}",
                    f"{c['compile_s'][k]:.1f}",
                    "yes" if c["equal"] else "NO",
                ]
            )
    t = C.table(
        [
            "N",
            "call",
            "eager (s)",
            "compiled (s)",
            "compiled / eager",
            "compile (s)",
            "bit-equal to eager",
        ],
        rows,
    )
    ratios = [c["ratio"][k] for c in res["cases"] for k in CALLS]
    return (
        f"{head}\n{desc}\n{t}\n\nCompiled / eager ranges from {min(ratios):.2f} to "
        f"{max(ratios):.2f}.\n"
    )
