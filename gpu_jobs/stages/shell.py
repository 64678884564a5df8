"""Each stage declared once: `@stage` wraps a compute in the commit shell and registers it.

    @stage("reward", timer="timing_s/reward")
    def reward(run, roles, k, batch_uri) -> Output:
        table = read(run, batch_uri, ["uid", "response_ids"])
        ...
        return Output(out_table, metrics, inputs=[batch_uri])

The result is a `StageSpec`, called like the compute (`reward(run, roles, k, batch_uri)`
returns the manifest URI). Everything that runs a stage reads its spec and nothing else: the graph
(`graph.run_iteration` calls the spec objects, so go-to-definition lands here), the Prefect tasks
(`tasks.stages.stage_task`), remote placement (`where`: which pool, `flows/remote.py`), the
deployment it goes to, and whether the run's algorithm needs it (`needed`). Adding a stage is one
decorated function and one line in the graph.

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
from typing import Any, Callable, Literal

import pyarrow as pa

from storage import committed, read_table, write_table

__all__ = ["Output", "StageSpec", "STAGES", "Where", "stage", "read"]

# Where a stage runs. "flow": always in the flow's process (work over committed tables, or models
# the flow keeps: remote placement refuses those configs). "trainer" / "rollout": in the flow's
# process with placement=colocated; with placement=remote, a run of the trainer's or the rollout
# pool's deployment that loads its model from storage. "colocated": an in-memory hand-off between
# the roles of one process that commits nothing; with placement=remote there is nothing to hand off.
Where = Literal["flow", "trainer", "rollout", "colocated"]


@dataclass
class Output:
    """What a stage's compute hands to the shell: its table, its metrics, and the references
    (URIs) of what it was computed from, recorded in the manifest (None entries are dropped)."""

    table: pa.Table
    metrics: dict[str, Any] = field(default_factory=dict)
    inputs: list[str | None] = field(default_factory=list)


class StageSpec:
    """One stage: its name (the folder it commits to and the task's name), its compute, the
    metric its wall time goes to, when the run needs it, where it runs and whether it commits.

    Calling it runs the compute inside the commit shell (a stage that commits) or as it is (a
    `commits=False` hand-off, whose return value is not a manifest). `compute` and `shell` are
    attributes, so a test or the chaos harness can wrap either for one run
    (`monkeypatch.setattr(spec, "compute", f)`; wrapping `shell` also sees the commit's faults).
    """

    def __init__(self, name: str, compute: Callable[..., Any], *, timer: str | None = None,
                 needed: Callable[[Any], bool] | None = None, where: Where = "flow", commits: bool = True):
        self.name, self.compute, self.timer, self.needed = name, compute, timer, needed
        self.where, self.commits = where, commits
        functools.update_wrapper(self, compute)  # name, docstring and signature of the compute

    def __repr__(self) -> str:
        return f"<stage {self.name!r} ({self.where})>"

    def is_needed(self, cfg: Any) -> bool:
        """Whether the run's algorithm needs this stage (the flow does not even start a task for
        one it does not: a task run costs ~25 ms of API calls when it does nothing)."""
        return self.needed is None or bool(self.needed(cfg))

    def __call__(self, run: Any, roles: Any, k: int, *input_uris: Any, **named_inputs: Any) -> Any:
        return self.shell(run, roles, k, *input_uris, **named_inputs)

    def shell(self, run: Any, roles: Any, k: int, *input_uris: Any, **named_inputs: Any) -> Any:
        """The compute inside the commit shell (what calling the stage does)."""
        if not self.commits:
            return self.compute(run, roles, k, *input_uris, **named_inputs)
        if not self.is_needed(run.cfg):
            return None
        dest = run.layout.stage(k, self.name)
        if uri := committed(dest, run.storage):
            return uri
        t0 = time.perf_counter()
        out = self.compute(run, roles, k, *input_uris, **named_inputs)
        metrics = dict(out.metrics)
        if self.timer is not None:
            metrics.setdefault(self.timer, time.perf_counter() - t0)
        return write_table(dest, out.table, inputs=[u for u in out.inputs if u], metrics=metrics, storage=run.storage)


STAGES: dict[str, StageSpec] = {}  # every declared stage by name, in declaration order


def stage(name: str, *, timer: str | None = None, needed: Callable[[Any], bool] | None = None,
          where: Where = "flow", commits: bool = True) -> Callable[[Callable[..., Any]], StageSpec]:
    """Declare `compute(run, roles, k, *input_uris) -> Output` as the stage `name`.

    `timer`: the metric the compute's wall time is recorded under (unless it sets it itself);
    `needed(cfg)`: False makes the stage return None at once (an optional stage); `where`: see
    `Where`; `commits=False`: no manifest (an in-memory hand-off; its compute returns what it likes).
    """
    def declare(compute: Callable[..., Any]) -> StageSpec:
        if name in STAGES:
            raise ValueError(f"stage {name!r} is declared twice: {STAGES[name].compute.__module__} and "
                             f"{compute.__module__}; give the new one its own name")
        spec = STAGES[name] = StageSpec(name, compute, timer=timer, needed=needed, where=where, commits=commits)
        return spec

    return declare


def read(run: Any, uri: str | None, columns: list[str] | None = None) -> pa.Table | None:
    """A committed table of this run (only what its manifest lists), or None for no URI."""
    return read_table(uri, columns=columns, storage=run.storage) if uri else None
