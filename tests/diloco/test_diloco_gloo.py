"""fh.diloco on 4 gloo ranks (2 replicas x 2 inner): the whole-tree loop and
``fh.functional_call(into=MainGrad)`` equal the naive reference (tests/diloco_problem.py),
every=1 with sgd(1.0) equals HSDP, steps without a sync issue no collective, and a DCP
checkpoint taken in the middle of a period resumes as if never interrupted; with
``compress=``, the same results bit for bit and the same comm_log events as a SimMesh, and a
resume that restores the error feedback's residual. One pool (one process group) for the
module."""

from __future__ import annotations

import contextlib
import itertools
import sys

import optree
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from diloco_problem import INNER_LR, LABELS, Loop, data, full_params, make, model, reference, train

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD, device_mesh
from functional_hsdp.tools.testing import GlooPool

AXES, O, I = ("dp_outer", "dp_inner"), 2, 2  # noqa: E741
STEPS = 7
CASES = [
    dict(every=e, fragments=f, delay=d, mix=m)
    for e, f, d, m in itertools.product((1, 3), (1, 2), (0, 1), (1.0, 0.5))
    if d < e
]


@pytest.fixture(scope="module")
def pool():
    with GlooPool(4, preload=(*DEFAULT_PRELOAD, "pytest", "torch.distributed.checkpoint")) as p:
        yield p


def _mesh() -> fh.DistMesh:
    return fh.DistMesh(device_mesh((O, I), AXES))


def _coords(mesh) -> tuple[int, int]:
    return mesh.coordinate("dp_outer"), mesh.coordinate("dp_inner")


def _error(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _whole_tree(cases) -> list[float]:
    """Per case: this rank's params (its replica's) against the reference's replica."""
    mesh = _mesh()
    o, i = _coords(mesh)
    x, y = data(STEPS, O, I)
    out = []
    for case in cases:
        got, _, _ = train(mesh, full_params(), x[:, o, i], y[:, o, i], steps=STEPS, **case)
        labels = LABELS[case["fragments"]]
        want = reference(full_params(), x, y, every=case["every"], labels=labels,
                         delay=case["delay"], mix=case["mix"],
                         compress=case.get("compress"))[o]  # fmt: skip
        out.append(_error(got, want))
    return out


def test_whole_tree_loop_equals_the_naive_reference(pool):
    for errors in pool.run(_whole_tree, CASES):
        assert max(errors) < 1e-5, errors


def _balanced() -> tuple[list, float]:
    """fh.balanced_fragments from this rank's ragged shards (tagged, and untagged with the
    spec) and from the full params; this rank's error against the reference trained on
    those labels (not contiguous in tree order)."""
    mesh = _mesh()
    o, i = _coords(mesh)
    inner = fh.replicas(fh.hsdp(mesh, *AXES), "dp_outer")
    shards = fh.shard(full_params(), inner)
    untagged = {k: v.clone() for k, v in shards.items()}
    labels = [
        fh.balanced_fragments(shards, 2),
        fh.balanced_fragments(untagged, 2, spec=inner),
        fh.balanced_fragments(full_params(), 2),
    ]
    x, y = data(STEPS, O, I)
    case = dict(every=3, fragments=labels[0], delay=1, mix=0.5)
    got, _, _ = train(mesh, full_params(), x[:, o, i], y[:, o, i], steps=STEPS, **case)
    want = reference(full_params(), x, y, every=3, labels=[labels[0][k] for k in sorted(got)],
                     delay=1, mix=0.5)[o]  # fmt: skip
    return labels, _error(got, want)


def test_balanced_fragments_agree_on_every_rank_and_train_as_the_reference(pool):
    for labels, error in pool.run(_balanced):
        assert labels == [{"0.bias": 0, "0.weight": 1, "2.bias": 0, "2.weight": 0}] * 3
        assert error < 1e-5


def _apart(where: str):
    """Replica 1 makes no call at all while replica 0 runs three steps on the replicas spec
    (validation on, or strict; ``where``: reduce_grads or MainGrad), or one of its ranks
    passes a tree of another shape (``bad``): then every rank meets in a barrier. A message
    of the agreement to replica 1 would wait for an answer that never comes (the mesh's
    timeout, 5 s, turns that wait into an error)."""
    mesh = fh.DistMesh(device_mesh((O, I), AXES), timeout=5.0)
    o, i = _coords(mesh)
    inner = fh.replicas(fh.hsdp(mesh, *AXES), "dp_outer")
    out = None
    if o == 0:
        g = {"w": torch.full((8, 4), float(i + 1)), "b": torch.ones(4)}
        if where == "bad" and i == 1:
            g["w"] = torch.ones(4, 8)
        try:
            with fh.validation("strict" if where == "strict" else "on"):
                for _ in range(3):
                    if where == "MainGrad":
                        mg = fh.MainGrad(inner, like=g)
                        mg.accumulate(g, last=True)
                        out = mg.grads["w"].flatten()[0].item()
                    else:
                        out = fh.reduce_grads(g, inner, last=True)["w"].flatten()[0].item()
        except (ValueError, fh.CollectiveError) as e:
            out = f"{type(e).__name__}: {e}"
    dist.barrier()
    return o, out


@pytest.mark.parametrize("where", ["reduce_grads", "MainGrad", "strict"])
def test_a_replicas_spec_agrees_within_its_replica_never_waiting_for_another(pool, where):
    for o, out in pool.run(_apart, where):
        assert out == (1.5 if o == 0 else None), out  # the inner mean of 1 and 2


def test_a_bad_tree_on_one_rank_of_a_replica_raises_on_that_replica_only(pool):
    outs = pool.run(_apart, "bad")
    assert [o for o, _ in outs] == [0, 0, 1, 1] and outs[2][1] is None and outs[3][1] is None
    for _, out in outs[:2]:  # both ranks of replica 0, not a timeout
        assert out.startswith("ValueError") and "(4, 8)" in out, out


def _module(cases) -> list[float]:
    """The model's own forward through shard_module/functional_call(into=MainGrad), units
    per Linear, fragments as a label per unit (a prefix tree) or an int."""
    mesh = _mesh()
    o, i = _coords(mesh)
    x, y = data(STEPS, O, I)
    out = []
    for case in cases:
        net = model()
        frag = {"0": 0, "2": 1} if case["fragments"] == 2 else 1
        dl = make(fh.hsdp(mesh, *AXES), **{**case, "fragments": frag})
        shards, tree_spec = fh.shard_module(net, dl.inner, units=[net[0], net[2]])
        mg = fh.MainGrad(tree_spec, like=shards)
        state = dl.init(shards)

        def loss_fn(s, xb, yb, net=net, mg=mg):
            pred = fh.functional_call(net, s, (xb,), into=mg)
            return torch.nn.functional.mse_loss(pred, yb)

        for t in range(STEPS):
            mg.begin_microbatch(last=True)
            torch.func.grad(loss_fn)(shards, x[t, o, i], y[t, o, i])
            mg.finish()
            for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(mg.grads)):
                p.sub_(INNER_LR * g)
            mg.zero_grad()
            new, state = dl.update(shards, state)
            for p, q in zip(optree.tree_leaves(shards), optree.tree_leaves(new)):
                if p is not q:
                    p.copy_(q)  # the units' shards stay the tensors shard_module made
        full = fh.gather(shards, tree_spec)
        got = {f"{u}.{k}": v for u, leaves in full.items() for k, v in leaves.items()}
        want = reference(full_params(), x, y, every=case["every"], labels=LABELS[case["fragments"]],
                         delay=case["delay"], mix=case["mix"], compress=case.get("compress"),
                         units=[["0.bias", "0.weight"], ["2.bias", "2.weight"]])[o]  # fmt: skip
        out.append(_error(got, want))
    return out


def test_functional_call_into_maingrad_equals_the_naive_reference(pool):
    cases = [c for c in CASES if c["every"] == 3 or c["mix"] == 1.0]
    for errors in pool.run(_module, cases):
        assert max(errors) < 1e-5, errors


def _hsdp_and_events():
    mesh = _mesh()
    o, i = _coords(mesh)
    x, y = data(6, O, I)
    spec = fh.hsdp(mesh, *AXES)
    dl = fh.diloco(spec, axis="dp_outer", every=1, outer=fh.sgd(1.0))
    loops = []
    for sp, d in ((dl.inner, dl), (spec, None)):
        params = fh.shard(full_params(), sp)
        opt = fh.sgd(INNER_LR)
        loops.append(Loop(mesh, sp, d, opt, params, opt.init(params), d and d.init(params)))
    for t in range(6):
        for loop in loops:
            loop.step(x[t, o, i], y[t, o, i])
    a, b = (fh.gather(loop.params, loop.spec) for loop in loops)
    _, events, _ = train(mesh, full_params(), x[:, o, i], y[:, o, i], steps=6, every=3,
                         fragments=2, delay=1)  # fmt: skip
    return _error(a, b), events


def test_every_1_is_hsdp_and_no_collective_runs_between_syncs(pool):
    due = fh.sync_steps(3, 2, 6)
    results = pool.run(_hsdp_and_events)
    for error, events in results:
        assert error < 1e-6
        for t, ev in enumerate(events):  # a rank holding none of a fragment issues nothing
            assert [axis for _, axis, _ in ev] == ["dp_outer"] * len(ev), (t, ev)
            assert len(ev) <= len(due[t]), (t, ev)
    for t in range(6):  # at a sync every fragment's pieces cross, split over the inner ranks
        sent = sum(n for _, events in results[:I] for _, _, n in events[t])
        assert (sent > 0) == bool(due[t]), t


def _save(loop: Loop, dl, path: str) -> None:
    """DCP: the loop's params and inner optimizer state (per replica) and its DiLoCo state."""
    saved = {
        "params": fh.state_dict(loop.params, dl.inner),
        "inner": fh.state_dict(loop.opt_state, dl.inner),
        "diloco": fh.state_dict(loop.state, dl.inner),
    }
    dcp.save(saved, checkpoint_id=path)


def _load(mesh, dl, opt, path: str, **load_kw) -> Loop:
    """A fresh loop of ``dl`` and ``opt`` whose trees are all loaded from ``path``
    (``load_kw``: ``dcp.load``'s, e.g. ``process_group``)."""
    like = optree.tree_map(lambda v: torch.empty_like(v, device="meta"), full_params())
    target = {
        "params": fh.empty_state_dict(like, dl.inner),
        "inner": fh.empty_state_dict(opt.init(like), dl.inner),
        "diloco": fh.empty_state_dict(dl.init(like), dl.inner),
    }
    dcp.load(target, checkpoint_id=path, **load_kw)
    return Loop(
        mesh,
        dl.inner,
        dl,
        opt,
        fh.load_state_dict(target["params"], dl.inner, like),
        fh.load_state_dict(target["inner"], dl.inner, opt.init(like)),
        fh.load_state_dict(target["diloco"], dl.inner, dl.init(like)),
    )


def _resume(path: str, before: int, after: int, compress=None, drop_residual=False):
    """Train ``before`` steps, save everything (params and inner momentum per replica, the
    DiLoCo state), train ``after`` more; load into fresh trees and train the same steps
    (``drop_residual``: with the loaded residual of ``compress``'s error feedback zeroed)."""
    mesh = _mesh()
    o, i = _coords(mesh)
    x, y = data(before + after, O, I)
    dl = make(fh.hsdp(mesh, *AXES), every=3, fragments=2, delay=1, mix=0.5, compress=compress)
    opt = fh.sgd(INNER_LR, momentum=0.5)
    params = fh.shard(full_params(), dl.inner)
    loop = Loop(mesh, dl.inner, dl, opt, params, opt.init(params), dl.init(params))
    for t in range(before):
        loop.step(x[t, o, i], y[t, o, i])
    in_flight, at_save = any(loop.state.due), fh.gather(loop.params, dl.inner)
    _save(loop, dl, path)
    for t in range(before, before + after):
        loop.step(x[t, o, i], y[t, o, i])
    resumed = _load(mesh, dl, opt, path)
    if drop_residual:
        zeros = optree.tree_map(torch.zeros_like, resumed.state.residual)
        resumed.state = resumed.state._replace(residual=zeros)
    for t in range(before, before + after):
        resumed.step(x[t, o, i], y[t, o, i])
    a, b = fh.gather(loop.params, dl.inner), fh.gather(resumed.params, dl.inner)
    same = all(torch.equal(a[k], b[k]) for k in a)
    return in_flight, at_save, same, resumed.state.count


def test_a_checkpoint_mid_period_with_a_sync_in_flight_resumes_exactly(pool, tmp_path):
    results = pool.run(_resume, str(tmp_path), 4, 4)
    for in_flight, _, same, count in results:
        assert in_flight and same and count == 8
    # the replicas had diverged when saved: each one's own weights came back
    replica0, replica1 = results[0][1], results[2][1]
    assert any(not torch.equal(replica0[k], replica1[k]) for k in replica0)


def _rejoin(path: str, case: dict, before: int, after: int):
    """Every rank trains ``before`` steps and saves (DCP); then replica group 1 (dp_outer
    coordinate 1) restarts: its trees are dropped, and a fresh diloco and inner optimizer
    take params, inner state and DiLoCo state from the checkpoint, loaded by its own ranks
    only (``dcp.load`` over its dp_inner group; the library's calls agree within the
    replica: group 0 takes no part), while group 0 goes on with its live trees. Both train
    ``after`` more steps (group 1 replays its steps since the checkpoint), through the next
    sync; compared with
    an uninterrupted run of the same steps (inner SGD with momentum: its state is restored
    too), which the other tests hold to the naive reference."""
    mesh = _mesh()
    o, i = _coords(mesh)
    x, y = data(before + after, O, I)

    def fresh(dl, opt):
        params = fh.shard(full_params(), dl.inner)
        return Loop(mesh, dl.inner, dl, opt, params, opt.init(params), dl.init(params))

    def inner():
        return fh.sgd(INNER_LR, momentum=0.5)

    dl = make(fh.hsdp(mesh, *AXES), **case)
    ref, loop = fresh(dl, inner()), fresh(dl, inner())
    for t in range(before + after):
        ref.step(x[t, o, i], y[t, o, i])
    for t in range(before):
        loop.step(x[t, o, i], y[t, o, i])
    _save(loop, dl, path)
    in_flight = any(loop.state.due)
    if o == 1:  # this group restarts: nothing of its run is kept
        del loop
        dl2 = make(fh.hsdp(mesh, *AXES), **case)
        group = device_mesh((O, I), AXES).get_group("dp_inner")
        # validation on: a replicas spec's calls agree within the replica (group 0 is busy
        # training and takes no part)
        loop = _load(mesh, dl2, inner(), path, process_group=group)
    for t in range(before, before + after):
        loop.step(x[t, o, i], y[t, o, i])
    got, want = fh.gather(loop.params, loop.spec), fh.gather(ref.params, ref.spec)
    anchor = fh.gather(loop.state.anchor, loop.spec)
    same = all(torch.equal(got[k], want[k]) for k in want) and all(
        torch.equal(anchor[k], v) for k, v in fh.gather(ref.state.anchor, ref.spec).items()
    )
    return in_flight, same, got, anchor, loop.state.count


@pytest.mark.parametrize(
    "case, before, after",
    [  # saved mid-period; the next sync after step 6
        (dict(every=3, fragments=1, delay=0, mix=1.0), 4, 2),
        # saved with fragment 1's sync in flight (lands after step 5); fragment 0 syncs after
        # step 6 (lands after 7), fragment 1 after 8 (lands after 9)
        (dict(every=4, fragments=2, delay=1, mix=1.0), 4, 5),
    ],
)
def test_a_replica_group_restarted_from_a_checkpoint_joins_at_the_next_sync(
    pool, tmp_path, case, before, after
):
    results = pool.run(_rejoin, str(tmp_path), case, before, after)
    for in_flight, same, _, _, count in results:
        assert same and count == before + after, (same, count)
        assert in_flight == (case["delay"] > 0)
    # the groups meet: the same anchor (the averaged weights) on both replicas, and with
    # mix=1 after a sync of the whole model, the same params
    anchors = [r[3] for r in results]
    assert all(torch.equal(anchors[0][k], anchors[2][k]) for k in anchors[0])
    if case["fragments"] == 1:
        a, b = results[0][2], results[2][2]
        assert all(torch.equal(a[k], b[k]) for k in a)


# -- compress= -----------------------------------------------------------------------------------

FORMATS = (torch.int8, torch.float8_e4m3fn, "int4")


def _updates(steps: int) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(3)
    return [
        [{k: 0.05 * (1 + o) * torch.randn(v.shape, generator=gen)
          for k, v in full_params().items()} for o in range(O)]
        for _ in range(steps)
    ]  # fmt: skip


def _outer_steps(mesh, fmt, rows) -> list:
    """Seven steps of dl.update on elementwise inner steps (fragments=2,
    delay=1, mix=0.5): per step the local params, the residual and the events. ``rows``:
    replica o's local shards of a tree (on a SimMesh, every replica's stacked)."""
    dl = make(fh.hsdp(mesh, *AXES), every=2, fragments=2, delay=1, mix=0.5,
              compress=fh.compress(fmt, block=32))  # fmt: skip
    params = fh.shard(full_params(), dl.inner)
    state, out = dl.init(params), []
    for u in _updates(7):
        u = rows([fh.shard(tree, dl.inner) for tree in u])
        with fh.comm_log() as log:
            params, state = dl.update({k: params[k] - u[k] for k in params}, state)
        events = [(e.op, e.axis, e.dtype, e.numel) for e in log.events]
        out.append((optree.tree_map(torch.clone, params), state.residual, events))
    return out


def _outer_steps_task(fmts, cap_mb: float | None = None) -> list:
    mesh = _mesh()
    o = mesh.coordinate("dp_outer")
    with _cap(cap_mb):
        return [_outer_steps(mesh, fmt, lambda trees, o=o: trees[o]) for fmt in fmts]


@contextlib.contextmanager
def _cap(cap_mb: float | None):
    """The pseudo-gradient's bucket cap set to ``cap_mb`` (None: as it is) inside."""
    module = sys.modules["functional_hsdp.diloco.outer"]
    old = module._CAP_MB
    module._CAP_MB = old if cap_mb is None else cap_mb
    try:
        yield
    finally:
        module._CAP_MB = old


def _rows_sim(trees: list[dict]) -> dict:
    return {k: torch.stack([trees[o][k][o] for o in range(O)]) for k in trees[0]}


def _equal(a, b) -> bool:
    """Same leaves bit for bit, ``b``'s SimMesh fill (a ragged Flat piece) past ``a``'s end
    zero."""
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    same = lambda x, y: torch.equal(x, y[: len(x)]) and not y[len(x) :].any()  # noqa: E731
    return len(la) == len(lb) and all(same(x, y) for x, y in zip(la, lb))


def test_compressed_whole_tree_loop_equals_the_naive_reference(pool):
    policy = fh.compress(torch.int8, block=32)
    for errors in pool.run(_whole_tree, [dict(c, compress=policy) for c in CASES]):
        assert max(errors) < 1e-6, errors


def test_compressed_functional_call_into_maingrad_equals_the_naive_reference(pool):
    # a bucket per unit: each inner rank's part of a fragment is its chunk of each unit
    policy = fh.compress(torch.int8, block=32)
    cases = [dict(c, compress=policy) for c in CASES if c["every"] == 3 and c["mix"] == 0.5]
    for errors in pool.run(_module, cases):
        assert max(errors) < 1e-6, errors


def test_compressed_syncs_on_gloo_equal_the_simmesh_bit_for_bit(pool):
    sim_mesh = fh.SimMesh(dict(zip(AXES, (O, I))))
    sims = [_outer_steps(sim_mesh, fmt, _rows_sim) for fmt in FORMATS]
    for rank, runs in enumerate(pool.run(_outer_steps_task, FORMATS)):
        o, i = divmod(rank, I)
        for fmt, got, sim in zip(FORMATS, runs, sims):
            for t, ((params, res, events), (p, r, e)) in enumerate(zip(got, sim)):
                assert events == e, (fmt, t)
                row = lambda tree, o=o, i=i: optree.tree_map(lambda x: x[o, i], tree)  # noqa: E731
                assert _equal(params, row(p)) and _equal(res, row(r)), (fmt, t, rank)
    # several buckets per sync: 26 elements a bucket (the fragments hold 112 and 68 a rank)
    with _cap(1e-4):
        capped = _outer_steps(sim_mesh, FORMATS[0], _rows_sim)
    assert all(len(e) >= 3 for _, _, e in capped[1:])  # a collective per bucket and leg
    for rank, (got,) in enumerate(pool.run(_outer_steps_task, FORMATS[:1], 1e-4)):
        o, i = divmod(rank, I)
        for (params, res, events), (p, r, e) in zip(got, capped):
            assert events == e
            row = lambda tree, o=o, i=i: optree.tree_map(lambda x: x[o, i], tree)  # noqa: E731
            assert _equal(params, row(p)) and _equal(res, row(r)), rank
    due = fh.sync_steps(2, 2, 7)  # a fragment syncs after every step here
    ops = [[op for op, *_ in e] for _, _, e in sims[0]]
    # delay=1: a sync's all-to-all at its issue, its all-gather where it lands, a step later
    landed = [[]] + due[:-1]
    assert ops == [["all_gather"] * len(g) + ["all_to_all"] * len(d) for g, d in zip(landed, due)]
    assert ops[0] == ["all_to_all"] and ops[1] == ["all_gather", "all_to_all"]


def test_a_compressed_checkpoint_mid_period_resumes_exactly_with_its_residual(pool, tmp_path):
    policy = fh.compress(torch.int8, block=32)
    results = pool.run(_resume, str(tmp_path / "kept"), 4, 4, policy)
    for in_flight, _, same, count in results:
        assert in_flight and same and count == 8
    dropped = pool.run(_resume, str(tmp_path / "dropped"), 4, 4, policy, True)
    assert not all(same for _, _, same, _ in dropped)  # the residual carries the rounding


def _mixed_dtypes(path: str):
    """bf16 and fp32 params (two buckets), delay 0: the fp32 residual saved with DCP and
    loaded comes back bit for bit, at the params' local shapes."""
    mesh = _mesh()
    full = {k: v.to(torch.bfloat16) for k, v in full_params().items()}
    full["norm"] = torch.linspace(-1.0, 1.0, 40)
    dl = make(fh.hsdp(mesh, *AXES), every=1, fragments=2, compress=fh.compress(torch.int8))
    params = fh.shard(full, dl.inner)
    state = dl.init(params)
    gen = torch.Generator().manual_seed(mesh.coordinate("dp_outer"))
    for _ in range(2):
        step = {
            k: (0.01 * torch.randn(v.shape, generator=gen)).to(v.dtype) for k, v in params.items()
        }
        params, state = dl.update({k: params[k] - step[k] for k in params}, state)
    dcp.save({"diloco": fh.state_dict(state, dl.inner)}, checkpoint_id=path)
    like = dl.init(optree.tree_map(lambda v: torch.empty_like(v, device="meta"), full))
    target = {"diloco": fh.empty_state_dict(like, dl.inner)}
    dcp.load(target, checkpoint_id=path)
    back = fh.load_state_dict(target["diloco"], dl.inner, like).residual
    kept = state.residual
    return all(back[k].dtype == torch.float32 and torch.equal(back[k], kept[k]) for k in full), [
        float(kept[k].abs().sum()) for k in full
    ]


def test_the_residual_of_mixed_dtype_params_checkpoints_in_fp32(pool, tmp_path):
    results = pool.run(_mixed_dtypes, str(tmp_path))
    assert all(same for same, _ in results)
    assert all(sum(x[k] for _, x in results) > 0 for k in range(5))  # something was kept


# -- a delayed sync overlaps the inner steps ---------------------------------------------------

LATE = 1.0  # seconds replica 1 reaches the sync after replica 0


def _raw_grads(t: int, o: int, i: int) -> dict:
    """Step ``t``'s gradient on rank ``(o, i)``, full shapes: the replicas diverge."""
    return {k: (o + 1) * (1 + 0.5 * i) * t * torch.linspace(-1, 1, v.numel()).view(v.shape)
            for k, v in full_params().items()}  # fmt: skip


def _late_loop(
    mesh, *, delay: int, late: float, coords, compress: bool = False, steps: int = 3
) -> tuple[list, dict]:
    """every=2: the sync issued after step 2 (landing after step 2 + delay); each inner step
    reduces its gradient within the replica. Replica 1 reaches the sync ``late`` s after
    replica 0. ``compress``: int8 (the all-to-all in flight, the all-gather where it lands).
    Returns each update's seconds and the params, gathered."""
    import time

    o, i = coords
    outer = fh.sgd(0.7, momentum=0.9, nesterov=True)
    policy = fh.compress(torch.int8, block=32) if compress else None
    dl = fh.diloco(fh.hsdp(mesh, *AXES), axis="dp_outer", every=2, outer=outer, delay=delay,
                   compress=policy)  # fmt: skip
    params = fh.shard(full_params(), dl.inner)
    state, times = dl.init(params), []
    for t in range(1, steps + 1):
        if isinstance(mesh, fh.SimMesh):
            raw = {k: torch.stack([torch.stack([_raw_grads(t, a, b)[k] for b in range(I)])
                                   for a in range(O)]) for k in params}  # fmt: skip
        else:
            raw = _raw_grads(t, o, i)
        g = fh.reduce_grads(raw, dl.inner, last=True)
        params = {k: params[k] - INNER_LR * g[k] for k in params}
        if t == 2 and o == 1:
            time.sleep(late)
        start = time.perf_counter()
        params, state = dl.update(params, state)
        times.append(time.perf_counter() - start)
    return times, fh.gather(params, dl.inner)


def _overlap(runs) -> list:
    mesh = _mesh()
    coords = _coords(mesh)
    out = []
    for delay, mode, compress in runs:
        with fh.validation(mode):
            out.append(_late_loop(mesh, delay=delay, late=LATE, coords=coords, compress=compress))
    return coords, out


def test_a_delayed_sync_is_issued_without_waiting_and_waited_for_where_it_lands(pool):
    # (delay, validation, compressed): compressed, the first leg (the all-to-all) is what
    # flies; the sum and the all-gather wait where the sync lands
    runs = [(1, "off", False), (1, "on", False), (0, "off", False), (1, "off", True)]
    sim = fh.SimMesh(dict(zip(AXES, (O, I))))
    want = [_late_loop(sim, delay=d, late=0, coords=(None, None), compress=c)[1]
            for d, _, c in runs]  # fmt: skip
    for (o, i), out in pool.run(_overlap, runs):
        for (delay, mode, _), (times, got), full in zip(runs, out, want):
            assert _error(got, {k: v[o, i] for k, v in full.items()}) < 1e-6, (delay, mode)
            if o == 1:  # the late replica finds the other waiting (or the result there)
                assert max(times) < LATE / 2, (delay, mode, times)
                continue
            issue, land = times[1], times[2]
            if delay and mode == "off":  # issued at once: the wait moved to the landing
                assert issue < LATE / 4 and land > LATE / 2, (times, mode)
            else:  # no delay, or the agreement before the collectives: it waits at the issue
                assert issue > LATE / 2 and land < LATE / 4, (times, delay, mode)


def _crossed(mode: str, compress: bool):
    """The replicas issue different syncs: their fragment 0 labels differ."""
    mesh = _mesh()
    o, _ = _coords(mesh)
    labels = {"0.bias": o, "0.weight": o, "2.bias": 1 - o, "2.weight": 1 - o}
    policy = fh.compress(torch.int8) if compress else None
    dl = fh.diloco(fh.hsdp(mesh, *AXES), axis="dp_outer", every=2, outer=fh.sgd(1.0),
                   fragments=labels, delay=1, compress=policy)  # fmt: skip
    params = fh.shard(full_params(), dl.inner)
    state = dl.init(params)
    with fh.validation(mode):
        for t in (1, 2):
            params = {k: v - 0.1 for k, v in params.items()}
            try:
                params, state = dl.update(params, state)
            except ValueError as e:
                return t, str(e)
    return None


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "int8"])
@pytest.mark.parametrize("mode", ["on", "strict"])
def test_replicas_that_issue_different_syncs_raise_before_the_collectives(pool, mode, compress):
    # compressed: without an agreement of its own a worker died (gloo aborts on the
    # all-to-all's sizes: each replica packs other leaves); with equal sizes it would have
    # averaged one replica's layer 0 with the other's layer 2, silently
    for t, message in pool.run(_crossed, mode, compress):
        assert t == 1, message  # at the issue, every rank alike: no collective was issued
        assert "pseudo_gradient[\"params['0.bias']\"] on rank" in message, message


# -- a DistMesh's compressed packing: the pieces end to end --------------------------------


def _packings(placements) -> list:
    """Per placement: whether every fragment's packing on this rank is the whole-pieces
    layout (``whole``), and its index is the pieces' positions in order, then the padding
    slot: what ``Packing.whole`` copies instead of gathering (a DistMesh's pieces hold no
    fill). Also that both ways give the same row and pieces, on random values."""
    mesh = _mesh()
    spec = fh.hsdp(mesh, *AXES)  # (Owner on some axes needs a third axis: SimMesh tests it)
    specs = {"flat": spec, "owner-major": fh.owned(spec), "hfsdp": fh.hfsdp(mesh, *AXES)}
    out = []
    for name in placements:
        dl = fh.diloco(specs[name], axis="dp_outer", every=2, outer=fh.sgd(1.0), fragments=2,
                       compress=fh.compress(torch.int8, block=32))  # fmt: skip
        params = fh.shard(full_params(), dl.inner)
        dl.init(params)
        packings = list(dl.update.__self__.cuts._packings.values())  # made by init
        ok = len(packings) == 2
        for pk in packings:
            width = sum(pk.widths)
            at = torch.arange(pk.length)
            ok &= pk.whole and torch.equal(pk.index, torch.where(at < width, at, width))
            pieces = [torch.randn(s) for s in pk.shapes]
            flat = [x.reshape(-1) for x in pieces] + [torch.zeros(1)]
            row = pk.gather(pieces)
            ok &= torch.equal(row, torch.cat(flat)[pk.index])
            ok &= all(torch.equal(a, b) for a, b in zip(pk.scatter([row]), pieces))
        out.append(ok)
    return out


def test_a_distmesh_packs_a_compressed_sync_without_an_index(pool):
    placements = ["flat", "owner-major", "hfsdp"]
    assert all(all(r) for r in pool.run(_packings, placements))
