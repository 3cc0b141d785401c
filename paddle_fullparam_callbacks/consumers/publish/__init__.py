"""The publisher (issue 26): each committed snapshot copied to object storage (S3 and S3-compatible
stores) or handed to a command, in a process of its own while training goes on, never visible on the
store as half a snapshot, resumed after a crash.

``store.py`` (the boto3 client and its retries), ``probe.py`` (the start's proof), ``upload.py``
(one file: single PUT or parallel multipart within a memory budget, checked after upload),
``journal.py`` (the multipart uploads started, for resuming), ``remote.py`` (the order of requests
that commits a snapshot on the store; latest/best by compare-and-swap; remote retention),
``engine.py`` (one publication end to end), ``worker.py`` (the publishing process the runner
starts), ``records.py`` (the record beside the snapshot), ``hook.py`` (the coordinator's line of
publications, on the consumers' hook base ``../hook.py``), ``offline.py`` (``paddle-fullparam
publish``) and ``verify.py`` (``paddle-fullparam verify s3://...``).
"""
