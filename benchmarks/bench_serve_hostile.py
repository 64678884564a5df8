"""`make bench-serve ARGS=--hostile` (issue 61 item 5): /health and good clients while one principal
sends the bounded-work attacks, against a clean run of the same server.

    .venv/bin/python -m benchmarks.bench_serve --hostile                 # built-in model, ~1 min
    .venv/bin/python -m benchmarks.bench_serve --hostile --seconds 30    # longer phases

One `rlmill serve` process (built-in model, --redis to a redis-server started here) with two API
keys: `good` (4 closed-loop completion clients, as bench_serve's) and `attacker`. Rate limits are
turned off (--rate-limit 0 --feedback-rate-limit 0) so what is measured is the bound on each
request's work, not the rate limit (with keys they are on by default). A prober GETs /health every
50 ms throughout. Phase `clean`: the good clients alone. Phase `hostile`: the same, while the
attacker loops, each in its own task: the $defs/allOf schema bomb and the backtracking `pattern`
as tools of a chat request (refused 400), feedback naming made-up answer ids inside the retention
window (the recall flood, 8 at once), and 4 streamed chats of n=64, max_tokens 128, read to their
end and sent again. Reported: /health p50/p99/max, the good clients' req/s, p50, p99 and errors
per phase, and what the attacker's requests got (status counts). Not a test: the numbers depend
on the machine and its load.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from benchmarks.chaos.serve_stack import Client, RedisServer, ServeProcess

GOAL_HEALTH_P99_S, GOAL_RPS, GOAL_P99_RATIO = 1.0, 20.0, 2.0
STREAMS, STREAM_N, STREAM_TOKENS, FLOOD = 4, 64, 128, 8


def _percentile(values: list[float], q: float) -> float:
    from benchmarks.bench_serve import percentile

    return percentile(values, q) if values else float("nan")


def schema_bomb(levels: int = 32) -> dict:
    """32 $defs levels of allOf [$ref, $ref] (2.3 KB): 2^32 steps for a full JSON Schema validator."""
    defs = {"d0": {"type": "string"}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{levels}"}}, "$defs": defs}


REGEX_BOMB = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(.*)*\u0000$"}}}


class Prober:
    """GET /health every `every_s` in a thread; each answer's latency (a failure counts as 60 s)."""

    def __init__(self, base: str, every_s: float = 0.05):
        self.base, self.every_s, self.latencies = base, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.base, timeout=60) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = http.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - t0 if ok else 60.0)
                self._stop.wait(self.every_s)

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(70)


class Attacker:
    """The attacks of the module docstring, as asyncio tasks in a thread; `got` counts statuses."""

    def __init__(self, base: str, key: str):
        self.base, self.headers = base, {"Authorization": f"Bearer {key}"}
        self.got: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=self.base, timeout=300, headers=self.headers, limits=limits) as http:
            await asyncio.gather(self._bomb(http, "schema bomb", schema_bomb()), self._bomb(http, "regex bomb", REGEX_BOMB),
                                 *(self._recall(http, random.Random(i)) for i in range(FLOOD)),
                                 *(self._stream(http) for _ in range(STREAMS)))

    async def _bomb(self, http, name: str, schema: dict) -> None:
        tool = {"type": "function", "function": {"name": "f", "description": "", "parameters": schema}}
        body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4, "tools": [tool]}
        while not self._stop.is_set():
            await self._count(name, http.post("/v1/chat/completions", json=body))

    async def _recall(self, http, rng: random.Random) -> None:
        from gpu_jobs.online.answers import new_answer_id

        while not self._stop.is_set():
            made_up = new_answer_id("chatcmpl", time.time() - rng.uniform(0, 20 * 3600))
            await self._count("recall flood", http.post("/v1/feedback", json={"answer_id": made_up, "score": 1}))

    async def _stream(self, http) -> None:
        body = {"messages": [{"role": "user", "content": "12+34="}], "n": STREAM_N, "max_tokens": STREAM_TOKENS,
                "temperature": 1.0, "stream": True}
        while not self._stop.is_set():
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                self.got[f"stream n={STREAM_N}: HTTP {r.status_code}"] += 1
            except Exception as exc:  # noqa: BLE001 -- counted, the attack goes on
                self.got[f"stream n={STREAM_N}: {type(exc).__name__}"] += 1
                await asyncio.sleep(0.05)

    async def _count(self, name: str, request) -> None:
        try:
            self.got[f"{name}: HTTP {(await request).status_code}"] += 1
        except Exception as exc:  # noqa: BLE001
            self.got[f"{name}: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)

    def __enter__(self) -> "Attacker":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(300)


def phase(base: str, good_key: str, seconds: float, warmup: float, attacker_key: str | None) -> dict:
    """One phase: the good clients (and the attacker when its key is given) with the prober."""
    with ExitStack() as stack:
        attacker = stack.enter_context(Attacker(base, attacker_key)) if attacker_key else None
        client = Client(base, 4, 6, headers={"Authorization": f"Bearer {good_key}"}).start()
        stack.callback(client.stop)
        time.sleep(warmup)  # the load runs for a fixed time: that is the measurement
        with Prober(base) as prober:
            t0 = time.monotonic()
            time.sleep(seconds)
            t1 = time.monotonic()
    window = [a.latency_s for a in client.answers if t0 <= a.done < t1]
    return {"health": prober.latencies, "good": window, "rps": len(window) / (t1 - t0),
            "errors": sum(client.errors.values()), "attacker": dict(attacker.got) if attacker else {}}


def _keys_file(work: Path) -> tuple[Path, dict[str, str]]:
    keys = {p: f"sk-{secrets.token_urlsafe(24)}" for p in ("good", "attacker")}
    path = work / "keys.json"
    path.write_text(json.dumps({k: {"principal": p, "roles": ["query", "feedback", "metrics"]}
                                for p, k in keys.items()}))
    path.chmod(0o600)
    return path, keys


def run_hostile(args, work: Path) -> str:
    path, keys = _keys_file(work)
    with ExitStack() as stack:
        redis = RedisServer(work).start()
        stack.callback(redis.stop)
        serve = ServeProcess(work, redis.url, api_key=keys["good"], model_args=(
            "--api-keys", str(path), "--rate-limit", "0", "--feedback-rate-limit", "0"))
        stack.callback(serve.stop)
        serve.start()
        phases = {}
        for name, attacker in (("clean", None), ("hostile", keys["attacker"])):
            phases[name] = phase(serve.base, keys["good"], args.seconds, args.warmup, attacker)
            p = phases[name]
            print(f"  {name}: good {p['rps']:.1f} req/s, /health p99 {_percentile(p['health'], 0.99) * 1000:.0f} ms",
                  file=sys.stderr, flush=True)
        dropped = serve.metrics()
    return hostile_report(args, phases, dropped)


def hostile_report(args, phases: dict, metrics: dict) -> str:
    lines = [f"\nrlmill serve under the bounded-work attacks, built-in model (hf engine), {time.strftime('%Y-%m-%d')}, "
             f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; {args.seconds:g} s per phase after "
             f"{args.warmup:g} s; `python -m benchmarks.bench_serve {' '.join(sys.argv[1:])}`".rstrip(),
             "| phase | /health probes | /health p50 ms | /health p99 ms | /health max ms | good req/s | good p50 ms "
             "| good p99 ms | good errors |", "|---|---|---|---|---|---|---|---|---|"]
    for name, p in phases.items():
        h, g = p["health"], p["good"]
        lines.append(f"| {name} | {len(h)} | {statistics.median(h) * 1000:.1f} | {_percentile(h, 0.99) * 1000:.1f} | "
                     f"{max(h) * 1000:.1f} | {p['rps']:.1f} | {statistics.median(g) * 1000:.1f} | "
                     f"{_percentile(g, 0.99) * 1000:.1f} | {p['errors']} |")
    got = phases["hostile"]["attacker"]
    lines.append("attacker's requests: " + "; ".join(f"{k} x{v}" for k, v in sorted(got.items())))
    stopped = {k: v for k, v in metrics.items() if "dropped_running" in k or "stopped_calls" in k or "client_gone" in k or "queue_full" in k}
    if stopped:
        lines.append("server: " + ", ".join(f"{k} {v:g}" for k, v in sorted(stopped.items())))
    clean, hostile = phases["clean"], phases["hostile"]
    h99 = _percentile(hostile["health"], 0.99)
    ratio = _percentile(hostile["good"], 0.99) / _percentile(clean["good"], 0.99)
    lines.append(f"goals: /health p99 < {GOAL_HEALTH_P99_S:g} s under attack: {h99:.3f} s "
                 f"({'met' if h99 < GOAL_HEALTH_P99_S else 'NOT met'}); good clients >= {GOAL_RPS:g} req/s: "
                 f"{hostile['rps']:.1f} ({'met' if hostile['rps'] >= GOAL_RPS else 'NOT met'}); good p99 <= "
                 f"{GOAL_P99_RATIO:g}x clean: {ratio:.2f}x ({'met' if ratio <= GOAL_P99_RATIO else 'NOT met'})")
    return "\n".join(lines)
