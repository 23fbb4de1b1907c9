"""``python -m functional_hsdp demo``: a small MLP trained with ddp, fsdp, hsdp or hfsdp.

The demo is the library's end-to-end check: one training loop, written once against the
public API, runs on real ranks (``--backend gloo``: :func:`train_gloo`, O*I local gloo ranks
started by :func:`functional_hsdp.mesh.launch.run`, each on a ``DeviceMesh`` and a
:class:`~functional_hsdp.DistMesh` with its own data slice) or in one process (``--backend
sim``: :func:`train_sim`, a :class:`~functional_hsdp.SimMesh`). The loop does not ask which
mesh it has. Two ``torch.func`` loops (``--mode``): the whole tree at once (``whole``,
:class:`_Whole`, the default) or layer by layer (``layerwise``, :class:`_Layerwise`). A dense
single-process reference (:func:`train_reference`) runs the same math; when the run passes:
:class:`Report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import einops
import optree
import torch
import torch.nn as nn
from torch.func import functional_call, grad, grad_and_value

import functional_hsdp as fh

from ..mesh import launch

__all__ = ["AXES", "Config", "Result", "Report", "add_arguments", "main", "run"]

AXES = ("dp_outer", "dp_inner")
STRATEGIES = ("ddp", "fsdp", "hsdp", "hfsdp")
BACKENDS = ("gloo", "sim")
MODES = ("whole", "layerwise")
TOLERANCE = 1e-5  # fp32: the distributed sums reassociate, nothing more
PARAM_TOLERANCE = 1e-5  # final parameters, relative to the largest reference parameter
PHASES = ("setup", "sync", "gather", "reduce", "forward", "backward", "finish", "end")

Params = dict[str, torch.Tensor]
CommTable = dict[tuple[str, str, str], tuple[int, int]]  # (phase, axis, op) -> (count, bytes)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a demo run; both backends and the reference read only this.

    ``batch`` is the number of samples per rank per microbatch, so the global batch is
    ``outer * inner * microbatches * batch`` and every rank holds an equal-sized slice (which
    is what makes the mean of per-rank mean losses equal the global mean loss).
    """

    strategy: str = "hsdp"
    backend: str = "gloo"
    mode: str = "whole"
    outer: int = 2
    inner: int = 2
    steps: int = 5
    microbatches: int = 3
    batch: int = 8
    features: int = 16
    hidden: int = 32
    outputs: int = 4
    lr: float = 0.1
    seed: int = 0

    @property
    def world_size(self) -> int:
        """Number of ranks, ``outer * inner``."""
        return self.outer * self.inner

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks and microbatches."""
        return self.world_size * self.microbatches * self.batch


@dataclasses.dataclass
class Result:
    """What one training run produces.

    ``rank_losses[s]`` holds, per rank, the rank's mean loss over its slice at the start of
    step ``s`` (a list in rank order). ``comm`` is one rank's collectives over all steps by
    ``(phase, axis, op)``, and ``impls`` says how the mesh carried out each ``(axis, op)``.
    """

    rank_losses: list[list[float]]
    params: Params
    comm: CommTable
    impls: dict[tuple[str, str], str]
    spec: str

    @property
    def losses(self) -> list[float]:
        """Mean loss over the global batch per step: the mean over equal-sized rank slices."""
        return [math.fsum(ranks) / len(ranks) for ranks in self.rank_losses]


@dataclasses.dataclass
class Report:
    """A run against its reference; it passes when :attr:`failures` is empty: every loss is
    finite, the per-step losses agree to within 1e-5 (``TOLERANCE``) and the final parameters
    to within 1e-5 relative (``PARAM_TOLERANCE``)."""

    config: Config
    result: Result
    reference_losses: list[float]
    max_loss_error: float
    max_param_error: float
    seconds: float

    @property
    def failures(self) -> list[str]:
        """Why the run fails, one sentence each: non-finite losses first, then parity."""
        for name, losses in (
            ("loss", self.result.losses),
            ("reference loss", self.reference_losses),
        ):
            bad = [s for s, v in enumerate(losses) if not math.isfinite(v)]
            if bad:
                return [f"non-finite {name} at step {bad[0]} ({losses[bad[0]]})"]
        if not math.isfinite(self.max_param_error):
            return [f"non-finite final parameters (max |Δparam| {self.max_param_error})"]
        found = []
        if not self.max_loss_error < TOLERANCE:
            found.append(f"max |Δloss| {self.max_loss_error:.3e} >= {TOLERANCE:g}")
        if not self.max_param_error < PARAM_TOLERANCE:
            found.append(
                f"final max |Δparam| (relative) {self.max_param_error:.3e} >= {PARAM_TOLERANCE:g}"
            )
        return found

    @property
    def passed(self) -> bool:
        """True when every loss is finite and losses and parameters match the reference."""
        return not self.failures


# -- model and data ------------------------------------------------------------------------


def make_model(cfg: Config, device: str = "meta") -> nn.Module:
    """The MLP. On ``meta`` it holds no data: ``functional_call`` supplies the parameters."""
    return nn.Sequential(
        nn.Linear(cfg.features, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, cfg.outputs)
    ).to(device)


def init_params(cfg: Config) -> Params:
    """Full initial parameters from the seed alone, so every rank builds the same ones."""
    gen = torch.Generator().manual_seed(cfg.seed)
    params = {}
    for name, p in make_model(cfg).named_parameters():
        fan_in = p.shape[-1] if p.ndim > 1 else cfg.features
        params[name] = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
    return params


def to_units(params: Params) -> list[Params]:
    """``{"0.weight": w, "0.bias": b, ...}`` -> ``[{"weight": w, "bias": b}, ...]``, one unit
    per Linear, in model order."""
    units: dict[str, Params] = {}
    for name, t in params.items():
        layer, leaf = name.split(".")
        units.setdefault(layer, {})[leaf] = t
    return list(units.values())


def from_units(units: list[Params], like: Params) -> Params:
    """The inverse of :func:`to_units`, with the names (and order) of ``like``."""
    layers = list(dict.fromkeys(name.split(".")[0] for name in like))
    return {name: units[layers.index(name.split(".")[0])][name.split(".")[1]] for name in like}


def make_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, shaped ``(outer, inner, microbatches, batch, feature)``.

    Rank ``(o, i)``'s microbatch ``m`` is ``x[o, i, m]``; both backends and the reference
    slice this one tensor, so they see exactly the same samples.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.global_batch, cfg.features, generator=gen)
    teacher_in = torch.randn(cfg.features, cfg.hidden, generator=gen) / math.sqrt(cfg.features)
    teacher_out = torch.randn(cfg.hidden, cfg.outputs, generator=gen) / math.sqrt(cfg.hidden)
    noise = 0.1 * torch.randn(cfg.global_batch, cfg.outputs, generator=gen)
    y = torch.tanh(x @ teacher_in) @ teacher_out + noise
    pattern = "(o i m b) f -> o i m b f"
    sizes = dict(o=cfg.outer, i=cfg.inner, m=cfg.microbatches)
    return einops.rearrange(x, pattern, **sizes), einops.rearrange(y, pattern, **sizes)


def make_spec(mesh: fh.Mesh, strategy: str) -> fh.Spec:
    """The preset for ``strategy``; ddp and fsdp span every mesh axis."""
    if strategy == "ddp":
        return fh.ddp(mesh)
    if strategy == "fsdp":
        return fh.fsdp(mesh)
    if strategy == "hsdp":
        return fh.hsdp(mesh, outer="dp_outer", inner="dp_inner")
    if strategy == "hfsdp":
        return fh.hfsdp(mesh, outer="dp_outer", inner="dp_inner")
    raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


# -- the training loops, once for both meshes ----------------------------------------------


class _Phases:
    """One rank's comm log cut into named phases: ``mark(name)`` opens a phase."""

    def __init__(self, log: fh.CommLog) -> None:
        self.log = log
        self.marks: list[tuple[int, str]] = [(0, "setup")]

    def mark(self, name: str) -> None:
        """Events from now on belong to phase ``name`` (one of :data:`PHASES`)."""
        self.marks.append((len(self.log.events), name))

    def table(self) -> CommTable:
        """``{(phase, axis, op): (count, bytes)}`` over every event logged."""
        table: CommTable = {}
        ends = [start for start, _ in self.marks[1:]] + [len(self.log.events)]
        for (start, phase), end in zip(self.marks, ends):
            for e in self.log.events[start:end]:
                count, nbytes = table.get((phase, e.axis, e.op), (0, 0))
                table[(phase, e.axis, e.op)] = (count + 1, nbytes + e.nbytes)
        return table


class _Loop:
    """State shared by both loops: main weights at the optimizer placement, and the phases.

    Main weights stay at the optimizer placement; ``sync_params`` brings them to the parameter
    placement each step (an all-gather over dp_outer for hfsdp, nothing for the others)."""

    def __init__(self, cfg: Config, mesh: fh.Mesh, spec: fh.Spec, *, full: Any, phases: _Phases):
        self.cfg, self.mesh, self.phases = cfg, mesh, phases
        # the whole tree's spec: one Spec (whole), or one per unit (layerwise)
        self.spec = spec if isinstance(full, dict) else [spec] * len(full)
        self.main = fh.shard(full, self.spec)  # optimizer placement, updated by SGD
        self.same_placement = spec.optimizer == spec.parameter

    def params(self) -> Any:
        """This step's weights at the parameter placement (hfsdp: all-gathered over outer)."""
        self.phases.mark("sync")
        return self.main if self.same_placement else fh.sync_params(self.main, self.spec)


class _Whole(_Loop):
    """Gather the whole tree, ``grad`` per rank, ``reduce_grads`` every microbatch.

    ``--mode whole`` (the default): ``gather`` the whole tree for the forward, ``grad`` per
    rank (on a SimMesh mapped with ``fh.per_rank``), ``reduce_grads`` every microbatch
    (deferred axes on the last), SGD as a ``tree_map``."""

    def __init__(self, cfg: Config, mesh: fh.Mesh, spec: fh.Spec, *, phases: _Phases):
        super().__init__(cfg, mesh, spec, full=init_params(cfg), phases=phases)
        model, M = make_model(cfg), cfg.microbatches

        def loss(params: Params, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            # Scaled by 1/M: reduce_grads accumulates microbatches as a sum.
            return nn.functional.mse_loss(functional_call(model, params, (xb,)), yb) / M

        self.grad_and_loss = fh.per_rank(grad_and_value(loss), mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One SGD step; returns each rank's loss (``mesh.batch_shape``)."""
        params, M = self.params(), self.cfg.microbatches
        self.phases.mark("gather")
        full = fh.gather(params, self.spec)
        self.phases.mark("reduce")
        acc, step_loss = None, torch.zeros(self.mesh.batch_shape)
        for m in range(M):
            g, value = self.grad_and_loss(full, x.select(-3, m), y.select(-3, m))
            acc = fh.reduce_grads(g, self.spec, last=(m == M - 1), acc=acc)
            step_loss = step_loss + value.detach()
        self.main = optree.tree_map(lambda p, g: p - self.cfg.lr * g, self.main, acc)
        return step_loss

    def final_params(self) -> Params:
        """Full parameters after training, as every rank holds them."""
        return fh.gather(self.main, self.spec)


def _linear(p: Params, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, p["weight"], p["bias"])


class _Layerwise(_Loop):
    """One ``fh.gathered`` unit per Linear, gradients reduce-scattered into a MainGrad.

    ``--mode layerwise``: each Linear runs through ``fh.gathered(..., into=mg)``, so a unit is
    all-gathered in its forward, re-gathered in its backward and its gradient reduce-scattered
    into a :class:`~functional_hsdp.MainGrad` as soon as it exists; ``mg.finish()`` after the
    last microbatch, SGD in place on the shards."""

    def __init__(self, cfg: Config, mesh: fh.Mesh, spec: fh.Spec, *, phases: _Phases):
        full = to_units(init_params(cfg))
        super().__init__(cfg, mesh, spec, full=full, phases=phases)
        self.mg = fh.MainGrad(self.spec, like=full)
        self.linear = fh.gathered(fh.per_rank(_linear, mesh), spec, into=self.mg)
        self.mse = fh.per_rank(nn.functional.mse_loss, mesh)
        self.grad_and_loss = grad(self._loss, has_aux=True)

    def _loss(self, units: list, xb: torch.Tensor, yb: torch.Tensor) -> tuple:
        h = xb
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                self.linear.prefetch(units[i + 1])  # its all-gather overlaps this unit
                h = torch.tanh(self.linear(unit, h))
            else:
                h = self.linear(unit, h)
        per_rank = self.mse(h, yb) / self.cfg.microbatches  # MainGrad sums microbatches
        self.phases.mark("backward")
        return per_rank.sum(), per_rank.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One SGD step; returns each rank's loss (``mesh.batch_shape``)."""
        units, step_loss = self.params(), torch.zeros(self.mesh.batch_shape)
        for m in range(self.cfg.microbatches):
            self.phases.mark("forward")
            _, value = self.grad_and_loss(units, x.select(-3, m), y.select(-3, m))
            step_loss = step_loss + value
        self.phases.mark("finish")
        self.mg.finish()  # the deferred axes' reduction
        for p, g in zip(optree.tree_leaves(self.main), optree.tree_leaves(self.mg.grads)):
            p.sub_(self.cfg.lr * g)  # in place: the shards stay the ones fh.shard made
        self.mg.zero_grad()
        return step_loss

    def final_params(self) -> Params:
        """Full parameters after training, as every rank holds them, by name."""
        return from_units(fh.gather(self.main, self.spec), init_params(self.cfg))


def train(
    cfg: Config, mesh: fh.Mesh, *, x: torch.Tensor, y: torch.Tensor, progress: bool
) -> Result:
    """SGD on local shards; ``x``/``y`` are this process's data with ``mesh.batch_shape`` in front.

    Shapes are ``(*mesh.batch_shape, microbatches, batch, feature)``: the full tensor on a
    SimMesh, one rank's slice on a DistMesh. ``progress`` shows the steps on stderr.
    """
    spec = make_spec(mesh, cfg.strategy)
    rank_losses = []
    with fh.comm_log() as log:
        phases = _Phases(log)
        loop = (_Whole if cfg.mode == "whole" else _Layerwise)(cfg, mesh, spec, phases=phases)
        desc = f"{cfg.strategy} {cfg.mode} on {cfg.backend}"
        for _ in _progress(cfg.steps, desc, enabled=progress):
            rank_losses.append(loop.step(x, y).flatten().tolist())
        phases.mark("end")
    full = loop.final_params()
    first_rank = (0,) * len(mesh.batch_shape)  # every rank holds the same full value
    return Result(
        rank_losses=rank_losses,
        params={k: v[first_rank].clone() for k, v in full.items()},
        comm=phases.table(),
        impls={(e.axis, e.op): e.impl for e in log.events},
        spec=repr(spec),
    )


def _progress(steps: int, desc: str, *, enabled: bool) -> Iterator[int]:
    """``range(steps)``, its progress on stderr while ``enabled``: a tqdm bar where tqdm is
    installed (``pip install -e ".[demo]"``), else a plain line. The library does not need
    tqdm, so neither does its demo."""
    if not enabled:
        return iter(range(steps))
    try:
        from tqdm import tqdm
    except ImportError:
        return _plain_progress(steps, desc, sys.stderr)
    return iter(tqdm(range(steps), desc, unit="step", file=sys.stderr))


def _plain_progress(steps: int, desc: str, out: TextIO) -> Iterator[int]:
    """``desc: i/steps steps`` before each step and after the last: on a terminal one line
    rewritten in place, elsewhere (a log, a pipe) a line each."""
    end = "\r" if out.isatty() else "\n"
    for i in range(steps):
        print(f"{desc}: {i}/{steps} steps", end=end, file=out, flush=True)
        yield i
    print(f"{desc}: {steps}/{steps} steps", file=out, flush=True)


def train_sim(cfg: Config) -> Result:
    """Every rank in this process, on a SimMesh (every value carries the mesh shape in
    front)."""
    mesh = fh.SimMesh(dict(zip(AXES, (cfg.outer, cfg.inner))))
    x, y = make_data(cfg)
    return train(cfg, mesh, x=x, y=y, progress=True)


def _worker(cfg: Config) -> Result:
    """One gloo rank, in the process group that :func:`functional_hsdp.mesh.launch.run` set up."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (cfg.outer, cfg.inner), mesh_dim_names=AXES)
    mesh = fh.DistMesh(dm)
    o, i = (mesh.coordinate(a) for a in AXES)
    x, y = make_data(cfg)
    return train(cfg, mesh, x=x[o, i], y=y[o, i], progress=dist.get_rank() == 0)


def train_gloo(cfg: Config) -> Result:
    """O*I local gloo ranks (``launch.run``); per-rank losses come back to this process.

    Rank 0's communication log stands for every rank: each rank issues the same collectives.
    """
    # The forkserver the ranks fork from imports this module too (if this run starts it).
    preload = (*launch.DEFAULT_PRELOAD, "functional_hsdp.tools.demo")
    ranks = launch.run(_worker, cfg, world_size=cfg.world_size, preload=preload)
    losses = [[r.rank_losses[s][0] for r in ranks] for s in range(cfg.steps)]
    return dataclasses.replace(ranks[0], rank_losses=losses)


def train_reference(cfg: Config) -> tuple[list[float], Params]:
    """Plain dense torch: the whole global batch, an ``nn.Module``, autograd and SGD.

    Its gradient is that of the mean loss over the global batch, which equals the mean over
    ranks of the sum over microbatches of grad(loss / M) when slices are equal-sized. The
    update is written out: ``torch.optim`` would import ``torch._dynamo`` (seconds) for five
    subtractions.
    """
    model = make_model(cfg).to_empty(device="cpu")
    model.load_state_dict(init_params(cfg))
    x, y = make_data(cfg)
    x, y = x.reshape(-1, cfg.features), y.reshape(-1, cfg.outputs)
    losses = []
    for _ in range(cfg.steps):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.lr * p.grad
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- running and reporting -----------------------------------------------------------------


def _check(cfg: Config) -> None:
    for name, value, allowed in (
        ("strategy", cfg.strategy, STRATEGIES),
        ("backend", cfg.backend, BACKENDS),
        ("mode", cfg.mode, MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def _max_error(a: list[float], b: list[float]) -> float:
    """max |a - b|, NaN when any difference is NaN (``max`` alone would skip it)."""
    errors = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(e) for e in errors) else max(errors, default=0.0)


def _param_error(got: Params, ref: Params) -> float:
    """max |got - ref| over all parameters, relative to max |ref| (at least 1)."""
    scale = max(1.0, max(t.abs().max().item() for t in ref.values()))
    return _max_error([(got[k] - ref[k]).abs().max().item() / scale for k in ref], [0.0] * len(ref))


def run(cfg: Config, out: TextIO | None = None) -> Report:
    """Print what will run, train with ``cfg``, run the reference, print the comparison.

    Everything goes to ``out`` (default stdout); the header is flushed before training so it
    comes before the progress (stderr).
    """
    _check(cfg)
    out = out or sys.stdout
    _print_header(cfg, out)
    start = time.perf_counter()
    result = train_gloo(cfg) if cfg.backend == "gloo" else train_sim(cfg)
    seconds = time.perf_counter() - start
    ref_losses, ref_params = train_reference(cfg)
    report = Report(
        config=cfg,
        result=result,
        reference_losses=ref_losses,
        max_loss_error=_max_error(result.losses, ref_losses),
        max_param_error=_param_error(result.params, ref_params),
        seconds=seconds,
    )
    _print_report(report, out)
    return report


def _plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``, ``3 microbatches``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('ch') else 's'}"


def _print_header(cfg: Config, out: TextIO) -> None:
    """What will run: strategy, mode, mesh, spec, model and batch."""
    spec = make_spec(fh.SimMesh(dict(zip(AXES, (cfg.outer, cfg.inner)))), cfg.strategy)
    params = init_params(cfg)
    n_params = sum(p.numel() for p in params.values())
    ranks = _plural(cfg.world_size, "rank")
    mbs = _plural(cfg.microbatches, "microbatch")
    layout = (
        f"{_plural(len(to_units(params)), 'unit')} (one per Linear), fh.gathered into a MainGrad"
        if cfg.mode == "layerwise"
        else "one tree, gathered whole"
    )
    where = (
        f"starting {ranks} as local gloo processes"
        if cfg.backend == "gloo"
        else f"{ranks} simulated in this process (SimMesh)"
    )
    lines = [
        f"functional_hsdp demo: {cfg.strategy} on {cfg.backend}, {cfg.mode} mode, mesh "
        f"dp_outer={cfg.outer} x dp_inner={cfg.inner} ({ranks}), {_plural(cfg.steps, 'step')} "
        f"x {mbs}, lr={cfg.lr}, seed={cfg.seed}",
        f"spec: parameter=[{', '.join(map(str, spec.parameter))}], gradient="
        f"[{', '.join(map(str, spec.gradient))}], optimizer="
        f"[{', '.join(map(str, spec.optimizer))}] over ({', '.join(AXES)})",
        f"model: MLP {cfg.features}-{cfg.hidden}-{cfg.outputs} ({n_params} parameters in "
        f"{len(params)} tensors) as {layout}",
        f"global batch {cfg.global_batch} = {ranks} x {mbs} x {_plural(cfg.batch, 'sample')}",
        f"training: {where}; progress on stderr",
    ]
    print("\n".join(lines), file=out, flush=True)


def _per_step(total: int, steps: int) -> str:
    """A total over all steps, per step (every step issues the same collectives)."""
    return str(total // steps) if total % steps == 0 else f"{total / steps:.2f}"


def _comm_lines(cfg: Config, result: Result) -> list[str]:
    """The per-step communication table, in phase order."""
    units = len(to_units(init_params(cfg)))
    lines = ["communication per step (one rank's inputs):"]
    if cfg.mode == "layerwise":
        lines[0] = (
            f"communication per step (one rank's inputs; {_plural(units, 'unit')} x "
            f"{_plural(cfg.microbatches, 'microbatch')}):"
        )
    lines.append(f"  {'phase':<10}{'axis':<10}{'op':<16}{'count':>6}{'bytes':>10}  impl")
    order = sorted(result.comm, key=lambda k: (PHASES.index(k[0]), k[1], k[2]))
    for phase, axis, op in order:
        count, nbytes = result.comm[(phase, axis, op)]
        lines.append(
            f"  {phase:<10}{axis:<10}{op:<16}{_per_step(count, cfg.steps):>6}"
            f"{_per_step(nbytes, cfg.steps):>10}  {result.impls[(axis, op)]}"
        )
    if not result.comm:
        lines.append("  (none)")
    return lines


def _print_report(report: Report, out: TextIO) -> None:
    """Losses against the reference, communication, time and the verdict."""
    cfg, result = report.config, report.result
    lines = ["", f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'|Δloss|':>9}"]
    for s, (a, b) in enumerate(zip(result.losses, report.reference_losses)):
        lines.append(f"{s:>4}  {a:>12.8f}  {b:>12.8f}  {abs(a - b):>9.2e}")
    lines += ["", *_comm_lines(cfg, result), ""]
    started = f", including starting {cfg.world_size} workers" if cfg.backend == "gloo" else ""
    lines.append(f"training wall time: {report.seconds:.2f} s{started}")
    lines.append(
        f"max |Δloss| over steps = {report.max_loss_error:.3e}; final max |Δparam| (relative) "
        f"= {report.max_param_error:.3e}"
    )
    what = f"({cfg.strategy} {cfg.mode} on {cfg.backend} vs dense reference)"
    if report.passed:
        lines.append(f"PASS: max |Δloss| {report.max_loss_error:.3e} < {TOLERANCE:g} {what}")
    else:
        lines.append(f"FAIL: {'; '.join(report.failures)} {what}")
    print("\n".join(lines), file=out, flush=True)


# -- command line ----------------------------------------------------------------------------


def _mesh_shape(text: str) -> tuple[int, int]:
    """``"OxI"`` -> ``(O, I)``, both positive."""
    parts = text.lower().split("x")
    try:
        outer, inner = (int(n) for n in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected OxI with two positive integers, like 2x2 or 4x1; got {text!r}"
        ) from None
    if outer < 1 or inner < 1:
        raise argparse.ArgumentTypeError(
            f"expected OxI with two positive integers (sizes are at least 1); got {text!r}"
        )
    return outer, inner


def _positive_int(text: str) -> int:
    """A positive integer flag value."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return n


def _integer(text: str) -> int:
    """Any integer flag value."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None


def _learning_rate(text: str) -> float:
    """A finite, non-negative float flag value."""
    try:
        lr = float(text)
    except ValueError:
        lr = math.nan
    if not (math.isfinite(lr) and lr >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0; got {text!r}")
    return lr


# flag -> (add_argument keywords, help); defaults come from Config
_FLAGS: dict[str, tuple[dict[str, Any], str]] = {
    "--strategy": (
        {"choices": STRATEGIES},
        "ddp and fsdp span both axes; hsdp defers dp_outer; hfsdp also shards the optimizer "
        "state over it (default: %(default)s)",
    ),
    "--mode": (
        {"choices": MODES},
        "whole: gather the whole tree per step; layerwise: one fh.gathered unit per Linear, "
        "gradients reduce-scattered into a MainGrad during backward (default: %(default)s)",
    ),
    "--backend": (
        {"choices": BACKENDS},
        "gloo: O*I local worker processes; sim: one process, SimMesh (default: %(default)s)",
    ),
    "--mesh": ({"type": _mesh_shape, "metavar": "OxI"}, "dp_outer x dp_inner sizes"),
    "--steps": ({"type": _positive_int}, "optimizer steps (default: %(default)s)"),
    "--microbatches": ({"type": _positive_int}, "microbatches per step (default: %(default)s)"),
    "--batch": ({"type": _positive_int}, "samples per rank per microbatch (default: %(default)s)"),
    "--hidden": ({"type": _positive_int}, "MLP hidden width (default: %(default)s)"),
    "--lr": ({"type": _learning_rate}, "SGD learning rate, finite, >= 0 (default: %(default)s)"),
    "--seed": ({"type": _integer}, "seed for parameters and data (default: %(default)s)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` flags; defaults come from :class:`Config`."""
    d = Config()
    defaults = dataclasses.asdict(d) | {"mesh": (d.outer, d.inner)}
    for flag, (kw, help_text) in _FLAGS.items():
        if flag == "--mesh":
            help_text += f" (default: {d.outer}x{d.inner})"
        parser.add_argument(flag, default=defaults[flag[2:]], help=help_text, **kw)


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed flags; 0 on PASS, 1 on FAIL or a failed worker."""
    cfg = Config(
        strategy=args.strategy,
        backend=args.backend,
        mode=args.mode,
        outer=args.mesh[0],
        inner=args.mesh[1],
        steps=args.steps,
        microbatches=args.microbatches,
        batch=args.batch,
        hidden=args.hidden,
        lr=args.lr,
        seed=args.seed,
    )
    try:
        report = run(cfg)
    except launch.WorkerError as e:
        print(e, file=sys.stderr)
        print("FAIL: a gloo worker failed (its traceback is above)", flush=True)
        return 1
    return 0 if report.passed else 1
