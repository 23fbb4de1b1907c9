"""The agreement's healthy path is one summary (an elementwise max over every rank) whose
cost does not grow with the mesh; every rank's row is exchanged only when the summary shows a
difference, and the validation mode reaches a backward from its forward, not from the context
of whichever thread runs it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import functional_hsdp as fh
from functional_hsdp.mesh import launch
from functional_hsdp.mesh.dist import DistDiagnostics
from functional_hsdp.runtime import validate


class Counting:
    """A mesh's diagnostics, recording the exchanges the library asks of it, by name (the
    mesh's own calls between them, a SimMesh's max through its exchange say, are not)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("describe", "members"):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


def counting(mesh) -> Counting:
    mesh.diagnostics = Counting(mesh.diagnostics)
    return mesh.diagnostics


# -- SimMesh ----------------------------------------------------------------------------------


def test_a_healthy_call_makes_one_summary_and_no_exchange(mesh, spec):
    calls = counting(mesh).calls
    g = {"w": torch.ones(2, 2, 6)}
    acc = fh.reduce_grads(g, spec, last=False)
    fh.gather(fh.reduce_grads(g, spec, last=True, acc=acc), spec)
    fh.MainGrad(spec, like={"w": torch.zeros(6)}).accumulate(g, last=True, check_finite=True)
    assert calls == ["start_max"] * 4


def test_a_nonfinite_leaf_falls_back_to_the_exchange_and_names_the_ranks():
    mesh = fh.SimMesh({"dp": 4})
    calls = counting(mesh).calls
    g = {"v": torch.ones(4, 2), "w": torch.ones(4, 3)}
    g["w"][1, 0] = g["w"][3, 2] = float("inf")
    with pytest.raises(ValueError, match=r"grads\['w'\]: holds NaN or Inf on ranks \[1, 3\]"):
        fh.reduce_grads(g, fh.fsdp(mesh), last=True, check_finite=True)
    assert calls == ["start_max", "exchange"]


def test_the_summary_carries_each_fields_maximum_and_minimum():
    """What the healthy path decides from: ``[row, -row]`` maximized over the mesh."""
    mesh = fh.SimMesh({"a": 2, "b": 3})
    rows = torch.arange(6 * 4).reshape(2, 3, 4) % 7
    got = mesh.diagnostics.start_max(torch.cat([rows, -rows], -1))()
    want = torch.cat([rows.amax((0, 1)), -rows.amin((0, 1))])
    assert torch.equal(got, want.expand(2, 3, 8))


# -- the validation mode in a backward ----------------------------------------------------------


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_validation_off_holds_in_a_backward_run_on_another_thread(op):
    """A new thread starts with an empty context, as autograd's CUDA device thread runs a
    backward: the backward's psum/pmean takes the mode its forward read."""
    mesh = fh.SimMesh({"dp": 2})
    calls = counting(mesh).calls
    fn = getattr(fh, op)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    grads: list = []

    def backward(loss):
        grads.append(torch.autograd.grad(loss, x)[0])

    with fh.validation("off"):
        loss = fn(x, "dp", mesh).square().sum()
        thread = threading.Thread(target=backward, args=(loss,))
        thread.start()
        thread.join(30)
    assert len(grads) == 1 and calls == []
    backward(fn(x, "dp", mesh).square().sum())  # on: forward and backward agree (counted)
    assert calls == ["start_max", "start_max"] and torch.equal(grads[0], grads[1])


# -- gloo ---------------------------------------------------------------------------------------


def _groups_task():
    dm = launch.device_mesh((2, 2), ("tp", "dp"))
    mesh = fh.DistMesh(dm)
    spec = fh.fsdp(mesh, "dp")
    calls = counting(mesh).calls
    same = {"w": torch.full((4,), float(dist.get_rank()))}
    fh.reduce_grads(same, spec, last=True)
    healthy = list(calls)
    # the tp groups hold different trees: allowed (each dp group agrees), after the exchange
    own = {"w": torch.full((3 + mesh.coordinate("tp"),), float(dist.get_rank()))}
    out = fh.gather(fh.reduce_grads(own, spec, last=True), spec)
    return healthy, calls[len(healthy) :], out["w"]


def test_dp_groups_with_different_trees_pass_after_the_exchange(pool):
    for rank, (healthy, differing, w) in enumerate(pool.run(_groups_task)):
        assert healthy == ["start_max"]
        assert differing == ["start_max", "exchange"] * 2  # reduce_grads, gather
        peers = [r for r in range(4) if r // 2 == rank // 2]  # dp groups {0, 1} and {2, 3}
        torch.testing.assert_close(w, torch.full((3 + rank // 2,), sum(peers) / 2))


def _odd_world_task(shape):
    """On a mesh whose size is not a power of two: the summary is the max on every rank;
    one rank's local error, or its own shape, reaches every rank."""
    mesh = fh.DistMesh(launch.device_mesh(shape, ("a", "b")[: len(shape)]))
    rank = dist.get_rank()
    row = torch.tensor([rank, -rank, 7 * rank % 5], dtype=torch.int64)
    summary = mesh.diagnostics.start_max(row)()
    spec = fh.ddp(mesh)
    g = {"w": torch.ones(2)}
    acc = fh.reduce_grads(g, spec, last=False)
    if rank == dist.get_world_size() - 1:  # the last rank: one of those folded into others
        acc = {"w": acc["w"].double()}
    errors = []
    for call in (
        lambda: fh.reduce_grads(g, spec, last=True, acc=acc),
        lambda: fh.reduce_grads({"w": torch.ones(2 + (rank == 1))}, spec, last=True),
    ):
        try:
            call()
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return summary, errors, len(mesh.diagnostics._rounds)


@pytest.mark.parametrize("shape", [(3,), (2, 3)], ids=["3", "2x3"])
def test_the_summary_on_a_mesh_whose_size_is_not_a_power_of_two(shape):
    n = 1
    for s in shape:
        n *= s
    results = launch.run(_odd_world_task, shape, world_size=n, timeout=60.0)
    for rank, (summary, errors, rounds) in enumerate(results):
        assert summary.tolist() == [n - 1, 0, max(7 * r % 5 for r in range(n))]
        assert rounds <= (n.bit_length() - 1) + 2
        assert "acc['w']: expected dtype" in errors[0], errors
        assert rank == n - 1 or f"raised on rank {n - 1}" in errors[0], errors
        assert "grads['w']: shape (2,) on ranks" in errors[1] and "(3,) on rank 1" in errors[1]


def test_recursive_doubling_rounds_reach_every_rank():
    """Every rank's schedule, run as messages: each ends with every rank's value."""
    for n in range(1, 20):
        ranks = list(range(10, 10 + n))
        rounds = {r: DistDiagnostics._doubling(k, ranks) for k, r in enumerate(ranks)}
        seen, step, inbox = {r: {r} for r in ranks}, dict.fromkeys(ranks, 0), {}
        while any(step[r] < len(rounds[r]) for r in ranks):
            moved = False
            for r in ranks:
                if step[r] == len(rounds[r]):
                    continue
                to, frm, tag = rounds[r][step[r]]
                if to is not None and (r, step[r]) not in inbox:
                    inbox[(r, step[r])] = None
                    inbox.setdefault((r, to, tag), []).append(set(seen[r]))
                if frm is not None and not inbox.get((frm, r, tag)):
                    continue
                seen[r] |= inbox[(frm, r, tag)].pop(0) if frm is not None else set()
                step[r] += 1
                moved = True
            assert moved, f"{n} ranks: the rounds deadlock"
        assert all(seen[r] == set(ranks) for r in ranks), n


def test_the_public_call_reads_the_mode_once(monkeypatch, mesh, spec):
    """The mode is read by the public call, not where the agreement runs."""
    reads = []
    monkeypatch.setattr(validate, "current_mode", lambda: reads.append(1) or "on")
    fh.reduce_grads({"w": torch.ones(2, 2, 6)}, spec, last=True)
    assert reads == [1]
