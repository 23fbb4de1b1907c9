"""The global norm of a sharded tree and clipping by it: :func:`global_norm`,
:func:`clip_by_global_norm` (the function) and :func:`clip_global_norm` (the transformation;
optax's ``transforms/_clipping.py``).

Invariant: the optimizers' one room that communicates. A norm sums over the axes where the
tree is sharded, and only those (one small all-reduce per axis, however many leaves), so every
rank holds the same norm and scales by the same factor.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from ..base.errors import still_partial
from ..base.tags import state_of
from ..base.tree import flatten
from ..mesh import Mesh
from ..spec.placement import Flat
from ..spec.specs import Spec, resolve_specs
from ..sync.collectives import psum
from .transformation import EmptyState, GradientTransformation, check_empty, empty_init, is_tensor

__all__ = ["clip_by_global_norm", "clip_global_norm", "global_norm"]

# torch.nn.utils.clip_grad_norm_'s epsilon, added once to the global norm (never per rank).
_CLIP_EPS = 1e-6


def _placement_str(spec: Spec, role: str) -> str:
    return "[" + ", ".join(map(str, spec.placements(role))) + "]"


def _spec_mesh(spec: Any) -> Mesh:
    return optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))[0].mesh


def _check_tagged(
    leaf: Any,
    index: int,
    treedef: optree.PyTreeSpec,
    *,
    path: str,
    axes: tuple[str, ...],
    spec: Spec,
) -> None:
    """Refuse a leaf whose state tag says it is Partial, or split over other axes than ``axes``."""
    found = state_of(leaf)
    if found is None:
        return
    state = found[0]
    if state.kind == "accumulating":
        why = f" {spec.deferred_axes}, so its norm is not defined yet"
        raise ValueError(still_partial(path, why))
    # The spec the leaf was made with: found by position when the tag's tree is this tree,
    # else known only when every spec of the tag's tree splits the same axes (say, a subtree
    # of a one-spec tree). Other specs with the same split axes give the same norm.
    made = [state.plan.specs[index]] if state.plan.treedef == treedef else state.plan.specs
    made_axes = {s.sharded_axes(state.role) for s in made}
    if len(made_axes) == 1 and made_axes != {axes}:
        raise ValueError(
            f"{path}: was made at the {state.role} placement "
            f"{_placement_str(made[0], state.role)} of another spec (split over "
            f"{made_axes.pop()}), but spec's optimizer placement "
            f"{_placement_str(spec, 'optimizer')} is split over {axes}, and a norm summed over "
            "the wrong axes is silently wrong; pass the spec the tree was made with"
        )


def global_norm(tree: Any, spec: Any) -> torch.Tensor:
    """The L2 norm of a whole sharded tree, as if it were gathered: the same on every rank.

    Each rank sums the squares of its local pieces (in float32, or in float64 when any leaf
    is float64); the sums are then added over the axes where the optimizer placement is Flat,
    Shard(d) or Owner, and only there: replicated axes hold copies, counted once. Leaves are
    grouped by the set of axes they are sharded on, so there is one all-reduce of a few
    scalars per sharded axis, however many leaves. On a SimMesh the zero fill of ragged
    pieces adds nothing.

    Args:
        tree: pytree of floating local shards at the optimizer placement of ``spec`` (a final
            :func:`reduce_grads` result, :func:`shard`-ed weights, or elementwise functions of
            those); on a SimMesh with the mesh shape in front. A Partial (accumulating) tree
            is refused.
        spec: a :class:`Spec`, or a pytree prefix of Specs (one mesh).

    Returns:
        The norm, float32 (float64 if any leaf is float64), not differentiable: a 0-d tensor
        on a DistMesh; on a SimMesh a tensor of the mesh shape (every rank's copy, all equal).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> fh.global_norm(fh.shard({"w": torch.full((5,), 2.0)}, spec), spec)  # sqrt(5 * 4)
        tensor([[4.4721, 4.4721],
                [4.4721, 4.4721]])
    """
    leaves, treedef, names = flatten(tree, "tree")
    specs, _ = resolve_specs(spec, treedef, "tree")
    mesh = _spec_mesh(spec)
    batch = mesh.batch_shape
    nb = len(batch)
    wide = any(x.dtype in (torch.float64, torch.complex128) for x in leaves if is_tensor(x))
    acc = torch.float64 if wide else torch.float32
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    with torch.no_grad():
        for i, (leaf, s, path) in enumerate(zip(leaves, specs, names)):
            axes = s.sharded_axes("optimizer")
            flat = any(isinstance(p, Flat) for p in s.optimizer)
            _check_leaf(leaf, path, mesh, axes=axes if flat else ())
            _check_tagged(leaf, i, treedef, path=path, axes=axes, spec=s)
            v = torch.view_as_real(leaf) if leaf.is_complex() else leaf
            v = v.reshape(*batch, math.prod(v.shape[nb:])).to(acc)
            # keep axes (Owner on some axes): each value on its owner, zeros elsewhere
            groups.setdefault(axes + s.keep_axes, []).append(torch.linalg.vecdot(v, v))
        if not groups:
            return torch.zeros(batch, dtype=acc)
        keys = list(groups)
        sums = [torch.stack(groups[k]).sum(0) for k in keys]
        # Sum each group over its own sharded axes: one psum per axis carries every group
        # sharded on it, so the count of collectives follows the axes, not the leaves. The
        # groups' sums ride as one leaf, packed tight (separate leaves would each start at an
        # aligned offset of the bucket), in a tree of its own, so that its layout is never
        # taken for a user's tree of scalars with a batch dim in front.
        for axis in mesh.axis_names:
            which = [j for j, k in enumerate(keys) if axis in k]
            if which:
                stacked = {"global_norm": torch.stack([sums[j] for j in which], -1)}
                totals = psum(stacked, axis, mesh)["global_norm"]
                for n, j in enumerate(which):
                    sums[j] = totals[..., n]
        return torch.stack(sums).sum(0).sqrt()


def _check_leaf(leaf: Any, path: str, mesh: Mesh, *, axes: tuple[str, ...]) -> None:
    if not is_tensor(leaf):
        raise TypeError(f"{path}: expected a torch.Tensor leaf; got {type(leaf).__name__}")
    if not (leaf.is_floating_point() or leaf.is_complex()):
        raise TypeError(f"{path}: expected a floating dtype; got {leaf.dtype}")
    batch = mesh.batch_shape
    if tuple(leaf.shape[: len(batch)]) != batch:
        raise ValueError(
            f"{path}: on {mesh!r} a value's leading dims must be the mesh shape {batch} "
            f"(rank (i, j, ...) holds x[i, j, ...]); got shape {tuple(leaf.shape)}"
        )
    if axes and leaf.dim() != len(batch) + 1:  # a Flat piece is 1-D (a Shard(d) chunk is not)
        raise ValueError(
            f"{path}: spec's optimizer placement splits this leaf over {axes}, so its local "
            f"value is a 1-D piece; got shape {tuple(leaf.shape)}. Pass local shards "
            "(from fh.shard or reduce_grads(..., last=True)), not full tensors"
        )


def clip_by_global_norm(
    tree: Any, spec: Any = None, max_norm: float | None = None
) -> tuple[Any, torch.Tensor]:
    """Scale a sharded tree so that its global norm is at most ``max_norm``.

    The factor is ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``:
    computed once from the global norm, so it is the same on every rank.

    This is the function form (as ``torch.nn.utils.clip_grad_norm_``). optax's
    ``clip_by_global_norm(max_norm)`` is a transformation: here that is
    :func:`clip_global_norm` ``(spec, max_norm)``, and optax's one-argument call
    ``clip_by_global_norm(1.0)`` raises a TypeError that says so.

    Args:
        tree: pytree of floating local shards at the optimizer placement of ``spec`` (see
            :func:`global_norm`).
        spec: a :class:`Spec`, or a pytree prefix of Specs (required; its default only lets a
            call without it be answered with the pointer above).
        max_norm: the largest norm allowed (a number >= 0; required).

    Returns:
        ``(clipped, norm)``: a new tree, same structure, shapes and dtypes, and the global norm
        before clipping (see :func:`global_norm`).

    Raises:
        TypeError: ``spec`` or ``max_norm`` missing (optax's transformation spelling).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> g = fh.shard({"w": torch.tensor([0.0, 3.0, 4.0])}, spec)
        >>> clipped, norm = fh.clip_by_global_norm(g, spec, max_norm=1.0)
        >>> norm, fh.gather(clipped, spec)["w"][0]
        (tensor([5., 5.]), tensor([0.0000, 0.6000, 0.8000]))
    """
    if spec is None or max_norm is None:
        raise TypeError(_clip_form_error(tree, spec, max_norm=max_norm))
    _check_max_norm(max_norm)
    norm = global_norm(tree, spec)
    factor = torch.clamp(max_norm / (norm + _CLIP_EPS), max=1.0)

    def scale(x: torch.Tensor) -> torch.Tensor:
        f = factor.to(x.device).reshape(*factor.shape, *[1] * (x.dim() - factor.dim()))
        # computed in the factor's precision, rounded once to x's dtype, as torch does
        return (x * f).to(x.dtype)

    return optree.tree_map(scale, tree), norm


def _clip_form_error(tree: Any, spec: Any, *, max_norm: Any) -> str:
    """What a call of :func:`clip_by_global_norm` without its spec or max_norm meant."""
    if spec is None and isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return (
            f"clip_by_global_norm({tree!r}): optax's clip_by_global_norm(max_norm) is a "
            "transformation; here clip_by_global_norm(tree, spec, max_norm) is the function "
            "-> (clipped, norm). For the transformation use "
            f"fh.clip_global_norm(spec, max_norm={tree!r})"
        )
    missing = " and ".join(n for n, v in (("spec", spec), ("max_norm", max_norm)) if v is None)
    return (
        f"clip_by_global_norm(tree, spec, max_norm): {missing} missing (for the "
        "transformation, optax's clip_by_global_norm, use fh.clip_global_norm(spec, max_norm))"
    )


def _check_max_norm(max_norm: Any) -> None:
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not (max_norm >= 0 and math.isfinite(max_norm))
    ):
        raise ValueError(f"max_norm must be a finite number >= 0; got {max_norm!r}")


def clip_global_norm(spec: Any, max_norm: float) -> GradientTransformation:
    """Clip the updates to a global norm of at most ``max_norm``: the transformation form of
    :func:`clip_by_global_norm` (optax's ``clip_by_global_norm``).

    The norm is the whole sharded tree's (:func:`global_norm`: one small all-reduce per
    sharded axis), so every rank scales by the same factor
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` on the
    dense gradient. Put it first in a :func:`chain` to clip the gradient.

    Args:
        spec: the :class:`Spec` (or spec tree) of the updates' optimizer placement.
        max_norm: the largest norm allowed (a number >= 0).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> params = fh.shard({"w": torch.zeros(3)}, spec)
        >>> opt = fh.chain(fh.clip_global_norm(spec, 1.0), fh.scale_by_learning_rate(1.0))
        >>> g = fh.shard({"w": torch.tensor([0.0, 3.0, 4.0])}, spec)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> fh.gather(updates, spec)["w"][0]
        tensor([-0.0000, -0.6000, -0.8000])
    """
    _check_max_norm(max_norm)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        check_empty(state)
        return clip_by_global_norm(updates, spec, max_norm)[0], state

    return GradientTransformation(empty_init, update)
