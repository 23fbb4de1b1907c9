"""The gathered units' cross-rank checks on a SimMesh: the running fingerprint of each step's
unit calls (default mode) and the agreement before each unit collective (strict mode) never
change a healthy result, are taken at the step's checks, and strict mode is read in forward
and carried into backward (which may run on another thread). The ranks that differ are in
tests/units/test_unit_divergence_gloo.py (a SimMesh runs every rank's calls alike)."""

from __future__ import annotations

import optree
import pytest
import torch
from reference import on_device_threads

import functional_hsdp as fh
from functional_hsdp.runtime import messages
from functional_hsdp.runtime.unit_calls import unit_log
from functional_hsdp.units import transfers as units


def _layer(p, x):
    return torch.tanh(x @ p["w"])


def _step(mode: str, recompute: bool = False, api: str = "torch.func.grad"):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    gen = torch.Generator().manual_seed(0)
    shards = fh.shard([{"w": torch.randn(6, 6, generator=gen) / 3} for _ in range(3)], [spec] * 3)
    mg = fh.MainGrad([spec] * 3, like=shards)
    block = fh.gathered(fh.per_rank(_layer, mesh), spec, into=mg, recompute=recompute)

    def loss(s, x):
        return fh.sequence(block, s, x).square().sum()

    with fh.validation(mode):
        for _m, _ in fh.microbatches(2, into=mg):
            x = torch.randn(2, 2, 4, 6, generator=gen)
            if api == "backward":  # plain autograd on the shards (the MainGrad knows them)
                for t in optree.tree_leaves(shards):
                    t.requires_grad_(True)
                loss(shards, x).backward()
                for t in optree.tree_leaves(shards):
                    t.requires_grad_(False)
                    t.grad = None
            else:
                (torch.func.grad if api == "torch.func.grad" else fh.grad)(loss)(shards, x)
        mg.finish()
    return mesh, optree.tree_map(torch.clone, mg.grads)


@pytest.mark.parametrize("recompute", [False, True])
def test_every_mode_gives_the_same_gradients(recompute):
    _, want = _step("off", recompute)
    for mode in ("on", "strict"):
        mesh, got = _step(mode, recompute)
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
            assert torch.equal(a, b)
        assert unit_log(mesh).count == 0  # taken by the step's checks


def test_the_log_records_each_unit_call_in_order_until_a_check_takes_it():
    mesh = fh.SimMesh({"dp": 2})
    spec = fh.fsdp(mesh)
    shards = fh.shard([{"w": torch.ones(4, 4)}] * 2, [spec] * 2)
    block = fh.gathered(fh.per_rank(_layer, mesh), spec)
    x = torch.ones(2, 3, 4)
    block(shards[1], block(shards[0], x))
    log = unit_log(mesh)
    assert log.count == 2 and "_layer on tree[0]" in log.texts[log.entries[0][1]]
    first = log.digest
    log.take()
    block(shards[0], block(shards[1], x))  # the other order: another digest
    assert log.digest != first
    with fh.validation("off"):  # not recorded
        block(shards[0], x)
    assert log.count == 2


@pytest.mark.parametrize("api", ["torch.func.grad", "fh.grad", "backward"])
def test_strict_is_carried_into_a_backward_on_a_device_thread(monkeypatch, api):
    """Every all-gather and reduce-scatter of the units is agreed before it is issued, also
    when backward runs where the caller's context (its validation mode) is not seen."""
    seen = []
    original = units._agree_before
    monkeypatch.setattr(
        units,
        "_agree_before",
        lambda call, what, **kw: (seen.append(what), original(call, what, **kw)),
    )
    _, want = _step("strict", api=api)
    counts = {what: seen.count(what) for what in set(seen)}
    seen.clear()
    with on_device_threads() as ran:
        _, got = _step("strict", api=api)
    assert "_Unit" in ran
    assert counts["reduce-scatter"] == 6 and {w: seen.count(w) for w in set(seen)} == counts
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert torch.equal(a, b)


def _lists(*ranks):
    """Per rank, its unit calls as (unit, unit+options) digests, padded with -1."""
    n = max(map(len, ranks))
    return torch.tensor([list(r) + [(-1, -1)] * (n - len(r)) for r in ranks])


@pytest.mark.parametrize(
    "ranks, how",
    [
        ([[(1, 1), (2, 2), (3, 3)], [(1, 1), (3, 3), (2, 2)]], "order"),
        ([[(1, 1), (2, 2), (3, 3)], [(1, 1), (3, 3)]], "skipped"),
        ([[(1, 1), (2, 2)], [(1, 1)]], "skipped"),
        ([[(1, 1), (2, 2)], [(1, 1), (3, 3)]], "another unit"),
    ],
)
def test_how_the_unit_calls_differ(ranks, how):
    lists = _lists(*ranks)
    made = [len(r) for r in ranks]
    assert messages._how(lists, made, 1, texts=["", ""]) == how


def test_how_names_the_options_or_dtypes_that_differ():
    lists = _lists([(1, 1)], [(1, 2)])
    a = "u | recompute=False; param_dtype=None; buckets=[4, 4]"
    b = "u | recompute=False; param_dtype=torch.bfloat16; buckets=[4, 4]"
    c = "u | recompute=True; param_dtype=None; buckets=[4, 4]"
    assert messages._how(lists, [1, 1], 0, texts=[a, b]) == "dtype: param_dtype"
    assert messages._how(lists, [1, 1], 0, texts=[a, c]) == "options: recompute"


def _composable(mode: str, transform: str, order=(0, 1)):
    """Two units through a transform that takes the composable path (vmap of grad, jvp, jvp of
    grad); returns the mesh and the result."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    gen = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(6, 6, generator=gen) / 3} for _ in range(2)]
    shards = fh.shard(full, [spec] * 2)
    block = fh.gathered(fh.per_rank(_layer, mesh), spec)
    x = torch.randn(3, 2, 2, 6, generator=gen)  # 3 samples on each rank

    def loss(s, x):
        for i in order:
            x = block(s[i], x)
        return x.square().sum()

    tangent = fh.shard([{"w": torch.ones(6, 6)}] * 2, [spec] * 2)
    with fh.validation(mode):
        if transform == "vmap":
            out = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(shards, x)
        elif transform == "jvp":
            out = torch.func.jvp(lambda s: loss(s, x[0]), (shards,), (tangent,))
        else:  # a Hessian-vector product
            out = torch.func.jvp(torch.func.grad(lambda s: loss(s, x[0])), (shards,), (tangent,))
    return mesh, out


@pytest.mark.parametrize("transform", ["vmap", "jvp", "hvp"])
def test_the_composable_path_records_its_unit_calls(transform):
    """Under vmap, jvp or a second derivative each unit call joins the step's running
    fingerprint (where its shards are found through the transforms' wrappers and forward
    mode's dual views), in order; validation('off') records nothing."""
    mesh, _ = _composable("on", transform)
    log = unit_log(mesh)
    texts = [log.texts[e[1]] for e in log.entries]
    assert len(texts) == 2 and "(composable path) on tree[0]" in texts[0], texts
    assert "(composable path) on tree[1]" in texts[1], texts
    other, _ = _composable("on", transform, order=(1, 0))
    assert unit_log(other).digest != log.digest
    off, _ = _composable("off", transform)
    assert unit_log(off).count == 0


@pytest.mark.parametrize("transform", ["vmap", "jvp", "hvp"])
def test_strict_agrees_before_every_composable_collective_and_changes_nothing(
    monkeypatch, transform
):
    from functional_hsdp.sync import autodiff

    seen = []
    original = autodiff.Move._agree
    monkeypatch.setattr(autodiff.Move, "_agree", lambda how: (seen.append(how), original(how)))
    _, want = _composable("on", transform)
    # (a unit's weights gathered again before its backward under vmap carry no call)
    assert not [how for how in seen if how.unit is not None and how.unit.mode == "strict"]
    _, got = _composable("strict", transform)
    strict = [how for how in seen if how.unit is not None and how.unit.mode == "strict"]
    gathers = [how for how in strict if how.frm == "parameter"]
    assert len(gathers) >= 2 and all(how.unit.where.startswith("tree[") for how in strict)
    if transform != "jvp":  # reverse mode: the adjoint reduce-scatters are agreed too
        assert any(how.frm == "input" for how in strict)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert torch.equal(a, b)
