"""Every `rlmill` command in README.md's code blocks, run as a user would (a new process).

Cheap ones (config show, data make, verify) must do what the README says: exit 0, or for the
README's verify of a run that does not exist yet, one `rlmill:` line naming it. Commands that
train are run by the flow tests instead; they are still parsed here, so a new kind of command in
the README fails this test until it is classified. Deliberate mistakes end in one `rlmill:`
error and never a traceback.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
LAUNCHERS = (["rlmill"], [".venv/bin/rlmill"], ["python", "-m", "flows.cli"], [".venv/bin/python", "-m", "flows.cli"])

# Commands that train run elsewhere: tests/flows/test_flow.py (rl-training through Prefect),
# tests/chaos (kills and resumes), tests/flows/test_server_cleanup.py (`rlmill train` killed).
SKIPPED = {
    "train": "trains a model through Prefect (minutes): covered by tests/flows and tests/chaos",
    "run": "the main job, 20 GRPO iterations (minutes): what `make run` does",
    "models": "installs a package from PyPI and converts a model: tests/test_smollm2_setup.py",
}


def readme_commands() -> list[list[str]]:
    """argv (after the launcher) of every rlmill command line in a code block of README.md."""
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", README, re.S):
        for line in block.splitlines():
            try:
                words = shlex.split(line.strip().removeprefix("$ "), comments=True)
            except ValueError:  # not shell (a table, a traceback)
                continue
            for launcher in LAUNCHERS:
                if words[: len(launcher)] == launcher:
                    found.append(words[len(launcher):])
    return found


COMMANDS = readme_commands()


def _rlmill(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # This checkout's CLI: `.venv/bin/rlmill` runs whichever clone last ran `make`.
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env=_env())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlmill: "), proc.stderr
    return lines[0]


def test_the_readme_shows_commands_and_each_is_classified():
    assert len(COMMANDS) >= 5, COMMANDS
    kinds = {tuple(argv[:2]) if argv[:1] in (["config"], ["data"]) else (argv[0],) for argv in COMMANDS}
    known = {("config", "show"), ("data", "make"), ("verify",), *((k,) for k in SKIPPED)}
    assert kinds <= known, f"README shows rlmill commands this test does not run or skip: {kinds - known}"


def test_skipped_readme_commands_are_the_training_ones():
    skipped = [argv for argv in COMMANDS if argv[0] in SKIPPED and argv[0] != "models"]
    assert skipped, "the README shows no training command any more: update SKIPPED"
    for argv in skipped:
        # A training command's config and overrides are still checked, without training.
        proc = _rlmill("config", "show", *argv[1:])
        assert proc.returncode == 0, f"`rlmill {shlex.join(argv)}` has an invalid config: {proc.stderr[-2000:]}"


def _cases(kind: tuple[str, ...]) -> list[list[str]]:
    return [argv for argv in COMMANDS if tuple(argv[: len(kind)]) == kind]


@pytest.mark.parametrize("argv", _cases(("config", "show")), ids=shlex.join)
def test_readme_config_show(argv):
    proc = _rlmill(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run_id:" in proc.stdout and "adv_estimator:" in proc.stdout


@pytest.mark.parametrize("argv", _cases(("data", "make")), ids=shlex.join)
def test_readme_data_make(argv, tmp_path):
    # The README writes to a bucket; the same command writes to a local folder here (no S3).
    argv = list(argv)
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / "data")
    proc = _rlmill(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "train.parquet").is_file()
    # --train-only (the nightly incoming folder): no held-out file a nightly run would train on.
    assert (tmp_path / "data" / "test.parquet").is_file() == ("--train-only" not in argv)


@pytest.mark.parametrize("argv", _cases(("verify",)), ids=shlex.join)
def test_readme_verify_of_a_run_not_trained_yet_names_it(argv, tmp_path):
    # In a fresh root the README's run does not exist: one line saying so, never "intact".
    run_id = next(a.split("=", 1)[1] for a in argv if a.startswith("run_id="))
    message = _one_line_error(_rlmill(*argv, f"root={tmp_path / 'root'}"))
    assert f"no run {run_id!r} under" in message and "intact" not in message


def test_readme_bad_key_example_is_what_the_cli_prints():
    shown = re.search(r"A bad key fails at once.*?```\n(.*?)```", README, re.S).group(1).strip()
    proc = _rlmill("config", "show", "--config", "examples/grpo_arith.yaml", "rollout.nn=4", "actor.lr=0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == shown


@pytest.mark.parametrize("argv, words", [
    (["data", "make", "arith", "--out", "{tmp}/d", "--train-size", "20000"], "arith has only 8100 distinct prompts"),
    (["data", "make", "arithmetic", "--out", "{tmp}/d"], "unknown dataset 'arithmetic'"),
    (["train", "--config", "examples/grpo_arith.yaml", "root={tmp}/root", "rollout.nn=4"], "rollout.nn: unknown key"),
    (["train", "--config", "{tmp}/no-such.yaml"], "does not exist"),
    (["verify", "--config", "examples/grpo_arith.yaml", "root={tmp}/root", "run_id=grpo-arth"], "no run 'grpo-arth'"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x[:3]))
def test_mistakes_end_in_one_rlmill_line_before_any_work(argv, words, tmp_path):
    proc = _rlmill(*(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("rlmill: ") and words in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written
