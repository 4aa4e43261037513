"""The manifest, ``hookloop.json``: reading it, verifying it (its own
CRC-32, the format and version, the size of every file it lists), and
verifying one file against it (size and CRC-32) before it is read.

The checksum of every file is CRC-32 (zlib's polynomial: the values of
hookloop 0.2's checkpoints), computed with ISA-L (``isal``: ~5x zlib, the
same values) when it is installed, else with :mod:`zlib`. The manifest
names the algorithm (``checksum``); a checkpoint without one is CRC-32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import accelerate as accel
from . import safe_read
from .errors import CheckpointError
from .layout import FORMAT, STATE_FILE, TMP_PREFIX, VERSION

#: the key of the manifest's own checksum (over the rest of it)
SELF_CRC = "manifest_crc32"
#: the algorithm of the file checksums (the manifest's ``checksum``; absent: this)
CHECKSUM = "crc32"


def _fastest_crc32():
    """zlib-compatible CRC-32 ``(data, value=0) -> int``: ISA-L's when
    installed (``pip install isal``; carry-less multiplication, ~5x zlib's
    on the machines measured), else zlib's. Both give the same values."""
    import zlib

    try:
        from isal import isal_zlib
    except ImportError:  # an optional speed-up
        return zlib.crc32, "zlib"
    if isal_zlib.crc32(b"hookloop") != zlib.crc32(b"hookloop"):  # pragma: no cover - never seen
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


crc32, CRC32_IMPLEMENTATION = _fastest_crc32()


def peek(path: Path) -> dict | None:
    """``hookloop.json`` as JSON, unchecked; None if unreadable (or refused:
    :func:`peek_checked`)."""
    try:
        return peek_checked(path)
    except CheckpointError:
        return None


def peek_checked(path: Path) -> dict:
    """``hookloop.json`` of ``path`` as a JSON object, its content unchecked,
    read as every manifest is (:func:`_load_json`), or a
    :class:`CheckpointError` naming the file or the folder."""
    path = Path(path)
    safe_read.check_folder(path)
    try:
        doc = _load_json(path)
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} has no {STATE_FILE}") from None
    except NotADirectoryError:
        raise CheckpointError(f"{str(path)!r} is not a directory") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not a JSON object")
    return doc


def _load_json(path: Path):
    """``path / hookloop.json`` read (a regular file inside ``path``, at most
    :data:`~.safe_read.MANIFEST_LIMIT` bytes) and parsed (at most
    :data:`~.safe_read.MAX_JSON_DEPTH` deep); :class:`CheckpointError`
    naming the file, or FileNotFoundError."""
    file = path / STATE_FILE
    data = safe_read.read_checked(file, path, limit=safe_read.MANIFEST_LIMIT,
                                  what=f"a checkpoint's {STATE_FILE}",
                                  why="the most hookloop reads of a manifest")
    try:
        return safe_read.loads_json(data, file)
    except safe_read.RefusedFile as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} {exc.problem}") from None


def read_manifest(path) -> dict:
    """``hookloop.json`` of a complete checkpoint, after checking that every
    file it lists exists with the size it was written with. Raises
    :class:`CheckpointError` for a missing, foreign, truncated or unfinished
    directory."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    safe_read.check_folder(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a checkpoint directory")
    state_file = path / STATE_FILE
    if not os.path.lexists(state_file):  # (a FIFO or a link out is refused below, by name)
        if path.name.startswith(TMP_PREFIX):
            why = "it is a save that never finished (a temporary directory)"
        elif accel.written_by_save_state(path):
            why = ("it looks written by accelerator.save_state without hookloop; "
                   "load it with accelerator.load_state")
        else:
            entries = sorted(p.name for p in path.iterdir())
            shown = ", ".join(entries[:6]) + (" ..." if len(entries) > 6 else "")
            why = f"it contains: {shown or 'nothing'}"
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: it has no {STATE_FILE} ({why})"
        )
    try:
        doc = _load_json(path)
    except FileNotFoundError:  # removed since
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is missing") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a hookloop checkpoint: {STATE_FILE} has no "
            f"'format': {FORMAT!r}"
        )
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {doc.get('version')!r}; this "
            f"hookloop reads version {VERSION} and older: upgrade hookloop"
        )
    required: tuple[str, ...] = ("loop", "networks", "accelerate", "plugins", "files", "num_processes")
    if doc["version"] >= 2:
        required += ("crc32", "run_id", SELF_CRC)
    for key in required:
        if key not in doc:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {STATE_FILE} lacks {key!r}: the checkpoint is corrupt"
            )
    if doc["version"] >= 2 and doc[SELF_CRC] != manifest_crc(doc):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} does not match its own checksum "
            f"({SELF_CRC}): it changed after it was written (bit rot, or an edit)"
        )
    if doc.get("checksum", CHECKSUM) != CHECKSUM:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its files are checksummed with {str(doc['checksum'])[:50]!r}; "
            f"this hookloop verifies {CHECKSUM!r} only: upgrade hookloop"
        )
    check_entries(path, doc)
    for rel, size in doc["files"].items():
        file = path / rel
        try:
            actual = safe_read.file_size(file, path, f"{rel} of a checkpoint")
        except FileNotFoundError:
            actual = None
        except safe_read.RefusedFile as exc:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} {exc.problem}") from None
        if actual is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is missing: the checkpoint is incomplete"
            )
        if actual != size:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {rel} is {actual} bytes but {size} were "
                "written: the checkpoint is truncated or corrupt"
            )
    return doc


def check_entries(path: Path, doc: dict) -> None:
    """The manifest's ``files`` (name: size) and ``crc32`` (name: CRC-32) name
    files inside the checkpoint (relative POSIX paths: no absolute path, no
    ``..``, ``.`` or empty part, no backslash), with whole numbers; else a
    :class:`CheckpointError` naming the entry."""
    where = f"checkpoint {str(path)!r}: {STATE_FILE}"
    for key in ("files", "crc32"):
        entries = doc.get(key)
        if entries is None and key == "crc32":
            continue
        if not isinstance(entries, dict):
            raise CheckpointError(f"{where}: {key!r} is not a JSON object: the checkpoint is corrupt")
        for rel, value in entries.items():
            problem = safe_read.relative_entry(rel)
            if problem is not None:
                raise CheckpointError(
                    f"{where} lists {rel[:200]!r} in {key!r}, which is not a file of the "
                    f"checkpoint ({problem}): refusing to read it"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{where}: {key!r} gives {rel!r} {str(value)[:50]!r}, not a "
                                      "whole number: the checkpoint is corrupt")


def manifest_crc(doc: dict) -> int:
    """The CRC-32 of the manifest without its own checksum, canonically dumped."""
    import zlib

    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def crc32_file(path: Path) -> int:
    """CRC-32 of a file, read through a memory map (no copy)."""
    with open(path, "rb") as f:
        return crc32_fd(f.fileno(), os.fstat(f.fileno()).st_size)


def crc32_fd(fd: int, size: int) -> int:
    """CRC-32 of the first ``size`` bytes of open file ``fd``, through a
    memory map, a few MiB at a time (each chunk is checksummed while it is
    in the cache)."""
    import mmap

    if size == 0:
        return 0
    value, step = 0, 8 << 20
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for start in range(0, size, step):
                value = crc32(view[start:start + step], value)
        finally:
            view.release()
    return value


def checksum_error(where: str, what: str, rel: str, now: int, crc: int) -> CheckpointError:
    """The refusal of a file whose CRC-32 is ``now``, not ``crc``."""
    return CheckpointError(f"{where}: cannot read {what} from {rel}: it does not match its checksum "
                           f"(CRC-32 {now:08x}, {crc:08x} when written): the file changed after it "
                           "was saved (bit rot, a bad copy, or an edit)")


def verified(path: Path, rel: str, doc: dict, where: str, what: str, deferred=None) -> safe_read.Opened:
    """``path / rel`` opened (:func:`~.safe_read.open_checked`: a regular
    file inside the checkpoint, at most the size the manifest records) once
    its size and CRC-32 match the manifest ``doc``, or a
    :class:`CheckpointError` naming ``what`` it holds. Use it in a ``with``
    block; read it through its ``source()`` or ``read()``. ``deferred``:
    ``deferred(opened, crc, rel, what)`` is given the CRC-32 to check instead
    (the size is checked here): the caller verifies it while it reads."""
    problem = None
    size = doc["files"].get(rel)
    if size is None:
        problem = "the manifest does not list it"
    elif (why := safe_read.relative_entry(rel)) is not None:
        problem = f"it is not a file of the checkpoint ({why})"
    else:
        opened = None
        try:
            opened = safe_read.open_checked(path / rel, path, limit=size, what=what,
                                            why="the size the manifest records")
            crc = (doc.get("crc32") or {}).get(rel)
            if opened.size != size:
                problem = f"it is {opened.size} bytes but {size} were written: truncated or corrupt"
            elif crc is None and doc["version"] >= 2:
                problem = "the manifest has no checksum for it"
            elif crc is not None and deferred is not None:
                deferred(opened, crc, rel, what)
                result, opened = opened, None
                return result
            elif crc is not None and (now := crc32_fd(opened.fd, opened.size)) != crc:
                raise checksum_error(where, what, rel, now, crc)
            else:
                result, opened = opened, None
                return result
        except safe_read.RefusedFile as exc:
            problem = exc.problem
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            if opened is not None:
                opened.close()
    raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}")
