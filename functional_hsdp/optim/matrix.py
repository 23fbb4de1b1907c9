"""Whole matrices from sharded trees: :func:`per_matrix` runs a function on each whole leaf
at its owner (:mod:`functional_hsdp.plan.owner`) and hands the results back at the optimizer
placement; matrix optimizers (:func:`~functional_hsdp.muon`, Shampoo's preconditioners) are
built on it, since a Flat shard splits a matrix across ranks.

Invariant: the function runs exactly once per leaf over the whole data-parallel mesh (outer
replicas included). On an Owner spec (:func:`~functional_hsdp.owned`) no communication; on
another, one all-to-all per bucket per Flat or ``Shard(d)`` axis (a local selection per
Replicate axis) to the owners, and back (plus one all-gather per Replicate axis).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import einops
import numpy as np
import optree
import torch

from ..base.tree import is_masked, refuse_tracked, refuse_vmap, unmask
from ..plan.buckets import shard_dims, unpack_full
from ..plan.lookup import find_plan_at
from ..plan.owner import BucketRoute, chunk_rows, local_items, owner_of_slot, route
from ..plan.recipe import Plan
from ..runtime.agreement import agreement
from ..runtime.scheduler import run

__all__ = ["per_matrix"]


def per_matrix(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any, spec: Any) -> Any:
    """``fn`` of every whole leaf, with the result at the optimizer placement again.

    Each leaf is moved to its owner (one rank of the data-parallel mesh; see
    :mod:`functional_hsdp.plan.owner`): on an Owner spec (:func:`~functional_hsdp.owned`) it is
    there already; on another spec one all-to-all per bucket per Flat or ``Shard(d)`` axis
    takes it there (and back; a ``Shard(d)`` leaf's ``torch.chunk`` pieces are joined
    along d at its owner). ``fn`` runs exactly once per leaf over the whole mesh, outer
    replicas included. Leaves of equal shape and dtype are stacked: ``fn`` is given
    ``(k, *shape)`` for k leaves and must return that shape (a stack of 3-D leaves such as
    MoE experts' ``[E, M, N]`` is ``(k, E, M, N)``: act on the last two dims). Its result is
    cast to the leaf's dtype.

    Args:
        fn: a function of a batch of matrices ``(..., M, N)`` returning the same shape.
        tree: local shards at ``spec``'s optimizer placement (a final ``reduce_grads``
            result, ``shard``-ed weights, elementwise functions of those); leaves may be
            :class:`MaskedNode` s (left as they are).
        spec: the :class:`~functional_hsdp.Spec` or spec tree the shards were made with.

    Returns:
        A new tree like ``tree``: local shards of ``fn(whole leaf)``.

    Raises:
        ValueError: a leaf with fewer than 2 dims (naming its path), or shards of another
            layout.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> w = fh.shard({"a": torch.eye(3), "b": torch.ones(2, 5)}, spec)
        >>> calls = []
        >>> out = fh.per_matrix(lambda x: calls.append(x.shape) or 2 * x, w, spec)
        >>> fh.gather(out, spec)["a"][1, 1], sorted(calls)
        (tensor([[2., 0., 0.],
                [0., 2., 0.],
                [0., 0., 2.]]), [torch.Size([1, 2, 5]), torch.Size([1, 3, 3])])
    """
    if not callable(fn):
        raise TypeError(f"per_matrix: fn must be callable; got {type(fn).__name__}")
    leaves, present, treedef, paths = unmask(tree, "tree")
    refuse_vmap([x for x, p in zip(leaves, present) if p], "per_matrix")
    with agreement(spec, "per_matrix") as agreed:
        if not any(present):
            return tree
        refuse_tracked(leaves, paths, "per_matrix")
        plan = find_plan_at(leaves, treedef, paths, spec=spec, role="optimizer", name="tree")
        _check_matrices(plan, present, paths)
        agreed.check(plan, paths, options=("per_matrix", str(tuple(present))), defer=True)
    out = list(leaves)
    in_owner = tuple(p and plan.specs[i].owner_axes != () for i, p in enumerate(present))
    elsewhere = tuple(p and not o for p, o in zip(present, in_owner))
    if any(elsewhere):
        routes = route(plan, elsewhere)
        _routed(
            fn, plan=plan, leaves=leaves, paths=paths, routes=routes, out=out, gate=agreed.settle
        )
    agreed.settle()
    if any(in_owner):
        _in_place(fn, plan=plan, leaves=leaves, paths=paths, which=in_owner, out=out)
    leaves_in = optree.tree_flatten(tree, is_leaf=is_masked)[0]
    out = [x if p else m for x, p, m in zip(out, present, leaves_in)]
    return optree.tree_unflatten(treedef, out)


def _check_matrices(plan: Plan, present: list[bool], paths: tuple[str, ...]) -> None:
    for i, p in enumerate(present):
        if not p:
            continue
        if len(plan.shapes[i]) < 2:
            raise ValueError(
                f"{paths[i]}: per_matrix needs matrices (2 or more dims); this leaf has shape "
                f"{tuple(plan.shapes[i])} (leave it to another transformation: fh.partition)"
            )


def _apply(fn: Callable, items: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
    """``dst = fn(src)`` for every ``(src, dst, path)``, one ``fn`` call per shape and
    dtype (the sources stacked)."""
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((tuple(item[0].shape), item[0].dtype), []).append(item)
    for (shape, _), group in groups.items():
        batch = torch.stack([src for src, _, _ in group])
        result = fn(batch)
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(batch.shape):
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise ValueError(
                f"{group[0][2]}: per_matrix's fn must return the shape it was given "
                f"{tuple(batch.shape)} (a stack of {len(group)} leaves of shape {shape}); "
                f"got {got}"
            )
        for (_, dst, _), r in zip(group, result):
            dst.copy_(r)


def _in_place(fn, *, plan: Plan, leaves: list, paths, which: tuple, out: list) -> None:
    """Leaves of Owner specs: each is whole on its owner already."""
    mesh, items = plan.mesh, []
    names = mesh.axis_names
    for bucket in plan.buckets:
        for s in bucket.slots:
            if not which[s.index]:
                continue
            owner = owner_of_slot(bucket, s)
            per_rank = {
                r: all(r[names.index(a)] == c for a, c in owner.items()) for r in _ranks(mesh)
            }
            x = leaves[s.index]
            new = out[s.index] = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
            shape = tuple(plan.shapes[s.index])
            for idx, mine in local_items(mesh, per_rank):
                if mine:
                    items.append((x[idx].reshape(shape), new[idx].view(shape), paths[s.index]))
    _apply(fn, items)


def _ranks(mesh: Any) -> list[tuple]:
    return list(np.ndindex(*mesh.sizes))


def _routed(fn, *, plan: Plan, leaves: list, paths, routes: list, out: list, gate) -> None:
    """Leaves of other specs: to their owners and back, bucket by bucket (fn runs on a
    bucket as soon as it arrived, while later buckets are in flight)."""
    chosen = [b for b, r in enumerate(routes) if r is not None]
    programs = []
    for b in chosen:
        at_owner = functools.partial(_at_owner, fn=fn, plan=plan, b=b, r=routes[b], paths=paths)
        programs.append([*routes[b].there, at_owner, *routes[b].back])

    def source(k: int) -> torch.Tensor:
        compact = routes[chosen[k]].compact
        if compact is not None:  # a Shard(d) bucket: the ranks' chunks, data only
            return compact.pack(leaves)
        return plan.pack(chosen[k], leaves, "optimizer")

    results = run(plan.mesh, programs, source, gate=gate)
    for b, result in zip(chosen, results):
        slots = plan.buckets[b].slots
        for j, piece in _unpacked(plan, b, plan.mesh.wait(result), r=routes[b]).items():
            out[slots[j].index] = piece


def _unpacked(plan: Plan, b: int, buf: torch.Tensor, *, r: BucketRoute) -> dict[int, torch.Tensor]:
    """The routed leaves' local shards (by slot position) in bucket b's buffer come back."""
    bucket, placed, batch = plan.buckets[b], plan.placed[b]["optimizer"], plan.mesh.batch_shape
    if r.compact is not None:
        return {j: r.compact.unpack(buf, j, placed.shapes[j]) for j in sorted(r.routed)}
    if getattr(placed.geometry, "kept", False):  # a keep spec: its kept pieces
        pieces = placed.geometry.unpack(buf)
    elif not placed.axes:
        pieces = unpack_full(bucket, buf, batch)
    else:
        pieces = plan.mesh.geometry.split(buf, placed.geometry)
        pieces = bucket.leaves_of(pieces) if placed.zeros else pieces
    return {j: piece for j, piece in enumerate(pieces) if j in r.routed}


def _at_owner(_k: int, buf: torch.Tensor, *, fn, plan: Plan, b: int, r: BucketRoute, paths):
    bucket, items = plan.buckets[b], []
    for idx, mine in local_items(plan.mesh, r.leaves):
        row = buf[idx]
        for j, offset in mine:
            s = bucket.slots[j]
            flat = row.narrow(-1, offset, s.numel)
            if s.dim is None or math.prod(s.shape[: s.dim]) == 1:  # chunk order is the leaf's
                view = flat.view(tuple(plan.shapes[s.index]))
                items.append((view, view, paths[s.index]))
            else:
                chunks = _Chunks(flat, s, bucket.ranks)
                items.append((chunks.whole(), chunks, paths[s.index]))
    _apply(fn, items)
    return buf


class _Chunks:
    """A Shard(d) leaf in chunk order (its nonempty chunks' data end to end, each
    row-major) in a flat view: :meth:`whole` joins the chunks along d into the leaf (a new
    tensor), :meth:`copy_` writes a whole leaf back into the view in chunk order."""

    def __init__(self, flat: torch.Tensor, slot: Any, n: int):
        self.pre, self.post, self.sizes = shard_dims(slot)
        self.rows = [k for k in (chunk_rows(slot, c) for c in range(n)) if k]
        row = slot.numel // slot.shape[slot.dim]
        self.views = [
            einops.rearrange(
                p, f"({self.pre} c {self.post}) -> ({self.pre}) c ({self.post})", **self.sizes
            )
            for p in flat.split([k * row for k in self.rows])
        ]

    def whole(self) -> torch.Tensor:
        joined = torch.cat(self.views, dim=1)
        return einops.rearrange(
            joined, f"({self.pre}) c ({self.post}) -> {self.pre} c {self.post}", **self.sizes
        )

    def copy_(self, x: torch.Tensor) -> None:
        rows = einops.rearrange(x, f"{self.pre} c {self.post} -> ({self.pre}) c ({self.post})")
        for view, part in zip(self.views, rows.split(self.rows, dim=1)):
            view.copy_(part)
