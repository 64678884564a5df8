"""The storage root is checked before a run starts (storage.probe.check_root): an unreachable S3
endpoint, a missing bucket, refused credentials or a folder that cannot be written end in one
line naming the problem and the fix, before the Prefect API starts and before anything is
written; a usable root is left exactly as it was. Against a real S3 endpoint (moto)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from storage import StorageConfig
from storage.probe import StorageCheckError, check_root
from tests.servers import free_port
from tests.tiny import EXAMPLE, REPO, tiny_overrides


def _bucket_keys(s3_endpoint: dict, bucket_url: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint["endpoint_url"], aws_access_key_id=s3_endpoint["key"],
                          aws_secret_access_key=s3_endpoint["secret"], region_name="us-east-1")
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket_url.removeprefix("s3://")).get("Contents", [])]


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create anything in: a chmod 555 folder, or for root (whom
    permissions do not stop) a sysfs folder. Checked, so the test never passes by accident."""
    import tempfile

    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
    else:
        folder = Path("/sys")
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError:
        return folder
    pytest.skip(f"{folder} is writable here: no read-only folder to test with")


# ------------------------------------------------------------------------------------- check_root
def test_a_usable_local_root_passes_and_is_left_as_it_was(tmp_path):
    check_root(str(tmp_path / "new" / "root"))  # missing folders are fine: the run creates them
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "root").mkdir()
    check_root(f"file://{tmp_path / 'root'}")
    assert list((tmp_path / "root").iterdir()) == []


def test_a_local_root_that_cannot_be_written_is_one_line(tmp_path):
    folder = _unwritable_folder(tmp_path)
    with pytest.raises(StorageCheckError, match=r"is not writable .*: set root= to a folder you can write") as e:
        check_root(str(folder / "rlmill-root"))
    assert "\n" not in str(e.value)
    check_root(str(folder / "rlmill-root"), write=False)  # reading (verify) is not refused
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(StorageCheckError, match="a-file is a file, not a folder"):
        check_root(str(tmp_path / "a-file" / "root"))


@pytest.mark.s3
def test_a_usable_bucket_passes_and_keeps_no_probe_object(s3_endpoint, s3_bucket_url, storage_config_s3):
    check_root(f"{s3_bucket_url}/some/prefix", storage_config_s3)
    check_root(s3_bucket_url, storage_config_s3)
    assert _bucket_keys(s3_endpoint, s3_bucket_url) == []


@pytest.mark.s3
def test_a_missing_bucket_is_one_line_with_the_fix(storage_config_s3):
    with pytest.raises(StorageCheckError) as e:
        check_root("s3://no-such-bucket-here/root", storage_config_s3)
    assert str(e.value).startswith("storage root s3://no-such-bucket-here/root: S3 bucket 'no-such-bucket-here' "
                                   "does not exist at http://127.0.0.1:")
    assert "create it first" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.s3
def test_refused_credentials_are_one_line_without_the_secret(moto_server_factory):
    endpoint = moto_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})  # checks keys: none is valid
    cfg = StorageConfig(endpoint_url=endpoint, key="AKIAWRONGKEY", secret="WRONGSECRETVALUE")
    with pytest.raises(StorageCheckError, match="rejected the credentials for bucket 'bucket-x'") as e:
        check_root("s3://bucket-x/root", cfg)
    assert "AWS_ACCESS_KEY_ID" in str(e.value) and "WRONGSECRETVALUE" not in str(e.value)


def test_an_endpoint_that_does_not_answer_is_retried_briefly_then_one_line():
    cfg = StorageConfig(endpoint_url=f"http://127.0.0.1:{free_port()}", key="k", secret="s")  # nothing listens
    assert cfg.retry_budget_seconds == 300  # the run's budget; the check has its own, short one
    with pytest.raises(StorageCheckError) as e:
        check_root("s3://bucket-x/root", cfg, budget_s=1.0)
    text = str(e.value)
    # How long it retried depends on the machine's load (a connect attempt can outlast the budget):
    # the line names the elapsed seconds, whatever they were.
    assert re.search(rf"no answer from S3 at {re.escape(cfg.endpoint_url)} \(retried for \d+ s;", text), text
    assert "that the S3 server is running" in text and "retry_budget_seconds" not in text


# ----------------------------------------------------------------------- `rlmill train`, before Prefect
def _rlmill_train(*overrides: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _rlmill("train", "--config", str(EXAMPLE), *overrides, cwd=cwd,
                   env={"RLMILL_LOCK_DIR": str(cwd / "locks"), **(env or {})})


def _rlmill(*argv: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_API_URL"))}
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**base, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", **env})


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stdout == "", proc.stdout  # not even the run id: nothing started
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlmill: storage root "), proc.stderr
    return lines[0]


@pytest.mark.s3
def test_train_with_a_missing_bucket_or_a_read_only_root_stops_in_one_line(s3_endpoint, tmp_path):
    env = {"AWS_ENDPOINT_URL": s3_endpoint["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_endpoint["key"],
           "AWS_SECRET_ACCESS_KEY": s3_endpoint["secret"]}
    line = _one_line(_rlmill_train(*tiny_overrides("s3://no-such-bucket-here/rl"), cwd=tmp_path, env=env))
    assert "S3 bucket 'no-such-bucket-here' does not exist" in line
    assert list(tmp_path.iterdir()) == []  # no lock, no .rlmill
    # docs/guide/verl-data-s3.md's `rlmill data make ... --out s3://my-bucket/...`, bucket not made yet: the same line.
    line = _one_line(_rlmill("data", "make", "arith", "--out", "s3://no-such-bucket-here/data", cwd=tmp_path, env=env))
    assert "S3 bucket 'no-such-bucket-here' does not exist" in line
    folder = _unwritable_folder(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    line = _one_line(_rlmill_train(*tiny_overrides(str(folder / "rlmill-root")), cwd=tmp_path))
    assert "is not writable" in line
    assert sorted(tmp_path.rglob("*")) == before


def test_train_with_an_endpoint_that_does_not_answer_stops_in_one_line(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"
    line = _one_line(_rlmill_train(*tiny_overrides("s3://bucket-x/rl"), f"storage.endpoint_url={endpoint}",
                                   "storage.key=k", "storage.secret=s", cwd=tmp_path))
    assert f"no answer from S3 at {endpoint} (retried for " in line
    assert list(tmp_path.iterdir()) == []  # no lock, no .rlmill


# ------------------------------------------------------------------------------ the flow's first step
@pytest.mark.s3
def test_the_flow_checks_storage_first_and_names_it_in_one_line(storage_config_s3, tmp_path, monkeypatch):
    """Deployment runs meet the same check: the rl-training flow's first step (check_startable)
    raises it, and its Failed state message is the line (user_error_line)."""
    from flows.config import load_run_config
    from flows.user_errors import check_startable, user_error_line

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    storage = [f"storage.endpoint_url={storage_config_s3.endpoint_url}"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", storage_config_s3.key.get_secret_value())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", storage_config_s3.secret.get_secret_value())
    cfg = load_run_config(str(EXAMPLE), [*tiny_overrides("s3://no-such-bucket-here/rl"), *storage, "run_id=r1"])
    with pytest.raises(StorageCheckError) as e:
        check_startable(cfg)
    assert user_error_line(e.value, cfg) == str(e.value)
    assert not (tmp_path / "locks").exists() or not any((tmp_path / "locks").iterdir())


def test_check_bucket_false_turns_the_s3_check_off():
    """For credentials that may not HEAD a bucket or delete objects (storage.check_bucket's help)."""
    cfg = StorageConfig(endpoint_url=f"http://127.0.0.1:{free_port()}", key="k", secret="s", check_bucket=False)
    check_root("s3://bucket-x/root", cfg, budget_s=30.0)  # nothing listens there: no request was sent


def test_a_root_with_credentials_or_an_unknown_scheme_is_one_line_without_them():
    with pytest.raises(StorageCheckError, match="credentials inside the URL are not accepted") as e:
        check_root("s3://AKIAKEY:se/cret@bucket-x/root")
    assert "se/cret" not in str(e.value) and "AKIAKEY" not in str(e.value)
    with pytest.raises(StorageCheckError, match="unsupported URL scheme 's4://'"):
        check_root("s4://bucket-x/root")
