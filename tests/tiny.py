"""The tiny run every end-to-end check uses: the built-in model and task, small enough that an
iteration takes a second or two on 2 busy cores. Shared by tests/*/conftest.py and the chaos
harness (benchmarks/chaos), which import it as `tests.tiny`."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"

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
    """The override list of a tiny run under `root`, then `extra`."""
    return [f"root={root}", *TINY, *extra]
