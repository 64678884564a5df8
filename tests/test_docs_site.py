"""The documentation holds together: the site builds with `mkdocs build --strict` (a broken link or
anchor, a page missing from the nav, or a missing generated reference page fails it), README.md's
links reach pages and headings that exist, the README stays a short front door, every repository
path the docs name in backticks exists, nothing cites documents outside the repository, and the
built home page renders in a real browser (headless Chromium) as something other than a blank page.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unicodedata
import zlib
from pathlib import Path

import pytest

from tests import docs_pages

REPO = docs_pages.REPO
README = REPO / "README.md"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for the module as `make docs` builds it (strict, the hooks included)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                           "-d", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-5000:]}"
    assert "WARNING" not in log, log[-5000:]  # strict turns warnings into a failure; say which, if any slipped by
    return out


def test_the_site_builds_strict_with_every_nav_page(site):
    for page in docs_pages.nav():  # generated pages (the hooks') included
        stem = page.removesuffix(".md")  # directory URLs: guide/configs.md -> guide/configs/index.html
        built = site / (f"{stem}.html" if stem == "index" or stem.endswith("/index") else f"{stem}/index.html")
        assert built.is_file(), f"{page}: not built ({built.relative_to(site)})"


# ---------------------------------------------------------------------------------- the README
def test_the_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/ (at most 300)"
    text = README.read_text()
    assert text.index("make run") < text.index("## Running it for real") < text.index("## Reference")


def _slug(title: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify), after the
    inline markup it strips: code ticks, links, emphasis."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").replace("*", "")
    title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    title = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", title)


def _anchors(markdown: str) -> set[str]:
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*?)\s*(\{#([\w-]+)\})?$", line)
        if m:
            anchors.add(m.group(3) or _slug(m.group(1)))
    return anchors


def test_every_relative_link_of_the_readme_reaches_a_page_and_heading():
    text = README.read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://|mailto:", t)]
    assert len(links) >= 20, links  # the README is mostly a map into docs/
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (REPO / path) if path else README
        if not target.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and anchor not in _anchors(target.read_text()):
            broken.append(f"{link}: {path or 'README.md'} has no heading #{anchor}")
    assert not broken, broken


# ------------------------------------------------------------------------ paths and citations
TOP = ("flows", "tasks", "gpu_jobs", "storage", "deployments", "examples", "benchmarks", "tests", "scripts", "docs")
FILES = ("Makefile", "pyproject.toml", "mkdocs.yml", "README.md")


def _repo_paths(markdown: str) -> set[str]:
    """Repository paths written in backticks (`gpu_jobs/stages/graph.py`, `tests/x.py::test_y`,
    `benchmarks/results/`), outside code blocks; placeholders (`<file>`) are not paths."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found = set()
    for code in re.findall(r"`([^`\n]+)`", prose):
        for word in code.split():
            word = word.split("::")[0].rstrip(".,;:)")
            if re.fullmatch(r"[\w./*-]+", word) and (word.split("/")[0] in TOP and "/" in word or word in FILES):
                found.add(word)
    return found


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for page in [README, *docs_pages.pages()]:
        for path in sorted(_repo_paths(page.read_text())):
            if not any(REPO.glob(path.rstrip("/"))):
                missing.append(f"{page.relative_to(REPO)}: `{path}`")
    assert not missing, f"paths the docs name that do not exist (moved? update the page): {missing}"


def test_every_module_the_docs_run_exists():
    """`python -m flows.online.feedback ...`: a module that moved leaves the command behind."""
    missing = []
    for page in [README, *docs_pages.pages()]:
        for module in sorted(set(re.findall(r"-m ([\w.]+)", page.read_text()))):
            if module.split(".")[0] not in TOP:
                continue  # pytest, mkdocs, pip, ...: not the repository's
            base = REPO / module.replace(".", "/")
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                missing.append(f"{page.relative_to(REPO)}: python -m {module}")
    assert not missing, f"modules the docs run that do not exist (moved? update the page): {missing}"


def test_no_file_cites_documents_outside_the_repository():
    # Spelt in pieces, so this file does not cite them either.
    outside = ("DESIGN" + ".md", "PLATFORM" + ".md", "../" + "shared")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    cited = []
    for name in filter(None, files):
        path = REPO / name
        if not path.is_file() or path.suffix in (".png", ".parquet", ".safetensors", ".gz", ".whl"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        cited += [f"{name}: {word}" for word in outside if word in text]
    assert not cited, f"files citing documents outside the repository (state the fact, or link docs/): {cited}"


# ------------------------------------------------------------------------- the page in a browser
def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of raw pixel bytes) of an 8-bit RGB or RGBA PNG, its filters undone:
    enough to see what a screenshot shows without an imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos: pos + 8])
        chunk = data[pos + 8: pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6), header
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1: (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i: i + 3]) for r in rows[::4] for i in range(0, len(r), bpp * 4)]


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (scripts/ensure_test_tools.sh installs it)")
def test_the_home_page_renders_in_a_browser(site, tmp_path):
    shot = tmp_path / "home.png"
    profile = tempfile.mkdtemp(prefix="rlmill-chromium-")
    try:
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--window-size=1200,900",
                        f"--screenshot={shot}", (site / "index.html").as_uri()],
                       capture_output=True, timeout=90)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.is_file() and shot.stat().st_size > 10_000, "no screenshot, or a tiny one"
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 900)
    # A blank page is one colour; the home page has the theme's header bar, text and a code block.
    colours = set(pixels)
    dark = sum(1 for p in pixels if sum(p) < 3 * 128)
    assert len(colours) > 50 and dark > len(pixels) // 200, (len(colours), dark, len(pixels))
