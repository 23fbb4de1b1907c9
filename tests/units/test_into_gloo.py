"""Each call's ``into=`` (and ``recompute=``, ``reshard_after_forward=``) on 4 gloo ranks (2x2
hsdp): through ``fh.functional_call`` on an ``nn.Module`` (an ``nn.Embedding`` root, a head
tied to it or not, or every parameter in a unit) and through ``fh.gathered`` blocks made
with different ``into=``, every sequence of issue 36 gives what the same step, or the same
probe without ``into=``, gives made clean (functional_hsdp/tools/testing/into_problem.py, which
tests/units/hostile.py runs too), on every rank."""

from __future__ import annotations

import pytest

from functional_hsdp.tools.testing.into_problem import SEQUENCES

KINDS = ("module-untied", "module-tied", "module-units", "blocks-untied", "blocks-tied")


def _sequences_task(kind: str, recompute: bool, grad: str) -> dict:
    """On each rank: every sequence on a fresh model of ``kind``; ``{sequence: checks}``, or
    the error a sequence raised."""
    from reference import AXES, dist_mesh

    import functional_hsdp as fh
    from functional_hsdp.tools.testing.into_problem import blocks_model, module_model, run

    spec = fh.hsdp(dist_mesh(), *AXES)
    how, tied = kind.split("-")
    if how == "module":
        make = lambda: module_model(spec, tied == "tied", root=tied != "units")  # noqa: E731
    else:
        make = lambda: blocks_model(spec, tied == "tied")  # noqa: E731
    out = {}
    for sequence in SEQUENCES:
        try:
            out[sequence] = run(sequence, make, spec.mesh, grad=grad, recompute=recompute)
        except Exception as e:  # noqa: BLE001 - reported per sequence
            out[sequence] = f"{type(e).__name__}: {e}"
    fh.clear_caches()
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_sequence_is_exact_on_every_rank(pool, kind, recompute):
    for rank, results in enumerate(pool.run(_sequences_task, kind, recompute, "fh.grad")):
        for sequence, checks in results.items():
            assert isinstance(checks, dict), (rank, sequence, checks)
            assert max(checks.values()) <= 1e-6, (rank, sequence, checks)


def test_under_torch_func_grad_too(pool):
    for rank, results in enumerate(
        pool.run(_sequences_task, "module-tied", False, "torch.func.grad")
    ):
        for sequence, checks in results.items():
            assert isinstance(checks, dict), (rank, sequence, checks)
            assert max(checks.values()) <= 1e-6, (rank, sequence, checks)


def _finished_task() -> dict:
    """A step into ``mg`` through ``fh.functional_call``, then a backward into ``mg`` again
    without ``zero_grad()``: the error; then ``zero_grad()`` and a step, against a clean one."""
    import torch
    from reference import AXES, dist_mesh

    import functional_hsdp as fh
    from functional_hsdp.tools.testing.into_problem import mesh_batches, module_model, step

    spec = fh.hsdp(dist_mesh(), *AXES)
    model = module_model(spec, tied=False)
    mg = model.maingrad()  # the error points here (into_problem is the package's: skipped)
    step(model.loss(mg), model.shards, mg, mesh=spec.mesh)
    try:
        fh.grad(model.loss(mg))(model.shards, mesh_batches(spec.mesh)[0])
        text = "no error"
    except ValueError as e:
        text = str(e)
    mg.zero_grad()
    got = step(model.loss(mg), model.shards, mg, mesh=spec.mesh)
    fresh = module_model(spec, tied=False)
    fresh_mg = fresh.maingrad()
    want = step(fresh.loss(fresh_mg), fresh.shards, fresh_mg, mesh=spec.mesh)
    fh.clear_caches()
    made = f"test_into_gloo.py:{_finished_task.__code__.co_firstlineno + 11}"
    return {
        "error": text,
        "made": made,
        "then exact": all(torch.equal(a, b) for a, b in zip(got, want)),
    }


def test_a_backward_into_a_finished_step_names_the_maingrad_and_the_call(pool):
    for out in pool.run(_finished_task):
        assert "whose step is finished" in out["error"], out
        assert "made at " in out["error"] and out["made"] in out["error"], out
        assert "the backward of the unit " in out["error"], out
        assert out["then exact"], out
