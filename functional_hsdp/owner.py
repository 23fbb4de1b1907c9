"""The owner placement: each leaf whole on one rank, and the moves to and from it.

A tree reaches the owner placement in one of two ways:

* **An Owner spec** (:func:`owned`; optimizer placement ``Owner`` on every data-parallel
  axis) lays its buckets out *owner-major* (:func:`owner_bucket`): a bucket's leaves are
  assigned to the ranks balanced by size (:func:`balance`: largest first, each to the least
  loaded, then evened by moves and swaps), and rank k's chunk of the bucket (k in the spec's
  split order, as a Flat chunk) holds the whole leaves it owns, padded to the largest chunk.
  A bucket is then n chunks of its heaviest owner's leaves: at least n times its largest
  leaf, whatever the assignment. A Llama decoder layer of width d (MLP 4d, half as many
  key-value heads as query heads) holds three 4d^2 MLP matrices and 3d^2 besides: on 4
  owners it pads to 16d^2 for its 15d^2 (four layers in one unit balance exactly). Its Flat
  chunks on those axes are then the owners' leaves, so the spec moves as a Flat one:
  Partial -> Owner is a reduce-scatter (in HSDP, the last microbatch's over the outer axis,
  instead of an all-reduce), Owner -> Replicate an all-gather (``sync_params``, ``gather``),
  Flat -> Owner nothing at all.
* **Any other spec** keeps its own layout; :func:`route` plans, once per tree and set of
  leaves, each bucket's moves from the optimizer placement to the owners and back. There:
  a local selection for each Replicate axis (a rank keeps the pieces whose owner shares its
  coordinate on it) and one all-to-all per Flat or Shard(d) axis (each piece to its
  owner's coordinate on that axis); then each owner's pieces are joined into whole leaves.
  Back: the reverse all-to-alls, and one all-gather per Replicate axis. Blocks are uneven
  (nothing padded on the wire); a rank's buffer is as long as the longest of the mesh, so
  that both meshes log the same events. A ``Shard(d)`` bucket is routed the same way from
  each rank's data (:class:`Compact`): leaf j's chunk c, its ``torch.chunk`` along d, is
  the elements ``[c S P Q, (c S + n_c) P Q)`` of the leaf in *chunk order* (the chunks'
  data end to end, each row-major; S the chunk length, n_c this chunk's, P and Q the sizes
  of the dims before and after d), so the planner moves ranges as for Flat; the owner
  joins the chunks along d into the whole leaf (for d = 0 chunk order is the leaf's own: a
  view), and splits the result back. Empty chunks send nothing; padding to S never travels.

* **An Owner spec on some data-parallel axes only** (``owned(spec, axes)``: HSDP's outer
  axis, where the parameter is Replicate) keeps the spec's own layout and chunks; along
  those *keep axes* (one of size > 1) each rank keeps only the pieces of its chunk whose
  leaf's owner (balanced per bucket over every data-parallel axis that moves:
  :func:`keep_owners`) has its coordinate there (:class:`Kept`, the optimizer
  placement's geometry). Partial -> Owner is a reduce-scatter-v and Owner -> Replicate an
  all-gather-v, each one all-to-all of the data with uneven blocks (:func:`keep_items`);
  :func:`route` moves the kept pieces over the other axes to the owner and back, and
  leaves the results with the keep axis's owners (no all-gather there).

Owners are ranks of the data-parallel axes that move (size > 1); a leaf's owner coordinate
on every other axis is the rank's own (other axes hold other values: each does its own).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cache import Bounded
from .layout import Bucket, Slot, align
from .placement import Owner
from .plan import Plan, Step
from .spec import Spec

__all__ = [
    "BucketRoute",
    "Compact",
    "Exchange",
    "Rearrange",
    "balance",
    "chunk_of",
    "chunk_rows",
    "exchange",
    "Kept",
    "keep_items",
    "keep_owners",
    "local_items",
    "owned",
    "owner_bucket",
    "owner_of_slot",
    "piece_of",
    "route",
]


def balance(sizes: Sequence[int], n: int) -> list[int]:
    """Each item's owner among ``n``, the loads as even as a greedy start and local steps
    make them: largest first, each to the least loaded (ties: the lowest index); then, while
    the heaviest owner is more than 1/256 above the bound no assignment beats (the largest
    item, and the total over ``n`` rounded up), the step that evens it and one of the 8 least
    loaded owners the most: one of its items moved there, or swapped for a smaller one (at
    most as many steps as items and owners: milliseconds for thousands of leaves). Every step
    lowers the heaviest load or the number of owners at it and raises no load above it, so
    every load stays within the largest item of every other.

    Example:
        >>> from functional_hsdp.owner import balance
        >>> balance([4, 1, 3, 2], 2)
        [0, 0, 1, 1]
        >>> balance([3, 3, 2, 2, 2], 2)  # largest first alone: loads 7 and 5
        [1, 1, 0, 0, 0]
    """
    heap = [(0, k) for k in range(n)]
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, k = heapq.heappop(heap)
        owner[i] = k
        heapq.heappush(heap, (load + sizes[i], k))
    if n > 1 and sizes:
        _even(sizes, owner, n)
    return owner


def _even(sizes: Sequence[int], owner: list[int], n: int) -> None:
    """:func:`balance`'s local steps, in place on ``owner``."""
    bound = max(max(sizes), -(-sum(sizes) // n))
    held: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per owner (size, item), sorted
    for i in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):
        held[owner[i]].append((sizes[i], i))
    loads = [sum(s for s, _ in h) for h in held]
    # within 1/256 of the bound is even enough; at most as many steps as items and owners
    enough = bound + bound // 256
    for _ in range(len(sizes) + n):
        h = max(range(n), key=lambda k: (loads[k], -k))
        lightest = heapq.nsmallest(_PARTNERS, range(n), key=lambda k: (loads[k], k))
        step = _best_step(held, loads, h, partners=lightest) if loads[h] > enough else None
        if step is None:
            return
        k, a, b = step
        for src, dst, item in ((h, k, a), (k, h, b)):
            if item is not None:
                held[src].remove(item)
                bisect.insort(held[dst], item)
                loads[src], loads[dst] = loads[src] - item[0], loads[dst] + item[0]
                owner[item[1]] = dst


_PARTNERS = 8  # the least loaded owners a step may pair with the heaviest


def _best_step(held: list, loads: list[int], h: int, *, partners: list[int]) -> tuple | None:
    """``(k, a, b)``: owner h's item a to owner k (one of ``partners``), and k's item b (None:
    none) to h, the pair's heavier load after it the lowest over every such k, a and b that
    lower h's load by less than its gap to k's; None if there is none."""
    best, found = loads[h], None
    for k in partners:
        gap = loads[h] - loads[k]
        if k == h or gap < 2:
            continue
        sizes_k = [s for s, _ in held[k]]
        for a in held[h]:
            # the transfer d = a - b is best at gap / 2: b's size nearest a - gap / 2
            at = bisect.bisect_left(sizes_k, a[0] - gap // 2)
            options = [None, *(held[k][j] for j in (at - 1, at) if 0 <= j < len(held[k]))]
            for b in options:
                d = a[0] - (b[0] if b is not None else 0)
                after = max(loads[h] - d, loads[k] + d)
                if 0 < d < gap and after < best:
                    best, found = after, (k, a, b)
    return found


def owner_bucket(run: list[Slot], spec: Spec, *, unit: int, dtype: torch.dtype, device) -> Bucket:
    """A bucket of ``run`` laid out owner-major over ``spec``'s split order.

    Owner k's chunk is ``[k C, (k + 1) C)``, C the largest owner's leaves (each at an aligned
    offset); the bucket is ``n C`` long. Owners are numbered heaviest first, so chunk 0 is
    never empty (a bucket's first leaf is at offset 0). The layout depends on the run's
    leaves alone (their sizes and order), never on where they sit in a larger tree: a unit's
    buckets are the same seen alone (as a gathered unit looks them up) or in the whole tree.
    """
    n = math.prod(spec.mesh.size(a) for a in spec.split_order)
    widths = [align(s.numel) for s in run]
    owner = balance(widths, n)
    loads = [0] * n
    for k, w in zip(owner, widths):
        loads[k] += w
    order = sorted(range(n), key=lambda k: (-loads[k], k))
    label = {k: r for r, k in enumerate(order)}
    chunk, cursor, slots = max(loads), [0] * n, []
    for s, k, w in zip(run, owner, widths):
        r = label[k]
        slots.append(dataclasses.replace(s, offset=r * chunk + cursor[r]))
        cursor[r] += w
    slots.sort(key=lambda s: s.offset)
    numel = sum(s.numel for s in run)
    return Bucket(
        spec=spec,
        unit=unit,
        dtype=dtype,
        device=device,
        slots=tuple(slots),
        numel=numel,
        padded=n * chunk,
    )


def owner_of_slot(bucket: Bucket, slot: Slot) -> dict[str, int]:
    """The coordinates (over the spec's split order) of the rank owning ``slot`` in an
    owner-major bucket."""
    mesh, axes = bucket.spec.mesh, bucket.spec.split_order
    k = slot.offset // (bucket.padded // math.prod(mesh.size(a) for a in axes))
    out = {}
    for a in reversed(axes):
        k, out[a] = divmod(k, mesh.size(a))
    return out


def owned(spec: Spec, axes: str | Sequence[str] | None = None) -> Spec:
    """``spec`` with its optimizer placement ``Owner`` on ``axes`` (default: every
    data-parallel axis).

    The spec's parameter and gradient placements stay. Every leaf's final gradient, main
    weight and optimizer state then lives on its owner, one rank of the data-parallel mesh
    (leaves balanced by size), and :func:`~functional_hsdp.per_matrix` runs ``fn`` there.

    * **On every data-parallel axis** (the default) the buckets are laid out owner-major,
      each leaf whole on its owner: for HSDP, the last microbatch reduce-scatters over the
      outer axis (where HSDP all-reduces), ``per_matrix`` runs with no communication, and
      :func:`~functional_hsdp.sync_params` all-gathers the new weights over the outer axis;
      main weights and state are sharded over both axes. The outer axis carries
      AdamW-HSDP's bytes times each bucket's padding to its heaviest owner (n times the
      heaviest owner's leaves, at least n times the bucket's largest leaf).
    * **On some axes only** (HSDP's outer: ``axes="dp_outer"``; there the parameter must be
      Replicate and the gradient Partial or Replicate) the spec keeps its own layout, and
      along that axis each rank keeps only the pieces of its chunk whose leaf its
      coordinate owns (:class:`Kept`; a leaf's local value elsewhere is empty). The last
      microbatch's outer all-reduce becomes a reduce-scatter-v (one all-to-all of the data
      only, each piece to its owner's coordinate, then a sum), ``sync_params`` an
      all-gather-v (one all-to-all): per rank, exactly HSDP's outer bytes on a 2-wide outer
      axis whatever the balance, nothing padded on the wire. ``per_matrix`` moves to each
      leaf's owner (the rank whose chunk holds most of it) only the pieces of leaves that
      straddle chunks (for HSDP at most an all-to-all pair over ``dp_inner``).
      Main weights and state are sharded over both axes, as owner-major's. One such axis of
      size > 1 at most.

    Args:
        spec: a :class:`~functional_hsdp.Spec` without ``Shard(d)``.
        axes: data-parallel axis names (default: all of them).

    Returns:
        A new Spec (equal for equal inputs).

    Example:
        >>> import functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner")).optimizer
        (Owner(), Owner())
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_outer").optimizer
        (Owner(), Flat())
    """
    if not isinstance(spec, Spec):
        raise TypeError(f"owned: expected a Spec; got {type(spec).__name__}")
    if spec.shard is not None:
        raise NotImplementedError("owned: a Shard(d) spec has no owner layout; use Flat()")
    if axes is None:
        chosen = spec.dp_axes
    else:
        chosen = (axes,) if isinstance(axes, str) else tuple(axes)
        wrong = [a for a in chosen if a not in spec.dp_axes]
        if wrong or not chosen:
            raise ValueError(
                f"owned: axes must be data-parallel axes of the spec {spec.dp_axes}; got {axes!r}"
            )
    names = spec.mesh.axis_names
    optimizer = [Owner() if a in chosen else x for a, x in zip(names, spec.optimizer)]
    return Spec(
        spec.mesh,
        parameter=spec.parameter,
        gradient=spec.gradient,
        optimizer=optimizer,
        dp_axes=spec.dp_axes,
        reduce_op=spec.reduce_op,
        bucket_cap_mb=spec.bucket_cap_mb,
        replica_axes=spec.replica_axes,
    )


# -- routing a bucket of another layout -------------------------------------------------------

Rank = tuple  # a rank's coordinates over every mesh axis
Seg = tuple  # (slot position j in the bucket, lo, hi): elements [lo, hi) of that leaf


@dataclass(frozen=True, eq=False)
class Exchange(Step):
    """An all-to-all step: ``counts`` (the int64 array ``(*sizes, n)`` the plan builds from)
    and, as ``Mesh.all_to_all`` takes them, ``rows`` (``counts`` as Python ints: rank
    coordinates -> the elements it sends to each member; a traced program reads it) and
    ``length``; ``sent``: the elements each rank this process holds sends to the others, in
    rank order (one on a DistMesh)."""

    counts: Any = None
    rows: Any = None
    length: int = 0
    sent: tuple[int, ...] = ()


def exchange(mesh: Any, axis: str, *, counts: np.ndarray, length: int) -> Exchange:
    """An :class:`Exchange` over ``axis`` of ``counts`` (per rank, elements to each member)."""
    d = mesh.axis_names.index(axis)
    own = {r: int(counts[r].sum() - counts[r][r[d]]) for r in np.ndindex(*mesh.sizes)}
    sent = tuple(n for _, n in local_items(mesh, own))
    return Exchange(
        op="all_to_all",
        axis=axis,
        reduce=None,
        size=mesh.size(axis),
        counts=counts,
        rows={r: tuple(int(x) for x in counts[r]) for r in np.ndindex(*mesh.sizes)},
        length=length,
        sent=sent,
    )


def local_items(mesh: Any, per_rank: dict) -> list[tuple[tuple, Any]]:
    """``(index of the rank's value in a local tensor, its entry of per_rank)`` for every rank
    this process holds: its own on a DistMesh (index ``()``), every one on a SimMesh."""
    coords = [np.asarray(mesh.coordinate(a)) for a in mesh.axis_names]
    return [
        (idx, per_rank[tuple(int(c[idx]) for c in coords)]) for idx in np.ndindex(*mesh.batch_shape)
    ]


def _merged(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Runs ``(source, length)`` (source -1: zeros) with neighbours joined."""
    out: list[list[int]] = []
    for src, n in runs:
        if n == 0:
            continue
        if out and (
            (src < 0 and out[-1][0] < 0) or (src >= 0 and out[-1][0] >= 0 and src == sum(out[-1]))
        ):
            out[-1][1] += n
        else:
            out.append([src, n])
    return tuple((s, n) for s, n in out)


class Rearrange:
    """A local step ``(bucket, buf) -> buf``: every rank's new buffer made of runs of its
    old one (``source`` long) and zeros, ``length`` long; one ``torch.cat`` for all the ranks
    held. ``identity``: it would return its input as it is (then it is left out)."""

    def __init__(self, mesh: Any, runs: dict[Rank, list], length: int, *, source: int):
        self.batch, self.length = mesh.batch_shape, length
        self.items = [(i, _merged(r)) for i, r in local_items(mesh, runs)]
        tails = [length - sum(n for _, n in r) for _, r in self.items]
        fills = [n for _, r in self.items for s, n in r if s < 0]
        self.zeros = max([*tails, *fills, 0])
        whole = all(r in ((), ((0, length),)) for _, r in self.items) and not any(tails)
        self.identity = whole and source == length

    def __call__(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        zeros = buf.new_zeros(self.zeros)
        parts = []
        for idx, runs in self.items:
            row, got = buf[idx], 0
            for src, n in runs:
                parts.append(row.narrow(-1, src, n) if src >= 0 else zeros.narrow(0, 0, n))
                got += n
            if got < self.length:
                parts.append(zeros.narrow(0, 0, self.length - got))
        if not parts:
            return buf.new_zeros((*self.batch, self.length))
        return torch.cat(parts).view(*self.batch, self.length)


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
    chunk is elements ``[lo, hi)`` of the leaf in chunk order (see the module docstring)."""

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
    """Builds a :class:`BucketRoute` for bucket ``b`` of ``plan``; ``owner[j]``: the owner
    coordinates of slot j (-1 on axes where every rank is its own), None if not routed."""

    def __init__(self, plan: Plan, b: int, owner: list):
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


def chunk_of(mesh: Any, bucket: Bucket, *, axes: Sequence[str], rank: Rank) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s chunk of a Flat bucket split over ``axes`` (in
    split order)."""
    start, stride = 0, bucket.padded
    for a in axes:
        stride //= mesh.size(a)
        start += rank[mesh.axis_names.index(a)] * stride
    return start, stride


def piece_of(slot: Slot, start: int, length: int) -> tuple[int, int]:
    """``(lo, hi)``: the elements of ``slot``'s leaf in the bucket range ``[start, start +
    length)`` (``lo == hi``: none)."""
    lo = min(max(start - slot.offset, 0), slot.numel)
    return lo, max(lo, min(max(start + length - slot.offset, 0), slot.numel))


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


def route(plan: Plan, routed: tuple[bool, ...]) -> list[BucketRoute | None]:
    """Every bucket's :class:`BucketRoute` for the leaves ``routed`` (by tree index), built
    once. Owners are balanced over the whole tree (largest leaf first, each to the least
    loaded rank, then evened: :func:`balance`), among the data-parallel axes that move of each
    spec."""
    key = (plan, routed)
    known = _ROUTES.get(key)
    if known is None:
        known = _ROUTES[key] = _build(plan, routed)
    return known


def _build(plan: Plan, routed: tuple[bool, ...]) -> list[BucketRoute | None]:
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


# -- Owner on some data-parallel axes only: the spec's own layout, values kept by owners ------


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


class Kept:
    """A keep spec's bucket at its optimizer placement (the ``geometry`` of its
    :class:`~functional_hsdp.plan.Placed`): each rank's *kept* pieces of its chunk (of the
    leaves whose owner has its coordinate on the keep axis), end to end, the data only, then
    zeros up to ``length`` (the longest of the ranks this process holds: a rank of a DistMesh
    holds its own). A leaf's local value is its piece where the
    rank keeps it, else empty (on a SimMesh: stacked, zero fill at the end, as Flat's).

    ``at[r]``: per piece rank r keeps, ``(slot position, lo, hi, position)``: elements
    ``[lo, hi)`` of the leaf at ``position`` of the buffer; ``chunk[r]``: the same pieces'
    positions in r's chunk; ``pieces[r]``: every leaf's piece of r's chunk, kept or not,
    ``(position in the chunk, length, its owner's coordinate on the keep axis)``.
    """

    kept = True  # what Plan looks for (it does not import this module)

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


def keep_items(plan: Plan, b: int, step: Step) -> list:
    """Bucket ``b``'s items for a move along its spec's keep axis (one that moves), between
    the spec's own chunk (its gradient and parameter placement's) and the kept pieces
    (:class:`Kept`, its optimizer placement's): ``step.op`` is

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
    mesh = plan.mesh
    kept: Kept = plan.placed[b]["optimizer"].geometry
    length, a, n = plan.placed[b]["gradient"].length, step.axis, step.size
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
    mesh: Any, step: Step, *, kept: Kept, pieces: dict, own: dict, counts, length: int
) -> list:
    """:func:`keep_items`' all-gather-v: each rank's kept pieces to every member of its group
    along the keep axis, back into its chunk, ``length`` long (``pieces``:
    :attr:`Kept.pieces`)."""
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
    position order), ``pieces`` as :attr:`Kept.pieces` gives them."""
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
