"""A unit's collectives, through the library's engine (:mod:`functional_hsdp.runtime.engine`): the
all-gather of its weights (parameter placement -> Replicate, in ``mp_policy.param_dtype``
when one is given: the shards are cast before it, so the wire and the compute are in it),
issued when needed or ahead of its use, and the reduce-scatter of its gradient (in
``mp_policy.reduce_dtype``), issued in backward and waited by the unit's wait node.

Each collective in flight is one typed record on the call (:class:`AllGather`,
:class:`ReduceScatter`, then :class:`Reduced`), whose docstring states its invariant. Every
rank issues the same collectives in the same order; under ``validation("strict")`` the ranks
agree on each before it is issued (:func:`_agree_before`).

An all-gather issued ahead (``prefetch``, or the backward prefetch of the unit before) is used
by whichever block runs those shards next, as long as it gathers them the same way (spec,
``into``, ``param_dtype``: :func:`~functional_hsdp.units.checks.adopts`); else it is
abandoned unused.

State: none of its own; what is in flight lives on the call records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..runtime import engine
from ..runtime.agreement import agree_on_unit_collective
from . import call as lifecycle
from .call import Call, Phase
from .checks import describe

__all__ = [
    "AllGather",
    "Reduced",
    "ReduceScatter",
    "abandon_ahead",
    "abandon_reduce_scatter",
    "gather",
    "issue_ahead",
    "start_reduce_scatter",
    "take_gradient",
    "wait_early",
]


class AllGather(NamedTuple):
    """A unit's all-gather issued ahead of its use (``call.ahead``): by the unit called before
    it (forward prefetch) or, in backward, by the unit called after it (backward prefetch).

    Invariant: at most one per call; every rank issued it alike, so it completes; it is used
    once, by the gather for the same ``when``, or abandoned (``engine.release``) when that
    gather will not come: the call is not made, its block gathers otherwise, or the chain
    ends. Nothing of it stays in flight past its chain.
    """

    when: str  # "forward" or "backward": the gather that uses it
    pending: list  # engine.start's per-bucket results, the last collective possibly in flight


class ReduceScatter(NamedTuple):
    """The gradient's reduce-scatter issued by a unit's backward (``call.reduction``, phase
    REDUCING).

    Invariant: every rank issued it alike; it is waited once: by the call's wait node, or
    early by a later unit's backward (then :class:`Reduced`), or abandoned at the end of the
    backward when the wait node never runs (a gradient of other inputs was asked for).
    """

    pending: list  # engine.start's per-bucket results


class Reduced(NamedTuple):
    """A reduce-scatter waited early (``call.reduction``, phase REDUCED), so that its
    gradient-sized input was freed before the next unit packs its own.

    Invariant: the buffers are the call's own (shard-sized), handed on once, by its wait
    node; nothing is added into a MainGrad before that.
    """

    buffers: list[torch.Tensor]


# -- the all-gather ----------------------------------------------------------------------------


def issue_ahead(call: Call, when: str, pieces: Sequence[torch.Tensor]) -> None:
    """Issue ``call``'s all-gather ahead of its use (``when``: its forward or backward); one
    issued before and not used is abandoned."""
    abandon_ahead(call)
    # in forward, ahead of its call: the record is still the prefetching block's
    call.ahead = AllGather(when, _start_all_gather(call, pieces, ahead=when == "forward"))


def abandon_ahead(call: Call) -> None:
    """Release the all-gather issued ahead for ``call`` and not used (every rank issued it
    alike, so it completes; nothing of it stays in flight or held)."""
    if call.ahead is not None:
        engine.release(call.plan, call.ahead.pending)
        call.ahead = None


def gather(call: Call, when: str, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unit's full weights: its all-gather issued ahead for ``when``, or one issued now."""
    ahead = call.ahead
    if ahead is not None and ahead.when == when:
        call.ahead, pending = None, ahead.pending
    else:
        pending = _start_all_gather(call, pieces)
    full, _ = engine.finish(call.plan, pending, "full", dtype=call.block.param_dtype)
    return full


def _start_all_gather(call: Call, pieces: Sequence[torch.Tensor], *, ahead: bool = False) -> list:
    if call.mode == "strict":
        _agree_before(call, "all-gather", ahead=ahead)
    plan, dtype = call.plan, call.block.param_dtype
    pack = lambda b: plan.pack(b, list(pieces), "parameter", dtype=dtype)  # noqa: E731
    return engine.start(plan, pack, [("parameter", "full")])


# -- the reduce-scatter ------------------------------------------------------------------------


def start_reduce_scatter(call: Call, weight_grads: list[torch.Tensor]) -> None:
    """Issue the reduce-scatter of the unit's weight gradient (BACKWARD -> REDUCING)."""
    if call.mode == "strict":
        _agree_before(call, "reduce-scatter")
    plan, dtype = call.plan, call.block.reduce_dtype
    pack = lambda b: plan.pack(b, weight_grads, "input", dtype=dtype)  # noqa: E731
    call.reduction = ReduceScatter(engine.start(plan, pack, [("input", "gradient")], wire=dtype))
    lifecycle.reduce_scatter_issued(call)


def wait_early(call: Call) -> None:
    """Wait for ``call``'s reduce-scatter if it is in flight, keeping the result (shard-sized,
    the call's own) for its wait node; nothing is handed on here."""
    if call.phase is Phase.REDUCING:
        call.reduction = Reduced(engine.wait(call.plan, call.reduction.pending))
        lifecycle.reduce_scatter_waited(call)


def take_gradient(call: Call) -> list[torch.Tensor] | None:
    """For the wait node: the reduced gradient's buckets (waited now, or early), or None
    when no reduce-scatter is pending (the unit's backward did not run, or wanted none)."""
    reduction, call.reduction = call.reduction, None
    if call.phase is Phase.REDUCING:
        lifecycle.gradient_handed_on(call)
        return engine.wait(call.plan, reduction.pending)
    if call.phase is Phase.REDUCED:
        lifecycle.gradient_handed_on(call)
        return reduction.buffers
    return None


def abandon_reduce_scatter(call: Call) -> None:
    """The backward ended and ``call``'s wait node did not run: release its reduce-scatter
    if still in flight (every rank issued it alike)."""
    if call.phase is Phase.REDUCING:
        reduction, call.reduction = call.reduction, None
        lifecycle.reduce_scatter_abandoned(call)
        engine.release(call.plan, reduction.pending)


# -- strict agreement --------------------------------------------------------------------------


def _agree_before(call: Call, collective: str, *, ahead: bool = False) -> None:
    """validation("strict"): every rank agrees on this unit collective before issuing it, so
    that a unit skipped or gathered otherwise on one rank raises on every rank instead of
    meeting another rank's collective (a crash or a hang). ``ahead``: a forward all-gather
    issued by the unit before (``prefetch``), whose block the error names as such (the
    call's own block takes the record over when it is called)."""
    block = call.block
    unit, options = describe(block, call)
    named = f"gathered({block.name}) on {call.where}"
    if ahead:
        named = f"the unit on {call.where} (its all-gather issued ahead by gathered({block.name}))"
    what = f"gathered: {collective} of {unit}"
    paths = [f"{call.where}[{i}]" for i in range(call.k)]
    agree_on_unit_collective(
        block.spec,
        call.plan,
        what=what,
        paths=paths,
        options=tuple(options.split("; ")),
        unit=named,
        op=collective,
    )
