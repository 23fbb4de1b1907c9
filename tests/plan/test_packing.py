"""Packing with alignment gaps: ``pack_full`` against a buffer filled leaf by leaf.

``pack_full`` reads one leaf's dtype, not every leaf's, and lets ``torch.cat`` promote the
rest; these cases pin that it still casts every leaf to the wire dtype, with the leaves of a
bucket in one dtype, cast on the way (bf16 <-> fp32), or mixed (a bucket grouped by another
``kind``): the first leaf in the wire dtype and a later one wider (the result is redone by
the casting path) or narrower. ``Gaps`` interleaves in one pick what a loop would, and
``Carve`` cuts the leaves' views (no view of a gap) with the sizes, strides and offsets of the
views that ``unpack_full``'s split gives.
"""

from __future__ import annotations

import pytest
import torch

import functional_hsdp as fh
from functional_hsdp.plan.buckets import (
    Carve,
    Gaps,
    build_buckets,
    interleave,
    pack_full,
    unpack_full,
)

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
# odd sizes (gaps after most leaves), 1-D only (flat) or of several dims
SHAPES = {
    "flat": [(7,), (16,), (5,), (33,), (1,)],
    "dims": [(7, 3), (16,), (), (3, 5, 7), (2, 2)],
}


def _bucket(shapes, dtypes):
    mesh = fh.SimMesh({"dp_outer": 1, "dp_inner": 1})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    n = len(shapes)
    buckets, _ = build_buckets(
        tuple(f"p{i}" for i in range(n)),
        shapes=tuple(shapes),
        dtypes=tuple(dtypes),
        devices=(torch.device("cpu"),) * n,
        specs=(spec,) * n,
        units=(0,) * n,
        kinds=("one",) * n,  # one bucket, whatever the dtypes
    )
    (bucket,) = buckets
    return bucket


def _expected(bucket, leaves, batch, dtype):
    out = torch.zeros((*batch, bucket.padded), dtype=dtype)
    for s in bucket.slots:
        x = leaves[s.index].reshape(*batch, -1).to(dtype)
        out[..., s.offset : s.offset + s.numel] = x
    return out


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("batch", [(), (2, 3)])
@pytest.mark.parametrize(
    "dtypes,wire",
    [
        ((F32,) * 5, None),  # the bucket's own dtype
        ((F32,) * 5, BF16),  # cast for the wire
        ((BF16,) * 5, F32),
        ((F32, BF16, F32, F32, BF16), None),  # first leaf in the wire dtype, a later narrower
        ((F32, F64, F32, BF16, F32), None),  # ... a later one wider: promoted, then redone
        ((BF16, F32, BF16, BF16, F32), F32),  # first leaf not in the wire dtype
    ],
)
def test_pack_full_casts_every_leaf_to_the_wire_dtype(kind, batch, dtypes, wire):
    shapes = SHAPES[kind]
    bucket = _bucket(shapes, dtypes)
    assert bucket.widest  # the layout has gaps
    gen = torch.Generator().manual_seed(0)
    leaves = [
        torch.randn((*batch, *shape), generator=gen, dtype=F64).to(dt)
        for shape, dt in zip(shapes, dtypes)
    ]
    dtype = wire or bucket.dtype
    buf = pack_full(bucket, leaves, batch, dtype=wire)
    assert buf.dtype == dtype and buf.shape == (*batch, bucket.padded)
    assert torch.equal(buf, _expected(bucket, leaves, batch, dtype))
    for x, y in zip(unpack_full(bucket, buf, batch), leaves):
        assert x.shape == y.shape and torch.equal(x, y.to(dtype))
        assert x._base is buf or x._base is buf._base  # views of the buffer


@pytest.mark.parametrize(
    "after", [(), (None,), (3,), (None, 2, None, 2, 5), (1, None, 15, 1, None), (0, 4, None)]
)
def test_gaps_interleave_as_a_loop_would(after):
    parts = [torch.full((2, k + 1), float(k)) for k in range(len(after))]
    zeros = torch.zeros(2, 15)
    expected = []
    for x, g in zip(parts, after):
        expected.append(x)
        if g is not None:
            expected.append(zeros[:, :g])
    got = list(interleave(parts, Gaps(after), zeros))
    assert len(got) == len(expected)
    for x, y in zip(got, expected):
        assert x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("batch", [(), (2, 3)])
@pytest.mark.parametrize("layers", [1, 3])
def test_carve_cuts_the_views_split_gives(batch, layers):
    # repeated layers: runs of evenly spaced leaves of one shape; odd sizes: gaps
    shapes = [(7, 3), (16,), (), (5,), (3, 5, 7)] * layers + [(5,), (2, 2)]
    bucket = _bucket(shapes, (F32,) * len(shapes))
    assert bucket.inner
    buf = torch.randn((*batch, bucket.padded))
    carve = Carve(buf.shape, lambda b: unpack_full(bucket, b, batch))
    got, expected = carve(buf), unpack_full(bucket, buf, batch)
    assert len(got) == len(expected)
    for x, y in zip(got, expected):
        assert x.shape == y.shape and x.stride() == y.stride()
        assert x.data_ptr() == y.data_ptr() and x._base is buf
    # where the places may not apply, the caller splits
    assert carve(buf.clone().requires_grad_()) is None
    assert carve(torch.randn((*batch, bucket.padded + 1)).narrow(-1, 1, bucket.padded)) is None
    assert carve(torch.randn((*batch, bucket.padded + 1))) is None
