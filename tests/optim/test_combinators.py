"""optax-style combinators and schedules on a SimMesh, against dense torch references.

- chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate(schedule)) on sharded trees
  trains as torch.optim.AdamW with torch's LambdaLR (the same schedule) on the dense mean
  gradient; with clip_global_norm first, as clip_grad_norm_ before it;
- fh.adamw is its chain bit for bit; an optimizer with a schedule is the optimizer with that
  step's number, step by step;
- the schedules give optax's formulas (written here from optax's documentation);
- a transformation of one's own chains with the library's;
- bad input gets an error naming the argument or the pytree path.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from reference import (
    AXES,
    STRATEGIES,
    EmaState,
    accumulate,
    dense_norm,
    dense_reduce,
    max_error,
    preset,
    random_tree,
    scale_by_ema,
    torch_clip,
)

import functional_hsdp as fh

S = fh.schedules
B1, B2, EPS, WD = 0.8, 0.99, 1e-6, 0.1


def _mesh(shape) -> fh.SimMesh:
    return fh.SimMesh(dict(zip(AXES, shape)))


def _adamw_chain(lr, *, clip=None, spec=None):
    parts = [
        fh.scale_by_adam(b1=B1, b2=B2, eps=EPS),
        fh.add_decayed_weights(WD),
        fh.scale_by_learning_rate(lr),
    ]
    return fh.chain(*([fh.clip_global_norm(spec, clip)] if clip is not None else []), *parts)


SCHEDULE = S.warmup_cosine_decay(0.0, 0.02, warmup_steps=2, decay_steps=6, end_value=0.002)


def _train_against_torch(strategy, shape, *, steps=7, clip=None):
    """The chain on shards and torch.optim.AdamW + LambdaLR on the dense mean gradient."""
    spec = preset(strategy, _mesh(shape))
    full = random_tree((), seed=20)
    params = fh.shard(full, spec)
    opt = _adamw_chain(SCHEDULE, clip=clip, spec=spec)
    state = opt.init(params)
    dense_leaves, treedef = optree.tree_flatten(full)
    dense = [x.clone().requires_grad_() for x in dense_leaves]
    torch_opt = torch.optim.AdamW(dense, lr=1.0, betas=(B1, B2), eps=EPS, weight_decay=WD)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: SCHEDULE(step))
    norms = []
    for step in range(steps):
        micro = [random_tree(shape, seed=100 * step + m) for m in range(2)]
        grads = accumulate(micro, spec)
        for p, g in zip(dense, optree.tree_leaves(dense_reduce(micro, len(shape)))):
            p.grad = g.float()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(dense, clip)))
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        torch_opt.step()
        lr_sched.step()
    ref = optree.tree_unflatten(treedef, [p.detach().double() for p in dense])
    return max_error(fh.gather(params, spec), ref), state, norms


@pytest.mark.parametrize("shape", [(2, 2), (2, 3)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adam_chain_with_a_schedule_trains_as_torch_adamw_with_lambdalr(strategy, shape):
    error, state, _ = _train_against_torch(strategy, shape)
    assert error < 1e-6
    adam, decay, lr = state.inner
    assert (adam.count, lr.count, decay) == (7, 7, fh.EmptyState())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_global_norm_first_in_a_chain_is_torch_clip_grad_norm_then_adamw(strategy):
    error, state, norms = _train_against_torch(strategy, (2, 3), clip=7.4)
    assert min(norms) < 7.4 < max(norms)  # clipping acts on some steps only
    assert error < 1e-6 and state.inner[0] == fh.EmptyState()


@pytest.mark.parametrize("clips", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clip_global_norm_in_a_chain_equals_torch_clip_grad_norm(strategy, clips):
    shape = (2, 3)
    spec = preset(strategy, _mesh(shape))
    micro = [random_tree(shape, seed=11 + m) for m in range(2)]
    final, dense = accumulate(micro, spec), dense_reduce(micro, len(shape))
    max_norm = dense_norm(dense) * (0.3 if clips else 2.0)
    opt = fh.chain(fh.clip_global_norm(spec, max_norm), fh.scale(2.0))
    with fh.comm_log() as log:
        updates, state = opt.update(final, opt.init(final), final)
    ref, _ = torch_clip(dense, max_norm)
    assert max_error(fh.gather(updates, spec), optree.tree_map(lambda x: 2 * x, ref)) < 2e-6
    # the same as the function form, and the norm's few scalars are all it communicates
    clipped, _ = fh.clip_by_global_norm(final, spec, max_norm)
    assert all(
        torch.equal(u, 2.0 * c)
        for u, c in zip(optree.tree_leaves(updates), optree.tree_leaves(clipped))
    )
    assert all(e.op == "all_reduce" and e.numel == 1 for e in log.events)
    assert state == fh.ChainState((fh.EmptyState(), fh.EmptyState()))


# -- adamw is its chain; a schedule is the number of its step --------------------------------


def _steps(opt, spec, shape, steps=5, params=None):
    """(every step's updates, final state) of ``opt`` on fixed gradients."""
    params = fh.shard(random_tree((), seed=3), spec) if params is None else params
    state, out = opt.init(params), []
    for step in range(steps):
        grads = accumulate([random_tree(shape, seed=50 + step)], spec)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        out.append(updates)
    return out, state


def _bitwise(a, b) -> bool:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) and x.dtype == y.dtype
        if isinstance(x, torch.Tensor)
        else (x == y and type(x) is type(y))
        for x, y in zip(la, lb)
    )


@pytest.mark.parametrize("lr", [0.01, SCHEDULE], ids=["float", "schedule"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_adamw_is_its_chain_bit_for_bit(strategy, lr):
    shape = (2, 2)
    spec = preset(strategy, _mesh(shape))
    got, state = _steps(fh.adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD), spec, shape)
    want, chain_state = _steps(_adamw_chain(lr), spec, shape)
    assert _bitwise(got, want)
    adam, _, lr_state = chain_state.inner
    assert isinstance(state, fh.ScaleByAdamState) and _bitwise(tuple(state), tuple(adam))
    assert state.count == lr_state.count == 5


def test_adamw_state_is_scale_by_adam_state_and_its_old_name_warns():
    params = {"w": torch.ones(3)}
    state = fh.adamw(0.1).init(params)
    assert type(state) is fh.ScaleByAdamState is type(fh.scale_by_adam().init(params))
    deprecated = r"fh\.AdamWState is deprecated: use fh\.ScaleByAdamState"
    with pytest.warns(DeprecationWarning, match=deprecated):
        old = fh.AdamWState
    assert old is fh.ScaleByAdamState and isinstance(state, old)
    assert "AdamWState" not in fh.__all__


def test_clip_by_global_norm_with_optax_s_one_argument_points_to_clip_global_norm():
    """optax's ``clip_by_global_norm(max_norm)`` is a transformation; here that is
    ``clip_global_norm(spec, max_norm)``, and the function form says so."""
    with pytest.raises(TypeError, match=r"use fh\.clip_global_norm\(spec, max_norm=1\.0\)"):
        fh.clip_by_global_norm(1.0)
    spec = fh.ddp(_mesh((2, 2)))
    with pytest.raises(TypeError, match=r"max_norm missing .* fh\.clip_global_norm"):
        fh.clip_by_global_norm({"w": torch.ones(2, 2, 3)}, spec)
    with pytest.raises(TypeError, match=r"spec and max_norm missing"):
        fh.clip_by_global_norm({"w": torch.ones(2, 2, 3)})


def test_adamw_is_its_chain_in_float64_and_bfloat16_params():
    spec = fh.hfsdp(_mesh((2, 2)), *AXES)
    for dtype in (torch.float64, torch.bfloat16):
        params = fh.shard(random_tree((), dtype=dtype, seed=4), spec)
        got, _ = _steps(fh.adamw(0.01, b1=B1, b2=B2, eps=EPS, weight_decay=WD), spec, (2, 2),
                        params=params)  # fmt: skip
        want, _ = _steps(_adamw_chain(0.01), spec, (2, 2), params=params)
        assert _bitwise(got, want) and optree.tree_leaves(got)[0].dtype == dtype


def _stepwise(make, lr, spec, shape, steps=4):
    """``make(lr)`` stepped with a schedule, and ``make(lr(t))`` rebuilt each step on the same
    state: the updates of each step."""
    params = fh.shard(random_tree((), seed=5), spec)
    scheduled, each = make(lr), []
    s1 = s2 = scheduled.init(params)
    for step in range(steps):
        grads = accumulate([random_tree(shape, seed=70 + step)], spec)
        u1, s1 = scheduled.update(grads, s1, params)
        u2, s2 = make(lr(step)).update(grads, s2, params)
        each.append(_bitwise(u1, u2))
    return each, s1


def test_a_schedule_is_the_number_of_its_step_in_sgd_adamw_and_muon():
    shape = (2, 2)
    mesh = _mesh(shape)
    spec = fh.hsdp(mesh, *AXES)
    lr = S.join([S.linear(0.0, 0.1, transition_steps=2), S.cosine_decay(0.1, 3)], [2])
    for make in (
        lambda lr: fh.sgd(lr, momentum=0.9, weight_decay=0.01),
        lambda lr: fh.adamw(lr, weight_decay=0.1),
        lambda lr: fh.chain(fh.scale_by_adam(), fh.scale_by_learning_rate(lr)),
    ):
        each, state = _stepwise(make, lr, spec, shape)
        assert all(each)
    matrices = {"w": (6, 4), "v": (5, 5)}
    params = fh.shard(random_tree((), shapes=matrices, seed=6), spec)
    opt, fixed = fh.muon(spec, lr, ns_dtype=torch.float32), {}
    state = opt.init(params)
    for step in range(3):
        grads = accumulate([random_tree(shape, shapes=matrices, seed=step)], spec)
        u1, new = opt.update(grads, state, params)
        fixed = fh.muon(spec, lr(step), ns_dtype=torch.float32)
        u2, _ = fixed.update(grads, state, params)
        assert _bitwise(u1, u2)
        state = new
    assert isinstance(state, fh.MuonState) and state.count == 3


# -- the schedules are optax's ------------------------------------------------------------------
# Written from optax's documentation (its *_schedule functions): piecewise formulas.


def _optax_linear(i, e, t_steps, begin, t):
    if t_steps <= 0 or t < begin:
        return i
    if t >= begin + t_steps:
        return e
    return i + (t - begin) / t_steps * (e - i)


def _optax_cosine(i, t_decay, alpha, p, t):
    if t > t_decay:
        return alpha * i
    return alpha * i + (1 - alpha) * i * (0.5 * (1 + math.cos(math.pi * t / t_decay))) ** p


def _optax_warmup_cosine(i, peak, warmup, decay, end, p, t):
    if t < warmup:
        return _optax_linear(i, peak, warmup, 0, t)
    alpha = 0.0 if peak == 0 else end / peak
    return _optax_cosine(peak, decay - warmup, alpha, p, t - warmup)


STEPS = [0, 1, 2, 3, 5, 7, 10, 11, 12, 50, 99, 100, 101, 150, 1000]


@pytest.mark.parametrize("t", STEPS)
def test_schedules_equal_optax_formulas(t):
    approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-15)  # noqa: E731
    assert S.constant(0.3)(t) == 0.3
    assert S.linear(1.0, 0.01, 100)(t) == approx(_optax_linear(1.0, 0.01, 100, 0, t))
    assert S.linear(0.2, 0.6, 90, 10)(t) == approx(_optax_linear(0.2, 0.6, 90, 10, t))
    assert S.linear(0.5, 0.0, 0)(t) == 0.5  # no transition: init_value throughout
    assert S.linear(1.0, 0.0, 10, -5)(t) == approx(_optax_linear(1.0, 0.0, 10, 0, t))
    assert S.cosine_decay(0.1, 100)(t) == approx(_optax_cosine(0.1, 100, 0.0, 1.0, t))
    assert S.cosine_decay(2.0, 11, alpha=0.1, exponent=2.0)(t) == approx(
        _optax_cosine(2.0, 11, 0.1, 2.0, t)
    )
    for args in [(0.0, 1e-3, 10, 100, 1e-5, 1.0), (1e-4, 0.5, 3, 12, 0.0, 1.5)]:
        assert S.warmup_cosine_decay(*args)(t) == approx(_optax_warmup_cosine(*args, t))
    joined = S.join([S.constant(1.0), S.linear(0.5, 0.0, 4), S.cosine_decay(0.2, 50)], [7, 11])
    want = 1.0 if t < 7 else _optax_linear(0.5, 0.0, 4, 0, t - 7) if t < 11 else None
    want = _optax_cosine(0.2, 50, 0.0, 1.0, t - 11) if want is None else want
    assert joined(t) == approx(want)


def test_schedules_match_optax_docstring_examples():
    lin = S.linear(init_value=1.0, end_value=0.01, transition_steps=100)
    assert (lin(0), lin(100)) == (1.0, pytest.approx(0.01))
    wcd = S.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=110, end_value=0.1)
    assert wcd(10) == 1.0 and wcd(110) == pytest.approx(0.1) and wcd(5) == 0.5


# -- a transformation of one's own --------------------------------------------------------------


def test_a_users_own_transform_chains_with_the_librarys():
    shape = (2, 3)
    spec = fh.hfsdp(_mesh(shape), *AXES)
    full = random_tree((), seed=8)
    params = fh.shard(full, spec)
    lr = S.linear(0.1, 0.0, transition_steps=4)
    opt = fh.chain(fh.clip_global_norm(spec, 1.0), scale_by_ema(0.5), fh.scale_by_learning_rate(lr))
    state = opt.init(params)
    dense = optree.tree_map(torch.Tensor.double, full)
    ema = optree.tree_map(torch.zeros_like, dense)
    for step in range(4):
        micro = [random_tree(shape, seed=90 + step)]
        updates, state = opt.update(accumulate(micro, spec), state, params)
        params = fh.apply_updates(params, updates)
        g = dense_reduce(micro, len(shape))
        norm = dense_norm(g)
        factor = min(1.0, 1.0 / (norm + 1e-6))
        ema = optree.tree_map(lambda e, x, f=factor: 0.5 * e + 0.5 * f * x, ema, g)
        rate = lr(step)
        dense = optree.tree_map(lambda p, e, r=rate: p - r * e, dense, ema)
    assert max_error(fh.gather(params, spec), dense) < 1e-6
    assert isinstance(state.inner[1], EmaState) and state.inner[1].count == 4


def test_a_chain_inside_partition_and_partition_inside_a_chain():
    shape = (2, 2)
    spec = fh.hsdp(_mesh(shape), *AXES)
    params = fh.shard(random_tree((), seed=9), spec)
    label = lambda path, leaf: "decayed" if path[0] == "z" else "plain"  # noqa: E731
    inner = fh.partition(
        {"decayed": _adamw_chain(0.01), "plain": fh.chain(fh.scale_by_adam(), fh.scale(-0.01))},
        label,
    )
    opt = fh.chain(fh.clip_global_norm(spec, 1.0), inner)
    got, state = _steps(opt, spec, shape, steps=2, params=params)
    ref_z, _ = _steps(fh.chain(fh.clip_global_norm(spec, 1.0), _adamw_chain(0.01)), spec, shape,
                      steps=2, params=params)  # fmt: skip
    assert all(torch.equal(a["z"], b["z"]) for a, b in zip(got, ref_z))
    assert state.inner[1].inner["decayed"].inner[0].count == 2


def test_add_decayed_weights_masks_by_tree_prefix_and_by_callable():
    params = {"a": torch.ones(3), "n": [torch.ones(2), {"s": torch.ones(1)}]}
    zeros = optree.tree_map(torch.zeros_like, params)
    by_tree = fh.add_decayed_weights(0.5, mask={"a": False, "n": True})
    by_path = fh.add_decayed_weights(0.5, mask=lambda path, leaf: path[0] == "n")
    for opt in (by_tree, by_path):
        out, _ = opt.update(zeros, opt.init(params), params)
        assert torch.equal(out["a"], torch.zeros(3))
        assert torch.equal(out["n"][0], torch.full((2,), 0.5))
        assert torch.equal(out["n"][1]["s"], torch.full((1,), 0.5))


# -- bad input ----------------------------------------------------------------------------------


def test_a_negative_lr_is_refused_naming_the_argument():
    spec = fh.ddp(_mesh((2, 2)))
    for make in (fh.sgd, fh.adamw):
        with pytest.raises(ValueError, match=r"^lr must be a number >= 0 or a schedule"):
            make(-0.1)
    with pytest.raises(ValueError, match=r"^muon: lr must be a number >= 0 or a schedule"):
        fh.muon(spec, -1e-3)
    with pytest.raises(ValueError, match=r"^learning_rate must be a number >= 0"):
        fh.scale_by_learning_rate(-1.0)
    with pytest.raises(ValueError, match="learning_rate must be .* got nan"):
        fh.scale_by_learning_rate(float("nan"))


@pytest.mark.parametrize(
    "returned, error, message",
    [
        ("0.1", TypeError, r"the schedule returned str '0\.1' at step 0; expected a number"),
        (None, TypeError, r"the schedule returned NoneType None at step 0"),
        (torch.tensor(0.1), TypeError, r"the schedule returned Tensor .* return float\(t\)"),
        (True, TypeError, r"the schedule returned bool True"),
        (-0.5, ValueError, r"the schedule returned -0\.5 at step 0; expected a finite number"),
        (float("inf"), ValueError, r"the schedule returned inf at step 0"),
    ],
    ids=["str", "None", "tensor", "bool", "negative", "inf"],
)
def test_a_schedule_returning_a_non_number_is_refused_naming_the_argument(returned, error, message):
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    for opt, name in (
        (fh.sgd(lambda step: returned), "lr"),
        (fh.adamw(lambda step: returned), "learning_rate"),  # its chain's part
        (fh.scale_by_learning_rate(lambda step: returned), "learning_rate"),
    ):
        with pytest.raises(error, match=f"^{name}: {message}"):
            opt.update(grads, opt.init(params), params)


def test_a_mask_that_does_not_match_the_params_is_refused_naming_the_path():
    params = {"a": torch.ones(3), "n": [torch.ones(2), {"s": torch.ones(1)}]}
    grads = optree.tree_map(torch.zeros_like, params)
    opt = fh.add_decayed_weights(0.1, mask={"a": True, "m": False})
    with pytest.raises(
        ValueError, match=r"(?s)mask is not a tree of bools with the params'.*missing key.*'m'"
    ):
        opt.update(grads, opt.init(params), params)
    opt = fh.add_decayed_weights(0.1, mask={"a": True, "n": [True, {"t": True}]})
    with pytest.raises(ValueError, match=r"mask\['n'\]\[1\]"):
        opt.update(grads, opt.init(params), params)
    opt = fh.add_decayed_weights(0.1, mask={"a": True, "n": [True, {"s": 1}]})
    with pytest.raises(TypeError, match=r"^mask for params\['n'\]\[1\]\['s'\]: expected a bool"):
        opt.update(grads, opt.init(params), params)
    opt = fh.add_decayed_weights(0.1, mask=lambda path, leaf: "yes")
    with pytest.raises(TypeError, match=r"^mask\(path, leaf\) for params\['a'\]: expected a bool"):
        opt.update(grads, opt.init(params), params)
    with pytest.raises(ValueError, match="needs params"):
        fh.add_decayed_weights(0.1).update(grads, fh.EmptyState())


def test_bad_chains_states_and_arguments_are_refused():
    params = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"chain: transforms\[1\] is not a GradientTransformation"):
        fh.chain(fh.scale(1.0), lambda g: g)
    opt = fh.chain(fh.scale_by_adam(), fh.scale_by_learning_rate(0.1))
    with pytest.raises(TypeError, match=r"state: expected the ChainState of this chain's init"):
        opt.update(params, fh.scale_by_adam().init(params), params)
    bad = fh.ChainState((fh.scale_by_adam().init({"v": torch.ones(2)}), fh.EmptyState()))
    with pytest.raises(ValueError, match="does not have the structure of params") as e:
        opt.update(params, bad, params)
    assert "(in chain's transforms[0])" in e.value.__notes__
    with pytest.raises(TypeError, match="expected a ScaleByLearningRateState"):
        opt.update(params, fh.ChainState((opt.init(params).inner[0], fh.EmptyState())), params)
    with pytest.raises(ValueError, match="b2 must be in"):
        fh.scale_by_adam(b2=1.0)
    with pytest.raises(ValueError, match="max_norm must be a finite number"):
        fh.clip_global_norm(fh.ddp(_mesh((2, 2))), -1.0)
    with pytest.raises(ValueError, match="scale: step_size must be a finite number"):
        fh.scale(float("inf"))
    with pytest.raises(ValueError, match="cosine_decay: decay_steps must be > 0"):
        S.cosine_decay(0.1, 0)
    with pytest.raises(ValueError, match="join: expected one boundary fewer"):
        S.join([S.constant(1.0)], [3])
    with pytest.raises(ValueError, match="decay_steps .* must be > warmup_steps"):
        S.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=10)
    with pytest.raises(TypeError, match="linear: transition_steps must be an int"):
        S.linear(0.0, 1.0, 2.5)


def test_schedules_is_a_submodule_path_too():
    """``fh.schedules`` lives in the optim layer; its old module path still imports it."""
    import importlib

    module = importlib.import_module("functional_hsdp.schedules")
    assert module is fh.schedules
    assert module.cosine_decay is fh.schedules.cosine_decay
