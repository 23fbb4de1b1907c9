"""The public tree functions: ``reduce_grads``, ``shard``, ``gather`` and ``sync_params``.

Each is pure (inputs are never mutated; results are new trees of plain tensors) and a thin
call into :mod:`functional_hsdp.runtime.engine`, which composes per-axis bucket collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.torch_releases import traced_or_eager
from ..runtime import engine, validate
from ..spec.precision import check_mp_policy

__all__ = ["gather", "reduce_grads", "shard", "sync_params"]


@traced_or_eager  # traced by torch.compile where dynamo can (torch >= 2.13); else eager
def reduce_grads(
    grads: Any,
    spec: Any,
    *,
    last: bool,
    acc: Any = None,
    at: str = "input",
    check_finite: bool = False,
    residual: Any = None,
) -> Any:
    """Reduce one microbatch's per-rank gradients and add them to the running sum.

    Reduces every DP axis whose gradient placement is not Partial (reduce-scatter to Flat,
    all-reduce to Replicate), adds ``acc``, and when ``last`` reduces the deferred (Partial)
    axes to the optimizer placement: reduce-scatters first, then all-reduces on the shard.
    Accumulation is a sum: scale the loss by 1/M for M microbatches.

    Args:
        grads: pytree of floating per-rank gradients, full shapes (on a SimMesh with the mesh
            shape in front), Partial over every DP axis.
        spec: a :class:`Spec`, or a pytree prefix of Specs (one mesh).
        last: keyword-only, required: True on the final microbatch of the step.
        acc: the previous call's result for this step (None on the first microbatch).
        at: ``"input"`` (default): ``grads`` are raw per-rank gradients, Partial on every DP
            axis. ``"gradient"``: ``grads`` are local shards already at the gradient
            placement (what ``torch.func.grad`` returns through :func:`gathered` units);
            only accumulation and, on ``last``, the deferred axes remain.
        check_finite: raise ValueError naming the first leaf of ``grads`` holding NaN or Inf
            (and the ranks), on every rank, before any collective. Costs a scan of the
            buckets read on the host (a host-device sync) and, even under
            ``validation("off")``, the agreement's summary per call on a DistMesh; must be
            the same on every rank.
        residual: with a spec whose ``outer_compress`` feeds its error back, on the last
            microbatch: the residual the previous step's call returned (None on the first
            step: zeros). Each rank's rounding loss, at the gradient placement; state the
            caller keeps and checkpoints (nothing is kept for it).

    Returns:
        A new tree with the structure of ``grads``: local shards at the gradient placement
        (still Partial on the deferred axes) or, when ``last``, at the optimizer placement.
        A Flat leaf's local shard is its part of the rank's bucket chunk, 1-D. On the last
        microbatch of a spec with ``outer_compress``: ``(grads, residual)``, the new
        residual a tree like ``grads`` at the gradient placement (fp32), or None without
        error feedback.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> g = {"w": torch.ones(2, 2, 3), "b": torch.ones(2, 2)}
        >>> acc = fh.reduce_grads(g, spec, last=False)
        >>> acc = fh.reduce_grads(g, spec, last=True, acc=acc)
        >>> fh.gather(acc, spec)["w"][0, 0]
        tensor([2., 2., 2.])
    """
    if check_finite and torch.compiler.is_compiling():  # its check reads the data: eager
        return _checked_eagerly(grads, spec, last=last, acc=acc, at=at, residual=residual)
    mode = validate.current_mode()
    # the step's last reduction of units' gradients also agrees on the units the ranks ran
    units = last is True and at == "gradient"
    return engine.reduce(
        grads,
        spec,
        last=last,
        acc=acc,
        at=at,
        check_finite=check_finite,
        mode=mode,
        units=units,
        residual=residual,
    )


@torch.compiler.disable
def _checked_eagerly(grads: Any, spec: Any, *, last: Any, acc: Any, at: str, residual: Any) -> Any:
    """``reduce_grads(..., check_finite=True)`` inside a function ``torch.compile`` traces:
    run eagerly, at a graph break (under ``fullgraph=True`` that break is dynamo's error),
    since the check reads the gradients' values on the host."""
    mode = validate.current_mode()
    return engine.reduce(
        grads, spec, last=last, acc=acc, at=at, check_finite=True, mode=mode, residual=residual
    )


def shard(tree: Any, spec: Any, *, to: str = "optimizer", stacked: bool | None = None) -> Any:
    """Full (replicated) values -> this rank's local shards at the optimizer placement.

    Replicate -> Flat is a local slice: no communication.

    Args:
        tree: pytree of full tensors, the same on every rank. On a SimMesh either stacked
            (the mesh shape in front of every leaf, as :func:`gather` returns) or plain
            (meaning the same value on every rank).
        spec: a :class:`Spec` or a pytree prefix of Specs.
        to: ``"optimizer"`` (default) or ``"parameter"``.
        stacked: SimMesh only: whether ``tree`` carries the mesh dims. By default a tree is
            taken as stacked when every leaf starts with the mesh shape and is the same on
            every rank (a full value is replicated), else as plain; pass it to be explicit.

    Returns:
        A new tree, same structure, of local shards (1-D pieces on Flat buckets).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.shard({"w": torch.arange(5.0)}, fh.fsdp(mesh))["w"]
        tensor([[0., 1., 2.],
                [3., 4., 0.]])
    """
    return engine.shard(tree, spec, to=to, stacked=stacked)


def gather(
    tree: Any, spec: Any, *, like: Any = None, source: str | None = None, mp_policy: Any = None
) -> Any:
    """Local shards -> full values on every rank (all-gathers, reverse split order).

    Args:
        tree: local shards at the optimizer placement (from :func:`shard`, a final
            :func:`reduce_grads`, or any elementwise function of those) or at the parameter
            placement (from :func:`sync_params`).
        spec: a :class:`Spec` or a pytree prefix of Specs.
        like: optional pytree of tensors with the full per-rank shapes (no mesh dims), for a
            tree whose layout this process has not seen in shard/reduce_grads.
        source: ``"optimizer"`` or ``"parameter"``; by default taken from the leaves' state,
            else found from the local shapes (optimizer first).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``: its ``param_dtype``
            (if set) is the dtype the shards are cast to before the all-gather, and of the
            result (bf16 on the wire for bf16 compute, as FSDP2).

    Returns:
        A new tree of full tensors (on a SimMesh with the mesh shape in front).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> fh.gather(fh.shard({"w": torch.arange(5.0)}, spec), spec)["w"][1]
        tensor([0., 1., 2., 3., 4.])
    """
    check_mp_policy(mp_policy, "gather")
    dtype = getattr(mp_policy, "param_dtype", None)
    return engine.move(
        tree, spec, "full", source=source, like=like, name="tree", call="gather", dtype=dtype
    )


def sync_params(tree: Any, spec: Any, *, like: Any = None) -> Any:
    """Main weights at the optimizer placement -> the parameter placement (all-gathers).

    A no-op copy when the two placements agree (ddp, fsdp, hsdp); for hfsdp it all-gathers
    over the outer axis.

    Args:
        tree: local shards at the optimizer placement.
        spec: a :class:`Spec` or a pytree prefix of Specs.
        like: optional pytree with the full per-rank shapes (see :func:`gather`).

    Returns:
        A new tree of local shards at the parameter placement.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"o": 2, "i": 2})
        >>> spec = fh.hfsdp(mesh, "o", "i")
        >>> w = fh.shard({"w": torch.arange(8.0)}, spec)
        >>> fh.sync_params(w, spec)["w"][0, 1]
        tensor([4., 5., 6., 7.])
    """
    return engine.move(
        tree, spec, "parameter", source="optimizer", like=like, name="tree", call="sync_params"
    )
