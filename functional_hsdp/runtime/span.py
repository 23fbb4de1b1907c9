"""The part of the mesh one call's agreement spans: the whole mesh, or one replica of it.

Replicas (:func:`~functional_hsdp.replicas`) train apart between syncs (DiLoCo): one
replica's calls never wait for another's, which may be slower or at another step. Invariant:
a call on a spec whose every Spec has replica axes agrees within its replica only (the
summary and every exchange span the mesh's other axes, ``Diagnostics.within``), and no
message of its agreement crosses a replica axis; any other call agrees over the whole mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree

__all__ = ["Within", "within"]


def _specs(spec: Any) -> list:
    """The Specs of a Spec or spec tree (none if ``spec`` is neither)."""
    from ..spec.specs import Spec

    if isinstance(spec, Spec):
        return [spec]
    try:
        leaves = optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))
    except Exception:  # not even a pytree: the caller's own check names the problem
        return []
    return [x for x in leaves if isinstance(x, Spec)]


class Within(NamedTuple):
    """A mesh as one call's agreement sees it: the axes it spans (every axis of the mesh but
    the replica axes of a :func:`~functional_hsdp.replicas` spec), their sizes, the mesh's
    batch shape and the exchanges over those axes (``Diagnostics.within``)."""

    base: Any
    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]
    batch_shape: tuple[int, ...]
    diagnostics: Any


def within(spec: Any) -> Any:
    """The mesh an agreement on ``spec`` spans (None if it names none): ``spec`` itself if
    it is a mesh; the mesh of its Specs; or, where every Spec of ``spec`` has replica axes,
    a :class:`Within` of the mesh's other axes. Replicas train apart between syncs (they may
    even be at different steps), so their calls agree within a replica, and no message of
    it crosses a replica axis."""
    if hasattr(spec, "diagnostics"):
        mesh, apart = spec, set()
    else:
        specs = _specs(spec)
        if not specs:
            return None
        mesh = specs[0].mesh
        apart = set.intersection(*(set(x.replica_axes) for x in specs))
    apart |= set(getattr(mesh, "apart_axes", ()))  # a fault-tolerant replica axis: never crossed
    if not apart:
        return mesh
    axes = tuple(a for a in mesh.axis_names if a not in apart)
    sizes = tuple(mesh.size(a) for a in axes)
    return Within(
        base=mesh,
        axis_names=axes,
        sizes=sizes,
        batch_shape=tuple(mesh.batch_shape),
        diagnostics=mesh.diagnostics.within(axes),
    )
