"""`rollout.multi_turn.environment`: which environment a multi-turn rollout runs, and loading it.

    >>> EnvironmentConfig(name="feedback", kwargs={"max_attempts": 3})      # a built-in
    >>> EnvironmentConfig(path="my_env.py", name="MyEnv")                   # yours, by path
    >>> EnvironmentConfig(name="my_pkg.interactions.Gsm8kInteraction")     # a verl interaction
    >>> make = load_environment(EnvironmentConfig(name="calculator")); env = make()
    >>> load_interaction_config("interaction.yaml")                        # verl's interaction YAML

A user's file is loaded as a custom reward function's is (gpu_jobs.reward.custom: executed from
exactly that path, s3:// fetched first); `name` is any callable it defines, usually the class.
A verl interaction class is imported by its module path and run through an adapter
(gpu_jobs.rollout.verl_interaction); `kwargs` are then its config dict. Both are the user's code:
they run in the tool sandbox.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

# Imported for its registrations: the built-in environments' names.
from gpu_jobs.rollout import builtin_environments  # noqa: F401
from gpu_jobs.rollout.environments import ENVIRONMENTS, Environment
from gpu_jobs.rollout.verl_interaction import (VerlInteraction, default_interaction_name, import_interaction_class,
                                               is_module_path)

__all__ = ["EnvironmentConfig", "load_environment", "load_interaction_config"]

_WHERE = "rollout.multi_turn.interaction_config_path"


class EnvironmentConfig(BaseModel):
    """`rollout.multi_turn.environment`: which environment answers the model (none by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="A built-in environment ('calculator': 3-digit products, reward "
                             "1 for the right final number; 'feedback': a simulated user who says when the first "
                             "answer is wrong and asks again); a verl interaction class by module path "
                             "('package.module.Class', verl's BaseInteraction interface, run through an adapter); "
                             "or with `path` the class (or factory) in that file. None: no environment (tools only).")
    path: str | None = Field(None, description="Python file defining your environment (reset(row) -> messages, "
                             "step(messages) -> (messages, reward, done)); it runs in the tool sandbox with "
                             "tool_timeout_s per call. Name the class in `name`.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the environment is "
                                   "built with, e.g. {max_attempts: 3} for 'feedback'; a verl interaction's config "
                                   "dict (its `name` included).")

    @property
    def enabled(self) -> bool:
        return self.name is not None

    @property
    def user_code(self) -> bool:
        """Whether the environment is the user's code (a file, or a class by module path): it runs
        in the tool sandbox, with tool_timeout_s per call."""
        return self.path is not None or (self.name is not None and self.name not in ENVIRONMENTS)

    @model_validator(mode="after")
    def _known(self, info: ValidationInfo) -> "EnvironmentConfig":
        check_files = (info.context or {}).get("check_files", True)
        if self.path is None:
            if self.name is None or self.name in ENVIRONMENTS:
                return self
            if not is_module_path(self.name):
                raise ValueError(f"unknown environment {self.name!r}: use one of {sorted(ENVIRONMENTS)}, a verl "
                                 "interaction as 'package.module.Class', or set environment.path to your file and "
                                 "environment.name to its class")
            # Only the top package is looked up: finding a submodule would import (run) its parents.
            top = self.name.partition(".")[0]
            if check_files and importlib.util.find_spec(top) is None:
                raise ValueError(f"environment {self.name!r}: no module {top!r} is installed or on PYTHONPATH")
            return self
        if self.name is None or not self.name.isidentifier():
            raise ValueError(f"environment.path={self.path!r}: name the class (or factory) it defines in "
                             "environment.name")
        if not self.path.endswith(".py"):
            raise ValueError(f"environment.path {self.path!r} is not a Python file")
        local = "://" not in self.path or self.path.startswith("file://")
        if check_files and local and not os.path.isfile(self.path.removeprefix("file://")):
            raise ValueError(f"environment file {self.path!r} does not exist (relative paths start at {os.getcwd()})")
        return self


def load_environment(cfg: EnvironmentConfig) -> Callable[[], Environment]:
    """A zero-argument factory of `cfg`'s environment (its kwargs bound); raises naming the fix."""
    if not cfg.enabled:
        raise ValueError("no environment configured (rollout.multi_turn.environment.name)")
    if cfg.path is None and cfg.name in ENVIRONMENTS:
        return functools.partial(ENVIRONMENTS[cfg.name], **cfg.kwargs)
    if cfg.path is None:  # a verl interaction by module path (checked: it has verl's calls)
        return functools.partial(VerlInteraction, import_interaction_class(cfg.name), dict(cfg.kwargs))
    from gpu_jobs.reward import load_custom_reward_function

    try:
        factory = load_custom_reward_function(cfg.path, cfg.name)  # any callable of the file, by path
    except AttributeError as e:
        raise AttributeError(str(e).replace("reward function", "environment")) from None
    return functools.partial(factory, **cfg.kwargs)


def load_interaction_config(path: str, check_files: bool = True) -> EnvironmentConfig:
    """The environment of verl's interaction YAML (`rollout.multi_turn.interaction_config_path`):

        interaction:
          - name: gsm8k                                     # verl's name (default: from the class)
            class_name: my_pkg.interactions.Gsm8kInteraction   # or a built-in (feedback), or file.py:Class
            config: {max_hints: 2}                          # the environment's kwargs

    A verl interaction class gets `config` plus its `name` as its config dict, as verl builds it;
    a built-in or a file's class gets `config` as keyword arguments. Raises ValueError in one
    line naming the file and the fix (several interactions, an unknown key, a bad class_name)."""
    import yaml
    from pydantic import ValidationError

    where = f"{_WHERE} {path!r}"
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    items = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items or set(doc) != {"interaction"}:
        raise ValueError(f"{where}: expected only an 'interaction:' list of {{name, class_name, config}}")
    if len(items) > 1:
        raise ValueError(f"{where}: {len(items)} interactions, but rlmill runs one per run: keep the one your rows "
                         "name (extra_info.interaction_kwargs.name) in the file")
    item = items[0]
    if not isinstance(item, dict) or not isinstance(item.get("class_name"), str):
        raise ValueError(f"{where}: interaction[0] needs class_name (and optionally name, config)")
    unknown = sorted(set(item) - {"name", "class_name", "config"})
    config = item.get("config") or {}
    if unknown or not isinstance(config, dict):
        raise ValueError(f"{where}: interaction[0] may hold only name, class_name and config (a mapping); "
                         f"remove {unknown or ['config: ' + type(config).__name__]}")
    fields = _interaction_fields(item["class_name"], item.get("name"), config)
    try:
        return EnvironmentConfig.model_validate(fields, context={"check_files": check_files})
    except ValidationError as e:
        raise ValueError(f"{where}: interaction[0].class_name: {e.errors()[0]['msg'].removeprefix('Value error, ')}") \
            from None


def _interaction_fields(class_name: str, name: Any, config: dict[str, Any]) -> dict[str, Any]:
    """EnvironmentConfig's fields for one interaction of the YAML (see load_interaction_config)."""
    if ":" in class_name:  # rlmill's 'path/to/file.py:Class', as in the tool YAML
        file, _, attr = class_name.rpartition(":")
        return {"path": file, "name": attr, "kwargs": config}
    if class_name in ENVIRONMENTS or not is_module_path(class_name):  # a built-in (or an unknown name: refused)
        return {"name": class_name, "kwargs": config}
    return {"name": class_name, "kwargs": {**config, "name": str(name or default_interaction_name(class_name))}}
