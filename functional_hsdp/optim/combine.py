"""Combinators: :func:`chain` (one transformation after another) and :func:`partition`
(a transformation per leaf, by label: optax's ``multi_transform``), with their states
(optax's ``transforms/_combining.py``).

Invariant: a combinator's state holds its members' states and nothing else, and saves itself
by the checkpoint protocol (each member's state under its index or label); in ``partition``
each member sees the other labels' leaves as :class:`MaskedNode` s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree

from ..base.tree import MaskedNode, format_path, is_masked, masked_node
from ..io.checkpoint import empty_member, load_members, save_member
from .transformation import GradientTransformation

__all__ = ["ChainState", "PartitionState", "chain", "partition"]


class ChainState(NamedTuple):
    """State of :func:`chain`.

    Attributes:
        inner: a tuple of the chained transformations' states, in their order.
    """

    inner: tuple

    # checkpoints (functional_hsdp.io.checkpoint's protocol): each state under its index

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """``{"0": ..., "1": ...}``: each transformation's state as ``fh.state_dict``
        saves it (a NamedTuple of your own field by field)."""
        likes = dict(enumerate(like.inner)) if isinstance(like, ChainState) else {}
        return {str(i): save_member(x, spec, like=likes.get(i)) for i, x in enumerate(self.inner)}

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load``, one entry per transformation."""
        return {str(i): empty_member(x, spec) for i, x in enumerate(self.inner)}

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> ChainState:
        """Each transformation's state loaded (this state the like)."""
        members = {str(i): x for i, x in enumerate(self.inner)}
        loaded = load_members(state, spec, members, name=name, owner="ChainState")
        return ChainState(tuple(loaded.values()))


def _is_transformation(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Transformations applied one after another (optax's ``chain``).

    ``update`` passes the updates through each transformation in turn, each with its own
    state and the same ``params``. Any ``(init, update)`` pair on local shards chains: the
    library's and your own (``update(updates, state, params) -> (updates, state)``; an
    elementwise function of local shards needs no communication).

    Args:
        *transforms: :class:`GradientTransformation` s (or any objects with ``init`` and
            ``update``).

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ChainState` of theirs.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.chain(fh.scale(0.5), fh.scale_by_learning_rate(0.1))
        >>> updates, state = opt.update({"w": torch.tensor([2.0, -4.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.2000])
        >>> state.inner
        (EmptyState(), ScaleByLearningRateState(count=1))
    """
    for i, tx in enumerate(transforms):
        if not _is_transformation(tx):
            raise TypeError(
                f"chain: transforms[{i}] is not a GradientTransformation (an object with init "
                f"and update); got {type(tx).__name__}"
            )

    def init(params: Any) -> ChainState:
        return ChainState(tuple(tx.init(params) for tx in transforms))

    def update(updates: Any, state: ChainState, params: Any = None) -> tuple[Any, ChainState]:
        if not isinstance(state, ChainState) or len(state.inner) != len(transforms):
            got = len(state.inner) if isinstance(state, ChainState) else type(state).__name__
            raise TypeError(
                f"state: expected the ChainState of this chain's init ({len(transforms)} "
                f"states); got {got}"
            )
        new = []
        for i, (tx, s) in enumerate(zip(transforms, state.inner)):
            try:
                updates, s = tx.update(updates, s, params)
            except Exception as e:
                e.add_note(f"(in chain's transforms[{i}])")
                raise
            new.append(s)
        return updates, ChainState(tuple(new))

    return GradientTransformation(init, update)


class PartitionState(NamedTuple):
    """State of :func:`partition`.

    Attributes:
        inner: ``{label: that transformation's state}`` (its trees hold
            :class:`MaskedNode` leaves where other labels' leaves are).
    """

    inner: dict

    # checkpoints (functional_hsdp.io.checkpoint's protocol): each label's state under its label

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """``{label: ...}``: each label's state as ``fh.state_dict`` saves it (its trees'
        MaskedNode leaves are another label's, saved there)."""
        likes = like.inner if isinstance(like, PartitionState) else {}
        return {k: save_member(x, spec, like=likes.get(k)) for k, x in self.inner.items()}

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load``, one entry per label."""
        return {k: empty_member(x, spec) for k, x in self.inner.items()}

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> PartitionState:
        """Each label's state loaded (this state the like)."""
        inner = dict(self.inner)
        return PartitionState(load_members(state, spec, inner, name=name, owner="PartitionState"))


def partition(transforms: dict[str, GradientTransformation], labels: Any) -> GradientTransformation:
    """A transformation per leaf, by label (optax's ``multi_transform``).

    Each transformation sees the params, gradients and its state with the other labels'
    leaves :class:`MaskedNode` s (empty subtrees: ``tree_map`` passes them by), and its updates
    fill its own leaves of the result.

    Args:
        transforms: ``{label: GradientTransformation}``.
        labels: a tree of labels with the params' structure (or a pytree prefix of it), or a
            callable ``(path, leaf) -> label``, ``path`` the tuple of keys to the leaf
            (``("layers", 0, "w")``) and ``leaf`` the params' leaf (a local shard: on a Flat
            placement 1-D, so decide by path, or by full shapes you hold).

    Returns:
        A :class:`~functional_hsdp.GradientTransformation`; its state is a
        :class:`PartitionState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.ddp(mesh)
        >>> params = fh.shard({"w": torch.eye(3), "b": torch.zeros(3)}, spec)
        >>> opt = fh.partition({"muon": fh.muon(spec, lr=0.1), "adamw": fh.adamw(lr=0.1)},
        ...                    lambda path, leaf: "muon" if path[0] == "w" else "adamw")
        >>> g = fh.reduce_grads({"w": torch.ones(2, 3, 3), "b": torch.ones(2, 3)}, spec,
        ...                     last=True)
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> isinstance(state, fh.PartitionState), sorted(state.inner), updates["b"][0]
        (True, ['adamw', 'muon'], tensor([-0.1000, -0.1000, -0.1000]))
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("partition: transforms must be a non-empty dict {label: transformation}")
    for label, tx in transforms.items():
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"partition: transforms[{label!r}] is not a GradientTransformation")

    def init(params: Any) -> PartitionState:
        of = _labels(labels, params, transforms)
        marks = [masked_node(x) for x in optree.tree_leaves(params)]
        inner = {k: tx.init(_mask(params, of, keep=k, marks=marks)) for k, tx in transforms.items()}
        return PartitionState(inner)

    def update(grads: Any, state: PartitionState, params: Any) -> tuple[Any, PartitionState]:
        if not isinstance(state, PartitionState) or set(state.inner) != set(transforms):
            raise TypeError("state: expected the PartitionState this partition's init made")
        of = _labels(labels, params, transforms)
        leaves, treedef = optree.tree_flatten(params)
        marks = [masked_node(x) for x in leaves]  # the params' metadata: one tree structure for all
        out, inner = list(leaves), {}
        for k, tx in transforms.items():
            masked_grads, masked_params = (
                _mask(grads, of, keep=k, marks=marks),
                _mask(params, of, keep=k, marks=marks),
            )
            u, inner[k] = tx.update(masked_grads, state.inner[k], masked_params)
            for i, x in enumerate(optree.tree_flatten(u, is_leaf=is_masked)[0]):
                if of[i] == k:
                    out[i] = x
        return optree.tree_unflatten(treedef, out), PartitionState(inner)

    return GradientTransformation(init, update)


def _labels(labels: Any, params: Any, transforms: dict) -> list[str]:
    """Every leaf's label, checked."""
    leaves, treedef = optree.tree_flatten(params)
    paths = treedef.paths()
    if callable(labels):
        out = [labels(path, leaf) for path, leaf in zip(paths, leaves)]
    else:
        try:
            out = optree.tree_leaves(optree.tree_broadcast_prefix(labels, params))
        except ValueError as e:
            raise ValueError(f"partition: labels is not a prefix of the params' tree: {e}") from e
    for path, label in zip(paths, out):
        if label not in transforms:
            raise ValueError(
                f"params{format_path(path)}: label {label!r} has no transformation; the labels "
                f"are {sorted(transforms)}"
            )
    return out


def _mask(tree: Any, of: list[str], *, keep: str, marks: list[MaskedNode]) -> Any:
    """``tree`` with the leaves of other labels than ``keep`` replaced by ``marks`` (the
    params', so that the params, gradients and states of one label have one structure)."""
    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_masked)
    if len(leaves) != len(of):
        raise ValueError(
            f"partition: a tree of {len(leaves)} leaves where the params have {len(of)}"
        )
    kept = [
        x if label == keep or is_masked(x) else mark for x, label, mark in zip(leaves, of, marks)
    ]
    return optree.tree_unflatten(treedef, kept)
