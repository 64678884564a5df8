"""The rlmill command line (in-process: argument parsing and the cheap commands)."""

import pytest

from flows.cli import main


def test_data_make_writes_verl_files(tmp_path, capsys):
    from storage.datasets import read_prompts

    main(["data", "make", "arith", "--out", str(tmp_path / "arith"), "--train-size", "50", "--test-size", "20"])
    out = capsys.readouterr().out
    assert "train.parquet" in out and "test.parquet" in out
    train = read_prompts(str(tmp_path / "arith" / "train.parquet"))
    assert len(train) == 50 and set(train.columns) >= {"data_source", "prompt", "reward_model"}


def test_config_show_prints_every_key_with_overrides(example_path, capsys):
    main(["config", "show", "--config", str(example_path), "rollout.n=3"])
    out = capsys.readouterr().out
    assert "n: 3" in out and "adv_estimator: grpo" in out and "ppo_mini_batch_size" in out


def test_bad_config_exits_with_the_key_named_before_any_work(example_path, tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(example_path), f"root={tmp_path}", "rollout.nn=4"])
    assert "rollout.nn: unknown key" in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written
