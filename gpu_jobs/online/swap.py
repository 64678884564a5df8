"""Hot swap: the served version follows models/<name>/CURRENT without failing or cutting a request.

    swap = HotSwap(source.load(), make_batcher, source=source, watch_s=5.0)
    with swap.lease(voter) as gen:     # a request (voter: app.py's, from its key): everything it does uses gen
        rows = await asyncio.wrap_future(gen.batcher.submit(...))
    swap.check()                       # one poll of CURRENT and CANARY (the watcher does this every watch_s)
    swap.stats()                       # {'swaps': 1, 'swap_failures': 0, 'watch_polls': 12, ...}
    swap.canary_stats()                # {'requests_baseline': 90, 'requests_candidate': 10, 'canary': {...}}
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

The canary (gpu_jobs/online/canary.py): while models/<name>/CANARY names a candidate other than the served
version, a second generation holds the candidate, loaded the same way (at start, and by the
watcher when CANARY appears or changes). A request whose voter (who the server counts the caller
as, from its API key: app.py) falls in the record's share (`Canary.routes_to_candidate`, an HMAC
of the voter with the canary's secret, read with the record: canary.canary_secret) leases the
candidate; every other voter leases the current generation (the baseline); a request with no
voter (a server without keys) gets an arm drawn for it alone. When CANARY goes (a rollback), the
candidate generation retires like an old version; when CURRENT moves to the candidate (a
promote), the loaded candidate generation becomes the current one, with no second load. A
candidate that fails to load is logged once and counted (`swap_failures`); everyone gets the
baseline until CANARY changes. canary_stats() gives the record without its secret.
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

    served: Any  # a gpu_jobs.online.model.ServedModel
    batcher: Any  # a gpu_jobs.online.batching.Batcher over served.engine
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
        self._retired_batches = {"requests": 0, "batches": 0, "sequences": 0, "dropped_running": 0,
                                 "stopped_calls": 0}
        self._counts = {"swaps": 0, "swap_failures": 0, "watch_polls": 0, "watch_errors": 0}
        self._canary: Generation | None = None  # the candidate's generation while a canary routes to it
        self._canary_record: Any = None  # its gpu_jobs.online.canary.Canary
        self._canary_secret = b""  # its routing secret (canary.canary_secret): never in stats or logs
        self._canary_seen: str | None = None  # the canary id CANARY named at the last read (None: none)
        self._canary_failing = False
        self._arms = {"baseline": 0, "candidate": 0}  # requests leased per arm
        self._stop = threading.Event()
        self._thread = None
        if self.registered:  # a restart mid-canary routes as before from its first request
            self.check_canary()
        if self.watching:
            self._thread = threading.Thread(target=self._watch, name="rlmill-serve-watch", daemon=True)
            self._thread.start()

    @property
    def watching(self) -> bool:
        return self.watch_s > 0 and self.registered

    @property
    def registered(self) -> bool:
        """A registered model (a source that is not the built-in model): it may have a canary."""
        return self.source is not None and not self.source.builtin

    @property
    def current(self) -> Generation:
        return self._current

    @property
    def canary(self) -> Any:
        """The gpu_jobs.online.canary.Canary requests are routed by now, or None."""
        return self._canary_record

    @contextlib.contextmanager
    def lease(self, voter: str | None = None) -> Iterator[Generation]:
        """The generation a request of `voter` gets (the candidate's when a canary routes `voter`
        to it, else the current one), held (not closed) until the block ends."""
        with self._lock:
            to_candidate = self._canary is not None and self._canary_record.routes_to_candidate(
                voter, self._canary_secret)
            gen = self._canary if to_candidate else self._current
            self._arms["candidate" if to_candidate else "baseline"] += 1
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
        """One poll of CURRENT, then of CANARY (check_canary); returns CURRENT's: "same",
        "swapped", "failed" (the version did not load) or "unreadable" (CURRENT missing or storage
        failing)."""
        status = self._check_current()
        if status != "unreadable":
            self.check_canary()
        return status

    def _check_current(self) -> str:
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
        with self._lock:  # a promoted candidate: its loaded generation becomes the current one
            promoted = self._canary if self._canary is not None and self._canary.version == version else None
            if promoted is not None:
                self._canary = self._canary_record = None
        if promoted is not None:
            self._install(promoted)
            return "swapped"
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
        self._install(Generation(served, self._make_batcher(served.engine)))

    def _install(self, new: Generation) -> None:
        with self._lock:
            old, self._current = self._current, new
            self._counts["swaps"] += 1
            waiting = old.in_flight
        log.warning("rlmill: now serving %s version %s (was %s; %d request(s) finishing on it)", new.served.name,
                    new.version, old.version, waiting)
        self._retire(old)

    def _retire(self, old: Generation) -> None:
        """Close `old` once its last request lets go of it (now, when none holds it)."""
        with self._lock:
            old.retired = True
            idle = old.in_flight == 0
            self._retiring.append(old)
        if idle:
            self._close_later(old)

    # ------------------------------------------------------------------ the canary
    def _models(self) -> Any:
        from storage import ModelLayout

        return ModelLayout(self.source.root, self.source.name, self.source.storage)

    def check_canary(self) -> str:
        """One read of models/<name>/CANARY: "same", "started" (the candidate loaded and routed
        to), "ended" (its generation retired), "failed" (the candidate did not load; not tried
        again until CANARY changes), "unreadable", or "none" (no canary, none running)."""
        from gpu_jobs.online.canary import canary_secret, read_canary

        try:
            record = read_canary(self._models())
            active = record if record is not None and record.candidate != self._current.version else None
            if (active.id if active else None) == self._canary_seen:
                self._canary_failing = False
                return "same"
            secret = canary_secret(self._models(), active) if active is not None else b""  # once per canary
        except Exception as exc:  # storage down, a damaged record: keep serving what is routed now
            if not self._canary_failing:
                log.warning("rlmill: cannot read models/%s/CANARY (%s: %s): routing stays as it is",
                            self.source.name, type(exc).__name__, " ".join(str(exc).split())[:300])
                self._canary_failing = True
            return "unreadable"
        self._canary_failing = False
        self._canary_seen = active.id if active else None
        if active is None:
            return "ended" if self._end_canary() else "none"
        if self._canary is not None and self._canary.version == active.candidate:
            with self._lock:  # the same candidate under a new canary id: its engine stays
                self._canary_record, self._canary_secret = active, secret
            return "started"
        try:
            served = self.source.load(active.candidate)
        except Exception as exc:  # a broken candidate: the baseline answers everyone
            with self._lock:
                self._counts["swap_failures"] += 1
            log.error("rlmill: canary %s: models/%s version %s does not load (%s: %s): every request goes to %s "
                      "until CANARY changes", active.id, self.source.name, active.candidate, type(exc).__name__,
                      " ".join(str(exc).split())[:300], self._current.version)
            self._end_canary()
            return "failed"
        new = Generation(served, self._make_batcher(served.engine))
        with self._lock:
            old, self._canary, self._canary_record, self._canary_secret = self._canary, new, active, secret
        if old is not None:
            self._retire(old)
        log.warning("rlmill: canary %s: %.0f%% of voters now go to %s version %s (the rest to %s)", active.id,
                    100 * active.share, self.source.name, active.candidate, self._current.version)
        return "started"

    def _end_canary(self) -> bool:
        with self._lock:
            gen, self._canary, self._canary_record = self._canary, None, None
        if gen is None:
            return False
        log.warning("rlmill: canary ended: version %s retired, every request goes to %s", gen.version,
                    self._current.version)
        self._retire(gen)
        return True

    def canary_stats(self) -> dict[str, Any]:
        """Requests leased per arm since start (baseline: every request not routed to a candidate),
        and the running canary's record as a dict (None when none routes now)."""
        from dataclasses import asdict

        with self._lock:
            record = self._canary_record
            return {"requests_baseline": self._arms["baseline"], "requests_candidate": self._arms["candidate"],
                    "canary": asdict(record) if record is not None else None}

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
            live = [self._current, *self._retiring] + ([self._canary] if self._canary is not None else [])
            batches = dict(self._retired_batches)
            for gen in live:
                stats = gen.batcher.stats()
                for k in batches:
                    batches[k] += stats.get(k, 0)
            return {**self._counts, "in_flight": sum(g.in_flight for g in live),
                    "retiring": len(self._retiring), **{f"batcher_{k}": v for k, v in batches.items()}}

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop watching, close the current generation, and wait for the retiring ones."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._current.close()
        with self._lock:
            canary, self._canary = self._canary, None
        if canary is not None:
            canary.close()
        with self._lock:
            closers = list(self._closers)
        for t in closers:
            t.join(timeout_s)
