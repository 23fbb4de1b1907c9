"""(B1) An HSDP training step: functional_hsdp (torch.func + MainGrad) versus FSDP2.

4 gloo processes, 2x2 mesh (dp_outer, dp_inner), M microbatches, an MLP of L x
Linear(D, D) + Tanh. The same initial weights and the same data for every variant; each step
is forward, backward, gradient sync and SGD. Variants, run interleaved step by step:

- ``fh``: ``full = fh.gather(params, spec)`` once per step, then per microbatch
  ``grad_and_value(functional_call)`` and ``mg.accumulate(g, last=last)``; SGD on the local
  shards with ``mg.grads``; ``mg.zero_grad()``.
- ``fsdp2``: ``fully_shard`` on each layer then the root, on the 2-D mesh (HSDP: replicate
  over dp_outer, shard over dp_inner), default ``reshard_after_forward=True`` (re-gathers in
  backward), ``set_requires_all_reduce(last)`` per microbatch, ``torch.optim.SGD``.
- ``fsdp2_raf0``: the same with ``reshard_after_forward=False``.
- ``fsdp2_once`` (extra, for reference): ``reshard_after_forward=False`` and
  ``set_reshard_after_backward(last)``: parameters are gathered once per step, as ``fh`` does.

Reported: losses of every variant (they must match), median step time over the timed steps
(a step's time is its slowest rank's), ratios fh / FSDP2, collectives per step (torch.profiler
c10d / gloo events, and comm_log for fh), per-step peak memory.
"""

from __future__ import annotations

import copy
from collections import Counter
from functools import partial

import optree
import torch

from .. import common as C

SIZES = {
    "tiny": {"D": 32, "L": 8, "B": 4, "M": 2, "warmup": 1, "steps": 1},
    "full": {"D": 1024, "L": 8, "B": 32, "M": 4, "warmup": 2, "steps": 7},
}
VARIANTS = ("fh", "fsdp2", "fsdp2_raf0", "fsdp2_once", "local")
REFERENCE = ("local",)  # not data parallel: its losses differ by design
LR = 0.05


def _model(D: int, L: int) -> torch.nn.Module:
    layers = []
    for _ in range(L):
        layers += [torch.nn.Linear(D, D), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _count_profiled(prof) -> dict[str, int]:
    names = Counter()
    for e in prof.events():
        n = e.name
        if n.startswith(("c10d::", "_c10d_functional::", "gloo:")):
            names[n] += 1
    return dict(names)


class _FH:
    def __init__(self, base, state, dm, M):
        from torch.func import functional_call, grad_and_value

        import functional_hsdp as fh

        self.fh, self.M = fh, M
        self.mesh = fh.DistMesh(dm)
        self.spec = fh.hsdp(self.mesh, *C.AXES)
        self.model = base
        full = {k: v.clone() for k, v in state.items()}
        self.params = fh.shard(full, self.spec)
        self.mg = fh.MainGrad(self.spec, like=full)

        def loss_fn(p, x, y):
            out = functional_call(self.model, p, (x,))
            loss = torch.nn.functional.mse_loss(out, y)
            return loss / M, loss.detach()

        self.grad = grad_and_value(loss_fn, has_aux=True)

    def step(self, xs, ys) -> float:
        fh, mg = self.fh, self.mg
        full = fh.gather(self.params, self.spec)
        total = 0.0
        for m, last in fh.microbatches(self.M):
            g, (_, loss) = self.grad(full, xs[m], ys[m])
            mg.accumulate(g, last=last)
            total += float(loss)
        del full, g
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, mg.grads)
        mg.zero_grad()
        return total / self.M

    def persistent(self) -> int:
        ts = optree.tree_leaves(self.params) + self.mg.buffers
        return sum(t.numel() * t.element_size() for t in ts)


class _Local:
    """Reference floor: the same forward/backward/SGD on this rank's data, no communication
    (each rank trains its own replica, so its losses differ from the others')."""

    def __init__(self, base, state, M):
        from torch.func import functional_call, grad_and_value

        self.M = M
        self.model = base
        self.params = {k: v.clone() for k, v in state.items()}

        def loss_fn(p, x, y):
            loss = torch.nn.functional.mse_loss(functional_call(self.model, p, (x,)), y)
            return loss / M, loss.detach()

        self.grad = grad_and_value(loss_fn, has_aux=True)

    def step(self, xs, ys) -> float:
        acc, total = None, 0.0
        for m in range(self.M):
            g, (_, loss) = self.grad(self.params, xs[m], ys[m])
            acc = g if acc is None else optree.tree_map(torch.add, acc, g)
            total += float(loss)
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, acc)
        return total / self.M

    def persistent(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())


class _FSDP2:
    def __init__(self, base, state, dm, M, mode):
        from torch.distributed.fsdp import fully_shard

        self.M, self.mode = M, mode
        model = copy.deepcopy(base)
        model.load_state_dict(state)
        raf = mode == "fsdp2"
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=dm, reshard_after_forward=raf)
        fully_shard(model, mesh=dm, reshard_after_forward=raf)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, xs, ys) -> float:
        model, total = self.model, 0.0
        for m in range(self.M):
            last = m == self.M - 1
            model.set_requires_all_reduce(last)
            if self.mode == "fsdp2_once":
                model.set_reshard_after_backward(last)
            loss = torch.nn.functional.mse_loss(model(xs[m]), ys[m])
            (loss / self.M).backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad()
        return total / self.M

    def persistent(self) -> int:
        n = 0
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            n += local.numel() * local.element_size()
        return n


def task(cfg: dict, variants=VARIANTS) -> dict:
    """On every rank: build all variants, run them interleaved, profile one step each."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    rank, world = dist.get_rank(), dist.get_world_size()
    D, L, B, M = cfg["D"], cfg["L"], cfg["B"], cfg["M"]
    n_steps = cfg["warmup"] + cfg["steps"] + 1  # + 1 profiled step
    torch.manual_seed(0)
    base = _model(D, L)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    gen = torch.Generator().manual_seed(1234)
    X = torch.randn(n_steps, world, M, B, D, generator=gen)
    W = torch.randn(D, D, generator=gen) / D**0.5
    Y = torch.sin(X @ W)
    runners = {}
    for v in variants:
        if v == "fh":
            runners[v] = _FH(base, state, dm, M)
        elif v == "local":
            runners[v] = _Local(base, state, M)
        else:
            runners[v] = _FSDP2(base, state, dm, M, v)

    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    for s in range(cfg["warmup"] + cfg["steps"]):
        for v in variants:
            dt, loss = C.timed(partial(runners[v].step, X[s, rank], Y[s, rank]))
            losses[v].append(loss)
            if s >= cfg["warmup"]:
                times[v].append(dt)
    # One more step of each, untimed: peak memory (glibc set to mmap allocations >= 64 KiB,
    # which would have changed the timings above), profiler events and comm_log.
    C.set_malloc()
    counts, logs, peaks = {}, {}, {}
    s = n_steps - 1
    for v in variants:
        C.barrier()
        with (
            C.Peak() as pk,
            profile(activities=[ProfilerActivity.CPU]) as prof,
            fh.comm_log() as log,
        ):
            losses[v].append(runners[v].step(X[s, rank], Y[s, rank]))
        peaks[v] = [pk.extra]
        counts[v] = _count_profiled(prof)
        logs[v] = {f"{a}/{op}": c for (a, op), (c, _) in log.summary().items()}
    return {
        "times": times,
        "losses": losses,
        "peaks": peaks,
        "persistent": {v: runners[v].persistent() for v in variants},
        "counts": counts,
        "comm_log": logs["fh"] if "fh" in logs else {},
        "numel": sum(p.numel() for p in base.parameters()),
    }


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    variants = list(per_rank[0]["times"])
    res.update(variants=variants, numel=per_rank[0]["numel"])
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    # the global loss of a step: mean over ranks of each rank's mean microbatch loss
    res["losses"] = C.mean_losses(per_rank, keys=variants)
    res["peak"] = {v: max(max(r["peaks"][v]) for r in per_rank) for v in variants}
    res["persistent"] = {v: max(r["persistent"][v] for r in per_rank) for v in variants}
    res["counts"] = per_rank[0]["counts"]
    res["comm_log"] = per_rank[0]["comm_log"]
    ref = res["losses"][variants[0]]
    res["loss_maxrel"] = {
        v: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(res["losses"][v], ref))
        for v in variants
    }
    if "fh" in variants:
        res["ratio"] = {v: res["median"]["fh"] / res["median"][v] for v in variants if v != "fh"}
    return res


_LABEL = {
    "fh": "functional_hsdp (torch.func + MainGrad)",
    "fsdp2": "FSDP2 default (reshard_after_forward=True)",
    "fsdp2_raf0": "FSDP2 reshard_after_forward=False",
    "fsdp2_once": "FSDP2 raf=False + set_reshard_after_backward(last) (extra)",
    "local": "reference: no communication (own replica per rank)",
}


def _short_counts(counts: dict[str, int]) -> str:
    keep = {k: v for k, v in counts.items() if not k.startswith("gloo:")}
    gloo = {k: v for k, v in counts.items() if k.startswith("gloo:")}
    a = ", ".join(f"{k} {v}" for k, v in sorted(keep.items()))
    b = ", ".join(f"{k} {v}" for k, v in sorted(gloo.items()))
    return f"{a}; {b}" if b else a


def report(res: dict, command: str, when: str) -> str:
    cfg, vs = res["cfg"], res["variants"]
    head = C.section_header(
        "(B1) HSDP training step versus FSDP2 (4 gloo processes, 2x2 mesh)", command, when
    )
    desc = (
        f"Model: {cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), {res['numel']:,} "
        f"parameters; M = {cfg['M']} microbatches of {cfg['B']} samples per rank; MSE loss; SGD "
        f"lr {LR}. Same initial weights and data for every variant; {cfg['warmup']} warm-up "
        f"steps, then {cfg['steps']} timed steps, the variants interleaved step by step (each "
        "step starts after a barrier; a step's time is its slowest rank's). Then one more "
        "step of each, untimed, under torch.profiler for the collective counts and with glibc "
        "set to mmap allocations >= 64 KiB (so freed memory leaves the RSS) for its peak "
        "memory: high-water mark of RSS minus RSS before the step (max over ranks); "
        "persistent: bytes of the state kept between steps (local parameter shards; for fh "
        "also MainGrad's buffers). The *reference* row is the floor without any communication: "
        "each rank runs the same forward, backward and SGD (torch.func) on its own replica.\n"
    )
    rows = []
    floor = res["median"].get("local")
    for v in vs:
        t = res["median"][v]
        rows.append(
            [
                _LABEL[v],
                f"{t:.3f}",
                " ".join(f"{x:.3f}" for x in res["times"][v]),
                f"{res['ratio'][v]:.2f}" if v in res.get("ratio", {}) else "-",
                f"{t - floor:.3f}" if floor is not None else "-",
                C.mib(res["peak"][v]),
                C.mib(res["persistent"][v]),
                C.mib(res["peak"][v] + res["persistent"][v]),
            ]
        )
    t1 = C.table(
        [
            "variant",
            "median step (s)",
            "timed steps (s)",
            "fh time / this time",
            "beyond the no-communication floor (s)",
            "step peak extra (MiB)",
            "persistent (MiB)",
            "sum (MiB)",
        ],
        rows,
    )
    loss_rows = [
        [_LABEL[v]]
        + [f"{x:.6f}" for x in res["losses"][v]]
        + ["- (not data parallel)" if v in REFERENCE else f"{res['loss_maxrel'][v]:.1e}"]
        for v in vs
    ]
    n = len(res["losses"][vs[0]])
    t2 = C.table(["variant"] + [f"step {i}" for i in range(n)] + ["max rel. diff vs fh"], loss_rows)
    count_rows = [[_LABEL[v], _short_counts(res["counts"][v])] for v in vs]
    t3 = C.table(["variant", "profiler events in one step (per rank)"], count_rows)
    log = ", ".join(f"{k} {v}" for k, v in sorted(res["comm_log"].items()))
    verdict = []
    for v in ("fsdp2", "fsdp2_raf0"):
        if v in res.get("ratio", {}):
            r = res["ratio"][v]
            verdict.append(
                f"- Goal fh / {v} <= 0.8: {r:.2f} — **{'met' if r <= 0.8 else 'not met'}**."
            )
    ok = all(x < 1e-4 for v, x in res["loss_maxrel"].items() if v not in REFERENCE)
    verdict.append(f"- Losses match (max relative difference < 1e-4): **{'yes' if ok else 'no'}**.")
    return "\n".join(
        [
            head,
            desc,
            t1,
            "\nLosses (mean over ranks of each rank's mean microbatch loss; the "
            "last column is the profiled step):\n",
            t2,
            "\nCollectives per step (torch.profiler, rank 0):\n",
            t3,
            f"\nfh's comm_log for the same step: {log}.\n",
            *verdict,
            "",
        ]
    )
