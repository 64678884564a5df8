"""Running environments' `reset` and `step` for a batch of episodes: built-ins here, a user's
environment in the tool sandbox (gpu_jobs.reward.sandbox), under the tools' limits.

    >>> runner = EnvironmentRunner(EnvironmentConfig(name="feedback"), timeout_s=10, num_workers=2,
    ...                            max_chars=64, side="middle")
    >>> [(env, messages)] = runner.reset([row])
    >>> [(env, result)] = runner.step([(env, messages + [{"role": "assistant", "content": "5"}])])
    >>> result.reward, result.done

A user's environment runs in worker processes with `tool_timeout_s` per call, like a user's
tool: its instance is pickled there with the conversation and comes back after the call (the
worker loaded the same file first, so the class unpickles under the same module name). A reset
or step that raises, hangs past the limit or kills its worker ends that episode with reward 0
(`failed` below), never the rollout. Every message the environment returns is cut to
`max_tool_response_length` characters, as a tool's answer is.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_environment
from gpu_jobs.rollout.environments import StepResult, step_result
from gpu_jobs.chat.tool_worker import truncate_text

__all__ = ["EnvironmentRunner", "FAILED"]

FAILED = "error"  # the env slot of an episode whose environment failed: it is over, reward 0

_WORKER: dict[str, Any] = {}


def _limited(result: StepResult, max_chars: int, side: str) -> StepResult:
    cut = [{"role": m["role"], "content": truncate_text(m["content"], max_chars, side)} for m in result.messages]
    return StepResult(cut, result.reward, result.done)


def _do_reset(factory, row: dict) -> tuple[Any, list[dict]]:
    env = factory()
    return env, step_result((env.reset(row), 0.0, False)).messages


def _do_step(env: Any, messages: list[dict], max_chars: int, side: str) -> tuple[Any, StepResult]:
    return env, _limited(step_result(env.step(messages)), max_chars, side)


# Worker side (module-level: pickled by reference); the user's file is loaded once per worker.
def _worker_init(cfg: dict, max_chars: int, side: str) -> None:
    _WORKER.update(factory=load_environment(EnvironmentConfig.model_validate(cfg, context={"check_files": False})),
                   max_chars=max_chars, side=side)


def _worker_call(task: tuple) -> tuple:
    kind, payload = task
    try:
        if kind == "reset":
            return ("ok", _do_reset(_WORKER["factory"], payload))
        env, messages = payload
        return ("ok", _do_step(env, messages, _WORKER["max_chars"], _WORKER["side"]))
    except Exception as e:  # the environment's bug ends its episode, never the rollout
        return ("error", f"{type(e).__name__}: {e}")


class EnvironmentRunner:
    """reset/step for many episodes at once; a failed one comes back as (FAILED, message)."""

    def __init__(self, cfg: EnvironmentConfig, timeout_s: float, num_workers: int, max_chars: int, side: str):
        self.cfg, self.timeout_s, self.num_workers = cfg, timeout_s, num_workers
        self.max_chars, self.side = max_chars, side
        self.factory = load_environment(cfg)  # here too: a bad file or name fails now, with its message
        self.sandboxed = cfg.user_code  # a file or a verl interaction: the user's code

    def reset(self, rows: Sequence[dict]) -> list[tuple[Any, Any]]:
        """(environment, opening messages) per row, or (FAILED, message)."""
        return self._run([("reset", dict(r)) for r in rows])

    def step(self, episodes: Sequence[tuple[Any, list[dict]]]) -> list[tuple[Any, Any]]:
        """(environment after the step, StepResult) per (environment, conversation), or (FAILED, message)."""
        return self._run([("step", (env, list(messages))) for env, messages in episodes])

    @staticmethod
    def copies(env: Any, n: int) -> list[Any]:
        """`n` independent copies of a freshly reset environment, one per response to its prompt."""
        return [env] + [copy.deepcopy(env) for _ in range(n - 1)]

    def _run(self, tasks: list[tuple]) -> list[tuple[Any, Any]]:
        if not tasks:
            return []
        results = self._in_sandbox(tasks) if self.sandboxed else [self._here(t) for t in tasks]
        return [(FAILED, out) if status != "ok" else out for status, out in results]

    def _here(self, task: tuple) -> tuple:
        kind, payload = task
        try:
            if kind == "reset":
                return ("ok", _do_reset(self.factory, payload))
            return ("ok", _do_step(*payload, self.max_chars, self.side))
        except Exception as e:  # a built-in's bug: the same treatment as a user's
            return ("error", f"{type(e).__name__}: {e}")

    def _in_sandbox(self, tasks: list[tuple]) -> list[tuple]:
        from gpu_jobs.reward.sandbox import Failed, SandboxSpec, run_guarded

        spec = SandboxSpec(work=_worker_call, timeout_s=self.timeout_s, num_workers=self.num_workers,
                           what="environment", init=_worker_init,
                           init_args=(self.cfg.model_dump(), self.max_chars, self.side))
        results, _ = run_guarded(tasks, spec)
        return [("error", f"{r.kind}: {r.message}") if isinstance(r, Failed) else r for r in results]
