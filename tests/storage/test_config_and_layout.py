"""URL resolution, configuration errors, create-only/pointer files and the run layout."""

from __future__ import annotations

import json
import socket

import pytest

from storage import (
    BucketNotFoundError,
    CredentialsError,
    InvalidNameError,
    ModelLayout,
    ObjectExistsError,
    RunLayout,
    StorageConfig,
    StorageError,
    UnsupportedURLError,
    join,
    read_pointer,
    url_to_fs,
    write_once,
    write_pointer,
    write_table,
)


def test_url_to_fs_backends(tmp_path):
    fs, path = url_to_fs(str(tmp_path / "a"))
    assert path == str(tmp_path / "a")
    fs2, path2 = url_to_fs(f"file://{tmp_path}/a")
    assert path2 == path and type(fs2) is type(fs)
    fs3, path3 = url_to_fs("memory://bucket/x")
    assert path3 == "/bucket/x"


def test_join():
    assert join("s3://b/root/", "runs", "r1/") == "s3://b/root/runs/r1"
    assert join("/tmp/x", "a") == "/tmp/x/a"
    assert join("memory://p", "a", "b") == "memory://p/a/b"


@pytest.mark.parametrize("url", ["s4://bucket/x", "gs://bucket/x", "", "http://x/y"])
def test_bad_scheme_is_one_line(url):
    with pytest.raises(UnsupportedURLError) as e:
        url_to_fs(url)
    assert "\n" not in str(e.value)


def test_config_hides_secrets():
    cfg = StorageConfig(endpoint_url="http://127.0.0.1:1", key="AKIDSECRETKEY", secret="SUPERSECRET")
    for text in (repr(cfg), str(cfg), cfg.model_dump_json()):
        assert "AKIDSECRETKEY" not in text and "SUPERSECRET" not in text
    assert cfg.s3fs_options()["secret"] == "SUPERSECRET"
    assert "region_name" not in cfg.s3fs_options()["client_kwargs"]


def test_config_field_help_and_validation():
    assert all(f.description for f in StorageConfig.model_fields.values())
    with pytest.raises(ValueError, match="http://"):
        StorageConfig(endpoint_url="127.0.0.1:9000")
    with pytest.raises(ValueError):
        StorageConfig(endpointurl="http://x")  # typo'd field names are rejected


def test_config_falls_back_to_env(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    opts = StorageConfig(key="mine").s3fs_options()
    assert opts["key"] == "mine" and opts["secret"] == "envsecret"
    assert opts["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"


@pytest.mark.s3
def test_s3_from_env_vars(monkeypatch, s3_endpoint, s3_bucket_url):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint["endpoint_url"])
    fs, path = url_to_fs(f"{s3_bucket_url}/x")
    fs.pipe_file(f"{path}/f", b"hi")
    assert fs.cat_file(f"{path}/f") == b"hi"


@pytest.mark.s3
def test_missing_bucket_is_one_line(storage_config_s3):
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-rlmill.*create it") as e:
        url_to_fs("s3://no-such-bucket-rlmill/x", storage_config_s3)
    assert "\n" not in str(e.value)


@pytest.mark.s3
def test_unreachable_endpoint_is_storage_error(monkeypatch):
    import storage.fs

    monkeypatch.setattr(storage.fs, "FIRST_CONTACT_BUDGET_S", 2.0)  # 15 s as shipped: the same path, shorter
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = StorageConfig(endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s")
    with pytest.raises(StorageError, match="endpoint_url") as e:
        url_to_fs("s3://bucket-x/y", cfg)
    # First contact: a wrong endpoint_url is a typo to report within FIRST_CONTACT_BUDGET_S, not
    # an outage to wait out for the whole 5-minute retry budget.
    assert cfg.retry_budget_seconds == 300 and "retry_budget_seconds=2)" in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def auth_moto(moto_server_factory):
    """A second moto server that checks credentials (no IAM user exists, so all keys are bad)."""
    return moto_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


@pytest.mark.s3
def test_bad_credentials_are_one_line(auth_moto):
    cfg = StorageConfig(endpoint_url=auth_moto, key="AKIAWRONGWRONGWRONG", secret="S3CRETVALUE")
    with pytest.raises(CredentialsError, match="AWS_ACCESS_KEY_ID") as e:
        url_to_fs("s3://some-bucket/x", cfg)
    assert "\n" not in str(e.value) and "S3CRETVALUE" not in str(e.value)
    assert "rejected the credentials" in str(e.value) and "storage.key / storage.secret" in str(e.value)
    assert "StorageConfig" not in str(e.value)


@pytest.mark.s3
def test_credentials_never_in_manifest(storage_config_s3, s3_endpoint, s3_bucket_url):
    import pyarrow as pa

    uri = write_table(f"{s3_bucket_url}/t", pa.table({"x": [1]}), storage=storage_config_s3,
                      inputs=[f"s3://{s3_endpoint['key']}:{s3_endpoint['secret']}@other/in"])
    fs, path = url_to_fs(uri, storage_config_s3)
    body = fs.cat_file(path).decode()
    assert s3_endpoint["key"] not in body and s3_endpoint["secret"] not in body
    assert "s3://other/in" in body


def test_credentials_in_s3_url_rejected():
    with pytest.raises(UnsupportedURLError, match="config keys storage.key / storage.secret"):
        url_to_fs("s3://key:secret@bucket/x")


@pytest.mark.s3
def test_no_credentials_at_all_is_said_so_with_the_keys_to_set(s3_endpoint, monkeypatch):
    """examples/verl_dataset_s3.yaml without credentials: none were given, so none were
    "rejected"; the fix names the config keys (storage.key), not a class (StorageConfig.key)."""
    from storage.probe import StorageCheckError, check_root

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    bare = StorageConfig(endpoint_url=s3_endpoint["endpoint_url"])
    with pytest.raises(CredentialsError) as e:
        url_to_fs("s3://my-bucket/rlmill", bare)
    text = str(e.value)
    assert text.startswith("no S3 credentials were given for bucket 'my-bucket' at http://127.0.0.1:"), text
    assert "storage.key and storage.secret" in text and "AWS_ACCESS_KEY_ID" in text
    assert "rejected" not in text and "StorageConfig" not in text and "\n" not in text
    with pytest.raises(StorageCheckError, match=r"^storage root s3://my-bucket/rlmill: no S3 credentials were given"):
        check_root("s3://my-bucket/rlmill", bare)


def test_write_once_and_pointer(storage_root):
    s = storage_root.storage
    url = join(storage_root.url, "once.json")
    write_once(url, b"1", s)
    with pytest.raises(ObjectExistsError):
        write_once(url, b"2", s)
    assert url_to_fs(url, s)[0].cat_file(url_to_fs(url, s)[1]) == b"1"
    ptr = join(storage_root.url, "LATEST")
    assert read_pointer(ptr, s) is None
    write_pointer(ptr, "3", s)
    write_pointer(ptr, "4", s)
    assert read_pointer(ptr, s) == "4"
    fs, path = url_to_fs(storage_root.url, s)
    assert not [p for p in fs.find(path) if ".tmp-" in p]


def test_run_layout_paths_and_helpers(storage_root):
    layout = RunLayout(storage_root.url, "run-2026.11.29_a", storage=storage_root.storage)
    base = join(storage_root.url, "runs", "run-2026.11.29_a")
    assert layout.run_json == f"{base}/run.json"
    assert layout.stage(7, "rollout") == f"{base}/iterations/7/rollout"
    assert layout.policy(2) == f"{base}/checkpoints/2/policy"
    assert layout.trainer(2) == f"{base}/checkpoints/2/trainer"
    assert layout.latest == f"{base}/checkpoints/LATEST"
    assert layout.read_run_json() is None
    layout.write_run_json({"lr": 1e-4})
    with pytest.raises(ObjectExistsError):
        layout.write_run_json({"lr": 2e-4})
    assert layout.read_run_json() == {"lr": 1e-4}
    assert layout.latest_checkpoint() is None
    layout.set_latest(2)
    layout.set_latest(4)
    assert layout.latest_checkpoint() == 4
    models = ModelLayout(storage_root.url, "arith", storage=storage_root.storage)
    assert models.version("v3") == join(storage_root.url, "models", "arith", "versions", "v3")
    assert models.current_url() is None
    models.promote("v3")
    assert models.current_version() == "v3" and models.current_url() == models.version("v3")


@pytest.mark.parametrize("bad", ["..", "../x", "a/b", "", ".hidden", "a..b", "x y", "a\\b", "é", None, 3, "-rf"])
def test_path_escape_rejected(bad):
    with pytest.raises(InvalidNameError):
        RunLayout("/tmp/root", bad)
    with pytest.raises(InvalidNameError):
        RunLayout("/tmp/root", "ok").stage(0, bad)
    with pytest.raises(InvalidNameError):
        ModelLayout("/tmp/root", bad)


@pytest.mark.parametrize("k", [-1, "3", 1.5, True])
def test_bad_iteration_rejected(k):
    with pytest.raises(InvalidNameError):
        RunLayout("/tmp/root", "ok").stage(k, "rollout")


def test_numpy_iteration_accepted():
    import numpy as np

    assert RunLayout("/r", "ok").stage(np.int64(3), "rollout") == "/r/runs/ok/iterations/3/rollout"


def test_run_json_is_plain_json(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    layout.write_run_json({"a": 1})
    assert json.loads((tmp_path / "runs" / "r" / "run.json").read_text()) == {"a": 1}
