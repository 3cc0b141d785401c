"""The start's proof that the store can take snapshots: write, read back and delete a probe object under
the prefix, and find out whether the store honours the conditional headers the protocol relies on.

Run by the coordinator at ``on_train_begin`` (and by ``paddle-fullparam publish``) before step 1: bad
credentials, a missing bucket, a wrong endpoint or region fail the start with the store's own error and
the URL. A store that ignores If-None-Match or If-Match (a second conditional PUT of the probe succeeds)
fails it too, unless ``publish.require_conditional_writes`` is false: then it is used with a warning.
"""
from __future__ import annotations

import os
import uuid
from typing import List

from .store import Store, StoreError

PROBE = ".fullparam-probe-"


class ProbeFailed(Exception):
    """The store cannot be used for publishing; the message names the URL, the endpoint and the store's error."""


def probe(store: Store, require_conditional: bool = True) -> List[str]:
    """Prove ``store`` usable; returns the warnings (a store ignoring conditional headers, when allowed)."""
    key = store.key(f"{PROBE}{uuid.uuid4().hex[:12]}")
    body = b"paddle_fullparam_callbacks probe " + os.urandom(16).hex().encode()
    where = f"publish.url {store.url} (endpoint {store.endpoint})"
    try:
        store.put(key, body, IfNoneMatch="*")
    except StoreError as e:
        raise ProbeFailed(f"{where}: cannot write the probe object {store.where(key)}: {e}") from e
    ignored = []
    try:
        got = store.get(key)
        if got is None or got[0] != body:
            raise ProbeFailed(f"{where}: the probe object {store.where(key)} reads back "
                              f"{'as missing' if got is None else 'with other bytes'} right after it was written")
        for what, condition in (("If-None-Match: *", {"IfNoneMatch": "*"}), ("If-Match", {"IfMatch": '"' + "0" * 32 + '"'})):
            try:
                store.put(key, body, **condition)
                ignored.append(what)
            except StoreError as e:
                if e.status != 412 and e.code != "PreconditionFailed":
                    raise ProbeFailed(f"{where}: a PUT with {what} of the probe object was refused: {e}") from e
    except StoreError as e:
        raise ProbeFailed(f"{where}: cannot read back the probe object {store.where(key)}: {e}") from e
    finally:
        try:
            store.delete(key)
        except StoreError as e:
            raise ProbeFailed(f"{where}: cannot delete the probe object {store.where(key)} (publishing needs "
                              f"delete for retention and replacement): {e}") from e
    if not ignored:
        return []
    message = (f"{where}: the store ignores {' and '.join(ignored)} (a conditional PUT of the probe object that "
               "must fail succeeded): the manifest cannot be written once-only nor latest/best replaced by "
               "compare-and-swap")
    if require_conditional:
        raise ProbeFailed(message + "; set publish.require_conditional_writes=false to publish with one writer per "
                                    "prefix (docs/publishing.md says what then holds)")
    return [message + "; publishing goes on (publish.require_conditional_writes=false): one writer per prefix"]
