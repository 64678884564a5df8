"""Every bad dataset the data gate knows is refused before the run starts, in one `rlmill:` line
that names the file, the column or row, and the fix: a file that is not Parquet, a missing
column, a prompt of the wrong type, an empty prompt, an over-long prompt, a rule reward without
a ground truth. (A Parquet file without `prompt` used to end in a 34-line traceback marked
"unexpected", 21 s in.)

    .venv/bin/python -m pytest -q tests/data/test_bad_datasets.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"


def _row(i: int, content: str = "1+2=", **changes) -> dict:
    row = {"data_source": "rlmill/arith", "prompt": [{"role": "user", "content": content}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": i}}
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


def _write(path: Path, rows: list[dict]) -> None:
    pd.DataFrame(rows).to_parquet(path)


# case -> (write the file, words the line must hold: where the problem is, and its fix)
CASES = {
    "missing column": (lambda p: _write(p, [{**{k: v for k, v in _row(i).items() if k != "prompt"}, "question": "1+2="}
                                            for i in range(20)]),
                       ["has no 'prompt' column", "its columns: data_source", "write verl's columns"]),
    "wrong type": (lambda p: _write(p, [_row(i, prompt=i) for i in range(20)]),
                   ["row 0 (and 19 more): column 'prompt' is not a list of {role, content} messages (it holds int 0)",
                    '[{"role": "user", "content": "..."}]']),
    "empty prompt": (lambda p: _write(p, [_row(i, content="" if i == 7 else "1+2=") for i in range(20)]),
                     ["row 7: column 'prompt' is empty", "fill in the prompt or remove the row"]),
    "over-long prompt": (lambda p: _write(p, [_row(i, content="1+" * 600 + "2=" if i == 3 else "1+2=")
                                              for i in range(20)]),
                         ["row 3: the prompt renders to", "> data.max_prompt_length=64",
                          "raise data.max_prompt_length, set data.overlong_prompts=filter"]),
    "missing ground truth": (lambda p: _write(p, [_row(i, reward_model={"style": "rule", "ground_truth": None})
                                                  if i == 5 else _row(i) for i in range(20)]),
                             ["row 5: column 'reward_model' has no ground_truth", "give it one"]),
    "not parquet": (lambda p: p.write_text("data_source,prompt\nrlmill/arith,1+2=\n"),
                    ["is not a Parquet file", "give a verl-format .parquet file"]),
}


@pytest.fixture
def bad_file(tmp_path):
    def make(case: str) -> Path:
        path = tmp_path / f"{case.replace(' ', '-')}.parquet"
        CASES[case][0](path)
        return path

    return make


def _overrides(path: Path, root: Path) -> list[str]:
    return [f"root={root}", f"data.train_files=[{path}]", f"data.val_files=[{path}]", "data.max_prompt_length=64"]


@pytest.mark.parametrize("case", CASES)
def test_the_pre_start_check_names_the_file_the_place_and_the_fix(case, bad_file, tmp_path, monkeypatch):
    """What `rlmill train` runs before Prefect (flows.user_errors.check_startable), in-process."""
    from flows.config import load_run_config
    from flows.user_errors import check_startable, user_error_line

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    path = bad_file(case)
    with pytest.raises(Exception) as err:
        check_startable(load_run_config(EXAMPLE, _overrides(path, tmp_path / "root")))
    line = user_error_line(err.value)  # a user's mistake: a line, not a traceback
    assert line is not None and "\n" not in line, err.value
    assert line.startswith(f"data file {path} (data.train_files) "), line
    assert all(words in line for words in CASES[case][1]), line
    assert not (tmp_path / "root").exists()


def test_quarantine_and_filter_let_the_rows_through_as_the_run_would(bad_file, tmp_path, monkeypatch):
    """Refused only where the run refuses: gate.on_failure=quarantine sets bad rows aside and
    data.overlong_prompts=filter drops long ones, so the pre-start check lets them pass."""
    from flows.config import load_run_config
    from flows.user_errors import check_startable

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    root = tmp_path / "root"
    for case, extra in (("empty prompt", "gate.on_failure=quarantine"),
                        ("over-long prompt", "data.overlong_prompts=filter")):
        check_startable(load_run_config(EXAMPLE, [*_overrides(bad_file(case), root), extra]))


def test_the_run_itself_reports_a_missing_column_as_the_users_mistake(bad_file):
    """Inside the flow (a deployment run), reading the file raises DatasetError: one line."""
    from flows.user_errors import user_error_line
    from storage.datasets import DatasetError, read_prompts

    path = bad_file("missing column")
    with pytest.raises(DatasetError) as err:
        read_prompts([str(path)])
    assert user_error_line(err.value) == str(err.value) and "has no 'prompt' column" in str(err.value)


@pytest.mark.slow
def test_rlmill_train_prints_one_line_and_writes_nothing(bad_file, tmp_path):
    """The whole output of `rlmill train` (a new process, as a user runs it) is that one line:
    for a file read without a model (missing column) and one the tokenizer measures (over-long).
    Each process is mostly imports (~8 s of a core); every case's line is checked in-process above
    (test_the_pre_start_check_names_the_file_the_place_and_the_fix), through the same
    check_startable and user_error_line the CLI prints."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
           "RLMILL_LOCK_DIR": str(tmp_path / "locks"), "PREFECT_HOME": str(tmp_path / "prefect")}
    started = {}
    for case in ("missing column", "over-long prompt"):
        path, root = bad_file(case), tmp_path / f"root-{case.replace(' ', '-')}"
        started[case] = (path, root, subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "train", "--config", str(EXAMPLE), *_overrides(path, root)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for case, (path, root, proc) in started.items():
        output = proc.communicate(timeout=300)[0].strip()
        assert proc.returncode == 1, f"{case}: {output[-3000:]}"
        assert len(output.splitlines()) == 1, f"{case}: {output[-3000:]}"
        assert output.startswith(f"rlmill: data file {path} (data.train_files) "), f"{case}: {output}"
        assert all(words in output for words in CASES[case][1]), f"{case}: {output}"
        assert not root.exists(), f"{case}: {root} was written"
    assert not (tmp_path / "prefect").exists()  # Prefect never started
