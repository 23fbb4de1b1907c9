"""Export local shards as DTensors, for torch.distributed.checkpoint and DTensor-aware tools.

Per leaf where DTensor can say what a rank holds (Replicate, Partial, ``Shard(d)``); a Flat
leaf's piece is a range of the flattened leaf that no DTensor placement describes, so Flat
trees export per bucket (:func:`to_dtensor` says how). Per-bucket DTensors are tied to the
mesh and the bucket layout: for checkpoints that load on another mesh shape or world size,
use :func:`~functional_hsdp.state_dict` (per leaf, full shapes;
:mod:`functional_hsdp.io.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base.tree import flatten
from ..io.checkpoint import contiguous_stride
from ..plan.lookup import find_plan
from ..plan.recipe import Plan
from ..spec.placement import Flat, Owner, Partial

__all__ = ["to_dtensor"]


def to_dtensor(tree: Any, spec: Any, *, per: str = "leaf", source: str | None = None) -> Any:
    """Wrap this rank's local shards as DTensors on the spec's DeviceMesh (no communication).

    Per leaf where DTensor can say what a rank holds: Replicate, Partial and ``Shard(d)`` (the
    local shard is exactly ``torch.chunk(x, n, d)[rank]``). A Flat leaf's piece is a range of
    the flattened leaf that no DTensor placement describes, so Flat trees export per bucket:
    the bucket is a 1-D global tensor (``Shard(0)`` over its Flat axis) or, with several Flat
    axes, a tensor of shape ``(n_1, ..., n_k, chunk)`` in split order with ``Shard(j)`` on the
    j-th split axis: exactly the rank's contiguous chunk, padding included (the zeros between
    leaves that align each leaf to 16 elements, and at the bucket's tail).

    Args:
        tree: local shards (from :func:`shard`, :func:`reduce_grads`, :func:`sync_params` or
            elementwise functions of those) on a :class:`DistMesh`.
        spec: a :class:`Spec` or a pytree prefix of Specs.
        per: ``"leaf"`` (default): a tree of the same structure with one DTensor per leaf;
            Flat leaves are refused. ``"bucket"``: a list with one DTensor per bucket, for
            any spec.
        source: ``"optimizer"`` or ``"parameter"``, as in :func:`gather`.

    Returns:
        A tree of DTensors (``per="leaf"``) or a list of bucket DTensors (``per="bucket"``).

    Example (on every rank of a DistMesh; tested in tests/mesh/test_dist_gloo.py)::

        import torch.distributed.checkpoint as dcp
        state = {"main": fh.to_dtensor(fh.shard(params, spec), spec, per="bucket")}
        dcp.save(state, checkpoint_id="ckpt")
    """
    if per not in ("leaf", "bucket"):
        raise ValueError(f"to_dtensor: per must be 'leaf' or 'bucket'; got {per!r}")
    leaves, treedef, paths = flatten(tree, "tree")
    if not leaves:
        return [] if per == "bucket" else optree.tree_unflatten(treedef, [])
    roles = (source,) if source else ("optimizer", "parameter")
    plan, role = find_plan(
        leaves,
        treedef,
        paths,
        spec=spec,
        like=None,
        roles=roles,
        kinds=("final", "weights"),
        name="tree",
    )
    device_mesh = getattr(plan.mesh, "device_mesh", None)
    if device_mesh is None:
        raise TypeError(f"to_dtensor needs a DistMesh (a real DeviceMesh); got {plan.mesh!r}")
    if per == "bucket":
        return _buckets(plan, role, leaves, device_mesh=device_mesh)
    out = []
    for slot, leaf, path in zip(plan.slot_of, leaves, paths):
        placements = plan.specs[slot.index].placements(role)
        if any(isinstance(p, (Flat, Owner)) for p in placements):
            raise NotImplementedError(
                f"{path}: a Flat (or Owner) leaf's local piece is not a DTensor shard; export "
                "such trees with to_dtensor(tree, spec, per='bucket')"
            )
        placements = [p if isinstance(p, Shard) else _plain(p) for p in placements]
        out.append(
            DTensor.from_local(
                leaf,
                device_mesh,
                placements,
                run_check=False,
                shape=torch.Size(slot.shape),
                stride=contiguous_stride(slot.shape),
            )
        )
    return optree.tree_unflatten(treedef, out)


def _plain(p: Any) -> Any:
    # Partial and Replicate are torch's own classes already; anything else has been refused.
    if isinstance(p, Partial):
        return Partial(p.reduce_op)
    return Replicate()


def _buckets(plan: Plan, role: str, leaves: list, *, device_mesh: Any) -> list[DTensor]:
    mesh, out = plan.mesh, []
    names = mesh.axis_names
    for b, bucket in enumerate(plan.buckets):
        if getattr(plan.placed[b][role].geometry, "kept", False):
            raise NotImplementedError(
                f"{bucket.slots[0].path}: a spec with Owner on {bucket.spec.keep_axes} only "
                "keeps each rank's owned pieces of its chunk, which no DTensor placement "
                "describes; export it with state_dict(tree, spec) (per leaf, full shapes)"
            )
        buf = plan.pack(b, leaves, role)
        spec = bucket.spec
        split = spec.sharded_axes(role)
        placements = []
        for axis, p in zip(names, spec.placements(role)):
            if axis in split:
                placements.append(Shard(split.index(axis) if len(split) > 1 else 0))
            else:
                placements.append(_plain(p))
        if len(split) > 1:
            counts = tuple(mesh.size(a) for a in split)
            local = buf.reshape(*(1,) * len(split), buf.shape[-1])
            shape = (*counts, buf.shape[-1])
        else:
            local, shape = buf, (bucket.padded,)
        out.append(
            DTensor.from_local(
                local,
                device_mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=contiguous_stride(shape),
            )
        )
    return out
