"""What the runtime package imports: never the test pool (``functional_hsdp.tools.testing``), and
nothing the library does not declare (the demo runs without tqdm, an extra)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository root
PACKAGE = ROOT / "functional_hsdp"
TESTING = "functional_hsdp.tools.testing"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_files() -> list[Path]:
    """Every module of the package but the testing subpackage's."""
    testing = PACKAGE / "tools" / "testing"
    return sorted(p for p in PACKAGE.rglob("*.py") if testing not in p.parents)


def _dynamic_import(node: ast.AST) -> str | None:
    """The module named by ``importlib.import_module("x")`` or ``__import__("x")``, if any."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return node.args[0].value if name in ("import_module", "__import__") else None


def _imported(source: str, module: str, is_package: bool) -> set[str]:
    """The absolute names a module's source imports, relative imports resolved: ``from a
    import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule), wherever the statement is
    (in a function too)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (name := _dynamic_import(node)) is not None:
            names.add(name)
    return names


def _imports_of(path: Path) -> set[str]:
    return _imported(path.read_text(), _module_name(path), path.name == "__init__.py")


def _names_testing(names: set[str]) -> set[str]:
    return {n for n in names if n == TESTING or n.startswith(TESTING + ".")}


def test_no_runtime_module_imports_the_test_pool():
    files = _runtime_files()
    assert PACKAGE / "mesh" / "launch.py" in files and PACKAGE / "tools" / "demo.py" in files
    offenders = {
        str(p.relative_to(ROOT)): sorted(_names_testing(_imports_of(p)))
        for p in files
        if _names_testing(_imports_of(p))
    }
    assert offenders == {}


def test_the_import_check_sees_every_form_of_import():
    # The check above must not pass for want of seeing an import: each form names the pool.
    forms = [
        "from .testing import GlooPool",
        "from . import testing",
        "from functional_hsdp.tools.testing.gloo_pool import GlooPool",
        "import functional_hsdp.tools.testing",
        "def f():\n    from ..tools.testing import gloo_pool",
        "importlib.import_module('functional_hsdp.tools.testing')",
    ]
    for source in forms:
        module = "functional_hsdp.mesh.dist" if ".." in source else "functional_hsdp.tools.demo"
        assert _names_testing(_imported(source, module, is_package=False)), source
    # ...and the pool's own modules do import the runtime's launcher, by a relative import.
    pool = PACKAGE / "tools" / "testing" / "gloo_pool.py"
    assert "functional_hsdp.mesh.launch" in _imports_of(pool)


def test_tqdm_is_not_a_dependency():
    pyproject = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    assert "tqdm" not in dependencies
    assert re.search(r'^demo = \["tqdm', pyproject, re.M)  # the demo's extra


def test_the_package_and_the_demo_run_without_tqdm_or_the_test_pool():
    """In a fresh interpreter where tqdm cannot be imported: every runtime module imports,
    the demo passes with its plain progress line, and the testing subpackage stays unloaded."""
    modules = [_module_name(p) for p in _runtime_files()]
    code = (
        "import importlib, sys\n"
        "sys.modules['tqdm'] = None  # as if not installed: importing it raises\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "from functional_hsdp.__main__ import main\n"
        "rc = main(['demo', '--backend', 'sim', '--steps', '2'])\n"
        f"print('testing loaded:', {TESTING!r} in sys.modules)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "testing loaded: False" in proc.stdout
    assert re.search(r"^hsdp whole on sim: 2/2 steps$", proc.stderr, re.M), proc.stderr
    assert re.search(r"^PASS: ", proc.stdout, re.M)
