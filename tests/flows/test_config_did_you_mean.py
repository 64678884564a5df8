"""A misspelled config key names the closest valid key (gpu_jobs/stages/config.py
_format_validation_error): siblings first, then every dotted key of the run config."""

import pytest

from flows.config import ConfigError, load_run_config


@pytest.mark.parametrize("override, key, guess", [
    ("rollout.nn=4", "rollout.nn", "rollout.n"),
    ("actor.lrr=1e-4", "actor.lrr", "actor.lr"),
    ("rolout.n=4", "rolout", "rollout"),
    ("trainer.totl_iterations=3", "trainer.totl_iterations", "trainer.total_iterations"),
    ("actor.kl_loss.kl_coef=0.1", "actor.kl_loss.kl_coef", "actor.kl_loss.kl_loss_coef"),
    ("algorithm.filter_groups.enabel=true", "algorithm.filter_groups.enabel", "algorithm.filter_groups.enable"),
    ("critic.lrr=1e-4", "critic.lrr", "critic.lr"),  # inside an optional section
    ("storage.endpoint=http://x", "storage.endpoint", "storage.endpoint_url"),
])
def test_an_unknown_key_names_the_closest_valid_one(override, key, guess):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert f"  {key}: unknown key (did you mean {guess}? `rlmill config show` lists every key)" in str(err.value)


def test_a_key_like_nothing_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["zzzz=1"])
    assert "zzzz: unknown key (check the spelling; `rlmill config show` lists every key)" in str(err.value)


def test_every_guess_is_itself_a_valid_key():
    """The suggestion must be accepted when the user copies it."""
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["trainer.chekpoint_every=2"])
    guess = str(err.value).split("did you mean ")[1].split("?")[0]
    assert load_run_config(None, [f"{guess}=2"]).trainer.checkpoint_every == 2
