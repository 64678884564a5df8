"""rlmill storage: one URL -> filesystem entry point, run layout, one commit primitive (files,
then a create-only manifest with each file's size and sha256) and one verifier, and on top of
them sharded Parquet tables and safetensors checkpoints as HF folders.

`import storage` stays light: torch, safetensors and transformers load only inside the
checkpoint functions, s3fs only when an s3:// URL is used.
"""

from .checkpoints import (
    INDEX_NAME,
    copy_checkpoint,
    download_checkpoint,
    load_state_dict,
    read_index,
    save_checkpoint,
)
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
from .fs import exists, join, overwrite, read_pointer, redact_url, url_to_fs, write_once, write_pointer
from .layout import ModelLayout, RunLayout, check_name
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    commit,
    committed,
    download_file,
    read_file,
    read_manifest,
    verify,
    write_files,
)
from .tables import gc_uncommitted, read_table, write_table

__all__ = [
    # URLs and configuration
    "StorageConfig",
    "url_to_fs",
    "join",
    "redact_url",
    "exists",
    "write_once",
    "overwrite",
    "write_pointer",
    "read_pointer",
    # layout
    "RunLayout",
    "ModelLayout",
    "check_name",
    # the commit primitive and the verifier
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFile",
    "write_files",
    "commit",
    "committed",
    "read_manifest",
    "read_file",
    "download_file",
    "verify",
    # tables
    "write_table",
    "read_table",
    "gc_uncommitted",
    # checkpoints
    "INDEX_NAME",
    "save_checkpoint",
    "load_state_dict",
    "download_checkpoint",
    "read_index",
    "copy_checkpoint",
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
