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


# ----------------------------------------------------------------------------- user mistakes
def _refused(argv, capsys=None) -> str:
    """main(argv) must exit with one `rlmill: ...` message (SystemExit carrying the text)."""
    with pytest.raises(SystemExit) as err:
        main(argv)
    message = err.value.code
    assert isinstance(message, str) and message.startswith("rlmill: "), message
    return message


def test_data_make_defaults_work_for_arith(tmp_path, capsys):
    from storage.datasets import read_prompts

    main(["data", "make", "arith", "--out", str(tmp_path / "arith")])
    train = read_prompts(str(tmp_path / "arith" / "train.parquet"))
    test = read_prompts(str(tmp_path / "arith" / "test.parquet"))
    assert (len(train), len(test)) == (7100, 1000)  # all 8100 distinct prompts, none shared
    prompts = lambda df: {m[0]["content"] for m in df["prompt"]}  # noqa: E731
    assert not prompts(train) & prompts(test)
    main(["data", "make", "arith", "--out", str(tmp_path / "some"), "--train-size", "8000"])
    assert len(read_prompts(str(tmp_path / "some" / "test.parquet"))) == 100  # what is left


@pytest.mark.parametrize("sizes, words", [
    (["--train-size", "20000"], "--train-size 20000"),
    (["--train-size", "8000", "--test-size", "1000"], "= 9000"),
    (["--test-size", "9000"], "--test-size 9000"),
])
def test_data_make_too_large_is_one_line_before_any_write(sizes, words, tmp_path):
    message = _refused(["data", "make", "arith", "--out", str(tmp_path / "d"), *sizes])
    assert "arith has only 8100 distinct prompts" in message and words in message
    assert "leave them out" in message or "leave the sizes out" in message
    assert "\n" not in message and not (tmp_path / "d").exists()


def test_data_make_unknown_names_are_refused(tmp_path):
    assert "unknown dataset 'arithm'" in _refused(["data", "make", "arithm", "--out", str(tmp_path / "d")])
    assert "did you mean rg:countdown" in _refused(["data", "make", "rg:countdwn", "--out", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()


def test_data_make_negative_size_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["data", "make", "arith", "--out", str(tmp_path / "d"), "--test-size", "-1"])
    assert err.value.code == 2 and "-1 is negative" in capsys.readouterr().err


def test_verify_names_a_missing_run_and_the_runs_there(example_path, tmp_path):
    from storage import RunLayout

    root = str(tmp_path / "root")
    RunLayout(root, "my-run").write_run_json({"run_uid": "u", "config": {}})
    message = _refused(["verify", "--config", str(example_path), f"root={root}", "run_id=my-rn"])
    assert f"no run 'my-rn' under {root}; runs there: my-run" in message
    assert "intact" not in message
    assert "runs there: none" in _refused(["verify", "--config", str(example_path), f"root={tmp_path / 'empty'}"])


def _frozen_run(tiny_config, root):
    from flows.config import frozen_config
    from storage import RunLayout

    cfg = tiny_config(root=root)
    RunLayout(cfg.root, cfg.run_id).write_run_json({"run_uid": "u", "config": frozen_config(cfg)})
    return cfg


def test_train_refuses_a_reused_run_id_with_another_config_before_prefect_starts(
        example_path, tiny, tiny_config, tmp_path, monkeypatch):
    import flows.cli as cli

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: pytest.fail("Prefect started"))
    root = str(tmp_path / "root")
    cfg = _frozen_run(tiny_config, root)
    cli._check_startable(cfg)  # the same config resumes
    cli._check_startable(tiny_config("trainer.total_iterations=50", root=root))  # so does a longer run
    message = _refused(["train", "--config", str(example_path), *tiny(root, "rollout.n=2")])
    assert f"run '{cfg.run_id}' already exists" in message and "(rollout.n)" in message


def test_train_refuses_missing_data_files_and_model_folders(example_path, tiny, tmp_path, monkeypatch):
    import flows.cli as cli

    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: pytest.fail("Prefect started"))
    root = str(tmp_path / "root")
    missing = tmp_path / "nope" / "train.parquet"
    message = _refused(["train", "--config", str(example_path), *tiny(root, f"data.train_files=[{missing}]")])
    assert f"data file {missing} (data.train_files) does not exist" in message and "rlmill data make" in message
    message = _refused(["train", "--config", str(example_path), *tiny(root, f"model.path={tmp_path / 'model'}")])
    assert "model.path" in message and "is not a folder" in message
    assert not (tmp_path / "root").exists()


def test_train_refuses_a_run_another_process_holds(example_path, tiny, tmp_path, monkeypatch):
    import flows.cli as cli
    from flows.run_lock import RunLock

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: pytest.fail("Prefect started"))
    root = str(tmp_path / "root")
    # flock is per open file: a second RunLock in this process conflicts like another process.
    with RunLock(root, "grpo-arith"):
        message = _refused(["train", "--config", str(example_path), *tiny(root)])
    assert "already being trained by pid" in message


def test_genuine_bugs_keep_their_traceback(monkeypatch, example_path):
    import flows.cli as cli

    def broken(args):
        raise ValueError("a bug, not the user's input")

    monkeypatch.setattr(cli, "cmd_config_show", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["config", "show", "--config", str(example_path)])


def test_the_ephemeral_server_is_started_only_without_an_api_url(monkeypatch):
    import flows.cli as cli
    from prefect.settings import PREFECT_API_URL, temporary_settings

    started = []
    import prefect.server.api.server as srv

    monkeypatch.setattr(srv.SubprocessASGIServer, "start", lambda self, timeout=None: started.append(self))
    monkeypatch.setattr(srv, "subprocess", srv.subprocess)  # put back after the test
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        cli._start_ephemeral_api()
    assert started == []
    with temporary_settings(updates={PREFECT_API_URL: None}):
        cli._start_ephemeral_api()
    assert len(started) == 1 and isinstance(srv.subprocess, cli._SubprocessDyingWithParent)
    assert srv.subprocess.TimeoutExpired is __import__("subprocess").TimeoutExpired  # the rest is untouched


def test_overrides_may_follow_options(example_path, capsys):
    main(["config", "show", "--config", str(example_path), "rollout.n=3", "--config", str(example_path), "rollout.n=5"])
    assert "n: 5" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["config", "show", "--bogus"])
    assert err.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
