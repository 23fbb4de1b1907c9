"""The all-to-all routes: each bucket of a spec without the owner-major layout, to its owners.

:func:`route` plans, once per plan and set of routed leaves, each bucket's
:class:`BucketRoute` (by :class:`_Planner`) from the optimizer placement to each leaf's owner
and back (``per_matrix``'s way for such specs; the moves: :func:`route`); a Shard(d) bucket
starts from each rank's data (:class:`Compact`). The routes are cached in ``_ROUTES``
(bounded; ``fh.clear_caches()`` empties it). A route reads a finished
:class:`~functional_hsdp.plan.recipe.Plan` by its fields (``mesh``, ``buckets``, ``placed``)
and does not import :mod:`functional_hsdp.plan.recipe`, which builds on this package (the
owner-major buckets, the kept pieces): the dependency goes one way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...base.cache import Bounded
from ...spec.placement import Step
from ..buckets import Bucket, Slot, align
from .keep import keep_owners
from .major import balance
from .pieces import Rank, Rearrange, Seg, chunk_of, exchange, local_items, piece_of

__all__ = ["BucketRoute", "Compact", "chunk_rows", "route"]


def chunk_rows(slot: Slot, c: int) -> int:
    """The length along d of chunk ``c`` of a Shard(d) leaf (``torch.chunk``: 0 past the
    last nonempty chunk)."""
    return min(max(slot.shape[slot.dim] - c * slot.size, 0), slot.size)


def _row(slot: Slot) -> int:
    """A Shard(d) leaf's elements per index along d."""
    return slot.numel // slot.shape[slot.dim]


class Compact:
    """A Shard(d) bucket's routed leaves as the ranks hold them, their data only: each
    rank's nonempty chunks flattened, end to end, then zeros up to ``length`` (the longest
    rank's). ``at[r]``: per chunk rank r holds, ``(slot position, position, lo, hi)``: the
    chunk is elements ``[lo, hi)`` of the leaf in chunk order.

    A Shard(d) bucket is routed as a Flat one, from each rank's data: leaf j's chunk c, its
    ``torch.chunk`` along d, is the elements ``[c S P Q, (c S + n_c) P Q)`` of the leaf in
    *chunk order* (the chunks' data end to end, each row-major; S the chunk length, n_c this
    chunk's, P and Q the sizes of the dims before and after d), so the planner moves ranges
    as for Flat; the owner joins the chunks along d into the whole leaf (for d = 0 chunk
    order is the leaf's own: a view), and splits the result back. Empty chunks send nothing;
    padding to S never travels."""

    def __init__(self, mesh: Any, bucket: Bucket, routed: Sequence[bool]):
        self.bucket, self.batch = bucket, mesh.batch_shape
        d = mesh.axis_names.index(bucket.shard[0])
        self.at: dict[Rank, list[tuple[int, int, int, int]]] = {}
        for r in np.ndindex(*mesh.sizes):
            at, position = [], 0
            for j, s in enumerate(bucket.slots):
                rows = chunk_rows(s, r[d]) if routed[j] else 0
                if rows:
                    lo = r[d] * s.size * _row(s)
                    at.append((j, position, lo, lo + rows * _row(s)))
                    position += rows * _row(s)
            self.at[r] = at
        self.length = max((sum(hi - lo for *_, lo, hi in a) for a in self.at.values()), default=0)
        self.items = local_items(mesh, self.at)
        self.where: dict[int, list[tuple[tuple, int, int]]] = {}  # j -> (index, position, n)
        for idx, at in self.items:
            for j, position, lo, hi in at:
                self.where.setdefault(j, []).append((idx, position, hi - lo))

    def pack(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        """A new ``(*batch, length)`` buffer of the local shards ``leaves`` (a tree's leaf
        list, at the optimizer placement)."""
        parts, bucket = [], self.bucket
        zeros = torch.zeros(self.length, dtype=bucket.dtype, device=bucket.device)
        for idx, at in self.items:
            for j, _, lo, hi in at:
                s = bucket.slots[j]
                x = leaves[s.index][idx].narrow(s.dim, 0, (hi - lo) // _row(s))
                parts.append(x.reshape(-1).to(bucket.dtype))
            parts.append(zeros.narrow(0, 0, self.length - sum(hi - lo for *_, lo, hi in at)))
        return torch.cat(parts).view(*self.batch, self.length)

    def unpack(self, buf: torch.Tensor, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot j's local shard (``shape``: batch dims in front) out of a packed buffer."""
        s = self.bucket.slots[j]
        out = buf.new_zeros(shape)
        for idx, position, n in self.where.get(j, ()):
            dst = out[idx].narrow(s.dim, 0, n // _row(s))
            dst.copy_(buf[idx].narrow(-1, position, n).view(dst.shape))
        return out


@dataclass
class BucketRoute:
    """One bucket's way to its owners and back.

    Attributes:
        there: program items from the optimizer placement's chunk to the owners' buffers.
        back: program items from the owners' buffers back to the chunk.
        leaves: per rank, ``(slot position, offset)`` of each leaf it owns in its buffer.
        length: the owners' buffer length.
        routed: the slot positions routed (the others come back as zeros).
        compact: a Shard(d) bucket's :class:`Compact`: the route starts from its ``pack``
            and ends in a buffer for its ``unpack`` (None: from and to the optimizer
            placement's chunk).
    """

    there: list
    back: list
    leaves: dict[Rank, list[tuple[int, int]]]
    length: int
    routed: frozenset = frozenset()
    compact: Compact | None = None


class _Planner:
    """Builds a :class:`BucketRoute` for bucket ``b`` of ``plan`` (a
    :class:`~functional_hsdp.plan.recipe.Plan`); ``owner[j]``: the owner
    coordinates of slot j (-1 on axes where every rank is its own), None if not routed."""

    def __init__(self, plan: Any, b: int, owner: list):
        self.mesh, self.bucket, self.owner = plan.mesh, plan.buckets[b], owner
        self.placed = plan.placed[b]["optimizer"]
        mesh, spec, axes = self.mesh, self.bucket.spec, self.placed.axes
        moving = [a for a in mesh.axis_names if a in spec.dp_axes and mesh.moves(a)]
        self.flat = [a for a in axes if a in moving]
        self.rep = [a for a in moving if a not in axes]
        # Replicate or keep (Owner on some axes only: the owner's coordinate keeps the value)
        self.keep = [a for a in self.rep if a in spec.keep_axes]
        self.dim = {a: k for k, a in enumerate(mesh.axis_names)}
        self.ranks = list(np.ndindex(*mesh.sizes))
        self.compact, self.length = None, self.placed.length  # the buffer a route starts from
        if self.bucket.shard is not None:
            self.compact = Compact(mesh, self.bucket, [o is not None for o in owner])
            self.length = self.compact.length
        self.kept = getattr(self.placed.geometry, "kept", False) and self.placed.geometry
        self.chunk = {r: self._chunk(r) for r in self.ranks}

    def _chunk(self, r: Rank) -> list[tuple[Seg, int]]:
        """The routed leaves' pieces in rank r's chunk, with their positions in it."""
        if self.compact is not None:
            return [((j, lo, hi), p) for j, p, lo, hi in self.compact.at[r]]
        if self.kept:  # a keep spec's kept pieces, end to end
            return [
                ((j, lo, hi), p) for j, lo, hi, p in self.kept.at[r] if self.owner[j] is not None
            ]
        start, length = chunk_of(self.mesh, self.bucket, axes=self.placed.axes, rank=r)
        out = []
        for j, s in enumerate(self.bucket.slots):
            if self.owner[j] is None:
                continue
            lo, hi = piece_of(s, start, length)
            if lo < hi:
                out.append(((j, lo, hi), s.offset + lo - start))
        return out

    def _at(self, j: int, a: str) -> int:
        return self.owner[j][self.dim[a]]

    def _owns(self, r: Rank, j: int) -> bool:
        return all(o < 0 or o == c for o, c in zip(self.owner[j], r))

    def build(self) -> BucketRoute:
        keep = {
            r: [
                (g, p)
                for g, p in self.chunk[r]
                if all(self._at(g[0], a) == r[self.dim[a]] for a in self.rep)
            ]
            for r in self.ranks
        }
        there, stages, held, source = [], [], keep, self.length
        for a in self.flat:
            stage = self._exchange(a, held, source)
            if not _moves(stage["step"].counts, self.dim[a]):  # the whole mesh's counts
                continue  # every piece at its owner's coordinate on a already: no exchange
            there += [stage["pre"], stage["step"]]
            stages.append(stage)
            held = {r: _packed(segs) for r, segs in stage["recv"].items()}
            source = stage["step"].length
        leaves, length, final = self._final(held, source)
        there.append(final)
        back, base = self._back(stages, held=held, leaves=leaves, length=length)
        back += self._merge(base)
        there = [x for x in there if not (isinstance(x, Rearrange) and x.identity)]
        back = [x for x in back if not (isinstance(x, Rearrange) and x.identity)]
        routed = frozenset(j for j, o in enumerate(self.owner) if o is not None)
        return BucketRoute(
            there=there,
            back=back,
            leaves=leaves,
            length=length,
            routed=routed,
            compact=self.compact,
        )

    def _exchange(self, a: str, held: dict, source: int) -> dict:
        """Stage of axis ``a``: order each rank's pieces by their owner's coordinate on ``a``
        (a Rearrange), send them there (an Exchange)."""
        d, n = self.dim[a], self.mesh.size(a)
        send = {r: sorted(held[r], key=lambda gp: self._at(gp[0][0], a)) for r in self.ranks}
        counts = np.zeros((*self.mesh.sizes, n), dtype=np.int64)
        for r, segs in send.items():
            for (j, lo, hi), _ in segs:
                counts[r][self._at(j, a)] += hi - lo
        recv = {}
        for r in self.ranks:
            recv[r] = [
                g
                for s in range(n)
                for g, _ in send[(*r[:d], s, *r[d + 1 :])]
                if self._at(g[0], a) == r[d]
            ]
        length_in = int(counts.sum(-1).max(initial=0))
        length_out = max((sum(hi - lo for _, lo, hi in g) for g in recv.values()), default=0)
        runs = {r: [(p, g[2] - g[1]) for g, p in segs] for r, segs in send.items()}
        pre = Rearrange(self.mesh, runs, length_in, source=source)
        step = exchange(self.mesh, a, counts=counts, length=length_out)
        sent = {r: [g for g, _ in segs] for r, segs in send.items()}
        return {"pre": pre, "step": step, "send": sent, "recv": recv, "in": length_in}

    def _final(self, held: dict, source: int) -> tuple[dict, int, Rearrange]:
        """Each owner's pieces joined into its whole leaves, at aligned offsets."""
        slots, leaves, runs = self.bucket.slots, {}, {}
        for r in self.ranks:
            mine = [j for j in range(len(slots)) if self.owner[j] is not None and self._owns(r, j)]
            pieces = {}
            for (j, lo, hi), p in held[r]:
                pieces.setdefault(j, []).append((lo, hi, p))
            offset, leaves[r], runs[r] = 0, [], []
            for j in mine:
                parts = sorted(pieces.get(j, []))
                assert sum(hi - lo for lo, hi, _ in parts) == slots[j].numel, "a leaf lost"
                runs[r] += [(-1, offset - sum(n for _, n in runs[r]))]
                runs[r] += [(p, hi - lo) for lo, hi, p in parts]
                leaves[r].append((j, offset))
                offset += align(slots[j].numel)
        length = max((sum(n for _, n in x) for x in runs.values()), default=0)
        return leaves, length, Rearrange(self.mesh, runs, length, source=source)

    def _back(self, stages: list, *, held: dict, leaves: dict, length: int) -> tuple[list, dict]:
        """The reverse exchanges, from the owners' buffers; returns the items and the
        buffer they end in (each rank's kept pieces, as positions of ``(j, lo)``)."""
        if not stages:  # the owners' buffer is the base
            at = {r: {(j, 0): off for j, off in leaves[r]} for r in self.ranks}
            return [], {"at": at, "length": length}
        offsets = {r: dict(leaves[r]) for r in self.ranks}
        runs = {r: [(offsets[r][j] + lo, hi - lo) for (j, lo, hi), _ in held[r]] for r in held}
        longest = max((sum(n for _, n in x) for x in runs.values()), default=0)
        items = [Rearrange(self.mesh, runs, longest, source=length)]
        for t in range(len(stages) - 1, -1, -1):
            stage, a = stages[t], stages[t].get("step").axis
            d = self.dim[a]
            fwd = stage["step"].counts
            counts = np.zeros_like(fwd)
            for r in self.ranks:
                for s in range(self.mesh.size(a)):
                    counts[r][s] = fwd[(*r[:d], s, *r[d + 1 :])][r[d]]
            items.append(exchange(self.mesh, a, counts=counts, length=stage["in"]))
            position = {r: _positions(stage["send"][r]) for r in self.ranks}
            if t:
                prev = stages[t - 1]["recv"]
                runs = {
                    r: [(position[r][(j, lo)], hi - lo) for j, lo, hi in prev[r]]
                    for r in self.ranks
                }
                items.append(
                    Rearrange(self.mesh, runs, stages[t - 1]["step"].length, source=stage["in"])
                )
        return items, {"at": position, "length": stages[0]["in"]}

    def _merge(self, base: dict) -> list:
        """All-gathers over the Replicate axes (innermost first), then every rank's chunk
        from the blocks: each piece from the member that kept it."""
        mesh, items = self.mesh, []
        gathered = [a for a in self.rep if a not in self.keep]
        for a in reversed(gathered):
            items.append(Step(op="all_gather", axis=a, reduce=None, size=mesh.size(a)))
        runs = {}
        for r in self.ranks:
            runs[r], end = [], 0
            for (j, lo, hi), p in self.chunk[r]:
                if any(self._at(j, a) != r[self.dim[a]] for a in self.keep):
                    continue  # kept by its owner's coordinate there: zeros here
                member, block = list(r), 0
                for a in gathered:  # the last gathered axis is the most significant
                    member[self.dim[a]] = self._at(j, a)
                for a in gathered:
                    block = block * mesh.size(a) + self._at(j, a)
                src = block * base["length"] + base["at"][tuple(member)][(j, lo)]
                runs[r] += [(-1, p - end), (src, hi - lo)]
                end = p + hi - lo
        source = math.prod(mesh.size(a) for a in gathered) * base["length"]
        return [*items, Rearrange(mesh, runs, self.length, source=source)]


def _moves(counts: np.ndarray, d: int) -> bool:
    """Whether an all-to-all of ``counts`` over mesh dim ``d`` sends anything to another
    rank (on any rank of the mesh)."""
    return any(counts[r].sum() != counts[r][r[d]] for r in np.ndindex(*counts.shape[:-1]))


def _packed(segs: list[Seg]) -> list[tuple[Seg, int]]:
    """Pieces laid end to end from 0: ``(piece, position)``."""
    out, at = [], 0
    for g in segs:
        out.append((g, at))
        at += g[2] - g[1]
    return out


def _positions(segs: list[Seg]) -> dict[tuple[int, int], int]:
    """``(j, lo) -> position`` of pieces laid end to end from 0."""
    return {(j, lo): p for (j, lo, _), p in _packed(segs)}


# (plan, routed leaf mask) -> per bucket its BucketRoute (None: nothing routed there)
_ROUTES: Bounded = Bounded(64)


def route(plan: Any, routed: tuple[bool, ...]) -> list[BucketRoute | None]:
    """Every bucket's :class:`BucketRoute` of ``plan`` (a
    :class:`~functional_hsdp.plan.recipe.Plan`) for the leaves ``routed`` (by tree index),
    built once. Owners are balanced over the whole tree (largest leaf first, each to the least
    loaded rank, then evened: :func:`balance`), among the data-parallel axes that move (size
    > 1) of each spec; a leaf's owner coordinate on every other axis is the rank's own (other
    axes hold other values: each does its own).

    There: a local selection for each Replicate axis (a rank keeps the pieces whose owner
    shares its coordinate on it) and one all-to-all per Flat or Shard(d) axis (each piece to
    its owner's coordinate on that axis); then each owner's pieces are joined into whole
    leaves. Back: the reverse all-to-alls, and one all-gather per Replicate axis. Blocks are
    uneven (nothing padded on the wire); a rank's buffer is as long as the longest of the
    mesh, so that both meshes log the same events. A keep spec's kept pieces are moved over
    the other axes to the owner and back, and the results left with the keep axis's owners
    (no all-gather there)."""
    key = (plan, routed)
    known = _ROUTES.get(key)
    if known is None:
        known = _ROUTES[key] = _build(plan, routed)
    return known


def _build(plan: Any, routed: tuple[bool, ...]) -> list[BucketRoute | None]:
    mesh, groups = plan.mesh, {}
    for b, bucket in enumerate(plan.buckets):
        axes = tuple(a for a in mesh.axis_names if a in bucket.spec.dp_axes and mesh.moves(a))
        for j, s in enumerate(bucket.slots):
            if routed[s.index]:
                groups.setdefault(axes, []).append((b, j, s.numel))
    owners: dict[tuple[int, int], tuple] = {}
    for b, bucket in enumerate(plan.buckets):  # keep specs: the owners their moves use
        if bucket.spec.keep_axes:
            for j, (s, o) in enumerate(zip(bucket.slots, keep_owners(bucket, mesh))):
                if routed[s.index]:
                    owners[(b, j)] = o
    groups = {
        axes: [(b, j, n) for b, j, n in items if (b, j) not in owners]
        for axes, items in groups.items()
    }
    for axes, items in groups.items():
        sizes = [mesh.size(a) for a in axes]
        for (b, j, _), k in zip(items, balance([n for *_, n in items], math.prod(sizes))):
            coord = dict(zip(axes, np.unravel_index(k, sizes))) if sizes else {}
            owners[(b, j)] = tuple(int(coord.get(a, -1)) for a in mesh.axis_names)
    out: list[BucketRoute | None] = []
    for b, bucket in enumerate(plan.buckets):
        owner = [owners.get((b, j)) for j in range(len(bucket.slots))]
        out.append(_Planner(plan, b, owner).build() if any(o is not None for o in owner) else None)
    return out
