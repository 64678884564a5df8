"""Fixtures for the security checks: a tiny run on the built-in model, and distinctive secrets.

The secrets are fresh per test and shaped like real AWS credentials (the secret holds '/' and
'+', as AWS secret keys do), so a leak shows up as an exact substring nowhere else produced.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"

# Small enough that an iteration takes a second or two on 2 busy cores (as tests/flows).
TINY = [
    "data.train_batch_size=8",
    "rollout.n=4",
    "data.val_size=32",
    "data.train_size=600",
    "actor.ppo_mini_batch_size=4",
    "trainer.tensorboard=false",
    "trainer.samples_in_artifact=2",
]


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
    return lambda root, *extra: [f"root={root}", *TINY, *extra]
