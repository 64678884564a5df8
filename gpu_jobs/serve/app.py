"""The OpenAI-compatible HTTP API (FastAPI) over one served model.

    server = Server(load_served_model(None), publisher=EventPublisher(url))
    uvicorn.run(create_app(server), host="127.0.0.1", port=8000)

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "builtin", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}'

Endpoints: POST /v1/chat/completions and /v1/completions (non-streaming, and `stream: true` as
server-sent events ending `data: [DONE]`), GET /v1/models, POST /v1/feedback, GET /health, and
GET /metrics (Prometheus text: requests, generate calls, events published and dropped).
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, one line each:
bad sampling parameters 400, an unknown model 404; for feedback, a malformed body 422 naming
the field, an unknown answer 404, an answer older than the retention window 410.
"""

from __future__ import annotations

import asyncio
import logging
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

__all__ = ["Server", "ServeSettings", "create_app"]

log = logging.getLogger("rlmill.serve")


@dataclass(frozen=True)
class ServeSettings:
    retention_hours: float = 24.0  # feedback is taken for answers younger than this
    max_batch: int = 16  # requests per engine.generate call at most
    batch_wait_ms: float = 5.0  # how long the batcher collects requests after the first
    answer_index_size: int = 200_000  # recent answer ids kept for feedback checks


class Server:
    """The served model, its batcher, the recent-answer index and the event publisher (or None)."""

    def __init__(self, served: Any, publisher: Any = None, settings: ServeSettings = ServeSettings()):
        self.served, self.publisher, self.settings = served, publisher, settings
        self.batcher = Batcher(served.engine, max_batch=settings.max_batch, max_wait_s=settings.batch_wait_ms / 1000)
        self.answers = AnswerIndex(settings.answer_index_size)
        self.counts = {"answers": 0, "feedback": 0, "events_not_logged": 0}

    @property
    def fingerprint(self) -> str:
        return f"{self.served.name}@{self.served.version}"

    def publish(self, event: dict) -> bool:
        if self.publisher is None:
            self.counts["events_not_logged"] += 1
            return False
        return self.publisher.publish(event)

    def metrics(self) -> dict[str, float]:
        out = {f"rlmill_serve_{k}_total": v for k, v in self.counts.items()}
        out.update({f"rlmill_serve_batcher_{k}_total": v for k, v in self.batcher.stats().items()})
        if self.publisher is not None:
            stats = self.publisher.stats()
            out["rlmill_serve_events_queued"] = stats.pop("queued")
            out.update({f"rlmill_serve_events_{k}_total": v for k, v in stats.items()})
        return out

    def close(self) -> None:
        self.batcher.close()
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
    app = FastAPI(title="rlmill serve", version=server.served.version)

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
        return {"status": "ok", "model": server.served.name, "version": server.served.version}

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
        ids = prompt if isinstance(prompt, list) else server.served.tokenizer.encode(prompt, add_special_tokens=False)
        return await _answer(server, "completion", req, prompt, list(ids))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        from gpu_jobs.data import render_prompt

        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return await _answer(server, "chat", req, messages, render_prompt(messages, server.served.tokenizer))

    @app.post("/v1/feedback")
    async def feedback(req: FeedbackRequest):
        return _feedback(server, req)

    return app


def _check_request(server: Server, req: Any, prompt_ids: list[int]) -> JSONResponse | None:
    if req.model is not None and req.model != server.served.name:
        return _error(404, f"the model {req.model!r} does not exist: this server serves {server.served.name!r}",
                      "model", "not_found_error")
    if (refused := refused_param(req)) is not None:
        raise refused
    limit = server.served.max_context
    if len(prompt_ids) + req.max_new_tokens() > limit:
        return _error(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                           f"{len(prompt_ids)} and max_tokens asks for {req.max_new_tokens()} more", "max_tokens")
    return None


async def _answer(server: Server, kind: str, req: Any, prompt: Any, prompt_ids: list[int]):
    if (refusal := _check_request(server, req, prompt_ids)) is not None:
        return refusal
    started, created = time.monotonic(), time.time()
    sampling = sampling_of(req)
    rows = await asyncio.wrap_future(server.batcher.submit([prompt_ids], req.n, sampling))
    s = server.served
    choices = make_choices(rows, s.tokenizer, req.stop)
    answer_id = new_answer_id("chatcmpl" if kind == "chat" else "cmpl")
    server.answers.add(KnownAnswer(answer_id, created, s.name, s.version, len(choices)))
    server.counts["answers"] += 1
    settings = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "max_tokens": req.max_new_tokens(), "n": req.n, "seed": req.seed, "stop": req.stop}
    server.publish(answer_event(
        answer_id, endpoint="chat.completions" if kind == "chat" else "completions", model=s.name,
        version=s.version, created=created, latency_s=time.monotonic() - started, prompt=prompt,
        prompt_ids=prompt_ids, choices=choices, sampling=settings, user=req.user, session_id=req.session_id))
    args = (answer_id, int(created), s.name, server.fingerprint, prompt_ids, choices)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream_chunks(kind, *args, s.tokenizer, usage), media_type="text/event-stream")
    return chat_response(*args) if kind == "chat" else completion_response(*args)


def _feedback(server: Server, req: FeedbackRequest):
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
    logged = server.publish(event)
    return {"id": event["event_id"], "object": "feedback", "answer_id": req.answer_id, "logged": logged}
