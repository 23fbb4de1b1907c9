"""DP-SGD's noise on SimMesh (fh.gaussian_noise, fh.add_gaussian_noise): one dense noise tree
per (seed, step), the same whatever the mesh or spec; replicas of a shard draw the same, other
shards independent noise; a rank draws only its own shard's blocks; the scale statistically;
bad input. The gloo form is in test_optim_gloo.py."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from reference import AXES, preset

import functional_hsdp as fh
from functional_hsdp.optim import noise as noise_room

SHAPES = {"w": (37, 11), "b": (5,), "e": (2, 3, 7), "big": (300,)}


def _zeros(batch=()):
    return {k: torch.zeros(*batch, *s) for k, s in SHAPES.items()}


def _dense(seed=0, step=0, block=noise_room.BLOCK):
    one = fh.ddp(fh.SimMesh({"dp": 1}))
    z = fh.gaussian_noise(_zeros((1,)), one, seed=seed, step=step, block=block)
    return {k: v[0] for k, v in z.items()}


def _specs(shape):
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    hsdp = preset("hsdp", mesh)
    return {
        **{name: preset(name, mesh) for name in ("ddp", "fsdp", "hsdp", "hfsdp")},
        "owned": fh.owned(hsdp),
        "owned_inner": fh.owned(hsdp, "dp_inner"),
        "tree": {"w": hsdp, "b": preset("fsdp", mesh), "e": fh.owned(hsdp), "big": hsdp},
    }


@pytest.mark.parametrize("block", [16, noise_room.BLOCK])
@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_every_spec_draws_pieces_of_the_same_dense_noise(shape, block):
    dense = _dense(seed=3, step=5, block=block)
    for name, spec in _specs(shape).items():
        z = fh.gaussian_noise(fh.shard(_zeros(), spec), spec, seed=3, step=5, block=block)
        full = fh.gather(z, spec)
        for k, v in dense.items():
            for r in range(math.prod(shape)):
                got = full[k].flatten(0, 1)[r]
                assert torch.equal(got, v), (name, k, r)


def test_replicas_of_a_shard_draw_the_same_noise_other_shards_other_noise():
    spec = _specs((3, 2))["hsdp"]
    z = fh.gaussian_noise(fh.shard(_zeros(), spec), spec, seed=1, step=0)
    for k, v in z.items():  # local shards (dp_outer, dp_inner, n)
        assert torch.equal(v[0], v[1]) and torch.equal(v[0], v[2]), k
        if v.shape[-1] > 1:
            assert not torch.equal(v[0, 0], v[0, 1]), k


def test_a_rank_draws_only_its_own_shards_blocks(monkeypatch):
    """Each draw is one block of ``block`` elements; a shard overlaps at most its length /
    block + 2 of them: the full leaf is never drawn on a rank that holds part of it."""
    drawn = []
    real = torch.randn

    def counting(*args, **kw):
        out = real(*args, **kw)
        drawn.append(out.numel())
        return out

    block = 8
    spec = _specs((1, 4))["fsdp"]
    g = fh.shard(_zeros(), spec)
    monkeypatch.setattr(noise_room.torch, "randn", counting)
    fh.gaussian_noise(g, spec, seed=0, step=0, block=block)
    monkeypatch.undo()
    numel = sum(math.prod(s) for s in SHAPES.values())
    # 4 ranks, each its quarter of each leaf plus at most one block on either side
    assert sum(drawn) <= numel + 4 * len(SHAPES) * 2 * block
    assert sum(drawn) < 2 * numel  # far from 4 full copies
    assert set(drawn) == {block}


def test_the_scale_and_independence_statistically():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, *AXES)
    n = 200_000
    std = 0.5
    params = fh.shard({"w": torch.zeros(n)}, spec)
    opt = fh.add_gaussian_noise(spec, std, seed=11)
    state = opt.init(params)
    zero = fh.shard({"w": torch.zeros(n)}, spec)
    u0, state = opt.update(zero, state, params)
    u1, state = opt.update(zero, state, params)
    assert state.count == 2
    a, b = u0["w"][0, 0], u0["w"][0, 1]  # two shards of step 0
    c = u1["w"][0, 0]  # the first shard at step 1
    for x in (a, b, c):
        # n / 2 samples: the sample std within 4 standard errors (std / sqrt(n))
        assert abs(x.std().item() - std) < 4 * std / math.sqrt(len(x))
        assert abs(x.mean().item()) < 4 * std / math.sqrt(len(x))
    for x, y in ((a, b), (a, c)):
        corr = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
        assert abs(corr) < 4 / math.sqrt(len(x))


def test_reproducible_by_seed_and_step_and_nothing_else():
    spec = _specs((2, 2))["hsdp"]
    g = fh.shard(_zeros(), spec)
    z = lambda **kw: fh.gaussian_noise(g, spec, **kw)  # noqa: E731
    same = optree.tree_map(torch.equal, z(seed=1, step=2), z(seed=1, step=2))
    assert all(optree.tree_leaves(same))
    for other in (z(seed=2, step=2), z(seed=1, step=3)):
        assert not any(optree.tree_leaves(optree.tree_map(torch.equal, z(seed=1, step=2), other)))


def test_the_noised_step_equals_the_dense_step():
    """chain(add_gaussian_noise, sgd) on shards = the dense gradient plus the dense noise."""
    spec = _specs((2, 3))["hsdp"]
    g_full = {k: torch.randn(s) for k, s in SHAPES.items()}
    opt = fh.chain(fh.add_gaussian_noise(spec, 0.3, seed=4), fh.sgd(0.1))
    params = fh.shard(_zeros(), spec)
    state = opt.init(params)
    for step in range(2):
        updates, state = opt.update(fh.shard(g_full, spec), state, params)
        params = fh.apply_updates(params, updates)
        z = _dense(seed=4, step=step)
        got = fh.gather(updates, spec)
        for k in SHAPES:
            torch.testing.assert_close(got[k][1, 2], -0.1 * (g_full[k] + 0.3 * z[k]))
    opt0 = fh.add_gaussian_noise(spec, 0.0, seed=4)  # no noise: the updates as they are
    g = fh.shard(g_full, spec)
    assert opt0.update(g, opt0.init(params))[0] is g


def test_bad_input_is_refused_naming_the_argument():
    spec = _specs((2, 2))["hsdp"]
    with pytest.raises(ValueError, match="seed is required"):
        fh.add_gaussian_noise(spec, 0.1, seed=None)
    with pytest.raises(TypeError, match="seed must be an int"):
        fh.add_gaussian_noise(spec, 0.1, seed=1.5)
    for bad in (-0.1, float("inf"), float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="stddev must be a finite number"):
            fh.add_gaussian_noise(spec, bad, seed=0)
    with pytest.raises(ValueError, match="block must be a positive int"):
        fh.add_gaussian_noise(spec, 0.1, seed=0, block=0)
    g = fh.shard(_zeros(), spec)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        fh.gaussian_noise(g, spec, seed=0, step=-1)
    with pytest.raises(TypeError, match=r"tree\['i'\]: noise is for floating-point"):
        fh.gaussian_noise({"i": torch.zeros(2, 2, 3, dtype=torch.int64)}, spec, seed=0, step=0)
    opt = fh.add_gaussian_noise(spec, 0.1, seed=0)
    with pytest.raises(TypeError, match="expected an AddGaussianNoiseState"):
        opt.update(g, fh.EmptyState())
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    R, P, S = fh.Replicate(), fh.Partial("avg"), fh.Shard(0)
    rows = fh.Spec(mesh, [R, S], [P, S], [R, S])
    with pytest.raises(NotImplementedError, match=r"\['w'\]: gaussian_noise supports Flat"):
        fh.gaussian_noise(fh.shard({"w": torch.zeros(4, 3)}, rows), rows, seed=0, step=0)
    partial = fh.reduce_grads({"w": torch.ones(2, 2, 6)}, spec, last=False)
    with pytest.raises(ValueError, match="w"):
        fh.gaussian_noise(partial, spec, seed=0, step=0)
