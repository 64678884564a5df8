"""The online loop under faults (issue 26, item 5): rl-retrain runs started twice or SIGKILLed mid-
training, `rlmill serve` restarted and the broker restarted during a canary, each row ending with
the online audit (online_audit.py: no feedback row trained twice or skipped; CURRENT and serve only
ever named promoted versions or the canary's candidate).

    .venv/bin/python -m benchmarks.chaos --only retrain-trigger-twice,retrain-kill-mid-run
    .venv/bin/python -m benchmarks.chaos --only serve-restart-canary,broker-restart-online
    RLMILL_FAILPOINT=after-train:update:1 RLMILL_FAILPOINT_MARKER=/tmp/m \\
        .venv/bin/python -m benchmarks.chaos.online_runs retrain --model arith root=/tmp/rl ...
        # `python -m flows.online.retrain` with a failpoint of benchmarks/chaos/failpoints.py armed

Every process is a real one, started as a user or a deployment would: rl-retrain runs are
`python -m flows.online.retrain` processes (through the wrapper above when a failpoint is armed) against
the session's Prefect API; serve, the feedback consumer and redis-server (appendonly, fsync always)
are serve_stack's. Faults happen at named points: a failpoint's marker, a committed segment, the
simulated users' round having been drained and counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .harness import EXAMPLE, Chaos, Outcome
from .online_audit import check, collect
from .serve_stack import START_S, Proc, RedisServer, ServeProcess, audit_answers, committed_ids, wait_until

RETRAIN_MODEL = "arith"
SERVE_MODEL = "demo"
FEEDBACK_ROWS = 8  # one batch of the tiny run: one window, one iteration
RUN_S = 900.0  # bound on one retrain process (model loads, one iteration, two greedy evaluations)
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Needs no ground truth: 1 for an answer made of digits only.
    return 1.0 if solution_str.strip().isdigit() else 0.0
'''


# ------------------------------------------------------------------------------------ setup
def register_builtin(models: Any, version: str) -> str:
    """models/<name>/versions/<version>: the built-in model committed as a checkpoint (index last),
    as a promoted version is (flows.nightly.export_merged); returns its URL. Already committed:
    left as it is."""
    from flows.nightly import export_merged

    return export_merged("builtin", models.version(version), models.storage)


def seed_feedback(work: Path, root: str, n: int, model: str = RETRAIN_MODEL, version: str = "v0") -> int:
    """n answers of `model` at `version` to arithmetic prompts with a thumbs-up each, XADDed as
    serve publishes them to a real redis-server, committed by the consumer; returns the rows."""
    import redis

    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.events import answer_event, encode, feedback_event

    broker = RedisServer(work).start()
    try:
        r = redis.Redis.from_url(broker.url)
        for i in range(n):
            a = answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model=model, version=version,
                             created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": f"{10 + i}+{20 + i}="}],
                             prompt_ids=[5, 6], choices=[{"index": 0, "text": str(30 + 2 * i), "token_ids": [7],
                                                          "logprobs": [-0.5], "finish_reason": "stop"}],
                             sampling={"temperature": 1.0})
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model=model, version=version, thumbs="up")))
        result = consume(root, broker.url)
    finally:
        broker.stop()
    if result.feedback != n or result.quarantined:
        raise RuntimeError(f"seeding: the consumer committed {result.feedback} of {n} feedback rows, "
                           f"quarantined {result.quarantined}")
    return result.feedback


def _retrain_setup(chaos: Chaos, name: str) -> tuple[Path, str, Path, Any]:
    """(work folder, root, reward file, ModelLayout): v0 = the built-in model, CURRENT; one
    window's worth of feedback committed."""
    from storage import ModelLayout

    work = chaos.work / name
    work.mkdir(parents=True, exist_ok=True)
    root, reward = str(work / "root"), work / "digits_reward.py"
    reward.write_text(REWARD)
    models = ModelLayout(root, RETRAIN_MODEL)
    register_builtin(models, "v0")
    models.promote("v0", by="chaos-setup", reason="the built-in model, registered by the chaos row")
    seed_feedback(work, root, FEEDBACK_ROWS)
    return work, root, reward, models


def retrain(chaos: Chaos, work: Path, root: str, reward: Path, name: str, failpoint: str | None = None,
            release: Path | None = None) -> Proc:
    """Start one rl-retrain run (`python -m flows.online.retrain` on the tiny run), armed at `failpoint`
    (its marker: work/marker-<name>; held until `release` exists, else until killed)."""
    from tests.tiny import tiny_overrides

    args = ["--model", RETRAIN_MODEL, "--config", str(EXAMPLE), "--eval-size", "8", "--min-gain=-1",
            *tiny_overrides(root, f"reward.custom_reward_function.path={reward}", "trainer.val_before_train=false",
                            "reward.num_workers=1", "data.val_size=8")]
    env = chaos.env(failpoint, work / f"marker-{name}") if failpoint else chaos.env()
    if release is not None:
        env["RLMILL_FAILPOINT_RELEASE"] = str(release)
    cmd = [sys.executable, "-m", "benchmarks.chaos.online_runs" if failpoint else "flows.online.retrain",
           *(["retrain"] if failpoint else []), *args]
    return Proc(f"retrain-{name}", cmd, work, env).start()


def _exit(proc: Proc, what: str) -> int:
    wait_until(what, lambda: not proc.alive, RUN_S, step=0.2)
    return proc.proc.returncode


def _status(proc: Proc) -> str:
    """The run's `status` from the JSON it printed last, else its last line (a refusal)."""
    text = proc.text()
    start = text.rfind("\n{\n")
    try:
        return json.loads(text[start + 1:])["status"] if start >= 0 else proc.tail(1)
    except (ValueError, KeyError):
        return proc.tail(1)


def _runs(root: str) -> list[str]:
    folder = Path(root) / "runs"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _row(fault: str, what: str, ok: bool, lost: int, audit) -> Outcome:
    return Outcome(fault, f"{what}; {audit.line()}", ok and lost == 0 and audit.problems == 0, lost + audit.problems)


# ------------------------------------------------------------------------------------ retrain rows
def retrain_trigger_twice(chaos: Chaos, fault: str) -> Outcome:
    """Run A claims the window and holds inside its training (rollout 1 committed); run B, the
    trigger's second firing, starts and runs to its end ("in progress": the window's run lock is
    held by A); A is released and finishes; run C starts after A finished ("nothing new").
    Exactly one run trains the window."""
    from gpu_jobs.online.windows import WindowLog

    work, root, reward, models = _retrain_setup(chaos, "retrain-trigger-twice")
    release = work / "release-a"
    a = retrain(chaos, work, root, reward, "a", "after-commit:rollout:1", release)
    b = None
    try:
        wait_until("run A to commit rollout 1 of its window's run (failpoint after-commit:rollout:1)",
                   (work / "marker-a").exists, RUN_S, a, step=0.1)
        claimed = [(w.seq, w.run_id) for w in WindowLog(models).windows()]
        b = retrain(chaos, work, root, reward, "b")
        b_rc = _exit(b, "run B (the trigger firing again while A trains) to exit")
        release.touch()
        a_rc = _exit(a, "run A to finish once released")
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
    c = retrain(chaos, work, root, reward, "c")
    c_rc = _exit(c, "run C (the trigger firing after A finished) to exit")
    windows, done = WindowLog(models).read()
    runs, moves = _runs(root), [h for h in models.history() if h.get("by") == "retrain"]
    audit = check(collect(root, RETRAIN_MODEL))
    said = {"A": _status(a), "B": _status(b), "C": _status(c)}
    what = (f"A claimed window(s) {claimed} and held mid-training; B (exit {b_rc}): {said['B'][:120]}; "
            f"A released (exit {a_rc}): {said['A']}; C after A (exit {c_rc}): {said['C']}; "
            f"{len(windows)} window(s), {len(done)} done, runs {runs}, {len(moves)} retrain promotion(s)")
    trained_once = (len(windows) == 1 and set(done) == {1} and runs == [windows[0].run_id] and len(moves) <= 1
                    and said["B"] not in ("promoted", "refused", "canary", "published"))
    ok = (a_rc == 0 and b_rc == 0 and c_rc == 0 and (said["A"], said["B"], said["C"]) == ("promoted", "in progress",
                                                                                       "nothing new") and trained_once)
    return _row(fault, what, ok, 0 if trained_once else 1, audit)


def retrain_kill_mid_run(chaos: Chaos, fault: str) -> Outcome:
    """The run is SIGKILLed with update 1 applied in memory (failpoint after-train:update:1, every
    earlier stage committed); `python -m flows.online.retrain` again resumes it: the same window (run id,
    segment URIs), nothing committed lost or changed, the run finished."""
    from gpu_jobs.online.windows import WindowLog

    from .audit import audit, snapshot
    from .harness import layout

    work, root, reward, models = _retrain_setup(chaos, "retrain-kill-mid-run")
    a = retrain(chaos, work, root, reward, "a", "after-train:update:1")
    try:
        wait_until("the run to apply update 1 in memory (failpoint after-train:update:1)",
                   (work / "marker-a").exists, RUN_S, a, step=0.1)
        windows_then = [(w.seq, w.run_id, tuple(w.uris)) for w in WindowLog(models).windows()]
        lay = layout(root, windows_then[0][1]) if windows_then else None
        before = snapshot(lay) if lay else {}
        a.kill()
    finally:
        a.stop()
    b = retrain(chaos, work, root, reward, "resume")
    b_rc = _exit(b, "the resumed run to exit")
    windows, done = WindowLog(models).read()
    windows_now = [(w.seq, w.run_id, tuple(w.uris)) for w in windows]
    run = audit(lay, before, iterations=1) if lay else None
    online = check(collect(root, RETRAIN_MODEL))
    same = bool(windows_then) and windows_now == windows_then and set(done) == {1}
    stale = "stale lock" in b.text()
    what = (f"SIGKILLed with update 1 in memory ({len(before)} stage manifests committed, window "
            f"{windows_then[0][:2] if windows_then else None}); resumed (exit {b_rc}, {_status(b)}"
            f"{', cleared the stale run lock' if stale else ''}): "
            f"{'the same window, run id and segments' if same else f'windows now {windows_now}'}; "
            f"run audit: {run.summary() if run else 'no run'}")
    lost = (run.data_lost + run.not_finished) if run else 1
    ok = b_rc == 0 and same and _status(b) == "promoted"
    return _row(fault, what, ok, lost + (0 if same else 1), online)


# ------------------------------------------------------------------------------------ canary rows
@contextlib.contextmanager
def canary_stack(chaos: Chaos, name: str, share: float = 0.5, min_samples: int = 8):
    """redis-server, serve (--watch-s 1) and a following consumer over model `demo`: v0 (the
    built-in model) CURRENT, v1 (a copy) its canary's candidate with `share` of the users. Yields
    (serve_runs.Stack, ModelLayout, Canary) once serve names the canary on /health."""
    from storage import ModelLayout
    from gpu_jobs.online.canary import CanaryPolicy, start_canary

    from .serve_runs import Stack

    work = chaos.work / name
    work.mkdir(parents=True, exist_ok=True)
    root = str(work / "root")
    models = ModelLayout(root, SERVE_MODEL)
    register_builtin(models, "v0")
    models.promote("v0", by="chaos-setup", reason="the built-in model, registered by the chaos row")
    register_builtin(models, "v1")
    canary = start_canary(models, "v1", CanaryPolicy(share, min_samples=min_samples), by="chaos")
    redis = RedisServer(work).start()
    serve = ServeProcess(work, redis.url, model_args=("--model", SERVE_MODEL, "--root", root, "--watch-s", "1"))
    s = Stack(work, root, redis, serve, {"PREFECT_API_URL": chaos.api_url} if chaos.api_url else {})
    try:
        serve.start()
        _wait_canary(s, canary.id)
        s.start_consumer()
        yield s, models, canary
    finally:
        s.close()


def _health(s) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{s.serve.base}/health", timeout=10).json()


def _wait_canary(s, canary_id: str) -> dict[str, Any]:
    """/health once it names canary `canary_id` (bounded)."""
    return wait_until(f"serve to name canary {canary_id} on /health",
                      lambda: (h := _health(s)).get("canary") and h["canary"]["id"] == canary_id and h,
                      START_S, s.serve, step=0.2)


def _simulate(s, requests: int, users: int, round: int):
    from gpu_jobs.online.simulate import plan_requests, simulate

    return simulate(s.serve.base, plan_requests(requests, users, 0, round=round), model=SERVE_MODEL,
                    max_tokens=6, concurrency=2)


def _arms(models: Any, canary: Any) -> tuple[int, int]:
    """(baseline, candidate) scored feedback rows as rl-canary counts them from the committed log."""
    from flows.online.canary import measure

    v = measure(models, canary)
    return v.n_baseline, v.n_candidate


def _expected(answers: list, canary: Any) -> tuple[tuple[int, int], list[str]]:
    """((baseline, candidate) answers the users rated, by the arm that answered; the users with an
    answer from neither arm). serve runs without keys here, so each request draws its own arm
    (gpu_jobs/online/canary.py: no voter, nothing to be sticky for) and each answer is one vote."""
    n = [0, 0]
    moved = set()
    for a in answers:
        if a.version not in (canary.baseline, canary.candidate):
            moved.add(a.user)
        n[a.version == canary.candidate] += 1
    return (n[0], n[1]), sorted(moved)


def _dropped(s) -> int:
    return int(s.serve.metrics().get("rlmill_serve_events_dropped_total", 0))


def serve_restart_canary(chaos: Chaos, fault: str, requests: int = 24, users: int = 12) -> Outcome:
    """A round of simulated users during a canary, drained and counted; serve SIGKILLed and
    restarted on its port; a second round; the split (share, canary id), each user's arm and the
    arms' counts must be what they were, plus the second round's, once; rl-canary decides."""
    from flows.online.canary import rl_canary

    from .serve_runs import restart_on_same_port

    with canary_stack(chaos, "serve-restart-canary") as (s, models, canary):
        first = _simulate(s, requests, users, round=1).answers
        s.drain()
        counted, h1, dropped = _arms(models, canary), _health(s)["canary"], _dropped(s)
        s.serve.kill()
        tries = restart_on_same_port(s.serve)
        h2 = _wait_canary(s, canary.id)["canary"]
        second = _simulate(s, requests, users, round=2).answers
        s.drain()
        after = _arms(models, canary)
        answers = first + second
        answered = audit_answers(s.root, [a.answer_id for a in answers], dropped + _dropped(s), model=SERVE_MODEL)
        decided = rl_canary(model=SERVE_MODEL, root=s.root)["status"]
        online = check(collect(s.root, SERVE_MODEL))
    (want_first, _), (want_all, moved) = _expected(first, canary), _expected(answers, canary)
    what = (f"{len(first)} answers, arms counted {counted} (baseline, candidate); serve SIGKILLed, restarted "
            f"({tries} start(s)), /health canary {'unchanged' if h1 == h2 else f'{h1} -> {h2}'}; {len(second)} more: "
            f"arms {after}, expected {want_all}; {len(moved)} user(s) answered by neither arm; rl-canary: {decided}; "
            f"{answered.line()}")
    wrong = abs(counted[0] - want_first[0]) + abs(counted[1] - want_first[1]) + \
        abs(after[0] - want_all[0]) + abs(after[1] - want_all[1])
    ok = h1 == h2 and not moved and min(want_all) > 0
    return _row(fault, what, ok, wrong + len(moved) + answered.data_lost, online)


class Users:
    """Simulated users rating answers round after round (`per_round` requests each) in a thread
    of their own until stop(); `rounds` counts the rounds finished, `answers` holds them all."""

    def __init__(self, s, per_round: int, users: int):
        self.s, self.per_round, self.users = s, per_round, users
        self.answers: list = []
        self.rounds, self.error = 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-users", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.answers += _simulate(self.s, self.per_round, self.users, round=self.rounds + 1).answers
                self.rounds += 1
        except Exception as exc:  # noqa: BLE001 - raised by stop(), in the row's thread
            self.error = exc

    def start(self) -> "Users":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_rounds(self, n: int, what: str) -> None:
        wait_until(f"{n} round(s) of ratings {what} (got {self.rounds})", lambda: self.rounds >= n or self.error,
                   RUN_S, step=0.1)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(RUN_S)
        if self._thread.is_alive() or self.error is not None:
            raise RuntimeError(f"the simulated users did not finish: {self.error or 'still running'}")
        return self.answers


def broker_restart_online(chaos: Chaos, fault: str, per_round: int = 16, users: int = 12, rounds_after: int = 2) -> Outcome:
    """Simulated users rate answers during a canary, round after round; once the consumer has
    committed a segment, redis-server is SIGKILLed and started again (appendonly: it keeps the
    stream and the group) while they go on; `rounds_after` more rounds; then drain: every answer
    committed once, the arms' counts exact."""
    with canary_stack(chaos, "broker-restart-online") as (s, models, canary):
        rating = Users(s, per_round, users).start()
        try:
            wait_until("the consumer's first committed segment", lambda: committed_ids(s.root, SERVE_MODEL)[0],
                       START_S, s.consumer, step=0.1)
            flowing, at = rating.alive, rating.rounds
            s.redis.kill()
            s.redis.start()
            rating.wait_rounds(at + 1 + rounds_after, "after the restart")  # the round in flight, then more
        finally:
            answers = rating.stop()
        consumer_died = not s.consumer.alive
        if consumer_died:  # what a supervisor would do; the row says so and does not count it recovered
            s.start_consumer()
        s.drain()
        after, dropped = _arms(models, canary), _dropped(s)
        answered = audit_answers(s.root, [a.answer_id for a in answers], dropped, model=SERVE_MODEL)
        online = check(collect(s.root, SERVE_MODEL))
    want, moved = _expected(answers, canary)
    what = (f"redis SIGKILLed and restarted after the first committed segment, in round {at + 1} of the users' "
            f"ratings ({'still rating' if flowing else 'ALREADY DONE'}), {rating.rounds - at - 1} full round(s) after; "
            f"the consumer {'DIED and was restarted' if consumer_died else 'kept running'}; {len(answers)} answers, "
            f"serve dropped {dropped}; arms {after}, expected {want}; {answered.line()}")
    wrong = abs(after[0] - want[0]) + abs(after[1] - want[1])
    ok = flowing and not consumer_died and not moved and rating.rounds - at - 1 >= rounds_after
    return _row(fault, what, ok, wrong + len(moved) + answered.data_lost, online)


ROWS = {
    "retrain-trigger-twice": ("rl-retrain triggered twice for one window: the second while the first trains it, "
                              "a third after it finished", retrain_trigger_twice),
    "retrain-kill-mid-run": ("rl-retrain SIGKILLed mid-training (update 1 in memory), started again",
                             retrain_kill_mid_run),
    "serve-restart-canary": ("rlmill serve SIGKILLed and restarted during a canary", serve_restart_canary),
    "broker-restart-online": ("Redis broker SIGKILLed and restarted while users rate a canary's answers",
                              broker_restart_online),
}


def main(argv: list[str]) -> None:
    """`retrain <flows.online.retrain args>` with RLMILL_FAILPOINT (benchmarks/chaos/failpoints.py) armed."""
    if not argv or argv[0] != "retrain":
        sys.exit("usage: python -m benchmarks.chaos.online_runs retrain <python -m flows.online.retrain options>")
    spec, marker = os.environ.get("RLMILL_FAILPOINT"), os.environ.get("RLMILL_FAILPOINT_MARKER")
    if spec:
        if not marker:
            sys.exit("RLMILL_FAILPOINT needs RLMILL_FAILPOINT_MARKER (the file to touch when it is hit)")
        from flows.failpoints import POINTS

        from .failpoints import install, parse

        try:
            spec in POINTS or parse(spec)  # a typo is one line, before the run's heavy imports
        except ValueError as exc:
            sys.exit(str(exc))
        install(spec, marker)
    from flows.online.retrain import main as retrain_main

    retrain_main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
