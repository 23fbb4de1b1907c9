"""N-D meshes and multi-axis deferral against the dense reference; per-axis comm counts."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import accumulate, dense_reduce, max_error, random_tree

import functional_hsdp as fh

R, F, P = fh.Replicate(), fh.Flat(), fh.Partial("avg")
NAMES = ("replica", "outer", "inner")
SPECS = {
    # name: (parameter, gradient, optimizer)
    "hsdp_3d": ([R, R, F], [P, P, F], [R, R, F]),  # two deferred axes
    "hfsdp_3d": ([R, R, F], [P, P, F], [R, F, F]),
    "zero1_3d": ([R, R, R], [P, P, P], [F, F, F]),  # everything deferred, sharded at the end
    "fsdp_3d": ([F, F, F], [F, F, F], [F, F, F]),
    "ddp_3d": ([R, R, R], [P, P, P], [R, R, R]),
    "eager_replica": ([R, R, F], [R, P, F], [R, R, F]),  # all-reduce replica every microbatch
}


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 3), (2, 1, 2)], ids=str)
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("microbatches", [1, 3])
def test_three_axis_specs_match_dense_reference(shape, name, microbatches):
    mesh = fh.SimMesh(dict(zip(NAMES, shape)))
    spec = fh.Spec(mesh, *SPECS[name])
    micro = [random_tree(shape, seed=m) for m in range(microbatches)]
    full = fh.gather(accumulate(micro, spec), spec)
    assert max_error(full, dense_reduce(micro, 3)) < 1e-5


@pytest.mark.parametrize("name", list(SPECS))
def test_three_axis_round_trips_are_the_identity(name):
    mesh = fh.SimMesh(dict(zip(NAMES, (2, 2, 2))))
    spec = fh.Spec(mesh, *SPECS[name])
    full = random_tree((), seed=5)
    exact = optree.tree_map(torch.Tensor.double, full)
    main = fh.shard(full, spec)
    assert max_error(fh.gather(main, spec), exact) == 0
    params = fh.sync_params(main, spec)
    assert max_error(fh.gather(params, spec), exact) == 0
    assert max_error(fh.gather(fh.shard(full, spec, to="parameter"), spec), exact) == 0


def test_multi_axis_deferral_reduces_both_axes_only_on_the_last_microbatch():
    mesh = fh.SimMesh(dict(zip(NAMES, (2, 2, 2))))
    spec = fh.Spec(mesh, *SPECS["hfsdp_3d"])
    micro = [random_tree((2, 2, 2), seed=m) for m in range(3)]
    acc, logs = None, []
    for m, (g, last) in enumerate(fh.microbatches(micro)):
        with fh.comm_log() as log:
            acc = fh.reduce_grads(g, spec, last=last, acc=acc)
        logs.append([(e.op, e.axis) for e in log.events])
        assert (m == 2) == last
    assert logs[0] == logs[1] == [("reduce_scatter", "inner")]
    # on the last: inner reduce-scatter, then outer reduce-scatter, then replica all-reduce
    assert logs[2] == [
        ("reduce_scatter", "inner"),
        ("reduce_scatter", "outer"),
        ("all_reduce", "replica"),
    ]


def test_all_reduces_run_on_the_fully_scattered_chunk():
    mesh = fh.SimMesh(dict(zip(NAMES, (2, 2, 2))))
    spec = fh.Spec(mesh, *SPECS["hfsdp_3d"])
    with fh.comm_log() as log:
        fh.reduce_grads(random_tree((2, 2, 2)), spec, last=True)
    rs_inner, rs_outer, ar = log.events
    assert rs_outer.numel * 2 == rs_inner.numel
    assert ar.numel * 2 == rs_outer.numel


def test_a_mesh_axis_outside_the_spec_is_left_alone():
    """A 3-axis mesh where 'tp' is not data-parallel: no communication on it."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2, "tp": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    micro = [random_tree((2, 2, 2), seed=m) for m in range(2)]
    with fh.comm_log() as log:
        out = fh.gather(accumulate(micro, spec), spec)
    assert "tp" not in {e.axis for e in log.events}
    ref = optree.tree_map(lambda *xs: sum(x.double() for x in xs).mean((0, 1)), *micro)
    errs = optree.tree_map(lambda x, r: (x[0, 0].double() - r).abs().max().item(), out, ref)
    assert max(optree.tree_leaves(errs)) < 1e-5
