"""One file to its final key: a single PUT up to the part size, else a multipart upload with parallel
parts, resumable from the journal; either way checked after upload.

Memory: a part is read from the file (``os.pread``, never the whole file) into one buffer that lives until
its upload has been answered; a semaphore of ``max_memory // part_size`` slots bounds the parts read and
in flight, and ``concurrency`` threads (at most slots - 1, so the reader is never the one waiting for
nothing) upload them. One reader thread reads the parts in order, so it also computes the file's
checksum of the manifest (BLAKE3): a local file that no longer matches its manifest is never completed.

The checks, each by the store of the bytes it received: every request carries Content-MD5 (stores verify
it on receipt and reject a mismatch); after upload the object's size must be the file's and, with
``publish.check_etag``, its ETag the MD5 of the bytes (a plain object) or the MD5 of the parts' MD5s
followed by ``-<parts>`` (a multipart object), as S3 computes them.
"""
from __future__ import annotations

import base64
import hashlib
import math
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from ... import _faults
from ...config.sizes import parse_size
from ...export.write import checksum
from .journal import Journal
from .store import Store, StoreError, md5_b64, quoted

MAX_PARTS = 10_000
MIB = 2**20


class LocalFileChanged(Exception):
    """The local file is not what its manifest describes (size or checksum): nothing of it is published."""


@dataclass
class FileResult:
    key: str
    bytes: int
    etag: str
    parts: int = 0  # 0: a single PUT
    reused_parts: int = 0  # parts of an earlier, interrupted upload kept (after matching their ETag)
    sent_bytes: int = 0


def part_size_for(size: int, part: int) -> int:
    """The part size for a file of ``size`` bytes: ``part``, raised (to whole MiB) so that the file
    takes at most 10,000 parts.

    >>> part_size_for(10 * 2**20, 5 * 2**20), part_size_for(200_000 * 2**20, 5 * 2**20) // 2**20
    (5242880, 20)
    """
    need = math.ceil(size / MAX_PARTS)
    return max(part, math.ceil(need / MIB) * MIB)


class Uploader:
    """Uploads files to ``store`` with the settings of a PublishConfig; ``journal`` records multipart uploads."""

    def __init__(self, store: Store, cfg, journal: Journal):
        self.store, self.cfg, self.journal = store, cfg, journal
        self.part = parse_size(cfg.part_size)
        self.slots = max(2, parse_size(cfg.max_memory) // self.part)
        self.workers = max(1, min(cfg.concurrency, self.slots - 1))

    def upload(self, path: Path, key: str, size: int, expected: Optional[Tuple[str, str]]) -> FileResult:
        """``path`` to ``key``; ``expected`` is the manifest's (algorithm, digest) of the file."""
        actual = os.stat(path).st_size
        if actual != size:
            raise LocalFileChanged(f"{path}: {actual} bytes, its manifest says {size}")
        if size <= self.part:
            return self._single(path, key, size, expected)
        return self._multipart(path, key, size, expected)

    # ---- a single PUT -----------------------------------------------------------------------
    def _single(self, path: Path, key: str, size: int, expected) -> FileResult:
        with open(path, "rb") as f:
            data = f.read()
        _check_digest(path, expected, data)
        md5_hex, _ = md5_b64(data)
        etag = self.store.put(key, data)
        self._check_object(key, size, md5_hex)
        return FileResult(key, size, etag, sent_bytes=size)

    def _check_object(self, key: str, size: int, etag: str) -> None:
        head = self.store.head(key)
        if head is None:
            raise StoreError(f"{self.store.where(key)}: missing right after its upload")
        if int(head.get("ContentLength", -1)) != size:
            raise StoreError(f"{self.store.where(key)}: the store holds {head.get('ContentLength')} bytes, "
                             f"the file has {size}")
        if self.cfg.check_etag and quoted(head.get("ETag")) != etag:
            raise StoreError(f"{self.store.where(key)}: the store's ETag {quoted(head.get('ETag'))} is not the MD5 "
                             f"of the bytes sent ({etag}); if this store's ETags are no MD5 (SSE-KMS, SSE-C), set "
                             "publish.check_etag=false")

    # ---- multipart --------------------------------------------------------------------------
    def _resume(self, key: str, part: int, size: int, digest: str) -> Tuple[Optional[str], Dict[int, Tuple[str, int]]]:
        """An upload of this key the journal left open and that still fits the file: (id, {part: (etag, size)})."""
        upload_id, parts = None, {}
        for uid, entry in self.journal.open_uploads(self.store.url).items():
            if entry.get("key") != key:
                continue
            fits = upload_id is None and (entry.get("part_size"), entry.get("size"), entry.get("digest")) == (part, size, digest)
            if fits:
                try:
                    parts = self._list_parts(key, uid)
                    upload_id = uid
                    continue
                except StoreError as e:
                    if e.code != "NoSuchUpload" and e.status != 404:
                        raise
            self.store.abort(key, uid)  # started by an earlier attempt, no use now
            self.journal.done(self.store.url, key, uid)
        return upload_id, parts

    def _list_parts(self, key: str, upload_id: str) -> Dict[int, Tuple[str, int]]:
        out, kw = {}, {"UploadId": upload_id}
        while True:
            r = self.store.call("list_parts", key, **kw)
            out.update({p["PartNumber"]: (quoted(p.get("ETag")), int(p["Size"])) for p in r.get("Parts", [])})
            if not r.get("IsTruncated"):
                return out
            kw = {"UploadId": upload_id, "PartNumberMarker": r["NextPartNumberMarker"]}

    def _multipart(self, path: Path, key: str, size: int, expected) -> FileResult:
        part = part_size_for(size, self.part)
        digest = expected[1] if expected else ""
        upload_id, existing = self._resume(key, part, size, digest)
        if upload_id is None:
            upload_id = self.store.call("create_multipart_upload", key)["UploadId"]
            self.journal.started(self.store.url, key, upload_id, part, size, digest)
        _faults.point("publish_upload_started")
        n_parts = math.ceil(size / part)
        etags: Dict[int, str] = {}
        md5s: Dict[int, bytes] = {}
        stats = {"reused": 0, "sent": 0}
        errors: list = []
        slots = threading.BoundedSemaphore(self.slots)
        work: "queue.Queue" = queue.Queue()
        lock = threading.Lock()

        def send() -> None:
            while True:
                item = work.get()
                if item is None:
                    return
                number, data = item
                try:
                    if not errors:
                        d = hashlib.md5(data).digest()  # here, not on the reader: the parts' MD5s run in parallel
                        md5_hex = d.hex()
                        with lock:
                            md5s[number] = d
                        r = self.store.call("upload_part", key, UploadId=upload_id, PartNumber=number, Body=data,
                                            ContentMD5=base64.b64encode(d).decode())
                        etag = quoted(r.get("ETag"))
                        if self.cfg.check_etag and etag != md5_hex:
                            raise StoreError(f"{self.store.where(key)} part {number}: the store's ETag {etag} is not "
                                             f"the MD5 of the bytes sent ({md5_hex}); set publish.check_etag=false if "
                                             "this store's ETags are no MD5")
                        with lock:
                            etags[number] = etag
                            stats["sent"] += len(data)
                except BaseException as e:  # the first error stops the file
                    errors.append(e)
                finally:
                    del data
                    slots.release()

        threads = [threading.Thread(target=send, name=f"pfc-part-{i}", daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        hasher = checksum.new(expected[0]) if expected else None
        try:
            with open(path, "rb") as f:
                fd = f.fileno()
                for number in range(1, n_parts + 1):
                    slots.acquire()
                    if errors:
                        slots.release()
                        break
                    data = os.pread(fd, min(part, size - (number - 1) * part), (number - 1) * part)
                    if hasher is not None:
                        hasher.update(data)
                    have = existing.get(number)
                    if have is not None and have[1] == len(data):
                        d = hashlib.md5(data).digest()
                        if have[0] == d.hex():  # the store holds this very part: kept
                            with lock:
                                md5s[number] = d
                                etags[number] = have[0]
                            stats["reused"] += 1
                            slots.release()
                            continue
                    work.put((number, data))
                    del data
        finally:
            for _ in threads:
                work.put(None)
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        if hasher is not None and hasher.hexdigest() != expected[1]:
            self.store.abort(key, upload_id)
            self.journal.done(self.store.url, key, upload_id)
            raise LocalFileChanged(f"{path}: its {expected[0]} differs from its manifest (changed or damaged since "
                                   "the commit); nothing of it was published")
        composite = hashlib.md5(b"".join(md5s[n] for n in range(1, n_parts + 1))).hexdigest() + f"-{n_parts}"
        parts = [{"PartNumber": n, "ETag": f'"{etags[n]}"'} for n in range(1, n_parts + 1)]
        _faults.point("publish_complete")
        try:
            r = self.store.call("complete_multipart_upload", key, UploadId=upload_id, MultipartUpload={"Parts": parts})
            etag = quoted(r.get("ETag"))
        except StoreError as e:
            # a retried Complete whose first attempt went through: the object is there, the upload is gone
            head = self.store.head(key) if e.code == "NoSuchUpload" else None
            if head is None or quoted(head.get("ETag")) != composite:
                raise
            etag = composite
        self.journal.done(self.store.url, key, upload_id)
        self._check_object(key, size, composite)
        return FileResult(key, size, etag, n_parts, stats["reused"], stats["sent"])


def _check_digest(path: Path, expected: Optional[Tuple[str, str]], data: bytes) -> None:
    if expected is not None and checksum.new(expected[0], data).hexdigest() != expected[1]:
        raise LocalFileChanged(f"{path}: its {expected[0]} differs from its manifest (changed or damaged since the "
                               "commit); nothing of it was published")

