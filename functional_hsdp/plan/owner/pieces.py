"""What the owner moves are made of: program items and chunk arithmetic.

They are shared by the all-to-all routes (:mod:`.routes`) and the keep axis's moves
(:mod:`.keep`). :class:`Exchange` is an all-to-all step with uneven blocks (:func:`exchange`
makes it from the counts), :class:`Rearrange` a local step that builds each rank's new buffer
from runs of its old one; :func:`chunk_of` and :func:`piece_of` say which elements of a Flat
bucket a rank's chunk holds, and :func:`local_items` which ranks this process holds (its own
on a DistMesh, every one on a SimMesh). None keeps state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...spec.placement import Step
from ..buckets import Bucket, Slot

__all__ = [
    "Exchange",
    "Rank",
    "Rearrange",
    "Seg",
    "chunk_of",
    "exchange",
    "local_items",
    "piece_of",
]

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
