"""mkdocs hooks (mkdocs.yml `hooks:`): the reference pages generated from the code at each build,
so the site always shows the current config keys and metric names (flows/reference.py).

    mkdocs build --strict        # adds reference/config.md and reference/metrics.md

or, without a site (mkdocs calls the hook through its plugin collection):

    >>> from mkdocs.config.defaults import MkDocsConfig
    >>> from mkdocs.structure.files import Files
    >>> cfg = MkDocsConfig()
    >>> cfg.load_dict({"site_name": "x", "docs_dir": "docs", "hooks": [__file__]}); _ = cfg.validate()
    >>> sorted(f.src_uri for f in cfg.plugins.on_files(Files([]), config=cfg))
    ['reference/config.md', 'reference/metrics.md']
"""

from __future__ import annotations

import sys
from pathlib import Path

# mkdocs loads this file by path, with the repository root maybe not importable (an installed
# mkdocs runs from anywhere): the project's packages come from this checkout.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flows.reference import config_reference, metrics_reference  # noqa: E402

PAGES = {"reference/config.md": config_reference, "reference/metrics.md": metrics_reference}


def on_files(files, config):
    """Add the generated pages; a file of the same name in docs/ is replaced (the code wins)."""
    from mkdocs.structure.files import File

    for uri, render in PAGES.items():
        stale = files.get_file_from_path(uri)
        if stale is not None:
            files.remove(stale)
        files.append(File.generated(config, uri, content=render()))
    return files
