"""What a rank group raises when a rank fails or the state it held is gone."""

from __future__ import annotations

__all__ = ["RankGroupError", "TrainerStateLostError"]


class RankGroupError(RuntimeError):
    """A rank of the group raised or died; the group has been torn down.

    ``rank``/``pid``: the rank that failed first (None when only the launcher failed);
    ``traceback_text``: its Python traceback, or how it died; ``command``: the call that failed;
    ``log_tail``: the end of the launcher's and ranks' output."""

    def __init__(self, message: str, *, rank: int | None = None, pid: int | None = None,
                 traceback_text: str = "", command: str | None = None, log_tail: str = ""):
        super().__init__(message)
        self.rank, self.pid, self.traceback_text = rank, pid, traceback_text
        self.command, self.log_tail = command, log_tail


class TrainerStateLostError(RankGroupError):
    """The group that held updates applied since the last save/load died: its weights and
    optimizer state are gone. ``load(url)`` a checkpoint (then replay), or ``reset()`` to the
    start model."""
