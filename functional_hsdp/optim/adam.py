"""Adam: :func:`scale_by_adam` (optax's building block) and :func:`adamw`, the chain
``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate`` with
``torch.optim.AdamW``'s math; both keep a :class:`ScaleByAdamState`.

Invariant: elementwise on local shards (no communication); the moments are trees laid out as
the params, at their placement, so they checkpoint and reshard as the params do.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch

from .combine import ChainState, chain
from .scaling import ScaleByLearningRateState, add_decayed_weights, scale_by_learning_rate
from .schedules import Schedule, check_lr
from .transformation import (
    EmptyState,
    GradientTransformation,
    check_hyper,
    check_state,
    grads_like,
    moments_like,
    tensor_leaves,
)

__all__ = ["ScaleByAdamState", "adamw", "scale_by_adam"]


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        mu: tree like the params (local shards): first moments (torch's ``exp_avg``).
        nu: tree like the params (local shards): second moments (torch's ``exp_avg_sq``).
    """

    count: int
    mu: Any
    nu: Any


def _adam_reference(grads: Any, params: Any) -> tuple[list, optree.PyTreeSpec, list]:
    """``(params or grads leaves, treedef, grads cast to their dtype)``."""
    if params is None:
        g, treedef, _ = tensor_leaves(grads, "grads")
        grads_like(grads, g, treedef)  # refuses an accumulating gradient
        return g, treedef, g
    p, treedef, _ = tensor_leaves(params, "params")
    return p, treedef, grads_like(grads, p, treedef)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's bias-corrected moment ratio (optax's ``scale_by_adam``), on local shards.

    With ``t`` the step count after this update: ``m = b1 m + (1 - b1) g``,
    ``v = b2 v + (1 - b2) g²``, and the update is
    ``(m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)`` (eps added as
    ``torch.optim.Adam`` adds it). Elementwise: no communication. Chain it with
    :func:`scale_by_learning_rate` (and :func:`add_decayed_weights` between: AdamW).

    Args:
        b1: decay rate of the first moment (torch's ``betas[0]``), in [0, 1).
        b2: decay rate of the second moment (torch's ``betas[1]``), in [0, 1).
        eps: added to the bias-corrected ``sqrt(v)``.

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ScaleByAdamState`. Its
        updates take the params' dtype (when ``params`` are passed).

    References:
        Kingma & Ba, *Adam: A Method for Stochastic Optimization*, ICLR 2015.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.scale_by_adam()
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(params), params)
        >>> updates["w"].round(decimals=6), state.count    # m / sqrt(v) = sign(g) at first
        (tensor([ 1., -1.]), 1)
    """
    check_hyper(eps=eps)
    for name, b in (("b1", b1), ("b2", b2)):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
            raise ValueError(f"{name} must be in [0, 1); got {b!r}")

    def init(params: Any) -> ScaleByAdamState:
        leaves, treedef, _ = tensor_leaves(params, "params")
        zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
        return ScaleByAdamState(0, zeros(), zeros())

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, ScaleByAdamState]:
        check_state(state, ScaleByAdamState)
        p, treedef, g = _adam_reference(grads, params)
        mu = moments_like(state.mu, "state.mu", params=p, params_def=treedef)
        nu = moments_like(state.nu, "state.nu", params=p, params_def=treedef)
        count = state.count + 1
        # host scalars, as torch's single-tensor Adam computes them
        bias_correction1 = 1 - b1**count
        bias_correction2_sqrt = (1 - b2**count) ** 0.5
        new_mu = [m.lerp(gi, 1 - b1) for m, gi in zip(mu, g)]
        new_nu = [torch.addcmul(v * b2, gi, gi, value=1 - b2) for v, gi in zip(nu, g)]
        updates = [
            (m / bias_correction1) / (v.sqrt() / bias_correction2_sqrt + eps)
            for m, v in zip(new_mu, new_nu)
        ]
        unflat = functools.partial(optree.tree_unflatten, treedef)
        return unflat(updates), ScaleByAdamState(count, unflat(new_mu), unflat(new_nu))

    return GradientTransformation(init, update)


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s math, on local shards.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr))``, with the chain's state kept as one
    :class:`ScaleByAdamState` (its parts' step counts are the same count): with ``t`` the
    step count after this update, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²``, and
    the update is
    ``-lr * ((m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps) + weight_decay * p)``.

    Args:
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0, as torch's ``LambdaLR``).
        b1: decay rate of the first moment (torch's ``betas[0]``).
        b2: decay rate of the second moment (torch's ``betas[1]``).
        eps: added to the bias-corrected ``sqrt(v)``, elementwise (no communication).
        weight_decay: decoupled weight decay, ``p -= lr * weight_decay * p``.

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ScaleByAdamState`
        (``AdamWState`` is its deprecated name).

    References:
        Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, ICLR 2019.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.adamw(lr=0.1, weight_decay=0.0)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])

        On a sharded tree, after the global-norm clip (the one step that communicates),
        ``torch.optim.AdamW`` on the local shards gives the same weights:

        >>> import optree
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hfsdp(mesh, "dp_outer", "dp_inner")
        >>> params = fh.shard({"w": torch.linspace(-1, 1, 6), "b": torch.ones(3)}, spec)
        >>> g = {"w": torch.randn(2, 2, 6), "b": torch.randn(2, 2, 3)}     # 4 ranks' gradients
        >>> grads, norm = fh.clip_by_global_norm(fh.reduce_grads(g, spec, last=True), spec, 0.5)
        >>> opt = fh.adamw(lr=0.1)
        >>> updates, state = opt.update(grads, opt.init(params), params)
        >>> new = fh.apply_updates(params, updates)
        >>> local = [p.clone().requires_grad_() for p in optree.tree_leaves(params)]
        >>> torch_opt = torch.optim.AdamW(local, lr=0.1)                  # the same, by torch.optim
        >>> for p, g in zip(local, optree.tree_leaves(grads)):
        ...     p.grad = g
        >>> torch_opt.step()
        >>> all(torch.allclose(p, q) for p, q in zip(local, optree.tree_leaves(new)))
        True
    """
    check_lr(lr)
    parts = chain(
        scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr)
    )

    def init(params: Any) -> ScaleByAdamState:
        return parts.init(params).inner[0]

    def update(grads: Any, state: ScaleByAdamState, params: Any) -> tuple[Any, ScaleByAdamState]:
        check_state(state, ScaleByAdamState)
        inner = (state, EmptyState(), ScaleByLearningRateState(state.count))
        updates, new = parts.update(grads, ChainState(inner), params)
        return updates, new.inner[0]

    return GradientTransformation(init, update)
