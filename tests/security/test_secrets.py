"""S3 credentials and tokens never appear in logs, artifacts, manifests, run.json or errors.

    .venv/bin/python -m pytest -q tests/security/test_secrets.py

The fast tests cover every way a user hands credentials over (YAML file, dotted overrides,
AWS_* variables), config errors, URLs with `user:secret@` inside, and storage errors. The slow
one trains a real run on S3 (moto) with `rlmill train` (the rl-training Prefect flow) and
distinctive credentials, then searches everything the run left behind for them: its stdout and
stderr, Prefect's stored logs, flow/task runs and artifacts (read back through the API), every
object in the bucket, TensorBoard events, Prefect's persisted task results. A run that fails on
storage is searched the same way, plus every log record the process created.

Logs are searched at INFO, the level a run logs at. botocore's own opt-in DEBUG wire log prints
request headers, which hold the access key id and the session token (never the secret key);
that is outside rlmill's control.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.config import ConfigError, frozen_config, load_run_config
from storage import StorageConfig, redact_url, url_to_fs, write_table
from storage.errors import BucketNotFoundError, CredentialsError, UnsupportedURLError
from storage.probe import StorageCheckError

REPO = Path(__file__).resolve().parents[2]


def _leaks(haystacks: dict[str, str | bytes], secrets: dict[str, str]) -> list[str]:
    """'<where>: <which secret>' for every secret found in any haystack."""
    found = []
    for where, text in haystacks.items():
        for which, value in secrets.items():
            needle = value.encode() if isinstance(text, bytes) else value
            if needle in text:
                found.append(f"{where}: {which}")
    return found


def _full_error(e: BaseException) -> str:
    """What a log would show: the message, the repr and the whole chained traceback."""
    return f"{e}\n{e!r}\n" + "".join(traceback.format_exception(e))


def _config_file(tmp_path: Path, example_path: Path, storage: dict) -> Path:
    data = yaml.safe_load(example_path.read_text())
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**data, "storage": storage}))
    return path


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("source", ["yaml file", "overrides", "AWS_* variables"])
def test_credentials_from_each_source_are_used_but_never_shown(source, secrets, tmp_path, example_path,
                                                               monkeypatch, capsys):
    from flows.cli import main

    path, overrides = str(example_path), []
    if source == "yaml file":
        path = str(_config_file(tmp_path, example_path, {"key": secrets.key, "secret": secrets.secret,
                                                         "token": secrets.token}))
    elif source == "overrides":
        overrides = [f"storage.key={secrets.key}", f"storage.secret={secrets.secret}", f"storage.token={secrets.token}"]
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", secrets.key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets.secret)
        monkeypatch.setenv("AWS_SESSION_TOKEN", secrets.token)
    cfg = load_run_config(path, overrides)
    opts = cfg.storage.s3fs_options()  # the positive control: the credentials do reach s3fs
    assert (opts["key"], opts["secret"], opts["token"]) == (secrets.key, secrets.secret, secrets.token)
    main(["config", "show", "--config", path, *overrides])
    shown = {"repr": repr(cfg), "str": str(cfg), "json": cfg.model_dump_json(),
             "run.json": json.dumps(frozen_config(cfg)), "rlmill config show": capsys.readouterr().out}
    assert "storage" in shown["rlmill config show"]
    assert _leaks(shown, secrets.all()) == []


def test_config_errors_never_echo_credentials(secrets, example_path):
    from flows.config import RunConfig

    errors = []
    with pytest.raises(ConfigError) as e:
        load_run_config(example_path, [f"storage.key={secrets.key}", f"storage.secret={secrets.secret}", "rollout.n=1"])
    errors.append(e.value)
    # Constructed directly, pydantic would echo the rejected input: the key sits near its start.
    with pytest.raises(ValueError) as e:
        RunConfig.model_validate({"storage": {"key": secrets.key}, "rollout": {"n": 1}})
    errors.append(e.value)
    for bad in ({"key": [secrets.key]}, {"secret": {"x": secrets.secret}}, {"token": 1, "key": secrets.key},
                {"endpoint_url": f"{secrets.key}:{secrets.secret}@127.0.0.1:9000", "key": secrets.key}):
        with pytest.raises(ValueError) as e:
            StorageConfig(**bad)
        errors.append(e.value)
    assert _leaks({f"error {i}": _full_error(x) for i, x in enumerate(errors)}, secrets.all()) == []


# ----------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("url, shown", [
    ("s3://KEYID:SECRETVALUE@bucket/x", "s3://bucket/x"),
    ("s3://KEYID:wJal/SECRET+VALUE@bucket/x", "s3://bucket/x"),  # AWS secrets hold '/'
    ("s3://KEYID:wJal/SEC/RET@bucket/dir/a@b", "s3://bucket/dir/a@b"),
    ("s3://KEYID:12/34567@bucket/x", "s3://bucket/x"),  # digits after ':' still are no bucket
    ("s3a://KEYID:SECRET?VALUE@bucket/x", "s3a://bucket/x"),
    ("s3://KEYID:SECRET#VALUE@bucket/x", "s3://bucket/x"),
    ("s3://KEYID@bucket/x", "s3://bucket/x"),
    ("http://KEYID:SECRETVALUE@host:9000/p", "http://host:9000/p"),
    ("http://KEYID:SEC/RETVALUE@host:9000/p", "http://host:9000/p"),
    # Not credentials: left alone.
    ("s3://bucket/a@b.txt", "s3://bucket/a@b.txt"),
    ("http://host:9000/a@b", "http://host:9000/a@b"),
    ("http://[::1]:9000/x", "http://[::1]:9000/x"),
    ("memory://x/a@b", "memory://x/a@b"),
    ("/local/a@b:c", "/local/a@b:c"),
])
def test_urls_with_credentials_are_redacted(url, shown):
    assert redact_url(url) == shown
    assert "KEYID" not in redact_url(url) and "SECRET" not in redact_url(url) and "VALUE" not in redact_url(url)


@settings(max_examples=300, deadline=None)
@given(key=st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=12, max_size=16),
       secret=st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/+", min_size=1, max_size=40),
       path=st.text("abcdefghijklmnopqrstuvwxyz/_.@-", max_size=20))
def test_any_s3_url_with_credentials_is_redacted_and_refused(key, secret, path):
    # Fixed prefixes keep a drawn value from matching error text by chance (Hypothesis also
    # draws string constants found in the code, e.g. "UnsupportedURLEr").
    key, secret = f"AKIA{key}", f"wJ9x/{secret}"
    url = f"s3://{key}:{secret}@bkt/{path}"
    assert redact_url(url) == f"s3://bkt/{path}"
    with pytest.raises(UnsupportedURLError) as e:  # refused before any request is made
        url_to_fs(url, StorageConfig(endpoint_url="http://127.0.0.1:9", check_bucket=False))
    assert _leaks({"error": _full_error(e.value)}, {"key": key, "secret": secret}) == []


@pytest.mark.parametrize("key", ["root", "data.train_files", "model.path", "reward.custom_reward_function.path",
                                 "storage.endpoint_url"])
def test_config_refuses_urls_with_credentials_without_echoing_them(key, secrets, example_path):
    value = {"root": f"s3://{secrets.key}:{secrets.secret}@bucket/rl",
             "data.train_files": f"[s3://{secrets.key}:{secrets.secret}@bucket/train.parquet]",
             "model.path": f"s3://{secrets.key}:{secrets.secret}@bucket/model",
             "reward.custom_reward_function.path": f"s3://{secrets.key}:{secrets.secret}@bucket/r.py",
             "storage.endpoint_url": f"http://{secrets.key}:{secrets.secret}@127.0.0.1:9000"}[key]
    with pytest.raises(ConfigError, match=f"{key.replace('.', '[.]')}.*credentials") as e:
        load_run_config(example_path, [f"{key}={value}"])
    assert _leaks({"error": _full_error(e.value)}, secrets.all()) == []


def test_manifest_inputs_are_redacted(secrets):
    import pyarrow as pa

    root = f"memory://rlmill-sec-{uuid.uuid4().hex[:8]}"
    inputs = [f"s3://{secrets.key}:{secrets.secret}@other/in", f"s3://{secrets.key}:{secrets.token}/x@other/in2"]
    uri = write_table(f"{root}/t", pa.table({"x": [1]}), inputs=inputs)
    fs, path = url_to_fs(uri)
    body = fs.cat_file(path)
    assert b"s3://other/in" in body and b"s3://other/in2" in body
    assert _leaks({"manifest": body}, secrets.all()) == []
    fs.rm(root.removeprefix("memory://"), recursive=True)


# ----------------------------------------------------------------------------- storage errors
@pytest.fixture(scope="module")
def auth_moto(moto_server_factory):
    """A moto server that checks credentials (no IAM user exists, so every key is refused)."""
    return moto_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


@pytest.mark.s3
def test_storage_errors_carry_no_credentials(secrets, s3_endpoint, s3_bucket_url, auth_moto):
    from storage import read_table

    good = StorageConfig(endpoint_url=s3_endpoint["endpoint_url"], key=secrets.key, secret=secrets.secret,
                         token=secrets.token)
    errors = {}
    with pytest.raises(BucketNotFoundError) as e:
        url_to_fs(f"s3://rlmill-no-such-{uuid.uuid4().hex[:8]}/x", good)
    errors["missing bucket"] = e.value
    with pytest.raises(FileNotFoundError) as e:  # an existing bucket, nothing committed there
        read_table(f"{s3_bucket_url}/runs/r/iterations/1/rollout", storage=good)
    errors["missing manifest"] = e.value
    fs, path = url_to_fs(s3_bucket_url, good)
    with pytest.raises(FileNotFoundError) as e:
        fs.cat_file(f"{path}/nothing-here")
    errors["missing object"] = e.value
    refused = good.model_copy(update={"endpoint_url": auth_moto})
    with pytest.raises(CredentialsError, match="rejected the credentials") as e:
        url_to_fs("s3://some-bucket/x", refused)
    errors["refused credentials"] = e.value
    assert _leaks({k: _full_error(v) for k, v in errors.items()}, secrets.all()) == []


# ----------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def prefect_api():
    """A Prefect API of this module's own (~10-20 s to start); yields its URL."""
    from tests.servers import module_prefect_api

    with module_prefect_api() as url:
        yield url


async def _all_pages(read, **kwargs) -> list:
    out, offset = [], 0
    while True:
        page = await read(limit=200, offset=offset, **kwargs)
        out += page
        if len(page) < 200:
            return out
        offset += 200


def _prefect_records(api_url: str) -> dict[str, str]:
    """Every flow run, task run, log and artifact the Prefect API at `api_url` stored, as JSON."""
    from prefect.client.orchestration import PrefectClient
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()  # logs reach the API from a background worker

    async def read():
        async with PrefectClient(api_url) as client:
            return {kind: await _all_pages(getattr(client, f"read_{kind}"))
                    for kind in ("flow_runs", "task_runs", "logs", "artifacts")}

    return {f"prefect {kind}": "\n".join(r.model_dump_json() for r in rows)
            for kind, rows in asyncio.run(read()).items()}


def _local_files(*folders: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for folder in folders if folder.exists() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def log_records():
    """Every log record any logger of this process creates, at the levels configured.

    A record factory rather than a handler: Prefect re-configures logging when a flow starts
    (dictConfig drops the handlers on the root logger, caplog's included)."""
    records, make = [], logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        records.append(make(*args, **kwargs))
        return records[-1]

    logging.setLogRecordFactory(factory)
    yield records
    logging.setLogRecordFactory(make)


def _formatted(records) -> str:
    fmt = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(fmt.format(r) for r in records)


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.deepspeed
@pytest.mark.s3
def test_a_real_run_on_s3_leaks_no_credentials(prefect_api, secrets, s3_endpoint, s3_bucket_url, tmp_path,
                                               example_path, tiny):
    from gpu_jobs.train.ranks.dist import child_env

    # `rlmill train` as a user runs it: key and secret in the config file, the session token
    # from the environment. Extra loggers at INFO put boto/s3fs/DeepSpeed logs on the console
    # and in Prefect's API too, so both are searched.
    config = _config_file(tmp_path, example_path, {"endpoint_url": s3_endpoint["endpoint_url"],
                                                   "key": secrets.key, "secret": secrets.secret})
    root, run_id = f"{s3_bucket_url}/rl", "sec-s3"
    overrides = tiny(root, f"run_id={run_id}", "trainer.total_iterations=1", "trainer.tensorboard=true",
                     "trainer.checkpoint_every=1")
    env = {**child_env(), "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "AWS_SESSION_TOKEN": secrets.token, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "RLMILL_LOCK_DIR": str(tmp_path / "locks"), "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results"),
           "PREFECT_LOGGING_EXTRA_LOGGERS": "rlmill,botocore,boto3,s3fs,fsspec,urllib3,aiobotocore,deepspeed"}
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(config), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]

    fs, bucket = url_to_fs(s3_bucket_url, StorageConfig(**s3_endpoint))
    objects = {f"s3://{p}": fs.cat_file(p) for p in fs.find(bucket)}
    # TensorBoard events of an s3:// root go to $XDG_CACHE_HOME/rlmill/tensorboard/<run_id>.
    local = _local_files(tmp_path / "xdg", tmp_path / "results", tmp_path / "locks")
    prefect = _prefect_records(prefect_api)
    # Positive controls: each place searched below really holds what the run wrote there.
    assert any(k.endswith(f"runs/{run_id}/run.json") for k in objects)
    assert any(k.endswith("/_MANIFEST.json") for k in objects) and any(k.endswith("policy/config.json") for k in objects)
    assert any("tfevents" in k for k in local) and any("results" in k for k in local)
    assert "iterations committed" in prefect["prefect logs"] and f"{run_id}-metrics" in prefect["prefect artifacts"]
    assert "iter-0001" in prefect["prefect flow_runs"] and "held-out mean score (val/acc)" in proc.stdout
    haystacks = {**objects, **local, **prefect, "stdout": proc.stdout, "stderr": proc.stderr}
    assert _leaks(haystacks, secrets.all()) == []


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.s3
def test_a_run_that_fails_on_storage_leaks_no_credentials(prefect_api, secrets, s3_endpoint, tmp_path,
                                                          example_path, tiny, monkeypatch, log_records):
    from flows.training import rl_training

    # Key and secret from the environment this time, the token from the config file.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", secrets.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets.secret)
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    config = _config_file(tmp_path, example_path, {"endpoint_url": s3_endpoint["endpoint_url"], "token": secrets.token})
    missing = f"s3://rlmill-no-such-{uuid.uuid4().hex[:8]}/rl"
    with pytest.raises(StorageCheckError) as e:  # the flow checks its root first
        rl_training(config=str(config), overrides=tiny(missing, "run_id=sec-fail"), iterations=1)
    prefect = _prefect_records(prefect_api)
    assert "does not exist" in prefect["prefect logs"]  # the failure was logged
    assert "does not exist" in _formatted(log_records)  # ...and went through this process's loggers
    haystacks = {"exception": _full_error(e.value), **prefect, "log records": _formatted(log_records)}
    assert _leaks(haystacks, secrets.all()) == []


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.s3
def test_credentials_passed_as_cli_overrides_stay_out_of_prefect(prefect_api, secrets, s3_endpoint, tmp_path,
                                                                example_path, tiny, monkeypatch):
    # Prefect stores flow parameters, so `rlmill train storage.secret=...` must not pass them as
    # overrides: the CLI moves them into AWS_* variables. (A deployment's `-p overrides=[...]` is
    # stored by Prefect before any rlmill code runs: the README says to use the worker's env.)
    from flows.cli import main

    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path / "locks"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, "")  # restored after the test; the CLI sets them
    creds = [f"storage.endpoint_url={s3_endpoint['endpoint_url']}", f"storage.key={secrets.key}",
             f"storage.secret={secrets.secret}", f"storage.token={secrets.token}"]
    missing = f"s3://rlmill-no-such-{uuid.uuid4().hex[:8]}/rl"  # fails at once: only the parameters matter
    # The CLI's storage check would refuse the bucket before the flow starts; this test is about
    # what the flow stores, so let it start and fail on the bucket itself.
    monkeypatch.setattr("storage.probe.check_root", lambda *args, **kwargs: None)
    with pytest.raises(BucketNotFoundError):
        main(["train", "--config", str(example_path), *tiny(missing, "run_id=sec-params", *creds),
              "trainer.total_iterations=1"])
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == secrets.secret
    assert _leaks(_prefect_records(prefect_api), secrets.all()) == []
