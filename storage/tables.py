"""Sharded Parquet tables committed by a manifest written last.

A stage writes `part-<uuid>-<i>.parquet` shards under fresh names, then publishes them by
creating `_MANIFEST.json` create-only. Readers read only what a manifest lists and check each
file's size and sha256, so a half-written or second attempt is invisible until it commits.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from .config import StorageConfig
from .errors import CorruptShardError, ManifestExistsError, NotCommittedError, ObjectExistsError
from .fs import create_only, join, redact_url, url_to_fs

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFile",
    "write_table",
    "read_table",
    "read_manifest",
    "committed",
    "gc_uncommitted",
]

MANIFEST_NAME = "_MANIFEST.json"
MANIFEST_FORMAT = "rlmill.table/1"
_TARGET_SHARD_BYTES = 128 << 20  # in-memory Arrow bytes per shard when rows_per_shard is None


@dataclass(frozen=True)
class ManifestFile:
    """One shard: path relative to the manifest's folder, byte size, sha256 hex, row count."""

    path: str
    size: int
    sha256: str
    rows: int


@dataclass(frozen=True)
class Manifest:
    """A committed table. `uri` is where it was read from (not stored in the file).

    Example:
        >>> import pyarrow as pa
        >>> from storage import write_table, read_manifest
        >>> uri = write_table("memory://rlmill-doc/m1", pa.table({"x": [1, 2]}), metrics={"n": 2})
        >>> m = read_manifest(uri); (m.num_rows, m.metrics, len(m.files))
        (2, {'n': 2}, 1)
    """

    files: list[ManifestFile]
    schema_version: int
    inputs: list[str]
    metrics: dict[str, Any]
    created_at: str
    num_rows: int
    arrow_schema: str
    uri: str = ""
    format: str = MANIFEST_FORMAT

    @property
    def sha256(self) -> str:
        """Content hash of the manifest's listing (stable cache key for downstream stages)."""
        body = json.dumps([asdict(f) for f in self.files], sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()

    def to_json(self) -> bytes:
        body = asdict(self)
        body.pop("uri")
        return json.dumps(body, indent=1, sort_keys=True, default=_json_default).encode()

    @classmethod
    def from_json(cls, data: bytes, uri: str = "") -> "Manifest":
        body = json.loads(data)
        if body.get("format") != MANIFEST_FORMAT:
            raise CorruptShardError(f"{uri} is not an rlmill table manifest (format {body.get('format')!r})")
        body["files"] = [ManifestFile(**f) for f in body["files"]]
        return cls(uri=uri, **body)


def _json_default(x: Any) -> Any:
    # Metrics often hold numpy scalars or tensors' .item(); store plain numbers.
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _manifest_uri(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith(MANIFEST_NAME) else join(url, MANIFEST_NAME)


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


def _manifest_exists(fs: Any, path: str) -> bool:
    return fs.exists(path)


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
    fs, root = url_to_fs(dest_url, storage)
    uri = _manifest_uri(dest_url)
    manifest_path = join(root, MANIFEST_NAME)
    if _manifest_exists(fs, manifest_path):  # early exit; the create-only write is the real guard
        raise ManifestExistsError(f"{redact_url(uri)} already committed: the stage is done")
    attempt = uuid.uuid4().hex
    files, blobs = [], {}
    for i, part in enumerate(_slices(table, rows_per_shard)):
        data = _shard_bytes(part)
        name = f"part-{attempt}-{i:05d}.parquet"
        blobs[join(root, name)] = data
        files.append(ManifestFile(name, len(data), hashlib.sha256(data).hexdigest(), part.num_rows))
    fs.pipe(blobs)  # concurrent PUTs on S3
    manifest = Manifest(
        files=files,
        schema_version=schema_version,
        inputs=[redact_url(str(u)) for u in inputs],
        metrics=dict(metrics or {}),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
        num_rows=table.num_rows,
        arrow_schema=str(table.schema),
    )
    try:
        create_only(fs, manifest_path, manifest.to_json(), url=uri)
    except ObjectExistsError:
        raise ManifestExistsError(
            f"{redact_url(uri)} was committed by another attempt first; it is left intact"
        ) from None
    return uri


def read_manifest(uri: str, storage: StorageConfig | None = None) -> Manifest:
    """Read a manifest given its URI or its folder; NotCommittedError if there is none."""
    uri = _manifest_uri(uri)
    fs, path = url_to_fs(uri, storage)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise NotCommittedError(f"no {MANIFEST_NAME} at {redact_url(uri)}: the stage has not committed") from None
    return Manifest.from_json(data, uri=uri)


def committed(dest_url: str, storage: StorageConfig | None = None) -> str | None:
    """The manifest URI if `dest_url` has committed, else None."""
    uri = _manifest_uri(dest_url)
    fs, path = url_to_fs(uri, storage)
    return uri if fs.exists(path) else None


def _verified(name: str, data: bytes, f: ManifestFile) -> bytes:
    if len(data) != f.size:
        raise CorruptShardError(f"{name}: size {len(data)} != {f.size} listed in the manifest (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != f.sha256:
        raise CorruptShardError(f"{name}: sha256 does not match the manifest (corrupted)")
    return data


def read_table(
    manifest_uri_or_dir: str, columns: list[str] | None = None, storage: StorageConfig | None = None
) -> pa.Table:
    """Read the shards a manifest lists, verifying each one's size and sha256."""
    manifest = read_manifest(manifest_uri_or_dir, storage)
    fs, mpath = url_to_fs(manifest.uri, storage)
    folder = mpath.rsplit("/", 1)[0]
    dir_url = manifest.uri.rsplit("/", 1)[0]
    paths = {join(folder, f.path): f for f in manifest.files}
    try:
        blobs = fs.cat(list(paths), on_error="raise")  # concurrent GETs on S3
    except FileNotFoundError as e:
        raise CorruptShardError(f"a shard listed by {redact_url(manifest.uri)} is missing: {e}") from None
    if len(paths) == 1 and not isinstance(blobs, dict):
        blobs = {next(iter(paths)): blobs}
    parts = []
    for path, f in paths.items():
        data = _verified(join(dir_url, f.path), _lookup(blobs, path, fs), f)
        parts.append(pq.read_table(pa.BufferReader(data), columns=columns))
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _lookup(blobs: dict[str, bytes], path: str, fs: Any) -> bytes:
    # fs.cat keys results by the filesystem's own path form, which may add or drop a prefix.
    if path in blobs:
        return blobs[path]
    stripped = fs._strip_protocol(path)
    for key, value in blobs.items():
        if fs._strip_protocol(key) == stripped:
            return value
    raise CorruptShardError(f"{path}: listed by the manifest but not found")


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
