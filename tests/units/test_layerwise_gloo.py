"""Layer-wise HSDP on 4 real gloo ranks (2x2 mesh): parity with dense SGD and with FSDP2's
``fully_shard`` HSDP, and the same collectives as on a SimMesh."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
from lw_problem import LR, dense_train, max_rel_error, train
from reference import AXES, GLOO_SHAPE, dist_preset, preset

import functional_hsdp as fh

STEPS = 3


def _train_task(strategy: str, microbatches: int, mode: str):
    got, events = train(dist_preset(strategy), STEPS, microbatches, mode)
    return optree.tree_map(torch.clone, got), [(e.op, e.axis, e.numel) for e in events]


@pytest.mark.parametrize(
    ("strategy", "microbatches", "mode"),
    [
        ("hsdp", 1, "pure"),
        ("hsdp", 3, "pure"),
        ("hsdp", 1, "sink"),
        ("hsdp", 3, "sink"),
        ("hsdp", 3, "maingrad"),
        ("hfsdp", 3, "sink"),
        ("fsdp", 3, "pure"),
        ("ddp", 3, "sink"),
    ],
)
def test_three_steps_match_dense_sgd_and_the_simmesh(pool, strategy, microbatches, mode):
    ref = dense_train(STEPS, microbatches, 4)
    results = pool.run(_train_task, strategy, microbatches, mode)
    sim_mesh = fh.SimMesh(dict(zip(AXES, GLOO_SHAPE)))
    _, sim_events = train(preset(strategy, sim_mesh), STEPS, microbatches, mode)
    sim_log = [(e.op, e.axis, e.numel) for e in sim_events]
    for got, log in results:
        assert max_rel_error(got, ref) <= 1e-5
        assert log == sim_log  # the same collectives, in the same order, forward and backward


# -- FSDP2 ------------------------------------------------------------------------------------

WIDTH, LAYERS, BATCH = 16, 3, 4


def _stack(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _data(step: int, microbatches: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(microbatches)]


def _fsdp2_task(microbatches: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _stack()
    dm = init_device_mesh("cpu", GLOO_SHAPE, mesh_dim_names=AXES)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=dm)
    fully_shard(model, mesh=dm)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for m, x in enumerate(_data(step, microbatches)):
            model.set_requires_all_reduce(m == microbatches - 1)
            (model(x).square().mean() / microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _fh_task(microbatches: int) -> list[torch.Tensor]:
    """The same model as a tree of Linear units, trained through fh.gathered + MainGrad."""
    model = _stack()
    spec = dist_preset("hsdp")
    full = [dict(layer.named_parameters()) for layer in model if isinstance(layer, torch.nn.Linear)]
    full = optree.tree_map(lambda t: t.detach().clone(), full)
    tree_spec = [spec] * LAYERS
    params = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full)
    linear = torch.nn.Linear(WIDTH, WIDTH)
    blk = fh.gathered(
        lambda p, x: torch.tanh(torch.func.functional_call(linear, p, (x,))), spec, into=mg
    )

    def loss(s, x):
        return fh.sequence(blk, s, x).square().mean() / microbatches

    for step in range(STEPS):
        for x in _data(step, microbatches):
            torch.func.grad(loss)(params, x)
        mg.finish()
        for p, g in zip(optree.tree_leaves(params), optree.tree_leaves(mg.grads)):
            p.sub_(LR * g)  # in place, as torch.optim
        mg.zero_grad()
    full_now = fh.gather(params, tree_spec)
    return [t.clone() for layer in full_now for t in (layer["weight"], layer["bias"])]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_parameters_after_three_steps_equal_fsdp2s(pool, microbatches):
    fsdp2 = pool.run(_fsdp2_task, microbatches)
    ours = pool.run(_fh_task, microbatches)
    for a, b in zip(ours, fsdp2):
        for x, y in zip(a, b):
            assert ((x - y).abs().max() / y.abs().max()).item() <= 1e-5
