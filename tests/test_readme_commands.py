"""Every `rlmill` command in the code blocks of README.md and the docs pages (tests/docs_pages.py)
and in the CLI's help texts is of a kind the tests know, parses, and names only config keys that
exist (with values the config accepts); every config key the docs name exists; the docs' bad-key
example is what the CLI prints,
and deliberate mistakes end in one `rlmill:` error and never a traceback (a new process each,
as a user runs them).

The guide's "Running it for real" commands themselves run, in order, in tests/test_readme_walkthrough.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_pages

REPO = Path(__file__).resolve().parents[1]
# README.md, then every docs page in the site's nav order.
README = docs_pages.readme_and_docs()
LAUNCHERS = (["rlmill"], [".venv/bin/rlmill"], ["python", "-m", "flows.cli"], [".venv/bin/python", "-m", "flows.cli"])

# The kinds of rlmill command the README may show, and where each runs.
KINDS = {
    ("config", "show"): "tests/test_readme_walkthrough.py",
    ("data", "make"): "tests/test_readme_walkthrough.py",
    ("verify",): "tests/test_readme_walkthrough.py (and below, a run that does not exist)",
    ("train",): "tests/test_readme_walkthrough.py (tiny), tests/flows, tests/chaos",
    ("run",): "the main job, 20 GRPO iterations (minutes): what `make run` does",
    ("models",): "fetch installs a package and converts a model: tests/test_smollm2_setup.py; "
                 "list/promote/rollback: tests/flows/test_cli_models.py",
    ("serve",): "a long-running server: tests/serve/test_serve.py (uvicorn and a real redis-server)",
    ("feedback",): "consume and dataset: tests/serve/test_serve.py (a real redis-server; SIGKILLed between commit and ack)",
    ("simulate",): "simulated users against a real serve: tests/serve/test_simulate.py; the README's loop: "
                   "tests/test_readme_walkthrough.py",
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


# ------------------------------------------------- the help texts and the keys, in step with the code
def _help_texts() -> dict[str, str]:
    """`rlmill ... --help` of every command level, by the command's words ("" for rlmill's own)."""
    import argparse

    from flows.cli import build_parser

    texts = {}

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        texts[words] = parser.format_help()
        for action in parser._actions:  # argparse keeps subcommands here, and nowhere public
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{words} {name}".strip())

    walk(build_parser(), "")
    return texts


HELP = _help_texts()
PLACEHOLDERS = {"ID": "grpo-arith-20261201-093000"}  # how the help writes a run id


def _help_commands() -> list[tuple[str, list[str]]]:
    """(the help it is in, argv after `rlmill`) of every example command line in the help texts."""
    def filled(word: str) -> str:
        key, sep, value = word.partition("=")
        return f"{key}={PLACEHOLDERS[value]}" if sep and value in PLACEHOLDERS else word

    return [(where, [filled(w) for w in shlex.split(line.strip(), comments=True)[1:]])
            for where, text in HELP.items() for line in text.splitlines() if line.startswith("  rlmill ")]


def _rlmill_keys() -> tuple[set[str], set[str]]:
    """(every dotted key of RunConfig, the keys whose value is a free-form mapping)."""
    import typing

    from pydantic import BaseModel

    from gpu_jobs.stages.config import RunConfig

    keys, free = set(), set()

    def walk(model, prefix=""):
        for name, fld in model.model_fields.items():
            key = prefix + (fld.alias or name)
            keys.add(key)
            args = (fld.annotation, *typing.get_args(fld.annotation))
            if any(typing.get_origin(a) is dict or a is dict for a in args):
                free.add(key)
            for arg in args:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    walk(arg, key + ".")

    walk(RunConfig)
    return keys, free


def _is_config_key(key: str) -> bool:
    from flows.verl_keys import VERL_KEYS

    keys, free = _rlmill_keys()
    return key in keys or key in VERL_KEYS or any(key.startswith(f + ".") for f in free)


def _check_command(argv: list[str]) -> None:
    """argv parses as main() parses it, is a kind the tests know, and every override is a
    config key with a valid value (the config loads, as `rlmill config show` would)."""
    from flows.cli import build_parser
    from flows.cli_data import _check_dataset_name
    from flows.config import load_run_config

    args, extra = build_parser().parse_known_args(argv)
    assert all("=" in e and not e.startswith("-") for e in extra), (argv, extra)
    kind = tuple(argv[:2]) if argv[:1] in (["config"], ["data"]) else (argv[0],)
    assert kind in KINDS, argv
    overrides = [*getattr(args, "overrides", []), *extra]
    for text in overrides:
        assert _is_config_key(text.partition("=")[0]), f"{argv}: {text.partition('=')[0]} is no config key"
    if args.command in ("train", "verify", "config"):
        load_run_config(args.config, overrides)
    if args.command == "data":
        _check_dataset_name(args.name)


def test_every_help_text_shows_examples_that_run(monkeypatch):
    monkeypatch.chdir(REPO)
    commands = _help_commands()
    shown_in = {where for where, _ in commands}
    assert {"", "run", "train", "verify", "data make", "config show"} <= shown_in, shown_in
    for where, argv in commands:
        _check_command(argv)


def test_every_readme_command_parses_and_names_real_keys(monkeypatch):
    monkeypatch.chdir(REPO)
    for argv in COMMANDS:
        _check_command(argv)


# The Benchmarks page quotes other programs (`model.generate`, ...): no config keys there.
USAGE = (REPO / "README.md").read_text() + "\n\n".join(p.read_text() for p in docs_pages.pages() if p.name != "benchmarks.md")


def test_every_config_key_the_readme_names_exists():
    from flows.verl_keys import VERL_SECTIONS
    from gpu_jobs.stages.config import RunConfig

    named = set()
    for code in re.findall(r"`([^`\n]+)`", USAGE):
        for word in code.split():
            key = word.partition("=")[0]
            if re.fullmatch(r"[a-z_]+(\.[A-Za-z0-9_]+)+", key) and \
                    key.split(".")[0] in (*RunConfig.model_fields, *VERL_SECTIONS):
                named.add(key)
    assert {"reward.custom_reward_function.path", "storage.key", "storage.secret", "data.max_prompt_length"} <= named
    unknown = sorted(k for k in named if not _is_config_key(k))
    assert not unknown, f"README names config keys RunConfig and the verl table do not have: {unknown}"


def test_the_readme_and_the_help_list_the_datasets_the_registry_has():
    from gpu_jobs.data import dataset_names

    names = " | ".join(dataset_names())
    assert names in README and names in " ".join(HELP["data make"].split())


def test_the_readme_documents_the_custom_reward_key_and_the_s3_example():
    section = docs_pages.page("guide/rewards.md")
    assert "reward.custom_reward_function.path" in section and "compute_score" in section
    s3 = docs_pages.page("guide/verl-data-s3.md")
    assert "examples/verl_dataset_s3.yaml" in s3 and "s3://my-bucket/data/arith" in s3 and "storage.key" in s3
