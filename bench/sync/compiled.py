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

from .. import common as C

SIZES = {
    "tiny": {
        "sizes": [20_000],
        "reps": 2,
        "warmup": 1,
        "backend": "aot_eager",
        "cap": 0.05,
        "step": {"D": 32, "L": 2, "B": 4, "M": 2},
    },
    "full": {
        "sizes": [1_000_000, 10_000_000],
        "reps": 7,
        "warmup": 2,
        "backend": "inductor",
        "cap": 25.0,
        "step": {"D": 1024, "L": 8, "B": 32, "M": 2},
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
    out["step"] = _whole_step(cfg, spec)
    return out


def _whole_step(cfg: dict, spec) -> dict:
    """A whole training step (gather, grad of a Linear stack per microbatch, reduce_grads, SGD)
    eager and through ``torch.compile`` (no fullgraph: gather runs eagerly at a graph break)."""
    import optree
    import torch
    from torch.func import functional_call, grad

    import functional_hsdp as fh

    c = cfg["step"]
    torch.manual_seed(0)
    layers = []
    for _ in range(c["L"]):
        layers += [torch.nn.Linear(c["D"], c["D"]), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(C.rank())
    xs = [torch.randn(c["B"], c["D"], generator=gen) for _ in range(c["M"])]
    g_fn = grad(lambda p, x: functional_call(model, p, (x,)).square().mean() / c["M"])

    def step(params):
        weights, acc = fh.gather(params, spec), None
        for m, last in fh.microbatches(c["M"]):
            acc = fh.reduce_grads(g_fn(weights, xs[m]), spec, last=last, acc=acc)
        return optree.tree_map(lambda p, g: p - 0.01 * g, params, acc)

    compiled = torch.compile(step, backend=cfg["backend"])
    params = fh.shard(full, spec)
    compile_s, got = C.timed(partial(compiled, params))
    want = step(params)
    diff = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want))
        if b.numel()  # a rank's piece of a leaf may be empty
    )
    ops = {"eager": partial(step, params), "compiled": partial(compiled, params)}
    times = C.interleaved(ops, cfg["warmup"], cfg["reps"])
    return {"times": times, "compile_s": compile_s, "max_rel_diff": diff}


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["cases"] = []
    _, step_median = C.slowest_rank_medians([r["step"]["times"] for r in per_rank])
    res["step"] = {
        "median": step_median,
        "ratio": step_median["compiled"] / step_median["eager"],
        "compile_s": max(r["step"]["compile_s"] for r in per_rank),
        "max_rel_diff": max(r["step"]["max_rel_diff"] for r in per_rank),
    }
    for n, case in per_rank[0].items():
        if n == "step":
            continue
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
    st, sc = res["step"], cfg["step"]
    whole = (
        f"\nA whole training step ({sc['L']} x Linear({sc['D']}) + tanh, M={sc['M']} "
        f"microbatches of {sc['B']}: `gather`, `grad`, `reduce_grads`, SGD) in one "
        f'`torch.compile(step, backend="{cfg["backend"]}")` (not fullgraph: `gather` runs '
        "eagerly at a clean graph break; the gradient computation and `reduce_grads` are "
        f"traced): eager {st['median']['eager']:.4f} s, compiled {st['median']['compiled']:.4f} "
        f"s, compiled / eager **{st['ratio']:.2f}**; compile time {st['compile_s']:.1f} s; "
        f"parameters after the step within a relative {st['max_rel_diff']:.1e} of eager's "
        "(inductor's kernels round differently; `aot_eager` is bit-equal, "
        "tests/sync/test_compile.py).\n"
    )
    return (
        f"{head}\n{desc}\n{t}\n\nCompiled / eager ranges from {min(ratios):.2f} to "
        f"{max(ratios):.2f}.\n{whole}"
    )
