"""Configuration of reward scoring (field names follow verl's `custom_reward_function.*`)."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["CustomRewardFunctionConfig", "RewardConfig"]


class CustomRewardFunctionConfig(BaseModel):
    """A user's reward function file, as in verl's `custom_reward_function` section."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None,
        description=(
            "Python file (local path or s3:// URL) defining the reward function; None uses the "
            "built-in scorers routed by data_source."
        ),
    )
    name: str = Field("compute_score", description="Name of the function in that file.")
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed to every call of the function."
    )

    @field_validator("path")
    @classmethod
    def _path_is_a_python_file(cls, v: str | None, info: ValidationInfo) -> str | None:
        # Only this path is ever executed, so a typo must fail here, before any work, not as a
        # broken worker pool mid-run. A config rebuilt from run.json (validation context
        # {"check_files": False}) was checked when the run was created and may run on another
        # machine, so only the suffix is checked then; s3:// files are fetched when loaded.
        if v is None:
            return v
        if not v.endswith(".py"):
            raise ValueError(f"{v!r} is not a Python file: name a .py file defining the reward function")
        local = "://" not in v or v.startswith("file://")
        if local and (info.context or {}).get("check_files", True) and not os.path.isfile(v.removeprefix("file://")):
            raise ValueError(f"reward function file {v!r} does not exist (relative paths start at {os.getcwd()})")
        return v

    @field_validator("name")
    @classmethod
    def _name_is_an_identifier(cls, v: str) -> str:
        if not v.isidentifier():
            raise ValueError(f"name {v!r} is not a Python function name")
        return v


class RewardConfig(BaseModel):
    """How responses are scored.

        >>> RewardConfig(custom_reward_function={"path": "my_reward.py"}, timeout_s=5, num_workers=2)
        >>> RewardConfig(score_range=(0, 1), on_error=0.0)   # opt in to a range check
    """

    model_config = ConfigDict(extra="forbid")

    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig, description="The user's reward function, if any."
    )
    timeout_s: float = Field(
        10.0, gt=0, description="Seconds one sample may take in a user function before it scores on_error."
    )
    num_workers: int = Field(
        2, ge=1, description="Worker processes that run user reward functions (built-ins run in-process)."
    )
    on_error: float = Field(
        0.0,
        description=(
            "Score given to a sample whose function raised, timed out, or returned NaN or a "
            "non-number; the error is recorded in that row's reward_extra and counted."
        ),
    )
    score_range: tuple[float, float] | None = Field(
        None,
        description=(
            "Opt-in check: (min, max) your reward function promises, e.g. [0, 1]; a score outside "
            "it then counts as an error and scores on_error. Default None: any finite score is "
            "kept, as verl does (e.g. -1 for a wrong format, a reward model's logits). NaN and "
            "infinity always count as errors."
        ),
    )
    start_method: Literal["spawn", "forkserver", "fork"] = Field(
        "spawn",
        description=(
            "How worker processes start. 'spawn' is safe in a process that holds torch threads; "
            "each worker costs a Python start (~0.2-0.5 s) once per batch."
        ),
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="Seconds the worker pool may take to start and import the user's file."
    )

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        if not math.isfinite(self.on_error):
            raise ValueError(f"on_error must be a finite number, got {self.on_error}")
        if self.score_range is not None:
            lo, hi = self.score_range
            if not lo <= hi:
                raise ValueError(f"score_range must be (min, max) with min <= max, got {self.score_range}")
            if not lo <= self.on_error <= hi:
                raise ValueError(
                    f"on_error={self.on_error} lies outside score_range={self.score_range}: set on_error "
                    "to a score inside the range (usually its minimum) or widen score_range"
                )
        return self
