"""Compressed outer reductions on 4 gloo ranks (2x2 mesh): the same results, bit for bit, and
the same comm_log events as a SimMesh (tests/runtime/test_compress.py pins the rest there); and
shard_module/functional_call with ``into=`` a MainGrad under ``outer_compress``. One process
group for the module."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import AXES, GLOO_SHAPE, dist_mesh, this_rank

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD
from functional_hsdp.tools.testing import GlooPool

FORMATS = (torch.bfloat16, torch.float8_e4m3fn, torch.int8, "int4")


@pytest.fixture(scope="module")
def pool():
    with GlooPool(4, preload=(*DEFAULT_PRELOAD, "pytest")) as p:
        yield p


def _stacked(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*GLOO_SHAPE, *shape, generator=gen) * torch.exp(
        torch.randn(*GLOO_SHAPE, *shape, generator=gen)
    )


def _wire(mesh, rank_of, fmt, scatter: bool):
    """Three steps of compressed_all_reduce over dp_outer with feedback: results, residual,
    events (``rank_of``: this process's values of a stacked tensor)."""
    policy, res, outs = fh.compress(fmt, block=32), None, []
    with fh.comm_log() as log:
        for step in range(3):
            x = rank_of(_stacked(step, 130 if not scatter else 128))
            out, res = fh.compressed_all_reduce(
                x, "dp_outer", mesh, compress=policy, residual=res, scatter=scatter
            )
            outs.append(out)
    return outs, res, log.events


def _grads(step: int, m: int) -> dict:
    return {"a": _stacked(10 * step + m, 37, 5), "b": [_stacked(10 * step + m + 5, 300)]}


def _tree(mesh, rank_of, kind: str, fmt):
    """Two steps of two microbatches, reduce_grads and MainGrad; per step the final grads
    (local shards), the residuals, and the events."""
    make = fh.hsdp if kind == "hsdp" else fh.hfsdp
    spec = make(mesh, *AXES, outer_compress=fh.compress(fmt, block=64), bucket_cap_mb=1e-3)
    like = {"a": torch.zeros(37, 5), "b": [torch.zeros(300)]}
    mg, res, out = fh.MainGrad(spec, like=like), None, []
    with fh.comm_log() as log:
        for step in range(2):
            acc = None
            for m, last in fh.microbatches(2):
                g = optree.tree_map(rank_of, _grads(step, m))
                mg.accumulate(g, last=last)
                if last:
                    acc, res = fh.reduce_grads(g, spec, last=True, acc=acc, residual=res)
                else:
                    acc = fh.reduce_grads(g, spec, last=False, acc=acc)
            # mg.grads are views of its buffers (on a DistMesh): keep a copy
            out.append((acc, res, optree.tree_map(torch.clone, mg.grads), mg.residual))
            mg.zero_grad()
    return out, log.events


def _wire_task(fmt, scatter):
    return _wire(dist_mesh(), lambda x: this_rank(x), fmt, scatter)


def _tree_task(kind, fmt):
    return _tree(dist_mesh(), lambda x: this_rank(x), kind, fmt)


def _sim() -> fh.SimMesh:
    return fh.SimMesh(dict(zip(AXES, GLOO_SHAPE)))


def _equal(a, b) -> bool:
    """Same leaves bit for bit, ``b``'s SimMesh fill (a ragged Flat piece) past ``a``'s end
    zero."""
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    same = lambda x, y: torch.equal(x, y[: len(x)]) and not y[len(x) :].any()  # noqa: E731
    return len(la) == len(lb) and all(same(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("scatter", [False, True], ids=["all_reduce", "scatter"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_compressed_all_reduce_on_gloo_equals_the_simmesh_bit_for_bit(pool, fmt, scatter):
    sim_out, sim_res, sim_events = _wire(_sim(), lambda x: x, fmt, scatter)
    for rank, (outs, res, events) in enumerate(pool.run(_wire_task, fmt, scatter)):
        o, i = divmod(rank, GLOO_SHAPE[1])
        assert events == sim_events
        assert all(torch.equal(a, b[o, i]) for a, b in zip(outs, sim_out))
        assert torch.equal(res, sim_res[o, i])


@pytest.mark.parametrize("kind", ["hsdp", "hfsdp"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, "int4"], ids=str)
def test_reduce_grads_and_maingrad_on_gloo_equal_the_simmesh(pool, kind, fmt):
    sim, sim_events = _tree(_sim(), lambda x: x, kind, fmt)
    for rank, (got, events) in enumerate(pool.run(_tree_task, kind, fmt)):
        o, i = divmod(rank, GLOO_SHAPE[1])
        assert events == sim_events
        for mine, theirs in zip(got, sim):
            for a, b in zip(mine, theirs):  # grads, residual of reduce_grads and of MainGrad
                assert _equal(a, optree.tree_map(lambda x, o=o, i=i: x[o, i], b))
    assert any(e.op == "all_to_all" and e.axis == "dp_outer" for e in sim_events)


# -- shard_module / functional_call into a MainGrad --------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 24)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(24, 24) for _ in range(2)])
        self.out = torch.nn.Linear(24, 16)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def _module_task(fmt):
    """Three steps of SGD through shard_module + functional_call(into=mg), compressed or not;
    the gathered weights, the outer ops, and whether the residual was carried and saved."""
    import torch.distributed as dist
    import torch.nn.functional as F

    policy = None if fmt is None else fh.compress(fmt)
    spec = fh.hsdp(dist_mesh(), *AXES, outer_compress=policy)
    net = Net()
    shards, tree_spec = fh.shard_module(net, spec, units=list(net.blocks))
    mg = fh.MainGrad(tree_spec, like=shards)
    gen = torch.Generator().manual_seed(dist.get_rank())

    def loss_fn(s, ids):
        logits = fh.functional_call(net, s, (ids,), into=mg)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) / 2

    with fh.comm_log() as log:
        for _ in range(3):
            for ids, _last in fh.microbatches(
                [torch.randint(16, (2, 6), generator=gen)] * 2, into=mg
            ):
                torch.func.grad(loss_fn)(shards, ids)
            mg.finish()
            with torch.no_grad():
                for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(mg.grads)):
                    p.sub_(0.5 * g)
            mg.zero_grad()
    kept = mg.residual is not None and mg.local_state_dict()["residuals"] is not None
    outer = sorted({e.op for e in log.events if e.axis == "dp_outer"})
    return fh.gather(shards, tree_spec), outer, kept


def test_shard_module_and_functional_call_train_within_the_bound(pool):
    dense = pool.run(_module_task, None)
    packed = pool.run(_module_task, torch.int8)
    for (w, outer, kept), (w0, outer0, _) in zip(packed, dense):
        assert outer0 == ["all_reduce"] and "all_to_all" in outer and "all_reduce" not in outer
        assert kept
        for a, b in zip(optree.tree_leaves(w), optree.tree_leaves(w0)):
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert 0 < rel < 0.02, rel


# -- checkpoints ---------------------------------------------------------------------------------


def _checkpoint_task(path: str):
    """A compressed MainGrad saved with DCP (final, then zeroed) and loaded into a new one: is
    the residual the same, and the gradients?"""
    import torch.distributed.checkpoint as dcp

    spec = fh.hsdp(dist_mesh(), *AXES, outer_compress=fh.compress("int4", block=32))
    like = {"a": torch.zeros(37, 5), "b": [torch.zeros(300)]}
    mg = fh.MainGrad(spec, like=like)
    mg.accumulate(optree.tree_map(this_rank, _grads(0, 0)), last=True)
    same = []
    for name in ("final", "empty"):
        dcp.save({"mg": fh.state_dict(mg)}, checkpoint_id=f"{path}/{name}")
        mg2 = fh.MainGrad(spec, like=like)
        state = {"mg": fh.empty_state_dict(mg2, spec)}
        dcp.load(state, checkpoint_id=f"{path}/{name}")
        fh.load_state_dict(state["mg"], spec, mg2)
        grads = mg.grads is None or _equal(mg2.grads, mg.grads)
        same.append(grads and _equal(mg2.residual, mg.residual) and _max(mg.residual) > 0)
        mg.zero_grad()
    return same


def _max(tree) -> float:
    return max(x.abs().max().item() for x in optree.tree_leaves(tree) if x.numel())


def test_dcp_saves_and_loads_a_compressed_maingrads_residual(pool, tmp_path):
    for same in pool.run(_checkpoint_task, str(tmp_path)):
        assert same == [True, True]
