"""fh.diloco and fh.replicas on a SimMesh: parity with the naive reference
(tests/diloco_problem.py: dense replicas, deltas averaged by hand, torch.optim.SGD(nesterov=True)
outside), the fragment schedule, the outer collectives' count and size, and bad input; with
``compress=``: parity with the reference's codec round trips by hand, error feedback's
bookkeeping, and the compressed wire."""

from __future__ import annotations

import itertools
from typing import Any

import optree
import pytest
import torch
from diloco_problem import (
    INNER_LR,
    LABELS,
    chunks,
    data,
    full_params,
    loss,
    make,
    max_error,
    reference,
    train,
)

import functional_hsdp as fh

O, I = 2, 2  # noqa: E741
_PLACE = {"R": fh.Replicate(), "P": fh.Partial(), "F": fh.Flat()}


def _mesh():
    return fh.SimMesh({"dp_outer": O, "dp_inner": I})


CASES = [
    dict(every=e, fragments=f, delay=d, mix=m)
    for e, f, d, m in itertools.product((1, 3), (1, 2), (0, 1), (1.0, 0.5))
    if d < e
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_whole_tree_loop_equals_the_naive_reference(case):
    steps = 7
    x, y = data(steps, O, I)
    full = full_params()
    got, _, _ = train(_mesh(), full, x, y, steps=steps, **case)
    want = reference(
        full,
        x,
        y,
        every=case["every"],
        labels=LABELS[case["fragments"]],
        delay=case["delay"],
        mix=case["mix"],
    )
    for o in range(O):
        for i in range(I):
            rank = {k: v[o, i] for k, v in got.items()}
            assert max_error(rank, want[o]) < 1e-5, (o, i)


def test_every_1_with_outer_sgd_lr_1_is_hsdp():
    steps = 5
    x, y = data(steps, O, I)
    full = full_params()
    mesh = _mesh()
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    dl = fh.diloco(spec, axis="dp_outer", every=1, outer=fh.sgd(1.0))
    params, hsdp = fh.shard(full, dl.inner), fh.shard(full, spec)
    state, opt = dl.init(params), fh.sgd(0.1)
    s1, s2 = opt.init(params), opt.init(hsdp)
    grad = fh.per_rank(torch.func.grad(__import__("diloco_problem").loss), mesh)
    for t in range(steps):
        acc = fh.reduce_grads(grad(fh.gather(params, dl.inner), x[t], y[t]), dl.inner, last=True)
        u, s1 = opt.update(acc, s1, params)
        params, state = dl.update(fh.apply_updates(params, u), state)
        acc = fh.reduce_grads(grad(fh.gather(hsdp, spec), x[t], y[t]), spec, last=True)
        u, s2 = opt.update(acc, s2, hsdp)
        hsdp = fh.apply_updates(hsdp, u)
    a, b = fh.gather(params, dl.inner), fh.gather(hsdp, spec)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_steps_without_a_sync_issue_no_collective_and_a_sync_one_all_reduce_per_bucket():
    steps, every = 8, 4
    x, y = data(steps, O, I)
    _, events, state = train(
        _mesh(), full_params(), x, y, steps=steps, every=every, fragments=2, delay=1
    )
    pieces = [a.shape[-1] for a in state.anchor.values()]  # this rank's 1-D pieces, per leaf
    aligned = [sum(-(-n // 16) * 16 for n in part) for part in (pieces[:2], pieces[2:])]
    due = fh.sync_steps(every, 2, steps)
    assert due == [[], [0], [], [1], [], [0], [], [1]]
    for t, ev in enumerate(events, 1):
        if not due[t - 1]:
            assert ev == [], t
        else:
            # one bucket per fragment here, of the local shards' pieces (each leaf 16-aligned
            # in the bucket; on a SimMesh the largest rank's), not the whole fragment
            (p,) = due[t - 1]
            assert ev == [("all_reduce", "dp_outer", aligned[p])]
    assert sum(pieces) < 16 + 128 + 4 + 64  # a shard: the inner ranks split the model


def test_the_inner_loop_on_replicas_never_touches_the_replica_axis():
    mesh = _mesh()
    spec = fh.replicas(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_outer")
    full = {"w": torch.randn(6, 4), "v": torch.randn(3, 8), "b": torch.randn(5)}
    g = {k: torch.randn(O, I, *v.shape) for k, v in full.items()}
    with fh.comm_log() as log:
        params = fh.shard(full, spec)
        acc = fh.reduce_grads(g, spec, last=False)
        acc = fh.reduce_grads(g, spec, last=True, acc=acc)
        fh.gather(params, spec)
        fh.clip_by_global_norm(acc, spec, 1.0)
        mg = fh.MainGrad(spec, like=full)
        mg.accumulate(g, last=True)
        u, _ = fh.adamw(0.1).update(acc, fh.adamw(0.1).init(params), params)
        mats = {"w": acc["w"], "v": acc["v"]}
        pm = {"w": params["w"], "v": params["v"]}
        with pytest.raises(ValueError):  # a sub-tree's pieces are not its own layout
            fh.per_matrix(lambda m: m, mats, spec)
        owned = fh.owned(spec)
        po = fh.shard({"w": full["w"], "v": full["v"]}, owned)
        go = fh.reduce_grads({"w": g["w"], "v": g["v"]}, owned, last=True)
        mu = fh.muon(owned, lr=0.1)
        mu.update(go, mu.init(po), po)
        del pm
    assert {e.axis for e in log.events} == {"dp_inner"}
    # each replica reduced its own gradients: the mean over its inner ranks
    got = fh.gather(acc, spec)["w"]
    want = (2 * g["w"]).mean(1, keepdim=True).expand_as(got)
    torch.testing.assert_close(got, want)
    # the norm is each replica's own
    norm = fh.global_norm(acc, spec)
    dense = torch.stack(
        [torch.cat([(2 * g[k][o]).mean(0).flatten() for k in sorted(g)]).norm() for o in range(O)]
    )
    torch.testing.assert_close(norm, dense[:, None].expand(O, I))


def test_fragments_as_an_int_cut_contiguous_groups_of_about_equal_bytes():
    mesh = _mesh()
    dl = fh.diloco(
        fh.hsdp(mesh, "dp_outer", "dp_inner"),
        axis="dp_outer",
        every=2,
        outer=fh.sgd(1.0),
        fragments=2,
    )
    state = dl.init(fh.shard(full_params(), dl.inner))
    marked = {
        k: [isinstance(v, fh.MaskedNode) for v in s.momentum.values()] if s.momentum else None
        for k, s in state.outer.inner.items()
    }
    assert marked == {"0": None, "1": None}  # sgd(1.0) keeps no momentum
    dl = fh.diloco(
        fh.hsdp(mesh, "dp_outer", "dp_inner"),
        axis="dp_outer",
        every=2,
        outer=fh.sgd(0.7, momentum=0.9),
        fragments=2,
    )
    state = dl.init(fh.shard(full_params(), dl.inner))
    got = [
        [not isinstance(v, fh.MaskedNode) for v in state.outer.inner[p].momentum.values()]
        for p in ("0", "1")
    ]
    assert got == [[True, True, False, False], [False, False, True, True]]


def _embed_head_layers() -> dict:
    """An embedding and a head side by side in tree order (4 KiB each), then four 1 KiB
    layers: contiguous halves cannot be equal; sized halves are (4 + 1 + 1 each)."""
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(32, 32, generator=gen) for k in ("embed", "head")}
    return {**full, **{f"l{i}": torch.randn(16, 16, generator=gen) for i in range(4)}}


def test_balanced_fragments_read_the_full_shapes_from_any_form_of_the_params():
    spec = fh.replicas(fh.hsdp(_mesh(), "dp_outer", "dp_inner"), "dp_outer")
    full = _embed_head_layers()
    want = {"embed": 0, "head": 1, "l0": 0, "l1": 1, "l2": 0, "l3": 1}
    shards = fh.shard(full, spec)
    untagged = {k: v.clone() for k, v in shards.items()}  # local shapes, no placement
    meta = {k: v.to("meta") for k, v in full.items()}
    assert fh.balanced_fragments(full, 2) == want
    assert fh.balanced_fragments(meta, 2) == want
    assert fh.balanced_fragments(shards, 2) == want
    assert fh.balanced_fragments(untagged, 2, spec=spec) == want
    assert fh.balanced_fragments(full, 1) == dict.fromkeys(full, 0)
    assert fh.balanced_fragments(full, 6) == {k: i for i, k in enumerate(full)}
    with pytest.raises(ValueError, match="balanced_fragments: fragments must be an int >= 1"):
        fh.balanced_fragments(full, 0)
    with pytest.raises(ValueError, match="balanced_fragments: fragments must be an int >= 1"):
        fh.balanced_fragments(full, True)
    with pytest.raises(ValueError, match="fragments=7 is more than the params' 6 leaves"):
        fh.balanced_fragments(full, 7)


def test_balanced_fragments_keep_each_sync_at_1_over_f_where_contiguous_groups_cannot():
    # a bucket per leaf: each rank holds half of every leaf (a SimMesh counts the largest
    # rank's pieces, and a leaf that falls in one rank's chunk of a shared bucket is whole)
    spec = fh.hsdp(_mesh(), "dp_outer", "dp_inner", bucket_cap_mb=1e-3)
    full = _embed_head_layers()
    largest = {}
    for name, fragments in (("whole", 1), ("contiguous", 2), ("balanced", None)):
        inner = fh.replicas(spec, "dp_outer")
        params = fh.shard(full, inner)
        labels = fragments or fh.balanced_fragments(params, 2)
        dl = fh.diloco(spec, axis="dp_outer", every=2, outer=fh.sgd(1.0), fragments=labels)
        state, sent = dl.init(params), []
        for step in range(4):
            params = {k: v - 0.01 * (step + 1) for k, v in params.items()}
            with fh.comm_log() as log:
                params, state = dl.update(params, state)
            sent.append(sum(e.numel for e in log.events if e.axis == "dp_outer"))
        largest[name] = max(sent)
    # each rank's pieces: 512 elements of each 32x32, 128 of each 16x16
    assert largest == {"whole": 1536, "contiguous": 1024, "balanced": 768}


def test_balanced_fragments_train_as_the_naive_reference_with_those_labels():
    steps = 7
    x, y = data(steps, O, I)
    full = full_params()
    labels = fh.balanced_fragments(full, 2)  # 0.weight alone: not contiguous in tree order
    assert labels == {"0.bias": 0, "0.weight": 1, "2.bias": 0, "2.weight": 0}
    got, _, _ = train(_mesh(), full, x, y, steps=steps, every=3, fragments=labels, delay=1, mix=0.5)
    want = reference(full, x, y, every=3, labels=[labels[k] for k in sorted(full)], delay=1,
                     mix=0.5)  # fmt: skip
    for o in range(O):
        for i in range(I):
            assert max_error({k: v[o, i] for k, v in got.items()}, want[o]) < 1e-5, (o, i)


def test_a_replicas_specs_agreement_spans_its_replica_and_still_names_the_rank():
    from functional_hsdp.runtime import span

    mesh = _mesh()
    inner = fh.replicas(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_outer")
    scope = span.within(inner)
    assert (scope.axis_names, scope.sizes, scope.batch_shape) == (("dp_inner",), (2,), (2, 2))
    assert span.within(fh.hsdp(mesh, "dp_outer", "dp_inner")) is mesh
    assert span.within(mesh) is mesh
    assert span.within({"a": inner, "b": fh.hsdp(mesh, "dp_outer", "dp_inner")}) is mesh
    g = {"w": torch.ones(2, 2, 8, 4)}
    g["w"][1, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\['w'\]: holds NaN or Inf on rank \(1, 0\)"):
        fh.reduce_grads(g, inner, last=True, check_finite=True)
    out = fh.reduce_grads(torch.ones(2, 2, 8, 4), inner, last=True)  # and a healthy call passes
    assert torch.equal(out, torch.ones_like(out))


_POLICIES = {  # a sync's wire: uncompressed, int8 with and without error feedback
    "plain": None,
    "int8": fh.compress(torch.int8, block=32),
    "int8-nofeedback": fh.compress(torch.int8, block=32, error_feedback=False),
}


@pytest.mark.parametrize("wire", list(_POLICIES))
def test_a_delayed_sync_is_in_flight_until_it_lands_and_saves_whole(wire):
    # compressed: the first leg (the all-to-all) in flight, the rest where it lands; a
    # checkpoint finishes it and saves its new residual (residual_tree) beside pending
    from functional_hsdp.diloco import SyncInFlight, pending_tree, residual_tree

    spec = fh.hsdp(_mesh(), "dp_outer", "dp_inner")
    policy = _POLICIES[wire]
    feedback = policy is not None and policy.error_feedback
    dl = fh.diloco(spec, axis="dp_outer", every=4, outer=fh.sgd(1.0), fragments=2, delay=1,
                   compress=policy)  # fmt: skip
    params = fh.shard(full_params(), dl.inner)
    state = dl.init(params)
    flying, held, states = [], [], []
    for _ in range(8):  # fragment 0 issued after steps 2 and 6, fragment 1 after 4 and 8
        params = {k: v - 0.1 * torch.arange(1.0, 3.0).view(2, 1, 1) for k, v in params.items()}
        params, state = dl.update(params, state)
        flying.append([s.fragment for s in state.flight if s is not None])
        held.append([k for k, v in state.pending.items() if isinstance(v, torch.Tensor)])
        states.append((params, state))
    assert flying == [[], [0], [], [1], [], [0], [], [1]]
    assert held == [[]] * 8  # a sync in flight holds its buckets only, not pending leaves
    first, second = sorted(params)[:2], sorted(params)[2:]
    sync = state.flight[1]
    assert isinstance(sync, SyncInFlight) and "in flight" in repr(sync)
    whole = pending_tree(state)  # what a checkpoint saves: the sync waited for, zeros elsewhere
    assert "waited" in repr(sync) and sync.leaves == (2, 3)
    assert all(torch.equal(whole[k], x) for k, x in zip(second, sync.result()))
    assert all(whole[k].abs().sum() > 0 for k in second)
    assert all(not whole[k].any() and whole[k].shape == params[k].shape for k in first)
    kept = residual_tree(state)
    assert (kept is None) != feedback
    if feedback:  # fragment 1's new residual in its place, the rest as the state holds it
        assert all(torch.equal(kept[k], x) for k, x in zip(second, sync.residual()))
        assert all(kept[k] is state.residual[k] for k in first)
        assert any(not torch.equal(kept[k], state.residual[k]) for k in second)
    # a state loaded from it (nothing in flight, the sync held in pending) lands alike
    params6, state6 = states[5]  # fragment 0 issued after step 6, lands after step 7
    loaded = state6._replace(
        pending=pending_tree(state6), residual=residual_tree(state6), flight=()
    )
    step7 = {k: v - 0.1 * torch.arange(1.0, 3.0).view(2, 1, 1) for k, v in params6.items()}
    live, live_state = dl.update(step7, state6)
    again, after = dl.update(step7, loaded)
    assert all(torch.equal(live[k], again[k]) for k in params)
    if feedback:
        assert all(torch.equal(live_state.residual[k], after.residual[k]) for k in params)
    assert not all(torch.equal(live[k], step7[k]) for k in first)  # it did land
    assert all(isinstance(v, fh.MaskedNode) for v in after.pending.values())
    with pytest.raises(ValueError, match="fragment 0's sync lands after step 7, but it is neither"):
        dl.update(step7, state6._replace(flight=()))  # in flight, then dropped
    with pytest.raises(ValueError, match="state.flight: expected 2 entries"):
        dl.update(step7, state6._replace(flight=(None,)))
    with pytest.raises(ValueError, match="state.pending: 3 leaves, the params 4"):
        dl.update(params, state._replace(pending={k: whole[k] for k in list(whole)[:3]}))


def _replica_steps(dl, steps: int, *, state=None, params=None):
    """``steps`` updates of a loop whose replica o moves every param by -(o + 1) * 0.1 * t."""
    params = fh.shard(full_params(), dl.inner) if params is None else params
    state = dl.init(params) if state is None else state
    for _ in range(steps):
        t = state.count + 1
        step = (torch.arange(2.0) + 1).view(2, 1, 1) * 0.1 * t
        params, state = dl.update({k: v - step.view(2, 1, *(1,) * (v.dim() - 2)) for k, v in
                                   params.items()}, state)  # fmt: skip
    return params, state


@pytest.mark.parametrize("delay", [0, 1])
def test_an_outer_optimizer_that_checks_placements_takes_the_pseudo_gradient(delay):
    """The averaged pseudo-gradient reaches ``outer`` at the params' placement (not at the
    all-reduce's): a global-norm clip on ``dl.inner`` takes it; with a bound it never
    reaches, it is plain SGD; with a small one, the anchor moves by exactly lr * the bound."""
    spec = fh.hsdp(_mesh(), "dp_outer", "dp_inner")
    got = {}
    for name, outer in {
        "sgd": fh.sgd(0.7),
        "loose": fh.chain(fh.clip_global_norm(fh.replicas(spec, "dp_outer"), 1e9), fh.sgd(0.7)),
        "tight": fh.chain(fh.clip_global_norm(fh.replicas(spec, "dp_outer"), 0.05), fh.sgd(0.7)),
    }.items():
        dl = fh.diloco(spec, axis="dp_outer", every=2, outer=outer, delay=delay)
        got[name] = _replica_steps(dl, 2 + delay)[1].anchor
    start = fh.shard(full_params(), fh.replicas(spec, "dp_outer"))
    assert all(torch.equal(got["sgd"][k], got["loose"][k]) for k in start)
    moved = fh.global_norm({k: got["tight"][k] - start[k] for k in start},
                           fh.replicas(spec, "dp_outer"))  # fmt: skip
    assert torch.allclose(moved, torch.full_like(moved, 0.7 * 0.05), rtol=1e-5), moved


@pytest.mark.parametrize("wire", list(_POLICIES))
def test_a_state_with_a_sync_in_flight_pickles_and_copies_waited_for(wire):
    import copy
    import pickle

    spec = fh.hsdp(_mesh(), "dp_outer", "dp_inner")
    policy = _POLICIES[wire]
    dl = fh.diloco(spec, axis="dp_outer", every=4, outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
                   fragments=2, delay=2, compress=policy)  # fmt: skip
    params, state = _replica_steps(dl, 2)  # fragment 0 issued after step 2, lands after 4
    assert state.flight[0] is not None and "in flight" in repr(state.flight[0])
    copied = copy.deepcopy(state)
    unpickled = pickle.loads(pickle.dumps(state))
    assert "waited" in repr(copied.flight[0]) and "waited" in repr(unpickled.flight[0])
    live, live_state = _replica_steps(dl, 4, state=state, params=params)
    for other in (copied, unpickled):
        again, again_state = _replica_steps(dl, 4, state=other, params=params)
        assert all(torch.equal(live[k], again[k]) for k in live)
        if wire == "int8":  # the copied sync's new residual came along
            res = live_state.residual
            assert all(torch.equal(res[k], again_state.residual[k]) for k in res)


def test_a_state_whose_flights_do_not_match_the_schedule_is_refused():
    spec = fh.hsdp(_mesh(), "dp_outer", "dp_inner")
    dl = fh.diloco(spec, axis="dp_outer", every=4, outer=fh.sgd(1.0), fragments=2, delay=3)
    params, state = _replica_steps(dl, 4)  # fragment 0 in flight (due 5), fragment 1 (due 7)
    assert all(s is not None for s in state.flight)
    swapped = state._replace(flight=state.flight[::-1])
    with pytest.raises(ValueError, match=r"state.flight\[0\]: SyncInFlight\(fragment=1"):
        dl.update(params, swapped)
    stale = state._replace(due=(0, state.due[1]))
    with pytest.raises(ValueError, match="does not match fragment 0's schedule"):
        dl.update(params, stale)


def test_a_reduction_in_flight_waits_once_and_an_interrupt_lets_it_wait_again(monkeypatch):
    from functional_hsdp.runtime import engine
    from functional_hsdp.sync import collectives

    mesh = _mesh()
    x = {"a": torch.arange(4.0).view(2, 1, 2).expand(2, 2, 2).contiguous()}
    real, calls = engine.finish, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    flight = collectives.start_pmean(x, "dp_outer", mesh)
    monkeypatch.setattr(engine, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        flight.result()
    assert not flight.done and "in flight" in repr(flight)
    out = flight.result()  # waited again
    assert flight.result() is out and len(calls) == 2  # and once only
    assert torch.equal(out["a"], fh.pmean(x, "dp_outer", mesh)["a"])

    def failing(*args, **kwargs):
        raise RuntimeError("the collective failed")

    flight = collectives.start_pmean(x, "dp_outer", mesh)
    monkeypatch.setattr(engine, "finish", failing)
    for _ in range(2):  # an error is kept and raised again, from the new call
        with pytest.raises(RuntimeError, match="the collective failed"):
            flight.result()
    assert collectives.start_pmean({}, "dp_outer", mesh).result() == {}


def test_bad_input_names_the_argument():
    mesh = _mesh()
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    outer = fh.sgd(0.7, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        fh.diloco(spec, axis="dp_outer", every=0, outer=outer)
    with pytest.raises(ValueError, match="axis 'pp' is not in the mesh"):
        fh.diloco(spec, axis="pp", every=2, outer=outer)
    with pytest.raises(ValueError, match=r"mix must be in \(0, 1\]"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, mix=0.0)
    with pytest.raises(ValueError, match=r"mix must be in \(0, 1\]"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, mix=1.5)
    with pytest.raises(ValueError, match="delay must be an int >= 0"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, delay=-1)
    with pytest.raises(ValueError, match="delay must be < every"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, delay=2)
    with pytest.raises(TypeError, match="compress must be a policy from fh.compress"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, compress="int8")
    with pytest.raises(TypeError, match="compress must be a policy from fh.compress"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, compress=torch.int8)
    with pytest.raises(TypeError, match="outer must be a GradientTransformation"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=torch.optim.SGD)
    params = fh.shard(full_params(), fh.replicas(spec, "dp_outer"))
    plain = fh.diloco(spec, axis="dp_outer", every=2, outer=outer)
    packed = fh.diloco(spec, axis="dp_outer", every=2, outer=outer, compress=fh.compress("int4"))
    with pytest.raises(ValueError, match="compress differs: the residual .* is missing"):
        packed.update(params, plain.init(params))
    with pytest.raises(ValueError, match="compress differs: the residual .* is there"):
        plain.update(params, packed.init(params))
    cut = plain.init(params)._replace(anchor={k: v[..., :1] for k, v in params.items()})
    with pytest.raises(ValueError, match=r"state.anchor\['0.bias'\]: local shape \(2, 2, 1\)"):
        plain.update(params, cut)
    bad = {"0.bias": 0, "0.weight": 1, "2.bias": 3, "2.weight": 0}
    with pytest.raises(ValueError, match=r"fragments\['2.bias'\]: label 3 is out of range"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, fragments=bad).init(params)
    with pytest.raises(ValueError, match="fragments is not a pytree prefix"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, fragments={"x": 0}).init(params)
    with pytest.raises(ValueError, match="fragments=5 is more than the params' 4 leaves"):
        fh.diloco(spec, axis="dp_outer", every=2, outer=outer, fragments=5).init(params)
    with pytest.raises(ValueError, match="replicas: axis 'pp' is not in the mesh"):
        fh.replicas(spec, "pp")
    with pytest.raises(ValueError, match="replicas: axis 'dp_outer' is not a data-parallel"):
        fh.replicas(fh.fsdp(mesh, "dp_inner"), "dp_outer")


def test_a_label_tree_as_a_prefix_gives_one_fragment_per_subtree():
    mesh = _mesh()
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    full = {"a": {"w": torch.randn(4, 4), "b": torch.randn(4)}, "c": torch.randn(8)}
    dl = fh.diloco(
        spec, axis="dp_outer", every=2, outer=fh.sgd(0.5, momentum=0.5), fragments={"a": 1, "c": 0}
    )
    state = dl.init(fh.shard(full, dl.inner))
    assert not isinstance(state.outer.inner["0"].momentum["c"], fh.MaskedNode)
    assert isinstance(state.outer.inner["0"].momentum["a"]["w"], fh.MaskedNode)
    assert isinstance(state.outer.inner["1"].momentum["c"], fh.MaskedNode)


# -- compress= -----------------------------------------------------------------------------------


def _signs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, 2, v.shape, generator=gen).float() * 2 - 1
            for k, v in full_params().items()}  # fmt: skip


@pytest.mark.parametrize("placement", ["kept", "owner-major", "flat"])
def test_a_compressed_sync_on_any_optimizer_placement_packs_each_ranks_own_elements(placement):
    """Every element of every delta 127 * 2**-10 * (replica + 1) * its sign: int8 carries the
    deltas and their mean exactly (one scale per block, |q| = 127), so a compressed sync
    equals the uncompressed one bit for bit, and any element packed or unpacked at another
    place (another sign) would show. ``kept``: the optimizer placement Owner on some axes
    (each rank keeps the pieces its coordinate owns, not a chunk)."""
    pod = fh.SimMesh({"pod": 2, "dp_outer": 2, "dp_inner": 2})
    rows = dict(parameter=["R", "R", "F"], gradient=["P", "P", "F"], optimizer=["R", "R", "F"])
    spec = fh.Spec(pod, **{k: [_PLACE[x] for x in v] for k, v in rows.items()})
    spec = {"kept": lambda: fh.owned(spec, axes="dp_outer"), "owner-major": lambda: fh.owned(spec),
            "flat": lambda: spec}[placement]()  # fmt: skip
    signs, got = _signs(5), {}
    start = {k: torch.round(v * 1024) / 1024 for k, v in full_params().items()}  # exact sums
    for policy in (None, fh.compress(torch.int8, block=32)):
        dl = fh.diloco(spec, axis="pod", every=1, outer=fh.sgd(1.0), compress=policy)
        params = fh.shard(start, dl.inner)
        state = dl.init(params)
        step = {k: (torch.arange(2.0) + 1).view(2, 1, 1, *(1,) * v.dim()) * 127 * 2**-10 * v
                for k, v in signs.items()}  # fmt: skip
        full = fh.gather(params, dl.inner)
        moved = {k: full[k] - step[k] for k in full}
        params, state = dl.update(fh.shard(moved, dl.inner, stacked=True), state)
        got[policy] = fh.gather(params, dl.inner)
        if policy is not None:
            assert all(not r.any() for r in optree.tree_leaves(state.residual))
    plain, packed = got.values()
    assert all(torch.equal(plain[k], packed[k]) for k in plain)
    want = {k: v - 1.5 * 127 * 2**-10 * signs[k] for k, v in start.items()}
    assert all(torch.equal(plain[k], want[k].expand_as(plain[k])) for k in want)


@pytest.mark.parametrize("feedback", [True, False], ids=["feedback", "no-feedback"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_compressed_whole_tree_loop_equals_the_naive_reference(case, feedback):
    steps = 7
    x, y = data(steps, O, I)
    policy = fh.compress(torch.int8, block=32, error_feedback=feedback)
    got, _, state = train(_mesh(), full_params(), x, y, steps=steps, compress=policy, **case)
    labels = LABELS[case["fragments"]]
    want = reference(full_params(), x, y, every=case["every"], labels=labels,
                     delay=case["delay"], mix=case["mix"], compress=policy)  # fmt: skip
    plain = reference(full_params(), x, y, every=case["every"], labels=labels,
                      delay=case["delay"], mix=case["mix"])  # fmt: skip
    for o in range(O):
        assert max_error(want[o], plain[o]) > 1e-5  # the rounding shows
        for i in range(I):
            assert max_error({k: v[o, i] for k, v in got.items()}, want[o]) < 1e-6, (o, i)
    assert (state.residual is None) != feedback


def _synthetic(steps: int) -> list[list[dict]]:
    """Per step and replica, what its inner step subtracts (elementwise: the same bits in the
    reference, so that no rounding of the wire can tip on float noise of the inner loop)."""
    gen = torch.Generator().manual_seed(3)
    full = full_params()
    return [
        [{k: 0.05 * (1 + o) * torch.randn(v.shape, generator=gen) for k, v in full.items()}
         for o in range(O)]
        for _ in range(steps)
    ]  # fmt: skip


def _per_replica(trees: list[dict], spec) -> dict:
    """Replica o's local shards of ``trees[o]`` (each tree sharded, its replica's row kept)."""
    rows = [fh.shard(t, spec) for t in trees]
    return {k: torch.stack([rows[o][k][o] for o in range(O)]) for k in rows[0]}


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float8_e4m3fn, "int4"], ids=str)
def test_compressed_outer_step_equals_the_naive_reference_in_every_format(fmt):
    steps, policy = 7, fh.compress(fmt, block=32)
    x, y = data(steps, O, I)
    updates = _synthetic(steps)
    for case in CASES:
        dl = make(fh.hsdp(_mesh(), "dp_outer", "dp_inner"), compress=policy, **case)
        params = fh.shard(full_params(), dl.inner)
        state = dl.init(params)
        for t in range(steps):
            u = _per_replica(updates[t], dl.inner)
            params, state = dl.update({k: params[k] - u[k] for k in params}, state)
        got = fh.gather(params, dl.inner)
        want = reference(full_params(), x, y, every=case["every"],
                         labels=LABELS[case["fragments"]], delay=case["delay"],
                         mix=case["mix"], compress=policy, updates=updates)  # fmt: skip
        for o in range(O):
            for i in range(I):
                rank = {k: v[o, i] for k, v in got.items()}
                assert max_error(rank, want[o]) < 1e-6, (case, o, i)


def _recorder(seen: list):
    """An outer optimizer that keeps the averaged pseudo-gradient it gets and steps by it."""
    return fh.GradientTransformation(
        init=lambda params: fh.EmptyState(),
        update=lambda g, s, params=None: (
            seen.append({k: v.clone() for k, v in g.items()}) or {k: -v for k, v in g.items()},
            s,
        ),
    )


def _feed(policy, deltas: list[list[dict]]) -> tuple[list[dict], list[dict], Any]:
    """Sync after every step, each replica's params ``anchor - deltas[k][o]``: per sync the
    true mean of the replicas' local pieces and what arrived; the last state."""
    seen: list = []
    dl = fh.diloco(fh.hsdp(_mesh(), "dp_outer", "dp_inner"), axis="dp_outer", every=1,
                   outer=_recorder(seen), compress=policy)  # fmt: skip
    state, true = dl.init(fh.shard(full_params(), dl.inner)), []
    for d in deltas:
        mine = _per_replica(d, dl.inner)
        true.append({k: v.mean(0, keepdim=True) for k, v in mine.items()})
        _, state = dl.update({k: state.anchor[k] - mine[k] for k in mine}, state)
    return true, seen, state


def test_error_feedback_sent_plus_the_last_residual_is_the_sum_of_the_contributions():
    k_syncs = 6
    gen = torch.Generator().manual_seed(5)
    deltas = [[{k: v * torch.rand(1, generator=gen) for k, v in d.items()} for d in row]
              for row in _synthetic(k_syncs)]  # fmt: skip
    true, seen, state = _feed(fh.compress(torch.int8, block=32), deltas)
    for key in true[0]:
        want = sum(t[key] for t in true)
        sent = sum(s[key] for s in seen)
        back = sent + state.residual[key].mean(0, keepdim=True)
        assert (back - want).abs().max() < 1e-6 * want.abs().max() * k_syncs
        assert (sent - want).abs().max() > 1e-4 * want.abs().max()  # the residual is needed
    # the same gradient fed K times: the running sum's error stays at one step's with
    # feedback, and grows about K times without
    same = [_synthetic(1)[0]] * k_syncs
    errors = {}
    for feedback in (True, False):
        true, seen, _ = _feed(fh.compress(torch.int8, block=32, error_feedback=feedback), same)
        errors[feedback] = [
            max((sum(s[k] for s in seen[:n]) - n * true[0][k]).abs().max().item() for k in seen[0])
            for n in (1, k_syncs)
        ]
    with_, without = errors[True], errors[False]
    assert with_[1] <= 2 * with_[0] and without[1] >= 0.8 * k_syncs * without[0], errors


def test_a_compressed_sync_issues_one_all_to_all_and_one_all_gather_per_bucket_and_nothing_else():
    # delay=1: the all-to-all at the issue, in flight over the next inner step; the sum and
    # the all-gather where the sync lands
    steps, every = 8, 4
    x, y = data(steps, O, I)
    mesh, policy = _mesh(), fh.compress(torch.int8, block=32)
    dl = make(fh.hsdp(mesh, "dp_outer", "dp_inner"), every=every, fragments=2, delay=1,
              compress=policy)  # fmt: skip
    params, opt = fh.shard(full_params(), dl.inner), fh.sgd(INNER_LR)
    opt_state, state = opt.init(params), dl.init(params)
    grad = fh.per_rank(torch.func.grad(loss), mesh)
    events = []
    for t in range(steps):
        acc = fh.reduce_grads(grad(fh.gather(params, dl.inner), x[t], y[t]), dl.inner, last=True)
        u, opt_state = opt.update(acc, opt_state, params)
        with fh.comm_log() as log:
            params, state = dl.update(fh.apply_updates(params, u), state)
        events.append([(e.op, e.axis, e.dtype, e.numel) for e in log.events])
    # each rank's row: its elements of the fragment, the longest inner rank's length
    held = chunks(full_params(), I)
    length = [max(sum(1 for k, _ in ids if k.startswith(p)) for ids in held) for p in "02"]
    assert length == [112, 68]
    due = fh.sync_steps(every, 2, steps)
    piece = [policy.nbytes(-(-n // O)) for n in length]
    for t, ev in enumerate(events, 1):
        landed = due[t - 2] if t > 1 else []
        want = [("all_gather", "dp_outer", torch.int8, piece[p]) for p in landed]
        want += [("all_to_all", "dp_outer", torch.int8, O * piece[p]) for p in due[t - 1]]
        assert ev == want, t
    assert [len(e) for e in events] == [0, 1, 1, 1, 1, 1, 1, 1]  # step 8's lands after 9
    for p in (0, 1):  # the two legs' bytes, scales included, against fp32's (a
        # reduce-scatter and an all-gather of the same row): about a quarter
        assert (O * piece[p] + piece[p]) / (2 * length[p] * 4) < 0.3
