"""(B9) Layer-wise HSDP (``fh.gathered`` units) versus FSDP2: peak step memory and step time.

4 gloo processes, 2x2 mesh (dp_outer, dp_inner), an MLP of L x (Linear(D, D) + Tanh), M
microbatches of B x D per rank, MSE loss scaled by 1/M in every variant, SGD. The same initial
parameters on every rank and for every variant, the same data for every variant. A step is
forward + backward + gradient sync + SGD. Variants:

- ``fsdp2``: ``fully_shard`` per Linear and the root on the 2-D DeviceMesh (HSDP),
  ``reshard_after_forward=True``, ``set_requires_all_reduce(last)``, ``torch.optim.SGD``,
  ``zero_grad(set_to_none=True)``. The baseline.
- ``lw_sink``: one unit per Linear, ``fh.gathered(layer, spec, into=mg)`` with
  ``mg = fh.MainGrad(tree_spec, like=full)``, ``fh.sequence`` (prefetch), the microbatches
  declared (``fh.microbatches(M, into=mg)``: the last one's backward issues each unit's
  dp_outer all-reduce), ``mg.finish()`` after the last microbatch, in-place SGD on the
  shards, ``mg.zero_grad()``. The README's layer-wise loop.
- ``lw_maingrad``: the same units without ``into``: ``torch.func.grad`` returns the
  gradient-placement shards, ``mg.accumulate(g, last=last, at="gradient")``.
- ``lw_pure``: ``acc = fh.reduce_grads(g, tree_spec, last=last, acc=acc, at="gradient")``,
  ``params = tree_map(lambda p, g: p - lr * g, params, acc)`` (new trees every step).
- ``lw_sink_raf0``: ``lw_sink`` with ``reshard_after_forward=False``.
- ``lw_sink_sync``: ``lw_sink`` without prefetch (a plain loop over the units) on
  ``fh.DistMesh(dm, overlap=False)``: no overlap at all.
- ``lw_sink_undeclared`` (not in ``VARIANTS``; ``bench deferred`` times it): ``lw_sink``
  with the microbatches not declared (``fh.microbatches(M)``), so ``mg.finish()`` issues
  every dp_outer all-reduce after the whole backward.
- ``whole_tree``: the README quickstart loop: ``full = fh.gather(params, spec)``, the whole
  model's gradient (``grad_and_value`` of ``functional_call``), ``fh.reduce_grads(g, spec,
  last=last, acc=acc)``, SGD into new trees.
- ``ddp_nosync``: torch DDP over the 4 ranks (full replicas: the memory-unconstrained
  reference), ``no_sync()`` on all but the last microbatch, ``torch.optim.SGD``.
- ``compute``: the same forward + backward + SGD as a plain ``nn.Module`` step, no
  communication (every rank trains its own replica at the same time, so the machine is as
  busy as in the other variants; its losses after the first step differ by design).

Three phases. *Time*: every variant built in one group of 4 ranks, steps interleaved
(:func:`common.interleaved`), glibc's default malloc. *Memory*: each variant in a fresh group
of 4 ranks (one-shot launch; the smoke test reuses its pool), glibc told to mmap allocations
>= 64 KiB: idle RSS before the variant is built, one warm-up step, then the high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``) of one measured step. *Cap*: ``whole_tree``
and ``lw_sink`` each in a fresh group, one measured step under an address-space limit
(``RLIMIT_AS``) that leaves each rank ``cap`` bytes above its idle RSS.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import resource

import optree
import torch
import torch.nn.functional as F

from .. import common as C

SIZES = {
    "tiny": {
        "D": 64,
        "L": 4,
        "B": 4,
        "M": 2,
        "warmup": 1,
        "reps": 1,
        "cap_mib": 256,
        "fresh": False,
    },
    "full": {
        "D": 2048,
        "L": 16,
        "B": 8,
        "M": 2,
        "warmup": 1,
        "reps": 4,
        "cap_mib": 640,
        "fresh": True,
    },
}
VARIANTS = (
    "fsdp2",
    "lw_sink",
    "lw_maingrad",
    "lw_pure",
    "lw_sink_raf0",
    "lw_sink_sync",
    "whole_tree",
    "ddp_nosync",
    "compute",
)
REFERENCE = ("compute",)  # not data parallel: its losses after the first step differ by design
CAPPED = ("whole_tree", "lw_sink")
LR = 0.05

_LABEL = {
    "fsdp2": "FSDP2 fully_shard HSDP (baseline)",
    "lw_sink": "fh layer-wise, gathered(into=MainGrad), microbatches(into=mg)",
    "lw_maingrad": "fh layer-wise, grads returned, MainGrad.accumulate(at='gradient')",
    "lw_pure": "fh layer-wise, pure: reduce_grads(at='gradient'), new trees",
    "lw_sink_raf0": "lw_sink, reshard_after_forward=False",
    "lw_sink_sync": "lw_sink, no prefetch, DistMesh(overlap=False)",
    "lw_sink_undeclared": "lw_sink, microbatches not declared: finish() issues the all-reduces",
    "whole_tree": "fh whole tree (README quickstart loop)",
    "ddp_nosync": "torch DDP + no_sync (full replicas)",
    "compute": "no communication (plain nn.Module step)",
}


# -- the problem ------------------------------------------------------------------------------


def _model(D: int, L: int, device: str = "cpu") -> torch.nn.Sequential:
    layers = []
    for _ in range(L):
        layers += [torch.nn.Linear(D, D, device=device), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _base(cfg: dict) -> torch.nn.Sequential:
    """The initial model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    return _model(cfg["D"], cfg["L"]).requires_grad_(False)


def _data(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's M microbatches (inputs, targets) of step ``step``."""
    gen = torch.Generator().manual_seed(10_000 * step + C.rank())
    shape = (cfg["M"], cfg["B"], cfg["D"])
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _layer(p: dict, x: torch.Tensor) -> torch.Tensor:
    """One unit: Linear + Tanh, on the unit's full weights."""
    return torch.tanh(F.linear(x, p["weight"], p["bias"]))


def _units(base: torch.nn.Sequential) -> list[dict]:
    """The full weights as one unit per Linear (copies)."""
    return [
        {k: v.detach().clone() for k, v in m.named_parameters()}
        for m in base
        if isinstance(m, torch.nn.Linear)
    ]


# -- the variants (each: step(xs, ys) -> mean microbatch loss of this rank) -------------------


class _FSDP2:
    def __init__(self, cfg, base, dm):
        from torch.distributed.fsdp import fully_shard

        self.M = cfg["M"]
        model = copy.deepcopy(base).requires_grad_(True)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=dm, reshard_after_forward=True)
        fully_shard(model, mesh=dm, reshard_after_forward=True)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, xs, ys) -> float:
        total = 0.0
        for m in range(self.M):
            self.model.set_requires_all_reduce(m == self.M - 1)
            loss = F.mse_loss(self.model(xs[m]), ys[m]) / self.M
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


class _LayerWise:
    """``mode``: "sink" (gathered into=MainGrad), "maingrad" (MainGrad.accumulate at the
    gradient placement) or "pure" (reduce_grads at the gradient placement, new trees)."""

    def __init__(self, cfg, base, dm, mode, raf=True, overlap=True, declare=True):
        import functional_hsdp as fh

        self.fh, self.mode, self.M = fh, mode, cfg["M"]
        spec = fh.hsdp(fh.DistMesh(dm, overlap=overlap), *C.AXES)
        full = _units(base)
        self.tree_spec = [spec] * len(full)
        self.params = fh.shard(full, self.tree_spec)
        self.mg = fh.MainGrad(self.tree_spec, like=full) if mode != "pure" else None
        # sink: the MainGrad learns which microbatch is last (deferred reductions in backward)
        self.declared = self.mg if mode == "sink" and declare else None
        del full
        into = self.mg if mode == "sink" else None
        block = fh.gathered(_layer, spec, reshard_after_forward=raf, into=into)
        M = self.M

        def loss_fn(units, x, y):
            if overlap:
                h = fh.sequence(block, units, x)
            else:  # no prefetch
                h = x
                for u in units:
                    h = block(u, h)
            return F.mse_loss(h, y) / M

        self.grad = torch.func.grad_and_value(loss_fn)

    def step(self, xs, ys) -> float:
        fh, mg, total, acc = self.fh, self.mg, 0.0, None
        for m, last in fh.microbatches(self.M, into=self.declared):
            g, loss = self.grad(self.params, xs[m], ys[m])
            total += float(loss)
            if self.mode == "maingrad":
                mg.accumulate(g, last=last, at="gradient")
            elif self.mode == "pure":
                acc = fh.reduce_grads(g, self.tree_spec, last=last, acc=acc, at="gradient")
            del g  # sink: zeros (expanded scalars)
        if self.mode == "pure":
            self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, acc)
            return total
        if self.mode == "sink":
            mg.finish()
        with torch.no_grad():  # in place, as torch.optim's SGD
            for p, g in zip(optree.tree_leaves(self.params), optree.tree_leaves(mg.grads)):
                p.add_(g, alpha=-LR)
        mg.zero_grad()
        return total


class _WholeTree:
    def __init__(self, cfg, base, dm):
        import functional_hsdp as fh

        self.fh, self.M = fh, cfg["M"]
        self.spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.params = fh.shard(
            {k: v.detach().clone() for k, v in base.named_parameters()}, self.spec
        )
        shell = _model(cfg["D"], cfg["L"], device="meta")  # structure only, no storage
        M = self.M

        def loss_fn(p, x, y):
            return F.mse_loss(torch.func.functional_call(shell, p, (x,)), y) / M

        self.grad = torch.func.grad_and_value(loss_fn)

    def step(self, xs, ys) -> float:
        fh, total, acc = self.fh, 0.0, None
        full = fh.gather(self.params, self.spec)
        for m, last in fh.microbatches(self.M):
            g, loss = self.grad(full, xs[m], ys[m])
            total += float(loss)
            acc = fh.reduce_grads(g, self.spec, last=last, acc=acc)
            del g
        del full
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, acc)
        return total


class _DDP:
    def __init__(self, cfg, base, dm):
        from torch.nn.parallel import DistributedDataParallel

        self.M = cfg["M"]
        self.model = DistributedDataParallel(copy.deepcopy(base).requires_grad_(True))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, xs, ys) -> float:
        total = 0.0
        for m in range(self.M):
            last = m == self.M - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = F.mse_loss(self.model(xs[m]), ys[m]) / self.M
                loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


class _Compute:
    def __init__(self, cfg, base, dm):
        self.M = cfg["M"]
        self.model = copy.deepcopy(base).requires_grad_(True)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, xs, ys) -> float:
        total = 0.0
        for m in range(self.M):
            loss = F.mse_loss(self.model(xs[m]), ys[m]) / self.M
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def _build(name: str, cfg: dict, base, dm):
    if name == "fsdp2":
        return _FSDP2(cfg, base, dm)
    if name == "lw_sink":
        return _LayerWise(cfg, base, dm, "sink")
    if name == "lw_maingrad":
        return _LayerWise(cfg, base, dm, "maingrad")
    if name == "lw_pure":
        return _LayerWise(cfg, base, dm, "pure")
    if name == "lw_sink_raf0":
        return _LayerWise(cfg, base, dm, "sink", raf=False)
    if name == "lw_sink_sync":
        return _LayerWise(cfg, base, dm, "sink", overlap=False)
    if name == "lw_sink_undeclared":
        return _LayerWise(cfg, base, dm, "sink", declare=False)
    if name == "whole_tree":
        return _WholeTree(cfg, base, dm)
    if name == "ddp_nosync":
        return _DDP(cfg, base, dm)
    if name == "compute":
        return _Compute(cfg, base, dm)
    raise ValueError(name)


# -- memory probes ----------------------------------------------------------------------------


def _where(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame in this file, and the innermost frame."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename == __file__]
    out = [f"{f.name}: `{f.line}`" for f in ours[-1:]]
    if frames and (not ours or frames[-1] is not ours[-1]):
        last = frames[-1]
        out.append(f"{last.filename.rsplit('/', 2)[-2:][-1]}:{last.name}")
    return " -> ".join(out)


# -- tasks (on every rank) ----------------------------------------------------------------------


def time_task(cfg: dict, variants=VARIANTS, build=None) -> dict:
    """All variants in this group, steps interleaved; glibc's default malloc. ``build``:
    what makes a variant's runner (default :func:`_build`)."""
    dm = C.device_mesh((2, 2))
    base = _base(cfg)
    runners = {v: (build or _build)(v, cfg, base, dm) for v in variants}
    del base
    gc.collect()
    losses = {v: [] for v in variants}
    step = [0]
    data = [_data(cfg, 0)]

    def op(v):
        return lambda: losses[v].append(runners[v].step(*data[0]))

    def advance():  # after the last variant of a repetition: the next step's data
        step[0] += 1
        data[0] = _data(cfg, step[0])

    times = C.interleaved(
        {v: op(v) for v in variants}, cfg["warmup"], cfg["reps"], after={variants[-1]: advance}
    )
    return {"times": times, "losses": losses}


def mem_task(cfg: dict, variant: str) -> dict:
    """One variant: idle RSS, build, one warm-up step, one measured step (its VmHWM)."""
    C.set_malloc()
    with C.frozen():
        dm = C.device_mesh((2, 2))
        C.warm_group(dm)
        idle = C.settle()
        base = _base(cfg)
        runner = _build(variant, cfg, base, dm)
        del base
        built = C.settle() - idle
        losses = [runner.step(*_data(cfg, 0))]
        data = _data(cfg, 1)
        C.barrier()
        before = C.settle() - idle
        reset = C.reset_peak()
        losses.append(runner.step(*data))
        peak = C.status("VmHWM") - idle
        after = C.settle() - idle
        C.barrier()
        return {
            "idle": idle,
            "built": built,
            "before": before,
            "peak": peak,
            "after": after,
            "losses": losses,
            "reset_ok": reset,
        }


def cap_task(cfg: dict, variant: str) -> dict:
    """One variant: build and warm up uncapped, then one step with the address space limited
    so that this rank has ``cap`` bytes above its idle RSS: the limit is the current virtual
    size plus the cap minus what the rank already holds above idle."""
    C.set_malloc()
    with C.frozen():
        cap = int(cfg["cap_mib"] * 2**20)
        dm = C.device_mesh((2, 2))
        C.warm_group(dm)
        idle = C.settle()
        base = _base(cfg)
        runner = _build(variant, cfg, base, dm)
        del base
        runner.step(*_data(cfg, 0))  # warm-up: plans, caches, threads, arenas, all uncapped
        data = _data(cfg, 1)
        C.barrier()
        held = C.settle() - idle
        vm = C.status("VmSize")
        limit = vm + cap - held
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        outcome, error, loss = "trains", "", None
        C.reset_peak()
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            loss = runner.step(*data)
        except (MemoryError, RuntimeError) as exc:
            outcome, error = "fails", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            error += f" (in {_where(exc)})"
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        peak = C.status("VmHWM") - idle
        del runner, data
        C.settle()
        return {
            "outcome": outcome,
            "error": error,
            "loss": loss,
            "held": held,
            "peak": peak,
            "vm_before": vm,
            "limit": limit,
            "cap": cap,
        }


# -- driver -----------------------------------------------------------------------------------


def run(size: str = "full", pool=None) -> dict:
    cfg = SIZES[size]
    own = None
    if pool is None and not cfg["fresh"]:  # tiny from the command line: one pool for all
        pool = own = C.new_pool()
    load = {}
    try:
        load["time"] = [C.loadavg()]
        per_rank, res = C.run_task(time_task, SIZES, size, pool)
        # memory and cap last: they switch a shared pool's malloc to mmap-everything
        load["time"].append(load.setdefault("memory", [C.loadavg()])[0])
        mem = {v: C.on_ranks(pool, mem_task, cfg, v) for v in VARIANTS}
        load["memory"].append(load.setdefault("cap", [C.loadavg()])[0])
        cap = {v: C.on_ranks(pool, cap_task, cfg, v) for v in CAPPED}
        load["cap"].append(C.loadavg())
    finally:
        if own is not None:
            own.close()
    variants = list(per_rank[0]["times"])
    res["variants"] = variants
    res["load"] = load
    res["numel"] = cfg["L"] * (cfg["D"] ** 2 + cfg["D"])
    res["fresh"] = pool is None
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    # a step's loss: mean over ranks of each rank's mean microbatch loss
    res["losses"] = C.mean_losses(per_rank, keys=variants)
    ref = res["losses"]["fsdp2"]
    res["loss_maxrel"] = {
        v: max(
            abs(a - b) / max(abs(b), 1e-12)
            for a, b in list(zip(res["losses"][v], ref))[: 1 if v in REFERENCE else None]
        )
        for v in variants
    }
    res["mem"] = {
        v: {
            key: max(r[key] for r in rs)
            for key in ("built", "before", "peak", "after")
            if key in rs[0]
        }
        | {
            "losses": [sum(col) / len(col) for col in zip(*(r["losses"] for r in rs))],
            "reset_ok": all(r["reset_ok"] for r in rs),
        }
        for v, rs in mem.items()
    }
    res["cap"] = {
        v: {
            "outcomes": [r["outcome"] for r in rs],
            "errors": sorted({r["error"] for r in rs if r["error"]}),
            "peak": max(r["peak"] for r in rs),
            "held": max(r["held"] for r in rs),
            "loss": (
                sum(r["loss"] for r in rs) / len(rs)
                if all(r["loss"] is not None for r in rs)
                else None
            ),
            "cap": rs[0]["cap"],
        }
        for v, rs in cap.items()
    }
    med, peak = res["median"], {v: res["mem"][v]["peak"] for v in VARIANTS}
    res["ratio"] = {
        v: {
            "mem_fsdp2": peak[v] / peak["fsdp2"],
            "time_fsdp2": med[v] / med["fsdp2"],
            "time_whole": med[v] / med["whole_tree"],
        }
        for v in variants
    }
    r = res["ratio"]
    res["goals"] = {
        "lw_sink memory <= 1.1x fsdp2": (r["lw_sink"]["mem_fsdp2"], 1.1),
        "lw_pure memory <= 1.6x fsdp2": (r["lw_pure"]["mem_fsdp2"], 1.6),
        "lw_sink step time <= 0.8x fsdp2": (r["lw_sink"]["time_fsdp2"], 0.8),
        "lw_sink step time <= 1.2x whole_tree": (r["lw_sink"]["time_whole"], 1.2),
    }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, vs = res["cfg"], res["variants"]
    model_bytes = res["numel"] * 4
    head = C.section_header(
        "(B9) Layer-wise HSDP (fh.gathered) versus FSDP2: memory and step time "
        "(4 gloo processes, 2x2 mesh)",
        command,
        when,
    )
    desc = (
        f"Model: {cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), {res['numel']:,} "
        f"parameters ({C.mib(model_bytes)} MiB fp32; an HSDP shard per rank is half of it); "
        f"M = {cfg['M']} microbatches of {cfg['B']} x {cfg['D']} per rank; MSE loss / M in "
        f"every variant; SGD lr {LR}. Same initial parameters on every rank and in every "
        "variant, same data in every variant. A step = forward + backward + gradient sync + "
        "SGD. Variants: `fsdp2` = `fully_shard` per Linear + root on the 2x2 DeviceMesh "
        "(HSDP), `reshard_after_forward=True`, `set_requires_all_reduce(last)`, "
        "`torch.optim.SGD`, `zero_grad(set_to_none=True)`; `lw_*` = one `fh.gathered` unit per "
        "Linear (`fh.sequence`, i.e. prefetch, unless noted); `whole_tree` = `fh.gather` + "
        "`grad` of the whole model + `reduce_grads` (the README quickstart); `ddp_nosync` = "
        "torch DDP with `no_sync()` on all but the last microbatch; `compute` = the same "
        "step as a plain `nn.Module` with no communication, run on every rank at once "
        "(bench/units/layerwise.py has the exact loops).\n\n"
        "**Memory** (*peak above idle*): each variant in "
        + (
            "a fresh group of 4 ranks (one-shot launch)"
            if res["fresh"]
            else "the shared pool of 4 ranks (not fresh: smoke test)"
        )
        + ", glibc told to mmap every allocation >= 64 KiB (`mallopt`, as "
        "`MALLOC_MMAP_THRESHOLD_=65536`), so freed tensors leave the RSS. *Idle* = the "
        "rank's RSS (`VmRSS`) after the process group and mesh are up and warmed, before the "
        "variant is built. Then build, one warm-up step, `gc.collect()` + `malloc_trim`, "
        "`echo 5 > /proc/self/clear_refs` (resets `VmHWM` to the current RSS), one measured "
        "step; *peak above idle* = `VmHWM` - idle, the maximum over the 4 ranks. It includes "
        "everything the variant holds (parameter shards or replicas, MainGrad buffers, DDP's "
        "buckets) plus the step's transients; *held before step* = RSS - idle just before the "
        "measured step; *step transient* = peak - held (max over ranks of each).\n\n"
        "**Time**: all variants built in one group of 4 ranks (glibc's default malloc), "
        + C.timing_note(cfg, "the variants")
        + " Ratios are of medians.\n\n"
        + "1-minute load average at the start / end of each phase (4 busy ranks make about 4; "
        "more is other work on this 2-core machine): "
        + ", ".join(f"{k} {a:.2f} / {b:.2f}" for k, (a, b) in res["load"].items())
        + ".\n"
    )
    med, mem, ratio = res["median"], res["mem"], res["ratio"]
    rows = []
    for v in vs:
        rows.append(
            [
                f"`{v}`",
                _LABEL[v],
                C.mib(mem[v]["peak"]),
                C.mib(mem[v]["before"]),
                C.mib(mem[v]["peak"] - mem[v]["before"]),
                f"{ratio[v]['mem_fsdp2']:.2f}",
                f"{med[v]:.3f}",
                f"{ratio[v]['time_fsdp2']:.2f}",
                f"{ratio[v]['time_whole']:.2f}",
            ]
        )
    t1 = C.table(
        [
            "variant",
            "what",
            "peak above idle (MiB)",
            "held before step (MiB)",
            "step transient (MiB)",
            "peak / fsdp2",
            "median step (s)",
            "time / fsdp2",
            "time / whole_tree",
        ],
        rows,
    )
    n = len(res["losses"][vs[0]])
    loss_rows = [
        [f"`{v}`"]
        + [f"{x:.7f}" for x in res["losses"][v]]
        + [
            f"{res['loss_maxrel'][v]:.1e}"
            + (" (first step only: own replicas)" if v in REFERENCE else "")
        ]
        for v in vs
    ]
    t2 = C.table(
        ["variant"] + [f"step {i}" for i in range(n)] + ["max rel. diff vs fsdp2"], loss_rows
    )
    mem_loss = ", ".join(
        f"`{v}` " + " / ".join(f"{x:.7f}" for x in mem[v]["losses"]) for v in vs if v in mem
    )
    ok = all(x < 1e-4 for x in res["loss_maxrel"].values())
    goals = []
    for name, (got, bound) in res["goals"].items():
        goals.append(f"- {name}: {got:.2f} — **{'met' if got <= bound else 'not met'}**.")
    gain = med["lw_sink_sync"] - med["lw_sink"]
    goals.append(
        f"- Overlap (prefetch + asynchronous collectives): `lw_sink` {med['lw_sink']:.3f} s vs "
        f"`lw_sink_sync` {med['lw_sink_sync']:.3f} s: {gain:+.3f} s per step "
        f"({gain / med['lw_sink_sync']:+.0%} of the no-overlap step; "
        f"sync / overlap = {med['lw_sink_sync'] / med['lw_sink']:.2f})."
    )
    goals.append(
        f"- Losses agree (every data-parallel variant within 1e-4 of fsdp2, `compute` on its "
        f"first step): **{'yes' if ok else 'no'}**."
    )
    cap = res["cap"]
    cap_mib = cfg["cap_mib"]
    cap_rows = [
        [
            f"`{v}`",
            ", ".join(cap[v]["outcomes"]),
            C.mib(cap[v]["held"]),
            C.mib(cap[v]["peak"]),
            f"{cap[v]['loss']:.7f}" if cap[v]["loss"] is not None else "-",
            "; ".join(cap[v]["errors"]) or "-",
        ]
        for v in CAPPED
    ]
    t3 = C.table(
        [
            "variant",
            "outcome per rank",
            "held before step (MiB)",
            "peak above idle in the capped step (MiB)",
            "loss",
            "error",
        ],
        cap_rows,
    )
    cap_text = (
        f"\n### Memory cap: {cap_mib} MiB above idle per rank "
        f"({cap_mib * 2**20 / model_bytes:.2f}x the fp32 model)\n\n"
        "Each variant in "
        + ("a fresh group" if res["fresh"] else "the shared pool")
        + ": idle RSS, build, one warm-up step uncapped, then one step under "
        "`resource.setrlimit(RLIMIT_AS, (VmSize + cap - held, hard))`, where *held* = RSS - "
        "idle before the step, restored after it; a `MemoryError`/`RuntimeError` on a rank is "
        "caught and reported as *fails*. Why not an absolute `RLIMIT_AS`: a torch + gloo "
        "process has gigabytes of virtual address space it never touches (libraries, thread "
        "stacks, glibc arenas), which differs from process to process, so a limit on it says "
        "nothing about memory; with every allocation >= 64 KiB an mmap of its own, the "
        "address space a step *adds* is what it allocates, so the limit above is a budget of "
        "`cap` bytes above idle, the variant's own state included. (An RSS watchdog could "
        "only observe, not make an allocation fail.) The cap lies between the two variants' "
        f"uncapped peaks above idle measured above (`lw_sink` {C.mib(mem['lw_sink']['peak'])} "
        f"MiB, `whole_tree` {C.mib(mem['whole_tree']['peak'])} MiB; `fsdp2` "
        f"{C.mib(mem['fsdp2']['peak'])} MiB), high enough that `whole_tree`'s all-gather of "
        "the full weights still fits, so that it fails in local compute (the same place on "
        "every rank) rather than between collectives.\n"
    )
    return "\n".join(
        [
            head,
            desc,
            t1,
            "\nLosses of the timed run (mean over ranks of each rank's mean microbatch loss, "
            "per step):\n",
            t2,
            f"\nMemory runs' losses (warm-up / measured step): {mem_loss}.\n",
            *goals,
            cap_text,
            t3,
            "",
        ]
    )
