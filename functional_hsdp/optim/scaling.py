"""Elementwise transformations that keep no moments: :func:`scale`,
:func:`scale_by_learning_rate` (its state the step count a schedule reads) and
:func:`add_decayed_weights`, optax's transformations of the same names.

Invariant: each acts leaf by leaf on local shards of any placement, so none communicates; a
learning rate is a number or a schedule evaluated at the state's ``count`` (0 first).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from ..base.tree import format_path
from .schedules import Schedule, check_lr, value_at
from .transformation import (
    EmptyState,
    GradientTransformation,
    check_empty,
    check_hyper,
    check_state,
    empty_init,
    like_params,
    tensor_leaves,
)

__all__ = [
    "ScaleByLearningRateState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
]


class ScaleByLearningRateState(NamedTuple):
    """State of :func:`scale_by_learning_rate`.

    Attributes:
        count: number of updates so far (a host int): the step a schedule is evaluated at.
    """

    count: int


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant (optax's ``scale``).

    Args:
        step_size: the factor (any finite number; negative flips the sign).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> opt = fh.scale(-2.0)
        >>> opt.update({"w": torch.ones(2)}, opt.init(None))[0]
        {'w': tensor([-2., -2.])}
    """
    if (
        isinstance(step_size, bool)
        or not isinstance(step_size, (int, float))
        or not math.isfinite(step_size)
    ):
        raise ValueError(f"scale: step_size must be a finite number; got {step_size!r}")

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        check_empty(state)
        leaves, treedef, _ = tensor_leaves(updates, "updates")
        return optree.tree_unflatten(treedef, [step_size * u for u in leaves]), state

    return GradientTransformation(empty_init, update)


def _mask_of(mask: Any, params: Any) -> list[bool]:
    """Every params leaf's mask value, checked (errors name the path)."""
    leaves, treedef = optree.tree_flatten(params)
    paths = treedef.paths()
    if mask is None:
        return [True] * len(leaves)
    if callable(mask):
        out, where = [mask(path, leaf) for path, leaf in zip(paths, leaves)], "mask(path, leaf)"
    else:
        errors = optree.prefix_errors(mask, params)
        if errors:
            raise ValueError(
                "add_decayed_weights: mask is not a tree of bools with the params' structure "
                f"(or a prefix of it): {errors[0]('mask')}"
            )
        out = optree.tree_leaves(optree.tree_broadcast_prefix(mask, params))
        where = "mask"
    for path, value in zip(paths, out):
        if not isinstance(value, bool):
            raise TypeError(
                f"{where} for params{format_path(path)}: expected a bool (True: decay this "
                f"leaf); got {type(value).__name__} {value!r}"
            )
    return out


def add_decayed_weights(weight_decay: float, mask: Any = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (optax's ``add_decayed_weights``).

    Before :func:`scale_by_learning_rate` this is decoupled weight decay (AdamW's:
    ``p -= lr * weight_decay * p``). Elementwise: no communication.

    Args:
        weight_decay: the factor (a number >= 0).
        mask: which leaves to decay: None (all); a tree of bools with the params'
            structure, or a pytree prefix of it (``{"w": True, "b": False}``); or a callable
            ``(path, leaf) -> bool`` as :func:`~functional_hsdp.partition`'s labels
            (``path`` the tuple of keys to the leaf, ``leaf`` its local shard: decide by
            path, since a Flat shard is 1-D).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`. Its
        ``update`` needs ``params``.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> opt = fh.add_decayed_weights(0.1, mask=lambda path, leaf: path[-1] != "b")
        >>> grads = {"w": torch.zeros(2), "b": torch.zeros(1)}
        >>> opt.update(grads, opt.init(params), params)[0]
        {'w': tensor([0.1000, 0.1000]), 'b': tensor([0.])}
    """
    check_hyper(weight_decay=weight_decay)
    if not (mask is None or callable(mask)):
        optree.tree_leaves(mask)  # a tree; checked against the params at each call

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        check_empty(state)
        if params is None:
            raise ValueError("add_decayed_weights: update needs params (the weights to decay)")
        p, treedef, _ = tensor_leaves(params, "params")
        hint = "pass the updates of these params"
        u, _ = like_params(updates, "updates", params=p, params_def=treedef, hint=hint)
        decay = _mask_of(mask, params)
        out = [
            torch.add(ui, pi, alpha=weight_decay) if d and weight_decay else ui
            for ui, pi, d in zip(u, p, decay)
        ]
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(empty_init, update)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (optax's ``scale_by_learning_rate``).

    Args:
        learning_rate: a number >= 0, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`), evaluated at the state's ``count``: 0 on the
            first update, as optax's and as ``torch.optim.lr_scheduler.LambdaLR``'s
            ``lr_lambda(0)`` for the first ``optimizer.step()``.
        flip_sign: multiply by ``-lr`` (descent; default) or by ``lr``.

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ScaleByLearningRateState`
        (the step count, so a checkpoint resumes the schedule).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> opt = fh.scale_by_learning_rate(fh.schedules.linear(1.0, 0.0, transition_steps=2))
        >>> state, g = opt.init(None), {"w": torch.ones(1)}
        >>> for _ in range(3):
        ...     updates, state = opt.update(g, state)
        ...     print(updates["w"])
        tensor([-1.])
        tensor([-0.5000])
        tensor([-0.])
    """
    check_lr(learning_rate, "learning_rate")

    def init(params: Any) -> ScaleByLearningRateState:
        return ScaleByLearningRateState(0)

    def update(
        updates: Any, state: Any, params: Any = None
    ) -> tuple[Any, ScaleByLearningRateState]:
        check_state(state, ScaleByLearningRateState)
        lr = value_at(learning_rate, state.count, "learning_rate")
        factor = -lr if flip_sign else lr
        leaves, treedef, _ = tensor_leaves(updates, "updates")
        out = optree.tree_unflatten(treedef, [factor * u for u in leaves])
        return out, ScaleByLearningRateState(state.count + 1)

    return GradientTransformation(init, update)
