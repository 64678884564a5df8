"""Retrain on arrival (flows/online/retrain.py, gpu_jobs/online/windows.py): the window is taken exactly once (a
second claim finds nothing new, a retry finds its own window, two racing writers get one window,
a crashed run's window is the next run's), the readiness rule, the reward refusal, and one tiny
rl-retrain flow run on feedback segments committed by the real consumer (redis-server).

    .venv/bin/python -m pytest -q tests/flows/test_retrain.py
"""

from __future__ import annotations

import threading
import time

import pytest

from storage import ModelLayout
from gpu_jobs.online.windows import Piece, WindowLog, backlog, readiness


def _log(root) -> WindowLog:
    return WindowLog(ModelLayout(root.url, "arith", root.storage))


def _run_id(seq: int) -> str:
    return f"retrain-arith-w{seq}"


# ------------------------------------------------------------------------------------ the window
def test_window_exactly_once_and_resume(storage_root):
    log = _log(storage_root)
    assert log.claim([], _run_id) is None and log.pending() is None  # empty: nothing new
    first = [Piece("seg/a", {"answers": 2, "feedback": 3}, 100.0), Piece("seg/b", {"feedback": 1}, 110.0)]
    w1 = log.claim(first, _run_id)
    assert (w1.seq, w1.run_id, w1.uris, w1.rows("feedback")) == (1, "retrain-arith-w1", ["seg/a", "seg/b"], 4)
    assert log.claim(first, _run_id) is None  # the trigger fired twice: nothing new
    # A retry or resume of the run finds its own window, read back from storage, not recomputed.
    again = _log(storage_root).find("retrain-arith-w1")
    assert (again.seq, again.pieces) == (1, w1.pieces)
    assert log.pending() == again  # not finished: the next run resumes it
    later = first + [Piece("seg/c", {"feedback": 5}, 120.0)]
    w2 = log.claim(later, _run_id)
    assert (w2.seq, w2.uris) == (2, ["seg/c"])  # only what no window holds
    assert log.finish(w1, {"decision": "promote"})["decision"] == "promote"
    assert log.finish(w1, {"decision": "refuse"})["decision"] == "promote"  # a retry keeps the first record
    assert log.pending().seq == 2
    log.finish(w2, {"decision": "refuse"})
    assert log.pending() is None and set(log.done()) == {1, 2}
    held = [u for w in log.windows() for u in w.uris]
    assert sorted(held) == ["seg/a", "seg/b", "seg/c"]  # every piece in exactly one window


class _Racing(WindowLog):
    """A claimer that reads the windows, then waits at `barrier` (both claimers have read the
    same listing) before writing: the race the create-only write settles."""

    def __init__(self, models, barrier: threading.Barrier):
        super().__init__(models)
        self.barrier, self.reads = barrier, 0

    def read(self):
        out = super().read()
        self.reads += 1
        if self.reads == 1:
            self.barrier.wait(timeout=30)  # raises BrokenBarrierError if the other claimer never reads
        return out


def test_two_writers_race_for_one_seq(tmp_path):
    models = ModelLayout(str(tmp_path), "arith")
    barrier = threading.Barrier(2)
    pieces = [Piece("seg/a", {"feedback": 3}, 1.0)]
    claimers = [_Racing(models, barrier), _Racing(models, barrier)]
    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, claimers[i].claim(pieces, _run_id)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a claimer never finished"
    winners = [w for w in got if w is not None]
    assert len(winners) == 1 and winners[0].seq == 1  # one won the write, the other found nothing new
    loser = claimers[got.index(None)]
    assert loser.reads == 2  # it re-read after losing the create-only write
    assert [w.seq for w in WindowLog(models).windows()] == [1]


# ------------------------------------------------------------------------------------ readiness
@pytest.mark.parametrize("rows,age,ready,why", [
    (0, None, False, "nothing waits"),
    (255, 299.0, False, "255 of 256 rows, oldest 299 s of 300 s: not yet"),
    (256, 1.0, True, "256 rows >= 256"),            # enough rows, however young
    (1, 300.0, True, "1 rows, the oldest waiting 300 s >= 300 s"),  # few rows, but old enough
])
def test_readiness_rule(rows, age, ready, why):
    r = readiness(rows, age, 256, 300.0)
    assert (r.ready, r.reason) == (ready, why)


def test_backlog_counts_unheld_and_unfinished(tmp_path):
    models = ModelLayout(str(tmp_path), "arith")
    log = WindowLog(models)
    a, b = Piece("seg/a", {"feedback": 3}, 100.0), Piece("seg/b", {"answers": 4, "feedback": 0}, 50.0)
    assert backlog(log, [a, b], "feedback", now=130.0) == (3, 30.0)  # b has no feedback: not waiting
    w = log.claim([a, b], _run_id)
    assert backlog(log, [a, b], "feedback", now=130.0) == (3, 30.0)  # claimed, not finished: still owed
    log.finish(w, {})
    assert backlog(log, [a, b], "feedback", now=130.0) == (0, None)


# ------------------------------------------------------------------------------------ checks
def test_reward_refused_without_a_function(tiny_config, tmp_path):
    from flows.online.retrain import check_reward

    line = check_reward(tiny_config())
    assert "reward.custom_reward_function.path" in line and "ground truth" in line
    assert check_reward(tiny_config("reward_model.enable=true")) is None  # combine=rm_only: the model's score alone
    assert "combine=add adds the rule score" in check_reward(tiny_config("reward_model.enable=true",
                                                                          "reward_model.combine=add"))
    custom = tmp_path / "r.py"
    custom.write_text("def compute_score(*a, **k):\n    return 0.0\n")
    assert check_reward(tiny_config(f"reward.custom_reward_function.path={custom}")) is None


def test_under_rm_only_rows_no_rule_scores_get_nan_not_an_error(tiny_config):
    """A feedback row (data_source rlmill/feedback/arith) has no rule scorer: with a reward model
    alone it is logged as NaN; an arith row beside it is still rule-scored; without rm_only the
    unknown source is the configuration error it always was."""
    import math

    from gpu_jobs.data.generators import ARITH_SOURCE
    from gpu_jobs.reward.registry import UnknownDataSourceError
    from gpu_jobs.stages.iteration import rule_scores

    rows = [{"data_source": "rlmill/feedback/arith", "solution_str": "5", "ground_truth": "5"},
            {"data_source": ARITH_SOURCE, "solution_str": "5", "ground_truth": "5"}]
    cfg = tiny_config("reward_model.enable=true")
    scores, extras, metrics = rule_scores(rows, cfg, rm_only=True)
    assert math.isnan(scores[0]) and scores[1] == 1.0 and extras[0] == {} and metrics["reward/n"] == 1.0
    with pytest.raises(UnknownDataSourceError, match="rlmill/feedback/arith"):
        rule_scores(rows, cfg, rm_only=False)


# ------------------------------------------------------------------------------------ the flow
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Needs no ground truth: 1 for an answer made of digits only.
    return 1.0 if solution_str.strip().isdigit() else 0.0
'''


def _answer(prompt: str, text: str) -> dict:
    """An answer event of model arith (version v0): one chat prompt, one choice `text`."""
    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.events import answer_event

    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version="v0",
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": prompt}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": text, "token_ids": [7], "logprobs": [-0.5],
                                                     "finish_reason": "stop"}], sampling={"temperature": 1.0})


def _commit_feedback(root: str, tmp_path, n: int) -> None:
    """n answers to arithmetic prompts and a thumbs-up for each, through redis and the consumer."""
    import redis

    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.events import encode, feedback_event
    from tests.serve.conftest import redis_server

    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        for i in range(n):
            a = _answer(f"{10 + i}+{20 + i}=", str(30 + 2 * i))
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model="arith", version="v0", thumbs="up")))
        result = consume(root, url)
        assert result.feedback == n and result.quarantined == 0, result


def test_a_window_carries_only_its_own_ratings(tmp_path):
    """An answer rated in segment 1 and again in segment 2: the window holding segment 2 trains it
    with the second rating only (training_rows(feedback_from=...)); all history has both."""
    import redis

    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.dataset import training_rows
    from gpu_jobs.online.events import encode, feedback_event
    from flows.online.retrain import feedback_pieces, window_rows
    from gpu_jobs.online.windows import Window
    from tests.serve.conftest import redis_server

    root = str(tmp_path / "root")
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        ids = []
        for i in range(2):
            a = _answer(f"1+{i}=", str(1 + i))
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model="arith", version="v0", thumbs="up")))
            ids.append(a["answer_id"])
        assert consume(root, url).feedback == 2
        r.xadd(STREAM, encode(feedback_event(ids[0], model="arith", version="v0", thumbs="down")))
        assert consume(root, url).feedback == 1
    pieces = feedback_pieces(root, "arith")
    assert len(pieces) == 2
    second = window_rows(root, "arith", Window(2, "retrain-arith-w2", (pieces[1],)))
    assert [(r["extra_info"]["answer_id"], r["extra_info"]["thumbs"]) for r in second] == [(ids[0], ["down"])]
    first = window_rows(root, "arith", Window(1, "retrain-arith-w1", (pieces[0],)))
    assert sorted(r["extra_info"]["thumbs"] == ["up"] for r in first) == [True, True]
    both = {r["extra_info"]["answer_id"]: r["extra_info"]["thumbs"] for r in training_rows(root, "arith")}
    assert both[ids[0]] == ["down"]  # anonymous rows count once per answer: the latest (signals.one_vote_each)


def test_rl_retrain_trains_the_pending_window_once(tiny, example_path, tmp_path):
    from flows.online.retrain import open_window, rl_retrain, window_readiness, window_rows

    root = str(tmp_path / "root")
    _commit_feedback(root, tmp_path, 8)
    assert window_readiness(root, "arith", 8, 300.0).ready
    assert not window_readiness(root, "arith", 9, 300.0).ready
    kw = dict(model="arith", root=root, config=str(example_path), eval_size=8, min_gain=-1.0)

    # A wrong reward is refused before any window is taken.
    state = rl_retrain(**kw, overrides=tiny(root), return_state=True)
    assert state.is_failed() and state.message.startswith("reward: the built-in rule scorers")
    assert WindowLog(ModelLayout(root, "arith")).windows() == []
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # so the automatic resume leaves it
        assert "input-error" in client.read_flow_run(state.state_details.flow_run_id).tags

    state = rl_retrain(**kw, overrides=tiny(root), run_id="retrain-arith-w7", return_state=True)
    assert state.is_failed() and state.message.startswith("reward:")  # the reward is checked first
    custom = f"reward.custom_reward_function.path={example_path.parent / 'custom_reward.py'}"
    state = rl_retrain(**kw, overrides=tiny(root, custom), run_id="retrain-arith-w7", return_state=True)
    assert state.is_failed() and "no feedback window of 'arith' is trained by that run" in state.message
    state = rl_retrain(**kw, overrides=tiny(root), epochs=0, return_state=True)
    assert state.is_failed() and state.message == "epochs=0: give the passes over the window (an int >= 1)"

    # A run that took window 1 and crashed: the next run trains that window under its run id.
    crashed = open_window.fn(root, "arith", None, None)
    assert crashed.run_id == "retrain-arith-w1" and len(window_rows(root, "arith", crashed)) == 8
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    # The held-out set is 8 rows both for the run's own validation and for the gate's two scores.
    overrides = tiny(root, f"reward.custom_reward_function.path={reward}", "trainer.val_before_train=false",
                     "reward.num_workers=1", "data.val_size=8")
    out = rl_retrain(**kw, overrides=overrides)
    assert out["status"] == "promoted" and out["run_id"] == "retrain-arith-w1" and out["rows"] == 8
    assert out["segments"] == crashed.uris
    models = ModelLayout(root, "arith")
    assert models.current_version() == "retrain-arith-w1" and models.history()[-1]["by"] == "retrain"
    assert out["new"]["n"] == out["promoted_before"]["n"] == 8
    assert WindowLog(models).done()[1]["decision"] == "promote"
    assert not window_readiness(root, "arith", 1, 0.0).ready  # everything trained: nothing waits

    # The trigger fires again: nothing new, Completed.
    assert rl_retrain(**kw, overrides=overrides) == {"status": "nothing new", "model": "arith"}


def test_ready_event_and_docstring_examples(tmp_path):
    import doctest

    import flows.online.replay
    import flows.online.retrain
    import gpu_jobs.online.windows
    from flows.online.feedback import READY_EVENT, feedback_models, ready_event

    for module in (gpu_jobs.online.windows, flows.online.retrain, flows.online.replay):
        assert doctest.testmod(module).failed == 0, module.__name__
    (tmp_path / "feedback" / "_quarantine").mkdir(parents=True)  # no model name: never announced
    (tmp_path / "feedback" / "arith").mkdir()
    assert feedback_models(str(tmp_path)) == ["arith"] and feedback_models(str(tmp_path / "none")) == []
    e = ready_event("arith", str(tmp_path), readiness(3, 400.0, 256, 300.0))
    assert e["event"] == READY_EVENT and e["resource"]["prefect.resource.id"] == "rlmill.model.arith"
    # What the deployment trigger's parameters read: {{ event.payload.model }} and {{ event.payload.root }}.
    assert e["payload"] == {"model": "arith", "root": str(tmp_path), "rows": 3, "oldest_age_s": 400.0,
                            "reason": "3 rows, the oldest waiting 400 s >= 300 s"}


def test_a_kto_retrain_trains_the_windows_thumbs(tiny, tmp_path):
    """A config with a `preference:` section (examples/kto_feedback.yaml): the window's thumbs
    become KTO examples (up = desirable), a quarter held out for val/acc, no reward needed; the
    candidate goes through the same gate and promotion."""
    import pyarrow.parquet as pq
    import redis

    from flows.online.retrain import rl_retrain
    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.events import encode, feedback_event
    from tests.serve.conftest import redis_server
    from tests.tiny import REPO

    root = str(tmp_path / "root")
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        for i in range(16):  # right sums thumbed up, wrong ones down
            right = i % 2 == 0
            a = _answer(f"{10 + i}+{20 + i}=", str(30 + 2 * i + (0 if right else 7)))
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model="arith", version="v0",
                                                 thumbs="up" if right else "down")))
        assert consume(root, url).feedback == 16
    overrides = tiny(root, "actor.ppo_micro_batch_size_per_gpu=4", "trainer.val_before_train=false",
                     "data.val_size=8")
    out = rl_retrain(model="arith", root=root, config=str(REPO / "examples" / "kto_feedback.yaml"),
                     overrides=overrides, eval_size=8, min_gain=-1.0)
    assert out["status"] == "promoted" and out["rows"] == 16, out
    window_file = tmp_path / "root" / "models" / "arith" / "retrain" / out["run_id"] / "window.parquet"
    table = pq.read_table(window_file)
    assert table.column_names == ["prompt", "completion", "label"]
    assert sorted(table.column("label").to_pylist()) == [False] * 8 + [True] * 8
    assert 0.0 <= out["run"]["val/acc after"] <= 1.0  # the run validated on its 4 held-out examples
    assert ModelLayout(root, "arith").current_version() == out["run_id"]


def test_replay_adds_older_windows_and_cold_start_rows_by_share(tmp_path):
    """Window 2 with replay {feedback: 0.5, cold_start: 1.0}: its own 4 rows, 2 of window 1's 6
    (seeded: the same 2 on a retry) and 4 cold-start rows; refusals are one line each."""
    from flows.online.retrain import check_replay, open_window, write_window_rows
    from gpu_jobs.data.generators import arith_pairs, arith_row
    from storage.datasets import read_prompts, write_prompts

    root = str(tmp_path / "root")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _commit_feedback(root, tmp_path / "a", 6)
    first = open_window.fn(root, "arith", None, None)
    _commit_feedback(root, tmp_path / "b", 4)
    WindowLog(ModelLayout(root, "arith")).finish(first, {"decision": "promote"})  # window 1 trained
    second = open_window.fn(root, "arith", None, None)
    assert (first.seq, second.seq) == (1, 2)
    cold = write_prompts([arith_row(a, b, "train", i) for i, (a, b) in enumerate(arith_pairs(20, 3))],
                         str(tmp_path / "cold.parquet"))
    replay = {"feedback": 0.5, "cold_start": 1.0, "cold_start_files": [cold]}
    dest = str(tmp_path / "w2.parquet")
    assert write_window_rows.fn(root, "arith", second, dest, None, None, replay) == 4 + 2 + 4
    rows = read_prompts([dest])
    sources = rows["data_source"].tolist()
    assert sources.count("rlmill/feedback/arith") == 6 and len(sources) - 6 == 4  # 4 own + 2 replayed; 4 cold
    own = {p[0]["content"] for p in rows["prompt"][:4]}
    assert own == {f"{10 + i}+{20 + i}=" for i in range(4)}  # window 2's own answers first
    again = str(tmp_path / "again.parquet")
    write_window_rows.fn(root, "arith", second, again, None, None, replay)
    assert read_prompts([again])["prompt"].tolist() == rows["prompt"].tolist()  # seeded by the window
    assert check_replay({"cold_start": 0.5}).startswith("replay['cold_start'] needs replay['cold_start_files']")
    assert check_replay({"feedbak": 0.5}).startswith("replay={'feedbak': 0.5}: give the rows replayed")
    assert check_replay({"feedback": -1}) == \
        "replay['feedback']=-1: a share between 0 and 10 (rows replayed per window row)"
