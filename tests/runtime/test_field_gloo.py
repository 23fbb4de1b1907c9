"""Field set-ups on 4 real gloo ranks: a data-parallel mesh that is part of a larger one (the
agreement on a gloo group of its own), the NCCL code path (functional collectives) run on
gloo, with every collective it issues waited or released, and AVG emulated as SUM then
divide where a backend lacks it."""

from __future__ import annotations

import gc
import time

import optree
import pytest
import torch
import torch.distributed as dist
from reference import (
    AXES,
    NCCL_STYLE,
    STRATEGIES,
    accumulate,
    carried_as,
    dist_mesh,
    preset,
    random_tree,
)

import functional_hsdp as fh
from functional_hsdp.mesh.dist import Carriage
from functional_hsdp.units import registry as units_module

WORLD = 4

NO_AVG = Carriage(native_avg=False, in_place=False, c10d_gather=False)


def _in_flight() -> int:
    """Functional collectives torch still holds unwaited (its work registry)."""
    return torch._C._distributed_c10d._get_work_registry_size()


# -- a data-parallel sub-mesh ----------------------------------------------------------------


def _sub_mesh_task():
    from functional_hsdp.mesh.launch import device_mesh

    root = device_mesh((2, 2), ("tp", "dp"))  # a tp x dp mesh; data parallel over "dp" only
    mesh = fh.DistMesh(root["dp"])
    spec = fh.fsdp(mesh)
    rank = dist.get_rank()
    g = {"w": torch.full((5,), float(rank)), "b": torch.arange(3.0) * rank}
    out = fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    try:  # the ranks of one dp group disagree on last: both raise, naming each other
        fh.reduce_grads(g, spec, last=rank % 2 == 0)
        error = None
    except ValueError as e:
        error = str(e)
    return out, error, mesh.diagnostics.group is not None, tuple(mesh.backends)


def test_a_sub_mesh_agrees_over_a_gloo_group_of_its_own(pool):
    results = pool.run(_sub_mesh_task)
    for rank, (out, error, own_group, backends) in enumerate(results):
        peers = [r for r in range(WORLD) if r // 2 == rank // 2]  # dp groups: {0,1}, {2,3}
        torch.testing.assert_close(out["w"], torch.full((5,), sum(peers) / 2))
        torch.testing.assert_close(out["b"], torch.arange(3.0) * sum(peers) / 2)
        assert error is not None and "last differs across ranks" in error, error
        assert f"ranks [{peers[0]}, {peers[1]}]" not in error  # one value per rank, named
        assert own_group and backends == ("gloo",)


# -- the functional (NCCL) path on gloo ---------------------------------------------------------


def _functional_equals_c10d(strategy: str, carriage: Carriage):
    micro = [random_tree((), seed=10 * dist.get_rank() + m) for m in range(3)]
    spec = fh.hsdp(dist_mesh(), *AXES) if strategy == "hsdp" else preset(strategy, dist_mesh())
    native = accumulate(micro, spec)
    with carried_as(carriage), fh.comm_log() as log:
        mesh = fh.DistMesh(dist_mesh().device_mesh)
        other = accumulate(micro, preset(strategy, mesh))
        full = fh.gather(other, preset(strategy, mesh))
    same = all(map(torch.equal, optree.tree_leaves(native), optree.tree_leaves(other)))
    return same, sorted({e.impl for e in log.events}), _in_flight(), full


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("carriage", [NCCL_STYLE, NO_AVG], ids=["functional", "sum+div"])
def test_functional_path_and_emulated_avg_equal_the_native_result(pool, strategy, carriage):
    """The code NCCL runs (functional collectives), and AVG emulated as SUM then divide (a
    backend without AVG), give gloo's native results bit for bit; comm_log says how each
    collective was carried; nothing is left in flight."""
    micro = [[random_tree((), seed=10 * r + m) for m in range(3)] for r in range(WORLD)]
    dense = optree.tree_map(lambda *xs: sum(xs) / WORLD, *[sum_tree(m) for m in micro])
    for same, impls, in_flight, full in pool.run(_functional_equals_c10d, strategy, carriage):
        assert same and in_flight == 0
        if carriage is NO_AVG:
            assert "sum+div" in impls
        else:
            assert impls == ["native"], impls
        for got, want in zip(optree.tree_leaves(full), optree.tree_leaves(dense)):
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)


def sum_tree(trees: list):
    return optree.tree_map(lambda *xs: sum(x.double() for x in xs), *trees)


def _released_task(where: str):
    """The functional path on gloo: after an error between issue and wait, a prefetch never
    used and prepared units evicted, nothing is in flight and no buffer is held."""
    from functional_hsdp.plan import recipe as plan_module

    with carried_as(NCCL_STYLE):
        mesh = fh.DistMesh(dist_mesh().device_mesh)
        spec = fh.hsdp(mesh, *AXES, bucket_cap_mb=256 * 4 / 2**20)
        before = _in_flight()
        if where == "error":
            g = {k: torch.ones(512) * (dist.get_rank() + 1) for k in "abcd"}  # 2 per bucket
            original = plan_module.Plan.pack

            def pack(self, b, leaves, role):
                if b == 1:
                    raise MemoryError("simulated: out of memory packing bucket 1")
                return original(self, b, leaves, role)

            plan_module.Plan.pack = pack
            try:
                with fh.comm_log() as log:
                    fh.reduce_grads(g, spec, last=True)
            except MemoryError:
                pass
            finally:
                plan_module.Plan.pack = original
            issued = len(log.events)
        else:
            full = [{"w": torch.randn(256, generator=torch.Generator().manual_seed(u))}
                    for u in range(6)]  # fmt: skip
            shards = fh.shard(full, [spec] * 6)
            block = fh.gathered(lambda p, x: x * p["w"].sum(), spec)
            x = torch.ones(3, requires_grad=True)
            with fh.comm_log() as log:
                if where == "evicted":  # more units declared next than are kept, none called
                    for u in range(1, 6):
                        block.prefetch(shards[u])
                        block(shards[0], x.detach())  # each call issues the declared gather
                    bounded = _in_flight() - before <= units_module._PREPARED
                else:
                    bounded = True
                block.prefetch(shards[1])  # unit 1 declared next, never called
                y = block(shards[0], x)
                torch.autograd.grad(y.sum(), [x])  # its end releases what was never used
            issued = len(log.events)
            if not bounded:
                return issued, -1
        deadline = time.monotonic() + 20
        while _in_flight() > before and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.02)
        dist.barrier()
        return issued, _in_flight() - before


@pytest.mark.parametrize("where", ["error", "unused prefetch", "evicted"])
def test_functional_collectives_are_released_on_every_path(pool, where):
    for issued, left in pool.run(_released_task, where):
        assert issued >= 1 and left == 0, (issued, left)
