"""Ranks that run their gathered units differently, on 4 gloo ranks (2x2 HSDP mesh).

One rank runs the units in another order, skips one, or gathers one with another
``param_dtype`` or ``recompute``. In the default validation mode every rank raises a
``ValueError`` naming the first unit call where the ranks differ, and how, before the
gradient reaches the optimizer (at ``microbatches``' end, ``MainGrad.finish`` or the last
``reduce_grads(..., at="gradient")``): before, a different order returned gradients silently
wrong. Under ``fh.validation("strict")`` the ranks agree before each unit collective, so every
rank raises at the unit's first collective, with no crash (before, gloo aborted the rank whose
buffer was too small) and no wait. The module path (``fh.functional_call``) is checked alike.
"""

from __future__ import annotations

import functools
import time

import optree
import pytest
import torch
import torch.distributed as dist
from reference import dist_mesh

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD
from functional_hsdp.tools.testing import GlooPool

UNITS = 3


def _layer(p, x):
    return torch.tanh(x @ p["w"])


def _policy(dtype=torch.bfloat16):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(dtype, torch.float32, torch.float32)


def _setup(into: bool, mesh=None):
    spec = fh.hsdp(mesh or dist_mesh(timeout=6), "dp_outer", "dp_inner")
    gen = torch.Generator().manual_seed(0)
    full = [{"w": torch.randn(8, 8, generator=gen) / 3} for _ in range(UNITS)]
    shards = fh.shard(full, [spec] * UNITS)  # one unit per layer
    mg = fh.MainGrad([spec] * UNITS, like=shards) if into else None
    return spec, shards, mg


def _loss_fn(variant: str, spec, mg):
    """The model: units 0, 1, 2; rank 1 runs them as ``variant`` says."""
    odd = dist.get_rank() == 1
    plain = fh.gathered(_layer, spec, into=mg)
    policy = {"dtype": None, "fp16": _policy()}.get(variant)  # unit 1's, but on rank 1
    if odd and variant in ("dtype", "fp16"):
        policy = _policy(torch.float16 if variant == "fp16" else torch.bfloat16)
    other = fh.gathered(
        _layer, spec, into=mg, recompute=odd and variant == "recompute", mp_policy=policy
    )
    order = [0, 1] if variant == "no-last-2-units" else [0, 1, 2]
    if odd:
        order = {"order": [0, 2, 1], "skip": [0, 2], "skip-prefetch": [0, 2]}.get(variant, order)
    prefetch = variant.endswith("-prefetch")

    def loss(shards, x):
        for j, i in enumerate(order):
            block = other if i == 1 else plain
            if prefetch and j + 1 < len(order):  # the next unit's all-gather issued ahead
                block.prefetch(shards[order[j + 1]])
            x = block(shards[i], x)
        return x.square().sum()

    return loss


def _data(m: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * dist.get_rank() + m))


def _step(variant: str, mode: str, api: str, mesh=None):
    """Two microbatches and an SGD step; returns the gathered gradient (only if no rank
    raised before the step). ``mesh``: the DistMesh to use (default: a new one)."""
    spec, shards, mg = _setup(into=api != "reduce_grads", mesh=mesh)
    grad = torch.func.grad(_loss_fn(variant, spec, mg))
    start = time.monotonic()
    try:
        with fh.validation(mode):
            if api == "microbatches":
                for m, _ in fh.microbatches(2, into=mg):
                    grad(shards, _data(m))
                mg.finish()
                g = mg.grads
            elif api == "finish":
                for m in range(2):
                    grad(shards, _data(m))
                mg.finish()
                g = mg.grads
            elif api == "declared":  # rank 1 declares no last microbatch in "no-last*"
                odd = dist.get_rank() == 1 and variant.startswith("no-last")
                for m in range(2):
                    mg.begin_microbatch(last=m == 1 and not odd)
                    grad(shards, _data(m))
                mg.finish()
                g = mg.grads
            else:
                g = None
                for m in range(2):
                    g = fh.reduce_grads(
                        grad(shards, _data(m)), [spec] * UNITS, last=m == 1, at="gradient", acc=g
                    )
    except ValueError as exc:  # the class rides in the message (the pool reports ValueError)
        kind = "CollectiveError" if isinstance(exc, fh.CollectiveError) else "ValueError only"
        raise ValueError(f"{exc} [{kind}] [after {time.monotonic() - start:.1f} s]") from None
    for s, d in zip(shards, g):  # the optimizer step: reached only with a right gradient
        s["w"].sub_(0.1 * d["w"])
    return fh.gather(g, [spec] * UNITS)


def _expect(pool, variant, mode, api, *texts, task=None, kind="ValueError") -> list[str]:
    with pytest.raises(Exception) as info:
        if task is None:
            pool.run(_step, variant, mode, api, timeout=60)
        else:
            pool.run(task, mode, timeout=60)
    errors = getattr(info.value, "errors", None)
    assert errors is not None, info.value  # not a crash: every worker reported
    assert sorted(errors) == [0, 1, 2, 3], info.value
    messages = []
    for name, message, _ in errors.values():
        assert name == kind, message
        for text in texts:
            assert text in message, message
        messages.append(message)
    return messages


def test_healthy_steps_agree_in_every_mode(pool):
    """No false alarm: the same step in each mode gives the same gradient on every rank."""
    results = {mode: pool.run(_step, "none", mode, "microbatches") for mode in ("on", "strict")}
    results["off"] = pool.run(_step, "none", "off", "finish")
    results["reduce_grads"] = pool.run(_step, "none", "on", "reduce_grads")
    first = results["on"][0]
    for per_rank in results.values():
        for g in per_rank:
            for a, b in zip(g, first):
                torch.testing.assert_close(a["w"], b["w"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("api", ["microbatches", "finish", "reduce_grads"])
def test_another_order_on_one_rank_raises_before_the_step(pool, api):
    """Rank 1 runs units 0, 2, 1: the all-gathers match in size, so the gradients were silently
    wrong; now every rank raises where the step exchanges, naming the unit call and 'order'."""
    where = {"microbatches": "MainGrad.begin_microbatch", "finish": "MainGrad.finish"}
    where = where.get(api, "reduce_grads")  # microbatches: checked at the last's declaration
    first = "call #2" if api == "microbatches" else "call #1"  # after begin_microbatch there
    messages = _expect(pool, "order", "on", api, where, "(order)", first, "rank 1")
    assert "_layer on tree[1]" in messages[0] and "_layer on tree[2]" in messages[0], messages[0]


def test_another_recompute_on_one_rank_raises_before_the_step(pool):
    """Rank 1 recomputes unit 1: every rank raises at the step's check, naming the option."""
    _expect(
        pool, "recompute", "on", "finish", "(options: recompute)", "_layer on tree[1]", "rank 1"
    )


def test_another_param_dtype_of_the_same_size_on_one_rank_raises_before_the_step(pool):
    """Unit 1 all-gathered in bfloat16, but in float16 on rank 1: the collectives match in
    bytes, so the weights were silently reinterpreted; now every rank raises, naming 'dtype'."""
    _expect(pool, "fp16", "on", "microbatches", "(dtype: param_dtype)", "param_dtype=torch.float16")


@pytest.mark.parametrize(
    "variant, texts",
    [
        ("order", ["call differs", "all-gather of _layer on tree[2]", "rank 1"]),
        ("skip", ["call differs", "all-gather of _layer on tree[2]", "rank 1"]),
        ("dtype", ["options differs", "param_dtype=torch.bfloat16", "rank 1"]),
        ("recompute", ["options differs", "recompute=True", "rank 1"]),
    ],
)
def test_strict_raises_at_the_units_first_collective(pool, variant, texts):
    """validation('strict'): the ranks agree before each unit collective, so a skipped unit
    or another dtype (before: gloo aborted one rank, the others waited) is a
    CollectiveError (functional_hsdp.base.errors.UnitsDiffer, a ValueError too) on every rank, at
    the all-gather of unit 1, at once."""
    messages = _expect(
        pool,
        variant,
        "strict",
        "microbatches",
        "before its all-gather",
        "[CollectiveError]",
        *texts,
    )
    for message in messages:
        assert "gathered(_layer) on tree[1]" in message or "on tree[2]" in message, message
        assert float(message.rsplit("[after ", 1)[1].split(" s]")[0]) < 3, message


def test_a_last_microbatch_declared_otherwise_on_one_rank_raises_under_strict(pool):
    """Rank 1 declares no last microbatch (``begin_microbatch(last=False)``) where the others
    declare it, so its units' deferred reductions would be issued by ``finish`` and theirs in
    backward, mismatched. Under strict the ranks agree on every declaration: a UnitsDiffer
    on every rank at once, before any is issued (before: no check saw the declaration)."""
    texts = ["MainGrad.begin_microbatch, before its deferred reduction", "[CollectiveError]"]
    texts += ["last=False", "rank 1"]
    for message in _expect(pool, "no-last", "strict", "declared", *texts):
        assert float(message.rsplit("[after ", 1)[1].split(" s]")[0]) < 3, message


@pytest.mark.timeout(120)
def test_a_last_microbatch_declared_otherwise_on_one_rank_raises_in_the_default_mode():
    """The default mode agrees at ``begin_microbatch(last=True)``: the ranks that declare it
    wait there for rank 1, which does not, so nobody issues a deferred reduction and every
    rank raises a CollectiveError within the mesh's timeout. Two units, whose reductions
    stay within MainGrad's depth of two, so that no rank waits for one in backward (before:
    every rank reached ``finish`` and returned). A fresh pool: a timeout leaves its groups
    unusable."""
    with GlooPool(4, preload=(*DEFAULT_PRELOAD, "pytest")) as fresh:
        start = time.monotonic()
        messages = _expect(fresh, "no-last-2-units", "on", "declared", kind="CollectiveError")
        assert time.monotonic() - start < 30
    assert any("exchange over mesh axes" in m for m in messages), messages


def _not_zeroed(mode: str):
    """A finished step; rank 1 forgets zero_grad() before the next step's declarations."""
    spec, shards, mg = _setup(into=True)
    grad = torch.func.grad(_loss_fn("none", spec, mg))
    for m, _ in fh.microbatches(2, into=mg):
        grad(shards, _data(m))
    mg.finish()
    if dist.get_rank() != 1:
        mg.zero_grad()
    start = time.monotonic()
    try:
        with fh.validation(mode):
            mg.begin_microbatch(last=True)
    except ValueError as exc:
        raise ValueError(f"{exc} [after {time.monotonic() - start:.1f} s]") from None


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_a_rank_whose_begin_microbatch_check_fails_tells_the_others(pool, mode):
    """Rank 1's own check fails in begin_microbatch(last=True) (a finished step it did not
    zero): its error reaches every rank in the declaration's agreement, at once (before: the
    others waited in it until the timeout)."""
    messages = _expect(pool, None, mode, None, "call zero_grad()", task=_not_zeroed)
    for message in messages:
        assert float(message.rsplit("[after ", 1)[1].split(" s]")[0]) < 3, message


def test_strict_names_a_prefetched_unit_and_leaves_nothing(pool):
    """Rank 1 skips unit 1 with prefetch on: strict refuses the all-gather unit 0's forward
    issues ahead, naming the unit it is for and the block that issued it; the raise comes
    from inside the unit's forward, and the next step equals a clean one."""
    texts = ("(its all-gather issued ahead by gathered(_layer)), before its all-gather",)
    messages = _expect(pool, "skip-prefetch", "strict", "microbatches", *texts, "[CollectiveError]")
    named = sorted(m.split(" (its", 1)[0] for m in messages)  # each rank's prefetched unit
    assert named == ["the unit on tree[1]['w']"] * 3 + ["the unit on tree[2]['w']"], named
    want = pool.run(_step, "none", "on", "microbatches")
    for g, w in zip(pool.run(_after_a_strict_error, "skip-prefetch"), want):
        for a, b in zip(g, w):
            assert torch.equal(a["w"], b["w"])


def _module_step(mode: str) -> None:
    """fh.functional_call through an nn.Module; rank 1 asks for recompute=True."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    spec = fh.hsdp(dist_mesh(timeout=6), "dp_outer", "dp_inner")
    shards, tree_spec = fh.shard_module(model, spec, units=[model[0], model[2]])
    mg = fh.MainGrad(tree_spec, like=shards)
    recompute = dist.get_rank() == 1

    def loss(s, x):
        return fh.functional_call(model, s, (x,), into=mg, recompute=recompute).square().mean()

    with fh.validation(mode):
        for m, _ in fh.microbatches(2, into=mg):
            fh.grad(loss)(shards, _data(m)[:, :6])
        mg.finish()


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_the_module_path_with_another_recompute_on_one_rank_raises(pool, mode):
    """functional_call's units are checked alike: in the default mode at the last microbatch's
    declaration (``begin_microbatch(last=True)``),
    under strict at the first unit's all-gather."""
    where = "before its all-gather" if mode == "strict" else "(options: recompute)"
    kind = "UnitsDiffer" if mode == "strict" else "ValueError"  # strict: a CollectiveError too
    _expect(pool, None, mode, None, where, "recompute=True", "rank 1", task=_module_step, kind=kind)


def _after_a_strict_error(variant: str):
    """A step that strict mode stops at a unit's collective, then a healthy one."""
    with pytest.raises(ValueError, match="before its all-gather"):
        _step(variant, "strict", "microbatches")
    return _step("none", "on", "microbatches")


def _after_a_strict_error_on_one_mesh(variant: str):
    """As :func:`_after_a_strict_error`, both steps on one mesh, as a training loop has."""
    mesh = dist_mesh(timeout=6)
    with pytest.raises(ValueError, match="before its all-gather"):
        _step(variant, "strict", "microbatches", mesh)
    return _step("none", "on", "microbatches", mesh)


@pytest.mark.parametrize("variant", ["skip", "dtype"])
def test_a_strict_error_leaves_no_unit_calls_to_the_next_steps_check(pool, variant):
    """The unit calls the stopped step recorded (different on rank 1) are not compared by the
    next step's check: before, on the same mesh, the clean step after a strict error raised
    'the ranks ran their gathered units differently' on every rank."""
    want = pool.run(_step, "none", "on", "microbatches")
    got = pool.run(_after_a_strict_error_on_one_mesh, variant)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("variant", ["skip", "recompute"])
def test_the_next_step_after_a_strict_error_equals_a_clean_one(pool, variant):
    """Nothing of the stopped step (its chain, a prefetch, a reduce-scatter) is left to change
    the next one."""
    want = pool.run(_step, "none", "on", "microbatches")
    got = pool.run(_after_a_strict_error, variant)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a["w"], b["w"])


def _per_sample(variant: str, mode: str):
    """Per-sample gradients (vmap of grad: the units' composable path), summed over the
    samples and reduced; rank 1 runs the units as ``variant`` says."""
    spec, shards, _ = _setup(into=False)
    block = fh.gathered(_layer, spec)
    order = [0, 1, 2]
    if dist.get_rank() == 1:
        order = {"order": [0, 2, 1], "skip": [0, 2]}.get(variant, order)

    def loss(s, x):
        for i in order:
            x = block(s[i], x)
        return x.square().sum()

    start = time.monotonic()
    try:
        with fh.validation(mode):
            per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(shards, _data(0))
            g = optree.tree_map(lambda t: t.sum(0), per)
            g = fh.reduce_grads(g, [spec] * UNITS, last=True, at="gradient")
    except ValueError as exc:  # the class rides in the message (the pool reports ValueError)
        kind = "CollectiveError" if isinstance(exc, fh.CollectiveError) else "ValueError only"
        raise ValueError(f"{exc} [{kind}] [after {time.monotonic() - start:.1f} s]") from None
    return fh.gather(g, [spec] * UNITS)


def test_the_composable_path_agrees_in_every_mode(pool):
    """No false alarm under vmap: the same per-sample gradients in each mode."""
    want = pool.run(_per_sample, "none", "off")
    for mode in ("on", "strict"):
        for g, w in zip(pool.run(_per_sample, "none", mode), want):
            for a, b in zip(g, w):
                assert torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_another_order_under_vmap_raises(pool, mode):
    """Rank 1 runs units 0, 2, 1 under vmap(grad): before, the composable path took part in
    neither mode's checks and every rank returned per-sample gradients silently wrong. Now
    the default mode raises at the reduce_grads that finishes them, naming the order; strict
    at unit 1's all-gather."""
    texts = ["reduce_grads", "(order)", "[ValueError only]"]
    if mode == "strict":  # refused before it was issued: a CollectiveError too (UnitsDiffer)
        texts = ["before its all-gather", "[CollectiveError]"]
    task = functools.partial(_per_sample, "order")
    messages = _expect(pool, None, mode, None, "composable path", *texts, "rank 1", task=task)
    assert "on tree[1]" in messages[0] and "on tree[2]" in messages[0], messages[0]


def test_a_unit_skipped_under_vmap_raises_at_once_under_strict(pool):
    """Under strict, a unit skipped on one rank under vmap is refused on every rank at its
    all-gather (functional_hsdp.base.errors.UnitsDiffer: a CollectiveError and a ValueError), at
    once (before:
    gloo's CollectiveError after the timeout, or an abort)."""
    task = functools.partial(_per_sample, "skip")
    texts = ("before its all-gather", "[CollectiveError]")
    for message in _expect(pool, None, "strict", None, *texts, task=task):
        assert float(message.rsplit("[after ", 1)[1].split(" s]")[0]) < 3, message
