"""The `calc3` dataset (gpu_jobs/data/calc_tasks.py): 3-digit products for the calculator
environment, generated offline, train and test disjoint, scored on the final answer's last number.

    .venv/bin/python -m pytest -q tests/data/test_calc3.py
"""

from __future__ import annotations

from gpu_jobs.data import CALC3_SOURCE, dataset_names, make_dataset
from gpu_jobs.data.calc_tasks import calc3_score, last_number
from gpu_jobs.reward import default_compute_score
from storage.datasets import read_prompts


def test_make_dataset_calc3_offline_disjoint_and_deterministic(tmp_path):
    assert "calc3" in dataset_names()
    train_url, test_url = make_dataset("calc3", str(tmp_path / "a"), train_size=64, test_size=16, seed=3)
    train, test = read_prompts([train_url]), read_prompts([test_url])
    assert len(train) == 64 and len(test) == 16
    row = train.iloc[0]
    a, b = int(row["extra_info"]["a"]), int(row["extra_info"]["b"])
    assert 100 <= a <= 999 and 100 <= b <= 999
    assert row["data_source"] == CALC3_SOURCE and row["reward_model"]["ground_truth"] == str(a * b)
    assert row["prompt"][0]["content"] == f"What is {a} times {b}? Use the calculator, then answer with only the number."
    pairs = lambda df: {(int(e["a"]), int(e["b"])) for e in df["extra_info"]}  # noqa: E731
    assert not pairs(train) & pairs(test)
    again, _ = make_dataset("calc3", str(tmp_path / "b"), train_size=64, test_size=16, seed=3)
    assert read_prompts([again]).equals(train)


def test_calc3_scores_the_final_answer_after_the_last_tool_result():
    assert last_number("1,234 then 56,088.") == 56088 and last_number("none") is None
    hermes = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>' \
             "user\n<tool_response>\n56088\n</tool_response>\nassistant\n"
    assert calc3_score(hermes + "The answer is 56088.", "56088") == 1.0
    assert calc3_score(hermes + "I am not sure.", "56088") == 0.0  # the tool's output alone earns nothing
    assert calc3_score("[calculator(123*456)]<56088>56088", "56088") == 1.0  # the brackets format
    assert default_compute_score(CALC3_SOURCE, "56088", "56088") == 1.0
