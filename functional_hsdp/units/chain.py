"""A chain: the unit calls of one forward pass, until its backward ends, and what they share.

Every call record points to its chain, so that a backward run on another thread than its
forward (autograd runs CUDA backward on its device threads) finds what the forward left:
nothing a forward and its backward share is kept per thread. What a chain does (backward
prefetch, the last unit's weights, what is in flight): :class:`Chain`.

State: a chain lives as long as a call record or this thread's registry
(:mod:`~functional_hsdp.units.registry`) refers to it. It refers to calls weakly; it holds
the last unit's gathered weights from that unit's forward until the next forward, the end of
the backward, or ``fh.clear_caches()``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import storage, transfers
from .call import Call

__all__ = [
    "Chain",
    "Kept",
    "abandon",
    "add_reducing",
    "close_at_end_of_backward",
    "drop_kept",
    "join",
    "keep_last",
    "link",
    "settle",
    "take_kept",
    "take_prev",
    "track_ahead",
]


class Kept(NamedTuple):
    """The last unit's gathered weights, kept for its backward, which comes next."""

    call: Any  # weak reference to the call: a forward whose backward never comes (its
    # output dropped) would else keep its record, and through it its block, MainGrad and
    # shards, until this thread's next forward; only the weights stay until then
    full: list


@dataclass(eq=False)
class Chain:
    """The unit calls of one forward pass, until its backward ends: what they share.

    The chain links each call to the one called before it (backward prefetch: autograd's
    engine runs the most recently created ready node first, so the backward of unit ``i``
    comes just before that of unit ``i-1``, whose all-gather it issues), keeps the last
    unit's gathered weights for its backward (FSDP2 does not reshard its root either), and
    knows what is still in flight, so that the end of the backward (or an error) releases
    what will not be used."""

    last: Any = None  # weak reference to the last unit called (backward prefetch)
    kept: Kept | None = None  # dropped by the next unit's forward, or by the backward
    ahead: list = field(default_factory=list)  # calls with an all-gather issued ahead
    reducing: list = field(default_factory=list)  # calls whose reduce-scatter was issued
    closing: bool = False  # an end-of-backward callback is queued
    task: int = -1  # the backward (autograd graph task) it is queued on
    closed: bool = False  # a backward ended: the next forward starts a new chain


def join(call: Call, chain: Chain, mode: str) -> None:
    """``call`` is part of ``chain``, and runs its collectives in validation ``mode`` (read
    in the caller's context, carried on the record into backward)."""
    call.chain, call.mode = chain, mode


def link(call: Call) -> None:
    """Forward: ``call`` is the chain's last unit; the one before is its ``prev``."""
    chain = call.chain
    call.prev, chain.last = chain.last, weakref.ref(call)


def take_prev(call: Call) -> Call | None:
    """Backward: the unit called before ``call`` (to prefetch), if it still lives; once."""
    prev, call.prev = call.prev, None
    return prev() if prev is not None else None


def keep_last(chain: Chain, call: Call, full: list) -> None:
    """``call`` is the forward's last unit so far: its gathered weights are kept."""
    chain.kept = Kept(weakref.ref(call), full)


def take_kept(chain: Chain) -> Kept | None:
    """Backward: what the last unit kept, taken off the chain."""
    kept, chain.kept = chain.kept, None
    return kept


def drop_kept(chain: Chain) -> None:
    """The last unit of ``chain`` keeps its gathered weights no longer: released now (a
    call record gone took its weights with it)."""
    kept = take_kept(chain)
    call = kept.call() if kept is not None else None
    if call is not None:
        storage.release_weights(call)


def track_ahead(call: Call) -> None:
    """``call``'s all-gather was issued ahead: abandoned at the chain's end if unused."""
    if call.chain is not None:
        call.chain.ahead.append(weakref.ref(call))


def add_reducing(chain: Chain, call: Call) -> None:
    """``call``'s reduce-scatter was issued: abandoned at the chain's end if never waited."""
    chain.reducing.append(weakref.ref(call))


def settle(chain: Chain) -> None:
    """Wait for the reduce-scatters of ``chain`` still in flight and keep their results
    (shard-sized, the call's own) for their wait nodes, so that their gradient-sized
    inputs are freed now. Nothing is handed on here: a wait node that never runs (a
    gradient not asked for) still gives nothing to a MainGrad."""
    for ref in chain.reducing:
        call = ref()
        if call is not None:
            transfers.wait_early(call)


def abandon(chain: Chain) -> None:
    """A forward or backward that raised: close ``chain`` now, so that the next forward
    starts a new one, and release what it held (the last unit's weights, the all-gathers
    issued ahead, the reduce-scatters in flight)."""
    drop_kept(chain)
    chain.last, chain.closed, chain.closing = None, True, False
    _abandon_in_flight(chain)


def _abandon_in_flight(chain: Chain) -> None:
    """Release what ``chain`` still has in flight and will not use: all-gathers issued ahead
    and reduce-scatters whose wait node never ran (every rank issued them alike)."""
    calls, chain.ahead = chain.ahead, []
    for ref in calls:
        call = ref()
        if call is not None:
            transfers.abandon_ahead(call)
    reducing, chain.reducing = chain.reducing, []
    for ref in reducing:
        call = ref()
        if call is not None:
            transfers.abandon_reduce_scatter(call)


def close_at_end_of_backward(chain: Chain) -> None:
    """At the end of this backward: close ``chain`` (the next forward starts a new one),
    drop what its last unit kept, and release prefetches never used."""
    if chain.closing:
        return
    chain.closing, chain.task = True, torch._C._current_graph_task_id()

    def done() -> None:
        chain.closing, chain.closed, chain.last, chain.kept = False, True, None, None
        # prefetches never used; a reduce-scatter whose wait node did not run (autograd.grad
        # asked for other inputs)
        _abandon_in_flight(chain)

    torch.autograd.Variable._execution_engine.queue_callback(done)
