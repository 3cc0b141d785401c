"""Reading a snapshot's files without ever leaving the snapshot directory.

Names come from the manifest, the index, a pointer or a listing, i.e. from the files being
checked. Each must be one plain path component (no ``/``, no ``..``, no NUL), and is opened
relative to an open descriptor of the directory with ``O_NOFOLLOW``: a symbolic link is refused
even when it points inside today (it can lead outside tomorrow), so nothing outside the directory
is ever opened. ``O_NONBLOCK`` keeps a FIFO from blocking the open; anything but a regular file
is refused before a byte is read. Every failure is an :class:`Unreadable` with a reason to print
after the file's name.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import List, Optional

from ..write.header import parse_json_strict, short

MAX_JSON_BYTES = 64 * 2**20  # a manifest or index is a few MB at most
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


class Unreadable(Exception):
    """A listed file that cannot be checked; ``str()`` is the reason."""


def name_problem(name, inside: str = "the snapshot") -> Optional[str]:
    """Why ``name`` is not a plain file name inside the snapshot (or ``inside``), or None when it is one.

    >>> name_problem("model-00001-of-00002.safetensors") is None
    True
    >>> name_problem("../../etc/hostname")
    "'../../etc/hostname' is not a plain file name inside the snapshot"
    """
    if not isinstance(name, str):
        return f"{short(name)} is {json_kind(name)}, not a file name"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape: no file has this name
        return f"{short(name)} is not a valid file name"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"{short(name)} is not a plain file name inside {inside}"
    if len(os.fsencode(name)) > 255:
        return f"{short(name)} is longer than a file name can be"
    return None


def label(name: str) -> str:
    """A file name as messages show it: as is when short and printable, else quoted and cut."""
    return name if name.isprintable() and 0 < len(name) <= 120 else short(name, 120)


def json_kind(value) -> str:
    """The JSON type of ``value``, for messages ('a list', 'a string', ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for types, word in ((dict, "an object"), (list, "a list"), (str, "a string"), ((int, float), "a number")):
        if isinstance(value, types):
            return word
    return type(value).__name__


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "is a symbolic link (never followed: a link can lead outside the directory)"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    return "is not a regular file (a FIFO, socket or device)"


def _reason(e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return "vanished while it was checked"
    return f"cannot be read ({e.strerror or e})"


class SnapshotDir:
    """An open directory; files are read only through it, by plain name, never through a link."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: "str | os.PathLike") -> "SnapshotDir":
        """Open a directory given by the user (a link there is the user's choice and is followed)."""
        try:
            return cls(os.open(path, _DIR_FLAGS), str(path))
        except OSError as e:
            raise Unreadable(_reason(e)) from e

    def child(self, name: str) -> "SnapshotDir":
        """Open the subdirectory ``name`` (a plain name; a link is refused)."""
        try:
            return SnapshotDir(os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd), os.path.join(self.path, name))
        except OSError as e:
            raise Unreadable(_reason(e)) from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "SnapshotDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def identity(self) -> tuple:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def names(self) -> List[str]:
        try:
            return sorted(os.listdir(self.fd))
        except OSError as e:
            raise Unreadable(_reason(e)) from e

    def lstat(self, name: str) -> Optional[os.stat_result]:
        """The entry's own status (a link is not followed), or None if there is no such entry."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return None
            raise Unreadable(_reason(e)) from e
        except ValueError:  # a NUL in the name: no such entry
            return None

    def kind_problem(self, name: str) -> Optional[str]:
        """Why the entry ``name`` is not a regular file ("missing" if absent), or None."""
        st = self.lstat(name)
        if st is None:
            return "missing"
        return None if stat.S_ISREG(st.st_mode) else _kind_of(st.st_mode)

    def open_file(self, name: str):
        """Open the regular file ``name`` for reading; raises :class:`Unreadable`."""
        problem = name_problem(name)
        if problem:
            raise Unreadable(problem)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as e:
            kind = self.kind_problem(name)  # a link (ELOOP), a socket (ENXIO), gone meanwhile, ...
            raise Unreadable(kind or _reason(e)) from e
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise Unreadable(_kind_of(mode))
        return os.fdopen(fd, "rb")

    def read_json(self, name: str, limit: Optional[int] = None):
        """Parse the JSON file ``name`` strictly (see ``parse_json_strict``); raises :class:`Unreadable`."""
        limit = MAX_JSON_BYTES if limit is None else limit
        with self.open_file(name) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise Unreadable(f"is {size} bytes, over the limit of {limit} for this file")
            data = f.read(limit + 1)
        try:
            return parse_json_strict(data)
        except ValueError as e:
            raise Unreadable(str(e)) from e

    def read_text(self, name: str, limit: int) -> str:
        """The UTF-8 text of the small file ``name``; raises :class:`Unreadable`."""
        with self.open_file(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise Unreadable(f"is over {limit} bytes")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Unreadable(f"is not UTF-8 ({e.reason} at byte {e.start})") from e


def describe_path(path: Path) -> Optional[str]:
    """Why a path given by the user cannot be a directory to verify, or None."""
    if not os.path.lexists(path):
        return "does not exist"
    if not path.exists():
        return "is a symbolic link to nothing"
    if path.is_file():
        return "is a file, not a snapshot or output directory"
    if not path.is_dir():
        return "is not a directory"
    return None
