"""Which prompts an iteration trains on: a pure function of (seed, epoch, step), so a resumed
run sees exactly the prompts it would have seen.

    >>> from gpu_jobs.data import PromptSampler
    >>> PromptSampler(seed=0, batch_size=4, n_rows=10).indices(0)   # iteration 1's rows
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_and_step", "epoch_permutation", "sample_batch", "PromptSampler"]


def epoch_and_step(iteration: int, batch_size: int, n_rows: int) -> tuple[int, int]:
    """(epoch, step within epoch) of a 0-based `iteration`; an epoch is n_rows // batch_size
    batches (the leftover rows of each permutation are skipped, like verl's drop_last=True)."""
    if batch_size <= 0 or n_rows <= 0:
        raise ValueError(f"batch_size and n_rows must be > 0, got {batch_size=} {n_rows=}")
    if batch_size > n_rows:
        raise ValueError(f"batch_size {batch_size} is larger than the dataset ({n_rows} rows)")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    steps_per_epoch = n_rows // batch_size
    return iteration // steps_per_epoch, iteration % steps_per_epoch


def epoch_permutation(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    """The row order of one epoch: a permutation of range(n_rows) seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def sample_batch(seed: int, iteration: int, batch_size: int, n_rows: int) -> list[int]:
    """Row indices of training batch `iteration`: batch k of the permutation of its epoch.

    A pure function of its arguments, so a resumed run sees exactly the prompts it would have
    seen. Epoch e covers iterations [e*S, (e+1)*S) with S = n_rows // batch_size.
    """
    epoch, step = epoch_and_step(iteration, batch_size, n_rows)
    perm = epoch_permutation(seed, epoch, n_rows)
    return perm[step * batch_size : (step + 1) * batch_size].tolist()


class PromptSampler:
    """Deterministic training batches over a dataset of `n_rows` rows.

        >>> s = PromptSampler(seed=0, batch_size=4, n_rows=10)
        >>> s.indices(0), s.epoch(5)          # iteration 5 is epoch 2 (2 batches per epoch)
    """

    def __init__(self, *, seed: int, batch_size: int, n_rows: int):
        epoch_and_step(0, batch_size, n_rows)  # validates the arguments
        self.seed, self.batch_size, self.n_rows = seed, batch_size, n_rows

    @property
    def steps_per_epoch(self) -> int:
        return self.n_rows // self.batch_size

    def epoch(self, iteration: int) -> int:
        return epoch_and_step(iteration, self.batch_size, self.n_rows)[0]

    def indices(self, iteration: int) -> list[int]:
        return sample_batch(self.seed, iteration, self.batch_size, self.n_rows)


# --------------------------------------------------------------------------------------------
# Rendering prompts with the tokenizer's chat template
# --------------------------------------------------------------------------------------------
