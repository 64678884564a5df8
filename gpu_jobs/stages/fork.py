"""A forked run: a new run whose starting state is another run's committed iteration K.

    rlmill train --config F --from RUN@K [--fresh-optimizer] [key=value ...]

    plan = plan_fork(child_cfg, parse_point("my-run@4"))   # every check; reads the parent, writes nothing
    materialize(plan)                                      # the child's copy of checkpoint 4, run.json last

Iteration numbering: the child continues the parent's. Its checkpoint K is a copy of the
parent's and its first own iteration is K+1, so everything that is a function of the iteration
number goes on where the parent was: the prompts (a pure function of (seed, epoch, k)), the
sampling seed, the lr schedule (the trainer's step), checkpoint_every and val_every, the async
schedule. A fork with the parent's config therefore reproduces the parent bit for bit
(tests/flows/test_fork.py). Iterations 1..K stay the parent's: the child's run.json names its
fork point (`forked_from`), and RunLayout.fork_base() makes K the child's "iteration 0", the one
last_committed starts after.

Copied, through storage's copy primitive (every file checked against the parent's manifest, the
copy's manifest written last), so that the child never reads the parent once it exists and
`rlmill verify` checks it on its own:
  - checkpoints/K: policy/ (HF folder), trainer/ (weights, optimizer, step, data cursor, RNG,
    the trainer's KL controller), critic/ when the child has a critic, update_metrics.json;
  - async (staleness s): the published policies the child's rollouts sample with before its own
    first update (after K-s .. K-1);
  - KL in the reward: iteration K's advantages table, whose manifest holds the KL controller
    iteration K+1 starts from;
then LATEST, then run.json (create-only) last: a fork stopped before it leaves files no run owns.

--fresh-optimizer: the child's trainer manifest says so, and loading it takes the weights only
(gpu_jobs/train/checkpoint.py); the Adam moments start at zero, the step (the lr schedule's
position), data cursor and RNG are kept.

Refused with one line (ForkError) before anything is written: a malformed RUN@K, no run RUN, a K
that is not a committed checkpoint (naming those that are), another model (any model.* key),
another kind of training (SFT, DPO/KTO, RL), a trainer layout the checkpoint cannot be loaded
into, nothing left to train, a child run id that already exists as something else. A fork stopped
before its run.json is finished by the same fork into that run id; a copy already there that
differs from this fork's is refused.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpu_jobs.stages.config import RunConfig, frozen_config
from gpu_jobs.stages.lineage import model_source
from gpu_jobs.stages.run import _default_config, _diff
from storage import (INDEX_NAME, CorruptShardError, RunLayout, committed, copy_checkpoint, join, read_manifest,
                     read_pointer, url_to_fs, write_pointer)
from storage.errors import InvalidNameError
from storage.layout import check_name
from storage.manifest import copy_committed

__all__ = ["ForkError", "ForkPoint", "ForkPlan", "parse_point", "plan_fork", "materialize", "forkable_iterations",
           "lineage"]

_POINT = re.compile(r"(?P<run>[^@\s]+)@(?P<k>[0-9]{1,12})")
_UPDATE_METRICS = "update_metrics.json"


class ForkError(ValueError):
    """A fork that cannot be made, worded with its fix (the CLI prints it as one line)."""


@dataclass(frozen=True)
class ForkPoint:
    """Run `run`'s committed iteration `iteration`."""

    run: str
    iteration: int

    def __str__(self) -> str:
        return f"{self.run}@{self.iteration}"


@dataclass(frozen=True)
class ForkPlan:
    """What materialize() writes: the child's config (its run id decided), the fork point, and
    the parent's commits to copy as (what, parent URL, child URL, manifest name)."""

    cfg: RunConfig
    point: ForkPoint
    fresh_optimizer: bool
    copies: list[tuple[str, str, str, str]]
    changes: dict[str, dict[str, Any]]  # dotted key -> {"from": the parent's value, "to": the child's}
    manifests: dict[str, str] = field(default_factory=dict)  # what -> sha256 of the parent's listing
    exists: bool = False  # the child is already this fork (the same command again): nothing to write

    def record(self) -> dict[str, Any]:
        """run.json's `forked_from`."""
        return {"run": self.point.run, "iteration": self.point.iteration, "root": self.cfg.root,
                "fresh_optimizer": self.fresh_optimizer, "manifests": dict(self.manifests)}

    def summary(self) -> str:
        """`P at iteration K (actor.lr 0.0001 -> 5e-05)`: what the CLI prints."""
        changed = ", ".join(f"{k} {v['from']!r} -> {v['to']!r}" for k, v in self.changes.items())
        extra = "; fresh optimizer" if self.fresh_optimizer else ""
        return f"{self.point.run} at iteration {self.point.iteration} ({changed or 'same config'}{extra})"


def parse_point(text: Any) -> ForkPoint:
    """`RUN@K` -> ForkPoint; ForkError naming the form otherwise."""
    m = _POINT.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ForkError(f"--from {text!r} is not RUN@K: give a run id and one of its checkpointed iterations, "
                        "e.g. --from grpo-arith-20261201-093000@4")
    try:
        run = check_name(m["run"], "run id")
    except InvalidNameError as exc:
        raise ForkError(f"--from {text!r}: {exc}") from None
    k = int(m["k"])
    if k < 1:
        raise ForkError(f"--from {text!r}: iteration 0 is the start model, not a checkpoint: give a checkpointed "
                        "iteration >= 1, or train without --from")
    return ForkPoint(run, k)


def forkable_iterations(layout: RunLayout) -> list[int]:
    """The iterations of a run a fork can start from: a committed iteration whose checkpoint holds
    a committed policy and trainer state (a run's own fork point counts: it has no iteration of its own)."""
    fs, path = url_to_fs(join(layout.root, "checkpoints"), layout.storage)
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)] if fs.exists(path) else []
    base, storage = layout.fork_base(), layout.storage
    return sorted(k for k in (int(n) for n in names if n.isascii() and n.isdigit() and len(n) <= 12)
                  if k >= 1 and committed(layout.trainer(k), storage) and committed(layout.policy(k), storage,
                                                                                      name=INDEX_NAME)
                  and (k == base or committed(layout.stage(k, "commit"), storage)))


def plan_fork(cfg: RunConfig, point: ForkPoint, *, fresh_optimizer: bool = False) -> ForkPlan:
    """Every check of a fork of `point` into the run `cfg` describes (run id decided), reading
    the parent only; ForkError, one line, for what cannot be forked."""
    parent = RunLayout(cfg.root, point.run, cfg.storage)
    frozen = parent.read_run_json()
    if frozen is None:
        raise ForkError(f"--from {point}: no run {point.run!r} under {cfg.root}: check the run id and root=")
    k = point.iteration
    if k not in (ks := forkable_iterations(parent)):
        held = ", ".join(map(str, ks))
        raise ForkError(f"--from {point}: run {point.run} has no committed checkpoint at iteration {k}; "
                        + (f"it has checkpoints at {held}: give one of them" if ks else
                           "it has no checkpoint yet (trainer.checkpoint_every sets how often a run saves one)"))
    if cfg.trainer.total_iterations <= k:
        raise ForkError(f"--from {point}: trainer.total_iterations={cfg.trainer.total_iterations} leaves nothing "
                        f"to train after iteration {k}: raise it (the fork goes on at iteration {k + 1})")
    changes = config_changes(frozen.get("config", {}), frozen_config(cfg))
    _check_same_model(point, changes)
    if (was := training_kind(frozen.get("config", {}))) != (now := training_kind(frozen_config(cfg))):
        raise ForkError(f"--from {point}: run {point.run} trains with {was} and this config with {now}: a fork goes on "
                        "with its parent's kind of training and reference; to train on that run's weights another "
                        "way, set model.path to its checkpoints/<k>/policy folder (a chain, docs/guide/sft.md)")
    trainer_state = read_manifest(parent.trainer(k), cfg.storage).extra.get("trainer_state", {})
    _check_layout(point, trainer_state, cfg, fresh_optimizer)
    copies = _copies(parent, RunLayout(cfg.root, cfg.run_id, cfg.storage), cfg, k)
    manifests = {what: read_manifest(src, cfg.storage, name=name).sha256 for what, src, _, name in copies}
    plan = ForkPlan(cfg, point, fresh_optimizer, copies, changes, manifests)
    return _against_existing_child(plan)


def config_changes(parent: dict, child: dict) -> dict[str, dict[str, Any]]:
    """Dotted keys whose value differs between two frozen configs, with both values (run_id
    aside: a fork always has its own)."""
    child = json.loads(json.dumps(child, default=str))
    out = {}
    for path in _diff(parent, child, _default_config()):
        if path == ("run_id",):
            continue
        out[".".join(map(str, path))] = {"from": _at(parent, path, _at(_default_config(), path)),
                                         "to": _at(child, path)}
    return out


def training_kind(config: dict) -> str:
    """What a frozen config trains: 'SFT', 'DPO/KTO' (a preference: section) or 'RL'."""
    return "SFT" if config.get("sft") else "DPO/KTO" if config.get("preference") else "RL"


def _at(tree: Any, path: tuple, missing: Any = None) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return missing
        tree = tree[part]
    return tree


def _check_same_model(point: ForkPoint, changes: dict[str, dict]) -> None:
    model = [k for k in changes if k.startswith("model.")]
    if model:
        shown = ", ".join(f"{k}={changes[k]['to']!r} (the parent's: {changes[k]['from']!r})" for k in model)
        raise ForkError(f"--from {point}: {shown}: a fork goes on from the parent's weights and reference model, "
                        "so it keeps the parent's model; drop the model.* overrides, or start a new run without --from")


def _check_layout(point: ForkPoint, state: dict, cfg: RunConfig, fresh_optimizer: bool) -> None:
    """The parent's trainer state loads into the child's trainer: the same layout, or one
    gpu_jobs/train/reshard.py reshards (world size and ZeRO stage, no pipeline on either side)."""
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    pp = cfg.actor.pipeline_parallel_size
    mine = (world, cfg.actor.resolved_zero_stage(world // pp), pp)
    saved = (state.get("world_size"), state.get("zero_stage"), state.get("pipeline_parallel_size", 1))
    if saved != mine and (saved[2] != 1 or mine[2] != 1):
        raise ForkError(f"--from {point}: its trainer state was saved with world_size={saved[0]}, zero_stage="
                        f"{saved[1]}, pipeline_parallel_size={saved[2]}, and this config trains with {mine[0]}, "
                        f"{mine[1]}, {mine[2]}: pipeline-parallel states do not reshard (gpu_jobs/train/reshard.py "
                        "handles world size and ZeRO stage without a pipeline); keep the parent's layout")
    if fresh_optimizer and (pp > 1 or cfg.model.lora_rank > 0):
        raise ForkError(f"--from {point} --fresh-optimizer: the weights-only load needs a full, non-pipeline "
                        "trainer (model.lora_rank=0, actor.pipeline_parallel_size=1); leave --fresh-optimizer out")


def _copies(parent: RunLayout, child: RunLayout, cfg: RunConfig, k: int) -> list[tuple[str, str, str, str]]:
    """(what, parent URL, child URL, manifest name) of every commit the child needs, in copy order."""
    storage = cfg.storage
    out = [("policy", parent.policy(k), child.policy(k), INDEX_NAME),
           ("trainer", parent.trainer(k), child.trainer(k), "_MANIFEST.json")]
    critic = join(parent.checkpoint(k), "critic")
    if cfg.critic is not None and committed(critic, storage):
        out.append(("critic", critic, join(child.checkpoint(k), "critic"), "_MANIFEST.json"))
    s = cfg.async_training.staleness_threshold
    for v in sorted({cfg.async_training.weights_version(j) for j in range(k + 1, k + s + 1)} - {0, k}):
        if not committed(parent.policy(v), storage, name=INDEX_NAME):
            raise ForkError(f"--from {parent.run_id}@{k}: async_training.staleness_threshold={s} samples iteration "
                            f"{k + 1} with the weights after update {v}, which run {parent.run_id} did not publish; "
                            "fork at another iteration or with a lower staleness_threshold")
        out.append((f"policy {v}", parent.policy(v), child.policy(v), INDEX_NAME))
    if cfg.algorithm.use_kl_in_reward and committed(parent.stage(k, "advantages"), storage):
        out.append(("advantages", parent.stage(k, "advantages"), child.stage(k, "advantages"), "_MANIFEST.json"))
    return out


def _against_existing_child(plan: ForkPlan) -> ForkPlan:
    """A child id that names an existing run: the same fork again resumes it; anything else is refused."""
    child = RunLayout(plan.cfg.root, plan.cfg.run_id, plan.cfg.storage)
    frozen = child.read_run_json()
    if frozen is None:
        return plan
    was = frozen.get("forked_from") or {}
    if (was.get("run"), was.get("iteration")) == (plan.point.run, plan.point.iteration):
        return ForkPlan(plan.cfg, plan.point, plan.fresh_optimizer, plan.copies, plan.changes, plan.manifests, True)
    what = f"a fork of {was.get('run')}@{was.get('iteration')}" if was else "not a fork"
    raise ForkError(f"--from {plan.point}: run {plan.cfg.run_id} already exists ({what}): --from starts a new run; "
                    "leave run_id out (a fresh id) or name a new one")


def materialize(plan: ForkPlan) -> None:
    """Write the child: each commit copied and checked (its manifest last), update_metrics.json,
    LATEST, then run.json, create-only, last. Idempotent: a second call after a crash finishes it."""
    if plan.exists:
        return
    cfg, k = plan.cfg, plan.point.iteration
    child = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    try:
        for what, src, dest, name in plan.copies:
            _copy(plan, what, src, dest, name)
    except CorruptShardError as exc:
        raise ForkError(f"--from {plan.point}: its checkpoint is damaged ({exc}); nothing was published: fork "
                        "from another checkpoint (`rlmill verify` checks the parent)") from None
    parent = RunLayout(cfg.root, plan.point.run, cfg.storage)
    metrics = read_pointer(join(parent.checkpoint(k), _UPDATE_METRICS), cfg.storage)
    if metrics is not None:
        write_pointer(join(child.checkpoint(k), _UPDATE_METRICS), metrics, cfg.storage)
    child.set_latest(k)
    source = model_source(cfg.model.path, cfg.storage)  # the parent's start weights, when a run made them (an SFT run)
    child.write_run_json({"run_uid": uuid.uuid4().hex, "created_at": time.time(), "config": frozen_config(cfg),
                          **({"model_source": source} if source else {}),
                          "forked_from": plan.record(), "config_changes": plan.changes})


def _copy(plan: ForkPlan, what: str, src: str, dest: str, name: str) -> None:
    """One commit into the child; a copy already there (an unfinished earlier fork under this run
    id) must be this one: the same listing and, for the trainer, the same --fresh-optimizer."""
    storage = plan.cfg.storage
    if name == INDEX_NAME:
        copy_checkpoint(src, dest, storage)
    elif what == "trainer":
        state = read_manifest(src, storage).extra["trainer_state"]
        copy_committed(src, dest, storage, extra={"trainer_state": {
            **state, "fresh_optimizer": plan.fresh_optimizer, "forked_from": str(plan.point)}})
    else:
        copy_committed(src, dest, storage)
    copy = read_manifest(dest, storage, name=name)
    fresh = copy.extra.get("trainer_state", {}).get("fresh_optimizer", plan.fresh_optimizer)
    if copy.sha256 != plan.manifests[what] or fresh != plan.fresh_optimizer:
        raise ForkError(f"--from {plan.point}: run {plan.cfg.run_id} already holds another {what} at {dest} (an "
                        "unfinished earlier fork into that run id): fork under a new run_id")


def lineage(root: str, run_id: str, storage: Any = None, most: int = 32) -> list[str]:
    """The runs `run_id` was forked from, nearest first, as `RUN@K` (empty for a run not forked).
    Reads each run.json on the way; stops at a run that is gone, a loop, or `most` steps."""
    out, seen = [], {run_id}
    while len(out) < most:
        try:
            frozen = RunLayout(root, run_id, storage).read_run_json() or {}
        except (InvalidNameError, ValueError):
            break
        was = (frozen.get("forked_from") if isinstance(frozen, dict) else None) or {}
        if not isinstance(was, dict) or not isinstance(was.get("run"), str) or was["run"] in seen:
            break
        out.append(f"{was['run']}@{was.get('iteration')}")
        run_id = was["run"]
        seen.add(run_id)
    return out
