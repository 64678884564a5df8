"""Concurrent requests -> one `engine.generate` call per batch, in one worker thread.

    batcher = Batcher(engine, max_batch=16, max_wait_s=0.005)
    rows = batcher.submit([prompt_ids], n=2, sampling=SamplingConfig(...)).result()   # a Future
    batcher.stats()      # {'requests': 1, 'batches': 1, 'sequences': 2}
    batcher.close()

The worker takes the first waiting request, then collects more for up to `max_wait_s` or until
`max_batch` requests wait, and groups them by (n, sampling): each group is ONE generate call
(engines are not thread-safe, and a call takes one n and one SamplingConfig). A request with a
seed is a group of its own: the hf engine draws a whole call from one generator, so batching it
with others would make the same seed give another answer. Async code awaits the Future with
`asyncio.wrap_future`.

The queue is bounded: with `max_queue` requests waiting (not yet taken into a batch), `submit`
raises QueueFull at once, which the API answers 429 with Retry-After, instead of holding an
unbounded backlog that would answer everyone late.

A request nobody waits for any more (its client left, its deadline passed) is `drop`ped: one still
queued is cancelled and never batched; one already generating is marked, and with an engine that
reports its steps (`streams_tokens`, the hf engine) its generate call stops at the next decoding
step once every request in the call is dropped (the call raises out of its step callback; a call
shared with a live request runs on). Elsewhere (vLLM, or a shared call) generation finishes and
the dropped request's rows are discarded.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Batcher", "ClientGone", "QueueFull", "wait_rows"]

log = logging.getLogger("rlmill.serve")


class QueueFull(RuntimeError):
    """`max_queue` requests are waiting for the engine already."""


class ClientGone(Exception):
    """The client of a request disconnected before its rows were ready."""


class _Dropped(Exception):
    """Raised from the engine's step callback: every request of the call was dropped."""


@dataclass
class _Request:
    prompts: list[list[int]]
    n: int
    sampling: Any
    future: Future = field(default_factory=Future)
    key: tuple = ()
    on_token: Callable[[int, int], None] | None = None  # (row of this request, token), from the worker


class Batcher:
    """One worker thread owning `engine`; see the module docstring."""

    def __init__(self, engine: Any, *, max_batch: int = 16, max_wait_s: float = 0.005, max_queue: int = 1024):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.engine, self.max_batch, self.max_wait_s, self.max_queue = engine, max_batch, max_wait_s, max_queue
        self._queue: queue.Queue = queue.Queue()
        self._counts = {"requests": 0, "batches": 0, "sequences": 0, "dropped_running": 0, "stopped_calls": 0}
        self._lock = threading.Lock()
        self._solo = itertools.count()
        self._dropped: set[Future] = set()  # running requests nobody waits for (drop)
        self._thread = threading.Thread(target=self._run, name="rlmill-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], n: int, sampling: Any,
               on_token: Callable[[int, int], None] | None = None) -> Future:
        """Queue `n` samples of each prompt; the Future gives the engine's rows (prompt-major).
        `on_token(row, token)` is called from the worker thread for each token as it is sampled,
        where the engine streams (`streams_tokens`), before the Future resolves; elsewhere never
        (the caller then has the whole rows at once). Raises QueueFull when `max_queue` requests
        wait already."""
        if self.waiting() >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are waiting for the engine")
        req = _Request(prompts, n, sampling, on_token=on_token)
        req.key = (n, sampling, next(self._solo) if getattr(sampling, "seed", None) is not None else None)
        self._queue.put(req)
        return req.future

    def drop(self, future: Future) -> None:
        """Nobody waits for `future` any more: cancelled if still queued (never batched), else
        marked so that its call stops early where it can (see the module docstring)."""
        if not future.cancel() and not future.done():
            with self._lock:
                self._dropped.add(future)
                self._counts["dropped_running"] += 1

    def waiting(self) -> int:
        """Requests queued and not yet taken into a batch."""
        return self._queue.qsize()

    def stats(self) -> dict[str, int]:
        """requests served, batches (= generate calls) made, sequences generated, running
        requests dropped, generate calls stopped early because all their requests were."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            groups: dict[tuple, list[_Request]] = {}
            for req in batch:
                groups.setdefault(req.key, []).append(req)
            for reqs in groups.values():
                self._generate(reqs)

    def _collect(self) -> list[_Request] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch, deadline = [first], time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch:
            try:
                req = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if req is None:  # close(): finish this batch, then stop
                self._queue.put(None)
                break
            batch.append(req)
        return batch

    def _gone(self, reqs: list[_Request]) -> bool:
        """Whether every request of a running call was dropped."""
        with self._lock:
            return all(r.future in self._dropped for r in reqs)

    def _generate(self, reqs: list[_Request]) -> None:
        """One engine.generate call for requests sharing (n, sampling); rows go back per request."""
        live = [r for r in reqs if r.future.set_running_or_notify_cancel()]
        if not live:
            return
        prompts = [p for r in live for p in r.prompts]
        n, sampling = live[0].n, live[0].sampling
        try:
            if getattr(self.engine, "streams_tokens", False):  # steps reported: a dropped call can stop
                rows = self.engine.generate(prompts, n, sampling, on_tokens=_dispatch(live, n, self._gone))
            else:
                rows = self.engine.generate(prompts, n, sampling)
        except _Dropped:
            with self._lock:
                self._counts["stopped_calls"] += 1
                self._dropped.difference_update(r.future for r in live)
            for r in live:
                r.future.set_exception(RuntimeError("dropped: nobody waits for this request"))
            return
        except BaseException as exc:  # the requests fail; the worker keeps serving
            log.exception("generate failed for a batch of %d request(s)", len(live))
            for r in live:
                r.future.set_exception(exc)
            return
        with self._lock:
            self._dropped.difference_update(r.future for r in live)
            self._counts["requests"] += len(live)
            self._counts["batches"] += 1
            self._counts["sequences"] += len(rows)
        start = 0
        for r in live:
            size = len(r.prompts) * n
            r.future.set_result(rows[start:start + size])
            start += size


def _dispatch(reqs: list[_Request], n: int, gone: Callable[[list[_Request]], bool] = lambda reqs: False
              ) -> Callable[[list[int], list[int]], None]:
    """The engine's on_tokens for one call over `reqs`' prompts (concatenated, prompt-major):
    each token goes to its request's on_token with the request's own row. A callback that fails
    is dropped for the rest of the call (logged); generation goes on. Once `gone(reqs)` (every
    request dropped) it raises _Dropped, which ends the engine's call at this step."""
    starts = list(itertools.accumulate((len(r.prompts) * n for r in reqs), initial=0))
    failed: set[int] = set()

    def on_tokens(rows: list[int], tokens: list[int]) -> None:
        if gone(reqs):
            raise _Dropped
        for row, token in zip(rows, tokens):
            i = bisect.bisect_right(starts, row) - 1
            if reqs[i].on_token is None or i in failed:
                continue
            try:
                reqs[i].on_token(row - starts[i], token)
            except Exception:  # noqa: BLE001 -- one client's stream must not fail the batch
                failed.add(i)
                log.exception("a token callback failed; that request's stream gets no more tokens")
    return on_tokens


async def wait_rows(batcher: Batcher, future: Future, timeout_s: float | None,
                    gone: asyncio.Event | None = None) -> list[dict]:
    """The rows `future` (from batcher.submit) gives, awaited on the event loop: TimeoutError
    past `timeout_s` (None: no deadline), ClientGone once `gone` is set first; either way the
    request is dropped (batcher.drop: out of the queue, or its call stopped where it can)."""
    rows = asyncio.wrap_future(future)
    watch = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        done, _ = await asyncio.wait({rows} | ({watch} if watch else set()), timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if rows in done:
            return rows.result()
        raise ClientGone if watch in done else TimeoutError
    finally:
        if watch is not None:
            watch.cancel()
        if not future.done():
            batcher.drop(future)
            rows.cancel()
