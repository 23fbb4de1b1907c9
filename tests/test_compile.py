"""``reduce_grads`` under ``torch.compile(fullgraph=True)``: traced, and equal to eager.

On 4 real gloo processes (2x2 DistMesh: the traced program uses the functional collectives)
and on a SimMesh. Both ``last`` values; ``acc`` None, an eager result, a compiled result; a
spec tree; a second tree shape (a guarded recompile). ``fullgraph=True`` fails on any graph
break, and a counting backend checks how many graphs were compiled.
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


def _on_rank(strategy: str, backend: str) -> dict:
    spec = dist_preset(strategy)
    return check_compiled_matches_eager(spec, (), 10 * dist.get_rank(), backend)


# inductor (what users run) once; aot_eager (dynamo + functionalization, no code generation)
# for the rest, which keeps this module to about a minute on a 2-core machine.
@pytest.mark.parametrize("strategy,backend", [("hsdp", "inductor"), ("hfsdp", "aot_eager")])
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
