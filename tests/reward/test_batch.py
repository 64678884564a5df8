"""score_batch: users' reward files in a guarded worker pool; bad samples score on_error."""

from __future__ import annotations

import textwrap
import time

import pytest
from pydantic import ValidationError

from gpu_jobs.reward import RewardConfig, UnknownDataSourceError, load_custom_reward_function, score_batch

USER_REWARD = textwrap.dedent(
    '''
    """A verl-style reward file, as a user would write it."""
    import math, os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise RuntimeError("boom")
        if solution_str == "hang":
            time.sleep(120)
        if solution_str == "nan":
            return math.nan
        if solution_str == "str":
            return "1.0"
        if solution_str == "crash":
            os._exit(3)
        if solution_str == "dict":
            return {"score": 1.0, "acc": True, "pred": ground_truth}
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    def reordered(solution_str, ground_truth, data_source, extra_info=None):
        # verl calls by keyword, so the parameter order does not matter
        return float(solution_str == ground_truth and data_source == "my/source" and extra_info["i"] >= 0)

    def bonus_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        return min(1.0, float(solution_str == ground_truth) + bonus)
    '''
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return str(path)


def _rows(*responses, gt="5"):
    return [
        {"data_source": "my/source", "solution_str": r, "ground_truth": gt, "extra_info": {"i": i}}
        for i, r in enumerate(responses)
    ]


def test_user_file_is_loaded_from_its_path(reward_file):
    fn = load_custom_reward_function(reward_file, "compute_score")
    assert fn("my/source", "5", "5") == 1.0
    with pytest.raises(AttributeError, match=r"'nope' not found .*\['bonus_score', 'compute_score', 'reordered'\]"):
        load_custom_reward_function(reward_file, "nope")
    with pytest.raises(FileNotFoundError):
        load_custom_reward_function(reward_file + ".missing")


def test_user_file_from_object_storage(reward_file, s3_bucket_url, storage_config_s3):
    from storage import url_to_fs

    url = f"{s3_bucket_url}/code/my_reward.py"
    fs, path = url_to_fs(url, storage_config_s3)
    fs.pipe_file(path, open(reward_file, "rb").read())
    assert load_custom_reward_function(url, storage=storage_config_s3)("s", "5", "5") == 1.0


def test_bad_samples_score_on_error_and_the_batch_completes(reward_file):
    cfg = RewardConfig(custom_reward_function={"path": reward_file}, timeout_s=1.0, num_workers=2, on_error=0.0)
    rows = _rows("5", "raise", "hang", "nan", "str", "dict", "4", " 5 ", "hang")
    t0 = time.monotonic()
    scores, extra, metrics = score_batch(rows, cfg)
    elapsed = time.monotonic() - t0
    # Bounded by the work, not by this machine's speed: a pool that waited for either hang (each
    # sleeps 120 s) would take at least 120 s; timing them out costs ~timeout_s + a pool restart each.
    assert elapsed < 120, elapsed
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    kinds = [e.get("error_kind") for e in extra]
    assert kinds == [None, "exception", "timeout", "invalid", "invalid", None, None, None, "timeout"]
    assert "RuntimeError: boom" in extra[1]["error"] and "not finite" in extra[3]["error"]
    assert "not a number" in extra[4]["error"]
    assert extra[5] == {"acc": True, "pred": "5"}
    assert metrics["reward/errors"] == 5 and metrics["reward/timeouts"] == 2
    assert metrics["reward/n"] == 9 and metrics["critic/score/mean"] == pytest.approx(3 / 9)


def test_a_crashing_worker_is_isolated_and_the_rest_score(reward_file):
    cfg = RewardConfig(custom_reward_function={"path": reward_file}, timeout_s=5.0, num_workers=2)
    scores, extra, metrics = score_batch(_rows("5", "crash", "5", "4", "crash", "5"), cfg)
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert extra[1]["error_kind"] == "crash" and extra[4]["error_kind"] == "crash"
    assert metrics["reward/crashes"] == 2 and metrics["reward/errors"] == 2


def test_functions_are_called_by_keyword_like_verl(reward_file):
    cfg = RewardConfig(custom_reward_function={"path": reward_file, "name": "reordered"}, num_workers=1)
    assert score_batch(_rows("5", "4"), cfg)[0] == [1.0, 0.0]


def test_a_broken_user_file_raises_its_own_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(:\n")
    with pytest.raises(SyntaxError):
        score_batch(_rows("5"), RewardConfig(custom_reward_function={"path": str(bad)}))
    ok = tmp_path / "ok.py"
    ok.write_text("def other(*args, **kwargs):\n    return 1.0\n")
    with pytest.raises(AttributeError, match=r"'missing' not found .*\['other'\]"):
        score_batch(_rows("5"), RewardConfig(custom_reward_function={"path": str(ok), "name": "missing"}))


def test_on_error_value_and_score_range_are_applied(reward_file):
    cfg = RewardConfig(
        custom_reward_function={"path": reward_file, "name": "bonus_score", "reward_kwargs": {"bonus": 0.5}},
        on_error=-1.0, score_range=(-1.0, 1.0), timeout_s=5.0, num_workers=1,
    )
    scores, _, metrics = score_batch(_rows("5", "4"), cfg)
    assert scores == [1.0, 0.5] and metrics["reward/errors"] == 0
    narrow = cfg.model_copy(update={"score_range": (-1.0, 0.25)})
    scores, extra, metrics = score_batch(_rows("4"), narrow)
    assert scores == [-1.0] and "outside the declared score_range" in extra[0]["error"]


def test_builtin_scorers_run_in_process():
    rows = [
        {"data_source": "rlmill/arith", "solution_str": "82", "ground_truth": "82"},
        {"data_source": "openai/gsm8k", "response": "#### 7", "reward_model": {"ground_truth": "7"}},
        {"data_source": "rlmill/arith", "solution_str": "81", "ground_truth": "82", "extra_info": '{"a": 40}'},
    ]
    scores, extra, metrics = score_batch(rows, RewardConfig())
    assert scores == [1.0, 1.0, 0.0] and extra == [{}, {}, {}]
    assert metrics["reward/errors"] == 0 and metrics["critic/score/max"] == 1.0
    assert metrics["reward/pool_restarts"] == 0
    with pytest.raises(UnknownDataSourceError, match="my/source"):
        score_batch(_rows("5"), RewardConfig())


def test_score_batch_accepts_a_dataframe_and_an_empty_batch():
    import pandas as pd

    df = pd.DataFrame([{"data_source": "rlmill/arith", "solution_str": "3", "ground_truth": "3"}])
    assert score_batch(df, RewardConfig())[0] == [1.0]
    scores, extra, metrics = score_batch([], RewardConfig())
    assert scores == [] and metrics["reward/n"] == 0


def test_config_checks_on_error_against_the_range():
    with pytest.raises(ValidationError, match="on_error=-1.0 lies outside score_range"):
        RewardConfig(on_error=-1.0, score_range=(0.0, 1.0))
    assert RewardConfig(on_error=-1.0).score_range is None  # no range unless one is declared
    with pytest.raises(ValidationError):
        RewardConfig(timeout_s=0)
    assert RewardConfig(score_range=None, on_error=-5.0).on_error == -5.0
    for name, field in RewardConfig.model_fields.items():
        assert field.description, name
