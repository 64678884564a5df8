"""The OpenAI-compatible HTTP API (FastAPI) over one served model, swapped when CURRENT moves.

    server = Server(load_served_model(None), publisher=EventPublisher(url))
    uvicorn.run(create_app(server), host="127.0.0.1", port=8000)

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "builtin", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}'

Endpoints: POST /v1/chat/completions and /v1/completions (non-streaming, and `stream: true` as
server-sent events ending `data: [DONE]`), GET /v1/models, POST /v1/feedback, GET /health, and
GET /metrics (Prometheus text: requests, generate calls, events logged, buffered and dropped,
swaps, requests per canary arm). Errors have OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, one line each, and a client's mistake is always a 4xx: bad sampling parameters, a token
id outside the vocabulary or a prompt over --max-prompt-chars 400, a missing or wrong API key 401,
a key without the path's role 403, an unknown model or path 404, a body over --max-body-bytes 413,
over the caller's rate or a full engine queue 429 (with Retry-After), no answer within
--request-timeout-s 504; for feedback, a malformed body or an index past the answer's choices 422
naming the field, an unknown answer 404, a second vote by the same voter on the same choice 409,
an answer older than the retention window 410. Keys, rate limits and the body cap are checked by
the Gate middleware before the body is parsed (limits.py, auth.py); tokenisation runs off the
event loop (a worker thread), so one huge prompt never stalls the others.

Voters (auth.request_voter): a key's principal, or "<principal>/<user>" for a key marked
asserts_users; without keys nobody (anonymous). Events record the principal and the voter, never
the key. Votes: one per (answer, choice, voter) while the answer is in the index (answers.py);
without keys per `user`, else `session_id`, else the client address.

A request holds the generation (version) that was current when it arrived, from tokenizing its
prompt to publishing its event (swap.py): a hot swap never cuts it, and its event names the
version that answered. Its response goes out once its event is in the broker, or after
`event_wait_ms` (the event stays queued, counted as buffered; broker.py); the header
`X-Rlmill-Event` says which: logged, buffered, dropped (queue full) or off (no broker). A
streamed answer (`stream: true`) sends each token's text as the engine samples it (the hf engine
reports every decoding step; streaming.py) and logs its event once, at its end (`X-Rlmill-Event:
at-end`), holding its version until then.

During a canary (models/<name>/CANARY, swap.py) a request's generation is picked by its voter
(an HMAC with the canary's secret: the same voter always the same arm, a `user` a plain key sends
changes nothing); an anonymous request gets an arm of its own. /health names the canary only to
the metrics role. Its answer's `system_fingerprint` and event name the version of
its arm, which is how the rl-canary flow counts each arm's feedback.

Chat takes OpenAI's `tools` and `tool_choice` ("auto" | "none"), and messages with `tool_calls`
and `tool` results (tools.py): the prompt is rendered with them by hermes.render_chat (the
rollout's hermes format; training renders the logged conversation with it), an answer's well-formed Hermes calls come back as `tool_calls` (finish_reason
"tool_calls"; malformed ones stay text and are counted, rlmill_serve_malformed_tool_calls_total),
and the answer event logs the conversation, the tools and the calls. `parallel_tool_calls: false`
returns the first of several calls only (the others dropped and counted,
rlmill_serve_dropped_tool_calls_total). `stream: true` with tools sends the content as it comes
and the calls, held back, as `delta.tool_calls` chunks when the answer ends (streaming.py); both
paths shape the calls with one step (_shaper), so the streamed answer and its event are the
non-streamed ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpu_jobs.online.auth import has_role, request_voter
from gpu_jobs.online.answers import AnswerIndex, KnownAnswer, id_time, new_answer_id
from gpu_jobs.online.batching import Batcher, ClientGone, QueueFull, wait_rows
from gpu_jobs.online.events import answer_event, feedback_event
from gpu_jobs.online.http_guard import HttpGuard
from gpu_jobs.online.limits import Gate, InFlight, RateLimiter, ServeLimits, client_gone, client_key, principal_of
from gpu_jobs.online.protocol import (ApiError, ChatRequest, CompletionRequest, FeedbackRequest, ParamError,
                                      chat_response, check_token_ids, completion_response, error_body, make_choices,
                                      refused_param, sampling_of)
from gpu_jobs.online.streaming import stream_body
from gpu_jobs.online.swap import Generation, HotSwap
from gpu_jobs.online.tools import shape_checked
from gpu_jobs.chat.hermes import render_chat

__all__ = ["Server", "ServeSettings", "create_app"]

EVENT_HEADER = "X-Rlmill-Event"
log = logging.getLogger("rlmill.serve")


@dataclass(frozen=True)
class ServeSettings:
    retention_hours: float = 24.0  # feedback is taken for answers younger than this
    max_batch: int = 16  # requests per engine.generate call at most
    batch_wait_ms: float = 5.0  # how long the batcher collects requests after the first
    answer_index_size: int = 200_000  # recent answer ids kept for feedback checks
    event_wait_ms: float = 250.0  # how long a response waits for its event's XADD (0: never waits)
    watch_s: float = 0.0  # how often CURRENT is read for a hot swap (0: never; needs a source)
    limits: ServeLimits = field(default_factory=ServeLimits)  # body, prompt, queue, deadline and rate bounds
    http: HttpGuard = field(default_factory=HttpGuard)  # docs pages, allowed Host names, trusted proxies


class Server:
    """The served model (swapped when CURRENT moves), the recent-answer index, the event
    publisher (or None) and the API keys (an auth.ApiKeys, or None: no keys asked for). It owns
    `served`: its engine is closed when retired or at close()."""

    def __init__(self, served: Any, publisher: Any = None, settings: ServeSettings = ServeSettings(),
                 source: Any = None, keys: Any = None, recall: Any = None):
        # rates left unset are on with keys, off without (ServeLimits.resolved)
        settings = dataclasses.replace(settings, limits=settings.limits.resolved(keys is not None))
        self.publisher, self.settings, self.keys = publisher, settings, keys
        self.in_flight = InFlight(settings.limits.max_in_flight)  # per caller: its burst is its own 429
        self.recall = recall  # a recall.AnswerRecall: answers logged before a restart, or None
        self.models = HotSwap(served, self._batcher, source=source, watch_s=settings.watch_s)
        self.answers = AnswerIndex(settings.answer_index_size)
        self.rates = RateLimiter(settings.limits)
        # the model's tool calls checked against their schemas: never on the event loop or in
        # the pool tokenisation uses (tools.shape_checked)
        self.checks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlmill-tool-checks")
        self.refused: dict[int, int] = {}  # status -> requests the Gate refused (keys, rates, body size)
        self.counts = {"answers": 0, "feedback": 0, "events_not_logged": 0, "refused_votes": 0, "timeouts": 0,
                       "queue_full": 0, "recalled_answers": 0, "tool_calls": 0, "malformed_tool_calls": 0,
                       "dropped_tool_calls": 0, "client_gone": 0}

    def _batcher(self, engine: Any) -> Batcher:
        return Batcher(engine, max_batch=self.settings.max_batch, max_wait_s=self.settings.batch_wait_ms / 1000,
                       max_queue=self.settings.limits.max_queue)

    @property
    def served(self) -> Any:
        """The version new requests get."""
        return self.models.current.served

    async def publish(self, event: dict) -> str:
        """Hand `event` to the broker: "logged", "buffered", "dropped", or "off" (no broker)."""
        if self.publisher is None:
            self.counts["events_not_logged"] += 1
            return "off"
        return await self.publisher.publish_async(event, self.settings.event_wait_ms / 1000)

    def metrics(self) -> dict[str, float]:
        out = {f"rlmill_serve_{k}_total": v for k, v in self.counts.items()}
        s = self.served
        out[f'rlmill_serve_info{{model="{s.name}",version="{s.version}"}}'] = 1
        for k, v in self.models.stats().items():
            out[f"rlmill_serve_{k}" if k in ("in_flight", "retiring") else f"rlmill_serve_{k}_total"] = v
        canary = self.models.canary_stats()
        for arm in ("baseline", "candidate"):
            out[f'rlmill_serve_canary_requests_total{{arm="{arm}"}}'] = canary[f"requests_{arm}"]
        if (c := canary["canary"]) is not None:
            out[f'rlmill_serve_canary_info{{id="{c["id"]}",candidate="{c["candidate"]}",baseline="{s.version}",'
                f'share="{c["share"]:g}"}}'] = 1
        for status, n in sorted(self.refused.items()):
            out[f'rlmill_serve_gate_refused_total{{status="{status}"}}'] = n
        if self.publisher is not None:
            stats = self.publisher.stats()
            out["rlmill_serve_events_queued"] = stats.pop("queued")
            out.update({f"rlmill_serve_events_{k}_total": v for k, v in stats.items()})
        return out

    def close(self, events_timeout_s: float = 5.0) -> None:
        """Close the engines (each batcher finishes what it holds), then send the queued events
        to the broker for up to `events_timeout_s` (what is left is counted as dropped)."""
        self.models.close()
        self.checks.shutdown(wait=False, cancel_futures=True)
        if self.recall is not None:
            self.recall.close()
        if self.publisher is not None:
            self.publisher.close(events_timeout_s)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status, headers=headers)


def _validation_line(exc: RequestValidationError) -> tuple[str | None, str]:
    """(field, one line) for the first problem pydantic found."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return None, "the body is not valid JSON"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    field = ".".join(loc) if loc else None
    return field, f"field {field!r}: {msg}"[:1000] if field else msg[:1000]


_HTTP_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error"}


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the API's refusals, pydantic's, Starlette's (an unknown path
    404, a wrong method 405, a body FastAPI cannot parse 400), and a server bug (500, logged)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        field, line = _validation_line(exc)
        status = 422 if request.url.path.rstrip("/").endswith("/feedback") else 400
        return _error(status, line, field)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        kind = _HTTP_KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
        return _error(status, str(exc.detail), None, kind, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.error("rlmill serve: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__,
                  " ".join(str(exc).split())[:300], exc_info=exc)
        return _error(500, f"internal error ({type(exc).__name__}); the server's log has the traceback", None,
                      "server_error")


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="rlmill serve", **server.settings.http.docs_kwargs())
    _install_error_handlers(app)
    app.add_middleware(Gate, keys=server.keys, limits=server.settings.limits, rates=server.rates,
                       refused=server.refused)
    server.settings.http.install(app)  # the Host check, outside the Gate (http_guard.py)
    limits = server.settings.limits

    @app.get("/health")
    async def health(request: Request):
        # The canary's details are an operator's (the metrics role): told to anyone, they say which
        # answers come from the candidate. The routing secret is never here.
        c = server.models.canary if has_role(server.keys, request.scope, "metrics") else None
        canary = None if c is None else {"id": c.id, "candidate": c.candidate, "share": c.share}
        return {"status": "ok", "model": server.served.name, "version": server.served.version, "canary": canary}

    @app.get("/v1/models")
    async def models():
        s = server.served
        return {"object": "list", "data": [{"id": s.name, "object": "model", "created": 0, "owned_by": "rlmill",
                                            "root": s.name, "version": s.version, "max_model_len": s.max_context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("".join(f"{k} {v}\n" for k, v in server.metrics().items()))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        req.check_size(limits.max_prompt_chars)
        prompt = req.single_prompt()
        with contextlib.ExitStack() as lease:  # a streamed answer takes the lease over (stream_body)
            lease.enter_context(server.in_flight.hold(principal_of(request.scope) or client_key(request.scope)))
            voter = request_voter(server.keys, principal_of(request.scope), req.user)
            gen = lease.enter_context(server.models.lease(voter))
            tok = gen.served.tokenizer
            if isinstance(prompt, list):
                ids = list(prompt)
                check_token_ids(ids, gen.served.vocab)
            else:  # off the event loop: a long prompt must not stall the other requests
                ids = list(await asyncio.to_thread(tok.encode, prompt, add_special_tokens=False))
            return await _answer(server, gen, "completion", req, prompt, ids, principal_of(request.scope), lease,
                                 voter=voter)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        req.check_size(limits.max_prompt_chars, limits.max_messages)
        messages = [m.logged() for m in req.messages]
        with contextlib.ExitStack() as lease:
            lease.enter_context(server.in_flight.hold(principal_of(request.scope) or client_key(request.scope)))
            voter = request_voter(server.keys, principal_of(request.scope), req.user)
            gen = lease.enter_context(server.models.lease(voter))
            ids = await asyncio.to_thread(_render, messages, gen.served.tokenizer, req.tool_list())
            return await _answer(server, gen, "chat", req, messages, ids, principal_of(request.scope), lease,
                                 voter=voter)

    @app.post("/v1/feedback")
    async def feedback(req: FeedbackRequest, request: Request):
        return await _feedback(server, req, request.scope)

    return app


def _render(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The chat template's token ids, with the tools (hermes.render_chat: the renderer training
    renders the logged conversation with); a template that refuses the messages (roles out of
    the order it wants, ...) is the caller's mistake: a 400."""
    from jinja2 import TemplateError

    try:
        return render_chat(messages, tokenizer, tools)
    except (TemplateError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ParamError("messages", f"the model's chat template refuses these messages ({type(exc).__name__}: "
                                     f"{' '.join(str(exc).split())[:200]})") from None


def _check_request(served: Any, req: Any, prompt_ids: list[int]) -> None:
    if req.model is not None and req.model != served.name:
        raise ApiError(404, f"the model {req.model[:200]!r} does not exist: this server serves {served.name!r}",
                       "model", "not_found_error")
    if (refused := refused_param(req)) is not None:
        raise refused
    limit = served.max_context
    if len(prompt_ids) + req.max_new_tokens() > limit:
        raise ParamError("max_tokens", f"this model's maximum context length is {limit} tokens; the prompt has "
                                       f"{len(prompt_ids)} and max_tokens asks for {req.max_new_tokens()} more")


def _submit(server: Server, gen: Generation, req: Any, prompt_ids: list[int], on_token: Any = None) -> Any:
    """The request queued on `gen`'s batcher (its Future); 429 when the engine's queue is full."""
    try:
        return gen.batcher.submit([prompt_ids], req.n, sampling_of(req), on_token=on_token)
    except QueueFull as exc:
        server.counts["queue_full"] += 1
        raise ApiError(429, f"the server is busy ({exc}); retry shortly", None, "rate_limit_error",
                       {"Retry-After": "1"}) from None


async def _generate(server: Server, gen: Generation, req: Any, prompt_ids: list[int]) -> list[dict]:
    """The engine's rows for the request, within the request deadline; 429 when the engine's
    queue is full, 504 past the deadline; a client that left gets nothing (499 to nobody). Either
    way the request is dropped: out of the queue, or its generation stopped (batching.wait_rows)."""
    timeout = server.settings.limits.request_timeout_s or None
    sent = _submit(server, gen, req, prompt_ids)
    try:
        return await wait_rows(gen.batcher, sent, timeout, client_gone())
    except ClientGone:
        server.counts["client_gone"] += 1
        raise ApiError(499, "the client closed the connection before its answer", None) from None
    except TimeoutError:
        server.counts["timeouts"] += 1
        raise ApiError(504, f"no answer within {timeout:g} s (--request-timeout-s): the engine is busy; retry "
                            "later or ask for fewer max_tokens", None, "timeout_error") from None


async def _answer(server: Server, gen: Generation, kind: str, req: Any, prompt: Any, prompt_ids: list[int],
                  principal: str | None, lease: contextlib.ExitStack, voter: str | None = None):
    """Generate on `gen` (held by the caller through `lease`), publish the event, then answer;
    a streamed answer (`stream: true`) sends its tokens as they come and publishes at its end,
    holding the lease until then."""
    s = gen.served
    _check_request(s, req, prompt_ids)
    started, created = time.monotonic(), time.time()
    answer_id = new_answer_id("chatcmpl" if kind == "chat" else "cmpl")
    settings = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "max_tokens": req.max_new_tokens(), "n": req.n, "seed": req.seed, "stop": req.stop}
    tools = req.tool_list() if kind == "chat" else None

    async def log_answer(choices: list[dict]) -> str:
        server.answers.add(KnownAnswer(answer_id, created, s.name, s.version, len(choices)))
        server.counts["answers"] += 1
        return await server.publish(answer_event(
            answer_id, endpoint="chat.completions" if kind == "chat" else "completions", model=s.name,
            version=s.version, created=created, latency_s=time.monotonic() - started, prompt=prompt,
            prompt_ids=prompt_ids, choices=choices, sampling=settings, user=req.user, session_id=req.session_id,
            principal=principal, tools=tools, voter=voter))

    shape = _shaper(server, req, tools) if tools and req.calls_wanted() else None
    if req.stream:
        # the event is logged at the end of the stream, after the headers: the header says so
        body = stream_body(kind, req, s, functools.partial(_submit, server, gen, req, prompt_ids), gen.batcher.drop,
                           answer_id, int(created), prompt_ids, log_answer, lease, shape, server.checks,
                           server.settings.limits.request_timeout_s)
        return StreamingResponse(body, media_type="text/event-stream", headers={EVENT_HEADER: "at-end"})
    choices = make_choices(await _generate(server, gen, req, prompt_ids), s.tokenizer, req.stop)
    if shape is not None:
        await shape(choices)
    logged = await log_answer(choices)
    args = (answer_id, int(created), s.name, f"{s.name}@{s.version}", prompt_ids, choices)
    body = chat_response(*args) if kind == "chat" else completion_response(*args)
    return JSONResponse(body, headers={EVENT_HEADER: logged})


def _shaper(server: Server, req: Any, tools: list[dict]) -> Any:
    """The step that makes an answer's Hermes calls its tool_calls (tools.shape_choices, in
    place) and counts them: one step, so a streamed answer ends as the non-streamed one."""

    async def shape(choices: list[dict]) -> None:
        # off the event loop, within a deadline: a tool's schema checks the arguments
        bad, dropped = await shape_checked(choices, tools, req.parallel_calls(), server.checks)
        server.counts["malformed_tool_calls"] += bad
        server.counts["dropped_tool_calls"] += dropped
        server.counts["tool_calls"] += sum(len(c.get("tool_calls") or ()) for c in choices)
    return shape


async def _known(server: Server, answer_id: str, field: str) -> KnownAnswer:
    """The answer `answer_id` names, or the 410 / 404 for it. One not in memory (given before a
    restart, or evicted) is looked up where it was logged (server.recall), off the event loop."""
    window_s = server.settings.retention_hours * 3600
    known = server.answers.get(answer_id)
    created = known.created if known else id_time(answer_id)
    if known is None and server.recall is not None and created is not None and time.time() - created <= window_s:
        if (known := await server.recall.find_async(answer_id)) is not None:  # its own executor, bounded
            server.answers.add(known)  # its votes are counted from here on
            server.counts["recalled_answers"] += 1
    if created is not None and time.time() - created > window_s:
        hours = (time.time() - created) / 3600
        raise ApiError(410, f"answer {answer_id} is {hours:.1f} h old: feedback is taken for "
                            f"{server.settings.retention_hours:g} h after an answer (--retention-hours)", field, "gone")
    if known is None:
        what = "" if field == "answer_id" else f" ({field})"
        raise ApiError(404, f"no answer {answer_id}{what} was served here in the last "
                            f"{server.settings.retention_hours:g} h", field, "not_found_error")
    return known


def _voter(req: FeedbackRequest, scope: dict, voter: str | None) -> str:
    """Whose repeat a second vote on a choice is: the request's voter (from its key), else -- a
    server without keys -- the user, else the session, else the address."""
    if voter is not None:
        return f"voter:{voter}"
    return f"user:{req.user}" if req.user else f"session:{req.session_id}" if req.session_id else client_key(scope)


async def _feedback(server: Server, req: FeedbackRequest, scope: dict):
    known = await _known(server, req.answer_id, "answer_id")
    if req.index >= known.n_choices:
        raise ApiError(422, f"field 'index': answer {req.answer_id} has {known.n_choices} choice(s)", "index")
    if req.preferred_over is not None:
        other = await _known(server, req.preferred_over, "preferred_over")
        if req.preferred_over_index >= other.n_choices:
            raise ApiError(422, f"field 'preferred_over_index': answer {req.preferred_over} has {other.n_choices} "
                                "choice(s)", "preferred_over_index")
    voter = request_voter(server.keys, principal_of(scope), req.user)
    vote = server.answers.vote(req.answer_id, req.index, _voter(req, scope, voter))
    if vote != "ok":
        server.counts["refused_votes"] += 1
        why = ("this voter already gave feedback on this choice of this answer" if vote == "duplicate" else
               "this answer has taken all the feedback it can" if vote == "full" else
               "the answer left the server's memory meanwhile")
        raise ApiError(409, f"feedback on choice {req.index} of {req.answer_id} refused: {why}", "answer_id",
                       "conflict")
    event = feedback_event(req.answer_id, model=known.model, version=known.version, index=req.index,
                           score=req.score, thumbs=req.thumbs, preferred_over=req.preferred_over,
                           preferred_over_index=req.preferred_over_index, text=req.text, user=req.user,
                           session_id=req.session_id, principal=principal_of(scope), voter=voter)
    server.counts["feedback"] += 1
    logged = await server.publish(event)
    return JSONResponse({"id": event["event_id"], "object": "feedback", "answer_id": req.answer_id,
                         "logged": logged in ("logged", "buffered")}, headers={EVENT_HEADER: logged})
