"""An S3 protocol server for the publisher's tests: moto's ``ThreadedMotoServer`` on a free loopback port
(real HTTP, real boto3), and a small HTTP proxy in front of it that can misbehave on request:

- ``fail(match, status, code, times)``: answer matching requests with an S3 error (500, 503 SlowDown, ...)
  instead of forwarding them, ``times`` times (a store under load);
- ``hold(match)``: stop a matching request until :meth:`Proxy.release`, then drop it unanswered; the test
  waits for ``arrived`` (an Event: no sleeping), e.g. to SIGKILL the publisher mid-multipart;
- ``lose(match)``: forward a matching request, then answer 500 (the store did it, the answer was lost);
- ``before(match, fn)``: call ``fn()`` before forwarding a matching request (another writer acts first);
- ``ignore_conditions = True``: strip If-None-Match and If-Match before forwarding (a store that ignores them).

Every request seen is in ``seen`` as (method, path with query). moto 5.2.5 checks no signature unless its
IAM authentication is switched on (:func:`enforce_auth`), so a header the proxy strips is not noticed.
"""
from __future__ import annotations

import http.client
import os
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, List, Optional, Tuple
from urllib.parse import urlsplit

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
             '<RequestId>proxy</RequestId></Error>')


def start_moto():
    """(server, endpoint URL) of a moto S3 server on a free port of 127.0.0.1."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def client(endpoint: str, **keys):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=keys.get("key", CREDENTIALS["AWS_ACCESS_KEY_ID"]),
                        aws_secret_access_key=keys.get("secret", CREDENTIALS["AWS_SECRET_ACCESS_KEY"]),
                        config=Config(request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def keys_under(c, bucket: str, prefix: str = "") -> List[str]:
    out, kw = [], {"Bucket": bucket, "Prefix": prefix}
    while True:
        r = c.list_objects_v2(**kw)
        out += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            return sorted(out)
        kw["ContinuationToken"] = r["NextContinuationToken"]


def open_uploads(c, bucket: str) -> List[Tuple[str, str]]:
    return [(u["Key"], u["UploadId"]) for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def enforce_auth(endpoint: str, on: bool) -> None:
    """moto's IAM authentication from the next request on (``on``), or off again."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0" if on else b"inf", method="POST",
                                 headers={"Content-Type": "application/octet-stream"})  # read as the raw body
    urllib.request.urlopen(req).read()


Match = Callable[[str, str], bool]  # (method, path?query) -> bool


@dataclass
class _Rule:
    match: Match
    action: str  # fail | hold
    status: int = 500
    code: str = "InternalError"
    times: int = 1
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    hits: int = 0
    fn: Optional[Callable[[], None]] = None


class Proxy:
    """A forwarding HTTP proxy to ``upstream`` (moto) on a free loopback port: ``endpoint``."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.rules: List[_Rule] = []
        self.seen: List[Tuple[str, str]] = []
        self.ignore_conditions = False
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client killed mid-request: expected here
                if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, match: Match, status: int = 500, code: str = "InternalError", times: int = 1) -> _Rule:
        rule = _Rule(match, "fail", status, code, times)
        self.rules.append(rule)
        return rule

    def lose(self, match: Match, times: int = 1) -> _Rule:
        rule = _Rule(match, "lose", times=times)
        self.rules.append(rule)
        return rule

    def before(self, match: Match, fn: Callable[[], None], times: int = 1) -> _Rule:
        rule = _Rule(match, "before", times=times, fn=fn)
        self.rules.append(rule)
        return rule

    def hold(self, match: Match, times: int = 1) -> _Rule:
        rule = _Rule(match, "hold", times=times)
        self.rules.append(rule)
        return rule

    def release(self) -> None:
        for rule in self.rules:
            rule.released.set()

    def clear(self) -> None:
        self.release()
        self.rules, self.seen, self.ignore_conditions = [], [], False

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def count(self, method: str, needle: str = "") -> int:
        return sum(1 for m, p in list(self.seen) if m == method and needle in p)

    def _rule_for(self, method: str, path: str) -> Optional[_Rule]:
        with self._lock:
            self.seen.append((method, path))
            for rule in self.rules:
                if rule.hits < rule.times and rule.match(method, path):
                    rule.hits += 1
                    return rule
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._rule_for(h.command, h.path)
        if rule is not None and rule.action == "hold":
            rule.arrived.set()
            rule.released.wait(120)
            h.close_connection = True  # dropped: the client never gets an answer
            return
        if rule is not None and rule.action == "before":
            rule.fn()
            rule = None
        if rule is not None and rule.action == "fail":
            data = ERROR_XML.format(code=rule.code, message=f"injected by the test proxy ({rule.status})").encode()
            h.send_response(rule.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(data) if h.command != "HEAD" else 0))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive", "proxy-connection")}
        if self.ignore_conditions:
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=120)
        try:
            conn.request(h.command, h.path, body=body if (body or length) else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if rule is not None:  # lose: done upstream, the answer replaced by an error
                rule.arrived.set()
                data = ERROR_XML.format(code="InternalError", message="injected after forwarding").encode()
                h.send_response(500)
                h.send_header("Content-Length", str(len(data)) if h.command != "HEAD" else "0")
                h.end_headers()
                if h.command != "HEAD":
                    h.wfile.write(data)
                return
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive", "server", "date"):
                    h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)) if h.command != "HEAD" else resp.getheader("Content-Length", "0"))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
        finally:
            conn.close()


# ---- the fixtures of the publisher's tests (imported by each test module that uses them) -----------------
@pytest.fixture(scope="module")
def moto():
    """moto's server on a free port for the module's tests, with test credentials in the environment."""
    old = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server, endpoint = start_moto()
    yield endpoint
    server.stop()
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def s3(moto, request):
    """(boto3 client, a fresh bucket's name, a proxy in front of the server)."""
    c = client(moto)
    bucket = f"train-{abs(hash(request.node.name)) % 10**8}"
    c.create_bucket(Bucket=bucket)
    proxy = Proxy(moto)
    yield c, bucket, proxy
    proxy.close()
