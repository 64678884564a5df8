"""The run config: YAML + dotted overrides, validated before any work, errors naming keys."""

import pytest

from flows.config import ConfigError, load_run_config
from flows.overrides import OverrideError, apply_overrides



def test_overrides_parse_yaml_scalars_and_nest():
    out = apply_overrides({"rollout": {"n": 4}}, ["rollout.n=8", "actor.lr=3e-5", "x.flag=true", "x.l=[1,2]"])
    assert out == {"rollout": {"n": 8}, "actor": {"lr": 3e-5}, "x": {"flag": True, "l": [1, 2]}}


@pytest.mark.parametrize("bad", ["rollout.n", "=3", "a..b=1", "rollout.n=[1,"])
def test_malformed_override_is_named(bad):
    with pytest.raises(OverrideError, match="override"):
        apply_overrides({}, [bad])


def test_override_into_a_value_is_refused():
    with pytest.raises(OverrideError, match="'rollout.n' is a value"):
        apply_overrides({"rollout": {"n": 4}}, ["rollout.n.x=1"])


def test_example_config_loads_with_overrides(example_path):
    cfg = load_run_config(example_path, ["algorithm.adv_estimator=rloo", "rollout.n=8"])
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.rollout.n == 8
    assert cfg.actor.lr == 1e-4  # from the YAML, not the class default


def test_defaults_give_critic_free_grpo():
    assert load_run_config().algorithm.adv_estimator == "grpo"


def test_every_bad_key_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["rollout.nn=4", "actor.lr=-1", "rollout.temperature=hot"])
    msg = str(err.value)
    assert "rollout.nn: unknown key" in msg
    assert "actor.lr:" in msg and "greater than 0" in msg
    assert "rollout.temperature:" in msg


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.adv_estimator=gae"], "needs a critic"),
    (["algorithm.adv_estimator=nope"], "nope"),
    (["rollout.n=1"], "rollout.n >= 2"),
    (["run_id=../escape"], "run_id"),
    (["data.train_size=8000"], "distinct arith problems"),
    (["actor.ppo_mini_batch_size=128"], "ppo_mini_batch_size"),
    (["actor.zero_stage=3", "actor.pipeline_parallel_size=2"], "pipeline"),
])
def test_cross_field_errors_say_how_to_fix(overrides, needle, example_path):
    with pytest.raises(ConfigError, match=needle):
        load_run_config(example_path, overrides)


def test_gae_with_a_critic_is_accepted(example_path):
    cfg = load_run_config(example_path, ["algorithm.adv_estimator=gae", "critic.lr=1e-4"])
    assert cfg.critic is not None and cfg.critic.lr == 1e-4


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(bad)


def test_secrets_are_masked_in_the_frozen_config():
    from flows.config import frozen_config

    cfg = load_run_config(None, ["storage.key=AKIAEXAMPLE", "storage.secret=verysecret"])
    text = str(frozen_config(cfg))
    assert "verysecret" not in text and "AKIAEXAMPLE" not in text


def test_several_nodes_take_their_rendezvous_from_the_config_or_the_environment(monkeypatch):
    from flows.config import load_run_config
    from gpu_jobs.stages.roles import _rendezvous

    assert _rendezvous(load_run_config(None, []).trainer) == {"nnodes": 1}
    given = load_run_config(None, ["trainer.nnodes=2", "trainer.master_addr=10.0.0.5", "trainer.master_port=29400"])
    assert _rendezvous(given.trainer) == {"nnodes": 2, "master_addr": "10.0.0.5", "master_port": 29400}
    # From a work pool's job variables; taken out of the environment, so that a one-rank engine
    # built in this process does not bind node 0's rendezvous port.
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.6")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = _rendezvous(load_run_config(None, ["trainer.nnodes=2"]).trainer)
    assert env == {"nnodes": 2, "master_addr": "10.0.0.6", "master_port": 29500}
    import os

    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
