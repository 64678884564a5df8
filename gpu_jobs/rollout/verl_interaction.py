"""A verl interaction class (verl.interactions.base.BaseInteraction's interface) run as an rlmill
environment (gpu_jobs.rollout.environments), so verl's simulated users work unchanged.

    >>> from gpu_jobs.rollout.environment_config import EnvironmentConfig, load_environment
    >>> make = load_environment(EnvironmentConfig(name="my_pkg.interactions.Gsm8kInteraction",
    ...                                           kwargs={"name": "gsm8k"}))
    >>> env = make()        # a VerlInteraction holding Gsm8kInteraction(config={"name": "gsm8k"})

verl builds an interaction once with `Class(config=...)` and drives it per request with async
calls; here each episode gets its own instance, and the calls map onto the protocol as verl's
tool agent loop makes them:

- `reset(row)`: `start_interaction(instance_id, **interaction_kwargs)`, the kwargs being the
  row's `extra_info.interaction_kwargs` (verl's data convention); the opening messages are the
  row's prompt, since a verl interaction does not write them.
- `step(messages)`: `generate_response(instance_id, messages, **interaction_kwargs)` ->
  (should_terminate, text, turn score, extra): the text comes back as one user turn, the score
  is the turn's reward (None, which verl skips, counts 0) and should_terminate ends the episode.
- `calculate_score` and `finalize_interaction` are not called, as in verl's tool agent loop:
  the turn's score is what generate_response returns, and the state goes with the instance.

The instance lives in the adapter's attributes: it is copied for each response to a prompt and
travels pickled to the sandbox's workers and back, so its state must be plain data in the
object (verl's examples keep it in a dict keyed by instance id), never a server-side session or
an open connection. Each call runs its coroutine to completion on a fresh event loop for the
same reason: nothing may stay bound to one loop between calls.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from typing import Any

from gpu_jobs.data.rendering import normalize_messages
from gpu_jobs.rollout.environments import StepResult

__all__ = ["VerlInteraction", "is_module_path", "import_interaction_class", "default_interaction_name"]

# What makes a class a verl interaction: the two calls an agent loop makes.
_VERL_METHODS = ("start_interaction", "generate_response")


def is_module_path(name: str) -> bool:
    """Whether `name` is a dotted 'package.module.Class' path (not a built-in's plain name).

    >>> is_module_path("verl.interactions.gsm8k_interaction.Gsm8kInteraction"), is_module_path("feedback")
    (True, False)
    """
    parts = name.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def default_interaction_name(class_path: str) -> str:
    """verl's name for an interaction the YAML leaves unnamed: the class name without its
    'Interaction' suffix, lower-cased.

    >>> default_interaction_name("verl.interactions.gsm8k_interaction.Gsm8kInteraction")
    'gsm8k'
    """
    simple = class_path.rpartition(".")[2]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def import_interaction_class(class_path: str) -> type:
    """The verl interaction class at 'package.module.Class'; raises ImportError or TypeError
    naming the path and the fix."""
    module, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"environment {class_path!r}: cannot import it ({type(e).__name__}: {e}); install its "
                          "package or put it on PYTHONPATH") from None
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in _VERL_METHODS):
        raise TypeError(f"environment {class_path!r} is not a verl interaction (start_interaction, "
                        "generate_response): name your rlmill environment class with environment.path (its file) "
                        "and environment.name")
    return cls


def _done(value: Any) -> Any:
    """`value`, or what it resolves to when it is awaitable (verl's calls are async; a plain
    function's result is taken as is)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def _interaction_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """A row's `extra_info.interaction_kwargs` (verl's convention; extra_info may be JSON text)."""
    extra = row.get("extra_info") or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    return dict(extra.get("interaction_kwargs") or {}) if isinstance(extra, dict) else {}


class VerlInteraction:
    """One episode of a verl interaction, with rlmill's reset/step (see the module docstring)."""

    def __init__(self, interaction_class: type, config: dict[str, Any]):
        self.name = str(config.get("name") or default_interaction_name(interaction_class.__qualname__))
        self.interaction = interaction_class(config={**config, "name": self.name})
        self.instance_id: str | None = None
        self.kwargs: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Start the interaction with the row's interaction_kwargs; the row's prompt opens the episode."""
        self.kwargs = _interaction_kwargs(row)
        asked = self.kwargs.get("name")
        if asked is not None and asked != self.name:  # verl would route it to another interaction
            raise ValueError(f"the row's interaction_kwargs name {asked!r}, but the configured interaction is "
                             f"{self.name!r} (rlmill runs one)")
        # A stable id per dataset row (verl uses its request id): the instance is this episode's alone.
        wanted = f"rlmill-{row.get('row', 0)}"
        self.instance_id = str(_done(self.interaction.start_interaction(wanted, **self.kwargs)) or wanted)
        return normalize_messages(row.get("prompt"))

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        """One generate_response: its text as a user turn, its score as the reward."""
        out = _done(self.interaction.generate_response(self.instance_id, messages, **self.kwargs))
        if not isinstance(out, (tuple, list)) or len(out) != 4:
            raise TypeError("a verl interaction's generate_response returns (should_terminate, text, score, extra)")
        terminate, text, score, _ = out
        return StepResult([{"role": "user", "content": "" if text is None else str(text)}],
                          0.0 if score is None else float(score), bool(terminate))
