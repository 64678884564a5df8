"""Errors raised by rlmill's storage layer.

Every error is a one-line message that says what went wrong and what to fix, so it reads well
in a Prefect task log. All of them derive from `StorageError`, so a caller can catch the family.
"""

from __future__ import annotations

__all__ = [
    "StorageError",
    "UnsupportedURLError",
    "InvalidNameError",
    "BucketNotFoundError",
    "CredentialsError",
    "ObjectExistsError",
    "ManifestExistsError",
    "CorruptShardError",
    "NotCommittedError",
    "StorageUnavailableError",
]


class StorageError(Exception):
    """Base class: something about storage needs fixing by the user or the caller."""


class UnsupportedURLError(StorageError, ValueError):
    """The URL's scheme is not one rlmill can store to (e.g. a typo like `s4://`)."""


class InvalidNameError(StorageError, ValueError):
    """A run id, stage, model or file name would escape its folder or has odd characters."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The S3 bucket named in the URL does not exist at the configured endpoint."""


class CredentialsError(StorageError, PermissionError):
    """S3 rejected the credentials (missing, wrong key id, wrong secret, or no access)."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there; the existing object is untouched."""


class ManifestExistsError(ObjectExistsError):
    """The stage (or checkpoint) already committed; the first commit is left intact."""


class CorruptShardError(StorageError):
    """A file listed by a manifest or index is missing or has the wrong size or sha256."""


class NotCommittedError(StorageError, FileNotFoundError):
    """There is no manifest (or checkpoint index) at the URL: nothing was committed there."""


class StorageUnavailableError(StorageError, ConnectionError):
    """Object storage kept failing with transient faults (unreachable, 5xx, throttled) for the
    whole retry budget (StorageConfig.retry_budget_seconds). Nothing committed is affected: the
    stage can be retried, or the run resumed, once the endpoint answers again."""
