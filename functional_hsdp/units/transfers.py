"""A unit's collectives, through the library's engine (:mod:`functional_hsdp.runtime.engine`).

The all-gather of its weights (parameter placement -> Replicate, in ``mp_policy.param_dtype``
when one is given: the shards are cast before it, so the wire and the compute are in it),
issued when needed or ahead of its use (:func:`issue_ahead`), and the reduce-scatter of its
gradient (in ``mp_policy.reduce_dtype``), issued in backward and waited by the unit's wait
node. Each in flight is an :class:`~functional_hsdp.runtime.flight.InFlight` on the call
(:class:`AllGather`, :class:`ReduceScatter`), whose docstring states its invariant.

Invariant: every rank issues the same collectives in the same order; under
``validation("strict")`` the ranks agree on each before it is issued (:func:`_agree_before`).
State: none of its own; what is in flight lives on the call records.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..plan.recipe import Plan
from ..runtime import engine
from ..runtime.agreement import agree_on_unit_collective
from ..runtime.flight import InFlight
from . import call as lifecycle
from .call import Call, Phase
from .checks import describe

__all__ = [
    "AllGather",
    "ReduceScatter",
    "abandon_ahead",
    "abandon_reduce_scatter",
    "gather",
    "issue_ahead",
    "start_reduce_scatter",
    "take_gradient",
    "wait_early",
]


class AllGather(InFlight[list]):
    """A unit's all-gather issued (``call.ahead`` when issued ahead of its use: by the unit
    called before it, forward prefetch, or in backward by the unit called after it, backward
    prefetch). Its ``result()`` (:class:`~functional_hsdp.runtime.flight.InFlight`'s, once) is the
    unit's full weights.

    Invariant: at most one ahead per call; every rank issued it alike, so it completes; it is
    used once, by the gather for the same ``when``, or abandoned (``abandon()``) when that
    gather will not come: the call is not made, its block gathers otherwise, or the chain
    ends. Nothing of it stays in flight past its chain.
    """

    __slots__ = ("when", "plan", "dtype", "pending")

    def __init__(self, when: str, pending: list, *, plan: Plan, dtype: torch.dtype | None):
        super().__init__()
        self.when = when  # "forward" or "backward": the gather that uses it
        self.plan, self.dtype = plan, dtype  # the unit's plan, mp_policy.param_dtype
        self.pending = pending  # engine.start's per-bucket results, the last possibly in flight

    def _wait(self) -> list[torch.Tensor]:
        full, _ = engine.finish(self.plan, self.pending, "full", dtype=self.dtype)
        self.pending = None
        return full

    def _release(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            engine.release(self.plan, pending)


class ReduceScatter(InFlight[list]):
    """The gradient's reduce-scatter issued by a unit's backward (``call.reduction``, phases
    REDUCING, then REDUCED once waited early). Its ``result()``
    (:class:`~functional_hsdp.runtime.flight.InFlight`'s, once) is the reduced gradient's buckets.

    Invariant: every rank issued it alike; it is waited once: by the call's wait node, or
    early by a later unit's backward, so that its gradient-sized input is freed before the
    next unit packs its own (its buffers, the call's own and shard-sized, are then held until
    the wait node hands them on, and nothing is added into a MainGrad before that); or it is
    abandoned at the end of the backward when the wait node never runs (a gradient of other
    inputs was asked for).
    """

    __slots__ = ("plan", "pending")

    def __init__(self, pending: list, *, plan: Plan):
        super().__init__()
        self.plan, self.pending = plan, pending  # engine.start's per-bucket results

    def _wait(self) -> list[torch.Tensor]:
        bufs = engine.wait(self.plan, self.pending)
        self.pending = None
        return bufs

    def _release(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            engine.release(self.plan, pending)


# -- the all-gather ----------------------------------------------------------------------------


def issue_ahead(call: Call, when: str, pieces: Sequence[torch.Tensor]) -> None:
    """Issue ``call``'s all-gather ahead of its use (``when``: its forward or backward); one
    issued before and not used is abandoned.

    An all-gather issued ahead (``prefetch``, or the backward prefetch of the unit before) is
    used by whichever block runs those shards next, as long as it gathers them the same way
    (spec, ``into``, ``param_dtype``: :func:`~functional_hsdp.units.checks.adopts`); else it
    is abandoned unused."""
    abandon_ahead(call)
    # in forward, ahead of its call: the record is still the prefetching block's
    call.ahead = _start_all_gather(call, when, pieces, ahead=when == "forward")


def abandon_ahead(call: Call) -> None:
    """Release the all-gather issued ahead for ``call`` and not used (every rank issued it
    alike, so it completes; nothing of it stays in flight or held)."""
    if call.ahead is not None:
        call.ahead.abandon()
        call.ahead = None


def gather(call: Call, when: str, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unit's full weights: its all-gather issued ahead for ``when``, or one issued now."""
    ahead = call.ahead
    if ahead is not None and ahead.when == when:
        call.ahead, flight = None, ahead
    else:
        flight = _start_all_gather(call, when, pieces)
    return flight.result()


def _start_all_gather(
    call: Call, when: str, pieces: Sequence[torch.Tensor], *, ahead: bool = False
) -> AllGather:
    if call.mode == "strict":
        _agree_before(call, "all-gather", ahead=ahead)
    plan, dtype = call.plan, call.block.param_dtype
    pack = lambda b: plan.pack(b, list(pieces), "parameter", dtype=dtype)  # noqa: E731
    pending = engine.start(plan, pack, [("parameter", "full")])
    return AllGather(when, pending, plan=plan, dtype=dtype)


# -- the reduce-scatter ------------------------------------------------------------------------


def start_reduce_scatter(call: Call, weight_grads: list[torch.Tensor]) -> None:
    """Issue the reduce-scatter of the unit's weight gradient (BACKWARD -> REDUCING)."""
    if call.mode == "strict":
        _agree_before(call, "reduce-scatter")
    plan, dtype = call.plan, call.block.reduce_dtype
    pack = lambda b: plan.pack(b, weight_grads, "input", dtype=dtype)  # noqa: E731
    pending = engine.start(plan, pack, [("input", "gradient")], wire=dtype)
    call.reduction = ReduceScatter(pending, plan=plan)
    lifecycle.reduce_scatter_issued(call)


def wait_early(call: Call) -> None:
    """Wait for ``call``'s reduce-scatter if it is in flight, keeping the result (shard-sized,
    the call's own) for its wait node; nothing is handed on here."""
    if call.phase is Phase.REDUCING:
        call.reduction.result()
        lifecycle.reduce_scatter_waited(call)


def take_gradient(call: Call) -> list[torch.Tensor] | None:
    """For the wait node: the reduced gradient's buckets (waited now, or early), or None
    when no reduce-scatter is pending (the unit's backward did not run, or wanted none)."""
    reduction, call.reduction = call.reduction, None
    if call.phase in (Phase.REDUCING, Phase.REDUCED):
        lifecycle.gradient_handed_on(call)
        return reduction.result()
    return None


def abandon_reduce_scatter(call: Call) -> None:
    """The backward ended and ``call``'s wait node did not run: release its reduce-scatter
    if still in flight (every rank issued it alike)."""
    if call.phase is Phase.REDUCING:
        reduction, call.reduction = call.reduction, None
        lifecycle.reduce_scatter_abandoned(call)
        reduction.abandon()


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
