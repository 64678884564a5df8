"""Where the documentation's text lives, for the tests that check it: README.md (the front door)
and the pages of the docs site, in the order of mkdocs.yml's nav (the order a reader and the
walkthrough follow). Pages the build generates (reference/config.md, reference/metrics.md, made by
scripts/docs_hooks.py) have no file and are left out."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
WALKED = "Running it for real"  # the nav section whose bash blocks tests/test_readme_walkthrough.py runs


def _flatten(items) -> list[str]:
    pages = []
    for item in items:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, list):
            pages += _flatten(item)
        elif isinstance(item, dict):
            for value in item.values():
                pages += [value] if isinstance(value, str) else _flatten(value)
    return pages


def nav(section: str | None = None) -> list[str]:
    """The nav's pages (paths under docs/) in order; `section`: only that top-level section's."""
    items = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    if section is not None:
        items = [v for item in items if isinstance(item, dict) for k, v in item.items() if k == section]
        assert items, f"mkdocs.yml's nav has no section {section!r}"
    return _flatten(items)


def pages(section: str | None = None) -> list[Path]:
    """The nav's pages that are files in docs/, in nav order."""
    return [DOCS / p for p in nav(section) if (DOCS / p).is_file()]


def text(section: str | None = None) -> str:
    """The pages' text joined in nav order (a section's, or every page's)."""
    return "\n\n".join(p.read_text() for p in pages(section))


def readme_and_docs() -> str:
    """README.md, then every page of the site: every command and key a reader is shown."""
    return (REPO / "README.md").read_text() + "\n\n" + text()


def page(name: str) -> str:
    """One page's text (`name` under docs/, e.g. "guide/verl-data-s3.md")."""
    return (DOCS / name).read_text()


def section_of(markdown: str, heading: str) -> str:
    """The text under the first heading whose title starts with `heading` (any level), up to the
    next heading of the same or a higher level; `# lines` inside code blocks are no headings."""
    lines, fenced, level, out = markdown.splitlines(), False, None, []
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"(#+) (.*)", line)
        if level is None:
            if m and m.group(2).startswith(heading):
                level = len(m.group(1))
            continue
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    assert level is not None, f"no heading {heading!r}"
    return "\n".join(out)
