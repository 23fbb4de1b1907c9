"""Plans: (tree structure, shapes, dtypes, spec) -> bucket layout and per-axis steps, cached.

Parse once, run many times: building a plan does all the Python bookkeeping (bucketing, the
collective sequence of every role change, each rank's ragged offsets); a call only packs,
runs the collectives and unpacks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .layout import (
    Bucket,
    Slot,
    build_buckets,
    pack_full,
    pack_shard_full,
    unpack_full,
    unpack_shard_full,
)
from .placement import Partial, reduce_op, transition
from .spec import Spec
from .trace import Event, record

__all__ = ["Plan", "Step", "get_plan", "layouts_for", "run"]


@dataclass(frozen=True)
class Step:
    """One step on one axis: reduce_scatter, all_reduce, all_gather or (local) slice."""

    op: str
    axis: str
    reduce: str | None


@functools.cache
def steps(spec: Spec, frm: str, to: str) -> tuple[Step, ...]:
    """The per-axis steps that move a bucket of ``spec`` from role ``frm`` to role ``to``.

    Reduce-scatters (and slices) first, in split order; then all-reduces, which so run on the
    smallest chunk; then all-gathers, in reverse split order.
    """
    names = spec.mesh.axis_names
    src, dst = spec.placements(frm), spec.placements(to)
    kinds = {a: transition(p, q, a) for a, p, q in zip(names, src, dst)}
    op = {a: reduce_op(p) if isinstance(p, Partial) else None for a, p in zip(names, src)}
    order = spec.split_order
    out = [Step(kinds[a], a, op[a]) for a in order if kinds[a] in ("reduce_scatter", "slice")]
    out += [Step("all_reduce", a, op[a]) for a in reversed(names) if kinds[a] == "all_reduce"]
    out += [Step("all_gather", a, None) for a in reversed(order) if kinds[a] == "all_gather"]
    return tuple(out)


class Plan:
    """Everything about one (tree structure, per-rank shapes, dtypes, devices, specs)."""

    def __init__(
        self,
        key: tuple,
        treedef: optree.PyTreeSpec,
        paths: tuple[str, ...],
        shapes: tuple[tuple[int, ...], ...],
        dtypes: tuple[torch.dtype, ...],
        devices: tuple[torch.device, ...],
        specs: tuple[Spec, ...],
        kinds: tuple | None = None,
    ):
        self.key = key
        self.treedef = treedef
        self.paths = paths
        self.shapes = shapes
        self.dtypes = dtypes
        self.specs = specs
        self.devices = devices
        self.kinds = kinds  # what decided bucket sharing; None: the dtypes
        self.mesh = specs[0].mesh
        self.buckets, self.empty = build_buckets(paths, shapes, dtypes, devices, specs, kinds)
        self._geometry: dict[tuple[int, str], Any] = {}
        # (slot, bucket index or None) and the slot's place in its bucket, per leaf index
        self._slots: list = [None] * len(paths)
        self._position: dict[int, int] = {}
        for b, bucket in enumerate(self.buckets):
            for k, s in enumerate(bucket.slots):
                self._slots[s.index] = (s, b)
                self._position[s.index] = k
        for s in self.empty:
            self._slots[s.index] = (s, None)

    def __repr__(self) -> str:
        return f"Plan({len(self.paths)} leaves, {len(self.buckets)} buckets)"

    def is_flat(self, bucket: Bucket, role: str) -> bool:
        return bool(bucket.spec.sharded_axes(role))

    def geometry(self, b: int, role: str) -> tuple[int, list]:
        """(chunk length, per-slot geometry) of bucket ``b`` at a sharded ``role``.

        Flat: each slot's ragged range in the rank's chunk. Shard(d): each slot's chunk
        length along d on this rank.
        """
        if (b, role) not in self._geometry:
            bucket, mesh = self.buckets[b], self.mesh
            axes = bucket.spec.sharded_axes(role)
            start, stride = 0, bucket.padded
            for a in axes:
                stride //= mesh.size(a)
                start = start + mesh.coordinate(a) * stride
            if bucket.shard is not None:
                axis = bucket.shard[0]
                geoms = [mesh.chunk_length(s.shape[s.dim], s.size, axis) for s in bucket.slots]
            else:
                geoms = [
                    mesh.ragged(s.offset - start, s.offset + s.numel - start, stride)
                    for s in bucket.slots
                ]
            self._geometry[(b, role)] = (stride, geoms)
        return self._geometry[(b, role)]

    def local_shape(self, slot: Slot, role: str, bucket_index: int | None) -> tuple[int, ...]:
        """The shape of a leaf's local value at ``role`` (batch dims included)."""
        batch = self.mesh.batch_shape
        bucket = self.buckets[bucket_index] if bucket_index is not None else None
        spec = self.specs[slot.index]
        if not spec.sharded_axes(role):
            return (*batch, *slot.shape)
        if bucket is None:  # a zero-size leaf: an empty piece on every rank
            return (*batch, *slot.shape) if spec.shard else (*batch, 0)
        _, geoms = self.geometry(bucket_index, role)
        geom = geoms[self._position[slot.index]]
        if bucket.shard is not None:
            return self.mesh.narrow_shape(slot.chunk_shape, slot.dim, geom)
        return self.mesh.ragged_shape(geom)

    def slots(self) -> list[tuple[Slot, int | None]]:
        """(slot, bucket index or None) for every leaf, in tree order."""
        return self._slots

    # -- packing --------------------------------------------------------------------------

    def pack(self, leaves: list[torch.Tensor], role: str) -> list[torch.Tensor]:
        """New bucket buffers holding ``leaves`` (local values at ``role``); no graph kept."""
        return [self.pack_bucket(b, leaves, role) for b in range(len(self.buckets))]

    @torch.no_grad()
    def pack_bucket(self, b: int, leaves: list[torch.Tensor], role: str) -> torch.Tensor:
        """A new buffer holding bucket ``b``'s leaves (local values at ``role``)."""
        batch, bucket = self.mesh.batch_shape, self.buckets[b]
        if not self.is_flat(bucket, role):
            pack = pack_shard_full if bucket.shard else pack_full
            return pack(bucket, leaves, batch)
        length, geoms = self.geometry(b, role)
        pieces = [leaves[s.index] for s in bucket.slots]
        if bucket.shard is None:
            return self.mesh.ragged_join(pieces, geoms, length)
        nb, flat = len(batch), []
        for s, x, geom in zip(bucket.slots, pieces, geoms):
            x = self.mesh.narrow(x, nb + s.dim, geom)  # ignore any fill past the chunk
            pad = s.size - x.shape[nb + s.dim]
            if pad:
                x = torch.nn.functional.pad(x, (0, 0) * (len(s.shape) - s.dim - 1) + (0, pad))
            flat.append(x.reshape(*batch, -1))
        return torch.cat(flat, dim=-1)

    def views(self, b: int, role: str) -> bool:
        """Whether :meth:`unpack` gives bucket ``b``'s leaves at ``role`` as views of its
        buffer (else as copies)."""
        bucket = self.buckets[b]
        if self.is_flat(bucket, role):
            return self.mesh.ragged_views
        return bucket.shard is None

    def unpack(self, bufs: list[torch.Tensor], role: str) -> list[torch.Tensor]:
        """Each leaf's local value at ``role``: views of ``bufs`` where the mesh allows."""
        batch, leaves = self.mesh.batch_shape, [None] * len(self.paths)
        for b, (bucket, buf) in enumerate(zip(self.buckets, bufs)):
            if not self.is_flat(bucket, role):
                unpack = unpack_shard_full if bucket.shard else unpack_full
                views = unpack(bucket, buf, batch)
            elif bucket.shard is None:
                _, geoms = self.geometry(b, role)
                views = self.mesh.ragged_split(buf, geoms)
            else:
                _, geoms = self.geometry(b, role)
                nb = len(batch)
                views = [
                    self.mesh.narrow(
                        buf[..., s.offset : s.offset + s.chunk_numel].view(*batch, *s.chunk_shape),
                        nb + s.dim,
                        g,
                    )
                    for s, g in zip(bucket.slots, geoms)
                ]
            for s, v in zip(bucket.slots, views):
                leaves[s.index] = v
        for s in self.empty:
            shape = self.local_shape(s, role, None)
            leaves[s.index] = torch.zeros(
                shape, dtype=self.dtypes[s.index], device=self.devices[s.index]
            )
        return leaves


Leg = Any  # a (from role, to role) pair, or a local function (bucket index, buffer) -> buffer


def run(plan: Plan, bufs: Any, *legs: Leg) -> list[torch.Tensor]:
    """Run every bucket through ``legs`` and return the buffers (possibly still pending:
    ``plan.mesh.wait`` each before use).

    A ``(frm, to)`` leg is the per-axis collectives that move a bucket from role ``frm`` to
    role ``to``; a function leg is local work on the waited buffer (adding the running
    accumulation, say). ``bufs`` is the list of input buffers, or a function from bucket
    index to buffer, called just before that bucket's first collective, so that packing the
    next bucket overlaps the collectives already in flight.

    Collectives are issued step-major across buckets: every bucket's first collective is
    issued before any bucket waits on its first, every second before any third, and so on.
    So buckets overlap each other, and the second axis's collective of one bucket runs while
    the first axis's collectives of later buckets are still in flight.
    """
    mesh, n = plan.mesh, len(plan.buckets)
    step_fn = steps.__wrapped__ if torch.compiler.is_compiling() else steps  # traced: no cache
    programs = []  # per bucket: [(local functions to run first, step or None)]
    for bucket in plan.buckets:
        program, local = [], []
        for leg in legs:
            if callable(leg):
                local.append(leg)
                continue
            for step in step_fn(bucket.spec, *leg):
                program.append((local, step))
                local = []
        program.append((local, None))
        programs.append(program)
    lazy = callable(bufs)
    out = [None] * n if lazy else list(bufs)
    try:
        for t in range(max([0, *map(len, programs)])):
            for b, program in enumerate(programs):
                if t >= len(program):
                    continue
                if t == 0 and lazy:
                    out[b] = bufs(b)
                local, step = program[t]
                buf = out[b]
                if local:
                    buf = mesh.wait(buf)
                    for fn in local:
                        buf = fn(b, buf)
                out[b] = apply(mesh, buf, step) if step is not None else buf
    except BaseException:
        for buf in out:  # collectives in flight: drop them rather than leak their buffers
            if buf is not None:
                mesh.abandon(buf)
        raise
    return out


def apply(mesh: Any, buf: torch.Tensor, step: Step) -> torch.Tensor:
    """Issue one bucket collective (logged) or take the local chunk."""
    if step.op == "slice":
        return mesh.chunk(buf, step.axis)
    buf = mesh.wait(buf)  # the previous step's result: its final length is logged
    if not torch.compiler.is_compiling():  # traced collectives are not logged
        record(
            Event(
                step.op,
                step.axis,
                buf.dtype,
                buf.shape[-1],
                step.reduce,
                mesh.impl(step.op, step.axis, step.reduce),
            )
        )
    if step.op == "reduce_scatter":
        return mesh.reduce_scatter(buf, step.axis, step.reduce)
    if step.op == "all_reduce":
        return mesh.all_reduce(buf, step.axis, step.reduce)
    return mesh.all_gather(buf, step.axis)


# -- caches -------------------------------------------------------------------------------

_PLANS: dict[tuple, Plan] = {}
_LAYOUTS: dict[tuple, dict[tuple, None]] = {}  # (treedef, specs) -> shapes seen, newest last
_MAX_PLANS = 256


def get_plan(
    treedef: optree.PyTreeSpec,
    paths: tuple[str, ...],
    shapes: tuple,
    dtypes: tuple,
    devices: tuple,
    specs: tuple[Spec, ...],
    kinds: tuple | None = None,
) -> Plan:
    """The cached plan for this tree; also remembers its shapes for :func:`layouts_for`.

    ``kinds`` (default: the dtypes) decides which leaves may share a bucket; see
    :func:`~functional_hsdp.layout.build_buckets`.
    """
    key = (treedef, shapes, dtypes, devices, specs, kinds)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = Plan(key, treedef, paths, shapes, dtypes, devices, specs, kinds)
        seen = _LAYOUTS.setdefault((treedef, specs), {})
        seen.pop(shapes, None)
        seen[shapes] = None
        if len(seen) > 16:
            seen.pop(next(iter(seen)))
    return plan


def layouts_for(treedef: optree.PyTreeSpec, specs: tuple[Spec, ...]) -> list[tuple]:
    """Per-rank full shapes of the trees of this structure and spec seen so far, newest first."""
    return list(reversed(_LAYOUTS.get((treedef, specs), {})))
