"""Sharded Parquet tables committed by a manifest written last.

A stage writes `part-<uuid>-<i>.parquet` shards under fresh names, then publishes them by
creating `_MANIFEST.json` create-only (storage.manifest.commit, kind "table", with the Arrow
schema). Readers read only what a manifest lists and check each file's size and sha256 (the one
verifier), so a half-written or second attempt is invisible until it commits.
"""

from __future__ import annotations

import datetime as dt
import io
import time
import uuid
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from .config import StorageConfig
from .fs import join, url_to_fs
from .manifest import MANIFEST_NAME, commit, ensure_uncommitted, read_files, read_manifest, write_files

__all__ = ["TABLE_KIND", "write_table", "read_table", "gc_uncommitted"]

TABLE_KIND = "table"
_TARGET_SHARD_BYTES = 128 << 20  # in-memory Arrow bytes per shard when rows_per_shard is None


def _shard_bytes(table: pa.Table) -> bytes:
    # Dictionary encoding of list columns costs ~4x write time and saves nothing on token ids.
    dict_cols = [f.name for f in table.schema
                 if not (pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
                         or pa.types.is_struct(f.type) or pa.types.is_map(f.type))]
    sink = io.BytesIO()
    # Non-compliant nested names keep list<item: ...> so a round-trip returns the same schema.
    # Min/max statistics of token lists serve no reader and cost ~30% of write time.
    pq.write_table(table, sink, use_dictionary=dict_cols or False, write_statistics=dict_cols or False,
                   use_compliant_nested_type=False)
    return sink.getvalue()


def _slices(table: pa.Table, rows_per_shard: int | None) -> Iterable[pa.Table]:
    if rows_per_shard is None:
        per_row = max(1, table.nbytes // max(1, table.num_rows))
        rows_per_shard = max(1, _TARGET_SHARD_BYTES // per_row)
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    if table.num_rows == 0:
        yield table  # one empty shard keeps the schema readable
        return
    for start in range(0, table.num_rows, rows_per_shard):
        yield table.slice(start, rows_per_shard)


def write_table(
    dest_url: str,
    table: pa.Table,
    *,
    inputs: Iterable[str] = (),
    metrics: dict[str, Any] | None = None,
    rows_per_shard: int | None = None,
    schema_version: int = 1,
    storage: StorageConfig | None = None,
) -> str:
    """Write `table` as Parquet shards under `dest_url` and commit; returns the manifest URI.

    Raises ManifestExistsError if `dest_url` already committed (the first commit stays intact;
    this attempt's shards become orphans for `gc_uncommitted`).
    """
    ensure_uncommitted(dest_url, "the stage", storage)  # early exit; commit's create-only write decides
    attempt = uuid.uuid4().hex
    blobs, rows = {}, {}
    for i, part in enumerate(_slices(table, rows_per_shard)):
        name = f"part-{attempt}-{i:05d}.parquet"
        blobs[name], rows[name] = _shard_bytes(part), part.num_rows
    files = write_files(dest_url, blobs, storage, rows=rows)
    return commit(dest_url, files, kind=TABLE_KIND, schema_version=schema_version, inputs=inputs,
                  metrics=metrics, extra={"arrow_schema": str(table.schema)}, storage=storage)


def read_table(
    manifest_uri_or_dir: str, columns: list[str] | None = None, storage: StorageConfig | None = None
) -> pa.Table:
    """Read the shards a manifest lists, verifying each one's size and sha256."""
    manifest = read_manifest(manifest_uri_or_dir, storage, kind=TABLE_KIND)
    # use_threads=False: shards are small, and Arrow's CPU thread pool can abort the process at
    # interpreter exit ("terminate called without an active exception", apache/arrow#34314; seen
    # once here, exit 134 after a read had finished).
    parts = [pq.read_table(pa.BufferReader(data), columns=columns, use_threads=False)
             for data in read_files(manifest, storage=storage)]
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "created", "last_modified"):
        value = info.get(key)
        if isinstance(value, dt.datetime):
            return value.timestamp() if value.tzinfo else value.replace(tzinfo=dt.timezone.utc).timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None


def gc_uncommitted(
    dest_url: str, *, grace_seconds: float = 3600.0, storage: StorageConfig | None = None
) -> list[str]:
    """Delete shards (and temp files) in `dest_url` that no manifest lists; returns their URLs.

    With a manifest, every unlisted shard is an orphan of a losing or crashed attempt and goes.
    Without one, a writer may still be running, so only files older than `grace_seconds` go.
    """
    fs, root = url_to_fs(dest_url, storage)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    listed: set[str] | None = None
    if fs.exists(join(root, MANIFEST_NAME)):
        listed = {f.path for f in read_manifest(dest_url, storage).files}
    now = time.time()
    doomed = []
    for info in entries:
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "directory" or name == MANIFEST_NAME:
            continue
        if not ((name.startswith("part-") and name.endswith(".parquet")) or ".tmp-" in name):
            continue
        if listed is not None and name in listed:
            continue
        if listed is None or ".tmp-" in name:
            mtime = _mtime(info)
            if mtime is not None and now - mtime < grace_seconds:
                continue
        doomed.append(name)
    for name in doomed:
        fs.rm_file(join(root, name))
    return [join(dest_url, name) for name in doomed]
