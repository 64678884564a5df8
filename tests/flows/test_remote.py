"""Remote placement: GPU stages rebuilt from storage alone give the colocated run's weights.

Each `rl_stage` call below is what a run of the `rl-stage/gpu` deployment does in its own
process: it reads run.json and checkpoints, never the caller's memory. Here the calls run
in-process (`.fn`, no Prefect); tests/deployments runs them through a real worker.
"""

from __future__ import annotations

import pytest
import torch

from flows.remote import rl_stage
from gpu_jobs import stages
from gpu_jobs.stages import Run, open_warm
from storage import committed, load_state_dict

pytestmark = pytest.mark.deepspeed


def _iteration_remote(cfg, k: int) -> None:
    run = Run.open(cfg)  # the flow side: no model loaded
    rollout = rl_stage.fn(cfg.root, cfg.run_id, k, "rollout")
    batch = stages.gate(run, None, k, rollout)
    reward = stages.reward(run, None, k, batch)
    adv = stages.advantages(run, None, k, batch, reward)
    rl_stage.fn(cfg.root, cfg.run_id, k, "update", [adv])


def _iteration_colocated(run, roles, k: int) -> None:
    rollout = stages.rollout(run, roles, k)
    batch = stages.gate(run, roles, k, rollout)
    reward = stages.reward(run, roles, k, batch)
    adv = stages.advantages(run, roles, k, batch, reward)
    stages.update(run, roles, k, adv)
    stages.weights_to_rollout(run, roles, k)


def test_remote_stages_match_the_colocated_run_bitwise(tiny_config, tmp_path):
    extra = ("trainer.total_iterations=2", "trainer.checkpoint_every=1")
    remote = tiny_config(*extra, "trainer.placement=remote", root=str(tmp_path / "remote"))
    local = tiny_config(*extra, root=str(tmp_path / "local"))
    for k in (1, 2):
        _iteration_remote(remote, k)
    run, roles = open_warm(local)
    for k in (1, 2):
        _iteration_colocated(run, roles, k)
    a = load_state_dict(str(tmp_path / "remote" / "runs" / remote.run_id / "checkpoints" / "2" / "policy"))
    b = load_state_dict(str(tmp_path / "local" / "runs" / local.run_id / "checkpoints" / "2" / "policy"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # Validation runs remotely too, on the checkpointed weights.
    uri = rl_stage.fn(remote.root, remote.run_id, 2, "validate")
    assert uri.endswith("iterations/2/validate/_MANIFEST.json")


def test_remote_placement_requires_per_iteration_checkpoints(tiny_config):
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint_every=1"):
        tiny_config("trainer.placement=remote", "trainer.checkpoint_every=2")


class _InProcessRemote:
    """The graph's calls as remote placement makes them, without Prefect: GPU stages through
    `rl_stage.fn` (what a deployment run executes, from storage alone), the rest with no roles.
    Records which deployment each GPU stage would have gone to."""

    def __init__(self, cfg):
        from flows.remote import REMOTE_POOLS

        self.cfg, self.run, self.remote, self.sent = cfg, Run.open(cfg), REMOTE_POOLS, []

    def __call__(self, stage, k, *inputs):
        if stage.where in self.remote:
            if not committed(self.run.layout.stage(k, stage.name), self.run.storage):  # run_remote starts none then
                self.sent.append((self.cfg.trainer.deployment_for(stage.where), stage.name, k))
            return rl_stage.fn(self.cfg.root, self.cfg.run_id, k, stage.name, list(inputs))
        if stage.where == "colocated":
            return 0.0
        return stage(self.run, None, k, *inputs)

    def start(self, stage, k, *inputs):
        result = self(stage, k, *inputs)
        return lambda: result


ASYNC_REMOTE = ("trainer.total_iterations=3", "trainer.checkpoint_every=1", "async_training.staleness_threshold=1",
                "actor.recompute_old_logprobs=true", "algorithm.rollout_correction.rollout_is=token")


def test_async_remote_stages_on_two_deployments_match_the_colocated_async_run_bitwise(tiny_config, tmp_path):
    """One-step-off async with rollout on its own deployment: the schedule (which rollout used
    which published weights, the trainer's log-probs restored from checkpoint k-1) is a pure
    function of the config, so the weights equal the colocated async run's."""
    from gpu_jobs.stages import DirectCalls, run_iteration

    remote = tiny_config(*ASYNC_REMOTE, "trainer.placement=remote", "trainer.rollout_deployment=rl-stage/rollout",
                         root=str(tmp_path / "remote"))
    calls = _InProcessRemote(remote)
    for k in (1, 2, 3):
        run_iteration(calls, remote, k)
    local = tiny_config(*ASYNC_REMOTE, root=str(tmp_path / "local"))
    run, roles = open_warm(local)
    for k in (1, 2, 3):
        run_iteration(DirectCalls(run, roles), local, k)
    a = load_state_dict(str(tmp_path / "remote" / "runs" / remote.run_id / "checkpoints" / "3" / "policy"))
    b = load_state_dict(str(tmp_path / "local" / "runs" / local.run_id / "checkpoints" / "3" / "policy"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    by_stage = {}
    for dep, stage, _ in calls.sent:
        by_stage.setdefault(stage, set()).add(dep)
    assert by_stage == {"rollout": {"rl-stage/rollout"}, "logprobs": {"rl-stage/gpu"}, "update": {"rl-stage/gpu"}}
    # rollout 2 ran ahead during iteration 1 (with the start model), rollout 3 during iteration 2
    assert [k for _, s, k in calls.sent if s == "rollout"] == [1, 2, 3]


def test_rollout_deployment_defaults_to_the_stage_deployment(tiny_config):
    from gpu_jobs.stages import STAGES

    pools = [STAGES[s].where for s in ("rollout", "validate", "logprobs", "update")]
    assert pools == ["rollout", "rollout", "trainer", "trainer"]
    cfg = tiny_config("trainer.placement=remote", "trainer.checkpoint_every=1").trainer
    assert {cfg.deployment_for(p) for p in pools} == {"rl-stage/gpu"}
    cfg = tiny_config("trainer.placement=remote", "trainer.checkpoint_every=1",
                      "trainer.rollout_deployment=rl-stage/rollout").trainer
    assert [cfg.deployment_for(p) for p in pools] == \
        ["rl-stage/rollout", "rl-stage/rollout", "rl-stage/gpu", "rl-stage/gpu"]


def test_a_stage_that_runs_in_the_flow_is_refused_by_the_stage_deployment(tiny_config):
    with pytest.raises(ValueError, match=r"stage 'gate' does not run on a work pool; the stages that do: "
                                         r"logprobs, preference_ref, rollout, update, validate"):
        rl_stage.fn("/nowhere", "r", 1, "gate")


@pytest.mark.slow
def test_a_remote_update_runs_its_own_rank_group(tiny_config, tmp_path):
    """placement=remote with trainer.n_gpus_per_node=2: the rl-stage update process (a pod on a GPU
    pool) starts the rank group itself and commits checkpoint 1 from it."""
    from storage import read_manifest

    cfg = tiny_config("trainer.total_iterations=1", "trainer.checkpoint_every=1", "trainer.placement=remote",
                      "trainer.n_gpus_per_node=2", root=str(tmp_path / "remote"))
    _iteration_remote(cfg, 1)
    run = Run.open(cfg)
    metrics = read_manifest(committed(run.layout.stage(1, "update"), run.storage), run.storage).metrics
    assert metrics["perf/rank_group_starts"] == 1.0 and metrics["actor/pg_loss"] == metrics["actor/pg_loss"]
    state = read_manifest(committed(run.layout.trainer(1), run.storage), run.storage).extra["trainer_state"]
    assert state["world_size"] == 2 and state["zero_stage"] == 3  # zero_stage auto: 3 across ranks
