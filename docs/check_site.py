"""What the built site must show, checked after ``sphinx-build`` (``.ci/docs-lane`` runs it):
every public name has its API page, and every notebook page shows its plots, as many as the
notebook draws.

    python docs/check_site.py docs/_build/html
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import functional_hsdp as fh  # noqa: E402


def problems(html: Path) -> list[str]:
    out = []
    for name in fh.__all__:
        page = html / "api" / f"{name}.html"
        if not page.exists():
            out.append(f"fh.{name}: no API page ({page.relative_to(html)})")
        elif isinstance(getattr(fh, name), types.ModuleType):  # fh.schedules: each of its names
            text, module = page.read_text(), getattr(fh, name)
            if f'id="module-{module.__name__}"' not in text:
                out.append(f"fh.{name}: its page documents no module of that name")
            for member in module.__all__:
                if f'id="{module.__name__}.{member}"' not in text:
                    out.append(f"fh.{name}.{member}: not documented on fh.{name}'s page")
        elif f'id="functional_hsdp.{name}"' not in page.read_text():
            out.append(f"fh.{name}: its page documents no object of that name")
    for source in sorted((ROOT / "notebooks").glob("*.py")):
        page = html / "notebooks" / f"{source.stem}.html"
        if not page.exists():
            out.append(f"notebooks/{source.stem}: no page")
            continue
        # a figure is drawn by plt.show() at the end of a cell (or by a cell's last figure)
        drawn = len(re.findall(r"^plt\.show\(\)|^fig\.show\(\)", source.read_text(), re.M))
        shown = len(re.findall(r'<img [^>]*src="[^"]*\.png"', page.read_text()))
        if shown < max(drawn, 1):
            out.append(f"notebooks/{source.stem}: {shown} plots on its page, {drawn} drawn")
    return out


if __name__ == "__main__":
    html = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "_build" / "html")
    found = problems(html)
    for line in found:
        print(line, file=sys.stderr)
    n_pages = len(fh.__all__)
    print(f"site: {n_pages} API pages, notebook plots: {'ok' if not found else 'MISSING'}")
    sys.exit(1 if found else 0)
