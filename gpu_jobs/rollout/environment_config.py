"""`rollout.multi_turn.environment`: which environment a multi-turn rollout runs, and loading it.

    >>> EnvironmentConfig(name="feedback", kwargs={"max_attempts": 3})      # a built-in
    >>> EnvironmentConfig(path="my_env.py", name="MyEnv")                   # yours, by path
    >>> make = load_environment(EnvironmentConfig(name="calculator")); env = make()

A user's file is loaded as a custom reward function's is (gpu_jobs.reward.custom: executed from
exactly that path, s3:// fetched first); `name` is any callable it defines, usually the class.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

# Imported for its registrations: the built-in environments' names.
from gpu_jobs.rollout import builtin_environments  # noqa: F401
from gpu_jobs.rollout.environments import ENVIRONMENTS, Environment

__all__ = ["EnvironmentConfig", "load_environment"]


class EnvironmentConfig(BaseModel):
    """`rollout.multi_turn.environment`: which environment answers the model (none by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="A built-in environment ('calculator': 3-digit products, reward "
                             "1 for the right final number; 'feedback': a simulated user who says when the first "
                             "answer is wrong and asks again), or with `path` the class (or factory) in that file. "
                             "None: no environment (tools only).")
    path: str | None = Field(None, description="Python file defining your environment (reset(row) -> messages, "
                             "step(messages) -> (messages, reward, done)); it runs in the tool sandbox with "
                             "tool_timeout_s per call. Name the class in `name`.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the environment is "
                                   "built with, e.g. {max_attempts: 3} for 'feedback'.")

    @property
    def enabled(self) -> bool:
        return self.name is not None

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> "EnvironmentConfig":
        if self.path is None:
            if self.name is not None and self.name not in ENVIRONMENTS:
                raise ValueError(f"unknown environment {self.name!r}: use one of {sorted(ENVIRONMENTS)}, or set "
                                 "environment.path to your file and environment.name to its class")
            return self
        if self.name is None or not self.name.isidentifier():
            raise ValueError(f"environment.path={self.path!r}: name the class (or factory) it defines in "
                             "environment.name")
        if not self.path.endswith(".py"):
            raise ValueError(f"environment.path {self.path!r} is not a Python file")
        check_files = (info.context or {}).get("check_files", True)
        local = "://" not in self.path or self.path.startswith("file://")
        if check_files and local and not os.path.isfile(self.path.removeprefix("file://")):
            raise ValueError(f"environment file {self.path!r} does not exist (relative paths start at {os.getcwd()})")
        return self


def load_environment(cfg: EnvironmentConfig) -> Callable[[], Environment]:
    """A zero-argument factory of `cfg`'s environment (its kwargs bound); raises naming the fix."""
    if not cfg.enabled:
        raise ValueError("no environment configured (rollout.multi_turn.environment.name)")
    if cfg.path is None:
        return functools.partial(ENVIRONMENTS[cfg.name], **cfg.kwargs)
    from gpu_jobs.reward import load_custom_reward_function

    try:
        factory = load_custom_reward_function(cfg.path, cfg.name)  # any callable of the file, by path
    except AttributeError as e:
        raise AttributeError(str(e).replace("reward function", "environment")) from None
    return functools.partial(factory, **cfg.kwargs)
