"""Backward as autograd runs it on a GPU: on its device thread, which sees none of the caller's
ContextVars or thread-locals. Every library ``autograd.Function``'s backward is run in a fresh
``contextvars.Context()`` with fresh thread-local state (``reference.on_device_threads``), and
what it computes must equal the same run on the caller's thread; a static check pins that no
ContextVar or thread-local read is reachable from a backward, a vmap rule or a jvp rule.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import optree
import pytest
import torch
from reference import STRATEGIES, on_device_threads, preset
from transform_problem import Problem

import functional_hsdp as fh

PACKAGE = Path(fh.__file__).resolve().parent


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def _examples(pb: Problem, n: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(n, *pb.mesh.batch_shape, 1, pb.full[0]["w"].shape[0], generator=gen)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_example_grad_norms_on_a_device_thread(strategy):
    """DP-SGD's norms pass: the units' backward takes the norms from the move made in forward
    (before: it read a ContextVar there, found none on the device thread, reduce-scattered
    the per-example gradients and raised)."""
    pb = Problem(preset(strategy, fh.SimMesh({"dp_outer": 2, "dp_inner": 2})))
    xs = _examples(pb)
    want = fh.per_example_grad_norms(pb.loss, pb.params, xs)
    with on_device_threads() as ran, fh.comm_log() as log:
        got = fh.per_example_grad_norms(pb.loss, pb.params, xs)
    assert "_Moved" in ran
    assert not [e for e in log.events if e.op == "reduce_scatter"]
    assert torch.equal(got, want)


class _Counting:
    """A mesh's diagnostics, counting the cross-rank exchanges made through it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name in ("describe", "members"):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("op", ["psum", "pmean"])
def test_validation_off_holds_in_a_backward_on_a_device_thread(op):
    """``validation("off")`` is taken when psum/pmean run forward: their backward (another
    psum/pmean) exchanges nothing either, on whichever thread it runs."""
    mesh = fh.SimMesh({"dp": 2})
    counting = mesh.diagnostics = _Counting(mesh.diagnostics)
    fn = getattr(fh, op)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with fh.validation("off"), on_device_threads() as ran:
        g = torch.func.grad(lambda x: fn(x, "dp", mesh).square().sum())(x)
    assert "_SelfAdjoint" in ran
    assert counting.calls == []
    want = torch.func.grad(lambda x: fn(x, "dp", mesh).square().sum())(x)
    assert torch.equal(g, want)
    assert counting.calls  # validation on: the exchanges are made (the counter counts)


def _unit_run(spec, recompute: bool, api: str) -> list:
    """Two microbatches through gathered units into a MainGrad, under ``api``."""
    pb = Problem(spec)
    mg = fh.MainGrad(pb.tree_spec, like=pb.full)
    block = fh.gathered(fh.per_rank(_layer, pb.mesh), spec, into=mg, recompute=recompute)
    loss = lambda s, x: fh.sequence(block, s, x).square().sum()  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(2, *pb.mesh.batch_shape, 3, pb.full[0]["w"].shape[0], generator=gen)
    for x, _last in fh.microbatches(list(xs), into=mg):
        if api == "torch.func.grad":
            torch.func.grad(loss)(pb.params, x)
        elif api == "fh.grad":
            fh.grad(loss)(pb.params, x)
        else:  # plain autograd on the shards themselves (the MainGrad knows them)
            for t in optree.tree_leaves(pb.params):
                t.requires_grad_(True)
            loss(pb.params, x).backward()
            for t in optree.tree_leaves(pb.params):
                t.requires_grad_(False)
                t.grad = None
    mg.finish()
    return optree.tree_map(torch.clone, mg.grads)


def _layer(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


@pytest.mark.parametrize("api", ["torch.func.grad", "fh.grad", "backward"])
@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_units_and_maingrad_on_a_device_thread(strategy, recompute, api):
    spec = preset(strategy, fh.SimMesh({"dp_outer": 2, "dp_inner": 2}))
    want = _unit_run(spec, recompute, api)
    with on_device_threads() as ran:
        got = _unit_run(spec, recompute, api)
    assert {"_Unit", "_Wait"} <= set(ran)
    assert _equal(got, want)


# -- on 4 gloo ranks: functional_call through an nn.Module -------------------------------------


def _module_task(fresh: bool) -> dict:
    from reference import dist_preset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    spec = dist_preset("hsdp")
    shards, tree_spec = fh.shard_module(model, spec, units=[model[0], model[2]])
    mg = fh.MainGrad(tree_spec, like=shards)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    batches = list(torch.randn(2, 4, 6, generator=gen))

    def loss(s, x):
        return fh.functional_call(model, s, (x,), into=mg).square().mean()

    with on_device_threads() if fresh else contextlib.nullcontext([]) as ran:
        for x, _last in fh.microbatches(batches, into=mg):
            fh.grad(loss)(shards, x)
        mg.finish()
    return {"grads": optree.tree_map(torch.clone, mg.grads), "ran": sorted(set(ran))}


def test_functional_call_on_a_device_thread(pool):
    want = pool.run(_module_task, False)
    got = pool.run(_module_task, True)
    for g, w in zip(got, want):
        assert {"_Unit", "_Wait"} <= set(g["ran"])
        assert _equal(g["grads"], w["grads"])


# -- static: nothing a backward reaches reads a ContextVar or a thread-local --------------------

RULES = ("backward", "jvp", "vmap")


def _modules() -> dict[str, ast.Module]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): ast.parse(p.read_text())
        for p in PACKAGE.rglob("*.py")
    }


def _thread_state(tree: ast.Module) -> set[str]:
    """Module globals that hold per-thread or per-context state: ContextVars and instances
    of ``threading.local`` subclasses."""
    locals_ = {
        c.name
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        and any(ast.unparse(b) in ("threading.local", "local") for b in c.bases)
    }
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Call):
            continue
        made = ast.unparse(value.func)
        if made.endswith("ContextVar") or made in locals_ or made.endswith("threading.local"):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


class _Index:
    """The package's functions, and a call resolved to those it may run: ``f(...)`` to this
    module's ``f`` or the one it imports, ``module.f(...)`` to that module's, ``Cls.apply`` to
    the Function's forward, ``Cls.m``/``self.m`` to this module's methods named ``m``, and any
    other ``x.m(...)`` to every method of the package named ``m`` (an over-approximation)."""

    def __init__(self, modules: dict[str, ast.Module]):
        self.top: dict[tuple[str, str], list] = {}  # (module, name) -> [function nodes]
        self.methods: dict[str, list] = {}  # method name -> [(module, node)]
        self.imports: dict[tuple[str, str], tuple[str, str | None]] = {}
        for mod, tree in modules.items():
            self._index(mod, tree)

    def _index(self, mod: str, tree: ast.Module) -> None:
        package = mod.rsplit(".", 1)[0] if "." in mod else mod
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.top.setdefault((mod, node.name), []).append(node)
            elif isinstance(node, ast.ClassDef):
                body = [f for f in node.body if isinstance(f, ast.FunctionDef)]
                self.top[(mod, node.name)] = [f for f in body if f.name in ("forward", "__init__")]
                for f in body:
                    self.top.setdefault((mod, f"{node.name}.{f.name}"), []).append(f)
                    self.methods.setdefault(f.name, []).append((mod, f))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
                for a in node.names:
                    self.imports[(mod, a.asname or a.name)] = (source, a.name)

    def _module_alias(self, mod: str, name: str) -> str | None:
        source, attr = self.imports.get((mod, name), (None, None))
        if source is None:
            return None
        full = f"{source}.{attr}"
        return full if any(m == full for m, _ in self.top) else None

    def resolve(self, mod: str, call: ast.expr) -> list:
        if isinstance(call, ast.Name):
            if (mod, call.id) in self.top:
                return self.top[(mod, call.id)]
            source, attr = self.imports.get((mod, call.id), (None, None))
            return self.top.get((source, attr), []) if source else []
        if not isinstance(call, ast.Attribute):
            return []
        owner = call.value.id if isinstance(call.value, ast.Name) else None
        if owner is not None and (target := self._module_alias(mod, owner)):
            return self.top.get((target, call.attr), [])
        if owner is not None and (mod, owner) in self.top and call.attr == "apply":
            return self.top.get((mod, f"{owner}.forward"), [])
        if owner in ("self", "cls") or (mod, owner) in self.top:
            return [f for m, f in self.methods.get(call.attr, []) if m == mod]
        return [f for _, f in self.methods.get(call.attr, [])]


def _calls(node: ast.AST) -> list[ast.expr]:
    """What a function calls (``f(...)``, ``x.f(...)``) or hands on by name (``g(f)``);
    nested functions are walked as part of it."""
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            out.append(sub.func)
            out += [a for a in sub.args if isinstance(a, ast.Name)]
    return out


def _reads(node: ast.AST, state: set[str]) -> set[str]:
    return {
        sub.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and sub.id in state and isinstance(sub.ctx, ast.Load)
    }


def _rules(modules) -> list[tuple[str, str, ast.AST]]:
    """Every backward / jvp / vmap of an ``autograd.Function`` of the package."""
    found = []
    for mod, tree in modules.items():
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and any(
                "Function" in ast.unparse(b) for b in cls.bases
            ):
                found += [
                    (mod, f"{mod}.{cls.name}.{f.name}", f)
                    for f in cls.body
                    if isinstance(f, ast.FunctionDef) and f.name in RULES
                ]
    return found


def _reachable_reads(modules) -> dict[str, set[str]]:
    state = set().union(*map(_thread_state, modules.values()))
    index = _Index(modules)
    owner = {id(f): mod for mod, tree in modules.items() for f in ast.walk(tree)}
    found = {}
    for _, name, rule in _rules(modules):
        seen, todo, reads = set(), [rule], set()
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            reads |= _reads(node, state)
            todo += [f for c in _calls(node) for f in index.resolve(owner[id(node)], c)]
        if reads:
            found[name] = reads
    return found


def test_no_contextvar_or_thread_local_read_is_reachable_from_a_backward():
    modules = _modules()
    state = set().union(*map(_thread_state, modules.values()))
    assert {"_NORMS", "_MODE", "_FORWARD"} <= state  # the check sees what it must
    assert len(_rules(modules)) >= 8
    assert _reachable_reads(modules) == {}


def test_the_static_check_finds_a_read_in_a_backward():
    """The check can fail: a backward that reads a ContextVar is reported."""
    modules = {
        "m": ast.parse(
            "import contextvars, torch\n"
            "_V = contextvars.ContextVar('v')\n"
            "def helper():\n    return _V.get()\n"
            "class F(torch.autograd.Function):\n"
            "    @staticmethod\n    def backward(ctx, g):\n        return helper()\n"
        )
    }
    assert _reachable_reads(modules) == {"m.F.backward": {"_V"}}
