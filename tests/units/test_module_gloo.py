"""Existing modules on 4 gloo ranks (2x2 mesh): a Hugging Face ``LlamaForCausalLM`` trained
through ``fh.shard_module`` + ``fh.functional_call`` against FSDP2 (``fully_shard`` per
decoder layer + root, HSDP) with the same weights and data, in fp32 and with FSDP2's
``MixedPrecisionPolicy`` (bf16 compute and all-gathers, fp32 reductions)."""

from __future__ import annotations

import pytest
import torch
from hf_problem import fh_train, fsdp2_train

from functional_hsdp.mesh.launch import DEFAULT_PRELOAD
from functional_hsdp.tools.testing import GlooPool

pytest.importorskip("transformers")

STEPS, M = 3, 2


@pytest.fixture(scope="module")
def pool():
    preload = (*DEFAULT_PRELOAD, "pytest", "torch.distributed.fsdp", "transformers")
    with GlooPool(4, preload=preload) as p:
        yield p


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _fsdp2_task(tied, mp_bf16=False, checkpoint=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp_bf16 else None
    return fsdp2_train(tied, STEPS, M, mp, checkpoint)


def _fh_task(tied, mp_bf16=False, **kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp_bf16 else None
    return fh_train(tied, STEPS, M, mp, **kw)


@pytest.fixture(scope="module")
def fsdp2(pool):
    """FSDP2's runs, once per configuration."""
    cache = {}

    def get(tied, mp_bf16=False):
        if (tied, mp_bf16) not in cache:
            cache[(tied, mp_bf16)] = pool.run(_fsdp2_task, tied, mp_bf16)
        return cache[(tied, mp_bf16)]

    return get


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_parameters_after_three_steps_equal_fsdp2s(pool, fsdp2, tied):
    theirs = fsdp2(tied)
    ours = pool.run(_fh_task, tied)
    for (p, losses, _), (q, their_losses, _) in zip(ours, theirs):
        assert _rel(p, q) <= 1e-5
        assert losses == pytest.approx(their_losses, rel=1e-6)


@pytest.mark.parametrize(
    ("recompute", "mode", "attn", "grad"),
    [
        (True, "sink", "sdpa", "torch.func"),
        (False, "pure", "eager", "torch.func"),
        (True, "pure", "sdpa", "torch.func"),
        (False, "sink", "sdpa", "fh"),
        (True, "pure", "sdpa", "fh"),
    ],
)
def test_llama_recompute_and_pure_modes_equal_fsdp2s(pool, fsdp2, recompute, mode, attn, grad):
    """Each mode, under torch.func.grad_and_value or fh.grad_and_value (autograd's memory)."""
    theirs = fsdp2(True)
    ours = pool.run(_fh_task, True, recompute=recompute, mode=mode, attn=attn, grad=grad)
    for (p, _, _), (q, _, _) in zip(ours, theirs):
        assert _rel(p, q) <= 1e-5


def test_llama_bf16_policy_is_fsdp2s(pool, fsdp2):
    """bf16 compute and all-gathers, fp32 reductions, as FSDP2's same policy: the losses are
    as close to FSDP2-bf16's as FSDP2's own bf16 run is to its fp32 one, or closer."""
    fp32, bf16 = fsdp2(True)[0], fsdp2(True, True)[0]
    ours = pool.run(_fh_task, True, True)[0]
    precision = max(abs(a - b) for a, b in zip(bf16[1], fp32[1]))
    assert precision > 0  # bf16 did change something
    assert max(abs(a - b) for a, b in zip(ours[1], bf16[1])) <= precision
    assert _rel(ours[0], bf16[0]) <= max(_rel(bf16[0], fp32[0]), 1e-5)
    dtypes = {(op, dtype) for op, _, dtype in ours[2]}
    assert dtypes == {
        ("all_gather", torch.bfloat16),
        ("reduce_scatter", torch.float32),
        ("all_reduce", torch.float32),
    }
    assert dtypes == bf16[2]  # what FSDP2's c10d calls carried


# -- a plain nested module with weights tied across units ----------------------------------------

WIDTH, VOCAB = 8, 11


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x, scale):
        return x + scale * self.mlp(self.norm(x))


class _Net(torch.nn.Module):
    """An embedding tied to the head (both root), three blocks (units), the first block's
    first Linear shared with the third's (so owned by the root, borrowed by both)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.blocks[2].mlp[0] = self.blocks[0].mlp[0]
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h, self.scale)
        return self.head(h)


def _net_batches(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(VOCAB, (3, 6), generator=gen) for _ in range(M)]


def _net_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) / M


def _nested_task(recompute):
    import optree
    import torch.distributed as dist
    from reference import AXES
    from torch.distributed.device_mesh import init_device_mesh

    import functional_hsdp as fh

    ref, net = _Net(), _Net()
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=AXES)
    spec = fh.hsdp(fh.DistMesh(dm), *AXES)
    shards, tree_spec = fh.shard_module(net, spec, units=list(net.blocks))
    mg = fh.MainGrad(tree_spec, like=shards)
    loss_fn = lambda s, ids: _net_loss(  # noqa: E731
        fh.functional_call(net, s, ids, into=mg, recompute=recompute), ids
    )
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    with fh.comm_log() as log:
        for step in range(STEPS):
            for ids, _ in fh.microbatches(_net_batches(step, dist.get_rank()), into=mg):
                torch.func.grad(loss_fn)(shards, ids)
            mg.finish()
            for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(mg.grads)):
                p.sub_(0.5 * g)
            mg.zero_grad()
            for r in range(dist.get_world_size()):  # dense: the mean over ranks
                for ids in _net_batches(step, r):
                    (_net_loss(ref(ids), ids) / dist.get_world_size()).backward()
            opt.step()
            opt.zero_grad()
    full = fh.gather(shards, tree_spec)
    errors = {}
    for name, p in ref.named_parameters():
        unit = next((k for k in full if k and name.startswith(k + ".")), "")
        mine = full[""][name] if name in full[""] else full[unit][name[len(unit) + 1 :]]
        errors[name] = ((mine - p).abs().max() / p.abs().max()).item()
    outside = None
    try:
        net(torch.zeros(1, 1, dtype=torch.long))
    except RuntimeError as e:
        outside = str(e)
    first_step = [(e.op, e.axis) for e in log.events][: len(log.events) // STEPS]
    return errors, sorted(shards), sorted(shards[""]), first_step, outside


@pytest.mark.parametrize("recompute", [False, True])
def test_a_nested_module_with_tied_weights_trains_as_dense_sgd(pool, recompute):
    for errors, units, root, events, outside in pool.run(_nested_task, recompute):
        assert max(errors.values()) <= 1e-5, errors
        assert units == ["", "blocks.0", "blocks.1", "blocks.2"]
        # the tied embedding/head and the Linear shared by two blocks belong to the root
        assert root == ["blocks.0.mlp.0.bias", "blocks.0.mlp.0.weight", "embed.weight"]
        # per microbatch: the root and each block reduce-scattered once (the tied and shared
        # weights too, their uses summed first); all-gathers: the root once, each block in
        # forward and in backward but the last one's
        rs = [e for e in events if e[0] == "reduce_scatter"]
        ag = [e for e in events if e[0] == "all_gather"]
        assert len(rs) == M * 4 and len(ag) == M * (1 + 3 + 2)
        assert outside is not None and "fh.functional_call" in outside
