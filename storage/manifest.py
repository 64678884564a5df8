"""The one commit primitive and the one verifier: every table, checkpoint, trainer state and
promoted model version in rlmill is a folder of files published by a manifest written last.

    files = write_files(dest, {"part-0.parquet": data})          # fresh names, concurrent PUTs
    uri = commit(dest, files, kind="table", metrics={"n": 2})    # the manifest, create-only
    verify(uri)                                                  # size + sha256 of every file

`commit` creates the manifest create-only (`If-None-Match: *` on S3, `os.link` locally), so a
second attempt raises ManifestExistsError and the first commit stays intact. The manifest lists
every file with its size and sha256, plus the kind, schema version, input references, metrics and
kind-specific keys (a table's `arrow_schema`; a checkpoint's HF `weight_map`). Readers read only
what a manifest lists, through `read_file` / `read_files` / `download_file` / `verify`, and all of
them check each file the same way: a file missing, truncated or changed raises CorruptShardError
naming it. Files without a manifest are invisible (and garbage, see tables.gc_uncommitted).

Example:
    >>> uri = commit("memory://rlmill-doc/c1", write_files("memory://rlmill-doc/c1", {"a.txt": b"hi"}),
    ...              kind="notes", metrics={"n": 1})
    >>> m = verify(uri); (m.kind, [(f.path, f.size) for f in m.files], m.metrics)
    ('notes', [('a.txt', 2)], {'n': 1})
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Iterable, Mapping

from .config import StorageConfig
from .errors import CorruptShardError, ManifestExistsError, NotCommittedError, ObjectExistsError
from .fs import create_only, join, redact_url, url_to_fs

__all__ = [
    "MANIFEST_NAME",
    "ManifestFile",
    "Manifest",
    "manifest_uri",
    "write_files",
    "commit",
    "committed",
    "ensure_uncommitted",
    "read_manifest",
    "read_file",
    "read_files",
    "download_file",
    "verify",
    "copy_committed",
]

MANIFEST_NAME = "_MANIFEST.json"
FORMAT = "rlmill.manifest/1"
_CHUNK = 8 << 20  # bytes hashed at a time when verifying without holding a whole file in memory
# Keys of the manifest's own fields; a kind's extra keys sit beside them and may not reuse them.
_RESERVED = ("format", "kind", "files", "schema_version", "inputs", "metrics", "created_at")


@dataclass(frozen=True)
class ManifestFile:
    """One listed file: path relative to the manifest's folder ('/'-separated), size in bytes,
    sha256 hex, and for a table shard its row count."""

    path: str
    size: int
    sha256: str
    rows: int | None = None

    @classmethod
    def of(cls, path: str, data: bytes, rows: int | None = None) -> "ManifestFile":
        return cls(path, len(data), hashlib.sha256(data).hexdigest(), rows)

    @classmethod
    def of_local_file(cls, path: str, local_path: str) -> "ManifestFile":
        """The entry of a file on local disk, hashed in chunks (a multi-GB optimizer shard is fine)."""
        with open(local_path, "rb") as f:
            size, sha = _digest(f)
        return cls(path, size, sha)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Manifest:
    """A commit, as read back. `uri` is where it was read from (not stored in the file).

    Example:
        >>> import pyarrow as pa
        >>> from storage import write_table, read_manifest
        >>> uri = write_table("memory://rlmill-doc/m1", pa.table({"x": [1, 2]}), metrics={"n": 2})
        >>> m = read_manifest(uri); (m.kind, m.num_rows, m.metrics, len(m.files))
        ('table', 2, {'n': 2}, 1)
    """

    kind: str
    files: list[ManifestFile]
    schema_version: int = 1
    inputs: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    uri: str = ""

    @property
    def sha256(self) -> str:
        """Content hash of the listing (a stable cache key for downstream stages)."""
        body = json.dumps([f.to_dict() for f in self.files], sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()

    @property
    def num_rows(self) -> int:
        """Rows of a table (the sum over its shards); 0 for other kinds."""
        return sum(f.rows or 0 for f in self.files)

    @property
    def folder(self) -> str:
        """URL of the folder the listed paths are relative to."""
        return self.uri.rsplit("/", 1)[0]

    def url_of(self, f: ManifestFile) -> str:
        return join(self.folder, f.path)

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "kind": self.kind, "files": [f.to_dict() for f in self.files],
                "schema_version": self.schema_version, "inputs": list(self.inputs),
                "metrics": self.metrics, "created_at": self.created_at, **self.extra}
        return json.dumps(body, indent=1, sort_keys=True, default=_json_default).encode()

    @classmethod
    def from_json(cls, data: bytes, uri: str = "") -> "Manifest":
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}, expected {FORMAT!r}")
            files = [ManifestFile(**f) for f in body["files"]]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CorruptShardError(f"{redact_url(uri)} is not an rlmill manifest ({e})") from None
        extra = {k: v for k, v in body.items() if k not in _RESERVED}
        return cls(kind=body.get("kind", ""), files=files, schema_version=body.get("schema_version", 1),
                   inputs=body.get("inputs", []), metrics=body.get("metrics", {}),
                   created_at=body.get("created_at", ""), extra=extra, uri=uri)


def _json_default(x: Any) -> Any:
    # Metrics often hold numpy scalars or tensors' .item(); store plain numbers.
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _digest(f: IO[bytes]) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


# ------------------------------------------------------------------------------------ writing
def manifest_uri(url: str, name: str = MANIFEST_NAME) -> str:
    """The manifest's URI given it or its folder.

    >>> manifest_uri("s3://b/runs/r/iterations/1/rollout/")
    's3://b/runs/r/iterations/1/rollout/_MANIFEST.json'
    """
    url = url.rstrip("/")
    return url if url.endswith("/" + name) or url == name else join(url, name)


def committed(dest_url: str, storage: StorageConfig | None = None, *, name: str = MANIFEST_NAME) -> str | None:
    """The manifest URI if `dest_url` has committed, else None."""
    uri = manifest_uri(dest_url, name)
    fs, path = url_to_fs(uri, storage)
    return uri if fs.exists(path) else None


def ensure_uncommitted(dest_url: str, what: str, storage: StorageConfig | None = None, *,
                       name: str = MANIFEST_NAME) -> None:
    """Raise ManifestExistsError if `dest_url` already committed: a writer calls this before
    writing any file, to fail fast. Only `commit`'s create-only write decides a race."""
    if uri := committed(dest_url, storage, name=name):
        raise ManifestExistsError(f"{redact_url(uri)} exists: {what} already committed there; "
                                  "the first commit is left intact (write to a fresh URL)")


def write_files(dest_url: str, blobs: Mapping[str, bytes], storage: StorageConfig | None = None, *,
                rows: Mapping[str, int] | None = None) -> list[ManifestFile]:
    """Write `blobs` (path relative to `dest_url` -> bytes) and return their manifest entries,
    in the same order. The PUTs run concurrently on S3. Use fresh names (e.g. with a uuid):
    until `commit`, these files are invisible, and a retry must not write over a racing attempt."""
    fs, root = url_to_fs(dest_url, storage)
    fs.pipe({join(root, rel): data for rel, data in blobs.items()})
    return [ManifestFile.of(rel, data, (rows or {}).get(rel)) for rel, data in blobs.items()]


def commit(
    dest_url: str,
    files: Iterable[ManifestFile],
    *,
    kind: str,
    schema_version: int = 1,
    inputs: Iterable[str] = (),
    metrics: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    name: str = MANIFEST_NAME,
    storage: StorageConfig | None = None,
) -> str:
    """Publish `files` (already written under `dest_url`) by creating the manifest; returns its URI.

    Create-only: if a manifest is already there, raises ManifestExistsError and leaves it intact
    (this attempt's files become orphans). `extra` holds the kind's own top-level keys.
    """
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"extra keys {clash} clash with the manifest's own fields")
    uri = manifest_uri(dest_url, name)
    manifest = Manifest(
        kind=kind,
        files=list(files),
        schema_version=schema_version,
        inputs=[redact_url(str(u)) for u in inputs],
        metrics=dict(metrics or {}),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(),
        extra=dict(extra or {}),
    )
    fs, path = url_to_fs(uri, storage)
    try:
        create_only(fs, path, manifest.to_json(), url=uri)
    except ObjectExistsError:
        raise ManifestExistsError(f"{redact_url(uri)} was committed by another attempt first; "
                                  "it is left intact") from None
    return uri


# ------------------------------------------------------------------------------------ reading
def read_manifest(url: str, storage: StorageConfig | None = None, *, name: str = MANIFEST_NAME,
                  kind: str | None = None) -> Manifest:
    """Read a manifest given its URI or its folder; NotCommittedError if there is none,
    CorruptShardError if it is not a manifest (of `kind`, when given)."""
    uri = manifest_uri(url, name)
    fs, path = url_to_fs(uri, storage)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise NotCommittedError(f"no {name} at {redact_url(uri)}: nothing was committed there") from None
    manifest = Manifest.from_json(data, uri=uri)
    if kind is not None and manifest.kind != kind:
        raise CorruptShardError(f"{redact_url(uri)} commits a {manifest.kind!r}, not a {kind!r}")
    return manifest


def _check(f: ManifestFile, size: int, sha256: str, shown: str) -> None:
    """The verifier's one rule: the file is exactly what the manifest listed."""
    if size != f.size:
        raise CorruptShardError(f"{shown}: size {size} != {f.size} listed in the manifest (truncated or replaced)")
    if sha256 != f.sha256:
        raise CorruptShardError(f"{shown}: sha256 does not match the manifest (corrupted)")


def _missing(shown: str) -> CorruptShardError:
    return CorruptShardError(f"{shown}: listed by the manifest but missing")


def _shown(manifest: Manifest, f: ManifestFile) -> str:
    return redact_url(manifest.url_of(f))


def _check_bytes(manifest: Manifest, f: ManifestFile, data: bytes) -> bytes:
    _check(f, len(data), hashlib.sha256(data).hexdigest(), _shown(manifest, f))
    return data


def read_file(manifest: Manifest, f: ManifestFile, storage: StorageConfig | None = None) -> bytes:
    """One listed file's bytes, verified."""
    fs, path = url_to_fs(manifest.url_of(f), storage)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise _missing(_shown(manifest, f)) from None
    return _check_bytes(manifest, f, data)


def read_files(manifest: Manifest, files: Iterable[ManifestFile] | None = None,
               storage: StorageConfig | None = None) -> list[bytes]:
    """Listed files' bytes (all by default), fetched concurrently on S3, each verified, in order.
    Holds them all in memory: for a table's shards, not for multi-GB checkpoint files."""
    files = list(manifest.files if files is None else files)
    if not files:
        return []
    fs, _ = url_to_fs(manifest.uri, storage)
    paths = [url_to_fs(manifest.url_of(f), storage)[1] for f in files]
    try:
        blobs = fs.cat(paths, on_error="raise")
    except FileNotFoundError:
        blobs = {}  # which one is missing is found and named below
    if not isinstance(blobs, dict):
        blobs = {paths[0]: blobs}
    out = []
    for f, path in zip(files, paths):
        data = _lookup(fs, blobs, path)
        out.append(read_file(manifest, f, storage) if data is None else _check_bytes(manifest, f, data))
    return out


def _lookup(fs: Any, blobs: dict[str, bytes], path: str) -> bytes | None:
    # fs.cat keys results by the filesystem's own path form, which may add or drop a prefix.
    if path in blobs:
        return blobs[path]
    stripped = fs._strip_protocol(path)
    return next((v for k, v in blobs.items() if fs._strip_protocol(k) == stripped), None)


def download_file(manifest: Manifest, f: ManifestFile, local_path: str,
                  storage: StorageConfig | None = None) -> str:
    """Copy one listed file to `local_path` (parent folders made) and verify it; returns the path."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    fs, path = url_to_fs(manifest.url_of(f), storage)
    try:
        fs.get_file(path, local_path)
    except FileNotFoundError:
        raise _missing(_shown(manifest, f)) from None
    with open(local_path, "rb") as fh:
        _check(f, *_digest(fh), _shown(manifest, f))
    return local_path


def _verify_listed(manifest: Manifest, storage: StorageConfig | None) -> None:
    for f in manifest.files:
        fs, path = url_to_fs(manifest.url_of(f), storage)
        try:
            with fs.open(path, "rb") as fh:  # streamed: one chunk in memory, not the whole file
                size, sha = _digest(fh)
        except FileNotFoundError:
            raise _missing(_shown(manifest, f)) from None
        _check(f, size, sha, _shown(manifest, f))


def verify(url: str, storage: StorageConfig | None = None, *, name: str = MANIFEST_NAME,
           kind: str | None = None) -> Manifest:
    """Read the manifest at `url` (or its folder) and check every listed file's size and sha256.

    Returns the manifest; raises NotCommittedError without one, CorruptShardError naming the first
    damaged file. Costs one full read of the commit's bytes (streamed).
    """
    manifest = read_manifest(url, storage, name=name, kind=kind)
    _verify_listed(manifest, storage)
    return manifest


def copy_committed(src_url: str, dest_url: str, storage: StorageConfig | None = None, *,
                   name: str = MANIFEST_NAME, extra: Mapping[str, Any] | None = None) -> str:
    """Copy a commit to `dest_url` through the same primitive; returns the new manifest's URI.

    The listed files are copied (server-side when both are on one filesystem), the copies are
    verified against the source's listing, then the same listing is committed create-only with the
    source as its input: a damaged source or copy is never published. A destination that already
    committed is returned as it is, so a retry after a crash is harmless. `extra`: kind-specific
    keys that replace the source's in the copy (a forked run's trainer state, gpu_jobs/stages/fork.py).
    """
    if uri := committed(dest_url, storage, name=name):
        return uri
    src = read_manifest(src_url, storage, name=name)
    sfs, _ = url_to_fs(src.uri, storage)
    dfs, droot = url_to_fs(dest_url, storage)
    for f in src.files:
        target = join(droot, f.path)
        if sfs is dfs:
            dfs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            dfs.cp_file(url_to_fs(src.url_of(f), storage)[1], target)
        else:
            dfs.pipe_file(target, read_file(src, f, storage))
    copy = Manifest(kind=src.kind, files=src.files, uri=manifest_uri(dest_url, name))
    _verify_listed(copy, storage)  # one more read of the copy: the price of never publishing damage
    try:
        return commit(dest_url, src.files, kind=src.kind, schema_version=src.schema_version,
                      inputs=[src.uri], metrics=src.metrics, extra={**src.extra, **(extra or {})}, name=name,
                      storage=storage)
    except ManifestExistsError:  # another try committed the same listing meanwhile
        return manifest_uri(dest_url, name)
