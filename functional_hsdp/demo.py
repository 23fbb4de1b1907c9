"""``python -m functional_hsdp demo``: train a small ``torch.func`` MLP with ddp, fsdp or hsdp.

The demo is the library's end-to-end check. One training loop, written once against the
public API (``shard``, ``gather``, ``reduce_grads``, ``comm_log``), runs either

- on real ranks (``--backend gloo``): the command starts O*I local gloo ranks itself with
  :func:`functional_hsdp.launch.run` (torch.distributed's elastic launcher); each builds a
  ``DeviceMesh`` and a :class:`~functional_hsdp.DistMesh`, and computes gradients on its own
  data slice; or
- in one process (``--backend sim``) on a :class:`~functional_hsdp.SimMesh`, where every value
  carries the mesh shape in front and per-rank gradients come from ``torch.func.vmap``.

The loop does not ask which mesh it has: it wraps the per-rank gradient in one ``vmap`` per
dim of ``mesh.batch_shape`` (none on a DistMesh, ``(O, I)`` on a SimMesh), and slices data the
same way. A dense single-process reference (a plain ``nn.Module``, autograd and SGD on the
whole global batch) runs the same math; the demo passes when the per-step losses agree to
within 1e-5.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

import einops
import optree
import torch
import torch.nn as nn
from torch.func import functional_call, grad_and_value, vmap
from tqdm import tqdm

import functional_hsdp as fh

from . import launch

__all__ = ["AXES", "Config", "Result", "Report", "add_arguments", "main", "run"]

AXES = ("dp_outer", "dp_inner")
STRATEGIES = ("ddp", "fsdp", "hsdp")
BACKENDS = ("gloo", "sim")
TOLERANCE = 1e-5  # fp32: the distributed sums reassociate, nothing more

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a demo run; both backends and the reference read only this.

    ``batch`` is the number of samples per rank per microbatch, so the global batch is
    ``outer * inner * microbatches * batch`` and every rank holds an equal-sized slice (which
    is what makes the mean of per-rank mean losses equal the global mean loss).
    """

    strategy: str = "hsdp"
    backend: str = "gloo"
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
        return self.outer * self.inner

    @property
    def global_batch(self) -> int:
        return self.world_size * self.microbatches * self.batch


@dataclasses.dataclass
class Result:
    """What one training run produces.

    ``rank_losses[s]`` holds, per rank, the rank's mean loss over its slice at the start of
    step ``s`` (a list in rank order). ``comm`` is ``CommLog.summary()`` over all steps of one
    rank, and ``impls`` says how the mesh carried out each (axis, op).
    """

    rank_losses: list[list[float]]
    params: Params
    comm: dict[tuple[str, str], tuple[int, int]]
    impls: dict[tuple[str, str], str]
    spec: str

    @property
    def losses(self) -> list[float]:
        """Mean loss over the global batch per step: the mean over equal-sized rank slices."""
        return [math.fsum(ranks) / len(ranks) for ranks in self.rank_losses]


@dataclasses.dataclass
class Report:
    """A run against its reference; ``passed`` is ``max_loss_error < TOLERANCE``."""

    config: Config
    result: Result
    reference_losses: list[float]
    max_loss_error: float
    max_param_error: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.max_loss_error < TOLERANCE


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
    raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")


# -- the training loop, once for both meshes -----------------------------------------------


def train(
    cfg: Config, mesh: fh.Mesh, x: torch.Tensor, y: torch.Tensor, *, progress: bool
) -> Result:
    """SGD on local shards; ``x``/``y`` are this process's data with ``mesh.batch_shape`` in front.

    Shapes are ``(*mesh.batch_shape, microbatches, batch, feature)``: the full tensor on a
    SimMesh, one rank's slice on a DistMesh.
    """
    model = make_model(cfg)
    spec = make_spec(mesh, cfg.strategy)
    M = cfg.microbatches

    def loss(params: Params, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        # Scaled by 1/M: reduce_grads accumulates microbatches as a sum.
        return nn.functional.mse_loss(functional_call(model, params, (xb,)), yb) / M

    per_rank: Callable = grad_and_value(loss)
    for _ in mesh.batch_shape:  # a SimMesh holds every rank: map over its leading dims
        per_rank = vmap(per_rank)

    params = fh.shard(init_params(cfg), spec)
    rank_losses = []
    with fh.comm_log() as log:
        for _ in tqdm(
            range(cfg.steps),
            desc=f"{cfg.strategy} on {cfg.backend}",
            unit="step",
            file=sys.stderr,
            disable=not progress,
        ):
            full = fh.gather(params, spec)
            acc, step_loss = None, torch.zeros(mesh.batch_shape)
            for m in range(M):
                g, value = per_rank(full, x.select(-3, m), y.select(-3, m))
                acc = fh.reduce_grads(g, spec, last=(m == M - 1), acc=acc)
                step_loss = step_loss + value.detach()
            rank_losses.append(step_loss.flatten().tolist())
            params = optree.tree_map(lambda p, g: p - cfg.lr * g, params, acc)

    full = fh.gather(params, spec)
    first_rank = (0,) * len(mesh.batch_shape)  # every rank holds the same full value
    impls = {(e.axis, e.op): e.impl for e in log.events}
    return Result(
        rank_losses=rank_losses,
        params={k: v[first_rank].clone() for k, v in full.items()},
        comm=log.summary(),
        impls=impls,
        spec=repr(spec),
    )


def train_sim(cfg: Config) -> Result:
    """Every rank in this process, on a SimMesh."""
    mesh = fh.SimMesh(dict(zip(AXES, (cfg.outer, cfg.inner))))
    x, y = make_data(cfg)
    return train(cfg, mesh, x, y, progress=True)


def _worker(cfg: Config) -> Result:
    """One gloo rank, in the process group that :func:`functional_hsdp.launch.run` set up."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (cfg.outer, cfg.inner), mesh_dim_names=AXES)
    mesh = fh.DistMesh(dm)
    o, i = (mesh.coordinate(a) for a in AXES)
    x, y = make_data(cfg)
    return train(cfg, mesh, x[o, i], y[o, i], progress=dist.get_rank() == 0)


def train_gloo(cfg: Config) -> Result:
    """O*I local gloo ranks (``launch.run``); per-rank losses come back to this process.

    Rank 0's communication log stands for every rank: each rank issues the same collectives.
    """
    # The forkserver the ranks fork from imports this module too (if this run starts it).
    preload = (*launch.DEFAULT_PRELOAD, "functional_hsdp.demo")
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


def run(cfg: Config, out: TextIO | None = None) -> Report:
    """Train with ``cfg``, run the reference, print the comparison to ``out`` (stdout)."""
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {cfg.strategy!r}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {cfg.backend!r}")
    start = time.perf_counter()
    result = train_gloo(cfg) if cfg.backend == "gloo" else train_sim(cfg)
    seconds = time.perf_counter() - start
    ref_losses, ref_params = train_reference(cfg)
    report = Report(
        config=cfg,
        result=result,
        reference_losses=ref_losses,
        max_loss_error=max(abs(a - b) for a, b in zip(result.losses, ref_losses)),
        max_param_error=max(
            (result.params[k] - ref_params[k]).abs().max().item() for k in ref_params
        ),
        seconds=seconds,
    )
    _print_report(report, out or sys.stdout)
    return report


def _print_report(report: Report, out: TextIO) -> None:
    cfg, result = report.config, report.result
    n_params = sum(p.numel() for p in result.params.values())

    def say(line: str = "") -> None:
        print(line, file=out)

    say(
        f"functional_hsdp demo: {cfg.strategy} on {cfg.backend}, mesh dp_outer={cfg.outer} x "
        f"dp_inner={cfg.inner} ({cfg.world_size} ranks), {cfg.steps} steps x "
        f"{cfg.microbatches} microbatches, lr={cfg.lr}, seed={cfg.seed}"
    )
    say(f"spec: {result.spec}")
    say(
        f"model: MLP {cfg.features}-{cfg.hidden}-{cfg.outputs} ({n_params} parameters in "
        f"{len(result.params)} tensors); global batch {cfg.global_batch} = {cfg.world_size} "
        f"ranks x {cfg.microbatches} microbatches x {cfg.batch}"
    )
    say()
    say(f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'|Δloss|':>9}")
    for s, (a, b) in enumerate(zip(result.losses, report.reference_losses)):
        say(f"{s:>4}  {a:>12.8f}  {b:>12.8f}  {abs(a - b):>9.2e}")
    say()

    def per_step(total: int) -> str:  # every step issues the same collectives
        return str(total // cfg.steps) if total % cfg.steps == 0 else f"{total / cfg.steps:.2f}"

    say("communication per step (one rank's inputs):")
    say(f"  {'axis':<10}{'op':<16}{'count':>6}{'bytes':>10}  impl")
    for (axis, op), (count, nbytes) in sorted(result.comm.items()):
        say(
            f"  {axis:<10}{op:<16}{per_step(count):>6}{per_step(nbytes):>10}  "
            f"{result.impls[(axis, op)]}"
        )
    if not result.comm:
        say("  (none)")
    say()
    started = f", including starting {cfg.world_size} workers" if cfg.backend == "gloo" else ""
    say(f"training wall time: {report.seconds:.2f} s{started}")
    say(
        f"max |Δloss| over steps = {report.max_loss_error:.3e}; final max |Δparam| = "
        f"{report.max_param_error:.3e}"
    )
    verdict = "PASS" if report.passed else "FAIL"
    relation = "<" if report.passed else ">="
    say(
        f"{verdict}: max |Δloss| {report.max_loss_error:.3e} {relation} {TOLERANCE:g} "
        f"({cfg.strategy} on {cfg.backend} vs dense reference)"
    )


# -- command line ----------------------------------------------------------------------------


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        outer, inner = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected OxI, like 2x2; got {text!r}") from None
    if outer < 1 or inner < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive; got {text!r}")
    return outer, inner


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` flags; defaults come from :class:`Config`."""
    d = Config()
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=d.strategy,
        help="ddp and fsdp span both axes; hsdp defers dp_outer (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="gloo: O*I local worker processes; sim: one process, SimMesh (default: %(default)s)",
    )
    parser.add_argument(
        "--mesh",
        type=_mesh_shape,
        default=(d.outer, d.inner),
        metavar="OxI",
        help="dp_outer x dp_inner sizes (default: 2x2)",
    )
    parser.add_argument(
        "--steps", type=_positive, default=d.steps, help="optimizer steps (default: %(default)s)"
    )
    parser.add_argument(
        "--microbatches",
        type=_positive,
        default=d.microbatches,
        help="microbatches per step (default: %(default)s)",
    )
    parser.add_argument(
        "--batch",
        type=_positive,
        default=d.batch,
        help="samples per rank per microbatch (default: %(default)s)",
    )
    parser.add_argument(
        "--hidden", type=_positive, default=d.hidden, help="MLP hidden width (default: %(default)s)"
    )
    parser.add_argument(
        "--lr", type=float, default=d.lr, help="SGD learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed for parameters and data (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed flags; 0 on PASS, 1 on FAIL or a failed worker."""
    cfg = Config(
        strategy=args.strategy,
        backend=args.backend,
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
