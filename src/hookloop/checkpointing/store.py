"""A checkpoint root on disk: the names and places (checkpoint folders,
``latest``, run folders, temporary and trash folders), cleaning a root, and
reading its files bounded and confined.

Every byte hookloop reads from a root goes through :func:`open_checked`: a
root may be shared, downloaded or on a disk that went bad, so a file is read
only when it is inside its root (symbolic links resolved; a link out is
refused, naming where it leads), a regular file (``stat`` before ``open``,
``O_NOFOLLOW | O_NONBLOCK``, ``fstat`` after: a FIFO or a device is never
read) and no bigger than its limit. Its one descriptor serves the CRC-32 (a
memory map; ISA-L's ``isal`` when installed, ~5x zlib's speed, the same
values) and then the library that parses it (safetensors, ``torch.load``).
"""

from __future__ import annotations

import contextlib
import json
import mmap as _mmap
import os
import re
import shutil
import stat
import zlib
from pathlib import Path

from .errors import CheckpointError, NotACheckpointName

FORMAT = "hookloop-checkpoint"
#: 2: run id, checksums, run settings, finiteness, optimizer classes and a
#: checksum of the manifest itself (hookloop 0.2 on); version 1 (0.1) is not read
VERSION = 2
STATE_FILE = "hookloop.json"
TENSORS_FILE = "hookloop.safetensors"
RANK_FILE = "hookloop-rank{rank}.safetensors"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: ``step-<update>[-epoch-end][.<generation>]``: a save of a position whose
#: checkpoint ``latest`` names takes the next generation (never renamed over it)
NAME_PATTERN = re.compile(r"^step-(\d+)(-epoch-end)?(?:\.(\d+))?$")
_RUN = re.compile(r"^version_(\d+)$")
#: ``latest`` holds one checkpoint name; a manifest, its JSON
LATEST_LIMIT, MANIFEST_LIMIT = 512, 16 << 20
#: the deepest nesting of lists and objects accepted in a checkpoint's JSON
MAX_JSON_DEPTH = 200
_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))

try:  # an optional speed-up: ISA-L's carry-less multiplication
    from isal import isal_zlib

    crc32 = isal_zlib.crc32 if isal_zlib.crc32(b"hookloop") == zlib.crc32(b"hookloop") else zlib.crc32
except ImportError:
    crc32 = zlib.crc32


# -- checkpoint names --------------------------------------------------------------------


def checkpoint_name(global_step: int, epoch_end: bool = False) -> str:
    return f"step-{global_step:08d}" + ("-epoch-end" if epoch_end else "")


def sort_key(path: Path):
    """The order of checkpoints: by step, epoch-end after mid-epoch, then by generation."""
    match = NAME_PATTERN.match(path.name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint's name (step-<N>[-epoch-end][.<n>])")
    return (int(match.group(1)), bool(match.group(2)), int(match.group(3) or 0))


def next_generation(path: Path) -> Path:
    """The first free ``<name>.<n>`` next to checkpoint ``path``."""
    match = NAME_PATTERN.match(path.name)
    base = path.name if match is None or match.group(3) is None else path.name.rsplit(".", 1)[0]
    n = 1
    while (path.parent / f"{base}.{n}").exists():
        n += 1
    return path.parent / f"{base}.{n}"


def list_checkpoints(root) -> list[Path]:
    """The checkpoint directories in ``root``, oldest first (not validated)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if NAME_PATTERN.match(p.name) and p.is_dir()), key=sort_key)


def read_latest(root) -> str | None:
    """The checkpoint name ``root/latest`` holds (None: none), read bounded and
    confined; never followed out of its root (:class:`CheckpointError`), nor
    to a ``.tmp-`` or ``.trash-`` folder (:class:`NotACheckpointName`)."""
    file = Path(root) / LATEST
    try:
        raw = read_checked(file, root, limit=LATEST_LIMIT, what="the name of the latest checkpoint",
                           why="the most a checkpoint's name takes")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except RefusedFile as exc:
        raise CheckpointError(f"{str(file)!r} {exc.problem}. Delete it (resume_from='latest' "
                              "then resumes from the newest usable checkpoint)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(file)!r}: {type(exc).__name__}: {exc}") from exc
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{str(file)!r} is not UTF-8 text ({len(raw)} bytes starting {raw[:16]!r}): it is "
                              "corrupt. Delete it, or write the name of a checkpoint in that directory into it "
                              "(resume_from='latest' then uses it)") from None
    if not name:
        return None
    if name in (".", "..") or any(c in name for c in "/\\\0\n") or os.path.isabs(name):
        raise CheckpointError(f"{str(file)!r} holds {name[:200]!r}, which is not the name of a checkpoint in "
                              f"{str(root)!r} (an absolute path, '..' or a path with separators): refusing to "
                              "follow it out of the checkpoint root. Write the name of one of its checkpoints "
                              "into it, or delete it")
    if not NAME_PATTERN.match(name):
        kind = ("a temporary folder (a save in progress, or killed)" if name.startswith(TMP_PREFIX)
                else "a folder being deleted" if name.startswith(TRASH_PREFIX)
                else "not a checkpoint's name (step-<N>[-epoch-end][.<generation>])")
        raise NotACheckpointName(f"{str(file)!r} names {name[:200]!r}, {kind}: it never names anything but "
                                 "a complete checkpoint, so it is not followed")
    return name


def read_latest_quietly(root) -> str | None:
    """``latest``'s checkpoint name, or None if it names none."""
    try:
        return read_latest(root)
    except CheckpointError:
        return None


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name``: write, fsync, ``os.replace``."""
    tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def remove(path: Path) -> None:
    """Delete a checkpoint directory, renamed first: a kill during the
    deletion never leaves a valid name on a half-deleted directory."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# -- run folders -------------------------------------------------------------------------


def default_directory(accelerator) -> Path:
    """``<accelerator.project_dir or .>/checkpoints``: where the run folders go."""
    return Path(accelerator.project_dir or os.getcwd()) / "checkpoints"


def run_folders(base) -> list[Path]:
    """The ``version_<N>`` run folders in ``base``, by N."""
    base = Path(base)
    if not base.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in base.iterdir() if (m := _RUN.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def is_run_dir(base, path) -> bool:
    """Whether ``path`` is a run folder of ``base``, or ``base`` itself."""
    path, base = Path(path), Path(base)
    try:
        same_base = os.path.realpath(path.parent) == os.path.realpath(base)
        is_base = os.path.realpath(path) == os.path.realpath(base)
    except OSError:
        return False
    return (same_base and bool(_RUN.match(path.name))) or is_base


def next_run_name(base) -> str:
    """``version_<N>``: one more than the highest existing (0 for the first)."""
    folders = run_folders(base)
    return f"version_{int(folders[-1].name[len('version_'):]) + 1 if folders else 0}"


def claim_run_folder(base, attempts: int = 1000) -> Path:
    """Create the next run folder ``base/version_<N>``: ``mkdir`` without
    ``exist_ok``, so that two processes starting together get two folders."""
    base, tried = Path(base), -1
    try:
        base.mkdir(parents=True, exist_ok=True)
        for _ in range(attempts):
            # past the last name tried, if that one was taken (by a folder, or a file)
            tried = max(int(next_run_name(base)[len("version_"):]), tried + 1)
            try:
                os.mkdir(base / f"version_{tried}")
            except FileExistsError:
                continue
            return base / f"version_{tried}"
    except OSError as exc:
        raise CheckpointError(f"cannot create a run folder in {str(base)!r}: {type(exc).__name__}: {exc}. Pass "
                              "Checkpoint(dir=...) a directory this process can write.") from exc
    raise CheckpointError(f"cannot create a run folder in {str(base)!r}: other processes took "
                          f"{attempts} names in a row")


# -- the root on disk ----------------------------------------------------------------------

#: the temporary directories of this process's saves in progress (real paths): never cleaned away
_live_saves: set[str] = set()


def mark_live(tmp: Path, live: bool = True) -> None:
    """``tmp`` is (or, ``live=False``, no longer is) a save of this process in progress."""
    (_live_saves.add if live else _live_saves.discard)(os.path.realpath(tmp))


def clean(root) -> None:
    """Remove what killed saves and rotations left in ``root`` (``.tmp-*``,
    ``.trash-*``, a half-written ``latest``), but this process's saves in
    progress. Main process only, holding the root's run lock: then every
    other temporary is a dead run's."""
    root = Path(root)
    found = [p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, TRASH_PREFIX, LATEST + ".tmp"))
             and os.path.realpath(p) not in _live_saves] if root.is_dir() else []
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # a probe file, a half-written latest
            with contextlib.suppress(OSError):
                path.unlink()


def check_writable(root) -> None:
    """Create ``root`` and write (then remove) a probe file, or raise
    :class:`CheckpointError` naming the directory and the reason."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{TMP_PREFIX}probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"hookloop")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {str(root)!r}: {type(exc).__name__}: {exc}. "
                              "Pass Checkpoint(dir=...) a directory this process can write.") from exc


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def synced_sum(path) -> tuple[int, int]:
    """fsync written file ``path``; its size and CRC-32 (read back from the
    page cache through a memory map)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        if not size:
            return 0, 0
        with _mmap.mmap(fd, size, access=_mmap.ACCESS_READ) as mapped:
            return size, crc32(mapped)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory
        fsync_file(path)


# -- reading, bounded and confined -------------------------------------------------------


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
        """A file object reading this very descriptor from its start (no second open)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return os.fdopen(self.fd, "rb", buffering=1 << 16, closefd=False)

    def path(self) -> str:
        """A path to this very file (its descriptor's, not its name's: what a
        library that opens by name reads is what was checked)."""
        for fds in ("/proc/self/fd", "/dev/fd"):
            if os.path.isdir(fds):
                return f"{fds}/{self.fd}"
        return str(self.file)

    def crc32(self) -> int:
        """The CRC-32 of the whole file, over a memory map of it (the GIL released)."""
        if not self.size:
            return 0
        with _mmap.mmap(self.fd, self.size, access=_mmap.ACCESS_READ) as mapped:
            return crc32(mapped)

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
