"""``recompute=True`` runs a unit's forward again in backward under the autocast state that
forward ran under (as ``torch.utils.checkpoint`` does), whatever autocast region the backward
is called in: its gradient is ``recompute=False``'s, bit for bit, on the same dtype path.

Before: the recompute ran under the backward's own state, so a unit whose forward ran under
CPU autocast was recomputed in float32 (``expected scalar type BFloat16 but found Float``
where its input was a bfloat16 activation, a silently different function elsewhere), and one
whose forward ran without autocast was recomputed in bfloat16 inside an autocast region.
"""

from __future__ import annotations

import contextlib
import copy

import optree
import pytest
import torch
from reference import AXES, preset
from torch._subclasses.fake_tensor import FakeTensorMode

import functional_hsdp as fh
from functional_hsdp.mesh import launch

UNITS = 3


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _problem(recompute: bool):
    """Three tanh-matmul units on a 2x2 hsdp SimMesh: (shards, block, input, the dtype of each
    call's matmul). The units' outputs are what the matmul gives: under autocast, bfloat16
    activations flow into the next unit."""
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = preset("hsdp", mesh)
    gen = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(4, 4, generator=gen) / 2} for _ in range(UNITS)]
    shards = fh.shard(full, [spec] * UNITS)
    seen = []

    def fn(p, x):
        y = x @ p["w"]
        seen.append(y.dtype)
        return torch.tanh(y)

    block = fh.gathered(fh.per_rank(fn, mesh), spec, recompute=recompute)
    return shards, block, torch.randn(2, 2, 3, 4, generator=gen), seen


def _grads(api: str, region: str, recompute: bool):
    """The shards' gradient with autocast around the forward, the backward or both."""
    shards, block, x, seen = _problem(recompute)
    loss = lambda s: fh.sequence(block, s, x).float().square().sum()  # noqa: E731
    forward, backward = region in ("forward", "both"), region in ("backward", "both")
    if api == "backward":
        for t in optree.tree_leaves(shards):
            t.requires_grad_(True)
        with _autocast(forward):
            value = loss(shards)
        with _autocast(backward):
            value.backward()
        return optree.tree_map(lambda t: t.grad, shards), seen
    transform = torch.func.grad if api == "torch.func.grad" else fh.grad

    def autocast_loss(s):  # autocast inside the loss: the backward runs after it, outside
        with _autocast(forward and not backward):
            return loss(s)

    with _autocast(backward):  # around the whole call: forward and backward
        return transform(autocast_loss)(shards), seen


@pytest.mark.parametrize(
    ("api", "region"),
    [
        ("torch.func.grad", "forward"),
        ("torch.func.grad", "both"),
        ("fh.grad", "forward"),
        ("fh.grad", "both"),
        ("backward", "forward"),
        ("backward", "both"),
        ("backward", "backward"),
    ],
)
def test_a_recomputed_unit_runs_in_the_dtypes_its_forward_ran_in(api, region):
    want, seen_once = _grads(api, region, recompute=False)
    got, seen_twice = _grads(api, region, recompute=True)
    dtype = torch.float32 if region == "backward" else torch.bfloat16
    assert seen_once == [dtype] * UNITS  # autocast did reach the units' forward (or not)
    assert seen_twice == [dtype] * (2 * UNITS)  # and their recompute alike
    for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_the_autocast_state_of_each_device_type_of_the_unit_is_replayed(monkeypatch):
    """CUDA's autocast state is captured and re-entered as the CPU's is, on CPU-only torch:
    ``device="cuda"`` tensors made by ``FakeTensorMode`` give the device type, and
    ``torch.autocast("cuda")`` is let on (it disables itself where CUDA is absent).

    Only the capture and its replay, not a whole gathered unit: on torch's CPU wheel autograd
    cannot make the gradient edge of a fake CUDA tensor (its ``AccumulateGrad`` asks for a
    CUDA device guard, which the build lacks), so no backward runs on them here."""
    from functional_hsdp.units.replay import autocast_state as _autocast_state
    from functional_hsdp.units.replay import replaying as _replaying

    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    with FakeTensorMode():
        w = torch.empty(4, 4, device="cuda")
    x = torch.ones(2)
    with torch.autocast("cuda", dtype=torch.float16):  # the forward: CUDA's on, the CPU's off
        state = _autocast_state([w, x, w])
    off = _autocast_state([w, x])  # a forward without autocast
    assert [kind for kind, _ in state] == ["cpu", "cuda"]
    with _autocast(True), _replaying(None, state):  # a backward called in CPU autocast
        assert torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cuda") == torch.float16
    with torch.autocast("cuda", dtype=torch.float16), _autocast(True), _replaying(None, off):
        assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cuda")  # the caller's state is back after a replay


# -- a module through fh.functional_call, on a one-rank DistMesh ------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU())
            for _ in range(3)
        )
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _module_task():
    """Per API and autocast region: whether recompute=True's gradient equals recompute=False's
    (and that forward ran in bfloat16 where autocast was on)."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=AXES)
    spec = fh.hsdp(fh.DistMesh(dm), *AXES)
    base = _Net()
    ids = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(1))
    results = {}
    for api, region in [("torch.func.grad", "forward"), ("fh.grad", "forward")] + [
        ("backward", r) for r in ("forward", "backward")
    ]:
        grads, dtypes = [], []
        for recompute in (False, True):
            net = copy.deepcopy(base)
            shards, _ = fh.shard_module(net, spec, units=list(net.blocks))
            grads.append(_module_grads(net, shards, ids, api, region, recompute, dtypes))
        same = all(
            g.dtype == w.dtype and torch.equal(g, w)
            for g, w in zip(optree.tree_leaves(grads[1]), optree.tree_leaves(grads[0]))
        )
        results[api, region] = (same, dtypes)
    return results


def _module_grads(net, shards, ids, api, region, recompute, dtypes):
    def loss(s, forward):
        with _autocast(forward):
            logits = fh.functional_call(net, s, ids, recompute=recompute)
        dtypes.append(logits.dtype)
        return logits.float().square().mean()

    if api != "backward":
        transform = torch.func.grad if api == "torch.func.grad" else fh.grad
        return transform(loss)(shards, True)
    for t in optree.tree_leaves(shards):
        t.requires_grad_(True)
    value = loss(shards, region == "forward")
    with _autocast(region == "backward"):
        value.backward()
    return optree.tree_map(lambda t: t.grad, shards)


def test_a_module_recomputed_through_functional_call_keeps_its_forwards_dtypes():
    (results,) = launch.run(_module_task, world_size=1, timeout=60.0)
    for (api, region), (same, dtypes) in results.items():
        want = torch.float32 if region == "backward" else torch.bfloat16
        assert dtypes == [want, want], (api, region)
        assert same, (api, region)
