"""Each call's ``into=`` (and ``recompute=``, ``reshard_after_forward=``) on a SimMesh: blocks
made with different ``into=`` alternate freely on one model, and every sequence of issue 36
gives what the same step, or the same probe without ``into=``, gives made clean
(tests/into_problem.py): a probe before the first step or between two steps, a new MainGrad,
two MainGrads in one step, an eval forward between steps, options that change every call.
The module path (``fh.functional_call``) is tested on gloo ranks (tests/test_into_gloo.py)."""

from __future__ import annotations

import pytest
from into_problem import SEQUENCES, blocks_model, run

import functional_hsdp as fh

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
