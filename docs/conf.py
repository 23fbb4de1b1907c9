"""Sphinx configuration: Sphinx + myst-nb + sphinx-book-theme, as optax and JAX document.

Build (from the repository root; ``pip install -e ".[docs]"`` first):

    sphinx-build -W --keep-going -b html docs docs/_build/html

What this file does before Sphinx reads the sources:

- checks ``docs/api_groups.py`` against ``functional_hsdp.__all__`` and stops the build, naming
  the name, when a public name is in no group (or two): a new name needs a group, it is never
  dropped silently;
- writes the API reference (``docs/api/``, generated, not committed): a page per group with a
  summary table, and a page per public name rendered by autodoc from its docstring;
- copies ``notebooks/*.ipynb`` into ``docs/notebooks/`` (generated), which myst-nb executes at
  build time and renders with their outputs and plots. Executed notebooks are cached by
  jupyter-cache under ``FH_DOCS_CACHE`` (default ``docs/_build/.jupyter_cache``), keyed on the
  library's sources as well as the notebook's cells, so a warm build re-runs only what changed.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import sys
import types
from pathlib import Path

from sphinx.errors import ConfigError

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS))
# the notebooks' kernels import this checkout's functional_hsdp, installed or not
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import api_groups  # noqa: E402

import functional_hsdp as fh  # noqa: E402

project = "functional_hsdp"
author = "functional_hsdp authors"
copyright = "2026, functional_hsdp authors"
release = fh.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# -- MyST: headings get anchors, so [text](page.md#a-heading) is checked like any reference
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# -- the notebooks: executed at build time, outputs and plots rendered
nb_execution_mode = "cache"
nb_execution_timeout = 300
nb_execution_raise_on_error = True  # a failing cell fails the build, with its traceback
nb_execution_show_tb = True
nb_merge_streams = True
nb_output_stderr = "remove"  # native log lines (the profiler's kineto in 04) are no reading

# -- autodoc: Google-style docstrings (Args / Returns / Example)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # no "Return type: Any" rows
autodoc_typehints_format = "short"
autosummary_generate = False  # the pages are written below, from api_groups
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Returns:" as written: its first line is prose, not "type: description"
napoleon_custom_sections = ["Returns", "Raises"]
napoleon_use_ivar = True  # a NamedTuple's Attributes: once, as fields (its members are listed)
add_module_names = False

# The build is nitpicky: every cross-reference in a docstring (:class:`Spec`, :func:`gather`)
# must reach its page. What the site does not document is named here: torch's and the standard
# library's objects (intersphinx would fetch their inventories; the build stays offline) and the
# library's private modules and types that public signatures mention.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|collections\.abc|typing|optree)(\..*)?"),
    (r"py:.*", r"functional_hsdp\.[a-z_]+(\.[a-z_]+)*(\.[A-Za-z_]+)?"),  # private modules' names
    (r"py:.*", r"(Geometry|Diagnostics|Kept|MeshAxes|T|BACKENDS)"),
    (r"py:.*", r"_\w+"),  # a private function a docstring names (_compressed_pseudo_gradient)
]

# napoleon reads the first line of a property's docstring as "type: description"; the
# library's properties are written as prose ("Leading dims of every distributed value: ..."),
# so they are left to autodoc as written. Raises sections are prose too.
import sphinx.ext.napoleon as _napoleon  # noqa: E402

_napoleon_process = _napoleon._process_docstring


def _process_docstring(app, what, name, obj, options, lines):
    if what not in ("attribute", "property"):
        _napoleon_process(app, what, name, obj, options, lines)


_napoleon._process_docstring = _process_docstring

# -- HTML
html_theme = "sphinx_book_theme"
html_title = "functional_hsdp"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": True,
    # an API page's own contents are one entry: its room goes to the docstring's examples,
    # written to 100 columns as the guides' code is
    "secondary_sidebar_items": {
        "*": ["page-toc.html"],
        "guides/*": ["page-toc.html"],
        "notebooks/*": ["page-toc.html"],
    },
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
copybutton_prompt_text = r">>> |\.\.\. "
copybutton_prompt_is_regexp = True


# -- the API reference, from api_groups ------------------------------------------------------

API = DOCS / "api"


def _write(path: Path, text: str) -> None:
    """Write only what changed, so Sphinx's incremental build reads only changed pages."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _name_page(name: str) -> str:
    obj = getattr(fh, name)
    if isinstance(obj, types.ModuleType):  # a public submodule (fh.schedules): its own names
        return (
            f"# {name}\n\n```{{eval-rst}}\n.. automodule:: {obj.__name__}\n"
            "   :members:\n   :member-order: bysource\n```\n"
        )
    module = getattr(obj, "__module__", "") or ""
    head = f"# {name}\n\n```{{eval-rst}}\n.. currentmodule:: functional_hsdp\n\n"
    if not module.startswith("functional_hsdp"):
        # torch's own class, re-exported: the library takes it as torch defines it
        origin = f"{module.rsplit('.placement_types', 1)[0]}.{name}"
        return (
            f"{head}.. py:class:: {name}\n   :canonical: {origin}\n\n"
            f"   torch's own ``{origin}``, re-exported: the library takes torch's placement "
            "with torch's meaning.\n```\n\nWhat it means in a spec: "
            "[Concepts](../guides/concepts.md), and the [placements](placements.md).\n"
        )
    if isinstance(obj, type):
        page = head + f".. autoclass:: {name}\n   :members:\n   :show-inheritance:\n```\n"
    else:
        page = head + f".. autofunction:: {name}\n```\n"
    return page + _module_notes(obj)


def _module_notes(obj) -> str:
    """A docstring that sends the reader to "the module docstring" (fh.diloco's: the math
    and the schedule) gets that docstring on its page: the library's modules have no pages."""
    module = sys.modules[obj.__module__]
    if not re.search(r"module\s+docstring", obj.__doc__ or "") or not module.__doc__:
        return ""
    return (
        f"\n## The module docstring (`{module.__name__}`)\n\n```{{eval-rst}}\n"
        f".. currentmodule:: functional_hsdp\n\n{inspect.cleandoc(module.__doc__)}\n```\n"
    )


def _group_page(title: str, blurb: str, names: list[str]) -> str:
    rows = "\n".join(f"   {n}" for n in names)
    toc = "\n".join(names)
    return (
        f"# {title}\n\n{blurb}\n\n```{{eval-rst}}\n.. currentmodule:: functional_hsdp\n\n"
        f".. autosummary::\n   :nosignatures:\n\n{rows}\n```\n\n"
        f"```{{toctree}}\n:hidden:\n\n{toc}\n```\n"
    )


def _api_pages() -> None:
    wrong = api_groups.problems(list(fh.__all__))
    if wrong:
        raise ConfigError(
            "the API reference's groups do not match functional_hsdp.__all__:\n  "
            + "\n  ".join(wrong)
        )
    wanted = {"index.md"}
    index = [
        "# API reference\n",
        "Every public name of `functional_hsdp` (imported as `fh`), grouped as the guides "
        "use them. Each page is generated from the name's docstring.\n",
    ]
    toc = []
    for title, (slug, blurb, names) in api_groups.GROUPS.items():
        _write(API / f"{slug}.md", _group_page(title, blurb, names))
        wanted.add(f"{slug}.md")
        for name in names:
            _write(API / f"{name}.md", _name_page(name))
            wanted.add(f"{name}.md")
        index.append(f"## [{title}]({slug}.md)\n\n{blurb}\n")
        index.append(", ".join(f"[`{n}`]({n}.md)" for n in names) + "\n")
        toc.append(slug)
    index.append("```{toctree}\n:hidden:\n\n" + "\n".join(toc) + "\n```\n")
    _write(API / "index.md", "\n".join(index))
    for stale in API.glob("*.md"):  # a name removed from __all__ loses its page
        if stale.name not in wanted:
            stale.unlink()


# -- the notebooks, copied in (Sphinx reads sources under docs/ only) ------------------------

NOTEBOOKS = DOCS / "notebooks"


def _copy_notebooks() -> None:
    NOTEBOOKS.mkdir(exist_ok=True)
    sources = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for src in sources:
        dst = NOTEBOOKS / src.name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)
    for stale in NOTEBOOKS.glob("*.ipynb"):
        if not (ROOT / "notebooks" / stale.name).exists():
            stale.unlink()


def _library_digest() -> str:
    """A digest of the library's sources: executed notebooks cached for other sources are
    not reused (jupyter-cache keys on the notebook's cells only)."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "functional_hsdp").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


_api_pages()
_copy_notebooks()
_cache_root = Path(os.environ.get("FH_DOCS_CACHE", DOCS / "_build" / ".jupyter_cache"))
nb_execution_cache_path = str(_cache_root / _library_digest())
if _cache_root.is_dir():  # keep the current library's cache only
    for old in _cache_root.iterdir():
        stale = old.name != Path(nb_execution_cache_path).name
        if old.is_dir() and stale and len(old.name) == 16 and old.name.isalnum():
            shutil.rmtree(old, ignore_errors=True)
