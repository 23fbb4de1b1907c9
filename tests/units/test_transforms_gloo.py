"""Every torch.func transform through layer-wise units on 4 gloo ranks (2x2 mesh), for every
preset: per-sample gradients, jvp, Hessian-vector products and a MAML step against dense
torch.func on every rank's data (tests/transform_problem.py), and the same collectives as on a
SimMesh."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
from reference import AXES, GLOO_SHAPE, STRATEGIES, dist_preset, preset
from transform_problem import (
    D,
    Problem,
    T,
    dense_hvp,
    dense_jvp,
    dense_maml,
    dense_per_sample,
    rel,
)

import functional_hsdp as fh

B = 3
WORLD = 4


def _all_ranks(seed: int, *lead: int) -> torch.Tensor:
    """Every rank's data, rank-major: (*lead, WORLD, T, D)."""
    return torch.randn(*lead, WORLD, T, D, generator=torch.Generator().manual_seed(seed))


def _task(strategy: str) -> dict:
    pb = Problem(dist_preset(strategy))
    r = dist.get_rank()
    xs, x, x_in, x_out = _all_ranks(0, B), _all_ranks(1), _all_ranks(2), _all_ranks(3)
    out = {}
    with fh.comm_log() as log:
        g = pb.per_sample(xs[:, r])
    out["events"] = [(e.op, e.axis, e.numel) for e in log.events]
    want = dense_per_sample(pb.full, xs)
    out["per_sample"] = max(
        rel(pb.finish(optree.tree_map(lambda t, b=b: t[b], g)), want[b]) for b in range(B)
    )
    tangent, full_tangent = pb.consistent(4)
    _, t_out = pb.jvp(x[r], tangent)
    out["jvp"] = rel(t_out, dense_jvp(pb.full, x[r], full_tangent))
    v, full_v = pb.consistent(5)
    want = dense_hvp(pb.full, x, full_v)
    out["hvp_fr"] = rel(pb.finish(pb.hvp_forward_reverse(x[r], v)), want)
    out["hvp_rr"] = rel(pb.finish(pb.hvp_reverse_reverse(x[r], v)), want)
    out["maml"] = rel(pb.finish(pb.maml(x_in[r], x_out[r])), dense_maml(pb.full, x_in, x_out))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_transform_matches_dense_torch_func_on_gloo(pool, strategy):
    results = pool.run(_task, strategy)
    sim = Problem(preset(strategy, fh.SimMesh(dict(zip(AXES, GLOO_SHAPE)))))
    with fh.comm_log() as log:
        sim.per_sample(torch.zeros(B, *GLOO_SHAPE, T, D))
    for res in results:
        for key in ("per_sample", "jvp", "hvp_fr", "hvp_rr", "maml"):
            assert res[key] <= 1e-5, (key, res[key])
        assert res["events"] == [(e.op, e.axis, e.numel) for e in log.events]


def _module_per_sample_task() -> tuple[float, list]:
    """Per-sample gradients through fh.functional_call of a nested module with tied weights
    (tests/units/test_module_gloo.py's), against dense autograd on every rank's sample."""
    import test_module_gloo as problem
    from torch.distributed.device_mesh import init_device_mesh

    ref, net = problem._Net(), problem._Net()
    dm = init_device_mesh("cpu", GLOO_SHAPE, mesh_dim_names=AXES)
    spec = fh.hsdp(fh.DistMesh(dm), *AXES)
    shards, tree_spec = fh.shard_module(net, spec, units=list(net.blocks))
    ids = torch.randint(problem.VOCAB, (B, WORLD, 6), generator=torch.Generator().manual_seed(0))

    def loss(s, x):
        logits = fh.functional_call(net, s, (x[None],))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())

    with fh.comm_log() as log:
        g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(
            shards, ids[:, dist.get_rank()]
        )
    worst = 0.0
    for b in range(B):
        one = optree.tree_map(lambda t, b=b: t[b], g)
        got = fh.gather(fh.reduce_grads(one, tree_spec, last=True, at="gradient"), tree_spec)
        ref.zero_grad()
        for x in ids[b]:  # the mean over ranks of each rank's sample loss
            logits = ref(x[None])
            (torch.nn.functional.cross_entropy(logits.flatten(0, 1), x) / WORLD).backward()
        for name, p in ref.named_parameters():
            unit = next((k for k in got if k and name.startswith(k + ".")), "")
            mine = got[""][name] if name in got[""] else got[unit][name[len(unit) + 1 :]]
            worst = max(worst, ((mine - p.grad).abs().max() / p.grad.abs().max()).item())
    return worst, [(e.op, e.axis) for e in log.events]


def test_per_sample_gradients_through_functional_call(pool):
    for worst, events in pool.run(_module_per_sample_task):
        assert worst <= 1e-5
        # the root and each block all-gathered in forward, the blocks but the last again in
        # backward (released in between); one reduce-scatter each for the whole batch
        assert sorted(events) == sorted([("all_gather", "dp_inner")] * 6
                                        + [("reduce_scatter", "dp_inner")] * 4)  # fmt: skip
