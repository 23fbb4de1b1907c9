"""What a thread's forward passes keep between unit calls, and only there.

That is the chain they extend, the wait nodes ``prefetch`` made ahead, and the composable
path's last unit: the package's one per-thread state (``_FORWARD``, a ``threading.local``;
what it holds and when it is released: :class:`_Forward`). Invariant: backward never reads
it; a backward may run on another thread (autograd's device threads), so everything a
backward needs is on the call record and its chain. The static check in
``tests/units/test_device_threads.py`` pins that no backward, jvp or vmap rule reaches a read of
it; every read of ``_FORWARD`` is in this module.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from ..base.cache import register
from . import chain as chains
from . import transfers
from .call import Call
from .chain import Chain

__all__ = ["Prepared", "current_chain", "forget", "remember", "swap_resharded", "take"]


class Prepared(NamedTuple):
    """A call record made ahead with its wait node, waiting for the call of its shards."""

    call: Call
    leaves: list  # the shards, as given
    wrapped: list  # the shards through the wait node
    grad: bool  # made with grad mode on: its wait node is in the graph


class _Forward(threading.local):
    """What a thread's forward passes keep between unit calls, and only there (backward
    never reads it): the chain they extend, and wait nodes made ahead by ``prefetch``.

    State and its release: per thread, the last chain (whose last unit keeps its gathered
    weights for its backward, until the end of that backward or, if none comes, this
    thread's next forward), at most ``_PREPARED`` wait nodes made ahead and never called
    (each holds its shards, its all-gather issued ahead abandoned when it is forgotten), and
    a weak reference to the composable path's last unit. ``fh.clear_caches()`` forgets this
    thread's (:meth:`_Forward.cache_clear`); another thread's goes with its next forward."""

    def __init__(self) -> None:
        self.chain: Chain | None = None
        self.prepared: dict[tuple[int, ...], Prepared] = {}
        self.resharded: Any = None  # weak reference to the composable path's last unit

    def cache_clear(self) -> None:
        """For :func:`~functional_hsdp.clear_caches`: forget what this thread's forwards keep
        (another thread's is its own): the last chain, whose last unit keeps its gathered
        weights for its backward (gathered again there if it comes), and the wait nodes made
        ahead and never called, which hold their shards (their all-gathers abandoned)."""
        chain, self.chain, self.resharded = self.chain, None, None
        if chain is not None:
            chains.drop_kept(chain)
        prepared, self.prepared = self.prepared, {}
        for entry in prepared.values():
            transfers.abandon_ahead(entry.call)


_FORWARD = _Forward()
register(_FORWARD)  # clear_caches forgets this thread's

#: Wait nodes made ahead (``prefetch``) and never called that a thread keeps, at most
_PREPARED = 4


def current_chain() -> Chain:
    """The chain this thread's next unit call joins: a new one after a backward ended."""
    chain = _FORWARD.chain
    if chain is not None and chain.closing and torch._C._current_graph_task_id() != chain.task:
        chains.abandon(chain)  # its backward raised: the end-of-backward callback never ran
    if chain is None or chain.closed:
        chain = _FORWARD.chain = Chain()
    return chain


def start_forward() -> None:
    """Begin a new forward pass on this thread: the unit calls from here on are one chain
    (what a model-level call, ``functional_call``, knows and a unit alone does not). A
    previous chain whose backward has not started is left to it, its last unit no longer
    kept; wait nodes made ahead and never called are forgotten."""
    chain = _FORWARD.chain
    if chain is not None and not chain.closed and not chain.closing:
        chains.drop_kept(chain)
    _FORWARD.chain = Chain()
    # wait nodes made ahead by an earlier forward (for a unit it did not call) belong to
    # that call, its options and grad mode: none is taken by this one
    prepared, _FORWARD.prepared = _FORWARD.prepared, {}
    for entry in prepared.values():
        transfers.abandon_ahead(entry.call)


def remember(call: Call, leaves: list, wrapped: list) -> None:
    """Keep a record made ahead until the call of ``leaves`` (the same tensors) takes it. One
    made before for the same tensors, or the oldest beyond ``_PREPARED``, is forgotten, its
    all-gather issued ahead abandoned."""
    prepared = _FORWARD.prepared
    key = tuple(map(id, leaves))
    if key in prepared:  # made ahead again before being called: the older one is unused
        transfers.abandon_ahead(prepared.pop(key).call)
    while len(prepared) >= _PREPARED:  # prepared but never called: forget the oldest
        transfers.abandon_ahead(prepared.pop(next(iter(prepared))).call)
    prepared[key] = Prepared(call, leaves, wrapped, grad=torch.is_grad_enabled())


def take(leaves: list) -> Prepared | None:
    """The record made ahead for these tensors, taken off the registry, or None. One made in
    the other grad mode (an eval forward's under ``torch.no_grad()``) is forgotten: its wait
    node would be missing from, or needlessly in, this call's graph."""
    found = _FORWARD.prepared.pop(tuple(map(id, leaves)), None)
    if found is not None and found.grad != torch.is_grad_enabled():
        transfers.abandon_ahead(found.call)
        return None
    return found


def forget(leaves: list) -> None:
    """Drop the record just remembered for these tensors (made at their call, not ahead)."""
    del _FORWARD.prepared[tuple(map(id, leaves))]


def swap_resharded(new: Any) -> Any:
    """The composable path's last unit (a weak reference, or None), replaced by ``new``."""
    old, _FORWARD.resharded = _FORWARD.resharded, new
    return old
