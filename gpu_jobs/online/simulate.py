"""Simulated users: they ask `rlmill serve` the built-in task's held-out problems, score each
answer with a hidden preference, and post the score to /v1/feedback.

    plan = plan_requests(requests=64, users=8, seed=0)          # who asks what, seeded
    result = simulate("http://127.0.0.1:8000", plan, max_tokens=6, temperature=1.0)
    print(format_table(result.table))                           # per served version: requests, mean reward

The hidden preference (what the users want, never sent to the server; only its score is):
correct and short answers to the built-in 2-digit addition task,

    score = correct * (1 - min(n_tokens, L) / (2 L))

where `correct` is the task's own rule reward on the prompt's ground truth (1 for the exact sum,
else 0), `n_tokens` the answer's completion tokens (the response's usage) and L the max_tokens
the users ask for. A right answer scores between 1/2 (it used all L tokens) and 1, a wrong one 0.

Each request names its user (`sim-user-<i>`, the request's `user`: against a server without keys
it picks no canary arm -- each request draws its own, and each answer is one vote; a `user` only
routes when a key that vouches for its users sends it, canary.py) and a per-request sampling
seed; the plan is a pure function of (requests, users, seed), so two runs against the same
server and version ask the same things. The version that answered is the response's `system_fingerprint` ("<model>@<version>"), which
is also what its answer event names, so the table's versions are the ones the canary counts.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Planned", "SimAnswer", "SimResult", "SimulateError", "format_table", "plan_requests", "preference_score",
           "score_answer", "simulate", "user_id", "version_table"]

USER_PREFIX = "sim-user-"
THUMBS_UP_AT = 0.5  # with thumbs: up when the score reaches this, down below it


class SimulateError(ValueError):
    """Something the simulation's user got wrong (a URL nothing answers at, a model the server
    does not serve): the message is one line with the fix."""


def user_id(i: int) -> str:
    """The stable id of simulated user `i`.

    >>> user_id(3)
    'sim-user-3'
    """
    return f"{USER_PREFIX}{i}"


def preference_score(correct: float, n_tokens: int, max_tokens: int) -> float:
    """The hidden preference: correct * (1 - min(n_tokens, L) / (2 L)) with L = max_tokens.

    >>> preference_score(1.0, 3, 6), preference_score(1.0, 6, 6), preference_score(1.0, 9, 6)
    (0.75, 0.5, 0.5)
    >>> preference_score(0.0, 1, 6)
    0.0
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return float(correct) * (1.0 - min(max(n_tokens, 0), max_tokens) / (2.0 * max_tokens))


def score_answer(row: dict[str, Any], text: str, n_tokens: int, max_tokens: int) -> tuple[float, float]:
    """(correct, score) of one answer `text` to the verl prompt `row`: the task's rule reward on
    its ground truth (gpu_jobs.reward's built-in scorer for the row's data_source), then the
    preference."""
    from gpu_jobs.reward.registry import default_compute_score

    correct = float(default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],
                                          row.get("extra_info")))
    return correct, preference_score(correct, n_tokens, max_tokens)


@dataclass(frozen=True)
class Planned:
    """One request of the plan: who asks, what (a verl prompt row), with which sampling seed."""

    index: int
    user: str
    row: dict[str, Any]
    seed: int


def plan_requests(requests: int, users: int, seed: int, *, pool: int | None = None, round: int = 0) -> list[Planned]:
    """Who asks what: held-out problems of the built-in task (its generator's "test" stream for
    `seed`), each asked by one of `users` users. Without `pool`, `requests` distinct problems;
    with it, `requests` draws (with replacement) from the stream's first `pool` problems -- users
    who keep asking the same things -- and `round` (a cycle's number) changes the draws and who
    asks, never the pool. A pure function of its arguments.

    >>> [(p.user, p.row["prompt"][0]["content"]) for p in plan_requests(3, 2, 0)] == \\
    ...     [(p.user, p.row["prompt"][0]["content"]) for p in plan_requests(3, 2, 0)]
    True
    >>> len({p.row["prompt"][0]["content"] for p in plan_requests(50, 4, 0, pool=5, round=1)})
    5
    """
    import numpy as np

    from gpu_jobs.data.generators import get_generator

    if requests < 1 or users < 1 or (pool is not None and pool < 1):
        raise ValueError(f"requests, users and pool must be >= 1, got {requests}, {users} and {pool}")
    rng = np.random.default_rng([seed, round, 7])
    if pool is None:
        rows = get_generator("arith")("test", requests, seed)
    else:
        problems = get_generator("arith")("test", pool, seed)
        rows = [problems[int(k)] for k in rng.integers(0, pool, size=requests)]
    who = rng.integers(0, users, size=requests)
    seeds = rng.integers(0, 2**31 - 1, size=requests)
    return [Planned(i, user_id(int(who[i])), rows[i], int(seeds[i])) for i in range(requests)]


@dataclass(frozen=True)
class SimAnswer:
    """What one simulated request got and what its user said."""

    index: int
    user: str
    prompt: str
    text: str
    version: str  # the version that answered (from the response's system_fingerprint)
    n_tokens: int
    correct: float
    score: float
    answer_id: str
    feedback_logged: bool  # the server said the feedback event reached (or waits for) the broker
    feedback_at: float  # time.time() when the feedback was posted


@dataclass
class SimResult:
    answers: list[SimAnswer] = field(default_factory=list)

    @property
    def table(self) -> list[dict[str, Any]]:
        return version_table(self.answers)

    @property
    def first_feedback_at(self) -> float | None:
        return min((a.feedback_at for a in self.answers), default=None)

    def mean_score(self, version: str | None = None) -> float:
        scores = [a.score for a in self.answers if version is None or a.version == version]
        return sum(scores) / len(scores) if scores else math.nan


def version_table(answers: list[SimAnswer]) -> list[dict[str, Any]]:
    """One row per version that answered, in order of first answer: version, requests, users,
    mean live reward (the hidden preference's mean score) and the share of correct answers.

    >>> a = lambda v, s, c: SimAnswer(0, "u", "p", "t", v, 3, c, s, "id", True, 0.0)
    >>> version_table([a("v0", 0.75, 1.0), a("v1", 0.0, 0.0), a("v0", 0.0, 0.0)])
    [{'version': 'v0', 'requests': 2, 'users': 1, 'mean_reward': 0.375, 'correct': 0.5}, \
{'version': 'v1', 'requests': 1, 'users': 1, 'mean_reward': 0.0, 'correct': 0.0}]
    """
    by: dict[str, list[SimAnswer]] = {}
    for a in answers:
        by.setdefault(a.version, []).append(a)
    return [{"version": v, "requests": len(xs), "users": len({x.user for x in xs}),
             "mean_reward": sum(x.score for x in xs) / len(xs), "correct": sum(x.correct for x in xs) / len(xs)}
            for v, xs in by.items()]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table as aligned text, one line per version (floats to 3 decimals).

    >>> print(format_table([{'version': 'v0', 'requests': 2, 'mean_reward': 0.375}]))
    version  requests  mean_reward
    v0              2        0.375
    """
    if not rows:
        return "(no answers)"
    cols = list(rows[0])
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    lines += ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(line.rstrip() for line in lines)


# ------------------------------------------------------------------------------------ the HTTP side
def base_url(url: str) -> str:
    """The server's root URL, whether `url` names it or its /v1.

    >>> base_url("http://127.0.0.1:8000/v1/"), base_url("http://h:1")
    ('http://127.0.0.1:8000', 'http://h:1')
    """
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def served_model(url: str, model: str | None, timeout_s: float = 10.0) -> tuple[str, str]:
    """(model, version) that the server at `url` serves now (GET /v1/models); SimulateError when
    nothing answers there or it serves another model than `model`."""
    import httpx

    try:
        r = httpx.get(f"{base_url(url)}/v1/models", timeout=timeout_s)
        r.raise_for_status()
        card = r.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise SimulateError(f"no rlmill serve answers GET {base_url(url)}/v1/models ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}): start `rlmill serve` or pass --url with its "
                            "address") from None
    if model is not None and model != card["id"]:
        raise SimulateError(f"the server at {base_url(url)} serves {card['id']!r}, not {model!r}: pass "
                            f"--model {card['id']} or leave --model out")
    return card["id"], str(card.get("version"))


def _ask(http: Any, url: str, model: str, p: Planned, max_tokens: int, temperature: float,
         thumbs: bool) -> SimAnswer:
    r = http.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": p.row["prompt"], "max_tokens": max_tokens, "temperature": temperature,
        "seed": p.seed, "user": p.user})
    r.raise_for_status()
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    n_tokens = int(body["usage"]["completion_tokens"])
    version = str(body.get("system_fingerprint", "")).rpartition("@")[2] or "?"
    correct, score = score_answer(p.row, text, n_tokens, max_tokens)
    feedback = {"answer_id": body["id"], "score": score, "user": p.user}
    if thumbs:
        feedback["thumbs"] = "up" if score >= THUMBS_UP_AT else "down"
    at = time.time()
    f = http.post(f"{url}/v1/feedback", json=feedback)
    f.raise_for_status()
    return SimAnswer(p.index, p.user, p.row["prompt"][0]["content"], text, version, n_tokens, correct, score,
                     body["id"], bool(f.json().get("logged")), at)


def simulate(url: str, plan: list[Planned], *, model: str | None = None, max_tokens: int = 6,
             temperature: float = 1.0, concurrency: int = 2, thumbs: bool = False,
             timeout_s: float = 120.0) -> SimResult:
    """Send every planned request to the server at `url` (`concurrency` at a time), score each
    answer with the hidden preference and post the score (and thumbs, with `thumbs`) to
    /v1/feedback. Answers come back in plan order. SimulateError when the server is not there,
    serves another model, or refuses a request."""
    import httpx

    url = base_url(url)
    model, _ = served_model(url, model)
    lock, out = threading.Lock(), []
    with httpx.Client(timeout=timeout_s) as http:
        def one(p: Planned) -> None:
            try:
                a = _ask(http, url, model, p, max_tokens, temperature, thumbs)
            except httpx.HTTPStatusError as exc:
                raise SimulateError(f"the server refused request {p.index} ({exc.response.status_code}: "
                                    f"{' '.join(exc.response.text.split())[:200]})") from None
            except httpx.HTTPError as exc:
                raise SimulateError(f"request {p.index} to {url} failed ({type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:200]}): is `rlmill serve` still running?") from None
            with lock:
                out.append(a)

        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="rlmill-sim") as pool:
            futures = [pool.submit(one, p) for p in plan]
            try:
                for f in futures:
                    f.result()  # the first failure, as raised
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # what has not started never will
                raise
    return SimResult(sorted(out, key=lambda a: a.index))
