"""Every torch.func transform through layer-wise units on a SimMesh, for every preset and the
owner specs (fh.owned of hsdp, owner-major and on dp_outer):
per-sample gradients (vmap of grad), jvp, Hessian-vector products (forward-over-reverse and
reverse-over-reverse) and a MAML step (grad of grad), each against dense torch.func on the
mean over ranks (tests/transform_problem.py); and what they issue (comm_log)."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import AXES, STRATEGIES, Tap, preset
from transform_problem import (
    D,
    Problem,
    T,
    dense_hvp,
    dense_jvp,
    dense_maml,
    dense_per_sample,
    ranks,
    rel,
)

import functional_hsdp as fh

B = 3
BATCH = (2, 2)


# the presets, and hsdp with its optimizer placement Owner (owner-major; on dp_outer only):
# the composable path moves parameters and gradients only, which the owner specs keep as
# their presets' (an all-to-all under vmap would be refused, not misread)
STRATEGIES = (*STRATEGIES, "owned", "owned_outer")


def _problem(strategy: str) -> Problem:
    if strategy.startswith("owned"):
        spec = preset("hsdp", fh.SimMesh(dict(zip(AXES, BATCH))))
        return Problem(fh.owned(spec) if strategy == "owned" else fh.owned(spec, "dp_outer"))
    return Problem(preset(strategy, fh.SimMesh(dict(zip(AXES, BATCH)))))


def _data(seed: int, *lead: int) -> torch.Tensor:
    return torch.randn(*lead, *BATCH, T, D, generator=torch.Generator().manual_seed(seed))


def _every_rank(full: list) -> list:
    """A finished (full, mesh dims in front) tree -> rank (0, 0)'s copy, after checking that
    every rank holds the same."""
    for t in optree.tree_leaves(full):
        assert torch.equal(t, t[:1, :1].expand_as(t))
    return optree.tree_map(lambda t: t[0, 0], full)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_sample_gradients_are_the_dense_ones_with_one_collective_per_unit(strategy):
    pb = _problem(strategy)
    xs = _data(0, B)
    with fh.comm_log() as log:
        g = pb.per_sample(xs)
    with fh.comm_log() as one:
        pb.per_sample(xs[:1])
    want = dense_per_sample(pb.full, xs.reshape(B, -1, T, D))
    for b in range(B):
        got = _every_rank(pb.finish(optree.tree_map(lambda t, b=b: t[b], g)))
        assert rel(got, want[b]) <= 1e-5
    # the batch's collectives are one sample's, each carrying B times the elements
    assert [(e.op, e.axis) for e in log.events] == [(e.op, e.axis) for e in one.events]
    assert [e.numel for e in log.events] == [
        e.numel * (B if e.op == "reduce_scatter" else 1) for e in one.events
    ]
    # and equal, bit for bit, to one first-order gradient per sample
    loop = [torch.func.grad(pb.loss)(pb.params, x) for x in xs]
    stacked = optree.tree_map(lambda *t: torch.stack(t), *loop)
    assert all(map(torch.equal, optree.tree_leaves(g), optree.tree_leaves(stacked)))


def test_per_sample_gradients_in_chunks():
    pb = _problem("hsdp")
    xs = _data(1, 5)
    whole = pb.per_sample(xs)
    with fh.comm_log() as log:
        chunked = pb.per_sample(xs, chunk_size=2)
    assert all(map(torch.equal, optree.tree_leaves(whole), optree.tree_leaves(chunked)))
    scatters = [e.numel for e in log.events if e.op == "reduce_scatter"]
    assert len(scatters) == 3 * len(pb.full)  # ceil(5 / 2) chunks per unit


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jvp_is_the_dense_jvp(strategy):
    pb = _problem(strategy)
    x = _data(2)
    tangent, full_tangent = pb.consistent(3)
    out, t_out = pb.jvp(x, tangent)
    assert torch.allclose(out, pb.out(pb.params, x))
    want = torch.stack([dense_jvp(pb.full, xr, full_tangent) for xr in ranks(x, BATCH)])
    assert rel(t_out.reshape(want.shape), want) <= 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["forward_reverse", "reverse_reverse"])
def test_hessian_vector_products_are_the_dense_ones(strategy, mode):
    pb = _problem(strategy)
    x = _data(4)
    v, full_v = pb.consistent(5)
    hvp = getattr(pb, f"hvp_{mode}")(x, v)
    want = dense_hvp(pb.full, ranks(x, BATCH), full_v)
    assert rel(_every_rank(pb.finish(hvp)), want) <= 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_maml_step_is_the_dense_one(strategy):
    """grad of (the loss after one inner SGD step on the mean gradient): the inner gradient's
    deferred axes reduced by the differentiable fh.pmean."""
    pb = _problem(strategy)
    x_in, x_out = _data(6), _data(7)
    got = _every_rank(pb.finish(pb.maml(x_in, x_out)))
    want = dense_maml(pb.full, ranks(x_in, BATCH), ranks(x_out, BATCH))
    assert rel(got, want) <= 1e-5


def test_first_order_training_keeps_its_own_path():
    """Under grad alone the unit takes its first-order path; under vmap of grad (per-sample
    gradients) the composable path releases the gathered weights between forward and
    backward alike (every unit's but the last is gathered again); under a second derivative
    it keeps them (no re-gather)."""
    pb = _problem("hsdp")
    x = _data(8)
    gathers = lambda log: sum(e.op == "all_gather" for e in log.events)  # noqa: E731
    with fh.comm_log() as first:
        torch.func.grad(pb.loss)(pb.params, x)
    with fh.comm_log() as per_sample:
        pb.per_sample(x[None])
    v, _ = pb.consistent(1)
    with fh.comm_log() as second:
        pb.hvp_reverse_reverse(x, v)
    assert gathers(first) == gathers(per_sample) == 2 * len(pb.full) - 1
    # each unit gathered once in forward, and once as its reduce-scatter's transpose
    assert gathers(second) == 2 * len(pb.full)


def test_per_sample_gradients_hold_one_units_gathered_weights_at_a_time():
    """Under vmap of grad: after forward the units but the last hold no gathered weights;
    once a unit's backward is over its weights are released again (the graph torch.func
    keeps until the end no longer holds their memory)."""
    from transform_problem import full_weights, layer

    mesh = fh.SimMesh(dict(zip(AXES, BATCH)))
    spec = preset("hsdp", mesh)
    params = fh.sync_params(fh.shard(full_weights() * 2, [spec] * 4), [spec] * 4)[:3]
    sizes, seen = [], []

    def watched(p, h):
        w = p["w"]
        while torch._C._functorch.is_functorch_wrapped_tensor(w):
            w = torch._C._functorch.get_unwrapped(w)
        seen.append(w)
        return layer(p, h)

    block = fh.gathered(fh.per_rank(watched, mesh), spec)
    held = lambda: [w.untyped_storage().nbytes() for w in seen]  # noqa: E731

    def loss(s, x):
        # a tap between units 0 and 1: units 1 and 2 have run their backward when it runs
        h = block(s[2], block(s[1], Tap.apply(block(s[0], x), lambda: sizes.append(held()))))
        sizes.append(held())
        return h.square().sum()

    xs = _data(10, B)
    g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    after_forward, in_backward = sizes
    assert after_forward[:2] == [0, 0] and after_forward[2] > 0  # the last unit kept
    assert in_backward[2] == 0  # released again once its backward was over
    loop = [torch.func.grad(loss)(params, x) for x in xs]
    stacked = optree.tree_map(lambda *t: torch.stack(t), *loop)
    assert all(map(torch.equal, optree.tree_leaves(g), optree.tree_leaves(stacked)))


def test_psum_and_pmean_are_differentiable_and_the_others_refuse_a_tracked_tree():
    mesh = fh.SimMesh({"dp": 2})
    x = torch.tensor([[1.0], [2.0]])
    # every rank's loss is (its mean)^2: d/dx_r = 2 * mean; psum: 2 * (sum) * 2 ranks
    assert torch.equal(torch.func.grad(lambda x: fh.pmean(x, "dp", mesh).square().sum())(x),
                       torch.full((2, 1), 3.0))  # fmt: skip
    assert torch.equal(torch.func.grad(lambda x: fh.psum(x, "dp", mesh).square().sum())(x),
                       torch.full((2, 1), 12.0))  # fmt: skip
    _, tangent = torch.func.jvp(lambda x: fh.pmean(x, "dp", mesh), (x,), (torch.ones(2, 1),))
    assert torch.equal(tangent, torch.ones(2, 1))
    spec = fh.fsdp(mesh)
    with pytest.raises(TypeError, match="reduce_grads is not differentiable"):
        torch.func.grad(lambda g: fh.reduce_grads({"w": g}, spec, last=True)["w"].sum())(
            torch.ones(2, 4)
        )
    with pytest.raises(TypeError, match="gather is not differentiable"):
        shards = fh.shard({"w": torch.ones(4)}, spec)
        torch.func.grad(lambda s: fh.gather(s, spec)["w"].sum())(shards)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp_sgd_per_example_norms_and_clipped_sum_are_the_dense_ones(strategy):
    """DP-SGD's two passes: each rank's per-example gradient norms (before any reduction
    across ranks), then a first-order gradient of the clip-weighted loss: the mean over ranks
    of the sums of clipped per-example gradients, as dense per-example clipping gives."""
    from transform_problem import dense_loss

    pb = _problem(strategy)
    examples = _data(9, B)[..., :1, :]  # B examples of one row on each rank
    with fh.comm_log() as log:
        norms = fh.per_example_grad_norms(pb.loss, pb.params, examples, chunk_size=2)
    assert not [e for e in log.events if e.op == "reduce_scatter"]  # nothing mixed, or sent
    per_rank = examples.reshape(B, -1, D)  # [example, rank]
    dense = [[torch.func.grad(dense_loss)(pb.full, x) for x in row] for row in per_rank]
    want_norms = torch.tensor(
        [
            [torch.cat([t.flatten() for t in optree.tree_leaves(g)]).norm() for g in row]
            for row in dense
        ]
    )
    assert torch.allclose(norms.reshape(B, -1), want_norms, rtol=1e-5)

    clip = 0.5 * want_norms.median()
    scale = (clip / norms).clamp(max=1.0)  # (B, *mesh)
    batch = examples.squeeze(-2).movedim(0, -2)  # (*mesh, B, D): each rank's batch

    def weighted(s):
        per_example = pb.out(s, batch).square().sum(-1)  # (*mesh, B)
        return (per_example * scale.movedim(0, -1)).sum()

    got = _every_rank(pb.finish(torch.func.grad(weighted)(pb.params)))
    clipped = [
        optree.tree_map(lambda t, c=c: t * c, g)
        for row, crow in zip(dense, (clip / want_norms).clamp(max=1.0))
        for g, c in zip(row, crow)
    ]
    want = optree.tree_map(lambda *t: sum(t) / per_rank.shape[1], *clipped)
    assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jacfwd_jacrev_and_the_jvps_of_basis_tangents(strategy):
    """jacfwd (vmap of jvp) gives exact tangents; jacrev (vmap of vjp) follows the mean
    convention, its reduce-scatter averaging over the sharded axes: jacrev * n = jacfwd, n
    the product of those axes' sizes. A column of jacfwd is the jvp of that basis tangent."""
    import math

    pb = _problem(strategy)
    x = _data(11)[..., :1, :]
    f = lambda s: pb.out(s, x)  # noqa: E731
    fwd = torch.func.jacfwd(f)(pb.params)
    rev = torch.func.jacrev(f)(pb.params)
    n = math.prod(pb.mesh.size(a) for a in pb.spec.sharded_axes("gradient"))
    assert rel(optree.tree_map(lambda t: t * n, rev), fwd) <= 1e-5
    piece = pb.params[0]["w"]
    k = piece.shape[-1] // 2
    basis = optree.tree_map(torch.zeros_like, pb.params)
    basis[0]["w"][..., k] = 1.0
    _, column = torch.func.jvp(f, (pb.params,), (basis,))
    jac = fwd[0]["w"].flatten(column.dim())  # (*out, every rank's piece elements)
    index = torch.arange(piece.numel()).reshape(piece.shape)[..., k].flatten()
    assert torch.allclose(column, jac[..., index].sum(-1), atol=1e-6)
