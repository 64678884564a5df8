"""Hot swap: the served version follows models/<name>/CURRENT without failing or cutting a request.

    swap = HotSwap(source.load(), make_batcher, source=source, watch_s=5.0)
    with swap.lease() as gen:          # a request: everything it does uses gen (model, tokenizer, batcher)
        rows = await asyncio.wrap_future(gen.batcher.submit(...))
    swap.check()                       # one poll of CURRENT (the watcher thread does this every watch_s)
    swap.stats()                       # {'swaps': 1, 'swap_failures': 0, 'watch_polls': 12, ...}
    swap.close()

A Generation is one loaded version: its ServedModel and the Batcher that owns its engine, and how
many requests hold it. A request takes the current generation once, when it arrives (`lease`),
and uses only it: the version its event names is the one that produced the answer, even when a
swap happens while it waits for the engine. When CURRENT points to another version, the watcher
loads it (tokenizer + rollout engine, through ModelSource.load, while the old one keeps
answering), then switches: new requests get the new generation, the old one is retired and
closed (batcher, then engine) by a thread of its own once its last request has let go of it. Two
engines are in memory for that moment.

A version that fails to load is logged once (one `rlmill: ...` line), counted
(`swap_failures`), and not tried again until CURRENT changes again; the old version goes on
serving. CURRENT that cannot be read (storage down) or is missing is logged when it starts and
counted (`watch_errors`); serving goes on. The built-in model has nothing to watch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["Generation", "HotSwap"]

log = logging.getLogger("rlmill.serve")


@dataclass
class Generation:
    """One loaded version and the requests holding it."""

    served: Any  # a gpu_jobs.serve.model.ServedModel
    batcher: Any  # a gpu_jobs.serve.batching.Batcher over served.engine
    in_flight: int = 0
    retired: bool = False
    closed: threading.Event = field(default_factory=threading.Event)

    @property
    def version(self) -> str:
        return self.served.version

    def close(self) -> None:
        """Stop the batcher (it finishes what it holds), then free the engine."""
        try:
            self.batcher.close()
            self.served.close()
        finally:
            self.closed.set()


class HotSwap:
    """The current generation, the watcher thread, and the retired generations still draining."""

    def __init__(self, served: Any, make_batcher: Callable[[Any], Any], *, source: Any = None,
                 watch_s: float = 0.0):
        if watch_s < 0:
            raise ValueError(f"watch_s must be >= 0 (0 = do not watch), got {watch_s}")
        self.source, self.watch_s, self._make_batcher = source, watch_s, make_batcher
        self._current = Generation(served, make_batcher(served.engine))
        self._lock = threading.Lock()
        self._last_seen: str | None = served.version  # CURRENT as last read: act only when it changes
        self._watch_failing = False
        self._retiring: list[Generation] = []
        self._closers: list[threading.Thread] = []
        self._retired_batches = {"requests": 0, "batches": 0, "sequences": 0}
        self._counts = {"swaps": 0, "swap_failures": 0, "watch_polls": 0, "watch_errors": 0}
        self._stop = threading.Event()
        self._thread = None
        if self.watching:
            self._thread = threading.Thread(target=self._watch, name="rlmill-serve-watch", daemon=True)
            self._thread.start()

    @property
    def watching(self) -> bool:
        return self.watch_s > 0 and self.source is not None and not self.source.builtin

    @property
    def current(self) -> Generation:
        return self._current

    @contextlib.contextmanager
    def lease(self) -> Iterator[Generation]:
        """The current generation, held (not closed) until the block ends."""
        with self._lock:
            gen = self._current
            gen.in_flight += 1
        try:
            yield gen
        finally:
            with self._lock:
                gen.in_flight -= 1
                last = gen.retired and gen.in_flight == 0
            if last:  # runs on the event loop: closing joins a thread, so it gets a thread of its own
                self._close_later(gen)

    def check(self) -> str:
        """One poll of CURRENT: "same", "swapped", "failed" (the version did not load) or
        "unreadable" (CURRENT missing or storage failing)."""
        with self._lock:
            self._counts["watch_polls"] += 1
        try:
            version = self.source.current_version()
        except Exception as exc:  # storage down, permissions, ...: keep serving, say so once
            return self._watch_error(f"cannot read models/{self.source.name}/CURRENT "
                                     f"({type(exc).__name__}: {' '.join(str(exc).split())})")
        if version is None:
            return self._watch_error(f"models/{self.source.name}/CURRENT is missing")
        if self._watch_failing:
            log.warning("rlmill: models/%s/CURRENT is readable again (%s)", self.source.name, version)
            self._watch_failing = False
        if version == self._last_seen:
            return "same"
        self._last_seen = version
        if version == self._current.version:
            return "same"
        try:
            served = self.source.load(version)
        except Exception as exc:  # a broken folder raises anything: the old version keeps serving
            with self._lock:
                self._counts["swap_failures"] += 1
            log.error("rlmill: models/%s/CURRENT -> %s does not load (%s: %s): still serving %s; trying again "
                      "when CURRENT changes", self.source.name, version, type(exc).__name__,
                      " ".join(str(exc).split())[:300], self._current.version)
            return "failed"
        self.swap(served)
        return "swapped"

    def swap(self, served: Any) -> None:
        """Serve `served` from now on; the old generation closes once its requests are done."""
        if self._stop.is_set():  # loaded while the server was closing: nobody will ask it anything
            served.close()
            return
        new = Generation(served, self._make_batcher(served.engine))
        with self._lock:
            old, self._current = self._current, new
            old.retired = True
            idle = old.in_flight == 0
            waiting = old.in_flight
            self._retiring.append(old)
            self._counts["swaps"] += 1
        log.warning("rlmill: now serving %s version %s (was %s; %d request(s) finishing on it)", served.name,
                    served.version, old.version, waiting)
        if idle:
            self._close_later(old)

    def _close_later(self, gen: Generation) -> None:
        def close() -> None:
            stats = gen.batcher.stats()
            gen.close()
            with self._lock:
                for k in self._retired_batches:
                    self._retired_batches[k] += stats.get(k, 0)
                self._retiring.remove(gen)

        thread = threading.Thread(target=close, name=f"rlmill-serve-retire-{gen.version}", daemon=True)
        with self._lock:
            self._closers = [t for t in self._closers if t.is_alive()] + [thread]
        thread.start()

    def _watch_error(self, line: str) -> str:
        with self._lock:
            self._counts["watch_errors"] += 1
        if not self._watch_failing:
            log.warning("rlmill: %s: still serving %s", line, self._current.version)
            self._watch_failing = True
        return "unreadable"

    def _watch(self) -> None:
        while not self._stop.wait(self.watch_s):
            try:
                self.check()
            except Exception:  # the watcher must outlive any bug in a poll: serving goes on
                log.exception("rlmill: the model watcher's poll failed")

    def stats(self) -> dict[str, int]:
        """Counters (swaps, swap_failures, watch_polls, watch_errors), gauges (in_flight,
        retiring: old versions still finishing requests), and the batchers' totals across versions."""
        with self._lock:
            batches = {k: v + self._current.batcher.stats().get(k, 0) for k, v in self._retired_batches.items()}
            for gen in self._retiring:
                for k, v in gen.batcher.stats().items():
                    batches[k] += v
            return {**self._counts, "in_flight": self._current.in_flight + sum(g.in_flight for g in self._retiring),
                    "retiring": len(self._retiring), **{f"batcher_{k}": v for k, v in batches.items()}}

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop watching, close the current generation, and wait for the retiring ones."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._current.close()
        with self._lock:
            closers = list(self._closers)
        for t in closers:
            t.join(timeout_s)
