"""Built-in rule scorers and routing by data_source, on hand-checked cases."""

from __future__ import annotations

import json

import pytest

from gpu_jobs.reward import (
    UnknownDataSourceError,
    default_compute_score,
    gsm8k_extract,
    gsm8k_score,
    math_score,
    register_reward_fn,
)
from gpu_jobs.reward.rules import last_boxed_only_string, normalize_math_answer, remove_boxed


# ---------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize(
    "text,strict,flexible",
    [
        ("Janet has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18", "18"),
        ("The total is $1,234.\n#### 1,234", "1234", "1234"),  # commas dropped
        ("#### -5", "-5", "-5"),
        ("so the answer is 42.", None, "42."),  # no "####": strict finds nothing, flexible the last number
        ("#### 3 and later 7", "3", "7"),
        ("no numbers here", None, None),
    ],
)
def test_gsm8k_extract_strict_and_flexible(text, strict, flexible):
    assert gsm8k_extract(text, "strict") == strict
    assert gsm8k_extract(text, "flexible") == flexible


def test_gsm8k_score():
    assert gsm8k_score("... #### 18", "18") == 1.0
    assert gsm8k_score("... #### 17", "18") == 0.0  # wrong answer: format_score 0
    assert gsm8k_score("... #### 17", "18", format_score=0.1) == 0.1
    assert gsm8k_score("the answer is 18", "18") == 0.0  # strict needs "####"
    assert gsm8k_score("the answer is 18", "18", method="flexible") == 1.0
    assert gsm8k_score("x" * 1000 + "#### 18", "18") == 1.0  # only the tail is searched
    with pytest.raises(ValueError):
        gsm8k_extract("#### 1", "loose")


# ---------------------------------------------------------------------------------- boxed math
def test_last_boxed_handles_nesting_and_variants():
    text = r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}} done"
    assert last_boxed_only_string(text) == r"\boxed{\frac{1}{\sqrt{2}}}"
    assert remove_boxed(last_boxed_only_string(text)) == r"\frac{1}{\sqrt{2}}"
    assert remove_boxed(last_boxed_only_string(r"so $\boxed 5$.")) == "5"
    assert remove_boxed(last_boxed_only_string(r"\fbox{7}")) == "7"
    assert last_boxed_only_string(r"\boxed{unclosed") is None
    assert last_boxed_only_string("no box") is None


@pytest.mark.parametrize(
    "a,b",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("1/2", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\left( 3, 4 \right)", "(3,4)"),
        (".5", "0.5"),
        ("2.0", "2"),
        (r"90^\circ", "90"),
        (r"10\text{ cm}", "10"),
        ("x = 3", "3"),
        (r"\$5", "5"),
        ("1,000", "1000"),
    ],
)
def test_normalisation_makes_equal_answers_equal(a, b):
    assert normalize_math_answer(a) == normalize_math_answer(b)


def test_math_score():
    assert math_score(r"We get $\boxed{\dfrac{1}{2}}$.", "1/2") == 1.0
    assert math_score(r"We get $\boxed{\frac{1}{3}}$.", r"\frac{1}{2}") == 0.0
    assert math_score(r"\boxed{3} wait no \boxed{4}", "4") == 1.0  # the last box counts
    assert math_score("The answer is 4", "4") == 0.0  # no box, no reward
    assert math_score(r"\boxed{4}", r"the answer \boxed{4}") == 1.0  # boxed ground truth


# ---------------------------------------------------------------------------------- routing
def test_routes_verl_and_rlmill_data_sources():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("lighteval/MATH", r"\boxed{2}", "2") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", r"\boxed{2}", "3") == 0.0
    assert default_compute_score("rlmill/arith", " 82\n", "82") == 1.0
    assert default_compute_score("rlmill/arith", "821", "82") == 0.0
    assert isinstance(default_compute_score("rlmill/arith", "82", "82"), float)


def test_unknown_data_source_lists_known_ones():
    known = r"no reward function for data_source='my/data'.*openai/gsm8k.*reasoning_gym/<task>"
    with pytest.raises(UnknownDataSourceError, match=known):
        default_compute_score("my/data", "x", "y")
    with pytest.raises(NotImplementedError):  # what verl raises, so verl-style handlers still work
        default_compute_score("my/data", "x", "y")


def test_registering_a_data_source_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("openai/gsm8k")(lambda *a: 0.0)


def test_reasoning_gym_rows_score_with_their_task(tmp_path):
    from storage.datasets import read_prompts
    from gpu_jobs.data import make_dataset

    train_url, _ = make_dataset("gsm_symbolic", str(tmp_path), train_size=3, test_size=1, seed=0)
    for row in read_prompts(train_url).to_dict("records"):
        gt = row["reward_model"]["ground_truth"]
        args = (row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"])
        assert default_compute_score(args[0], f"<answer>{gt}</answer>", gt, args[2]) == 1.0
        assert default_compute_score(args[0], gt, gt, args[2]) == 1.0
        assert default_compute_score(args[0], "<answer>-123456</answer>", gt, args[2]) < 1.0
        # extra_info may arrive as a JSON string (the sample table stores it that way)
        assert default_compute_score(args[0], gt, gt, json.dumps(args[2])) == 1.0


def test_reasoning_gym_without_stored_entry_uses_the_ground_truth():
    assert default_compute_score("reasoning_gym/gsm_symbolic", "<answer>12</answer>", "12") == 1.0


@pytest.mark.parametrize("task", ["arc_agi", "countdown", "chain_sum"])
def test_reasoning_gym_entries_survive_parquet_for_scoring(task, tmp_path):
    # arc_agi keeps its boards as tuples in the metadata: they must come back as tuples
    from storage.datasets import read_prompts
    from gpu_jobs.data import make_dataset

    train_url, _ = make_dataset(f"rg:{task}", str(tmp_path), train_size=2, test_size=0, seed=1)
    for row in read_prompts(train_url).to_dict("records"):
        gt = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], gt, gt, row["extra_info"]) == 1.0


def test_times_scores_the_last_number_of_the_answer():
    from gpu_jobs.reward import default_compute_score

    for answer, score in [("56", 1.0), ("7 x 8 = 56", 1.0), ("It is 56.", 1.0), ("8 x 7 = 54", 0.0),
                          ("56 or 54", 0.0), ("To solve this we multiply", 0.0), ("1,056", 0.0), ("", 0.0)]:
        assert default_compute_score("rlmill/times", answer, "56") == score, answer
    assert default_compute_score("rlmill/times", "1,056", "1056") == 1.0
