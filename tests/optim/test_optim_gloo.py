"""Optimizers on 4 real gloo processes (2x2 mesh), started once for the module.

HFSDP with fh.adamw and fh.clip_by_global_norm trains a small torch.func MLP and matches a
single-rank baseline that uses torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ on the full
batch; so does the chain fh.clip_global_norm, scale_by_adam, add_decayed_weights,
scale_by_learning_rate(schedule) against AdamW with torch's LambdaLR (and fh.adamw with that
schedule is the chain bit for bit); global_norm on a DistMesh gives SimMesh's norm on every rank;
fh.gaussian_noise on every rank is SimMesh's at its coordinates bit for bit, with no collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import (
    AXES,
    GLOO_SHAPE,
    MLP_IN,
    STRATEGIES,
    accumulate,
    dist_mesh,
    dist_preset,
    mlp_loss,
    mlp_problem,
    mlp_step,
    preset,
    random_tree,
    this_rank,
)
from torch.func import grad_and_value

import functional_hsdp as fh

LR, STEPS, MICROBATCHES = 0.05, 5, 3
MAX_NORM = 0.25  # between the gradient norms of the steps: clipping is active in some only


def _setup():
    return mlp_problem(GLOO_SHAPE[0] * GLOO_SHAPE[1], MICROBATCHES)


def _train_hfsdp_adamw():
    spec = fh.hfsdp(dist_mesh(), *AXES)
    model, full0, x, y = _setup()
    step_grad = grad_and_value(mlp_loss(model))
    rank = dist.get_rank()
    params = fh.shard(full0, spec)  # main weights at the optimizer placement [F, F]
    opt = fh.adamw(LR)
    assert isinstance(opt, fh.GradientTransformation)  # optax's (init, update) pair
    state = opt.init(params)
    losses, norms = [], []
    for _ in range(STEPS):
        acc, loss_sum = mlp_step(step_grad, fh.gather(params, spec), x[rank], y[rank], spec)
        with fh.comm_log() as log:
            grads, norm = fh.clip_by_global_norm(acc, spec, MAX_NORM)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        losses.append(loss_sum)
        norms.append(norm)
    events = [(e.op, e.axis, e.numel) for e in log.events]
    return torch.tensor(losses), torch.stack(norms), fh.gather(params, spec), events


def _train_single_rank():
    model, params, x, y = _setup()
    params = {k: v.requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=LR)
    loss_fn = mlp_loss(model)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(params, x.reshape(-1, MLP_IN), y.reshape(-1, 1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM))
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), torch.stack(norms), {k: v.detach() for k, v in params.items()}


def test_hfsdp_adamw_with_clipping_matches_single_rank_torch_adamw(pool):
    results = pool.run(_train_hfsdp_adamw)
    ref_losses, ref_norms, ref_params = _train_single_rank()
    assert (ref_norms > MAX_NORM).any() and (ref_norms < MAX_NORM).any()
    # each rank's loss is the mean over its samples; equal sizes make their mean the global one
    losses = torch.stack([r[0] for r in results]).mean(0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]
    for _, norms, final, events in results:
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(norms, results[0][1], rtol=0, atol=0)  # same on every rank
        for k in ref_params:
            torch.testing.assert_close(final[k], ref_params[k], rtol=1e-5, atol=1e-6)
        # one scalar all-reduced per sharded axis
        assert events == [("all_reduce", "dp_outer", 1), ("all_reduce", "dp_inner", 1)]


# -- DistMesh and SimMesh give the same norm -----------------------------------------------


def _norm_on_rank(strategy: str):
    spec = dist_preset(strategy)
    micro = [this_rank(random_tree(GLOO_SHAPE, seed=m)) for m in range(2)]
    return fh.global_norm(accumulate(micro, spec), spec)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dist_global_norm_equals_sim_global_norm(pool, strategy):
    results = pool.run(_norm_on_rank, strategy)
    spec = preset(strategy, fh.SimMesh(dict(zip(AXES, GLOO_SHAPE))))
    micro = [random_tree(GLOO_SHAPE, seed=m) for m in range(2)]
    sim = fh.global_norm(accumulate(micro, spec), spec)
    for rank, norm in enumerate(results):
        assert norm.shape == ()
        torch.testing.assert_close(norm, sim[divmod(rank, GLOO_SHAPE[1])], rtol=1e-6, atol=0)


# -- the combinators: a chain with a schedule ------------------------------------------------

SCHEDULE_STEPS = 6
SCHEDULE = fh.schedules.warmup_cosine_decay(
    0.0, 0.05, warmup_steps=2, decay_steps=SCHEDULE_STEPS, end_value=0.005
)
B1, B2, WD = 0.8, 0.99, 0.1


def _chain(spec, lr):
    return fh.chain(
        fh.clip_global_norm(spec, MAX_NORM),
        fh.scale_by_adam(b1=B1, b2=B2),
        fh.add_decayed_weights(WD),
        fh.scale_by_learning_rate(lr),
    )


def _train_hfsdp_chain():
    spec = fh.hfsdp(dist_mesh(), *AXES)
    model, full0, x, y = _setup()
    step_grad = grad_and_value(mlp_loss(model))
    rank = dist.get_rank()
    params = fh.shard(full0, spec)
    opt = _chain(spec, SCHEDULE)
    adamw = fh.adamw(SCHEDULE, b1=B1, b2=B2, weight_decay=WD)  # after the same clipping
    state, adamw_state = opt.init(params), adamw.init(params)
    losses, same = [], []
    for _ in range(SCHEDULE_STEPS):
        acc, loss_sum = mlp_step(step_grad, fh.gather(params, spec), x[rank], y[rank], spec)
        with fh.comm_log() as log:
            updates, state = opt.update(acc, state, params)
        clipped, _ = fh.clip_by_global_norm(acc, spec, MAX_NORM)
        adamw_updates, adamw_state = adamw.update(clipped, adamw_state, params)
        same.append(all(torch.equal(updates[k], adamw_updates[k]) for k in updates))
        params = fh.apply_updates(params, updates)
        losses.append(loss_sum)
    events = [(e.op, e.axis, e.numel) for e in log.events]
    counts = (state.inner[1].count, state.inner[3].count, adamw_state.count)
    kinds = (type(state), *map(type, state.inner), type(adamw_state))
    sgd = fh.sgd(SCHEDULE, momentum=0.9)  # a schedule's step is the state's count there too
    sgd_state = sgd.update(acc, sgd.init(params), params)[1]
    assert isinstance(sgd_state, fh.SGDState) and sgd_state.count == 1
    return torch.tensor(losses), fh.gather(params, spec), events, same, counts, kinds


def _train_single_rank_lambdalr():
    model, params, x, y = _setup()
    params = {k: v.requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=1.0, betas=(B1, B2), weight_decay=WD)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: SCHEDULE(step))
    loss_fn = mlp_loss(model)
    losses, norms = [], []
    for _ in range(SCHEDULE_STEPS):
        opt.zero_grad()
        loss = loss_fn(params, x.reshape(-1, MLP_IN), y.reshape(-1, 1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM))
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return torch.tensor(losses), torch.stack(norms), {k: v.detach() for k, v in params.items()}


def test_adam_chain_with_a_schedule_matches_torch_adamw_with_lambdalr(pool):
    """clip_global_norm -> scale_by_adam -> add_decayed_weights -> scale_by_learning_rate
    (warmup-cosine) on HFSDP shards == clip_grad_norm_ + AdamW + LambdaLR on the full batch;
    fh.adamw (same schedule) after fh.clip_by_global_norm is the chain bit for bit."""
    results = pool.run(_train_hfsdp_chain)
    ref_losses, ref_norms, ref_params = _train_single_rank_lambdalr()
    assert (ref_norms > MAX_NORM).any() and (ref_norms < MAX_NORM).any()
    losses = torch.stack([r[0] for r in results]).mean(0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]
    states = (fh.ChainState, fh.EmptyState, fh.ScaleByAdamState, fh.EmptyState)
    states += (fh.ScaleByLearningRateState, fh.ScaleByAdamState)
    for _, final, events, same, counts, kinds in results:
        assert kinds == states
        for k in ref_params:
            torch.testing.assert_close(final[k], ref_params[k], rtol=0, atol=1e-6)
        assert all(same) and counts == (SCHEDULE_STEPS,) * 3
        # the chain communicates only the norm: one scalar all-reduced per sharded axis
        assert events == [("all_reduce", "dp_outer", 1), ("all_reduce", "dp_inner", 1)]


NOISE_SHAPES = {"w": (37, 11), "b": (5,), "big": (300,)}
NOISE_SPECS = ("hsdp", "fsdp", "hfsdp", "owned", "owned_inner")


def _noise_spec(name: str, mesh):
    if name == "owned":
        return fh.owned(preset("hsdp", mesh))
    if name == "owned_inner":
        return fh.owned(preset("hsdp", mesh), "dp_inner")
    return preset(name, mesh)


def _noise_on_rank():
    """Each spec's noise (seed 7, step 3) as this rank draws it, with no collective."""
    out = {}
    for name in NOISE_SPECS:
        spec = _noise_spec(name, dist_mesh())
        g = fh.shard({k: torch.zeros(s) for k, s in NOISE_SHAPES.items()}, spec)
        with fh.comm_log() as log:
            out[name] = fh.gaussian_noise(g, spec, seed=7, step=3, block=64)
        assert not log.events
    return out


def test_gaussian_noise_on_4_ranks_is_simmeshs_shard_by_shard(pool):
    """Every rank's noise equals the SimMesh's at its coordinates bit for bit, for each spec
    (so replicas along dp_outer draw the same noise, and the noise is the dense one's); the
    SimMesh's zero fill of ragged pieces stays zero."""
    results = pool.run(_noise_on_rank)
    mesh = fh.SimMesh(dict(zip(AXES, GLOO_SHAPE)))
    for name in NOISE_SPECS:
        spec = _noise_spec(name, mesh)
        g = fh.shard({k: torch.zeros(s) for k, s in NOISE_SHAPES.items()}, spec)
        want = fh.gaussian_noise(g, spec, seed=7, step=3, block=64)
        for rank, got in enumerate(results):
            o, i = divmod(rank, GLOO_SHAPE[1])
            for k in NOISE_SHAPES:
                mine, sim = got[name][k], want[k][o, i]  # SimMesh: zero fill after the piece
                assert torch.equal(mine, sim[: mine.shape[0]]), (name, k, rank)
                assert not sim[mine.shape[0] :].any(), (name, k, rank)
