"""The faults `make chaos` injects, each a function `(Chaos) -> Outcome`, in one registry.

Every scenario runs the tiny GRPO run of `harness.py` and checks "completes, and nothing
committed is lost or duplicated" with `audit.py`; faults in the *input* (dataset, config) must
instead be refused before anything is written. `QUICK` is the reduced set `make test` runs.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from pathlib import Path
from typing import Callable

from .audit import audit, snapshot
from .harness import EXAMPLE, ITERATIONS, Chaos, Outcome, layout, overrides

SCENARIOS: dict[str, tuple[str, Callable[[Chaos], Outcome]]] = {}
QUICK = ("sigkill-chain", "kill-after-last-commit", "corrupt-checkpoint", "s3-outage-long", "reward-faults-mixed", "bad-dataset", "bad-config")


def scenario(name: str, fault: str):
    def register(fn: Callable[[Chaos], Outcome]) -> Callable[[Chaos], Outcome]:
        SCENARIOS[name] = (fault, fn)
        return fn

    return register


def _result(fault: str, outcome: str, ok: bool, report, weights: str = "-") -> Outcome:
    """A row for a run that must complete: recovered only if it did, lost nothing, and finished."""
    if report.data_lost:
        outcome += f"; {report.summary()}"
    return Outcome(fault, outcome, ok and not report.data_lost and not report.not_finished, report.data_lost,
                   weights, report.not_finished)


def _tail(text: str, n: int = 1) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[:160]


# ------------------------------------------------------------------------------ SIGKILL
def _kill_then_resume(chaos: Chaos, name: str, fault: str, points: list[str]) -> Outcome:
    root = str(chaos.work / name)
    lay, before = layout(root, "r"), {}
    for point in points:
        chaos.kill_at(root, "r", point)
        before.update(snapshot(lay))  # everything committed so far must survive every resume
    done = chaos.finish(root, "r")
    report = audit(lay, before, ITERATIONS)
    ok = done.returncode == 0
    outcome = (f"killed {len(points)}x ({len(before)} manifests committed); resumed and completed" if ok
               else f"resume failed: {_tail(done.stdout)}")
    return _result(fault, outcome, ok, report, chaos.same_as_reference(root, "r") if ok else "-")


KILL_POINTS = {
    "kill-after-rollout": ("SIGKILL after rollout committed (iter 1)", "after-commit:rollout:1"),
    "kill-after-gate": ("SIGKILL after gate committed (iter 1)", "after-commit:gate:1"),
    "kill-after-reward": ("SIGKILL after reward committed (iter 1)", "after-commit:reward:1"),
    "kill-after-advantages": ("SIGKILL after advantages committed (iter 3)", "after-commit:advantages:3"),
    "kill-after-update": ("SIGKILL after update committed, no checkpoint (iter 1)", "after-commit:update:1"),
    "kill-after-checkpoint": ("SIGKILL after checkpoint 2, before update 2's manifest", "after-checkpoint:update:2"),
    "kill-after-iteration": ("SIGKILL after iteration 2 committed", "after-commit:commit:2"),
    "kill-mid-rollout": ("SIGKILL mid-rollout: responses generated, not committed (iter 3)", "before-commit:rollout:3"),
    "kill-mid-reward": ("SIGKILL mid-reward: scores computed, not committed (iter 2)", "before-commit:reward:2"),
    "kill-mid-update": ("SIGKILL mid-update: weights changed in memory only (iter 3)", "after-train:update:3"),
    "kill-mid-commit": ("SIGKILL mid-commit: shards written, manifest not (iter 2 advantages)",
                        "before-manifest:advantages:2"),
}
for _name, (_fault, _point) in KILL_POINTS.items():
    scenario(_name, _fault)(lambda chaos, n=_name, f=_fault, p=_point: _kill_then_resume(chaos, n, f, [p]))


@scenario("sigkill-chain", "SIGKILL mid-rollout (1), mid-commit (2), mid-update (3), then resume")
def sigkill_chain(chaos: Chaos) -> Outcome:
    return _kill_then_resume(chaos, "sigkill-chain", SCENARIOS["sigkill-chain"][0],
                             ["before-commit:rollout:1", "before-manifest:reward:2", "after-train:update:3"])


@scenario("kill-after-last-commit", "SIGKILL after the last commit: at the final validation, then each resume at "
                                   "the report, the flow's return, after Completed; resumed by hand")
def kill_after_last_commit(chaos: Chaos) -> Outcome:
    """A chain over the moments of flows/failpoints.py: the run is killed at the first, each resume
    at the next (so each resume has got past the moment before), and the last resume finishes.
    Nothing may be committed after the first kill: every stage and checkpoint was already there."""
    from flows.failpoints import AFTER_LAST_COMMIT

    root = str(chaos.work / "kill-after-last-commit")
    lay, recommitted = layout(root, "r"), []
    points = list(AFTER_LAST_COMMIT)  # not run:setup: that one is before any iteration
    chaos.kill_at(root, "r", points[0])
    before = snapshot(lay)
    for point in points[1:]:
        chaos.kill_at(root, "r", point)
        recommitted += sorted(set(snapshot(lay)) - set(before))
    done = chaos.finish(root, "r")
    recommitted += sorted(set(snapshot(lay)) - set(before))
    report = audit(lay, before, ITERATIONS)
    ok = done.returncode == 0 and not recommitted and bool(before)
    if done.returncode:
        outcome = f"resume failed: {_tail(done.stdout)}"
    elif recommitted or not before:
        outcome = f"a resume committed again: {recommitted[:2]}"
    else:
        outcome = f"killed at {len(points)} moments after the last commit; resumed, completed, committed nothing new"
    return _result(SCENARIOS["kill-after-last-commit"][0], outcome, ok, report,
                   chaos.same_as_reference(root, "r") if ok else "-")


# ------------------------------------------------------------------------------ corruption
def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    path.write_bytes(bytes(data))


@scenario("corrupt-checkpoint", "checkpoint file corrupted after commit, then resume")
def corrupt_checkpoint(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "corrupt-checkpoint")
    lay = layout(root, "r")
    chaos.kill_at(root, "r", "after-commit:advantages:3")
    before = snapshot(lay)
    files = [p for p in Path(lay.trainer(2).removeprefix("file://")).rglob("*") if p.is_file()
             and p.name != "trainer_state.json"]
    victim = max(files, key=lambda p: p.stat().st_size)
    _flip_bytes(victim)
    done = chaos.finish(root, "r")
    report = audit(lay, before, ITERATIONS)
    ok = done.returncode == 0
    detected = "is damaged" in done.stdout
    outcome = (f"{victim.name} of checkpoint 2 {'detected by sha256' if detected else 'NOT detected'}; "
               f"replayed updates 1-2 from the start model; completed" if ok else f"failed: {_tail(done.stdout)}")
    return _result(SCENARIOS["corrupt-checkpoint"][0], outcome, ok and detected, report,
                   chaos.same_as_reference(root, "r") if ok else "-")


def _first_shard(lay, k: int, stage: str) -> tuple[str, Path]:
    folder = Path(lay.stage(k, stage).removeprefix("file://"))
    return f"{lay.stage(k, stage)}/_MANIFEST.json", next(folder.glob("part-*.parquet"))


@scenario("corrupt-past-shard", "Parquet shard of a finished iteration corrupted, then resume")
def corrupt_past_shard(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "corrupt-past")
    lay = layout(root, "r")
    chaos.kill_at(root, "r", "after-commit:advantages:3")
    before = snapshot(lay)
    manifest, shard = _first_shard(lay, 1, "rollout")
    _flip_bytes(shard)
    done = chaos.finish(root, "r")
    report = audit(lay, before, ITERATIONS, damaged={manifest})
    from storage import CorruptShardError, read_table

    try:
        read_table(manifest)
        named = False
    except CorruptShardError as e:
        named = shard.name in str(e)
    ok = done.returncode == 0
    outcome = (f"completed (the run never rereads it); reading it raises CorruptShardError "
               f"{'naming the shard' if named else 'WITHOUT the name'}" if ok else f"failed: {_tail(done.stdout)}")
    return _result(SCENARIOS["corrupt-past-shard"][0], outcome, ok and named, report,
                   chaos.same_as_reference(root, "r") if ok else "-")


@scenario("corrupt-needed-shard", "Parquet shard the next stage needs corrupted (iter 3 advantages)")
def corrupt_needed_shard(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "corrupt-needed")
    lay = layout(root, "r")
    chaos.kill_at(root, "r", "after-commit:advantages:3")
    before = snapshot(lay)
    manifest, shard = _first_shard(lay, 3, "advantages")
    _flip_bytes(shard)
    first = chaos.finish(root, "r")
    refused = first.returncode != 0 and "CorruptShardError" in first.stdout and shard.name in first.stdout
    repair = chaos.verify(root, "r", "--repair")
    done = chaos.finish(root, "r")
    report = audit(lay, before, ITERATIONS, damaged={manifest})
    ok = done.returncode == 0 and refused and "set aside" in repair.stdout
    outcome = ("training refused it (CorruptShardError names the shard); `rlmill verify --repair` set it "
               "aside; resume recomputed it and completed" if ok else
               f"refused={refused}; repair: {_tail(repair.stdout)}; resume: {_tail(done.stdout)}")
    return _result(SCENARIOS["corrupt-needed-shard"][0], outcome, ok, report,
                   chaos.same_as_reference(root, "r") if done.returncode == 0 else "-")


# ------------------------------------------------------------------------------ object storage
def _train_in_process(*args: str) -> Exception | None:
    """One rl-training flow run in this process; the exception it ended with, or None."""
    from flows.training import rl_training

    try:
        rl_training(config=str(EXAMPLE), overrides=list(args))
    except Exception as e:  # noqa: BLE001 - the scenario reports it
        return e
    return None


@contextlib.contextmanager
def _moto():
    """An in-process S3 endpoint that can be stopped and started again with its buckets kept."""
    import logging

    from moto.server import ThreadedMotoServer

    from tests.servers import free_port

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    port = free_port()
    box = {"server": ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)}
    box["server"].start()

    def restart() -> None:
        box["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        box["server"].start()

    try:
        yield f"http://127.0.0.1:{port}", box, restart
    finally:
        box["server"].stop()


@contextlib.contextmanager
def _attempts_of(stage: str, k: int):
    """Record each attempt of `stage` at iteration k (Prefect retries included): the exception
    type it ended with, or None. Wraps the stage's commit shell, which its task calls."""
    from gpu_jobs.stages import STAGES

    spec = STAGES[stage]
    real, attempts = spec.shell, []

    def wrapped(run, roles, kk, *a, **kw):
        if kk != k:
            return real(run, roles, kk, *a, **kw)
        try:
            out = real(run, roles, kk, *a, **kw)
        except Exception as e:
            attempts.append(type(e).__name__)
            raise
        attempts.append(None)
        return out

    spec.shell = wrapped
    try:
        yield attempts
    finally:
        del spec.shell  # the class's shell again


def _s3_outage(chaos: Chaos, name: str, seconds: float, *extra: str) -> Outcome:
    """Stop the S3 endpoint for `seconds` while iteration 2's reward manifest is being written (a
    commit point), start it again from a timer, and let the ONE run carry on: no operator, no
    restart. The product's storage backoff (and, past its budget, Prefect's task retries with
    their delays) must carry the run through."""
    import s3fs

    import storage.manifest as manifest
    from storage import StorageConfig

    fault = SCENARIOS[name][0]
    with _moto() as (endpoint, box, restart):
        # moto's backend is per process: every scenario gets its own bucket.
        bucket = f"chaos-{name}-{threading.get_ident() % 10_000}-{int(time.time())}"
        s3fs.S3FileSystem(key="chaos", secret="chaos", client_kwargs={"endpoint_url": endpoint}).mkdir(bucket)
        creds = [f"storage.endpoint_url={endpoint}", "storage.key=chaos", "storage.secret=chaos"]
        root, real, fired = f"s3://{bucket}/runs", manifest.create_only, threading.Event()
        lay = layout(root, "r", StorageConfig(endpoint_url=endpoint, key="chaos", secret="chaos"))
        before: dict[str, str] = {}
        timing: dict[str, float] = {}

        def create_only(fs, path, data, *, url=None):
            # The outage starts while iteration 2's reward manifest (a commit point) is written.
            if path.endswith("iterations/2/reward/_MANIFEST.json") and not fired.is_set():
                fired.set()
                before.update(snapshot(lay))  # what was committed when the endpoint went away
                box["server"].stop()
                timing["down"] = time.monotonic()
                threading.Timer(seconds, lambda: (restart(), timing.setdefault("up", time.monotonic()))).start()
            return real(fs, path, data, url=url)

        manifest.create_only = create_only
        try:
            with _attempts_of("reward", 2) as attempts:
                t0 = time.monotonic()
                err = _train_in_process(*overrides(root, "r", *creds, *extra))
                took = time.monotonic() - t0
        finally:
            manifest.create_only = real
        while fired.is_set() and "up" not in timing:  # a failed run must not leave the timer behind
            time.sleep(0.2)
        report = audit(lay, before, ITERATIONS)
        weights = chaos.same_as_reference(root, "r", lay.storage) if err is None else "-"
    if not fired.is_set():
        return Outcome(fault, "harness error: the outage never started (no reward manifest PUT of iteration 2 seen)",
                       False, report.data_lost, "-", report.not_finished)
    if err is not None:
        outcome = f"failed, not restarted: {type(err).__name__}: {str(err)[:110]}"
    else:
        failed = [a for a in attempts if a]
        carried = ("storage's backoff alone carried it (one attempt of the stage)" if not failed else
                   f"the reward task failed {len(failed)}x ({failed[0]}) and Prefect retried it after its "
                   f"backoff delays; attempt {len(attempts)} committed")
        outcome = (f"endpoint down {timing['up'] - timing['down']:.0f} s from iteration 2's reward manifest PUT; "
                   f"{carried}; the one run completed ({took:.0f} s in all, no restart)")
    return _result(fault, outcome, err is None, report, weights)


scenario("s3-outage", "S3 endpoint stopped 4 s during a commit, then restarted; no operator")(
    lambda chaos: _s3_outage(chaos, "s3-outage", 4.0))
scenario("s3-outage-long", "S3 endpoint stopped 40 s during a commit, then restarted; no operator")(
    lambda chaos: _s3_outage(chaos, "s3-outage-long", 40.0))
scenario("s3-outage-3min", "S3 endpoint stopped 3 min during a commit, then restarted; no operator")(
    lambda chaos: _s3_outage(chaos, "s3-outage-3min", 180.0))
scenario("s3-outage-past-budget",
         "S3 endpoint stopped 40 s, storage retry budget cut to 5 s: Prefect task retries (backoff) carry it")(
    lambda chaos: _s3_outage(chaos, "s3-outage-past-budget", 40.0, "storage.retry_budget_seconds=5"))


# ------------------------------------------------------------------------------ run lock
@scenario("stale-lock", "run SIGKILLed holding its run lock: a second start while it lived is refused, "
                        "the next start clears the stale lock")
def stale_lock(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "stale-lock")
    lay = layout(root, "r")
    refused: dict[str, object] = {}

    def second_start(pid: int) -> None:  # the first run is alive, holding the lock
        done = chaos.finish(root, "r")
        refused.update(ok=done.returncode != 0 and f"already being trained by pid {pid}" in done.stdout,
                       tail=_tail(done.stdout))

    dead = chaos.kill_at(root, "r", "after-commit:reward:1", while_held=second_start)
    before = snapshot(lay)
    done = chaos.finish(root, "r")
    report = audit(lay, before, ITERATIONS)
    cleared = "found and cleared a stale lock on run 'r'" in done.stdout and f"pid {dead}" in done.stdout
    ok = done.returncode == 0
    live = "a second start while it ran was refused" if refused.get("ok") else f"NOT refused: {refused.get('tail')}"
    stale = (f"the next start said it cleared the stale lock of pid {dead}" if cleared
             else "the next start did NOT report the stale lock")
    outcome = f"{live}; {stale}; resumed and completed" if ok else f"resume failed: {_tail(done.stdout)}"
    return _result(SCENARIOS["stale-lock"][0], outcome, ok and cleared and bool(refused.get("ok")), report,
                   chaos.same_as_reference(root, "r") if ok else "-")


# ------------------------------------------------------------------------------ leftovers
REWARD_THAT_WAITS = '''
import os, time

def _rank_group_running():
    """Whether this run's torchrun rank group (gpu_jobs.train.ranks.worker) has started."""
    tag = ("RLMILL_CHAOS_TAG=" + os.environ.get("RLMILL_CHAOS_TAG", "")).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"gpu_jobs.train.ranks.worker" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read().split(b"\\0"):
                    return True
        except OSError:
            pass
    return False

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match. The first call (with $CHAOS_REWARD_AFTER_GROUP, the first once the run's rank
    group is up) touches $CHAOS_REWARD_MARKER and then works for a long time."""
    marker = os.environ.get("CHAOS_REWARD_MARKER")
    if marker and not os.path.exists(marker) and (
            not os.environ.get("CHAOS_REWARD_AFTER_GROUP") or _rank_group_running()):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
    return 1.0 if solution_str.strip() == ground_truth else 0.0
'''


def _what(process: str) -> str:
    """A short name for a 'pid cmdline' line of harness.session_processes."""
    cmd = process.split(" ", 1)[1] if " " in process else process
    for needle, name in (("resource_tracker", "multiprocessing resource tracker"),
                         ("spawn_main", "reward worker (multiprocessing spawn)"),
                         ("forkserver", "multiprocessing forkserver"),
                         ("prefect.server", "Prefect API server (uvicorn)"),
                         ("torchrun", "torchrun"), ("vllm", "vLLM process")):
        if needle in cmd:
            return name
    return cmd[:60]


def _kill_leaves_nothing(chaos: Chaos, name: str, *extra: str, after_group: bool = False) -> Outcome:
    root = str(chaos.work / name)
    reward = chaos.work / f"reward_waits_{name}.py"
    reward.write_text(REWARD_THAT_WAITS)
    marker = chaos.work / f"reward-marker-{time.monotonic_ns()}"
    extra = (f"reward.custom_reward_function.path={reward}", "reward.num_workers=2", *extra)
    env = {"CHAOS_REWARD_MARKER": str(marker), **({"CHAOS_REWARD_AFTER_GROUP": "1"} if after_group else {})}
    # No PREFECT_API_URL: the run starts its own ephemeral Prefect server.
    left = chaos.kill_main_only(root, "r", marker, *extra, env=env, drop_env=("PREFECT_API_URL",))
    before = snapshot(layout(root, "r"))
    done = chaos.finish(root, "r", *extra)
    report = audit(layout(root, "r"), before, ITERATIONS)
    ok = done.returncode == 0
    outcome = ("nothing left running 20 s after the kill" if not left else
               f"{len(left)} process(es) left running 20 s after the kill: " + ", ".join(_what(x) for x in left))
    outcome += "; resumed and completed" if ok else f"; resume failed: {_tail(done.stdout)}"
    return _result(SCENARIOS[name][0], outcome, ok and not left, report)


# vLLM in-process (rlmill's default: VLLM_ENABLE_V1_MULTIPROCESSING=0), DeepSpeed ZeRO-3 on one
# in-process rank, reward workers in a process pool, the run's own ephemeral Prefect server.
scenario("kill-leaves-nothing", "SIGKILL of the rlmill process alone (not its group) while reward workers "
                                "score, with vLLM, DeepSpeed and its own Prefect server: nothing left running")(
    lambda chaos: _kill_leaves_nothing(chaos, "kill-leaves-nothing", "rollout.engine=vllm"))
# The warm torchrun group of 2 DeepSpeed ranks (trainer.n_gpus_per_node=2), killed in iteration 2.
scenario("kill-leaves-nothing-ranks", "as kill-leaves-nothing, with a torchrun group of 2 DeepSpeed ranks "
                                      "(trainer.n_gpus_per_node=2) alive")(
    lambda chaos: _kill_leaves_nothing(chaos, "kill-leaves-nothing-ranks", "trainer.n_gpus_per_node=2",
                                       after_group=True))


# ------------------------------------------------------------------------------ reward function
FAULTY_REWARD = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match, except every third prompt, where it misbehaves: {mode}."""
    i = int((extra_info or {{}}).get("index", 0))
    mode = "{mode}"
    if mode == "mixed":  # one run that meets every fault: quick enough for `make test`
        mode = {{0: "raises", 1: "nan", 2: "string"}}.get(i % 4, "hangs" if i % 16 == 3 else "")
    elif i % 3:
        mode = ""
    if mode:
        if mode == "raises":
            raise ValueError("injected failure")
        if mode == "hangs":
            time.sleep(3600)
        if mode == "nan":
            return float("nan")
        if mode == "string":
            return "high"
    return 1.0 if solution_str.strip() == ground_truth else 0.0
'''


def _reward_faults(chaos: Chaos, name: str, modes: list[str]) -> Outcome:
    counts, errors, lost, unfinished = {}, [], 0, 0
    for mode in modes:
        path = chaos.work / f"reward_{mode}.py"
        path.write_text(FAULTY_REWARD.format(mode=mode))
        root = str(chaos.work / f"{name}-{mode}")
        err = _train_in_process(*overrides(root, "r", f"reward.custom_reward_function.path={path}",
                                           "reward.timeout_s=2", "reward.num_workers=2"))
        lay = layout(root, "r")
        report = audit(lay, {}, ITERATIONS)
        lost += report.data_lost
        unfinished += report.not_finished
        if err is not None or report.data_lost or report.not_finished:
            errors.append(f"{mode}: {err or report.summary()}")
            continue
        from storage import read_manifest

        m = [read_manifest(lay.stage(k, "reward")).metrics for k in range(1, ITERATIONS + 1)]
        counts[mode] = (int(sum(x["reward/errors"] for x in m)), int(sum(x["reward/n"] for x in m)))
    outcome = ("completed; bad samples scored on_error and counted: "
               + ", ".join(f"{mode} {e}/{n}" for mode, (e, n) in counts.items()))
    ok = not errors and all(e > 0 for e, _ in counts.values())
    return Outcome(SCENARIOS[name][0], outcome if not errors else "; ".join(errors)[:200], ok, lost,
                   not_finished=unfinished)


scenario("reward-faults", "reward function raises / hangs / returns NaN / returns a string (a run each)")(
    lambda chaos: _reward_faults(chaos, "reward-faults", ["raises", "hangs", "nan", "string"]))
scenario("reward-faults-mixed", "reward function raising, hanging, NaN and string in one run")(
    lambda chaos: _reward_faults(chaos, "reward-faults-mixed", ["mixed"]))


# ------------------------------------------------------------------------------ bad input
def _nothing_written(root: str, run_id: str) -> bool:
    run = Path(root) / "runs" / run_id
    return not (run / "run.json").exists() and not (run / "iterations").exists()


def _refused(chaos: Chaos, name: str, cases: dict[str, list[str]], expect: dict[str, str]) -> Outcome:
    """Each case must fail with a message containing `expect[case]`, with nothing written."""
    from flows.config import load_run_config

    results, bad = [], []
    for case, extra in cases.items():
        root = str(chaos.work / f"{name}-{case}")
        try:
            load_run_config(EXAMPLE, overrides(root, "r", *extra))  # what `rlmill train` checks first
            err = _train_in_process(*overrides(root, "r", *extra))
        except Exception as e:  # noqa: BLE001
            err = e
        msg = str(err or "")
        if err is None or expect[case].lower() not in msg.lower() or not _nothing_written(root, "r"):
            bad.append(f"{case}: {'accepted' if err is None else msg[:120]}")
        else:
            results.append(case)
    outcome = (f"all {len(results)} refused before any write, each naming the problem ({', '.join(results)})"
               if not bad else "; ".join(bad)[:200])
    return Outcome(SCENARIOS[name][0], outcome, None if not bad else False, 0)


def _write_dataset(path: Path, rows: list[dict]) -> str:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _row(i: int, content="12+34=", **changes) -> dict:
    row = {"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": content}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "46"}, "extra_info": {"split": "train", "index": i}}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


@scenario("bad-dataset", "dataset with missing fields, empty prompts, over-long prompts, wrong types")
def bad_dataset(chaos: Chaos) -> Outcome:
    work = chaos.work
    files = {
        "missing-field": _write_dataset(work / "missing.parquet", [_row(i, reward_model=None) for i in range(40)]),
        "empty-prompt": _write_dataset(work / "empty.parquet", [_row(i, content="" if i == 7 else "1+2=")
                                                                 for i in range(40)]),
        "over-long": _write_dataset(work / "long.parquet", [_row(i, content="1+" * 600 + "2=" if i == 3 else "1+2=")
                                                            for i in range(40)]),
        "wrong-type": _write_dataset(work / "types.parquet", [_row(i, prompt=i) for i in range(40)]),
    }
    cases = {case: [f"data.train_files=[{f}]", f"data.val_files=[{f}]", "data.max_prompt_length=64"]
             for case, f in files.items()}
    expect = {"missing-field": "reward_model", "empty-prompt": "empty", "over-long": "long",
              "wrong-type": "prompt"}
    return _refused(chaos, "bad-dataset", cases, expect)


@scenario("bad-config", "config with unknown keys or out-of-range values")
def bad_config(chaos: Chaos) -> Outcome:
    cases = {"unknown-key": ["actor.lrr=1e-4"], "out-of-range": ["rollout.n=0"], "wrong-type": ["actor.lr=fast"],
             "impossible-combination": ["actor.ppo_mini_batch_size=999"]}
    expect = {"unknown-key": "lrr", "out-of-range": "rollout.n", "wrong-type": "actor.lr",
              "impossible-combination": "ppo_mini_batch_size"}
    return _refused(chaos, "bad-config", cases, expect)


# The orchestrator going away (real server + workers) and async runs killed mid-flight live in
# their own modules, which register their scenarios here when imported (they import this module,
# so they are loaded last).
importlib.import_module(f"{__package__}.orchestrator")
importlib.import_module(f"{__package__}.async_runs")
importlib.import_module(f"{__package__}.rank_runs")
importlib.import_module(f"{__package__}.cluster_runs")  # faults between hosts (deployments/cluster)

# Serving (rlmill serve, the broker, the feedback consumer) under faults: benchmarks/chaos/serve_runs.py.
from .serve_runs import ROWS as _SERVE_ROWS  # noqa: E402 - it needs Outcome and Chaos only, not this module
from .online_runs import ROWS as _ONLINE_ROWS  # noqa: E402 - the online loop (retrain, canary) under faults
from .hostile_runs import ROWS as _HOSTILE_ROWS  # noqa: E402 - an attacker beside good clients

for _name, (_fault, _fn) in {**_SERVE_ROWS, **_ONLINE_ROWS, **_HOSTILE_ROWS}.items():
    scenario(_name, _fault)(lambda chaos, f=_fault, fn=_fn: fn(chaos, f))
