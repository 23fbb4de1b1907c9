"""Do two checkouts of the library do the same work? B9, B13, B14, B18 and B19
(``layerwise``, ``module``, ``dpsgd``, ``diloco``, ``compress``) run on both, one side after
the other, in one job, and compared:

- the collectives each rank issues, step by step and **in order** (``fh.comm_log``: op, axis,
  dtype, element count, reduce op), in every library variant, and its loss and eval figures,
  bit for bit (:func:`trace_diff`). B9, B13, B14: one step (the second; the first warms it),
  its loss. B18: every variant (HSDP, the inner loop alone, DiLoCo, Streaming) over as many
  steps as its longest period takes to sync, a delayed sync issued and landed and every
  Streaming fragment's sync within them (``every + delay + 1``: 51 at the full size, 4 at the
  tiny); a digest of each rank's shards after every step; the eval loss after the last. B19:
  every ``outer_compress`` variant (and none) over 2 steps (the second with the error
  feedback's residual), each step's loss and the eval loss after; the ``compress=`` DiLoCo
  variants (``diloco/...``) over ``every + 1`` steps (one sync), the same figures;
- each benchmark's own figures, run in full on each side (step time, peak step memory per
  rank), and those of its figures that must be identical (bytes on the wire; B18's dp_outer
  bytes, syncs and eval curves; B19's bytes, losses, eval curves and residual sizes).

::

    git worktree add /tmp/before <commit>
    python -m bench.same_work /tmp/before          # this checkout is "after"
    python -m bench.same_work /tmp/before --size tiny --names module   # seconds
    python -m bench.same_work /tmp/before --trace-only --names diloco  # the traces alone

``--trace-only`` compares the collectives and the loss figures without running the
benchmarks themselves (B18's full run takes about 6 minutes a side on 2 cores).

Each side runs in a process of its own whose working directory and ``PYTHONPATH`` are that
checkout, this file (copied into a temporary directory as ``same_work_side``, ahead on the
path) its main module, so both sides run this version of the comparison and each imports its
own ``functional_hsdp`` and ``bench``; the other checkout is not written to. Not a
registered benchmark: it compares two libraries rather than measuring one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

NAMES = ("layerwise", "module", "dpsgd", "diloco", "compress")
# the library's variants of each benchmark (the peers' variants do not change with it);
# B18's and B19's: :func:`library`
LIBRARY = {
    "layerwise": (
        "lw_sink",
        "lw_maingrad",
        "lw_pure",
        "lw_sink_raf0",
        "lw_sink_sync",
        "whole_tree",
    ),
    "module": tuple(
        f"{k}/{v}" for k in ("llama", "mlp") for v in ("fh", "fh_recompute", "fh_bf16", "fh_func")
    ),
    "dpsgd": ("fh", "fh_dpsgd", "whole_dpsgd"),
}
COMPRESS_STEPS = 2  # B19's HSDP variants: the second step has the error feedback's residual


def _bench(name: str):
    """Benchmark ``name``'s module in this side's checkout, wherever its ``bench`` keeps it
    (``bench/<layer>/<name>.py``; ``bench/<name>.py`` in a checkout from before the layers):
    its ``BENCHMARKS``."""
    import bench

    return bench.BENCHMARKS[name]


def library(name: str, cfg: dict) -> tuple[str, ...]:
    """The library variants of benchmark ``name`` at its config ``cfg`` (every variant of
    B18 and B19 is the library's; B19's DiLoCo ones are ``diloco/<variant>``)."""
    if name == "diloco":
        return tuple(v[0] for v in cfg["variants"])
    if name == "compress":
        B19 = _bench("compress")
        return (*B19.VARIANTS, *(f"diloco/{v}" for v in B19.DILOCO))
    return LIBRARY[name]


def _runner(name: str, variant: str, cfg: dict, dm: Any):
    """``(runner, data(step))`` of one library variant of benchmark ``name``."""
    mod = _bench(name)
    if name == "layerwise":
        base = mod._base(cfg)
        return mod._build(variant, cfg, base, dm), lambda k: mod._data(cfg, k)
    if name == "module":
        kind, v = variant.split("/")
        return mod._build(kind, v, cfg, dm), lambda k: (mod._data(kind, cfg, k),)
    return mod._build(variant, cfg, dm), lambda k: mod._data(cfg, k)


def _entry(steps: list, losses=(), eval_loss=None, weights=()) -> dict:
    """One variant's trace on one rank: per step its collectives in issue order, the losses
    and digests of the weights (per step, where the variant has them), the eval loss."""
    return {"steps": steps, "losses": list(losses), "eval": eval_loss, "weights": list(weights)}


def _events(log) -> list:
    return [[e.op, e.axis, str(e.dtype), e.numel, e.reduce] for e in log.events]


def _digest(tree) -> str:
    """A digest of a pytree's tensors' bytes (equal only if every bit is)."""
    import hashlib

    import optree
    import torch

    h = hashlib.sha256()
    for x in optree.tree_leaves(tree):
        h.update(x.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _trace_task(name: str, cfg: dict) -> dict:
    """On every rank: each library variant's trace (:func:`_entry`). B9, B13, B14: the
    second step (the first one warms it) under ``comm_log``, its events and its loss."""
    if name in ("diloco", "compress"):
        return _trace_diloco(cfg) if name == "diloco" else _trace_compress(cfg)
    import functional_hsdp as fh
    from bench import common as C

    dm = C.device_mesh((2, 2))
    out = {}
    for variant in LIBRARY[name]:
        runner, data = _runner(name, variant, cfg, dm)
        runner.step(*data(0))
        with fh.comm_log() as log:
            loss = runner.step(*data(1))
        out[variant] = _entry([_events(log)], [float(loss)])
        del runner
    return out


def _split(mb: float) -> tuple:
    """B18's text: (training bytes, held-out bytes), as its benchmarks split it."""
    text = _bench("diloco")._text(mb)
    split = int(0.9 * len(text))
    return text[:split], text[split:]


def _trace_diloco(cfg: dict) -> dict:
    """B18 on this rank: every variant over ``every + delay + 1`` steps of its longest period
    (the same steps and batches for all, as its memory pass), each step's collectives and a
    digest of this rank's shards after it; the eval loss after the last step."""
    import torch

    import functional_hsdp as fh
    from bench import common as C

    B18 = _bench("diloco")
    train, held = _split(cfg["data_mb"])
    eval_gen = torch.Generator().manual_seed(7)
    evals = [B18._batch(held, eval_gen, cfg) for _ in range(cfg["eval_batches"])]
    n = max(every + delay + 1 for _, every, _, delay in cfg["variants"])
    out = {}
    for variant, every, fragments, delay in cfg["variants"]:
        run = B18._Run(cfg, every, fragments, delay)
        gen = torch.Generator().manual_seed(1000 + C.rank())
        steps, weights = [], []
        for _ in range(n):
            ids = B18._batch(train, gen, cfg)
            with fh.comm_log() as log:
                run.step(ids)
            steps.append(_events(log))
            weights.append(_digest(run.shards))
        run.drain()
        out[variant] = _entry(steps, eval_loss=run.evaluate(evals), weights=weights)
        del run
    return out


def _trace_compress(cfg: dict) -> dict:
    """B19 on this rank: its HSDP variants (:func:`_trace_compress_hsdp`), then its DiLoCo
    ones (``diloco/<variant>``), each over ``every + 1`` steps (one sync): each step's
    collectives and loss, the eval loss after the last step."""
    import torch

    import functional_hsdp as fh
    from bench import common as C

    B18, B19 = _bench("diloco"), _bench("compress")
    dm = C.device_mesh((2, 2))
    out = _trace_compress_hsdp(cfg["hsdp"], dm)
    dc = cfg["diloco"]
    train, held = _split(dc["data_mb"])
    eval_gen = torch.Generator().manual_seed(7)
    evals = [B18._batch(held, eval_gen, dc) for _ in range(dc["eval_batches"])]
    for variant in B19.DILOCO:
        run = B19._DiLoCo(variant, dc, dm)
        gen = torch.Generator().manual_seed(1000 + C.rank())
        steps, losses = [], []
        for _ in range(dc["every"] + 1):
            ids = B18._batch(train, gen, dc)
            with fh.comm_log() as log:
                losses.append(run.step(ids)[0])
            steps.append(_events(log))
        out[f"diloco/{variant}"] = _entry(steps, losses, run.eval_loss(evals))
        del run
    return out


def _trace_compress_hsdp(hc: dict, dm) -> dict:
    """B19's HSDP variants on this rank, each over :data:`COMPRESS_STEPS` steps of ``M``
    microbatches: each step's collectives and loss, the eval loss after the last step."""
    import torch

    import functional_hsdp as fh
    from bench import common as C

    B18, B19 = _bench("diloco"), _bench("compress")
    train, held = _split(hc["data_mb"])
    eval_gen = torch.Generator().manual_seed(7 + C.rank())
    evals = [B18._batch(held, eval_gen, hc) for _ in range(hc["eval_batches"])]
    out = {}
    for variant in B19.VARIANTS:
        run = B19._Run(variant, hc, dm)
        gen = torch.Generator().manual_seed(1000 + C.rank())
        steps, losses = [], []
        for _ in range(COMPRESS_STEPS):
            batches = [B18._batch(train, gen, hc) for _ in range(hc["M"])]
            with fh.comm_log() as log:
                losses.append(run.step(batches))
            steps.append(_events(log))
        out[variant] = _entry(steps, losses, run.eval_loss(evals))
        del run
    return out


def side(names: list[str], size: str, out: str, trace_only: bool = False) -> None:
    """In a checkout: the traces, then (unless ``trace_only``) each benchmark's own run;
    written to ``out``."""
    import functional_hsdp
    from bench import common as C

    res: dict = {"library": functional_hsdp.__file__, "trace": {}, "bench": {}, "variants": {}}
    for name in names:
        mod = _bench(name)
        cfg = mod.SIZES[size]
        res["variants"][name] = library(name, cfg)
        t0 = time.perf_counter()
        res["trace"][name] = C.on_ranks(None, _trace_task, name, cfg)
        print(f"   {name}: traced in {time.perf_counter() - t0:.0f} s", flush=True)
        if trace_only:
            continue
        t0 = time.perf_counter()
        res["bench"][name] = mod.run(size)
        res["bench"][name]["wall_s"] = time.perf_counter() - t0
        print(f"   {name}: run in {res['bench'][name]['wall_s']:.0f} s", flush=True)
    with open(out, "w") as f:
        json.dump(res, f, default=str)


def _run_side(checkout: str, argv: list[str], tmp: str) -> None:
    """One side: this file, as ``same_work_side`` in ``tmp``, run in ``checkout`` on its
    library (``argv``: the side's options)."""
    module = os.path.join(tmp, "same_work_side.py")
    if not os.path.exists(module):
        shutil.copy(os.path.abspath(__file__), module)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, checkout])}
    cmd = [sys.executable, "-m", "same_work_side", *argv]
    subprocess.run(cmd, cwd=checkout, env=env, check=True)


# -- the comparison (pure: dicts as the sides write them) ----------------------------------------


def _bits(x: Any) -> str:
    """``x`` as exact text (floats as ``repr``: equal only if every bit is, NaN equal to NaN)."""
    return json.dumps(x, default=str, sort_keys=True)


def _first_diff(eb: list, ea: list) -> str:
    """The first collective where two steps' lists differ."""
    i = next((i for i, (x, y) in enumerate(zip(eb, ea)) if _bits(x) != _bits(y)), None)
    i = min(len(eb), len(ea)) if i is None else i
    b = eb[i] if i < len(eb) else "nothing"
    a = ea[i] if i < len(ea) else "nothing"
    return f"collective {i + 1} is {b} before, {a} after ({len(eb)} vs {len(ea)} in the step)"


def _entry_diff(b: dict, a: dict) -> list[str]:
    """How two traces of one variant on one rank differ (before ``b``, after ``a``)."""
    out = []
    sb, sa = b["steps"], a["steps"]
    if len(sb) != len(sa):
        out.append(f"{len(sb)} steps traced before, {len(sa)} after")
    for k, (eb, ea) in enumerate(zip(sb, sa)):
        if _bits(eb) != _bits(ea):
            out.append(f"step {k + 1}: {_first_diff(eb, ea)}")
    for key in ("losses", "eval", "weights"):
        if _bits(b.get(key)) != _bits(a.get(key)):
            out.append(f"{key}: {b.get(key)} before, {a.get(key)} after")
    return out


def trace_diff(before: list[dict], after: list[dict], variant: str) -> list[str]:
    """Where the two sides' traces of ``variant`` differ (per rank, ``{variant: entry}`` as
    :func:`_trace_task` returns them): each step's collectives in issue order, the losses,
    the eval loss and the weights' digests, bit for bit. ``[]``: identical on every rank."""
    if len(before) != len(after):
        return [f"{len(before)} ranks before, {len(after)} after"]
    out = []
    for rank, (b, a) in enumerate(zip(before, after)):
        if variant not in b or variant not in a:
            out.append(f"rank {rank}: traced only {'after' if variant in a else 'before'}")
            continue
        out += [f"rank {rank}: {d}" for d in _entry_diff(b[variant], a[variant])]
    return out


def _flat(prefix: str, x: Any) -> dict[str, Any]:
    """``x`` with its dicts flattened into ``prefix/key`` entries."""
    if not isinstance(x, dict):
        return {prefix: x}
    out = {}
    for k, v in x.items():
        out.update(_flat(f"{prefix}/{k}", v))
    return out


_DILOCO_EXACT = ("bytes_per_step", "max_step_bytes", "quiet_nonzero", "syncs", "curve", "kept",
                 "pending", "shard_bytes")  # fmt: skip
_COMPRESS_EXACT = ("wire", "eval", "curve", "losses", "residual_bytes", "shard", "numel")
_COMPRESS_DILOCO_EXACT = ("sent", "eval", "losses", "residual", "syncs", "shard", "numel")


def exact_figures(name: str, res: dict) -> dict[str, Any]:
    """The figures of benchmark ``name``'s own run (``res``) that the same work leaves
    identical, flat (``key/variant/...``): B9, B13, B14 the library variants' losses per
    step and the bytes on the wire (B13); B18's dp_outer bytes, syncs,
    eval curves and state bytes; B19's bytes, losses, eval curves and residual sizes."""
    if name == "diloco":
        return {
            k: v
            for variant, x in res["variants"].items()
            for key in _DILOCO_EXACT
            for k, v in _flat(f"{key}/{variant}", x[key]).items()
        }
    if name == "compress":
        out = {}
        for key in _COMPRESS_EXACT:
            out.update(_flat(key, res[key]))
        for key in _COMPRESS_DILOCO_EXACT:
            out.update(_flat(f"diloco/{key}", res["diloco"][key]))
        return out
    losses = res.get("losses", {})
    out = {f"losses/{v}": losses[v] for v in LIBRARY[name] if v in losses}
    return {**out, **(_flat("wire", res["wire"]) if "wire" in res else {})}


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{1e3 * s:.1f}"


def figures(name: str, res: dict) -> dict[str, tuple[str, str]]:
    """``{variant: (step time, peak step memory)}`` cells of benchmark ``name``'s own run:
    B9, B13, B14 median step (ms) and peak step memory above idle (MiB); B18 median step
    without / with a sync (ms) and the tensors' largest / lowest step peak (kB); B19 median
    step (ms) and one step's peak RSS (MiB; its DiLoCo variants: none measured)."""
    if name == "diloco":
        out = {}
        for v, x in res["variants"].items():
            m = x.get("memory") or {}
            mem = f"{m['torch'] / 1e3:.0f} / {m['torch_low'] / 1e3:.0f}" if m else "-"
            out[v] = (f"{_ms(x['step_quiet'])} / {_ms(x['step_sync'])}", mem)
        return out
    if name == "compress":
        out = {v: (_ms(t), f"{res['peak'][v] / 2**20:.1f}") for v, t in res["step_s"].items()}
        for v, t in res["diloco"]["step_s"].items():
            out[f"diloco/{v}"] = (_ms(t), "-")
        return out
    mem = res.get("mem", {})
    return {
        v: (_ms(t), f"{mem[v]['peak'] / 2**20:.1f}" if v in mem else "nan")
        for v, t in res.get("median", {}).items()
        if v in LIBRARY[name]
    }


_TRACE_HEAD = (
    "| variant | steps | collectives, all steps (rank 0) | steps with a dp_outer collective "
    "(rank 0) | identical on every rank | last loss before | last loss after |\n"
    "|---|---|---|---|---|---|---|"
)
_BENCH_HEAD = (
    "\n| variant | step time before | after | peak step memory before "
    "| after |\n|---|---|---|---|---|"
)
_MAX_DIFFS = 6  # lines of differences shown per variant


def _last(entry: dict) -> str:
    """The variant's last loss figure: the eval loss, else the last step's loss."""
    x = entry["eval"] if entry.get("eval") is not None else (entry["losses"] or [None])[-1]
    return "-" if x is None else f"{x:.9g}"


def _outer_steps(entry: dict) -> str:
    steps = [k + 1 for k, ev in enumerate(entry["steps"]) if any(e[1] == "dp_outer" for e in ev)]
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{len(steps)} of them"


def _compare_traces(before: dict, after: dict, name: str) -> tuple[list[str], bool]:
    """One benchmark's trace rows, and whether every variant's trace is identical."""
    tb, ta = before["trace"][name], after["trace"][name]
    variants = list(dict.fromkeys([*before["variants"][name], *after["variants"][name]]))
    lines, notes, same = [f"### {name}\n", _TRACE_HEAD], [], True
    for v in variants:
        diff = trace_diff(tb, ta, v)
        same &= not diff
        notes += [f"- {v}: {d}" for d in diff[:_MAX_DIFFS]]
        if len(diff) > _MAX_DIFFS:
            notes.append(f"- {v}: ... {len(diff) - _MAX_DIFFS} more")
        b0, a0 = tb[0].get(v), ta[0].get(v)
        if b0 is None or a0 is None:
            lines.append(f"| {v} | - | - | - | **no** | - | - |")
            continue
        lines.append(
            f"| {v} | {len(a0['steps'])} | {sum(len(s) for s in a0['steps'])} | "
            f"{_outer_steps(a0)} | {'yes' if not diff else '**no**'} | {_last(b0)} | "
            f"{_last(a0)} |"
        )
    if notes:
        lines += ["\nDifferences (the first of each step):\n", *notes]
    return lines, same


def _compare_bench(bb: dict, ba: dict, name: str) -> tuple[list[str], bool]:
    """One benchmark's own figures side by side, and whether its exact ones match."""
    lines = [f"\nThe benchmark's own run ({_UNITS.get(name, _UNITS['layerwise'])}):", _BENCH_HEAD]
    fb, fa = figures(name, bb), figures(name, ba)
    for v in fa:
        (tb, mb), (ta, ma) = fb.get(v, ("-", "-")), fa[v]
        lines.append(f"| {v} | {tb} | {ta} | {mb} | {ma} |")
    eb, ea = exact_figures(name, bb), exact_figures(name, ba)
    diff = [k for k in dict.fromkeys([*eb, *ea]) if _bits(eb.get(k)) != _bits(ea.get(k))]
    more = f" and {len(diff) - 10} more" if len(diff) > 10 else ""
    verdict = "identical" if not diff else f"differ in {diff[:10]}{more}"
    lines.append(f"\nThe run's exact figures ({len(ea)}: {_exact_what(name)}): {verdict}.")
    return lines, not diff


def _exact_what(name: str) -> str:
    if name == "diloco":
        return "dp_outer bytes, syncs, eval curves, state bytes"
    if name == "compress":
        return "bytes on the wire, losses, eval curves, residual sizes"
    return "the library variants' losses" + (", bytes on the wire" if name == "module" else "")


_UNITS = {
    "layerwise": "step time: median ms of the slowest rank; peak step memory above idle, MiB",
    "diloco": "step time: median ms without / with a sync; peak step memory: the tensors' "
    "largest / lowest step peak, kB (the largest over the ranks)",
    "compress": "step time: median ms of the slowest rank; peak step memory: one step's "
    "peak RSS above the RSS before it, MiB (DiLoCo's: not measured)",
}


def _compare_one(before: dict, after: dict, name: str) -> tuple[list[str], bool]:
    """One benchmark's rows, and whether its collectives, losses and exact figures match."""
    lines, same = _compare_traces(before, after, name)
    bb, ba = before["bench"].get(name), after["bench"].get(name)
    if bb is not None and ba is not None:
        rows, ok = _compare_bench(bb, ba, name)
        lines += rows
        same &= ok
    return [*lines, ""], same


def compare(before: dict, after: dict, names: list[str]) -> tuple[str, bool]:
    """A markdown report of the two sides, and whether their collectives are identical."""
    lines, same = [], True
    for name in names:
        rows, ok = _compare_one(before, after, name)
        lines += rows
        same &= ok
    return "\n".join(lines), same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.same_work", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("before", nargs="?", help="the other checkout (the baseline)")
    ap.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--size", default="full", choices=["tiny", "full"])
    ap.add_argument("--trace-only", action="store_true",
                    help="compare the traces only (not the benchmarks' own runs)")  # fmt: skip
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        side(a.names, a.size, a.side, trace_only=a.trace_only)
        return 0
    if not a.before:
        ap.error("give the baseline checkout")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    opts = ["--size", a.size, *(["--trace-only"] if a.trace_only else []), "--names", *a.names]
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for label, checkout in (("before", os.path.abspath(a.before)), ("after", here)):
            res[label] = os.path.join(tmp, f"{label}.json")
            print(f"== {label}: {checkout}", flush=True)
            _run_side(checkout, ["--side", res[label], *opts], tmp)
        before, after = (json.load(open(res[k])) for k in ("before", "after"))
    for label, r in (("before", before), ("after", after)):
        print(f"{label} imported {r['library']}")
    report, same = compare(before, after, a.names)
    print(report)
    what = "collectives, their order, losses" + ("" if a.trace_only else " and exact figures")
    print(f"{what} identical" if same else "THE SIDES DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
