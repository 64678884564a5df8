"""trainer.loggers for real: a tiny rlmill run logs to a real `mlflow server` (SQLite store, local
artifacts) and to Weights & Biases offline files, then resumes into the same tracker runs; a
failing run ends its tracker runs FAILED, and so does a tracker that fails to open or to finish
(no tracker run is left RUNNING). Everything is read back through MLflow's client and from the
.wandb file W&B wrote (its protobuf records). No mocks. The server here is the client
environment's (mlflow-skinny: no web UI); the UI's run page is checked in test_mlflow_ui.py.

    .venv/bin/python -m pytest -q tests/flows/test_trackers.py
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from tests.flows.mlflow_server import mlflow_runs as runs_tagged
from tests.flows.mlflow_server import mlflow_server as start_mlflow_server

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

mlflow = pytest.importorskip("mlflow", reason="the test extra installs it: bash scripts/ensure_venv.sh test")
wandb = pytest.importorskip("wandb", reason="the test extra installs it: bash scripts/ensure_venv.sh test")

RUN = "trk"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The client environment's `mlflow server` on a free port; its URL."""
    with start_mlflow_server(Path(sys.executable).parent / "mlflow", tmp_path_factory.mktemp("mlflow")) as url:
        yield url


# ------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def tracker_env(mlflow_server, tmp_path_factory):
    """Where the trackers log: the module's MLflow server, W&B offline files in one folder (W&B
    reads its environment once per process, so every run of this module shares WANDB_DIR)."""
    wandb_dir = tmp_path_factory.mktemp("wandb")
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir),
           "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield wandb_dir / "wandb"


@pytest.fixture(scope="module")
def runs(tracker_env, tmp_path_factory, example_path, tiny):
    """Run RUN for 2 iterations with both trackers, then resume it to 3."""
    from flows.training import rl_training

    root = tmp_path_factory.mktemp("trackers") / "root"
    overrides = tiny(str(root), f"run_id={RUN}", "trainer.logger=[console,mlflow,wandb]", "trainer.val_every=2")
    first = rl_training(config=str(example_path), overrides=overrides, iterations=2)
    second = rl_training(config=str(example_path), overrides=overrides, iterations=3)
    assert second["resumed from iteration"] == 2, second
    return {"root": root, "wandb": tracker_env, "first": first, "second": second}


def mlflow_runs(url: str, run_id: str = RUN):
    return runs_tagged(url, run_id)


def test_mlflow_has_one_run_with_the_config_metrics_by_iteration_and_the_report(runs, mlflow_server, tmp_path):
    client, found = mlflow_runs(mlflow_server)
    assert len(found) == 1, "the resumed rlmill run must continue its MLflow run, not start a second one"
    run = client.get_run(found[0].info.run_id)  # search_runs leaves some params out
    assert run.info.run_name == RUN and run.info.status == "FINISHED"
    # Params: the frozen config of run.json, flattened, logged once by the first process.
    from flows.trackers import flat_params

    frozen = json.loads((runs["root"] / "runs" / RUN / "run.json").read_text())["config"]
    assert run.data.params == flat_params(frozen) and run.data.params["run_id"] == RUN
    assert run.data.params["rollout.n"] == str(frozen["rollout"]["n"]) == "4"
    assert run.data.params["trainer.loggers"] == "['mlflow', 'wandb']"
    # Metrics: one point per iteration, step = iteration, across both processes.
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "timing_s/step")} == {1, 2, 3}
    val = client.get_metric_history(run.info.run_id, "val/acc")  # trainer.val_every=2
    assert [m.step for m in val] == [2, 3] and all(0.0 <= m.value <= 1.0 for m in val)
    assert any(name.startswith("val-core/") and "_at_" in name for name in run.data.metrics)  # mean@N renamed
    # The report, through the server's artifact proxy.
    names = {a.path for a in client.list_artifacts(run.info.run_id, "rlmill")}
    assert names == {"rlmill/summary.json", "rlmill/curves.png"}
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "rlmill/summary.json", str(tmp_path))).read_text())
    assert summary["status"] == "finished" and summary["iterations logged"] == [3]
    assert "critic/score/mean" in summary["last"]
    png = Path(client.download_artifacts(run.info.run_id, "rlmill/curves.png", str(tmp_path))).read_bytes()
    assert png[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------- W&B offline
def wandb_records(path: Path):
    """The protobuf records of a .wandb file: W&B's LevelDB-style log (a 7-byte header ':W&B',
    0xBEE1, version; then 32 KiB blocks of chunks, each `crc32 u32, length u16, type u8`, type
    1 = whole record, 2/3/4 = first/middle/last piece). wandb 0.31 reads it in its Go core only."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1), f"{path} is not a .wandb file"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pieces, pos = pieces + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_folder(folder: Path) -> dict:
    """One offline run folder: its run record, history rows by step, exit code, files."""
    out = {"history": {}, "exit": None, "files": {p.name for p in (folder / "files").iterdir()}}
    for record in wandb_records(next(folder.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            out["history"][record.history.step.num] = row
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def test_wandb_offline_run_has_the_config_metrics_by_iteration_and_the_report(runs):
    folders = sorted(runs["wandb"].glob(f"offline-run-*-{RUN}"))
    assert len(folders) == 2, "one offline folder per process, both for the same W&B run"
    first, second = (wandb_folder(f) for f in folders)
    for part in (first, second):
        assert part["run"].run_id == RUN and part["run"].project == "rlmill" and part["exit"] == 0
        assert {"rlmill-summary.json", "curves.png"} <= part["files"]
    config = {item.key: json.loads(item.value_json) for item in first["run"].config.update}
    assert config["run_id"] == RUN and config["rollout"]["n"] == 4 and config["trainer"]["val_every"] == 2
    # Steps are iterations and continue in the resumed process.
    assert sorted(first["history"]) == [1, 2] and sorted(second["history"]) == [3]
    assert all("critic/score/mean" in row for part in (first, second) for row in part["history"].values())
    assert "val/acc" in first["history"][2] and "val/acc" not in first["history"][1]
    assert "val/acc" in second["history"][3]  # the last iteration always validates
    summary = json.loads((folders[1] / "files" / "rlmill-summary.json").read_text())
    assert summary["status"] == "finished" and summary["iterations logged"] == [3]


# ------------------------------------------------------------------------------------- a failing run
def test_a_failing_run_ends_its_tracker_runs_failed(mlflow_server, tracker_env, tmp_path, example_path, tiny):
    """A task timeout no stage can meet fails the run at its first validation, after the trackers
    started: MLflow's run ends FAILED and W&B's with exit code 1, and the run's own error still
    surfaces."""
    from flows.training import rl_training

    overrides = tiny(str(tmp_path / "root"), "run_id=trk-fail", "trainer.logger=[console,mlflow,wandb]",
                     "tasks.retries=0", "tasks.timeout_seconds=0.01")
    with pytest.raises(Exception, match="timed out"):
        rl_training(config=str(example_path), overrides=overrides, iterations=1)
    _, found = mlflow_runs(mlflow_server, "trk-fail")
    assert [r.info.status for r in found] == ["FAILED"]
    (folder,) = tracker_env.glob("offline-run-*-trk-fail")
    assert wandb_folder(folder)["exit"] == 1


# ------------------------------------------------------------------------------------- no run left RUNNING
def test_a_tracker_that_fails_to_open_ends_those_opened_before_it_failed(mlflow_server, tracker_env, tmp_path,
                                                                      example_path, tiny, monkeypatch):
    """W&B refuses its mode (a real settings error, raised by wandb.init) after MLflow's run
    started: the run stops with one error naming W&B, and MLflow's run is FAILED, not RUNNING.
    W&B reads its environment once per process (wandb.setup), so its state is torn down around
    the changed mode, and the rest of the module gets the offline mode back."""
    from flows.trackers import TrackerError
    from flows.training import rl_training

    overrides = tiny(str(tmp_path / "root"), "run_id=trk-open", "trainer.logger=[console,mlflow,wandb]")
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")
    try:
        with pytest.raises(TrackerError, match=r"^rlmill: trainer.loggers: the wandb run of trk-open did not open: "
                                               r"(?s:.*)no-such-mode(?s:.*) \(ended FAILED: mlflow\); fix: check WANDB_MODE, "
                                               r".*or leave wandb out of trainer.loggers$"):
            rl_training(config=str(example_path), overrides=overrides, iterations=1)
    finally:
        monkeypatch.undo()
        wandb.teardown()
    client, found = mlflow_runs(mlflow_server, "trk-open")
    assert [r.info.status for r in found] == ["FAILED"]
    note = Path(client.download_artifacts(found[0].info.run_id, "rlmill/aborted.txt", str(tmp_path))).read_text()
    assert "the wandb run of trk-open did not open" in note


def test_every_tracker_ends_when_one_cannot_finish(mlflow_server, tracker_env, tmp_path):
    """W&B's run folder is gone when the run ends (a real FileNotFoundError from its finish),
    and W&B comes first: MLflow's run still gets its report and FINISHED, W&B's run still ends
    (exit code 1: its report is missing), and the error names W&B."""
    from flows.trackers import TrackerError, finish_trackers, open_trackers

    trackers = open_trackers("trk-finish", ["wandb", "mlflow"], {"run_id": "trk-finish"})
    for tracker in trackers:
        tracker.log(1, {"critic/score/mean": 0.5})
    shutil.rmtree(trackers[0].run.dir)
    with pytest.raises(TrackerError, match=r"could not end the wandb run: FileNotFoundError"):
        finish_trackers(trackers, failed=False, summary={"status": "finished"}, curves_png=b"\x89PNG")
    client, (run,) = mlflow_runs(mlflow_server, "trk-finish")
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "rlmill")} == {"rlmill/summary.json",
                                                                                  "rlmill/curves.png"}
    (folder,) = tracker_env.glob("offline-run-*-trk-finish")
    exits = [r.exit.exit_code for r in wandb_records(next(folder.glob("run-*.wandb")))
             if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]


# ------------------------------------------------------------------------------------- not installed
@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_logger_whose_package_is_missing_is_refused_up_front(name, monkeypatch):
    """`make test` installs both, so each is made not importable here: a None in sys.modules is
    how Python marks a module as such."""
    from flows.config import ConfigError, load_run_config

    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=f"trainer.loggers names '{name}' but it is not installed: `bash scripts/ensure_venv.sh test`"):
        load_run_config(None, [f"trainer.loggers=[{name}]"])


def test_without_matplotlib_a_run_has_no_curves_png_and_says_so(monkeypatch, caplog, tmp_path):
    # A slim environment (the GPU bundle carries no matplotlib): the picture is skipped with one
    # warning; every tracker still finishes with its summary.
    import sys

    from flows.reporting import curves_png
    from flows.trackers import finish_trackers

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level("WARNING", logger="rlmill"):
        assert curves_png([(1, {"critic/score/mean": 0.5})], [(1, 0.4)]) is None
    assert "matplotlib is not installed" in caplog.text

    class Recorder:
        finished = None

        def finish(self, failed, summary, curves_png):
            self.finished = (failed, summary, curves_png)

    from flows import trackers

    monkeypatch.setitem(trackers.TRACKER_NAMES, Recorder, "recorder")
    t = Recorder()
    finish_trackers([t], failed=False, summary={"status": "finished"}, curves_png=None)
    assert t.finished == (False, {"status": "finished"}, None)
