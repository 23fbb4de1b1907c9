"""Each call's ``into=`` (and ``recompute=``, ``reshard_after_forward=``) on a SimMesh: blocks
made with different ``into=`` alternate freely on one model, and every sequence of issue 36
gives what the same step, or the same probe without ``into=``, gives made clean
(functional_hsdp/tools/testing/into_problem.py, which tests/units/hostile.py runs too): a probe
before the first step or between two steps, a new MainGrad, two MainGrads in one step, an eval
forward between steps, options that change every call.
The module path (``fh.functional_call``) is tested on gloo ranks (tests/units/test_into_gloo.py)."""

from __future__ import annotations

import pytest
import torch

import functional_hsdp as fh
from functional_hsdp.tools.testing.into_problem import SEQUENCES, blocks_model, run

MODELS = {  # (tied, whole model one unit)
    "untied": (False, False),
    "tied": (True, False),
    "whole": (False, True),
}


def _spec() -> fh.Spec:
    return fh.hsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}), "dp_outer", "dp_inner")


@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("sequence", SEQUENCES)
def test_blocks_with_other_options_alternate_exactly(sequence, model, recompute):
    spec = _spec()
    tied, whole = MODELS[model]
    checks = run(
        sequence,
        lambda: blocks_model(spec, tied, whole),
        spec.mesh,
        grad="fh.grad",
        recompute=recompute,
    )
    assert max(checks.values()) <= 1e-6, checks


@pytest.mark.parametrize("sequence", ["probe_between_steps", "new_maingrad"])
def test_under_torch_func_grad_too(sequence):
    spec = _spec()
    checks = run(
        sequence,
        lambda: blocks_model(spec, True),
        spec.mesh,
        grad="torch.func.grad",
        recompute=False,
    )
    assert max(checks.values()) <= 1e-6, checks


def test_a_backward_into_a_finished_step_names_the_maingrad_and_the_call():
    from functional_hsdp.tools.testing.into_problem import mesh_batches, step

    spec = _spec()
    model = blocks_model(spec, tied=False)
    mg = fh.MainGrad(model.tree_spec, like=model.shards)  # the error points here
    made_line = test_a_backward_into_a_finished_step_names_the_maingrad_and_the_call
    step(model.loss(mg), model.shards, mg, mesh=spec.mesh)
    with pytest.raises(ValueError) as info:  # no zero_grad(): the step is still finished
        fh.grad(model.loss(mg))(model.shards, mesh_batches(spec.mesh)[0])
    text = str(info.value)
    line = made_line.__code__.co_firstlineno + 5
    assert f"test_into.py:{line}" in text, text
    assert "MainGrad(" in text and "whose step is finished" in text, text
    assert "the unit _head on tree['head']" in text, text  # the call: its unit and shards
    mg.zero_grad()  # and the MainGrad is usable again: a clean step
    got = step(model.loss(mg), model.shards, mg, mesh=spec.mesh)
    fresh = blocks_model(spec, tied=False)
    fresh_mg = fresh.maingrad()
    want = step(fresh.loss(fresh_mg), fresh.shards, fresh_mg, mesh=spec.mesh)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
