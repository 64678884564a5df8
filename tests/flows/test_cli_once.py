"""One decision per command: `rlmill train` and `rlmill run` validate the run config once and
decide the run id once, from the command line to the rl-training flow's start of training, and
check that the run can start once (before Prefect starts); a deployment run (the flow's plain
parameters) validates its parameters and checks the run once too.

Measured by counting calls of the validating function (gpu_jobs.stages.config.build_run_config,
which flows.config.load_run_config calls), of the run-id rule (flows.config.decide_run_id) and
of the start check (flows.user_errors.check_startable, which reads every data file), wrapped, not
replaced. The flow runs as its plain function (rl_training.fn: no Prefect API) and
stops where training would start (_train), which records the config it got.

    .venv/bin/python -m pytest -q tests/flows/test_cli_once.py
"""

from __future__ import annotations

import pytest

from flows.cli import main


class Counted:
    """``fn`` wrapped: calls pass through and are counted."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """(validations, run-id decisions, configs _train got, start checks); the CLI runs the flow
    in-process."""
    import flows.cli as cli
    import flows.config as config
    import flows.training as training
    import flows.user_errors as user_errors

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    validate, decide = Counted(config.build_run_config), Counted(config.decide_run_id)
    monkeypatch.setattr(config, "build_run_config", validate)  # what load_run_config calls
    monkeypatch.setattr(config, "decide_run_id", decide)  # what the CLI and the flow call
    checks = Counted(user_errors.check_startable)
    monkeypatch.setattr(cli, "_check_startable", checks)  # the CLI's
    monkeypatch.setattr(user_errors, "check_startable", checks)  # the flow imports it when it runs
    monkeypatch.setattr(cli, "_start_ephemeral_api", lambda: None)
    monkeypatch.setattr(training, "rl_training", training.rl_training.fn)  # the flow's body, without Prefect
    trained = []

    def train(cfg, logger):
        trained.append(cfg)
        return {"run_id": cfg.run_id, "val/acc before": 0.4, "val/acc after": 0.5, "iterations": 1,
                "train seconds (this process)": 1.0, "curves": "x.png", "val_curve": []}

    monkeypatch.setattr(training, "_train", train)
    return validate, decide, trained, checks


def test_train_validates_once_and_decides_the_run_id_once(example_path, tiny, tmp_path, counted, capsys):
    validate, decide, trained, checks = counted
    main(["train", "--config", str(example_path), *tiny(str(tmp_path / "root"))])
    assert (validate.calls, decide.calls, len(trained), checks.calls) == (1, 1, 1, 1)
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    assert first == f"rlmill: new run {trained[0].run_id}; to resume it, run the same command with " \
                    f"run_id={trained[0].run_id}"  # the id the CLI printed is the one the flow trains
    main(["train", "--config", str(example_path), *tiny(str(tmp_path / "root")), f"run_id={trained[0].run_id}"])
    assert (validate.calls, decide.calls, trained[1].run_id, checks.calls) == (2, 2, trained[0].run_id, 2)


def test_run_validates_once_and_decides_the_run_id_once(tmp_path, counted):
    validate, decide, trained, checks = counted
    main(["run", f"root={tmp_path / 'root'}", "trainer.total_iterations=1"])
    assert (validate.calls, decide.calls, len(trained), checks.calls) == (1, 1, 1, 1)
    assert trained[0].run_id.startswith("grpo-arith-") and trained[0].trainer.total_iterations == 1


def test_a_deployment_run_validates_its_parameters_once(example_path, tiny, tmp_path, counted):
    """No CLI before it: the flow validates its plain parameters itself, once, and decides the id once."""
    import flows.training as training

    validate, decide, trained, checks = counted
    training.rl_training(config=str(example_path), overrides=tiny(str(tmp_path / "root")), iterations=2)
    assert (validate.calls, decide.calls, checks.calls) == (1, 1, 1)
    assert trained[0].trainer.total_iterations == 2 and trained[0].run_id.startswith("grpo-arith-")


def test_a_bad_value_is_still_one_line_from_the_one_validation(example_path, tmp_path, counted):
    validate, decide, trained, checks = counted
    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(example_path), f"root={tmp_path}", "actor.lr=0"])
    assert str(err.value.code).startswith("rlmill: invalid run config") and "actor.lr" in str(err.value.code)
    assert (validate.calls, decide.calls, trained, checks.calls) == (1, 0, [], 0)
