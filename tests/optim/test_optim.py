"""global_norm, clip_by_global_norm, sgd and adamw on SimMesh, against dense torch references."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import (
    AXES,
    STRATEGIES,
    accumulate,
    dense_norm,
    dense_reduce,
    max_error,
    preset,
    random_tree,
    torch_clip,
)

import functional_hsdp as fh

MESHES = [(2, 2), (1, 4), (2, 3)]
R, F, P = fh.Replicate(), fh.Flat(), fh.Partial("avg")


def _mesh(shape, axes=AXES) -> fh.SimMesh:
    return fh.SimMesh(dict(zip(axes, shape)))


def _final(spec, shape, seed=0, microbatches=2):
    """Final reduced gradients on a SimMesh and their dense (float64) value."""
    micro = [random_tree(shape, seed=seed + m) for m in range(microbatches)]
    return accumulate(micro, spec), dense_reduce(micro, len(shape))


def _assert_all_equal(norm: torch.Tensor, expected: float, shape, rtol=1e-6) -> None:
    assert norm.shape == tuple(shape)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(
        norm.double(), torch.full(shape, expected).double(), rtol=rtol, atol=0
    )


# -- global_norm equals the dense norm -----------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_norm_of_reduced_grads_equalsdense_norm(strategy, shape):
    spec = preset(strategy, _mesh(shape))
    final, dense = _final(spec, shape)
    _assert_all_equal(fh.global_norm(final, spec), dense_norm(dense), shape)
    # an elementwise function of a result (untagged leaves) is measured the same way
    doubled = optree.tree_map(lambda x: 2 * x, final)
    _assert_all_equal(fh.global_norm(doubled, spec), 2 * dense_norm(dense), shape)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_norm_of_sharded_weights_equalsdense_norm(strategy):
    shape = (2, 3)
    spec = preset(strategy, _mesh(shape))
    full = random_tree((), seed=3)
    _assert_all_equal(fh.global_norm(fh.shard(full, spec), spec), dense_norm(full), shape)


def _three_axis_spec(mesh):
    return fh.Spec(mesh, parameter=[R, R, F], gradient=[P, P, F], optimizer=[R, F, F])


UNEVEN = {"a": (7, 3), "b": (5,), "c": (1,), "d": (2, 3, 3), "e": ()}


def test_global_norm_on_a_three_axis_mesh_with_a_hand_built_spec():
    shape = (2, 2, 2)
    spec = _three_axis_spec(_mesh(shape, ("x", "y", "z")))
    micro = [random_tree(shape, shapes=UNEVEN, seed=m) for m in range(3)]
    final = accumulate(micro, spec)
    dense = dense_reduce(micro, 3)
    assert max_error(fh.gather(final, spec), dense) < 1e-5  # the library takes this spec
    with fh.comm_log() as log:
        norm = fh.global_norm(final, spec)
    _assert_all_equal(norm, dense_norm(dense), shape)
    # split over y and z: one scalar all-reduced over each, none over the replicated x
    assert [(e.op, e.axis, e.numel) for e in log.events] == [
        ("all_reduce", "y", 1),
        ("all_reduce", "z", 1),
    ]


def test_global_norm_counts_shard_dim_axes_as_sharded():
    shape = (2, 3)
    mesh = _mesh(shape)
    s0 = fh.Shard(0)
    # FSDP2-style torch.chunk shards (zero-filled on a SimMesh), beside a Flat subtree
    shard_spec = fh.Spec(mesh, parameter=[R, s0], gradient=[P, s0], optimizer=[R, s0])
    spec = {"a": shard_spec, "n": fh.hfsdp(mesh, *AXES), "z": shard_spec}
    final, dense = _final(spec, shape, seed=4)
    with fh.comm_log() as log:
        norm = fh.global_norm(final, spec)
    _assert_all_equal(norm, dense_norm(dense), shape)
    assert [(e.op, e.axis, e.numel) for e in log.events] == [
        ("all_reduce", "dp_outer", 1),
        ("all_reduce", "dp_inner", 2),
    ]
    clipped, _ = fh.clip_by_global_norm(final, spec, 0.5 * dense_norm(dense))
    assert max_error(fh.gather(clipped, spec), torch_clip(dense, 0.5 * dense_norm(dense))[0]) < 1e-6


def test_global_norm_ignores_a_non_data_parallel_axis():
    # tp is Replicate in every role: raw gradients are the same on every tp rank
    shape = (2, 2, 2)
    mesh = _mesh(shape, (*AXES, "tp"))
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    micro = [
        optree.tree_map(lambda x: x[:, :, None].expand(shape + x.shape[2:]), g)
        for g in (random_tree(shape[:2], seed=m) for m in range(2))
    ]
    dense = dense_reduce([optree.tree_map(lambda x: x[:, :, 0], g) for g in micro], 2)
    final = accumulate(micro, spec)
    with fh.comm_log() as log:
        norm = fh.global_norm(final, spec)
    _assert_all_equal(norm, dense_norm(dense), shape)
    assert [(e.op, e.axis, e.numel) for e in log.events] == [("all_reduce", "dp_inner", 1)]


# -- the three known silent bugs -----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_norm_does_not_depend_on_the_replica_count(strategy):
    # bug: reducing the norm over the replica group too makes it sqrt(n_replicas) too large
    full = random_tree((), seed=5)
    expected = dense_norm(full)
    for outer in (1, 2, 3):
        shape = (outer, 2)
        spec = preset(strategy, _mesh(shape))
        _assert_all_equal(fh.global_norm(fh.shard(full, spec), spec), expected, shape)


def test_norm_does_not_depend_on_the_shard_count():
    # bug: a norm over the local shard only is sqrt(n_shards) too small
    full = random_tree((), seed=6)
    expected = dense_norm(full)
    for inner in (1, 2, 3, 4):
        for strategy in ("fsdp", "hfsdp"):
            shape = (2, inner)
            spec = preset(strategy, _mesh(shape))
            _assert_all_equal(fh.global_norm(fh.shard(full, spec), spec), expected, shape)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_epsilon_is_added_once_not_per_rank(strategy):
    # bug: an epsilon added per rank before the reduction. A zero tree has norm exactly 0,
    # and a tiny one is clipped by torch's factor max_norm / (norm + 1e-6).
    shape = (2, 2)
    spec = preset(strategy, _mesh(shape))
    zeros = fh.shard(optree.tree_map(torch.zeros_like, random_tree((), seed=0)), spec)
    assert torch.equal(fh.global_norm(zeros, spec), torch.zeros(shape))
    full = random_tree((), seed=7)
    tiny = optree.tree_map(lambda x: x * (2e-6 / dense_norm(full)), full)
    clipped, _ = fh.clip_by_global_norm(fh.shard(tiny, spec), spec, max_norm=1e-6)
    ref = torch_clip(tiny, 1e-6)[0]
    assert max_error(fh.gather(clipped, spec), ref) < 1e-12
    ratio = float(
        optree.tree_leaves(ref)[0].flatten()[0] / optree.tree_leaves(tiny)[0].flatten()[0]
    )
    assert ratio == pytest.approx(1 / 3, rel=1e-4)


def test_one_collective_per_sharded_axis_however_many_leaves():
    shape = (2, 2)
    mesh = _mesh(shape)
    hsdp, hfsdp = fh.hsdp(mesh, *AXES), fh.hfsdp(mesh, *AXES)
    many = {f"k{n}": (n + 1, 3) for n in range(40)}
    tree = {"a": random_tree(shape, shapes=many, seed=1), "b": random_tree(shape, seed=2)}
    spec = {"a": hsdp, "b": hfsdp}
    final = accumulate([tree], spec)
    with fh.comm_log() as log:
        norm = fh.global_norm(final, spec)
    # a's leaves are split over dp_inner, b's over both: two scalars over dp_inner, one over
    # dp_outer
    assert [(e.op, e.axis, e.numel) for e in log.events] == [
        ("all_reduce", "dp_outer", 1),
        ("all_reduce", "dp_inner", 2),
    ]
    _assert_all_equal(norm, dense_norm(dense_reduce([tree], 2)), shape)


def test_global_norm_of_mixed_dtypes_and_an_empty_tree():
    shape = (2, 2)
    spec = fh.hfsdp(_mesh(shape), *AXES)
    full = {"a": torch.randn(9, 2), "h": torch.randn(5, dtype=torch.bfloat16)}
    with fh.comm_log() as log:
        norm = fh.global_norm(fh.shard(full, spec), spec)
    assert len(log.events) == 2  # one float32 scalar per axis, whatever the leaves' dtypes
    _assert_all_equal(norm, dense_norm(full), shape)
    wide = fh.global_norm(fh.shard({"a": full["a"].double()}, spec), spec)
    assert wide.dtype == torch.float64
    assert torch.equal(fh.global_norm({}, spec), torch.zeros(shape))


# -- clipping matches torch.nn.utils.clip_grad_norm_ ---------------------------------------


@pytest.mark.parametrize("clips", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_by_global_norm_matches_torch_clip_grad_norm(strategy, clips):
    shape = (2, 3)
    spec = preset(strategy, _mesh(shape))
    final, dense = _final(spec, shape, seed=11)
    max_norm = dense_norm(dense) * (0.3 if clips else 2.0)
    clipped, norm = fh.clip_by_global_norm(final, spec, max_norm)
    ref, ref_norm = torch_clip(dense, max_norm)
    torch.testing.assert_close(norm, ref_norm.expand(shape), rtol=1e-6, atol=0)
    assert max_error(fh.gather(clipped, spec), ref) < 1e-6
    after = fh.global_norm(clipped, spec)
    assert bool((after <= max_norm * (1 + 1e-6)).all()) if clips else torch.equal(after, norm)
    for c, f in zip(optree.tree_leaves(clipped), optree.tree_leaves(final)):
        assert c.shape == f.shape and c.dtype == f.dtype
        if not clips:
            assert torch.equal(c, f)


# -- sgd and adamw on sharded trees equal torch.optim on dense params ----------------------


def _run(strategy, shape, make_fh, make_torch, steps=3, max_norm=None):
    spec = preset(strategy, _mesh(shape))
    full = random_tree((), seed=20)
    params = fh.shard(full, spec)
    opt = make_fh()
    state = opt.init(params)
    dense_leaves, treedef = optree.tree_flatten(full)
    dense = [x.clone().requires_grad_() for x in dense_leaves]
    torch_opt = make_torch(dense)
    for step in range(steps):
        micro = [random_tree(shape, seed=100 * step + m) for m in range(2)]
        grads = accumulate(micro, spec)
        for p, g in zip(dense, optree.tree_leaves(dense_reduce(micro, len(shape)))):
            p.grad = g.float()
        if max_norm is not None:
            grads, norm = fh.clip_by_global_norm(grads, spec, max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(dense, max_norm)
            torch.testing.assert_close(norm, ref_norm.expand(shape), rtol=1e-5, atol=0)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        torch_opt.step()
    assert state.count == steps
    ref = optree.tree_unflatten(treedef, [p.detach().double() for p in dense])
    assert max_error(fh.gather(params, spec), ref) < 2e-6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sgd_on_shards_equals_torch_sgd_on_dense_params(strategy):
    _run(
        strategy,
        (2, 3),
        lambda: fh.sgd(0.1, momentum=0.9, weight_decay=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05),
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nesterov_sgd_on_shards_equals_torch_nesterov_sgd(strategy):
    _run(
        strategy,
        (2, 3),
        lambda: fh.sgd(0.7, momentum=0.9, weight_decay=0.01, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, weight_decay=0.01, nesterov=True),
    )


def test_nesterov_without_momentum_is_refused_as_torch_does():
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        fh.sgd(0.1, nesterov=True)


def test_plain_sgd_keeps_no_buffers():
    _run("hsdp", (2, 2), lambda: fh.sgd(0.2), lambda ps: torch.optim.SGD(ps, lr=0.2))
    assert fh.sgd(0.2).init({"w": torch.ones(3)}).momentum is None


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adamw_on_shards_equals_torch_adamw_on_dense_params(strategy, shape):
    _run(
        strategy,
        shape,
        lambda: fh.adamw(0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    )


def test_adamw_with_clipping_equals_torch_adamw_with_clip_grad_norm():
    _run(
        "hfsdp",
        (2, 2),
        lambda: fh.adamw(0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01),
        steps=4,
        max_norm=1.0,
    )


def test_torch_adamw_on_local_shards_equals_functional_adamw():
    # torch.optim works on local shards as they are (on a SimMesh, all ranks stacked): only
    # the norm needs fh.clip_by_global_norm
    shape = (2, 2)
    spec = fh.hfsdp(_mesh(shape), *AXES)
    params = fh.shard(random_tree((), seed=30), spec)
    local = [p.clone().requires_grad_() for p in optree.tree_leaves(params)]
    torch_opt = torch.optim.AdamW(local, lr=0.05)
    opt = fh.adamw(0.05)
    state = opt.init(params)
    for step in range(3):
        grads = accumulate([random_tree(shape, seed=step)], spec)
        grads, _ = fh.clip_by_global_norm(grads, spec, max_norm=2.0)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        for p, g in zip(local, optree.tree_leaves(grads)):
            p.grad = g
        torch_opt.step()
    # the ragged zero fill stays zero: resharding the gathered result gives the same pieces
    resharded = optree.tree_leaves(fh.shard(fh.gather(params, spec), spec))
    for p, q, r in zip(local, optree.tree_leaves(params), resharded):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)
        assert torch.equal(q, r)


def test_update_is_pure():
    params = {"w": torch.ones(4)}
    grads = {"w": torch.full((4,), 0.5)}
    opt = fh.adamw(0.1)
    state = opt.init(params)
    before = [x.clone() for x in optree.tree_leaves((params, grads, state.mu, state.nu))]
    opt.update(grads, state, params)
    after = optree.tree_leaves((params, grads, state.mu, state.nu))
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and state.count == 0


# -- bad input -----------------------------------------------------------------------------


def test_global_norm_refuses_a_partial_tree_with_its_path():
    shape = (2, 2)
    for strategy in ("ddp", "hsdp", "hfsdp"):
        spec = preset(strategy, _mesh(shape))
        acc = fh.reduce_grads(random_tree(shape, seed=0), spec, last=False)
        with pytest.raises(ValueError, match=r"tree\['a'\]: is an accumulating gradient") as e:
            fh.global_norm(acc, spec)
        assert "reduce_grads(..., last=True)" in str(e.value)
        with pytest.raises(ValueError, match=r"tree\[0\]: is an accumulating"):
            fh.clip_by_global_norm(acc["n"], spec, 1.0)


def test_global_norm_refuses_a_tree_made_for_another_spec():
    shape = (2, 2)
    mesh = _mesh(shape)
    hsdp, hfsdp = fh.hsdp(mesh, *AXES), fh.hfsdp(mesh, *AXES)
    final = accumulate([random_tree(shape, seed=0)], hsdp)
    with pytest.raises(
        ValueError, match=r"tree\['a'\]: was made at the optimizer placement \[R, F\]"
    ):
        fh.global_norm(final, hfsdp)
    with pytest.raises(ValueError, match="split over"):
        fh.global_norm(final["n"], fh.fsdp(mesh))  # a subtree: still recognised
    # parameter placement of hfsdp is [R, F], not its optimizer placement [F, F]
    weights = fh.sync_params(fh.shard(random_tree((), seed=0), hfsdp), hfsdp)
    with pytest.raises(ValueError, match=r"tree\['a'\]: was made at the parameter placement"):
        fh.global_norm(weights, hfsdp)
    # full tensors where the spec expects Flat pieces
    with pytest.raises(ValueError, match=r"tree\['a'\]: .* 1-D piece"):
        fh.global_norm(random_tree(shape), fh.fsdp(mesh))
    # a different spec that splits the same axes gives the same norm, so it is accepted
    same = fh.hsdp(mesh, *AXES, bucket_cap_mb=1e-4)
    assert torch.equal(fh.global_norm(final, same), fh.global_norm(final, hsdp))


def test_global_norm_refuses_leaves_without_the_mesh_dims_or_not_floating():
    spec = fh.ddp(_mesh((2, 2)))
    with pytest.raises(ValueError, match=r"tree\['w'\]: .* leading dims must be the mesh shape"):
        fh.global_norm({"w": torch.ones(3)}, spec)
    with pytest.raises(TypeError, match=r"tree\['w'\]: expected a floating dtype"):
        fh.global_norm({"w": torch.ones(2, 2, 3, dtype=torch.int64)}, spec)
    with pytest.raises(ValueError, match="max_norm must be a finite number"):
        fh.clip_by_global_norm({"w": torch.ones(2, 2, 3)}, spec, -1.0)


def test_optimizer_state_from_another_spec_is_refused():
    shape = (2, 2)
    mesh = _mesh(shape)
    full = random_tree((), seed=0)
    hsdp, hfsdp = fh.hsdp(mesh, *AXES), fh.hfsdp(mesh, *AXES)
    params = fh.shard(full, hfsdp)
    grads = accumulate([random_tree(shape, seed=1)], hfsdp)
    for opt in (fh.adamw(0.1), fh.sgd(0.1, momentum=0.9)):
        stale = opt.init(fh.shard(full, hsdp))
        with pytest.raises(
            ValueError, match=r"state\.(mu|momentum)\[.*\]: expected local shape"
        ) as e:
            opt.update(grads, stale, params)
        assert "made for another spec" in str(e.value)
        other_tree = opt.init({"a": params["a"]})
        with pytest.raises(ValueError, match=r"does not have the structure of params"):
            opt.update(grads, other_tree, params)
    with pytest.raises(TypeError, match="state: expected a ScaleByAdamState"):
        fh.adamw(0.1).update(grads, fh.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match="made without momentum"):
        fh.sgd(0.1, momentum=0.9).update(grads, fh.sgd(0.1).init(params), params)


def test_update_refuses_grads_at_another_placement_or_still_partial():
    shape = (2, 2)
    mesh = _mesh(shape)
    hsdp, hfsdp = fh.hsdp(mesh, *AXES), fh.hfsdp(mesh, *AXES)
    params = fh.shard(random_tree((), seed=0), hfsdp)
    opt = fh.adamw(0.1)
    state = opt.init(params)
    g = random_tree(shape, seed=1)
    with pytest.raises(ValueError, match=r"grads\[.*\]: expected local shape"):
        opt.update(accumulate([g], hsdp), state, params)
    with pytest.raises(ValueError, match=r"grads\['a'\]: is an accumulating gradient"):
        opt.update(fh.reduce_grads(g, hfsdp, last=False), fh.adamw(0.1).init(params), params)
    with pytest.raises(ValueError, match="b1 must be in"):
        fh.adamw(0.1, b1=1.0)
    with pytest.raises(ValueError, match="lr must be a number"):
        fh.sgd(-0.1)


def test_apply_updates_keeps_the_tag_of_params_the_library_returned():
    from functional_hsdp.base.tags import state_of

    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = fh.owned(preset("hsdp", mesh), "dp_outer")
    full = random_tree((), seed=3)
    params = fh.shard(full, spec)
    updates = optree.tree_map(torch.ones_like, params)
    new = fh.apply_updates(params, updates)
    for leaf in optree.tree_leaves(new):
        state, _ = state_of(leaf)
        assert (state.role, state.kind) == ("optimizer", "weights")
    want = optree.tree_map(lambda x: (x + 1).expand(2, 2, *x.shape), full)
    got = fh.gather(new, spec)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))
    # a tree the user made (tree_map) stays untagged, and so does apply_updates' result of it
    mine = optree.tree_map(torch.clone, params)
    assert all(state_of(x) is None for x in optree.tree_leaves(fh.apply_updates(mine, updates)))
