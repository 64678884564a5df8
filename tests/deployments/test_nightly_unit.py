"""The nightly flow's plain functions (and the flows.nightly_state ones it uses) and the deployment
files, without a Prefect server.

    .venv/bin/python -m pytest -q tests/deployments/test_nightly_unit.py
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from flows import nightly as N
from flows import nightly_state as I
from storage import ModelLayout, RunLayout

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ decide
@pytest.mark.parametrize("new,cur,min_gain,promote", [
    (0.52, 0.50, 0.0, True),    # better
    (0.50, 0.50, 0.0, True),    # a tie is "not worse"
    (0.49, 0.50, 0.0, False),   # worse by one row in a hundred
    (0.52, 0.50, 0.05, False),  # better, but not by the required margin
    (0.40, 0.50, -0.2, True),   # a negative min_gain tolerates a regression
    (0.1 + 0.2, 0.3, 0.0, True),  # 0.30000000000000004 vs 0.3: float noise is a tie
])
def test_decide(new, cur, min_gain, promote):
    d = N.decide(new, cur, min_gain)
    assert d.promote is promote
    assert f"{min_gain:+.4f}" in d.reason


def test_decide_nan():
    assert not N.decide(math.nan, 0.5).promote  # a broken evaluation never promotes
    assert N.decide(0.5, math.nan).promote


# ------------------------------------------------------------------------------------ new files
def _touch(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_list_new_files(tmp_path):
    prefix = tmp_path / "incoming"
    assert I.list_new_files(str(prefix), {}) == []  # prefix not there yet: nothing to do
    _touch(prefix / "a.parquet", 10)
    _touch(prefix / "day2" / "b.parquet", 20)
    _touch(prefix / ".b.parquet.tmp-123", 5)       # write_prompts' staging name
    _touch(prefix / "_quarantine" / "c.parquet", 5)
    _touch(prefix / "notes.txt", 5)
    _touch(prefix / "day3" / "test.parquet", 7)      # a `rlmill data make` folder's held-out split
    found = I.list_new_files(str(prefix), {})
    assert [(f.rel, f.size) for f in found] == [("a.parquet", 10), ("day2/b.parquet", 20)]
    assert found[1].url == f"{prefix}/day2/b.parquet"
    # Processed files are skipped; a file rewritten with another size is new again.
    assert [f.rel for f in I.list_new_files(str(prefix), {"a.parquet": 10, "day2/b.parquet": 20})] == []
    assert [f.rel for f in I.list_new_files(str(prefix), {"a.parquet": 9, "day2/b.parquet": 20})] == ["a.parquet"]


def test_list_new_files_memory_url():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/rlmill-nightly-unit/in/x.parquet", b"123")
    try:
        found = I.list_new_files("memory://rlmill-nightly-unit/in", {})
        assert [(f.url, f.rel, f.size) for f in found] == [
            ("memory://rlmill-nightly-unit/in/x.parquet", "x.parquet", 3)]
    finally:
        fs.rm("/rlmill-nightly-unit", recursive=True)


# ------------------------------------------------------------------------------------ state
def test_state_roundtrip(tmp_path):
    url = I.state_url(ModelLayout(str(tmp_path), "arith"))
    assert url.endswith("models/arith/nightly_state.json")
    state = I.read_state(url)
    assert state == {"processed": {}, "history": []}
    state["processed"]["a.parquet"] = 10
    state["history"] = [{"run_id": f"r{i}"} for i in range(I.HISTORY_KEPT + 5)]
    I.write_state(url, state)
    again = I.read_state(url)
    assert again["processed"] == {"a.parquet": 10}
    assert [h["run_id"] for h in again["history"]][0] == "r5"  # only the last HISTORY_KEPT nights
    assert len(again["history"]) == I.HISTORY_KEPT


def test_pick_run_id(tmp_path):
    from flows.nightly_state import pick_run_id

    root = str(tmp_path)
    state = {"processed": {}, "history": []}
    assert pick_run_id("20260101", state, ["f1"], root) == "nightly-20260101"
    # A run of that id that failed with the same files is resumed under the same id ...
    RunLayout(root, "nightly-20260101").write_run_json({"config": {"data": {"train_files": ["f1"]}}})
    assert pick_run_id("20260101", state, ["f1"], root) == "nightly-20260101"
    # ... but new files that day get a new id, and so does a second night after a success.
    assert pick_run_id("20260101", state, ["f2"], root) == "nightly-20260101-2"
    state["history"].append({"run_id": "nightly-20260101"})
    assert pick_run_id("20260101", state, ["f1"], root) == "nightly-20260101-2"


def test_nightly_state_docstring_examples():
    import doctest

    assert doctest.testmod(I, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------------------------ promotion
def test_promote_version_copies_through_the_commit_primitive(tmp_path):
    import torch

    from storage import INDEX_NAME, CorruptShardError, NotCommittedError, load_state_dict, save_checkpoint, verify

    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    src = save_checkpoint(str(tmp_path / "run" / "policy"), sd, config={"model_type": "qwen2"}, shard_bytes=16)
    models = ModelLayout(str(tmp_path), "arith")
    dest = N.promote_version(src, models, "v1")
    assert dest == models.version("v1") and models.current_version() == "v1"
    got = load_state_dict(dest)
    assert set(got) == {"w", "b"} and torch.equal(got["w"], sd["w"])
    assert sorted(p.name for p in Path(dest).iterdir()) == sorted(p.name for p in Path(src).iterdir())
    assert verify(dest, name=INDEX_NAME).inputs == [f"{src}/{INDEX_NAME}"]  # the copy names its source
    assert N.promote_version(src, models, "v1") == dest  # committed already: a retry changes nothing
    # A flipped byte in the source is caught by the verifier; CURRENT stays on the good version.
    shard = Path(src) / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="model-00002-of-00002.safetensors: sha256"):
        N.promote_version(src, models, "v2")
    assert models.current_version() == "v1" and not (Path(models.version("v2")) / INDEX_NAME).exists()
    # A source without its index (a half-written checkpoint) is never copied.
    (Path(src) / INDEX_NAME).unlink()
    with pytest.raises(NotCommittedError):
        N.promote_version(src, models, "v3")
    assert models.current_version() == "v1" and not (Path(models.version("v3")) / INDEX_NAME).exists()


def test_markdown_shows_both_scores_and_decision():
    files = [I.NewFile("/in/a.parquet", "a.parquet", 10)]
    md = N.decision_markdown("arith", "20260101", "nightly-20260101", N.decide(0.4, 0.5),
                             {"mean_reward": 0.4, "exact_match": 0.4, "n": 50},
                             {"mean_reward": 0.5, "exact_match": 0.5, "n": 50},
                             "/r/runs/nightly-20260101/checkpoints/1/policy", "builtin", None, files, None)
    assert "REFUSED" in md and "0.4000" in md and "0.5000" in md and "/in/a.parquet" in md
    assert "nothing promoted yet" in md
    md = N.nothing_markdown("arith", "20260101", "/in", {"processed": {"a": 1}, "history": []})
    assert "nothing to do" in md and "`/in`" in md


# ------------------------------------------------------------------------------------ deployment files
def test_prefect_yaml_deployments():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"manual", "nightly", "gpu", "rollout", "auto", "consume", "on-feedback", "decide", "daily"}
    assert deps["daily"]["entrypoint"] == "flows/online/retention.py:rl_retention"
    (daily,) = deps["daily"]["schedules"]
    assert daily["cron"] == "30 3 * * *" and daily["timezone"] == "{{ $RLMILL_NIGHTLY_TZ }}" and daily["active"]
    assert deps["rollout"]["entrypoint"] == "flows/remote.py:rl_stage" and "schedules" not in deps["rollout"]
    assert deps["manual"]["entrypoint"] == "flows/training.py:rl_training"
    assert deps["gpu"]["entrypoint"] == "flows/remote.py:rl_stage" and "schedules" not in deps["gpu"]
    assert deps["nightly"]["entrypoint"] == "flows/nightly.py:rl_nightly"
    assert "schedules" not in deps["manual"]
    (sched,) = deps["nightly"]["schedules"]
    assert sched["cron"] == "0 2 * * *" and sched["timezone"] == "{{ $RLMILL_NIGHTLY_TZ }}"
    for d in deps.values():
        assert d["work_pool"]["name"] == "{{ $RLMILL_WORK_POOL }}"
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ repo.stdout }}"}}]
    # The entrypoints name the flows the deployments are called after.
    from flows.training import rl_training

    from flows.remote import rl_stage

    assert rl_training.name == "rl-training" and N.rl_nightly.name == "rl-nightly"
    assert rl_stage.name == "rl-stage"  # rl-stage/gpu, trainer.stage_deployment's default
    assert (REPO / deps["nightly"]["parameters"]["config"]).exists()


def test_script_usage_and_missing_server():
    script = str(REPO / "scripts" / "prefect_local.sh")
    res = subprocess.run(["bash", script], capture_output=True, text=True)
    assert res.returncode == 2 and "server" in res.stderr and "deploy" in res.stderr
    env = {"PATH": "/usr/bin:/bin", "PORT": "9", "RLMILL_SERVER_WAIT_S": "1", "HOME": str(Path.home())}
    res = subprocess.run(["bash", script, "deploy"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1 and "no Prefect server answers at http://127.0.0.1:9/api" in res.stderr


def test_a_server_on_every_address_gives_the_ui_one_a_browser_can_reach():
    script = str(REPO / "scripts" / "prefect_local.sh")
    base = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}

    def ui_url(**env):
        res = subprocess.run(["bash", script, "ui-url"], capture_output=True, text=True, env={**base, **env},
                             timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    assert ui_url() == "http://127.0.0.1:4200"
    assert ui_url(RLMILL_SERVER_HOST="10.1.2.3", PORT="4300") == "http://10.1.2.3:4300"
    everywhere = ui_url(RLMILL_SERVER_HOST="0.0.0.0")
    assert everywhere.startswith("http://") and everywhere.endswith(":4200") and "0.0.0.0" not in everywhere
    assert ui_url(RLMILL_SERVER_HOST="0.0.0.0", PREFECT_UI_API_URL="http://ui.example:80/api") == "http://ui.example:80"


def test_nightly_cli_parses(monkeypatch):
    seen = {}
    monkeypatch.setattr(N, "rl_nightly", lambda **kw: seen.update(kw) or {"status": "nothing to do"})
    N.main(["--iterations", "2", "--eval-size", "5", "--min-gain", "0.1", "--night", "20260102", "root=/tmp/x"])
    assert seen == {"config": "examples/grpo_arith.yaml", "overrides": ["root=/tmp/x"], "model_name": "arith",
                    "new_data_prefix": None, "iterations": 2, "eval_size": 5, "min_gain": 0.1, "night": "20260102"}
    json.dumps(seen)


@pytest.mark.slow  # imports great_expectations (~5 s) and loads the built-in model's tokenizer
def test_validate_new_data_gate(tmp_path):
    from flows.config import load_run_config
    from storage.datasets import read_prompts, write_prompts
    from gpu_jobs.data import arith_row
    from storage.quality import DataQualityError

    rows = [arith_row(10 + i, 20, "train", i) for i in range(6)]
    rows[2]["prompt"] = [{"role": "user", "content": ""}]  # an empty prompt fails the gate
    url = write_prompts(rows, str(tmp_path / "in" / "bad.parquet"))
    out = str(tmp_path / "models" / "arith" / "nightly" / "r1")

    cfg = load_run_config(None, [f"root={tmp_path}"])
    with pytest.raises(DataQualityError):  # on_failure=raise (the default): the night fails
        N.validate_new_data.fn([url], cfg, "builtin", out)

    cfg = load_run_config(None, [f"root={tmp_path}", "gate.on_failure=quarantine"])
    (clean,) = N.validate_new_data.fn([url], cfg, "builtin", out)
    assert clean == f"{out}/clean.parquet"
    assert len(read_prompts(clean)) == 5 and len(read_prompts(f"{out}/quarantine.parquet")) == 1
    assert N.validate_new_data.fn([url], cfg, "builtin", out) == [clean]  # a retried night rewrites the same files
    good = write_prompts(rows[:2], str(tmp_path / "in" / "good.parquet"))
    assert N.validate_new_data.fn([good], cfg, "builtin", out + "-good") == [good]  # clean: trained as they are
