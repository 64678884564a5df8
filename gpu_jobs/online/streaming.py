"""`stream: true` as the tokens are generated: the text each new token adds, held back only where a
stop string or a half-decoded character could still change it, and (chat with tools) where a
tool call could be starting.

    text = TokenText(n=2, tokenizer=tok, stops=["\\n"])
    text.add(0, token_id)      # -> "4": what choice 0's text gained and can be sent now ("" if nothing)
    text.rest(0, "46")         # -> "6": what is left to send once the final text is known

    calls = ToolText(functools.partial(tools.judge_checked, tools=tools_list, executor=pool))
    await calls.add("Sure <tool")    # -> "Sure": content that no call can change any more
    final_deltas("chat", shaped_choice, calls.sent, tokenizer)   # the rest, the calls, the finish

Why hold back: a stop string cuts the final text before it (protocol.make_choices), so the last
len(longest stop) - 1 characters may still be cut and are not sent until the answer ends; a
choice whose text contains a stop string sends nothing more. A character whose bytes span two
tokens decodes to U+FFFD until its last token arrives, so it waits too. Each step decodes only the
tokens since the choice's last complete character (detok.py: offsets, as vLLM and TGI do), so a
streamed answer of L tokens costs O(L) short decodes, and what is sent is always a prefix of the
final text.

With tools (vLLM's Hermes tool parser streams the same way) the content is sent while the text
cannot be the start of a `<tool_call>`: only a suffix that is a prefix of `<tool_call>` (and the
whitespace before it, which the content of an answer with calls leaves out) is held. From the
first `<tool_call>` on, the text is held: once a block closes malformed (or more than MAX_CALLS
close), the answer is text whatever follows, and everything held goes out as content at once and
the rest as it comes; otherwise the calls go out when the answer ends, as `delta.tool_calls`
chunks in OpenAI's shape (per call: index, id, type and function.name with empty arguments, then
the arguments), the last chunk with finish_reason "tool_calls". They wait for the end, not for
their block's close as in vLLM, because what follows can still turn a well-formed call into text
in the non-streamed answer (a malformed later call, a cut at max_tokens): the answer streamed is
the non-streamed one (tools.shape_choices on the final text decides both), and so is the answer
logged. A Hermes model ends its turn right after its calls, so the wait is the later calls'
tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from concurrent.futures import Future
from typing import Any, AsyncIterator, Awaitable, Callable

from gpu_jobs.online.detok import Detokenizer
from gpu_jobs.online.tools import MAX_CALLS, content_of, judge_checked
from gpu_jobs.chat.hermes import TAG

__all__ = ["TokenText", "ToolText", "chunk", "delta", "final_deltas", "sendable", "sse_answer", "stream_body"]

END = "</tool_call>"

log = logging.getLogger("rlmill.serve")


class TokenText:
    """The streamed text of `n` choices (see the module docstring); each choice's text is built
    incrementally (detok.Detokenizer), so a token costs a decode of a few tokens, and the stop
    strings are looked for only where the new text could complete one."""

    def __init__(self, n: int, tokenizer: Any, stops: list[str] | None):
        self.tokenizer, self.stops = tokenizer, [s for s in stops or () if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.texts = [Detokenizer(tokenizer) for _ in range(n)]
        self.shown = [""] * n
        self.stopped = [False] * n

    def add(self, choice: int, token: int) -> str:
        """Take one sampled token of `choice`; the text it lets us send now."""
        if self.stopped[choice]:
            return ""
        decoded = self.texts[choice]
        piece = decoded.add(token)
        if not piece:
            return ""
        text = decoded.text
        tail = text[max(0, len(text) - len(piece) - self.hold):]  # a new stop ends inside it
        if any(s in tail for s in self.stops):
            self.stopped[choice] = True  # the final text ends before the stop: the rest comes at the end
            return ""
        safe = len(text) - self.hold
        shown = len(self.shown[choice])
        if safe <= shown:
            return ""
        out = text[shown:safe]
        self.shown[choice] += out
        return out

    def rest(self, choice: int, final: str) -> str:
        """What remains to send of `choice` whose final text is `final`."""
        shown = self.shown[choice]
        return final[len(shown):] if final.startswith(shown) else ""


def sendable(text: str, judge: Callable[[str], bool]) -> str:
    """The content that an answer's text so far (`text`) already fixes, whatever comes after it:
    `judge(block)` says whether a closed `<tool_call>...</tool_call>` block is well formed.

    >>> sendable("Sure <tool_c", lambda block: True)
    'Sure'
    >>> sendable("Sure <tool_call>bad</tool_call> more", lambda block: False)
    'Sure <tool_call>bad</tool_call> more'
    """
    start = text.find(TAG)
    if start < 0:
        held = next((k for k in range(min(len(TAG) - 1, len(text)), 0, -1) if text.endswith(TAG[:k])), 0)
        # trailing whitespace waits too: before a call, content_of leaves it out
        return text[:len(text) - held].rstrip()
    at, closed = start, 0
    while (end := text.find(END, at)) >= 0:
        closed += 1
        if closed > MAX_CALLS or not judge(text[at:end + len(END)]):
            return text  # the answer will be its text (tools.shape_choice): all of it is content
        if (at := text.find(TAG, end + len(END))) < 0:
            break
    return text[:start].rstrip()


class _Unjudged(Exception):
    """sendable needs the verdict on a block not judged yet."""

    def __init__(self, block: str):
        self.block = block


class ToolText:
    """The content streamed of one chat choice with tools (see the module docstring): `add`
    takes the text a token added (TokenText.add) and returns the content to send now; `sent` is
    all the content sent so far. Each closed block is judged once, by the async `judge`
    (tools.judge_checked: off the event loop, with a deadline)."""

    def __init__(self, judge: Callable[[str], Awaitable[bool]]):
        self.check, self.judged = judge, {}
        self.text = self.sent = ""

    def _known(self, block: str) -> bool:
        if block not in self.judged:
            raise _Unjudged(block)
        return self.judged[block]

    async def add(self, piece: str) -> str:
        """Take the text a token added; the content it lets us send now ("" if none)."""
        self.text += piece
        while True:
            try:
                now = sendable(self.text, self._known)
                break
            except _Unjudged as need:  # a block closed: judged once, then the text is read again
                self.judged[need.block] = bool(await self.check(need.block))
        if len(now) <= len(self.sent) or not now.startswith(self.sent):
            return ""
        out, self.sent = now[len(self.sent):], now
        return out


def final_deltas(kind: str, choice: dict, sent: str | None, tokenizer: Any) -> list[dict]:
    """The deltas that end one choice once its final form (tools.shape_choices applied) is
    known: the rest of its content (its whole text cut at token boundaries when nothing was sent
    yet), its tool calls in OpenAI's chunk shape, and its finish reason. `sent`: the content the
    client has (None or "": nothing)."""
    from gpu_jobs.online.protocol import _pieces

    i, calls = choice["index"], choice.get("tool_calls")
    final = (content_of(choice["text"]) or "") if calls else choice["text"]
    if sent:
        pieces = [final[len(sent):]] if final.startswith(sent) else []
    else:
        pieces = [final] if calls else _pieces(choice, tokenizer)
    out = [delta(kind, i, p) for p in pieces if p]
    for k, c in enumerate(calls or ()):
        f = c["function"]
        out.append(_calls_delta(i, {"index": k, "id": c["id"], "type": "function",
                                    "function": {"name": f["name"], "arguments": ""}}))
        out.append(_calls_delta(i, {"index": k, "function": {"arguments": f["arguments"]}}))
    return out + [delta(kind, i, finish_reason=choice["finish_reason"])]


def _calls_delta(index: int, call: dict) -> dict:
    return {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}


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
                     finish: Callable[[list[dict]], Awaitable[Any]], include_usage: bool,
                     held: contextlib.ExitStack, shape: Callable[[list[dict]], Awaitable[Any]] | None = None,
                     judge: Callable[[str], Awaitable[bool]] | None = None) -> AsyncIterator[str]:
    """The events of one streamed answer: each choice's text as its tokens arrive on `tokens`
    ((choice, token) pairs, then None once `sent` resolved), then what the final choices
    (protocol.make_choices) add, finish reasons, usage, and `[DONE]`. With tools, `judge` (is a
    closed `<tool_call>` block well formed) holds the calls back (ToolText) and `shape(choices)`
    makes the final choices' tool_calls as the non-streamed answer does. `finish(choices)` logs
    the answer once, before `[DONE]`; `held` (the request's lease on its version) is released
    when the stream ends, however it ends."""
    from gpu_jobs.online.protocol import _usage, make_choices

    with held:
        text = TokenText(n, tokenizer, stops)
        calls = [ToolText(judge) for _ in range(n)] if judge is not None else None
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
            piece = text.add(*item)
            if piece and calls is not None:
                piece = await calls[item[0]].add(piece)
            if piece:
                yield chunk(head, [delta(kind, item[0], piece)])
        try:
            choices = make_choices(sent.result(), tokenizer, stops)
            if shape is not None:
                await shape(choices)
        except Exception as exc:  # noqa: BLE001 -- the status line is gone: the error goes in the stream
            log.exception("a streamed generation failed")
            yield _error(500, f"generation failed: {type(exc).__name__}", "server_error")
            return
        for c in choices:
            shown = calls[c["index"]].sent if calls is not None else text.shown[c["index"]]
            for part in final_deltas(kind, c, shown, tokenizer):
                yield chunk(head, [part])
        if include_usage:
            yield chunk(head, [], usage=_usage(prompt_ids, choices))
        await finish(choices)
        yield "data: [DONE]\n\n"


def stream_body(kind: str, req: Any, served: Any, submit: Callable[..., Future], drop: Callable[[Future], None],
                answer_id: str, created: int, prompt_ids: list[int], finish: Callable[[list[dict]], Awaitable[Any]],
                lease: contextlib.ExitStack, shape: Callable[[list[dict]], Awaitable[Any]] | None, checks: Any,
                timeout_s: float | None) -> AsyncIterator[str]:
    """Queue the request (`submit(on_token=...)`, which raises the 429 of a full queue before the
    response starts) with a token callback, and return its events (sse_answer). With `shape`
    (tools) its calls are held back and judged in `checks` (tools.judge_checked). The request is
    dropped (`drop`: out of the queue, or its generation stopped) when the stream ends first:
    its client left or its deadline passed."""
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue = asyncio.Queue()
    sent = submit(on_token=lambda row, token: loop.call_soon_threadsafe(tokens.put_nowait, (row, token)))
    sent.add_done_callback(lambda _: loop.call_soon_threadsafe(tokens.put_nowait, None))
    lease.callback(drop, sent)  # a no-op once the rows are in
    head = {"id": answer_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": served.name, "system_fingerprint": f"{served.name}@{served.version}"}
    usage = bool(req.stream_options and req.stream_options.include_usage)
    judge = None
    if shape is not None:
        judge = functools.partial(judge_checked, tools=req.tool_list(), executor=checks)
    return sse_answer(kind, head, prompt_ids, req.n, served.tokenizer, req.stop, tokens, sent, timeout_s, finish,
                      usage, lease.pop_all(), shape, judge)


def _error(status: int, message: str, kind: str) -> str:
    """An error inside a stream whose status line (200) is already sent, in OpenAI's shape."""
    from gpu_jobs.online.protocol import error_body

    return f"data: {json.dumps(error_body(status, message, None, kind))}\n\n"
