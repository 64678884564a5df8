"""The shared storage suite for the one commit primitive and the one verifier: every test runs
on local disk, memory:// and s3:// (moto) through the `storage_root` fixture."""

from __future__ import annotations

import json
import threading

import pytest

import storage.manifest as M
from storage import (
    CorruptShardError,
    ManifestExistsError,
    NotCommittedError,
    commit,
    committed,
    download_file,
    join,
    read_file,
    read_manifest,
    url_to_fs,
    verify,
    write_files,
)

BLOBS = {"a.bin": b"alpha" * 100, "sub/b.bin": b"beta" * 1000, "empty.bin": b""}


def _commit(dest, storage, blobs=BLOBS, **kw):
    files = write_files(dest, blobs, storage)
    return commit(dest, files, kind="test", storage=storage, **kw)


def _damage(fs, path, how):
    data = fs.cat_file(path)
    if how == "flip":
        fs.pipe_file(path, data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif how == "truncate":
        fs.pipe_file(path, data[:-3])
    else:
        fs.rm_file(path)


def test_commit_lists_every_file_and_verify_passes(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "c")
    assert committed(dest, s) is None
    uri = _commit(dest, s, inputs=["s3://KEY:secret@b/in/_MANIFEST.json"], metrics={"n": 3},
                  extra={"note": "hi"}, schema_version=2)
    assert uri == join(dest, "_MANIFEST.json") == committed(dest, s)
    m = verify(dest, s)
    assert m.kind == "test" and m.schema_version == 2 and m.metrics == {"n": 3} and m.extra == {"note": "hi"}
    assert m.inputs == ["s3://b/in/_MANIFEST.json"]  # credentials never reach a manifest
    assert {f.path: (f.size, f.rows) for f in m.files} == {
        "a.bin": (500, None), "sub/b.bin": (4000, None), "empty.bin": (0, None)}
    assert [read_file(m, f, s) for f in m.files] == list(BLOBS.values())
    assert M.read_files(m, storage=s) == list(BLOBS.values())
    fs, path = url_to_fs(uri, s)
    body = json.loads(fs.cat_file(path))
    assert body["format"] == "rlmill.manifest/1" and body["note"] == "hi"
    assert all(len(f["sha256"]) == 64 for f in body["files"]) and "rows" not in body["files"][0]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_verifier_names_the_damaged_file(storage_root, how, tmp_path):
    s = storage_root.storage
    dest = join(storage_root.url, "c")
    _commit(dest, s)
    fs, root = url_to_fs(dest, s)
    _damage(fs, join(root, "sub/b.bin"), how)
    m = read_manifest(dest, s)
    (bad,) = [f for f in m.files if f.path == "sub/b.bin"]
    needle = {"flip": "sub/b.bin: sha256", "truncate": "sub/b.bin: size", "delete": "sub/b.bin: .*missing"}[how]
    with pytest.raises(CorruptShardError, match=needle):
        verify(dest, s)
    with pytest.raises(CorruptShardError, match=needle):
        read_file(m, bad, s)
    with pytest.raises(CorruptShardError, match=needle):
        M.read_files(m, storage=s)
    with pytest.raises(CorruptShardError, match=needle):
        download_file(m, bad, str(tmp_path / "b.bin"), s)


def test_second_commit_is_refused_create_only(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "c")
    files = write_files(dest, BLOBS, s)
    first = commit(dest, files, kind="test", metrics={"try": 1}, storage=s)
    with pytest.raises(ManifestExistsError):  # the same manifest again: create-only says no
        commit(dest, files, kind="test", metrics={"try": 2}, storage=s)
    with pytest.raises(ManifestExistsError, match="already committed"):
        M.ensure_uncommitted(dest, "the test", s)
    assert read_manifest(first, s).metrics == {"try": 1}


def test_concurrent_commits_have_one_winner(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "c")
    outcomes = []

    def work(i: int) -> None:
        files = write_files(dest, {f"part-{i}.bin": bytes([i]) * 10}, s)
        try:
            commit(dest, files, kind="test", metrics={"i": i}, storage=s)
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
    m = verify(dest, s)
    assert m.metrics == {"i": winners[0]} and [f.path for f in m.files] == [f"part-{winners[0]}.bin"]


def test_no_manifest_is_not_committed_and_other_kinds_are_refused(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "c")
    write_files(dest, BLOBS, s)  # files without a manifest are invisible
    with pytest.raises(NotCommittedError):
        verify(dest, s)
    _commit(dest, s)
    with pytest.raises(CorruptShardError, match="not a 'table'"):
        read_manifest(dest, s, kind="table")
    fs, root = url_to_fs(join(storage_root.url, "junk"), s)
    fs.pipe_file(join(root, "_MANIFEST.json"), b'{"format": "something else"}')
    with pytest.raises(CorruptShardError, match="not an rlmill manifest"):
        read_manifest(join(storage_root.url, "junk"), s)
    with pytest.raises(ValueError, match="clash"):
        commit(join(storage_root.url, "d"), [], kind="test", extra={"files": []}, storage=s)


def test_another_manifest_name(storage_root):
    s = storage_root.storage
    dest = join(storage_root.url, "hf")
    uri = _commit(dest, s, name="index.json", extra={"weight_map": {"w": "a.bin"}})
    assert uri == join(dest, "index.json") and committed(dest, s) is None
    assert verify(dest, s, name="index.json").extra["weight_map"] == {"w": "a.bin"}


def test_copy_committed_verifies_before_it_publishes(storage_root):
    s = storage_root.storage
    src, dest = join(storage_root.url, "src"), join(storage_root.url, "dest")
    src_uri = _commit(src, s, metrics={"n": 1})
    uri = M.copy_committed(src, dest, s)
    copy = verify(uri, s)
    assert copy.inputs == [src_uri] and copy.metrics == {"n": 1} and copy.files == read_manifest(src, s).files
    assert M.copy_committed(src, dest, s) == uri  # committed already: a retry changes nothing
    # A flipped byte in the source is caught before the copy is published.
    fs, root = url_to_fs(src, s)
    _damage(fs, join(root, "a.bin"), "flip")
    with pytest.raises(CorruptShardError, match="a.bin: sha256"):
        M.copy_committed(src, join(storage_root.url, "dest2"), s)
    assert committed(join(storage_root.url, "dest2"), s) is None
    with pytest.raises(NotCommittedError):
        M.copy_committed(join(storage_root.url, "nothing"), join(storage_root.url, "dest3"), s)
