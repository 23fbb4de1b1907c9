"""Collectives as differentiable functions: every ``torch.func`` transform through them.

JAX's rules, in the library's data-parallel convention: a value that differs per rank (a
rank's gradient, its full weights' cotangent) stands for the *mean* over ranks, the way a
rank's loss stands for the mean loss. So ``grad`` through an all-gather gives the
reduce-scatter with AVG (the gradient of the mean loss, as the layer-wise units always have),
and the moves come in adjoint pairs (:data:`ADJOINT`). A move is linear: its jvp is the same
move of the tangent, its backward is itself a move (so ``grad`` of ``grad`` works), and under
``vmap`` one collective per bucket carries the whole batch (:func:`move`). A gathered unit runs
these moves under the transforms its first-order path cannot honour (see
:mod:`functional_hsdp.units`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

import einops
import optree
import torch

from ..base.tags import state_of_alias
from ..plan.recipe import Plan, Step
from ..runtime import engine, validate
from ..runtime.agreement import agree_on_unit_collective
from ..runtime.scheduler import expand, issue
from ..runtime.unit_calls import unit_log

__all__ = ["Move", "collecting_norms", "move", "per_example_grad_norms"]

#: Each move's adjoint, in the mean convention (see the module docstring): the moves are
#: transposes of each other for the inner product that averages per-rank values and sums
#: sharded ones.
#:
#: ====================================  ==================================================
#: move (forward)                        its adjoint (backward)
#: ====================================  ==================================================
#: parameter -> full (all-gather)        input -> gradient (reduce-scatter, AVG)
#: input -> gradient (reduce-scatter)    parameter -> full (all-gather)
#: ====================================  ==================================================
ADJOINT = {
    ("parameter", "full"): ("input", "gradient"),
    ("input", "gradient"): ("parameter", "full"),
}


@dataclass(frozen=True, eq=False)
class Move:
    """Leaves of ``plan`` at role ``frm`` to role ``to``, packed in ``dtype`` (None: the
    plan's), and the dtype of the adjoint's (``grad_dtype``: the reduce dtype of a unit)."""

    plan: Plan
    frm: str
    to: str
    _: KW_ONLY
    dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    #: if given, the forward appends ``(plain inputs, plain outputs)`` to it (a unit that
    #: releases its gathered weights between forward and backward needs them), and callables
    #: appended after that run once the move's backward is done
    record: list | None = None
    #: per_example_grad_norms' accumulator, taken when the move is made (in forward, on the
    #: caller's thread): the backward that adds to it may run on autograd's device thread,
    #: which sees none of the caller's ContextVars
    norms: _SquaredNorms | None = None
    #: the unit call this move belongs to (made by :func:`move`, shared by its adjoint and
    #: tangent moves): the validation mode read there and where its shards are
    unit: UnitCall | None = None

    @property
    def adjoint(self) -> Move:
        frm, to = ADJOINT[(self.frm, self.to)]
        return Move(
            self.plan,
            frm,
            to,
            dtype=self.grad_dtype,
            grad_dtype=self.dtype,
            norms=self.norms,
            unit=self.unit,
        )

    def run(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The move on plain tensors (one collective per bucket per axis, through the
        engine)."""
        self._agree()
        plan, dtype = self.plan, self.dtype
        pack = lambda b: plan.pack(b, leaves, self.frm, dtype=dtype)  # noqa: E731
        pending = engine.start(plan, pack, [(self.frm, self.to)], wire=dtype)
        out, _ = engine.finish(plan, pending, self.to, dtype=dtype)
        return out

    def run_batched(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The move on leaves with a batch dim in front (vmap): per bucket one buffer
        ``(B, *mesh, length)`` and one collective per step for the whole batch."""
        self._agree()
        plan, dtype, batch = self.plan, self.dtype, leaves[0].shape[0]
        mesh = plan.mesh
        bufs = []
        for b, bucket in enumerate(plan.buckets):
            packed = torch.stack(
                [plan.pack(b, list(xs), self.frm, dtype=dtype) for xs in zip(*leaves)]
            )
            program = expand(plan.program(b, self.frm, self.to), dtype or bucket.dtype)
            for item in program:
                packed = (
                    _batched_step(mesh, packed, item) if isinstance(item, Step) else item(b, packed)
                )
            bufs.append(packed)
        per_sample = [plan.unpack([buf[k] for buf in bufs], self.to, dtype) for k in range(batch)]
        return [torch.stack(xs) for xs in zip(*per_sample)]

    def _agree(self) -> None:
        """validation("strict"): every rank agrees on this move of a unit before its
        collectives (as a first-order unit's do), so that a unit skipped or gathered otherwise
        on one rank is an error on every rank, not a mismatched collective."""
        unit = self.unit
        if unit is None or unit.mode != "strict":
            return
        op = "all-gather" if self.frm == "parameter" else "reduce-scatter"
        what = f"gathered (composable path): {op} of the unit on {unit.where}"
        paths = [f"{unit.where}[{i}]" for i in range(len(self.plan.shapes))]
        options = (f"{self.frm}->{self.to}", f"dtype={self.dtype}", *unit.options)
        agree_on_unit_collective(
            self.plan.specs,
            self.plan,
            what=what,
            paths=paths,
            options=options,
            unit=f"gathered (composable path) on {unit.where}",
            op=op,
        )


@dataclass(eq=False)
class UnitCall:
    """One call of a unit on the composable path: the validation mode read when it was made
    (in forward, in the caller's context), carried into its backward, which may run on
    another thread; where its shards are (the path of the first in the tree ``fh.shard``
    made), found by its forward; whether the call is in the step's record of unit calls."""

    mode: str
    options: tuple[str, ...]
    where: str = "shards"
    recorded: bool = False

    def record(self, plan: Plan, leaves: tuple[torch.Tensor, ...]) -> None:
        """The primal's forward (its leaves unwrapped from the transforms): find where the
        shards are and add the call to the mesh's record of unit calls (the running
        fingerprint that the step's checks agree on)."""
        self.recorded = True
        self.where = _where(leaves[0]) if leaves else self.where
        if self.mode != "off":
            unit_log(plan.mesh).record(
                f"all-gather (composable path) on {self.where}", "; ".join(self.options)
            )


def _where(leaf: torch.Tensor) -> str:
    """Where the unit ``leaf`` belongs to is: the path of the unit's first leaf in the tree
    ``fh.shard`` made, found by ``leaf``'s tag (also through the alias forward mode makes of
    it), else ``"shards"``."""
    found = state_of_alias(leaf)
    slots = getattr(found[0].plan, "slot_of", ()) if found is not None else ()
    if found is None or found[1] >= len(slots):
        return "shards"
    units = found[0].plan.meta.units
    first = units.index(units[found[1]])  # the unit's first leaf, whichever leaf was found
    return f"{slots[first].path}"


def _batched_step(mesh: Any, buf: torch.Tensor, step: Step) -> torch.Tensor:
    """One collective step on ``(B, *mesh, length)``: each rank's chunk made contiguous for
    the whole batch (rank-major) around a reduce-scatter or all-gather."""
    names = " ".join(f"m{k}" for k in range(len(mesh.batch_shape)))
    if step.op in ("slice", "all_to_all"):  # neither is a move of this module's legs
        raise NotImplementedError(f"a {step.op} under vmap is not a move of this module")
    n = step.size
    if step.op == "reduce_scatter":
        flat = einops.rearrange(buf, f"b {names} (n c) -> {names} (n b c)", n=n)
        out = mesh.wait(issue(mesh, flat.contiguous(), step))
        return einops.rearrange(out, f"{names} (b c) -> b {names} c", b=buf.shape[0])
    if step.op == "all_gather":
        flat = einops.rearrange(buf, f"b {names} c -> {names} (b c)")
        out = mesh.wait(issue(mesh, flat.contiguous(), step))
        return einops.rearrange(out, f"{names} (n b c) -> b {names} (n c)", n=n, b=buf.shape[0])
    flat = einops.rearrange(buf, f"b {names} l -> {names} (b l)")  # all-reduce: elementwise
    out = mesh.wait(issue(mesh, flat.contiguous(), step))
    return einops.rearrange(out, f"{names} (b l) -> b {names} l", b=buf.shape[0])


class _Moved(torch.autograd.Function):
    """``Move.run`` as a differentiable function: backward is the adjoint move, jvp the move
    of the tangent, vmap the batched move."""

    @staticmethod
    def forward(how: Move, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if how.unit is not None and not how.unit.recorded:  # the unit call's primal
            how.unit.record(how.plan, leaves)
        out = how.run(list(leaves))
        if how.record is not None and not how.record:  # the primal's (a tangent's is not)
            how.record.append((list(leaves), out))
        return tuple(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.how = inputs[0]
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        how = ctx.how.adjoint
        out = _Moved.apply(how, *_dense(grads, _shapes(how.plan, how.frm, grads)))
        for done in (ctx.how.record or [])[1:]:
            done()
        return (None, *(g.to(dtype) for g, (_, dtype, _) in zip(out, ctx.inputs)))

    @staticmethod
    def jvp(ctx: Any, _how: Any, *tangents: torch.Tensor) -> tuple:
        return _Moved.apply(replace(ctx.how, record=None), *_dense(tangents, ctx.inputs))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, how: Move, *leaves: torch.Tensor) -> tuple:
        dims = in_dims[1:]
        if all(d is None for d in dims):
            return _Moved.apply(how, *leaves), (None,) * len(how.plan.shapes)
        size = info.batch_size
        batched = [
            x.unsqueeze(0).expand(size, *x.shape) if d is None else x.movedim(d, 0)
            for x, d in zip(leaves, dims)
        ]
        if how.unit is not None and not how.unit.recorded:  # shards batched: no forward
            how.unit.record(how.plan, ())
        norms = how.norms
        if norms is not None and how.frm == "input":  # per-example norms, nothing reduced
            norms.add(batched, len(how.plan.mesh.batch_shape))
            zero = torch.zeros((), dtype=batched[0].dtype, device=batched[0].device)
            # the per-example gradients nobody reads: expanded zeros, no memory
            zeros = [zero.expand(size, *shape) for shape in how.plan.local_shapes[how.to]]
            return tuple(zeros), (0,) * len(zeros)
        return tuple(how.run_batched(batched)), (0,) * len(batched)


def _dense(xs: tuple, like: list) -> list[torch.Tensor]:
    """Cotangents or tangents as plain strided tensors: autograd may hand on expanded zeros,
    and None for an input or output with none (then zeros of ``like``'s (shape, dtype,
    device))."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if x is None else x.contiguous()
        for x, (shape, dtype, device) in zip(xs, like)
    ]


def _shapes(plan: Plan, role: str, xs: tuple) -> list:
    """(local shape, dtype, device) of each leaf at ``role``, for cotangents that are None."""
    first = next((x for x in xs if x is not None), None)
    dtype = first.dtype if first is not None else None
    return [
        (shape, dtype or plan.dtypes[i], plan.devices[i])
        for i, shape in enumerate(plan.local_shapes[role])
    ]


class _SquaredNorms:
    """Per-example squared gradient norms, summed over the units a backward reaches."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def add(self, batched: list[torch.Tensor], mesh_dims: int) -> None:
        # each leaf (B, *mesh, *shape): this rank's examples' full gradients, before any
        # reduction across ranks mixes them
        part = sum(
            torch.linalg.vector_norm(x.flatten(1 + mesh_dims), dim=-1, dtype=torch.float32) ** 2
            for x in batched
            if x.numel()
        )
        self.total = part if self.total is None else self.total + part


_NORMS: contextvars.ContextVar[_SquaredNorms | None] = contextvars.ContextVar(
    "fh_per_example_norms", default=None
)


def collecting_norms() -> _SquaredNorms | None:
    """The accumulator of a :func:`per_example_grad_norms` pass running on this thread, for
    a move made now (forward only: backward reads it from the move, never from here)."""
    return _NORMS.get()


def per_example_grad_norms(
    loss_fn: Callable, shards: Any, examples: Any, *args: Any, chunk_size: int | None = None
) -> torch.Tensor:
    """The gradient norm of each of this rank's examples, over every gathered unit (and
    ``fh.functional_call`` unit) the loss reaches: the first pass of DP-SGD's per-example
    clipping (Opacus's ghost clipping in two passes).

    ``loss_fn(shards, example, *args)`` is one example's loss (``examples`` carries the
    examples along dim 0, a pytree of tensors). It runs under ``vmap(grad(...))``, and each
    unit's backward takes the squared norm of every example's full gradient *before* the
    reduce-scatter that would mix ranks' examples, and reduce-scatters nothing. The second
    pass is an ordinary first-order ``grad`` of ``sum_b min(1, C / norm_b) * loss_b`` on the
    batch, at FSDP memory: its gradient is the mean over ranks of the sums of clipped
    per-example gradients.

    Memory: the composable path's (each unit's gathered weights held through the pass, and
    one unit's per-example full gradients at a time: ``chunk_size`` examples of it).

    Args:
        loss_fn: one example's scalar loss.
        shards: the units' shards at the parameter placement.
        examples: this rank's examples, a pytree of tensors batched along dim 0 (on a
            SimMesh with the mesh dims after it).
        *args: more arguments of ``loss_fn``, not batched.
        chunk_size: examples per pass (default: all at once).

    Returns:
        A float32 tensor of the norms, ``(B,)`` (on a SimMesh ``(B, *mesh)``: every rank's).
    """
    leaves = optree.tree_leaves(examples)
    if not leaves:
        raise ValueError("per_example_grad_norms: examples has no tensor leaves")
    size = leaves[0].shape[0]
    step = chunk_size or size
    out = []
    for start in range(0, size, step):
        chunk = optree.tree_map(lambda x, start=start: x[start : start + step], examples)
        norms = _SquaredNorms()
        token = _NORMS.set(norms)
        try:
            per = torch.func.vmap(
                torch.func.grad(loss_fn), in_dims=(None, 0, *([None] * len(args)))
            )
            per(shards, chunk, *args)
        finally:
            _NORMS.reset(token)
        if norms.total is None:
            raise ValueError(
                "per_example_grad_norms: the loss reached no gathered unit (the norms are "
                "taken in the units' backward)"
            )
        out.append(norms.total)
    return torch.cat(out).sqrt()


def move(how: Move, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """``how`` applied to ``leaves`` (in the plan's leaf order), differentiable under every
    ``torch.func`` transform and plain autograd: a unit's all-gather on the composable path.

    A move is linear, so its forward-mode rule (``jvp``) is the same move applied to the
    tangent, and its backward is itself a move (differentiable again: ``grad`` of ``grad``,
    Hessian-vector products by ``jvp(grad(f))`` or ``vjp(grad(f))``). Under ``vmap`` a batch
    dim rides inside the buffer: one collective per bucket for the whole batch, each rank's
    chunk laid out rank-major around it (``b (n c) -> (n b c)``), so a batch of B per-sample
    gradients is one reduce-scatter of B times the bytes, not B collectives. These moves keep
    the gathered weights in the graph (no resharding, no recompute), where first-order
    training keeps its own, leaner path.

    The call is one more in the step's record of unit calls (the running fingerprint the
    step's checks agree on, as a first-order unit call is), and under
    ``validation("strict")`` the ranks agree before each of its collectives and its
    adjoint's and tangents' (the mode read now, in the caller's context)."""
    options = (
        f"param_dtype={how.dtype}",
        f"reduce_dtype={how.grad_dtype}",
        f"buckets={[b.padded for b in how.plan.buckets]}",
    )
    how = replace(how, unit=UnitCall(validate.current_mode(), options))
    return list(_Moved.apply(how, *leaves))
