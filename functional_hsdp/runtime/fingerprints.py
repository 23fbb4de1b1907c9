"""What one rank says of its call: the fingerprint its agreement compares, and the NaN scan.

A call describes itself as a header (operation, ``last``, options, mesh, data-parallel axes,
tree structure) and one line per leaf (path, shape, dtype, device type, spec, bucket slot),
hashed into the integers of its row (:mod:`~functional_hsdp.runtime.agreement`). Invariant:
a digest depends only on these texts, never on the process (62-bit blake2b, not ``hash``),
so equal calls on any two ranks give equal rows; a plan's fingerprint is computed once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ABSENT",
    "CALL_FIELDS",
    "HEADER",
    "LEAF_FIELDS",
    "MASK",
    "Fingerprint",
    "digest",
    "fingerprint",
    "nonfinite_index",
]

MASK = (1 << 62) - 1
ABSENT = -1  # the per-leaf digest of a leaf a rank does not have (digests are >= 0)
HEADER = ("call", "last", "options", "mesh", "dp axes", "tree")
CALL_FIELDS = 5  # the header fields every rank of the mesh must agree on (all but "tree")
LEAF_FIELDS = ("path", "shape", "dtype", "device", "spec", "bucket slot")


def digest(text: str) -> int:
    """A 62-bit blake2b digest of ``text``: the same in every process (``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MASK


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to do: header texts, per-leaf texts and their digests."""

    header: tuple[str, ...]  # one text per HEADER field
    leaves: tuple[tuple[str, ...], ...]  # one tuple of LEAF_FIELDS texts per leaf
    whole: int

    def row(self) -> list[int]:
        """Its part of the per-call row: the digests of the call (every header field but
        the tree), of the whole, the leaf count and each header field (hashed once)."""
        row = self.__dict__.get("_row")
        if row is None:
            call = digest("\x1e".join(self.header[:CALL_FIELDS]))
            row = [call, self.whole, len(self.leaves), *map(digest, self.header)]
            object.__setattr__(self, "_row", row)
        return row

    def leaf_digests(self, n: int) -> list[int]:
        """Per-leaf digests of what the user passed (path, shape, dtype, device, spec), then
        of the bucket slots, each padded to ``n`` leaves: a leaf whose own description
        differs is reported before one whose slot differs only because of an earlier leaf."""
        pad = [ABSENT] * (n - len(self.leaves))
        own = [digest("\x1f".join(leaf[:-1])) for leaf in self.leaves]
        return own + pad + [digest(leaf[-1]) for leaf in self.leaves] + pad


def _spec_text(spec: Any) -> str:
    return (
        f"{spec!r} dp_axes={spec.dp_axes} reduce_op={spec.reduce_op} "
        f"bucket_cap_mb={spec.bucket_cap_mb}"
    )


def fingerprint(
    plan: Any, op: str, paths: Sequence[str], *, last: Any = None, options: tuple[str, ...] = ()
) -> Fingerprint:
    """Describe a call of ``op`` with ``plan`` (full per-rank shapes, not local pieces)."""
    mesh = plan.mesh
    slot_text = {}
    for b, bucket in enumerate(plan.buckets):
        for s in bucket.slots:
            slot_text[s.index] = f"bucket {b} [{s.offset}:{s.offset + s.numel}] of {bucket.padded}"
    specs = {spec: _spec_text(spec) for spec in set(plan.specs)}
    leaves = tuple(
        (
            path,
            str(tuple(shape)),
            str(dtype),
            device.type,
            specs[spec],
            slot_text.get(i, "none (zero-size)"),
        )
        for i, (path, shape, dtype, device, spec) in enumerate(
            zip(paths, plan.shapes, plan.dtypes, plan.devices, plan.specs)
        )
    )
    header = (
        op,
        f"last={last!r}",
        ", ".join(options) or "none",
        " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.sizes)),
        ", ".join(plan.dp_axes),
        str(plan.treedef),
    )
    whole = digest("\x1e".join(header) + "\x1d" + "\x1e".join("\x1f".join(x) for x in leaves))
    return Fingerprint(header, leaves, whole)


def nonfinite_index(
    leaves: Sequence[torch.Tensor],
    batch_ndim: int,
    packed: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per rank, the index of the first leaf holding NaN or Inf, else -1 (batch shape).

    ``packed``: the leaves' bucket buffers, if at hand: all finite (the usual case) is then
    one check per bucket; leaves are scanned one by one only to find a bad one.
    """
    if packed is not None:
        flags = [torch.isfinite(b).all(-1) for b in packed]
        if not flags or bool(torch.stack(flags).all()):
            return torch.full(packed[0].shape[:-1] if packed else (), -1, dtype=torch.int64)
    flags = [torch.isfinite(x.detach()).reshape(*x.shape[:batch_ndim], -1).all(-1) for x in leaves]
    bad = ~torch.stack(flags).cpu()  # (n_leaves, *batch)
    return torch.where(bad.any(0), bad.to(torch.int8).argmax(0), -1).to(torch.int64)
