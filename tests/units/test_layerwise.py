"""Layer-wise HSDP on a SimMesh: ``fh.gathered`` units inside the loss, gradients at the
gradient placement, checked against dense single-process SGD (tests/lw_problem.py)."""

from __future__ import annotations

import threading

import optree
import pytest
import torch
from lw_problem import B, T, V, block, dense_train, init, max_rel_error, train
from reference import AXES, STRATEGIES, Tap, preset
from torch.func import grad

import functional_hsdp as fh

STEPS = 3
RANKS = 4


@pytest.fixture(scope="module")
def dense():
    """Dense SGD for M = 1 and 3 microbatches (computed once)."""
    return {m: dense_train(STEPS, m, RANKS) for m in (1, 3)}


def _mesh() -> fh.SimMesh:
    return fh.SimMesh(dict(zip(AXES, (2, 2))))


@pytest.mark.parametrize("mode", ["pure", "maingrad", "sink", "deferred"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_three_steps_match_dense_sgd(strategy, mode, dense):
    mesh = _mesh()
    got, _ = train(preset(strategy, mesh), STEPS, 3, mode)
    assert max_rel_error(got, dense[3], mesh.batch_shape) <= 1e-5


@pytest.mark.parametrize("mode", ["pure", "maingrad", "sink", "deferred"])
def test_one_microbatch_matches_dense_sgd(mode, dense):
    mesh = _mesh()
    got, _ = train(preset("hsdp", mesh), STEPS, 1, mode)
    assert max_rel_error(got, dense[1], mesh.batch_shape) <= 1e-5


@pytest.mark.parametrize("mode", ["maingrad", "sink", "deferred"])
def test_zero_grad_without_set_to_none_gives_the_same_training(mode, dense):
    mesh = _mesh()
    got, _ = train(preset("hsdp", mesh), STEPS, 3, mode, set_to_none=False)
    assert max_rel_error(got, dense[3], mesh.batch_shape) <= 1e-5


def _counts(events) -> dict:
    out: dict = {}
    for e in events:
        out[(e.op, e.axis)] = out.get((e.op, e.axis), 0) + 1
    return out


@pytest.mark.parametrize("reshard", [True, False])
def test_collectives_per_step_are_fsdp2s(reshard):
    """Per step, as FSDP2 HSDP with the same units: an all-gather per unit call in forward and,
    when resharding, again in backward (but for the forward's last call, whose weights its
    backward, next, uses as they are); a reduce-scatter over dp_inner per unit call per
    microbatch; one dp_outer all-reduce per bucket, on the last microbatch only."""
    mesh, layers, m = _mesh(), 2, 3
    _, events = train(preset("hsdp", mesh), 1, m, "sink", reshard_after_forward=reshard)
    calls = layers + 2  # the blocks, and the tied embedding: used as input and as the head
    units = layers + 1  # one bucket each
    assert _counts(events) == {
        ("all_gather", "dp_inner"): m * (2 * calls - 1 if reshard else calls),
        ("reduce_scatter", "dp_inner"): m * calls,
        ("all_reduce", "dp_outer"): units,
    }
    outer = [i for i, e in enumerate(events) if e.axis == "dp_outer"]
    assert outer == list(range(len(events) - units, len(events)))  # after the last backward


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_declared_last_microbatch_issues_each_units_deferred_reduction_in_its_backward(strategy):
    """With the microbatches declared to the MainGrad, the last backward issues each unit's
    dp_outer reduction as soon as that unit's gradient is complete, while the backward of the
    units before it still runs; finish() issues nothing. The same collectives, the same
    bits."""
    mesh, layers, m = _mesh(), 2, 3
    spec = preset(strategy, mesh)
    got, events = train(spec, 2, m, "deferred")
    want, ref_events = train(spec, 2, m, "sink")
    assert all(map(torch.equal, optree.tree_leaves(got), optree.tree_leaves(want)))
    assert sorted(map(str, events)) == sorted(map(str, ref_events))
    step = events[len(events) // 2 :]  # the second step
    outer = [i for i, e in enumerate(step) if e.axis == "dp_outer" and e.op != "all_gather"]
    inner_rs = [i for i, e in enumerate(step) if e.op == "reduce_scatter" and e.axis == "dp_inner"]
    units = layers + 1
    assert len(outer) == units
    # the backward of the last microbatch: head (embed unit), block 1, block 0, embedding;
    # block 1's and block 0's reductions start before the embedding's reduce-scatter
    assert outer[0] < inner_rs[-1] and outer[1] < inner_rs[-1]
    # the tied embedding unit is reduced once, after both of its gradients arrived
    assert outer[-1] > inner_rs[-1]


def test_a_gradient_after_its_units_deferred_reduction_is_refused():
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full, shards, _, x = _unit_problem(spec)
    mg = fh.MainGrad(spec, like=full)
    blk = fh.gathered(fh.per_rank(lambda p, x: x @ p["w"] + p["b"], mesh), spec, into=mg)
    f = lambda s: blk(s, x).square().sum()  # noqa: E731
    mg.begin_microbatch(last=True)
    grad(f)(shards)  # the unit's reduction over dp_outer starts in this backward
    with pytest.raises(ValueError, match="reduced over the deferred axes already"):
        grad(f)(shards)
    mg.finish()
    with pytest.raises(ValueError, match="call zero_grad"):
        mg.begin_microbatch(last=False)
    with pytest.raises(TypeError, match="last must be a bool"):
        fh.MainGrad(spec, like=full).begin_microbatch(last=1)
    with pytest.raises(TypeError, match="into must be a MainGrad"):
        list(fh.microbatches(2, into=object()))


def test_keeping_gathered_weights_gives_the_same_training(dense):
    mesh = _mesh()
    got, _ = train(preset("hsdp", mesh), STEPS, 3, "pure", reshard_after_forward=False)
    assert max_rel_error(got, dense[3], mesh.batch_shape) <= 1e-5


def test_prefetching_changes_nothing_but_the_order(dense):
    mesh = _mesh()
    a, ea = train(preset("hsdp", mesh), STEPS, 3, "pure", prefetch=True)
    b, eb = train(preset("hsdp", mesh), STEPS, 3, "pure", prefetch=False)
    assert max_rel_error(a, dense[3], mesh.batch_shape) <= 1e-5
    assert all(map(torch.equal, optree.tree_leaves(a), optree.tree_leaves(b)))
    assert sorted(map(str, ea)) == sorted(map(str, eb))


# -- prefetching: the exact order of collectives and computations ------------------------------


def _unit_order(run, recompute: bool) -> list[str]:
    """One forward and backward through three fsdp units of different sizes on a 2-rank
    SimMesh, as one list in time order: each collective from comm_log (``"all_gather k"``,
    ``"reduce_scatter k"``: k is the unit, read off the event's size), each computation of a
    unit, recorded by the unit's fn (``"forward k"``, ``"recompute k"`` for its second run) and
    by an identity on its output (``"backward k"``), and each first wait for a unit's
    reduce-scatter (a spy on the mesh's wait)."""
    mesh = fh.SimMesh({"dp": 2})
    spec = fh.fsdp(mesh)
    units = fh.shard(
        [{"w": torch.full((2 * (k + 1),), 0.1 * (k + 1))} for k in range(3)], [spec] * 3
    )
    marks: list[tuple[int, str]] = []  # (comm_log events so far, what happened)
    record = lambda label: marks.append((len(log.events), label))  # noqa: E731
    runs: dict[int, int] = {}
    scattered: list[tuple[torch.Tensor, int]] = []  # (reduce-scatter result, its unit)
    reduce_scatter, wait = mesh.reduce_scatter, mesh.wait

    def spy_reduce_scatter(buf, axis, op):
        out = reduce_scatter(buf, axis, op)
        scattered.append((out, buf.shape[-1] // 2 - 1))
        return out

    def spy_wait(x):
        for k, (out, unit) in enumerate(scattered):
            if out is x:
                record(f"wait reduce_scatter {unit}")
                del scattered[k]  # its first wait only
                break
        return wait(x)

    def fn(p, x):  # unit k holds 2(k+1) weights
        k = p["w"].shape[-1] // 2 - 1
        runs[k] = runs.get(k, 0) + 1
        record(f"{'forward' if runs[k] == 1 else 'recompute'} {k}")
        return Tap.apply(torch.tanh(x * p["w"].sum()), lambda: record(f"backward {k}"))

    block = fh.gathered(fh.per_rank(fn, mesh), spec, recompute=recompute)
    mesh.reduce_scatter, mesh.wait = spy_reduce_scatter, spy_wait
    raised: list[BaseException] = []

    def forward_and_backward() -> None:
        try:
            torch.func.grad(lambda s: run(block, s, torch.ones(2, 3)).sum())(units)
        except BaseException as e:  # re-raised below
            raised.append(e)

    # on a thread of its own: the units' forward state is per thread, and this is the order
    # of one forward pass from its start, whatever earlier tests left on the main thread
    thread = threading.Thread(target=forward_and_backward)
    with fh.comm_log() as log:
        thread.start()
        thread.join()
    if raised:
        raise raised[0]
    out, m = [], 0
    for i, e in enumerate(log.events):
        while m < len(marks) and marks[m][0] <= i:
            out.append(marks[m][1])
            m += 1
        unit = e.numel - 1 if e.op == "all_gather" else e.numel // 2 - 1
        out.append(f"{e.op} {unit}")
    return out + [text for _, text in marks[m:]]


def _in_sequence(block, units, x):
    return fh.sequence(block, units, x)


def _declared(block, units, x):  # what sequence does, spelled out with block.prefetch
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            block.prefetch(units[i + 1])
        x = block(unit, x)
    return x


def _one_by_one(block, units, x):
    for unit in units:
        x = block(unit, x)
    return x


# Forward: unit i+1's all-gather is issued before unit i computes. Backward (reshard after
# forward; the last unit keeps its weights): unit i-1's re-gather is issued before unit i's
# backward; each unit's reduce-scatter is issued at the end of its backward.
PREFETCHED = [
    "all_gather 0", "all_gather 1", "forward 0", "all_gather 2", "forward 1", "forward 2",
    "all_gather 1", "backward 2", "reduce_scatter 2",
    "all_gather 0", "backward 1", "reduce_scatter 1",
    "backward 0", "reduce_scatter 0",
]  # fmt: skip
# Without a declared next unit, each forward all-gather waits for the unit's own call.
ONE_BY_ONE = [
    "all_gather 0", "forward 0", "all_gather 1", "forward 1", "all_gather 2", "forward 2",
    *PREFETCHED[6:],
]  # fmt: skip


def _recomputed(order: list[str]) -> list[str]:
    """``order`` with recompute=True: each unit's fn runs again just before its backward."""
    out = []
    for x in order:
        if x.startswith("backward"):
            out.append(x.replace("backward", "recompute"))
        out.append(x)
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-graph", "recompute"])
@pytest.mark.parametrize("run", [_in_sequence, _declared], ids=["sequence", "block.prefetch"])
def test_the_next_units_all_gather_is_issued_before_this_unit_computes(run, recompute):
    """README: sequence issues the next unit's all-gather before the current unit computes, the
    previous unit's re-gather before the current unit's backward, and each reduce-scatter runs
    during the next unit's backward (issued before unit i-1's backward, waited after it);
    ``block.prefetch`` declares the same by hand; it is waited before unit i-1's own
    reduce-scatter is issued, so one gradient-sized buffer is in flight at a time (as
    FSDP2). The exact order in time, not a sorted list."""
    want = _recomputed if recompute else list
    order = _unit_order(run, recompute)
    assert [x for x in order if not x.startswith("wait")] == want(PREFETCHED)
    for k in (1, 2):
        issued, waited = order.index(f"reduce_scatter {k}"), order.index(f"wait reduce_scatter {k}")
        assert issued < order.index(f"backward {k - 1}") < waited, order
        assert waited < order.index(f"reduce_scatter {k - 1}"), order
    one_by_one = [x for x in _unit_order(_one_by_one, recompute) if not x.startswith("wait")]
    assert one_by_one == want(ONE_BY_ONE)  # the order prefetching changes


def test_bf16_weights_accumulate_in_fp32_main_grads():
    """bf16 shards (compute and wire in bf16), MainGrad in fp32, over 16 microbatches: the
    dense fp32 sum, exactly. Every per-microbatch gradient here is exact in bf16 (small
    integers times 1 or 1/2, and their averages over 2 ranks), so the only rounding left is
    the accumulation's: in fp32 there is none, while accumulating in bf16 (a MainGrad of
    dtype bf16) errs by more than 1e-3 of the largest gradient (measured: 6.6e-3)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    tree_spec = {"blocks": [spec] * 2}
    M, D = 16, 64
    full32 = {"blocks": [{"w": torch.ones(D)}, {"w": torch.full((D,), 0.5)}]}
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(16, (2, 2, 4, D), generator=gen).float() for _ in range(M)]

    def main_grads(dtype):
        shards = fh.shard(optree.tree_map(lambda t: t.bfloat16(), full32), tree_spec)
        mg = fh.MainGrad(tree_spec, like=full32, dtype=dtype)
        blk = fh.gathered(fh.per_rank(lambda p, h: h * p["w"], mesh), spec, into=mg)
        loss = lambda s, x: fh.sequence(blk, s["blocks"], x.bfloat16()).float().sum()  # noqa: E731
        with fh.comm_log() as log:
            for x, _ in fh.microbatches(xs, into=mg):
                grad(loss)(shards, x)
            mg.finish()
        return fh.gather(mg.grads, tree_spec), {(e.op, e.dtype) for e in log.events}

    def dense_loss(p, x):
        for b in p["blocks"]:
            x = x * b["w"]
        return x.sum()

    # the mean over ranks of the sum over microbatches, in float64
    per_rank = [grad(dense_loss)(full32, x[o, i]) for x in xs for o in (0, 1) for i in (0, 1)]
    ref = optree.tree_map(lambda *g: sum(t.double() for t in g) / 4, *per_rank)
    got, wire = main_grads(torch.float32)
    assert all(x.dtype == torch.float32 for x in optree.tree_leaves(got))
    assert {("all_gather", torch.bfloat16), ("reduce_scatter", torch.bfloat16)} <= wire
    low, _ = main_grads(torch.bfloat16)  # what accumulating in bf16 would give
    assert (
        max_rel_error(got, ref, mesh.batch_shape)
        <= 1e-6
        < 1e-3
        < max_rel_error(low, ref, mesh.batch_shape)
    )


def _unit_problem(spec):
    mesh = spec.mesh
    full = {"w": torch.linspace(-1, 1, 12).reshape(4, 3), "b": torch.arange(3.0)}
    shards = fh.shard(full, spec)
    blk = fh.gathered(fh.per_rank(lambda p, x: torch.tanh(x @ p["w"] + p["b"]), mesh), spec)
    x = torch.randn(*mesh.batch_shape, 2, 4, generator=torch.Generator().manual_seed(1))
    return full, shards, blk, x


def _dense_unit_grad(full, x, batch):
    def f(p, x):
        return torch.tanh(x @ p["w"] + p["b"]).square().sum()

    xs = x.reshape(-1, *x.shape[len(batch) :])
    gs = [grad(f)(full, xi) for xi in xs]
    return optree.tree_map(lambda *t: sum(t) / len(t), *gs)


def _finish(g, spec):
    return fh.gather(fh.reduce_grads(g, spec, last=True, at="gradient"), spec)


def _shard0_spec() -> fh.Spec:
    mesh = fh.SimMesh({"dp": 3})
    return fh.Spec(mesh, [fh.Shard(0)], [fh.Shard(0)], [fh.Shard(0)])


def _three_axis_spec() -> fh.Spec:
    """hsdp with two deferred replica axes on a 2x2x2 mesh."""
    mesh = fh.SimMesh({"replica": 2, "outer": 2, "inner": 2})
    r, f = fh.Replicate(), fh.Flat()
    return fh.Spec(mesh, [r, r, f], [fh.Partial("avg"), fh.Partial("avg"), f], [r, r, f])


@pytest.mark.parametrize("make", [_shard0_spec, _three_axis_spec], ids=["shard0", "3d"])
def test_shard_dim_specs_and_three_axis_meshes(make):
    spec = make()
    full, shards, blk, x = _unit_problem(spec)
    g = grad(lambda s: blk(s, x).square().sum())(shards)
    got = _finish(g, spec)
    ref = _dense_unit_grad(full, x, spec.mesh.batch_shape)
    assert max_rel_error(got, ref, spec.mesh.batch_shape) <= 1e-5


def test_plain_autograd_vjp_and_grad_and_value_agree():
    spec = preset("hsdp", _mesh())
    _, shards, blk, x = _unit_problem(spec)
    by_grad = grad(lambda s: blk(s, x).square().sum())(shards)
    g2, value = torch.func.grad_and_value(lambda s: blk(s, x).square().sum())(shards)
    out, vjp = torch.func.vjp(lambda s: blk(s, x).square().sum(), shards)
    (g3,) = vjp(torch.ones(()))
    leaves = {k: v.clone().requires_grad_() for k, v in shards.items()}
    blk(leaves, x).square().sum().backward()
    g4 = {k: v.grad for k, v in leaves.items()}
    for other in (g2, g3, g4):
        assert all(map(torch.equal, optree.tree_leaves(by_grad), optree.tree_leaves(other)))
    assert torch.equal(value, out)


def test_a_weight_used_by_two_units_gets_both_gradients():
    """A tied weight: the same shards through two gathered calls; the engine sums two finished
    gradients (the wait nodes hand them on only after their reduce-scatters)."""
    spec = preset("hsdp", _mesh())
    full, shards, blk, x = _unit_problem(spec)
    twice = grad(lambda s: (blk(s, x) + blk(s, x)).square().sum() / 4)(shards)
    once = grad(lambda s: blk(s, x).square().sum())(shards)
    assert max_rel_error(_finish(twice, spec), _finish(once, spec)) <= 1e-6


def test_refuses_into_under_transforms_and_a_spec_tree():
    spec = preset("hsdp", _mesh())
    full, shards, _, x = _unit_problem(spec)
    mg = fh.MainGrad(spec, like=full)
    into = fh.gathered(fh.per_rank(lambda p, x: x @ p["w"] + p["b"], spec.mesh), spec, into=mg)
    f = lambda s: into(s, x).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="not added into a MainGrad"):
        grad(lambda s: grad(f)(s)["w"].sum())(shards)
    with pytest.raises(TypeError, match="one Spec"):
        fh.gathered(lambda p: p, {"a": spec})
    lopsided = fh.Spec(
        spec.mesh, [fh.Replicate(), fh.Flat()], [fh.Flat(), fh.Flat()], [fh.Flat(), fh.Flat()]
    )
    with pytest.raises(NotImplementedError, match="sharded over other axes"):
        fh.gathered(lambda p: p, lopsided)


def test_refuses_non_tensor_outputs_and_unknown_shards_for_into():
    spec = preset("hsdp", _mesh())
    full, shards, _, x = _unit_problem(spec)
    bad = fh.gathered(lambda p, x: {"y": p["w"].sum(), "n": 3}, spec)
    with pytest.raises(TypeError, match="pytree of tensors"):
        bad(shards, x)
    mg = fh.MainGrad(spec, like=full)
    blk = fh.gathered(fh.per_rank(lambda p, x: x @ p["w"] + p["b"], spec.mesh), spec, into=mg)
    copies = optree.tree_map(torch.clone, shards)  # untagged: which unit is unknown
    with pytest.raises(ValueError, match="not known as a unit"):
        grad(lambda s: blk(s, x).sum())(copies)
    with pytest.raises(TypeError, match="into must be a MainGrad"):
        fh.gathered(lambda p: p, spec, into=object())


# -- recompute, resharding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recompute", "reshard", "mode"),
    [
        (False, True, "deferred"),
        (False, False, "pure"),
        (True, True, "sink"),
        (True, False, "pure"),
    ],
)
def test_recompute_and_resharding_choices_match_dense_sgd(recompute, reshard, mode, dense):
    mesh = _mesh()
    got, _ = train(
        preset("hsdp", mesh), STEPS, 3, mode, recompute=recompute, reshard_after_forward=reshard
    )
    assert max_rel_error(got, dense[3], mesh.batch_shape) <= 1e-5


@pytest.mark.parametrize("reshard", [True, False])
def test_recompute_issues_the_same_collectives(reshard):
    runs = [
        train(preset("hsdp", _mesh()), 1, 2, "deferred", recompute=r, reshard_after_forward=reshard)
        for r in (False, True)
    ]
    assert [[(e.op, e.axis, e.numel) for e in events] for _, events in runs] == [
        [(e.op, e.axis, e.numel) for e in runs[0][1]]
    ] * 2


def test_a_backward_that_raises_leaves_nothing_to_the_next_forward(monkeypatch):
    """After a backward that raised (its end-of-backward callback never runs), the next
    forward on the thread starts anew: at the end of its backward, an all-gather it issued
    ahead for a unit that never ran is released, as on a fresh thread."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full, shards, _, x = _unit_problem(spec)
    mg = fh.MainGrad(spec, like=full)
    blk = fh.gathered(fh.per_rank(lambda p, x: x @ p["w"] + p["b"], mesh), spec, into=mg)
    f = lambda s: blk(s, x).square().sum()  # noqa: E731
    mg.begin_microbatch(last=True)
    grad(f)(shards)
    with pytest.raises(ValueError, match="reduced over the deferred axes"):
        grad(f)(shards)
    mg.finish()
    released = []
    abandon = type(mesh).abandon
    monkeypatch.setattr(type(mesh), "abandon", lambda m, x: released.append(x) or abandon(m, x))
    plain = fh.gathered(fh.per_rank(lambda p, x: torch.tanh(x @ p["w"]), mesh), spec)
    layers = fh.shard([{"w": torch.eye(4) / 2}] * 3, [spec] * 3)

    def loss(s):
        plain.prefetch(s[2])  # declared, then never called
        return plain(s[1], plain(s[0], x)).sum()

    grad(loss)(layers)
    assert len(released) == 1


@pytest.mark.parametrize("mode", ["sink", "deferred", "maingrad"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_non_persistent_main_grad_trains_the_same(mode, set_to_none):
    mesh = _mesh()
    a, ea = train(preset("hsdp", mesh), 2, 3, mode, set_to_none=set_to_none, persistent=False)
    b, eb = train(preset("hsdp", mesh), 2, 3, mode, set_to_none=set_to_none)
    assert all(map(torch.equal, optree.tree_leaves(a), optree.tree_leaves(b)))
    assert [(e.op, e.numel) for e in ea] == [(e.op, e.numel) for e in eb]


def test_a_non_persistent_main_grad_holds_memory_only_for_what_landed():
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full = init(2)
    tree_spec = {"embed": spec, "blocks": [spec] * 2}
    shards = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full, persistent=False)
    held = lambda: [b.untyped_storage().nbytes() > 0 for b in mg.buffers]  # noqa: E731
    assert held() == [False] * 3
    blk = fh.gathered(fh.per_rank(block, mesh), spec, into=mg)
    h = torch.randn(2, 2, B, T, 8)
    seen = []

    def loss(s):
        out = blk(s["blocks"][1], blk(s["blocks"][0], h))
        return out.square().sum()

    grad(loss)(shards)  # the blocks' buckets landed, not the embedding's
    seen = held()
    mg.finish()
    assert seen.count(True) == 2 and held() == [True] * 3  # finish zero-fills the rest
    assert torch.equal(fh.gather(mg.grads, tree_spec)["embed"]["tok"], torch.zeros(2, 2, V, 8))
    mg.zero_grad()
    assert held() == [False] * 3 and mg.grads is None
    state = mg.local_state_dict()  # released buckets save as zeros, nothing taken again
    assert held() == [False] * 3 and all(not b.any() for b in state["buffers"])
    with pytest.raises(TypeError, match="persistent must be a bool"):
        fh.MainGrad(tree_spec, like=full, persistent="no")


def test_a_unit_given_leaves_of_several_units_is_refused_naming_them():
    """Shards of two units into a MainGrad: refused, naming the leaves, before any gradient
    lands in another unit's buffer (it was accepted, silently wrong)."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    full = [{"w": torch.randn(3, 3), "b": torch.randn(3)} for _ in range(2)]
    shards = fh.shard(full, [spec, spec])
    mg = fh.MainGrad([spec, spec], like=full)
    block = fh.gathered(fh.per_rank(lambda p, h: torch.tanh(h @ p["w"] + p["b"]), mesh), spec,
                        into=mg)  # fmt: skip
    x = torch.randn(2, 2, 4, 3)
    mixed = {"w": shards[0]["w"], "b": shards[1]["b"]}
    with pytest.raises(ValueError, match=r"one unit.*\[0\]\['w'\].*\[1\]\['b'\]"):
        torch.func.grad(lambda s: block(s, x).sum())(mixed)
    with pytest.raises(ValueError, match=r"one unit.*\[1\]\['w'\].*\[0\]\['b'\]"):
        torch.func.grad(lambda s: block(s, x).sum())({"w": shards[1]["w"], "b": shards[0]["b"]})
    torch.func.grad(lambda s: block(s, x).sum())(shards[0])  # the unit as made: accepted
