"""Where a snapshot writer's time went, thread by thread (``SnapshotWriter.stats``)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class WriterStats(dict):
    """Seconds (``*_s``) and counts of one writer, summed over its threads:

    * ``put_wait_s``: the producer (the assembly) blocked in ``put`` by ``max_pending_bytes``;
    * ``pool_wait_s``: the writer thread waiting for a free copy buffer (the disk or the hash is behind);
    * ``copy_s``: making strided tensors (transposed views) contiguous, on the worker threads;
    * ``fill_s``: computing lazy arrays (casts to ``export.dtype``, LoRA merges) into the copy buffers,
      on the worker threads;
    * ``write_s``: ``pwrite`` into the page cache, in file order, on whichever worker; ``allocate_s``:
      ``fallocate``;
    * ``hash_s``: the checksum of every byte in file order, on whichever worker;
    * ``writeback_s``: starting early writeback; ``fsync_s``: each file's final fsync (file thread);
    * ``rehash_s``: reading back a file written out of order to checksum it;
    * ``bytes_copied``, ``bytes_filled``, ``bytes_written``, ``bytes_hashed``, ``blocks``, ``writebacks``.

    Times of different threads overlap: their sum may exceed the wall time (``elapsed_s``).
    """

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def add(self, key: str, value) -> None:
        with self._lock:
            self[key] = self.get(key, 0) + value

    @contextmanager
    def timed(self, key: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self)
