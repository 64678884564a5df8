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
from storage import load_state_dict

pytestmark = pytest.mark.deepspeed


def _iteration_remote(cfg, k: int) -> None:
    run = Run.open(cfg)  # the flow side: no model loaded
    rollout = rl_stage.fn(cfg.root, cfg.run_id, k, "rollout")
    batch = stages.gate(run, None, k, rollout)
    reward = stages.reward(run, None, k, batch)
    adv = stages.advantages(run, None, k, batch, reward)
    rl_stage.fn(cfg.root, cfg.run_id, k, "update", [adv])


def _iteration_colocated(run, engines, k: int) -> None:
    rollout = stages.rollout(run, engines, k)
    batch = stages.gate(run, engines, k, rollout)
    reward = stages.reward(run, engines, k, batch)
    adv = stages.advantages(run, engines, k, batch, reward)
    stages.update(run, engines, k, adv)
    stages.sync_weights(run, engines, k)


def test_remote_stages_match_the_colocated_run_bitwise(tiny_config, tmp_path):
    extra = ("trainer.total_iterations=2", "trainer.checkpoint_every=1")
    remote = tiny_config(*extra, "trainer.placement=remote", root=str(tmp_path / "remote"))
    local = tiny_config(*extra, root=str(tmp_path / "local"))
    for k in (1, 2):
        _iteration_remote(remote, k)
    run, engines = open_warm(local)
    for k in (1, 2):
        _iteration_colocated(run, engines, k)
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
