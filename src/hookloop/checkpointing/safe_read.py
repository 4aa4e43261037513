"""Reading from a checkpoint folder, bounded and confined, each file opened
once: every byte hookloop reads from a checkpoint root goes through
:func:`open_checked`.

A checkpoint root may be shared with others, downloaded, or on a disk that
went bad, so a file is opened only when

- it is inside its root: its real path (symbolic links resolved) stays
  under the root's real path; a link that leads out is refused, naming the
  link and where it leads, never what it holds;
- it is a regular file: checked with ``stat`` before it is opened (a FIFO or
  a device is never opened), opened with ``O_NOFOLLOW`` and ``O_NONBLOCK``
  and checked again with ``fstat`` on what was opened;
- it is no bigger than its limit (:data:`LATEST_LIMIT`,
  :data:`MANIFEST_LIMIT`, a data file: the size its manifest records), and
  no more than that is ever read.

The open descriptor is what everything reads: the deserialisers (through
:meth:`Opened.file` and :meth:`Opened.mmap`) and the CRC-32 (:func:`crc32_fd`),
so that a file is opened once and its bytes come from storage once (a
network file system serves the second reader from the page cache). JSON is
parsed by :func:`loads_json`, with a depth limit. Every refusal is a
:class:`RefusedFile`, a :class:`~.errors.CheckpointError` naming the file.

The checksum of every file is CRC-32 (zlib's polynomial), computed with ISA-L
(``isal``: ~5x zlib, the same values) when it is installed, else with zlib.
"""

from __future__ import annotations

import contextlib
import json
import mmap as _mmap
import os
import stat
import zlib
from pathlib import Path

from .errors import CheckpointError

#: ``latest`` holds one checkpoint name (``step-00000040-epoch-end.12``)
LATEST_LIMIT = 512
#: ``hookloop.json``: the position, the networks, the plugin states as JSON
MANIFEST_LIMIT = 16 << 20
#: a safetensors header (safetensors itself refuses one over 100 MB)
HEADER_LIMIT = 100 << 20
#: the deepest nesting of lists and objects accepted in a checkpoint's JSON
#: (Python's own parser gives up near 1000, with a RecursionError)
MAX_JSON_DEPTH = 200

_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def _fastest_crc32():
    try:
        from isal import isal_zlib
    except ImportError:  # an optional speed-up
        return zlib.crc32, "zlib"
    if isal_zlib.crc32(b"hookloop") != zlib.crc32(b"hookloop"):  # pragma: no cover - never seen
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


#: zlib-compatible ``crc32(data, value=0)``, and whose it is (``"isal"`` or ``"zlib"``)
crc32, CRC32_IMPLEMENTATION = _fastest_crc32()


def crc32_fd(fd: int, size: int) -> int:
    """CRC-32 of the first ``size`` bytes of open file ``fd``, through a
    memory map (no copy), in one call: the GIL is released for the whole file."""
    return crc32_of(_mmap.mmap(fd, size, access=_mmap.ACCESS_READ) if size else None)


def crc32_of(mapped) -> int:
    """CRC-32 of a memory map (closed afterwards; None: an empty file)."""
    if mapped is None:
        return 0
    with mapped:
        return crc32(mapped)


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
    """The real path of ``file``, once it is inside ``root``; else
    :class:`RefusedFile` naming ``file`` and where it leads."""
    real_root, real = os.path.realpath(root), os.path.realpath(file)
    if not inside(real, real_root):
        link = " (a symbolic link)" if os.path.islink(file) else ""
        raise RefusedFile(file, f"leads to {real!r}{link}, outside {real_root!r}: refusing to "
                                "follow it out of the checkpoint folder")
    return real


def check_folder(path) -> None:
    """Refuse a checkpoint folder that is a symbolic link, or whose real path
    is not its real parent's entry of the same name."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        path = Path(os.path.abspath(path))
        if not path.name:
            return
    real = os.path.realpath(path)
    if os.path.islink(path) or real != os.path.join(os.path.realpath(path.parent), path.name):
        raise RefusedFile(path, f"is a symbolic link to {real!r}: a checkpoint folder must be a "
                                "folder of its checkpoint root, not a link to one elsewhere "
                                "(copy it in instead)")


def _stat(real: str, file, what: str):
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(file, f"is {_kind(st.st_mode)}, not a regular file: refusing to read {what}")
    return st


def file_size(file, root, what: str) -> int:
    """The size of regular file ``file`` inside ``root`` (not opened)."""
    return _stat(confined(file, root), file, what).st_size


class Opened:
    """A checked, open regular file of a checkpoint folder
    (:func:`open_checked`); use it in a ``with`` block."""

    def __init__(self, file: Path, fd: int, size: int, limit: int, why: str):
        self.file, self.fd, self.size = file, fd, size
        self._limit, self._why = limit, why

    def read(self) -> bytes:
        """The whole file: at most its limit (one more byte is an error)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks, total = [], 0
        while chunk := os.read(self.fd, min(1 << 20, self._limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > self._limit:
                raise RefusedFile(self.file, f"grew past {self._limit} bytes while it was read "
                                             f"({self._why}): refusing to read more")
        return b"".join(chunks)

    def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (fewer at the end of the file)."""
        return os.pread(self.fd, size, offset) if size else b""

    def reader(self):
        """An unbuffered file object reading this very descriptor, from its
        start (what ``torch.load`` is given: no second open)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return os.fdopen(self.fd, "rb", buffering=0, closefd=False)

    def mmap(self, private: bool = True):
        """A memory map of the file, which outlives the descriptor (None: an
        empty file). ``private``: copy-on-write (tensors made from it own
        it: it is unmapped when the last one goes); else read-only."""
        if not self.size:
            return None
        return _mmap.mmap(self.fd, self.size, access=_mmap.ACCESS_COPY if private else _mmap.ACCESS_READ)

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
    before = _stat(real, file, what)
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
        return Opened(file, fd, st.st_size, limit, why)
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
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "it has an empty, '.' or '..' part"
    return None
