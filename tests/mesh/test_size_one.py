"""``DistMesh(issue_size_one=True)``: at world size 1 every path still issues its collectives
(one GPU then runs NCCL's streams, waits and buffer lifetimes), with results equal to the
default mesh's, where a size-1 axis moves nothing. One gloo rank here, as on one GPU."""

from __future__ import annotations

import optree
import pytest
import torch

import functional_hsdp as fh
from functional_hsdp.mesh import launch

AXES = ("dp_outer", "dp_inner")


def _paths(mesh: fh.DistMesh) -> tuple[dict, dict]:
    """Every kind of call on a (1, 1) mesh: whole tree, MainGrad, units into a MainGrad.
    Returns the results and, per path, the collectives logged."""
    torch.manual_seed(0)
    full = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    g = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    out, counts = {}, {}
    for name, spec in (("hsdp", fh.hsdp(mesh, *AXES)), ("hfsdp", fh.hfsdp(mesh, *AXES))):
        with fh.comm_log() as log:
            shards = fh.shard(full, spec)
            acc = fh.reduce_grads(g, spec, last=False)
            acc = fh.reduce_grads(g, spec, last=True, acc=acc)
            out[f"{name} whole"] = (fh.gather(shards, spec), fh.gather(acc, spec))
        counts[f"{name} whole"] = len(log.events)
        with fh.comm_log() as log:
            mg = fh.MainGrad(spec, like=full)
            for _, last in fh.microbatches(2, into=mg):
                mg.accumulate(g, last=last)
            out[f"{name} maingrad"] = fh.gather(mg.grads, spec)
        counts[f"{name} maingrad"] = len(log.events)
        with fh.comm_log() as log:
            out[f"{name} units"] = _units(spec)
        counts[f"{name} units"] = len(log.events)
    return out, counts


def _units(spec: fh.Spec) -> list:
    """Two gathered units into a MainGrad, two microbatches, under fh.grad."""
    full = [{"w": torch.randn(3, 3), "b": torch.randn(3)} for _ in range(2)]
    tree_spec = [spec, spec]
    shards = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full)
    block = fh.gathered(lambda p, h: torch.tanh(h @ p["w"] + p["b"]), spec, into=mg)
    loss = lambda s, x: fh.sequence(block, s, x).square().sum()  # noqa: E731
    for x, _ in fh.microbatches(list(torch.randn(2, 4, 3)), into=mg):
        fh.grad(loss)(shards, x)
    mg.finish()
    return fh.gather(mg.grads, tree_spec)


def _task() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=AXES)
    plain, plain_counts = _paths(fh.DistMesh(dm))
    issued, issued_counts = _paths(fh.DistMesh(dm, issue_size_one=True))
    same = {
        k: all(
            torch.equal(a, b)
            for a, b in zip(optree.tree_leaves(plain[k]), optree.tree_leaves(issued[k]))
        )
        for k in plain
    }
    dist.destroy_process_group()
    return {"same": same, "plain": plain_counts, "issued": issued_counts}


@pytest.mark.timeout(120)
def test_size_one_axes_issue_collectives_with_the_same_results():
    (res,) = launch.run(_task, world_size=1, join=False)
    assert all(res["same"].values()), res["same"]
    assert all(n == 0 for n in res["plain"].values()), res["plain"]  # the default: none
    assert all(n > 0 for n in res["issued"].values()), res["issued"]


def test_issue_size_one_must_be_a_bool():
    with pytest.raises(TypeError, match="issue_size_one must be a bool"):
        fh.DistMesh(object(), issue_size_one=1)
