"""Reading from a checkpoint folder, bounded and confined: every byte
hookloop reads from a checkpoint root goes through :func:`open_checked`.

A checkpoint root may be shared with others, downloaded, or on a disk that
went bad, so a file is opened only when

- it is inside its root: its real path (symbolic links resolved) stays
  under the root's real path; a link that leads out is refused, naming the
  link and where it leads, never what it holds;
- it is a regular file: checked with ``stat`` before it is opened (a FIFO or
  a device is never opened), opened with ``O_NOFOLLOW`` and ``O_NONBLOCK``
  (where the system has them) and checked again with ``fstat`` on what was
  opened (a FIFO swapped in cannot block it);
- it is no bigger than its limit (:data:`LATEST_LIMIT`,
  :data:`MANIFEST_LIMIT`, a data file: the size its manifest records), and
  no more than that is ever read (a file that grows while read is refused).

JSON from such a file is parsed by :func:`loads_json`, with a depth limit.
Every refusal is a :class:`RefusedFile`, a
:class:`~.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from .errors import CheckpointError

#: ``latest`` holds one checkpoint name (``step-00000040-epoch-end.12``)
LATEST_LIMIT = 512
#: ``hookloop.json``: the position, the networks, the plugin states as JSON
#: (their tensors are in ``hookloop.safetensors``), sizes and checksums
MANIFEST_LIMIT = 16 << 20
#: a safetensors header (safetensors itself refuses one over 100 MB)
HEADER_LIMIT = 100 << 20
#: the deepest nesting of lists and objects accepted in a checkpoint's JSON
#: (a manifest is ~4 deep plus its plugin states; Python's own parser gives
#: up near 1000, with a RecursionError)
MAX_JSON_DEPTH = 200

_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


class RefusedFile(CheckpointError):
    """A file of a checkpoint folder that hookloop does not read.

    :ivar file: the file, as it was named (inside its root).
    :ivar problem: why, without the file's name (``"is a FIFO ..."``).
    """

    def __init__(self, file, problem: str):
        super().__init__(f"{str(file)!r} {problem}")
        self.file = Path(file)
        self.problem = problem


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def inside(real: str, real_root: str) -> bool:
    """Whether real path ``real`` is ``real_root`` or under it."""
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def confined(file, root) -> str:
    """The real path of ``file``, once it is inside ``root`` (both with their
    symbolic links resolved); else :class:`RefusedFile` naming ``file`` and
    where it leads (the target's name only: nothing of it is read)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(file)
    if not inside(real, real_root):
        link = " (a symbolic link)" if os.path.islink(file) else ""
        raise RefusedFile(file, f"leads to {real!r}{link}, outside {real_root!r}: refusing to "
                                "follow it out of the checkpoint folder")
    return real


def check_folder(path) -> None:
    """Refuse a checkpoint folder that is a symbolic link, or whose real path
    is not its real parent's entry of the same name (its content lives
    elsewhere): :class:`RefusedFile` naming it and where it leads."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        path = Path(os.path.abspath(path))
        if not path.name:
            return
    real = os.path.realpath(path)
    expected = os.path.join(os.path.realpath(path.parent), path.name)
    if os.path.islink(path) or real != expected:
        raise RefusedFile(path, f"is a symbolic link to {real!r}: a checkpoint folder must be a "
                                "folder of its checkpoint root, not a link to one elsewhere "
                                "(copy it in instead)")


def file_size(file, root, what: str) -> int:
    """The size of regular file ``file`` inside ``root`` (not opened)."""
    real = confined(file, root)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(file, f"is {_kind(st.st_mode)}, not a regular file: refusing to read {what}")
    return st.st_size


class Opened:
    """A checked, open regular file of a checkpoint folder
    (:func:`open_checked`); use it in a ``with`` block."""

    def __init__(self, file: Path, real: str, fd: int, size: int, limit: int, why: str):
        self.file, self.real, self.fd, self.size = file, real, fd, size
        self._limit, self._why = limit, why

    def read(self) -> bytes:
        """The whole file: at most its limit (one more byte is an error)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks, total = [], 0
        while True:
            chunk = os.read(self.fd, min(1 << 20, self._limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > self._limit:
                raise RefusedFile(self.file, f"grew past {self._limit} bytes while it was read "
                                             f"({self._why}): refusing to read more")
        return b"".join(chunks)

    def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (fewer at the end of the file)."""
        os.lseek(self.fd, offset, os.SEEK_SET)
        chunks, left = [], size
        while left > 0:
            chunk = os.read(self.fd, min(1 << 20, left))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def crc32(self) -> int:
        """CRC-32 of the file, through a memory map of the open file."""
        import mmap
        import zlib

        if self.size == 0:
            return 0
        with mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ) as mapped:
            return zlib.crc32(mapped)

    def source(self):
        """What a loader (``torch.load``, safetensors) is given to read this
        very file: its open descriptor's ``/proc/self/fd`` path where there
        is one (Linux), else its bytes."""
        proc = f"/proc/self/fd/{self.fd}"
        if os.path.exists(proc):
            return proc
        return self.read()

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checked(file, root, *, limit: int, what: str, why: str | None = None) -> Opened:
    """Open regular file ``file`` of checkpoint folder (or root) ``root``,
    no bigger than ``limit`` bytes, or raise :class:`RefusedFile` naming it
    (``what`` it holds, ``why`` that limit). A missing file raises
    :class:`FileNotFoundError`."""
    file = Path(file)
    why = why or f"the most {what} may be"
    real = confined(file, root)
    try:
        before = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(before.st_mode):
        raise RefusedFile(file, f"is {_kind(before.st_mode)}, not a regular file: refusing to read {what}")
    try:
        fd = os.open(real, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise RefusedFile(file, f"changed into {_kind(st.st_mode)} while it was opened: refusing "
                                    f"to read {what}")
        if st.st_size > limit:
            raise RefusedFile(file, f"is {st.st_size} bytes, more than {limit} ({why}): refusing to "
                                    f"read {what}")
        return Opened(file, real, fd, st.st_size, limit, why)
    except BaseException:
        os.close(fd)
        raise


def read_checked(file, root, *, limit: int, what: str, why: str | None = None) -> bytes:
    """The bytes of ``file`` (:func:`open_checked`)."""
    with open_checked(file, root, limit=limit, what=what, why=why) as opened:
        return opened.read()


def loads_json(data: bytes, file, *, max_depth: int = MAX_JSON_DEPTH):
    """``data`` as JSON (UTF-8), nested at most ``max_depth`` deep; else
    :class:`RefusedFile` naming ``file`` (never a RecursionError or a
    MemoryError)."""
    try:
        doc = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        raise RefusedFile(file, f"is nested too deep to parse as JSON (more than {max_depth} "
                                "levels): it is corrupt, or not hookloop's") from None
    except MemoryError:
        raise RefusedFile(file, "does not fit in memory when parsed as JSON: it is corrupt, "
                                "or not hookloop's") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RefusedFile(file, f"is not valid JSON ({str(exc)[:200]}): it is truncated or "
                                "corrupt") from None
    if depth(doc, max_depth) > max_depth:
        raise RefusedFile(file, f"is JSON nested more than {max_depth} levels deep: it is "
                                "corrupt, or not hookloop's")
    return doc


def depth(doc, stop: int) -> int:
    """How deep lists and dicts nest in ``doc`` (without recursion), counted
    up to ``stop + 1``."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        obj, level = todo.pop()
        if isinstance(obj, (list, dict)):
            deepest = max(deepest, level)
            if deepest > stop:
                return deepest
            todo.extend((v, level + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    return deepest


def relative_entry(rel) -> str | None:
    """Why ``rel`` is not a file path inside its checkpoint (relative, POSIX,
    no ``..``, ``.`` or empty parts, no backslash or NUL), or None if it is."""
    if not isinstance(rel, str) or not rel:
        return "it is not a file name"
    if "\\" in rel or "\0" in rel:
        return "it holds a backslash or a NUL"
    if rel.startswith("/") or os.path.isabs(rel) or (len(rel) > 1 and rel[0].isalpha() and rel[1] == ":"):
        return "it is an absolute path"
    parts = rel.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "it has an empty, '.' or '..' part"
    return None
