"""rlmill storage: one URL -> filesystem entry point, run layout, sharded Parquet tables
committed by a manifest, and safetensors checkpoints as HF folders.

`import storage` stays light: torch, safetensors and transformers load only inside the
checkpoint functions, s3fs only when an s3:// URL is used.
"""

from .checkpoints import INDEX_NAME, download_checkpoint, load_state_dict, read_index, save_checkpoint
from .config import StorageConfig
from .errors import (
    BucketNotFoundError,
    CorruptShardError,
    CredentialsError,
    InvalidNameError,
    ManifestExistsError,
    NotCommittedError,
    ObjectExistsError,
    StorageError,
    UnsupportedURLError,
)
from .fs import join, read_pointer, redact_url, url_to_fs, write_once, write_pointer
from .layout import ModelLayout, RunLayout, check_name
from .tables import (
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    committed,
    gc_uncommitted,
    read_manifest,
    read_table,
    write_table,
)

__all__ = [
    # URLs and configuration
    "StorageConfig",
    "url_to_fs",
    "join",
    "redact_url",
    "write_once",
    "write_pointer",
    "read_pointer",
    # layout
    "RunLayout",
    "ModelLayout",
    "check_name",
    # tables
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFile",
    "write_table",
    "read_table",
    "read_manifest",
    "committed",
    "gc_uncommitted",
    # checkpoints
    "INDEX_NAME",
    "save_checkpoint",
    "load_state_dict",
    "download_checkpoint",
    "read_index",
    # errors
    "StorageError",
    "UnsupportedURLError",
    "InvalidNameError",
    "BucketNotFoundError",
    "CredentialsError",
    "ObjectExistsError",
    "ManifestExistsError",
    "CorruptShardError",
    "NotCommittedError",
]
