"""(B17) The hostile matrix of the layer-wise units and the module path.

Every case is a small function that uses the library as a user would (valid paths), or
misuses it, or raises in the middle of a step, or makes the ranks disagree. Each runs on a
``SimMesh`` (in this process; the cases that need ranks apart, the module path and the ranks
that disagree, only on gloo) and on 4 fresh gloo ranks (``fh.DistMesh(dm, timeout=6)``), in
the default validation mode and under ``fh.validation("strict")``. Each case states what the
README's contract says must happen; the harness records what did:

- ``ok``: every rank returned, and its result equals the dense ``torch`` reference (the
  gradient of the mean over ranks of each rank's loss, on the full weights, sharded as the
  library's result is); the ``*/into/*`` cases (issue 36: calls with other ``into=``,
  ``recompute=``, ``reshard_after_forward=`` on one model, run by
  ``functional_hsdp/tools/testing/into_problem.py``, which the tests share) compare every step and
  probe of the sequence with the same one made clean instead (fresh shards, a fresh
  ``MainGrad``, nothing run before), to 1e-6, and each step's collectives and layer runs with
  the clean step's;
- ``clear error``: every rank raised the same kind of error, not a ``CollectiveError`` (a
  library ``ValueError``/``TypeError``/``NotImplementedError``/``RuntimeError``, or the case's
  own exception, which must come through), or strict mode's ``errors.UnitsDiffer`` (a
  ``CollectiveError`` for a collective refused before it was issued, and a ``ValueError``
  naming the unit where the ranks differ);
- ``CollectiveError``: every rank still alive raised ``fh.CollectiveError``;
- ``silent wrong``: every rank returned, and a result differs from the reference;
- ``hang``: a rank had not answered when the case's outer wall-clock limit passed;
- ``crash``: a rank died (a signal: gloo's ``SIGABRT``) without being meant to;
- ``other``: anything else (some ranks raised and others returned, mixed errors, an error of
  torch's collectives that is not a ``CollectiveError``);
- ``leak``, beside the outcome: after the case ran once, it runs twice more (where every rank
  answered without a ``CollectiveError``, so that its ranks are still in step), and the live
  tensors (``gc.get_objects()``, after ``fh.clear_caches()``, which forgets what the library
  keeps by design and bounds, and ``gc.collect()``) or the models ``shard_module`` remembers
  grew after each of the two runs (something torch builds once shows after one run only).

A case of ranks that disagree that ends in a clear error on every rank is followed, on every
rank, by a clean step, which must equal the reference (else: ``silent wrong``).

Fresh ranks for every case and mode: 4 processes forked from the forkserver, which join one
gloo group (the rendezvous store is this process's) and answer through a pipe. A rank that has
answered stays alive until the case ends (so that a peer still in a collective is not let off
by a closed connection), and the outer limit ends it. ``functional_hsdp.mesh.launch.run`` is not
used: its agent stops every rank as soon as one raises or dies, which would hide what the
others do. (The tiny size, which the default test suite runs, runs its one gloo case, which
every rank answers, on the test module's pool of ranks instead.)

A test helper, imported by name (``hostile``: its gloo ranks import it so); its tests, the tiny
size by default and the whole matrix as an opt-in long run, are tests/units/test_hostile.py's.
"""

from __future__ import annotations

import copy
import fnmatch
import gc
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import optree
import torch

from bench import common as C

# the mesh's timeout: every wait of the library is bounded by it
MESH_TIMEOUT = 6.0
# a case's outer wall-clock limit on gloo (beyond it: a hang), its repeats' the same again
DEADLINE = 60.0
STALL = 10.0  # how long a stalling rank sleeps (beyond the mesh's timeout)
REPEATS = 2  # runs after the first, for the leak check
MODES = ("on", "strict")
WORLD, SHAPE, AXES = 4, (2, 2), ("dp_outer", "dp_inner")
M, B, D, UNITS = 2, 4, 8, 3  # microbatches, rows per microbatch, width, units
ODD = 1  # the rank that differs in the cases where ranks disagree
OUTCOMES = ("ok", "clear error", "CollectiveError", "silent wrong", "hang", "crash", "other")

SIZES = {
    # the default test suite's: valid cases on a SimMesh (one an issue-36 sequence, checked against
    # its clean step), ranks that disagree on gloo (seconds)
    "tiny": {
        "cases": [
            "units/valid/sequence-into",
            "units/into/probe_between_steps-untied",
            "units/diverge/order",
        ],
        "gloo": False,
    },
    "full": {"cases": None, "gloo": True},
}


# -- cases --------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str  # "<path>/<kind>/<what>"
    fn: Callable[[Ctx], Any]
    expect: dict[str, tuple[str, ...]]  # mode -> outcomes the README's contract allows
    what: str
    sim: bool = True  # also on a SimMesh
    victims: tuple[int, ...] = ()  # ranks meant to die or fail alone: not judged
    repeat: bool = True  # run again for the leak check (where the ranks are still in step)
    tol: float = 1e-5

    @property
    def path(self) -> str:
        return self.name.split("/")[0]

    @property
    def kind(self) -> str:
        return self.name.split("/")[1]


CASES: dict[str, Case] = {}


def case(name: str, what: str, expect="ok", strict=None, **kw) -> Callable:
    """Register the decorated function as case ``name``: ``expect`` the outcomes allowed in
    the default mode (one or a tuple), ``strict`` under validation('strict') (default: the
    same)."""
    on = (expect,) if isinstance(expect, str) else tuple(expect)
    st = on if strict is None else ((strict,) if isinstance(strict, str) else tuple(strict))

    def register(fn: Callable) -> Callable:
        assert name not in CASES, name
        CASES[name] = Case(name, fn, {"on": on, "strict": st}, what, **kw)
        return fn

    return register


class Expected(Exception):
    """A case's own exception (raised in the user's forward or backward): it must come
    through to the caller, unchanged, on every rank."""


class Check:
    """A case's result and the dense reference for it (this rank's local shards, or the
    stacked ranks' on a SimMesh); or, made by :meth:`measured`, the relative errors a case
    measured against its own reference."""

    def __init__(self, got: Any, want: Any, then_raise: BaseException | None = None):
        self.got, self.want, self.then_raise = got, want, then_raise
        self.errors: dict[str, float] | None = None

    @classmethod
    def measured(cls, errors: dict[str, float]) -> Check:
        """``{check: relative error}`` (a yes/no check is 0.0 or 1.0), which the case computed
        against its own reference (the ``*/into/*`` cases: the same step made clean)."""
        check = cls(None, None)
        check.errors = dict(errors)
        return check

    def error(self) -> tuple[float, str | None]:
        """The largest relative error, and the check it is of (None: the whole result)."""
        if self.errors is None:
            return _relative_error(self.got, self.want), None
        if not self.errors:
            return float("inf"), "no check ran"
        worst = max(self.errors, key=self.errors.__getitem__)
        return self.errors[worst], worst


class Ctx:
    """What a case runs with: the mesh, this rank (None on a SimMesh), the mode."""

    def __init__(self, mesh: Any, rank: int | None, mode: str):
        import functional_hsdp as fh

        self.mesh, self.rank, self.mode = mesh, rank, mode
        self.sim = bool(mesh.batch_shape)
        self.spec = fh.hsdp(mesh, *AXES)
        self.odd = rank == ODD

    def x(self, m: int, n: int = B) -> torch.Tensor:
        """This rank's microbatch ``m`` (every simulated rank's, stacked, on a SimMesh)."""
        if self.sim:
            return torch.stack([_x(r, m, n) for r in range(WORLD)]).view(*SHAPE, n, D)
        return _x(self.rank, m, n)


def _x(r: int, m: int, n: int = B) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1000 + 10 * r + m))


def _per_rank_loss(out: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """Each rank's loss (the mean of its squared outputs), summed over the simulated ranks
    (each rank's gradient is its own: the ranks are vmapped)."""
    return out.square().flatten(len(ctx.mesh.batch_shape)).mean(-1).sum()


def _layer(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"])


def _full(seed: int = 0, units: int = UNITS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(D, D, generator=gen) / 3, "b": torch.randn(D, generator=gen) / 3}
        for _ in range(units)
    ]


def _policy(dtype=torch.bfloat16):
    """Compute in ``dtype``, reduce and return in float32 (so that a unit with this policy
    and one without can follow each other)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(dtype, torch.float32, torch.float32)


def _orders(order_odd=None, n: int = UNITS) -> list[list[int]]:
    """Each rank's order of units: ``order_odd`` on rank ODD, 0, 1, ... elsewhere."""
    base = list(range(n))
    return [order_odd if (r == ODD and order_odd is not None) else base for r in range(WORLD)]


def _dense_grad(full: Any, loss: Callable, orders, mbs: list[int], n: int = B) -> Any:
    """The reference: the gradient of the mean over ranks of each rank's loss, summed over its
    microbatches ``mbs`` (each loss scaled by 1/M), on the dense full weights."""
    total = None
    for r in range(WORLD):
        for m in mbs:
            g = torch.func.grad(loss)(full, _x(r, m, n), orders[r])
            g = optree.tree_map(lambda t: t / (WORLD * M), g)
            total = g if total is None else optree.tree_map(torch.add, total, g)
    return total


def _dense_units_loss(full: list, x: torch.Tensor, order: list[int]) -> torch.Tensor:
    h = x
    for i in order:
        h = _layer(full[i], h)
    return h.square().mean()


class Units:
    """Three units of ``tanh(x @ w + b)`` (8 x 8): gathered blocks, their shards, a MainGrad."""

    def __init__(
        self,
        ctx: Ctx,
        *,
        into: bool = True,
        recompute: bool = False,
        reshard: bool = True,
        mp: Any = None,
        n: int = UNITS,
    ):
        import functional_hsdp as fh

        self.ctx, self.fh, self.n = ctx, fh, n
        self.tree_spec = [ctx.spec] * n
        self.full = _full(units=n)
        self.shards = fh.shard(self.full, self.tree_spec)
        self.mg = fh.MainGrad(self.tree_spec, like=self.full) if into else None
        self.block = self.make(recompute=recompute, reshard=reshard, mp=mp)

    def make(self, *, recompute=False, reshard=True, mp=None, into="same"):
        fh = self.fh
        mg = self.mg if into == "same" else into
        return fh.gathered(
            fh.per_rank(_layer, self.ctx.mesh),
            self.ctx.spec,
            into=mg,
            recompute=recompute,
            reshard_after_forward=reshard,
            mp_policy=mp,
        )

    def out(self, shards, x, order=None, blocks=None):
        if order is None and blocks is None:
            return self.fh.sequence(self.block, shards, x)
        h = x
        for i in order if order is not None else range(self.n):
            h = (blocks[i] if blocks is not None else self.block)(shards[i], h)
        return h

    def loss(self, order=None, blocks=None) -> Callable:
        return lambda s, x: _per_rank_loss(self.out(s, x, order, blocks), self.ctx) / M

    def loss_into(self, mg: Any) -> Callable:
        """The loss with every unit adding into ``mg``."""
        return self.loss(blocks=[self.make(into=mg)] * self.n)

    def want(self, order_odd=None, mbs=None, full=None) -> Any:
        g = _dense_grad(
            self.full if full is None else full,
            _dense_units_loss,
            _orders(order_odd, self.n),
            list(range(M)) if mbs is None else mbs,
        )
        return self.fh.shard(g, self.tree_spec)

    def step(self, api: str = "torch.func.grad", loss=None, declared: bool = True) -> Any:
        return _step(self, api, loss or self.loss(), declared)


def _step(pb: Any, api: str, loss: Callable, declared: bool) -> Any:
    """One step of M microbatches: the final gradient (cloned from the MainGrad, which is
    zeroed for the next step; or the pure path's reduce_grads result)."""
    fh, mg = pb.fh, pb.mg
    if mg is not None:
        for m, _last in fh.microbatches(M, into=mg if declared else None):
            _differentiate(api, lambda s, m=m: loss(s, pb.ctx.x(m)), pb.shards)
        mg.finish()
        got = optree.tree_map(torch.clone, mg.grads)
        mg.zero_grad()
        return got
    acc = None
    for m, last in fh.microbatches(M):
        g = _differentiate(api, lambda s, m=m: loss(s, pb.ctx.x(m)), pb.shards)
        acc = fh.reduce_grads(g, pb.tree_spec, last=last, acc=acc, at="gradient")
    return acc


def _differentiate(api: str, fn: Callable, shards: Any) -> Any:
    """The gradient of ``fn`` at ``shards`` by ``api`` (None where it went into a MainGrad by
    plain autograd)."""
    import functional_hsdp as fh

    if api == "torch.func.grad":
        return torch.func.grad(fn)(shards)
    if api == "fh.grad":
        return fh.grad(fn)(shards)
    if api == "fh.grad_and_value":
        return fh.grad_and_value(fn)(shards)[0]
    assert api == "autograd", api
    leaves = optree.tree_leaves(shards)
    for t in leaves:
        t.requires_grad_(True)
    try:
        fn(shards).backward()
        grads = [t.grad for t in leaves]
    finally:
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
    if any(g is None for g in grads):
        return None
    return optree.tree_unflatten(optree.tree_structure(shards), grads)


class Boom(torch.autograd.Function):
    """An identity whose backward raises the case's own exception."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    generate_vmap_rule = True

    @staticmethod
    def backward(ctx, g):
        raise Expected("boom in backward")

    @staticmethod
    def jvp(ctx, t):
        return t


def _failing(loss: Callable, where: str) -> Callable:
    """``loss`` that raises the case's own exception in its forward (after the units ran) or
    in its backward (before any unit's backward)."""

    def fn(s, x):
        value = loss(s, x)
        if where == "forward":
            raise Expected("boom in forward")
        return Boom.apply(value)

    return fn


# -- the module path ----------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Three Linear(8, 8) + tanh layers (the units) in ``self.order``, and a Linear head (the
    root)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(UNITS))
        self.head = torch.nn.Linear(D, D)
        self.order = list(range(UNITS))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return self.head(x)


class Module:
    """A ``Net`` through ``fh.shard_module`` (its layers the units) and ``fh.functional_call``,
    with a dense copy for the reference."""

    def __init__(self, ctx: Ctx, *, mp: Any = None, order_odd=None, into: bool = True):
        import functional_hsdp as fh

        self.ctx, self.fh = ctx, fh
        torch.manual_seed(0)
        self.model = Net()
        self.dense = copy.deepcopy(self.model)
        if ctx.odd and order_odd is not None:
            self.model.order = list(order_odd)
        self.order_odd = order_odd
        self.shards, self.tree_spec = fh.shard_module(
            self.model, ctx.spec, units=list(self.model.layers), mp_policy=mp
        )
        self.mg = fh.MainGrad(self.tree_spec, like=self.shards) if into else None

    def loss_into(self, mg: Any) -> Callable:
        return self.loss(into=mg)

    def loss(self, into="same", **kw) -> Callable:
        mg = self.mg if into == "same" else into
        fh, model, ctx = self.fh, self.model, self.ctx

        def fn(s, x):
            out = fh.functional_call(model, s, (x,), into=mg, **kw)
            return _per_rank_loss(out, ctx) / M

        return fn

    def want(self, mbs=None, full_of=None) -> Any:
        dense = self.dense
        params = full_of if full_of is not None else dict(dense.named_parameters())
        params = {k: v.detach() for k, v in params.items()}

        def loss(p, x, order):
            dense.order = order
            return torch.func.functional_call(dense, p, (x,)).square().mean()

        g = _dense_grad(
            params, loss, _orders(self.order_odd), list(range(M)) if mbs is None else mbs
        )
        tree = {
            key: {n: g[f"{key}.{n}" if key else n] for n in unit}
            for key, unit in self.shards.items()
        }
        return self.fh.shard(tree, self.tree_spec)

    def step(self, api: str = "fh.grad_and_value", loss=None, declared: bool = True) -> Any:
        return _step(self, api, loss or self.loss(), declared)


def _sgd(shards: Any, grads: Any, lr: float = 0.1) -> None:
    for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(grads)):
        p.sub_(lr * g)


def _stepped_full(pb: Units, grads_full: Any) -> list:
    return optree.tree_map(lambda p, g: p - 0.1 * g, pb.full, grads_full)


# ---- valid paths (the result must equal the dense reference) ----------------------------------


def _units_case(api: str, **kw) -> Callable:
    def fn(ctx: Ctx) -> Check:
        pb = Units(ctx, **kw)
        return Check(pb.step(api), pb.want())

    return fn


for _name, _api in (
    ("sequence-into", "torch.func.grad"),
    ("fhgrad-into", "fh.grad"),
    ("fhgrad_and_value-into", "fh.grad_and_value"),
    ("backward-into", "autograd"),
):
    case(
        f"units/valid/{_name}",
        f"gathered + sequence, into=MainGrad, microbatches(into=), {_api}",
    )(_units_case(_api))
case("units/valid/pure", "gathered + sequence, no into: torch.func.grad + reduce_grads(at=)")(
    _units_case("torch.func.grad", into=False)
)
case("units/valid/pure-fhgrad", "no into: fh.grad + reduce_grads(at='gradient')")(
    _units_case("fh.grad", into=False)
)
case("units/valid/recompute", "recompute=True, into=MainGrad")(
    _units_case("torch.func.grad", recompute=True)
)
case("units/valid/recompute-fhgrad", "recompute=True under fh.grad")(
    _units_case("fh.grad", recompute=True)
)
case("units/valid/no-reshard", "reshard_after_forward=False")(
    _units_case("torch.func.grad", reshard=False)
)
case("units/valid/mp-bf16", "mp_policy bf16 params, fp32 reduce", tol=3e-2)(
    _units_case("fh.grad", mp=_policy())
)


@case("units/valid/undeclared", "into=MainGrad, microbatches not declared: finish issues all")
def _(ctx):
    pb = Units(ctx)
    return Check(pb.step(declared=False), pb.want())


@case("units/valid/accumulate-at-gradient", "pure grads into mg.accumulate(at='gradient')")
def _(ctx):
    pb = Units(ctx, into=False)
    mg = pb.fh.MainGrad(pb.tree_spec, like=pb.full)
    for m, last in pb.fh.microbatches(M):
        g = torch.func.grad(pb.loss())(pb.shards, ctx.x(m))
        mg.accumulate(g, last=last, at="gradient")
    return Check(optree.tree_map(torch.clone, mg.grads), pb.want())


@case("units/valid/prefetch-other-block", "block A prefetches the unit block B runs next")
def _(ctx):
    pb = Units(ctx)
    first = pb.make()  # another block, gathering alike: it adopts the prefetch

    def loss(s, x):
        first.prefetch(s[1])
        h = first(s[0], x)
        pb.block.prefetch(s[2])
        h = pb.block(s[1], h)
        return _per_rank_loss(pb.block(s[2], h), ctx) / M

    return Check(pb.step(loss=loss), pb.want())


@case("units/valid/prefetch-unused", "a prefetch whose unit is never called (released)")
def _(ctx):
    pb = Units(ctx)
    other = Units(ctx, into=False)  # prefetched, never run

    def loss(s, x):
        pb.block.prefetch(other.shards[0])  # issued ahead by unit 0's forward, never used
        return pb.loss(order=list(range(UNITS)))(s, x)

    return Check(pb.step(loss=loss), pb.want())


@case("units/valid/two-steps", "two steps with SGD in place and zero_grad between")
def _(ctx):
    pb = Units(ctx)
    first = pb.step()
    _sgd(pb.shards, first)
    second = pb.step()
    stepped = _stepped_full(pb, _dense_grad(pb.full, _dense_units_loss, _orders(), [0, 1]))
    return Check(second, pb.want(full=stepped))


@case("units/valid/vmap", "per-sample gradients: vmap(grad) of the units, summed, reduced")
def _(ctx):
    pb = Units(ctx, into=False)
    fh = pb.fh
    acc = None
    for m, last in fh.microbatches(M):
        xs = ctx.x(m).movedim(-2, 0)  # samples first

        def loss(s, x):
            return _per_rank_loss(pb.out(s, x), ctx) / (M * B)

        per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(pb.shards, xs)
        g = optree.tree_map(lambda t: t.sum(0), per)
        acc = fh.reduce_grads(g, pb.tree_spec, last=last, acc=acc, at="gradient")
    return Check(acc, pb.want())


def _tangent() -> list:
    return _full(seed=7)


@case("units/valid/jvp", "forward mode: jvp through the units")
def _(ctx):
    pb = Units(ctx, into=False)
    t = pb.fh.shard(_tangent(), pb.tree_spec)
    _, tout = torch.func.jvp(lambda s: pb.out(s, ctx.x(0)), (pb.shards,), (t,))
    xs = [_x(r, 0) for r in range(WORLD)]
    dense = [
        torch.func.jvp(lambda f, x=x: _dense_units_loss_out(f, x), (pb.full,), (_tangent(),))[1]
        for x in xs
    ]
    want = torch.stack(dense).view(*SHAPE, B, D) if ctx.sim else dense[ctx.rank]
    return Check(tout, want)


def _dense_units_loss_out(full, x):
    h = x
    for i in range(UNITS):
        h = _layer(full[i], h)
    return h


@case("units/valid/hvp", "second order: jvp of grad (a Hessian-vector product)")
def _(ctx):
    pb = Units(ctx, into=False)
    t = pb.fh.shard(_tangent(), pb.tree_spec)
    loss = lambda s: pb.loss()(s, ctx.x(0)) * M  # noqa: E731
    _, hv = torch.func.jvp(torch.func.grad(loss), (pb.shards,), (t,))
    got = pb.fh.reduce_grads(hv, pb.tree_spec, last=True, at="gradient")

    def mean_loss(full):
        return sum(_dense_units_loss(full, _x(r, 0), list(range(UNITS))) for r in range(WORLD)) / 4

    want = torch.func.jvp(torch.func.grad(mean_loss), (pb.full,), (_tangent(),))[1]
    return Check(got, pb.fh.shard(want, pb.tree_spec))


def _module_case(api: str, *, into: bool = True, mp=None, **kw) -> Callable:
    def fn(ctx: Ctx) -> Check:
        pb = Module(ctx, mp=mp, into=into)
        return Check(pb.step(api, loss=pb.loss(**kw)), pb.want())

    return fn


case("module/valid/into", "functional_call(into=mg) under fh.grad_and_value", sim=False)(
    _module_case("fh.grad_and_value")
)
case("module/valid/funcgrad", "functional_call(into=mg) under torch.func.grad", sim=False)(
    _module_case("torch.func.grad")
)
case("module/valid/pure", "functional_call without into + reduce_grads(at=)", sim=False)(
    _module_case("torch.func.grad", into=False)
)
case("module/valid/recompute", "functional_call(recompute=True)", sim=False)(
    _module_case("fh.grad", recompute=True)
)
case("module/valid/no-reshard", "functional_call(reshard_after_forward=False)", sim=False)(
    _module_case("fh.grad", reshard_after_forward=False)
)
case("module/valid/mp-bf16", "shard_module(mp_policy=bf16)", sim=False, tol=3e-2)(
    _module_case("fh.grad", mp=_policy())
)
case("module/valid/backward", "functional_call, plain .backward() into mg", sim=False)(
    _module_case("autograd")
)


@case("module/valid/two-steps", "two steps with SGD in place", sim=False)
def _(ctx):
    pb = Module(ctx)
    first = pb.step()
    _sgd(pb.shards, first)
    second = pb.step()
    dense = {k: v.detach() for k, v in pb.dense.named_parameters()}

    def loss(p, x, order):
        pb.dense.order = order
        return torch.func.functional_call(pb.dense, p, (x,)).square().mean()

    g = _dense_grad(dense, loss, _orders(), [0, 1])
    stepped = {k: dense[k] - 0.1 * g[k] for k in dense}
    return Check(second, pb.want(full_of=stepped))


@case("module/valid/vmap", "per-sample gradients through functional_call", sim=False)
def _(ctx):
    pb = Module(ctx, into=False)
    fh = pb.fh
    acc, loss = None, pb.loss(into=None)

    def one(s, x):  # one sample's loss
        return loss(s, x[None]) / B

    for m, last in fh.microbatches(M):
        per = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(
            pb.shards, ctx.x(m).movedim(-2, 0)
        )
        g = optree.tree_map(lambda t: t.sum(0), per)
        acc = fh.reduce_grads(g, pb.tree_spec, last=last, acc=acc, at="gradient")
    return Check(acc, pb.want())


# ---- misuse (a clear error on every rank, naming what is wrong) -------------------------------


def _misuse(name: str, what: str, **kw) -> Callable:
    return case(name, what, expect="clear error", **kw)


def _steps(pb: Any, ctx: Ctx, n: int = 1) -> None:
    """``n`` steps of M microbatches into the MainGrad, each finished (no zero_grad)."""
    for _ in range(n):
        for m, _last in pb.fh.microbatches(M, into=pb.mg):
            pb.fh.grad(pb.loss())(pb.shards, ctx.x(m))
        pb.mg.finish()


def _misuse_vmap(pb, ctx):
    xs = ctx.x(0).movedim(-2, 0)  # per sample
    torch.func.vmap(torch.func.grad(pb.loss()), in_dims=(None, 0))(pb.shards, xs)


def _misuse_jvp(pb, ctx):
    t = optree.tree_map(torch.ones_like, pb.shards)
    torch.func.jvp(lambda s: pb.loss()(s, ctx.x(0)), (pb.shards,), (t,))


def _misuse_grad_of_grad(pb, ctx):
    g = torch.func.grad(lambda s: pb.loss()(s, ctx.x(0)))
    torch.func.grad(lambda s: sum(t.sum() for t in optree.tree_leaves(g(s))))(pb.shards)


def _misuse_second_backward(pb, ctx):
    for t in optree.tree_leaves(pb.shards):
        t.requires_grad_(True)
    pb.mg.begin_microbatch(last=False)
    loss = pb.loss()(pb.shards, ctx.x(0))
    loss.backward(retain_graph=True)
    loss.backward()


def _misuse_foreign(pb, ctx):
    torch.func.grad(pb.loss())(optree.tree_map(torch.clone, pb.shards), ctx.x(0))


def _misuse_other_maingrad(pb, ctx):
    other = pb.fh.MainGrad([ctx.spec] * 2, like=_full(units=2))
    torch.func.grad(pb.loss_into(other))(pb.shards, ctx.x(0))


for _name, _what, _body in (
    ("vmap-into", "vmap(grad) with into=MainGrad", _misuse_vmap),
    ("jvp-into", "jvp with into=MainGrad", _misuse_jvp),
    ("grad-of-grad-into", "grad of grad with into=MainGrad", _misuse_grad_of_grad),
    ("second-backward", "a second .backward() (recompute=False)", _misuse_second_backward),
    ("foreign-shards", "clones of the shards with into=MainGrad", _misuse_foreign),
    ("other-maingrad", "into= a MainGrad made for another tree", _misuse_other_maingrad),
    (
        "forgot-zero-grad",
        "a second step without mg.zero_grad()",
        lambda pb, ctx: _steps(pb, ctx, 2),
    ),
    ("finish-twice", "mg.finish() twice", lambda pb, ctx: (_steps(pb, ctx), pb.mg.finish())),
):
    for _path, _make in (("units", Units), ("module", Module)):
        _misuse(f"{_path}/misuse/{_name}", _what, sim=_path == "units")(
            lambda ctx, make=_make, body=_body: body(make(ctx), ctx)
        )


@_misuse("units/misuse/finish-empty", "mg.finish() with nothing accumulated")
def _(ctx):
    Units(ctx).mg.finish()


@_misuse("units/misuse/bad-prefetch", "prefetch of a tree that is not a unit's shards")
def _(ctx):
    pb = Units(ctx)
    bad = {"w": torch.zeros((*ctx.mesh.batch_shape, 5))}

    def loss(s, x):
        pb.block.prefetch(bad)
        return pb.loss()(s, x)

    torch.func.grad(loss)(pb.shards, ctx.x(0))


@_misuse("units/misuse/mixed-shards", "a unit given one leaf of unit 0 and one of unit 1")
def _(ctx):
    pb = Units(ctx)
    s = pb.shards
    mixed = {"w": s[0]["w"], "b": s[1]["b"]}
    torch.func.grad(lambda m, x: _per_rank_loss(pb.block(m, x), ctx))(mixed, ctx.x(0))


@_misuse("units/misuse/wrong-shape", "a unit's shards of another shape (pure)")
def _(ctx):
    pb = Units(ctx, into=False)
    bad = {"w": torch.zeros((*ctx.mesh.batch_shape, 3)), "b": pb.shards[0]["b"]}
    torch.func.grad(lambda m, x: _per_rank_loss(pb.block(m, x), ctx))(bad, ctx.x(0))


@_misuse("units/misuse/after-last", "a unit's gradient after its deferred reduction started")
def _(ctx):
    pb = Units(ctx)
    pb.mg.begin_microbatch(last=True)
    for m in range(M):  # two backward passes after one last=True
        torch.func.grad(pb.loss())(pb.shards, ctx.x(m))


def _module_misuse(name: str, what: str, **kw) -> Callable:
    return _misuse(name, what, sim=False, **kw)


def _call_with(ctx, edit: Callable) -> None:
    pb = Module(ctx, into=False)
    shards = {k: dict(v) for k, v in pb.shards.items()}
    edit(shards)
    pb.loss(into=None)(shards, ctx.x(0))  # no transform: functional_call's own checks


@_module_misuse("module/misuse/missing-param", "functional_call: a unit's shards lack 'bias'")
def _(ctx):
    _call_with(ctx, lambda s: s["layers.1"].pop("bias"))


@_module_misuse("module/misuse/extra-param", "functional_call: a unit's shards have an extra")
def _(ctx):
    _call_with(ctx, lambda s: s["layers.1"].update(extra=torch.zeros(3)))


@_module_misuse("module/misuse/wrong-shape", "functional_call: a shard of another shape")
def _(ctx):
    _call_with(ctx, lambda s: s["layers.1"].update(bias=torch.zeros(3)))


@_module_misuse("module/misuse/not-a-tensor", "functional_call: a shard that is not a tensor")
def _(ctx):
    _call_with(ctx, lambda s: s["layers.1"].update(bias=[0.0] * 4))


@_module_misuse("module/misuse/wrong-dtype", "functional_call: a shard in float64")
def _(ctx):
    _call_with(ctx, lambda s: s["layers.1"].update(bias=s["layers.1"]["bias"].double()))


@_module_misuse("module/misuse/missing-unit", "functional_call: the shards lack a unit")
def _(ctx):
    _call_with(ctx, lambda s: s.pop("layers.2"))


@_module_misuse("module/misuse/mixed-shards", "a unit's weight replaced by another unit's")
def _(ctx):
    pb = Module(ctx)
    shards = {k: dict(v) for k, v in pb.shards.items()}
    shards["layers.1"]["weight"] = pb.shards["layers.0"]["weight"]
    torch.func.grad(pb.loss())(shards, ctx.x(0))


@_module_misuse("module/misuse/outside-call", "the sharded model called directly")
def _(ctx):
    Module(ctx).model(ctx.x(0))


@_module_misuse("module/misuse/shard-twice", "shard_module twice on one model")
def _(ctx):
    pb = Module(ctx)
    pb.fh.shard_module(pb.model, ctx.spec, units=list(pb.model.layers))


@_module_misuse("module/misuse/unsharded", "functional_call on a model never sharded")
def _(ctx):
    import functional_hsdp as fh

    pb = Module(ctx)
    fh.functional_call(Net(), pb.shards, (ctx.x(0),))


# ---- exceptions in the user's forward or backward: the error comes through on every rank, ----
# ---- nothing is kept, and the next step equals a clean one ------------------------------------


TRANSFORMS = ("vmap", "jvp", "hvp")  # the composable path's


def _run(how: str, loss: Callable, shards: Any, x: torch.Tensor) -> None:
    """``loss`` differentiated by ``how``: a first-order API, or a transform of the
    composable path (per-sample gradients, forward mode, a Hessian-vector product)."""
    if how not in TRANSFORMS:
        _differentiate(how, lambda s: loss(s, x), shards)
    elif how == "vmap":
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(shards, x.movedim(-2, 0))
    else:
        t = optree.tree_map(torch.ones_like, shards)
        f = (lambda s: loss(s, x)) if how == "jvp" else torch.func.grad(lambda s: loss(s, x))
        torch.func.jvp(f, (shards,), (t,))


def _raises(path: str, where: str, how: str, into: bool) -> Callable:
    """The user's forward or backward raises after the units ran, differentiated by ``how``;
    then a clean step."""

    def fn(ctx: Ctx) -> Check:
        pb = (Units if path == "units" else Module)(ctx, into=into)
        if pb.mg is not None:
            pb.mg.begin_microbatch(last=False)
        raised = None
        try:
            _run(how, _failing(pb.loss(), where), pb.shards, ctx.x(0))
        except Expected as exc:
            raised = exc
        if pb.mg is not None:
            pb.mg.zero_grad()
        got = pb.step("fh.grad" if how in TRANSFORMS else how)  # the next step, clean
        return Check(got, pb.want(), then_raise=raised or AssertionError("nothing raised"))

    return fn


_APIS = {
    "torch.func.grad": "funcgrad",
    "fh.grad": "fhgrad",
    "fh.grad_and_value": "fhgrad_and_value",
    "autograd": "backward",
}
_RAISES = [
    *(
        (f"{w}-{short}", w, api, True)
        for w in ("forward", "backward")
        for api, short in _APIS.items()
    ),
    ("forward-pure", "forward", "fh.grad", False),
    ("vmap-forward", "forward", "vmap", False),
    ("vmap-backward", "backward", "vmap", False),
    ("jvp-forward", "forward", "jvp", False),
    ("hvp-backward", "backward", "hvp", False),
]
for _path in ("units", "module"):
    for _name, _where, _how, _into in _RAISES:
        case(
            f"{_path}/exception/{_name}",
            f"{_where} raises after the units ran, under {_how}"
            + (" (into=mg)" if _into else "")
            + ", then a clean step",
            expect="clear error",
            sim=_path == "units",
        )(_raises(_path, _where, _how, _into))


@case("units/release/forward-only", "a forward whose backward never comes, then a step")
def _(ctx):
    pb = Units(ctx)
    for t in optree.tree_leaves(pb.shards):
        t.requires_grad_(True)
    pb.loss()(pb.shards, ctx.x(0))  # dropped
    for t in optree.tree_leaves(pb.shards):
        t.requires_grad_(False)
    return Check(pb.step(), pb.want())


@case("module/release/forward-only", "functional_call whose backward never comes", sim=False)
def _(ctx):
    pb = Module(ctx)
    for t in optree.tree_leaves(pb.shards):
        t.requires_grad_(True)
    pb.loss()(pb.shards, ctx.x(0))
    for t in optree.tree_leaves(pb.shards):
        t.requires_grad_(False)
    return Check(pb.step(), pb.want())


# ---- calls with other options on one model (issue 36): each sequence equals the same ---------
# ---- steps and probes made clean (fresh shards, a fresh MainGrad, nothing run before) ---------

# the sequences of functional_hsdp/tools/testing/into_problem.py (shared with
# tests/units/test_into*.py)
INTO_SEQUENCES = {
    "probe_before_first_step": "a gradient without into= (a probe), then a step into mg",
    "probe_between_steps": "a step, zero_grad, a probe without into=, a step",
    "new_maingrad": "a step into mg, then a step into a new MainGrad (mg keeps its step)",
    "two_maingrads_interleaved": "two MainGrads (two losses), each microbatch into both",
    "eval_between_steps": "a step, zero_grad, an eval forward under no_grad, a step",
    "options_alternate": "steps with recompute / reshard_after_forward flipped each call, "
    "each followed by a probe with the other options",
}
INTO_MODELS = {  # path -> model -> what
    "module": {
        "untied": "nn.Embedding root, untied Linear head, 3 layer units; functional_call",
        "tied": "nn.Embedding root, head tied to it, 3 layer units; functional_call",
        "units": "no root: embedding, 3 layers, head each a unit; functional_call",
    },
    "units": {
        "untied": "gathered blocks: embedding unit (kept), 3 layers by fh.sequence (prefetch), "
        "untied head",
        "tied": "gathered blocks: embedding unit (kept), 3 layers by fh.sequence, tied head",
        "whole": "the whole model one gathered unit",
    },
}


def _into_make(ctx: Ctx, path: str, model: str) -> Callable:
    """A maker of fresh models (into_problem's ``Model``) of ``path`` and ``model``."""
    from functional_hsdp.tools.testing import into_problem as ip

    if path == "module":
        tied, root = model == "tied", model != "units"
        return lambda: ip.module_model(ctx.spec, tied, root=root)
    return lambda: ip.blocks_model(ctx.spec, model == "tied", whole=model == "whole")


def _into_case(path: str, model: str, sequence: str, grad: str) -> Callable:
    """``sequence`` with recompute off, then on: every check against its clean reference."""

    def fn(ctx: Ctx) -> Check:
        from functional_hsdp.tools.testing import into_problem as ip

        make, errors = _into_make(ctx, path, model), {}
        for recompute in (False, True):
            got = ip.run(sequence, make, ctx.mesh, grad=grad, recompute=recompute)
            errors.update({f"recompute={recompute}: {k}": v for k, v in got.items()})
        return Check.measured(errors)

    return fn


INTO_TOL = 1e-6  # the issue's: exact to 1e-6 against the clean step
for _path, _models in INTO_MODELS.items():
    for _model, _model_what in _models.items():
        for _seq, _seq_what in INTO_SEQUENCES.items():
            case(
                f"{_path}/into/{_seq}-{_model}",
                f"{_seq_what}; {_model_what}; fh.grad, recompute off and on",
                sim=_path == "units",
                tol=INTO_TOL,
            )(_into_case(_path, _model, _seq, "fh.grad"))
    for _seq in ("probe_between_steps", "new_maingrad"):
        case(
            f"{_path}/into/{_seq}-tied-funcgrad",
            f"{INTO_SEQUENCES[_seq]}; {_models['tied']}; torch.func.grad, recompute off and on",
            sim=_path == "units",
            tol=INTO_TOL,
        )(_into_case(_path, "tied", _seq, "torch.func.grad"))


def _into_finished(path: str) -> Callable:
    """A step into ``mg``, then a backward into ``mg`` again without ``zero_grad()``: a
    ValueError that names the MainGrad (where it was made) and the call (its unit); then
    ``zero_grad()`` and a step, which must equal the same step made clean."""

    def fn(ctx: Ctx) -> Check:
        from functional_hsdp.tools.testing import into_problem as ip

        make = _into_make(ctx, path, "untied")
        clean = make()  # first: nothing run before it
        clean_mg = clean.maingrad()
        want = ip.step(clean.loss(clean_mg), clean.shards, clean_mg, mesh=ctx.mesh)
        model = make()
        mg = model.maingrad()  # the error must point here
        made = f"made at {__file__}:{sys._getframe().f_lineno - 1}"
        ip.step(model.loss(mg), model.shards, mg, mesh=ctx.mesh)
        try:
            ip.GRADS["fh.grad"](model.loss(mg))(model.shards, ip.mesh_batches(ctx.mesh)[0])
        except ValueError as exc:
            raised = exc
        else:
            raise AssertionError("a backward into a finished MainGrad: nothing raised")
        text = str(raised)
        for part in ("MainGrad(", made, "whose step is finished", "the backward of the unit "):
            if part not in text:  # a ValueError, but not the one that names both
                raise AssertionError(f"the error does not say {part!r}: {text}")
        mg.zero_grad()
        got = ip.step(model.loss(mg), model.shards, mg, mesh=ctx.mesh)
        return Check(got, want, then_raise=raised)

    return fn


for _path in INTO_MODELS:
    case(
        f"{_path}/into/finished-maingrad",
        "a backward into a finished MainGrad (no zero_grad): a ValueError naming the "
        "MainGrad and the call, then zero_grad and a step equal to a clean one",
        expect="clear error",
        sim=_path == "units",
        tol=INTO_TOL,
    )(_into_finished(_path))


# ---- ranks that disagree (gloo only): caught on every rank before the optimizer step ----------


def _diverge(name: str, what: str, on, strict=None, clean_after=True, **kw) -> Callable:
    """A case of ranks that disagree; ``clean_after``: where every rank raised a clear error,
    a clean step follows on every rank, and must equal the reference (nothing of the stopped
    step is left to change it)."""
    register = case(name, what, expect=on, strict=strict, sim=False, **kw)
    if not clean_after:
        return register
    return lambda fn: register(_then_clean(fn, name.split("/")[0]))


def _then_clean(fn: Callable, path: str) -> Callable:
    def run(ctx: Ctx) -> Any:
        try:
            return fn(ctx)
        except ValueError as exc:
            clean = Units(ctx) if path == "units" else Module(ctx)
            try:
                got = clean.step()
            except Exception as later:  # noqa: BLE001 - reported as the case's outcome
                raise AssertionError(
                    f"the clean step after '{str(exc)[:80]}' failed: "
                    f"{type(later).__name__}: {later}"
                ) from None
            return Check(got, clean.want(), then_raise=exc)

    return run


ERR, COLL, CRASH = "clear error", "CollectiveError", "crash"
# what the README says of a unit skipped, or gathered in a dtype of another width, on one rank
# in the default mode: a CollectiveError within the timeout, or gloo aborts one rank
MISMATCHED = (COLL, ERR, CRASH)


def _units_order(ctx, api="torch.func.grad", into=True):
    pb = Units(ctx, into=into)
    order = [0, 2, 1] if ctx.odd else [0, 1, 2]
    return Check(pb.step(api, loss=pb.loss(order=order)), pb.want(order_odd=[0, 2, 1]))


_diverge("units/diverge/order", "rank 1 runs units 0, 2, 1", ERR)(_units_order)
_diverge("units/diverge/order-pure", "rank 1 runs units 0, 2, 1; pure path", ERR)(
    lambda ctx: _units_order(ctx, into=False)
)
_diverge("units/diverge/order-fhgrad", "rank 1 runs units 0, 2, 1; fh.grad", ERR)(
    lambda ctx: _units_order(ctx, api="fh.grad")
)


@_diverge("units/diverge/skip", "rank 1 skips unit 1", MISMATCHED, ERR)
def _(ctx):
    pb = Units(ctx)
    order = [0, 2] if ctx.odd else [0, 1, 2]
    return Check(pb.step(loss=pb.loss(order=order)), pb.want(order_odd=[0, 2]))


def _blocks_odd(pb: Units, ctx: Ctx, **odd_kw) -> list:
    """Unit 1's block made with ``odd_kw`` on rank ODD, as the others' elsewhere."""
    other = pb.make(**odd_kw) if ctx.odd else pb.block
    return [pb.block, other, pb.block]


@_diverge("units/diverge/dtype-width", "unit 1 in bf16 on rank 1, fp32 elsewhere", MISMATCHED, ERR)
def _(ctx):
    pb = Units(ctx)
    blocks = _blocks_odd(pb, ctx, mp=_policy())
    return Check(pb.step(loss=pb.loss(blocks=blocks)), pb.want())


@_diverge("units/diverge/dtype-same-width", "unit 1 in fp16 on rank 1, bf16 elsewhere", ERR)
def _(ctx):
    pb = Units(ctx)
    fp16, bf16 = pb.make(mp=_policy(torch.float16)), pb.make(mp=_policy())
    blocks = [pb.block, fp16 if ctx.odd else bf16, pb.block]
    return Check(pb.step(loss=pb.loss(blocks=blocks)), pb.want())


@_diverge("units/diverge/recompute", "unit 1 with recompute=True on rank 1 only", ERR)
def _(ctx):
    pb = Units(ctx)
    blocks = _blocks_odd(pb, ctx, recompute=True)
    return Check(pb.step(loss=pb.loss(blocks=blocks)), pb.want())


@_diverge(
    "units/diverge/reshard", "unit 1 reshard_after_forward=False on rank 1 only", (COLL, ERR), ERR
)
def _(ctx):
    pb = Units(ctx)
    blocks = _blocks_odd(pb, ctx, reshard=False)
    return Check(pb.step(loss=pb.loss(blocks=blocks)), pb.want())


@_diverge("units/diverge/order-vmap", "rank 1 runs units 0, 2, 1 under vmap(grad)", ERR)
def _(ctx):
    pb = Units(ctx, into=False)
    order = [0, 2, 1] if ctx.odd else [0, 1, 2]
    acc = None
    for m, last in pb.fh.microbatches(M):

        def loss(s, x):
            return _per_rank_loss(pb.out(s, x, order=order), ctx) / (M * B)

        per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(
            pb.shards, ctx.x(m).movedim(-2, 0)
        )
        g = optree.tree_map(lambda t: t.sum(0), per)
        acc = pb.fh.reduce_grads(g, pb.tree_spec, last=last, acc=acc, at="gradient")
    return Check(acc, pb.want(order_odd=[0, 2, 1]))


def _loop(
    ctx,
    pb,
    *,
    n_odd=M,
    finish_early=False,
    last_flag=True,
    stall=False,
    die=False,
    raise_alone=False,
    api="torch.func.grad",
    loss=None,
):
    """A step in which rank ODD misbehaves as told (the others run it as they should)."""
    loss = loss or pb.loss()
    n = n_odd if ctx.odd else M
    for m in range(n):
        if ctx.odd and m == 1:
            if stall:
                time.sleep(STALL)
            if die:
                os._exit(3)
            if finish_early:
                break
        last = m == n - 1
        pb.mg.begin_microbatch(last=last and (last_flag or not ctx.odd))
        fn = _failing(loss, "forward") if (raise_alone and ctx.odd and m == 1) else loss
        _differentiate(api, lambda s, m=m, fn=fn: fn(s, ctx.x(m)), pb.shards)
    pb.mg.finish()  # its agreement checks the step's unit calls too
    return Check(optree.tree_map(torch.clone, pb.mg.grads), pb.want())


def _faults(path: str) -> None:
    make = Units if path == "units" else Module
    api = "torch.func.grad" if path == "units" else "fh.grad_and_value"
    for name, what, kw, extra in (
        ("finish-early", "rank 1 finishes after its first microbatch", {"finish_early": True}, {}),
        ("no-last-flag", "rank 1 never declares the last microbatch", {"last_flag": False}, {}),
        ("more-microbatches", "rank 1 runs 3 microbatches, the others 2", {"n_odd": 3}, {}),
        ("stall", f"rank 1 sleeps {STALL:.0f} s mid-step", {"stall": True}, {"repeat": False}),
        ("dies", "rank 1 exits mid-step", {"die": True}, {"victims": (ODD,), "repeat": False}),
        (
            "raises-alone",
            "rank 1's forward raises, the others' not",
            {"raise_alone": True},
            {"victims": (ODD,), "repeat": False},
        ),
    ):
        # strict agrees on every begin_microbatch: a rank that declares otherwise (no last
        # microbatch, another count, a finish after the first) is refused at once
        declared = name in ("finish-early", "no-last-flag", "more-microbatches")
        strict = (ERR,) if declared else None
        _diverge(f"{path}/diverge/{name}", what, (COLL, ERR), strict, clean_after=False, **extra)(
            lambda ctx, kw=kw: _loop(ctx, make(ctx), api=api, **kw)
        )


_faults("units")
_faults("module")


@_diverge(
    "units/diverge/no-last-flag-2-units",
    "as no-last-flag, 2 units (their deferred all-reduces within MainGrad's depth of 2: "
    "nobody waits in backward)",
    (COLL, ERR),
    (ERR,),
    clean_after=False,
)
def _(ctx):
    return _loop(ctx, Units(ctx, n=2), last_flag=False)


@_diverge("units/diverge/skip-vmap", "rank 1 skips unit 1 under vmap(grad)", MISMATCHED, ERR)
def _(ctx):
    pb = Units(ctx, into=False)
    order = [0, 2] if ctx.odd else [0, 1, 2]
    per = torch.func.vmap(
        torch.func.grad(lambda s, x: _per_rank_loss(pb.out(s, x, order=order), ctx) / (M * B)),
        in_dims=(None, 0),
    )(pb.shards, ctx.x(0).movedim(-2, 0))
    g = optree.tree_map(lambda t: t.sum(0), per)
    got = pb.fh.reduce_grads(g, pb.tree_spec, last=True, at="gradient")
    return Check(got, pb.want(order_odd=[0, 2], mbs=[0]))


@_diverge("module/diverge/recompute", "functional_call(recompute=True) on rank 1 only", ERR)
def _(ctx):
    pb = Module(ctx)
    return Check(pb.step(loss=pb.loss(recompute=ctx.odd)), pb.want())


@_diverge("module/diverge/reshard", "reshard_after_forward=False on rank 1 only", (COLL, ERR), ERR)
def _(ctx):
    pb = Module(ctx)
    return Check(pb.step(loss=pb.loss(reshard_after_forward=not ctx.odd)), pb.want())


@_diverge("module/diverge/order", "rank 1's model runs its layers 0, 2, 1", ERR)
def _(ctx):
    pb = Module(ctx, order_odd=[0, 2, 1])
    return Check(pb.step(), pb.want())


@_diverge("module/diverge/skip", "rank 1's model skips layer 1", MISMATCHED, ERR)
def _(ctx):
    pb = Module(ctx, order_odd=[0, 2])
    return Check(pb.step(), pb.want())


@_diverge(
    "module/diverge/dtype-width", "shard_module(mp_policy=bf16) on rank 1 only", MISMATCHED, ERR
)
def _(ctx):
    pb = Module(ctx, mp=_policy() if ctx.odd else None)
    return Check(pb.step(), pb.want())


# -- running a case -----------------------------------------------------------------------------


def _live() -> tuple[int, int, int]:
    """(live tensors, their bytes, models shard_module remembers), after ``fh.clear_caches()``
    (what the library keeps by design, bounded: the last forward's kept weights, up to 4
    unused prefetches, cached plans; see the README's "Nothing is held for you") and a
    collection."""
    import functional_hsdp as fh
    from functional_hsdp.units import module

    fh.clear_caches()
    gc.collect()
    count = nbytes = 0
    with warnings.catch_warnings():  # isinstance on every object touches deprecated modules
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        count += 1
        try:
            nbytes += t.numel() * t.element_size()
        except (NotImplementedError, RuntimeError):  # a functorch wrapper: 1
            nbytes += 1
    return count, nbytes, len(module._SHARDED)


def _relative_error(got: Any, want: Any) -> float:
    a, b = optree.tree_leaves(got), optree.tree_leaves(want)
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        x, y = x.detach().double(), y.detach().double()
        scale = max(float(y.abs().max()) if y.numel() else 0.0, 1e-6)
        worst = max(worst, float((x - y).abs().max()) / scale if x.numel() else 0.0)
    return worst


def _once(c: Case, ctx: Ctx) -> dict:
    """Run the case once: what this rank saw."""
    import functional_hsdp as fh
    from functional_hsdp.base.errors import UnitsDiffer

    start = time.monotonic()
    try:
        with fh.validation(ctx.mode):
            res = c.fn(ctx)
        err, worst = res.error() if isinstance(res, Check) else (None, None)
        if isinstance(res, Check) and res.then_raise is not None and err is not None:
            if err <= c.tol:  # the next step was clean: what counts is the error raised
                raise res.then_raise
        return {"kind": "ok", "err": err, "worst": worst, "elapsed": time.monotonic() - start}
    except Exception as exc:  # what the case is about
        return {
            "kind": "error",
            "type": type(exc).__name__,
            # strict mode's refusal of differing unit collectives (a CollectiveError that is
            # also the cross-rank check's ValueError, naming the unit): a clear error
            "collective": isinstance(exc, fh.CollectiveError) and not isinstance(exc, UnitsDiffer),
            "expected": isinstance(exc, Expected),
            "msg": str(exc),
            "elapsed": time.monotonic() - start,
        }


def _repeat(c: Case, ctx: Ctx, before: tuple[int, int, int]) -> dict:
    """Run the case REPEATS times more, measuring after each: what every run added (the leak
    check). A leak grows with every run; something made once (a lazily built buffer of
    torch's) shows in one run only."""
    growth = []
    for _ in range(REPEATS):
        _once(c, ctx)
        after = _live()
        growth.append([a - b for a, b in zip(after, before)])
        before = after
    return {key: min(g[i] for g in growth) for i, key in enumerate(("tensors", "bytes", "models"))}


def _sim(c: Case, mode: str) -> dict:
    """The case on a SimMesh, in this process."""
    import functional_hsdp as fh

    ctx = Ctx(fh.SimMesh(dict(zip(AXES, SHAPE))), None, mode)
    first = _once(c, ctx)
    held = _live()
    leak = _repeat(c, ctx, held) if c.repeat and not first.get("collective") else None
    return {
        "replies": {0: first},
        "dead": {},
        "missing": [],
        "leak": {0: leak} if leak else {},
        "sim": True,
    }


def _rank_main(rank: int, port: int, conn, name: str, mode: str, log: str) -> None:
    """A gloo rank of one case: run it, answer, run it again if told, answer, wait. Its
    stderr (a crash's report: gloo's message, the Python stacks) goes to ``log``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import functional_hsdp as fh
    from functional_hsdp.mesh import launch

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    launch.prepare_worker()
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    # the groups' own timeout is long: the library's waits are bounded by the mesh's
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    dm = init_device_mesh("cpu", SHAPE, mesh_dim_names=AXES)
    dist.barrier()
    ctx = Ctx(fh.DistMesh(dm, timeout=MESH_TIMEOUT), rank, mode)
    c = CASES[name]
    first = _once(c, ctx)
    held = _live()
    conn.send(first)
    if conn.recv() == "repeat":
        conn.send(_repeat(c, ctx, held))
    time.sleep(3600)  # stay: a peer still in a collective must not be let off; killed


def _collect(procs, conns, wanted: set[int], deadline: float) -> tuple[dict, dict, list]:
    """Replies of the ranks in ``wanted`` until each replied or died, or the deadline."""
    replies, end = {}, time.monotonic() + deadline
    waiting = set(wanted)
    while waiting and time.monotonic() < end:
        objs = [conns[r] for r in waiting] + [procs[r].sentinel for r in waiting]
        multiprocessing.connection.wait(objs, timeout=min(0.5, max(0.0, end - time.monotonic())))
        for r in list(waiting):
            if conns[r].poll():
                try:
                    replies[r] = conns[r].recv()
                    waiting.discard(r)
                    continue
                except EOFError:
                    pass
            if not procs[r].is_alive():
                waiting.discard(r)
    dead = {r: procs[r].exitcode for r in wanted if r not in replies and not procs[r].is_alive()}
    missing = sorted(set(wanted) - set(replies) - set(dead))
    return replies, dead, missing


def _gloo(c: Case, mode: str) -> dict:
    """The case on 4 fresh gloo ranks."""
    import torch.distributed as dist

    from functional_hsdp.mesh import launch

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    mp = multiprocessing.get_context("forkserver")
    procs, conns = [], []
    logs = tempfile.mkdtemp(prefix="fh_hostile_")
    C._note_worker_library()
    try:
        with launch.starting_workers((*C.PRELOAD, "hostile")):
            for r in range(WORLD):
                here, there = mp.Pipe()
                p = mp.Process(
                    target=_rank_main,
                    args=(r, store.port, there, c.name, mode, os.path.join(logs, f"rank{r}")),
                    daemon=True,
                )
                p.start()
                there.close()
                procs.append(p)
                conns.append(here)
        replies, dead, missing = _collect(procs, conns, set(range(WORLD)), DEADLINE)
        out = {"replies": replies, "dead": dead, "missing": missing, "leak": {}}
        out["why"] = {r: _why(os.path.join(logs, f"rank{r}")) for r in dead}
        judged = [r for r in range(WORLD) if r not in c.victims]
        in_step = all(r in replies and not replies[r].get("collective") for r in range(WORLD))
        if c.repeat and in_step:
            for conn in conns:
                conn.send("repeat")
            leak, dead2, missing2 = _collect(procs, conns, set(judged), DEADLINE)
            out["leak"] = leak
            out["repeat_dead"], out["repeat_missing"] = dead2, missing2
        else:
            for conn in conns:
                try:
                    conn.send("stop")
                except OSError:
                    pass
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for conn in conns:
            conn.close()
        shutil.rmtree(logs, ignore_errors=True)
        del store


def _why(log: str) -> str:
    """What a rank that died said last on stderr (gloo's enforce message, if any)."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    said = [x.strip() for x in lines if "what():" in x or "Error" in x]
    return said[0][:300] if said else ""


# -- judging ------------------------------------------------------------------------------------


def _signal(code: int | None) -> str:
    import signal

    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit code {code}"


def judge(c: Case, run: dict) -> dict:
    """The outcome of one run of a case (see the module docstring), with its leak."""
    judged = [r for r in sorted(set(range(WORLD)) | set(run["replies"])) if r not in c.victims]
    if run.get("sim"):
        judged = [0]  # a SimMesh: one process
    dead = {r: code for r, code in run["dead"].items() if r in judged}
    missing = [r for r in run["missing"] if r in judged]
    replies = {r: run["replies"][r] for r in judged if r in run["replies"]}
    detail = ""
    if dead:
        outcome = "crash"
        detail = ", ".join(f"rank {r} {_signal(code)}" for r, code in sorted(dead.items()))
    elif missing:
        outcome, detail = "hang", f"ranks {missing} did not answer in {DEADLINE:.0f} s"
    else:
        kinds = {x["kind"] for x in replies.values()}
        if kinds == {"ok"}:
            worst = max(replies.values(), key=lambda x: x["err"] or 0.0)
            err = worst["err"] or 0.0
            outcome = "ok" if err <= c.tol else "silent wrong"
            detail = f"max relative error {err:.2g}"
            if outcome != "ok" and worst.get("worst"):
                detail += f" in '{worst['worst']}'"
        elif kinds == {"error"}:
            coll = [x["collective"] for x in replies.values()]
            types = sorted({x["type"] for x in replies.values()})
            if all(coll):
                outcome = "CollectiveError"
            elif not any(coll) and not any(_unclear(x, c) for x in replies.values()):
                outcome = "clear error"
            else:
                outcome = "other"
            slowest = max(x["elapsed"] for x in replies.values())
            detail = f"{'/'.join(types)} in {slowest:.1f} s"
        else:
            outcome = "other"
            detail = "some ranks raised, others returned: " + ", ".join(
                f"rank {r}: {x.get('type', 'ok')}" for r, x in sorted(replies.items())
            )
    # the repeats (leak check) must not crash or hang either
    rdead = {r: v for r, v in run.get("repeat_dead", {}).items() if r in judged}
    rmissing = [r for r in run.get("repeat_missing", []) if r in judged]
    if outcome in ("ok", "clear error") and rdead:
        outcome, detail = "crash", f"when run again: ranks {sorted(rdead)} died"
    elif outcome in ("ok", "clear error") and rmissing:
        outcome, detail = "hang", f"when run again: ranks {rmissing} did not answer"
    growth = [x for x in run["leak"].values() if x]
    leak = None
    if growth:
        worst = max(growth, key=lambda x: (x["models"], x["bytes"], x["tensors"]))
        if worst["models"] > 0 or worst["bytes"] > 0 or worst["tensors"] > 0:
            leak = worst
    message = next((x["msg"] for x in replies.values() if x["kind"] == "error"), "")
    if outcome == "crash":
        message = next((w for r, w in run.get("why", {}).items() if r in dead and w), message)
    return {
        "outcome": outcome,
        "detail": detail,
        "leak": leak,
        "checked_leak": bool(growth),
        "message": message[:400],
        "ranks": {
            r: {k: x.get(k) for k in ("kind", "type", "elapsed", "err") if k in x}
            for r, x in sorted(run["replies"].items())
        },
        "expected": outcome in c.expect[run["mode"]],
    }


def _unclear(reply: dict, c: Case) -> bool:
    """An error of torch's collectives that the library did not turn into a CollectiveError,
    or the harness's own (a case whose exception did not come through), or, in a case about
    the user's own exception, another one."""
    msg = reply.get("msg", "")
    if c.kind == "exception" and not reply.get("expected"):
        return True
    return reply["type"] == "AssertionError" or any(
        s in msg for s in ("Gloo", "gloo", "Connection closed", "c10d", "preamble")
    )


def violations(mode: str, res: dict) -> list[str]:
    """What the matrix's targets forbid: silent wrong, hang, leak (both modes); crash
    (strict)."""
    bad = []
    if res["outcome"] in ("silent wrong", "hang"):
        bad.append(res["outcome"])
    if res["outcome"] == "crash" and mode == "strict":
        bad.append("crash")
    if res["leak"]:
        bad.append("leak")
    return bad


# -- the matrix's interface (tests/units/test_hostile.py) ---------------------------------------


def select(patterns: list[str] | None) -> list[Case]:
    if not patterns:
        return list(CASES.values())
    chosen = [c for c in CASES.values() if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"hostile: no case matches {patterns}; cases: {sorted(CASES)}")
    return chosen


def _pool_task(name: str, mode: str) -> dict:
    """A pool rank of one case (the tiny size's cases, which every rank answers): run
    it, and again for the leak check where this rank's outcome leaves the ranks in step."""
    import functional_hsdp as fh
    from functional_hsdp.mesh import launch

    ctx = Ctx(fh.DistMesh(launch.device_mesh(SHAPE, AXES), timeout=MESH_TIMEOUT), None, mode)
    ctx.rank = launch.rank()
    ctx.odd = ctx.rank == ODD
    c = CASES[name]
    first = _once(c, ctx)
    held = _live()
    leak = _repeat(c, ctx, held) if c.repeat and not first.get("collective") else None
    return {"first": first, "leak": leak}


def _pooled(c: Case, mode: str, pool) -> dict:
    """The case on ``pool``'s ranks (not fresh ones: for the tiny size)."""
    per_rank = pool.run(_pool_task, c.name, mode, timeout=DEADLINE)
    return {
        "replies": {r: x["first"] for r, x in enumerate(per_rank)},
        "dead": {},
        "missing": [],
        "leak": {r: x["leak"] for r, x in enumerate(per_rank) if x["leak"] is not None},
    }


def run(size: str = "full", pool=None, cases: list[str] | None = None) -> dict:
    """Every selected case, on a SimMesh (where it applies) and on 4 fresh gloo ranks, in
    each mode. ``pool`` (the test module's) is used at the tiny size only, whose cases every
    rank answers: a fresh set of ranks per case would cost seconds each."""
    chosen = select(cases if cases else SIZES[size]["cases"])
    pooled = pool is not None and size == "tiny" and not cases
    torch.manual_seed(0)
    out: dict[str, Any] = {"size": size, "cases": {}, "selection": cases}
    t0 = time.perf_counter()
    for c in chosen:
        rows = {}
        gloo = SIZES[size]["gloo"] or cases or not c.sim  # tiny: gloo only where it must
        for mesh in ("sim", "gloo") if c.sim and gloo else ("sim",) if c.sim else ("gloo",):
            for mode in MODES:
                start = time.perf_counter()
                if mesh == "sim":
                    raw = _sim(c, mode)
                else:
                    raw = _pooled(c, mode, pool) if pooled else _gloo(c, mode)
                raw["mode"] = mode
                res = judge(c, raw)
                res["wall_s"] = time.perf_counter() - start
                rows[f"{mesh}/{mode}"] = res
                print(
                    f"  {c.name:40s} {mesh:4s} {mode:6s} {res['outcome']:15s} "
                    f"{'LEAK ' if res['leak'] else ''}{res['detail']} [{res['wall_s']:.1f} s]",
                    flush=True,
                )
        out["cases"][c.name] = {
            "what": c.what,
            "expect": c.expect,
            "runs": rows,
        }
    out["wall_s"] = time.perf_counter() - t0
    return out


def _cell(res: dict) -> str:
    text = res["outcome"]
    if res["outcome"] in ("silent wrong", "hang", "crash", "other"):
        text = f"**{text}**"
    if res["detail"] and res["outcome"] != "ok":
        text += f" ({res['detail']})"
    if res["leak"]:
        leak = res["leak"]
        text += (
            f" **+leak** (each run added at least {leak['bytes'] / 1024:.1f} KiB in "
            f"{leak['tensors']} tensors, {leak['models']} models)"
        )
    return text


def counts(res: dict) -> dict[str, dict[str, int]]:
    """Per mesh and mode: how many runs had each outcome, and leaks."""
    table: dict[str, dict[str, int]] = {}
    for entry in res["cases"].values():
        for key, run_ in entry["runs"].items():
            row = table.setdefault(key, {o: 0 for o in (*OUTCOMES, "leak", "runs")})
            row[run_["outcome"]] += 1
            row["leak"] += bool(run_["leak"])
            row["runs"] += 1
    return table


def report(res: dict, command: str, when: str) -> str:
    lines = [
        C.section_header(
            "(B17) The hostile matrix: the layer-wise units and the module path under valid "
            "use, misuse, exceptions and ranks that disagree (SimMesh and 4 gloo processes, "
            "2x2 mesh)",
            command,
            when,
        ),
        f"{len(res['cases'])} cases"
        + (f" (selected: {', '.join(res['selection'])})" if res.get("selection") else "")
        + ", each on 4 fresh gloo ranks (`fh.DistMesh(dm, timeout=6)`, an outer limit of "
        f"{DEADLINE:.0f} s) and, where it applies, on a `SimMesh` in one process; in the "
        "default validation mode (`on`) and under `fh.validation('strict')`. A case that ends "
        "with every rank answering and no `CollectiveError` runs twice more, and the live "
        "tensors (`gc.get_objects()`) and the models `shard_module` remembers must not grow. "
        "Outcomes: see `tests/units/hostile.py`'s docstring. Cases: `FH_HOSTILE='units/diverge/*' "
        "python -m pytest -s tests/units/test_hostile.py` runs some (globs).",
        "",
        "### Counts per mesh and mode",
        "",
    ]
    table = counts(res)
    rows = [
        [key, table[key]["runs"], *(table[key][o] for o in (*OUTCOMES, "leak"))]
        for key in sorted(table)
    ]
    lines.append(C.table(["mesh/mode", "runs", *OUTCOMES, "leak"], rows))
    lines += ["", "### What violates the matrix's targets", ""]
    bad = []
    for name, entry in res["cases"].items():
        for key, r in entry["runs"].items():
            v = violations(key.split("/")[1], r)
            if v:
                bad.append([f"`{name}`", key, ", ".join(v), _cell(r), r["message"][:160]])
    lines.append(
        C.table(["case", "mesh/mode", "violation", "outcome", "message"], bad) if bad else "None."
    )
    lines += ["", "### Every case", ""]
    keys = ["sim/on", "sim/strict", "gloo/on", "gloo/strict"]
    rows = []
    for name, entry in res["cases"].items():
        exp = entry["expect"]
        want = " / ".join(dict.fromkeys((" or ".join(exp["on"]), " or ".join(exp["strict"]))))
        cells = []
        for k in keys:
            r = entry["runs"].get(k)
            cells.append("-" if r is None else (_cell(r) + ("" if r["expected"] else " (!)")))
        rows.append([f"`{name}`", entry["what"], want, *cells])
    lines.append(C.table(["case", "what", "expected (on / strict)", *keys], rows))
    lines.append(
        "\n(!) marks an outcome other than the expected one. Times are the slowest rank's, "
        "from the start of the case to its error."
    )
    return "\n".join(lines) + "\n"
