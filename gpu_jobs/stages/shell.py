"""The commit shell every stage runs inside.

    @stage("reward")
    def reward(run, engines, k, batch_uri) -> Output:
        table = read(run, batch_uri, ["uid", "response_ids"])
        ...
        return Output(out_table, metrics, inputs=[batch_uri])

The shell does what makes a stage safe to retry and to resume: it returns the manifest URI of
(run, k, stage) if that already committed, without computing; otherwise it runs the compute,
adds the stage's timer and commits the table with its metrics and input references by writing
the manifest last (`storage.write_table`). A stage that is not needed by the run's algorithm
returns None before looking at storage. State that outlives a stage is read back from what
committed (the KL controller from the advantages manifest), never changed before the commit.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

from storage import committed, read_table, write_table

__all__ = ["Output", "stage", "read"]


@dataclass
class Output:
    """What a stage's compute hands to the shell: its table, its metrics, and the references
    (URIs) of what it was computed from, recorded in the manifest (None entries are dropped)."""

    table: pa.Table
    metrics: dict[str, Any] = field(default_factory=dict)
    inputs: list[str | None] = field(default_factory=list)


def stage(name: str, *, timer: str | None = None, needed: Callable[[Any], bool] | None = None):
    """Wrap `compute(run, engines, k, *input_uris) -> Output` in the commit shell.

    `timer`: the metric the compute's wall time is recorded under (unless it sets it itself);
    `needed(cfg)`: False makes the stage return None at once (an optional stage).
    """
    def wrap(compute: Callable[..., Output]) -> Callable[..., str | None]:
        @functools.wraps(compute)
        def shell(run: Any, engines: Any, k: int, *input_uris: Any) -> str | None:
            if needed is not None and not needed(run.cfg):
                return None
            dest = run.layout.stage(k, name)
            if uri := committed(dest, run.storage):
                return uri
            t0 = time.perf_counter()
            out = compute(run, engines, k, *input_uris)
            metrics = dict(out.metrics)
            if timer is not None:
                metrics.setdefault(timer, time.perf_counter() - t0)
            return write_table(dest, out.table, inputs=[u for u in out.inputs if u], metrics=metrics,
                               storage=run.storage)

        shell.stage_name = name  # type: ignore[attr-defined]
        return shell

    return wrap


def read(run: Any, uri: str | None, columns: list[str] | None = None) -> pa.Table | None:
    """A committed table of this run (only what its manifest lists), or None for no URI."""
    return read_table(uri, columns=columns, storage=run.storage) if uri else None
