"""A repository under a prefix of an S3-compatible bucket (AWS, SeaweedFS, MinIO, ...), through botocore.

S3 PUT is atomic per object and strongly consistent, which is all the store's ordering rules need. Objects are
written with one PUT each (packs are ~16 MiB, far under the 5 GiB single-PUT limit), so no multipart upload can be
left behind by a crash.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from keepstate.store.backend import Backend, ObjectInfo, check_key
from keepstate.store.errors import BackendError, ObjectNotFound, ShortRead

if TYPE_CHECKING:
    from boto3.session import Session
    from mypy_boto3_s3 import S3Client

_session_lock = threading.Lock()
_session: Session | None = None


def _shared_session() -> Session:
    """One boto3 session per process: it caches the service model, which makes each new client ~10x cheaper."""
    global _session
    with _session_lock:
        if _session is None:
            import boto3

            _session = boto3.session.Session()
        return _session


class S3Backend(Backend):
    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        prefix: str = "",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        create_bucket: bool = True,
    ) -> None:
        from botocore.config import Config

        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client: S3Client = _shared_session().client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=16,
                # Checksums are ours (BLAKE3 of every object); skip botocore's extra CRC trailers, which some
                # S3-compatible servers do not accept.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        if create_bucket:
            self._ensure_bucket()

    @property
    def location(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"{where}?endpoint={self.endpoint}" if self.endpoint else where

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: Exception, what: str, key: str) -> BackendError:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(key, self.location)
            if code in ("InvalidRange", "416"):
                return ShortRead(f"short read of {key} in {self.location}: range past its end")
            return BackendError(f"cannot {what} {key} in {self.location}: {code} {exc}")
        return BackendError(f"cannot {what} {key} in {self.location}: {exc}")

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise BackendError(f"cannot open bucket {self.bucket} at {self.endpoint}: {code} {exc}") from exc
        except BotoCoreError as exc:
            raise BackendError(f"cannot reach S3 endpoint {self.endpoint}: {exc}") from exc
        try:
            self._client.create_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise BackendError(f"cannot create bucket {self.bucket} at {self.endpoint}: {code} {exc}") from exc

    def save(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._put(key, bytes(data))

    def save_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        self._put(key, b"".join(parts))

    def _put(self, key: str, body: bytes) -> None:
        full = self._key(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=body)
        except Exception as exc:
            raise self._error(exc, "write", key) from exc

    def load(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}  # ValueError before any I/O
        if length is not None:
            if length == 0:
                self.stat(key)
                return b""
            args["Range"] = f"bytes={offset}-{offset + length - 1}"
        elif offset:
            args["Range"] = f"bytes={offset}-"
        try:
            response = self._client.get_object(**args)
            data: bytes = response["Body"].read()
        except Exception as exc:
            raise self._error(exc, "read", key) from exc
        if length is not None and len(data) != length:
            raise ShortRead(f"short read of {key} in {self.location}: wanted {length} bytes at {offset}, "
                               f"got {len(data)}")
        return data

    def stat(self, key: str) -> int:
        full = self._key(key)
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])
        except Exception as exc:
            raise self._error(exc, "stat", key) from exc

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][strip:], int(item["Size"]))
        except Exception as exc:
            raise self._error(exc, "list", prefix or "/") from exc

    def remove(self, key: str) -> None:
        full = self._key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as exc:
            error = self._error(exc, "remove", key)
            if not isinstance(error, ObjectNotFound):
                raise error from exc

    def close(self) -> None:
        self._client.close()
