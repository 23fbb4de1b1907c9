"""Every preset on SimMesh against the dense reference: mean over ranks of sum over microbatches.

(Empty trees, zero-size and scalar leaves: tests/runtime/test_reliability.py.)
"""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from reference import (
    AXES,
    STRATEGIES,
    accumulate,
    check_acc_reuse,
    dense_reduce,
    max_error,
    packs,
    plans_built,
    preset,
    random_tree,
)

import functional_hsdp as fh

MESHES = [(1, 4), (2, 2), (4, 1), (2, 3)]
CAP_40 = 40 * 4 / 2**20  # bucket cap of 40 elements: several buckets
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gathered_grads_equal_dense_reference(shape, strategy, microbatches, dtype):
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    spec = preset(strategy, mesh)
    micro = [random_tree(shape, dtype, seed=m) for m in range(microbatches)]
    full = fh.gather(accumulate(micro, spec), spec)
    ref = dense_reduce(micro, batch_ndim=2)
    # every rank holds the same full value
    assert max_error(full, ref) < TOL[dtype] * max(1, microbatches)
    assert optree.tree_all(optree.tree_map(lambda x: x.dtype == dtype, full))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_small_buckets_give_the_same_result(strategy):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    micro = [random_tree((2, 3), seed=m) for m in range(3)]
    big = fh.gather(accumulate(micro, preset(strategy, mesh)), preset(strategy, mesh))
    tiny_spec = preset(strategy, mesh, bucket_cap_mb=40 * 4 / 2**20)  # 40 elements a bucket
    tiny = fh.gather(accumulate(micro, tiny_spec), tiny_spec)
    assert max_error(tiny, optree.tree_map(lambda x: x[0, 0].double(), big)) < 1e-6


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_reduce_op_of_the_spec_is_used(op):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner", reduce_op=op)
    micro = [random_tree((2, 2), seed=m) for m in range(2)]
    with fh.comm_log() as log:
        full = fh.gather(accumulate(micro, spec), spec)
    assert max_error(full, dense_reduce(micro, 2, op)) < 1e-5
    assert {e.reduce for e in log.events if e.op != "all_gather"} == {op}


def test_inputs_are_never_mutated():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    g1, g2 = random_tree((2, 2), seed=1), random_tree((2, 2), seed=2)
    acc = fh.reduce_grads(g1, spec, last=False)
    before = copy.deepcopy((g1, g2, acc))
    out = fh.reduce_grads(g2, spec, last=True, acc=acc)
    for x, y in zip(optree.tree_leaves((g1, g2, acc)), optree.tree_leaves(before)):
        assert torch.equal(x, y)
    assert all(
        o.data_ptr() != a.data_ptr()
        for o, a in zip(optree.tree_leaves(out), optree.tree_leaves(acc))
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_acc_given_back_as_returned_matches_a_fresh_copy(strategy):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    as_returned, fresh = check_acc_reuse(strategy, preset(strategy, mesh), (2, 2))
    assert fresh  # a copy is packed from its leaves
    if strategy == "ddp":  # leaves that view their bucket buffer: read from it, not re-packed
        assert as_returned == []  # (SimMesh's ragged Flat pieces are copies: packed)


@pytest.mark.parametrize(
    "shape", [{"dp": 4}, {"dp_outer": 2, "dp_inner": 1}], ids=["ddp", "hsdp-inner-1"]
)
def test_an_acc_given_back_as_returned_is_not_packed_again(shape):
    """Where result leaves view their bucket buffer, the next call reads the buffer: no bucket
    of the acc is packed from its leaves (a copy of the same acc is)."""
    mesh = fh.SimMesh(shape)
    spec = fh.ddp(mesh) if len(shape) == 1 else fh.hsdp(mesh, *AXES, bucket_cap_mb=CAP_40)
    batch = tuple(shape.values())
    micro = [random_tree(batch, seed=m) for m in range(3)]
    acc = fh.reduce_grads(micro[0], spec, last=False)
    with packs("gradient") as as_returned:
        acc = fh.reduce_grads(micro[1], spec, last=False, acc=acc)
        out = fh.reduce_grads(micro[2], spec, last=True, acc=acc)
    assert as_returned == []
    with packs("gradient") as fresh:
        again = fh.reduce_grads(micro[2], spec, last=True, acc=optree.tree_map(torch.clone, acc))
    assert fresh  # the spy sees packing: a copy is packed from its leaves
    assert all(map(torch.equal, optree.tree_leaves(out), optree.tree_leaves(again)))


def test_result_is_a_tree_of_plain_tensors_with_the_same_structure():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    g = random_tree((2, 2))
    out = fh.reduce_grads(g, spec, last=True)
    assert optree.tree_structure(out) == optree.tree_structure(g)
    assert all(type(x) is torch.Tensor for x in optree.tree_leaves(out))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sgd_on_local_shards_matches_dense_sgd(strategy):
    """A custom optimizer works elementwise on shard(params) and the reduced grads."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    spec = preset(strategy, mesh)
    full = random_tree((), seed=0)
    params = fh.shard(full, spec)
    micro = [random_tree((2, 3), seed=m) for m in range(3)]
    grads = accumulate(micro, spec)
    new = optree.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    ref = optree.tree_map(lambda p, g: p.double() - 0.1 * g, full, dense_reduce(micro, 2))
    assert max_error(fh.gather(new, spec), ref) < 1e-5


@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (1, 4)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shard_then_gather_is_the_identity(shape, strategy):
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    spec = preset(strategy, mesh)
    full = random_tree((), seed=3)
    back = fh.gather(fh.shard(full, spec), spec)
    assert max_error(back, optree.tree_map(torch.Tensor.double, full)) == 0
    stacked = optree.tree_map(lambda x: x.expand(*shape, *x.shape), full)
    assert (
        max_error(
            fh.gather(fh.shard(stacked, spec), spec), optree.tree_map(torch.Tensor.double, full)
        )
        == 0
    )


def test_flat_padding_falls_between_leaves_and_at_the_tail():
    """Uneven sizes: 5 + 21 elements on 4 ranks. Each leaf starts at a multiple of 16 elements
    (a at 0, b at 16: 11 zeros between them) and the bucket ends at 37, padded to 40 (4
    chunks of 10): zeros between leaves and at the tail, never inside a leaf."""
    mesh = fh.SimMesh({"dp": 4})
    spec = fh.fsdp(mesh)
    tree = {"a": torch.arange(1.0, 6.0), "b": torch.arange(6.0, 27.0)}
    local = fh.shard(tree, spec)
    # chunk length 10: rank 0 = a(5) + 5 zeros; rank 1 = 6 zeros + b[:4]; rank 2 = b[4:14];
    # rank 3 = b[14:21] + 3 zeros (SimMesh stacks ragged pieces, zero-filled to the longest)
    assert local["a"][0].tolist() == [1, 2, 3, 4, 5]
    assert not local["a"][1:].any()
    assert local["b"][1, :4].tolist() == [6, 7, 8, 9]
    assert local["b"][2].tolist() == list(range(10, 20))
    assert local["b"][3, :7].tolist() == list(range(20, 27))
    assert not local["b"][0].any() and not local["b"][1, 4:].any() and not local["b"][3, 7:].any()
    assert fh.gather(local, spec)["b"][2].tolist() == tree["b"].tolist()


def test_spec_as_pytree_prefix_gives_subtrees_their_own_spec():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = {"a": fh.ddp(mesh), "n": fh.hsdp(mesh, "dp_outer", "dp_inner"), "z": fh.fsdp(mesh)}
    micro = [random_tree((2, 2), seed=m) for m in range(3)]
    with fh.comm_log() as log:
        grads = accumulate(micro, spec)
    assert grads["a"].shape == (2, 2, 7, 3)  # ddp: full shape
    assert grads["z"].dim() == 3  # fsdp: flat pieces
    assert max_error(fh.gather(grads, spec), dense_reduce(micro, 2)) < 1e-5
    # one bucket per spec: ddp 1 AR on each axis; fsdp 3 RS per axis; hsdp 3 RS + 1 AR
    assert log.count("all_reduce") == 2 + 1
    assert log.count("reduce_scatter") == 3 * 2 + 3


def test_axes_outside_dp_axes_are_not_reduced():
    """ddp over dp_inner only: each dp_outer group keeps its own mean."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.ddp(mesh, "dp_inner")
    micro = [random_tree((2, 2), seed=m) for m in range(2)]
    with fh.comm_log() as log:
        out = accumulate(micro, spec)
    assert {e.axis for e in log.events} == {"dp_inner"}
    ref = optree.tree_map(lambda *xs: sum(x.double() for x in xs).mean(1), *micro)
    errs = optree.tree_map(lambda x, r: (x[:, 0].double() - r).abs().max().item(), out, ref)
    assert max(optree.tree_leaves(errs)) < 1e-5


def test_per_axis_collectives_match_dense_math():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    x = {"w": torch.randn(2, 3, 4, 5), "b": torch.randn(2, 3, 7)}
    s = fh.psum(x, "dp_inner", mesh)
    m = fh.pmean(x, "dp_outer", mesh)
    for k in x:
        torch.testing.assert_close(s[k], x[k].sum(1, keepdim=True).expand_as(x[k]))
        torch.testing.assert_close(m[k], x[k].mean(0, keepdim=True).expand_as(x[k]))
    pieces = fh.psum_scatter(x, "dp_inner", mesh)
    back = fh.all_gather(pieces, "dp_inner", mesh)
    for k in x:
        torch.testing.assert_close(back[k], s[k])


def test_a_second_identical_call_builds_no_plan():
    """The plan (buckets, steps, geometry) is built once per tree structure, shapes and spec:
    a repeated call of every public function only packs, communicates and unpacks."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hfsdp(mesh, "dp_outer", "dp_inner", bucket_cap_mb=CAP_40)
    fh.clear_caches()  # the first calls below build what they need

    def step(seed: int) -> None:
        micro = [random_tree((2, 2), seed=seed + m) for m in range(2)]
        params = fh.shard(random_tree((), seed=seed), spec)
        fh.gather(fh.sync_params(params, spec), spec)
        grads = accumulate(micro, spec)
        fh.gather(optree.tree_map(lambda p, g: p - 0.1 * g, params, grads), spec)
        mg = fh.MainGrad(spec, like=random_tree(()))
        for g, last in fh.microbatches(micro):
            mg.accumulate(g, last=last)
        fh.psum(micro[0], "dp_inner", mesh)

    with plans_built() as first:
        step(0)
    assert first  # the spy sees plans being built
    with plans_built() as again:
        step(10)  # the same structure, shapes and spec; other values
    assert again == []
    with plans_built() as other:  # a new shape is a new plan
        fh.reduce_grads(random_tree((2, 2), shapes={"w": (3, 2)}), spec, last=True)
    assert len(other) == 1
