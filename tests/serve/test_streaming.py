"""`stream: true` sends each token's text while the engine is still generating (issue 42 item 5),
and the answer's event is logged once, at the end. The engine is the built-in model's real hf
engine, held after its first decoding step so the test can see what reached the client then."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx

from gpu_jobs.online.app import Server
from gpu_jobs.online.streaming import TokenText


class Held:
    """The real engine, stopped after its first decoding step until `release` is set."""

    streams_tokens = True

    def __init__(self, engine):
        self.engine, self.first, self.release = engine, threading.Event(), threading.Event()

    def generate(self, prompts, n, sampling, on_tokens=None):
        def step(rows, tokens):
            on_tokens(rows, tokens)
            self.first.set()
            assert self.release.wait(60), "the test never released the engine"
        return self.engine.generate(prompts, n, sampling, on_tokens=step if on_tokens else None)


def test_tokens_reach_the_client_before_the_answer_is_done(served, run_app):
    held = Held(served.engine)
    model = SimpleNamespace(**{k: getattr(served, k) for k in ("name", "version", "tokenizer", "max_context",
                                                               "vocab", "path")}, engine=held)
    model.close = lambda: None
    server = Server(model)
    body = {"prompt": "12+34=", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with run_app(server) as base, httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["x-rlmill-event"] == "at-end"
        lines = r.iter_lines()
        first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
        # the first token's text arrived while the engine is still held after its first step
        assert first["choices"][0]["text"] == "4" and held.first.is_set() and not held.release.is_set()
        assert server.counts["answers"] == 0  # nothing logged yet: the event goes at the end
        held.release.set()
        rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
    chunks = [json.loads(x) for x in rest[:-1]]
    assert rest[-1] == "[DONE]" and "4" + "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "46"
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and server.counts["answers"] == 1
    assert server.answers.get(first["id"]).n_choices == 1  # known for feedback once logged


def test_the_streamed_text_is_always_a_prefix_of_the_final_text(served):
    """A stop string may cut the final text: its last characters are held back until the end."""
    tok = served.tokenizer
    ids = tok.encode("12+34=467", add_special_tokens=False)
    text = TokenText(1, tok, ["=4"])
    sent = "".join(text.add(0, t) for t in ids)
    final = "12+34"  # what make_choices keeps: the text before the stop
    assert final.startswith(sent) and sent + text.rest(0, final) == final
    plain = TokenText(2, tok, None)
    assert "".join(plain.add(1, t) for t in ids) == "12+34=467" and plain.rest(0, "x") == "x"
