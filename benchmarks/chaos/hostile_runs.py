"""Hostile traffic against the online loop (issue 42 item 7): while well-behaved clients ask, an
attacker with a valid key sends malformed requests, floods votes on one answer, calls without a
key, and another producer writes poison entries into the stream. The row ends with the audit.

    .venv/bin/python -m benchmarks.chaos --only hostile-traffic

The stack is serve_runs' (real `rlmill serve` with --api-keys, `feedback consume --follow`, a real
redis-server). The good clients (serve_stack.Client, with their key) run alone for `window_s`,
then as long again beside the attacker; each window's answers per second and p99 latency are
measured in this row, so the ratio is between two windows of the same machine at the same load.
What must hold (the row's pass): no 5xx answered to the attacker, every good answer committed
exactly once, at most one committed vote of the attacker per answer choice, every poison entry
quarantined, and nothing left pending in the stream.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

from .harness import Chaos, Outcome
from .serve_runs import stack
from .serve_stack import START_S, Client, audit_answers

GOOD_KEY = "sk-good-Vb7Nq2Xk9Lm4Rt6Yw3Zp8Hc5"  # serve refuses placeholder keys ("0123456789...", auth.weakness)
BAD_KEY = "sk-mallory-Jf3Gd8Sa1Qw6Ek9Ru4Ty2Io7"
POISON = [{"foo": "bar"}, {"event": "{not json"}, {"event": json.dumps({"kind": "feedback", "event_id": "x/../.."})},
          {"event": json.dumps({"kind": "answer", "event_id": "evt-1", "created": 1e12})}]


def _malformed(rng: random.Random) -> tuple[str, bytes | dict]:
    """One client mistake: (path, body); bytes are sent as they are."""
    return rng.choice([
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"prompt": [-1, 99999999], "max_tokens": 4}),
        ("/v1/completions", {"prompt": "1+1=", "max_tokens": -3}),
        ("/v1/completions", {"prompt": "1+1=", "n": 10 ** 9}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "x" * 2_000_000}),
        ("/v1/feedback", {"answer_id": "chatcmpl-none", "score": 2.0}),
        ("/v1/feedback", {"answer_id": "x", "preferred_over": "y", "preferred_over_index": 2 ** 31}),
    ])


class Attacker:
    """One thread: 10 % malformed requests, the rest votes on one answer it got (all but the first
    refused), a call without a key now and then, and a poison stream entry every 20 requests."""

    def __init__(self, base: str, redis_url: str, seed: int = 0):
        self.base, self.redis_url, self.rng = base, redis_url, random.Random(seed)
        self.statuses: Counter = Counter()
        self.poisoned = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def start(self) -> "Attacker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        import httpx
        import redis

        broker = redis.Redis.from_url(self.redis_url)
        auth = {"Authorization": f"Bearer {BAD_KEY}"}
        with httpx.Client(base_url=self.base, timeout=60, headers=auth) as http:
            target = http.post("/v1/completions", json={"prompt": "12+34=", "max_tokens": 4, "n": 2}).json()["id"]
            for i in range(10 ** 9):
                if self._stop.is_set():
                    return
                if i % 10 == 0:
                    path, body = _malformed(self.rng)
                    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
                elif i % 10 == 5:
                    r = httpx.post(f"{self.base}/v1/completions", json={"prompt": "1+1="}, timeout=60)  # no key
                else:
                    r = http.post("/v1/feedback", json={"answer_id": target, "index": i % 2, "thumbs": "up"})
                self.statuses[r.status_code] += 1
                if i % 20 == 19:
                    broker.xadd("rlmill:events", self.rng.choice(POISON))
                    self.poisoned += 1


def _window(client: Client, seconds: float) -> tuple[float, float]:
    """(answers per second, p99 latency in s) of the answers that arrived in the next `seconds`."""
    t0 = time.monotonic()
    time.sleep(seconds)  # the measurement window itself
    t1 = time.monotonic()
    lat = [a.latency_s for a in list(client.answers) if t0 <= a.done < t1]
    p99 = statistics.quantiles(lat, n=100)[98] if len(lat) >= 2 else float("nan")
    return len(lat) / (t1 - t0), p99


def _votes_per_choice(root: str, principal: str) -> int:
    """The most committed feedback rows of `principal` on one answer choice."""
    from gpu_jobs.online.dataset import read_segments

    _, feedback = read_segments(root, "builtin")
    per = Counter((f["answer_id"], f["index"]) for f in feedback if f.get("principal") == principal)
    return max(per.values(), default=0)


def _quarantined(root: str) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in Path(root, "feedback", "_quarantine").rglob("*.parquet"))


def hostile_traffic(chaos: Chaos, fault: str, window_s: float = 20.0, concurrency: int = 4) -> Outcome:
    keys = chaos.work / "hostile-keys.yaml"
    keys.parent.mkdir(parents=True, exist_ok=True)
    keys.write_text(f"{GOOD_KEY}: {{principal: app, roles: [query, feedback, metrics]}}\n"
                    f"{BAD_KEY}: {{principal: mallory, roles: [query, feedback]}}\n")
    keys.chmod(0o600)  # serve refuses a keys file others may read
    with stack(chaos, "hostile-traffic", serve_args=("--api-keys", str(keys)), api_key=GOOD_KEY) as s:
        s.start_consumer()
        client = Client(s.serve.base, concurrency, headers={"Authorization": f"Bearer {GOOD_KEY}"}).start()
        attacker = None
        try:
            client.wait_answers(10, START_S, "to warm up")
            clean_rps, clean_p99 = _window(client, window_s)
            attacker = Attacker(s.serve.base, s.redis.url).start()
            hostile_rps, hostile_p99 = _window(client, window_s)
        finally:
            if attacker is not None:
                attacker.stop()
            client.stop()
        s.drain()
        audit = audit_answers(s.root, client.ids, int(s.serve.metrics().get("rlmill_serve_events_dropped_total", 0)))
        votes, quarantined = _votes_per_choice(s.root, "mallory"), _quarantined(s.root)
    statuses = attacker.statuses if attacker else Counter()
    server_errors = sum(n for code, n in statuses.items() if code >= 500)
    codes = ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items()))
    what = (f"good clients {clean_rps:.1f} -> {hostile_rps:.1f} answers/s ({hostile_rps / clean_rps:.2f}x), p99 "
            f"{clean_p99:.3f} -> {hostile_p99:.3f} s ({hostile_p99 / clean_p99:.2f}x); attacker answered {codes}; "
            f"{attacker.poisoned if attacker else 0} poison entries, {quarantined} quarantined; the attacker's "
            f"votes committed per choice at most {votes}")
    ok = (server_errors == 0 and votes <= 1 and attacker is not None and quarantined >= attacker.poisoned
          and sum(statuses.values()) > 0)
    recovered = ok and audit.data_lost == 0
    return Outcome(fault, f"{what}; {audit.line()}", recovered, audit.data_lost)


ROWS = {
    "hostile-traffic": ("an attacker with a valid key: malformed requests, a vote flood, calls without a key, "
                        "poison stream entries, beside good clients", hostile_traffic),
}
