"""The package's code keeps a readable shape, checked on its source (nothing imported or run):

- no function is longer than ``MAX_LINES`` lines of code, its docstring not counted (a public
  function's docstring, with its arguments and examples, is as long as it needs to be);
- no call to a function or class of the package passes more than ``MAX_POSITIONAL``
  positional arguments, or ``True`` / ``False`` positionally: what an argument means is
  written at the call (the definitions make such arguments keyword-only);
- no module imports a private name (a leading underscore) of another module of the package,
  or reads one as ``module._name``: what a room offers another has a public name;
- the package's modules import each other without a cycle, imports inside functions and
  under ``if TYPE_CHECKING:`` counted (importing ``a.b.c`` runs the packages ``a.b`` too, so
  an import reaches them);
- each module sits in a layer of ``functional_hsdp/layers.py`` (a package named there) or is
  one of the :data:`TOP` modules directly in the package, and a layer's module imports only
  from its own layer or one below it;
- no module reads a private attribute of an object of another module's class (``obj._x``,
  ``_x`` defined by a class of another module): :func:`reach_ins` says how that is told
  from torch's or Python's own private attributes;
- the checkpoint room (``functional_hsdp.io``) names no stateful type of another room
  (:func:`is_state_type`): each says how it is saved where it is defined.

Calls into torch, optree, einops or the standard library are not checked, only those that
resolve to a definition in the package (:class:`_Index` says how).
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository root
PACKAGE = ROOT / "functional_hsdp"
FILES = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
MAX_LINES = 45
MAX_POSITIONAL = 3

# Method names that tensors and the builtin containers have too: ``x.add(True)`` on a receiver
# of unknown type is taken for theirs, not for a package method of the same name.
_FOREIGN = {
    name
    for kind in (list, dict, set, tuple, str, bytes, collections.deque, torch.Tensor)
    for name in dir(kind)
}


def _module_name(path: str) -> tuple[str, bool]:
    """``a/b/c.py`` -> (``a.b.c``, False); ``a/b/__init__.py`` -> (``a.b``, True)."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _nested_functions(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Functions defined inside other functions, by name."""
    found: dict[str, list[ast.AST]] = {}
    for outer in ast.walk(tree):
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(outer):
                if node is not outer and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.setdefault(node.name, []).append(node)
    return found


class _Index:
    """The package's definitions, and a call resolved to those it runs.

    ``f(...)`` resolves to this module's ``f`` (top level or nested) or the one it imports
    from the package; ``cls(...)`` in a class to the class; ``module.f(...)`` and
    ``Cls.f(...)`` to that module's ``f`` and that class's method (its package bases
    searched); ``self.m(...)`` and ``super().m(...)`` to the enclosing class's method;
    ``a if c else b`` to both. Any other receiver (``x.m(...)``, ``x`` a local value) is taken
    for a package object when ``m`` is a method of a package class and no method of a tensor
    or builtin container; a receiver imported from outside the package never is.
    """

    def __init__(self, sources: dict[str, str]):
        self.modules: dict[str, tuple[str, ast.Module, bool]] = {}
        self.defs: dict[tuple[str, str], ast.AST] = {}  # (module, name) -> def or class
        self.nested: dict[str, dict[str, list[ast.AST]]] = {}
        self.imports: dict[tuple[str, str], tuple[str, str | None]] = {}
        self.foreign: set[tuple[str, str]] = set()  # (module, name) imported from outside
        self.methods: dict[str, list[tuple[str, ast.AST]]] = {}
        self.root = next(iter(sources)).split("/")[0]
        for path, text in sources.items():
            mod, is_package = _module_name(path)
            tree = ast.parse(text)
            self.modules[mod] = (path, tree, is_package)
            self._index(mod, tree, is_package)

    def _index(self, mod: str, tree: ast.Module, is_package: bool) -> None:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[(mod, node.name)] = node
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.methods.setdefault(f.name, []).append((mod, f))
        self.nested[mod] = _nested_functions(tree)
        here = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                for a in node.names:
                    self._bind(mod, a.asname or a.name, source, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self._bind(mod, a.asname, a.name, None)
                    else:  # ``import a.b`` binds ``a``
                        top = a.name.split(".")[0]
                        self._bind(mod, top, top, None)

    def _bind(self, mod: str, alias: str, source: str, name: str | None) -> None:
        if source == self.root or source.startswith(self.root + "."):
            self.imports[(mod, alias)] = (source, name)
        else:
            self.foreign.add((mod, alias))

    def symbol(self, mod: str, name: str, depth: int = 0):
        """What ``name`` is in module ``mod``: a module's name (str), a ``(module, def)``
        pair, or None (not the package's)."""
        if (mod, name) in self.defs:
            return mod, self.defs[(mod, name)]
        if (mod, name) not in self.imports or depth > 20:
            return None
        source, attr = self.imports[(mod, name)]
        if attr is None:
            return source if source in self.modules else None
        found = self.symbol(source, attr, depth + 1)
        if found is None and f"{source}.{attr}" in self.modules:
            return f"{source}.{attr}"
        return found

    def value(self, mod: str, expr: ast.expr):
        """What a receiver expression is, as :meth:`symbol` says."""
        if isinstance(expr, ast.Name):
            return self.symbol(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.value(mod, expr.value)
            if isinstance(owner, str):
                return self.symbol(owner, expr.attr)
        return None

    def method(self, mod: str, cls: ast.ClassDef, name: str, depth: int = 0) -> list:
        """``cls``'s method ``name``, or the one it inherits from a package class."""
        for f in cls.body:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name:
                return [f]
        return [] if depth > 20 else self.inherited(mod, cls, name, depth + 1)

    def inherited(self, mod: str, cls: ast.ClassDef, name: str, depth: int = 0) -> list:
        """The method ``name`` of ``cls``'s package bases."""
        found = []
        for base in cls.bases:
            owner = self.value(mod, base)
            if isinstance(owner, tuple) and isinstance(owner[1], ast.ClassDef):
                found += self.method(owner[0], owner[1], name, depth)
        return found

    def callees(self, mod: str, cls: ast.ClassDef | None, func: ast.expr) -> list[ast.AST]:
        """The package's definitions that a call of ``func`` in ``mod`` (in class ``cls``)
        runs; empty for anything else."""
        if isinstance(func, ast.IfExp):
            return self.callees(mod, cls, func.body) + self.callees(mod, cls, func.orelse)
        if isinstance(func, ast.Name):
            if func.id == "cls" and cls is not None:
                return [cls]
            found = self.symbol(mod, func.id)
            own = [found[1]] if isinstance(found, tuple) else []
            return own + self.nested[mod].get(func.id, [])
        if not isinstance(func, ast.Attribute):
            return []
        receiver = func.value
        if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls") and cls is not None:
            return self.method(mod, cls, func.attr)
        if (
            isinstance(receiver, ast.Call)
            and ast.unparse(receiver.func) == "super"
            and cls is not None
        ):
            return self.inherited(mod, cls, func.attr)
        owner = self.value(mod, receiver)
        if isinstance(owner, str):
            found = self.symbol(owner, func.attr)
            return [found[1]] if isinstance(found, tuple) else []
        if isinstance(owner, tuple):
            return self.method(*owner, func.attr) if isinstance(owner[1], ast.ClassDef) else []
        base = receiver
        while isinstance(base, (ast.Attribute, ast.Subscript, ast.Call)):
            base = base.func if isinstance(base, ast.Call) else base.value
        if isinstance(base, ast.Name) and (mod, base.id) in self.foreign:
            return []
        if func.attr in _FOREIGN:
            return []
        return [f for _, f in self.methods.get(func.attr, [])]


class _Calls(ast.NodeVisitor):
    """Every call of a module, with the class it is written in (None outside classes)."""

    def __init__(self):
        self.classes: list[ast.ClassDef | None] = [None]
        self.found: list[tuple[ast.ClassDef | None, ast.Call]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Call(self, node: ast.Call) -> None:
        self.found.append((self.classes[-1], node))
        self.generic_visit(node)


def _positional_problems(call: ast.Call) -> list[str]:
    args = [a for a in call.args if not isinstance(a, ast.Starred)]
    problems = []
    if len(args) > MAX_POSITIONAL:
        problems.append(f"{len(args)} positional arguments")
    if any(isinstance(a, ast.Constant) and isinstance(a.value, bool) for a in args):
        problems.append("a positional True/False")
    return problems


def positional_calls(index: _Index) -> dict[str, list[str]]:
    """path -> ``path:line: call (problems)`` for each call into the package that passes more
    than MAX_POSITIONAL positionals or a positional bool."""
    found: dict[str, list[str]] = {}
    for mod, (path, tree, _) in index.modules.items():
        calls = _Calls()
        calls.visit(tree)
        for cls, call in calls.found:
            problems = _positional_problems(call)
            if problems and index.callees(mod, cls, call.func):
                name = ast.unparse(call.func)
                found.setdefault(path, []).append(
                    f"{path}:{call.lineno}: {name}(...) passes {' and '.join(problems)}"
                )
    return found


def resolved_calls(index: _Index) -> int:
    """How many calls of the package resolve to a package definition (the check's reach)."""
    n = 0
    for mod, (_, tree, _) in index.modules.items():
        calls = _Calls()
        calls.visit(tree)
        n += sum(bool(index.callees(mod, cls, call.func)) for cls, call in calls.found)
    return n


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's lines from its ``def`` to its end, its docstring not counted."""
    lines = node.end_lineno - node.lineno + 1
    if ast.get_docstring(node, clean=False) is not None:
        lines -= node.body[0].end_lineno - node.body[0].lineno + 1
    return lines


def long_functions(index: _Index) -> dict[str, list[str]]:
    """path -> ``path:line: name (n lines)`` for each function over MAX_LINES lines of code."""
    found: dict[str, list[str]] = {}
    for path, tree, _ in index.modules.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node)
                if n > MAX_LINES:
                    found.setdefault(path, []).append(
                        f"{path}:{node.lineno}: {node.name} has {n} lines of code "
                        f"(at most {MAX_LINES}, its docstring not counted)"
                    )
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _from_source(index: _Index, mod: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement of ``mod`` names, its dots resolved."""
    _, _, is_package = index.modules[mod]
    here = mod if is_package else mod.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
    return f"{base}.{node.module}" if node.module else base


def _import_sources(index: _Index, mod: str, node: ast.ImportFrom | ast.Import) -> list:
    """``(module, name)`` pairs an import statement of ``mod`` reads from the package:
    ``from m import n`` gives ``(m, n)``, or ``(m.n, None)`` where ``m.n`` is a module;
    ``import m`` gives ``(m, None)``."""
    if isinstance(node, ast.Import):
        pairs = [(a.name, None) for a in node.names]
    else:
        source, pairs = _from_source(index, mod, node), []
        for a in node.names:
            module = f"{source}.{a.name}"
            pairs.append((module, None) if module in index.modules else (source, a.name))
    return [(m, n) for m, n in pairs if m in index.modules]


def private_imports(index: _Index) -> dict[str, list[str]]:
    """path -> ``path:line: ...`` for each private name of another package module that a
    module imports (``from .m import _n``) or reads (``m._n``, ``m`` a package module)."""
    found: dict[str, list[str]] = {}
    for mod, (path, tree, _) in index.modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _from_source(index, mod, node)
                for a in node.names if source in index.modules and source != mod else ():
                    if _private(a.name):
                        found.setdefault(path, []).append(
                            f"{path}:{node.lineno}: imports {a.name} from {source}"
                        )
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = index.value(mod, node.value)
                if isinstance(owner, str) and owner != mod:
                    found.setdefault(path, []).append(
                        f"{path}:{node.lineno}: reads {owner}.{node.attr}"
                    )
    return found


def import_graph(index: _Index) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, imports inside
    functions and under ``if TYPE_CHECKING:`` included (one for annotations only still ties
    the two modules: a reader needs both). An import of ``a.b.c`` also reaches the packages
    ``a.b`` (not the package root, nor a package the importer is inside: those run first)."""
    graph: dict[str, dict[str, int]] = {}
    for mod, (_, tree, _) in index.modules.items():
        edges = graph.setdefault(mod, {})
        inside = {mod.rsplit(".", k)[0] for k in range(mod.count(".") + 1)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for source, _ in _import_sources(index, mod, node):
                parts = source.split(".")
                reached = {".".join(parts[:k]) for k in range(2, len(parts) + 1)}
                for target in reached - inside - {index.root}:
                    if target in index.modules and target != mod:
                        edges.setdefault(target, node.lineno)
    return graph


def import_cycles(index: _Index) -> list[str]:
    """Each cycle of :func:`import_graph` as ``a.py:line -> b.py:line -> ... -> a`` (one
    per strongly connected group of modules: the shortest cycle through its first module)."""
    graph = import_graph(index)
    order, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(_cycle_text(index, graph, group) for group in groups)


def _cycle_text(index: _Index, graph: dict, group: list[str]) -> str:
    """The shortest cycle through ``group[0]`` within ``group``, each step with its line."""
    start, members = group[0], set(group)
    paths, seen = {start: [start]}, {start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    cycle = paths[v] + [start]
                    steps = [
                        f"{index.modules[a][0]}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])
                    ]
                    return " -> ".join([*steps, start])
                if w in members and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(group)


TOP = ("__init__", "layers")  # the modules directly in the package that are the top
# ``python -m <root>`` runs ``__main__``, which nothing imports: it is in the highest layer


def _literal(tree: ast.Module, name: str):
    """The literal a top-level assignment of ``tree`` gives ``name`` (None if none does)."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    return None


def layer_table(index: _Index) -> tuple[str, ...]:
    """The package's layers, bottom up: ``LAYERS`` as ``<root>/layers.py`` writes it, read
    from its source (nothing imported); empty without that module."""
    found = index.modules.get(f"{index.root}.layers")
    return tuple(_literal(found[1], "LAYERS") or ()) if found else ()


def layer_ranks(index: _Index) -> dict[str, float]:
    """Each layer's height, bottom up, and the top's: above every layer but ``USERS`` (the
    layers that use the package as its users do; ``<root>/layers.py`` names them)."""
    table = layer_table(index)
    found = index.modules.get(f"{index.root}.layers")
    users = tuple(_literal(found[1], "USERS") or ()) if found else ()
    rank: dict[str, float] = {name: k for k, name in enumerate(table)}
    rank["top"] = min((rank[u] for u in users), default=len(table)) - 0.5
    return rank


def layer_of(mod: str, table: tuple[str, ...]) -> str | None:
    """``mod``'s layer: ``<layer>`` for ``<root>.<layer>`` and the modules under it (a layer
    of ``table``), ``"top"`` for the root and the :data:`TOP` modules directly in it, None
    for any other module (it sits in no layer)."""
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in table:
        return parts[1]
    if len(parts) == 2 and parts[1] == "__main__" and table:
        return table[-1]
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in TOP):
        return "top"
    return None


def layer_problems(index: _Index) -> dict[str, list[str]]:
    """path -> ``path:1: <module> sits in no layer of <root>/layers.py`` for a module outside
    the layers and the top, and ``path:line: <layer> imports <module> (layer <other>)`` for
    each import of a layer's module that goes up: to a higher layer or the top (imports
    inside functions and under ``if TYPE_CHECKING:`` included). The top imports anything; an
    import of a module in no layer is left to that module's own finding."""
    table, rank = layer_table(index), layer_ranks(index)
    found: dict[str, list[str]] = {}
    for mod, (path, tree, _) in index.modules.items():
        layer = layer_of(mod, table)
        if layer is None:
            found[path] = [f"{path}:1: {mod} sits in no layer of {index.root}/layers.py"]
            continue
        ups = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for source, _ in _import_sources(index, mod, node):
                    other = layer_of(source, table)
                    if other is not None and rank[other] > rank[layer]:
                        ups.add((node.lineno, source, other))
        if ups:
            found[path] = [
                f"{path}:{line}: {layer} imports {source} (layer {other})"
                for line, source, other in sorted(ups)
            ]
    return found


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("self", "cls")


_SETATTR = ("setattr", "object.__setattr__")


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class defines: its methods and nested classes, its class attributes
    (fields included) and ``__slots__``, and what its methods set on ``self``
    (``self._x = ...``, ``object.__setattr__(self, "_x", ...)``)."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets):
            names |= {
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            names |= {node.attr} if _is_self(node.value) else set()
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in _SETATTR:
            args = node.args
            if len(args) > 1 and _is_self(args[0]) and isinstance(args[1], ast.Constant):
                names.add(args[1].value)
    return names


def _inherited_attributes(index: _Index, mod: str, cls: ast.ClassDef, depth: int = 0) -> set:
    """What ``cls`` (of ``mod``) has from its package bases, as :func:`_class_attributes`."""
    names = set()
    for base in cls.bases if depth < 20 else ():
        owner = index.value(mod, base)
        if isinstance(owner, tuple) and isinstance(owner[1], ast.ClassDef):
            names |= _class_attributes(owner[1])
            names |= _inherited_attributes(index, *owner, depth + 1)
    return names


def private_attributes(index: _Index, *, inherited: bool) -> dict[str, set[str]]:
    """module -> the private attributes (one leading underscore) its classes define, and with
    ``inherited`` those they have from their package bases too."""
    found = {}
    for mod, (_, tree, _) in index.modules.items():
        names = set()
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                names |= _class_attributes(cls)
                names |= _inherited_attributes(index, mod, cls) if inherited else set()
        found[mod] = {n for n in names if isinstance(n, str) and _private(n)}
    return found


def _receiver_is_ours(index: _Index, mod: str, receiver: ast.expr) -> bool:
    """Whether ``receiver._x`` may be a package object's attribute read from outside: not
    ``self``, ``cls`` or ``super()`` (the class's own), not a package module (its private
    names are :func:`private_imports`' concern), nothing imported from outside."""
    if _is_self(receiver) or isinstance(index.value(mod, receiver), str):
        return False
    if isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super":
        return False
    base = receiver
    while isinstance(base, (ast.Attribute, ast.Subscript, ast.Call)):
        base = base.func if isinstance(base, ast.Call) else base.value
    return not (isinstance(base, ast.Name) and (mod, base.id) in index.foreign)


def reach_ins(index: _Index) -> dict[str, list[str]]:
    """path -> ``path:line: reads <expr>._x (defined in <modules>)`` for each private
    attribute ``_x`` that a module reads (or writes) on an object of another module's class:
    ``_x`` is defined by a class of another package module (:func:`_class_attributes`) and
    by no class of this one, nor by their package bases (a subclass's module shares its
    base's private interface). One that no package class defines (``t._local_tensor``) is
    torch's, optree's or Python's, not the package's, and so is one that tensors and the
    builtin containers have (``t._base``): the receiver's type is not known."""
    own = private_attributes(index, inherited=True)
    owners: dict[str, set[str]] = {}
    for mod, names in private_attributes(index, inherited=False).items():
        for name in names:
            owners.setdefault(name, set()).add(mod)
    found: dict[str, list[str]] = {}
    for mod, (path, tree, _) in index.modules.items():
        hits = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr in own[mod] | _FOREIGN:
                continue
            if node.attr in owners and _receiver_is_ours(index, mod, node.value):
                verb = "reads" if isinstance(node.ctx, ast.Load) else "writes"
                where = ", ".join(sorted(owners[node.attr]))
                hits.add((node.lineno, f"{verb} {ast.unparse(node)} (defined in {where})"))
        if hits:
            found[path] = [f"{path}:{line}: {text}" for line, text in sorted(hits)]
    return found


#: Methods of the state protocol: a class that has one says how it is saved and loaded.
STATE_PROTOCOL = ("__fh_state_dict__", "__fh_load_state_dict__")


def is_state_type(index: _Index, mod: str, cls: ast.ClassDef) -> bool:
    """Whether ``cls`` (of ``mod``) is a stateful type: it has a method of the state protocol
    (its own or a package base's), or it is a NamedTuple named ``...State``, or ``MainGrad``."""
    if cls.name == "MainGrad":
        return True
    named_tuple = any(ast.unparse(b).split(".")[-1] == "NamedTuple" for b in cls.bases)
    if named_tuple and cls.name.endswith("State"):
        return True
    return any(index.method(mod, cls, name) for name in STATE_PROTOCOL)


def _named(index: _Index, mod: str, node: ast.AST) -> list:
    """What a name, a ``module.name`` or a ``from ... import`` of ``mod`` stands for, as
    :meth:`_Index.symbol` says."""
    if isinstance(node, ast.Name):
        return [index.symbol(mod, node.id)]
    if isinstance(node, ast.Attribute):
        return [index.value(mod, node)]
    if isinstance(node, ast.ImportFrom):
        source = _from_source(index, mod, node)
        return [index.symbol(source, a.name) for a in node.names if source in index.modules]
    return []


def state_type_names(index: _Index, room: str) -> dict[str, list[str]]:
    """path -> ``path:line: names state type <Class>`` for each name (an import included)
    in a module of the checkpoint room (the module ``room`` and those under it) that stands
    for a stateful type (:func:`is_state_type`) of a module outside the room: each such type
    says how it is saved where it is defined, and the room keeps no list of them."""

    def inside(m: str) -> bool:
        return m == room or m.startswith(room + ".")

    found: dict[str, list[str]] = {}
    for mod, (path, tree, _) in index.modules.items():
        hits = set()
        for node in ast.walk(tree) if inside(mod) else ():
            for target in _named(index, mod, node):
                if (
                    isinstance(target, tuple)
                    and isinstance(target[1], ast.ClassDef)
                    and not inside(target[0])
                    and is_state_type(index, *target)
                ):
                    hits.add((node.lineno, target[1].name))
        if hits:
            found[path] = [f"{path}:{line}: names state type {name}" for line, name in sorted(hits)]
    return found


@functools.cache
def _package() -> _Index:
    return _Index({path: (ROOT / path).read_text() for path in FILES})


@functools.cache
def _found(check) -> dict[str, list[str]]:
    """What ``check`` finds in the package, path by path (once for all the files' tests)."""
    return check(_package())


@pytest.mark.parametrize("path", FILES)
def test_no_function_is_long(path: str):
    found = _found(long_functions).get(path, [])
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", FILES)
def test_calls_into_the_package_pass_few_positionals_and_no_positional_bool(path: str):
    found = _found(positional_calls).get(path, [])
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", FILES)
def test_no_module_imports_a_private_name_of_another(path: str):
    found = _found(private_imports).get(path, [])
    assert not found, "\n".join(found)


def test_the_modules_import_each_other_without_a_cycle():
    """Dependencies go one way, imports inside functions counted (one hidden there is a
    cycle all the same: it only runs later), and those for annotations only too."""
    cycles = import_cycles(_package())
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("path", FILES)
def test_each_module_sits_in_a_layer_and_imports_only_its_layer_or_below(path: str):
    """The layers of ``functional_hsdp/layers.py``, bottom up: a module of a layer imports
    from its own layer or one below (type-checking imports included), never from the top."""
    found = _found(layer_problems).get(path, [])
    assert not found, "\n".join(found)


def test_the_layer_check_reads_the_layer_table():
    """The table is read from ``functional_hsdp/layers.py``'s source, bottom up."""
    table = layer_table(_package())
    assert len(table) > 5 and table[0] == "base", table


@pytest.mark.parametrize("path", FILES)
def test_no_module_reads_a_private_attribute_of_another_modules_object(path: str):
    found = _found(reach_ins).get(path, [])
    assert not found, "\n".join(found)


def test_the_reach_in_check_reaches_the_package():
    """The package's classes define private attributes for the check to look for."""
    own = private_attributes(_package(), inherited=False)
    assert sum(map(len, own.values())) > 100
    assert any("_deferred" in names for names in own.values())


#: The checkpoint room: the layer ``io`` of the package (its module or package).
ROOM = "functional_hsdp.io"
ROOM_FILES = [p for p in FILES if f"{_module_name(p)[0]}.".startswith(f"{ROOM}.")]


@pytest.mark.parametrize("path", ROOM_FILES or ["functional_hsdp/io/"])
def test_the_checkpoint_room_names_no_state_type(path: str):
    """Each stateful type (a MainGrad, a NamedTuple state, a class of the state protocol)
    says how it is saved where it is defined; the checkpoint room keeps no list of them."""
    assert path in FILES, f"the checkpoint room {ROOM} holds no module (the checkpoints' code)"
    found = state_type_names(_package(), ROOM).get(path, [])
    assert not found, "\n".join(found)


def test_the_import_checks_reach_the_package():
    """The import graph holds the package's imports: most modules import another."""
    graph = import_graph(_package())
    assert len(graph) == len(FILES)
    assert sum(map(len, graph.values())) > 150
    assert "functional_hsdp.plan.owner" in graph["functional_hsdp.plan.recipe"]


def test_the_call_check_reaches_the_package():
    """The resolver finds the package's calls: most of them, not none."""
    index = _package()
    assert len(index.modules) == len(FILES)
    assert resolved_calls(index) > 800


def _function(name: str, docstring: str, code_lines: int) -> str:
    """A function of ``code_lines`` lines of code (its ``def`` and ``return`` included) and
    ``docstring``."""
    body = "    x += 1\n" * (code_lines - 2)
    return f'def {name}(x):\n    """{docstring}"""\n{body}    return x\n'


_SAMPLE = {
    "pkg/__init__.py": "from .a import K, f\n",
    "pkg/a.py": (
        "import torch\n"
        "def f(a, b, c, d=0, flag=False):\n"
        "    return a\n"
        "class K:\n"
        "    def __init__(self, a, b=0, c=0, d=0):\n"
        "        self.a = a\n"
        "    def m(self, x, flag=False):\n"
        "        return torch.cat([x], 0, out=None) if flag else self.grow(x, 1, 2, 3)\n"
        "    def grow(self, *args):\n"
        "        return args\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        return cls(1, 2, 3, 4)\n"
        "class L(K):\n"
        "    def __init__(self):\n"
        "        super().__init__(1, 2, 3, 4)\n"
        + _function("long", "One line.\n\n    More lines: not counted.\n    ", MAX_LINES + 1)
        + _function("short", "One line.", MAX_LINES)
    ),
    "pkg/b.py": (
        "import functools, torch\n"
        "from . import a\n"
        "from .a import K as Renamed\n"
        "import pkg\n"
        "def h(x, y, z):\n"
        "    a.f(1, 2, 3, 4)\n"  # line 6
        "    a.f(1, 2, 3, flag=True)\n"
        "    pkg.f(1, 2, 3, d=4)\n"
        "    Renamed(1, 2, 3, 4)\n"  # line 9
        "    (Renamed if x else a.K)(1, 2, True)\n"  # line 10
        "    torch.cat([x], 0, out=None).add(1, 2, 3, 4)\n"
        "    functools.reduce(x, y, z, 4)\n"
        "    y.m(z, False)\n"  # line 13
        "    y.add(True)\n"
        "    a.f(*x, 1, 2, 3)\n"
        "    def inner(p, q, r, s):\n"
        "        return p\n"
        "    return inner(1, 2, 3, 4)\n"  # line 18
    ),
}


def test_the_checks_can_fail():
    """Each check reports what breaks its rule, naming the place, and nothing else."""
    index = _Index(_SAMPLE)
    assert long_functions(index) == {
        "pkg/a.py": [
            f"pkg/a.py:17: long has {MAX_LINES + 1} lines of code (at most "
            f"{MAX_LINES}, its docstring not counted)"
        ]
    }
    found = {
        path: [line.split(": ", 1)[0] for line in lines]
        for path, lines in positional_calls(index).items()
    }
    assert found == {
        "pkg/a.py": ["pkg/a.py:8", "pkg/a.py:13", "pkg/a.py:16"],
        "pkg/b.py": ["pkg/b.py:6", "pkg/b.py:9", "pkg/b.py:10", "pkg/b.py:13", "pkg/b.py:18"],
    }
    assert "a positional True/False" in positional_calls(index)["pkg/b.py"][2]


_IMPORTS = {
    "pkg/__init__.py": "from .a import f\n",
    "pkg/a.py": "from .b import g\ndef f():\n    return g\n",
    "pkg/b.py": (
        "import os\n"
        "from . import c\n"
        "def g():\n"
        "    from .a import f\n"  # line 4: a cycle hidden in a function
        "    from .sub.d import _h\n"  # line 5: private; reaches the package sub too
        "    return c._k, os._exit, f\n"  # line 6: c._k is private, os._exit not ours
    ),
    "pkg/c.py": "_k = 1\nfrom .sub import _m\n",  # line 2: a private module is a private name
    "pkg/sub/__init__.py": "from .d import x\n",
    "pkg/sub/d.py": "from .. import e\n_h = x = 1\n",
    "pkg/sub/_m.py": "from ._n import y\n",  # a public name of a private module: fine
    "pkg/sub/_n.py": "y = 1\n",
    "pkg/e.py": "from .sub import x\n",  # e -> sub -> d -> e: through the package
    "pkg/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .g import G\n",
    "pkg/g.py": "from .f import F\n",  # f -> g for annotations only: a cycle all the same
}


def test_the_import_checks_can_fail():
    """Private names read across modules, and cycles (one hidden inside a function, one
    through a package's ``__init__``, one for annotations only), are reported with their
    lines; nothing else."""
    index = _Index(_IMPORTS)
    assert private_imports(index) == {
        "pkg/b.py": [
            "pkg/b.py:5: imports _h from pkg.sub.d",
            "pkg/b.py:6: reads pkg.c._k",
        ],
        "pkg/c.py": ["pkg/c.py:2: imports _m from pkg.sub"],
    }
    assert import_cycles(index) == [
        "pkg/a.py:1 -> pkg/b.py:4 -> pkg.a",
        "pkg/e.py:1 -> pkg/sub/__init__.py:1 -> pkg/sub/d.py:1 -> pkg.e",
        "pkg/f.py:3 -> pkg/g.py:1 -> pkg.f",
    ]


def test_maingrads_public_surface_is_what_the_api_table_documents():
    """``MainGrad``'s public methods and properties are those its row of the API table
    (``docs/api_overview.md``) names, no more (what the units need goes through their private
    interface, ``maingrad.units_of(mg)``) and no fewer."""
    import re

    import functional_hsdp as fh

    lines = (ROOT / "docs" / "api_overview.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| `MainGrad("))
    documented = set(re.findall(r"`(\w+)(?:\(\))?`", row.split("|")[2]))
    public = {n for n in vars(fh.MainGrad) if not n.startswith("_")}
    assert public == documented, (sorted(public - documented), sorted(documented - public))


_LAYERS = {
    "pkg/__init__.py": "from .high.h import H\nfrom .low import f\nfrom .app import y\n",
    "pkg/__main__.py": "from . import flat, high\nfrom .app import x\n",  # the highest layer
    "pkg/layers.py": 'LAYERS: tuple[str, ...] = ("low", "high", "app")\nUSERS = ("app",)\n',
    "pkg/app/__init__.py": "import pkg\nfrom ..high import h\n",  # a users layer: above the top
    "pkg/low/__init__.py": "from .f import f\n",
    "pkg/low/f.py": (
        "from typing import TYPE_CHECKING\n"
        "from .. import flat\n"  # a module in no layer: reported there, not here
        "def f():\n"
        "    from ..high.h import H\n"  # line 4: up, hidden in a function
        "    return H\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.high import h\n"  # line 7: up, for annotations only
    ),
    "pkg/high/__init__.py": "",
    "pkg/high/h.py": (
        "import pkg\n"  # the top: no layer imports it
        "from ..low import f\n"  # below: fine
        "from . import g\n"  # its own layer: fine
        "class H:\n"
        "    pass\n"
    ),
    "pkg/high/g.py": "",
    "pkg/flat.py": "x = 1\n",  # directly in the package, not a top module: in no layer
    "pkg/other/__init__.py": "",  # a package not named in the table: in no layer
}


def test_the_layer_check_can_fail():
    """Imports up a layer (inside a function, under TYPE_CHECKING, to the top) and modules
    in no layer are reported, and so is the top's import of a users layer; imports down,
    within a layer, from the top and from a users layer to the top are not."""
    index = _Index(_LAYERS)
    assert layer_table(index) == ("low", "high", "app")
    assert layer_problems(index) == {
        "pkg/__init__.py": ["pkg/__init__.py:3: top imports pkg.app (layer app)"],
        "pkg/flat.py": ["pkg/flat.py:1: pkg.flat sits in no layer of pkg/layers.py"],
        "pkg/high/h.py": ["pkg/high/h.py:1: high imports pkg (layer top)"],
        "pkg/low/f.py": [
            "pkg/low/f.py:4: low imports pkg.high.h (layer high)",
            "pkg/low/f.py:7: low imports pkg.high.h (layer high)",
        ],
        "pkg/other/__init__.py": [
            "pkg/other/__init__.py:1: pkg.other sits in no layer of pkg/layers.py"
        ],
    }


_ATTRIBUTES = {
    "pkg/__init__.py": "",
    "pkg/a.py": (
        "class A:\n"
        "    _kind = 'a'\n"
        "    __slots__ = ('_slot',)\n"
        "    def __init__(self):\n"
        "        self._x = self._base = 1\n"
        "        object.__setattr__(self, '_y', 2)\n"
        "    def _m(self):\n"
        "        return self._x\n"
        "def peek(a):\n"
        "    return a._x + a._y\n"  # its own module's class: fine
    ),
    "pkg/b.py": (
        "import torch\n"
        "from . import a as amod\n"
        "from .a import A\n"
        "def g(a, c):\n"
        "    a._kind = a._x + c._z\n"  # line 5
        "    return A._m, a._slot, a._y\n"  # line 6
        "def h(t):\n"
        # no package class defines _local_tensor; _base is a tensor's too; torch is not
        # ours; a module's private name is private_imports' concern
        "    return t._local_tensor, t._base, torch._x, amod._x\n"
    ),
    "pkg/c.py": (
        "from .a import A\n"
        "class C(A):\n"
        "    def __init__(self, other):\n"
        "        super().__init__()\n"
        "        self._z = other._x\n"  # C has A's _x: a subclass shares its base's
        "    def f(self):\n"
        "        return self._m(), super()._m()\n"
        "def k(c):\n"
        "    return c._z, c._kind\n"
    ),
}


def test_the_reach_in_check_can_fail():
    """Private attributes of another module's classes, read or written, are reported with
    the module that defines them; a class's own (``self``, ``super()``, its module's, its
    package bases'), torch's, Python's and a module's private names are not."""
    assert reach_ins(_Index(_ATTRIBUTES)) == {
        "pkg/b.py": [
            "pkg/b.py:5: reads a._x (defined in pkg.a)",
            "pkg/b.py:5: reads c._z (defined in pkg.c)",
            "pkg/b.py:5: writes a._kind (defined in pkg.a)",
            "pkg/b.py:6: reads A._m (defined in pkg.a)",
            "pkg/b.py:6: reads a._slot (defined in pkg.a)",
            "pkg/b.py:6: reads a._y (defined in pkg.a)",
        ]
    }


_ROOM = {
    "pkg/__init__.py": "",
    "pkg/grads.py": (
        "from typing import NamedTuple\n"
        "class MainGrad:\n"
        "    pass\n"
        "class Saved:\n"
        "    def __fh_state_dict__(self):\n"
        "        return {}\n"
        "class Later(Saved):\n"  # the protocol, inherited
        "    pass\n"
        "class AdamState(NamedTuple):\n"
        "    count: int\n"
        "class Options(NamedTuple):\n"  # a NamedTuple, not a state
        "    lr: float\n"
        "class FooState:\n"  # named a state, not a NamedTuple
        "    pass\n"
    ),
    "pkg/io/__init__.py": "from .save import save\n",
    "pkg/io/save.py": (
        "import typing\n"
        "from .. import grads\n"
        "from ..grads import AdamState, Options\n"  # line 3
        "class RoomState(typing.NamedTuple):\n"  # the room's own
        "    n: int\n"
        "def save(x):\n"
        "    if isinstance(x, grads.MainGrad):\n"  # line 7
        "        return RoomState(1)\n"
        "    if isinstance(x, (grads.Later, grads.FooState, Options)):\n"  # line 9
        "        return x\n"
        "    return x.__fh_state_dict__()\n"
    ),
}


def test_the_state_type_check_can_fail():
    """A stateful type of another room named in the checkpoint room (imported, or read as
    ``module.Class``) is reported at each line; other classes and the room's own are not."""
    assert state_type_names(_Index(_ROOM), "pkg.io") == {
        "pkg/io/save.py": [
            "pkg/io/save.py:3: names state type AdamState",
            "pkg/io/save.py:7: names state type MainGrad",
            "pkg/io/save.py:9: names state type Later",
        ]
    }


def _layer_folders(root: Path, extra: set[str]) -> dict[str, bool]:
    """Each folder of ``root`` holding Python files -> whether it is a layer of the package's
    table (read from ``functional_hsdp/layers.py``'s source) or one of ``extra``."""
    table = layer_table(_package())
    return {
        d.name: d.name in table or d.name in extra
        for d in sorted(root.iterdir())
        if d.is_dir() and any(d.glob("*.py"))
    }


def test_tests_and_bench_mirror_the_layers():
    """tests/ and bench/ are cut like the package: a folder per layer (tests/project/ for the
    checks of the whole project, bench/device/ for the run on one GPU), no test or benchmark
    left at their top."""
    for root, extra in ((ROOT / "tests", {"project"}), (ROOT / "bench", {"device"})):
        folders = _layer_folders(root, extra)
        assert folders and all(folders.values()), (root.name, folders)
    assert not sorted((ROOT / "tests").glob("test_*.py"))
    import bench

    top = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not top & set(bench.LAYERS), sorted(top & set(bench.LAYERS))
