"""Configuration of reward scoring (field names follow verl's `custom_reward_function.*`)."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = ["CustomRewardFunctionConfig", "RewardConfig", "RewardModelConfig", "RewardModelPathConfig",
           "SandboxConfig"]


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


class SandboxConfig(BaseModel):
    """The limits of the worker processes that run a user's reward function
    (gpu_jobs.reward.isolation); every worker also gets an allow-listed environment (no
    credentials) and its own process group."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(4096, ge=64, description="Address space of one worker in MiB (RLIMIT_AS); an "
                                  "allocation past it raises MemoryError in the function. None: no limit.")
    cpu_s: float | None = Field(None, gt=0, description="CPU seconds one sample may use (RLIMIT_CPU, moved per "
                                "sample); past it the function raises TimeoutError. None: 2 x timeout_s + 1.")
    open_files: int | None = Field(256, ge=16, description="Open file descriptors per worker (RLIMIT_NOFILE).")
    file_size_mb: int | None = Field(1024, ge=1, description="Largest file a worker may write, in MiB "
                                     "(RLIMIT_FSIZE); a larger write fails with EFBIG.")
    network: bool = Field(False, description="Let the function reach the network. False: each worker gets a "
                          "network namespace of its own (no interface up, not even loopback) where the OS "
                          "permits it; where it does not, a warning is logged once and the network stays.")
    env: list[str] = Field(default_factory=list, description="Names of further environment variables the workers "
                           "get from this process (the rest of its environment never reaches them).")

    def limits(self):
        """These settings as the sandbox's SandboxLimits."""
        from .isolation import SandboxLimits

        return SandboxLimits(self.memory_mb, self.cpu_s, self.open_files, self.file_size_mb, self.network,
                             tuple(self.env))


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
    start_method: Literal["spawn"] = Field(
        "spawn",
        description=(
            "How worker processes start: always a fresh interpreter ('spawn'), the only way its "
            "environment can be cleaned; each worker costs a Python start (~0.2-0.5 s) once per batch."
        ),
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig,
                                   description="Limits of the worker processes (memory, CPU, files, network).")
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


class RewardModelPathConfig(BaseModel):
    """Which reward model (verl's `reward_model.model` section)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        "builtin",
        description=(
            "An HF AutoModelForSequenceClassification folder with num_labels=1 (local path, file:// "
            "or storage URL), or 'builtin': the project's tiny arithmetic reward model, built on "
            "first use from the built-in policy and cached (gpu_jobs/models/reward_model.py)."
        ),
    )


class RewardModelConfig(BaseModel):
    """Model-based reward (verl's `reward_model.*`): a sequence classifier scores every response
    in its own stage; its score replaces or adds to the rule reward.

        >>> RewardModelConfig(enable=True)                                   # score = rm score
        >>> RewardModelConfig(enable=True, combine="add", coef=0.5)          # rule + 0.5 * rm
    """

    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(False, description="Score responses with the reward model (verl reward_model.enable).")
    model: RewardModelPathConfig = Field(default_factory=RewardModelPathConfig, description="The reward model.")
    micro_batch_size_per_gpu: int = Field(
        64, ge=1, description="Responses per reward-model forward pass (verl's name).")
    max_length: int | None = Field(
        None, ge=1, description="Most tokens of prompt + response the reward model reads, keeping the end "
        "(the response); None = prompt + response never truncated.")
    combine: Literal["rm_only", "add"] = Field(
        "rm_only",
        description=(
            "How the score that trains is made: 'rm_only' = coef * rm_score (verl: the reward model's "
            "score replaces the rule reward); 'add' = rule score + coef * rm_score. The rule score is "
            "computed in both cases and logged (critic/rule_score/mean); validation (val/acc) always "
            "scores with the rule."
        ),
    )
    coef: float = Field(1.0, description="Weight of the reward model's score (a logit) in the training score.")

    @field_validator("coef")
    @classmethod
    def _finite_coef(cls, v: float) -> float:
        if not math.isfinite(v) or v == 0:
            raise ValueError(f"coef must be a finite non-zero number, got {v} (to turn the model off set "
                             "reward_model.enable=false)")
        return v

    def combined(self, rule_score: float, rm_score: float) -> float:
        """The training score of one response from its rule score and reward-model score."""
        return (rule_score if self.combine == "add" else 0.0) + self.coef * rm_score
