"""The documentation site's sources: every public name has an API page in exactly one group.

The API reference is generated from ``docs/api_groups.py`` (``docs/conf.py`` writes a page per
group and per name, and refuses to build while a name is in no group). A name added to
``fh.__all__`` fails here until it is given a group; the build itself (``sphinx-build -W``) runs
in CI's docs lane (``.ci/docs-lane``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import functional_hsdp as fh

DOCS = Path(__file__).resolve().parents[2] / "docs"  # parents[2]: the repository root


def _groups():
    spec = importlib.util.spec_from_file_location("api_groups", DOCS / "api_groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_in_exactly_one_api_group():
    assert _groups().problems(list(fh.__all__)) == []


def test_a_name_in_no_group_is_named_with_what_to_do():
    problems = _groups().problems([*fh.__all__, "new_thing"])
    assert problems == [
        "'new_thing' is in functional_hsdp.__all__ but in no group of docs/api_groups.py: "
        "add it to the group a reader would look in"
    ]


def test_the_groups_are_the_readmes():
    titles = [t.lower() for t in _groups().GROUPS]
    assert titles == [
        "placements and specs", "meshes", "collectives", "gradients", "units and modules",
        "optimizers", "checkpoints", "checks",
    ]  # fmt: skip


def test_every_page_a_guide_links_to_exists():
    """Links between the docs' own pages (the build checks them too, with anchors). The API
    pages are generated at build time (``docs/api/``, not committed): a link to one must name
    the index, a group's page or a public name's page of ``docs/api_groups.py``."""
    import re

    groups = _groups().GROUPS
    api_pages = {"index", *(slug for slug, _, _ in groups.values())}
    api_pages |= {name for _, _, names in groups.values() for name in names}
    for page in DOCS.rglob("*.md"):
        if "_build" in page.parts or page.parts[-2] in ("api", "notebooks"):
            continue
        for target in re.findall(r"\]\(([^)#:\s]+\.(?:md|ipynb))(?:#[^)]*)?\)", page.read_text()):
            path = (page.parent / target).resolve()
            if path.suffix == ".ipynb" and path.parent == DOCS / "notebooks":
                path = DOCS.parent / "notebooks" / path.name  # copied in at build time
            if path.parent == DOCS / "api":  # generated at build time
                assert path.suffix == ".md" and path.stem in api_pages, (
                    f"{page.relative_to(DOCS)} links to {target}: no such API page"
                )
                continue
            assert path.exists(), f"{page.relative_to(DOCS)} links to {target}: no such file"
