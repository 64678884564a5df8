"""The shared storage suite for sharded Parquet tables: every test runs on local disk,
memory:// and s3:// (moto) through the `storage_root` fixture."""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow as pa
import pytest

from storage import (
    CorruptShardError,
    ManifestExistsError,
    NotCommittedError,
    RunLayout,
    committed,
    gc_uncommitted,
    join,
    read_manifest,
    read_table,
    url_to_fs,
    write_table,
)


def rollout_table(n_rows: int = 50, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 20, size=n_rows)
    return pa.table({
        "uid": pa.array([f"u{i}" for i in range(n_rows)]),
        "prompt_ids": pa.array([rng.integers(0, 1000, 5).astype(np.int32) for _ in range(n_rows)],
                               pa.list_(pa.int32())),
        "response_ids": pa.array([rng.integers(0, 1000, n).astype(np.int32) for n in lens],
                                 pa.list_(pa.int32())),
        "rollout_logprobs": pa.array([(-rng.random(n)).astype(np.float32) for n in lens],
                                     pa.list_(pa.float32())),
        "response_len": pa.array(lens.astype(np.int32)),
    })


def test_round_trip_lists_exact(storage_root):
    table = rollout_table()
    dest = join(storage_root.url, "stage")
    uri = write_table(dest, table, rows_per_shard=16, inputs=["s3://x/in/_MANIFEST.json"],
                      metrics={"n": np.int64(50)}, storage=storage_root.storage)
    assert uri == join(dest, "_MANIFEST.json")
    back = read_table(uri, storage=storage_root.storage)
    assert back.schema == table.schema
    assert back.equals(table)
    assert read_table(dest, columns=["response_ids"], storage=storage_root.storage).column_names == ["response_ids"]
    m = read_manifest(dest, storage=storage_root.storage)
    assert len(m.files) == 4 and sum(f.rows for f in m.files) == 50 == m.num_rows
    assert m.inputs == ["s3://x/in/_MANIFEST.json"] and m.metrics == {"n": 50}
    assert "list<item: int32>" in m.extra["arrow_schema"] and m.schema_version == 1 and m.created_at
    assert m.kind == "table"


def test_empty_table_keeps_schema(storage_root):
    table = rollout_table(0)
    uri = write_table(join(storage_root.url, "empty"), table, storage=storage_root.storage)
    assert read_table(uri, storage=storage_root.storage).schema == table.schema


def test_second_commit_raises_and_first_stays(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "stage")
    first = write_table(dest, rollout_table(10, seed=1), storage=s)
    with pytest.raises(ManifestExistsError):
        write_table(dest, rollout_table(10, seed=2), storage=s)
    assert read_table(first, storage=s).equals(rollout_table(10, seed=1))


def test_create_only_commit_race_leaves_first_intact(storage_root, monkeypatch):
    """Two attempts both pass the early exists() check; only the create-only write decides."""
    import storage.tables as tables

    s = storage_root.storage
    dest = join(storage_root.url, "stage")
    write_table(dest, rollout_table(10, seed=1), storage=s)
    fs, _ = url_to_fs(dest, s)
    monkeypatch.setattr(tables, "ensure_uncommitted", lambda *a, **kw: None)
    with pytest.raises(ManifestExistsError):
        tables.write_table(dest, rollout_table(10, seed=2), storage=s)
    assert read_table(dest, storage=s).equals(rollout_table(10, seed=1))
    # The loser's shards are orphans: invisible to readers, removed by gc.
    assert len(fs.ls(url_to_fs(dest, s)[1])) == 3
    assert len(gc_uncommitted(dest, storage=s)) == 1
    assert read_table(dest, storage=s).num_rows == 10


def _shard_path(storage_root, dest):
    m = read_manifest(dest, storage=storage_root.storage)
    fs, path = url_to_fs(dest, storage_root.storage)
    return fs, join(path, m.files[0].path), m.files[0].path


def test_corrupted_shard_names_the_file(storage_root):
    dest = join(storage_root.url, "stage")
    write_table(dest, rollout_table(), storage=storage_root.storage)
    fs, path, name = _shard_path(storage_root, dest)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptShardError, match=name):
        read_table(dest, storage=storage_root.storage)


def test_truncated_shard_names_the_file(storage_root):
    dest = join(storage_root.url, "stage")
    write_table(dest, rollout_table(), storage=storage_root.storage)
    fs, path, name = _shard_path(storage_root, dest)
    fs.pipe_file(path, fs.cat_file(path)[:-10])
    with pytest.raises(CorruptShardError, match=f"{name}.*size"):
        read_table(dest, storage=storage_root.storage)


def test_missing_shard_is_reported(storage_root):
    dest = join(storage_root.url, "stage")
    write_table(dest, rollout_table(), storage=storage_root.storage)
    fs, path, _ = _shard_path(storage_root, dest)
    fs.rm_file(path)
    with pytest.raises(CorruptShardError):
        read_table(dest, storage=storage_root.storage)


def test_uncommitted_shards_are_invisible_and_gced(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "stage")
    fs, path = url_to_fs(dest, s)
    fs.pipe_file(join(path, "part-crashed-00000.parquet"), b"half a shard")
    assert committed(dest, storage=s) is None
    with pytest.raises(NotCommittedError):
        read_table(dest, storage=s)
    # Within the grace period a writer may still be running: nothing is deleted.
    assert gc_uncommitted(dest, storage=s) == []
    assert gc_uncommitted(dest, grace_seconds=0, storage=s) == [join(dest, "part-crashed-00000.parquet")]
    assert not fs.exists(join(path, "part-crashed-00000.parquet"))


def test_gc_keeps_listed_shards(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "stage")
    fs, path = url_to_fs(dest, s)
    fs.pipe_file(join(path, "part-orphan-00000.parquet"), b"x")
    uri = write_table(dest, rollout_table(), rows_per_shard=20, storage=s)
    assert committed(dest, storage=s) == uri
    assert gc_uncommitted(dest, storage=s) == [join(dest, "part-orphan-00000.parquet")]
    assert read_table(uri, storage=s).num_rows == 50
    assert gc_uncommitted(join(storage_root.url, "nothing-here"), storage=s) == []


def test_concurrent_writers_to_different_stages(storage_root):
    s = storage_root.storage
    layout = RunLayout(storage_root.url, "run-1", storage=s)
    errors, uris = [], {}

    def work(i: int) -> None:
        try:
            uris[i] = write_table(layout.stage(0, f"stage{i}"), rollout_table(30, seed=i),
                                  rows_per_shard=10, storage=s)
        except Exception as e:  # surfaced below with the thread's index
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i, uri in uris.items():
        assert read_table(uri, storage=s).equals(rollout_table(30, seed=i))


def test_same_stage_concurrent_commit_has_one_winner(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "stage")
    outcomes = []

    def work(i: int) -> None:
        try:
            write_table(dest, rollout_table(10, seed=i), storage=s)
            outcomes.append(("ok", i))
        except ManifestExistsError:
            outcomes.append(("exists", i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for kind, i in outcomes if kind == "ok"]
    assert len(winners) == 1 and len(outcomes) == 3
    assert read_table(dest, storage=s).equals(rollout_table(10, seed=winners[0]))


def test_manifest_is_json_with_file_hashes(storage_root):
    dest = join(storage_root.url, "stage")
    uri = write_table(dest, rollout_table(), storage=storage_root.storage)
    fs, path = url_to_fs(uri, storage_root.storage)
    body = json.loads(fs.cat_file(path))
    assert {"files", "schema_version", "inputs", "metrics", "created_at", "arrow_schema"} <= set(body)
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in body["files"])
