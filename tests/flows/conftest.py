"""Fixtures for the flow tests: a tiny run config on the built-in model and task."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"

# Small enough that an iteration takes a second or two on 2 busy cores.
TINY = [
    "data.train_batch_size=8",
    "rollout.n=4",
    "data.val_size=32",
    "data.train_size=600",
    "actor.ppo_mini_batch_size=4",
    "trainer.tensorboard=false",
    "trainer.samples_in_artifact=2",
]


def tiny_overrides(root: str, *extra: str) -> list[str]:
    return [f"root={root}", *TINY, *extra]


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
