"""The keep axis: an Owner spec on some data-parallel axes only (``owned(spec, axes)``).

That is HSDP's outer axis, where the parameter is Replicate. The spec keeps its own layout and
chunks; along the keep axis (one of size > 1) each rank keeps only the pieces of its chunk
whose leaf's owner (:func:`keep_owners`) has its coordinate there (:class:`KeptPieces`, the
optimizer placement's geometry, which :class:`~functional_hsdp.plan.recipe.Plan` builds).
Partial -> Owner is a reduce-scatter-v and Owner -> Replicate an all-gather-v, each one
all-to-all of the data with uneven blocks (:func:`keep_items`, which the plan calls for each
such move). Nothing here keeps state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...spec.placement import Step
from ..buckets import Bucket, align
from .major import balance
from .pieces import Rank, Rearrange, chunk_of, exchange, local_items, piece_of

__all__ = ["KeptPieces", "keep_items", "keep_owners"]


def keep_owners(bucket: Bucket, mesh: Any) -> list[tuple[int, ...]]:
    """Per slot of a bucket of a spec with :attr:`~functional_hsdp.Spec.keep_axes`: its
    owner's coordinates over every mesh axis (-1 where every rank is its own: axes that are
    not data-parallel or do not move); per bucket, the same on every rank, and the same for
    the moves of the spec and for ``per_matrix``'s route.

    The keep axis's coordinate evens what each rank keeps: largest leaf first, each to the
    coordinate whose heaviest chunk (of the spec's own chunks) grows least with the leaf's
    pieces. On the chunked axes a leaf's owner is the rank whose chunk holds most of it, so
    that ``per_matrix`` moves only the pieces of leaves that straddle chunks (none, if no
    leaf does): the chunks being equal, each rank's whole leaves are about what it keeps,
    within a straddling leaf. Other data-parallel axes that move are balanced by size
    (:func:`balance`).
    """
    spec = bucket.spec
    axes = [a for a in mesh.axis_names if a in spec.dp_axes and mesh.moves(a)]
    keep = [a for a in axes if a in spec.keep_axes]
    if not keep:
        return _balanced_owners(bucket, mesh, axes=axes, slots=range(len(bucket.slots)))
    a, split = keep[0], spec.sharded_axes("gradient")
    chunks = math.prod(mesh.size(x) for x in split)
    length = bucket.padded // chunks
    pieces = [
        [hi - lo for lo, hi in (piece_of(s, c * length, length) for c in range(chunks))]
        for s in bucket.slots
    ]
    loads = np.zeros((mesh.size(a), chunks), dtype=np.int64)
    at = [0] * len(bucket.slots)
    for j in sorted(range(len(bucket.slots)), key=lambda j: (-bucket.slots[j].numel, j)):
        grown = loads + np.asarray(pieces[j])
        k = min(range(mesh.size(a)), key=lambda k: (grown[k].max(), loads[k].sum(), k))
        loads[k], at[j] = grown[k], k
    rest = [x for x in axes if x != a and x not in split]
    out = _balanced_owners(bucket, mesh, axes=rest, slots=range(len(bucket.slots)))
    names, sizes = mesh.axis_names, [mesh.size(x) for x in split]
    for j, piece in enumerate(pieces):
        c = max(range(chunks), key=lambda c: (piece[c], -c))  # where most of it is
        coord = dict(zip(split, np.unravel_index(c, sizes)), **{a: at[j]})
        out[j] = tuple(int(coord[x]) if x in coord else o for x, o in zip(names, out[j]))
    return out


def _balanced_owners(bucket: Bucket, mesh: Any, *, axes: list, slots, fixed=None) -> list:
    """Owner coordinates for ``slots`` balanced by size over ``axes`` (:func:`balance`),
    with ``fixed`` coordinates on other axes."""
    sizes = [mesh.size(a) for a in axes]
    out = []
    for k in balance([align(bucket.slots[j].numel) for j in slots], math.prod(sizes)):
        coord = dict(zip(axes, np.unravel_index(k, sizes))) if sizes else {}
        coord.update(fixed or {})
        out.append(tuple(int(coord.get(a, -1)) for a in mesh.axis_names))
    return out


class KeptPieces:
    """A keep spec's bucket at its optimizer placement (the ``geometry`` of its
    :class:`~functional_hsdp.plan.recipe.Placed`): each rank's *kept* pieces of its chunk (of the
    leaves whose owner has its coordinate on the keep axis), end to end, the data only, then
    zeros up to ``length`` (the longest of the ranks this process holds: a rank of a DistMesh
    holds its own). A leaf's local value is its piece where the
    rank keeps it, else empty (on a SimMesh: stacked, zero fill at the end, as Flat's).

    ``at[r]``: per piece rank r keeps, ``(slot position, lo, hi, position)``: elements
    ``[lo, hi)`` of the leaf at ``position`` of the buffer; ``chunk[r]``: the same pieces'
    positions in r's chunk; ``pieces[r]``: every leaf's piece of r's chunk, kept or not,
    ``(position in the chunk, length, its owner's coordinate on the keep axis)``.
    """

    # What a geometry's readers ask (getattr(geometry, "kept", False): plan, dtensor,
    # checkpoint, matrix, the routes): Flat's mesh geometry and Shard's chunk lengths lack it.
    kept = True

    def __init__(self, mesh: Any, bucket: Bucket, axes: tuple[str, ...]):
        self.bucket, self.batch = bucket, mesh.batch_shape
        (d,) = [mesh.axis_names.index(a) for a in bucket.spec.keep_axes if mesh.moves(a)]
        owners = keep_owners(bucket, mesh)
        self.at: dict[Rank, list[tuple[int, int, int, int]]] = {}
        self.chunk: dict[Rank, list[int]] = {}
        self.pieces: dict[Rank, list[tuple[int, int, int]]] = {}
        for r in np.ndindex(*mesh.sizes):
            start, length = chunk_of(mesh, bucket, axes=axes, rank=r)
            at, chunk, pieces, position = [], [], [], 0
            for j, s in enumerate(bucket.slots):
                lo, hi = piece_of(s, start, length)
                if lo == hi:
                    continue
                pieces.append((s.offset + lo - start, hi - lo, owners[j][d]))
                if owners[j][d] == r[d]:
                    at.append((j, lo, hi, position))
                    chunk.append(s.offset + lo - start)
                    position += hi - lo
            self.at[r], self.chunk[r], self.pieces[r] = at, chunk, pieces
        self.items = local_items(mesh, self.at)
        # the longest of the ranks held: a rank of a DistMesh holds its own pieces only
        self.length = max((sum(hi - lo for _, lo, hi, _ in a) for _, a in self.items), default=0)
        longest = [0] * len(bucket.slots)
        for _, at in self.items:
            for j, lo, hi, _ in at:
                longest[j] = max(longest[j], hi - lo)
        self.shapes = tuple((*self.batch, n) for n in longest)
        self.views = self.batch == ()  # one rank: its pieces are views of the buffer

    def pack(self, values: Sequence[torch.Tensor], *, dtype: torch.dtype) -> torch.Tensor:
        """A new ``(*batch, length)`` buffer of the bucket's leaves' local values (slot
        order)."""
        bucket = self.bucket
        zeros = torch.zeros(self.length, dtype=dtype, device=bucket.device)
        parts = []
        for idx, at in self.items:
            for j, lo, hi, _ in at:
                parts.append(values[j][idx].narrow(-1, 0, hi - lo).to(dtype))
            parts.append(zeros.narrow(0, 0, self.length - sum(hi - lo for _, lo, hi, _ in at)))
        if not parts:
            return zeros.new_zeros((*self.batch, self.length))
        return torch.cat(parts).view(*self.batch, self.length)

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's local value out of a buffer (views on a DistMesh)."""
        if self.views:
            out = [buf.narrow(-1, 0, 0)] * len(self.bucket.slots)
            for j, lo, hi, position in self.items[0][1]:
                out[j] = buf.narrow(-1, position, hi - lo)
            return out
        out = [buf.new_zeros(shape) for shape in self.shapes]
        for idx, at in self.items:
            for j, lo, hi, position in at:
                out[j][idx].narrow(-1, 0, hi - lo).copy_(buf[idx].narrow(-1, position, hi - lo))
        return out


class _Sum:
    """A local step after a reduce-scatter-v's all-to-all: each rank's ``n`` equal blocks
    (``own`` elements each) summed (and averaged for ``"avg"``), ``length`` long. A 16-bit
    buffer is summed and averaged in float32, then rounded once: no float16 overflow in
    the sum (as the fp16 pre- and post-divides spare the other reductions)."""

    def __init__(self, mesh: Any, own: dict[Rank, int], *, n: int, length: int, op: str):
        self.batch, self.n, self.length, self.op = mesh.batch_shape, n, length, op
        self.items = local_items(mesh, own)

    def __call__(self, _b: int, buf: torch.Tensor) -> torch.Tensor:
        out = buf.new_zeros((*self.batch, self.length))
        wide = torch.float32 if buf.element_size() < 4 else buf.dtype
        for idx, own in self.items:
            if not own:
                continue
            blocks = buf[idx].narrow(-1, 0, self.n * own).view(self.n, own)
            dst = out[idx].narrow(-1, 0, own)
            if wide == buf.dtype:
                torch.sum(blocks, 0, out=dst)
                total = dst
            else:
                total = torch.sum(blocks, 0, dtype=wide)
            if self.op == "avg":
                total.div_(self.n)
            if total is not dst:
                dst.copy_(total)
        return out


def keep_items(step: Step, *, mesh: Any, kept: KeptPieces, length: int) -> list:
    """A bucket's items for a move along its spec's keep axis (one that moves), between the
    spec's own chunk (its gradient and parameter placement's, ``length`` long) and the kept
    pieces (``kept``, its optimizer placement's geometry): ``step.op`` is

    * ``"reduce_scatter_v"`` (Partial -> Owner): each rank sends each member the pieces of
      its chunk that member's coordinate owns (one all-to-all, uneven blocks, the data
      only), and sums the blocks it gets: its kept pieces;
    * ``"all_gather_v"`` (Owner -> Replicate): each rank sends its kept pieces to every
      member (one all-to-all), and every piece of the chunk is taken from its owner's block;
    * ``"select"`` (Replicate -> Owner): the rank's kept pieces of its chunk.

    Where every rank keeps as much (equal matrices, say), the blocks are even: the mesh's
    own reduce-scatter and all-gather carry them, the same bytes. The choice, as every
    count here, comes from the whole mesh's layout: the same on every rank.
    """
    a, n = step.axis, step.size
    ranks, pieces = list(np.ndindex(*mesh.sizes)), kept.pieces
    own = {r: sum(hi - lo for _, lo, hi, _ in kept.at[r]) for r in ranks}
    mine = {
        r: [(p, hi - lo) for p, (_, lo, hi, _) in zip(kept.chunk[r], kept.at[r])] for r in ranks
    }
    if step.op == "select":
        return [Rearrange(mesh, mine, kept.length, source=length)]
    counts = np.zeros((*mesh.sizes, n), dtype=np.int64)
    for r in ranks:
        for _, m, c in pieces[r]:
            counts[r][c] += m
    even = len(set(own.values())) == 1  # every rank keeps as much
    if step.op == "reduce_scatter_v":
        send = {r: [(p, m) for c in range(n) for p, m, o in pieces[r] if o == c] for r in ranks}
        pre = Rearrange(mesh, send, int(counts.sum(-1).max(initial=0)), source=length)
        if even:
            return [pre, Step(op="reduce_scatter", axis=a, reduce=step.reduce, size=n)]
        return [
            pre,
            exchange(mesh, a, counts=counts, length=n * kept.length),
            _Sum(mesh, own, n=n, length=kept.length, op=step.reduce),
        ]
    if step.op == "all_gather_v":
        return _all_gather_v(
            mesh, step, kept=kept, pieces=pieces, own=own, counts=counts, length=length
        )
    raise ValueError(f"keep_items: unknown move {step.op!r}")


def _all_gather_v(
    mesh: Any, step: Step, *, kept: KeptPieces, pieces: dict, own: dict, counts, length: int
) -> list:
    """:func:`keep_items`' all-gather-v: each rank's kept pieces to every member of its group
    along the keep axis, back into its chunk, ``length`` long (``pieces``:
    :attr:`KeptPieces.pieces`)."""
    ranks, n, a = list(own), step.size, step.axis
    runs = {r: _from_blocks(pieces[r], n) for r in ranks}
    if len(set(own.values())) == 1:  # even blocks: the mesh's own all-gather
        blocks = n * kept.length
        return [
            Step(op="all_gather", axis=a, reduce=None, size=n),
            Rearrange(mesh, runs, length, source=blocks),
        ]
    gather = np.zeros_like(counts)
    for r in ranks:
        gather[r][:] = own[r]
    total = max((int(counts[r].sum()) for r in ranks), default=0)
    return [
        Rearrange(
            mesh,
            {r: [(0, own[r])] * n for r in ranks},
            n * max(own.values(), default=0),  # as long on every rank: one logged length
            source=kept.length,
        ),
        exchange(mesh, a, counts=gather, length=total),
        Rearrange(mesh, runs, length, source=total),
    ]


def _from_blocks(pieces: list[tuple[int, int, int]], n: int) -> list[tuple[int, int]]:
    """Runs of a chunk from an all-gather-v's blocks (block c: the pieces member c keeps, in
    position order), ``pieces`` as :attr:`KeptPieces.pieces` gives them."""
    base, at = 0, {}
    for c in range(n):
        for p, m, o in pieces:
            if o == c:
                at[p], base = base, base + m
    return _spans([(at[p], m, True, p) for p, m, _ in pieces])


def _spans(parts: list[tuple]) -> list[tuple[int, int]]:
    """Runs of a chunk from pieces ``(source, length, kept, position)`` in position order
    (``position`` defaults to ``source``): zeros before each piece and for pieces not kept."""
    runs, end = [], 0
    for part in parts:
        src, m, kept = part[:3]
        p = part[3] if len(part) > 3 else src
        runs += [(-1, p - end), (src if kept else -1, m)]
        end = p + m
    return runs
