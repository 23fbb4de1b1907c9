"""Communication is checked by counting collectives in comm_log, and overlap by the order in
which the mesh's collectives are issued and waited (a spy on the mesh protocol)."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import AXES, STRATEGIES, every_call, issue_and_wait_order, preset, random_tree

import functional_hsdp as fh

CAP_40 = 40 * 4 / 2**20  # bucket cap of 40 elements


def per_microbatch_logs(spec, micro):
    logs, acc = [], None
    for m, g in enumerate(micro):
        with fh.comm_log() as log:
            acc = fh.reduce_grads(g, spec, last=(m == len(micro) - 1), acc=acc)
        logs.append(log)
    return logs, acc


def n_buckets(spec, tree) -> int:
    from functional_hsdp.plan.buckets import build_buckets

    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    nb = len(spec.mesh.batch_shape)
    buckets, _ = build_buckets(
        tuple(map(str, paths)),
        shapes=tuple(tuple(x.shape[nb:]) for x in leaves),
        dtypes=tuple(x.dtype for x in leaves),
        devices=tuple(x.device for x in leaves),
        specs=(spec,) * len(leaves),
        units=(0,) * len(leaves),
    )
    return len(buckets)


@pytest.mark.parametrize("microbatches", [1, 3, 4])
@pytest.mark.parametrize("cap", [25.0, CAP_40], ids=["one_bucket", "many_buckets"])
def test_outer_allreduce_only_on_last_microbatch(microbatches, cap):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner", bucket_cap_mb=cap)
    micro = [random_tree((2, 2), seed=m) for m in range(microbatches)]
    b = n_buckets(spec, micro[0])
    assert (b == 1) == (cap == 25.0)
    logs, _ = per_microbatch_logs(spec, micro)
    for m, log in enumerate(logs):
        assert log.count("reduce_scatter", "dp_inner") == b
        assert log.count("all_reduce", "dp_outer") == (b if m == microbatches - 1 else 0)
        assert log.count() == log.count("reduce_scatter", "dp_inner") + log.count(
            "all_reduce", "dp_outer"
        )
    total = sum(log.count("reduce_scatter", "dp_inner") for log in logs)
    assert total == microbatches * b


def test_outer_allreduce_runs_on_the_inner_shard():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 4})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    with fh.comm_log() as log:
        fh.reduce_grads(random_tree((2, 4)), spec, last=True)
    rs, ar = log.events
    assert (rs.op, ar.op) == ("reduce_scatter", "all_reduce")  # reduce-scatter first
    assert ar.numel * 4 == rs.numel
    # 170 elements, each leaf at a multiple of 16 elements (a: 0-20, n[0]: 32-36, n[1].s: 48,
    # z: 64-206), padded to 208 = 4 * 52
    assert rs.numel == 64 + 13 * 11 + 1 == 208


def test_counts_do_not_grow_with_the_number_of_leaves():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    tree = {f"p{i}": torch.randn(2, 2, 3) for i in range(500)}
    with fh.comm_log() as log:
        fh.reduce_grads(tree, spec, last=True)
    assert log.count() == 2


def test_one_bucket_per_dtype():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    tree = {
        "a": torch.randn(2, 2, 3),
        "b": torch.randn(2, 2, 3).bfloat16(),
        "c": torch.randn(2, 2, 9),
    }
    with fh.comm_log() as log:
        out = fh.reduce_grads(tree, spec, last=True)
    assert sorted(str(e.dtype) for e in log.events if e.op == "reduce_scatter") == [
        "torch.bfloat16",
        "torch.float32",
    ]
    assert out["b"].dtype == torch.bfloat16


@pytest.mark.parametrize("microbatches", [1, 3])
def test_ddp_defers_everything_and_fsdp_defers_nothing(microbatches):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    micro = [random_tree((2, 2), seed=m) for m in range(microbatches)]
    logs, _ = per_microbatch_logs(fh.ddp(mesh), micro)
    for m, log in enumerate(logs):
        n = 1 if m == microbatches - 1 else 0
        assert log.count("all_reduce", "dp_inner") == log.count("all_reduce", "dp_outer") == n
        assert log.count("reduce_scatter") == 0
    logs, _ = per_microbatch_logs(fh.fsdp(mesh), micro)
    for log in logs:
        assert (
            log.count("reduce_scatter", "dp_inner") == log.count("reduce_scatter", "dp_outer") == 1
        )
        assert log.count("all_reduce") == 0


@pytest.mark.parametrize("cap", [25.0, CAP_40], ids=["one_bucket", "many_buckets"])
def test_hfsdp_reduce_scatters_over_outer_on_the_last_microbatch_and_sync_gathers(cap):
    """Per bucket: a reduce-scatter on inner every microbatch, one on outer on the last, and one
    all-gather on outer in sync_params (of shard's weights or of updated ones)."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hfsdp(mesh, "dp_outer", "dp_inner", bucket_cap_mb=cap)
    micro = [random_tree((2, 2), seed=m) for m in range(3)]
    b = n_buckets(spec, micro[0])
    assert (b == 1) == (cap == 25.0)
    logs, grads = per_microbatch_logs(spec, micro)
    assert [log.count("reduce_scatter", "dp_outer") for log in logs] == [0, 0, b]
    assert [log.count("reduce_scatter", "dp_inner") for log in logs] == [b, b, b]
    params = fh.shard(random_tree(()), spec)
    updated = optree.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    for tree in (params, updated):
        with fh.comm_log() as log:
            fh.sync_params(tree, spec)
        assert [(e.op, e.axis) for e in log.events] == [("all_gather", "dp_outer")] * b


def test_shard_is_communication_free_and_gather_undoes_splits_in_reverse_order():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.fsdp(mesh)
    with fh.comm_log() as log:
        params = fh.shard(random_tree(()), spec)
    assert log.events == []
    with fh.comm_log() as log:
        fh.gather(params, spec)
    # split order is inner first, so gathers run outer first
    assert [(e.op, e.axis) for e in log.events] == [
        ("all_gather", "dp_outer"),
        ("all_gather", "dp_inner"),
    ]


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)], ids=["outer-1", "inner-1"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_collective_on_a_size_1_axis(strategy, shape):
    """A size-1 axis moves nothing: no public call issues a collective over it (the other
    axis still communicates). DistMesh on gloo: tests/mesh/test_dist_gloo.py."""
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    with fh.comm_log() as log:
        every_call(preset(strategy, mesh, bucket_cap_mb=CAP_40))
    wide = AXES[shape.index(4)]
    assert log.events and {e.axis for e in log.events} == {wide}


def test_event_bytes_and_summary():
    mesh = fh.SimMesh({"dp": 2})
    with fh.comm_log() as log:
        fh.psum({"w": torch.ones(2, 10)}, "dp", mesh)
    assert log.events[0].nbytes == 40
    assert log.summary() == {("dp", "all_reduce"): (1, 40)}
    assert log.nbytes(axis="dp") == 40


# -- overlap: the order of issues and waits ----------------------------------------------------

RS, AR = "issue reduce_scatter dp_inner", "issue all_reduce dp_outer"
# three buckets, each reduce-scattered over dp_inner then all-reduced over dp_outer: every
# bucket's first collective is issued before any is waited (step-major), and each bucket's
# all-reduce as soon as its reduce-scatter is waited, while the later buckets' are in flight
STEP_MAJOR = [
    f"{RS} #0", f"{RS} #1", f"{RS} #2",
    "wait #0", f"{AR} #3", "wait #1", f"{AR} #4", "wait #2", f"{AR} #5",
    "wait #3", "wait #4", "wait #5",
]  # fmt: skip
# MainGrad keeps two buckets in flight: bucket 2 is issued once bucket 0 is waited
TWO_DEEP = [f"{RS} #0", f"{RS} #1", "wait #0", f"{RS} #2", "wait #1", "wait #2"]
TWO_DEEP_OUTER = [f"{AR} #3", f"{AR} #4", "wait #3", f"{AR} #5", "wait #4", "wait #5"]


def test_every_bucket_is_issued_before_any_is_waited():
    """Overlap (README "Overlap"): reduce_grads issues bucket b+1's collective before it waits
    for bucket b's, and MainGrad.accumulate runs two buckets deep. Recorded by wrapping the
    mesh's collectives and wait (the mesh protocol); DistMesh on gloo:
    tests/mesh/test_dist_gloo.py."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner", bucket_cap_mb=CAP_40)
    g = {k: torch.randn(2, 2, 40) for k in "abc"}  # a bucket each
    with issue_and_wait_order(mesh) as order:
        acc = fh.reduce_grads(g, spec, last=False)
    assert order == [f"{RS} #0", f"{RS} #1", f"{RS} #2", "wait #0", "wait #1", "wait #2"]
    with issue_and_wait_order(mesh) as order:
        fh.reduce_grads(g, spec, last=True, acc=acc)
    assert order == STEP_MAJOR
    mg = fh.MainGrad(spec, like={k: torch.zeros(40) for k in "abc"})
    with issue_and_wait_order(mesh) as order:
        mg.accumulate(g, last=False)
    assert order == TWO_DEEP
    with issue_and_wait_order(mesh) as order:
        mg.accumulate(g, last=True)
    assert order == TWO_DEEP + TWO_DEEP_OUTER
