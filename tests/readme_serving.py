"""The docs walkthrough's steps (tests/test_readme_walkthrough.py, which lists them in STEPS)
for docs/guide/serving.md and docs/guide/online.md: curl against a real `rlmill serve`, the feedback
consumer, simulated users, and the retrain and canary deployments through the walk's worker. Each
step takes the walk and the README's command, runs it as the user's shell would (walk.sh) and
checks what it changed: counts in storage, the canary's routing, the registered model.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from typing import TYPE_CHECKING

from tests.tiny import TINY

if TYPE_CHECKING:
    from tests.test_readme_walkthrough import Step, Walk

# ADJUSTED['retrain']: the retrain plans its own batch from the window (flows.online.retrain.plan_training);
# TINY's 8 would split the README's 64 ratings into 8 iterations. The gate scores both models after
# training anyway: no validation before it (as benchmarks/online_demo.py).
RETRAIN_TINY = [*(o for o in TINY if not o.startswith(("data.train_batch_size=", "actor.ppo_mini_batch_size="))),
                "trainer.val_before_train=false"]


# ---------------------------------------------------------------------------- Serving and feedback
def completion(walk: Walk, step: Step) -> None:
    """The README's curl of /v1/chat/completions: an answer with its chatcmpl- id (kept for the feedback)."""
    answer = json.loads(walk.sh(walk.serve_ports(step.text)))
    assert answer["id"].startswith("chatcmpl-") and answer["choices"][0]["message"]["content"] is not None, answer
    walk.answer_ids.append(answer["id"])
    walk.unconsumed["answers"] += 1


def feedback(walk: Walk, step: Step) -> None:
    """The README's curl of /v1/feedback, on the answer the completion gave: logged."""
    assert walk.answer_ids, "the README posts feedback before any completion answered"
    reply = json.loads(walk.sh(walk.serve_ports(step.text).replace("chatcmpl-...", walk.answer_ids[-1])))
    assert reply["answer_id"] == walk.answer_ids[-1] and reply["logged"] is True, reply
    walk.unconsumed["feedback"] += 1


def feedback_cli(walk: Walk, step: Step) -> None:
    """`rlmill feedback consume` commits every answer and rating given since the last drain;
    `rlmill feedback dataset` writes training rows."""
    out = walk.sh(walk.serve_ports(step.text))
    if " consume " in step.text:
        answers, rated = walk.unconsumed["answers"], walk.unconsumed["feedback"]
        assert re.search(rf"\b{answers} answers and {rated} feedback committed", out), (answers, rated, out)
        walk.unconsumed = {"answers": 0, "feedback": 0}
    else:
        assert re.search(r"rlmill: [1-9]\d* training rows -> feedback.parquet", out), out


def serve_with_keys(walk: Walk, step: Step) -> None:
    """`rlmill serve --api-keys keys.yaml --host 0.0.0.0`: the keys file docs/guide/serving.md's steps
    made in the clone, the server on a free port beside the walk's; /v1/models is a 401 without a
    key and a 200 with the frontend's key; SIGTERM drains it and it exits 0."""
    import signal
    import subprocess
    import urllib.error
    import urllib.request

    from tests.servers import free_port

    # keys.yaml and frontend.key: made by the page's `python -m gpu_jobs.online.auth` steps, just before
    assert "sha256:" in (walk.clone / "keys.yaml").read_text(), "the page makes its keys before serving with them"
    port = free_port()
    command = walk.serve_ports(step.text).replace("--port 8000", f"--port {port}")
    proc = subprocess.Popen(["bash", "-c", command], cwd=walk.clone, env=walk.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
                time.sleep(1)
        url = f"http://127.0.0.1:{port}/v1/models"
        try:
            urllib.request.urlopen(url, timeout=10)
            raise AssertionError("/v1/models answered without a key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401, exc.code
        key = (walk.clone / "frontend.key").read_text().strip()
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"}),
                                    timeout=10)
        assert ok.status == 200
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]


def governance(walk: Walk, step: Step) -> None:
    """`rlmill feedback forget` deletes the user's rows (none of theirs left in any committed
    segment); `rlmill models lineage` lists what trained what; `rlmill feedback retain --dry-run`
    finds nothing 30 days old in a fresh walk."""
    from gpu_jobs.online.consumer import manifest_rows, segment_manifests

    out = walk.sh(walk.serve_ports(step.text))
    if " forget " in step.text:
        user = shlex.split(step.text)[shlex.split(step.text).index("--user") + 1]
        assert re.search(rf"rlmill: '{user}' forgotten \(\S+_forget/\S+\.json\): [1-9]\d* row\(s\) of arith", out), out
        rows = [r for m in segment_manifests(str(walk.clone / ".rlmill" / "feedback")) for r in manifest_rows(m)]
        assert rows and not [r for r in rows if r.get("user") == user], out
    elif " retain " in step.text:
        assert "rlmill: retention 30d: would remove 0 hour folder(s) and 0 dead letter(s)" in out, out
    else:
        assert "trained on" in out or "no retrain window promoted" in out, out


# ---------------------------------------------------------------------------- Online learning
def simulate(walk: Walk, step: Step) -> None:
    """`rlmill simulate`: its table counts, per version, the requests serve answered there -- all on
    CURRENT without a canary; during one (the walk's serve has no keys: each request draws its arm)
    both arms, every request counted once."""
    from gpu_jobs.online.simulate import plan_requests
    from gpu_jobs.online.canary import read_canary

    words = shlex.split(step.text)
    requests, users, seed = (int(words[words.index(f) + 1]) if f in words else default
                             for f, default in (("--requests", 64), ("--users", 8), ("--seed", 0)))
    out = walk.sh(walk.serve_ports(step.text))
    models = walk.models(walk.health()["model"])
    canary, current = read_canary(models), models.current_version()
    want: dict[str, int] = {}
    for planned in plan_requests(requests, users, seed):  # without keys each request draws its own arm
        want[current] = want.get(current, 0) + 1
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["version", "requests"])
    got = {}
    for line in lines[head + 1:]:
        cells = line.split()
        if len(cells) < 2 or not cells[1].isdigit():
            break
        got[cells[0]] = int(cells[1])
    if canary is not None:  # the arms' split is per request: both arms answered, all requests in all
        assert set(got) == {current, canary.candidate} and sum(got.values()) == requests, (got, out)
    else:
        assert got == want, (got, want, out)
    assert "not logged" not in out, out
    walk.last_table, walk.rated = got, walk.rated + requests
    walk.unconsumed = {k: v + requests for k, v in walk.unconsumed.items()}  # one answer and one rating each


def _param(words: list[str], name: str) -> str:
    """The value of a deployment run's `-p name=value`."""
    return next(w.split("=", 1)[1] for w in words if w.startswith(f"{name}="))


def _watched(walk: Walk, words: list[str]) -> str:
    """A deployment run with --watch (through the walk's worker) that ends Completed."""
    assert "--watch" in words
    return walk.watch(shlex.join(words))


def _wait_for_serve(walk: Walk, what: str, want, timeout: float = 60) -> None:
    """A bounded wait until serve's /health satisfies `want` (serve polls models/<name>/ every --watch-s)."""
    deadline = time.monotonic() + timeout
    while not want(health := walk.health()):
        assert walk.serve.poll() is None and time.monotonic() < deadline, f"serve never showed {what}: {health}"
        time.sleep(0.5)


def retrain(walk: Walk, step: Step) -> None:
    """rl-retrain through the worker (ADJUSTED['retrain'], ['gates']): Completed; its window holds
    exactly the ratings given since the last window, one training row each; the candidate passed
    the gate and a canary of it runs; serve then routes to it."""
    from gpu_jobs.online.canary import read_canary
    from gpu_jobs.online.windows import WindowLog

    words = walk.with_overrides(shlex.split(step.text), RETRAIN_TINY)
    _watched(walk, [*words, "-p", "eval_size=32", "-p", "min_gain=-1"])
    models = walk.models(_param(words, "model"))
    window = WindowLog(models).windows()[-1]
    done = WindowLog(models).done().get(window.seq, {})
    assert done.get("feedback_rows") == done.get("rows") == walk.rated, (window, done, walk.rated)
    walk.rated = 0
    canary = read_canary(models)
    assert canary is not None and done["canary"] == canary.id and canary.candidate == window.run_id, (done, canary)
    _wait_for_serve(walk, f"the canary {canary.id}", lambda h: (h["canary"] or {}).get("id") == canary.id)


def models_canary(walk: Walk, step: Step) -> None:
    """`rlmill models canary`: each arm's n is what the last simulate's table gave its version
    (every rating since the canary started), then the decision now."""
    from gpu_jobs.online.canary import read_canary

    out = walk.sh(step.text)
    canary = read_canary(walk.models(shlex.split(step.text)[3]))
    for arm, version in (("baseline", canary.baseline), ("candidate", canary.candidate)):
        n = walk.last_table.get(version, 0)
        assert re.search(rf"^  {arm} +{re.escape(version)}: n {n},", out, re.M), (arm, version, n, out)
    walk.decision_now = re.search(r"^decision now: (wait|promote|rollback):", out, re.M).group(1)


def canary_decide(walk: Walk, step: Step) -> None:
    """rl-canary/decide through the worker: Completed, and storage shows the decision `rlmill
    models canary` stated just before it: wait keeps the canary, promote moves CURRENT to the
    candidate, rollback ends the canary and keeps CURRENT."""
    from gpu_jobs.online.canary import read_canary

    assert walk.decision_now, "the README decides a canary before `rlmill models canary` showed its numbers"
    models = walk.models(_param(shlex.split(step.text), "model"))
    before, current = read_canary(models), models.current_version()
    _watched(walk, shlex.split(step.text))
    after, now = read_canary(models), models.current_version()
    want = {"wait": (before.id, current), "promote": (None, before.candidate), "rollback": (None, current)}
    assert (after.id if after else None, now) == want[walk.decision_now], (walk.decision_now, before, after, now)
