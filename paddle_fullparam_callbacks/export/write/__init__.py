"""The streaming safetensors writer (``writer``): its threads (``pipeline``), strided copies
(``copy``), the system calls it uses (``syscalls``), its statistics (``stats``), the file checksum
(``checksum``), durable small writes (``fsync``) and the bounds-checked header reader (``header``).
Knows nothing of models, trainers or the commit protocol."""
