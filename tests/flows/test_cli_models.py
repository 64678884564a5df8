"""`rlmill models list|promote|rollback` through main(), on a local folder and on a real S3 endpoint
(moto on loopback): versions are published the way the nightly flow publishes them (a committed
run checkpoint of tiny files, copied by flows.nightly.promote_version), every move of CURRENT is
recorded under models/<name>/history/, and every refusal is one `rlmill:` line with nothing
written."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from flows.cli import main
from flows.nightly import promote_version
from storage import INDEX_NAME, ModelLayout, RunLayout, StorageConfig, commit, url_to_fs, write_files, write_pointer
from flows.nightly_state import read_state, record_success, state_url
from tests.servers import free_port, stop_process

NAME = "arith"
# Nightly's own promotion calls ModelLayout.promote without saying who it is: its records carry
# the default actor until flows/nightly.py passes by="nightly" (see the layout's promote).
NIGHTLY_ACTORS = {"nightly", "api"}


@dataclass(frozen=True)
class Registry:
    root: str
    storage: StorageConfig | None

    def layout(self) -> ModelLayout:
        return ModelLayout(self.root, NAME, self.storage)

    def publish(self, version: str, run_id: str, k: int, score: float | None = None) -> None:
        """Nightly's path: a committed checkpoint of run `run_id` (iteration k), copied to
        versions/<version> and promoted; with `score`, the night's record as nightly writes it."""
        src = RunLayout(self.root, run_id, self.storage).policy(k)
        files = write_files(src, {"config.json": b'{"model_type": "tiny"}', "model.safetensors": version.encode()},
                            self.storage)
        commit(src, files, kind="checkpoint", extra={"weight_map": {"w": "model.safetensors"}}, name=INDEX_NAME,
               storage=self.storage)
        promote_version(src, self.layout(), version)
        if score is not None:
            url = state_url(self.layout())
            record = {"night": run_id, "run_id": run_id, "promoted_version": version,
                      "new": {"mean_reward": score, "exact_match": score / 2, "n": 8}}
            record_success(url, read_state(url, self.storage), [], record, self.storage)

    def snapshot(self) -> dict[str, bytes]:
        fs, path = url_to_fs(self.root, self.storage)
        return {p: fs.cat_file(p) for p in fs.find(path)} if fs.exists(path) else {}


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def registry(request, tmp_path, monkeypatch) -> Registry:
    """An empty storage root; for S3, the CLI reaches moto through the AWS_* variables, as a user's would."""
    if request.param == "local":
        return Registry(str(tmp_path / "root"), None)
    endpoint = request.getfixturevalue("s3_endpoint")
    for var, value in (("AWS_ENDPOINT_URL", endpoint["endpoint_url"]), ("AWS_ACCESS_KEY_ID", endpoint["key"]),
                       ("AWS_SECRET_ACCESS_KEY", endpoint["secret"])):
        monkeypatch.setenv(var, value)
    return Registry(f"{request.getfixturevalue('s3_bucket_url')}/root", request.getfixturevalue("storage_config_s3"))


def models(registry: Registry, *argv: str) -> None:
    main(["models", *argv, "--root", registry.root])


def listed(registry: Registry, capsys) -> dict:
    capsys.readouterr()
    models(registry, "list", NAME, "--json")
    return json.loads(capsys.readouterr().out)


def refused(registry: Registry, *argv: str) -> str:
    """models(*argv) must exit with one `rlmill: ...` line and leave every byte under the root as it was."""
    before = registry.snapshot()
    with pytest.raises(SystemExit) as err:
        models(registry, *argv)
    message = err.value.code
    assert isinstance(message, str) and message.startswith("rlmill: ") and "\n" not in message, message
    assert registry.snapshot() == before, f"{argv} wrote something before refusing"
    return message


def test_list_promote_and_rollback_move_current_and_record_each_move(registry, capsys):
    registry.publish("nightly-20261129", "nightly-20261129", 2, score=0.5)
    registry.publish("nightly-20261130", "nightly-20261130", 3, score=0.625)
    registry.publish("hand-made", "exp-7", 1)  # promoted without a nightly record: no score

    out = listed(registry, capsys)
    assert [(v["version"], v["run"], v["iteration"], v["current"]) for v in out["versions"]] == [
        ("nightly-20261129", "nightly-20261129", 2, False), ("nightly-20261130", "nightly-20261130", 3, False),
        ("hand-made", "exp-7", 1, True)]  # oldest commit first
    assert [v["heldout"] and v["heldout"]["mean_reward"] for v in out["versions"]] == [0.5, 0.625, None]
    assert out["current"] == "hand-made" and out["rollback_to"] == "nightly-20261130" and out["uncommitted"] == {}
    assert [(r["seq"], r["from"], r["to"]) for r in out["history"]] == [
        (1, None, "nightly-20261129"), (2, "nightly-20261129", "nightly-20261130"), (3, "nightly-20261130", "hand-made")]
    assert {r["by"] for r in out["history"]} <= NIGHTLY_ACTORS

    models(registry, "promote", NAME, "nightly-20261129", "--reason", "canary lost")
    assert registry.layout().current_version() == "nightly-20261129"
    assert "CURRENT hand-made -> nightly-20261129 (promote" in capsys.readouterr().out
    last = registry.layout().history()[-1]
    assert (last["seq"], last["by"], last["from"], last["to"], last["reason"]) == (
        4, "promote", "hand-made", "nightly-20261129", "canary lost")
    assert last["at"].endswith("+00:00") and last["user"]

    # Each rollback undoes one more move: back to hand-made, then down the nightly promotions.
    for expected in ("hand-made", "nightly-20261130", "nightly-20261129"):
        models(registry, "rollback", NAME)
        assert registry.layout().current_version() == expected
    assert [(r["by"], r["to"]) for r in registry.layout().history()[4:]] == [
        ("rollback", "hand-made"), ("rollback", "nightly-20261130"), ("rollback", "nightly-20261129")]
    message = refused(registry, "rollback", NAME)
    assert "nothing to roll back to" in message and "rlmill models rollback arith VERSION" in message, message

    models(registry, "rollback", NAME, "hand-made", "--reason", "by hand")  # a named version: any committed one
    assert registry.layout().current_version() == "hand-made"
    capsys.readouterr()
    models(registry, "promote", NAME, "hand-made")  # already CURRENT: no move, no record
    assert "already hand-made: nothing changed" in capsys.readouterr().out
    assert len(registry.layout().history()) == 8

    models(registry, "list", NAME)
    text = capsys.readouterr().out
    assert "CURRENT -> hand-made; rollback returns to nightly-20261129" in text, text
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in text.splitlines()[2:5]}
    assert rows["hand-made"].startswith("* hand-made") and "exp-7 (1)" in rows["hand-made"], text
    assert "0.6250" in rows["nightly-20261130"] and "0.3125" in rows["nightly-20261130"], text
    assert "last moves of CURRENT (8 on record):" in text and "rollback by" in text and ": by hand" in text, text


def test_every_refusal_is_one_line_and_writes_nothing(registry):
    for argv in (("list", "nope"), ("promote", "nope", "v1"), ("rollback", "nope")):
        message = refused(registry, *argv)
        assert "no model 'nope' under" in message and "models there: none" in message, message

    registry.publish("v1", "run-a", 1)
    half = registry.layout().version("v2")  # an interrupted copy: files, no index
    write_files(half, {"config.json": b"{}"}, registry.storage)

    message = refused(registry, "promote", NAME, "v9")
    assert "no version 'v9' of model 'arith'" in message and "committed versions there: v1" in message, message
    message = refused(registry, "promote", NAME, "v2")
    assert "version 'v2' of model 'arith' is not committed" in message and INDEX_NAME in message, message
    assert "(v1)" in message, message
    message = refused(registry, "rollback", NAME, "v2")
    assert "is not committed" in message, message
    message = refused(registry, "rollback", NAME)  # v1 is the only version CURRENT ever named
    assert "nothing to roll back to: no version of 'arith' was CURRENT before v1" in message, message
    message = refused(registry, "promote", "../arith", "v1")
    assert "invalid model name '../arith'" in message, message
    message = refused(registry, "promote", NAME, "../v1")
    assert "no version '../v1'" in message, message

    fs, path = url_to_fs(registry.layout().current, registry.storage)
    fs.rm(path)  # versions, but CURRENT gone
    message = refused(registry, "rollback", NAME)
    assert "has no CURRENT version" in message and "rlmill models promote arith VERSION" in message, message

    assert [k for k in registry.snapshot() if "/versions/v2/" in k]  # the half copy is still there, untouched


def test_list_shows_an_uncommitted_folder_apart(registry, capsys):
    registry.publish("v1", "run-a", 1)
    write_files(registry.layout().version("v2"), {"config.json": b"{}"}, registry.storage)
    out = listed(registry, capsys)
    assert [v["version"] for v in out["versions"]] == ["v1"] and list(out["uncommitted"]) == ["v2"]
    assert out["rollback_to"] is None


def test_an_unrecorded_move_of_current_still_rolls_back_to_the_last_recorded(tmp_path, capsys):
    """A crash between CURRENT's write and its record (or any plain write of CURRENT) leaves a move
    without a record: the version before it is the last one on record."""
    registry = Registry(str(tmp_path / "root"), None)
    registry.publish("v1", "run-a", 1)
    registry.publish("v2", "run-b", 1)
    write_pointer(registry.layout().current, "v1")  # moved back by hand, not recorded
    models(registry, "rollback", NAME)
    assert registry.layout().current_version() == "v2"
    assert registry.layout().history()[-1]["from"] == "v1"


def test_a_racing_writer_never_overwrites_a_record(tmp_path, monkeypatch):
    """Two writers that list the same history pick the same seq; the create-only write makes the
    second take the next one instead of replacing the first's record."""
    layout = ModelLayout(str(tmp_path / "root"), NAME)
    stale = layout._history_paths()  # before any record: both writers saw an empty history
    layout.record_move(None, "v1", by="promote")
    monkeypatch.setattr(layout, "_history_paths", lambda: stale)
    second = layout.record_move("v1", "v2", by="rollback")
    assert second["seq"] == 2
    monkeypatch.undo()
    assert [(r["seq"], r["to"]) for r in layout.history()] == [(1, "v1"), (2, "v2")]


def _publish_builtin(registry: Registry, version: str, run_id: str) -> None:
    """A loadable version: the built-in model's files committed as run `run_id`'s checkpoint (the
    index names every tensor, as save_checkpoint's does), then nightly's copy and promotion."""
    from gpu_jobs.models import resolve_model_path

    folder = Path(resolve_model_path("builtin"))
    blobs = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != INDEX_NAME}
    weights = blobs["model.safetensors"]
    header = json.loads(weights[8:8 + struct.unpack("<Q", weights[:8])[0]])  # safetensors: u64 length, JSON
    src = RunLayout(registry.root, run_id, registry.storage).policy(1)
    commit(src, write_files(src, blobs), kind="checkpoint", name=INDEX_NAME,
           extra={"metadata": {"total_size": len(weights)},
                  "weight_map": {k: "model.safetensors" for k in header if k != "__metadata__"}})
    promote_version(src, registry.layout(), version)


def test_a_running_server_swaps_back_after_rollback(tmp_path):
    """`rlmill serve --watch-s 0.5` follows `rlmill models rollback`: /health names v1 again."""
    registry = Registry(str(tmp_path / "root"), None)
    _publish_builtin(registry, "v1", "run-a")
    _publish_builtin(registry, "v2", "run-b")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--model", NAME, "--root", registry.root,
                             "--redis", "none", "--port", str(port), "--watch-s", "0.5"],
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def serving(version: str, what: str, bound_s: float = 120) -> None:
        deadline = time.monotonic() + bound_s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["version"] == version:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up after {bound_s} s waiting for {what}")
            time.sleep(0.05)

    try:
        serving("v2", "rlmill serve to answer /health with the promoted v2")
        models(registry, "rollback", NAME, "--reason", "test")
        serving("v1", "rlmill serve --watch-s 0.5 to swap back to v1 after the rollback")
    finally:
        stop_process(proc)
    assert "now serving arith version v1 (was v2" in proc.communicate(timeout=30)[0]
