"""Set-ups users run that a single-threaded test harness does not: a backward on another thread
than its forward (autograd's device threads on CUDA), and the agreement's place in a call
(issued before the first bucket is packed, waited just before the first collective)."""

from __future__ import annotations

import gc
import threading
import weakref

import optree
import pytest
import torch
from reference import preset

import functional_hsdp as fh
from functional_hsdp.plan.recipe import Plan

D, UNITS = 6, 3


def _mesh() -> fh.SimMesh:
    return fh.SimMesh({"dp_outer": 2, "dp_inner": 2})


def _model(into: bool):
    """A stack of gathered units; ``seen`` holds weak references to every full weight the
    units' function was given (forward and backward)."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    gen = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(D, D, generator=gen) / D**0.5} for _ in range(UNITS)]
    tree_spec = [spec] * UNITS
    shards = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full) if into else None
    seen: list = []

    def fn(p, h):  # on a SimMesh the weights carry the mesh dims: a batched matmul
        seen.append(weakref.ref(p["w"]))
        return torch.tanh(h @ p["w"])

    block = fh.gathered(fn, spec, into=mg)
    x = torch.randn(*mesh.batch_shape, 4, D, generator=gen)
    return shards, block, x, mg, seen


def _step(backward_thread: bool, into: bool):
    shards, block, x, mg, seen = _model(into)
    leaves = [optree.tree_map(lambda t: t.clone().requires_grad_(), s) for s in shards]
    if into:  # the MainGrad finds the unit from the tensors fh.shard made
        leaves = [optree.tree_map(lambda t: t.requires_grad_(), s) for s in shards]
    with fh.comm_log() as log:
        loss = fh.sequence(block, leaves, x).square().sum()
        roots = [loss]
        del loss
        if backward_thread:
            errors: list = []

            def run():
                try:
                    roots.pop().backward()
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            t = threading.Thread(target=run)
            t.start()
            t.join(60)
            assert not errors, errors
        else:
            roots.pop().backward()
        if into:
            mg.finish()
    grads = mg.grads if into else [optree.tree_map(lambda t: t.grad, s) for s in leaves]
    gc.collect()
    held = [r for r in seen if r() is not None]
    return [t.clone() for t in optree.tree_leaves(grads)], [str(e) for e in log.events], held


@pytest.mark.parametrize("into", [False, True], ids=["pure", "into"])
def test_backward_on_another_thread_gives_the_same_results_and_collectives_and_holds_nothing(
    into,
):
    """Autograd runs a CUDA backward on its own device threads. What a unit's forward leaves
    for its backward lives in the call records, so a backward on another thread finds it:
    the last unit's kept weights and the backward prefetches are used there, the collectives
    are the same ones, and when the backward ends no gathered weight is held by anyone."""
    same_grads, same_events, same_held = _step(False, into)
    other_grads, other_events, other_held = _step(True, into)
    assert all(map(torch.equal, same_grads, other_grads))
    assert other_events == same_events
    assert same_held == [] and other_held == []
    gathers = sum(e.startswith("Event(op='all_gather'") for e in same_events)
    assert gathers == 2 * UNITS - 1  # the forward's last unit is not re-gathered


def test_agreement_is_issued_before_packing_and_waited_before_the_first_collective(monkeypatch):
    mesh = _mesh()
    spec = preset("hsdp", mesh, bucket_cap_mb=24 * 4 / 2**20)  # 24 elements: 3 buckets
    order: list[str] = []
    start = mesh.diagnostics.start_exchange

    def spy_start(t):
        order.append("issue")
        waiter = start(t)

        def wait():
            order.append("wait")
            return waiter()

        return wait

    pack = Plan.pack

    def spy_pack(self, b, leaves, role):
        order.append(f"pack {b}")
        return pack(self, b, leaves, role)

    reduce_scatter = mesh.reduce_scatter

    def spy_reduce_scatter(buf, axis, op):
        order.append("collective")
        return reduce_scatter(buf, axis, op)

    monkeypatch.setattr(mesh.diagnostics, "start_exchange", spy_start)
    monkeypatch.setattr(Plan, "pack", spy_pack)
    monkeypatch.setattr(mesh, "reduce_scatter", spy_reduce_scatter)
    g = {k: torch.ones(2, 2, 24) for k in "abc"}
    fh.reduce_grads(g, spec, last=False)
    assert order[:4] == ["issue", "pack 0", "wait", "collective"]
    assert order.count("issue") == order.count("wait") == 1
    acc = fh.reduce_grads(g, spec, last=False)
    order.clear()
    fh.reduce_grads(acc, spec, last=False, at="gradient")
    # no collective at all (nothing to reduce before the last microbatch): settled at the end
    assert order[-1] == "wait" and order.count("collective") == 0


def test_a_call_that_fails_while_packing_still_takes_part_in_its_exchange(monkeypatch):
    """An error after the exchange was issued (out of memory packing a bucket) waits for the
    exchange before raising, so that every rank's next exchange pairs with the right one."""
    mesh = _mesh()
    spec = preset("hsdp", mesh)
    waited: list = []
    start = mesh.diagnostics.start_exchange

    def spy_start(t):
        waiter = start(t)
        return lambda: waited.append(True) or waiter()

    def failing_pack(self, b, leaves, role):
        raise MemoryError("simulated: out of memory packing")

    monkeypatch.setattr(mesh.diagnostics, "start_exchange", spy_start)
    monkeypatch.setattr(Plan, "pack", failing_pack)
    with pytest.raises(MemoryError):
        fh.reduce_grads({"w": torch.ones(2, 2, 5)}, spec, last=True)
    assert waited == [True]


def test_a_gradient_for_the_inputs_only_reduces_nothing():
    """Shards that need no gradient (frozen weights, a gradient for the inputs alone): the
    unit's backward computes the inputs' gradient, the same as with the weights', and issues
    no reduce-scatter."""
    shards, block, x, _, _ = _model(into=False)
    x = x.clone().requires_grad_()
    trainable = [optree.tree_map(lambda t: t.clone().requires_grad_(), s) for s in shards]
    frozen = [optree.tree_map(torch.clone, s) for s in shards]
    want = torch.autograd.grad(fh.sequence(block, trainable, x).square().sum(), [x])[0]
    with fh.comm_log() as log:
        got = torch.autograd.grad(fh.sequence(block, frozen, x).square().sum(), [x])[0]
    torch.testing.assert_close(got, want)
    ops = [e.op for e in log.events]
    assert "all_gather" in ops and "reduce_scatter" not in ops, ops
