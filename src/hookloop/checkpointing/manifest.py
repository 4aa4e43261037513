"""The manifest, ``hookloop.json``: written last into a checkpoint, read
once when it is loaded. Verifying it (its own CRC-32, the format and
version, the size of every file it lists) and opening one file against it
(:func:`verified`: size now, CRC-32 as it is read).

The manifest names the checksum algorithm (``checksum``; absent: CRC-32,
the values of hookloop 0.2's checkpoints).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from . import safe_read
from .errors import CheckpointError
from .layout import FORMAT, STATE_FILE, TMP_PREFIX, VERSION

#: the key of the manifest's own checksum (over the rest of it)
SELF_CRC = "manifest_crc32"
#: the algorithm of the file checksums (the manifest's ``checksum``; absent: this)
CHECKSUM = "crc32"
_REQUIRED = ("loop", "networks", "accelerate", "plugins", "files", "num_processes")


def peek(path: Path) -> dict | None:
    """``hookloop.json`` as JSON, unchecked; None if it cannot be read."""
    try:
        return peek_checked(path)
    except CheckpointError:
        return None


def peek_checked(path: Path) -> dict:
    """``hookloop.json`` of ``path`` as a JSON object (a regular file inside
    ``path``, at most :data:`~.safe_read.MANIFEST_LIMIT` bytes, at most
    :data:`~.safe_read.MAX_JSON_DEPTH` deep), its content unchecked, or a
    :class:`CheckpointError` naming the file or the folder."""
    path = Path(path)
    safe_read.check_folder(path)
    file = path / STATE_FILE
    try:
        data = safe_read.read_checked(file, path, limit=safe_read.MANIFEST_LIMIT,
                                      what=f"a checkpoint's {STATE_FILE}",
                                      why="the most hookloop reads of a manifest")
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} has no {STATE_FILE}") from None
    except NotADirectoryError:
        raise CheckpointError(f"{str(path)!r} is not a directory") from None
    try:
        doc = safe_read.loads_json(data, file)
    except safe_read.RefusedFile as exc:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} {exc.problem}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not a JSON object")
    return doc


def read_manifest(path) -> dict:
    """``hookloop.json`` of a complete checkpoint, read once and verified:
    its format, version, required keys and own checksum, and every file it
    lists there with the size it was written with. Raises
    :class:`CheckpointError` for a missing, foreign, truncated or unfinished
    directory."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    safe_read.check_folder(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a checkpoint directory")
    if not os.path.lexists(path / STATE_FILE):  # (a FIFO or a link out is refused below, by name)
        from . import accelerate as accel

        if path.name.startswith(TMP_PREFIX):
            why = "it is a save that never finished (a temporary directory)"
        elif accel.written_by_save_state(path):
            why = ("it looks written by accelerator.save_state without hookloop; "
                   "load it with accelerator.load_state")
        else:
            entries = sorted(p.name for p in path.iterdir())
            why = f"it contains: {', '.join(entries[:6]) + (' ...' if len(entries) > 6 else '') or 'nothing'}"
        raise CheckpointError(f"{str(path)!r} is not a hookloop checkpoint: it has no {STATE_FILE} ({why})")
    try:
        doc = peek_checked(path)
    except CheckpointError as exc:
        if f"has no {STATE_FILE}" not in str(exc):
            raise
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is missing") from None
    return verify(path, doc)


def verify(path: Path, doc: dict) -> dict:
    """``doc``, the manifest of ``path``, once it is hookloop's, complete,
    unchanged since it was written, and every file it lists has its size."""
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a hookloop checkpoint: {STATE_FILE} has no "
                              f"'format': {FORMAT!r}")
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {doc.get('version')!r}; "
                              f"this hookloop reads version {VERSION} and older: upgrade hookloop")
    required = _REQUIRED + (("crc32", "run_id", SELF_CRC) if doc["version"] >= 2 else ())
    for key in required:
        if key not in doc:
            raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} lacks {key!r}: the "
                                  "checkpoint is corrupt")
    if doc["version"] >= 2 and doc[SELF_CRC] != manifest_crc(doc):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} does not match its own "
                              f"checksum ({SELF_CRC}): it changed after it was written (bit rot, or an edit)")
    if doc.get("checksum", CHECKSUM) != CHECKSUM:
        raise CheckpointError(f"checkpoint {str(path)!r}: its files are checksummed with "
                              f"{str(doc['checksum'])[:50]!r}; this hookloop verifies {CHECKSUM!r} "
                              "only: upgrade hookloop")
    check_entries(path, doc)
    for rel, size in doc["files"].items():
        try:
            actual = safe_read.file_size(path / rel, path, f"{rel} of a checkpoint")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is missing: the checkpoint is "
                                  "incomplete") from None
        except safe_read.RefusedFile as exc:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} {exc.problem}") from None
        if actual != size:
            raise CheckpointError(f"checkpoint {str(path)!r}: {rel} is {actual} bytes but {size} "
                                  "were written: the checkpoint is truncated or corrupt")
    return doc


def check_entries(path: Path, doc: dict) -> None:
    """The manifest's ``files`` (name: size) and ``crc32`` (name: CRC-32) name
    files inside the checkpoint (:func:`~.safe_read.relative_entry`), with
    whole numbers; else a :class:`CheckpointError` naming the entry."""
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
                raise CheckpointError(f"{where} lists {rel[:200]!r} in {key!r}, which is not a file "
                                      f"of the checkpoint ({problem}): refusing to read it")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{where}: {key!r} gives {rel!r} {str(value)[:50]!r}, not a "
                                      "whole number: the checkpoint is corrupt")


def manifest_crc(doc: dict) -> int:
    """The CRC-32 of the manifest without its own checksum, canonically dumped."""
    body = {k: v for k, v in doc.items() if k != SELF_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def write(folder: Path, doc: dict) -> None:
    """Write ``doc`` as ``folder/hookloop.json`` with its own checksum, fsync'ed."""
    doc[SELF_CRC] = manifest_crc(doc)
    with open(folder / STATE_FILE, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def checksum_error(where: str, what: str, rel: str, now: int, crc: int) -> CheckpointError:
    """The refusal of a file whose CRC-32 is ``now``, not ``crc``."""
    return CheckpointError(f"{where}: cannot read {what} from {rel}: it does not match its checksum "
                           f"(CRC-32 {now:08x}, {crc:08x} when written): the file changed after it "
                           "was saved (bit rot, a bad copy, or an edit)")


def verified(path: Path, rel: str, doc: dict, where: str, what: str) -> tuple[safe_read.Opened, int | None]:
    """``path / rel`` opened once (a regular file inside the checkpoint, no
    bigger than the manifest records) and its size checked, with the CRC-32
    it must have (None: a version 1 checkpoint's, unchecked): the caller
    checks it on the bytes it reads. A :class:`CheckpointError` naming
    ``what`` it holds otherwise."""
    problem, size = None, doc["files"].get(rel)
    crc = (doc.get("crc32") or {}).get(rel)
    if size is None:
        problem = "the manifest does not list it"
    elif (why := safe_read.relative_entry(rel)) is not None:
        problem = f"it is not a file of the checkpoint ({why})"
    elif crc is None and doc["version"] >= 2:
        problem = "the manifest has no checksum for it"
    else:
        try:
            opened = safe_read.open_checked(path / rel, path, limit=size, what=what,
                                            why="the size the manifest records")
        except safe_read.RefusedFile as exc:
            problem = exc.problem
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if opened.size == size:
                return opened, crc
            opened.close()
            problem = f"it is {opened.size} bytes but {size} were written: truncated or corrupt"
    raise CheckpointError(f"{where}: cannot read {what} from {rel}: {problem}")
