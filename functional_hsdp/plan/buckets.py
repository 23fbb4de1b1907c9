"""Buckets: which leaves share a flat buffer, where each leaf lives in it, and packing.

Layout (where bytes live) is separate from the buffers that hold them (made per call) and from
the mesh that reduces them. A bucket holds leaves of one *unit* (a leaf of the spec prefix,
FSDP2's ``fully_shard`` granularity: one spec), dtype and device, in tree order, up to the
spec's size cap, so a unit's buckets never hold another unit's leaves. Invariant: every leaf
starts at a multiple of :data:`ALIGN` elements of its bucket, and padding is zeros between
leaves and at the tail, never inside a leaf, and never read as data (:class:`Bucket` says
where it goes, for Flat and for ``Shard(d)`` buckets).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import einops
import torch

from ..spec.specs import Spec

__all__ = [
    "ALIGN",
    "Bucket",
    "Carve",
    "Gaps",
    "Slot",
    "bucket_elements",
    "align",
    "build_buckets",
    "interleave",
    "pack_full",
    "pack_shard_full",
    "shard_dims",
    "spaced",
    "unpack_full",
    "unpack_shard_full",
]

#: Every leaf's offset in its bucket is a multiple of ALIGN elements: 16 bytes in a 1-byte
#: dtype, so aligned in every dtype. In elements, not bytes, so that a layout does not depend
#: on the dtype, as the bucket cap does not: bf16 parameters, their fp32 main grads and a
#: bucket cast to a ``param_dtype`` or ``reduce_dtype`` for the wire all share one layout.
ALIGN = 16


def align(n: int, multiple: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (an offset or width in a bucket)."""
    return -(-n // multiple) * multiple


def _getter(indices: Sequence[int]) -> Callable[[Sequence], tuple]:
    """Items ``indices`` of a sequence, as a tuple, in one C-level call."""
    pick = operator.itemgetter(*indices)
    return pick if len(indices) > 1 else lambda xs: (pick(xs),)


class Gaps:
    """Where zeros go between a block's parts: ``after[k]`` elements after part k (None:
    none), ``widths`` the distinct ones. Built once per layout, so that a call interleaves
    the parts with one view of a zero tensor per width in one C-level pick (a Python loop
    over the parts costs more than the ``torch.cat`` of them)."""

    def __init__(self, after: Sequence[int | None]):
        self.after = tuple(after)
        self.widths = tuple(sorted({g for g in self.after if g is not None}))
        self.widest = max(self.widths, default=0)
        # positions in (*parts, *one view per width): each part, then its gap's view
        view = {w: len(self.after) + j for j, w in enumerate(self.widths)}
        order = []
        for k, g in enumerate(self.after):
            order.append(k)
            if g is not None:
                order.append(view[g])
        self.order = tuple(order)
        self._pick = _getter(order) if order else tuple


@dataclass(frozen=True)
class Slot:
    """One leaf's place: its index in the flattened tree, path, per-rank shape and range
    (``offset``: a multiple of :data:`ALIGN`).

    For a Shard(d) bucket, ``offset`` is within a rank's block, ``dim`` is d and ``size`` the
    padded chunk length along it.
    """

    index: int
    path: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    dim: int | None = None
    size: int = 0

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """A Shard(d) leaf's padded chunk shape."""
        return tuple(self.size if k == self.dim else n for k, n in enumerate(self.shape))

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk_shape)

    @property
    def width(self) -> int:
        """Elements the leaf takes in its bucket (a Shard(d) leaf: in a rank's block)."""
        return self.numel if self.dim is None else self.chunk_numel


@dataclass(frozen=True)
class Bucket:
    """Leaves packed into one flat buffer of ``padded`` elements per rank: ``numel`` of them
    data, the rest zeros between leaves (for alignment) and at the tail.

    Every leaf starts at a multiple of :data:`ALIGN` elements of its bucket, zeros filling the
    gap after the previous leaf: a gathered leaf (a view of the gathered bucket) is then
    16-byte aligned, as matrix kernels want their operands, in whatever dtype the bucket
    travels in (fp8 up to fp64). A bucket's length is padded at the tail to a multiple of the
    product of its Flat axes' sizes, so every Flat chunk is the same size (chunk boundaries may
    fall inside a leaf). Zero-size leaves take no bucket: they never need communication.

    A bucket of a ``Shard(d)`` spec is laid out rank-major instead (FSDP2's all-gather
    layout): block r holds every leaf's r-th ``torch.chunk`` along ``d``, each padded to the
    first chunk's size and starting at an aligned offset of the block, whose length is a
    multiple of ``ALIGN`` (so block r's leaves are aligned in the gathered bucket too); a
    rank's shards are one contiguous chunk of the bucket and the collectives are the same as
    for Flat. Only packing and unpacking differ.
    """

    spec: Spec
    unit: int
    dtype: torch.dtype
    device: torch.device
    slots: tuple[Slot, ...]
    numel: int
    padded: int
    shard: tuple[str, int] | None = None  # (axis, dim) of a Shard(dim) bucket

    @property
    def ranks(self) -> int:
        """Blocks of a Shard(d) bucket: the size of its axis."""
        return self.spec.mesh.size(self.shard[0]) if self.shard else 1

    def __post_init__(self) -> None:
        # Derived once here, not lazily (a lazily cached attribute would be filled inside a
        # torch.compile trace, which cannot trace cached_property's lock on Python 3.11).
        set_ = object.__setattr__
        set_(self, "flat_shapes", all(len(s.shape) == 1 for s in self.slots))
        indices = tuple(s.index for s in self.slots)
        set_(self, "indices", indices)
        set_(self, "_pick", _getter(indices))  # the bucket's leaves out of a tree's leaf list
        # per slot: the zeros after it up to the next leaf or the end of the block (None: none)
        ends = [s.offset for s in self.slots[1:]] + [self.padded // self.ranks]
        after = tuple(e - s.offset - s.width or None for s, e in zip(self.slots, ends))
        set_(self, "after", after)
        set_(self, "gaps", Gaps(after))
        set_(self, "widest", self.gaps.widest)  # 0: no padding at all
        set_(self, "inner", any(after[:-1]))  # whether padding falls between leaves
        #: the block's consecutive ranges: each leaf, then the zeros after it (if any)
        spans = [w for s, g in zip(self.slots, after) for w in (s.width, g) if w is not None]
        set_(self, "spans", spans)
        at = [0]  # each leaf's position among the spans
        for g in after[:-1]:
            at.append(at[-1] + (2 if g else 1))
        set_(self, "at", tuple(at))
        set_(self, "_pick_spans", _getter(at))
        #: the leaves and the gaps between them, as ``(offset, numel)``: no tail
        inner = [(s.offset, s.width) for s in self.slots]
        inner += [(s.offset + s.width, g) for s, g in zip(self.slots, after[:-1]) if g]
        set_(self, "ranges", sorted(inner))

    def leaves_of(self, pieces: Sequence) -> tuple:
        """The leaves' pieces out of the pieces of every span (or of every range: the same
        positions, the tail being last)."""
        if torch.compiler.is_compiling():  # dynamo cannot trace itemgetter
            return tuple(pieces[k] for k in self.at)
        return self._pick_spans(pieces)

    def take(self, leaves: list) -> tuple:
        """This bucket's leaves out of a tree's leaf list, in slot order."""
        if torch.compiler.is_compiling():  # dynamo cannot trace itemgetter
            return tuple(leaves[i] for i in self.indices)
        return self._pick(leaves)


def bucket_elements(spec: Spec) -> int:
    """The cap in elements: bucket_cap_mb counted as 4-byte words, whatever the dtype."""
    return max(1, int(spec.bucket_cap_mb * 2**20) // 4)


def build_buckets(
    paths: tuple[str, ...],
    *,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    devices: tuple[torch.device, ...],
    specs: tuple[Spec, ...],
    units: tuple[int, ...],
    kinds: tuple | None = None,
    owner_major: Callable[..., Bucket] | None = None,
) -> tuple[tuple[Bucket, ...], tuple[Slot, ...]]:
    """Group leaves into buckets; returns (buckets, zero-size slots).

    Leaves share a bucket when they share a unit, device and *kind*: by default their dtype.
    A persistent buffer of another dtype (fp32 main grads for bf16 parameters) passes the
    parameters' dtypes as ``kinds`` to get the parameters' layout. ``owner_major`` lays out
    an Owner spec's buckets (:func:`functional_hsdp.plan.owner.owner_bucket`, which the plan
    passes: the owner package builds on this module, not this module on it).
    """
    kinds = dtypes if kinds is None else kinds
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(units, kinds, devices)):
        groups.setdefault(key, []).append(i)
    buckets: list[Bucket] = []
    empty: list[Slot] = []
    for (unit, _, device), members in groups.items():
        spec, dtype = specs[members[0]], dtypes[members[0]]
        make = _bucket
        if spec.owner_axes:  # an Owner spec: owner-major buckets
            if owner_major is None:
                raise ValueError(
                    "build_buckets: an Owner spec's buckets are owner-major; pass "
                    "owner_major=functional_hsdp.plan.owner.owner_bucket"
                )
            make = owner_major
        for run in _runs(members, paths, shapes, spec=spec, empty=empty):
            buckets.append(make(run, spec, unit=unit, dtype=dtype, device=device))
    return tuple(buckets), tuple(empty)


def _runs(
    members: list[int],
    paths: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
    *,
    spec: Spec,
    empty: list[Slot],
) -> list[list[Slot]]:
    """A group's leaves in runs of at most the cap (counted in data, not padding; an Owner
    spec's cap is per owner), each leaf at the first aligned offset after the previous one;
    zero-size ones go to ``empty``."""
    cap, shard = bucket_elements(spec), spec.shard
    cap *= math.prod(spec.mesh.size(a) for a in spec.owner_axes)
    runs: list[list[Slot]] = [[]]
    end = total = 0
    for i in members:
        numel = math.prod(shapes[i])
        if numel == 0:
            empty.append(Slot(index=i, path=paths[i], shape=shapes[i], offset=0, numel=0))
            continue
        if runs[-1] and total + numel > cap:
            runs.append([])
            end = total = 0
        slot = Slot(index=i, path=paths[i], shape=shapes[i], offset=align(end), numel=numel)
        if shard is not None:
            slot = _shard_slot(slot, shard, spec.mesh.size(shard[0]))
        runs[-1].append(slot)
        end = slot.offset + slot.width
        total += numel
    return [run for run in runs if run]


def _bucket(run: list[Slot], spec: Spec, *, unit: int, dtype: torch.dtype, device) -> Bucket:
    """A bucket of ``run``, its tail padded so that every Flat chunk is as long (a multiple
    of the product of the Flat axes' sizes), or every Shard(d) block: a multiple of ALIGN,
    so that the leaves of every block of the gathered bucket are aligned."""
    end, shard = run[-1].offset + run[-1].width, spec.shard
    if shard is not None:
        padded = align(end) * spec.mesh.size(shard[0])
    else:
        padded = align(end, math.prod(spec.mesh.size(a) for a in spec.split_order))
    total = sum(s.numel for s in run)
    return Bucket(
        spec=spec,
        unit=unit,
        dtype=dtype,
        device=device,
        slots=tuple(run),
        numel=total,
        padded=padded,
        shard=shard,
    )


def interleave(
    parts: Sequence[torch.Tensor], gaps: Gaps, zeros: torch.Tensor
) -> Sequence[torch.Tensor]:
    """``parts`` with ``gaps.after[k]`` zeros (a view of ``zeros``' last dim) after part k,
    where it is not None: the padding between leaves without a kernel launch per gap."""
    if not gaps.widths:
        return parts
    items = (*parts, *[zeros.narrow(-1, 0, w) for w in gaps.widths])
    if torch.compiler.is_compiling():  # dynamo cannot trace itemgetter
        return [items[k] for k in gaps.order]
    return gaps._pick(items)


def spaced(
    bucket: Bucket, parts: Sequence[torch.Tensor], lead: tuple[int, ...], *, dtype: torch.dtype
) -> Sequence[torch.Tensor]:
    """A block's flat parts (a leaf's, or a Shard(d) leaf's chunks, each ``(*lead, width)``)
    with the bucket's zeros between and after them: they concatenate to the block."""
    if not bucket.widest:  # nothing to insert (the common case: leaves of aligned sizes)
        return parts
    zeros = torch.zeros((*lead, bucket.widest), dtype=dtype, device=bucket.device)
    return interleave(parts, bucket.gaps, zeros)


@torch.no_grad()
def pack_full(
    bucket: Bucket,
    leaves: list[torch.Tensor],
    batch: tuple[int, ...],
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Concatenate full-shape leaves (and the zeros between and after them) into one new
    ``(*batch, padded)`` buffer of ``dtype`` (default: the bucket's).

    One copy of every leaf, into a new buffer (the collectives may reduce it in place). Without
    batch dims (a real rank) two or more parts are flattened and concatenated in one C++ call
    (torch's own ``flatten_dense_tensors``, as DDP's bucketing uses), which spares a
    Python-level reshape per leaf; it returns a view of a single tensor, so one unpadded leaf,
    or batch dims, take one ``torch.cat`` of flattened views. (``einops.pack`` does the same
    but parses its pattern per leaf, which dominates the host time of trees of many small
    leaves.) Leaves of another dtype than ``dtype`` (bf16 gradients reduced in fp32, say) are
    cast by the same one ``torch.cat`` into the buffer. No graph is kept.
    """
    parts = bucket.take(leaves)
    dtype = dtype or bucket.dtype
    # One leaf's dtype read, not every leaf's (which costs about as much as the torch.cat):
    # torch.cat promotes mixed dtypes, so a result in ``dtype`` holds every leaf cast to it,
    # as the casting path below would; another result dtype is redone by that path.
    if parts[0].dtype == dtype:
        out = _concat(bucket, parts, batch, dtype=dtype)
        if out.dtype == dtype:
            return out
    out = torch.empty((*batch, bucket.padded), dtype=dtype, device=bucket.device)
    flat = [x.reshape(*batch, -1) for x in parts]
    torch.cat(spaced(bucket, flat, batch, dtype=dtype), dim=-1, out=out)
    return out


def _concat(
    bucket: Bucket, parts: Sequence[torch.Tensor], batch: tuple[int, ...], *, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`pack_full` of leaves of ``dtype`` (others promote the result's dtype)."""
    if batch and not bucket.flat_shapes:
        parts = [x.reshape(*batch, -1) for x in parts]
    parts = spaced(bucket, parts, batch, dtype=dtype)
    if not batch and len(parts) > 1 and _FLATTEN is not None:
        return _FLATTEN(parts)
    if bucket.flat_shapes or batch:  # every part is (*batch, n) already
        return torch.cat(parts, dim=-1)
    return torch.cat([x.reshape(-1) for x in parts])


# torch's C++ flatten of a tensor list (torch._utils._flatten_dense_tensors calls it); if a
# torch build lacks it, pack_full falls back to torch.cat of reshaped leaves.
_FLATTEN = getattr(getattr(torch._C, "_nn", None), "flatten_dense_tensors", None)


class Carve:
    """The leaves' views of a ``shape`` buffer whose leaves have gaps between them, at the
    sizes, strides and offsets that ``split`` (a buffer -> its leaves' views, through a view
    of every gap) gives them, learned once from a meta tensor. Leaves of one shape at evenly
    spaced offsets (the same leaf of every layer of a model, say) are one ``as_strided`` view
    unbound into them: one C++ loop, about as cheap per leaf as ``split``.

    Why not ``split`` itself: its view of every gap, freed at once among the leaves' views
    (which live on as the result), leaves the heap full of holes, and every tensor made after
    it, in the library or outside, was about twice as slow (``bench host``: a bare
    cat + split of 10,000 leaves, 9 ms before a call, 20 ms after it).
    """

    def __init__(self, shape: tuple[int, ...], split: Callable[[torch.Tensor], Sequence]):
        self.shape, self._split = torch.Size(shape), split
        self._places: tuple | None = None  # learned on the first eager call, not in a trace

    def __call__(self, buf: torch.Tensor) -> list[torch.Tensor] | None:
        """The leaves' views of ``buf``; None where its places may not apply (other strides
        or offset, a buffer autograd tracks, under torch.compile): then ``split`` it."""
        if torch.compiler.is_compiling() or buf.requires_grad or buf.storage_offset():
            return None
        if self._places is None:
            self._places = self._learn()
        stride, runs, order = self._places
        if buf.shape != self.shape or buf.stride() != stride:
            return None
        rows: list[torch.Tensor] = []
        for size, strides, offset in runs:
            rows.extend(buf.as_strided(size, strides, offset).unbind(0))
        return list(order(rows))

    def _learn(self) -> tuple:
        """(the buffer's strides, per run: its 2-d view's size, strides and offset, the pick
        of the leaves out of the runs' rows)."""
        probe = torch.empty(self.shape, device="meta")
        runs: list[list] = []  # [size, strides, first offset, step, leaves]
        last: dict[tuple, list] = {}  # (size, strides) -> its newest run
        for k, v in enumerate(self._split(probe)):
            key, offset = (tuple(v.shape), v.stride()), v.storage_offset()
            run = last.get(key)
            step = offset - run[2] - run[3] * (len(run[4]) - 1) if run else 0
            if run is not None and (len(run[4]) == 1 or step == run[3]):
                run[3] = step if len(run[4]) == 1 else run[3]
                run[4].append(k)
            else:
                last[key] = run = [key[0], key[1], offset, 0, [k]]
                runs.append(run)
        position = [0] * sum(len(run[4]) for run in runs)
        for j, k in enumerate(k for run in runs for k in run[4]):
            position[k] = j
        views = tuple(((len(r[4]), *r[0]), (r[3], *r[1]), r[2]) for r in runs)
        return probe.stride(), views, _getter(position)


def unpack_full(bucket: Bucket, buf: torch.Tensor, batch: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of each leaf, full shape, in a packed ``(*batch, padded)`` buffer."""
    pieces = torch.split(buf, bucket.spans, dim=-1)
    # the leaves' pieces: every other one where padding falls between them, else all but a tail
    pieces = bucket.leaves_of(pieces) if bucket.inner else pieces[: len(bucket.slots)]
    if bucket.flat_shapes:  # every leaf is 1-D: the pieces are the leaves
        return list(pieces)
    # Splitting the contiguous last dim into the leaf's dims is always a view.
    return [p.view((*batch, *s.shape)) for p, s in zip(pieces, bucket.slots)]


def _shard_slot(slot: Slot, shard: tuple[str, int], n: int) -> Slot:
    axis, dim = shard
    ndim = len(slot.shape)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{slot.path}: Shard({dim}) on axis {axis!r} is out of range for a leaf of shape "
            f"{slot.shape}"
        )
    dim %= ndim
    size = -(-slot.shape[dim] // n)  # torch.chunk's chunk length
    return Slot(
        index=slot.index,
        path=slot.path,
        shape=slot.shape,
        offset=slot.offset,
        numel=slot.numel,
        dim=dim,
        size=size,
    )


def shard_dims(slot: Slot) -> tuple[str, str, dict[str, int]]:
    """einops names for a Shard(d) leaf's dims before and after d, and their sizes."""
    shape, dim = slot.shape, slot.dim
    before, after = range(dim), range(len(shape) - dim - 1)
    sizes = {f"a{k}": shape[k] for k in before} | {f"b{k}": shape[dim + 1 + k] for k in after}
    return " ".join(f"a{k}" for k in before), " ".join(f"b{k}" for k in after), sizes


def pack_shard_full(
    bucket: Bucket,
    leaves: list[torch.Tensor],
    batch: tuple[int, ...],
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Full-shape leaves -> a new rank-major ``(*batch, padded)`` Shard(d) bucket of ``dtype``
    (default: the bucket's)."""
    nb, n = len(batch), bucket.ranks
    names = " ".join(f"m{k}" for k in range(nb))
    parts = []
    for s in bucket.slots:
        x = leaves[s.index].detach().to(dtype or bucket.dtype)
        pad = n * s.size - s.shape[s.dim]
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (len(s.shape) - s.dim - 1) + (0, pad))
        pre, post, _ = shard_dims(s)
        parts.append(
            einops.rearrange(x, f"{names} {pre} (n c) {post} -> {names} n ({pre} c {post})", n=n)
        )
    blocks = torch.cat(spaced(bucket, parts, (*batch, n), dtype=dtype or bucket.dtype), dim=-1)
    return einops.rearrange(blocks, f"{names} n p -> {names} (n p)")


def unpack_shard_full(
    bucket: Bucket, buf: torch.Tensor, batch: tuple[int, ...]
) -> list[torch.Tensor]:
    """A rank-major Shard(d) bucket -> each leaf, full shape (new tensors)."""
    nb, n = len(batch), bucket.ranks
    names = " ".join(f"m{k}" for k in range(nb))
    blocks = einops.rearrange(buf, f"{names} (n p) -> {names} n p", n=n)
    out = []
    for s in bucket.slots:
        pre, post, sizes = shard_dims(s)
        x = einops.rearrange(
            blocks.narrow(-1, s.offset, s.chunk_numel),
            f"{names} n ({pre} c {post}) -> {names} {pre} (n c) {post}",
            c=s.size,
            **sizes,
        )
        out.append(x.narrow(nb + s.dim, 0, s.shape[s.dim]))
    return out
