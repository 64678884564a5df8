"""The runnable examples in storage's docstrings run (they are memory:// or pure URL math)."""

from __future__ import annotations

import doctest
import importlib

import pytest

import storage


@pytest.mark.parametrize("module", ["storage.config", "storage.fs", "storage.retry", "storage.layout", "storage.tables",
                                    "storage.checkpoints", "storage.manifest"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_public_api_is_explicit():
    assert len(storage.__all__) == len(set(storage.__all__))
    for name in storage.__all__:
        assert hasattr(storage, name), name
