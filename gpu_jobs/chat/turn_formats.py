"""How a multi-turn rollout's turns look in tokens, one registry entry per call format:
the prompt (with the tools shown), the calls parsed from a model turn, and the token ids of
the turn that carries the results back.

    >>> from gpu_jobs.chat.turn_formats import TURN_FORMATS
    >>> turns = TURN_FORMATS["hermes"](tokenizer, ToolSet(["calculator"]))
    >>> prompt = turns.prompt(render_prompt([{"role": "user", "content": "123*456?"}], tokenizer))
    >>> turns.parse('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "123*456"}}\\n</tool_call>')
    [Call(name='calculator', arguments={'expression': '123*456'})]
    >>> turns.result_ids(["56088"])      # the tool turn, rendered alone and tokenized alone
    >>> turns.message_ids([{"role": "user", "content": "Try again."}])   # an environment's turn

Token-in/token-out: the agent loop appends exactly these ids after exactly the tokens the
engine sampled; nothing is ever re-rendered from text. `hermes` uses the chat template's own
tool section when it has one (`apply_chat_template(..., tools=...)` differs from without), else
writes Qwen2.5's `# Tools` section into the system turn and returns results as
`<tool_response>` blocks in a user turn (gpu_jobs.chat.hermes). A prompt with its own system
message gets the tools in that message (after its text, as Qwen2.5's template writes them):
`turns.prompt(ids, messages)` with the prompt's messages.
"""

from __future__ import annotations

from typing import Any

from gpu_jobs.data.rendering import render_prompt
from gpu_jobs.registry import Registry
from gpu_jobs.chat.hermes import Call, CallError, parse_calls, tools_section, tool_response
from gpu_jobs.chat.tools import ToolSet, get_tool_format

__all__ = ["TURN_FORMATS", "BracketsTurns", "HermesTurns", "render_text"]

TURN_FORMATS: Registry = Registry("multi-turn call format")

# Contents no real conversation holds: where they land in a rendering marks the turn boundaries.
_PROBE_USER, _PROBE_ASSISTANT = "\x1fPROBE-USER\x1f", "\x1fPROBE-ASSISTANT\x1f"
# Distinct system messages whose splice a HermesTurns keeps: a dataset shares a few, and one with
# a system message per row must not grow the cache without bound.
_SYSTEM_SPLICES = 1024


def render_text(tokenizer: Any, messages: list[dict], generation_prompt: bool, tools: list | None = None) -> str:
    """The chat template's text of `messages` (no tokenizing)."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@TURN_FORMATS.register("brackets")
class BracketsTurns:
    """rlmill's own format for the built-in model: one call '[name(arguments)]' per turn, its
    answer '<text>' appended as is."""

    def __init__(self, tokenizer: Any, tools: ToolSet):
        self.tokenizer, self.tools, self.format = tokenizer, tools, get_tool_format("brackets")

    def prompt(self, ids: list[int], messages: list[dict] | None = None) -> list[int]:
        """`ids` unchanged: the brackets format shows no tools in the prompt."""
        return list(ids)

    def parse(self, text: str) -> list[Call | CallError]:
        call = self.format.parse_call(text)
        if call is None:
            return []
        if call[0] not in self.tools.entries:
            return [CallError(f"error: unknown tool {call[0]!r}; tools: {', '.join(sorted(self.tools.entries))}")]
        return [Call(*call)]

    def result_ids(self, results: list[str]) -> list[int]:
        return _encode(self.tokenizer, "".join(self.format.render_response(r) for r in results))

    def message_ids(self, messages: list[dict]) -> list[int]:
        """An environment's messages as the template writes them after a model turn, tokenized
        alone (a `tool` message as a tool answer '<text>')."""
        if messages and all(m["role"] == "tool" for m in messages):
            return self.result_ids([m["content"] for m in messages])
        return _encode(self.tokenizer, _after_model_turn(self.tokenizer, messages, None))


@TURN_FORMATS.register("hermes")
class HermesTurns:
    """OpenAI tools in the Hermes format, through the model's chat template."""

    def __init__(self, tokenizer: Any, tools: ToolSet):
        self.tokenizer, self.schemas = tokenizer, tools.schemas()
        self.tool_list = list(self.schemas.values())
        probe = [{"role": "user", "content": _PROBE_USER}]
        self.native = render_text(tokenizer, probe, True, self.tool_list) != render_text(tokenizer, probe, True)
        # No tools (an environment alone): prompts stay as rendered, nothing to splice in.
        self.plain_prefix, self.tools_prefix = _prompt_splice(tokenizer, self._with_tools) if self.tool_list else ([], [])
        self._system_splices: dict[str, tuple[list[int], list[int]]] = {}

    def _with_tools(self, messages: list[dict]) -> str:
        """The template's text of `messages` with the tools shown (natively or in the system turn)."""
        if self.native:
            return render_text(self.tokenizer, messages, True, self.tool_list)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        rest = messages[1:] if system is not None else messages
        return render_text(self.tokenizer, [{"role": "system", "content": tools_section(self.tool_list, system)},
                                            *rest], True)

    def prompt(self, ids: list[int], messages: list[dict] | None = None) -> list[int]:
        """`ids` (a prompt rendered without tools) with the template's tool section in place.

        `messages` are the prompt's own messages (None: not known). When they open with a system
        message the tools go into it, and `ids` must be exactly those messages' rendering
        (render_prompt); else `ids` must start with the template's plain system turn (its default
        one). Either way the tokens after the system turn are kept exactly as given."""
        if not self.tool_list:
            return list(ids)
        system = _own_system(messages)
        if system is None:
            plain, tooled = self.plain_prefix, self.tools_prefix
        else:
            # The splice is computed from the messages: they must be what `ids` were rendered
            # from, or the tools could land inside a longer system text.
            if render_prompt(messages, self.tokenizer) != list(ids):
                raise ValueError("rollout.multi_turn.format=hermes: a prompt's token ids are not its messages as "
                                 "the chat template renders them (another prompt column, or other template "
                                 "arguments?); the tools cannot be placed in its system message")
            plain, tooled = self._system_splice(system)
        if list(ids[:len(plain)]) == plain:
            return tooled + list(ids[len(plain):])
        if messages is None:
            why = ("does not start with the chat template's plain system turn (does it hold its own system "
                   "message? pass the prompts' messages: generate(..., rows=...), as generate_with_rows does)")
        elif system is None:
            why = "does not start with the chat template's plain system turn, and its messages hold no system message"
        else:
            why = "does not start with its system turn as the template renders it alone"
        raise ValueError(f"rollout.multi_turn.format=hermes: a prompt {why}; the tools cannot be placed in it")

    def _system_splice(self, system: str) -> tuple[list[int], list[int]]:
        """(plain prefix, prefix with tools) of prompts whose own system message is `system`."""
        if system not in self._system_splices:
            if len(self._system_splices) >= _SYSTEM_SPLICES:
                self._system_splices.clear()
            self._system_splices[system] = _prompt_splice(self.tokenizer, self._with_tools, system)
        return self._system_splices[system]

    def parse(self, text: str) -> list[Call | CallError]:
        return parse_calls(text, self.schemas)

    def result_ids(self, results: list[str]) -> list[int]:
        """The results' turn as the template writes it after a model turn, tokenized alone:
        `tool` messages where the template has a tool section, else one user turn of
        `<tool_response>` blocks; it ends with the next assistant turn's header."""
        return self.message_ids([{"role": "tool", "content": r} for r in results])

    def message_ids(self, messages: list[dict]) -> list[int]:
        """Messages after a model turn (tool results, an environment's user turn), rendered alone
        and tokenized alone; without a native tool section, each run of `tool` messages becomes
        one user turn of `<tool_response>` blocks, as Qwen2.5's template writes them."""
        if not self.native:
            messages = _tool_runs_as_user_turns(messages)
        return _encode(self.tokenizer, _after_model_turn(self.tokenizer, messages, self.tool_list if self.native
                                                         else None))


def _tool_runs_as_user_turns(messages: list[dict]) -> list[dict]:
    """Consecutive `tool` messages merged into one user turn of `<tool_response>` blocks."""
    out: list[dict] = []
    run: list[str] = []
    for m in [*messages, None]:
        if m is not None and m["role"] == "tool":
            run.append(m["content"])
            continue
        if run:
            out.append({"role": "user", "content": tool_response(run)})
            run = []
        if m is not None:
            out.append(m)
    return out


def _after_model_turn(tokenizer: Any, messages: list[dict], tools: list | None) -> str:
    """The template's text between the end of a model turn (its EOS included: the model samples
    it) and the next model turn, when `messages` come in between."""
    convo = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    full = render_text(tokenizer, convo + messages, True, tools)
    at = full.find(_PROBE_ASSISTANT)
    if at >= 0:
        rest = full[at + len(_PROBE_ASSISTANT):]
        eos = tokenizer.eos_token or ""
        return rest[len(eos):] if eos and rest.startswith(eos) else rest
    # A template that drops assistant turns (the built-in model's): what the messages add.
    base = render_text(tokenizer, convo, False, tools)
    if not full.startswith(base):
        raise ValueError("the chat template does not render tool results after a model turn")
    return full[len(base):]


def _own_system(messages: list[dict] | None) -> str | None:
    """The text of the system message `messages` open with, or None (no messages, or no system message)."""
    if messages and messages[0].get("role") == "system":
        return str(messages[0].get("content") or "")
    return None


def _prompt_splice(tokenizer: Any, with_tools, system: str | None = None) -> tuple[list[int], list[int]]:
    """(plain prefix, prefix with tools): the leading tokens where a prompt rendered with the
    tools differs from one rendered without, for prompts opening with the system message
    `system` (None: none of their own); the same for every conversation (checked on two)."""
    head = [] if system is None else [{"role": "system", "content": system}]
    found = []
    for text in (_PROBE_USER, "2+2?"):
        msgs = head + [{"role": "user", "content": text}]
        plain = _encode(tokenizer, render_text(tokenizer, msgs, True))
        tooled = _encode(tokenizer, with_tools(msgs))
        same = 0
        while same < min(len(plain), len(tooled)) and plain[-1 - same] == tooled[-1 - same]:
            same += 1
        found.append((plain[:len(plain) - same], tooled[:len(tooled) - same]))
    if found[0] != found[1]:
        raise ValueError("the chat template's tool section depends on the conversation: rlmill cannot place it "
                         "in prompts rendered without tools")
    return found[0]
