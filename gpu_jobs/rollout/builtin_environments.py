"""The built-in environments (gpu_jobs.rollout.environments.ENVIRONMENTS).

    >>> env = CalculatorEnvironment()
    >>> opening = env.reset(calc3_row(123, 456, "train", 0))
    >>> env.step(opening + [{"role": "assistant", "content": "56088"}])
    StepResult(messages=[], reward=1.0, done=True)

`calculator`: the `calc3` task (3-digit products, `rlmill data make calc3`); the model may call
the calculator tool (rollout.multi_turn.tools, any format) and then answers; the final answer's
last number scores 1 when it is the product (with `require_call=True` only after a tool result).
`feedback`: a simulated user (verl's interactions) on any task whose data_source has a built-in
scorer: after a wrong answer it says "That's not right, try again." and gives the model another
turn, up to `max_attempts` answers; each turn's reward is its answer's score, so the final
reward is the last answer's. Both keep their state (the row, attempts so far) in attributes.
"""

from __future__ import annotations

from typing import Any

from gpu_jobs.data.calc_tasks import calc3_row, calc3_score
from gpu_jobs.data.rendering import normalize_messages
from gpu_jobs.rollout.environments import StepResult, register_environment

__all__ = ["CalculatorEnvironment", "FeedbackEnvironment"]


def _ground_truth(row: dict[str, Any]) -> Any:
    reward_model = row.get("reward_model") or {}
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def _last_answer(messages: list[dict[str, Any]]) -> str:
    """The model's last turn's text ('' when the conversation holds none)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


@register_environment("calculator")
class CalculatorEnvironment:
    """3-digit multiplication with the calculator tool; one answer, reward 1 if it is right."""

    def __init__(self, require_call: bool = False):
        self.require_call = require_call
        self.truth: Any = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.truth = _ground_truth(row)
        return normalize_messages(row["prompt"])

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        called = any(m["role"] == "tool" for m in messages)
        right = calc3_score(_last_answer(messages), self.truth)
        return StepResult([], right if called or not self.require_call else 0.0, True)


@register_environment("feedback")
class FeedbackEnvironment:
    """A user who checks each answer with the row's built-in scorer and asks again when it is wrong."""

    def __init__(self, max_attempts: int = 2, retry_message: str = "That's not right, try again.",
                 pass_score: float = 1.0):
        if max_attempts < 1:
            raise ValueError(f"feedback: max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts, self.retry_message, self.pass_score = max_attempts, retry_message, pass_score
        self.row: dict[str, Any] = {}
        self.attempts = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.row, self.attempts = dict(row), 0
        return normalize_messages(row["prompt"])

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        from gpu_jobs.reward import default_compute_score

        self.attempts += 1
        row = self.row
        score = default_compute_score(row["data_source"], _last_answer(messages), _ground_truth(row),
                                      row.get("extra_info"))
        score = float(score["score"] if isinstance(score, dict) else score)
        if score >= self.pass_score or self.attempts >= self.max_attempts:
            return StepResult([], score, True)
        return StepResult([{"role": "user", "content": self.retry_message}], score, False)
