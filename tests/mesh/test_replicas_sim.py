"""The simulated quorum (fh.simulated_quorum on a SimMesh) against naive references written
here in plain torch: per-step HSDP (the mean over each quorum's participants, uncommitted
steps dropped, a returning replica healed from a peer), Muon with owners within each group
(against torch's Muon per replica), and DiLoCo (the same, with weight= token-weighted merging
and a healed replica contributing nothing); and the errors."""

from __future__ import annotations

import copy

import pytest
import torch

import functional_hsdp as fh
from functional_hsdp.mesh.replicas import STATE_KEY, _healed, _Kept, _sendable

R, I = 3, 2  # noqa: E741 - replicas x inner ranks
SHAPES = {"w": 10, "b": 3}
LR = 0.1
# per quorum: who is alive; quorum 2 fails mid-step; replica 1 dies at 3 and returns at 6;
# replica 2 dies at 7 and returns at 9; at 11 replica 0 is gone for good
ALIVE = [(0, 1, 2)] * 3 + [(0, 2)] * 3 + [(0, 1, 2)] + [(0, 1)] * 2 + [(0, 1, 2)] * 2 + [(1, 2)]
FAIL = (2, 8)


def grad_of(r: int, i: int, pos: int) -> dict:
    g = torch.Generator().manual_seed(7919 * r + 104_729 * i + pos)
    return {k: torch.randn(n, generator=g, dtype=torch.float64) for k, n in SHAPES.items()}


def test_pmean_over_the_quorum_is_over_its_participants():
    sim = fh.simulated_quorum(axis="r", alive=[(0, 1, 2), (2, 0)])
    mesh = fh.SimMesh({"r": 3, "dp": 2}, replicas=sim)
    x = torch.arange(6.0).view(3, 2, 1)
    sim.quorum(x)
    assert torch.equal(fh.psum({"x": x}, "r", mesh)["x"][0, :, 0], torch.tensor([6.0, 9.0]))
    assert sim.commit()
    sim.quorum(x)
    got = fh.pmean({"x": x}, "r", mesh)["x"]
    assert torch.equal(got[:, :, 0], torch.tensor([[2.0, 3.0]] * 3))
    assert sim.log[-1].participants == 2 and sim.log[-1].alive == (0, 2)


def test_hsdp_per_step_matches_the_naive_reference():
    sim = fh.simulated_quorum(axis="r", alive=ALIVE, fail=FAIL)
    mesh = fh.SimMesh({"r": R, "dp": I}, replicas=sim)
    spec = fh.hsdp(mesh, "r", "dp")
    params = fh.shard({k: torch.zeros(n, dtype=torch.float64) for k, n in SHAPES.items()}, spec)
    pos = torch.zeros(R, I, dtype=torch.int64)
    ref = {r: {k: torch.zeros(n, dtype=torch.float64) for k, n in SHAPES.items()} for r in range(R)}
    ref_pos, done = dict.fromkeys(range(R), 0), dict.fromkeys(range(R), 0)
    for _ in range(len(ALIVE) + 2):
        params, pos = sim.quorum((params, pos))
        alive = sim.alive
        # naive: a replica behind the others takes the first up-to-date one's weights
        top = max(done[r] for r in alive)
        src = next(r for r in alive if done[r] == top)
        for r in alive:
            if done[r] < top:
                ref[r] = {key: v.clone() for key, v in ref[src].items()}
                ref_pos[r], done[r] = ref_pos[src], top
        assert set(sim.healed) == {r for r in alive if r != src and sim.healed and r in sim.healed}
        grads = {
            key: torch.stack(
                [
                    torch.stack([grad_of(r, i, int(pos[r, i]))[key] for i in range(I)])
                    for r in range(R)
                ]
            )
            for key in SHAPES
        }
        g = fh.reduce_grads(grads, spec, last=True)
        mean = {
            key: torch.stack(
                [grad_of(r, i, ref_pos[r])[key] for r in alive for i in range(I)]
            ).mean(0)
            for key in SHAPES
        }
        if sim.commit():
            params = {key: params[key] - LR * g[key] for key in params}
            pos = pos + 1
            for r in alive:
                ref[r] = {key: ref[r][key] - LR * mean[key] for key in SHAPES}
                ref_pos[r] += 1
                done[r] += 1
        full = fh.gather(params, spec)
        for r in alive:
            for key in SHAPES:
                torch.testing.assert_close(full[key][r, 0], ref[r][key], rtol=0, atol=1e-12)
    assert [q.committed for q in sim.log].count(False) == len(FAIL)
    assert any(q.healed for q in sim.log)


MATRICES = {"w": (8, 6), "v": (5, 7), "u": (6, 6)}


def _muon_grads(r: int, i: int, pos: int) -> dict:
    g = torch.Generator().manual_seed(7919 * r + 104_729 * i + pos)
    return {k: torch.randn(s, generator=g) for k, s in MATRICES.items()}


def test_owners_within_each_group_run_muon_per_step_as_the_naive_reference():
    """fh.owned on a replica mesh owns leaves within each group (the replica axis stays
    Replicate): Muon runs once per matrix in each group with no collective of its own, the
    optimizer state heals with the weights, and every replica equals torch's Muon on the
    mean gradient over each committed quorum's participants."""
    from reference import torch_muon_in

    sim = fh.simulated_quorum(axis="r", alive=ALIVE, fail=FAIL)
    mesh = fh.SimMesh({"r": R, "dp": I}, replicas=sim)
    spec = fh.owned(fh.hsdp(mesh, "r", "dp"))
    assert spec.optimizer == (fh.Replicate(), fh.Owner()) and spec.owner_axes == ("dp",)
    start = {k: torch.randn(s, generator=torch.Generator().manual_seed(3)) for k, s in
             MATRICES.items()}  # fmt: skip
    params = fh.shard(start, spec)
    opt = fh.muon(spec, lr=0.02, ns_dtype=torch.float32)
    state = opt.init(params)
    pos = torch.zeros(R, I, dtype=torch.int64)
    ref = {r: {k: v.clone().requires_grad_() for k, v in start.items()} for r in range(R)}
    muon = {r: torch.optim.Muon(ref[r].values(), lr=0.02) for r in range(R)}
    ref_pos, done = dict.fromkeys(range(R), 0), dict.fromkeys(range(R), 0)
    for _ in range(len(ALIVE) + 2):
        params, state, pos = sim.quorum((params, state, pos))
        alive = sim.alive
        top = max(done[r] for r in alive)
        src = next(r for r in alive if done[r] == top)
        for r in alive:
            if done[r] < top:  # the naive heal: weights and Muon's momentum from the peer
                with torch.no_grad():
                    for k, v in ref[r].items():
                        v.copy_(ref[src][k])
                muon[r].load_state_dict(copy.deepcopy(muon[src].state_dict()))
                ref_pos[r], done[r] = ref_pos[src], top
        grads = {
            k: torch.stack(
                [torch.stack([_muon_grads(r, i, int(pos[r, i]))[k] for i in range(I)])
                 for r in range(R)]
            )
            for k in MATRICES
        }  # fmt: skip
        with fh.comm_log() as log:
            g = fh.reduce_grads(grads, spec, last=True)
            updates, new_state = opt.update(g, state, params)
        # the replica axis carries the gradient's all-reduce alone; Muon moves nothing
        assert [e.op for e in log.events if e.axis == "r"] == ["all_reduce"]
        assert {e.op for e in log.events if e.axis == "dp"} == {"reduce_scatter"}
        mean = {
            k: torch.stack([_muon_grads(q, i, ref_pos[q])[k] for q in alive for i in range(I)])
            .double()
            .mean(0)
            .float()
            for k in MATRICES
        }
        if sim.commit():
            params, state = fh.apply_updates(params, updates), new_state
            pos = pos + 1
            for r in alive:
                for k, v in ref[r].items():
                    v.grad = mean[k].clone()
                with torch_muon_in(torch.float32):
                    muon[r].step()
                ref_pos[r] += 1
                done[r] += 1
        full = fh.gather(params, spec)
        for r in alive:
            for k in MATRICES:
                torch.testing.assert_close(full[k][r, 0], ref[r][k].detach(), rtol=0, atol=2e-6)
    assert [q.committed for q in sim.log].count(False) == len(FAIL)
    assert any(q.healed for q in sim.log)


def _diloco_reference(weighted: bool, steps: int, every: int):
    """DiLoCo by hand: per replica params and anchor; outer sgd(0.5) on the merged
    pseudo-gradient; a quorum at each sync."""
    lr_out = 0.5
    params = {
        r: {k: torch.zeros(n, dtype=torch.float64) for k, n in SHAPES.items()} for r in range(R)
    }
    anchor = {r: {k: v.clone() for k, v in params[r].items()} for r in range(R)}
    pos, done, q = dict.fromkeys(range(R), 0), dict.fromkeys(range(R), 0), 0
    for t in range(1, steps + 1):
        for r in range(R):
            g = {
                k: torch.stack([grad_of(r, i, pos[r])[k] for i in range(I)]).mean(0) for k in SHAPES
            }
            params[r] = {k: params[r][k] - LR * g[k] for k in SHAPES}
            pos[r] += 1
        if t % every:
            continue
        alive = ALIVE[min(q, len(ALIVE) - 1)]
        top = max(done[r] for r in alive)
        src = next(r for r in alive if done[r] == top)
        healed = [r for r in alive if done[r] < top]
        for r in healed:
            params[r] = {k: v.clone() for k, v in params[src].items()}
            anchor[r] = {k: v.clone() for k, v in anchor[src].items()}
            pos[r], done[r] = pos[src], top
        w = {r: (0.0 if r in healed else 1.0 + r + pos[r] % 3) for r in alive}
        if not weighted:
            w = {r: (0.0 if r in healed else 1.0) for r in alive}
        if q not in FAIL:
            for r in alive:
                done[r] += 1
            if weighted:
                delta = {
                    k: sum(w[r] * (anchor[r][k] - params[r][k]) for r in alive) / sum(w.values())
                    for k in SHAPES
                }
            else:
                delta = {
                    k: sum(w[r] * (anchor[r][k] - params[r][k]) for r in alive) / len(alive)
                    for k in SHAPES
                }
            for r in alive:
                anchor[r] = {k: anchor[r][k] - lr_out * delta[k] for k in SHAPES}
                params[r] = {k: v.clone() for k, v in anchor[r].items()}
        q += 1
    return params, ALIVE[min(q - 1, len(ALIVE) - 1)]


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weight"])
def test_diloco_matches_the_naive_reference(weighted):
    every, steps = 2, 2 * (len(ALIVE) + 1)
    sim = fh.simulated_quorum(axis="r", alive=ALIVE, fail=FAIL)
    mesh = fh.SimMesh({"r": R, "dp": I}, replicas=sim)
    dl = fh.diloco(fh.hsdp(mesh, "r", "dp"), axis="r", every=every, outer=fh.sgd(0.5))
    params = fh.shard({k: torch.zeros(n, dtype=torch.float64) for k, n in SHAPES.items()}, dl.inner)
    state = dl.init(params)
    pos = torch.zeros(R, I, dtype=torch.int64)
    for _ in range(steps):
        grads = {
            key: torch.stack(
                [
                    torch.stack([grad_of(r, i, int(pos[r, i]))[key] for i in range(I)])
                    for r in range(R)
                ]
            )
            for key in SHAPES
        }
        g = fh.reduce_grads(grads, dl.inner, last=True)
        params = {key: params[key] - LR * g[key] for key in params}
        pos = pos + 1
        weight = None
        if dl.sync_due(state):
            params, state, pos = sim.quorum((params, state, pos))
            if weighted:
                per = (1.0 + torch.arange(R).view(R, 1) + pos % 3).to(torch.float64)
                weight = per.expand(R, I)
        params, state = dl.update(params, state, weight=weight)
    want, alive = _diloco_reference(weighted, steps, every)
    full = fh.gather(params, dl.inner)
    for r in alive:
        for key in SHAPES:
            torch.testing.assert_close(full[key][r, 0], want[r][key], rtol=1e-12, atol=1e-12)
    assert not any(q.committed is None for q in sim.log)


def test_a_failed_sync_changes_nothing_and_the_next_carries_it():
    sim = fh.simulated_quorum(axis="r", alive=[(0, 1)], fail=(0,))
    mesh = fh.SimMesh({"r": 2, "dp": 1}, replicas=sim)
    dl = fh.diloco(fh.hsdp(mesh, "r", "dp"), axis="r", every=1, outer=fh.sgd(1.0))
    params = fh.shard({"w": torch.zeros(2)}, dl.inner)
    state = dl.init(params)
    params = {"w": params["w"] - torch.tensor([1.0, 3.0]).view(2, 1, 1)}
    params, state = sim.quorum((params, state))
    new, new_state = dl.update(params, state)
    assert torch.equal(new["w"], params["w"])  # the local progress kept
    assert torch.equal(new_state.anchor["w"], state.anchor["w"])  # the anchor too
    new, new_state = sim.quorum((new, new_state))
    new, new_state = dl.update(new, new_state)  # committed: the mean of both, carried
    assert torch.equal(new["w"], torch.full((2, 1, 2), -2.0))


def test_errors_name_the_argument():
    sim = fh.simulated_quorum(axis="x", alive=[(0,)])
    with pytest.raises(ValueError, match="axis 'x' is not in the mesh"):
        fh.SimMesh({"r": 2}, replicas=sim)
    with pytest.raises(TypeError, match="replicas must be fh.simulated_quorum"):
        fh.SimMesh({"r": 2}, replicas=object())
    sim = fh.simulated_quorum(axis="r", alive=[(0, 5)])
    fh.SimMesh({"r": 2, "dp": 1}, replicas=sim)
    with pytest.raises(ValueError, match=r"subset of range\(2\)"):
        sim.quorum({})
    sim = fh.simulated_quorum(axis="r", alive=[(0, 1)])
    mesh = fh.SimMesh({"r": 2, "dp": 1}, replicas=sim)
    with pytest.raises(RuntimeError, match="no quorum is open"):
        sim.commit()
    dl = fh.diloco(fh.hsdp(mesh, "r", "dp"), axis="r", every=1, outer=fh.sgd(1.0))
    params = fh.shard({"w": torch.zeros(2)}, dl.inner)
    state = dl.init(params)
    with pytest.raises(ValueError, match="no quorum is open: start one when dl.sync_due"):
        dl.update(params, state)
    sim.quorum(params)
    with pytest.raises(RuntimeError, match="has not committed"):
        sim.quorum(params)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight must be finite and >= 0"):
            dl.update(params, state, weight=bad)
    with pytest.raises(TypeError, match="weight must be a number"):
        dl.update(params, state, weight="10")
    with pytest.raises(ValueError, match="on the fault-tolerant axis 'r'"):
        fh.diloco(
            fh.hsdp(mesh, "r", "dp"), axis="r", every=4, fragments=2, delay=2, outer=fh.sgd(1.0)
        )
    with pytest.raises(ValueError, match="compress= on the simulated quorum's axis"):
        fh.diloco(
            fh.hsdp(mesh, "r", "dp"),
            axis="r",
            every=2,
            outer=fh.sgd(1.0),
            compress=fh.compress(torch.int8),
        )
    with pytest.raises(ValueError, match="only all-reduces run over a simulated quorum's axis"):
        mesh.all_gather(torch.zeros(2, 1, 2), "r")


def test_healing_refuses_trees_that_differ_from_the_peers():
    paths = ("trees[0]['w']", "trees[1]")
    mine = [torch.zeros(3), 4]
    sent = {
        "paths": list(paths),
        "leaves": [_sendable(p, x) for p, x in zip(paths, [torch.ones(3), 9])],
    }
    got = _healed(paths, mine, sent)
    assert got[0] is mine[0] and torch.equal(mine[0], torch.ones(3)) and got[1] == 9
    other = {"paths": ["trees[0]['v']", "trees[1]"], "leaves": sent["leaves"]}
    with pytest.raises(
        ValueError, match=r"leaf 0 is trees\[0\]\['w'\] here and trees\[0\]\['v'\] on the peer"
    ):
        _healed(paths, [torch.zeros(3), 4], other)
    with pytest.raises(
        ValueError, match=r"trees\[0\]\['w'\] is \(3,\) torch.float32 here and \(2,\)"
    ):
        _healed(paths, [torch.zeros(3), 4], {"paths": list(paths), "leaves": [torch.ones(2), 1]})
    masked = fh.masked_node(torch.zeros(2))
    assert isinstance(_sendable("p", masked), _Kept)
    assert STATE_KEY == "functional_hsdp"
