"""Stochastic gradient descent: :func:`sgd` with ``torch.optim.SGD``'s math (momentum,
``nesterov=``, coupled weight decay) and its :class:`SGDState`.

Invariant: elementwise on local shards (no communication); the momentum buffers are a tree laid
out as the params, or None without momentum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from .schedules import Schedule, check_lr, value_at
from .transformation import (
    GradientTransformation,
    check_hyper,
    check_state,
    grads_like,
    moments_like,
    tensor_leaves,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        momentum: tree like the params (local shards) of momentum buffers; None without
            momentum.
    """

    count: int
    momentum: Any


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD``'s math, on local shards.

    ``d = g + weight_decay * p``; with momentum ``buf = momentum * buf + d`` (``buf = d`` on
    the first step) and ``d = buf``, or with ``nesterov`` ``d = d + momentum * buf``; the
    update is ``-lr * d``.

    Args:
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0, kept in the state's
            ``count``).
        momentum: momentum factor (0: none, no per-parameter state).
        weight_decay: L2 penalty added to the gradient (coupled, as torch.optim.SGD).
        nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)`` (needs
            ``momentum > 0``). DiLoCo's outer optimizer is ``sgd(0.7, 0.9, nesterov=True)``.

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`SGDState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.sgd(lr=0.1, momentum=0.9)
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> fh.apply_updates(params, updates)["w"], state.count
        (tensor([0.9000, 0.9000]), 1)
    """
    check_lr(lr)
    check_hyper(momentum=momentum, weight_decay=weight_decay)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool; got {nesterov!r}")
    if nesterov and not momentum:
        raise ValueError(
            f"nesterov=True needs momentum > 0 (as torch.optim.SGD); got momentum={momentum!r}"
        )

    def init(params: Any) -> SGDState:
        leaves, treedef, _ = tensor_leaves(params, "params")
        if not momentum:
            return SGDState(0, None)
        return SGDState(0, optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves]))

    def update(grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        check_state(state, SGDState)
        p, treedef, _ = tensor_leaves(params, "params")
        g = grads_like(grads, p, treedef)
        d = [gi + weight_decay * pi if weight_decay else gi for gi, pi in zip(g, p)]
        new_momentum = None
        if momentum:
            if state.momentum is None:
                raise ValueError(
                    "state.momentum is None: this state was made without momentum; "
                    "call init(params) with this optimizer"
                )
            buf = moments_like(state.momentum, "state.momentum", params=p, params_def=treedef)
            # zero buffers make the first step buf = d, as torch's clone
            bufs = [momentum * b + di for b, di in zip(buf, d)]
            new_momentum = optree.tree_unflatten(treedef, bufs)
            d = [di + momentum * b for di, b in zip(d, bufs)] if nesterov else bufs
        step_lr = value_at(lr, state.count)
        updates = optree.tree_unflatten(treedef, [-step_lr * di for di in d])
        return updates, SGDState(state.count + 1, new_momentum)

    return GradientTransformation(init, update)
