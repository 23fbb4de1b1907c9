"""Shard(d) placements (FSDP2 style) on SimMesh: dense reference, layouts, errors."""

from __future__ import annotations

import re

import optree
import pytest
import torch
from reference import AXES, accumulate, dense_reduce, max_error, random_tree

import functional_hsdp as fh

R, P, F = fh.Replicate(), fh.Partial("avg"), fh.Flat()
SHAPES = {"a": (7, 3), "b": (5, 4), "c": (1, 6), "z": (13, 11), "w": (2, 3, 5)}


def shard_specs(mesh, dim):
    S = fh.Shard(dim)
    return {
        "hsdp": fh.Spec(mesh, [R, S], [P, S], [R, S]),
        "fsdp_inner": fh.Spec(mesh, [R, S], [P, S], [R, S], bucket_cap_mb=30 * 4 / 2**20),
        "zero2": fh.Spec(mesh, [R, R], [P, P], [R, S]),
    }


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (2, 3), (4, 1)], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", ["hsdp", "fsdp_inner", "zero2"])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_shard_dim_matches_dense_reference(shape, dim, name, microbatches):
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    spec = shard_specs(mesh, dim)[name]
    micro = [random_tree(shape, shapes=SHAPES, seed=m) for m in range(microbatches)]
    full = fh.gather(accumulate(micro, spec), spec)
    assert max_error(full, dense_reduce(micro, 2)) < 1e-5


@pytest.mark.parametrize("dim", [0, 1])
def test_local_shards_are_torch_chunks_zero_filled(dim):
    mesh = fh.SimMesh({"dp": 4})
    spec = fh.Spec(mesh, [fh.Shard(dim)], [fh.Shard(dim)], [fh.Shard(dim)])
    full = random_tree((), shapes=SHAPES, seed=1)
    local = fh.shard(full, spec)
    for k, x in full.items():
        chunks = torch.chunk(x, 4, dim=dim)
        size = chunks[0].shape[dim]
        for r in range(4):
            mine = local[k][r]
            assert mine.shape[dim] == size
            want = chunks[r] if r < len(chunks) else x.narrow(dim, 0, 0)
            n = want.shape[dim]
            assert torch.equal(mine.narrow(dim, 0, n), want)
            assert not mine.narrow(dim, n, size - n).any()


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_then_gather_is_the_identity(dim):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    spec = shard_specs(mesh, dim)["hsdp"]
    full = random_tree((), shapes=SHAPES, seed=2)
    assert (
        max_error(fh.gather(fh.shard(full, spec), spec), optree.tree_map(torch.Tensor.double, full))
        == 0
    )


def test_one_collective_per_bucket_per_axis():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = shard_specs(mesh, 0)["hsdp"]
    tree = {f"p{i}": torch.randn(2, 2, 5, 3) for i in range(50)}
    acc, first = None, True
    with fh.comm_log() as log:
        for g, last in fh.microbatches([tree] * 3):
            acc = fh.reduce_grads(g, spec, last=last, acc=acc if not first else None)
            first = False
    assert log.count("reduce_scatter", "dp_inner") == 3
    assert log.count("all_reduce", "dp_outer") == 1


def test_flat_and_shard_subtrees_mix_through_a_spec_prefix():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = {
        "a": fh.hsdp(mesh, "dp_outer", "dp_inner"),
        "b": shard_specs(mesh, 0)["hsdp"],
        "c": fh.hsdp(mesh, "dp_outer", "dp_inner"),
        "w": shard_specs(mesh, 1)["zero2"],
        "z": shard_specs(mesh, 1)["hsdp"],
    }
    micro = [random_tree((2, 2), shapes=SHAPES, seed=m) for m in range(3)]
    out = accumulate(micro, spec)
    assert out["a"].dim() == 3 and out["b"].shape == (2, 2, 3, 4)
    assert max_error(fh.gather(out, spec), dense_reduce(micro, 2)) < 1e-5


def test_maingrad_with_shard_dim_equals_the_pure_path():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = shard_specs(mesh, 1)["hsdp"]
    micro = [random_tree((2, 2), shapes=SHAPES, seed=m) for m in range(3)]
    mg = fh.MainGrad(spec, like=random_tree((), shapes=SHAPES))
    for g, last in fh.microbatches(micro):
        mg.accumulate(g, last=last)
    pure = accumulate(micro, spec)
    for a, b in zip(optree.tree_leaves(mg.grads), optree.tree_leaves(pure)):
        assert torch.equal(a, b)


def test_shard_dim_out_of_range_names_the_path():
    mesh = fh.SimMesh({"dp": 2})
    spec = fh.Spec(mesh, [fh.Shard(1)], [fh.Shard(1)], [fh.Shard(1)])
    tree = {"ok": torch.zeros(2, 4, 4), "bias": torch.zeros(2, 5)}
    message = "grads['bias']: Shard(1) on axis 'dp' is out of range"
    with pytest.raises(ValueError, match=re.escape(message)):
        fh.reduce_grads(tree, spec, last=True)


def test_unsupported_shard_combinations_are_named():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    S0, S1 = fh.Shard(0), fh.Shard(1)
    with pytest.raises(NotImplementedError, match="more than one axis"):
        fh.Spec(mesh, [S0, S0], [S0, S0], [S0, S0])
    with pytest.raises(NotImplementedError, match="keeps its placement"):
        fh.Spec(mesh, [R, S0], [P, S1], [R, S1])
    with pytest.raises(NotImplementedError, match="Flat and Shard"):
        fh.Spec(mesh, [R, S0], [P, S0], [F, S0])
