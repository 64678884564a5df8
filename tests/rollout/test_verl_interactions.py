"""verl's interactions in rlmill (gpu_jobs.rollout.verl_interaction, environment_config's
load_interaction_config, rollout.multi_turn.interaction_config_path and its verl key): the YAML
read into the environment, its one-line errors, a verl-style interaction class adapted to
reset/step, and that class driven by the agent loop in the sandbox (its state crossing the
worker processes between turns).

    .venv/bin/python -m pytest -q tests/rollout/test_verl_interactions.py

The interaction class is written here with verl's BaseInteraction interface (async
start_interaction / generate_response / calculate_score / finalize_interaction, built with
`config=`); verl itself is not installed.
"""

from __future__ import annotations

import copy
import textwrap

import pytest

from gpu_jobs.rollout import SamplingConfig
from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig, generate_with_rows
from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_environment, load_interaction_config
from gpu_jobs.rollout.environments import Environment, StepResult
from gpu_jobs.rollout.verl_interaction import VerlInteraction
from tests.rollout.test_environments import EOS, TOK, ScriptedEngine, ids

GUESS = '''
class GuessInteraction:
    """verl's interface: state per instance id in a dict, async calls, built with config=."""

    def __init__(self, config):
        self.config, self.name = config, config.get("name", "interaction_agent")
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self._instance_dict[instance_id] = {"truth": ground_truth, "tries": 0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = self._instance_dict[instance_id]
        state["tries"] += 1
        answer = [m for m in messages if m["role"] == "assistant"][-1]["content"].strip()
        if answer == state["truth"]:
            return True, "Correct!", 1.0, {}
        return state["tries"] >= self.config.get("max_tries", 2), f"Wrong (try {state['tries']}).", 0.0, {}

    async def calculate_score(self, instance_id=None, **kwargs):
        return 0.0

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self._instance_dict.pop(instance_id, None)


class Plain:
    def __init__(self, **kwargs):
        pass
'''
CLASS = "guess_interactions.GuessInteraction"
ROW = {"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": "37+45="}],
       "reward_model": {"ground_truth": "82"}, "row": 3,
       "extra_info": {"index": 3, "interaction_kwargs": {"name": "guess", "ground_truth": "82"}}}


@pytest.fixture
def guess(tmp_path, monkeypatch):
    """The interaction's module importable here and in the sandbox's (spawned) workers."""
    (tmp_path / "guess_interactions.py").write_text(textwrap.dedent(GUESS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "interaction.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# -------------------------------------------------------------------------------- the YAML
def test_the_yaml_maps_one_interaction_onto_the_environment(guess):
    verl = write_yaml(guess, f"""
        interaction:
          - name: guess
            class_name: {CLASS}
            config: {{max_tries: 3}}
    """)
    assert load_interaction_config(verl) == EnvironmentConfig(name=CLASS, kwargs={"max_tries": 3, "name": "guess"})
    unnamed = write_yaml(guess, f"interaction:\n  - class_name: {CLASS}\n")
    assert load_interaction_config(unnamed).kwargs == {"name": "guess"}  # verl's default: class name less 'Interaction'
    builtin = write_yaml(guess, "interaction:\n  - name: f\n    class_name: feedback\n    config: {max_attempts: 3}\n")
    assert load_interaction_config(builtin) == EnvironmentConfig(name="feedback", kwargs={"max_attempts": 3})
    cfg = MultiTurnConfig(enable=True, tools=[], interaction_config_path=builtin)
    assert cfg.environment_config().name == "feedback" and not cfg.environment.enabled


@pytest.mark.parametrize("text, message", [
    (f"interaction:\n  - class_name: {CLASS}\n  - class_name: feedback\n", "2 interactions, but rlmill runs one"),
    (f"interaction:\n  - class_name: {CLASS}\n    tools: []\n", r"remove \['tools'\]"),
    ("interactions:\n  - class_name: feedback\n", "expected only an 'interaction:' list"),
    ("interaction:\n  - class_name: nosuchpkg.mod.Cls\n", "no module 'nosuchpkg' is installed"),
    ("interaction:\n  - class_name: nope\n", "unknown environment 'nope'"),
])
def test_yaml_errors_are_one_line_naming_the_file_and_the_fix(guess, text, message):
    path = write_yaml(guess, text)
    with pytest.raises(ValueError, match=message) as err:
        load_interaction_config(path)
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"rollout.multi_turn.interaction_config_path {path!r}")
    with pytest.raises(ValueError, match=message):  # the config checks the file when it is set
        MultiTurnConfig(enable=True, interaction_config_path=path)


def test_config_refuses_two_environments_and_a_class_that_is_not_an_interaction(guess):
    path = write_yaml(guess, "interaction:\n  - class_name: feedback\n")
    with pytest.raises(ValueError, match="not both"):
        MultiTurnConfig(enable=True, interaction_config_path=path, environment={"name": "feedback"})
    with pytest.raises(ValueError, match="interaction_config_path needs rollout.multi_turn.enable=true"):
        MultiTurnConfig(interaction_config_path=path)
    with pytest.raises(TypeError, match="is not a verl interaction .* environment.path"):
        load_environment(EnvironmentConfig(name="guess_interactions.Plain"))
    assert EnvironmentConfig(name=CLASS).user_code and not EnvironmentConfig(name="feedback").user_code


# -------------------------------------------------------------------------------- the adapter
def test_the_adapter_drives_verls_calls_as_reset_and_step(guess):
    env = load_environment(EnvironmentConfig(name=CLASS, kwargs={"name": "guess", "max_tries": 2}))()
    assert isinstance(env, VerlInteraction) and isinstance(env, Environment)
    assert env.interaction.config == {"name": "guess", "max_tries": 2}  # built as verl builds it
    opening = env.reset(ROW)
    assert opening == ROW["prompt"] and env.instance_id == "rlmill-3"
    other = copy.deepcopy(env)  # one copy per response: independent state
    wrong = env.step(opening + [{"role": "assistant", "content": "81"}])
    assert wrong == StepResult([{"role": "user", "content": "Wrong (try 1)."}], 0.0, False)
    assert env.step(opening + [{"role": "assistant", "content": "80"}]) == StepResult(
        [{"role": "user", "content": "Wrong (try 2)."}], 0.0, True)  # max_tries reached
    assert other.step(opening + [{"role": "assistant", "content": "82"}]) == StepResult(
        [{"role": "user", "content": "Correct!"}], 1.0, True)
    routed = {**ROW, "extra_info": {"interaction_kwargs": {"name": "weather"}}}
    with pytest.raises(ValueError, match="name 'weather', but the configured interaction is 'guess'"):
        env.reset(routed)


# -------------------------------------------------------------------------------- through the loop
def test_a_verl_interaction_through_the_agent_loop_in_the_sandbox(guess):
    path = write_yaml(guess, f"interaction:\n  - name: guess\n    class_name: {CLASS}\n    config: {{max_tries: 2}}\n")

    def run(script):
        cfg = MultiTurnConfig(enable=True, tools=[], interaction_config_path=path, max_assistant_turns=3,
                              tool_num_workers=1, tool_timeout_s=30)
        loop = AgentLoopEngine(ScriptedEngine(script), cfg, TOK)
        return generate_with_rows(loop, [ROW], [ids("37+45=")], 2, SamplingConfig(max_response_length=64)), loop

    rows, loop = run(lambda text: "82" if text.endswith("(try 1).") else "81")
    assert loop.environment.sandboxed
    first, retry, second = ids("81") + [EOS], ids("Wrong (try 1)."), ids("82") + [EOS]
    for row in rows:  # token-in/token-out: sampled, the interaction's user turn, sampled
        assert row["response_ids"] == first + retry + second
        assert row["response_mask"] == [1] * len(first) + [0] * len(retry) + [1] * len(second)
        assert row["turn_scores"] == [0.0, 1.0]
    # Always wrong: the second step sees tries=1 from the first (the state went to the worker
    # and back), so it ends the episode at max_tries=2 and its message is dropped.
    rows, loop = run(lambda text: "81")
    assert all(r["turn_scores"] == [0.0, 0.0] and r["num_turns"] == 2 for r in rows)
    assert rows[0]["response_ids"] == first + retry + first and loop.last_metrics["multi_turn/env_errors"] == 0.0


def test_the_verl_key_reaches_rlmills_config(guess):
    from flows.config import load_run_config

    path = write_yaml(guess, f"interaction:\n  - name: guess\n    class_name: {CLASS}\n")
    cfg = load_run_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=True",
                                 f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}"])
    assert cfg.rollout.multi_turn.interaction_config_path == path
    assert cfg.rollout.multi_turn.environment_config() == EnvironmentConfig(name=CLASS, kwargs={"name": "guess"})
