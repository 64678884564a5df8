"""verl's `rollout.multi_turn` config section: the tools, the call format and every limit.

    >>> cfg = MultiTurnConfig(enable=True, format="hermes", max_assistant_turns=4, max_parallel_calls=2)
    >>> [e.name for e in cfg.tool_entries()]
    ['calculator']
    >>> MultiTurnConfig(enable=True, tools=[], environment={"name": "feedback"}).environment.enabled
    True
    >>> MultiTurnConfig(enable=True, interaction_config_path="interaction.yaml").environment_config()  # verl's YAML
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_interaction_config
from gpu_jobs.chat.tools import ToolEntry, check_tool_spec, entry_of, load_tool_config
from gpu_jobs.chat.turn_formats import TURN_FORMATS

__all__ = ["MultiTurnConfig"]


class MultiTurnConfig(BaseModel):
    """verl's `rollout.multi_turn` section (names follow it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = Field(False, description="Multi-turn rollouts: run the tool calls in the model's turns and "
                         "continue after each tool's answer (validation and ReMax baselines too).")
    max_assistant_turns: int = Field(3, ge=1, description="Most model turns per response; a tool call in the "
                                     "last one is not run.")
    tools: list[str] = Field(default_factory=lambda: ["calculator"], description="Tools the model may call: "
                             "built-in names ('calculator') or 'path/to/file.py:function' (brackets: called with "
                             "the argument text; hermes: with the call's arguments as keywords; returns the "
                             "answer text; runs in the tool sandbox). Replaced by tool_config_path when set. May be [] "
                             "with an environment.")
    tool_config_path: str | None = Field(None, description="verl's tool YAML (tools: - class_name, config, "
                                         "tool_schema); class_name is a built-in tool or "
                                         "'path/to/file.py:function', config its keyword arguments, tool_schema "
                                         "its OpenAI schema. Replaces `tools`.")
    format: str = Field("brackets", description=f"Tool call format: one of {sorted(TURN_FORMATS)}; 'brackets' = "
                        "call '[name(arguments)]' then EOS, answer '<text>' (the built-in tool model); 'hermes' = "
                        "OpenAI tools through the chat template (Qwen2.5's <tool_call> JSON format where the "
                        "template has no tool section).")
    max_parallel_calls: int = Field(1, ge=1, description="Most tool calls run per model turn (verl's name); "
                                    "further calls in that turn are answered with an error.")
    max_tool_response_length: int = Field(64, ge=1, description="Most characters of a tool's answer kept in "
                                           "the conversation (verl's name); cut in the sandbox for user tools.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle", description="Which end of a longer answer to cut: 'left' keeps the end, 'right' the start, "
        "'middle' both ends.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Seconds one user-tool call may take; past it the "
                                  "tool answers with an error text (the model sees it as the result).")
    tool_num_workers: int = Field(2, ge=1, description="Sandbox worker processes that run user tools (and a "
                                  "user's environment).")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="What answers the "
                                           "model's turns that call no tool, with a reward per turn (verl's "
                                           "interactions): a built-in environment or your own by path; its "
                                           "calls run under the tools' limits (tool_timeout_s, "
                                           "max_tool_response_length, the sandbox for a user's file).")
    interaction_config_path: str | None = Field(None, description="verl's interaction YAML (interaction: - "
                                                "name, class_name, config), read as `environment`: class_name is a "
                                                "verl interaction class by module path ('package.module.Class', "
                                                "given config plus name as its config dict), a built-in "
                                                "environment or 'path/to/file.py:Class' (given config as keyword "
                                                "arguments). One interaction; instead of `environment`.")

    @field_validator("tools")
    @classmethod
    def _tools_exist(cls, v: list[str], info: ValidationInfo) -> list[str]:
        check_files = (info.context or {}).get("check_files", True)
        return [check_tool_spec(s, check_files) for s in v]

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in TURN_FORMATS:
            raise ValueError(f"unknown tool call format {v!r}: use one of {sorted(TURN_FORMATS)}")
        return v

    @model_validator(mode="after")
    def _tool_file_reads(self, info: ValidationInfo) -> "MultiTurnConfig":
        check_files = (info.context or {}).get("check_files", True)
        interaction = self.interaction_config_path is not None
        if interaction and self.environment.enabled:
            raise ValueError("set rollout.multi_turn.environment or rollout.multi_turn.interaction_config_path, "
                             "not both")
        with_env = interaction or self.environment.enabled
        if not self.tools and self.tool_config_path is None and not with_env:
            raise ValueError("name at least one tool, e.g. ['calculator'] (no tools only with an environment)")
        if with_env and not self.enable:
            which = "interaction_config_path" if interaction else "environment"
            raise ValueError(f"rollout.multi_turn.{which} needs rollout.multi_turn.enable=true")
        if self.tool_config_path is not None and check_files:
            load_tool_config(self.tool_config_path)  # raises naming the key at fault
        if interaction and check_files:
            load_interaction_config(self.interaction_config_path)  # raises naming the file and the fix
        if self.enable and self.format == "hermes" and check_files:
            missing = [e.name for e in self.tool_entries() if e.schema is None]
            if missing:
                raise ValueError(f"rollout.multi_turn.format=hermes needs a JSON schema per tool; {missing} have "
                                 "none: give them in rollout.multi_turn.tool_config_path")
        return self

    def tool_entries(self) -> list[ToolEntry]:
        """The run's tools: tool_config_path's, else those named in `tools`."""
        if self.tool_config_path is not None:
            return load_tool_config(self.tool_config_path)
        return [entry_of(s) for s in self.tools]

    def environment_config(self) -> EnvironmentConfig:
        """The run's environment: interaction_config_path's, else `environment` (disabled: none)."""
        if self.interaction_config_path is not None:
            return load_interaction_config(self.interaction_config_path)
        return self.environment
