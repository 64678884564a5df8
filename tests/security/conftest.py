"""Fixtures for the security checks: a tiny run on the built-in model, and distinctive secrets.

The secrets are fresh per test and shaped like real AWS credentials (the secret holds '/' and
'+', as AWS secret keys do), so a leak shows up as an exact substring nowhere else produced.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny import EXAMPLE, tiny_overrides


@dataclass(frozen=True)
class Secrets:
    key: str
    secret: str
    token: str

    def all(self) -> dict[str, str]:
        return {"key": self.key, "secret": self.secret, "token": self.token}


@pytest.fixture
def secrets() -> Secrets:
    tag = uuid.uuid4().hex.upper()
    return Secrets(key=f"AKIA{tag[:16]}", secret=f"wJal/{tag[:20]}+SecretKey", token=f"FwoGZXIvYXdzE{tag[:24]}Tok")


@pytest.fixture(scope="session")
def example_path() -> Path:
    return EXAMPLE


@pytest.fixture(scope="session")
def tiny():
    """tiny(root, *extra) -> the override list of a tiny run under `root`."""
    return tiny_overrides
