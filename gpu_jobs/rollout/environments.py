"""Environments of multi-turn rollouts: what answers the model's turns that no tool answers (a
simulated user, a task that checks the answer), and the rewards it gives (verl's interactions,
TRL's environments).

    >>> from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_environment
    >>> make = load_environment(EnvironmentConfig(name="feedback"))     # or path="my_env.py", name="MyEnv"
    >>> env = make()
    >>> env.reset({"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": "2+2="}],
    ...            "reward_model": {"ground_truth": "4"}})
    [{'role': 'user', 'content': '2+2='}]
    >>> env.step([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "5"}])
    StepResult(messages=[{'role': 'user', 'content': "That's not right, try again."}], reward=0.0, done=False)

The protocol (`Environment`): `reset(row)` gets the dataset row (verl's fields: data_source,
prompt, reward_model, extra_info) and returns the opening messages; after a model turn without a
tool call, `step(messages)` gets the whole conversation so far (the model's turn last) and
returns the messages to append (a user turn, or `tool` messages), the reward of that turn and
whether the episode is done. The agent loop also steps the last model turn of every response,
whatever it holds (a call cut by max_assistant_turns, a turn cut by the length budget), so every
response ends with exactly one final reward. Tools stay the loop's (rollout.multi_turn.tools).

An environment is a class (or any factory) called with the configured keyword arguments, one
instance per prompt, copied for each of its n responses; its state lives in its attributes. A
built-in is named (`ENVIRONMENTS`: `calculator`, `feedback`, gpu_jobs.rollout.builtin_environments);
a user's is `path` + `name`, like a custom reward function (gpu_jobs.rollout.environment_config),
and runs in the tool sandbox (gpu_jobs.rollout.env_runner): its instances travel to the worker
processes and back pickled. A verl interaction class (named by module path, or in verl's
interaction YAML) runs through an adapter to this protocol (gpu_jobs.rollout.verl_interaction).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

from gpu_jobs.registry import Registry

__all__ = ["Environment", "StepResult", "ENVIRONMENTS", "register_environment", "step_result"]


class StepResult(NamedTuple):
    """What one step gives back: messages to append, the turn's reward, whether the episode ends."""

    messages: list[dict[str, Any]]
    reward: float
    done: bool


@runtime_checkable
class Environment(Protocol):
    """One episode's counterpart of the model; one instance per response."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The opening messages of the episode for a dataset `row` (verl's fields; `prompt` as a
        list of {"role", "content"} dicts). They are rendered with the chat template as the prompt
        (hermes: the tools shown in its system turn, or in their own system message when they
        open with one)."""
        ...

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float, bool]:
        """After a model turn: `messages` is the conversation so far, the model's turn last
        ({"role": "assistant", "content": its text}; tool results as {"role": "tool"} messages).
        Returns (messages to append: user or tool turns, reward of this turn, done). When done or
        out of turns the messages are dropped; the reward of the last step is the final one."""
        ...


ENVIRONMENTS: Registry = Registry("environment")
register_environment = ENVIRONMENTS.register
"""Decorator registering a built-in environment class (or factory) under a name."""


def step_result(value: Any) -> StepResult:
    """A step's return value checked: (messages, reward, done) with messages a list of
    {"role", "content"} dicts and a finite reward; raises TypeError/ValueError saying what is wrong.

    >>> step_result(([{"role": "user", "content": "again"}], 0, False))
    StepResult(messages=[{'role': 'user', 'content': 'again'}], reward=0.0, done=False)
    """
    import math

    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"step must return (messages, reward, done), got {type(value).__name__}")
    messages, reward, done = value
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise TypeError("step's messages must be a list of {'role': str, 'content': str} dicts")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step's reward is not finite: {reward}")
    return StepResult([{"role": m["role"], "content": m["content"]} for m in messages], reward, bool(done))
