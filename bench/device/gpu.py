"""(B11) One device: every library path at world size 1, against plain ``torch.func`` and FSDP2.

The check to run on one GPU (``python -m bench gpu``; on a machine without CUDA it runs on the
CPU and says so). One process, a one-rank process group made here (NCCL on CUDA, gloo on the
CPU) and ``init_device_mesh(device, (1, 1), mesh_dim_names=("dp_outer", "dp_inner"))``: every
library path runs on the device's tensors, on ``DistMesh(dm, issue_size_one=True)``, so that
every collective a 2-D mesh would issue is issued on the size-1 axes too (one rank's NCCL
collectives: the streams, waits and buffer lifetimes of the real path; a one-rank mesh
exchanges no agreement rows). The *collectives* phase counts them, per variant and step.
An MLP of L x (Linear(D, D) + Tanh), fp32, MSE loss / M, SGD; the same initial weights and
data for every variant. Variants, each a whole step (M microbatches of forward + backward,
gradient sync, SGD):

- ``plain``: ``torch.func`` training with no library: ``grad_and_value(functional_call)`` per
  microbatch, gradients summed with ``tree_map``, SGD into new trees. The dense reference.
- ``fsdp2``: ``fully_shard`` per Linear and the root on the (1, 1) mesh (HSDP),
  ``torch.optim.SGD``, ``zero_grad(set_to_none=True)``.
- ``whole_tree``: the README quickstart: ``fh.gather``, ``grad`` of the whole model,
  ``fh.reduce_grads(g, spec, last=last, acc=acc)``, SGD into new trees.
- ``maingrad``: the same with ``mg.accumulate(g, last=last)`` and SGD on ``mg.grads``.
- ``lw_sink``: one ``fh.gathered(layer, spec, into=mg)`` unit per Linear, ``fh.sequence``,
  ``fh.microbatches(M, into=mg)``, ``mg.finish()``, in-place SGD on the shards.
- ``lw_pure``: the same units without ``into``; ``fh.reduce_grads(g, tree_spec, last=last,
  acc=acc, at="gradient")``, SGD into new trees.

Phases: *correctness* (each library variant and FSDP2 two steps from the same weights, with 1
and with M microbatches, its full weights compared with ``plain``'s); *time* (all variants
built, steps interleaved; step time from CUDA events, or ``perf_counter`` on the CPU, and the
host's enqueue time: until the step's Python returns, before any synchronization; no step
reads device data on the host); *syncs* (one step of each under
``torch.cuda.set_sync_debug_mode("warn")``, its warnings counted); *memory* (each variant
alone: ``torch.cuda.max_memory_allocated`` of one step, reset before it, minus the allocated
memory before the variant was built). Syncs and memory are CUDA only.

Then the same four phases for the path users run with a model they did not write: a Hugging
Face ``LlamaForCausalLM`` through ``fh.shard_module`` + ``fh.functional_call(..., into=mg)``
(with and without ``recompute``) against FSDP2 ``fully_shard`` per decoder layer and the model
alone, all with bf16 mixed precision (:mod:`bench.device.gpu_hf`; its correctness reference is
FSDP2-bf16). Skipped, with a note, where ``transformers`` cannot be imported.

Then Muon (:mod:`bench.device.gpu_muon`): ``fh.muon`` on the owner placements against
``torch.optim.Muon`` + ``torch.optim.AdamW`` (correctness, Newton-Schulz in fp32 on both
sides), its step beside ``fh.adamw``'s (time, syncs, memory as above), and Newton-Schulz's time
per step (CUDA events around every call).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import shutil
import tempfile
import time
import warnings
from collections import Counter

import optree
import torch
import torch.nn.functional as F

from .. import common as C
from . import gpu_hf, gpu_muon

# Per device: CUDA sizes a model worth timing on an H200 (8 x 4096^2 fp32: 537 MB of weights);
# the CPU's fit a 2-core machine in a couple of minutes.
SIZES = {
    "tiny": {
        "cuda": {"D": 64, "L": 3, "B": 8, "M": 2, "warmup": 1, "reps": 2},
        "cpu": {"D": 64, "L": 3, "B": 8, "M": 2, "warmup": 1, "reps": 2},
    },
    "full": {
        "cuda": {"D": 4096, "L": 8, "B": 2048, "M": 4, "warmup": 3, "reps": 15},
        "cpu": {"D": 1024, "L": 8, "B": 128, "M": 4, "warmup": 2, "reps": 11},
    },
}
VARIANTS = ("plain", "fsdp2", "whole_tree", "maingrad", "lw_sink", "lw_pure")
LIBRARY = ("whole_tree", "maingrad", "lw_sink", "lw_pure")
LR = 0.05
CORRECT_STEPS = 2
TOLERANCE = 1e-4  # relative, fp32: the same math in other summation orders
DATASETS = 3  # distinct steps' data, cycled (all variants see the same sequence)
PROCESSES = 1

_LABEL = {
    "plain": "torch.func, no library (dense reference)",
    "fsdp2": "FSDP2 fully_shard (per Linear + root)",
    "whole_tree": "fh whole tree: gather + grad + reduce_grads",
    "maingrad": "fh whole tree: gather + grad + MainGrad.accumulate",
    "lw_sink": "fh layer-wise: gathered(into=MainGrad), microbatches(into=mg)",
    "lw_pure": "fh layer-wise pure: reduce_grads(at='gradient')",
}


# -- the problem ------------------------------------------------------------------------------


def _model(D: int, L: int, device) -> torch.nn.Sequential:
    layers = []
    for _ in range(L):
        layers += [torch.nn.Linear(D, D, device=device), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _layer(p: dict, x: torch.Tensor) -> torch.Tensor:
    """One unit: Linear + Tanh, on the unit's full weights."""
    return torch.tanh(F.linear(x, p["weight"], p["bias"]))


def _as_units(flat: dict) -> list[dict]:
    """``{"0.weight": ..., "0.bias": ..., "2.weight": ...}`` as one dict per Linear."""
    units: dict[str, dict] = {}
    for k, v in flat.items():
        i, name = k.split(".")
        units.setdefault(i, {})[name] = v
    return [units[i] for i in sorted(units, key=int)]


class _Problem:
    """The initial weights (seeded, on the device), a meta shell of the model for
    ``functional_call``, and the data: DATASETS steps of M microbatches."""

    def __init__(self, cfg: dict, device: torch.device, M: int):
        self.cfg, self.device, self.M = cfg, device, M
        D, L, B = cfg["D"], cfg["L"], cfg["B"]
        torch.manual_seed(0)
        self.base = _model(D, L, device).requires_grad_(False)
        self.shell = _model(D, L, "meta")
        gen = torch.Generator(device=device).manual_seed(1234)
        w = torch.randn(D, D, generator=gen, device=device) / D**0.5
        self.xs = torch.randn(DATASETS, M, B, D, generator=gen, device=device)
        self.ys = torch.sin(self.xs @ w)

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.base.named_parameters()}

    def data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.xs[step % DATASETS], self.ys[step % DATASETS]


# -- the variants (each: step(xs, ys) -> the step's loss as a device tensor; full()) ----------


class _Plain:
    def __init__(self, pb: _Problem, dm):
        from torch.func import functional_call, grad_and_value

        self.M, self.params = pb.M, pb.full()
        M, shell = pb.M, pb.shell
        self.grad = grad_and_value(
            lambda p, x, y: F.mse_loss(functional_call(shell, p, (x,)), y) / M
        )

    def step(self, xs, ys):
        acc, total = None, 0.0
        for m in range(self.M):
            g, loss = self.grad(self.params, xs[m], ys[m])
            acc = g if acc is None else optree.tree_map(torch.add, acc, g)
            total = total + loss.detach()
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, acc)
        return total

    def full(self) -> list[dict]:
        return _as_units(self.params)


class _FSDP2:
    def __init__(self, pb: _Problem, dm):
        from torch.distributed.fsdp import fully_shard

        self.M = pb.M
        model = copy.deepcopy(pb.base).requires_grad_(True)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=dm)
        fully_shard(model, mesh=dm)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, xs, ys):
        total = 0.0
        for m in range(self.M):
            self.model.set_requires_all_reduce(m == self.M - 1)
            loss = F.mse_loss(self.model(xs[m]), ys[m]) / self.M
            loss.backward()
            total = total + loss.detach()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def full(self) -> list[dict]:
        return _as_units({k: v.full_tensor().detach() for k, v in self.model.named_parameters()})


class _WholeTree:
    """``maingrad``: MainGrad.accumulate instead of reduce_grads."""

    def __init__(self, pb: _Problem, dm, maingrad: bool = False):
        from torch.func import functional_call, grad_and_value

        import functional_hsdp as fh

        self.fh, self.M = fh, pb.M
        self.spec = fh.hsdp(fh.DistMesh(dm, issue_size_one=True), *C.AXES)
        full = pb.full()
        self.params = fh.shard(full, self.spec)
        self.mg = fh.MainGrad(self.spec, like=full) if maingrad else None
        M, shell = pb.M, pb.shell
        self.grad = grad_and_value(
            lambda p, x, y: F.mse_loss(functional_call(shell, p, (x,)), y) / M
        )

    def step(self, xs, ys):
        fh, mg, acc, total = self.fh, self.mg, None, 0.0
        full = fh.gather(self.params, self.spec)
        for m, last in fh.microbatches(self.M):
            g, loss = self.grad(full, xs[m], ys[m])
            if mg is not None:
                mg.accumulate(g, last=last)
            else:
                acc = fh.reduce_grads(g, self.spec, last=last, acc=acc)
            total = total + loss.detach()
        del full, g
        grads = mg.grads if mg is not None else acc
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, grads)
        if mg is not None:
            mg.zero_grad()
        return total

    def full(self) -> list[dict]:
        return _as_units(self.fh.gather(self.params, self.spec))


class _LayerWise:
    """``sink``: gathered(into=MainGrad) with the microbatches declared; else the pure form."""

    def __init__(self, pb: _Problem, dm, sink: bool):
        import functional_hsdp as fh

        self.fh, self.M = fh, pb.M
        spec = fh.hsdp(fh.DistMesh(dm, issue_size_one=True), *C.AXES)
        full = _as_units(pb.full())
        self.tree_spec = [spec] * len(full)
        self.params = fh.shard(full, self.tree_spec)
        self.mg = fh.MainGrad(self.tree_spec, like=full) if sink else None
        block = fh.gathered(_layer, spec, into=self.mg)
        M = pb.M
        self.grad = torch.func.grad_and_value(
            lambda units, x, y: F.mse_loss(fh.sequence(block, units, x), y) / M
        )

    def step(self, xs, ys):
        fh, mg, acc, total = self.fh, self.mg, None, 0.0
        for m, last in fh.microbatches(self.M, into=mg):
            g, loss = self.grad(self.params, xs[m], ys[m])
            if mg is None:
                acc = fh.reduce_grads(g, self.tree_spec, last=last, acc=acc, at="gradient")
            total = total + loss.detach()
        del g
        if mg is None:
            self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, acc)
            return total
        mg.finish()
        with torch.no_grad():  # in place, as torch.optim's SGD
            for p, g in zip(optree.tree_leaves(self.params), optree.tree_leaves(mg.grads)):
                p.add_(g, alpha=-LR)
        mg.zero_grad()
        return total

    def full(self) -> list[dict]:
        return self.fh.gather(self.params, self.tree_spec)


def _build(name: str, pb, dm):
    if name.startswith("hf_"):
        return gpu_hf.build(name, pb, dm)
    if name in gpu_muon.VARIANTS:
        return gpu_muon.build(name, pb, dm)
    if name == "plain":
        return _Plain(pb, dm)
    if name == "fsdp2":
        return _FSDP2(pb, dm)
    if name in ("whole_tree", "maingrad"):
        return _WholeTree(pb, dm, maingrad=name == "maingrad")
    if name in ("lw_sink", "lw_pure"):
        return _LayerWise(pb, dm, sink=name == "lw_sink")
    raise ValueError(name)


# -- one rank ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_rank(device: torch.device):
    """A one-rank default process group (NCCL on CUDA, gloo on the CPU) and its (1, 1)
    DeviceMesh, destroyed on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError(
            "bench gpu makes its own one-rank process group: run it in a process that has "
            "none (python -m bench gpu)"
        )
    tmp = tempfile.mkdtemp(prefix="fh_bench_gpu_")
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    try:
        yield init_device_mesh(device.type, (1, 1), mesh_dim_names=C.AXES)
    finally:
        import functional_hsdp as fh

        fh.clear_caches()  # plans hold this run's meshes
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(runner, data, device) -> tuple[float, float, torch.Tensor]:
    """(step seconds, host enqueue seconds, loss tensor) of one step, from an idle device."""
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        loss = runner.step(*data)
        dt = time.perf_counter() - t0
        return dt, dt, loss
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    loss = runner.step(*data)
    enqueue = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, enqueue, loss


def _rel_error(got: list[dict], want: list[dict]) -> float:
    errors = [
        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True)
    ]
    return max(errors)


def _correctness(cfg: dict, device, dm) -> dict:
    """Per microbatch count: each variant's full weights after CORRECT_STEPS steps versus
    ``plain``'s (relative error, worst leaf), and its losses."""
    out = {}
    for M in sorted({1, cfg["M"]}):
        pb = _Problem(cfg, device, M)
        ref = _build("plain", pb, dm)
        want_losses = [float(ref.step(*pb.data(s))) for s in range(CORRECT_STEPS)]
        want = ref.full()
        del ref
        case = {}
        for v in VARIANTS[1:]:
            runner = _build(v, pb, dm)
            losses = [float(runner.step(*pb.data(s))) for s in range(CORRECT_STEPS)]
            case[v] = {
                "params": _rel_error(runner.full(), want),
                "loss": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want_losses)),
            }
            del runner
        out[M] = case
        del pb, want
        gc.collect()
    return out


def _syncs(runner, data) -> tuple[int, list[str]]:
    """Warnings of ``torch.cuda.set_sync_debug_mode("warn")`` in one step (host-device
    synchronizations), and where the first few came from."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.step(*data)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    hits = [w for w in caught if "synchroniz" in str(w.message)]
    where = Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in hits)
    return len(hits), [f"{k} ({n}x)" for k, n in where.most_common(4)]


def _collectives(runner, data) -> dict[str, int]:
    """The library's collectives in one step (``comm_log``), by op; FSDP2's and torch's own
    are not logged there (their variants show none)."""
    import functional_hsdp as fh

    with fh.comm_log() as log:
        runner.step(*data)
    return dict(Counter(e.op for e in log.events))


def _memory(pb: _Problem, device, dm, name: str) -> dict:
    """One variant alone: allocated before it was built (idle: the problem's initial weights
    and data included), one warm-up step, then one step's peak (``max_memory_allocated``,
    reset before it), in bytes above idle."""
    gc.collect()
    torch.cuda.empty_cache()
    _sync(device)
    idle = torch.cuda.memory_allocated(device)
    runner = _build(name, pb, dm)
    runner.step(*pb.data(0))
    data = pb.data(1)
    gc.collect()
    _sync(device)
    held = torch.cuda.memory_allocated(device) - idle
    torch.cuda.reset_peak_memory_stats(device)
    runner.step(*data)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - idle
    del runner, data
    return {"held": held, "peak": peak}


def _measure(res: dict, cfg: dict, device: torch.device) -> None:
    """The four phases, into ``res``."""
    t0 = time.perf_counter()
    phases = res["phase_s"] = {}
    with _one_rank(device) as dm:
        phases["set-up"] = time.perf_counter() - t0
        res["correct"] = _correctness(cfg, device, dm)
        phases["correctness"] = time.perf_counter() - t0 - sum(phases.values())
        pb = _Problem(cfg, device, cfg["M"])
        res["numel"] = sum(p.numel() for p in pb.base.parameters())
        _phases(res, pb, cfg, device, dm, VARIANTS, phases, t0)
        del pb
        gc.collect()
        if res["hf"].get("skipped") is None:
            _hf_phases(res["hf"], device, dm)
        _muon_phases(res["muon"], device, dm)
    res["wall_s"] = time.perf_counter() - t0


def _phases(res: dict, pb, cfg: dict, device, dm, variants, phases: dict, t0: float) -> None:
    """Time (every variant built, steps interleaved), syncs and memory (CUDA only), into
    ``res``; each phase's seconds into ``phases``."""
    cuda = device.type == "cuda"
    runners = {v: _build(v, pb, dm) for v in variants}
    step_t = {v: [] for v in variants}
    enq_t = {v: [] for v in variants}
    losses: dict[str, list] = {v: [] for v in variants}
    for rep in range(cfg["warmup"] + cfg["reps"]):
        for v in variants:
            dt, enq, loss = _timed_step(runners[v], pb.data(rep), device)
            losses[v].append(float(loss))  # after the timed region (synchronized)
            if rep >= cfg["warmup"]:
                step_t[v].append(dt)
                enq_t[v].append(enq)
    res["times"], res["enqueue"], res["losses"] = step_t, enq_t, losses
    phases["time"] = time.perf_counter() - t0 - sum(phases.values())
    res["collectives"] = {v: _collectives(runners[v], pb.data(0)) for v in variants}
    if cuda:
        res["syncs"] = {v: _syncs(runners[v], pb.data(0)) for v in variants}
        phases["syncs"] = time.perf_counter() - t0 - sum(phases.values())
    del runners
    gc.collect()
    if cuda:
        res["memory"] = {v: _memory(pb, device, dm, v) for v in variants}
        phases["memory"] = time.perf_counter() - t0 - sum(phases.values())


def _hf_phases(hf: dict, device, dm) -> None:
    """The Llama's four phases (bench/device/gpu_hf.py), into ``hf``."""
    t0 = time.perf_counter()
    phases = hf["phase_s"] = {}
    cfg = hf["cfg"]
    pb = gpu_hf.Problem(cfg, device)
    hf["numel"] = pb.numel
    phases["set-up"] = time.perf_counter() - t0
    hf["correct"] = gpu_hf.correctness(pb, dm)
    phases["correctness"] = time.perf_counter() - t0 - sum(phases.values())
    _phases(hf, pb, cfg, device, dm, gpu_hf.VARIANTS, phases, t0)
    del pb
    gc.collect()
    hf["wall_s"] = time.perf_counter() - t0


def _muon_phases(mu: dict, device, dm) -> None:
    """Muon's phases (bench/device/gpu_muon.py), into ``mu``: correctness, time, syncs and memory
    as the MLP's, then Newton-Schulz time."""
    t0 = time.perf_counter()
    phases = mu["phase_s"] = {}
    cfg = mu["cfg"]
    mu["correct"] = gpu_muon.correctness(cfg, device, dm)
    phases["correctness"] = time.perf_counter() - t0
    pb = gpu_muon.Problem(cfg, device)
    mu["numel"] = pb.numel
    _phases(mu, pb, cfg, device, dm, gpu_muon.VARIANTS, phases, t0)
    mu["ns"] = gpu_muon.newton_schulz_time(pb, dm, device, cfg["reps"])
    phases["Newton-Schulz"] = time.perf_counter() - t0 - sum(phases.values())
    del pb
    gc.collect()
    mu["wall_s"] = time.perf_counter() - t0


def run(size: str = "full", pool=None) -> dict:
    """On this process's device (CUDA if present, else the CPU); ``pool`` is not used (one
    rank, in this process)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = SIZES[size][device.type]
    res: dict = {"size": size, "cfg": cfg, "device": device.type}
    skipped = gpu_hf.available()
    res["hf"] = {"cfg": gpu_hf.SIZES[size][device.type], "skipped": skipped}
    res["muon"] = {"cfg": {**cfg, **gpu_muon.TIMING[size][device.type]}}  # the same MLP
    res["device_name"] = torch.cuda.get_device_name(device) if cuda else C.machine()
    threads = torch.get_num_threads()
    if not cuda:  # one thread, as each gloo benchmark worker: steady on a busy machine
        torch.set_num_threads(1)
    res["threads"] = torch.get_num_threads()
    try:
        _measure(res, cfg, device)
    finally:
        torch.set_num_threads(threads)
    res["median"] = {v: C.median(t) for v, t in res["times"].items()}
    res["median_enqueue"] = {v: C.median(t) for v, t in res["enqueue"].items()}
    ref = res["losses"]["plain"]
    res["loss_maxrel"] = {
        v: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(res["losses"][v], ref))
        for v in VARIANTS
    }
    res["correct_ok"] = all(
        c["params"] <= TOLERANCE and c["loss"] <= TOLERANCE
        for case in res["correct"].values()
        for c in case.values()
    )
    gpu_muon.summarize(res["muon"])
    hf = res["hf"]
    if hf.get("skipped") is None:
        hf["median"] = {v: C.median(t) for v, t in hf["times"].items()}
        hf["median_enqueue"] = {v: C.median(t) for v, t in hf["enqueue"].items()}
        ref = hf["losses"][gpu_hf.REFERENCE]
        hf["loss_maxrel"] = {
            v: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(hf["losses"][v], ref))
            for v in gpu_hf.VARIANTS
        }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, cuda = res["cfg"], res["device"] == "cuda"
    where = f"CUDA: {res['device_name']}" if cuda else "CPU only (no CUDA device)"
    head = C.section_header(
        f"(B11) One device, world size 1: the library's paths versus torch.func and FSDP2, "
        f"and a Hugging Face Llama "
        f"({'CUDA' if cuda else 'CPU run, not a GPU measurement'})",
        command,
        when,
    )
    desc = (
        f"Device: {where}. One process, a one-rank process group "
        f"({'NCCL' if cuda else 'gloo'}) and a (1, 1) DeviceMesh (dp_outer, dp_inner): every "
        "path runs on the device's tensors, on `DistMesh(dm, issue_size_one=True)`: the "
        "collectives of a 2-D mesh are issued on the size-1 axes too (*collectives per step*: "
        "the library's, from `comm_log`)"
        + (
            ""
            if cuda
            else f"; {res['threads']} CPU thread (`torch.set_num_threads`), as each gloo "
            "benchmark worker"
        )
        + ". Model: "
        f"{cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), {res['numel']:,} parameters, "
        f"fp32 ({C.mib(4 * res['numel'])} MiB); M = {cfg['M']} microbatches of {cfg['B']} x "
        f"{cfg['D']}; MSE loss / M; SGD lr {LR}; the same initial weights and data in every "
        "variant (bench/device/gpu.py has the exact loops). "
        f"{cfg['warmup']} warm-up and {cfg['reps']} timed steps per variant, interleaved; "
        "median. *Step*: "
        + (
            "CUDA events around the step, from an idle device"
            if cuda
            else "`perf_counter` around the step"
        )
        + "; *enqueue*: host time until the step's Python returns, before any synchronization"
        + ("" if cuda else " (on the CPU the work runs as it is issued: the same as the step)")
        + ". No timed step reads device data on the host (losses are summed as tensors and read "
        "after the step).\n"
    )
    med, enq = res["median"], res["median_enqueue"]
    mem, syncs = res.get("memory", {}), res.get("syncs", {})
    rows = []
    for v in VARIANTS:
        rows.append(
            [
                f"`{v}`",
                _LABEL[v],
                f"{1e3 * med[v]:.1f}",
                f"{med[v] / med['plain']:.2f}",
                f"{med[v] / med['fsdp2']:.2f}",
                f"{1e3 * enq[v]:.1f}" if cuda else "= step",
                f"{enq[v] / med[v]:.2f}" if cuda else "n/a",
                C.mib(mem[v]["peak"]) if v in mem else "n/a",
                C.mib(mem[v]["held"]) if v in mem else "n/a",
                str(syncs[v][0]) if v in syncs else "n/a",
                gpu_hf.collectives_text(res["collectives"][v]),
                f"{res['loss_maxrel'][v]:.1e}",
            ]
        )
    t1 = C.table(
        [
            "variant",
            "what",
            "step (ms)",
            "/ plain",
            "/ fsdp2",
            "enqueue (ms)",
            "enqueue / step",
            "peak above idle (MiB)",
            "held between steps (MiB)",
            "syncs per step",
            "collectives per step",
            "loss max rel. diff vs plain",
        ],
        rows,
    )
    crow = []
    for M, case in res["correct"].items():
        for v, c in case.items():
            crow.append([str(M), f"`{v}`", f"{c['params']:.1e}", f"{c['loss']:.1e}"])
    t2 = C.table(
        ["M", "variant", "weights: max rel. error vs plain", "losses: max rel. diff"], crow
    )
    lines = [
        head,
        desc,
        t1,
        f"\n**Correctness** against the dense `plain` run, {CORRECT_STEPS} steps from the same "
        "weights with 1 and with M microbatches (the full weights gathered; worst leaf, "
        f"relative L2 error; tolerance {TOLERANCE:g}):\n",
        t2,
        f"\n- Every library path and FSDP2 agree with the dense run within {TOLERANCE:g}: "
        f"**{'yes' if res['correct_ok'] else 'no'}**.",
    ]
    if cuda:
        lib = {v: syncs[v][0] for v in LIBRARY}
        lines.append(
            "- Host-device synchronizations per step of the library's paths (goal 0; "
            '`torch.cuda.set_sync_debug_mode("warn")` warnings in one step): '
            + ", ".join(f"`{v}` {n}" for v, n in lib.items())
            + f" — **{'met' if not any(lib.values()) else 'not met'}**."
        )
        for v in VARIANTS:
            if syncs[v][1]:
                lines.append(f"  - `{v}`: from {', '.join(syncs[v][1])}")
        lines.append(
            "- *Peak above idle*: `torch.cuda.max_memory_allocated` of one step (reset before "
            "it, after a warm-up step), minus the allocated memory before the variant was "
            "built (the initial weights and the data it is built from and trains on), each "
            "variant alone; *held*: allocated between steps, above idle."
        )
    else:
        lines.append(
            "- Memory (`torch.cuda.max_memory_allocated`) and syncs "
            "(`torch.cuda.set_sync_debug_mode`) are CUDA only: n/a here. Run `python -m bench "
            'gpu` on a GPU for them (bench/README.md, "On a GPU").'
        )
    lines.append(
        "- Time per phase (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in res["phase_s"].items())
        + " (the process group and the model's weights are made inside)."
    )
    lines += gpu_hf.report_lines(res["hf"], cuda)
    lines += gpu_muon.report_lines(res["muon"], cuda)
    lines.append("")
    return "\n".join(lines)
