"""DiLoCo's state: :class:`DiLoCoState`, its checks, and how it is saved and loaded.

Invariant: the state is the caller's pytree, and a checkpoint of it is whole at any step:
the syncs in flight are waited for and saved averaged in ``pending`` (:func:`pending_tree`,
zeros where nothing is held) beside the residual with their new residuals in place
(:func:`residual_tree`), so every step's checkpoint has one structure and loads with nothing
in flight.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ..base.tags import result_state, tag
from ..base.tree import MaskedNode, format_path, structure_error
from ..io.checkpoint import empty_state_dict, load_state_dict, load_tree, state_dict
from ..optim.combine import PartitionState
from .syncs import SyncInFlight

__all__ = ["DiLoCoState", "pending_tree", "residual_tree"]


class DiLoCoState(NamedTuple):
    """State of :func:`diloco` (a pytree: tensors and host ints).

    Attributes:
        anchor: tree like the params (local shards at the inner spec's optimizer placement):
            the weights of the last sync, equal on every replica.
        outer: a :class:`PartitionState` with one outer-optimizer state per fragment
            (labels ``"0"``, ``"1"``, ...; other fragments' leaves :class:`MaskedNode`).
        count: inner steps seen so far (a host int, the same on every rank).
        due: per fragment, the step after which its sync in flight lands (0: none).
        pending: tree like the params: for a fragment whose sync was reduced but has not
            landed (a sync in a state loaded from a checkpoint), its averaged
            pseudo-gradient (equal on every replica); :class:`MaskedNode`
            elsewhere (a sync in ``flight`` too), so that only what is held takes memory.
            None when ``delay == 0`` (nothing is ever in flight between calls). A
            checkpoint saves it whole (the syncs in flight waited for, zeros for the other
            MaskedNode leaves: ``functional_hsdp.diloco.pending_tree``); after a load, the next
            ``update`` masks the leaves of the fragments not due again.
        residual: with ``compress=`` and error feedback, tree like the params (fp32, local
            shards): what rounding lost of each rank's part of its fragment's last compressed
            sync that landed, added into the next (per rank: it differs between replicas);
            a sync in flight holds its fragment's new one (``residual_tree`` gives the tree
            with it in place, what a checkpoint saves). None otherwise.
        flight: per fragment, its sync in flight (a ``functional_hsdp.diloco.SyncInFlight``:
            a host object, not a tensor; the ``update`` where it lands waits for it), or
            None; ``()``: none anywhere. A sync is in flight from its issue to its landing
            when ``delay > 0`` (compressed: its first leg); checkpoints wait for it and save
            it in ``pending``, and pickling (``torch.save``, ``copy.deepcopy``) waits for it
            and keeps its result.
    """

    anchor: Any
    outer: PartitionState
    count: int
    due: tuple[int, ...]
    pending: Any
    residual: Any = None
    flight: tuple = ()

    # -- checkpoints: functional_hsdp.io.checkpoint's protocol ------------------------------

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """This state in a mesh-independent checkpoint (``fh.state_dict(state, spec)``), at
        any step: see :func:`_as_dict`."""
        field = lambda name: None if like is None else getattr(like, name)  # noqa: E731
        return _as_dict(self, lambda sub, name: state_dict(sub, spec, like=field(name)))

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load`` (``fh.empty_state_dict(like, spec)``)."""
        return _as_dict(self, lambda sub, _: empty_state_dict(sub, spec))

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> DiLoCoState:
        """The state :meth:`__fh_state_dict__` saved, loaded on ``spec``'s mesh (this state
        the like): nothing in flight, each saved sync held in ``pending``."""
        return _loaded(state, spec, self, name=name)


def pending_leaves(pending: Any) -> list:
    """``pending``'s leaves in tree order, a :class:`MaskedNode` one included."""
    return optree.tree_leaves(pending, is_leaf=lambda x: isinstance(x, MaskedNode))


def pending_tree(state: DiLoCoState) -> Any:
    """``state.pending`` whole: the syncs in flight waited for and in their place, zeros
    (like the anchor's leaves, and at their placement) in place of the other
    :class:`MaskedNode` leaves; what a checkpoint saves. None without a delay."""
    if state.pending is None:
        return None
    anchor, treedef = optree.tree_flatten(state.anchor)
    held = pending_leaves(state.pending)
    for i, x in _flown(state, SyncInFlight.result).items():
        held[i] = x
    full = [x if isinstance(x, torch.Tensor) else torch.zeros_like(a) for x, a in zip(held, anchor)]
    tag_like(full, anchor)
    return optree.tree_unflatten(treedef, full)


def residual_tree(state: DiLoCoState) -> Any:
    """``state.residual`` with the new residual of each compressed sync in flight in its
    fragment's place (the sync finished now: the update where it lands reuses it); what a
    checkpoint saves. None without error feedback."""
    if state.residual is None:
        return None
    leaves, treedef = optree.tree_flatten(state.residual)
    new = _flown(state, SyncInFlight.residual)
    if not new:
        return state.residual
    out = [new.get(i, x) for i, x in enumerate(leaves)]
    tag_like(out, leaves)
    return optree.tree_unflatten(treedef, out)


def _flown(state: DiLoCoState, which: Any) -> dict[int, torch.Tensor]:
    """Leaf index -> a copy of what the sync in flight on it brings (``which(sync)``: its
    result or its new residual, one tensor per leaf, or None), waited for now (the update
    where it lands reuses it). Copies: the originals are views of the reduction's buckets,
    and a checkpoint tags what it saves."""
    out = {}
    for sync in state.flight:
        got = None if sync is None else which(sync)
        if got is not None:
            out.update((i, x.clone()) for i, x in zip(sync.leaves, got))
    return out


def tag_like(out: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
    """Tag ``out`` with the placement ``leaves`` carry (the params'), if they carry one."""
    made = result_state(leaves)
    if made is not None:  # the params' placement, kept (as apply_updates does)
        tag(out, made.plan, made.role, kind=made.kind)


def _check_flight(state: DiLoCoState, n: int) -> None:
    """``state.flight``: ``()``, or per fragment None or its own :class:`SyncInFlight`, due."""
    if state.flight and (
        len(state.flight) != n
        or any(x is not None and not isinstance(x, SyncInFlight) for x in state.flight)
    ):
        raise ValueError(
            f"state.flight: expected {n} entries (None or a SyncInFlight, per fragment); "
            f"got {state.flight!r}"
        )
    for p, sync in enumerate(state.flight):
        if sync is not None and (sync.fragment != p or state.due[p] <= state.count):
            raise ValueError(
                f"state.flight[{p}]: {sync!r} does not match fragment {p}'s schedule (due "
                f"after step {state.due[p]}, the state at step {state.count}): this state was "
                "not made by init and update"
            )


def check_state(
    state: Any, treedef: Any, *, leaves: list, n: int, delay: int, feedback: bool
) -> None:
    """``state`` is one that ``init`` and ``update`` of this diloco (fragments, ``delay``,
    error feedback) made for the params' ``leaves`` and ``treedef``, or raise naming the path."""
    if not isinstance(state, DiLoCoState):
        raise TypeError(
            f"state: expected a DiLoCoState (from this diloco's init); got {type(state).__name__}"
        )
    if len(state.due) != n or (state.pending is None) != (delay == 0):
        raise ValueError("state: was made by another diloco (fragments or delay differ)")
    if (state.residual is None) == feedback:
        raise ValueError(
            "state: was made by another diloco (compress differs: the residual of error "
            f"feedback is {'missing' if feedback else 'there'})"
        )
    _check_flight(state, n)
    held = None if state.pending is None else len(pending_leaves(state.pending))
    if held is not None and held != len(leaves):
        raise ValueError(
            f"state.pending: {held} leaves, the params {len(leaves)}: this state was made "
            "for another tree"
        )
    for name in ("anchor", "residual"):
        tree = getattr(state, name)
        if tree is None:
            continue
        got, got_def = optree.tree_flatten(tree)
        if got_def != treedef:
            raise ValueError(structure_error(treedef, tree, f"state.{name}", what="params"))
        for i, (a, p) in enumerate(zip(got, leaves)):
            if a.shape != p.shape:  # the path only for the message: not on every call
                path = format_path(treedef.paths()[i])
                raise ValueError(
                    f"state.{name}{path}: local shape {tuple(a.shape)}, params{path} "
                    f"{tuple(p.shape)}: this state was made for another spec or tree"
                )


# -- checkpoints ------------------------------------------------------------------------------


def _as_dict(state: DiLoCoState, convert: Any) -> dict[str, Any]:
    """A DiLoCoState as a dict: its trees (anchor, pending, residual) and outer state
    converted (``convert(value, field name)``), the step count and each fragment's due step
    as host values. A sync in flight (``state.flight``) is waited for and saved averaged in
    ``pending`` (the update where it lands gets the same tensors), so any step saves;
    ``pending`` is saved whole (:func:`pending_tree`: zeros where it is MaskedNode), so every
    step's checkpoint has one structure, and the state it loads into has nothing in
    flight. The residual of a compressed sync's error feedback is per rank: a tree at the
    params' placement, saved like them (one row per replica, each replica's own), with the
    new residual of a compressed sync in flight in its fragment's place
    (:func:`residual_tree`)."""
    out = {
        "anchor": convert(state.anchor, "anchor"),
        "outer": convert(state.outer, "outer"),
        "count": state.count,
        "due": list(state.due),
    }
    trees = {"pending": pending_tree(state), "residual": residual_tree(state)}
    for name, tree in trees.items():
        if tree is not None:
            out[name] = convert(tree, name)
    return out


def _loaded(state: dict, spec: Any, like: DiLoCoState, *, name: str) -> DiLoCoState:
    """What :func:`_as_dict` saved, loaded at ``like``'s layout (``name``: for errors)."""
    trees = [key for key in ("pending", "residual") if getattr(like, key) is not None]
    for key in ("anchor", "outer", "count", "due", *trees):
        if key not in state:
            raise ValueError(f"{name}: has no entry {key!r} (for DiLoCoState.{key})")
    if len(state["due"]) != len(like.due):
        raise ValueError(
            f"{name}['due']: {len(state['due'])} fragments, but like has {len(like.due)}: "
            "load with the diloco (fragments) the checkpoint was saved with"
        )
    # the residual (fp32) sits at the params' layout: their dtypes choose its buckets
    kinds = dict(residual=tuple(x.dtype for x in optree.tree_leaves(like.anchor)))
    loaded = dict.fromkeys(("pending", "residual"))
    likes = {"pending": pending_tree(like), "residual": like.residual}
    for key in trees:
        loaded[key] = load_tree(
            state[key], spec, likes[key], name=f"{name}[{key!r}]", kinds=kinds.get(key)
        )
    return DiLoCoState(
        anchor=load_tree(state["anchor"], spec, like.anchor, name=f"{name}['anchor']"),
        outer=load_state_dict(state["outer"], spec, like.outer),
        count=int(state["count"]),
        due=tuple(int(x) for x in state["due"]),
        **loaded,
    )
