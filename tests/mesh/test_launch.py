"""Tests of the one-shot ``functional_hsdp.mesh.launch.run`` and the reusable
``functional_hsdp.tools.testing.GlooPool``.

Task functions are module-level (``_task_*``) so the workers can import them from this module
(pytest imports it as ``test_launch``: tests/mesh/ is on sys.path, and neither it nor tests/ is
a package).
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import reference
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from functional_hsdp.base.torch_releases import funcol_all_gather_single
from functional_hsdp.mesh import launch
from functional_hsdp.mesh.launch import WorkerError, device_mesh
from functional_hsdp.tools.testing import GlooPool, WorkerTimeout

# A pool that gives up on a task (its timeout of 1 s, or error_grace of 3 s after a rank
# raised) returns well before the 60 s it would otherwise wait. Measured (2-core machine,
# 5 runs each): 1.02-1.06 s and 3.02-3.05 s at load average 3; 1.33-3.0 s and 3.5-4.4 s with 8
# busy processes beside it (load average 18). The bound is ten times the worst overshoot
# measured, and half the 60 s: it holds under load and still fails if the pool waits the task
# out.
GIVES_UP_WITHIN = 30.0


@pytest.fixture(scope="module")
def pool():
    """conftest.py's pool, but giving up on stuck ranks 3 s after another one raised."""
    with GlooPool(4, preload=(*launch.DEFAULT_PRELOAD, "pytest"), error_grace=3.0) as p:
        yield p


# ---------------------------------------------------------------- tasks ----


def _task_all_reduce(base: float, *, scale: float = 1.0):
    r = dist.get_rank()
    t = torch.full((3,), (base + r) * scale)
    out = funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
    return {"rank": r, "world": dist.get_world_size(), "sum": out, "pid": os.getpid()}


def _task_mesh_2x2():
    mesh = device_mesh((2, 2), ("dp", "tp"))
    assert device_mesh((2, 2), ("dp", "tp")) is mesh  # cached per worker
    r = dist.get_rank()
    t = torch.tensor([float(r)])
    over_dp = funcol.wait_tensor(funcol.all_reduce(t, "sum", (mesh, 0)))
    over_tp = funcol.wait_tensor(funcol.all_reduce(t, "sum", (mesh, 1)))
    tp_group = mesh.get_group("tp")
    over_tp_pg = funcol.wait_tensor(funcol.all_reduce(t, "sum", tp_group))
    assert torch.equal(over_tp, over_tp_pg)
    gathered = funcol_all_gather_single(t, 0, (mesh, 1))
    return (
        mesh.mesh_dim_names,
        tuple(mesh.get_coordinate()),
        over_dp.item(),
        over_tp.item(),
        funcol.wait_tensor(gathered).tolist(),
    )


def _task_raise_on_rank(bad_rank: int):
    r = dist.get_rank()
    if r == bad_rank:
        raise ValueError(f"bad value on rank {r}")
    return r * 10


def _task_raise_everywhere():
    raise KeyError(f"missing-{dist.get_rank()}")


def _task_exit_on_rank_2():
    if dist.get_rank() == 2:
        os._exit(3)
    # The others block in a collective that rank 2 never joins.
    t = torch.ones(1)
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD)).item()


def _task_sleep(seconds: float):
    time.sleep(seconds)
    return dist.get_rank()


def _task_raise_then_others_block():
    t = torch.ones(1)
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 never joins the all_reduce")
    return funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD)).item()


def _task_unpicklable_result():
    return lambda: None


def _task_tensor_roundtrip(x: torch.Tensor):
    r = dist.get_rank()
    big = torch.arange(1000.0)
    return {
        "shifted": x + r,
        "view": big[10:13],  # a view of a larger storage
        "param": torch.nn.Parameter(torch.ones(2) * r),
        "nonleaf": torch.ones(2, requires_grad=True) * 2,
        "int": torch.tensor([r], dtype=torch.int64),
    }


# ---------------------------------------------------------------- tests ----


def test_all_reduce_on_every_rank(pool):
    out = pool.run(_task_all_reduce, 1.0, scale=2.0)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 for o in out)
    expected = torch.full((3,), 2.0 * (1 + 2 + 3 + 4))
    for o in out:
        assert isinstance(o["sum"], torch.Tensor)
        assert torch.equal(o["sum"], expected)
    assert len({o["pid"] for o in out}) == 4


def test_tensor_args_and_results_travel_by_value(pool):
    x = torch.tensor([1.0, 2.0])
    out = pool.run(_task_tensor_roundtrip, x)
    for r, o in enumerate(out):
        assert torch.equal(o["shifted"], x + r)
        assert o["view"].tolist() == [10.0, 11.0, 12.0]
        assert o["view"].untyped_storage().nbytes() == 3 * 4  # compact copy
        assert o["param"].requires_grad and o["param"].tolist() == [r, r]
        assert o["nonleaf"].requires_grad and o["nonleaf"].is_leaf
        assert o["int"].dtype == torch.int64 and o["int"].item() == r


def test_helper_module_functions_as_tasks(pool):
    # Functions of a helper module in tests/ (not the test module), or of the package, work too.
    assert pool.run(reference.coords) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert pool.run(launch.rank) == [0, 1, 2, 3]
    assert pool.run(launch.world_size) == [4, 4, 4, 4]


def test_device_mesh_2x2_per_dim_groups(pool):
    out = pool.run(_task_mesh_2x2)
    # mesh = [[0, 1], [2, 3]]: dim 0 ("dp") groups {0,2},{1,3}; dim 1 ("tp") {0,1},{2,3}
    assert [o[0] for o in out] == [("dp", "tp")] * 4
    assert [o[1] for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [o[2] for o in out] == [2.0, 4.0, 2.0, 4.0]
    assert [o[3] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o[4] for o in out] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    # Second call reuses the cached mesh (no new process groups) and still works.
    assert pool.run(_task_mesh_2x2) == out


def test_exception_on_one_rank(pool):
    pids = pool.pids
    with pytest.raises(WorkerError) as info:
        pool.run(_task_raise_on_rank, 1)
    err = info.value
    assert not isinstance(err, TimeoutError)
    assert set(err.errors) == {1}
    type_name, message, tb = err.errors[1]
    assert type_name == "ValueError"
    assert "bad value on rank 1" in message
    assert "_task_raise_on_rank" in tb and "Traceback" in tb
    assert "rank 1" in str(err) and "ValueError" in str(err)
    assert "_task_raise_on_rank" in str(err)  # remote traceback in the message
    # The ranks that did not raise still returned their values.
    assert err.results == {0: 0, 2: 20, 3: 30}
    # No worker was lost: the pool keeps its processes.
    assert not pool.broken
    assert pool.run(_task_raise_on_rank, -1) == [0, 10, 20, 30]
    assert pool.pids == pids


def test_exception_on_every_rank(pool):
    with pytest.raises(WorkerError) as info:
        pool.run(_task_raise_everywhere)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3]
    for r, (type_name, message, _) in errors.items():
        assert type_name == "KeyError"
        assert f"missing-{r}" in message
    assert not pool.broken


def test_unpicklable_task_or_result(pool):
    # Caught in the parent, before anything is sent to the workers.
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.run(lambda: 1)
    with pytest.raises(WorkerError) as info:
        pool.run(_task_unpicklable_result)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    assert not pool.broken


def test_worker_death_is_reported_promptly_and_pool_recovers(pool):
    starts = pool.starts
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(_task_exit_on_rank_2, timeout=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, elapsed
    err = info.value
    assert not isinstance(err, TimeoutError)
    assert err.exitcodes == {2: 3}
    assert "rank 2" in str(err)
    assert pool.broken
    # Next run restarts the workers and works.
    out = pool.run(_task_all_reduce, 0.0)
    assert pool.starts == starts + 1
    assert not pool.broken
    assert [o["sum"][0].item() for o in out] == [6.0] * 4


def test_timeout_raises_and_pool_recovers(pool):
    pids = pool.pids
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        pool.run(_task_sleep, 60.0, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < GIVES_UP_WITHIN, elapsed  # the timeout, not the task's 60 s
    assert isinstance(info.value, WorkerTimeout)
    assert isinstance(info.value, WorkerError)
    assert info.value.missing == [0, 1, 2, 3]
    assert pool.broken
    assert not any(_pid_exists(pid) for pid in pids)  # stuck workers killed at once
    assert pool.run(_task_sleep, 0.0) == [0, 1, 2, 3]


def test_error_while_others_block_in_collective(pool):
    # Rank 0 raises; ranks 1-3 wait in an all_reduce forever.  The pool gives
    # up on them after error_grace (3 s here) instead of the full timeout.
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(_task_raise_then_others_block, timeout=60)
    elapsed = time.monotonic() - t0
    assert 3.0 <= elapsed < GIVES_UP_WITHIN, elapsed  # error_grace, not the 60 s timeout
    err = info.value
    assert not isinstance(err, TimeoutError)
    assert set(err.errors) == {0}
    assert err.errors[0][0] == "RuntimeError"
    assert err.missing == [1, 2, 3]
    assert pool.broken
    assert pool.run(launch.rank) == [0, 1, 2, 3]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_standalone_pool_context_manager():
    with GlooPool(world_size=2, timeout=30) as p:
        assert p.started
        assert p.run(launch.world_size) == [2, 2]
        pids = p.pids
    assert not p.started
    assert not any(_pid_exists(pid) for pid in pids)


# -- the one-shot run ------------------------------------------------------------------------


def test_run_starts_fresh_ranks_and_returns_each_ranks_result(pool):
    out = launch.run(_task_all_reduce, 1.0, scale=2.0)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["world"] == 4 for o in out)
    for o in out:
        assert torch.equal(o["sum"], torch.full((3,), 2.0 * (1 + 2 + 3 + 4)))
    pids = {o["pid"] for o in out}
    assert len(pids) == 4 and pids.isdisjoint(pool.pids) and os.getpid() not in pids
    assert not any(_pid_exists(pid) for pid in pids)  # ended with the run
    assert launch.run(launch.world_size, world_size=2) == [2, 2]


def test_run_reports_a_failing_rank_and_stops_the_others_at_once():
    # Rank 0 raises; ranks 1-3 wait in an all_reduce (collective timeout: 60 s). The agent
    # stops them as soon as rank 0 fails.
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch.run(_task_raise_then_others_block, timeout=60)
    assert time.monotonic() - t0 < 20
    err = info.value
    assert set(err.errors) == {0} and not err.exitcodes
    type_name, message, tb = err.errors[0]
    assert type_name == "RuntimeError" and "never joins the all_reduce" in message
    assert "_task_raise_then_others_block" in tb and "_task_raise_then_others_block" in str(err)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        launch.run(lambda: 1)  # refused before any process starts
