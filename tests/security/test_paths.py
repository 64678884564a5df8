"""Names that would escape a run's folder are refused, with a clear error, before anything is written.

    .venv/bin/python -m pytest -q tests/security/test_paths.py

Covers run ids, stage names, iteration numbers, model names/versions and storage roots, at each
door a user can come through: RunLayout/ModelLayout, the config loader (YAML file and dotted
overrides), the rl-training flow's `run_id` parameter, the CLI, and the stage commit helpers.
"""

from __future__ import annotations

import ntpath
import os
import posixpath
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.config import ConfigError, load_run_config
from storage.errors import InvalidNameError
from storage.layout import ModelLayout, RunLayout, check_name, check_root

REPO = Path(__file__).resolve().parents[2]

ESCAPES = [
    "..", ".", "../x", "x/..", "../../etc/passwd", "a/b", "/abs", "/", "", " ", "a\\b", "..\\x",
    "C:\\x", "C:", "x\0y", "\0", "run\n", "\nrun", "run\r", "a..b", ".hidden", "-rf", "~", "~root",
    "%2e%2e", "a b", "é", "run\u2215x", "\uff52\uff55\uff4e", "\u2024\u2024", "r" * 129,
]
NOT_STRINGS = [None, 3, 1.5, b"run", ["run"]]


def _is_one_safe_segment(name: str) -> bool:
    """What 'cannot escape' means for a folder name, independent of check_name's regex."""
    root = "/root/runs"
    return (
        0 < len(name) <= 128
        and name.isascii() and name.isprintable() and not any(c.isspace() for c in name)
        and "/" not in name and "\\" not in name and ":" not in name and ".." not in name
        and not name.startswith((".", "-", "~"))
        and posixpath.normpath(posixpath.join(root, name)) == f"{root}/{name}"
        and ntpath.normpath(ntpath.join("C:\\root", name)) == f"C:\\root\\{name}"
    )


# ----------------------------------------------------------------------------- the validator
@pytest.mark.parametrize("bad", ESCAPES + NOT_STRINGS, ids=repr)
def test_escaping_names_are_refused_everywhere_a_name_becomes_a_folder(bad, tmp_path):
    root = str(tmp_path / "root")
    layout, models = RunLayout(root, "ok"), ModelLayout(root, "m")
    makers = [lambda: RunLayout(root, bad), lambda: layout.stage(1, bad), lambda: ModelLayout(root, bad)]
    if isinstance(bad, str):  # versions may be ints (str(3) is a fine folder name)
        makers += [lambda: models.version(bad), lambda: models.promote(bad)]
    for make in makers:
        with pytest.raises(InvalidNameError, match="letters, digits") as e:
            make()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "root").exists()


def test_longest_allowed_name_is_128_characters():
    assert check_name("r" * 128) == "r" * 128
    with pytest.raises(InvalidNameError, match="1-128"):
        check_name("r" * 129)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=140), st.text(alphabet="./\\\0\n :~-_aZ9é", max_size=12)))
def test_any_accepted_name_is_one_safe_folder(name):
    try:
        accepted = check_name(name)
    except InvalidNameError:
        return
    assert accepted == name and _is_one_safe_segment(name), repr(name)
    assert RunLayout("/root", name).root == f"/root/runs/{name}"


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True).filter(lambda s: ".." not in s))
def test_every_ordinary_name_is_accepted(name):
    assert check_name(name, "run id") == name
    assert RunLayout("s3://b/rl", name).stage(2, name) == f"s3://b/rl/runs/{name}/iterations/2/{name}"


@pytest.mark.parametrize("k", [-1, "3", "../3", "1/2", 1.5, float("nan"), True, None, [1]], ids=repr)
def test_bad_iteration_numbers_are_refused(k):
    layout = RunLayout("/tmp/root", "ok")
    for make in (layout.iteration, lambda k: layout.stage(k, "rollout"), layout.checkpoint, layout.policy,
                 layout.trainer, layout.set_latest):
        with pytest.raises(InvalidNameError, match="non-negative int"):
            make(k)


@pytest.mark.parametrize("root", ["", "   ", "/tmp/x\0y", "/tmp/x\ny", None, 5], ids=repr)
def test_unusable_roots_are_refused(root):
    # An empty root used to put runs at /runs/<id>: join("", "runs") is "/runs".
    for make in (lambda: RunLayout(root, "ok"), lambda: ModelLayout(root, "m"), lambda: check_root(root)):
        with pytest.raises(InvalidNameError, match="storage root"):
            make()


# ----------------------------------------------------------------------------- the doors
@pytest.mark.parametrize("run_id", ["../x", "a/b", "/etc", "..", "a..b", "x\\y", "", "~", ".x", "r" * 129])
def test_config_loader_refuses_escaping_run_ids(run_id, tmp_path, example_path):
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match="run_id") as e:
        load_run_config(example_path, [f"root={root}", f"run_id={run_id}"])
    assert str(e.value).startswith("invalid run config:")
    assert not root.exists()


@pytest.mark.parametrize("run_id", ["run\n", "r\0x", "../x", "a\tb"], ids=repr)
def test_yaml_file_cannot_smuggle_control_characters_into_run_id(run_id, tmp_path, example_path):
    import yaml

    data = yaml.safe_load(example_path.read_text())
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**data, "root": str(tmp_path / "root"), "run_id": run_id}))
    with pytest.raises(ConfigError, match="run_id"):
        load_run_config(cfg)
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("override, key", [
    ("root=", "root"), ("root='  '", "root"), ('root="/tmp/a\\0b"', "root"),
    ("data.generate=rg:../../../../tmp/x", "data.generate"), ("data.generate=rg:a/b", "data.generate"),
    ("data.generate=../arith", "data.generate"),
])
def test_config_loader_refuses_roots_and_dataset_names_that_escape(override, key, example_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(example_path, [override])


def test_flow_run_id_parameter_is_checked_before_anything_is_written(tmp_path, example_path, monkeypatch):
    from flows.training import rl_training

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    root = tmp_path / "root"
    # .fn is the flow's body without a Prefect API: the config check is its first line.
    with pytest.raises(ConfigError, match="run_id"):
        rl_training.fn(config=str(example_path), overrides=[f"root={root}"], run_id="../escape")
    assert not root.exists() and not (tmp_path / "locks").exists()


@pytest.mark.parametrize("argv", [["train"], ["config", "show"]])
def test_cli_refuses_escaping_run_id_in_process(argv, tmp_path, example_path, capsys):
    from flows.cli import main

    root = tmp_path / "root"
    with pytest.raises(SystemExit) as e:
        main([*argv, "--config", str(example_path), f"root={root}", "run_id=../x"])
    assert isinstance(e.value.code, str) and e.value.code.startswith("rlmill: invalid run config:")
    assert "run_id: invalid run_id '../x'" in e.value.code
    assert not root.exists()


def test_cli_process_exits_1_and_writes_nothing(tmp_path, example_path):
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLMILL_LOCK_DIR": str(tmp_path / "locks")}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(example_path),
                           f"root={root}", "run_id=../../etc"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "run_id: invalid run_id '../../etc'" in proc.stderr
    assert not root.exists() and not (tmp_path / "locks").exists()


@pytest.mark.parametrize("stage", ["../update", "a/b", "", "..", "commit/../../x"])
def test_stage_commit_helpers_refuse_escaping_stage_names(stage, tmp_path):
    from gpu_jobs.stages import last_committed
    from gpu_jobs.stages import Output, StageSpec

    layout = RunLayout(str(tmp_path / "root"), "r")
    # The commit shell reads only run.layout, run.storage and run.cfg.
    run = SimpleNamespace(layout=layout, storage=None, cfg=None)
    compute = StageSpec(stage, lambda run, roles, k: Output(pa.table({"x": [1]})))
    with pytest.raises(InvalidNameError):
        compute(run, None, 1)
    with pytest.raises(InvalidNameError):
        last_committed(layout, stage)
    with pytest.raises(InvalidNameError):
        StageSpec("rollout", lambda run, roles, k: Output(pa.table({"x": [1]})))(run, None, -1)
    assert not (tmp_path / "root").exists()
