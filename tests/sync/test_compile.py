"""``reduce_grads`` under ``torch.compile(fullgraph=True)``: traced, and equal to eager.

On 4 real gloo processes (2x2 DistMesh: the traced program uses the functional collectives)
and on a SimMesh; hsdp, hfsdp and the owner specs (``fh.owned``, owner-major and on dp_outer,
its uneven all-to-all). Both ``last`` values; ``acc`` None, an eager result, a compiled result; a
spec tree; a second tree shape (a guarded recompile). ``fullgraph=True`` fails on any graph
break, and a counting backend checks how many graphs were compiled. And what the README says a
compiled call does not do: tag its results, log collectives, run the cross-rank agreement, or
trace ``check_finite=True``.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
from reference import AXES, dist_preset, preset, random_tree

import functional_hsdp as fh

SHAPES = {"w": (37, 5), "n": [(7,), {"s": (3, 2)}]}
OTHER = {"w": (11, 5), "n": [(9,), {"s": (3, 2)}]}


def _compiled(spec, backend: str):
    graphs = []
    inner = torch._dynamo.lookup_backend(backend)

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return inner(gm, example_inputs)

    fns = {
        last: (lambda g, acc, last=last: fh.reduce_grads(g, spec, last=last, acc=acc))
        for last in (False, True)
    }
    return (
        fns,
        {k: torch.compile(f, fullgraph=True, backend=counting) for k, f in fns.items()},
        graphs,
    )


def _same(x, y) -> bool:
    xs, ys = optree.tree_leaves(x), optree.tree_leaves(y)
    return optree.tree_structure(x) == optree.tree_structure(y) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(xs, ys)
    )


def check_compiled_matches_eager(spec, batch, seed: int, backend: str) -> dict:
    """Compiled vs eager, bit for bit, over the cases of this module's docstring."""
    torch._dynamo.reset()
    eager, compiled, graphs = _compiled(spec, backend)
    g1, g2 = (random_tree(batch, shapes=SHAPES, seed=seed + k) for k in (0, 1))
    before = optree.tree_map(torch.clone, (g1, g2))
    eager_acc = eager[False](g1, None)
    compiled_acc = compiled[False](g1, None)
    out = {"acc": _same(eager_acc, compiled_acc)}
    for last in (False, True):
        want = eager[last](g2, eager_acc)
        out[f"last={last}, eager acc"] = _same(want, compiled[last](g2, eager_acc))
        out[f"last={last}, compiled acc"] = _same(want, compiled[last](g2, compiled_acc))
    out["final of None"] = _same(eager[True](g1, None), compiled[True](g1, None))
    out["inputs kept"] = _same((g1, g2), before)
    n = len(graphs)  # one graph per (function, acc None or not)
    h1, h2 = (random_tree(batch, shapes=OTHER, seed=seed + k) for k in (2, 3))
    acc = eager[False](h1, None)
    out["other shapes"] = _same(eager[True](h2, acc), compiled[True](h2, acc))
    out["graphs"] = (n, len(graphs) - n)
    return out


def _owned(strategy: str, spec: fh.Spec) -> fh.Spec:
    """``owned`` (Owner on every axis, owner-major), ``owned_outer`` (on dp_outer only:
    SHAPES' uneven leaves make its outer moves all-to-alls with uneven blocks), or ``spec``."""
    if strategy == "owned":
        return fh.owned(spec)
    if strategy == "owned_outer":
        return fh.owned(spec, "dp_outer")
    return spec


def _on_rank(strategy: str, backend: str) -> dict:
    spec = _owned(strategy, dist_preset("hsdp" if strategy.startswith("owned") else strategy))
    return check_compiled_matches_eager(spec, (), 10 * dist.get_rank(), backend)


# inductor (what users run) once; aot_eager (dynamo + functionalization, no code generation)
# for the rest, which keeps this module to about a minute on a 2-core machine.
@pytest.mark.parametrize(
    "strategy,backend",
    [("hsdp", "inductor"), ("hfsdp", "aot_eager"), ("owned_outer", "aot_eager")],
)
def test_compiled_reduce_grads_matches_eager_on_gloo(pool, strategy, backend):
    for result in pool.run(_on_rank, strategy, backend):
        graphs = result.pop("graphs")
        assert all(result.values()), result
        assert graphs == (4, 1), graphs  # last=False/True x acc None/not; 1 recompile


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_reduce_grads_matches_eager_on_sim_mesh(strategy):
    spec = preset(strategy, fh.SimMesh(dict(zip(AXES, (2, 2)))))
    result = check_compiled_matches_eager(spec, (2, 2), 0, "aot_eager")
    result.pop("graphs")
    assert all(result.values()), result


@pytest.mark.parametrize("strategy", ["owned", "owned_outer"])
def test_owner_specs_compile_on_a_sim_mesh(strategy):
    # owned_outer's uneven all-to-all reads its counts as Python ints in the trace
    spec = _owned(strategy, preset("hsdp", fh.SimMesh(dict(zip(AXES, (2, 2))))))
    with fh.comm_log() as log:
        fh.reduce_grads(random_tree((2, 2), shapes=SHAPES, seed=0), spec, last=True)
    ops = {e.op for e in log.events if e.axis == "dp_outer"}
    assert ops == ({"all_to_all"} if strategy == "owned_outer" else {"reduce_scatter"}), ops
    result = check_compiled_matches_eager(spec, (2, 2), 0, "aot_eager")
    result.pop("graphs")
    assert all(result.values()), result


def test_a_spec_tree_compiles():
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = {"w": fh.hsdp(mesh, *AXES), "n": fh.ddp(mesh)}
    result = check_compiled_matches_eager(spec, (2, 2), 0, "aot_eager")
    result.pop("graphs")
    assert all(result.values()), result


@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_a_compiled_call_first_needs_no_eager_call_before_it(strategy):
    # everything the trace reads is computed outside it, even for a tree never seen eagerly
    spec = preset(strategy, fh.SimMesh(dict(zip(AXES, (2, 2)))))
    torch._dynamo.reset()
    shapes = {"first": (6, 3), "seen": [(5,)]}
    g = random_tree((2, 2), shapes=shapes, seed=5)
    f = torch.compile(lambda g: fh.reduce_grads(g, spec, last=True), fullgraph=True)
    got = f(g)
    assert _same(got, fh.reduce_grads(g, spec, last=True))


def test_compiled_results_are_untagged_unlogged_and_not_agreed_on():
    """README "torch.compile": a compiled call records nothing in comm_log and runs no
    cross-rank agreement; its results carry no state tag, so an acc from one is checked by
    structure, dtype and shape only (an eager final result given as acc is refused by its tag,
    a compiled one is read by value); check_finite=True cannot be traced."""
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = fh.ddp(mesh)  # final and accumulating results have the same local shapes
    exchanges = []
    start_exchange = mesh.diagnostics.start_exchange

    def spy(row):  # the agreement's one exchange per call (the mesh's Diagnostics protocol)
        exchanges.append(row)
        return start_exchange(row)

    mesh.diagnostics.start_exchange = spy
    torch._dynamo.reset()
    g = random_tree((2, 2), shapes=SHAPES, seed=0)
    final = torch.compile(
        lambda g: fh.reduce_grads(g, spec, last=True), fullgraph=True, backend="aot_eager"
    )
    with fh.comm_log() as eager_log:
        eager = fh.reduce_grads(g, spec, last=True)
    assert eager_log.events and len(exchanges) == 1  # eager: both, so the spies see them
    with fh.comm_log() as log:
        compiled = [final(g), final(g)]  # traced, then the compiled graph
    assert log.events == [] and len(exchanges) == 1
    assert all(_same(eager, c) for c in compiled)
    with pytest.raises(ValueError, match=r"acc\['n'\]\[0\]: is a finalized result"):
        fh.reduce_grads(g, spec, last=False, acc=eager)
    fresh = fh.reduce_grads(g, spec, last=False, acc=optree.tree_map(torch.clone, eager))
    assert _same(fh.reduce_grads(g, spec, last=False, acc=compiled[0]), fresh)
    with pytest.raises(TypeError, match="expected dtype torch.float32"):
        fh.reduce_grads(g, spec, last=False, acc=optree.tree_map(torch.Tensor.double, compiled[0]))
    cut = optree.tree_map(lambda t: t[..., :1], compiled[0])
    with pytest.raises(ValueError, match="expected local shape"):
        fh.reduce_grads(g, spec, last=False, acc=cut)
    checked = torch.compile(
        lambda g: fh.reduce_grads(g, spec, last=True, check_finite=True),
        fullgraph=True,
        backend="aot_eager",
    )
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="disable"):
        checked(g)


def test_check_finite_runs_eagerly_at_a_graph_break():
    """check_finite=True inside a compiled function (no fullgraph) runs eagerly, at a graph
    break: eager's results, and a NaN raises naming its leaf (before, dynamo resumed after
    the check's data-dependent break and failed inside its own pytree code)."""
    mesh = fh.SimMesh(dict(zip(AXES, (2, 2))))
    spec = fh.hsdp(mesh, *AXES)
    torch._dynamo.reset()
    g = random_tree((2, 2), shapes=SHAPES, seed=3)

    def step(g):
        out = fh.reduce_grads(g, spec, last=True, check_finite=True)
        return optree.tree_map(lambda t: t * 2, out)

    compiled = torch.compile(step, backend="aot_eager")
    assert _same(compiled(g), step(g))
    bad = optree.tree_map(torch.clone, g)
    first = optree.tree_leaves(bad)[0]
    first.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        compiled(bad)


# -- a whole training step under torch.compile ----------------------------------------------


def _whole_step(spec, batch, steps: int = 2, compiled: bool = False):
    """gather + grad + reduce_grads + SGD in one compiled function (aot_eager: traced, no
    code generation, so equal to eager bit for bit): gather (like shard, sync_params, MainGrad
    and gathered units) runs eagerly at a clean graph break; the rest is traced. Returns the
    parameters after ``steps`` steps."""
    torch._dynamo.reset()
    full = {"w": torch.linspace(-1, 1, 20).reshape(5, 4), "b": torch.linspace(0, 1, 4)}

    def loss(p, x):
        return torch.tanh(x @ p["w"] + p["b"]).square().sum()

    per_rank = fh.per_rank(torch.func.grad(loss), spec.mesh)

    def step(params, xs):
        weights = fh.gather(params, spec)
        acc = None
        for m, x in enumerate(xs):
            acc = fh.reduce_grads(per_rank(weights, x), spec, last=m == len(xs) - 1, acc=acc)
        return optree.tree_map(lambda p, g: p - 0.1 * g, params, acc)

    run = torch.compile(step, backend="aot_eager") if compiled else step
    params = fh.shard(full, spec)
    gen = torch.Generator().manual_seed(dist.get_rank() if not batch else 0)
    for _ in range(steps):
        params = run(params, [torch.randn(*batch, 3, 5, generator=gen) for _ in range(2)])
    return optree.tree_map(torch.clone, params)


@pytest.mark.parametrize("strategy", ["hfsdp"])
def test_a_whole_step_compiles_and_equals_eager_on_a_simmesh(strategy):
    spec = preset(strategy, fh.SimMesh(dict(zip(AXES, (2, 2)))))
    assert _same(_whole_step(spec, (2, 2)), _whole_step(spec, (2, 2), compiled=True))


def _whole_step_on_rank(strategy: str):
    spec = dist_preset(strategy)
    return _same(_whole_step(spec, ()), _whole_step(spec, (), compiled=True))


def test_a_whole_step_compiles_and_equals_eager_on_gloo(pool):
    assert pool.run(_whole_step_on_rank, "hsdp", timeout=240) == [True] * 4


def test_fullgraph_over_gather_is_a_clear_error_not_a_type_error():
    spec = preset("hsdp", fh.SimMesh(dict(zip(AXES, (2, 2)))))
    params = fh.shard({"w": torch.ones(5, 4)}, spec)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        torch.compile(lambda p: fh.gather(p, spec), fullgraph=True)(params)
