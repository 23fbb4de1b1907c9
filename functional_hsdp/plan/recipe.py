"""Plans: a tree's metadata and spec -> a finished recipe, built once and cached.

Parse once, run many times (as einops does with a pattern): building a :class:`Plan` does
all the Python bookkeeping (bucketing, every role change's per-axis collectives, each
bucket's geometry and every leaf's local shape at every role); a call only packs, runs the
collectives and unpacks. The plan never goes back to the :class:`~functional_hsdp.Spec`.

Roles (where a value rests): ``input`` (raw per-rank gradients: Partial on every DP axis),
``gradient``, ``optimizer``, ``parameter`` (the spec's three placements) and ``full`` (all
Replicate).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optree
import torch

from ..base.cache import Bounded
from ..spec.placement import Owner, Partial, Placement, Replicate, Step, reduce_op, transition
from ..spec.specs import Spec
from .buckets import (
    Bucket,
    Carve,
    Gaps,
    Slot,
    build_buckets,
    interleave,
    pack_full,
    pack_shard_full,
    spaced,
    unpack_full,
    unpack_shard_full,
)
from .owner import KeptPieces, keep_items, owner_bucket

__all__ = [
    "LEGS",
    "ROLES",
    "Placed",
    "Plan",
    "Step",
    "TreeMeta",
    "get_plan",
    "layouts_for",
    "remember_layout",
]

ROLES = ("input", "gradient", "optimizer", "parameter", "full")

#: The role changes a plan prepares (from, to).
LEGS = (
    ("input", "gradient"),
    ("gradient", "optimizer"),
    ("full", "optimizer"),
    ("full", "parameter"),
    ("optimizer", "full"),
    ("parameter", "full"),
    ("optimizer", "parameter"),
)


@dataclass(frozen=True)
class TreeMeta:
    """Everything a plan depends on: the cache key, and the one argument that builds a plan.

    ``shapes`` are per-rank full shapes (no mesh dims); ``units`` number each leaf's unit
    (its spec-prefix leaf); ``kinds`` decide which leaves may share a bucket (default: the
    dtypes; a MainGrad passes the parameters' dtypes to get their layout in fp32).
    """

    treedef: optree.PyTreeSpec
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]
    specs: tuple[Spec, ...]
    units: tuple[int, ...]
    kinds: tuple | None = None
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        key = (self.treedef, self.shapes, self.dtypes, self.devices, self.specs, self.units)
        object.__setattr__(self, "_hash", hash((*key, self.kinds)))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True)
class Placed:
    """A bucket at one role: its sharded axes, per-rank length, leaf pieces and shapes."""

    axes: tuple[str, ...]  # sharded (Flat/Shard) axes, in split order
    length: int  # elements of the rank's buffer at this role
    geometry: Any  # Flat: the mesh geometry's pieces; Shard(d): per-slot chunk lengths
    shapes: tuple[tuple[int, ...], ...]  # per slot: the local shape (batch dims in front)
    views: bool  # whether unpacking gives views of the buffer (else copies)
    # Flat: per slot, the width of this rank's piece of the alignment gap after it (None: no
    # gap), and the shape of one zero tensor every such piece is a view of
    after: tuple[int | None, ...] = ()
    zeros: tuple[int, ...] = ()
    gaps: Gaps = field(init=False, repr=False, compare=False)  # ``after``, prepared

    def __post_init__(self) -> None:
        object.__setattr__(self, "gaps", Gaps(self.after))


def _gap_pieces(
    bucket: Bucket, every: list[tuple[int, ...]]
) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """Per slot: the width of this rank's piece of the gap after it (None: no gap range), of
    ``every`` piece shape of the bucket's ranges; and the zeros' shape (batch dims, widest)."""
    after = [every[p + 1][-1] if g else None for p, g in zip(bucket.at, bucket.after[:-1])]
    after.append(None)  # the tail is no range: the geometry pads the chunk itself
    widths = [w for w in after if w is not None]
    zeros = (*every[0][:-1], max(widths)) if widths else ()
    return tuple(after), zeros


def _steps(spec: Spec, frm: str, to: str) -> tuple[Step, ...]:
    """The per-axis steps that move a bucket of ``spec`` from role ``frm`` to role ``to``.

    Reduce-scatters (and slices) first, in split order; then all-reduces, which so run on the
    smallest chunk; then all-gathers, in reverse split order. Size-1 axes move nothing,
    unless the mesh issues collectives on them (``DistMesh(issue_size_one=True)``).
    """
    mesh = spec.mesh
    names = [a for a in mesh.axis_names if mesh.moves(a)]
    src, dst = spec.placements(frm), spec.placements(to)
    index = {a: mesh.axis_names.index(a) for a in names}
    keep = spec.keep_axes
    kinds = {
        a: (_keep_move if a in keep else transition)(src[index[a]], dst[index[a]], a) for a in names
    }
    op = {
        a: reduce_op(src[index[a]]) if isinstance(src[index[a]], Partial) else None for a in names
    }
    order = [a for a in spec.split_order if a in kinds]
    n = mesh.size

    def steps(kind: str, axes) -> list[Step]:
        return [Step(op=kind, axis=a, reduce=op[a], size=n(a)) for a in axes if kinds[a] == kind]

    out = [
        Step(op=kinds[a], axis=a, reduce=op[a], size=n(a))
        for a in order
        if kinds[a] in ("reduce_scatter", "slice")
    ]
    kept = [a for a in names if a in keep]
    out += steps("reduce_scatter_v", kept) + steps("select", kept)
    out += steps("all_reduce", reversed(names))
    out += steps("all_gather_v", reversed(kept))
    out += steps("all_gather", reversed(order))
    return tuple(out)


def _keep_move(frm: Placement, to: Placement, axis: str) -> str | None:
    """The move along a ``keep_axes`` axis (Owner there keeps the spec's chunk; see
    :func:`functional_hsdp.plan.owner.keep_items`): None, or a move ``keep_items`` makes."""
    if isinstance(to, Partial) and not isinstance(frm, Partial):
        raise ValueError(
            f"axis {axis!r}: cannot move {frm!r} to {to!r}: a reduced value cannot become a "
            "summand again"
        )
    if type(frm) is type(to):
        return transition(frm, to, axis)
    moves = {
        (Partial, Owner): "reduce_scatter_v",
        (Partial, Replicate): "all_reduce",
        (Owner, Replicate): "all_gather_v",
        (Replicate, Owner): "select",
    }
    return moves[(type(frm), type(to))]


def _keeps(spec: Spec) -> bool:
    """Whether ``spec`` keeps values by owner along an axis that moves (its optimizer
    placement is then :class:`functional_hsdp.plan.owner.KeptPieces`)."""
    return any(spec.mesh.moves(a) for a in spec.keep_axes)


#: moves along a keep axis, made per bucket by :func:`functional_hsdp.plan.owner.keep_items`
KEEP_MOVES = ("reduce_scatter_v", "all_gather_v", "select")


class Plan:
    """The finished recipe for one :class:`TreeMeta`: buckets, programs, geometry, shapes."""

    def __init__(self, meta: TreeMeta, paths: tuple[str, ...]):
        self.meta = meta
        self.treedef = meta.treedef
        self.shapes, self.dtypes, self.devices = meta.shapes, meta.dtypes, meta.devices
        self.specs = meta.specs
        self.mesh = meta.specs[0].mesh
        names = {a for spec in set(meta.specs) for a in spec.dp_axes}
        #: the data-parallel axes of the specs, in mesh order
        self.dp_axes = tuple(a for a in self.mesh.axis_names if a in names)
        self.buckets, self.empty = build_buckets(
            paths,
            shapes=meta.shapes,
            dtypes=meta.dtypes,
            devices=meta.devices,
            specs=meta.specs,
            units=meta.units,
            kinds=meta.kinds,
            owner_major=owner_bucket,
        )
        n = len(meta.shapes)
        self.bucket_of: list[int | None] = [None] * n  # per leaf: its bucket (None: zero-size)
        self.slot_of: list[Slot] = [None] * n  # type: ignore[list-item]
        for b, bucket in enumerate(self.buckets):
            for s in bucket.slots:
                self.slot_of[s.index], self.bucket_of[s.index] = s, b
        for s in self.empty:
            self.slot_of[s.index] = s
        # unpacked leaves come bucket by bucket, then the zero-size ones: back to tree order
        order = [s.index for bucket in self.buckets for s in bucket.slots]
        order += [s.index for s in self.empty]
        position = [0] * n
        for k, i in enumerate(order):
            position[i] = k
        self._position = position
        self._in_order = position == list(range(n))  # unpacked leaves already in tree order
        self._reorder = operator.itemgetter(*position) if n > 1 else (lambda xs: tuple(xs))
        self.placed = self._placed()
        self.programs = self._programs()
        self.local_shapes = {role: self._local_shapes(role) for role in ROLES}

    def __repr__(self) -> str:
        return f"Plan({len(self.shapes)} leaves, {len(self.buckets)} buckets)"

    # -- building --------------------------------------------------------------------------

    def _programs(self) -> dict[tuple[str, str], tuple[tuple[Step, ...] | None, ...]]:
        by_spec: dict[tuple[Spec, tuple[str, str]], tuple[Step, ...] | None] = {}
        for spec in dict.fromkeys(self.specs):
            for leg in LEGS:
                try:
                    by_spec[(spec, leg)] = _steps(spec, *leg)
                except (ValueError, NotImplementedError):  # a move this spec cannot make
                    by_spec[(spec, leg)] = None
        out = {leg: [by_spec[(b.spec, leg)] for b in self.buckets] for leg in LEGS}
        for programs in out.values():
            for b, steps in enumerate(programs):
                if steps and any(x.op in KEEP_MOVES for x in steps):
                    programs[b] = tuple(
                        y
                        for x in steps
                        for y in (self._keep_items(b, x) if x.op in KEEP_MOVES else (x,))
                    )
        return {leg: tuple(programs) for leg, programs in out.items()}

    def _keep_items(self, b: int, step: Step) -> list:
        """Bucket ``b``'s items for ``step``, a move along its keep axis (``keep_items``)."""
        placed = self.placed[b]
        return keep_items(
            step,
            mesh=self.mesh,
            kept=placed["optimizer"].geometry,
            length=placed["gradient"].length,
        )

    def _placed(self) -> list[dict[str, Placed]]:
        out = []
        #: per bucket and role: how unpacking cuts the leaves' views (None: as it splits)
        self.carves: list[dict[str, Carve | None]] = []
        for bucket in self.buckets:
            spec, per_axes, cut = bucket.spec, {}, {}
            roles, carves = {}, {}
            for role in ROLES:
                axes = (
                    spec.sharded_axes(role)
                    if role in ("gradient", "optimizer", "parameter")
                    else ()
                )
                if role == "optimizer" and _keeps(spec):  # the kept pieces of the chunk
                    kept = KeptPieces(self.mesh, bucket, axes)
                    roles[role] = Placed(
                        axes=axes,
                        length=kept.length,
                        geometry=kept,
                        shapes=kept.shapes,
                        views=kept.views,
                    )
                    carves[role] = None
                    continue
                if axes not in per_axes:
                    per_axes[axes] = self._place(bucket, axes)
                    cut[axes] = self._carve(bucket, per_axes[axes])
                roles[role], carves[role] = per_axes[axes], cut[axes]
            out.append(roles)
            self.carves.append(carves)
        return out

    def _carve(self, bucket: Bucket, placed: Placed) -> Carve | None:
        """A :class:`Carve` for unpacking views of a bucket whose leaves have gaps between
        them at ``placed`` (None: no gap between them, where one split makes no more views
        than leaves, and costs less; or not views)."""
        batch = self.mesh.batch_shape
        if bucket.shard is not None or not placed.views:
            return None
        if not placed.axes:
            if not bucket.inner:
                return None
            return Carve((*batch, bucket.padded), lambda buf: unpack_full(bucket, buf, batch))
        if not placed.zeros:
            return None
        geometry, pieces = self.mesh.geometry, placed.geometry
        return Carve(
            (*batch, placed.length), lambda buf: bucket.leaves_of(geometry.split(buf, pieces))
        )

    def _place(self, bucket: Bucket, axes: tuple[str, ...]) -> Placed:
        mesh, batch = self.mesh, self.mesh.batch_shape
        if not axes:
            shapes = tuple((*batch, *s.shape) for s in bucket.slots)
            return Placed(
                axes=(),
                length=bucket.padded,
                geometry=None,
                shapes=shapes,
                views=bucket.shard is None,
            )
        start, stride = 0, bucket.padded
        for a in axes:
            stride //= mesh.size(a)
            start = start + mesh.coordinate(a) * stride
        geometry = mesh.geometry
        if bucket.shard is not None:
            axis = bucket.shard[0]
            lengths = [geometry.chunk_length(s.shape[s.dim], s.size, axis) for s in bucket.slots]
            shapes = tuple(
                geometry.narrow_shape(s.chunk_shape, s.dim, g)
                for s, g in zip(bucket.slots, lengths)
            )
            return Placed(axes=axes, length=stride, geometry=lengths, shapes=shapes, views=False)
        # the gaps between leaves are ranges too: the geometry sees consecutive ranges
        pieces = geometry.pieces(start, bucket.ranges, stride)
        every = [tuple(shape) for shape in geometry.piece_shapes(pieces)]
        shapes = bucket.leaves_of(every)
        after, zeros = _gap_pieces(bucket, every)
        # a geometry may know per bucket that its pieces are views (SimMesh: no rank has fill)
        views = getattr(pieces, "views", geometry.views)
        return Placed(
            axes=axes,
            length=stride,
            geometry=pieces,
            shapes=shapes,
            views=views,
            after=after,
            zeros=zeros,
        )

    def _local_shapes(self, role: str) -> tuple[tuple[int, ...], ...]:
        batch, out = self.mesh.batch_shape, [None] * len(self.shapes)
        for b, bucket in enumerate(self.buckets):
            for s, shape in zip(bucket.slots, self.placed[b][role].shapes):
                out[s.index] = shape
        for s in self.empty:  # a zero-size leaf: an empty piece on every rank
            spec = self.specs[s.index]
            flat = role in ("gradient", "optimizer", "parameter") and spec.sharded_axes(role)
            out[s.index] = (*batch, 0) if flat and spec.shard is None else (*batch, *s.shape)
        return tuple(out)

    # -- running ---------------------------------------------------------------------------

    def program(self, b: int, frm: str, to: str) -> tuple[Step, ...]:
        """Bucket ``b``'s steps from role ``frm`` to role ``to``."""
        steps = self.programs[(frm, to)][b]
        if steps is None:
            raise ValueError(f"{self.buckets[b].spec!r} cannot move a value from {frm} to {to}")
        return steps

    @torch.no_grad()
    def pack(
        self, b: int, leaves: list[torch.Tensor], role: str, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A new buffer holding bucket ``b``'s leaves (local values at ``role``), in
        ``dtype`` (default: the bucket's): mixed precision casts while packing."""
        batch, bucket, placed = self.mesh.batch_shape, self.buckets[b], self.placed[b][role]
        dtype = dtype or bucket.dtype
        if not placed.axes:
            if bucket.shard:
                return pack_shard_full(bucket, leaves, batch, dtype=dtype)
            return pack_full(bucket, leaves, batch, dtype=dtype)
        values = bucket.take(leaves)
        if getattr(placed.geometry, "kept", False):  # a keep spec's optimizer placement
            return placed.geometry.pack(values, dtype=dtype)
        if dtype != bucket.dtype:  # a shard-sized cast, then one packing copy
            values = tuple(x.to(dtype) for x in values)
        if bucket.shard is None:
            if placed.zeros:  # the gaps' pieces between the leaves' (geometry.join wants all)
                zeros = torch.zeros(placed.zeros, dtype=dtype, device=bucket.device)
                values = interleave(values, placed.gaps, zeros)
            geometry = self.mesh.geometry
            return geometry.join(list(values), placed.geometry, dtype=dtype, device=bucket.device)
        nb, flat = len(batch), []
        for s, x, length in zip(bucket.slots, values, placed.geometry):
            x = self.mesh.geometry.narrow(x, nb + s.dim, length)  # ignore fill past the chunk
            pad = s.size - x.shape[nb + s.dim]
            if pad:
                x = torch.nn.functional.pad(x, (0, 0) * (len(s.shape) - s.dim - 1) + (0, pad))
            flat.append(x.reshape(*batch, -1))
        return torch.cat(spaced(bucket, flat, batch, dtype=dtype), dim=-1)

    def unpack(
        self, bufs: list[torch.Tensor], role: str, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """Each leaf's local value at ``role``, in tree order: views of ``bufs`` where
        :attr:`Placed.views` says so, else new tensors. ``dtype``: the buffers' dtype when
        they were packed in another than the plan's (zero-size leaves are made in it)."""
        batch, geometry, values = self.mesh.batch_shape, self.mesh.geometry, []
        for b, (bucket, buf) in enumerate(zip(self.buckets, bufs)):
            placed, carve = self.placed[b][role], self.carves[b][role]
            cut = carve(buf) if carve is not None else None
            if cut is not None:  # views of the leaves only, none of the gaps
                values.extend(cut)
            elif getattr(placed.geometry, "kept", False):
                values.extend(placed.geometry.unpack(buf))
            elif not placed.axes:
                unpack = unpack_shard_full if bucket.shard else unpack_full
                values.extend(unpack(bucket, buf, batch))
            elif bucket.shard is None:
                pieces = geometry.split(buf, placed.geometry)
                values.extend(bucket.leaves_of(pieces) if placed.zeros else pieces)
            else:
                nb = len(batch)
                for s, length in zip(bucket.slots, placed.geometry):
                    chunk = buf.narrow(-1, s.offset, s.chunk_numel).view(*batch, *s.chunk_shape)
                    values.append(geometry.narrow(chunk, nb + s.dim, length))
        for s in self.empty:
            shape = self.local_shapes[role][s.index]
            values.append(
                torch.zeros(
                    shape, dtype=dtype or self.dtypes[s.index], device=self.devices[s.index]
                )
            )
        if self._in_order:
            return values
        if torch.compiler.is_compiling():  # dynamo cannot trace itemgetter
            return [values[k] for k in self._position]
        return list(self._reorder(values))

    def held(self, role: str, members: set[int]) -> np.ndarray:
        """Elements of the leaves ``members`` (tree indices) that each rank of the mesh
        holds at ``role``, ranks in coordinate order (flat): for every rank, whatever this
        process sees (a DistMesh rank holds only its own pieces, and every rank must agree
        on lengths that depend on all of them, as a compressed packing's rows do)."""
        mesh = self.mesh
        coords = dict(zip(mesh.axis_names, np.indices(mesh.sizes).reshape(len(mesh.sizes), -1)))
        total = np.zeros(math.prod(mesh.sizes), dtype=np.int64)
        for bucket, placed in zip(self.buckets, self.placed):
            placed, slots = placed[role], [s for s in bucket.slots if s.index in members]
            if not slots:
                continue
            if getattr(placed.geometry, "kept", False):  # Owner on some axes: each rank's pieces
                at = placed.geometry.at  # for every rank of the mesh, in coordinate order
                for k, rank in enumerate(np.ndindex(*mesh.sizes)):
                    total[k] += sum(
                        hi - lo for j, lo, hi, _ in at[rank] if bucket.slots[j].index in members
                    )
            elif not placed.axes:  # whole leaves on every rank
                total += sum(s.numel for s in slots)
            elif bucket.shard is not None:  # torch.chunk along the shard dim
                axis, dim = bucket.shard
                for s in slots:
                    along = np.clip(s.shape[dim] - coords[axis] * s.size, 0, s.size)
                    total += s.numel // s.shape[dim] * along
            else:  # Flat: each leaf's range cut by the rank's chunk of the bucket
                start, stride = 0, bucket.padded
                for a in placed.axes:
                    stride //= mesh.size(a)
                    start = start + coords[a] * stride
                for s in slots:
                    lo = np.clip(s.offset - start, 0, placed.length)
                    hi = np.clip(s.offset + s.numel - start, 0, placed.length)
                    total += np.maximum(hi, lo) - lo
        return total


# -- the plan cache ---------------------------------------------------------------------------

_PLANS: Bounded = Bounded(256)
# (treedef, specs, units) -> per-rank full shapes seen, newest last (for finding the layout of
# local shards, whose full shapes they do not show)
_LAYOUTS: Bounded = Bounded(256)


def get_plan(meta: TreeMeta, paths: tuple[str, ...]) -> Plan:
    """The cached plan for ``meta`` (``paths`` name leaves in errors while building it)."""
    plan = _PLANS.get(meta)
    if plan is None:
        plan = _PLANS[meta] = Plan(meta, paths)
        remember_layout(meta.treedef, meta.specs, meta.units, shapes=meta.shapes)
    return plan


def remember_layout(
    treedef: optree.PyTreeSpec, specs: tuple[Spec, ...], units: tuple[int, ...], *, shapes: tuple
) -> None:
    """Record the per-rank full shapes of a tree of this structure and spec (newest last)."""
    key = (treedef, specs, units)
    seen = _LAYOUTS.get(key)
    if seen is None:
        seen = _LAYOUTS[key] = {}
    seen.pop(shapes, None)
    seen[shapes] = None
    if len(seen) > 16:
        del seen[next(iter(seen))]


def layouts_for(
    treedef: optree.PyTreeSpec, specs: tuple[Spec, ...], units: tuple[int, ...]
) -> list[tuple]:
    """Per-rank full shapes of the trees of this structure and spec seen so far, newest first."""
    return list(reversed(_LAYOUTS.get((treedef, specs, units), {})))
