"""One export, end to end: where tensors come from (``streaming``), the plans (``planning``), the
exporters (``exporters``), the status exchange and commit (``finishing``), the distributed context
(``distributed``), host memory (``host``) and the session that ties them across a job's exports
(``session``). It reads a :class:`~..source.ModelSource`, whichever path fed it (the trainer or
``convert``)."""
from .session import ExportSession

__all__ = ["ExportSession"]
