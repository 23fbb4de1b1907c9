"""What every optimizer room builds on: :class:`GradientTransformation`, :class:`EmptyState`,
:func:`apply_updates`, and the checks the rooms share (optax's ``GradientTransformation``).

Invariant: a transformation is a pair of pure functions on local shards; its state is a pytree
the caller holds (a NamedTuple), and bad input is refused naming the pytree path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from ..base.errors import still_partial
from ..base.tags import result_state, state_of, tag
from ..base.tree import flatten, structure_error

__all__ = ["EmptyState", "GradientTransformation", "apply_updates"]


class GradientTransformation(NamedTuple):
    """A pair of pure functions, as optax's.

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(grads, state, params) -> (updates, new_state)``; apply with
            :func:`apply_updates`.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none (:func:`scale`,
    :func:`add_decayed_weights`, :func:`clip_global_norm`)."""


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def tensor_leaves(tree: Any, name: str) -> tuple[list, optree.PyTreeSpec, tuple[str, ...]]:
    """``(leaves, treedef, paths)`` of a tree whose leaves must be tensors."""
    leaves, treedef, names = flatten(tree, name)
    for leaf, path in zip(leaves, names):
        if not is_tensor(leaf):
            raise TypeError(f"{path}: expected a torch.Tensor leaf; got {type(leaf).__name__}")
    return leaves, treedef, names


def like_params(
    tree: Any, name: str, *, params: list, params_def: optree.PyTreeSpec, hint: str
) -> tuple[list, list[str]]:
    """``tree``'s leaves and paths, checked to have the structure and local shapes of params."""
    leaves, treedef, names = tensor_leaves(tree, name)
    if treedef != params_def:
        error = structure_error(params_def, tree, name, what="params")
        raise ValueError(f"{error}; {hint}")
    for leaf, p, path in zip(leaves, params, names):
        if leaf.shape != p.shape:
            raise ValueError(
                f"{path}: expected local shape {tuple(p.shape)} (as params"
                f"{path[len(name) :]}); got {tuple(leaf.shape)}; {hint}"
            )
    return leaves, names


STATE_HINT = (
    "this optimizer state was made for another spec or tree (its local shards are laid out "
    "differently); call init(params) with params at this spec's optimizer placement"
)
GRAD_HINT = (
    "grads must be local shards at the placement of params (a final reduce_grads result, "
    "with the spec params were sharded with)"
)


def grads_like(grads: Any, params: list, params_def: optree.PyTreeSpec) -> list[torch.Tensor]:
    """``grads``' leaves, checked against the params' and cast to their dtypes; a
    still-accumulating gradient is refused."""
    for leaf, path in zip(*tensor_leaves(grads, "grads")[::2]):
        found = state_of(leaf)
        if found is not None and found[0].kind == "accumulating":
            raise ValueError(still_partial(path))
    leaves, _ = like_params(grads, "grads", params=params, params_def=params_def, hint=GRAD_HINT)
    return [g.to(p.dtype) for g, p in zip(leaves, params)]


def moments_like(tree: Any, name: str, *, params: list, params_def: optree.PyTreeSpec) -> list:
    """A state's tree of per-leaf buffers (moments), checked to be laid out as the params."""
    leaves, names = like_params(tree, name, params=params, params_def=params_def, hint=STATE_HINT)
    for leaf, p, path in zip(leaves, params, names):
        if leaf.dtype != p.dtype:
            raise TypeError(f"{path}: expected dtype {p.dtype} (as params); got {leaf.dtype}")
    return leaves


def check_state(state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(
            f"state: expected {article} {cls.__name__} (from this optimizer's init); got "
            f"{type(state).__name__}"
        )


def check_hyper(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0; got {value!r}")


def empty_init(params: Any) -> EmptyState:
    return EmptyState()


def check_empty(state: Any) -> None:
    if not isinstance(state, EmptyState):
        raise TypeError(f"state: expected an EmptyState (from init); got {type(state).__name__}")


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates``, leaf by leaf (a new tree; nothing is mutated).

    Args:
        params: pytree of local shards.
        updates: a tree of the same structure and local shapes (from an ``update``).

    Returns:
        A new tree of ``p + u``, in each param's dtype. Where ``params`` is, as a whole, a
        tree the library returned (``shard``, ``sync_params``, an earlier
        ``apply_updates``), the new tree carries its state tag: later calls read it at the
        same placement without looking at shapes (which some layouts share between the
        optimizer and the parameter placement on some ranks).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> fh.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    p, treedef, _ = tensor_leaves(params, "params")
    hint = "pass the updates that update() returned for params"
    u, _ = like_params(updates, "updates", params=p, params_def=treedef, hint=hint)
    out = [(pi + ui).to(pi.dtype) for pi, ui in zip(p, u)]
    made = result_state(p)
    if made is not None:  # the params' placement, kept: p + u has p's layout
        tag(out, made.plan, made.role, kind=made.kind)
    return optree.tree_unflatten(treedef, out)
