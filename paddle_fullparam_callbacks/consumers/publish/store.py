"""The object store: one boto3 client, and every request through :meth:`Store.call`, which retries what a
store may answer under load (throttling, 5xx, a dropped connection) with exponential backoff and jitter,
and turns every other failure into a :class:`StoreError` that carries the store's own code and message
and the ``s3://`` address it concerns.

botocore's own retries are off (one attempt per call): the publisher's retry count and backoff are the
recipe's (``publish.retries``, ``publish.retry_backoff_s``) and every retry is counted. Request checksums
are sent only where this package asks for them (Content-MD5 on every upload, which the store verifies on
receipt): botocore's newer default of CRC32 trailers in aws-chunked bodies is what many S3-compatible
stores reject.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import random
import threading
import time
from typing import Callable, Optional, Tuple

from ...config.publishing import parse_s3_url

logger = logging.getLogger("paddle_fullparam_callbacks")

# the codes S3 and S3-compatible stores answer when they want the client to slow down or try again
RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "RequestTimeout",
    "InternalError", "ServiceUnavailable", "OperationAborted", "RequestTimeTooSkewed",
    "ConditionalRequestConflict",  # 409: another conditional write to the key in flight; S3 says to retry
})
MAX_BACKOFF_S = 30.0


class StoreError(Exception):
    """A request the store refused (or that never reached it), after any retries."""

    def __init__(self, message: str, code: str = "", status: int = 0):
        super().__init__(message)
        self.code, self.status = code, status


def md5_b64(data: bytes) -> Tuple[str, str]:
    """(hex, base64) MD5 of ``data``: the ETag S3 computes of a plain upload, and its Content-MD5 header."""
    d = hashlib.md5(data).digest()
    return d.hex(), base64.b64encode(d).decode()


def quoted(etag: Optional[str]) -> str:
    return (etag or "").strip().strip('"')


class Store:
    """``s3://bucket/prefix`` of a publish config, through boto3 (imported here, not at package import)."""

    def __init__(self, cfg, url: Optional[str] = None, sleep: Callable[[float], None] = time.sleep,
                 retries: Optional[int] = None):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise StoreError("publishing to s3:// needs boto3: pip install 'paddle-fullparam-callbacks[s3]'") from e
        self.url = url or cfg.url
        self.bucket, self.prefix = parse_s3_url(self.url)
        self.retries = cfg.retries if retries is None else retries
        self.backoff = float(cfg.retry_backoff_s)
        self._sleep = sleep
        self._lock = threading.Lock()
        self.retried = 0  # requests retried (all threads)
        # payload_signing_enabled=False: the body is not hashed a second time for the signature (SHA-256, the
        # slowest hash of the lot); every upload carries Content-MD5, a signed header the store checks
        config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required", max_pool_connections=max(10, cfg.concurrency + 4),
                        connect_timeout=10, read_timeout=300, s3={"payload_signing_enabled": False})
        self.client = boto3.session.Session().client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                                                     config=config)
        self.endpoint = self.client.meta.endpoint_url

    # ---- keys ------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def where(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}/{self.prefix}"

    # ---- requests --------------------------------------------------------------------------
    def call(self, op: str, key: str = "", **kwargs):
        """``client.<op>(Bucket=..., Key=key, **kwargs)`` with retries; StoreError when it fails for good."""
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

        args = {"Bucket": self.bucket, **({"Key": key} if key else {}), **kwargs}
        attempt = 0
        while True:
            try:
                return getattr(self.client, op)(**args)
            except ClientError as e:
                err, meta = e.response.get("Error", {}), e.response.get("ResponseMetadata", {})
                code, status = str(err.get("Code", "")), int(meta.get("HTTPStatusCode") or 0)
                transient = code in RETRY_CODES or status in (429, 500, 502, 503, 504)
                message = f"{err.get('Message') or e}"
            except (ConnectionError, HTTPClientError) as e:
                code, status, transient, message = type(e).__name__, 0, True, str(e)
            except BotoCoreError as e:  # no credentials, a bad parameter: nothing a retry would change
                raise StoreError(f"{op} {self.where(key)} (endpoint {self.endpoint}): {type(e).__name__}: {e}",
                                 type(e).__name__) from e
            if not transient or attempt >= self.retries:
                tried = f" after {attempt + 1} attempts" if attempt else ""
                raise StoreError(f"{op} {self.where(key)} (endpoint {self.endpoint}){tried}: {code}"
                                 f"{f' (HTTP {status})' if status else ''}: {message}", code, status)
            wait = min(MAX_BACKOFF_S, self.backoff * 2 ** attempt) * random.uniform(0.5, 1.0)
            attempt += 1
            with self._lock:
                self.retried += 1
            logger.debug("%s %s: %s, retry %d in %.2f s", op, self.where(key), code, attempt, wait)
            self._sleep(wait)

    def get(self, key: str) -> Optional[Tuple[bytes, str]]:
        """(body, ETag) of ``key``, or None if there is no such object."""
        try:
            r = self.call("get_object", key)
        except StoreError as e:
            if e.status == 404 or e.code in ("NoSuchKey", "404"):
                return None
            raise
        return r["Body"].read(), quoted(r.get("ETag"))

    def head(self, key: str) -> Optional[dict]:
        try:
            return self.call("head_object", key)
        except StoreError as e:
            if e.status == 404 or e.code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def put(self, key: str, body: bytes, **conditions) -> str:
        """PUT ``body`` with its Content-MD5 (and ``IfNoneMatch``/``IfMatch``); returns the store's ETag."""
        _, b64 = md5_b64(body)
        return quoted(self.call("put_object", key, Body=body, ContentMD5=b64, **conditions).get("ETag"))

    def list(self, prefix: str, delimiter: Optional[str] = None):
        """Every (key, size, etag) under ``prefix`` and, with ``delimiter``, the common prefixes."""
        token, keys, dirs = None, [], []
        while True:
            kw = {"Prefix": prefix, **({"Delimiter": delimiter} if delimiter else {}),
                  **({"ContinuationToken": token} if token else {})}
            r = self.call("list_objects_v2", **kw)
            keys += [(o["Key"], o["Size"], quoted(o.get("ETag"))) for o in r.get("Contents", [])]
            dirs += [p["Prefix"] for p in r.get("CommonPrefixes", [])]
            if not r.get("IsTruncated"):
                return keys, dirs
            token = r["NextContinuationToken"]

    def uploads(self, prefix: str):
        """Multipart uploads in progress under ``prefix``: [(key, upload id)]."""
        out, kw = [], {"Prefix": prefix}
        while True:
            r = self.call("list_multipart_uploads", **kw)
            out += [(u["Key"], u["UploadId"]) for u in r.get("Uploads", [])]
            if not r.get("IsTruncated"):
                return out
            kw = {"Prefix": prefix, "KeyMarker": r.get("NextKeyMarker"), "UploadIdMarker": r.get("NextUploadIdMarker")}

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self.call("abort_multipart_upload", key, UploadId=upload_id)
        except StoreError as e:
            if e.code != "NoSuchUpload" and e.status != 404:
                raise

    def delete(self, key: str, **conditions) -> None:
        self.call("delete_object", key, **conditions)

    def delete_many(self, keys) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            r = self.call("delete_objects", Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            if r.get("Errors"):
                first = r["Errors"][0]
                raise StoreError(f"delete_objects {self.where(first.get('Key', ''))}: {first.get('Code')}: "
                                 f"{first.get('Message')} ({len(r['Errors'])} keys not deleted)", first.get("Code", ""))
