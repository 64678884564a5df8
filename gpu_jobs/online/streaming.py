"""`stream: true` as the tokens are generated: the text each new token adds, held back only where a
stop string or a half-decoded character could still change it.

    text = TokenText(n=2, tokenizer=tok, stops=["\\n"])
    text.add(0, token_id)      # -> "4": what choice 0's text gained and can be sent now ("" if nothing)
    text.rest(0, "46")         # -> "6": what is left to send once the final text is known

Why hold back: a stop string cuts the final text before it (protocol.make_choices), so the last
len(longest stop) - 1 characters may still be cut and are not sent until the answer ends; a
choice whose text contains a stop string sends nothing more. A character whose bytes span two
tokens decodes to U+FFFD until its last token arrives, so a trailing U+FFFD waits too. Each step
decodes the choice's tokens so far (fast tokenizers: well under a millisecond for hundreds of
tokens), so what is sent is always a prefix of the final text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import Future
from typing import Any, AsyncIterator, Awaitable, Callable

__all__ = ["TokenText", "chunk", "delta", "sse_answer"]

log = logging.getLogger("rlmill.serve")


class TokenText:
    """The streamed text of `n` choices (see the module docstring)."""

    def __init__(self, n: int, tokenizer: Any, stops: list[str] | None):
        self.tokenizer, self.stops = tokenizer, [s for s in stops or () if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.shown = [""] * n
        self.stopped = [False] * n

    def add(self, choice: int, token: int) -> str:
        """Take one sampled token of `choice`; the text it lets us send now."""
        if self.stopped[choice]:
            return ""
        self.ids[choice].append(token)
        text = self.tokenizer.decode(self.ids[choice], skip_special_tokens=True)
        if any(s in text for s in self.stops):
            self.stopped[choice] = True  # the final text ends before the stop: the rest comes at the end
            return ""
        safe = text[:len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd")
        shown = self.shown[choice]
        if len(safe) <= len(shown) or not safe.startswith(shown):
            return ""
        self.shown[choice] = safe
        return safe[len(shown):]

    def rest(self, choice: int, final: str) -> str:
        """What remains to send of `choice` whose final text is `final`."""
        shown = self.shown[choice]
        return final[len(shown):] if final.startswith(shown) else ""


def chunk(head: dict, part: list[dict], **extra) -> str:
    """One server-sent event in OpenAI's chunk format."""
    return f"data: {json.dumps({**head, 'choices': part, **extra})}\n\n"


def delta(kind: str, index: int, piece: str | None = None, finish_reason: str | None = None,
          role: bool = False) -> dict:
    """One choice's part of a chunk: new text, a finish reason, or (chat) the assistant's role."""
    if kind == "chat":
        body = {"role": "assistant", "content": ""} if role else {} if piece is None else {"content": piece}
        return {"index": index, "delta": body, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish_reason}


async def sse_answer(kind: str, head: dict, prompt_ids: list[int], n: int, tokenizer: Any, stops: list[str] | None,
                     tokens: asyncio.Queue, sent: Future, timeout_s: float | None,
                     finish: Callable[[list[dict]], Awaitable[None]], include_usage: bool,
                     held: contextlib.ExitStack) -> AsyncIterator[str]:
    """The events of one streamed answer: each choice's text as its tokens arrive on `tokens`
    ((choice, token) pairs, then None once `sent` resolved), then what the final choices
    (protocol.make_choices) add, finish reasons, usage, and `[DONE]`. `finish(choices)` logs the
    answer once, before `[DONE]`; `held` (the request's lease on its version) is released when the
    stream ends, however it ends."""
    from gpu_jobs.online.protocol import _pieces, _usage, make_choices

    with held:
        text = TokenText(n, tokenizer, stops)
        if kind == "chat":
            yield chunk(head, [delta(kind, i, role=True) for i in range(n)])
        loop = asyncio.get_running_loop()
        deadline = None if not timeout_s else loop.time() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                item = await asyncio.wait_for(tokens.get(), left)
            except TimeoutError:
                yield _error(504, f"no answer within {timeout_s:g} s (--request-timeout-s)", "timeout_error")
                return
            if item is None:
                break
            if piece := text.add(*item):
                yield chunk(head, [delta(kind, item[0], piece)])
        try:
            choices = make_choices(sent.result(), tokenizer, stops)
        except Exception as exc:  # noqa: BLE001 -- the status line is gone: the error goes in the stream
            log.exception("a streamed generation failed")
            yield _error(500, f"generation failed: {type(exc).__name__}", "server_error")
            return
        for c in choices:
            i = c["index"]
            pieces = _pieces(c, tokenizer) if not text.shown[i] else [p for p in (text.rest(i, c["text"]),) if p]
            for piece in pieces:
                yield chunk(head, [delta(kind, i, piece)])
            yield chunk(head, [delta(kind, i, finish_reason=c["finish_reason"])])
        if include_usage:
            yield chunk(head, [], usage=_usage(prompt_ids, choices))
        await finish(choices)
        yield "data: [DONE]\n\n"


def _error(status: int, message: str, kind: str) -> str:
    """An error inside a stream whose status line (200) is already sent, in OpenAI's shape."""
    from gpu_jobs.online.protocol import error_body

    return f"data: {json.dumps(error_body(status, message, None, kind))}\n\n"
