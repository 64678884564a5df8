"""The one error type the trainer raises for bad inputs: it names the problem and the fix."""

from __future__ import annotations

__all__ = ["TrainInputError"]


class TrainInputError(ValueError):
    """A batch, config or checkpoint the trainer cannot use.

    Raised before any weight changes, so a failed update leaves the model as it was. The message
    says what is wrong and how to fix it, e.g. ``advantages row 3 has NaN at token 5: ...``.
    """
