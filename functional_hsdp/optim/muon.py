"""Muon (``torch.optim.Muon``'s math) on sharded trees: :func:`newton_schulz`, its batched
orthogonalization, and :func:`muon`, a chain whose first part orthogonalizes the momentum of
each whole matrix through :func:`~functional_hsdp.per_matrix`; its state is a
:class:`MuonState`.

Invariant: each matrix is orthogonalized exactly once over the whole mesh; the momentum lives
at the optimizer placement, a tree laid out as the params (checkpointed as AdamW's moments).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from ..base.tree import format_path
from .combine import ChainState, chain
from .matrix import per_matrix
from .scaling import ScaleByLearningRateState, add_decayed_weights, scale_by_learning_rate
from .schedules import Schedule, check_lr
from .transformation import EmptyState, GradientTransformation

__all__ = ["MuonState", "muon", "newton_schulz"]


def newton_schulz(
    x: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on a batch of matrices ``(..., M, N)``.

    ``torch.optim.Muon``'s orthogonalization, batched: in ``dtype``, each matrix transposed
    if it has more rows than columns, divided by its Frobenius norm (at least ``eps``), then
    ``steps`` times ``X <- a X + (b A + c A²) X`` with ``A = X Xᵀ``.

    Args:
        x: matrices, ``(..., M, N)``.
        coefficients: ``(a, b, c)``.
        steps: iterations.
        eps: the smallest norm divided by.
        dtype: the dtype of the iteration (bf16 as torch's; float32 for fp32 accuracy).

    Returns:
        The orthogonalized matrices, shape of ``x``, in ``dtype``.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> q = fh.newton_schulz(torch.randn(2, 8, 4), dtype=torch.float32)
        >>> s = torch.linalg.svdvals(q)
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    shape = y.shape
    y = y.reshape(-1, *shape[-2:])
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, update, y, beta=a)
    y = y.reshape(shape)
    return y.mT if tall else y


class MuonState(NamedTuple):
    """State of :func:`muon`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        momentum: tree like the params (local shards at the optimizer placement): torch's
            ``momentum_buffer``.
    """

    count: int
    momentum: Any


_ADJUST = (None, "original", "match_rms_adamw")


def _lr_ratio(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an ``m x n`` matrix."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1, m / n))


def _orthogonalized(x: torch.Tensor, *, ns: dict, adjust_lr_fn: str | None) -> torch.Tensor:
    ratio = _lr_ratio(adjust_lr_fn, x.shape[-2], x.shape[-1])
    return newton_schulz(x, **ns).to(x.dtype) * ratio


def _check_muon(*, lr, weight_decay, momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn):
    check_lr(lr, "muon: lr")
    for name, value in (
        ("weight_decay", weight_decay),
        ("momentum", momentum),
        ("eps", eps),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"muon: {name} must be a number >= 0; got {value!r}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"muon: ns_coefficients must be 3 numbers; got {ns_coefficients!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be an int in [0, 100); got {ns_steps!r}")
    if adjust_lr_fn not in _ADJUST:
        raise ValueError(f"muon: adjust_lr_fn must be one of {_ADJUST}; got {adjust_lr_fn!r}")


def muon(
    spec: Any,
    lr: float | Schedule = 1e-3,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> GradientTransformation:
    """Muon with ``torch.optim.Muon``'s math, on local shards, each matrix orthogonalized
    once over the whole mesh (:func:`per_matrix`).

    With ``B`` the momentum buffer: ``B <- lerp(B, g, 1 - momentum)``; the direction is
    ``lerp(g, B, momentum)`` with ``nesterov``, else ``B``; ``O`` its Newton-Schulz
    orthogonalization (:func:`newton_schulz` in ``ns_dtype``); the update is
    ``-lr * weight_decay * p - lr * ratio * O``, ``ratio`` torch's ``adjust_lr_fn`` of the
    matrix's last two dims ``(M, N)``: ``sqrt(max(1, M / N))`` (None, ``"original"``) or
    ``0.2 * sqrt(max(M, N))`` (``"match_rms_adamw"``). The momentum lives at the optimizer
    placement (a tree like the params; checkpointed as AdamW's moments are).

    It is a chain (:func:`~functional_hsdp.chain`): the orthogonalized momentum ``ratio * O``,
    then :func:`~functional_hsdp.add_decayed_weights` and
    :func:`~functional_hsdp.scale_by_learning_rate`, its state kept as one :class:`MuonState`.

    Args:
        spec: the Spec (or spec tree) of the params; :func:`~functional_hsdp.owned` specs
            orthogonalize where the leaves are, others move them (see :func:`per_matrix`).
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0).
        weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.
        ns_dtype: the dtype of the Newton-Schulz iteration (torch's is bf16; float32 gives
            fp32 accuracy).

    Returns:
        A :class:`~functional_hsdp.GradientTransformation`; its state is a
        :class:`MuonState`. Every leaf must have 2 or more dims (use :func:`partition` for
        the others); a 3-D leaf is a stack of matrices.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner"))
        >>> params = fh.shard({"w": torch.eye(4)}, spec)
        >>> opt = fh.muon(spec, lr=0.1, ns_dtype=torch.float32)
        >>> g = fh.reduce_grads({"w": torch.randn(2, 2, 4, 4)}, spec, last=True)
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> new = fh.apply_updates(params, updates)
        >>> fh.gather(new, spec)["w"].shape, isinstance(state, fh.MuonState), state.count
        (torch.Size([2, 2, 4, 4]), True, 1)
    """
    _check_muon(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    ns = dict(coefficients=tuple(ns_coefficients), steps=ns_steps, eps=eps, dtype=ns_dtype)
    orthogonalize = functools.partial(_orthogonalized, ns=ns, adjust_lr_fn=adjust_lr_fn)
    parts = chain(
        _scale_by_muon(spec, momentum=momentum, nesterov=nesterov, orthogonalize=orthogonalize),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )

    def init(params: Any) -> MuonState:
        return parts.init(params).inner[0]

    def update(grads: Any, state: MuonState, params: Any) -> tuple[Any, MuonState]:
        if not isinstance(state, MuonState):
            raise TypeError(f"state: expected a MuonState (from init); got {type(state).__name__}")
        inner = (state, EmptyState(), ScaleByLearningRateState(state.count))
        updates, new = parts.update(grads, ChainState(inner), params)
        return updates, new.inner[0]

    return GradientTransformation(init, update)


def _scale_by_muon(
    spec: Any, *, momentum: float, nesterov: bool, orthogonalize: Callable
) -> GradientTransformation:
    """Muon's direction before the learning rate: ``ratio * O`` (see :func:`muon`)."""

    def init(params: Any) -> MuonState:
        return MuonState(0, optree.tree_map(torch.zeros_like, params))

    def update(grads: Any, state: MuonState, params: Any) -> tuple[Any, MuonState]:
        _same_layout(grads, params, "grads")
        _same_layout(state.momentum, params, "state.momentum")
        g = optree.tree_map(lambda g, p: g.to(p.dtype), grads, params)
        buf = optree.tree_map(lambda b, g: b.lerp(g, 1 - momentum), state.momentum, g)
        direction = optree.tree_map(lambda g, b: g.lerp(b, momentum), g, buf) if nesterov else buf
        return per_matrix(orthogonalize, direction, spec), MuonState(state.count + 1, buf)

    return GradientTransformation(init, update)


def _same_layout(tree: Any, params: Any, name: str) -> None:
    """``tree`` has the structure and local shapes of ``params`` (errors name the path)."""
    if optree.tree_structure(tree) != optree.tree_structure(params):
        raise ValueError(
            f"{name}: has structure {optree.tree_structure(tree)}, but params has "
            f"{optree.tree_structure(params)}"
        )
    for path, x, p in zip(
        optree.tree_paths(tree), optree.tree_leaves(tree), optree.tree_leaves(params)
    ):
        if x.shape != p.shape:
            raise ValueError(
                f"{name}{format_path(path)}: expected local shape {tuple(p.shape)} (as the "
                f"params'); got {tuple(x.shape)}: local shards at the params' placement?"
            )
