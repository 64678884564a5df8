"""Fixtures for the flow tests: a tiny run config on the built-in model and task."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import EXAMPLE, tiny_overrides


@pytest.fixture(scope="session")
def example_path() -> Path:
    return EXAMPLE


@pytest.fixture(scope="session")
def tiny():
    """tiny(root, *extra) -> the override list of a tiny run under `root`."""
    return tiny_overrides


@pytest.fixture
def tiny_config(tmp_path):
    from flows.config import load_run_config

    def make(*extra: str, root: str | None = None):
        return load_run_config(EXAMPLE, tiny_overrides(root or str(tmp_path / "root"), *extra))

    return make
