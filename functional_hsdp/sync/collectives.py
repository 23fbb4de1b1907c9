"""Per-axis pytree collectives with JAX's names: psum, pmean, psum_scatter, all_gather.

Each packs the tree's leaves into buckets (per dtype, size-capped), issues one collective per
bucket on one mesh axis (logged by :func:`comm_log`), and unpacks. Other mesh axes are left
alone. ``reduce_grads``, ``shard`` and ``gather`` compose the same bucket collectives, one axis
at a time, under a full :class:`Spec`; these functions are that machinery with a one-axis spec.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ..base.cache import lru
from ..base.tree import tracked
from ..mesh import Mesh
from ..runtime import engine, validate
from ..spec.placement import Flat, Replicate
from ..spec.specs import Spec

__all__ = ["psum", "pmean", "psum_scatter", "all_gather"]


@lru(maxsize=256)
def _axis_spec(mesh: Mesh, axis: str, *, target: str, op: str, bucket_cap_mb: float) -> Spec:
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not in the mesh; its axes are {mesh.axis_names}")
    place = Flat() if target == "flat" else Replicate()
    row = [place if a == axis else Replicate() for a in mesh.axis_names]
    return Spec(
        mesh,
        parameter=row,
        gradient=row,
        optimizer=row,
        dp_axes=(axis,),
        reduce_op=op,
        bucket_cap_mb=bucket_cap_mb,
    )


def psum(tree: Any, axis: str, mesh: Mesh, *, bucket_cap_mb: float = 25.0) -> Any:
    """Sum every leaf over ``axis`` (all-reduce); every rank on the axis gets the sum.

    Args:
        tree: pytree of floating local values (on a SimMesh with the mesh shape in front).
        axis: the mesh axis name.
        mesh: the mesh.
        bucket_cap_mb: bucket size cap (MiB of 4-byte elements).

    Returns:
        A new tree, same structure and shapes.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.psum(torch.tensor([[1.0], [2.0]]), "dp", mesh)
        tensor([[3.],
                [3.]])
    """
    spec = _axis_spec(mesh, axis, target="replicate", op="sum", bucket_cap_mb=bucket_cap_mb)
    return _differentiable_reduce(tree, spec, "psum")


def pmean(tree: Any, axis: str, mesh: Mesh, *, bucket_cap_mb: float = 25.0) -> Any:
    """Average every leaf over ``axis`` (all-reduce with AVG, or SUM then divide).

    Args: as :func:`psum`.

    Returns:
        A new tree, same structure and shapes.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.pmean(torch.tensor([[1.0], [2.0]]), "dp", mesh)
        tensor([[1.5000],
                [1.5000]])
    """
    spec = _axis_spec(mesh, axis, target="replicate", op="avg", bucket_cap_mb=bucket_cap_mb)
    return _differentiable_reduce(tree, spec, "pmean")


def start_pmean(
    tree: Any, axis: str, mesh: Mesh, *, bucket_cap_mb: float = 25.0, name: str = "tree"
) -> Any:
    """:func:`pmean` issued, not waited for: a
    :class:`~functional_hsdp.runtime.engine.ReduceInFlight` whose ``result()`` is :func:`pmean`'s
    tree. The call agrees across ranks as :func:`pmean` does, before its first collective (under
    ``validation("off")`` it waits for nobody), then issues one all-reduce per bucket and returns
    with them in flight; ``result()`` waits for them. Not differentiable: ``tree``'s leaves must not
    be tracked. DiLoCo's syncs use it (a delayed one overlaps the inner steps). ``name``: the tree's
    name in errors. Unlike :func:`pmean`'s, the result's leaves carry no placement tag: they are
    views of the reduction's buckets, which the caller gives a meaning of its own (the
    pseudo-gradient sits at the params' placement, not at the collective's)."""
    spec = _axis_spec(mesh, axis, target="replicate", op="avg", bucket_cap_mb=bucket_cap_mb)
    mode = validate.current_mode()
    return engine.reduce(
        tree,
        spec,
        last=True,
        acc=None,
        name=name,
        call="pmean",
        mode=mode,
        wait=False,
        tagged=False,
    )


def agree_pmean(
    tree: Any,
    axis: str,
    mesh: Mesh,
    *,
    bucket_cap_mb: float = 25.0,
    name: str = "tree",
    options: tuple[str, ...] = (),
) -> None:
    """:func:`start_pmean`'s cross-rank agreement alone, settled, and no all-reduce: for a
    caller that averages ``tree`` over ``axis`` by collectives of its own (DiLoCo's
    compressed sync), so that ranks about to average different trees (or with other
    ``options``: say the compression policy) all raise a ``ValueError`` naming the leaf
    before those collectives are issued. Nothing is exchanged under ``validation("off")``."""
    spec = _axis_spec(mesh, axis, target="replicate", op="avg", bucket_cap_mb=bucket_cap_mb)
    mode = validate.current_mode()
    engine.agree(tree, spec, name=name, call="pmean", mode=mode, options=options)


def psum_scatter(
    tree: Any, axis: str, mesh: Mesh, *, op: str = "sum", bucket_cap_mb: float = 25.0
) -> Any:
    """Sum over ``axis`` and keep this rank's Flat chunk (reduce-scatter per bucket).

    Args:
        tree: pytree of floating local values (on a SimMesh with the mesh shape in front).
        axis: the mesh axis name.
        mesh: the mesh.
        op: ``"sum"`` (default, as JAX) or ``"avg"``.
        bucket_cap_mb: bucket size cap (MiB of 4-byte elements).

    Returns:
        A new tree, same structure, of 1-D pieces: each leaf's part of this rank's chunk.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.psum_scatter(torch.ones(2, 4), "dp", mesh)
        tensor([[2., 2.],
                [2., 2.]])
    """
    spec = _axis_spec(mesh, axis, target="flat", op=op, bucket_cap_mb=bucket_cap_mb)
    return _reduce(tree, spec, call="psum_scatter", mode=validate.current_mode())


def all_gather(
    tree: Any, axis: str, mesh: Mesh, *, like: Any = None, bucket_cap_mb: float = 25.0
) -> Any:
    """Undo :func:`psum_scatter`'s split: all-gather each bucket over ``axis``.

    Args:
        tree: Flat pieces along ``axis`` (from :func:`psum_scatter`, or elementwise
            functions of them).
        axis: the mesh axis name.
        mesh: the mesh.
        like: optional pytree with the full per-rank shapes, for pieces whose layout this
            process has not seen.
        bucket_cap_mb: must equal the cap the pieces were made with.

    Returns:
        A new tree of full tensors.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.all_gather(fh.psum_scatter(torch.ones(2, 3), "dp", mesh), "dp", mesh)
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    spec = _axis_spec(mesh, axis, target="flat", op="sum", bucket_cap_mb=bucket_cap_mb)
    return engine.move(
        tree, spec, "full", source="optimizer", like=like, name="tree", call="all_gather"
    )


def _reduce(tree: Any, spec: Spec, *, call: str, mode: str) -> Any:
    return engine.reduce(tree, spec, last=True, acc=None, name="tree", call=call, mode=mode)


def _differentiable_reduce(tree: Any, spec: Spec, call: str) -> Any:
    """psum and pmean: differentiable when a leaf is tracked (by autograd or a torch.func
    transform). Both are their own adjoint in the library's convention (a per-rank value
    stands for the mean over ranks; see :mod:`functional_hsdp.sync.autodiff`), so backward and
    jvp are the same reduction of the cotangent or tangent.

    The validation mode is read here, in the caller's context, and handed to the backward
    and jvp: autograd may run a backward on another thread (on CUDA, its device thread),
    which does not see the caller's context, so reading it there would ignore the caller's
    ``validation("off")``."""
    leaves, treedef = optree.tree_flatten(tree)
    mode = validate.current_mode()
    if not any(tracked(x) for x in leaves):
        return _reduce(tree, spec, call=call, mode=mode)
    out = _SelfAdjoint.apply(spec, call, mode, treedef, *leaves)
    return optree.tree_unflatten(treedef, list(out))


class _SelfAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(spec: Spec, call: str, mode: str, treedef: Any, *leaves: torch.Tensor) -> tuple:
        tree = optree.tree_unflatten(treedef, list(leaves))
        return tuple(optree.tree_leaves(_reduce(tree, spec, call=call, mode=mode)))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.spec, ctx.call, ctx.mode, ctx.treedef = inputs[:4]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        grads = [g.contiguous() for g in grads]
        out = _SelfAdjoint.apply(ctx.spec, ctx.call, ctx.mode, ctx.treedef, *grads)
        return (None, None, None, None, *out)

    @staticmethod
    def jvp(ctx: Any, _spec: Any, _call: Any, _mode: Any, _treedef: Any, *tangents: Any) -> tuple:
        return _SelfAdjoint.apply(ctx.spec, ctx.call, ctx.mode, ctx.treedef, *tangents)
