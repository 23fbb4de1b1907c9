"""Integration on 4 real gloo processes (2x2 mesh), started once for the module.

The reference parity test (as in Megatron-LM PR 5743): a small MLP trained 5 steps with SGD
through torch.func matches a single-rank baseline; DistMesh gives SimMesh's outputs and logs;
comm_log's counts agree with torch.profiler's c10d events; overlap on and off, by the order of
issues and waits; no collective on a size-1 axis. (Bad input on every rank:
tests/runtime/test_reliability_gloo.py.)
"""

from __future__ import annotations

import time

import optree
import pytest
import torch
import torch.distributed as dist
from reference import (
    AXES,
    GLOO_SHAPE,
    MLP_IN,
    STRATEGIES,
    accumulate,
    check_acc_reuse,
    dense_reduce,
    dist_mesh,
    dist_preset,
    every_call,
    issue_and_wait_order,
    mlp_loss,
    mlp_problem,
    mlp_step,
    preset,
    random_tree,
    this_rank,
)
from torch.func import grad_and_value

import functional_hsdp as fh
from functional_hsdp.mesh.launch import device_mesh

# -- the reference parity test -------------------------------------------------------------

LR = 0.2
WORLD = GLOO_SHAPE[0] * GLOO_SHAPE[1]
CAP_40 = 40 * 4 / 2**20  # bucket cap of 40 elements: several buckets


def _train_dist(strategy: str, steps: int, microbatches: int):
    spec = dist_preset(strategy)
    model, full0, x, y = mlp_problem(WORLD, microbatches)
    step_grad = grad_and_value(mlp_loss(model))
    rank = dist.get_rank()
    params = fh.shard(full0, spec)
    losses = []
    for _ in range(steps):
        acc, loss = mlp_step(step_grad, fh.gather(params, spec), x[rank], y[rank], spec)
        losses.append(loss)
        params = optree.tree_map(lambda p, g: p - LR * g, params, acc)
    return torch.tensor(losses), fh.gather(params, spec)


def _train_single_rank(steps: int, microbatches: int):
    model, params, x, y = mlp_problem(WORLD, microbatches)
    step_grad = grad_and_value(mlp_loss(model))
    losses = []
    for _ in range(steps):
        g, loss = step_grad(params, x.reshape(-1, MLP_IN), y.reshape(-1, 1))
        losses.append(loss.item())
        params = optree.tree_map(lambda p, g: p - LR * g, params, g)
    return torch.tensor(losses), params


@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_losses_match_single_rank_sgd(pool, strategy, microbatches):
    results = pool.run(_train_dist, strategy, 5, microbatches)
    ref_losses, ref_params = _train_single_rank(5, microbatches)
    # each rank's loss is the mean over its samples; equal sizes make their mean the global one
    losses = torch.stack([r[0] for r in results]).mean(0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]
    for _, final in results:
        for k in ref_params:
            torch.testing.assert_close(final[k], ref_params[k], rtol=1e-5, atol=1e-6)


# -- SimMesh and DistMesh agree ------------------------------------------------------------


def _micro(dtype: torch.dtype, microbatches: int):
    return [random_tree(GLOO_SHAPE, dtype, seed=m) for m in range(microbatches)]


def _reduce_on_rank(strategy: str, dtype: torch.dtype, microbatches: int, cap: float):
    spec = dist_preset(strategy, bucket_cap_mb=cap)
    local = [this_rank(g) for g in _micro(dtype, microbatches)]
    with fh.comm_log() as log:
        out = accumulate(local, spec)
        full = fh.gather(out, spec)
    return out, full, log.events


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dist_mesh_gives_sim_mesh_outputs_and_logs(pool, strategy, dtype):
    cap = 40 * 4 / 2**20  # several buckets
    results = pool.run(_reduce_on_rank, strategy, dtype, 3, cap)
    spec = preset(strategy, fh.SimMesh(dict(zip(AXES, GLOO_SHAPE))), bucket_cap_mb=cap)
    micro = _micro(dtype, 3)
    with fh.comm_log() as log:
        sim = accumulate(micro, spec)
        sim_full = fh.gather(sim, spec)
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for rank, (out, full, events) in enumerate(results):
        o, i = divmod(rank, GLOO_SHAPE[1])
        assert events == log.events
        for path, d, s in zip(
            optree.tree_paths(out), optree.tree_leaves(out), optree.tree_leaves(sim)
        ):
            mine = s[o, i]
            if mine.shape != d.shape:  # a ragged Flat piece: SimMesh zero-fills to the longest
                assert d.dim() == 1 and mine.dim() == 1, path
                assert not mine[d.shape[0] :].any(), path
                mine = mine[: d.shape[0]]
            torch.testing.assert_close(d, mine, **tol, msg=str(path))
        for d, s in zip(optree.tree_leaves(full), optree.tree_leaves(sim_full)):
            torch.testing.assert_close(d, s[o, i], **tol)


# -- comm_log against torch.profiler -------------------------------------------------------

# The op a profiler records for each logged collective, by how the mesh carried it out: on
# gloo both reductions are in-place c10d all-reduces and all-gathers c10d
# all_gather_single (see DistMesh); functional otherwise.
_FUNCTIONAL = {
    "reduce_scatter": "_c10d_functional::reduce_scatter_tensor",
    "all_reduce": "_c10d_functional::all_reduce",
    "all_gather": "_c10d_functional::all_gather_into_tensor",
}
_C10D = {"c10d in-place": "c10d::allreduce_", "c10d all_gather": "c10d::_allgather_base_"}


def _profiler_name(event: fh.Event) -> str:
    found = [name for impl, name in _C10D.items() if event.impl.startswith(impl)]
    return found[0] if found else _FUNCTIONAL[event.op]


def _profiled_step(strategy: str, microbatches: int, cap: float):
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    spec = dist_preset(strategy, bucket_cap_mb=cap)
    local = [this_rank(g) for g in _micro(torch.float32, microbatches)]
    params = fh.shard(random_tree((), seed=9), spec)
    with profile(activities=[ProfilerActivity.CPU]) as prof, fh.comm_log() as log:
        accumulate(local, spec)
        fh.gather(params, spec)
    expected = Counter(_profiler_name(e) for e in log.events)
    names = {*_FUNCTIONAL.values(), *_C10D.values()}
    seen = Counter(e.name for e in prof.events() if e.name in names)
    return dict(expected), dict(seen), log.summary()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_comm_counts_agree_with_profiler_c10d_events(pool, strategy):
    microbatches, cap = 3, 40 * 4 / 2**20
    results = pool.run(_profiled_step, strategy, microbatches, cap)
    for logged, profiled, _ in results:
        assert logged == profiled
    if strategy == "hsdp":
        summary = results[0][2]
        buckets = summary[("dp_outer", "all_reduce")][0]
        assert buckets > 1
        assert summary[("dp_inner", "reduce_scatter")][0] == microbatches * buckets


# -- MainGrad: the reference parity test in both zero_grad modes ---------------------------


def _train_maingrad(strategy: str, steps: int, microbatches: int, set_to_none: bool):
    spec = dist_preset(strategy)
    model, full0, x, y = mlp_problem(WORLD, microbatches)
    step_grad = grad_and_value(mlp_loss(model))
    rank = dist.get_rank()
    params = fh.shard(full0, spec)
    mg = fh.MainGrad(spec, like=full0)
    losses, pure_equal, pointers = [], True, []

    def accumulate_main_grad(g, last):
        mg.accumulate(g, last=last)

    for _ in range(steps):
        full = fh.gather(params, spec)
        acc, loss_sum = mlp_step(step_grad, full, x[rank], y[rank], spec, accumulate_main_grad)
        grads = mg.grads
        pointers.append([t.data_ptr() for t in optree.tree_leaves(grads)])
        pure_equal &= all(
            torch.equal(a, b) for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(acc))
        )
        losses.append(loss_sum)
        params = optree.tree_map(lambda p, g: p - LR * g, params, grads)
        mg.zero_grad(set_to_none=set_to_none)
    return torch.tensor(losses), pure_equal, pointers


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_maingrad_training_matches_single_rank_sgd(pool, microbatches, set_to_none):
    results = pool.run(_train_maingrad, "hsdp", 5, microbatches, set_to_none)
    ref_losses, _ = _train_single_rank(5, microbatches)
    losses = torch.stack([r[0] for r in results]).mean(0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for _, pure_equal, pointers in results:
        assert pure_equal  # the MainGrad path and the pure path give identical grads
        assert all(p == pointers[0] for p in pointers)  # views of the same storage every step


# -- Shard(d): FSDP2-style per-leaf shards; DTensor export and torch.distributed.checkpoint --

SHARD_SHAPES = {"a": (7, 3), "b": (5, 4), "c": (1, 6), "z": (13, 11)}


def _shard_spec(mesh: fh.Mesh, dim: int) -> fh.Spec:
    R, P, S = fh.Replicate(), fh.Partial("avg"), fh.Shard(dim)
    return fh.Spec(mesh, [R, S], [P, S], [R, S], bucket_cap_mb=60 * 4 / 2**20)


def _shard_on_rank(dim: int):
    spec = _shard_spec(dist_mesh(), dim)
    micro = [random_tree(GLOO_SHAPE, shapes=SHARD_SHAPES, seed=m) for m in range(3)]
    local = [this_rank(g) for g in micro]
    out = accumulate(local, spec)
    return (
        out,
        fh.gather(out, spec),
        {k: v.full_tensor() for k, v in fh.to_dtensor(out, spec).items()},
    )


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_dim_local_shards_are_torch_chunks(pool, dim):
    results = pool.run(_shard_on_rank, dim)
    micro = [random_tree(GLOO_SHAPE, shapes=SHARD_SHAPES, seed=m) for m in range(3)]
    ref = optree.tree_map(lambda x: x.float(), dense_reduce(micro, 2))
    sim_spec = _shard_spec(fh.SimMesh(dict(zip(AXES, GLOO_SHAPE))), dim)
    sim = accumulate(micro, sim_spec)
    for rank, (out, full, exported) in enumerate(results):
        o, i = divmod(rank, GLOO_SHAPE[1])
        for k in ref:
            chunks = torch.chunk(ref[k], GLOO_SHAPE[1], dim=dim)
            want = chunks[i] if i < len(chunks) else ref[k].narrow(dim, 0, 0)
            torch.testing.assert_close(out[k], want, rtol=1e-5, atol=1e-6)
            # SimMesh holds the same chunk, zero-filled to the first chunk's size
            torch.testing.assert_close(
                out[k], sim[k][o, i].narrow(dim, 0, out[k].shape[dim]), rtol=0, atol=0
            )
            torch.testing.assert_close(full[k], ref[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(exported[k], ref[k], rtol=1e-5, atol=1e-6)


def _acc_reuse_on_rank(strategy: str, cap: float):
    spec = dist_preset(strategy, bucket_cap_mb=cap)
    return check_acc_reuse(strategy, spec, (), rank=dist.get_rank())


@pytest.mark.parametrize("cap", [25.0, 1e-5], ids=["one-bucket", "a-bucket-per-leaf"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_acc_given_back_as_returned_matches_a_fresh_copy(pool, strategy, cap):
    """... and is read from its bucket buffers: no bucket of it is packed again (on a real rank
    every result leaf views its bucket), while a copy of it is."""
    for as_returned, fresh in pool.run(_acc_reuse_on_rank, strategy, cap):
        assert as_returned == [] and fresh, (as_returned, fresh)


def _overlap_off_on_rank(strategy: str):
    dm = device_mesh(GLOO_SHAPE, AXES)
    micro = [this_rank(random_tree(GLOO_SHAPE, seed=m)) for m in range(3)]
    out, logs = [], []
    for mesh in (fh.DistMesh(dm), fh.DistMesh(dm, overlap=False)):
        spec = preset(strategy, mesh, bucket_cap_mb=1e-4)  # a bucket per leaf or so
        with fh.comm_log() as log:
            out.append(accumulate(micro, spec))
            for wire in (None, torch.float16):  # fp16: pre- and post-divided around the sum
                mg = fh.MainGrad(spec, like=micro[0], reduce_dtype=wire)
                for m, g in enumerate(micro):
                    mg.accumulate(g, last=m == 2)
                out.append(optree.tree_map(torch.clone, mg.grads))
        logs.append(log.events)
    a, b = (optree.tree_leaves(x) for x in out[:3]), (optree.tree_leaves(x) for x in out[3:])
    same = [all(map(torch.equal, x, y)) for x, y in zip(a, b)]
    fp16_close = all(
        torch.allclose(x, y, rtol=1e-2, atol=1e-2)
        for x, y in zip(optree.tree_leaves(out[1]), optree.tree_leaves(out[2]))
    )
    try:
        fh.DistMesh(dm, overlap="no")
        refused = False
    except TypeError as e:
        refused = "overlap must be a bool" in str(e)
    return all(same) and refused, fp16_close, logs[0] == logs[1], len({e.axis for e in logs[0]})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overlap_off_gives_the_same_bits_and_collectives(pool, strategy):
    for same, fp16_close, same_log, axes in pool.run(_overlap_off_on_rank, strategy):
        assert same and fp16_close and same_log and axes == 2


def _issue_and_wait_order_on_rank(overlap: bool):
    mesh = fh.DistMesh(device_mesh(GLOO_SHAPE, AXES), overlap=overlap)
    spec = fh.hsdp(mesh, *AXES, bucket_cap_mb=CAP_40)
    g = {k: torch.randn(40) for k in "abc"}  # a bucket each
    acc = fh.reduce_grads(g, spec, last=False)
    with issue_and_wait_order(mesh) as order:
        fh.reduce_grads(g, spec, last=True, acc=acc)
    return order


RS, AR = "issue reduce_scatter dp_inner", "issue all_reduce dp_outer"


def test_overlap_issues_every_bucket_before_waiting_and_overlap_off_waits_each(pool):
    """With overlap (the default) bucket b+1's reduce-scatter is issued before bucket b's is
    waited, and each bucket's dp_outer all-reduce while later buckets' reduce-scatters are in
    flight; DistMesh(overlap=False) waits for each collective as it issues it. Recorded by
    wrapping the mesh's collectives and wait (tests/runtime/test_comm_counts.py: the same on a
    SimMesh)."""
    step_major = [
        f"{RS} #0", f"{RS} #1", f"{RS} #2",
        "wait #0", f"{AR} #3", "wait #1", f"{AR} #4", "wait #2", f"{AR} #5",
        "wait #3", "wait #4", "wait #5",
    ]  # fmt: skip
    one_at_a_time = [
        f"{RS} #0", "wait #0", f"{RS} #1", "wait #1", f"{RS} #2", "wait #2",
        f"{AR} #3", "wait #3", f"{AR} #4", "wait #4", f"{AR} #5", "wait #5",
    ]  # fmt: skip
    assert pool.run(_issue_and_wait_order_on_rank, True) == [step_major] * WORLD
    assert pool.run(_issue_and_wait_order_on_rank, False) == [one_at_a_time] * WORLD


def _events_on_rank(shape: tuple[int, int], strategy: str):
    mesh = fh.DistMesh(device_mesh(shape, AXES))
    with fh.comm_log() as log:
        every_call(preset(strategy, mesh, bucket_cap_mb=CAP_40), seed=dist.get_rank())
    return sorted({e.axis for e in log.events})


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)], ids=["outer-1", "inner-1"])
def test_no_collective_on_a_size_1_axis(pool, shape):
    """A size-1 axis of a DistMesh moves nothing (tests/runtime/test_comm_counts.py: SimMesh)."""
    wide = AXES[shape.index(4)]
    for strategy in STRATEGIES:
        assert pool.run(_events_on_rank, shape, strategy) == [[wide]] * WORLD, strategy


def _error_after_issue_on_rank(where: str):
    import gc
    import weakref

    from functional_hsdp.plan import recipe as plan_module

    spec = fh.ddp(dist_mesh(), bucket_cap_mb=1e-3)
    g = {k: torch.ones(256) * (dist.get_rank() + 1) for k in "abcd"}  # a bucket per leaf
    mg = fh.MainGrad(spec, like=g)
    issued = []
    original = plan_module.Plan.pack

    def pack(self, b, leaves, role):
        if b == 2:
            raise MemoryError("simulated: out of memory packing bucket 2")
        out = original(self, b, leaves, role)
        issued.append(weakref.ref(out))
        return out

    def mg_pack(b, leaves):
        if b == 2:
            raise MemoryError("simulated: out of memory packing bucket 2")
        out = type(mg)._pack(mg, b, leaves)
        issued.append(weakref.ref(out))
        return out

    try:
        if where == "reduce_grads":
            plan_module.Plan.pack = pack
            fh.reduce_grads(g, spec, last=True)
        else:
            mg._pack = mg_pack
            mg.accumulate(g, last=True)
    except MemoryError:
        pass
    finally:
        plan_module.Plan.pack = original
    # Every rank issued the same collectives, so they complete. The backend drops a finished
    # collective's buffer on its own thread, at the latest when the group's next collective
    # runs: a gloo barrier alone left one buffer held in about 3 runs of 100 (torch 2.13 and
    # 2.15), freed by the next all-reduce on its group. So the retry comes first (the process
    # group still works, and it gives the right answer), then a poll up to a generous bound
    # for a loaded machine: a buffer still held after it is a leak.
    for axis in spec.mesh.axis_names:
        dist.barrier(group=spec.mesh.group(axis))
    out = fh.reduce_grads(g, spec, last=True)
    deadline = time.monotonic() + 20
    while True:
        gc.collect()
        leaked = [r() for r in issued if r() is not None]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return len(issued), len(leaked), out["a"][0].item()


@pytest.mark.parametrize("where", ["reduce_grads", "MainGrad"])
def test_an_error_after_collectives_were_issued_leaks_nothing(pool, where):
    for issued, leaked, value in pool.run(_error_after_issue_on_rank, where):
        assert (issued, leaked, value) == (2, 0, 2.5)


def _shard_storage(strategy: str):
    spec = dist_preset(strategy)
    params = fh.shard(random_tree((), seed=3), spec)
    return [v.untyped_storage().nbytes() for v in optree.tree_leaves(params)]


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_local_shards_do_not_keep_the_full_buffer_alive(pool, strategy):
    # the one bucket: 170 fp32 elements, each leaf at a multiple of 16 (a: 0-20, n[0]: 32-36,
    # n[1].s: 48, z: 64-206), padded to 208; a rank's chunk is 1/ranks of it
    full = 208 * 4
    ranks = WORLD if strategy == "fsdp" else GLOO_SHAPE[1]
    for storages in pool.run(_shard_storage, strategy):
        assert max(storages) <= full // ranks, storages


def _checkpoint_round_trip(strategy: str, path: str):
    import torch.distributed.checkpoint as dcp

    spec = dist_preset(strategy)
    params = fh.shard(random_tree((), seed=3), spec)
    state = {"buckets": fh.to_dtensor(params, spec, per="bucket")}
    dcp.save(state, checkpoint_id=path)
    zeros = optree.tree_map(torch.zeros_like, params)
    target = {"buckets": fh.to_dtensor(zeros, spec, per="bucket", source="optimizer")}
    dcp.load(target, checkpoint_id=path)
    same = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(state["buckets"], target["buckets"])
    )
    norm = torch.nn.utils.get_total_norm(state["buckets"]).full_tensor()
    return same, norm


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "hfsdp"])
def test_to_dtensor_buckets_round_trip_through_distributed_checkpoint(pool, strategy, tmp_path):
    results = pool.run(_checkpoint_round_trip, strategy, str(tmp_path / strategy))
    full = random_tree((), seed=3)
    dense_norm = torch.linalg.vector_norm(
        torch.cat([x.flatten() for x in optree.tree_leaves(full)])
    )
    for same, norm in results:
        assert same
        torch.testing.assert_close(norm, dense_norm)


def _to_dtensor_refusals():
    """What no DTensor describes is refused with the path: a leaf's Flat or Owner piece per
    leaf; per bucket, the kept pieces of Owner on dp_outer only."""
    hsdp = dist_preset("hsdp")
    out = {}
    for name, spec, per in (
        ("owned per leaf", fh.owned(hsdp), "leaf"),
        ("outer per bucket", fh.owned(hsdp, "dp_outer"), "bucket"),
    ):
        try:
            fh.to_dtensor(fh.shard(random_tree((), seed=3), spec), spec, per=per)
            out[name] = "no error"
        except NotImplementedError as e:
            out[name] = str(e)
    owned = fh.owned(hsdp)  # owner-major buckets export as the Flat ones do
    buckets = fh.to_dtensor(fh.shard(random_tree((), seed=3), owned), owned, per="bucket")
    out["owned buckets"] = float(torch.nn.utils.get_total_norm(buckets).full_tensor())
    return out


def test_to_dtensor_refuses_owner_pieces_no_dtensor_describes(pool):
    full = random_tree((), seed=3)
    dense = torch.linalg.vector_norm(torch.cat([x.flatten() for x in optree.tree_leaves(full)]))
    for out in pool.run(_to_dtensor_refusals):
        assert "(or Owner) leaf's local piece is not a DTensor shard" in out["owned per leaf"]
        assert "Owner on ('dp_outer',) only" in out["outer per bucket"]
        assert "state_dict" in out["outer per bucket"]
        assert abs(out["owned buckets"] - dense.item()) < 1e-4
