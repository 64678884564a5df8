"""A reward function is only ever loaded from the path the config names.

    .venv/bin/python -m pytest -q tests/security/test_reward_loading.py

A dataset row is data, never code: whatever its data_source, extra_info or reward_model fields
say (a module name, a .py path, a file:// or s3:// URL), scoring dispatches only to the built-in
scorers or to the configured file. A bad path in the config fails when the config is loaded,
before any work.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.config import ConfigError, config_from_run_json, frozen_config, load_run_config
from gpu_jobs.reward import (REWARD_FNS, REWARD_PREFIXES, RewardConfig, UnknownDataSourceError, get_reward_fn,
                             load_custom_reward_function, score_batch)

CONFIGURED = textwrap.dedent('''
    """The file the config names: says which file scored and what source it was shown."""

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "scored_by": __file__, "seen_source": data_source}
''')


@pytest.fixture
def evil(tmp_path):
    """A .py file that, if anything ever executed it, leaves a marker file behind."""
    marker = tmp_path / "EXECUTED"
    path = tmp_path / "evil.py"
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pwned')\n"
                    "def compute_score(*args, **kwargs):\n    return 1.0\n")
    return path, marker


@pytest.fixture
def configured(tmp_path):
    path = tmp_path / "configured_reward.py"
    path.write_text(CONFIGURED)
    return str(path)


def _hostile_rows(evil_path) -> list[dict]:
    e = str(evil_path)
    pointers = {"path": e, "custom_reward_function": {"path": e, "name": "compute_score"}, "reward_fn": e,
                "module": "evil", "rg_task": e}
    return [
        {"data_source": "os.system", "solution_str": "touch /tmp/pwned", "ground_truth": "5"},
        {"data_source": e, "solution_str": "5", "ground_truth": "5"},
        {"data_source": f"file://{e}", "solution_str": "5", "ground_truth": "5"},
        {"data_source": "s3://bucket/evil.py", "solution_str": "5", "ground_truth": "5"},
        {"data_source": "gpu_jobs.reward.custom", "solution_str": "5", "ground_truth": "5"},
        {"data_source": "__import__('os').system('id')", "solution_str": "5", "ground_truth": "5"},
        {"data_source": f"reasoning_gym/{e}", "solution_str": "5", "ground_truth": "5"},
        {"data_source": "reasoning_gym/../../evil", "solution_str": "5", "ground_truth": "5", "extra_info": pointers},
        {"data_source": "rlmill/arith", "solution_str": "5", "ground_truth": "5", "extra_info": pointers},
        {"data_source": "rlmill/arith", "solution_str": "5", "extra_info": json.dumps(pointers),
         "reward_model": {"ground_truth": "5", "style": "custom", "path": e, "custom_reward_function": e}},
    ]


def _modules_from(path) -> list[str]:
    return [name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None) == str(path)]


def test_builtin_scoring_never_runs_code_a_row_points_at(evil):
    evil_path, marker = evil
    for row in _hostile_rows(evil_path):
        try:
            scores, extras, _ = score_batch([row], RewardConfig())
        except UnknownDataSourceError as e:  # a configuration error that lists the built-ins
            assert "rlmill/arith" in str(e) and "custom_reward_function.path" in str(e)
            continue
        if row["data_source"] == "rlmill/arith":  # the pointers in extra_info/reward_model are ignored
            assert scores == [1.0] and extras == [{}]
        else:  # reasoning_gym/<not a task>: the row scores on_error, naming the unknown task
            assert scores == [0.0] and "not registered" in extras[0]["error"]
    assert not marker.exists() and not _modules_from(evil_path)


def test_a_configured_file_scores_every_row_whatever_the_row_says(evil, configured):
    evil_path, marker = evil
    rows = _hostile_rows(evil_path)
    cfg = RewardConfig(custom_reward_function={"path": configured}, num_workers=1)
    scores, extras, metrics = score_batch(rows, cfg)
    assert metrics["reward/errors"] == 0 and scores == [0.5] * len(rows)
    assert [x["scored_by"] for x in extras] == [configured] * len(rows)
    assert [x["seen_source"] for x in extras] == [r["data_source"] for r in rows]
    assert not marker.exists() and not _modules_from(evil_path)


BUILTINS = set(REWARD_FNS.values()) | set(REWARD_PREFIXES.values())


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), st.sampled_from(["os.system", "os", "builtins.eval", "/tmp/x.py",
                                                        "file:///tmp/x.py", "reasoning_gym/", "reasoning_gym",
                                                        "rlmill/arith/../../x", "gsm8k\0"])))
def test_registry_dispatches_only_to_builtin_scorers(data_source):
    before = set(sys.modules)
    try:
        fn = get_reward_fn(data_source)
    except UnknownDataSourceError as e:
        assert "known:" in str(e)
    else:
        assert fn in BUILTINS
    assert set(sys.modules) == before  # looking a source up imports nothing


def test_the_loader_reads_the_named_file_never_sys_path(tmp_path, monkeypatch):
    import json as stdlib_json

    monkeypatch.chdir(tmp_path)  # a relative name must not fall back to an importable module
    for name in ("json", "os", "json.py", "gpu_jobs/reward/registry", "gpu_jobs.reward.registry"):
        with pytest.raises(FileNotFoundError, match="not found"):
            load_custom_reward_function(name)
    shadow = tmp_path / "json.py"  # named like a stdlib module: loaded from its path, shadows nothing
    shadow.write_text("def compute_score(*a, **k):\n    return 0.25\n")
    assert load_custom_reward_function(str(shadow))("s", "x", "y") == 0.25
    assert sys.modules["json"] is stdlib_json


# ----------------------------------------------------------------------------- config time
@pytest.mark.parametrize("setup, override, needle", [
    (None, "path={tmp}/missing.py", "does not exist"),
    ("file", "path={tmp}/notes.txt", "not a Python file"),
    ("dir", "path={tmp}/pkg.py", "does not exist"),
    (None, "path=os", "not a Python file"),
    (None, "path=os.system", "not a Python file"),
    ("ok", "name=os.system", "not a Python function name"),
    ("ok", "name=__import__('os')", "not a Python function name"),
])
def test_a_bad_reward_path_fails_when_the_config_loads(setup, override, needle, tmp_path, example_path):
    (tmp_path / "notes.txt").write_text("def compute_score(*a): return 1.0\n")
    (tmp_path / "pkg.py").mkdir()
    (tmp_path / "ok.py").write_text("def compute_score(*a, **k):\n    return 1.0\n")
    extra = [f"reward.custom_reward_function.path={tmp_path}/ok.py"] if setup == "ok" else []
    root = tmp_path / "root"
    overrides = [f"root={root}", *extra, "reward.custom_reward_function." + override.format(tmp=tmp_path)]
    with pytest.raises(ConfigError, match=f"reward.custom_reward_function.(path|name): .*{needle}"):
        load_run_config(example_path, overrides)
    assert not root.exists()


def test_a_good_reward_path_loads_and_survives_run_json(tmp_path, example_path, configured):
    cfg = load_run_config(example_path, [f"reward.custom_reward_function.path={configured}"])
    assert cfg.reward.custom_reward_function.path == configured
    frozen = {"config": json.loads(json.dumps(frozen_config(cfg)))}
    # A process rebuilding the config from run.json (a remote stage) may not see the user's file.
    (tmp_path / "configured_reward.py").unlink()
    assert config_from_run_json(frozen).reward.custom_reward_function.path == configured
    frozen["config"]["reward"]["custom_reward_function"]["path"] = str(tmp_path / "evil.txt")
    with pytest.raises(ConfigError, match="not a Python file"):
        config_from_run_json(frozen)
