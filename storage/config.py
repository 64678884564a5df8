"""Typed storage settings: where S3 is and how to sign in to it.

Defaults live here only. A field left as None falls back to the standard AWS environment
variable (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION), then to botocore's own credential chain.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

__all__ = ["StorageConfig"]


class StorageConfig(BaseModel):
    """How to reach object storage. Secrets never show in repr/str (they are SecretStr).

    Example:
        >>> from storage import StorageConfig
        >>> cfg = StorageConfig(endpoint_url="http://127.0.0.1:9000", key="k", secret="s")
        >>> "s" in str(cfg.secret), cfg.secret.get_secret_value()
        (False, 's')
    """

    # Pydantic echoes a rejected input in its error text; here that input may be a secret.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint URL, e.g. http://127.0.0.1:9000 for MinIO/moto. "
        "None: AWS_ENDPOINT_URL if set, else AWS S3.",
    )
    key: SecretStr | None = Field(
        None, description="S3 access key id. None: AWS_ACCESS_KEY_ID, then botocore's chain."
    )
    secret: SecretStr | None = Field(
        None, description="S3 secret access key. None: AWS_SECRET_ACCESS_KEY, then botocore's chain."
    )
    token: SecretStr | None = Field(
        None, description="Optional STS session token. None: AWS_SESSION_TOKEN if set."
    )
    region: str | None = Field(
        None,
        description="AWS region. Leave None for moto/MinIO: a region makes bucket creation "
        "fail there with 'location-constraint is not valid'.",
    )
    anon: bool = Field(False, description="Unsigned (anonymous) requests, for public buckets.")
    check_bucket: bool = Field(
        True,
        description="On first use of a bucket in this process, check that it exists and that "
        "the credentials work, and before a run starts, that they may write and delete under the "
        "root (an empty object, removed at once), so a typo fails with a clear one-line error. "
        "Turn off for credentials that may not HEAD the bucket or delete objects.",
    )
    retry_budget_seconds: float = Field(
        300.0,
        ge=0,
        description="How long one S3 request keeps retrying a transient fault (connection refused, "
        "reset or timed out, HTTP 5xx, 429/503 SlowDown throttling) before it fails with "
        "StorageUnavailableError; exponential backoff with full jitter. 5 minutes covers what "
        "object stores do in normal operation (an endpoint or load-balancer restart, a MinIO "
        "rolling upgrade, a burst of throttling: seconds to a few minutes) at the cost of a run "
        "that waits instead of failing; a stage holds minutes of GPU work, and waiting is cheaper "
        "than losing it and needing an operator. Longer outages are incidents: Prefect task "
        "retries (tasks.retry_delay_seconds) then try the stage again. Faults that cannot heal "
        "(403/bad credentials, a missing bucket or object, a create-only conflict) never wait. "
        "The first contact with an endpoint in a process waits at most 15 s (a wrong endpoint_url "
        "is reported quickly). 0 = no retries.",
    )
    retry_max_delay_seconds: float = Field(
        30.0,
        gt=0,
        description="Longest single wait between two retries of a request: a recovered endpoint "
        "is noticed within this many seconds.",
    )

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_has_scheme(cls, v: str | None) -> str | None:
        # Checked first, and the value is not echoed: 'user:secret@host' must not reach a log.
        if v is not None and "@" in v:
            raise ValueError("endpoint_url must not hold credentials ('user:secret@host'): "
                             "set storage.key/storage.secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(
                f"endpoint_url {v!r} must start with http:// or https:// "
                "(e.g. http://127.0.0.1:9000)"
            )
        return v.rstrip("/") if v else v

    @classmethod
    def from_env(cls) -> "StorageConfig":
        """Settings from the standard AWS environment variables (unset ones stay None)."""
        env = os.environ.get
        return cls(
            endpoint_url=env("AWS_ENDPOINT_URL") or None,
            key=env("AWS_ACCESS_KEY_ID") or None,
            secret=env("AWS_SECRET_ACCESS_KEY") or None,
            token=env("AWS_SESSION_TOKEN") or None,
            region=env("AWS_REGION") or env("AWS_DEFAULT_REGION") or None,
        )

    def resolved(self) -> "StorageConfig":
        """This config with unset fields filled from the AWS environment variables."""
        env = StorageConfig.from_env()
        filled = {k: getattr(env, k) for k in ("endpoint_url", "key", "secret", "token", "region")
                  if getattr(self, k) is None}
        return self.model_copy(update=filled)

    def s3fs_options(self) -> dict[str, Any]:
        """Keyword arguments for s3fs.S3FileSystem (contains secrets: never log or store it)."""
        cfg = self.resolved()
        opts: dict[str, Any] = {"anon": cfg.anon}
        if cfg.key is not None:
            opts["key"] = cfg.key.get_secret_value()
        if cfg.secret is not None:
            opts["secret"] = cfg.secret.get_secret_value()
        if cfg.token is not None:
            opts["token"] = cfg.token.get_secret_value()
        client_kwargs: dict[str, Any] = {}
        if cfg.endpoint_url:
            client_kwargs["endpoint_url"] = cfg.endpoint_url
        if cfg.region:
            client_kwargs["region_name"] = cfg.region
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        return opts
