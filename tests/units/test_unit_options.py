"""The options of a gathered unit on a SimMesh: ``recompute`` (forward's graph kept, the
gathered weights released until backward, or per-unit activation checkpointing),
``mp_policy`` (FSDP2's ``MixedPrecisionPolicy``), which arguments are differentiated, and a
prefetch declared on one block used by another."""

from __future__ import annotations

import optree
import pytest
import torch
from lw_problem import block, dense_train, init, max_rel_error, train
from reference import AXES, Tap, preset
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.func import grad

import functional_hsdp as fh

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh() -> fh.SimMesh:
    return fh.SimMesh(dict(zip(AXES, (2, 2))))


def _linear_problem(recompute: bool = False, mp_policy=None, n: int = 3, into=False):
    """``n`` tanh-Linear units on a 2x2 hsdp SimMesh; returns (mesh, spec tree, full weights,
    shards, block, input, the weights each call of fn saw, MainGrad or None)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    gen = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(4, 4, generator=gen) / 2, "b": torch.randn(4, generator=gen)}]
    full = full + [optree.tree_map(lambda t: t.flip(0), full[0]) for _ in range(n - 1)]
    tree_spec = [spec] * n
    shards = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full) if into else None
    seen = []

    def fn(p, x):
        seen.append(p["w"])
        return torch.tanh(x @ p["w"] + p["b"])

    blk = fh.gathered(
        fh.per_rank(fn, mesh), spec, recompute=recompute, mp_policy=mp_policy, into=mg
    )
    x = torch.randn(2, 2, 3, 4, generator=gen)
    return mesh, tree_spec, full, shards, blk, x, seen, mg


def _dense_grads(full, x):
    def loss(p, x):
        for u in p:
            x = torch.tanh(x @ u["w"] + u["b"])
        return x.square().sum()

    gs = [grad(loss)(full, xi) for xi in x.reshape(-1, *x.shape[2:])]
    return optree.tree_map(lambda *t: sum(t) / len(t), *gs)


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (unwrapped from any torch.func transform)."""
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(t) or functorch.is_batchedtensor(t):
        t = functorch.get_unwrapped(t)
    return t.untyped_storage().nbytes()


# -- recompute ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
def test_fn_runs_once_per_call_without_recompute_and_twice_with_it(recompute):
    mesh, tree_spec, full, shards, blk, x, seen, _ = _linear_problem(recompute)
    g = grad(lambda s: fh.sequence(blk, s, x).square().sum())(shards)
    got = fh.gather(fh.reduce_grads(g, tree_spec, last=True, at="gradient"), tree_spec)
    assert max_rel_error(got, _dense_grads(full, x), mesh.batch_shape) <= 1e-5
    assert len(seen) == (6 if recompute else 3)


def test_without_recompute_the_gathered_weights_are_released_until_backward():
    """Forward keeps each unit's graph; the gathered weights it holds have no storage once the
    next unit started (the last unit keeps them: its backward comes next), and get it back,
    with the right values, in backward."""
    mesh, tree_spec, full, shards, blk, x, seen, _ = _linear_problem()
    sizes = {}

    def loss(s):
        out = fh.sequence(blk, s, x).square().sum()
        sizes["after forward"] = [_storage_bytes(w) for w in seen]
        return out

    g = grad(loss)(shards)
    assert sizes["after forward"][:2] == [0, 0]
    assert sizes["after forward"][2] > 0
    got = fh.gather(fh.reduce_grads(g, tree_spec, last=True, at="gradient"), tree_spec)
    assert max_rel_error(got, _dense_grads(full, x), mesh.batch_shape) <= 1e-5


@pytest.mark.parametrize("recompute", [False, True])
def test_a_units_graph_frees_each_nodes_saved_tensors_in_its_backward(recompute):
    """A unit's graph (forward's, or the recomputed one) is differentiated once: each node's
    saved tensors are freed when it has run, as loss.backward() frees them, not kept until
    the unit's backward ends (fails if the unit's vjp retains its graph)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full = [{"w": torch.eye(4)}, {"w": torch.eye(4) / 2}]
    shards = fh.shard(full, [spec] * 2)
    nodes = []

    def fn(p, x):
        y = inner = torch.tanh(x @ p["w"])
        functorch = torch._C._functorch
        while inner.grad_fn is None and functorch.is_batchedtensor(inner):  # per_rank's vmap
            inner = functorch.get_unwrapped(inner)
        if inner.grad_fn is not None:  # built for backward (not recompute's first run)
            nodes.append(inner.grad_fn)
        return y

    blk = fh.gathered(fh.per_rank(fn, mesh), spec, recompute=recompute)
    grad(lambda s: fh.sequence(blk, s, torch.ones(2, 2, 3, 4)).sum())(shards)
    assert len(nodes) == 2
    for node in nodes:
        with pytest.raises(RuntimeError, match="freed"):
            _ = node._saved_result


@pytest.mark.parametrize("recompute", [False, True])
def test_both_choices_hold_under_every_reverse_mode_api(recompute):
    mesh, tree_spec, full, shards, blk, x, _, _ = _linear_problem(recompute)
    f = lambda s: fh.sequence(blk, s, x).square().sum()  # noqa: E731
    by_grad = grad(f)(shards)
    by_gv, value = torch.func.grad_and_value(f)(shards)
    out, vjp = torch.func.vjp(f, shards)
    (by_vjp,) = vjp(torch.ones(()))
    leaves = optree.tree_map(lambda t: t.clone().requires_grad_(), shards)
    f(leaves).backward()
    by_autograd = optree.tree_map(lambda t: t.grad, leaves)
    by_fh, fh_value = fh.grad_and_value(f)(shards)  # autograd, on the shards themselves
    for other in (by_gv, by_vjp, by_autograd, by_fh):
        assert all(map(torch.equal, optree.tree_leaves(by_grad), optree.tree_leaves(other)))
    assert torch.equal(value, out) and torch.equal(value, fh_value)


# -- mixed precision ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pure", "sink"])
def test_bf16_policy_gathers_in_bf16_reduces_in_fp32_and_keeps_fp32_masters(mode):
    mesh = _mesh()
    got, events = train(preset("hsdp", mesh), 2, 2, mode, mp_policy=BF16)
    assert {(e.op, e.dtype) for e in events} == {
        ("all_gather", torch.bfloat16),
        ("reduce_scatter", torch.float32),
        ("all_reduce", torch.float32),
    }
    assert all(t.dtype == torch.float32 for t in optree.tree_leaves(got))
    ref, fp32_run = dense_train(2, 2, 4), train(preset("hsdp", mesh), 2, 2, mode)[0]
    error = max_rel_error(got, ref, mesh.batch_shape)
    assert max_rel_error(fp32_run, ref, mesh.batch_shape) <= 1e-5
    # bf16 compute changed the result, within bf16's precision. (Exact parity with a bf16
    # reference is shown on gloo against FSDP2's same policy, tests/units/test_module_gloo.py: on
    # a SimMesh the per-rank ops run under vmap, whose bf16 kernels round differently from
    # a plain dense run's, by 1-2 % on these gradients.)
    assert 1e-5 < error <= 5e-2


def test_reduce_dtype_defaults_to_param_dtype():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _, events = train(preset("hsdp", _mesh()), 1, 1, "pure", mp_policy=mp)
    assert {(e.op, e.dtype) for e in events if e.op != "all_reduce"} == {
        ("all_gather", torch.bfloat16),
        ("reduce_scatter", torch.bfloat16),
    }


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_and_output_dtype(cast):
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    shards = fh.shard({"w": torch.eye(4)}, spec)
    dtypes = []

    def fn(p, x):
        dtypes.append((p["w"].dtype, x.dtype))
        return x.to(p["w"].dtype) @ p["w"]

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32, cast)
    blk = fh.gathered(fh.per_rank(fn, mesh), spec, mp_policy=mp)
    x = torch.randn(2, 2, 3, 4)
    out, (g_shards, g_x) = None, (None, None)
    out = blk(shards, x)
    g_shards, g_x = grad(lambda s, x: blk(s, x).sum(), argnums=(0, 1))(shards, x)
    assert out.dtype == torch.float32  # output_dtype
    assert dtypes[0] == (torch.bfloat16, torch.bfloat16 if cast else torch.float32)
    assert g_x.dtype == torch.float32 and g_shards["w"].dtype == torch.float32
    assert torch.allclose(out, x.bfloat16().float(), atol=1e-2)


def test_mp_policy_is_checked():
    spec = preset("hsdp", _mesh())
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        fh.gathered(lambda p: p, spec, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(TypeError, match="param_dtype must be a floating"):
        fh.gathered(lambda p: p, spec, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))
    with pytest.raises(TypeError, match="recompute must be a bool"):
        fh.gathered(lambda p: p, spec, recompute="no")


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
def test_only_tracked_floating_arguments_are_differentiated(recompute):
    """A float constant (a rotary table, a mask) gets no gradient computed inside the unit;
    a tracked input does, and its gradient is right."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(2))}
    shards = fh.shard(full, spec)

    calls = []  # the table's gradients computed

    def fn(p, h, table):
        return torch.tanh(h @ p["w"]) * Tap.apply(table, lambda: calls.append(1))

    blk = fh.gathered(fh.per_rank(fn, mesh), spec, recompute=recompute)
    h, table = torch.randn(2, 2, 3, 4), torch.rand(2, 2, 3, 4)
    g_h = grad(lambda h: blk(shards, h, table).sum())(h)
    assert not calls  # the table's gradient was never computed
    dense = torch.func.vmap(
        torch.func.vmap(grad(lambda h, t: (torch.tanh(h @ full["w"]) * t).sum()))
    )
    assert torch.allclose(g_h, dense(h, table), atol=1e-6)
    g_t = grad(lambda t: blk(shards, h, t).sum())(table)  # tracked: differentiated
    assert calls
    assert torch.allclose(g_t, torch.tanh(h @ full["w"]), atol=1e-6)


# -- prefetch across blocks ----------------------------------------------------------------------


def _tied_problem(cross: bool):
    """The README's shape: an embedding block, a stack of blocks, the head tied to the
    embedding; with ``cross``, the embedding prefetches the first block and the last block
    the head. Returns (gradient at the gradient placement, comm_log events, compute marks)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    tree_spec = {"embed": spec, "blocks": [spec] * 2}
    shards = fh.shard(init(2), tree_spec)
    marks = []

    def mark(name, fn):
        def run(*a):
            marks.append((name, len(log.events)))
            return fn(*a)

        return run

    emb = fh.gathered(fh.per_rank(mark("embed", lambda p, i: p["tok"][i]), mesh), spec)
    blk = fh.gathered(fh.per_rank(mark("block", block), mesh), spec)
    head = fh.gathered(fh.per_rank(mark("head", lambda p, h: h @ p["tok"].T), mesh), spec)
    ids = torch.randint(13, (2, 2, 3, 5), generator=torch.Generator().manual_seed(3))

    def loss(s):
        if cross:
            emb.prefetch(s["blocks"][0])
        h = emb(s["embed"], ids)
        for k, b in enumerate(s["blocks"]):
            nxt = s["blocks"][k + 1] if k + 1 < len(s["blocks"]) else s["embed"]
            if cross or k + 1 < len(s["blocks"]):
                blk.prefetch(nxt)
            h = blk(b, h)
        return head(s["embed"], h).square().mean()

    with fh.comm_log() as log:
        g = grad(loss)(shards)
    return fh.reduce_grads(g, tree_spec, last=True, at="gradient"), log.events, marks


def test_a_prefetch_declared_on_another_block_is_used_not_repeated():
    g_cross, e_cross, marks = _tied_problem(cross=True)
    g_plain, e_plain, plain_marks = _tied_problem(cross=False)
    assert all(map(torch.equal, optree.tree_leaves(g_cross), optree.tree_leaves(g_plain)))
    gathers = lambda events: [e for e in events if e.op == "all_gather"]  # noqa: E731
    assert len(gathers(e_cross)) == len(gathers(e_plain))  # no all-gather thrown away
    # (unit computing, all-gathers issued before it computes): the embedding computes with
    # block 0's all-gather in flight, the last block with the head's
    assert marks == [("embed", 2), ("block", 3), ("block", 4), ("head", 4)]
    assert plain_marks == [("embed", 1), ("block", 3), ("block", 3), ("head", 4)]


def test_gather_in_param_dtype():
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    shards = fh.shard({"w": torch.linspace(-1, 1, 10)}, spec)
    with fh.comm_log() as log:
        full = fh.gather(shards, spec, mp_policy=BF16)
    assert full["w"].dtype == torch.bfloat16 and shards["w"].dtype == torch.float32
    assert torch.equal(full["w"][0, 0], torch.linspace(-1, 1, 10).bfloat16())
    assert [(e.op, e.dtype) for e in log.events] == [("all_gather", torch.bfloat16)]
    with pytest.raises(TypeError, match=r"gather: mp_policy must be"):
        fh.gather(shards, spec, mp_policy=torch.bfloat16)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_second_backward_of_the_same_forward(recompute):
    """retain_graph=True: with recompute the second backward gives the same gradient; without
    it the unit's graph is gone, and that is a clear error (never a silent zero)."""
    _, _, _, shards, blk, x, _, _ = _linear_problem(recompute)
    leaves = optree.tree_map(lambda t: t.clone().requires_grad_(), shards)
    loss = fh.sequence(blk, leaves, x).square().sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in optree.tree_leaves(leaves)]
    if recompute:
        loss.backward()
        for a, t in zip(first, optree.tree_leaves(leaves)):
            assert torch.allclose(t.grad, 2 * a)
    else:
        with pytest.raises(RuntimeError, match="second backward .* needs recompute=True"):
            loss.backward()


def test_a_gathered_weight_returned_as_an_output_keeps_its_memory():
    """A unit that returns one of its full weights (an identity unit, or the weight beside a
    result): that output is the weight itself, and is never released with the unit's other
    gathered weights."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full = [{"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(5))}] * 2
    shards = fh.shard(full, [spec] * 2)
    blk = fh.gathered(fh.per_rank(lambda p, x: (torch.tanh(x @ p["w"]), p["w"]), mesh), spec)
    x = torch.randn(2, 2, 3, 4)
    kept = []

    def loss(s):
        h, w0 = blk(s[0], x)
        h, _ = blk(s[1], h)  # the first unit's other weights may be released now
        kept.append(w0)
        return (h.square().sum() + w0.sum()), w0

    g, w0 = grad(loss, has_aux=True)(shards)
    assert torch.equal(w0, full[0]["w"].expand(2, 2, 4, 4))
    assert torch.equal(kept[0], w0)


@pytest.mark.parametrize("recompute", [False, True])
def test_dropout_in_a_unit_draws_the_same_numbers_when_recomputed(recompute):
    """A unit with dropout: the gradient is that of the forward that ran (recompute replays
    its random numbers, as torch.utils.checkpoint does)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    full = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(6))}
    shards = fh.shard(full, spec)
    # written for every rank at once (batched matmul over the mesh dims), not under vmap
    fn = lambda p, x: torch.nn.functional.dropout(x @ p["w"], 0.5, training=True)  # noqa: E731
    blk = fh.gathered(fn, spec, recompute=recompute)
    x = torch.randn(2, 2, 3, 4)
    torch.manual_seed(7)
    g_x, out = grad(lambda x: (lambda y: (y.square().sum(), y))(blk(shards, x)), has_aux=True)(x)
    stacked = {"w": full["w"].expand(2, 2, 4, 4)}
    torch.manual_seed(7)
    g_want, want = grad(lambda x: (lambda y: (y.square().sum(), y))(fn(stacked, x)), has_aux=True)(
        x
    )
    assert (out == 0).any() and torch.equal(out, want)  # the same mask
    assert torch.allclose(g_x, g_want)


def test_a_maingrad_gets_the_gradients_asked_for_and_no_others():
    """A unit's reduce-scatter is waited for early (in the next unit's backward), but its
    result reaches the MainGrad only through the shards' wait node: a gradient taken with
    respect to the input only leaves the MainGrad empty; a full backward fills it with the
    dense gradient."""
    mesh, tree_spec, full, shards, blk, x, _, mg = _linear_problem(into=True)
    for s in optree.tree_leaves(shards):
        s.requires_grad_(True)
    x = x.clone().requires_grad_()
    for _ in fh.microbatches(1, into=mg):
        torch.autograd.grad(fh.sequence(blk, shards, x).square().sum(), [x])
    assert mg.grads is None or all(
        torch.count_nonzero(t) == 0 for t in optree.tree_leaves(mg.grads)
    )
    mg.zero_grad()
    for _ in fh.microbatches(1, into=mg):
        fh.grad(lambda s: fh.sequence(blk, s, x.detach()).square().sum())(shards)
    mg.finish()
    got = fh.gather(mg.grads, tree_spec)  # the mesh dims in front: every rank's copy
    dense = _dense_grads(full, x.detach())
    for g, d in zip(optree.tree_leaves(got), optree.tree_leaves(dense)):
        torch.testing.assert_close(g[0, 0], d, rtol=1e-5, atol=1e-6)
