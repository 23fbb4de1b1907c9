"""Reliability on 4 real gloo ranks (2x2 mesh): bad input never hangs, faults raise in time.

* Cross-rank mismatches (trees, shapes, dtypes, specs, ``last``, calls) are caught by the
  fingerprint exchange before any gradient collective: every rank raises the same ValueError
  naming the first differing leaf path and the ranks.
* ``check_finite=True`` with NaN on one rank: every rank raises, naming the leaf and the rank.
* Local bad input given on every rank raises on every rank; the documented behaviours (empty
  tree, zero-size, non-contiguous and requires_grad leaves) work.
* Faults: a rank that dies mid-accumulation, or raises alone, makes the survivors raise
  CollectiveError within the process group's timeout (5 s here; asserted < 20 s). These run in
  their own short-lived process groups (``_world``), since the shared pool kills every worker
  as soon as one dies.
* Determinism: the same inputs give bit-identical results across calls, ranks and processes.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from datetime import timedelta

import optree
import pytest
import torch
import torch.distributed as dist
from reference import AXES, GLOO_SHAPE, dist_mesh

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD, WorkerError, device_mesh


def _hsdp(mesh=None, **kw) -> fh.Spec:
    return fh.hsdp(mesh or dist_mesh(), "dp_outer", "dp_inner", **kw)


def _grads(seed: int = 0, **shapes) -> dict:
    gen = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    shapes = shapes or {"b": (5,), "w": (5, 3)}
    return {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}


def _expect_on_every_rank(pool, task, exc: str, *texts: str, args=()) -> list[str]:
    with pytest.raises(WorkerError) as info:
        pool.run(task, *args, timeout=60)
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2, 3], info.value
    messages = []
    for name, message, _ in errors.values():
        assert name == exc, message
        for text in texts:
            assert text in message, message
        messages.append(message)
    return messages


# -- cross-rank mismatches: the fingerprint exchange ---------------------------------------


def _shape_differs():
    rank = dist.get_rank()
    fh.reduce_grads(_grads(w=(4, 3) if rank == 2 else (5, 3)), _hsdp(), last=True)


def _dtype_differs():
    g = _grads()
    if dist.get_rank() == 1:
        g["w"] = g["w"].double()
    fh.reduce_grads(g, _hsdp(), last=True)


def _tree_differs():
    g = _grads()
    if dist.get_rank() == 3:
        g["c"] = torch.ones(2)
    fh.reduce_grads(g, _hsdp(), last=False)


def _container_differs():  # the same paths ([0], [1]), a list on one rank and a tuple elsewhere
    g = [torch.ones(4), torch.ones(3)]
    fh.reduce_grads(g if dist.get_rank() == 0 else tuple(g), _hsdp(), last=True)


def _last_differs():
    fh.reduce_grads(_grads(), _hsdp(), last=dist.get_rank() == 2)


def _last_differs_ddp():  # ddp's non-last call issues no collective; it is still compared
    fh.reduce_grads(_grads(), fh.ddp(dist_mesh()), last=dist.get_rank() == 2)


def _spec_differs():
    mesh = dist_mesh()
    spec = fh.fsdp(mesh) if dist.get_rank() == 0 else _hsdp(mesh)
    fh.reduce_grads(_grads(), spec, last=True)


def _bucket_cap_differs():
    cap = 1.0 if dist.get_rank() == 3 else 25.0
    fh.reduce_grads(_grads(), _hsdp(bucket_cap_mb=cap), last=True)


def _calls_differ():
    spec = _hsdp()
    params = fh.shard({"b": torch.zeros(5), "w": torch.zeros(5, 3)}, spec)
    if dist.get_rank() == 2:
        fh.gather(params, spec)
    else:
        fh.reduce_grads(_grads(), spec, last=True)


def _maingrad_like_differs():
    rank = dist.get_rank()
    spec = _hsdp()
    like = {"w": torch.zeros(6 if rank == 1 else 5, 3)}
    mg = fh.MainGrad(spec, like=like)
    mg.accumulate({"w": torch.ones(6 if rank == 1 else 5, 3)}, last=True)


def _maingrad_last_differs():
    mg = fh.MainGrad(_hsdp(), like={"w": torch.zeros(5, 3)})
    mg.accumulate({"w": torch.ones(5, 3)}, last=dist.get_rank() == 0)


def _shape_changes_after_the_first_step():
    spec = _hsdp()
    for step in range(3):  # a healthy step first: the check is per call, not per layout
        shape = (4, 3) if step == 2 and dist.get_rank() == 1 else (5, 3)
        acc = fh.reduce_grads(_grads(step, w=shape), spec, last=False)
        fh.reduce_grads(_grads(step, w=shape), spec, last=True, acc=acc)


def _last_changes_after_the_first_step():
    spec = _hsdp()
    for step in range(2):
        last = step == 1 and dist.get_rank() == 3
        acc = fh.reduce_grads(_grads(step), spec, last=False)
        fh.reduce_grads(_grads(step), spec, last=True, acc=acc)
        fh.reduce_grads(_grads(step), spec, last=last)


def _check_finite_on_one_rank():
    fh.reduce_grads(_grads(), _hsdp(), last=True, check_finite=dist.get_rank() == 0)


def _dp_axes_differ():  # ranks that exchanged over their own axes would wait in other groups
    mesh = dist_mesh()
    spec = fh.fsdp(mesh, "dp_inner") if dist.get_rank() == 1 else fh.fsdp(mesh)
    fh.reduce_grads(_grads(), spec, last=True)


CROSS_RANK = {
    "shape": (_shape_differs, ["grads['w']: shape (5, 3) on ranks [0, 1, 3] but (4, 3) on rank 2"]),
    "dtype": (
        _dtype_differs,
        ["grads['w']: dtype torch.float32 on ranks [0, 2, 3] but torch.float64 on rank 1"],
    ),
    "tree": (
        _tree_differs,
        [
            "grads['w']: the tree structure differs across ranks at leaf 1: grads['w'] on "
            "ranks [0, 1, 2] but grads['c'] on rank 3"
        ],
    ),
    "container": (_container_differs, ["the tree structure differs across ranks", "on rank 0"]),
    "last": (
        _last_differs,
        ["last differs across ranks: last=False on ranks [0, 1, 3] but last=True on rank 2"],
    ),
    "last_ddp": (_last_differs_ddp, ["last=False on ranks [0, 1, 3] but last=True on rank 2"]),
    "spec": (_spec_differs, ["grads['b']: spec", "on rank 0 but", "on ranks [1, 2, 3]"]),
    "bucket_cap": (_bucket_cap_differs, ["bucket_cap_mb=25.0 on ranks [0, 1, 2] but", "on rank 3"]),
    "shape_later": (
        _shape_changes_after_the_first_step,
        ["grads['w']: shape (5, 3) on ranks [0, 2, 3] but (4, 3) on rank 1"],
    ),
    "last_later": (
        _last_changes_after_the_first_step,
        ["last=False on ranks [0, 1, 2] but last=True on rank 3"],
    ),
    "check_finite_one_rank": (
        _check_finite_on_one_rank,
        ["options differs across ranks", "check_finite=True", "on rank 0"],
    ),
    "dp_axes": (_dp_axes_differ, ["dp axes differs across ranks", "dp_inner on rank 1"]),
    "calls": (
        _calls_differ,
        ["call differs across ranks: reduce_grads on ranks [0, 1, 3] but gather on rank 2"],
    ),
    "maingrad_like": (
        _maingrad_like_differs,
        ["grads['w']: shape (5, 3) on ranks [0, 2, 3] but (6, 3) on rank 1"],
    ),
    "maingrad_last": (
        _maingrad_last_differs,
        ["last=True on rank 0 but last=False on ranks [1, 2, 3]"],
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CROSS_RANK))
def test_cross_rank_mismatch_raises_the_same_error_on_every_rank(pool, case):
    task, texts = CROSS_RANK[case]
    messages = _expect_on_every_rank(pool, task, "ValueError", *texts)
    assert len(set(messages)) == 1  # the very same message on every rank
    assert "cross-rank check before the first collective" in messages[0]


def _fp16_average_does_not_overflow():
    g = {"w": torch.full((4,), 40000.0, dtype=torch.float16)}  # 4 x 40000 > 65504
    avg = fh.reduce_grads(g, fh.ddp(dist_mesh()), last=True)["w"]
    mg = fh.MainGrad(fh.ddp(dist_mesh()), like=g, dtype=torch.float16)
    mg.accumulate(g, last=True)
    return avg, mg.grads["w"]


def test_fp16_reductions_pre_and_post_divide_on_gloo(pool):
    for avg, main in pool.run(_fp16_average_does_not_overflow, timeout=60):
        assert torch.equal(avg, torch.full((4,), 40000.0, dtype=torch.float16)), avg
        assert torch.equal(main, avg)


def _complex_leaf():
    fh.reduce_grads({"c": torch.ones(3, dtype=torch.complex64)}, _hsdp(), last=True)


@pytest.mark.timeout(60)
def test_complex_leaves_are_refused_naming_the_path(pool):
    _expect_on_every_rank(pool, _complex_leaf, "TypeError", "grads['c']: complex gradients")


def _nan_on_rank_2(maingrad: bool):
    g = _grads(a=(3,), w=(5, 3))
    if dist.get_rank() == 2:
        g["w"][1, 1] = float("nan")
    if maingrad:
        fh.MainGrad(_hsdp(), like=g).accumulate(g, last=True, check_finite=True)
    else:
        fh.reduce_grads(g, _hsdp(), last=True, check_finite=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("maingrad", [False, True], ids=["reduce_grads", "MainGrad"])
def test_nan_on_one_rank_with_check_finite_raises_on_every_rank(pool, maingrad):
    messages = _expect_on_every_rank(
        pool,
        _nan_on_rank_2,
        "ValueError",
        "grads['w']: holds NaN or Inf on rank 2",
        args=(maingrad,),
    )
    assert len(set(messages)) == 1


def _check_finite_every_call():
    spec, out = _hsdp(), []
    for step in range(3):
        g = _grads(step)
        if step == 2 and dist.get_rank() == 3:
            g["b"][0] = float("inf")
        try:
            fh.reduce_grads(g, spec, last=True, check_finite=True)
            out.append("ok")
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(60)
def test_check_finite_checks_every_call_not_only_the_first(pool):
    for out in pool.run(_check_finite_every_call, timeout=60):
        assert out[:2] == ["ok", "ok"]
        assert out[2].startswith("grads['b']: holds NaN or Inf on rank 3")


# -- local bad input given on every rank --------------------------------------------------


def _sparse_leaf():
    fh.reduce_grads({"w": torch.ones(5, 3), "s": torch.ones(4).to_sparse()}, _hsdp(), last=True)


def _meta_leaf():
    g = {"w": torch.ones(5, 3), "m": torch.empty(4, device="meta")}
    fh.reduce_grads(g, _hsdp(), last=True)


def _int_leaf():
    fh.reduce_grads(
        {"w": torch.ones(5, 3), "i": torch.ones(4, dtype=torch.int32)}, _hsdp(), last=True
    )


def _non_tensor_leaf():
    fh.reduce_grads({"w": torch.ones(5, 3), "lr": 0.1}, _hsdp(), last=True)


def _acc_of_another_structure():
    spec = _hsdp()
    acc = fh.reduce_grads(_grads(), spec, last=False)
    fh.reduce_grads(_grads(), spec, last=True, acc={"w": acc["w"]})


def _finalized_acc():
    spec = _hsdp()
    g = {"w": torch.ones(5, 3)}
    final = fh.reduce_grads(g, spec, last=True)
    fh.reduce_grads(g, spec, last=True, acc=final)


def _last_not_a_bool():
    fh.reduce_grads({"w": torch.ones(3)}, _hsdp(), last="yes")


def _acc_of_another_shape():
    g = {"w": torch.ones(5, 3)}
    fh.reduce_grads(g, fh.fsdp(dist_mesh()), last=True, acc={"w": torch.ones(15)})


LOCAL = {
    "sparse": (_sparse_leaf, "TypeError", "grads['s']: expected a dense (strided) tensor"),
    "meta": (_meta_leaf, "ValueError", "grads['m']: is on the meta device"),
    "int": (_int_leaf, "TypeError", "grads['i']: gradients must have a floating dtype"),
    "non_tensor": (_non_tensor_leaf, "TypeError", "grads['lr']: expected a torch.Tensor"),
    "acc_structure": (_acc_of_another_structure, "ValueError", "acc does not have the structure"),
    "acc_finalized": (_finalized_acc, "ValueError", "acc['w']: is a finalized result"),
    "last_not_bool": (_last_not_a_bool, "TypeError", "last must be a bool"),
    "acc_shape": (_acc_of_another_shape, "ValueError", "acc['w']: expected local shape"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(LOCAL))
def test_local_bad_input_raises_on_every_rank(pool, case):
    task, exc, text = LOCAL[case]
    _expect_on_every_rank(pool, task, exc, text)


# -- documented behaviours ----------------------------------------------------------------


def _documented():
    spec = _hsdp()
    with fh.comm_log() as log:
        empty = fh.reduce_grads({}, spec, last=True)
    w = torch.ones(5, 3, requires_grad=True)
    g = {
        "z": torch.ones(0, 3),
        "t": (torch.arange(12.0).reshape(3, 4) * (dist.get_rank() + 1)).t(),
        "r": w * (dist.get_rank() + 1),
    }
    out = fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    return empty, log.events, out, [x.requires_grad for x in optree.tree_leaves(out)]


@pytest.mark.timeout(60)
def test_empty_zero_size_non_contiguous_and_requires_grad_leaves_work(pool):
    mean = (1 + 2 + 3 + 4) / 4
    for empty, events, out, requires_grad in pool.run(_documented, timeout=60):
        assert empty == {} and events == []
        assert out["z"].shape == (0, 3)
        torch.testing.assert_close(out["t"], torch.arange(12.0).reshape(3, 4).t() * mean)
        torch.testing.assert_close(out["r"], torch.full((5, 3), mean))
        assert not any(requires_grad)


# -- determinism --------------------------------------------------------------------------


def _repeatable():
    spec = fh.hfsdp(dist_mesh(), "dp_outer", "dp_inner", bucket_cap_mb=40 * 4 / 2**20)
    runs = []
    for _ in range(3):
        acc = None
        for m, last in fh.microbatches(3):
            acc = fh.reduce_grads(_grads(m, a=(7, 3), b=(33,)), spec, last=last, acc=acc)
        runs.append(fh.gather(acc, spec))
    return runs, os.getpid()


def _bit_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@pytest.mark.timeout(60)
def test_results_are_bit_identical_across_calls_ranks_and_processes(pool):
    first = pool.run(_repeatable, timeout=60)
    pool.close()  # fresh worker processes and process group
    second = pool.run(_repeatable, timeout=60)
    assert {pid for _, pid in first}.isdisjoint(pid for _, pid in second)
    reference = first[0][0][0]
    for (runs_a, _), (runs_b, _) in zip(first, second):
        for run in runs_a + runs_b:  # every call, every rank, both sets of processes
            assert _bit_equal(run, reference)


# -- faults: rank death and lone errors, in their own process groups ----------------------

PG_TIMEOUT_S = 5.0
BOUND_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_main(rank, world, init, conn, task):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    try:
        conn.send(("ok", task()))
    except BaseException as e:
        conn.send(("err", type(e).__name__, str(e), getattr(e, "elapsed", None)))
    time.sleep(120)  # stay alive so that peers wait on us until their timeout; killed below


def _world(task, world: int = 4, deadline: float = 60.0) -> dict[int, tuple]:
    """Run ``task`` on ``world`` fresh gloo processes; {rank: reply} of those that reply."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(DEFAULT_PRELOAD))  # no-op if the pool started it
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs, conns = [], {}
    try:
        for r in range(world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_world_main, args=(r, world, init, send, task), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns[r] = recv
        replies, end = {}, time.monotonic() + deadline
        while conns and time.monotonic() < end:
            for conn in multiprocessing.connection.wait(list(conns.values()), timeout=0.5):
                r = next(k for k, c in conns.items() if c is conn)
                try:
                    replies[r] = conn.recv()
                except EOFError:  # died without a reply
                    pass
                del conns[r]
        return replies
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)


def _short_timeouts(dm) -> None:
    # init_device_mesh gives its groups the backend default (30 min for gloo), not the
    # timeout of init_process_group: set the one this test relies on.
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for d in range(dm.ndim):
        _set_pg_timeout(timedelta(seconds=PG_TIMEOUT_S), dm.get_group(d))


def _timed(fn):
    start = time.monotonic()
    try:
        fn()
    except BaseException as e:
        e.elapsed = time.monotonic() - start
        raise


def _dies_mid_accumulation(maingrad: bool):
    dm = device_mesh(GLOO_SHAPE, AXES)
    _short_timeouts(dm)
    spec = _hsdp(fh.DistMesh(dm))
    mg = fh.MainGrad(spec, like={"w": torch.zeros(5, 3)}) if maingrad else None

    def step(die: bool):
        acc = None
        for m, last in fh.microbatches(2):
            g = {"w": torch.full((5, 3), float(m))}
            if mg is not None:
                mg.accumulate(g, last=last)
            else:
                acc = fh.reduce_grads(g, spec, last=last, acc=acc)
            if die and m == 0 and dist.get_rank() == 2:
                os._exit(1)
        if mg is not None:
            mg.zero_grad()

    step(die=False)  # a healthy step first: the failure is in a gradient collective
    _timed(lambda: step(die=True))
    return "finished"


def _raises_alone():
    dm = device_mesh(GLOO_SHAPE, AXES)
    _short_timeouts(dm)
    spec = _hsdp(fh.DistMesh(dm))
    g = {"w": torch.ones(5, 3)}
    fh.reduce_grads(g, spec, last=True)
    acc = fh.reduce_grads(g, spec, last=False)
    if dist.get_rank() == 2:
        acc = {"w": acc["w"].double()}  # a local error: raised at once, on rank 2 only
    _timed(lambda: fh.reduce_grads(g, spec, last=True, acc=acc))


def _task_dies_mid_accumulation_pure():
    return _dies_mid_accumulation(False)


def _task_dies_mid_accumulation_maingrad():
    return _dies_mid_accumulation(True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "task",
    [_task_dies_mid_accumulation_pure, _task_dies_mid_accumulation_maingrad],
    ids=["reduce_grads", "MainGrad"],
)
def test_a_rank_dying_mid_accumulation_makes_survivors_raise_in_time(task):
    start = time.monotonic()
    replies = _world(task)
    assert sorted(replies) == [0, 1, 3]  # rank 2 died without a reply
    for rank, reply in replies.items():
        assert reply[0] == "err", (rank, reply)
        _, name, message, elapsed = reply
        assert name == "CollectiveError", message
        assert "a peer rank may have died" in message and f"on rank {rank}" in message
        assert (
            "over mesh axis 'dp_" in message or "over mesh axes 'dp_outer', 'dp_inner'" in message
        )
        assert elapsed < BOUND_S, (rank, elapsed)
    assert time.monotonic() - start < 60


@pytest.mark.timeout(90)
def test_a_rank_raising_alone_makes_the_others_raise_in_time():
    replies = _world(_raises_alone)
    assert sorted(replies) == [0, 1, 2, 3]
    name, message = replies[2][1:3]
    assert name == "TypeError" and "acc['w']: expected dtype" in message
    for rank in (0, 1, 3):  # told in the call's one exchange: they raise at once, naming it
        _, name, message, elapsed = replies[rank]
        assert name == "TypeError" and "acc['w']: expected dtype" in message, message
        assert "raised on rank 2" in message
        assert elapsed < BOUND_S, (rank, elapsed)


def _stalls(mesh_timeout):
    """Rank 2 is alive but late (busy elsewhere): the others' waits are bounded."""
    dm = device_mesh(GLOO_SHAPE, AXES)  # groups with gloo's default 30 min timeout
    spec = _hsdp(fh.DistMesh(dm) if mesh_timeout is None else fh.DistMesh(dm, timeout=2.0))
    g = {"w": torch.ones(5, 3)}
    fh.reduce_grads(g, spec, last=True)
    if dist.get_rank() == 2:
        time.sleep(PG_TIMEOUT_S + 3)
    _timed(lambda: fh.reduce_grads(g, spec, last=True))


def _task_stalls_default():
    return _stalls(None)


def _task_stalls_explicit():
    return _stalls(2.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("task", "bound"),
    [(_task_stalls_default, PG_TIMEOUT_S + 10), (_task_stalls_explicit, 2.0 + 10)],
    ids=["process_group_timeout", "DistMesh_timeout"],
)
def test_a_late_rank_makes_the_others_raise_within_the_timeout(task, bound):
    """The mesh's groups keep gloo's 30 min default, but the library's waits honour the
    default process group's timeout, or DistMesh(dm, timeout=...)."""
    replies = _world(task)
    for rank in (0, 1, 3):
        _, name, message, elapsed = replies[rank]
        assert name == "CollectiveError", message
        assert "exchange over mesh ax" in message and "timeout" in message
        assert elapsed < bound, (rank, elapsed)
