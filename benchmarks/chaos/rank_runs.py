"""Chaos for runs whose update is a warm group of 2 DeepSpeed ranks (trainer.n_gpus_per_node=2):
`rlmill train` (the Prefect flow) SIGKILLed after the group trained update 2 in memory, before
anything of it committed; the resumed run must start one new group, replay, and end with the
weights of an uninterrupted 2-rank run bitwise, its group started once for the whole run.

    .venv/bin/python -m benchmarks.chaos --only ranks-kill-after-train
"""

from __future__ import annotations

from .audit import audit, snapshot
from .harness import ITERATIONS, Chaos, Outcome, layout
from .scenarios import SCENARIOS, _result, _tail, scenario

RANKS = ("trainer.n_gpus_per_node=2", "actor.zero_stage=3")


def group_starts(root: str, run_id: str) -> list[float]:
    """perf/rank_group_starts of every committed update, in iteration order."""
    from storage import committed, read_manifest

    lay, out = layout(root, run_id), []
    for k in range(1, ITERATIONS + 1):
        uri = committed(lay.stage(k, "update"))
        if uri:
            out.append(read_manifest(uri).metrics.get("perf/rank_group_starts", float("nan")))
    return out


@scenario("ranks-kill-after-train", "2 ranks: SIGKILL after the group trained update 2, before it committed, "
                                    "then resume")
def ranks_kill_after_train(chaos: Chaos) -> Outcome:
    name = "ranks-kill-after-train"
    reference_starts = group_starts(chaos.reference_root(RANKS), "r")
    root = str(chaos.work / name)
    chaos.kill_at(root, "r", "after-train:update:2", extra=RANKS)
    before = snapshot(layout(root, "r"))
    done = chaos.finish(root, "r", *RANKS)
    report = audit(layout(root, "r"), before, ITERATIONS)
    ok = done.returncode == 0
    resumed_starts = group_starts(root, "r")
    what = (f"killed with update 2 trained in the group ({len(before)} manifests committed); "
            f"group starts per update: uninterrupted {reference_starts}, resumed {resumed_starts}")
    once = reference_starts == [1.0] * ITERATIONS == resumed_starts
    outcome = f"{what}; resumed and completed" if ok else f"{what}; resume failed: {_tail(done.stdout)}"
    return _result(SCENARIOS[name][0], outcome, ok and once, report,
                   chaos.same_as_reference(root, "r", extra=RANKS) if ok else "-")
