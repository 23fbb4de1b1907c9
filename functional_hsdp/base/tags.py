"""Result tags: which plan made a result leaf, at which role, in which state.

Every result leaf carries a small state tag, the way JAX tracks which axes a value varies
over, so that feeding a result back in the wrong state (a finalized result as ``acc``, weights
as gradients, another spec's result) is an error rather than silent corruption. Tags live in
registries beside the tensors, not on them, so that copying, pickling or ``torch.save`` of a
result drags no plan or mesh along. A tensor the user made (by ``tree_map``, a copy or a
load) has no tag and is checked by structure, dtype and shape only. What tagging costs:
:func:`tag`.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from itertools import repeat
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
        pointers: each leaf's data pointer when it was made (only with ``bufs``): a leaf
            whose storage was replaced since (``.set_``, ``.data =``) no longer views its
            bucket.
    """

    plan: Any
    role: str
    kind: str
    bufs: tuple[weakref.ref | None, ...] | None = None
    refs: tuple[weakref.ref, ...] = ()
    pointers: tuple[int, ...] = ()
    # id(leaf) -> index, built on the first per-leaf question (most results are never asked)
    _position: dict | None = field(default=None, repr=False)

    def index(self, leaf: Any) -> int | None:
        """``leaf``'s index in this result if it is one of its live leaves, else None."""
        position = self._position
        if position is None:
            position = {id(x): i for i, x in enumerate(map(_deref, self.refs)) if x is not None}
            object.__setattr__(self, "_position", position)
        i = position.get(id(leaf))
        return i if i is not None and self.refs[i]() is leaf else None

    def alive(self) -> bool:
        """Whether any of its leaves is still alive."""
        return any(map(operator.is_not, map(_deref, self.refs), repeat(None)))


_deref = weakref.ref.__call__
_pointer = torch.Tensor.data_ptr
_is = operator.is_


class _Leaves(dict):
    """id(leaf) -> (State, index), for result leaves that are not views of a bucket buffer.
    No per-tensor callback (its cost would be paid on every leaf): dead entries are swept
    whenever the registry has doubled."""

    def __init__(self) -> None:
        super().__init__()
        self.sweep_at = 1 << 14
        register(self)

    def cache_clear(self) -> None:
        self.clear()

    def add(self, leaves: list, indices: Any, state: State) -> None:
        self.update(zip(map(id, leaves), zip(repeat(state), indices)))
        if len(self) > self.sweep_at:
            for key in [k for k, (st, i) in self.items() if st.refs[i]() is None]:
                del self[key]
            self.sweep_at = max(1 << 14, 2 * len(self))


class _Views(dict):
    """id(buffer) -> [weak reference to the buffer, the States of results that view it].
    A buffer lives as long as any view of it (PyTorch keeps a view's base alive), and its
    entry goes with it (a callback per buffer, not per leaf)."""

    def __init__(self) -> None:
        super().__init__()
        register(self)

    def cache_clear(self) -> None:
        self.clear()

    def add(self, root: torch.Tensor, state: State) -> None:
        key = id(root)
        entry = self.get(key)
        if entry is None or entry[0]() is not root:
            ref = weakref.ref(root, lambda r, key=key: self._drop(key, r))
            self[key] = [ref, [state], 4]
            return
        states = entry[1]
        if states[-1] is not state:
            states.append(state)
            if len(states) > entry[2]:  # a long-lived buffer (MainGrad's): forget dead results
                states[:] = [s for s in states if s.alive()]
                entry[2] = max(4, 2 * len(states))

    def _drop(self, key: int, ref: weakref.ref) -> None:
        entry = self.get(key)
        if entry is not None and entry[0] is ref:
            del self[key]

    def states(self, root: Any) -> list[State]:
        """The States of results viewing ``root``, newest last (empty if none)."""
        entry = self.get(id(root))
        return entry[1] if entry is not None and entry[0]() is root else []


_LEAVES = _Leaves()
_VIEWS = _Views()

# plan -> role -> (per view bucket: the index of its first leaf; indices of the other leaves)
_SPLIT: weakref.WeakKeyDictionary = register(weakref.WeakKeyDictionary())


def _split(plan: Any, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    by_role = _SPLIT.get(plan)
    if by_role is None:
        by_role = _SPLIT[plan] = {}
    split = by_role.get(role)
    if split is None:
        firsts, copies = [], [s.index for s in plan.empty]
        for bucket, placed in zip(plan.buckets, plan.placed):
            if placed[role].views:
                firsts.append(bucket.slots[0].index)
            else:
                copies.extend(s.index for s in bucket.slots)
        split = by_role[role] = (tuple(firsts), tuple(sorted(copies)))
    return split


def tag(
    leaves: list[torch.Tensor], plan: Any, role: str, *, kind: str, bufs: list | None = None
) -> None:
    """Register ``leaves`` (one result, in tree order) with their state; ``bufs``: the bucket
    buffers they were unpacked from, remembered (weakly) where the leaves are views.

    Tagging costs one weak reference per leaf; the rest is per bucket. Most result leaves are
    views of their bucket's buffer (the plan says which:
    :attr:`~functional_hsdp.plan.recipe.Placed.views`): those are registered once per bucket,
    under the buffer they view (``leaf._base``), and a leaf is found by its buffer and then by
    identity in the result. Only leaves that are copies (a SimMesh's ragged pieces, a
    ``Shard(d)`` bucket's chunks, zero-size leaves) are registered one by one."""
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
    pointers = tuple(map(_pointer, leaves)) if bufs is not None else ()
    state = State(plan=plan, role=role, kind=kind, bufs=bufs, refs=refs, pointers=pointers)
    firsts, copies = _split(plan, role)
    roots = [leaves[i]._base for i in firsts]
    if any(root is None for root in roots):  # views without a base (inference_mode): per leaf
        copies = range(len(leaves))
    else:
        for root in roots:
            _VIEWS.add(root, state)
    if len(copies) == len(leaves):
        _LEAVES.add(leaves, range(len(leaves)), state)
    elif copies:
        _LEAVES.add([leaves[i] for i in copies], copies, state)


def state_of(leaf: Any) -> tuple[State, int] | None:
    """``(state, index in its result)`` of a tagged leaf, else None. (Not under
    torch.compile: callers that can be traced check is_compiling first.)"""
    found = _LEAVES.get(id(leaf))
    if found is not None and found[0].refs[found[1]]() is leaf:
        return found
    base = getattr(leaf, "_base", None) if isinstance(leaf, torch.Tensor) else None
    if base is not None:
        for state in reversed(_VIEWS.states(base)):
            i = state.index(leaf)
            if i is not None:
                return state, i
    return None


def state_of_alias(leaf: torch.Tensor) -> tuple[State, int] | None:
    """:func:`state_of`, else that of a tagged leaf ``leaf`` is an alias of (forward mode's
    dual tensor of a shard is a view of it, or of the bucket buffer it is itself a view of):
    the leaf its base is, else a leaf of a result viewing that same base, of the same memory,
    shape and strides if one is (leaves of one base are one bucket's: one unit's). None if
    neither."""
    found = state_of(leaf)
    base = getattr(leaf, "_base", None)
    if found is not None or base is None:
        return found
    found = state_of(base)
    if found is not None:
        return found
    key = (leaf.data_ptr(), leaf.shape, leaf.stride())
    fallback = None
    for state in reversed(_VIEWS.states(base)):
        for i, ref in enumerate(state.refs):
            y = ref()
            if y is None or y._base is not base:
                continue
            if (y.data_ptr(), y.shape, y.stride()) == key:
                return state, i
            fallback = fallback or (state, i)
    return fallback


def result_state(leaves: list) -> State | None:
    """The state of ``leaves`` if they are, in order, exactly the leaves of one result."""
    if torch.compiler.is_compiling() or not leaves:
        return None
    first = leaves[0]
    found = _LEAVES.get(id(first))
    # an entry of a dead leaf whose id this one reuses (swept lazily) must not hide the views
    if found is not None and found[1] == 0 and found[0].refs[0]() is first:
        candidates = [found[0]]
    else:
        base = getattr(first, "_base", None) if isinstance(first, torch.Tensor) else None
        candidates = reversed(_VIEWS.states(base)) if base is not None else ()
    for state in candidates:
        refs = state.refs
        # every leaf is the live object the result held at that position (C-level loops)
        if len(refs) == len(leaves) and all(map(_is, map(_deref, refs), leaves)):
            return state
    return None


def untouched(state: State, leaves: list) -> bool:
    """Whether every leaf still has the storage it was made with (so still views its bucket)."""
    return tuple(map(_pointer, leaves)) == state.pointers


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
