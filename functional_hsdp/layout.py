"""Buckets: which leaves share a flat buffer, where each leaf lives in it, and packing.

Layout (where bytes live) is separate from the buffers that hold them (made per call) and from
the mesh that reduces them. A bucket holds leaves of one spec, dtype and device, in tree order,
up to the spec's size cap; its length is padded at the tail to a multiple of the product of its
Flat axes' sizes, so every Flat chunk is the same size and padding never falls inside a leaf.
Zero-size leaves take no bucket: they never need communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch

from .placement import Flat
from .spec import Spec

__all__ = ["Slot", "Bucket", "build_buckets", "pack_full", "unpack_full"]


@dataclass(frozen=True)
class Slot:
    """One leaf's place: its index in the flattened tree, path, per-rank shape and range."""

    index: int
    path: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """Leaves packed into one flat buffer of ``padded`` elements per rank."""

    spec: Spec
    dtype: torch.dtype
    device: torch.device
    slots: tuple[Slot, ...]
    numel: int
    padded: int

    def flat_axes(self, placements) -> tuple[str, ...]:
        """The Flat axes of ``placements``: a prefix of the spec's split order."""
        names = self.spec.mesh.axis_names
        n = sum(1 for a in self.spec.split_order if isinstance(placements[names.index(a)], Flat))
        return self.spec.split_order[:n]


def bucket_elements(spec: Spec) -> int:
    """The cap in elements: bucket_cap_mb counted as 4-byte words, whatever the dtype."""
    return max(1, int(spec.bucket_cap_mb * 2**20) // 4)


def build_buckets(
    paths: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    devices: tuple[torch.device, ...],
    specs: tuple[Spec, ...],
    kinds: tuple | None = None,
) -> tuple[tuple[Bucket, ...], tuple[Slot, ...]]:
    """Group leaves into buckets; returns (buckets, zero-size slots).

    Leaves share a bucket when they share a spec, device and *kind*: by default their dtype.
    A persistent buffer of another dtype (fp32 main grads for bf16 parameters) passes the
    parameters' dtypes as ``kinds`` to get the parameters' layout.
    """
    kinds = dtypes if kinds is None else kinds
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(specs, kinds, devices)):
        groups.setdefault(key, []).append(i)
    buckets: list[Bucket] = []
    empty: list[Slot] = []
    for (spec, _, device), members in groups.items():
        dtype = dtypes[members[0]]
        cap = bucket_elements(spec)
        multiple = math.prod(spec.mesh.size(a) for a in spec.split_order)
        runs: list[list[Slot]] = [[]]
        offset = 0
        for i in members:
            numel = math.prod(shapes[i])
            if numel == 0:
                empty.append(Slot(i, paths[i], shapes[i], 0, 0))
                continue
            if runs[-1] and offset + numel > cap:
                runs.append([])
                offset = 0
            runs[-1].append(Slot(i, paths[i], shapes[i], offset, numel))
            offset += numel
        for run in filter(None, runs):
            total = run[-1].offset + run[-1].numel
            padded = -(-total // multiple) * multiple
            buckets.append(Bucket(spec, dtype, device, tuple(run), total, padded))
    return tuple(buckets), tuple(empty)


def _pattern(batch_ndim: int) -> str:
    return " ".join(f"m{k}" for k in range(batch_ndim)) + " *"


def pack_full(bucket: Bucket, leaves: list[torch.Tensor], batch: tuple[int, ...]) -> torch.Tensor:
    """Concatenate full-shape leaves (and the tail padding) into one new ``(*batch, padded)``."""
    parts = [leaves[s.index].detach() for s in bucket.slots]
    if bucket.padded > bucket.numel:
        parts.append(
            torch.zeros(
                (*batch, bucket.padded - bucket.numel), dtype=bucket.dtype, device=bucket.device
            )
        )
    packed, _ = einops.pack(parts, _pattern(len(batch)))
    return packed


def unpack_full(bucket: Bucket, buf: torch.Tensor, batch: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of each leaf, full shape, in a packed ``(*batch, padded)`` buffer."""
    return einops.unpack(
        buf[..., : bucket.numel], [s.shape for s in bucket.slots], _pattern(len(batch))
    )
