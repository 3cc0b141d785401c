"""Layer 3: full tensors from sharded state dicts, as ``(name, tensor)`` streams."""
from .local import LocalAssembler
from .mapping import DestinationMap, MappingError, build_destination_map, local_shard_info, source_signature

__all__ = ["DestinationMap", "LocalAssembler", "MappingError", "build_destination_map", "local_shard_info", "source_signature"]
