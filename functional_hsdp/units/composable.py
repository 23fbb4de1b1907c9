"""The composable path: a unit under ``vmap``, forward mode or a second derivative.

There the first-order Functions (:mod:`~functional_hsdp.units.functions`) cannot go (forward
mode: ``jvp``, a ``torch.autograd.forward_ad`` dual level). The unit is all-gathered by a
differentiable move (:func:`functional_hsdp.sync.autodiff.move`) and ``fn`` runs on the
result; what that keeps and what it does not: :func:`composable`.

State: the weights released between forward and backward live in the graph
(:class:`ReleasedWeights`, held by the :class:`_Refill` nodes and the move's record); this
thread's registry refers weakly to the last one, so that the next unit's forward releases it.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import optree
import torch

from ..sync import autodiff
from . import registry
from .checks import unit_plan
from .storage import Released, refill_storage, release_storage

__all__ = ["ReleasedWeights", "composable", "composed"]


def composable(block: Any, shards: Any, *, args: tuple, kwargs: dict) -> Any:
    """``block.fn`` on the unit all-gathered by a differentiable move.

    The move's backward is a differentiable reduce-scatter, its jvp the all-gather of the
    tangent, its vmap one collective for the batch. No recompute, no prefetch, and nothing is
    added into a ``MainGrad``: the gathered weights stay in the graph, but under vmap of one
    gradient level (per-sample gradients, DP-SGD's norms), where they are released between
    forward and backward (:class:`ReleasedWeights`) as the first-order path does."""
    if block.into is not None:
        raise NotImplementedError(
            f"gathered({block.name}, into=...): under vmap, jvp or a second derivative "
            "the unit's gradients are returned, not added into a MainGrad (per-sample "
            "or higher-order gradients have no MainGrad buffer): leave into=None and "
            "reduce them with fh.reduce_grads(..., at='gradient')"
        )
    leaves, treedef, _, plan = unit_plan(block, shards, "shards")
    record: list = []
    how = autodiff.Move(
        plan,
        "parameter",
        "full",
        dtype=block.param_dtype,
        grad_dtype=block.reduce_dtype,
        record=record,
        norms=autodiff.collecting_norms(),
    )
    # the unit before gives its gathered weights' memory back now (per-sample gradients)
    previous = registry.swap_resharded(None)
    previous = previous() if previous is not None else None
    if previous is not None:
        previous.release()
    full = optree.tree_unflatten(treedef, autodiff.move(how, leaves))
    out = _run(block, full, args=args, kwargs=kwargs)
    if block.reshard_after_forward and record and _per_sample_only():
        out = _released_until_backward(how, record, out)
    return out


def _run(block: Any, full: Any, *, args: tuple, kwargs: dict) -> Any:
    """``block.fn`` on the gathered weights, with the mixed-precision casts of floating
    arguments and outputs."""
    cast = block.param_dtype if block.cast_inputs else None
    if cast is not None:
        args, kwargs = optree.tree_map(lambda x: x.to(cast) if _floating(x) else x, (args, kwargs))
    out = block.fn(full, *args, **kwargs)
    if block.output_dtype is not None:
        out = optree.tree_map(lambda x: x.to(block.output_dtype) if _floating(x) else x, out)
    return out


def _released_until_backward(how: autodiff.Move, record: list, out: Any) -> Any:
    """The unit's gathered weights (the move's plain outputs, in ``record``) to be released
    when the next unit starts, and refilled by the first gradient to reach ``out``."""
    released = ReleasedWeights(replace(how, record=None), *record[0])
    registry.swap_resharded(weakref.ref(released))  # the graph keeps it, not the thread
    # once the unit's backward is over, released again: torch.func keeps the graph (and the
    # tensors it saved) until its whole backward ends
    record.append(released.release)
    return optree.tree_map(lambda x: _Refill.apply(released, x) if _floating(x) else x, out)


class ReleasedWeights:
    """A unit's gathered weights on the composable path, released between its forward and
    its backward (as the first-order path does) when only vmap and one gradient level are
    at work: per-sample gradients, DP-SGD's norms. The first gradient to reach the unit's
    outputs (:class:`_Refill`) gathers them again, into their own memory."""

    def __init__(self, how: autodiff.Move, inputs: list, outputs: list):
        self.how, self.inputs, self.outputs = how, inputs, outputs
        self.released: Released | None = None  # what release_storage returned, until refilled

    def release(self) -> None:
        if self.released is None:
            self.released = release_storage(
                self.outputs, {x.untyped_storage().data_ptr() for x in self.inputs}
            )

    def refill(self) -> None:
        released, self.released = self.released, None
        if released is not None and released.leaves:
            refill_storage(released, self.outputs, self.how.run(self.inputs))


class _Refill(torch.autograd.Function):
    """Identity on a unit's output; backward: the unit's released weights gathered again
    before the unit's own backward reads them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(released: ReleasedWeights, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.released = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.released.released is not None:
            ctx.released.refill()
        return None, grad


def _per_sample_only() -> bool:
    """Whether only vmap and one level of reverse mode are at work (per-sample gradients):
    then the composable path can release a unit's weights between forward and backward."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    kinds = [i.key() for i in retrieve_all_functorch_interpreters()]
    return (
        kinds.count(TransformType.Grad) == 1
        and all(k in (TransformType.Grad, TransformType.Vmap) for k in kinds)
        and torch.autograd.forward_ad._current_level < 0
    )


def composed() -> bool:
    """Whether this call runs under a transform the first-order path cannot honour: vmap,
    forward mode (jvp, or a ``torch.autograd.forward_ad`` dual level), or a second level of
    reverse mode (``grad`` of ``grad``, ``vjp`` of ``grad``). Its units then take the
    composable path."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    grads = 0
    for interpreter in retrieve_all_functorch_interpreters():
        kind = interpreter.key()
        if kind in (TransformType.Vmap, TransformType.Jvp):
            return True
        grads += kind == TransformType.Grad
    return grads > 1 or torch.autograd.forward_ad._current_level >= 0


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
