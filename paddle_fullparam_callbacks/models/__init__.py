"""What the package knows of framework model classes: names, global shapes and configs
(``model_info``), tensor-parallel state dicts that contradict their layer (``shard_fixes``),
pipeline classes (``pipe``) and the name mappings to Hugging Face (``mappings``). Turns a live
model into a :class:`~..export.source.ModelSource`; used by both the trainer and convert paths."""
