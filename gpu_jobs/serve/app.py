"""The OpenAI-compatible HTTP API (FastAPI) over one served model, swapped when CURRENT moves.

    server = Server(load_served_model(None), publisher=EventPublisher(url))
    uvicorn.run(create_app(server), host="127.0.0.1", port=8000)

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "builtin", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}'

Endpoints: POST /v1/chat/completions and /v1/completions (non-streaming, and `stream: true` as
server-sent events ending `data: [DONE]`), GET /v1/models, POST /v1/feedback, GET /health, and
GET /metrics (Prometheus text: requests, generate calls, events logged, buffered and dropped,
swaps, requests per canary arm). Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, one line
each: bad sampling parameters 400, an unknown model 404; for feedback, a malformed body 422
naming the field, an unknown answer 404, an answer older than the retention window 410.

A request holds the generation (version) that was current when it arrived, from tokenizing its
prompt to publishing its event (swap.py): a hot swap never cuts it, and its event names the
version that answered. Its response goes out once its event is in the broker, or after
`event_wait_ms` (the event stays queued, counted as buffered; broker.py); the header
`X-Rlmill-Event` says which: logged, buffered, dropped (queue full) or off (no broker).

During a canary (models/<name>/CANARY, swap.py) a request's generation is picked by its `user`,
else its `session_id`: the same id always gets the same arm; a request with neither goes to the
baseline (the current version). Its answer's `system_fingerprint` and event name the version of
its arm, which is how the rl-canary flow counts each arm's feedback.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gpu_jobs.serve.answers import AnswerIndex, KnownAnswer, id_time, new_answer_id
from gpu_jobs.serve.batching import Batcher
from gpu_jobs.serve.events import answer_event, feedback_event
from gpu_jobs.serve.protocol import (ChatRequest, CompletionRequest, FeedbackRequest, ParamError, chat_response,
                                     completion_response, make_choices, refused_param, sampling_of, stream_chunks)
from gpu_jobs.serve.swap import Generation, HotSwap, route_key

__all__ = ["Server", "ServeSettings", "create_app"]

EVENT_HEADER = "X-Rlmill-Event"


@dataclass(frozen=True)
class ServeSettings:
    retention_hours: float = 24.0  # feedback is taken for answers younger than this
    max_batch: int = 16  # requests per engine.generate call at most
    batch_wait_ms: float = 5.0  # how long the batcher collects requests after the first
    answer_index_size: int = 200_000  # recent answer ids kept for feedback checks
    event_wait_ms: float = 250.0  # how long a response waits for its event's XADD (0: never waits)
    watch_s: float = 0.0  # how often CURRENT is read for a hot swap (0: never; needs a source)


class Server:
    """The served model (swapped when CURRENT moves), the recent-answer index and the event
    publisher (or None). It owns `served`: its engine is closed when retired or at close()."""

    def __init__(self, served: Any, publisher: Any = None, settings: ServeSettings = ServeSettings(),
                 source: Any = None):
        self.publisher, self.settings = publisher, settings
        self.models = HotSwap(served, self._batcher, source=source, watch_s=settings.watch_s)
        self.answers = AnswerIndex(settings.answer_index_size)
        self.counts = {"answers": 0, "feedback": 0, "events_not_logged": 0}

    def _batcher(self, engine: Any) -> Batcher:
        return Batcher(engine, max_batch=self.settings.max_batch, max_wait_s=self.settings.batch_wait_ms / 1000)

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
        if self.publisher is not None:
            stats = self.publisher.stats()
            out["rlmill_serve_events_queued"] = stats.pop("queued")
            out.update({f"rlmill_serve_events_{k}_total": v for k, v in stats.items()})
        return out

    def close(self) -> None:
        self.models.close()
        if self.publisher is not None:
            self.publisher.close()


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    message = " ".join(message.split())
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _validation_line(exc: RequestValidationError) -> tuple[str | None, str]:
    """(field, one line) for the first problem pydantic found."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return None, "the body is not valid JSON"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    field = ".".join(loc) if loc else None
    return field, f"field {field!r}: {msg}" if field else msg


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="rlmill serve")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        field, line = _validation_line(exc)
        status = 422 if request.url.path.endswith("/feedback") else 400
        return _error(status, line, field)

    @app.exception_handler(ParamError)
    async def _param(request: Request, exc: ParamError):
        return _error(400, str(exc), exc.param)

    @app.get("/health")
    async def health():
        c = server.models.canary
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
    async def completions(req: CompletionRequest):
        prompt = req.single_prompt()
        with server.models.lease(route_key(req.user, req.session_id)) as gen:
            ids = prompt if isinstance(prompt, list) else gen.served.tokenizer.encode(prompt, add_special_tokens=False)
            return await _answer(server, gen, "completion", req, prompt, list(ids))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        from gpu_jobs.data import render_prompt

        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        with server.models.lease(route_key(req.user, req.session_id)) as gen:
            ids = render_prompt(messages, gen.served.tokenizer)
            return await _answer(server, gen, "chat", req, messages, ids)

    @app.post("/v1/feedback")
    async def feedback(req: FeedbackRequest):
        return await _feedback(server, req)

    return app


def _check_request(served: Any, req: Any, prompt_ids: list[int]) -> JSONResponse | None:
    if req.model is not None and req.model != served.name:
        return _error(404, f"the model {req.model!r} does not exist: this server serves {served.name!r}",
                      "model", "not_found_error")
    if (refused := refused_param(req)) is not None:
        raise refused
    limit = served.max_context
    if len(prompt_ids) + req.max_new_tokens() > limit:
        return _error(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                           f"{len(prompt_ids)} and max_tokens asks for {req.max_new_tokens()} more", "max_tokens")
    return None


async def _answer(server: Server, gen: Generation, kind: str, req: Any, prompt: Any, prompt_ids: list[int]):
    """Generate on `gen` (held by the caller), publish the event, then answer."""
    s = gen.served
    if (refusal := _check_request(s, req, prompt_ids)) is not None:
        return refusal
    started, created = time.monotonic(), time.time()
    rows = await asyncio.wrap_future(gen.batcher.submit([prompt_ids], req.n, sampling_of(req)))
    choices = make_choices(rows, s.tokenizer, req.stop)
    answer_id = new_answer_id("chatcmpl" if kind == "chat" else "cmpl")
    server.answers.add(KnownAnswer(answer_id, created, s.name, s.version, len(choices)))
    server.counts["answers"] += 1
    settings = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "max_tokens": req.max_new_tokens(), "n": req.n, "seed": req.seed, "stop": req.stop}
    logged = await server.publish(answer_event(
        answer_id, endpoint="chat.completions" if kind == "chat" else "completions", model=s.name,
        version=s.version, created=created, latency_s=time.monotonic() - started, prompt=prompt,
        prompt_ids=prompt_ids, choices=choices, sampling=settings, user=req.user, session_id=req.session_id))
    args = (answer_id, int(created), s.name, f"{s.name}@{s.version}", prompt_ids, choices)
    headers = {EVENT_HEADER: logged}
    if req.stream:  # the chunks are cut from the finished answer: nothing left for the engine to do
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream_chunks(kind, *args, s.tokenizer, usage), media_type="text/event-stream",
                                 headers=headers)
    body = chat_response(*args) if kind == "chat" else completion_response(*args)
    return JSONResponse(body, headers=headers)


async def _feedback(server: Server, req: FeedbackRequest):
    window_s = server.settings.retention_hours * 3600
    known = server.answers.get(req.answer_id)
    created = known.created if known else id_time(req.answer_id)
    if created is not None and time.time() - created > window_s:
        hours = (time.time() - created) / 3600
        return _error(410, f"answer {req.answer_id} is {hours:.1f} h old: feedback is taken for "
                           f"{server.settings.retention_hours:g} h after an answer (--retention-hours)",
                      "answer_id", "gone")
    if known is None:
        return _error(404, f"no answer {req.answer_id} was served here in the last "
                           f"{server.settings.retention_hours:g} h", "answer_id", "not_found_error")
    if req.index >= known.n_choices:
        return _error(422, f"field 'index': answer {req.answer_id} has {known.n_choices} choice(s)", "index")
    if req.preferred_over is not None and server.answers.get(req.preferred_over) is None:
        return _error(404, f"no answer {req.preferred_over} (preferred_over) was served here in the last "
                           f"{server.settings.retention_hours:g} h", "preferred_over", "not_found_error")
    event = feedback_event(req.answer_id, model=known.model, version=known.version, index=req.index,
                           score=req.score, thumbs=req.thumbs, preferred_over=req.preferred_over,
                           preferred_over_index=req.preferred_over_index, text=req.text, user=req.user,
                           session_id=req.session_id)
    server.counts["feedback"] += 1
    logged = await server.publish(event)
    return JSONResponse({"id": event["event_id"], "object": "feedback", "answer_id": req.answer_id,
                         "logged": logged in ("logged", "buffered")}, headers={EVENT_HEADER: logged})
