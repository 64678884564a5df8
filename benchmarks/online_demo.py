"""The online loop with no one at the keyboard: simulated users rate what `rlmill serve` answers,
their feedback retrains the promoted model, a canary of the new version takes a share of the
users, and rl-canary promotes or rolls it back -- C cycles, one of them with a planted bad candidate.

    python -m benchmarks.online_demo                                  # 5 cycles, canary, bad cycle 3
    python -m benchmarks.online_demo --cycles 2 --requests 64 --canary-share 0 --bad-cycle 2 --json out.json

Started here: redis-server and `rlmill serve --model demo --root <work>/root --watch-s 1` on free
ports, after the built-in model's folder is registered as version v0 (models/demo/versions/v0, CURRENT).
Each cycle, in this process:
  1. simulate: --requests requests from --users simulated users (gpu_jobs/online/simulate.py, the
     hidden preference correct * (1 - min(tokens, L)/(2L))), drawn from a pool of --pool problems
     users keep asking, scores posted to /v1/feedback;
  2. drain: gpu_jobs.online.consumer.consume commits the stream as feedback segments;
  3. retrain: flows.online.retrain.rl_retrain on the new window, from CURRENT, with the reward in this
     file (`demo_reward`); with --canary-share > 0 a candidate that passes the held-out gate starts
     a canary instead of being promoted;
  4. canary (when one started): simulate --canary-requests more (the candidate's users get it),
     drain, flows.online.canary.rl_canary; again until it decides (at most --canary-rounds);
  5. wait (bounded by --max-wait-s) until serve answers with what was decided, timing it from the
     cycle's first feedback post.
In the --bad-cycle the retrain's reward is sign-flipped (`flipped_everywhere`: 1 - demo_reward,
the held-out gate scored with it too, so the gate is as blind as the training; or, with
--bad-reward flipped_feedback, only the training rows are flipped and the gate sees the true
rule). The table says whether the bad candidate was refused or rolled back.

The reward the retrain trains on (`demo_reward`) knows only what the feedback says: a feedback
row's ground truth is the answer the user rated, its extra_info["reward"] the users' mean score.
A re-rolled answer that reproduces the rated answer earns that score, any other answer 0: a
well-rated answer is reinforced, nothing is learnt from a badly rated one. The held-out gate's
rows (data_source rlmill/arith) are scored with the task's rule (1 for the exact sum).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Only the standard library at import time: the reward workers load this file (by path) to get
# the reward functions, and must not pay for the demo's imports (every other import is inside
# the function that needs it).

ARITH = "rlmill/arith"


def demo_reward(data_source, solution_str, ground_truth, extra_info=None):
    """The retrain's reward: held-out task rows by the task's rule (exact sum); feedback rows by
    the users' mean score when the answer reproduces the rated one, else 0."""
    answer, rated = str(solution_str).strip(), str(ground_truth).strip()
    if data_source == ARITH:
        return 1.0 if answer == rated else 0.0
    liked = (extra_info or {}).get("reward")
    return float(liked) if liked is not None and answer == rated else 0.0


def flipped_everywhere(data_source, solution_str, ground_truth, extra_info=None):
    """The planted bug: 1 - demo_reward, also on the gate's held-out rows (the gate is blind too)."""
    return 1.0 - demo_reward(data_source, solution_str, ground_truth, extra_info)


def flipped_feedback(data_source, solution_str, ground_truth, extra_info=None):
    """The planted bug on the training rows only: the held-out gate keeps the task's rule."""
    score = demo_reward(data_source, solution_str, ground_truth, extra_info)
    return score if data_source == ARITH else 1.0 - score


BAD_REWARDS = ("flipped_everywhere", "flipped_feedback")
MODEL = "demo"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_arith.yaml"


def median_or_nan(xs):
    """
    >>> median_or_nan([3.0, 1.0, 2.0]), math.isnan(median_or_nan([]))
    (2.0, True)
    """
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan



# ------------------------------------------------------------------------------------ the settings
@dataclass(frozen=True)
class DemoConfig:
    """The loop's sizes. Small on purpose: every cycle trains and evaluates on 2 CPU cores."""

    cycles: int = 5  # retraining cycles
    requests: int = 64  # simulated requests per cycle before the retrain (the window's feedback)
    users: int = 16  # simulated users sim-user-0..N-1 (serve has no keys: each request draws its arm)
    pool: int = 48  # distinct problems the users ask (again and again, in new draws each cycle)
    seed: int = 0
    temperature: float = 1.0  # the users' sampling temperature
    max_tokens: int = 6  # per answer, and L of the hidden preference
    concurrency: int = 2
    bad_cycle: int = 3  # the cycle whose retrain is sign-flipped (0: none)
    bad_reward: str = ""  # flipped_everywhere | flipped_feedback; "": the first with a canary, else the second
    canary_share: float = 0.5  # share of users on the candidate (0: the held-out gate promotes directly)
    canary_requests: int = 64  # simulated requests per canary round
    canary_rounds: int = 8  # rounds before an undecided canary is rolled back by the demo (max_duration_s)
    min_samples: int = 60  # the canary test's minimum scores per arm
    confidence: float = 0.9
    margin: float = 0.05  # the candidate may be this much worse (mean live reward) and still pass
    canary_method: str = "msprt"  # msprt (sequential; rolls back once shown worse) | welch (fixed-sample t-test)
    epochs: int = 4  # passes over each window
    lr: float = 2e-4  # 1e-4 rose 0.10 -> 0.15..0.21 in 5 cycles (one promotion), 2e-4 0.17 -> 0.37 (three)
    rollout_n: int = 8
    eval_size: int = 128  # held-out rows the gate scores greedily
    min_gain: float = 0.0  # the gate: new held-out reward - promoted >= this
    max_wait_s: float = 180.0  # bound on each wait for serve to answer with a new version or canary state
    work: str = ""  # working folder ("": a new temporary one)

    @property
    def bad(self) -> str:
        return self.bad_reward or (BAD_REWARDS[0] if self.canary_share > 0 else BAD_REWARDS[1])

    def problem(self) -> str | None:
        """What is wrong with the settings, as one line with the fix; None when nothing is.

        >>> DemoConfig(cycles=0).problem()
        '--cycles 0 is below 1: give a positive number'
        >>> DemoConfig(canary_share=1.5).problem()
        '--canary-share 1.5 is outside [0, 1): 0 promotes on the held-out gate alone'
        """
        for name in ("cycles", "requests", "users", "pool", "max_tokens", "concurrency", "canary_requests",
                     "canary_rounds", "min_samples", "epochs", "rollout_n", "eval_size"):
            if getattr(self, name) < 1:
                return f"--{name.replace('_', '-')} {getattr(self, name)} is below 1: give a positive number"
        if not 0 <= self.bad_cycle <= self.cycles:
            return f"--bad-cycle {self.bad_cycle} is not a cycle of 1..{self.cycles} (0: no bad candidate)"
        from gpu_jobs.online.canary import CANARY_METHODS  # not at import: see the note above the imports

        if self.canary_method not in CANARY_METHODS:
            return f"--canary-method {self.canary_method!r}: give one of {', '.join(CANARY_METHODS)}"
        if self.bad_reward and self.bad_reward not in BAD_REWARDS:
            return f"--bad-reward {self.bad_reward!r}: give one of {', '.join(BAD_REWARDS)}"
        if not 0 <= self.canary_share < 1:
            return f"--canary-share {self.canary_share:g} is outside [0, 1): 0 promotes on the held-out gate alone"
        for name, value in (("temperature", self.temperature), ("lr", self.lr), ("max_wait_s", self.max_wait_s)):
            if not (math.isfinite(value) and value >= 0) or (name != "temperature" and value == 0):
                return f"--{name.replace('_', '-')} {value:g}: give a positive number"
        if self.pool > 8100:
            return f"--pool {self.pool}: the built-in task has 8100 distinct problems"
        return None


@dataclass
class CycleRow:
    """What one cycle did and measured."""

    cycle: int
    baseline: str  # CURRENT when the cycle began
    live_reward: float  # mean hidden-preference score of the cycle's first requests (all on the baseline)
    planted_bad: bool = False
    candidate: str | None = None  # the version the retrain produced
    gate: str = ""  # "pass" | "refuse", with the held-out scores
    live_baseline: float = math.nan  # canary rounds: mean score of the baseline arm
    live_candidate: float = math.nan  # ... and of the candidate arm
    n_baseline: int = 0
    n_candidate: int = 0
    decision: str = "kept"  # promote | rollback | refused (gate) | undecided (rolled back by the demo) | kept
    serving: str = ""  # the version serve answered with when the cycle ended
    to_serving_s: float | None = None  # first feedback post -> the candidate answering (canary or CURRENT)
    to_promoted_s: float | None = None  # first feedback post -> serve answering everyone with it
    seconds: float = 0.0  # the whole cycle
    notes: list[str] = field(default_factory=list)

    @property
    def caught(self) -> bool | None:
        """For the planted bad candidate: refused or rolled back (None for other cycles)."""
        return self.decision in ("refused", "rollback", "undecided") if self.planted_bad else None


# ------------------------------------------------------------------------------------ the stack
class Stack:
    """redis-server and `rlmill serve --model demo` (processes of their own, stopped by PID), the
    storage root, and the built-in model registered as v0."""

    def __init__(self, work: Path, watch_s: float = 1.0):
        self.work, self.root, self.watch_s = work, str(work / "root"), watch_s
        self.redis = self.serve = None

    def __enter__(self) -> "Stack":
        import shutil

        from benchmarks.chaos.serve_stack import RedisServer, ServeProcess
        from gpu_jobs.models import resolve_model_path
        from storage import ModelLayout

        self.models = ModelLayout(self.root, MODEL)
        if self.models.current_version() is None:  # the built-in HF folder as version v0 (a local root)
            shutil.copytree(resolve_model_path("builtin"), self.models.version("v0"), dirs_exist_ok=True)
            self.models.promote("v0", by="online-demo", reason="the built-in model, registered by the demo")
        import os

        from gpu_jobs.online.signing import KEY_FILE_ENV, write_key_file

        # serve signs its events and the in-process consumer checks them: one key, through the
        # environment (given back at exit: a test process goes on with its own)
        self._key_env = os.environ.get(KEY_FILE_ENV)
        os.environ[KEY_FILE_ENV] = str(write_key_file(self.work / "event.key"))
        try:
            self.redis = RedisServer(self.work).start()
            self.serve = ServeProcess(self.work, self.redis.url, model_args=(
                "--model", MODEL, "--root", self.root, "--watch-s", f"{self.watch_s:g}")).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import os

        for proc in (self.serve, self.redis):
            if proc is not None:
                proc.stop()
        from gpu_jobs.online.signing import KEY_FILE_ENV

        if getattr(self, "_key_env", None) is None:
            os.environ.pop(KEY_FILE_ENV, None)
        else:
            os.environ[KEY_FILE_ENV] = self._key_env

    @property
    def url(self) -> str:
        return self.serve.base

    def state(self) -> tuple[str, str | None]:
        """(version serve answers everyone with, canary candidate or None), from GET /health."""
        import httpx

        h = httpx.get(f"{self.url}/health", timeout=10).json()
        return h["version"], (h["canary"] or {}).get("candidate")

    def wait_state(self, what: str, want, timeout_s: float) -> float:
        """Wait (bounded) until `want(state())` holds; returns time.time() then. TimeoutError
        names `what` and the state serve was in."""
        from benchmarks.chaos.serve_stack import wait_until

        try:
            wait_until(what, lambda: want(self.state()), timeout_s, self.serve, step=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; serve answers with {self.state()} (version, canary candidate)") from None
        return time.time()

    def drain(self) -> int:
        """Commit what the stream holds as feedback segments; the feedback rows committed."""
        from gpu_jobs.online.consumer import consume

        r = consume(self.root, self.redis.url, consumer="online-demo")
        if r.quarantined:
            raise RuntimeError(f"the consumer quarantined {r.quarantined} event(s): {r.reasons}")
        return r.feedback


# ------------------------------------------------------------------------------------ one cycle
def retrain_overrides(cfg: DemoConfig, reward_name: str) -> list[str]:
    """The rl-retrain run config on top of examples/grpo_arith.yaml: this file's reward, a small
    lr, the demo's sizes, no validation before training, one reward worker."""
    return [f"reward.custom_reward_function.path={Path(__file__).resolve()}",
            f"reward.custom_reward_function.name={reward_name}", f"actor.lr={cfg.lr}", f"rollout.n={cfg.rollout_n}",
            f"data.val_size={cfg.eval_size}", "trainer.val_before_train=false", "reward.num_workers=1",
            "trainer.tensorboard=false", "trainer.samples_in_artifact=2"]


def _simulate(stack: Stack, cfg: DemoConfig, requests: int, round: int):
    from gpu_jobs.online.simulate import plan_requests, simulate

    plan = plan_requests(requests, cfg.users, cfg.seed, pool=cfg.pool, round=round)
    return simulate(stack.url, plan, model=MODEL, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                    concurrency=cfg.concurrency)


def _retrain(stack: Stack, cfg: DemoConfig, reward_name: str) -> dict[str, Any]:
    from flows.online.retrain import rl_retrain

    test = {"min_samples": cfg.min_samples, "confidence": cfg.confidence, "margin": cfg.margin,
            "method": cfg.canary_method}
    # The flow's own return value, not return_state=True's state.result(): that state is the one the
    # API answered with, and once (CI, 2026-12-05) it came back Completed without its data
    # (prefect MissingResult) although the run had finished.
    try:
        return rl_retrain(model=MODEL, root=stack.root, config=str(EXAMPLE),
                          overrides=retrain_overrides(cfg, reward_name), epochs=cfg.epochs, eval_size=cfg.eval_size,
                          min_gain=cfg.min_gain, canary_share=cfg.canary_share,
                          canary_test=test if cfg.canary_share > 0 else None)
    except Exception as exc:  # noqa: BLE001 - a failed flow run raises what failed it
        raise RuntimeError(f"rl-retrain failed: {type(exc).__name__}: {exc}") from exc


def _canary_rounds(stack: Stack, cfg: DemoConfig, row: CycleRow, k: int) -> None:
    """Canary traffic and rl-canary decisions until it decides, at most cfg.canary_rounds."""
    from flows.online.canary import rl_canary, settle
    from gpu_jobs.online.canary import read_canary

    answers = []
    for r in range(1, cfg.canary_rounds + 1):
        answers += _simulate(stack, cfg, cfg.canary_requests, round=1000 * k + r).answers
        stack.drain()
        out = rl_canary(model=MODEL, root=stack.root)
        if out["status"] != "wait":
            row.decision = out["status"]
            row.notes.append(f"decided by the test at n {out['n_baseline']}/{out['n_candidate']} (baseline/candidate "
                             f"voters) in round {r}")
            break
    else:
        canary = read_canary(stack.models)
        if canary is not None:  # the test never decided in the rounds given: the baseline stays
            settle(stack.models, canary, "rollback", {"reason": f"undecided after {cfg.canary_rounds} rounds"},
                   by="online-demo")
        row.decision = "undecided"
    for arm, version in (("baseline", row.baseline), ("candidate", row.candidate)):
        scores = [a.score for a in answers if a.version == version]
        setattr(row, f"n_{arm}", len(scores))
        setattr(row, f"live_{arm}", sum(scores) / len(scores) if scores else math.nan)


def run_cycle(stack: Stack, cfg: DemoConfig, k: int) -> CycleRow:
    """Cycle `k` (see the module docstring)."""
    started = time.time()
    bad = k == cfg.bad_cycle
    baseline = stack.models.current_version()
    sim = _simulate(stack, cfg, cfg.requests, round=1000 * k)
    row = CycleRow(k, baseline, sim.mean_score(), planted_bad=bad)
    t0 = sim.first_feedback_at
    stack.drain()
    out = _retrain(stack, cfg, cfg.bad if bad else "demo_reward")
    row.candidate = out.get("run_id")
    if "new" in out:
        row.gate = (f"{'pass' if out['decision'] == 'promote' else 'refuse'} {out['new']['mean_reward']:.3f} vs "
                    f"{out['promoted_before']['mean_reward']:.3f}")
    status, cand = out["status"], row.candidate
    if status == "promoted":
        row.to_serving_s = row.to_promoted_s = stack.wait_state(
            f"serve to answer with {cand}", lambda s: s[0] == cand, cfg.max_wait_s) - t0
        row.decision = "promote"
    elif status == "canary":
        row.to_serving_s = stack.wait_state(f"serve to route canary users to {cand}", lambda s: s[1] == cand,
                                            cfg.max_wait_s) - t0
        _canary_rounds(stack, cfg, row, k)
        if row.decision == "promote":
            row.to_promoted_s = stack.wait_state(f"serve to answer everyone with {cand}", lambda s: s[0] == cand,
                                                 cfg.max_wait_s) - t0
        else:
            stack.wait_state(f"serve to retire the rolled-back {cand}", lambda s: s[1] is None, cfg.max_wait_s)
    elif status == "refused":
        row.decision = "refused"
    else:  # nothing new / nothing to train / published while another canary runs
        row.notes.append(status)
    row.serving = stack.state()[0]
    row.seconds = time.time() - started
    return row


# ------------------------------------------------------------------------------------ the report
def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def cycle_table(rows: list[CycleRow]) -> str:
    """The per-cycle table (markdown).

    >>> print(cycle_table([CycleRow(1, "v0", 0.25, candidate="retrain-demo-w1", gate="pass 0.4 vs 0.3",
    ...                             decision="promote", serving="retrain-demo-w1", to_serving_s=61.0)]))
    | cycle | baseline | live reward | candidate | gate (held-out) | live baseline / candidate (n) | decision | serving | feedback -> serving s | -> promoted s |
    |---|---|---|---|---|---|---|---|---|---|
    | 1 | v0 | 0.250 | retrain-demo-w1 | pass 0.4 vs 0.3 | - / - (0/0) | promote | retrain-demo-w1 | 61.0 | - |
    """
    head = ("| cycle | baseline | live reward | candidate | gate (held-out) | live baseline / candidate (n) | decision "
            "| serving | feedback -> serving s | -> promoted s |\n" + "|---" * 10 + "|")
    lines = [head]
    for r in rows:
        decision = r.decision + (" (planted bad: " + ("caught" if r.caught else "NOT caught") + ")"
                                 if r.planted_bad else "")
        lines.append(f"| {r.cycle} | {r.baseline} | {_f(r.live_reward)} | {r.candidate or '-'} | {r.gate or '-'} | "
                     f"{_f(r.live_baseline)} / {_f(r.live_candidate)} ({r.n_baseline}/{r.n_candidate}) | {decision} | "
                     f"{r.serving} | {_f(r.to_serving_s, 1)} | {_f(r.to_promoted_s, 1)} |")
    return "\n".join(lines)


def summary(rows: list[CycleRow]) -> dict[str, Any]:
    """The goals as measured: median feedback -> new version serving, the live reward per cycle,
    whether every planted bad candidate was caught.

    >>> s = summary([CycleRow(1, "v0", 0.2, to_serving_s=50.0), CycleRow(2, "v1", 0.3, planted_bad=True,
    ...                                                                  decision="rollback")])
    >>> s["median_to_serving_s"], s["live_reward"], s["bad_caught"]
    (50.0, [0.2, 0.3], [True])
    """
    return {"median_to_serving_s": median_or_nan([r.to_serving_s for r in rows]),
            "median_to_promoted_s": median_or_nan([r.to_promoted_s for r in rows]),
            "live_reward": [round(r.live_reward, 4) for r in rows],
            "bad_caught": [r.caught for r in rows if r.planted_bad]}


# ------------------------------------------------------------------------------------ the loop
def run_demo(cfg: DemoConfig, out=print) -> list[CycleRow]:
    """Start the stack under cfg.work (or a temporary folder), run the cycles, print each row as
    it finishes and the table at the end; returns the rows. ValueError for wrong settings."""
    import tempfile

    if (line := cfg.problem()) is not None:
        raise ValueError(line)
    work = Path(cfg.work or tempfile.mkdtemp(prefix="rlmill-online-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[CycleRow] = []
    out(f"online demo under {work}: {cfg.cycles} cycles x {cfg.requests} requests from {cfg.users} users, "
        f"canary share {cfg.canary_share:g}, bad candidate in cycle {cfg.bad_cycle or '-'} ({cfg.bad})")
    with Stack(work) as stack:
        for k in range(1, cfg.cycles + 1):
            row = run_cycle(stack, cfg, k)
            rows.append(row)
            out(f"cycle {k}: {row.baseline} live {_f(row.live_reward)} -> {row.candidate} gate {row.gate or '-'}; "
                f"arms {_f(row.live_baseline)}/{_f(row.live_candidate)} ({row.n_baseline}/{row.n_candidate}); "
                f"{row.decision}; serving {row.serving}; feedback->serving {_f(row.to_serving_s, 1)} s, "
                f"->promoted {_f(row.to_promoted_s, 1)} s; cycle {row.seconds:.0f} s")
    out(cycle_table(rows))
    out(json.dumps(summary(rows)))
    return rows


def parse(argv: list[str] | None = None) -> tuple[DemoConfig, str | None]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.online_demo", description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    for f in DemoConfig.__dataclass_fields__.values():
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name), help=f"default {getattr(defaults, f.name)!r}")
    p.add_argument("--json", default=None, help="also write the rows and the summary to this file")
    a = vars(p.parse_args(argv))
    dest = a.pop("json")
    return DemoConfig(**a), dest


def main(argv: list[str] | None = None) -> None:
    import os

    cfg, dest = parse(argv)
    if (line := cfg.problem()) is not None:
        sys.exit(f"rlmill: {line}")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the cycle lines are the output
    from flows.cli import _quiet_env

    _quiet_env()
    import torch

    torch.set_num_threads(1)
    try:
        rows = run_demo(cfg)
    except (TimeoutError, RuntimeError, FileNotFoundError) as exc:
        sys.exit(f"rlmill: online demo stopped: {' '.join(str(exc).split())}")
    if dest:
        Path(dest).write_text(json.dumps({"config": asdict(cfg), "rows": [asdict(r) for r in rows],
                                          "summary": summary(rows)}, indent=1, default=str))


if __name__ == "__main__":
    main()
