"""The parts of the cluster on one machine (deployments/cluster) that need no root: where its
state may live, what each host gets as its image, the hosts' supervisor, the CLI's refusals, and
how a rank of another node finds the model. The cluster itself (namespaces, root) runs in
`make chaos` (benchmarks/chaos/cluster_runs.py) and `make cluster`.

    .venv/bin/python -m pytest -q tests/cluster
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_state_under_tmp_and_long_prefixes_are_refused_with_the_fix():
    from deployments.cluster.hosts import Cluster, ClusterError

    with pytest.raises(ClusterError, match="outside /tmp"):
        Cluster("/tmp/rlmill-cluster")
    with pytest.raises(ClusterError, match="15 characters"):
        Cluster("/var/tmp/x", prefix="a-much-too-long")
    c = Cluster("/var/tmp/rlmill-cluster-unit", prefix="rlmu", subnet="10.9.8")
    assert (c.addr("api"), c.netns("train1"), c.bridge) == ("10.9.8.10", "rlmu-train1", "rlmu0")
    assert c.pid("api") is None and c.init_pid("api") is None  # nothing booted


def test_the_image_is_the_checkout_and_the_environment_its_venv_builds_on():
    from deployments.cluster.hosts import image_paths

    paths = image_paths()
    assert paths[0] == str(REPO)
    # Each path is a real folder; whatever .venv chains to (scripts/ensure_venv.sh) is in it.
    assert all(os.path.isdir(p) for p in paths)
    import numpy  # a package of the environment: its folder must be inside the image

    assert any(Path(numpy.__file__).resolve().is_relative_to(Path(p).resolve()) for p in paths)


def test_the_supervisor_restarts_a_service_that_exits_and_stops_on_sigterm(tmp_path):
    """A service that exits is started again (with growing pauses while it fails); SIGTERM stops
    every service and the supervisor."""
    marks = tmp_path / "starts"
    code = ("import sys; from deployments.cluster.services import Supervisor; "
            f"sys.exit(Supervisor({{'flaky': ['sh', '-c', 'echo x >> {marks}; exit 1'], "
            f"'steady': ['sleep', '600']}}, dict(__import__('os').environ), logs={str(tmp_path / 'logs')!r}).run())")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (not marks.exists() or len(marks.read_text().split()) < 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(marks.read_text().split()) >= 3  # started, restarted after 1 s, then after 3 s
        assert "start sleep 600" in (tmp_path / "logs" / "steady.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("argv, expect", [
    (["--state", "/tmp/x", "status"], "outside /tmp"),
    (["kill", "nohost"], "invalid choice"),
])
def test_cli_mistakes_end_in_one_line_not_a_traceback(argv, expect):
    done = subprocess.run([sys.executable, "-m", "deployments.cluster", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and expect in done.stderr and "Traceback" not in done.stderr


def test_a_rank_of_another_node_loads_the_model_from_storage(tmp_path, s3_bucket_url, storage_config_s3,
                                                            monkeypatch):
    """Node 0 resolved model.path into a folder of its own; on another node that folder is not
    there, so the rank downloads the run's model.path (a storage URL) into its own cache."""
    import torch

    from gpu_jobs.train.ranks.worker import model_folder
    from storage import save_checkpoint

    here = tmp_path / "node0-folder"
    here.mkdir()
    assert model_folder(str(here), "s3://anything", None) == str(here)  # the folder is here: used as is

    url = f"{s3_bucket_url}/models/m"
    save_checkpoint(url, {"w": torch.arange(4.0)}, config={"model_type": "toy"}, storage=storage_config_s3)
    monkeypatch.setenv("RLMILL_CACHE_DIR", str(tmp_path / "node1-cache"))
    got = model_folder(str(tmp_path / "not-on-this-node"), url, storage_config_s3)
    assert Path(got).is_relative_to(tmp_path / "node1-cache") and (Path(got) / "config.json").exists()

    with pytest.raises(FileNotFoundError, match="storage URL every node reaches"):
        model_folder(str(tmp_path / "not-on-this-node"), "builtin", None)


def _s3_store(journal: Path, port: int):
    import boto3

    proc = subprocess.Popen([sys.executable, "-m", "deployments.cluster.s3_store", "--port", str(port), "--journal",
                             str(journal)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="k",
                          aws_secret_access_key="s", region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.list_buckets()
            return proc, client
        except Exception:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)


def test_the_s3_host_serves_after_a_sigkill_what_it_had_stored(tmp_path):
    """deployments/cluster/s3_store.py: objects (one over 8 MB, one multipart), a delete, then SIGKILL;
    the restarted server serves exactly what was stored."""
    from tests.servers import free_port

    journal, port, big = tmp_path / "s3" / "journal.jsonl", free_port(), os.urandom(6 * 2**20)
    proc, c = _s3_store(journal, port)
    try:
        c.create_bucket(Bucket="rlmill")
        c.put_object(Bucket="rlmill", Key="runs/a/model.safetensors", Body=big)
        c.put_object(Bucket="rlmill", Key="runs/a/gone", Body=b"x")
        c.delete_object(Bucket="rlmill", Key="runs/a/gone")
        upload = c.create_multipart_upload(Bucket="rlmill", Key="runs/a/multi")["UploadId"]
        parts = [{"PartNumber": n, "ETag": c.upload_part(Bucket="rlmill", Key="runs/a/multi", PartNumber=n,
                                                          UploadId=upload, Body=big[: 5 * 2**20 + n])["ETag"]}
                 for n in (1, 2)]
        c.complete_multipart_upload(Bucket="rlmill", Key="runs/a/multi", UploadId=upload,
                                    MultipartUpload={"Parts": parts})
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with open(journal, "a") as f:  # killed mid-append: a torn last line
        f.write('{"method": "PUT", "url": "http://127.0.0.1/rlmill/torn')
    proc, c = _s3_store(journal, port)
    try:
        keys = [o["Key"] for o in c.list_objects_v2(Bucket="rlmill")["Contents"]]
        assert sorted(keys) == ["runs/a/model.safetensors", "runs/a/multi"]
        assert c.get_object(Bucket="rlmill", Key="runs/a/model.safetensors")["Body"].read() == big
        assert c.head_object(Bucket="rlmill", Key="runs/a/multi")["ContentLength"] == 2 * 5 * 2**20 + 3
        c.put_object(Bucket="rlmill", Key="runs/a/after", Body=b"y")  # journaled after the cut torn line
    finally:
        proc.terminate()
        assert proc.wait(20) == 0  # SIGTERM: a clean stop
    proc, c = _s3_store(journal, port)  # and once more: the journal is whole again
    try:
        assert c.get_object(Bucket="rlmill", Key="runs/a/after")["Body"].read() == b"y"
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_journal_damaged_before_its_last_line_is_refused_with_the_fix(tmp_path):
    from deployments.cluster.s3_store import entries

    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"method": "PUT", "url": "http://h/b"}\nnot json\n{"method": "GET", "url": "http://h/b"}\n')
    with pytest.raises(SystemExit, match="line 2 is not JSON .* move the journal aside"):
        entries(str(journal))
    journal.write_text('{"method": "PUT", "url": "http://h/b"}\n{"method": "PU')
    assert [e["method"] for e in entries(str(journal))] == ["PUT"]
