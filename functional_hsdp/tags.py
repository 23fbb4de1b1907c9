"""Result tags: which plan made a result leaf, at which role, in which state.

Every result leaf carries a small state tag, the way JAX tracks which axes a value varies
over, so that feeding a result back in the wrong state (a finalized result as ``acc``, weights
as gradients, another spec's result) is an error rather than silent corruption. Tags live in
a registry beside the tensors (keyed by ``id``, checked by a weak reference), not on them, so
that copying, pickling or ``torch.save`` of a result drags no plan or mesh along. A tensor the
user made (by ``tree_map``, a copy or a load) has no tag and is checked by structure, dtype and
shape only.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from itertools import count, repeat
from typing import Any

import torch

from .cache import register
from .errors import still_partial

__all__ = ["State", "kind_error", "result_state", "state_of", "tag", "untouched"]

KINDS = ("accumulating", "final", "weights")


@dataclass(frozen=True, eq=False)
class State:
    """What a tagged result is.

    Attributes:
        plan: the plan that made it.
        role: the role whose placements it is at.
        kind: ``"accumulating"`` (still Partial on the deferred axes), ``"final"`` or
            ``"weights"``.
        bufs: weak references to the bucket buffers its leaves view (None for a bucket whose
            leaves are copies), so that a later call given these very leaves back as ``acc``
            reads the buffer instead of packing the leaves again.
        refs: weak references to the result's leaves, in order.
        pointers: each leaf's data pointer when it was made: a leaf whose storage was
            replaced since (``.set_``, ``.data =``) no longer views its bucket.
        position: ``id(leaf)`` -> its index in the result.
    """

    plan: Any
    role: str
    kind: str
    bufs: tuple[weakref.ref | None, ...] | None = None
    refs: tuple[weakref.ref, ...] = ()
    pointers: tuple[int, ...] = ()
    position: dict = field(default_factory=dict)

    def index(self, leaf: Any) -> int | None:
        """``leaf``'s index in this result if it is one of its live leaves, else None."""
        i = self.position.get(id(leaf))
        return i if i is not None and self.refs[i]() is leaf else None


class _Registry(dict):
    """id(tensor) -> its State (one object per result: nothing allocated per leaf but the
    weak reference). No per-tensor callback (its cost would be paid on every result leaf):
    dead entries are swept whenever the registry has doubled."""

    def __init__(self) -> None:
        super().__init__()
        self.sweep_at = 1 << 14
        register(self)

    def cache_clear(self) -> None:
        self.clear()

    def add(self, leaves: list[torch.Tensor], state: State) -> None:
        self.update(zip(state.position, repeat(state)))
        if len(self) > self.sweep_at:
            for key in [k for k, st in self.items() if st.refs[st.position[k]]() is None]:
                del self[key]
            self.sweep_at = max(1 << 14, 2 * len(self))


_STATES = _Registry()
_deref = weakref.ref.__call__
_pointer = torch.Tensor.data_ptr


def tag(
    leaves: list[torch.Tensor], plan: Any, role: str, kind: str, bufs: list | None = None
) -> None:
    """Register ``leaves`` (one result, in tree order) with their state; ``bufs``: the bucket
    buffers they were unpacked from, remembered (weakly) where the leaves are views."""
    if torch.compiler.is_compiling():  # a side registry dynamo cannot trace: results untagged
        return
    if bufs is not None:  # a same-shape view's base lives as long as the leaves do
        bufs = tuple(
            weakref.ref(x._base if x._base is not None and x._base.shape == x.shape else x)
            if placed[role].views
            else None
            for x, placed in zip(bufs, plan.placed)
        )
    refs = tuple(map(weakref.ref, leaves))
    pointers = tuple(map(_pointer, leaves)) if bufs else ()
    state = State(plan, role, kind, bufs, refs, pointers, dict(zip(map(id, leaves), count())))
    _STATES.add(leaves, state)


def state_of(leaf: Any) -> tuple[State, int] | None:
    """``(state, index in its result)`` of a tagged leaf, else None. (Not under
    torch.compile: callers that can be traced check is_compiling first.)"""
    state = _STATES.get(id(leaf))
    if state is None:
        return None
    i = state.index(leaf)
    return None if i is None else (state, i)


def result_state(leaves: list) -> State | None:
    """The state of ``leaves`` if they are, in order, exactly the leaves of one result."""
    if torch.compiler.is_compiling() or not leaves:
        return None
    state = _STATES.get(id(leaves[0]))
    if state is None:
        return None
    # every leaf is the live object the result held at that position (C-level loops)
    if len(state.refs) == len(leaves) and all(map(operator.is_, map(_deref, state.refs), leaves)):
        return state
    return None


def untouched(state: State, leaves: list) -> bool:
    """Whether every leaf still has the storage it was made with (so still views its bucket)."""
    return list(map(_pointer, leaves)) == list(state.pointers)


_KIND_ERRORS = {
    ("final", "accumulating"): (
        "{path}: is a finalized result (reduce_grads(..., last=True) returned it), not a "
        "running accumulation; start the next step with acc=None"
    ),
    ("weights", "accumulating"): (
        "{path}: holds weights (from shard/sync_params), not a running gradient accumulation"
    ),
}


def kind_error(path: str, kind: str, wanted: tuple[str, ...]) -> str:
    """The message for a leaf of state ``kind`` where one of ``wanted`` is expected."""
    if kind == "accumulating":
        return still_partial(path)
    return _KIND_ERRORS[(kind, wanted[0])].format(path=path)
