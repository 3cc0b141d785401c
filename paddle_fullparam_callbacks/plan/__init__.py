"""Layer 2: pure planning from metadata, no collectives and no I/O: the topology plan (meshes,
splits, writers), the export plan (shard files, headers, offsets, the index), snapshot names and
the trigger/retention decisions."""
