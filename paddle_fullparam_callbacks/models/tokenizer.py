"""The tokenizer (and processor) files a snapshot carries, and where they come from.

A snapshot without tokenizer files loads as weights only: ``AutoTokenizer.from_pretrained``, vLLM,
SGLang and llama.cpp's ``convert_hf_to_gguf.py`` need them. The files come from, in this order:

1. ``export.tokenizer``: a directory (a tokenizer's, a processor's or a whole model's) whose
   tokenizer and processor files are copied as they are;
2. the trainer's ``tokenizer`` / ``processing_class`` (its ``save_pretrained`` writes them; a
   processor writes its image processor config and chat template too);
3. none: the job says so once at start, with how to give one.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any, List, Optional

from ..config.schema import ConfigError

logger = logging.getLogger("paddle_fullparam_callbacks")

FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|spiece\.model"
    r"|sentencepiece\.bpe\.model|.*\.tiktoken|chat_template\.(json|jinja)|preprocessor_config\.json"
    r"|processor_config\.json|video_preprocessor_config\.json)$")
"""Names of the files ``save_pretrained`` of a tokenizer or processor writes (and nothing of a model's)."""


def tokenizer_files(directory: "str | Path") -> List[Path]:
    """The tokenizer and processor files in ``directory`` (not its subdirectories)."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file() and FILES.match(p.name))


class TokenizerFiles:
    """Tokenizer files on disk, written into a snapshot as ``save_pretrained`` would write them."""

    def __init__(self, files: List[Path], origin: str = ""):
        self.files = list(files)
        self.origin = origin

    @classmethod
    def from_directory(cls, directory: "str | Path") -> "TokenizerFiles":
        """The files of ``export.tokenizer``; a ConfigError when it holds none."""
        files = tokenizer_files(directory)
        if not files:
            raise ConfigError("export.tokenizer", f"{str(directory)!r} holds no tokenizer files (tokenizer.json, "
                                                  "tokenizer_config.json, vocab/merges files, tokenizer.model, ...)")
        return cls(files, str(directory))

    def save_pretrained(self, directory: str) -> None:
        for f in self.files:
            shutil.copyfile(f, Path(directory) / f.name)


NO_TOKENIZER = ("the trainer has no tokenizer and export.tokenizer is not set: snapshots will hold no tokenizer "
                "files, so AutoTokenizer.from_pretrained, vLLM and llama.cpp's converter cannot use them as they "
                "are. Give the Trainer its tokenizer (tokenizer= / processing_class=), or set export.tokenizer to a "
                "directory that holds the tokenizer files (the base model's, for instance)")


def choose(config_path: Optional[str], trainer_tokenizer: Any, warn: bool) -> Any:
    """The tokenizer a snapshot is given: export.tokenizer's files, else the trainer's, else None (with
    the warning, where ``warn``: once per job, at start)."""
    if config_path:
        return TokenizerFiles.from_directory(config_path)
    if trainer_tokenizer is None and warn:
        logger.warning("%s", NO_TOKENIZER)
    return trainer_tokenizer
