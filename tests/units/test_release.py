"""The library holds nothing of the user's strongly: once the user drops a model, its shards
and its ``MainGrad``, a ``gc.collect()`` frees them, after training steps, after a forward
whose backward never came, with or without recompute. ``fh.clear_caches()`` forgets what the
library remembers for objects still alive.

Before: ``shard_module``'s registry kept every model (its record referred to its own key),
and with it its last ``MainGrad``; under plain autograd a unit's call record kept the tensors
its forward was given, whose graph led back to the record: a cycle through autograd's nodes,
which the garbage collector cannot see, keeping the graph and the shards for good.
"""

from __future__ import annotations

import gc
import weakref

import optree
import pytest
import torch
from reference import AXES, preset

import functional_hsdp as fh
from functional_hsdp.mesh import launch

VOCAB, WIDTH = 11, 8


class _Net(torch.nn.Module):
    """An embedding tied to the head (the root), three blocks (the units)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)


def _refs(*objects) -> list:
    return [weakref.ref(x) for x in optree.tree_leaves(objects, none_is_leaf=True)]


def _alive(refs: list) -> list[str]:
    gc.collect()
    return [type(r()).__name__ for r in refs if r() is not None]


def _steps(spec, api: str, recompute: bool) -> list:
    """Two training steps of two microbatches each into a MainGrad; the weak references to
    the model, its MainGrad and every shard."""
    model = _Net()
    shards, tree_spec = fh.shard_module(model, spec, units=list(model.blocks))
    mg = fh.MainGrad(tree_spec, like=shards)
    ids = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))

    def loss(s):
        logits = fh.functional_call(model, s, ids, into=mg, recompute=recompute)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    for _ in range(2):
        for _ in fh.microbatches(2, into=mg):
            if api == "torch.func.grad":
                torch.func.grad(loss)(shards)
            else:
                fh.grad_and_value(loss)(shards)
        mg.finish()
        for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(mg.grads)):
            p.sub_(0.1 * g)
        mg.zero_grad()
    return _refs(model, mg, shards)


def _forward_only(spec, recompute: bool, grad: bool) -> list:
    """A forward whose backward never comes: its output dropped."""
    model = _Net()
    shards, tree_spec = fh.shard_module(model, spec, units=list(model.blocks))
    mg = fh.MainGrad(tree_spec, like=shards)
    for p in optree.tree_leaves(shards):
        p.requires_grad_(grad)
    fh.functional_call(model, shards, torch.zeros(2, 5, dtype=torch.long), into=mg)
    return _refs(model, mg, shards)


def _maingrad_of_a_live_model(spec) -> tuple[list, torch.nn.Module]:
    """A step into a MainGrad, which is then dropped while its model lives."""
    model = _Net()
    shards, tree_spec = fh.shard_module(model, spec, units=list(model.blocks))
    mg = fh.MainGrad(tree_spec, like=shards)
    ids = torch.zeros(2, 5, dtype=torch.long)
    fh.grad(lambda s: fh.functional_call(model, s, ids, into=mg).sum())(shards)
    return _refs(mg), model


def _release_task():
    """What stays alive after each case (type names: none expected); and of a MainGrad
    dropped while its model lives, what stays before and after fh.clear_caches()."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=AXES)
    spec = fh.hsdp(fh.DistMesh(dm), *AXES)
    torch.manual_seed(0)
    alive = {}
    for api in ("torch.func.grad", "fh.grad_and_value"):
        for recompute in (False, True):
            alive[api, recompute] = _alive(_steps(spec, api, recompute))
    for recompute in (False, True):
        for grad in (True, False):
            alive["forward only", recompute, grad] = _alive(_forward_only(spec, recompute, grad))
    refs, model = _maingrad_of_a_live_model(spec)
    held = _alive(refs)  # the model's gathered blocks of its last options hold it
    fh.clear_caches()
    cleared = _alive(refs)
    try:  # the sharding itself stays known
        fh.shard_module(model, spec, units=[])
        sharding = "forgotten"
    except ValueError as e:
        sharding = str(e)
    return alive, held, cleared, sharding


def test_a_sharded_model_its_shards_and_maingrad_are_freed_once_dropped():
    (result,) = launch.run(_release_task, world_size=1, timeout=60.0)
    alive, held, cleared, sharding = result
    for case, names in alive.items():
        assert names == [], case
    assert held == ["MainGrad"] and cleared == []
    assert "sharded already" in sharding


def _layerwise(api: str, recompute: bool) -> list:
    """Three units on a SimMesh: a step into a MainGrad, or a forward whose output is
    dropped; the weak references to the block, the MainGrad and the shards."""
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = preset("hsdp", mesh)
    shards = fh.shard([{"w": torch.randn(4, 4)} for _ in range(3)], [spec] * 3)
    mg = fh.MainGrad([spec] * 3, like=shards)
    block = fh.gathered(
        fh.per_rank(lambda p, x: torch.tanh(x @ p["w"]), mesh), spec, into=mg, recompute=recompute
    )
    loss = lambda s, x: fh.sequence(block, s, x).square().sum()  # noqa: E731
    x = torch.randn(2, 2, 3, 4)
    if api == "forward only":
        for p in optree.tree_leaves(shards):
            p.requires_grad_(True)
        loss(shards, x)
    else:
        for _ in fh.microbatches(1, into=mg):
            (torch.func.grad if api == "torch.func.grad" else fh.grad)(loss)(shards, x)
        mg.finish()
    return _refs(block, mg, shards)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("api", ["torch.func.grad", "fh.grad", "forward only"])
def test_gathered_units_keep_no_shards_or_maingrad(api, recompute):
    """The same for layer-wise units on a SimMesh, under plain autograd and torch.func."""
    assert _alive(_layerwise(api, recompute)) == []
