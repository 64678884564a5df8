"""Every `rlmill` command in README.md's code blocks is of a kind the tests know, the README's
bad-key example is what the CLI prints, and deliberate mistakes end in one `rlmill:` error and
never a traceback (a new process each, as a user runs them).

The README's commands themselves run, in order, in tests/test_readme_walkthrough.py.
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

# The kinds of rlmill command the README may show, and where each runs.
KINDS = {
    ("config", "show"): "tests/test_readme_walkthrough.py",
    ("data", "make"): "tests/test_readme_walkthrough.py",
    ("verify",): "tests/test_readme_walkthrough.py (and below, a run that does not exist)",
    ("train",): "tests/test_readme_walkthrough.py (tiny), tests/flows, tests/chaos",
    ("run",): "the main job, 20 GRPO iterations (minutes): what `make run` does",
    ("models",): "installs a package from PyPI and converts a model: tests/test_smollm2_setup.py",
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


def test_the_readme_shows_commands_and_each_is_classified():
    assert len(COMMANDS) >= 5, COMMANDS
    kinds = {tuple(argv[:2]) if argv[:1] in (["config"], ["data"]) else (argv[0],) for argv in COMMANDS}
    assert kinds <= set(KINDS), f"README shows rlmill commands no test runs or checks: {kinds - set(KINDS)}"


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
