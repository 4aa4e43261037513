"""Reading a checkpoint folder bounded and confined, each file opened once:
every byte hookloop reads from a checkpoint root goes through
:func:`open_checked`. A root may be shared, downloaded, or on a disk that went
bad, so a file is opened only when it is inside its root (symbolic links
resolved; a link out is refused, naming where it leads, never what it holds),
a regular file (``stat`` before ``open``, ``O_NOFOLLOW | O_NONBLOCK``,
``fstat`` after: a FIFO or a device is never read), and no bigger than its
limit; no more than that is ever read. The open descriptor is what every
reader uses: the deserialisers (:meth:`Opened.reader`, :meth:`Opened.mmap`)
and the CRC-32 (zlib's polynomial; ISA-L's ``isal`` when installed, ~5x
faster, the same values). Every refusal is a :class:`RefusedFile` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap as _mmap
import os
import stat
import zlib
from pathlib import Path

from .errors import CheckpointError

#: ``latest`` holds one checkpoint name; a manifest, its JSON; a safetensors header
LATEST_LIMIT, MANIFEST_LIMIT, HEADER_LIMIT = 512, 16 << 20, 100 << 20
#: the deepest nesting of lists and objects accepted in a checkpoint's JSON
MAX_JSON_DEPTH = 200
_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))

try:  # an optional speed-up: ISA-L's carry-less multiplication
    from isal import isal_zlib

    crc32, CRC32_IMPLEMENTATION = (isal_zlib.crc32, "isal") if isal_zlib.crc32(b"hookloop") == zlib.crc32(
        b"hookloop") else (zlib.crc32, "zlib")
except ImportError:
    crc32, CRC32_IMPLEMENTATION = zlib.crc32, "zlib"


#: bytes read at a time to catch up a checksum
CHUNK = 4 << 20


def crc32_of(mapped) -> int:
    """CRC-32 of a memory map, in one call (the GIL released), closing it; None: empty."""
    if mapped is None:
        return 0
    with mapped:
        return crc32(mapped)


def crc32_fd(fd: int, size: int) -> int:
    """CRC-32 of the first ``size`` bytes of open file ``fd``."""
    return crc32_of(_mmap.mmap(fd, size, access=_mmap.ACCESS_READ) if size else None)


class RefusedFile(CheckpointError):
    """A file of a checkpoint folder that hookloop does not read; ``problem``:
    why, without the file's name."""

    def __init__(self, file, problem: str):
        super().__init__(f"{str(file)!r} {problem}")
        self.file, self.problem = Path(file), problem


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def confined(file, root) -> str:
    """The real path of ``file``, once it is inside ``root``; else :class:`RefusedFile`."""
    real_root, real = os.path.realpath(root), os.path.realpath(file)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        link = " (a symbolic link)" if os.path.islink(file) else ""
        raise RefusedFile(file, f"leads to {real!r}{link}, outside {real_root!r}: refusing to follow it out "
                                "of the checkpoint folder")
    return real


def check_folder(path) -> None:
    """Refuse a checkpoint folder that is a symbolic link (its content lives elsewhere)."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        path = Path(os.path.abspath(path))
        if not path.name:
            return
    real = os.path.realpath(path)
    if os.path.islink(path) or real != os.path.join(os.path.realpath(path.parent), path.name):
        raise RefusedFile(path, f"is a symbolic link to {real!r}: a checkpoint folder must be a folder of "
                                "its checkpoint root, not a link to one elsewhere (copy it in instead)")


def _stat(file, root, what: str):
    real = confined(file, root)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(file, f"is {_kind(st.st_mode)}, not a regular file: refusing to read {what}")
    return real, st


def file_size(file, root, what: str) -> int:
    """The size of regular file ``file`` inside ``root`` (not opened)."""
    return _stat(file, root, what)[1].st_size


class Opened:
    """A checked, open regular file of a checkpoint folder; use it in a ``with`` block."""

    def __init__(self, file: Path, fd: int, size: int, limit: int, why: str):
        self.file, self.fd, self.size, self._limit, self._why = file, fd, size, limit, why

    def read(self) -> bytes:
        """The whole file, at most its limit (one more byte is an error)."""
        data = os.pread(self.fd, min(self._limit, self.size) + 1, 0)
        while len(data) <= self._limit and (more := os.pread(self.fd, self._limit + 1 - len(data), len(data))):
            data += more  # (it grew since it was opened)
        if len(data) > self._limit:
            raise RefusedFile(self.file, f"grew past {self._limit} bytes while it was read ({self._why}): "
                                         "refusing to read more")
        return data

    def read_at(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset) if size else b""

    def reader(self):
        """An unbuffered file object reading this very descriptor from its start (no second open)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return os.fdopen(self.fd, "rb", buffering=0, closefd=False)

    def mmap(self, private: bool = True):
        """A memory map of the file, which outlives the descriptor (None: empty).
        ``private``: copy-on-write (tensors made from it keep it); else read-only."""
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


class ChecksummingReader(io.RawIOBase):
    """A file object over an :class:`Opened` file that computes the whole
    file's CRC-32 from the bytes its reader reads, in file order: what the
    reader reads front to back is checksummed as it lands, hot in the cache
    (``torch.load`` reads a zip's records in order, each storage straight into
    its tensor's memory); the little it skips between them (a record's name
    and padding) and what it read out of order (the zip's directory, at the
    end) is read for the checksum: each byte of the file read once more at
    most, the tensors' not at all. :meth:`checksum` finishes it."""

    #: a gap up to this size ahead of the checksum is read to keep up; a read further ahead is left for the end
    GAP = 1 << 16

    def __init__(self, opened: Opened):
        super().__init__()
        self.opened, self.pos, self.done, self.crc = opened, 0, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset if whence == os.SEEK_SET else self.pos + offset if whence == os.SEEK_CUR \
            else self.opened.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.opened.size - self.pos))
        n = _pread_into(self.opened.fd, view[:want], self.pos) if want else 0
        if self.done < self.pos <= self.done + self.GAP:
            self._catch_up(self.pos)
        if self.pos <= self.done < self.pos + n:
            self.crc = crc32(view[self.done - self.pos:n], self.crc)
            self.done = self.pos + n
        self.pos += n
        return n

    def _catch_up(self, upto: int) -> None:
        while self.done < upto:
            data = os.pread(self.opened.fd, min(CHUNK, upto - self.done), self.done)
            if not data:
                break
            self.crc, self.done = crc32(data, self.crc), self.done + len(data)

    def checksum(self) -> int:
        """The CRC-32 of the whole file (the rest read now)."""
        self._catch_up(self.opened.size)
        return self.crc


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (short only at the end of the file)."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # (Windows)
            data = os.pread(fd, len(view) - done, offset + done)
            n = len(data)
            view[done:done + n] = data
        if not n:
            break
        done += n
    return done


def open_checked(file, root, *, limit: int, what: str, why: str | None = None) -> Opened:
    """Open regular file ``file`` of checkpoint folder (or root) ``root``, no
    bigger than ``limit`` bytes, or raise :class:`RefusedFile` naming it
    (``what`` it holds, ``why`` that limit); a missing one: FileNotFoundError."""
    file, why = Path(file), why or f"the most {what} may be"
    real, before = _stat(file, root, what)
    try:
        fd = os.open(real, _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RefusedFile(file, f"cannot be read ({what}): {type(exc).__name__}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise RefusedFile(file, f"changed into {_kind(st.st_mode)} while it was opened: refusing to read {what}")
        if st.st_size > limit:
            raise RefusedFile(file, f"is {st.st_size} bytes, more than {limit} ({why}): refusing to read {what}")
        return Opened(file, fd, st.st_size, limit, why)
    except BaseException:
        os.close(fd)
        raise


def read_checked(file, root, *, limit: int, what: str, why: str | None = None) -> bytes:
    with open_checked(file, root, limit=limit, what=what, why=why) as opened:
        return opened.read()


def loads_json(data: bytes, file, *, max_depth: int = MAX_JSON_DEPTH):
    """``data`` as JSON, nested at most ``max_depth`` deep; else
    :class:`RefusedFile` naming ``file`` (never a RecursionError)."""
    try:
        doc = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        raise RefusedFile(file, f"is nested too deep to parse as JSON (more than {max_depth} levels): it is "
                                "corrupt, or not hookloop's") from None
    except MemoryError:
        raise RefusedFile(file, "does not fit in memory when parsed as JSON: it is corrupt, or not "
                                "hookloop's") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RefusedFile(file, f"is not valid JSON ({str(exc)[:200]}): it is truncated or corrupt") from None
    deepest, todo = 0, [(doc, 1)]  # (without recursion)
    while todo and deepest <= max_depth:
        obj, level = todo.pop()
        if isinstance(obj, (list, dict)):
            deepest = max(deepest, level)
            todo.extend((v, level + 1) for v in (obj.values() if isinstance(obj, dict) else obj))
    if deepest > max_depth:
        raise RefusedFile(file, f"is JSON nested more than {max_depth} levels deep: it is corrupt, or not hookloop's")
    return doc


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
